"""Object storage through the wheel, against a real S3 server on 127.0.0.1 (moto's server, started
by `tests/support/s3_server.py`): every load and save API on `s3://` URLs, with options given
explicitly (`storage_options=`) and from the environment; saves read back by boto3 and the
official `safetensors`; errors that name the URL and never a secret."""

import os
import subprocess
import sys

import pytest
import torch

import turboio
import turboio.torch as tt
from conftest import ROOT, same, sample_dict

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

ACCESS_KEY = "AKIATURBOIOTEST"
SECRET_KEY = "turboio-secret-Zq8uXk2pW9"


class Server:
    def __init__(self):
        script = ROOT / "tests" / "support" / "s3_server.py"
        self.proc = subprocess.Popen(
            [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        line = self.proc.stdout.readline()
        assert line.startswith("PORT "), f"the S3 server did not start: {line!r}"
        self.endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
        self.options = {
            "endpoint": self.endpoint,
            "region": "us-east-1",
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "part_size": "5MiB",
            "retry_timeout": 5,
            "max_retries": 2,
        }
        self.client = boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY
        )

    def faults(self, body):
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(self.endpoint + "/__faults", data=body.encode(), method="POST")).read()

    def stats(self):
        import json
        import urllib.request

        return json.loads(urllib.request.urlopen(self.endpoint + "/__stats").read())

    def get(self, bucket, key):
        return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()

    def stop(self):
        self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def s3():
    server = Server()
    for bucket in ("pyobj", "models"):
        server.client.create_bucket(Bucket=bucket)
    yield server
    server.stop()


def big_dict(seed=0):
    g = torch.Generator().manual_seed(seed)
    # Every dtype the official safetensors package reads back too.
    out = {k: v for k, v in sample_dict(seed).items() if "e8m0" not in k and "fnuz" not in k}
    # Several multipart parts and ranged GETs at 5 MiB parts.
    out["big.f32"] = torch.randn(4 * 1024 * 1024, generator=g)
    out["big.bf16"] = torch.randn(3000, 1000, generator=g).bfloat16()
    return out


def test_save_and_load_through_every_api_match_the_reference(s3, tmp):
    from safetensors.torch import load as st_load

    sd = big_dict(1)
    opts = s3.options
    # veTurboIO's API: the object's bytes are the local save's, byte for byte.
    turboio.save_file(sd, "s3://pyobj/a.safetensors", storage_options=opts)
    turboio.save_file(sd, str(tmp / "a.safetensors"))
    body = s3.get("pyobj", "a.safetensors")
    assert body == (tmp / "a.safetensors").read_bytes()
    ref = st_load(body)
    for name, t in turboio.load("s3://pyobj/a.safetensors", storage_options=opts).items():
        assert same(t, ref[name]), name
    # safetensors.torch's API.
    tt.save_file(sd, "s3://pyobj/b.safetensors", metadata={"k": "v"}, storage_options=opts)
    got = tt.load_file("s3://pyobj/b.safetensors", storage_options=opts)
    assert set(got) == set(sd) and all(same(got[k], sd[k]) for k in sd)
    with tt.safe_open("s3://pyobj/b.safetensors", framework="pt", storage_options=opts) as f:
        assert f.metadata() == {"k": "v"}
        assert same(f.get_tensor("big.bf16"), sd["big.bf16"])
        assert same(f.get_slice("big.f32")[5:9], sd["big.f32"][5:9])
    # Background saves to a URL.
    handle = turboio.save_file(sd, "s3://pyobj/c.safetensors", blocking=False, storage_options=opts)
    handle.wait()
    assert s3.get("pyobj", "c.safetensors") == body
    # Into pre-allocated tensors (veTurboIO's state_dict=).
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    turboio.load("s3://pyobj/a.safetensors", state_dict=dst, storage_options=opts)
    assert all(same(dst[k], sd[k]) for k in sd)
    # dtype on load.
    bf = turboio.load("s3://pyobj/a.safetensors", dtype=torch.bfloat16, storage_options=opts)
    assert same(bf["big.f32"], sd["big.f32"].bfloat16())


