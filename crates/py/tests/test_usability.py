"""What a new user trips over: the package namespace, the torch dependency, progress totals,
messages, the converter's errors, state_dict loads into tied weights, wrong keys."""

import base64
import importlib.metadata
import os
import subprocess
import sys

import pytest
import safetensors.torch as st
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

import turboio
from conftest import same


def test_public_namespace_is_the_api():
    submodules = {"torch", "fastsafetensors", "convert", "models", "vllm_plugin", "deepnvme", "dcp"}
    public = {n for n in dir(turboio) if not n.startswith("_")}
    assert public <= set(turboio.__all__) | submodules, sorted(public - set(turboio.__all__) - submodules)


def test_torch_is_a_dependency_and_its_absence_is_clear():
    requires = importlib.metadata.requires("turboio") or []
    assert any(r.startswith("torch") and "extra" not in r for r in requires), requires
    code = "import sys; sys.modules['torch'] = None; import turboio"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and "pip install" in last and "torch" in last, r.stderr


@pytest.mark.parametrize("mode", ["auto", "copied"])
def test_progress_ends_with_the_total(tmp, mode):
    # Big enough that the load outlasts the first progress call.
    path = tmp / "p.safetensors"
    st.save_file({"a": torch.zeros(8 << 20), "b": torch.ones(7)}, path)
    seen = []
    turboio.load(str(path), progress=seen.append, use_direct_io=(mode == "copied"))
    assert seen and seen[-1] == path.stat().st_size, seen
    assert seen == sorted(seen)


def test_map_location_is_quoted_as_given(tmp):
    path = tmp / "x.safetensors"
    st.save_file({"a": torch.ones(2)}, path)
    try:
        turboio.load(str(path), map_location="cuda:0")
    except Exception as e:  # noqa: BLE001 - whatever CUDA support says, it quotes the argument right
        assert "map_location='cuda'" not in str(e) and "cuda:0" in str(e), str(e)


