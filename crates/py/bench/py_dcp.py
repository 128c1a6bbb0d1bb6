"""One timed torch.distributed.checkpoint operation from 2 gloo ranks (spawned processes) for
`cargo xtask bench --training`, printing one JSON line.

  --op save  --writer turboio|dcp [--threads N] --dir D --size BYTES
        dcp.save of a state dict of BYTES in all (16 float32 tensors per rank plus a few
        non-tensor items), from the first barrier to the last; durable for both writers (each
        fsyncs its data and metadata files); {"s"}
  --op async --writer ...   dcp.async_save: the time the caller was blocked (until the call
        returned) and the time until the future completed; {"s", "blocked_s"}
  --op load  --reader turboio|dcp --dir D --size BYTES
        dcp.load into a state dict allocated and touched before the timer, the checkpoint's
        files evicted from the page cache first (cold); {"s"}
"""

import argparse
import json
import os
import tempfile
import time
import warnings


def state_dict(rank, world, size, fill):
    import torch

    per_rank = size // world
    n = 16
    numel = per_rank // 4 // n
    sd = {f"layer{i}.rank{rank}": torch.full((numel,), float(fill + i), dtype=torch.float32) for i in range(n)}
    sd[f"step.rank{rank}"] = 100
    sd[f"config.rank{rank}"] = {"lr": 1e-4, "betas": [0.9, 0.95]}
    return sd


def evict(directory):
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def worker(rank, world, a, init, out):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    if a.op == "load":
        sd = state_dict(rank, world, a.size, 0)  # allocated and touched (filled) before the timer
        if rank == 0:
            evict(a.dir)
        dist.barrier()
        if a.reader == "turboio":
            from turboio.dcp import FileSystemReader
        else:
            from torch.distributed.checkpoint import FileSystemReader
        t = time.perf_counter()
        dcp.load(sd, storage_reader=FileSystemReader(a.dir))
        dist.barrier()
        s = time.perf_counter() - t
        expect = float(1 + 3)
        assert float(sd[f"layer3.rank{rank}"][-1]) == expect, "loaded the wrong bytes"
        result = {"s": s}
    else:
        sd = state_dict(rank, world, a.size, 1)
        if a.writer == "turboio":
            from turboio.dcp import FileSystemWriter
        else:
            from torch.distributed.checkpoint import FileSystemWriter
        writer = FileSystemWriter(a.dir, thread_count=a.threads)
        dist.barrier()
        t = time.perf_counter()
        if a.op == "async":
            fut = dcp.async_save(sd, storage_writer=writer)
            blocked = time.perf_counter() - t
            fut.result()
        else:
            dcp.save(sd, storage_writer=writer)
            blocked = None
        dist.barrier()
        s = time.perf_counter() - t
        result = {"s": s}
        if blocked is not None:
            result["blocked_s"] = blocked
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", required=True, choices=["save", "async", "load"])
    p.add_argument("--writer", choices=["turboio", "dcp"], default="dcp")
    p.add_argument("--reader", choices=["turboio", "dcp"], default="dcp")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dir", required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    a = p.parse_args()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(a.world, a, os.path.join(tmp, "init"), out), nprocs=a.world, join=True)
        with open(out) as f:
            print(f.read())


if __name__ == "__main__":
    main()
