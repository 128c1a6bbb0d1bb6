"""One save by one Python saver, timed, for `cargo xtask bench` (each run in its own process).

The tensors of --file are loaded and copied into ordinary process memory first (not timed),
as a training loop holds them. The timed part is the save plus, for savers that do not make
the file durable themselves, an `fsync` of the file and its directory, so every row ends with
the data on disk. Prints one JSON line: {"save_s", "blocked_s", "fsync_s"}.
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
    p.add_argument("--saver", required=True)
    p.add_argument("--file", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import safetensors.torch
    import torch

    sd = {k: v.clone() for k, v in safetensors.torch.load_file(a.file).items()}
    blocked = None
    durable_itself = a.saver.startswith("turboio")
    if a.saver == "turboio.save_file":
        import turboio

        t0 = time.perf_counter()
        turboio.save_file(sd, a.out)
    elif a.saver == "turboio.torch.save_file":
        import turboio.torch

        t0 = time.perf_counter()
        turboio.torch.save_file(sd, a.out)
    elif a.saver == "turboio.save_file(blocking=False), buffers reused":
        import turboio

        # A training loop's steady state: the process's first background save allocates the
        # snapshot buffers (4 GiB of fresh pages), the next ones reuse them. Untimed first save.
        turboio.save_file(sd, a.out, blocking=False).wait()
        t0 = time.perf_counter()
        h = turboio.save_file(sd, a.out, blocking=False)
        blocked = time.perf_counter() - t0
        h.wait()
    elif a.saver == "turboio.save_file(blocking=False), first in a new process":
        import turboio

        # The process's first background save: its snapshot buffers are fresh memory.
        t0 = time.perf_counter()
        h = turboio.save_file(sd, a.out, blocking=False)
        blocked = time.perf_counter() - t0
        h.wait()
    elif a.saver == "floor of a snapshot: copy into fresh memory (no file)":
        # What any snapshot costs in a new process: every byte copied into memory never touched
        # before (torch's intra-op threads). Not a save: nothing is written.
        t0 = time.perf_counter()
        copies = [torch.empty_like(v) for v in sd.values()]
        for c, v in zip(copies, sd.values()):
            c.copy_(v)
        t = time.perf_counter() - t0
        del copies
        print(json.dumps({"save_s": t, "blocked_s": t, "fsync_s": 0.0}))
        return
    elif a.saver == "safetensors.torch.save_file":
        t0 = time.perf_counter()
        safetensors.torch.save_file(sd, a.out)
    elif a.saver == "torch.save":
        t0 = time.perf_counter()
        torch.save(sd, a.out)
    else:
        raise SystemExit(f"unknown saver {a.saver}")
    t1 = time.perf_counter()
    if not durable_itself:
        fsync(a.out)
    t2 = time.perf_counter()
    print(json.dumps({"save_s": t2 - t0, "blocked_s": blocked if blocked is not None else t2 - t0, "fsync_s": t2 - t1}))


if __name__ == "__main__":
    main()
