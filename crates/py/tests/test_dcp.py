"""turboio.dcp: torch.distributed.checkpoint's FileSystemWriter and FileSystemReader on turboio.

On a real process group (gloo, spawned processes): DTensors sharded over 2 ranks saved and
loaded by 3 (DCP's planner reshards), and the other way; turboio's files read by DCP's own
reader and DCP's files by turboio's; async_save; non-tensor items. And the commit: a saver
killed with SIGKILL at every step of its protocol and at random moments, after which a load
gets exactly the previous checkpoint or the new one."""

import io
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import turboio
import turboio.dcp as tdcp


def full_model(step):
    g = torch.Generator().manual_seed(step)
    return {
        "embed": torch.randn(12, 8, generator=g),
        "layer.w": torch.randn(9, 5, generator=g).to(torch.bfloat16),
        "layer.b": torch.randn(7, generator=g),
        "ids": torch.arange(30, dtype=torch.int64).reshape(6, 5) * step,
    }


def state_dict(mesh, step, empty=False):
    from torch.distributed.tensor import Shard, distribute_tensor

    full = full_model(step)
    if empty:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items() if k != "layer.b"}
    sd["layer.b"] = full["layer.b"]  # a plain tensor, the same on every rank
    sd["step"] = -1 if empty else step
    sd["extra"] = {"lr": 0.0 if empty else 0.01 * step, "names": [] if empty else ["x", "y", str(step)]}
    return sd


def writer_for(kind, path):
    return tdcp.FileSystemWriter(path, thread_count=2) if kind == "turboio" else dcp.FileSystemWriter(path)


def reader_for(kind, path):
    return tdcp.FileSystemReader(path, window=1000) if kind == "turboio" else dcp.FileSystemReader(path)


def save_worker(rank, world, d, saves, step, use_async):
    """Saves the state dict of `step` once per `(path, writer kind)` in `saves`."""
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{d}/init-save-{world}-{step}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    sd = state_dict(mesh, step)
    for path, kind in saves:
        if use_async:
            dcp.async_save(sd, storage_writer=writer_for(kind, path)).result()
        else:
            dcp.save(sd, storage_writer=writer_for(kind, path))
    dist.barrier()
    dist.destroy_process_group()


def load_worker(rank, world, d, loads, step, tag):
    """Loads `step`'s checkpoint from each `(path, reader kind)` in `loads` into a state dict
    sharded over this world, and records which entries differ from the expected ones."""
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{d}/init-load-{tag}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    want = state_dict(mesh, step)
    bad = []
    for path, kind in loads:
        target = state_dict(mesh, step, empty=True)
        dcp.load(target, storage_reader=reader_for(kind, path))
        for k, v in want.items():
            got = target[k]
            if isinstance(v, torch.Tensor):
                a = got.to_local() if hasattr(got, "to_local") else got
                b = v.to_local() if hasattr(v, "to_local") else v
                if a.dtype != b.dtype or not torch.equal(a, b):
                    bad.append(f"{kind} reading {os.path.basename(path)}: {k}")
            elif got != v:
                bad.append(f"{kind} reading {os.path.basename(path)}: {k}")
    with open(f"{d}/load-{tag}-{rank}.json", "w") as f:
        json.dump({"bad": bad, "loads": len(loads)}, f)
    dist.barrier()
    dist.destroy_process_group()


def loaded_ok(d, tag, world):
    for r in range(world):
        res = json.loads((d / f"load-{tag}-{r}.json").read_text())
        assert res["bad"] == [] and res["loads"] > 0, (tag, r, res)


@pytest.mark.parametrize("save_world,load_world", [(2, 3), (3, 2)])
def test_resharded_and_interchangeable_with_dcps_own(tmp, save_world, load_world):
    d = tmp
    ours, theirs = str(d / "turboio-ckpt"), str(d / "dcp-ckpt")
    saves = [(ours, "turboio"), (theirs, "dcp")]
    mp.spawn(save_worker, args=(save_world, str(d), saves, 3, False), nprocs=save_world, join=True)
    files = sorted(os.listdir(ours))
    assert ".metadata" in files and all(tdcp._OURS.match(f) for f in files if f != ".metadata"), files
    # turboio's reader on turboio's files, DCP's reader on turboio's, turboio's on DCP's.
    loads = [(ours, "turboio"), (ours, "dcp"), (theirs, "turboio")]
    mp.spawn(load_worker, args=(load_world, str(d), loads, 3, "r"), nprocs=load_world, join=True)
    loaded_ok(d, "r", load_world)


