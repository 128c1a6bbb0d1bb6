"""GPU entry points of the three APIs.

Without a GPU (CI): every one raises a clear exception naming the missing library or device, never
crashes, and the CPU paths are unchanged. With TURBOIO_TEST_CUDA=1 (a GPU machine): loads to
CUDA, plain and encrypted, match CPU loads; CUDA tensors reach torch through DLPack zero-copy with
kDLCUDA and the right index; saves of CUDA tensors are byte-identical to safetensors'.
"""

import base64
import os

import pytest
import torch

import turboio
import turboio.torch as st
from turboio import SafeTensorsFileLoader, SingleGroup, fastsafe_open
from turboio import _cuda, _turboio

from conftest import same

GPU = os.environ.get("TURBOIO_TEST_CUDA") == "1"
needs_gpu = pytest.mark.skipif(not GPU, reason="TURBOIO_TEST_CUDA is not 1 (no GPU test)")
no_gpu = pytest.mark.skipif(GPU, reason="a GPU is present")

MISSING = ("libcuda", "no CUDA device")


def sample(tmp, n=4096):
    tensors = {
        "w": torch.randn(n, 33, dtype=torch.float32),
        "b": torch.arange(1000, dtype=torch.int64),
        "h": torch.randn(257, 5).to(torch.bfloat16),
        "e": torch.empty(0, 3, dtype=torch.float16),
    }
    path = tmp / "m.safetensors"
    st.save_file(tensors, path, metadata={"format": "pt"})
    return path, tensors


def assert_missing_gpu(excinfo, device="cuda:0"):
    msg = str(excinfo.value)
    assert device in msg, msg
    assert any(m in msg for m in MISSING), msg


@no_gpu
@pytest.mark.parametrize("where", ["cuda", "cuda:0", torch.device("cuda", 0), torch.device("cuda")])
def test_veturboio_map_location_cuda_raises_naming_what_is_missing(tmp, where):
    path, _ = sample(tmp)
    with pytest.raises(RuntimeError) as e:
        turboio.load(str(path), map_location=where)
    assert_missing_gpu(e)
    with pytest.raises(RuntimeError) as e:
        turboio.load(str(path), map_location="cuda:3", helper=turboio.init_io_helper(), use_pinmem=True)
    assert_missing_gpu(e, "cuda:3")


def test_npu_is_a_clear_error(tmp):
    path, _ = sample(tmp)
    for call in (
        lambda: turboio.load(str(path), map_location="npu:0"),
        lambda: st.load_file(path, device="npu:0"),
        lambda: SafeTensorsFileLoader(SingleGroup(), device="npu:0"),
    ):
        with pytest.raises(RuntimeError, match="not supported in this build"):
            call()


@no_gpu
def test_safetensors_and_fastsafetensors_apis_raise_without_a_gpu(tmp):
    path, _ = sample(tmp)
    for device in ("cuda", "cuda:0", 0):
        with pytest.raises(RuntimeError) as e:
            st.load_file(path, device=device)
        assert_missing_gpu(e)
    with pytest.raises(RuntimeError) as e:
        st.safe_open(path, framework="pt", device="cuda:0")
    assert_missing_gpu(e)
    for nogds in (True, False):
        with pytest.raises(RuntimeError) as e:
            SafeTensorsFileLoader(SingleGroup(), device="cuda:0", nogds=nogds)
        assert_missing_gpu(e)
    with pytest.raises(RuntimeError) as e:
        fastsafe_open([str(path)], device="cuda:0")
    assert_missing_gpu(e)
    with pytest.raises(RuntimeError) as e:
        _turboio.load(str(path), device="cuda:0", gds="auto")
    assert_missing_gpu(e)


@no_gpu
def test_iter_weights_to_cuda_raises_naming_what_is_missing(tmp):
    path, _ = sample(tmp)
    for window in (None, "1MiB"):
        with pytest.raises(RuntimeError) as e:
            next(turboio.iter_weights([str(path)], "cuda:0", window=window))
        assert_missing_gpu(e)


@needs_gpu
@pytest.mark.parametrize("window", [None, 4096])
def test_iter_weights_loads_straight_into_the_gpu(tmp, window):
    """Each group through the device path (the vLLM plug-in's upload): CUDA tensors equal to
    the file's, valid after the iterator moved on."""
    path, tensors = sample(tmp, n=1 << 16)
    got = dict(turboio.iter_weights([str(path)], "cuda:0", window=window))
    assert got.keys() == tensors.keys()
    for k, v in tensors.items():
        assert got[k].device == torch.device("cuda", 0), k
        assert same(got[k].cpu(), v), k


