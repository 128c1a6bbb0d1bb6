"""Zero copy through DLPack, memory lifetime, writability, Ctrl-C."""

import gc
import os
import signal

import numpy as np
import pytest
import safetensors.torch as st
import torch

import turboio
from turboio import _turboio
from conftest import rss_bytes, same


@pytest.fixture
def one_gib(tmp):
    path = tmp / "big.safetensors"
    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, generator=g).view(torch.float32) for i in range(16)}
    turboio.save_file(tensors, str(path))
    del tensors
    return path


def test_tensors_are_views_of_one_load(tmp):
    sd = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.arange(10, dtype=torch.int16)}
    path = str(tmp / "v.safetensors")
    st.save_file(sd, path)
    loaded = _turboio.load(path)
    pts = {p.name: p for p in loaded.tensors()}
    a = torch.from_dlpack(pts["a"])
    a2 = torch.from_dlpack(pts["a"])
    assert a.data_ptr() == a2.data_ptr(), "no copy: both views point at the same bytes"
    n = np.from_dlpack(pts["a"])
    assert n.ctypes.data == a.data_ptr() and n.dtype == np.float32
    assert np.array_equal(np.from_dlpack(pts["b"]), sd["b"].numpy())
    # Tensors sit in the load's memory exactly as in the file.
    begin = {name: b for name, _, _, b, _ in loaded.infos()}
    b = torch.from_dlpack(pts["b"])
    assert b.data_ptr() - a.data_ptr() == begin["b"] - begin["a"]


def test_writes_copy_pages_not_the_file(tmp):
    sd = {"w": torch.randn(1 << 20)}
    path = tmp / "w.safetensors"
    st.save_file(sd, path)
    before = path.read_bytes()
    out = turboio.load(str(path))
    assert _turboio.load(str(path)).report()["held"] == "mapped"
    out["w"][123] = 42.0
    out["w"][:10].zero_()
    assert out["w"][123].item() == 42.0
    assert path.read_bytes() == before, "the file on disk never changes"
    again = turboio.load(str(path))
    assert torch.equal(again["w"], sd["w"]), "other loads see the file, not our writes"


def test_a_kept_tensor_outlives_its_siblings(tmp):
    sd = {f"t{i}": torch.full((1000,), float(i)) for i in range(50)}
    path = str(tmp / "k.safetensors")
    st.save_file(sd, path)
    out = turboio.load(path)
    kept = out["t17"]
    del out
    gc.collect()
    for _ in range(3):  # churn memory so a freed mapping would be reused
        junk = [torch.randn(100_000) for _ in range(20)]
        del junk
    assert torch.equal(kept, sd["t17"])
    view = kept[10:20]
    del kept
    gc.collect()
    assert torch.equal(view, sd["t17"][10:20])


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


@pytest.mark.parametrize("mode", ["auto", "copied"])
def test_memory_is_released(one_gib, mode):
    gc.collect()
    base = rss_bytes()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak
    for _ in range(20):
        loaded = _turboio.load(str(one_gib), mode=mode)
        sd = turboio._torch.tensors_of(loaded)
        assert len(sd) == 16
        del sd, loaded
    gc.collect()
    assert peak_rss_bytes() < 2.5 * (1 << 30), f"peak RSS {peak_rss_bytes() / 2**30:.2f} GiB over 20 loads"
    assert rss_bytes() - base < 256 << 20, "nothing is left behind"


def test_loads_with_progress_and_ctrl_c(one_gib):
    seen = []
    turboio.load(str(one_gib), progress=seen.append)
    assert seen and seen[0] == 0, "called at the start"

    def interrupt(done):
        signal.raise_signal(signal.SIGINT)

    base = rss_bytes()
    # Python's own Ctrl-C handler, even where the test runner inherited SIGINT ignored (a
    # background job): then Python installs none by itself.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            turboio.load(str(one_gib), use_direct_io=True, progress=interrupt)
    finally:
        signal.signal(signal.SIGINT, previous)
    gc.collect()
    assert rss_bytes() - base < 256 << 20, "the aborted load freed its memory"

    def fail(done):
        raise ValueError("stop here")

    with pytest.raises(ValueError, match="stop here"):
        turboio.load(str(one_gib), progress=fail)
    out = turboio.load(str(one_gib))
    assert len(out) == 16, "the loader works after an abort"


def test_arena_pool_reuse(tmp):
    sd = {"w": torch.randn(1 << 20)}
    path = str(tmp / "p.safetensors")
    st.save_file(sd, path)
    helper = turboio.init_io_helper()
    for _ in range(3):
        out = turboio.load(path, helper=helper, use_direct_io=True)
        assert torch.equal(out["w"], sd["w"])
        del out
        gc.collect()
    assert helper.free_bytes() >= 4 << 20