def test_async_save_and_a_second_save_replacing_the_first(tmp):
    d = tmp
    path = str(d / "ckpt")
    mp.spawn(save_worker, args=(2, str(d), [(path, "turboio")], 1, True), nprocs=2, join=True)
    first = set(os.listdir(path))
    mp.spawn(save_worker, args=(2, str(d), [(path, "turboio")], 2, True), nprocs=2, join=True)
    second = set(os.listdir(path))
    # The first save's data files were deleted after the second one's commit; none is shared.
    assert first & second == {".metadata"}, (first, second)
    mp.spawn(load_worker, args=(2, str(d), [(path, "turboio")], 2, "a"), nprocs=2, join=True)
    loaded_ok(d, "a", 2)


def test_options_checked(tmp):
    with pytest.raises(ValueError, match="sfcs://m/ckpt: turboio.dcp takes local directories and object-store URLs"):
        tdcp.FileSystemWriter("sfcs://m/ckpt")
    with pytest.raises(ValueError, match="TORCH_SAVE"):
        tdcp.FileSystemWriter(tmp, serialization_format=dcp.filesystem.SerializationFormat.SAFETENSORS)
    with pytest.raises(ValueError, match="thread_count"):
        tdcp.FileSystemWriter(tmp, thread_count=0)
    with pytest.raises(ValueError, match="hdfs://n/ckpt: turboio.dcp takes local directories"):
        tdcp.FileSystemReader("hdfs://n/ckpt")
    # Object-store URLs are taken (tested against an S3 server in test_object.py).
    assert tdcp.FileSystemReader("gs://bucket/ckpt/").checkpoint_id == "gs://bucket/ckpt"
    assert tdcp.FileSystemWriter.validate_checkpoint_id("s3://bucket/ckpt")


def test_a_missing_or_damaged_data_file_is_named(tmp):
    warnings.simplefilter("ignore")
    sd = {"w": torch.randn(100, 10), "n": 3}
    dcp.save(sd, storage_writer=tdcp.FileSystemWriter(tmp / "c"), no_dist=True)
    data = next(f for f in os.listdir(tmp / "c") if f.endswith(".distcp"))
    with open(tmp / "c" / data, "r+b") as f:
        f.truncate(100)
    with pytest.raises(BaseException, match=data):  # DCP wraps errors in CheckpointException(BaseException)
        dcp.load({"w": torch.zeros(100, 10), "n": 0}, storage_reader=tdcp.FileSystemReader(tmp / "c"), no_dist=True)
    os.unlink(tmp / "c" / data)
    with pytest.raises(BaseException, match=f"{data}: a data file of the checkpoint is missing"):
        dcp.load({"w": torch.zeros(100, 10), "n": 0}, storage_reader=tdcp.FileSystemReader(tmp / "c"), no_dist=True)


# The saver for the kill test: saves versions 1, 2, ... of a state dict into one directory and
# prints "committed N" after each. With KILL_AT=k it sends itself SIGKILL right before or after
# its k-th atomic file write (data files, then the metadata: every step of the commit).
SAVER = textwrap.dedent(
    """
    import os, signal, sys, threading, warnings
    import torch, torch.distributed.checkpoint as dcp
    import turboio.dcp as tdcp
    sys.path.insert(0, sys.argv[2])
    from test_dcp import kill_model
    warnings.simplefilter("ignore")
    kill_at, when = int(os.environ.get("KILL_AT", "0")), os.environ.get("KILL_WHEN", "before")
    calls = [0]
    lock = threading.Lock()
    real = tdcp._write_file
    def counted(*a, **k):
        with lock:  # data files are written by several threads at once
            calls[0] += 1
            n = calls[0]
        if n == kill_at and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        real(*a, **k)
        if n == kill_at and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
    tdcp._write_file = counted
    first = int(os.environ.get("FIRST", "1"))
    for step in range(first, first + int(os.environ.get("SAVES", "1000000"))):
        dcp.save(kill_model(step), storage_writer=tdcp.FileSystemWriter(sys.argv[1], thread_count=3), no_dist=True)
        print("committed", step, flush=True)
    """
)