def test_options_from_the_environment(s3, monkeypatch):
    sd = {"w": torch.arange(100, dtype=torch.float32)}
    turboio.save_file(sd, "s3://pyobj/env.safetensors", storage_options=s3.options)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    assert same(turboio.load("s3://pyobj/env.safetensors")["w"], sd["w"])
    assert same(tt.load_file("s3://pyobj/env.safetensors")["w"], sd["w"])


def test_models_under_a_prefix(s3):
    sd = big_dict(2)
    opts = s3.options
    index = turboio.save_model_dir(sd, "s3://models/run1", max_shard_size="6MB", storage_options=opts)
    assert index == "s3://models/run1/model.safetensors.index.json"
    keys = [o["Key"] for o in s3.client.list_objects_v2(Bucket="models", Prefix="run1/")["Contents"]]
    assert "run1/model.safetensors.index.json" in keys and len(keys) >= 4
    got = turboio.load_model("s3://models/run1", storage_options=opts)
    assert set(got) == set(sd) and all(same(got[k], sd[k]) for k in sd)
    names = dict(turboio.iter_weights("s3://models/run1", storage_options=opts))
    assert set(names) == set(sd)
    # Replaced as a set: the old shards are gone after the commit.
    small = {"only": torch.ones(10)}
    turboio.save_model_dir(small, "s3://models/run1", storage_options=opts)
    keys = sorted(o["Key"] for o in s3.client.list_objects_v2(Bucket="models", Prefix="run1/")["Contents"])
    assert len(keys) == 2, keys
    assert list(turboio.load_model("s3://models/run1", storage_options=opts)) == ["only"]
    # Each object asked for once: the index, then every shard (small ones come whole with the
    # opening GET).
    few = {f"l{i}.w": torch.full((64, 64), float(i)) for i in range(6)}
    turboio.save_model_dir(few, "s3://models/few", max_shard_size="40KB", storage_options=opts)
    shards = [o["Key"] for o in s3.client.list_objects_v2(Bucket="models", Prefix="few/")["Contents"]]
    assert len(shards) == 4, shards
    s3.faults("{}")
    got = turboio.load_model("s3://models/few", storage_options=opts)
    assert all(same(got[k], few[k]) for k in few)
    assert s3.stats()["requests"] == 4, s3.stats()


def test_selections_read_only_their_bytes_from_the_store(s3):
    sd = big_dict(5)
    opts = s3.options
    turboio.save_file(sd, "s3://pyobj/sel.safetensors", storage_options=opts)
    size = len(s3.get("pyobj", "sel.safetensors"))
    want = sd["big.bf16"].numel() * 2  # 6 MB of a 23 MB object
    for load in (
        lambda: turboio.load("s3://pyobj/sel.safetensors", tensors="big.bf16", storage_options=opts),
        lambda: tt.load_file("s3://pyobj/sel.safetensors", tensors=["big.bf16"], storage_options=opts),
    ):
        s3.faults("{}")  # resets the counters
        got = load()
        assert list(got) == ["big.bf16"] and same(got["big.bf16"], sd["big.bf16"])
        read = s3.stats()["get_bytes"]
        # The tensor, the header and at most one coalescing gap (4 MiB) either side.
        assert want <= read < want + (9 << 20) and read < size // 2, (read, want, size)
    # A model: shards holding nothing selected are never fetched.
    turboio.save_model_dir(sd, "s3://models/sel", max_shard_size="6MB", storage_options=opts)
    s3.faults("{}")
    got = turboio.load_model("s3://models/sel", tensors=["big.bf16"], storage_options=opts)
    assert list(got) == ["big.bf16"] and same(got["big.bf16"], sd["big.bf16"])
    stats = s3.stats()
    assert stats["get_bytes"] < want + (9 << 20), stats
    with pytest.raises(KeyError, match="closest: `big.bf16`"):
        turboio.load_model("s3://models/sel", tensors=["big.bf15"], storage_options=opts)


