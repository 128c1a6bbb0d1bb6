"""The page-cache policy from Python: `cache=` and veTurboIO's `use_direct_io`."""

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
