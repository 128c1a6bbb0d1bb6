"""The page-cache policy from Python (`cache=`, veTurboIO's `use_direct_io`) and background saves."""

import os

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