def test_a_safetensors_object_is_opened_once(s3):
    """`turboio.load` of a URL asks the store once for a small safetensors object (its header
    and data come with the opening GET): the kind of the content is not asked first (a torch
    checkpoint is told apart only when the safetensors load fails; see the next test)."""
    sd = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
    turboio.save_file(sd, "s3://pyobj/once.safetensors", storage_options=s3.options)
    s3.faults("{}")
    got = turboio.load("s3://pyobj/once.safetensors", storage_options=s3.options)
    assert set(got) == set(sd) and all(same(got[k], sd[k]) for k in sd)
    assert s3.stats()["requests"] == 1, s3.stats()
    # Neither safetensors nor torch: the safetensors error, naming the URL.
    s3.client.put_object(Bucket="pyobj", Key="junk.safetensors", Body=b"\x10\x00\x00\x00\x00\x00\x00\x00not json........")
    with pytest.raises(ValueError, match="s3://pyobj/junk.safetensors"):
        turboio.load("s3://pyobj/junk.safetensors", storage_options=s3.options)


def test_torch_checkpoints_from_s3(s3, tmp):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(700, 300, generator=g)
    sd = {"emb": w, "head": w, "t": w.t(), "n": torch.arange(7)}
    torch.save(sd, tmp / "c.pt")
    s3.client.upload_file(str(tmp / "c.pt"), "pyobj", "c.pt")
    got = turboio.load("s3://pyobj/c.pt", storage_options=s3.options)
    ref = torch.load(tmp / "c.pt", weights_only=True)
    assert set(got) == set(ref) and all(same(got[k], ref[k]) for k in ref)
    assert got["emb"].data_ptr() == got["head"].data_ptr()
    # Through the node cache: the zip's records the load skips are fetched when it closes the
    # file, so the whole object is kept, and the next load reads nothing from the server.
    cache = tmp / "pt-cache"
    turboio.load("s3://pyobj/c.pt", storage_options=s3.options, cache_dir=cache)
    assert len(_entries(cache)) == 1
    assert (cache / _entries(cache)[0]).read_bytes() == (tmp / "c.pt").read_bytes()
    s3.faults("{}")
    got = turboio.load("s3://pyobj/c.pt", storage_options=s3.options, cache_dir=cache)
    assert all(same(got[k], ref[k]) for k in ref)
    assert s3.stats()["get_bytes"] == 0


def test_save_pt_and_load_to_shmem_take_urls_with_storage_options(s3, tmp):
    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "n": torch.ones(5, dtype=torch.int64)}
    turboio.save_pt(sd, "s3://pyobj/saved.pt", storage_options=s3.options)
    body = s3.get("pyobj", "saved.pt")
    import io

    ref = torch.load(io.BytesIO(body), weights_only=True)
    assert all(same(ref[k], sd[k]) for k in sd)
    got = turboio.load("s3://pyobj/saved.pt", storage_options=s3.options)
    assert all(same(got[k], sd[k]) for k in sd)
    turboio.save_file(sd, "s3://pyobj/shm.safetensors", storage_options=s3.options)
    for url in ("s3://pyobj/shm.safetensors", "s3://pyobj/saved.pt"):
        shm = turboio.load_to_shmem(url, storage_options=s3.options)
        try:
            data = s3.get("pyobj", url.rsplit("/", 1)[1])
            assert bytes(shm.buf[: len(data)]) == data, url
        finally:
            shm.close()
            shm.unlink()
    with pytest.raises(FileNotFoundError, match="s3://pyobj/none.pt"):
        turboio.load_to_shmem("s3://pyobj/none.pt", storage_options=s3.options)