def test_convert_errors_are_one_line(tmp):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "turboio.convert", *args], capture_output=True, text=True)

    r = run("-i", str(tmp / "missing.pt"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "missing.pt" in r.stderr, r.stderr
    src = tmp / "m.pt"
    torch.save({"a": torch.ones(2)}, src)
    (tmp / "m.safetensors").write_bytes(b"")
    r = run("-i", str(src))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "exists" in r.stderr, r.stderr


def read_chars():
    """Bytes this process has read with read()/pread() (all threads)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_state_dict_with_shared_destinations_is_filled_once(tmp):
    # 32 entries of 1 MiB with different bytes, loaded into one tensor (tied weights taken to
    # the extreme): the result is the last entry's bytes, as if each were read in turn.
    n, size = 32, 1 << 20
    sd = {f"w{i:02d}": torch.full((size,), i, dtype=torch.uint8) for i in range(n)}
    path = tmp / "tied.safetensors"
    st.save_file(sd, path)
    last = sorted(sd)[-1]  # file order is by name for tensors of equal size
    path.read_bytes()  # in the page cache: read with pread, which /proc/self/io counts
    for _ in range(3):
        shared = torch.empty(size, dtype=torch.uint8)
        dest = {name: shared for name in sd}
        before = read_chars()
        out = turboio.load(str(path), state_dict=dest)
        read = read_chars() - before
        assert out is dest
        assert torch.equal(shared, sd[last]), torch.unique(shared)
        assert read < 4 * size, f"the shared destination was filled {read / size:.1f} times, not once"
    # Partial overlaps (views of one storage): later entries win where they overlap.
    st.save_file({"a": torch.full((4,), 1, dtype=torch.uint8), "b": torch.full((4,), 2, dtype=torch.uint8)}, path)
    base = torch.zeros(6, dtype=torch.uint8)
    turboio.load(str(path), state_dict={"a": base[0:4], "b": base[2:6]})
    assert base.tolist() == [1, 1, 2, 2, 2, 2]


KEY, IV = b"abcdefgh12345678", b"1234567887654321"


def first_keystream_byte(key):
    c = Cipher(algorithms.AES(key), modes.CTR(IV)).encryptor()
    return c.update(b"\0")[0]


def test_a_wrong_key_that_decrypts_to_0x80_is_refused(tmp, monkeypatch):
    monkeypatch.setenv("DATAPIPE_SOCKET_PATH", str(tmp / "no-datapipe.sock"))
    for k in list(os.environ):
        if k.startswith("VETURBOIO_KMS_") or k in ("VETURBOIO_USE_CIPHER", "VETURBOIO_CIPHER_HEADER"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("VETURBOIO_KEY", base64.b64encode(KEY).decode())
    monkeypatch.setenv("VETURBOIO_IV", base64.b64encode(IV).decode())
    path = tmp / "enc.safetensors"
    sd = {"a": torch.arange(10.0)}
    turboio.save_file(sd, str(path), use_cipher=True)
    first = path.read_bytes()[0]
    # A wrong key under which the file's first byte decrypts to 0x80 (a pickle's first byte):
    # about one key in 256.
    wrong = next(
        k for k in (b"wrong-key-%06d" % i for i in range(100_000)) if first ^ first_keystream_byte(k) == 0x80
    )
    monkeypatch.setenv("VETURBOIO_KEY", base64.b64encode(wrong).decode())
    for fn in [
        lambda: turboio.load_to_shmem(str(path), use_cipher=True),
        lambda: turboio.load(str(path), use_cipher=True),
    ]:
        with pytest.raises(ValueError, match="wrong key"):
            fn()
    monkeypatch.setenv("VETURBOIO_KEY", base64.b64encode(KEY).decode())
    assert same(turboio.load(str(path), use_cipher=True)["a"], sd["a"])


def test_load_of_a_model_directory_or_prefix_points_to_load_model(tmp):
    """Issue 49, item 9: `turboio.load` of a model directory raised `OSError: Is a directory`,
    of a model's key prefix a bare `FileNotFoundError`; both now say what loads a model."""
    d = tmp / "model"
    turboio.save_model_dir({"a": torch.ones(3), "b": torch.zeros(2)}, str(d), max_shard_size="20B")
    with pytest.raises(IsADirectoryError, match=r"turboio\.load_model\("):
        turboio.load(str(d))
    assert set(turboio.load_model(str(d))) == {"a", "b"}
    # A server that answers 404 to everything: the prefix is no object.
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/models/llama"
        with pytest.raises(FileNotFoundError, match=r"model's prefix .*turboio\.load_model"):
            turboio.load(url)
        # A file's URL that is missing says only that.
        with pytest.raises(FileNotFoundError) as info:
            turboio.load(url + "/model.safetensors")
        assert "load_model" not in str(info.value)
    finally:
        server.shutdown()


def test_storage_option_mistakes_are_value_errors():
    """Issue 49, item 13: an unknown storage option was a RuntimeError, a bad value a ValueError."""
    with pytest.raises(ValueError, match="unknown storage option"):
        turboio.load("s3://bucket/x.safetensors", storage_options={"no_such_option": "1"})
    with pytest.raises(ValueError, match="concurrency"):
        turboio.load("s3://bucket/x.safetensors", storage_options={"concurrency": "x"})


def test_the_wheel_puts_the_cli_on_the_path(tmp):
    """`pip install` of the wheel gives the `turboio` command (issue 49, item 5): the CLI's own
    code through the console script, with the binary's exit statuses."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import safetensors.torch as st
    import torch

    script = Path(sys.executable).parent / "turboio"
    assert script.exists(), f"no console script next to {sys.executable}"
    assert shutil.which("turboio", path=str(script.parent)) == str(script)
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Usage: turboio" in out.stdout and "inspect" in out.stdout, out
    f = tmp / "x.safetensors"
    st.save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(f))
    out = subprocess.run([str(script), "inspect", str(f)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "w" in out.stdout and "F32" in out.stdout, out
    out = subprocess.run([str(script), "load", str(f), "--check"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out
    out = subprocess.run([str(script), "load", str(f), "--bogus"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--bogus" in out.stderr, out
    out = subprocess.run([str(script), "load", str(tmp / "missing.safetensors")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.startswith("turboio: error:") and "missing.safetensors" in out.stderr, out
