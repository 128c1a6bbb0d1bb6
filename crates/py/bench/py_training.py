"""One timed operation per process for `cargo xtask bench --training`, printing one JSON line:
DeepSpeed's DeepNVMe (`aio_handle`), and turboio reading into tensors the caller already has.

  --op build                     JIT-builds the async_io op (cached in TORCH_EXTENSIONS_DIR); {"build_s"}
  --op pwrite --out F --size N   N bytes from a page-locked tensor to F with sync_pwrite, then fsync of
                                 the file and its directory (durable, as turboio's saves); F is
                                 overwritten in place if it exists (DeepNVMe opens without O_TRUNC),
                                 else created; {"s"}
  --op pread --file F            the whole of F into a page-locked tensor with sync_pread; {"s"}
  --op turboio-into --file F     turboio.load(F, state_dict=..., use_direct_io=True) into tensors of
                                 the file's shapes allocated and touched before the timer; {"s"}
  --impl turboio                 pwrite and pread through turboio.deepnvme's aio_handle (the same
                                 calls, DeepSpeed's import swapped for turboio's)
  --impl python                  pwrite and pread as DeepNVMe's py_store_cpu_tensor.py and
                                 py_load_cpu_tensor.py do: f.write(tensor.numpy()) to a new file
                                 (plus the same fsyncs), torch.frombuffer(f.read())

The handle uses DeepSpeed's defaults (block 1 MiB, queue depth 128, one thread per op) unless
--intra-op-parallelism is given. The buffer is allocated and touched before the timer starts,
as a training loop reuses its pinned buffers. Run with DS_ACCELERATOR=cpu on a machine without
a GPU (the CPU accelerator builds the op with libaio).
"""

import argparse
import json
import os
import time

from py_save import fsync  # the same fsync of the file and its directory as the save rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", required=True, choices=["build", "pwrite", "pread", "turboio-into"])
    p.add_argument("--out")
    p.add_argument("--file")
    p.add_argument("--size", type=int)
    p.add_argument("--intra-op-parallelism", type=int, default=1)
    p.add_argument("--impl", choices=["deepspeed", "turboio", "python"], default="deepspeed")
    a = p.parse_args()
    t0 = time.perf_counter()
    import torch

    if a.impl == "python":
        if a.op == "pwrite":
            buf = torch.full((a.size,), 7, dtype=torch.uint8)
            t = time.perf_counter()
            with open(a.out, "wb") as f:
                f.write(buf.numpy())
            fsync(a.out)
            s = time.perf_counter() - t
        else:
            t = time.perf_counter()
            with open(a.file, "rb") as f:
                buf = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
            s = time.perf_counter() - t
        print(json.dumps({"s": s}))
        return

    if a.op == "turboio-into":
        import safetensors
        import turboio

        # The bench's file holds uint8 tensors; ones() touches every page before the timer.
        with safetensors.safe_open(a.file, "pt") as f:
            sd = {k: torch.ones(f.get_slice(k).get_shape(), dtype=torch.uint8) for k in f.keys()}
        t = time.perf_counter()
        turboio.load(a.file, state_dict=sd, use_direct_io=True)
        print(json.dumps({"s": time.perf_counter() - t}))
        return
    if a.impl == "turboio":
        from turboio.deepnvme import AsyncIOBuilder
    else:
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
