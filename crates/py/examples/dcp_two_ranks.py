"""torch.distributed.checkpoint on turboio, from 2 ranks (gloo on the CPU; NCCL ranks work the
same, with a CPU backend in the group for async_save: "cpu:gloo,cuda:nccl").

    python crates/py/examples/dcp_two_ranks.py /tmp/ckpt

Each rank holds half of a model's tensors (DTensors sharded over a 2-rank mesh); the script
saves them, saves again in the background with async_save while "training" goes on, then loads
the checkpoint back into fresh tensors and checks them.
"""

import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from turboio.dcp import FileSystemReader, FileSystemWriter


def model(step):
    g = torch.Generator().manual_seed(step)
    return {"embed": torch.randn(1024, 256, generator=g), "head": torch.randn(256, 1000, generator=g)}


def rank_main(rank, world, path, init):
    warnings.simplefilter("ignore")  # DCP warns that it overwrites the first save
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))

    def state(step):
        sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in model(step).items()}
        sd["step"] = step
        return sd

    # A blocking save: when it returns, every rank's data and the metadata are durable.
    dcp.save(state(1), storage_writer=FileSystemWriter(path))
    # A background save: the state dict is copied to memory of its own, then written while the
    # caller goes on; the previous checkpoint stays loadable until this one is committed.
    future = dcp.async_save(state(2), storage_writer=FileSystemWriter(path))
    # ... training steps would run here ...
    future.result()

    target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in model(0).items()}
    target["step"] = 0
    dcp.load(target, storage_reader=FileSystemReader(path))
    want = state(2)
    assert target["step"] == 2
    for k in ("embed", "head"):
        assert torch.equal(target[k].to_local(), want[k].to_local()), k
    if rank == 0:
        print(f"saved twice and loaded step {target['step']} from {path}: {sorted(os.listdir(path))}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="turboio-dcp-")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(2, path, os.path.join(tmp, "init")), nprocs=2, join=True)