def test_errors_name_the_url_and_keep_secrets(s3):
    opts = s3.options
    with pytest.raises(FileNotFoundError, match="s3://pyobj/nope.safetensors"):
        turboio.load("s3://pyobj/nope.safetensors", storage_options=opts)
    with pytest.raises(FileNotFoundError, match="s3://no-such-bucket-x/a.safetensors"):
        tt.load_file("s3://no-such-bucket-x/a.safetensors", storage_options=opts)
    with pytest.raises(ValueError, match="concurrency"):
        turboio.load("s3://pyobj/a.safetensors", storage_options={**opts, "concurrency": "lots"})
    with pytest.raises(TypeError, match="storage_options"):
        turboio.load("s3://pyobj/a.safetensors", storage_options=["endpoint"])
    turboio.save_file({"x": torch.ones(3)}, "s3://pyobj/x.safetensors", storage_options=opts)
    s3.faults('{"require_key": "AKIASOMEBODYELSE"}')
    try:
        with pytest.raises(Exception) as info:
            turboio.load("s3://pyobj/x.safetensors", storage_options=opts)
    finally:
        s3.faults("{}")
    text = str(info.value) + repr(info.value)
    assert "s3://pyobj/x.safetensors" in text and "access denied" in text and SECRET_KEY not in text
    from turboio import _remote

    assert SECRET_KEY not in repr(_remote.storage("s3://pyobj/x", opts))


def test_urls_with_secrets_never_reach_exception_text():
    """Issue 48, items 3 and 4: a presigned URL is refused before any request (its query would
    be dropped and another object loaded), and neither its query nor a URL's user info appears
    in the exception, from the Rust errors or from the Python package's own messages."""
    import socket

    from turboio import _remote

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    signed = f"http://127.0.0.1:{port}/m.safetensors?X-Amz-Signature=sig123&X-Amz-Security-Token=tok456"
    with pytest.raises(Exception) as info:
        turboio.load(signed)
    text = str(info.value) + repr(info.value)
    assert "query string" in text and "sig123" not in text and "tok456" not in text, text
    with pytest.raises(Exception) as info:
        turboio.load(f"http://alice:hunter2@127.0.0.1:{port}/m.safetensors", storage_options={"max_retries": "0"})
    text = str(info.value) + repr(info.value)
    assert "hunter2" not in text and "alice" not in text and "m.safetensors" in text, text
    assert _remote.shown(signed) == f"http://127.0.0.1:{port}/m.safetensors?<redacted>"
    assert _remote.shown("/data/a?b.safetensors") == "/data/a?b.safetensors"


def test_throttling_and_cut_bodies_are_retried(s3):
    sd = big_dict(3)
    turboio.save_file(sd, "s3://pyobj/retry.safetensors", storage_options=s3.options)
    for faults in ('{"slowdown_every": 2}', '{"truncate_every": 3}'):
        s3.faults(faults)
        try:
            got = turboio.load("s3://pyobj/retry.safetensors", storage_options=s3.options)
        finally:
            s3.faults("{}")
        assert all(same(got[k], sd[k]) for k in sd), faults


def _entries(cache_dir):
    return sorted(p.name for p in cache_dir.iterdir() if p.name.endswith(".data"))


