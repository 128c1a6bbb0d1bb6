"""The page-cache policy from Python (`cache=`, veTurboIO's `use_direct_io`) and background saves."""

import os
import subprocess
import sys

import pytest
import torch

import turboio
from turboio import _turboio


def _evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _sample(tmp):
    path = str(tmp / "m.safetensors")
    turboio.save_file({"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(7)}, path)
    return path


def test_default_keeps_the_cache_and_bypass_says_so(tmp):
    path = _sample(tmp)
    _evict(path)
    r = _turboio.load(path).report()
    assert (r["cache"], r["cache_reason"], r["held"]) == ("kept", "default", "mapped")
    _evict(path)
    r = _turboio.load(path, mode="copied", cache="bypass").report()
    assert (r["cache"], r["cache_reason"], r["held"], r["direct"]) == ("bypassed", "asked for", "copied", True)
    with pytest.raises(ValueError, match="cache policy"):
        _turboio.load(path, cache="sometimes")


def test_use_direct_io_means_bypass(tmp):
    path = _sample(tmp)
    sd = turboio.load(path, use_direct_io=True)
    assert torch.equal(sd["w"], torch.arange(1 << 20, dtype=torch.float32))
    sd = turboio.load(path, cache="keep")
    assert torch.equal(sd["b"], torch.ones(7))
    with pytest.raises(ValueError, match="use_direct_io"):
        turboio.load(path, use_direct_io=True, cache="keep")
    with pytest.raises(ValueError, match="cannot bypass"):
        _turboio.load(path, mode="mapped", cache="bypass")


def test_background_saves(tmp):
    from turboio import torch as st

    path = str(tmp / "bg.safetensors")
    w = torch.arange(1 << 22, dtype=torch.float32)
    expect = w.clone()
    h = turboio.save_file({"w": w}, path, blocking=False)
    w.fill_(-1)  # the snapshot was taken before save_file returned
    del w
    h.wait()
    assert h.done() and h.exception() is None
    assert h.progress()[0] == h.progress()[1] == os.path.getsize(path)
    assert torch.equal(st.load_file(path)["w"], expect)
    # In order, same path: the last one wins.
    hs = [st.save_file({"w": torch.full((1000,), float(i))}, path, blocking=False) for i in range(5)]
    for h in hs:
        h.wait()
    assert torch.equal(st.load_file(path)["w"], torch.full((1000,), 4.0))
    # A failed write raises from wait(), and again from exception().
    h = st.save_file({"w": torch.ones(3)}, str(tmp / "missing" / "x.safetensors"), blocking=False)
    with pytest.raises(FileNotFoundError, match="missing"):
        h.wait()
    assert isinstance(h.exception(), FileNotFoundError)


def test_background_saves_queued_faster_than_written_hold_two_snapshots(tmp):
    """Eight background saves of 128 MiB to one path, asked for at once: the snapshot pool holds
    at most two, so the caller waits for the oldest save instead of holding eight copies (an
    outside review saw six snapshots of 256 MiB at once before the pool was bounded)."""
    code = (
        "import os\n"
        # Two cores at most: the writers' buffers (a few chunks per core) stay small beside 128 MiB.
        "os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])\n"
        "import resource, sys, torch, turboio\n"
        "w = torch.ones(32 << 20)\n"  # 128 MiB
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "hs = [turboio.save_file({'w': w}, sys.argv[1], blocking=False) for i in range(8)]\n"
        "for h in hs: h.wait()\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "assert torch.equal(turboio.load(sys.argv[1])['w'], w)\n"
        "print(peak - base)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp / "q.safetensors")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    added = int(r.stdout)
    # Two snapshots (256 MiB), the writers' buffers and slack (measured: 322 MiB); eight
    # snapshots would be 1 GiB.
    assert added < (2 * 128 + 192) << 20, f"peak RSS grew by {added >> 20} MiB for eight queued 128 MiB saves"


def test_a_background_save_over_its_host_memory_budget_is_refused_before_copying(tmp):
    """`max_host_memory=` bounds a background save's snapshot: a larger one raises MemoryError
    with the numbers and leaves the previous file as it was; one within it saves."""
    from turboio import torch as st

    path = str(tmp / "budget.safetensors")
    st.save_file({"w": torch.zeros(4)}, path)
    w = torch.ones(1 << 20)  # 4 MiB
    for save in (st.save_file, turboio.save_file):
        with pytest.raises(MemoryError, match=r"budget\.safetensors.*snapshot needs 4\.2 MB.*max_host_memory is 1MiB"):
            save({"w": w}, path, blocking=False, max_host_memory="1MiB")
        assert torch.equal(st.load_file(path)["w"], torch.zeros(4)), "the old file stays"
        save({"w": w}, path, blocking=False, max_host_memory=8 << 20).wait()
        assert torch.equal(st.load_file(path)["w"], w)
        st.save_file({"w": torch.zeros(4)}, path)
    with pytest.raises(ValueError, match="max_host_memory"):
        st.save_file({"w": w}, path, blocking=False, max_host_memory="lots")


def test_reuse_blocks_writes_into_the_previous_versions_blocks(tmp):
    """`reuse_blocks=True`: a replacing save keeps the old file as a hidden spare and the next
    one writes into its blocks (the same inode), from both APIs; without it the spare goes."""
    from turboio import torch as st

    path = str(tmp / "ckpt.safetensors")
    spare = str(tmp / ".ckpt.safetensors.turboio-spare")
    w = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    turboio.save_file(w, path, reuse_blocks=True)
    first = os.stat(path).st_ino
    st.save_file({"w": w["w"] + 1}, path, reuse_blocks=True)
    assert os.stat(spare).st_ino == first
    turboio.save_file({"w": w["w"] + 2}, path, reuse_blocks=True, blocking=False).wait()
    assert os.stat(path).st_ino == first, "written into the spare's blocks"
    assert torch.equal(st.load_file(path)["w"], w["w"] + 2)
    st.save_file({"w": w["w"] + 3}, path)
    _turboio.wait_for_saves()
    assert not os.path.exists(spare)
    assert sorted(os.listdir(tmp)) == ["ckpt.safetensors"]
