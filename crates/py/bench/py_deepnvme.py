"""DeepSpeed's DeepNVMe (`aio_handle`) for `cargo xtask bench --training`: one timed operation per
process, each printing one JSON line.

  --op build                     JIT-builds the async_io op (cached in TORCH_EXTENSIONS_DIR); {"build_s"}
  --op pwrite --out F --size N   N bytes from a page-locked tensor to F with sync_pwrite, then fsync of
                                 the file and its directory (durable, as turboio's saves); F is
                                 overwritten in place if it exists (DeepNVMe opens without O_TRUNC),
                                 else created; {"s"}
  --op pread --file F            the whole of F into a page-locked tensor with sync_pread; {"s"}

The handle uses DeepSpeed's defaults (block 1 MiB, queue depth 128, one thread per op) unless
--intra-op-parallelism is given. The buffer is allocated and touched before the timer starts,
as a training loop reuses its pinned buffers. Run with DS_ACCELERATOR=cpu on a machine without
a GPU (the CPU accelerator builds the op with libaio).
"""

import argparse
import json
import os
import time


def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    d = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(d)
    finally:
        os.close(d)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", required=True, choices=["build", "pwrite", "pread"])
    p.add_argument("--out")
    p.add_argument("--file")
    p.add_argument("--size", type=int)
    p.add_argument("--intra-op-parallelism", type=int, default=1)
    a = p.parse_args()
    t0 = time.perf_counter()
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    aio = AsyncIOBuilder().load(verbose=False)
    if a.op == "build":
        print(json.dumps({"build_s": time.perf_counter() - t0}))
        return
    h = aio.aio_handle(1 << 20, 128, False, False, a.intra_op_parallelism)
    example = torch.empty(0, dtype=torch.uint8)
    if a.op == "pwrite":
        buf = h.new_cpu_locked_tensor(a.size, example)
        buf.fill_(7)
        t = time.perf_counter()
        n = h.sync_pwrite(buf, a.out)
        fsync(a.out)
        s = time.perf_counter() - t
        h.free_cpu_locked_tensor(buf)
    else:
        size = os.path.getsize(a.file)
        buf = h.new_cpu_locked_tensor(size, example)
        buf.zero_()
        t = time.perf_counter()
        n = h.sync_pread(buf, a.file)
        s = time.perf_counter() - t
        h.free_cpu_locked_tensor(buf)
    if n != 1:
        raise SystemExit(f"DeepNVMe {a.op} returned {n}")
    print(json.dumps({"s": s}))


if __name__ == "__main__":
    main()