def test_the_node_cache_serves_every_load_api_locally(s3, tmp, monkeypatch):
    sd = big_dict(3)
    opts = s3.options
    turboio.save_file(sd, "s3://pyobj/cached.safetensors", storage_options=opts)
    turboio.save_model_dir(sd, "s3://models/cached", max_shard_size="8MB", storage_options=opts)
    size = len(s3.get("pyobj", "cached.safetensors"))
    cache = tmp / "node-cache"

    s3.faults("{}")
    got = turboio.load("s3://pyobj/cached.safetensors", storage_options=opts, cache_dir=cache)
    assert all(same(got[k], sd[k]) for k in sd)
    assert s3.stats()["get_bytes"] >= size
    assert len(_entries(cache)) == 1
    del got

    # Warm: no byte from the server, through every load API; the load's report says so.
    s3.faults("{}")
    from turboio import _remote, _turboio

    storage = _remote.storage("s3://pyobj/cached.safetensors", opts, cache)
    report = _turboio.load("s3://pyobj/cached.safetensors", storage=storage).report()
    assert report["served_by"] == "node cache: hit", report
    got = turboio.load("s3://pyobj/cached.safetensors", storage_options=opts, cache_dir=cache)
    assert all(same(got[k], sd[k]) for k in sd)
    got = tt.load_file("s3://pyobj/cached.safetensors", storage_options=opts, cache_dir=cache)
    assert all(same(got[k], sd[k]) for k in sd)
    with tt.safe_open("s3://pyobj/cached.safetensors", framework="pt", storage_options=opts, cache_dir=cache) as f:
        assert same(f.get_tensor("big.bf16"), sd["big.bf16"])
    assert s3.stats()["get_bytes"] == 0, s3.stats()

    # Models: the first load fills one entry per shard, the next reads none from the server.
    model = turboio.load_model("s3://models/cached", storage_options=opts, cache_dir=cache)
    assert set(model) == set(sd) and all(same(model[k], sd[k]) for k in sd)
    shards = len(_entries(cache)) - 1
    assert shards >= 2
    s3.faults("{}")
    model = dict(turboio.iter_weights("s3://models/cached", storage_options=opts, cache_dir=cache))
    assert all(same(model[k], sd[k]) for k in sd)
    assert turboio.load_model("s3://models/cached", storage_options=opts, cache_dir=cache).keys() == sd.keys()
    assert s3.stats()["get_bytes"] < 64 << 10, s3.stats()  # the index only (it is not cached: small)

    # From the environment, with the environment's credentials.
    monkeypatch.setenv("TURBOIO_CACHE_DIR", str(cache))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    s3.faults("{}")
    got = turboio.load("s3://pyobj/cached.safetensors")
    assert all(same(got[k], sd[k]) for k in sd)
    assert s3.stats()["get_bytes"] == 0

    # Trusting the version seen for an hour: once it is recorded, loads ask the server nothing.
    monkeypatch.setenv("TURBOIO_CACHE_REVALIDATE", "1h")
    turboio.load("s3://pyobj/cached.safetensors", storage_options=opts, cache_dir=cache)
    s3.faults("{}")
    got = turboio.load("s3://pyobj/cached.safetensors", storage_options=opts, cache_dir=cache)
    assert all(same(got[k], sd[k]) for k in sd)
    assert s3.stats()["requests"] == 0, s3.stats()
    monkeypatch.delenv("TURBOIO_CACHE_REVALIDATE")

    # A new version of the object is a miss, and the load returns the new tensors.
    sd2 = big_dict(4)
    turboio.save_file(sd2, "s3://pyobj/cached.safetensors", storage_options=opts)
    got = turboio.load("s3://pyobj/cached.safetensors", storage_options=opts, cache_dir=cache)
    assert all(same(got[k], sd2[k]) for k in sd2)
    monkeypatch.setenv("TURBOIO_CACHE_MAX_SIZE", "a lot")
    with pytest.raises(ValueError, match="TURBOIO_CACHE_MAX_SIZE"):
        turboio.load("s3://pyobj/cached.safetensors", storage_options=opts)


_KILLED_LOAD = """
import sys, torch, turboio
print("started", flush=True)
turboio.load(sys.argv[1], storage_options=eval(sys.argv[2]), cache_dir=sys.argv[3])
print("done", flush=True)
"""


