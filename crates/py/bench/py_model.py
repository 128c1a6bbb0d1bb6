"""One load of a whole sharded model by one loader, timed, for `cargo xtask bench --model`
(each run in its own process). Prints one JSON line: {"load_s", "touch_s", "tensors"} (and
"bytes_read" per rank for the distributed rows). "touch" reads one byte of every 4 KiB page of
every tensor after the load, when lazily mapped loaders actually read the file.

Loaders: "turboio.load_model (one job)", "turboio.load, file after file",
"safetensors.torch.load_file, looped", "fastsafetensors, all files", and
"gloo 2 ranks: direct" / "gloo 2 ranks: collectives" (two processes, each rank gets its dim-0
block of every tensor through turboio's fastsafetensors API).
"""

import argparse
import glob
import json
import os
import time

from py_load import touch  # one byte of every 4 KiB page of every CPU tensor


def shards(d):
    index = os.path.join(d, "model.safetensors.index.json")
    with open(index) as f:
        wm = json.load(f)["weight_map"]
    return [os.path.join(d, s) for s in dict.fromkeys(wm.values())]


def rank_main(rank, world, d, mode, out):
    import torch.distributed as dist

    from turboio.fastsafetensors import SafeTensorsFileLoader

    dist.init_process_group("gloo", init_method=f"file://{out}.init", rank=rank, world_size=world)
    files = shards(d)
    dist.barrier()
    t0 = time.perf_counter()
    loader = SafeTensorsFileLoader(dist.group.WORLD, "cpu", shard_mode=mode)
    loader.add_filenames({r: files[r::world] for r in range(world)})
    fb = loader.copy_files_to_device()
    got = [fb.get_sharded(k, 0) for k in loader.get_keys()]
    t1 = time.perf_counter()
    touch(got)
    t2 = time.perf_counter()
    dist.barrier()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"load_s": t1 - t0, "touch_s": t2 - t1, "bytes_read": fb.bytes_read, "tensors": len(got)}, f)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--loader", required=True)
    p.add_argument("--dir", required=True)
    a = p.parse_args()
    import torch  # noqa: F401  (imported before timing: every loader needs it)

    files = shards(a.dir)
    if a.loader.startswith("gloo 2 ranks: "):
        import tempfile

        import torch.multiprocessing as mp

        mode = a.loader.split(": ")[1]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r")
            mp.spawn(rank_main, args=(2, a.dir, mode, out), nprocs=2, join=True)
            rs = [json.load(open(f"{out}.{r}")) for r in range(2)]
        print(json.dumps({
            "load_s": max(r["load_s"] for r in rs),
            "touch_s": max(r["touch_s"] for r in rs),
            "tensors": rs[0]["tensors"],
            "bytes_read": [r["bytes_read"] for r in rs],
        }))
        return
    if a.loader.startswith("turboio"):
        import turboio
    elif a.loader.startswith("safetensors"):
        import safetensors.torch
    elif a.loader.startswith("fastsafetensors"):
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    t0 = time.perf_counter()
    if a.loader == "turboio.load_model (one job)":
        sd = turboio.load_model(a.dir)
    elif a.loader == "turboio.load, file after file":
        sd = {}
        for f in files:
            sd.update(turboio.load(f))
    elif a.loader == "safetensors.torch.load_file, looped":
        sd = {}
        for f in files:
            sd.update(safetensors.torch.load_file(f))
    elif a.loader == "fastsafetensors, all files":
        loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
        loader.add_filenames({0: files})
        fb = loader.copy_files_to_device()
        sd = {k: fb.get_tensor(k) for k in loader.get_keys()}
    else:
        raise SystemExit(f"unknown loader {a.loader}")
    t1 = time.perf_counter()
    touch(sd.values())
    t2 = time.perf_counter()
    print(json.dumps({"load_s": t1 - t0, "touch_s": t2 - t1, "tensors": len(sd)}))


if __name__ == "__main__":
    main()
