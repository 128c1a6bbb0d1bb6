"""turboio.deepnvme: DeepSpeed DeepNVMe's handle API on turboio.

Side by side with DeepSpeed's own handle (`deepnvme_cases.py`, when DeepSpeed's async_io op is
available: `cargo xtask test --deepspeed`), and on its own against plain Python file I/O for
what DeepSpeed's handle gets wrong or cannot do (unaligned offsets and lengths, any buffer,
errors that are raised instead of asserted)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from turboio.deepnvme import AsyncIOBuilder, GDSBuilder

HERE = pathlib.Path(__file__).resolve().parent


def pattern(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def handle(**kw):
    return AsyncIOBuilder().load().aio_handle(**kw)


def run_cases(impl, directory, env):
    r = subprocess.run(
        [sys.executable, str(HERE / "deepnvme_cases.py"), "--impl", impl, "--dir", str(directory)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, f"{impl}: exit {r.returncode}\n{r.stderr[-3000:]}"
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{impl}: no result line\n{r.stdout[-2000:]}"
    return json.loads(lines[-1])


def test_same_results_as_deepspeed(tmp):
    site = os.environ.get("TURBOIO_DEEPSPEED_SITE")
    if not site:
        pytest.skip("DeepSpeed's async_io op is not set up (cargo xtask test --deepspeed)")
    (tmp / "ds").mkdir()
    (tmp / "turboio").mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = site
    env.setdefault("DS_ACCELERATOR", "cpu")
    theirs = run_cases("deepspeed", tmp / "ds", env)
    ours = run_cases("turboio", tmp / "turboio", dict(os.environ))
    assert sorted(ours) == sorted(theirs)
    differ = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    assert not differ, f"turboio vs DeepSpeed: {differ}"
    assert len(ours) >= 25


def test_the_cases_without_deepspeed(tmp):
    """The side-by-side script on turboio alone, checked against what the cases must give."""
    out = run_cases("turboio", tmp, dict(os.environ))
    assert out["defaults"] == [1 << 20, 128, False, False, 1, 512]
    assert out["custom"] == [65536, 8, True, True, 4, 2048]
    assert out["locked"][4] == 0 and out["locked"][5:] == [True, False]
    for k in ("pwrite_new", "pwrite_inside", "pwrite_across", "pwrite_past_end", "pread_4k", "iop4_write", "iop4_read"):
        assert out[k][0] == 1, k
    assert out["async_pread"][:2] == [[0, 0, 0], 3]
    assert out["async_pwrite"][:2] == [[0, 0], 2]
    assert out["read_whole"][0] == 0 and out["write_form"][0] == 0
    assert out["pwrite_past_end"][1][0] == 4 << 20
    assert out["pwrite_mode"] == oct(0o600 & ~_umask())
    for k in ("read_missing", "async_read_missing", "write_missing_dir", "iop_indivisible_read", "iop_indivisible_write"):
        assert out[k] == -1, k
    assert out["w8_exists"] is False
    assert out["free"] == [True, False]


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


@pytest.mark.parametrize("intra, block, depth", [(1, 65536, 128), (3, 65536, 128), (1, 12288, 1), (2, 4096, 100_000)])
def test_any_offset_and_length_in_place(tmp, intra, block, depth):
    """Writes at offsets and lengths off the block grid keep every other byte of the file, reads
    give the file's bytes, into buffers of any alignment and dtype, whatever the handle's block
    size and queue depth (the reads keep that many blocks in flight)."""
    h = handle(intra_op_parallelism=intra, block_size=block, queue_depth=depth)
    path = tmp / "x.bin"
    model = bytearray()
    cases = [(0, 4096 * 3), (3, 5001), (4093, 9000), (70_000, 3), (1 << 20, (1 << 20) + 3 * 7), (5, 0), (12, 300_000)]
    for i, (offset, n) in enumerate(cases):
        n -= n % intra
        src = pattern(n, i)
        assert h.sync_pwrite(src, path, offset) == 1
        if len(model) < offset + n:
            model.extend(bytes(offset + n - len(model)))
        model[offset : offset + n] = src.numpy().tobytes()
        assert path.read_bytes() == bytes(model), (offset, n)
    data = path.read_bytes()
    for offset, n in [(1, 3 * intra), (4095, 4098 - 4098 % intra), (12345, 777 * intra), (0, len(data) - len(data) % intra)]:
        dst = torch.zeros(n + 1, dtype=torch.uint8)[1:]  # an address off any block
        assert h.sync_pread(dst, path, offset) == 1
        assert dst.numpy().tobytes() == data[offset : offset + n]
    f32 = torch.zeros(30, dtype=torch.float32)
    assert h.sync_pread(f32[3:3 + 6 * intra], path, 7) == 1
    assert f32[3:3 + 6 * intra].numpy().tobytes() == data[7 : 7 + 24 * intra]
    assert f32[:3].eq(0).all() and f32[3 + 6 * intra:].eq(0).all()


def test_failures_are_return_values_or_clear_errors(tmp, caplog):
    h = handle()
    path = tmp / "f.bin"
    path.write_bytes(bytes(range(256)) * 64)
    buf = torch.zeros(100, dtype=torch.uint8)
    # As DeepSpeed: -1, and the reason logged with the file's name.
    assert h.sync_pread(buf, tmp / "missing.bin") == -1
    assert h.async_pread(buf, tmp / "missing.bin") == -1
    assert h.sync_pwrite(buf, tmp / "no" / "x.bin") == -1
    assert h.async_pwrite(buf, tmp / "no" / "x.bin") == -1
    assert "missing.bin" in caplog.text and "x.bin" in caplog.text
    h2 = handle(intra_op_parallelism=2)
    assert h2.sync_pread(torch.zeros(101, dtype=torch.uint8), path) == -1
    assert h2.sync_pwrite(torch.zeros(101, dtype=torch.uint8), tmp / "odd.bin") == -1
    assert not (tmp / "odd.bin").exists()
    # Where DeepSpeed's asserts end the process: exceptions naming what is wrong.
    with pytest.raises(ValueError, match=r"f\.bin: file_offset \+ buffer nbytes > file bytes: 16484 > 16384"):
        h.sync_pread(buf, path, 16384)
    with pytest.raises(RuntimeError, match="no operation is pending"):
        h.wait()
    with pytest.raises(ValueError, match="must be contiguous"):
        h.sync_pread(torch.zeros(10, 10, dtype=torch.uint8)[:, 0], path)
    with pytest.raises(TypeError, match="torch.Tensor"):
        h.sync_pread(bytearray(10), path)
    with pytest.raises(ValueError, match="negative"):
        h.sync_pwrite(buf, path, -1)
    with pytest.raises(ValueError, match="a buffer of the file's size"):
        h.read(buf, path, False)
    with pytest.raises(TypeError, match="async"):
        h.pread(buf, path, False)
    with pytest.raises(ValueError, match="intra_op_parallelism"):
        handle(intra_op_parallelism=0)
    # Nothing was written by any of these.
    assert path.read_bytes() == bytes(range(256)) * 64


def test_queued_operations_run_in_order_and_report_errors_from_wait(tmp):
    h = handle()
    path = tmp / "q.bin"
    a, b = pattern(300_000, 1), pattern(200_000, 2)
    assert h.async_pwrite(a, path) == 0
    assert h.async_pwrite(b, path, 50_001) == 0  # overlaps the first: queued after it, wins
    assert h.wait() == 2
    expected = bytearray(a.numpy().tobytes())
    expected[50_001:250_001] = b.numpy().tobytes()
    assert path.read_bytes() == bytes(expected)
    # A failure among queued operations: every one runs, then wait() raises it.
    d = tmp / "a-directory"
    d.mkdir()
    good = torch.zeros(1000, dtype=torch.uint8)
    assert h.async_pread(torch.zeros(10, dtype=torch.uint8), d) == 0
    assert h.async_pread(good, path, 7) == 0
    with pytest.raises(OSError, match="a-directory"):
        h.wait()
    assert good.numpy().tobytes() == bytes(expected[7:1007])
    # The handle is usable afterwards, and nothing is left pending.
    assert h.sync_pread(good, path) == 1
    with pytest.raises(RuntimeError):
        h.wait()
    # The descriptor form of async_pwrite (DeepSpeed's overload), positional and by keyword.
    fd = os.open(tmp / "fd.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        assert h.async_pwrite(a[:5000], fd, 3) == 0
        assert h.async_pwrite(a[:10], fd=fd, file_offset=5003) == 0
        assert h.wait() == 2
    finally:
        os.close(fd)
    assert (tmp / "fd.bin").read_bytes() == bytes(3) + a[:5000].numpy().tobytes() + a[:10].numpy().tobytes()


def test_validate_and_the_whole_file_forms(tmp):
    h = handle()
    path = tmp / "v.bin"
    src = pattern(12_345, 5)
    assert h.write(src, path, True) == 0
    dst = torch.zeros(12_345, dtype=torch.uint8)
    assert h.read(dst, path, True) == 0
    assert torch.equal(dst, src)
    assert h.pread(dst, path, True, False, 0) == 1
    assert h.pwrite(src, path, True, **{"async": True}) == 0 and h.wait() == 1


def test_locked_tensors():
    h = handle()
    t = h.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.bfloat16))
    assert t.dtype == torch.bfloat16 and t.shape == (1000,) and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    assert h.is_pinned(t) and not h.is_pinned(torch.zeros(4))
    t.fill_(1.5)
    assert h.free_cpu_locked_tensor(t) is True
    assert h.free_cpu_locked_tensor(t) is False
    assert not h.is_pinned(t)
    assert t.float().eq(1.5).all()  # the memory lives as long as the tensor
    k = h.new_cpu_locked_tensor(num_elem=3, example_tenosr=torch.empty(0, dtype=torch.int64))
    assert k.dtype == torch.int64 and k.shape == (3,)
    assert h.new_cpu_locked_tensor(0, torch.empty(0)).numel() == 0


def test_gds_handle_keeps_its_methods(tmp):
    assert GDSBuilder().is_compatible() == torch.cuda.is_available()
    g = GDSBuilder().load().gds_handle(intra_op_parallelism=1)
    path = tmp / "g.bin"
    src = pattern(10_000, 9)
    assert g.sync_pwrite(src, path) == 1
    dst = torch.zeros(10_000, dtype=torch.uint8)
    assert g.sync_pread(dst, path) == 1 and torch.equal(dst, src)
    assert g.pin_device_tensor(torch.zeros(3)) is False
    assert g.unpin_device_tensor(torch.zeros(3)) is False
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            g.new_pinned_device_tensor(10, torch.empty(0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_go_through_a_bounce_buffer(tmp):
    for h in (handle(), GDSBuilder().load().gds_handle()):
        path = tmp / "c.bin"
        src = pattern(3_000_001, 3).cuda()
        assert h.sync_pwrite(src, path, 5) == 1
        assert path.read_bytes()[5:] == src.cpu().numpy().tobytes()
        dst = torch.zeros(3_000_001, dtype=torch.uint8, device="cuda")
        assert h.sync_pread(dst, path, 5) == 1
        assert torch.equal(dst, src)
        if hasattr(h, "new_pinned_device_tensor"):
            t = h.new_pinned_device_tensor(100, torch.empty(0, dtype=torch.float16))
            assert t.is_cuda and h.pin_device_tensor(t) and h.unpin_device_tensor(t)