def test_loads_killed_at_random_points_leave_a_usable_cache(s3, tmp):
    import random
    import time

    sd = {"w": torch.randn(16 * 1024 * 1024, generator=torch.Generator().manual_seed(5))}
    turboio.save_file(sd, "s3://pyobj/killed.safetensors", storage_options=s3.options)
    body = s3.get("pyobj", "killed.safetensors")
    cache = tmp / "killed-cache"
    rng = random.Random(11)
    cut = parts = 0
    for _ in range(5):
        p = subprocess.Popen(
            [sys.executable, "-c", _KILLED_LOAD, "s3://pyobj/killed.safetensors", repr(s3.options), str(cache)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout.readline().strip() == "started"
        time.sleep(rng.uniform(0.0, 0.6))  # a random point of the load, not a timing assertion
        p.kill()
        p.wait()
        entries = _entries(cache) if cache.exists() else []
        cut += not entries
        parts += cache.exists() and any(n.endswith(".part") for n in os.listdir(cache))
        for name in entries:  # anything published is the whole object
            assert (cache / name).read_bytes() == body
        got = turboio.load("s3://pyobj/killed.safetensors", storage_options=s3.options, cache_dir=cache)
        assert same(got["w"], sd["w"])
        assert _entries(cache) and (cache / _entries(cache)[0]).read_bytes() == body
        for name in os.listdir(cache):
            if name.endswith(".data") or name.endswith(".json"):
                os.remove(cache / name)
    print(f"{cut} of 5 kills landed before the entry was published, {parts} during the fetch")


def test_dcp_checkpoints_on_object_storage(s3, monkeypatch):
    """turboio.dcp on an s3:// prefix: save, load (into the same and other layouts), a second save
    replacing the first (its objects deleted after the commit), encryption, and errors."""
    import warnings

    import torch.distributed.checkpoint as dcp

    import turboio.dcp as tdcp

    warnings.simplefilter("ignore")
    opts = s3.options
    g = torch.Generator().manual_seed(9)

    def model(step):
        return {"w": torch.randn(512, 1024, generator=g) + step, "b": torch.arange(100) * step,
                "h": torch.randn(33, 7, generator=g).bfloat16(), "step": step, "cfg": {"lr": 0.1 * step}}

    def objects():
        return sorted(o["Key"] for o in s3.client.list_objects_v2(Bucket="models", Prefix="dcp/")["Contents"])

    url = "s3://models/dcp"
    for step in (1, 2):
        sd = model(step)
        dcp.save(sd, storage_writer=tdcp.FileSystemWriter(url, thread_count=3, storage_options=opts), no_dist=True)
        names = objects()
        assert "dcp/.metadata" in names and all(n == "dcp/.metadata" or n.endswith(".distcp") for n in names), names
        assert len(names) == 4, f"three data objects of this save and the metadata: {names}"
        target = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)} | {"step": -1, "cfg": {"lr": 0.0}}
        reader = tdcp.FileSystemReader(url, storage_options=opts)
        dcp.load(target, storage_reader=reader, no_dist=True)
        for k in ("w", "b", "h"):
            assert same(target[k], sd[k]), (step, k)
        assert target["step"] == step and target["cfg"] == {"lr": 0.1 * step}
        assert reader.items_read_directly == 3
    # Narrowed and strided destinations go through the copying path.
    target = {"w": torch.zeros(1024, 512).t(), "b": torch.zeros(100, dtype=torch.int64)}
    dcp.load(target, storage_reader=tdcp.FileSystemReader(url, storage_options=opts), no_dist=True)
    assert same(target["w"], sd["w"]) and same(target["b"], sd["b"])
    # Encrypted, keys from the environment.
    import base64

    monkeypatch.setenv("VETURBOIO_KEY", base64.b64encode(b"k" * 16).decode())
    monkeypatch.setenv("VETURBOIO_IV", base64.b64encode(b"i" * 16).decode())
    enc = "s3://models/dcp-enc"
    dcp.save(sd, storage_writer=tdcp.FileSystemWriter(enc, use_cipher=True, storage_options=opts), no_dist=True)
    raw = s3.get("models", "dcp-enc/.metadata")
    assert b"torch.distributed" not in raw, "the metadata object is encrypted"
    target = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)} | {"step": -1, "cfg": {"lr": 0.0}}
    dcp.load(target, storage_reader=tdcp.FileSystemReader(enc, use_cipher=True, storage_options=opts), no_dist=True)
    assert same(target["w"], sd["w"]) and target["cfg"] == sd["cfg"]
    # The Hugging Face layout under a prefix: a model directory turboio serves from the bucket.
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    dcp.save(tensors, storage_writer=tdcp.HuggingFaceStorageWriter("s3://models/hf", max_shard_size="1MB",
                                                                   storage_options=opts), no_dist=True)
    got = turboio.load_model("s3://models/hf", storage_options=opts)
    assert set(got) == set(tensors) and all(same(got[k], tensors[k]) for k in tensors)
    # Errors name the URL.
    with pytest.raises(BaseException, match=r"s3://models/nothing-here/\.metadata: no checkpoint metadata"):
        dcp.load({"w": torch.zeros(1)}, storage_reader=tdcp.FileSystemReader("s3://models/nothing-here", storage_options=opts),
                 no_dist=True)
    with pytest.raises(ValueError, match="ftp://x/y: turboio.dcp takes local directories and object-store URLs"):
        tdcp.FileSystemWriter("ftp://x/y")
    with pytest.raises(ValueError, match="storage option concurrency: must be a whole number"):
        tdcp.FileSystemWriter(url, storage_options={**opts, "concurrency": "many"})


