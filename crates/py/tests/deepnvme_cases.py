"""The side-by-side cases of DeepNVMe's handle API, run once with DeepSpeed's op and once with
turboio's, each in a process of its own; prints one JSON object of what each case returned and
the SHA-256 of every buffer and file it produced.

    python deepnvme_cases.py --impl deepspeed|turboio --dir DIR

Only cases DeepSpeed's handle itself gets right: page-locked buffers from the handle, offsets
and sizes on 4096-byte blocks (its O_DIRECT writes and reads silently do nothing off the block
grid), no read past the end of a file and no wait() with nothing pending (its asserts end the
process). turboio's behaviour beyond these is tested in test_deepnvme.py.
"""

import argparse
import hashlib
import json
import os

import torch


def sha(b) -> str:
    if isinstance(b, torch.Tensor):
        b = b.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(b).hexdigest()[:16]


def pattern(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", required=True, choices=["deepspeed", "turboio"])
    p.add_argument("--dir", required=True)
    a = p.parse_args()
    if a.impl == "deepspeed":
        from deepspeed.ops.op_builder import AsyncIOBuilder
    else:
        from turboio.deepnvme import AsyncIOBuilder
    aio = AsyncIOBuilder().load(verbose=False)
    d = a.dir
    out = {}

    def file_state(path):
        with open(path, "rb") as f:
            data = f.read()
        return [len(data), sha(data)]

    h = aio.aio_handle()
    out["defaults"] = [h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
                       h.get_intra_op_parallelism(), h.get_alignment()]
    h2 = aio.aio_handle(block_size=65536, queue_depth=8, single_submit=True, overlap_events=True, intra_op_parallelism=4)
    out["custom"] = [h2.get_block_size(), h2.get_queue_depth(), h2.get_single_submit(), h2.get_overlap_events(),
                     h2.get_intra_op_parallelism(), h2.get_alignment()]

    example = torch.empty(0, dtype=torch.uint8)
    buf = h.new_cpu_locked_tensor(4 << 20, example)
    f16 = h.new_cpu_locked_tensor(num_elem=1000, example_tenosr=torch.empty(0, dtype=torch.float16))
    out["locked"] = [str(buf.dtype), list(buf.shape), str(f16.dtype), list(f16.shape), buf.data_ptr() % 4096,
                     h.is_pinned(buf), h.is_pinned(torch.zeros(3))]

    # Writes: a new file, in place inside it, and past its end.
    path = os.path.join(d, "data.bin")
    buf.copy_(pattern(4 << 20, 1))
    out["pwrite_new"] = [h.sync_pwrite(buf[: 1 << 20], path), file_state(path)]
    out["pwrite_mode"] = oct(os.stat(path).st_mode & 0o777)
    buf.copy_(pattern(4 << 20, 2))
    out["pwrite_inside"] = [h.sync_pwrite(buf[:4096], path, 8192), file_state(path)]
    out["pwrite_across"] = [h.sync_pwrite(buf[: 3 * 4096], path, 4096), file_state(path)]
    out["pwrite_past_end"] = [h.sync_pwrite(buf[: 2 << 20], path, 2 << 20), file_state(path)]

    # Reads, at offsets and whole.
    for name, n, off in [("pread_4k", 4096, 4096), ("pread_64k", 65536, 0), ("pread_mid", 1 << 20, 3 << 20)]:
        dst = h.new_cpu_locked_tensor(n, example)
        dst.zero_()
        out[name] = [h.sync_pread(dst, path, off), sha(dst)]
    whole = h.new_cpu_locked_tensor(os.path.getsize(path), example)
    out["read_whole"] = [h.read(whole, path, False), sha(whole)]
    out["pread_kw"] = [h.sync_pread(buffer=whole[:4096], filename=path, file_offset=4096), sha(whole[:4096])]

    # Queued operations: return values, then wait(), then the bytes.
    x = [h.new_cpu_locked_tensor(8192, example) for _ in range(3)]
    q = [h.async_pread(x[0], path, 0), h.async_pread(x[1], path, 8192), h.async_pread(x[2], path, 1 << 20)]
    out["async_pread"] = [q, h.wait(), [sha(t) for t in x]]
    buf.copy_(pattern(4 << 20, 3))
    p2, p3 = os.path.join(d, "w2.bin"), os.path.join(d, "w3.bin")
    q = [h.async_pwrite(buf[:8192], p2), h.async_pwrite(buf[8192:12288], p3, 4096)]
    out["async_pwrite"] = [q, h.wait(), file_state(p2), file_state(p3)]
    out["pread_async_form"] = [h.pread(x[0], path, False, True, 4096), h.wait(), sha(x[0])]
    out["pread_sync_form"] = [h.pread(x[1], path, False, False, 0), sha(x[1])]
    p4 = os.path.join(d, "w4.bin")
    out["pwrite_sync_form"] = [h.pwrite(buf[:4096], p4, False, False, 0), file_state(p4)]
    p5 = os.path.join(d, "w5.bin")
    out["write_form"] = [h.write(buf[:8192], p5, False), file_state(p5)]
    p6 = os.path.join(d, "w6.bin")
    fd = os.open(p6, os.O_CREAT | os.O_WRONLY, 0o644)
    out["async_pwrite_fd"] = [h.async_pwrite(buf[:4096], fd, 0), h.wait(), file_state(p6)]
    os.close(fd)

    # Several threads per operation.
    h4 = aio.aio_handle(intra_op_parallelism=4)
    big = h4.new_cpu_locked_tensor(2 << 20, example)
    big.copy_(pattern(2 << 20, 4))
    p7 = os.path.join(d, "w7.bin")
    out["iop4_write"] = [h4.sync_pwrite(big, p7), file_state(p7)]
    big.zero_()
    out["iop4_read"] = [h4.sync_pread(big[: 1 << 20], p7, 1 << 20), sha(big[: 1 << 20])]

    # The failures DeepSpeed answers with -1.
    out["read_missing"] = h.sync_pread(x[0], os.path.join(d, "missing.bin"))
    out["async_read_missing"] = h.async_pread(x[0], os.path.join(d, "missing.bin"))
    out["write_missing_dir"] = h.sync_pwrite(x[0], os.path.join(d, "no", "x.bin"))
    h2p = aio.aio_handle(intra_op_parallelism=2)
    odd = h2p.new_cpu_locked_tensor(4097, example)
    out["iop_indivisible_read"] = h2p.sync_pread(odd, path)
    out["iop_indivisible_write"] = h2p.sync_pwrite(odd, os.path.join(d, "w8.bin"))
    out["w8_exists"] = os.path.exists(os.path.join(d, "w8.bin"))

    out["free"] = [h.free_cpu_locked_tensor(f16), h.free_cpu_locked_tensor(torch.zeros(3))]
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