def test_device_strings_and_cpu_paths_are_unchanged(tmp):
    path, tensors = sample(tmp)
    assert _turboio.check_device("cpu") == "cpu"
    with pytest.raises(ValueError):
        _turboio.check_device("tpu:0")
    with pytest.raises(ValueError):
        _turboio.check_device("cuda:x")
    with pytest.raises(ValueError, match="GDS"):
        _turboio.load(str(path), gds="sometimes")
    out = turboio.load(str(path), map_location="cpu")
    for k, v in tensors.items():
        assert same(out[k], v)
        assert out[k].device.type == "cpu"
    pt = _turboio.load(str(path)).tensors()[0]
    assert pt.__dlpack_device__() == (1, 0)
    assert pt.device == "cpu"
    assert _turboio.load(str(path)).report()["fallbacks"] == []
    helper = turboio.init_io_helper()
    assert helper.free_bytes() >= 0
    for k, v in st.load_file(path, device="cpu").items():
        assert same(v, tensors[k])


def test_nvidia_wheel_library_dirs_are_found():
    # The venv has torch's CUDA 13 wheels: nvidia/cu13/lib holds libnvrtc and libcufile.
    dirs = _cuda.library_dirs()
    if not any(os.path.exists(os.path.join(d, "libcufile.so.0")) for d in dirs):
        pytest.skip("no nvidia wheel with libcufile.so.0 in this environment")
    assert any(d.endswith(os.path.join("nvidia", "cu13", "lib")) or "cufile" in d for d in dirs), dirs


@needs_gpu
@pytest.mark.parametrize("cipher", [False, True])
def test_gpu_loads_match_cpu_loads(tmp, cipher, monkeypatch):
    path, tensors = sample(tmp, n=1 << 16)
    if cipher:
        monkeypatch.setenv("VETURBOIO_KEY", base64.b64encode(b"abcdefgh12345678").decode())
        monkeypatch.setenv("VETURBOIO_IV", base64.b64encode(b"1234567887654321").decode())
        enc = tmp / "enc.safetensors"
        turboio.save_file(tensors, str(enc), use_cipher=True)
        path = enc
    helper = turboio.init_io_helper()
    for _ in range(2):
        out = turboio.load(str(path), map_location="cuda:0", helper=helper, use_cipher=cipher)
        for k, v in tensors.items():
            assert out[k].device == torch.device("cuda", 0)
            assert same(out[k].cpu(), v), k
    assert helper.free_bytes() > 0, "pinned staging buffers kept for the next load"
    cuda = st.load_file(path, device="cuda:0") if not cipher else None
    if cuda is not None:
        for k, v in tensors.items():
            assert same(cuda[k].cpu(), v)


@needs_gpu
def test_gpu_selection_and_device_memory_plan(tmp):
    """A selected load into the GPU holds only the selection (views of one CUDA export); a load
    over `max_device_memory`, or over the device's free memory, fails before allocating."""
    path, tensors = sample(tmp, n=1 << 16)
    out = turboio.load(str(path), map_location="cuda:0", tensors=["w", "h"])
    assert set(out) == {"w", "h"}
    assert out["w"].untyped_storage().data_ptr() == out["h"].untyped_storage().data_ptr(), "one export"
    for k in out:
        assert same(out[k].cpu(), tensors[k]), k
    torch.cuda.synchronize()
    free_before, total = torch.cuda.mem_get_info(0)
    with pytest.raises(MemoryError, match=r"cuda:0 memory but max_device_memory is 1KiB"):
        turboio.load(str(path), map_location="cuda:0", max_device_memory=1024)
    free_after, _ = torch.cuda.mem_get_info(0)
    assert free_after >= free_before - (8 << 20), "nothing allocated"
    # More than the whole device has free: refused with what it has, before allocating.
    huge = tmp / "huge.safetensors"
    with open(huge, "wb") as f:
        header = ('{"x":{"dtype":"U8","shape":[%d],"data_offsets":[0,%d]}}' % (total + (1 << 30), total + (1 << 30))).encode()
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + total + (1 << 30))
    with pytest.raises(MemoryError, match=r"cuda:0 has .* free"):
        turboio.load(str(huge), map_location="cuda:0")


@needs_gpu
def test_gpu_dlpack_is_zero_copy_and_freed_with_the_last_view(tmp):
    path, tensors = sample(tmp, n=1 << 18)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info(0)
    loaded = _turboio.load(str(path), device="cuda:0")
    pt = loaded.tensors()[0]
    name = pt.name
    assert pt.__dlpack_device__() == (2, 0)
    a = torch.from_dlpack(pt)
    b = torch.from_dlpack(pt)
    assert a.data_ptr() == b.data_ptr(), "zero copy"
    assert a.data_ptr() % 16 == 0
    del loaded, pt
    assert same(a.cpu(), tensors[name]), "the view outlives the load object"
    free_mid, _ = torch.cuda.mem_get_info(0)
    assert free_mid < free_before
    del a, b
    import gc

    gc.collect()
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info(0)
    assert free_after >= free_before - (8 << 20)