def _dcp_rank(rank, world, d, url, opts, step, save):
    """One gloo rank: saves `step`'s sharded state dict (test_dcp's) to `url`, or loads it
    resharded over this world and records the entries that differ."""
    import json
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import turboio.dcp as tdcp
    from test_dcp import state_dict

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{d}/init-{world}-{save}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    if save:
        dcp.save(state_dict(mesh, step), storage_writer=tdcp.FileSystemWriter(url, thread_count=2, storage_options=opts))
    else:
        want, got = state_dict(mesh, step), state_dict(mesh, step, empty=True)
        dcp.load(got, storage_reader=tdcp.FileSystemReader(url, storage_options=opts))
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        bad = [k for k, v in want.items()
               if (not torch.equal(local(got[k]), local(v)) if isinstance(v, torch.Tensor) else got[k] != v)]
        with open(f"{d}/bad-{rank}.json", "w") as f:
            json.dump(bad, f)
    dist.barrier()
    dist.destroy_process_group()


def test_dcp_from_two_ranks_to_object_storage_loaded_by_three(s3, tmp):
    import json

    import torch.multiprocessing as mp

    url = "s3://models/dcp-ranks"
    mp.spawn(_dcp_rank, args=(2, str(tmp), url, s3.options, 3, True), nprocs=2, join=True)
    keys = [o["Key"] for o in s3.client.list_objects_v2(Bucket="models", Prefix="dcp-ranks/")["Contents"]]
    assert "dcp-ranks/.metadata" in keys and any(k.startswith("dcp-ranks/__1_") for k in keys), keys
    mp.spawn(_dcp_rank, args=(3, str(tmp), url, s3.options, 3, False), nprocs=3, join=True)
    for r in range(3):
        assert json.loads((tmp / f"bad-{r}.json").read_text()) == [], r


def test_dcp_hugging_face_layout_consolidated_under_a_prefix(s3, tmp):
    import torch.multiprocessing as mp

    from test_dcp import full_model, hf_save_worker

    url = "s3://models/hf-ranks"
    mp.spawn(hf_save_worker, args=(2, str(tmp), url, 6, None, s3.options), nprocs=2, join=True)
    keys = sorted(o["Key"] for o in s3.client.list_objects_v2(Bucket="models", Prefix="hf-ranks/")["Contents"])
    assert keys == ["hf-ranks/model-00001-of-00001.safetensors", "hf-ranks/model.safetensors.index.json"], keys
    want = full_model(6)
    got = turboio.load_model(url, storage_options=s3.options)
    assert set(got) == set(want) and all(same(got[k], want[k]) for k in want)