def kill_model(step):
    g = torch.Generator().manual_seed(step)
    return {
        "a": torch.randn(256, 1024, generator=g),  # 1 MiB
        "b": torch.randn(3000, generator=g).to(torch.float16),
        "c": torch.full((64, 64), step, dtype=torch.int32),
        "step": step,
    }


def load_step(path, kind):
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in kill_model(0).items()}
    dcp.load(target, storage_reader=reader_for(kind, path), no_dist=True)
    step = target["step"]
    want = kill_model(step)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(target[k], v), f"{kind}: tensor {k} is not step {step}'s"
    return step


def kill_at_random(p, rng, last, kill, first_commits=0, chance=0.5, work=3_000_000):
    """Lets saver `p` commit `first_commits` to 2 saves (its "committed N" lines), then, with
    probability `chance`, a random moment inside the next one (busy-waiting on a random amount
    of CPU work, not on the clock), and kills it with `kill()`; returns the last step it printed
    (`last` if none)."""
    for _ in range(rng.randrange(first_commits, 3)):
        line = p.stdout.readline()
        if not line:
            break
        last = int(line.split()[1])
    if rng.random() < chance:
        x = 0
        for j in range(rng.randrange(0, work)):
            x ^= j
    kill()
    rest = p.stdout.read()
    p.wait()
    for line in rest.splitlines():
        # A kill can cut the last line short ("committed" without its step, seen once): that
        # save committed, and `last + 1` is what the loads then accept.
        words = line.split()
        if len(words) == 2 and words[0] == "committed":
            last = int(words[1])
    return last


def load_after_kill(i, path, last, load):
    """Both readers load the checkpoint after kill `i` with `load(path, kind)`, which must get
    exactly step `last` (the last committed) or `last + 1` (killed after its commit); returns
    the step."""
    for kind in ("turboio", "dcp"):
        try:
            step = load(path, kind)
        except BaseException as e:
            raise AssertionError(f"kill {i}: {kind} could not load the checkpoint (last committed {last}); "
                                 f"files: {sorted(os.listdir(path))}") from e
        assert step in (last, last + 1), (i, kind, step, last, sorted(os.listdir(path)))
    return step