@needs_gpu
def test_freeing_a_load_leaves_the_threads_current_context(tmp):
    """The DLPack deleter frees device memory on whichever thread drops the last tensor: that
    thread's current CUDA context must be the same afterwards (torch relies on it; with two
    GPUs, freeing the last cuda:1 tensor used to leave device 1 current)."""
    import ctypes
    import gc

    cuda = ctypes.CDLL("libcuda.so.1")
    current = lambda: (lambda c: (cuda.cuCtxGetCurrent(ctypes.byref(c)), c.value)[1])(ctypes.c_void_p())  # noqa: E731
    path, tensors = sample(tmp, n=1 << 12)
    sd = turboio.load(str(path), map_location="cuda:0")
    torch.cuda.synchronize()
    assert cuda.cuCtxSetCurrent(None) == 0
    assert current() is None
    del sd
    gc.collect()
    assert current() is None, "freeing the load made a context current on this thread"


@needs_gpu
def test_pt_loads_to_a_gpu_keep_tied_weights_shared(tmp):
    w = torch.randn(64, 32)
    torch.save({"emb": w, "head": w, "wt": w.t()}, tmp / "tied.pt")
    ref = torch.load(tmp / "tied.pt", map_location="cuda:0", weights_only=True)
    got = turboio.load(str(tmp / "tied.pt"), map_location="cuda:0")
    assert got["emb"].device == torch.device("cuda:0")
    assert got["emb"].data_ptr() == got["head"].data_ptr() == got["wt"].data_ptr()
    assert ref["emb"].data_ptr() == ref["head"].data_ptr()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    # The device-memory plan: the storages' 8 KiB (once: tied) against a budget.
    with pytest.raises(MemoryError, match=r"tied\.pt: this load needs .* of cuda:0 memory but max_device_memory is"):
        turboio.load(str(tmp / "tied.pt"), map_location="cuda:0", max_device_memory=4096)
    assert len(turboio.load(str(tmp / "tied.pt"), map_location="cuda:0", max_device_memory=8192)) == 3


@needs_gpu
def test_cuda_tensors_save_byte_identical(tmp):
    import safetensors.torch

    tensors = {"w": torch.randn(300, 7), "h": torch.randn(5, 5).to(torch.bfloat16), "e": torch.empty(0)}
    ref = tmp / "ref.safetensors"
    safetensors.torch.save_file(tensors, str(ref))
    cuda = {k: v.to("cuda:0") for k, v in tensors.items()}
    out = tmp / "out.safetensors"
    st.save_file(cuda, out)
    assert out.read_bytes() == ref.read_bytes()
    turboio.save_file(cuda, str(tmp / "ve.safetensors"))
    assert (tmp / "ve.safetensors").read_bytes() == ref.read_bytes()


@needs_gpu
@pytest.mark.parametrize("nogds", [True, False])
def test_fastsafetensors_on_cuda(tmp, nogds):
    path, tensors = sample(tmp)
    loader = SafeTensorsFileLoader(SingleGroup(), device="cuda:0", nogds=nogds)
    loader.add_filenames({0: [str(path)]})
    fb = loader.copy_files_to_device()
    for k, v in tensors.items():
        t = fb.get_tensor(k)
        assert t.device == torch.device("cuda", 0)
        assert same(t.cpu(), v)
    with fastsafe_open([str(path)], device="cuda:0", nogds=nogds) as f:
        assert same(f.get_tensor("w").cpu(), tensors["w"])
    with st.safe_open(path, framework="pt", device="cuda:0") as f:
        assert f.get_tensor("w").device.type == "cuda"
        assert same(f.get_slice("w")[:10].cpu(), tensors["w"][:10])


def test_staging_pools_can_be_sized_and_released():
    with pytest.raises(ValueError, match="stages nothing"):
        turboio.staging_pool("cpu")
    if not GPU:
        with pytest.raises(RuntimeError) as e:
            turboio.staging_pool("cuda:0")
        assert_missing_gpu(e)
    pool = _turboio.StagingPool()
    assert pool.max_buffers == 64, "room for 16 readers of 4 slots"
    pool.set_max_buffers(3)
    assert pool.max_buffers == 3
    assert (pool.free_bytes(), pool.live_bytes(), pool.allocations()) == (0, 0, 0)
    pool.release()
    assert "max_buffers=3" in repr(pool)
    helper = turboio.init_io_helper()
    assert helper.free_bytes() >= 0
    helper.clear()


@needs_gpu
def test_gpu_loads_in_a_process_share_one_pinned_pool(tmp):
    """Every load to a GPU takes its slots from the device's process pool, with or without a
    helper: the first load pins them, every later one pins nothing."""
    path, tensors = sample(tmp, n=1 << 17)
    pool = turboio.staging_pool("cuda:0")
    turboio.load(str(path), map_location="cuda:0")
    pinned = pool.allocations()
    assert pinned > 0 and pool.live_bytes() > 0
    for helper in (None, turboio.init_io_helper()):
        out = turboio.load(str(path), map_location="cuda:0", helper=helper)
        assert same(out["w"].cpu(), tensors["w"])
    st.load_file(path, device="cuda:0")
    assert pool.allocations() == pinned, "a steady-state load pins nothing"
    assert turboio.staging_pool("cuda:0").allocations() == pinned, "one pool per device and process"
    pool.release()
    assert pool.free_bytes() == 0
