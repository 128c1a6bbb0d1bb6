"""sfcs:// paths through the wheel, over the fake libcloudfs (crates/io-sfcs/fake-cloudfs,
built here with cargo), and Ctrl-C during key look-ups against a datapipe that never answers.

The fake serves SFCS path P from local path P (its root is `file:///`), so files written
through SFCS can be checked with plain file reads.
"""

import base64
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import turboio
import turboio as veturboio
import turboio.torch as st
from turboio import SafeTensorsFileLoader, SingleGroup

from conftest import ROOT, same

KEY = b"abcdefgh12345678"
IV = b"1234567887654321"


@pytest.fixture(scope="session")
def fake_lib():
    cargo = os.environ.get("CARGO", "cargo")
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    subprocess.run([cargo, "build", "--quiet", "-p", "turboio-fake-cloudfs"], cwd=ROOT, check=True)
    lib = target / "debug" / "libturboio_fake_cloudfs.so"
    assert lib.exists(), lib
    return lib


@pytest.fixture
def cluster(fake_lib, tmp, monkeypatch):
    """The SFCS settings of a test cluster (static credentials), for this process."""
    env = {
        "LIBCFS_PATH": str(fake_lib),
        "SFCS_FSNAME": "fs-test",
        "SFCS_REGION": "cn-test",
        "SFCS_UFS_PATH": "file:///",
        "SFCS_NS_ID": "ns-1",
        "SFCS_NETWORK_SEGMENT": "10.0.0.0/8",
        "SFCS_MULTI_NIC_WHITELIST": "eth0",
        "SFCS_AUTHENTICATION_SERVICE_NAME": "auth-svc",
        "SFCS_ACCESS_KEY": "AKTEST",
        "SFCS_SECRET_KEY": "SK-very-secret-value",
        "SFCS_NAMENODE_ENDPOINT_ADDRESS": "10.1.2.3",
        "SFCS_METAINFO_PATH": str(tmp / "no-policies.json"),
        "CREDENTIAL_PATH": str(tmp / "no-credentials"),
        "DATAPIPE_SOCKET_PATH": str(tmp / "no-datapipe.sock"),
        "FAKE_CFS_LOG": str(tmp / "calls.log"),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("VETURBOIO_USE_SFCS_SDK", raising=False)
    monkeypatch.delenv("VETURBOIO_USE_CIPHER", raising=False)
    return env


def sfcs(p):
    return "sfcs:/" + str(p)


def sample():
    g = torch.Generator().manual_seed(1)
    return {
        "a": torch.randn(300, 500, generator=g),
        "b": torch.randint(0, 100, (1000,), generator=g, dtype=torch.int64),
        "c": torch.randn(7, generator=g).to(torch.bfloat16),
    }


def calls(cluster):
    p = pathlib.Path(cluster["FAKE_CFS_LOG"])
    return p.read_text().splitlines() if p.exists() else []


def test_veturboio_api_round_trips_through_sfcs(cluster, tmp):
    sd = sample()
    path = tmp / "m.safetensors"
    veturboio.save_file(sd, sfcs(path))
    assert path.exists(), "the fake keeps SFCS path P at local path P"
    assert any(line.startswith("cfsConcat ") or line.startswith("cfsRename2 ") for line in calls(cluster))
    out = veturboio.load(sfcs(path))
    assert set(out) == set(sd) and all(same(out[k], sd[k]) for k in sd)
    # Pre-allocated destinations.
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    veturboio.load(sfcs(path), state_dict=dst)
    assert all(same(dst[k], sd[k]) for k in sd)
    # Torch pickles, by content.
    veturboio.save_pt(sd, sfcs(tmp / "m.pt"))
    pt = veturboio.load(sfcs(tmp / "m.pt"))
    assert all(same(pt[k], sd[k]) for k in sd)
    # Shared memory.
    shm = veturboio.load_to_shmem(sfcs(path))
    try:
        assert bytes(shm.buf[: path.stat().st_size]) == path.read_bytes()
    finally:
        shm.close()
        shm.unlink()
    model = torch.nn.Linear(4, 3)
    veturboio.save_model(model, sfcs(tmp / "model.safetensors"))
    back = veturboio.load(sfcs(tmp / "model.safetensors"))
    assert same(back["weight"], model.weight.detach())
    with pytest.raises(FileNotFoundError):
        veturboio.load(sfcs(tmp / "missing.safetensors"))


def test_use_sfcs_sdk_routes_plain_paths_except_dev_shm(cluster, tmp, monkeypatch):
    sd = sample()
    monkeypatch.setenv("VETURBOIO_USE_SFCS_SDK", "1")
    path = tmp / "routed.safetensors"
    veturboio.save_file(sd, str(path))
    n = len(calls(cluster))
    assert n > 0, "the save went through the SFCS library"
    out = veturboio.load(str(path))
    assert all(same(out[k], sd[k]) for k in sd)
    assert len(calls(cluster)) > n
    shm_dir = pathlib.Path("/dev/shm")
    if shm_dir.is_dir() and os.access(shm_dir, os.W_OK):
        local = shm_dir / f"turboio-test-{os.getpid()}.safetensors"
        try:
            n = len(calls(cluster))
            veturboio.save_file(sd, str(local))
            out = veturboio.load(str(local))
            assert all(same(out[k], sd[k]) for k in sd)
            assert len(calls(cluster)) == n, "/dev/shm/ paths stay local"
        finally:
            local.unlink(missing_ok=True)


def test_safetensors_torch_and_fastsafetensors_take_sfcs_paths(cluster, tmp):
    sd = sample()
    path = tmp / "t.safetensors"
    st.save_file(sd, sfcs(path))
    out = st.load_file(sfcs(path))
    assert all(same(out[k], sd[k]) for k in sd)
    with st.safe_open(sfcs(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(sd)
        assert same(f.get_tensor("a"), sd["a"])
    loader = SafeTensorsFileLoader(SingleGroup(), "cpu")
    loader.add_filenames({0: [sfcs(path)]})
    buf = loader.copy_files_to_device()
    assert same(buf.get_tensor("b"), sd["b"])


def test_encrypted_files_through_sfcs_interoperate_with_local_ones(cluster, tmp, monkeypatch):
    monkeypatch.setenv("VETURBOIO_KEY", base64.b64encode(KEY).decode())
    monkeypatch.setenv("VETURBOIO_IV", base64.b64encode(IV).decode())
    sd = sample()
    path = tmp / "enc.safetensors"
    veturboio.save_file(sd, sfcs(path), use_cipher=True)
    local = tmp / "local-enc.safetensors"
    veturboio.save_file(sd, str(local), use_cipher=True)
    assert path.read_bytes() == local.read_bytes(), "the same bytes as a local encrypted save"
    out = veturboio.load(str(path), use_cipher=True)
    assert all(same(out[k], sd[k]) for k in sd)
    out = veturboio.load(sfcs(local), use_cipher=True)
    assert all(same(out[k], sd[k]) for k in sd)


def test_without_the_library_an_sfcs_path_names_libcfs_path(cluster, tmp):
    env = dict(os.environ, LIBCFS_PATH="/nonexistent/libcloudfs.so")
    code = (
        "import turboio, torch\n"
        "try:\n"
        "    turboio.load('sfcs://models/m.safetensors')\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
        "turboio.save_file({'x': torch.zeros(2)}, %r)\n"
        "print('LOCAL OK')\n" % str(tmp / "local.safetensors")
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR sfcs://models/m.safetensors: " in out.stdout, out.stdout
    assert "LIBCFS_PATH=/nonexistent/libcloudfs.so" in out.stdout, out.stdout
    assert "LOCAL OK" in out.stdout


def test_missing_settings_give_veturboios_errors(cluster, monkeypatch):
    monkeypatch.delenv("SFCS_FSNAME")
    with pytest.raises(RuntimeError, match="fsname is required"):
        veturboio.load("sfcs://data/m.safetensors")
    monkeypatch.setenv("SFCS_FSNAME", "fs-test")
    monkeypatch.delenv("SFCS_NETWORK_SEGMENT")
    with pytest.raises(RuntimeError, match="Network setting is not valid"):
        veturboio.load("sfcs://data/m.safetensors")


@pytest.fixture
def silent_datapipe(tmp, monkeypatch):
    """A datapipe socket that accepts connections and never answers; `accepted` is set once a
    request is in flight."""
    path = tmp / "silent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(16)
    accepted = threading.Event()
    held = []

    def accept():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            accepted.set()

    threading.Thread(target=accept, daemon=True).start()
    monkeypatch.setenv("DATAPIPE_SOCKET_PATH", str(path))
    for k in ("VETURBOIO_KEY", "VETURBOIO_IV", "VETURBOIO_USE_CIPHER"):
        monkeypatch.delenv(k, raising=False)
    for k in list(os.environ):
        if k.startswith("VETURBOIO_KMS_"):
            monkeypatch.delenv(k)
    yield accepted
    server.close()
    for c in held:
        c.close()


@pytest.mark.parametrize("call", ["load", "save_pt"])
def test_ctrl_c_stops_a_key_lookup_against_a_silent_datapipe(tmp, silent_datapipe, call):
    path = tmp / "m.safetensors"
    st.save_file(sample(), path)
    interrupted_at = []

    def interrupt():
        if silent_datapipe.wait(60):
            interrupted_at.append(time.monotonic())
            signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            if call == "load":
                veturboio.load(str(path), use_cipher=True)
            else:
                veturboio.save_pt(sample(), str(tmp / "m.pt"), use_cipher=True)
        returned_at = time.monotonic()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupted_at, "the key look-up never reached the datapipe"
    assert returned_at - interrupted_at[0] < 1.0, f"Ctrl-C took {returned_at - interrupted_at[0]:.2f} s"
    assert not (tmp / "m.pt").exists(), "nothing was written"