def test_killed_saves_leave_the_previous_checkpoint_or_the_new_one(tmp):
    """SIGKILL at every step of the protocol (before and after each atomic write: 3 data files
    and the metadata) and at random moments; after each kill both readers load exactly the last
    committed step or the one being saved. TURBOIO_DCP_KILLS sets the number of random kills
    (default 6; the closing note's run used 100)."""
    warnings.simplefilter("ignore")
    path = tmp / "ckpt"
    script = tmp / "saver.py"
    script.write_text(SAVER)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, SAVES="1", FIRST="1")
    r = subprocess.run([sys.executable, script, path, here], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "committed 1" in r.stdout, r.stderr[-2000:]
    committed = 1
    points = [(k, w) for k in range(1, 5) for w in ("before", "after")]
    for kill_at, when in points:
        env = dict(os.environ, SAVES="1", FIRST=str(committed + 1), KILL_AT=str(kill_at), KILL_WHEN=when)
        r = subprocess.run([sys.executable, script, path, here], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == -signal.SIGKILL, (kill_at, when, r.returncode, r.stderr[-2000:])
        for kind in ("turboio", "dcp"):
            try:
                step = load_step(path, kind)
            except BaseException as e:
                raise AssertionError(f"killed at {kill_at} {when}: {kind} could not load; files: {sorted(os.listdir(path))}") from e
            # The metadata's rename is the 4th write: killed after it, the new step is committed.
            want = committed + 1 if (kill_at, when) == (4, "after") else committed
            assert step == want, (kill_at, when, kind, step, committed)
        committed = step
    rng = random.Random(25)
    kills = int(os.environ.get("TURBOIO_DCP_KILLS", "6"))
    for i in range(kills):
        env = dict(os.environ, FIRST=str(committed + 1))
        p = subprocess.Popen([sys.executable, script, path, here], env=env, stdout=subprocess.PIPE, text=True)
        # Let it commit 0 to 2 saves, then kill it at a random point of the next one.
        last = kill_at_random(p, rng, committed, p.kill)
        committed = load_after_kill(i, path, last, load_step)
    # Leftovers of killed saves are gone after the next complete save.
    env = dict(os.environ, SAVES="1", FIRST=str(committed + 1))
    r = subprocess.run([sys.executable, script, path, here], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    left = sorted(f for f in os.listdir(path) if not f.startswith(".metadata"))
    assert len(left) == 3, left


RANK_SAVER = textwrap.dedent(
    """
    import os, sys, warnings
    sys.path.insert(0, sys.argv[2])
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp
    import turboio.dcp as tdcp
    from test_dcp import state_dict

    def rank_main(rank, world, path, init, first):
        from torch.distributed.device_mesh import init_device_mesh
        warnings.simplefilter("ignore")
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        for step in range(first, first + 1000000):
            dcp.save(state_dict(mesh, step), storage_writer=tdcp.FileSystemWriter(path, thread_count=2))
            if rank == 0:
                print("committed", step, flush=True)

    if __name__ == "__main__":
        mp.spawn(rank_main, args=(2, sys.argv[1], sys.argv[3], int(sys.argv[4])), nprocs=2)
    """
)


def load_full_step(path, kind):
    """Loads a checkpoint saved from ranks into whole tensors (one process) and checks that every
    tensor is the saved step's; returns the step."""
    target = {k: torch.zeros_like(v) for k, v in full_model(0).items()}
    target["step"], target["extra"] = -1, {"lr": 0.0, "names": []}
    dcp.load(target, storage_reader=reader_for(kind, path), no_dist=True)
    step = target["step"]
    want = full_model(step)
    for k, v in want.items():
        assert torch.equal(target[k], v), f"{kind}: tensor {k} is not step {step}'s"
    assert target["extra"]["lr"] == 0.01 * step, (kind, target["extra"], step)
    return step


def test_ranks_killed_mid_save_leave_the_previous_checkpoint_or_the_new_one(tmp):
    """Two gloo ranks saving DTensor checkpoints in a loop, both killed (SIGKILL to the process
    group) at random moments; after each kill both readers load exactly the last committed step
    or the one being saved. TURBOIO_DCP_RANK_KILLS sets the number of kills (default 3)."""
    warnings.simplefilter("ignore")
    path = tmp / "ckpt"
    script = tmp / "rank_saver.py"
    script.write_text(RANK_SAVER)
    here = os.path.dirname(os.path.abspath(__file__))
    rng = random.Random(26)
    committed = 0
    seen = {"previous": 0, "new": 0, "before any commit": 0}
    for i in range(int(os.environ.get("TURBOIO_DCP_RANK_KILLS", "3"))):
        p = subprocess.Popen([sys.executable, script, path, here, tmp / f"init-{i}", str(committed + 1)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
        # The first launch commits at least one save; later ones 0 to 2 before the kill.
        last = kill_at_random(p, rng, committed, lambda: os.killpg(p.pid, signal.SIGKILL),
                              first_commits=1 if committed == 0 else 0, chance=0.7, work=4_000_000)
        if last == 0:
            seen["before any commit"] += 1
            continue  # killed before anything was committed: nothing to load yet
        step = load_after_kill(i, path, last, load_full_step)
        seen["new" if step == last + 1 else "previous"] += 1
        committed = step
    print(f"ranks killed: the load got {seen}")
    assert committed > 0, "no save was ever committed"


def test_the_readme_example_runs(tmp):
    example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "dcp_two_ranks.py")
    r = subprocess.run([sys.executable, example, str(tmp / "ckpt")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "loaded step 2" in r.stdout, r.stdout


def test_encrypted_checkpoints(tmp, monkeypatch):
    """use_cipher=True: every data file and the metadata encrypted (no plaintext of the tensors
    on disk), read back with the key; without it, or with another key, a clear failure."""
    import base64

    from test_cipher import IV, KEY

    monkeypatch.setenv("VETURBOIO_KEY", base64.b64encode(KEY).decode())
    monkeypatch.setenv("VETURBOIO_IV", base64.b64encode(IV).decode())
    monkeypatch.setenv("DATAPIPE_SOCKET_PATH", str(tmp / "no-datapipe.sock"))
    warnings.simplefilter("ignore")
    sd = kill_model(5)
    path = tmp / "enc"
    dcp.save(sd, storage_writer=tdcp.FileSystemWriter(path, thread_count=2, use_cipher=True), no_dist=True)
    plain = sd["a"].numpy().tobytes()[:4096]
    for name in os.listdir(path):
        assert plain not in (path / name).read_bytes(), name
    assert load_step_with(path, tdcp.FileSystemReader(path, use_cipher=True)) == 5
    with pytest.raises((BaseException,), match=r"\.metadata"):
        load_step_with(path, tdcp.FileSystemReader(path))  # read as plain: not DCP metadata
    monkeypatch.setenv("VETURBOIO_KEY", base64.b64encode(b"abcdefgh12345679").decode())
    with pytest.raises((BaseException,), match=r"\.metadata"):
        load_step_with(path, tdcp.FileSystemReader(path, use_cipher=True))


def load_step_with(path, reader):
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in kill_model(0).items()}
    dcp.load(target, storage_reader=reader, no_dist=True)
    want = kill_model(target["step"])
    assert all(torch.equal(target[k], v) for k, v in want.items() if isinstance(v, torch.Tensor))
    return target["step"]


def test_metadata_that_would_run_code_is_refused(tmp):
    """A .metadata crafted to call a function when unpickled (DCP's own reader would run it)."""
    warnings.simplefilter("ignore")
    dcp.save(kill_model(1), storage_writer=tdcp.FileSystemWriter(tmp / "c"), no_dist=True)
    marker = tmp / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp / "c" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(BaseException, match=r"\.metadata: not DCP checkpoint metadata: (posix|os)\.system is not allowed"):
        load_step_with(tmp / "c", tdcp.FileSystemReader(tmp / "c"))
    assert not marker.exists()
    (tmp / "c" / ".metadata").write_bytes(b"not a pickle at all")
    with pytest.raises(BaseException, match=r"\.metadata: (not|damaged) DCP checkpoint metadata"):
        load_step_with(tmp / "c", tdcp.FileSystemReader(tmp / "c"))
    os.unlink(tmp / "c" / ".metadata")
    with pytest.raises(BaseException, match=r"\.metadata: no checkpoint metadata"):
        load_step_with(tmp / "c", tdcp.FileSystemReader(tmp / "c"))


@pytest.mark.parametrize("bad", ["../d/__0_0.distcp", "/abs/__0_0.distcp", "sub/__0_0.distcp", ".."])
def test_metadata_naming_files_outside_the_checkpoint_is_refused(tmp, bad):
    """A .metadata whose items name a data file outside the checkpoint directory: another
    checkpoint's bytes would load without error."""
    warnings.simplefilter("ignore")
    dcp.save(kill_model(1), storage_writer=tdcp.FileSystemWriter(tmp / "c"), no_dist=True)
    dcp.save(kill_model(2), storage_writer=tdcp.FileSystemWriter(tmp / "d"), no_dist=True)
    md = tdcp.FileSystemReader(tmp / "c").read_metadata()
    for k, info in md.storage_data.items():
        md.storage_data[k] = type(info)(relative_path=bad, offset=info.offset, length=info.length)
    (tmp / "c" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(BaseException, match="not a file name inside the checkpoint directory"):
        load_step_with(tmp / "c", tdcp.FileSystemReader(tmp / "c"))


def test_bytes_items_in_crafted_metadata_run_nothing(tmp):
    """Crafted metadata that declares a tensor's key as a pickled item, or points a non-tensor
    item at a pickle that calls a function: DCP's planner would unpickle either with
    weights_only=False; the reader refuses both, and runs nothing."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    warnings.simplefilter("ignore")
    dcp.save({"w": torch.arange(10.0), "step": 1}, storage_writer=tdcp.FileSystemWriter(tmp / "c"), no_dist=True)
    clean = tdcp.FileSystemReader(tmp / "c").read_metadata()
    step = MetadataIndex(fqn="step")
    info = clean.storage_data[step]

    # 1. The tensor "w" declared a bytes item (the step's pickle): refused, w untouched.
    md = tdcp.FileSystemReader(tmp / "c").read_metadata()
    md.state_dict_metadata["w"] = BytesStorageMetadata()
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "w"}
    md.storage_data[MetadataIndex(fqn="w")] = info
    (tmp / "c" / ".metadata").write_bytes(pickle.dumps(md))
    target = {"w": torch.zeros(10), "step": 0}
    with pytest.raises(BaseException, match="stored as pickled bytes, but its destination is a tensor"):
        dcp.load(target, storage_reader=tdcp.FileSystemReader(tmp / "c"), no_dist=True)
    assert isinstance(target["w"], torch.Tensor)

    # 2. "step" pointed at a pickle that would run a command.
    marker = tmp / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    torch.save(Evil(), buf)
    data = next(f for f in os.listdir(tmp / "c") if f.endswith(".distcp"))
    at = os.path.getsize(tmp / "c" / data)
    with open(tmp / "c" / data, "ab") as f:
        f.write(buf.getvalue())
    md = tdcp.FileSystemReader(tmp / "c").read_metadata()
    md.state_dict_metadata["w"] = clean.state_dict_metadata["w"]
    md.storage_data = dict(clean.storage_data)
    md.storage_data[step] = type(info)(relative_path=info.relative_path, offset=at, length=len(buf.getvalue()))
    (tmp / "c" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(BaseException, match="weights_only=True refuses"):
        dcp.load({"w": torch.zeros(10), "step": 0}, storage_reader=tdcp.FileSystemReader(tmp / "c"), no_dist=True)
    assert not marker.exists(), "nothing ran"
    # The honest checkpoint's items still load (the step through the planner).
    (tmp / "c" / ".metadata").write_bytes(pickle.dumps(clean))
    target = {"w": torch.zeros(10), "step": 0}
    dcp.load(target, storage_reader=tdcp.FileSystemReader(tmp / "c"), no_dist=True)
    assert target["step"] == 1 and torch.equal(target["w"], torch.arange(10.0))


def test_whole_tensors_are_read_straight_into_their_destination(tmp):
    warnings.simplefilter("ignore")
    sd = kill_model(4)
    sd["t"] = torch.randn(40, 30).t()  # saved as a non-contiguous tensor (its own storage)
    dcp.save(sd, storage_writer=tdcp.FileSystemWriter(tmp / "c", thread_count=2), no_dist=True)
    reader = tdcp.FileSystemReader(tmp / "c")
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in sd.items()}
    target["t"] = torch.zeros(30, 40)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert all(torch.equal(target[k], v) for k, v in sd.items() if isinstance(v, torch.Tensor)) and target["step"] == 4
    assert reader.items_read_directly == 3  # a, b and c; "t" (strided) through torch.load
    # A destination that is not contiguous, or of another dtype: the copying path, same values.
    reader = tdcp.FileSystemReader(tmp / "c")
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in sd.items()}
    target["a"] = torch.zeros(1024, 256).t()
    target["c"] = torch.zeros(64, 64, dtype=torch.int64)
    target["t"] = torch.zeros(30, 40)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["a"], sd["a"]) and torch.equal(target["c"], sd["c"].long()) and torch.equal(target["b"], sd["b"])
    assert reader.items_read_directly == 1  # b only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_dicts(tmp):
    """CUDA tensors saved by turboio's writer (moved to host memory first) and loaded into CUDA
    destinations (the copying path), each way with DCP's own reader and writer too."""
    warnings.simplefilter("ignore")
    sd = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kill_model(5).items()}
    dcp.save(sd, storage_writer=tdcp.FileSystemWriter(tmp / "t", thread_count=2), no_dist=True)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp / "d"), no_dist=True)
    for path, reader in ((tmp / "t", tdcp.FileSystemReader), (tmp / "t", dcp.FileSystemReader),
                         (tmp / "d", tdcp.FileSystemReader)):
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in sd.items()}
        dcp.load(target, storage_reader=reader(path), no_dist=True)
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                assert target[k].is_cuda and torch.equal(target[k], v), (path, reader, k)
        assert target["step"] == 5


def test_hugging_face_layout(tmp):
    """A full state dict saved through HuggingFaceStorageWriter is a model directory: turboio
    and torch's HuggingFaceStorageReader load it; a mapping fixes the files; a second save
    replaces the set; what it cannot write is refused clearly."""
    from safetensors.torch import load_file

    warnings.simplefilter("ignore")
    sd = {k: v for k, v in full_model(3).items()}
    sd["lm_head.weight"] = torch.randn(50, 8)
    d = tmp / "hf"
    dcp.save(sd, storage_writer=tdcp.HuggingFaceStorageWriter(d, max_shard_size="500B"), no_dist=True)
    turboio._turboio.wait_for_saves()  # replaced files are unlinked in the background
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.startswith("model-") and f.endswith(".safetensors") for f in files), files
    assert sorted(p.name for p in d.iterdir()) == sorted(files + ["model.safetensors.index.json"])
    got = turboio.load_model(str(d))
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    # torch's own reader loads it back through DCP.
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(target, storage_reader=dcp.HuggingFaceStorageReader(str(d)), no_dist=True)
    assert all(torch.equal(target[k], sd[k]) for k in sd)
    # An existing model's layout: each tensor in the file the mapping says; the old set is gone.
    mapping = {k: (2 if k.startswith("layer") else 1) for k in sd}
    dcp.save(sd, storage_writer=tdcp.HuggingFaceStorageWriter(d, fqn_to_index_mapping=mapping), no_dist=True)
    turboio._turboio.wait_for_saves()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["layer.w"] == "model-00002-of-00002.safetensors"
    assert index["weight_map"]["embed"] == "model-00001-of-00002.safetensors"
    assert sorted(p.name for p in d.iterdir()) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    shard = load_file(str(d / "model-00002-of-00002.safetensors"))
    assert sorted(shard) == ["layer.b", "layer.w"] and torch.equal(shard["layer.w"], sd["layer.w"])
    # Refused: non-tensor items, sharded saves, a mapping that leaves a tensor out.
    with pytest.raises(BaseException, match="`step` is not a tensor"):
        dcp.save({**sd, "step": 3}, storage_writer=tdcp.HuggingFaceStorageWriter(tmp / "x"), no_dist=True)
    with pytest.raises(ValueError, match="either a full state dict from one process"):
        tdcp.HuggingFaceStorageWriter(tmp / "x", save_distributed=True)
    with pytest.raises(BaseException, match=r"fqn_to_index_mapping has no file for \['lm_head.weight'\]"):
        dcp.save(sd, storage_writer=tdcp.HuggingFaceStorageWriter(tmp / "y", fqn_to_index_mapping={
            k: 1 for k in sd if k != "lm_head.weight"}), no_dist=True)


def hf_save_worker(rank, world, d, path, step, mapping, storage_options=None):
    """Saves `step`'s DTensors sharded over `world` gloo ranks, consolidated into a model
    directory by HuggingFaceStorageWriter."""
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{d}/init-hf-{world}-{step}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    sd = {k: v for k, v in state_dict(mesh, step).items() if isinstance(v, torch.Tensor)}
    writer = tdcp.HuggingFaceStorageWriter(path, fqn_to_index_mapping=mapping, save_distributed=True,
                                           enable_consolidation=True, storage_options=storage_options)
    dcp.save(sd, storage_writer=writer)
    dist.barrier()
    dist.destroy_process_group()


def test_hugging_face_layout_consolidated_from_ranks(tmp):
    """DTensors sharded over 3 ranks become one servable directory with whole tensors; the
    staging files are gone after the commit; a second save (another layout) replaces the set."""
    path = tmp / "hf"
    mp.spawn(hf_save_worker, args=(3, str(tmp), str(path), 4, None), nprocs=3, join=True)
    want = full_model(4)
    got = turboio.load_model(str(path))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert sorted(p.name for p in path.iterdir()) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(target, storage_reader=dcp.HuggingFaceStorageReader(str(path)), no_dist=True)
    assert all(torch.equal(target[k], want[k]) for k in want)
    mapping = {k: i + 1 for i, k in enumerate(sorted(want))}
    mp.spawn(hf_save_worker, args=(2, str(tmp), str(path), 5, mapping), nprocs=2, join=True)
    want = full_model(5)
    got = turboio.load_model(str(path))
    assert all(torch.equal(got[k], want[k]) for k in want)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"].values()) == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert len([p for p in path.iterdir()]) == 5, sorted(p.name for p in path.iterdir())
