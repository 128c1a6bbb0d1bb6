"""Per-tensor cost and tensor selection, for `cargo xtask bench --tensors`.

    py_tensors.py files --dir D --size BYTES
        writes (once) `tensors-5000-SIZE.safetensors`, `tensors-510-SIZE.safetensors` and a
        `torch.save` copy of the 510-tensor file; prints their paths as JSON.
    py_tensors.py load --file F [--pt P] --runs N [--cold]
        times each loader N times in this process, in a shuffled order each round (the file
        evicted from the page cache before each run with --cold), the load alone and the load
        plus a first read of every page of its result; prints
        {"load": {loader: [seconds]}, "total": {loader: [seconds]}}.
    py_tensors.py subset --model DIR --runs N
        cold loads of the whole model and of every 10th tensor (by name) with
        `turboio.load_model`, alternating; prints {"whole": {...}, "subset": {...}} with
        seconds, bytes read from the block device and bytes of the tensors.

    py_tensors.py gaps --dir D --runs N
        where coalescing selected ranges pays: for each gap G in 16 KiB, 64 KiB, 256 KiB and 1 MiB,
        a file of 256 pairs (a 64 KiB tensor to keep, then G bytes to skip) written once, and
        cold loads of the kept tensors with every range read on its own
        (TURBOIO_COALESCE_GAP=0), with all of them read as one (16 MiB) and with the default,
        alternating; prints {G: {"separate"|"merged"|"default": {"seconds": [...],
        "disk_bytes": [...]}}, "kept_bytes": n}.

Loaders: "turboio.load" (tensors as views of one export), "safetensors.torch.load_file",
"turboio without tensors: its populated mapping, header parsed" (`turboio._turboio.load`: the same
mapped load, without making torch tensors), "ceiling: mmap + MADV_POPULATE_READ, 1 thread, no header, no tensor"
(Python's mmap), and, with --pt, "turboio.load of the .pt copy". Every loader's result is
dropped before the next runs; "hot" means the file is in the page cache (read once first).
"""

import argparse
import gc
import json
import mmap
import os
import random
import time


def gen(path, n, size, seed):
    """`n` tensors of mixed dtypes (F32, BF16, F16, I64) and sizes, about `size` bytes."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    per = max(64, size // n)
    out = {}
    for i in range(n):
        dt = [torch.float32, torch.bfloat16, torch.float16, torch.int64][i % 4]
        el = torch.tensor([], dtype=dt).element_size()
        # Sizes from a half to one and a half of the mean, rows of 64 elements.
        numel = max(64, int(per * (0.5 + (i * 7919 % 1000) / 1000) / el) // 64 * 64)
        shape = (numel // 64, 64)
        if dt == torch.int64:
            t = torch.randint(0, 1 << 30, shape, generator=g, dtype=torch.int64)
        else:
            t = torch.randn(shape, generator=g).to(dt)
        out[f"model.layers.{i // 10}.block.{i % 10}.weight"] = t
    tmp = f"{path}.tmp"
    save_file(out, tmp)
    os.replace(tmp, path)
    return out


def files(d, size):
    import torch

    os.makedirs(d, exist_ok=True)
    label = f"{size >> 20}MiB"
    paths = {}
    for n in (5000, 510):
        p = os.path.join(d, f"tensors-{n}-{label}.safetensors")
        if not os.path.exists(p):
            print(f"generating {p} ...", flush=True)
            sd = gen(p, n, size, n)
            if n == 510:
                torch.save(sd, os.path.join(d, f"tensors-{n}-{label}.pt"))
        paths[n] = p
    paths["pt"] = os.path.join(d, f"tensors-510-{label}.pt")
    print(json.dumps({str(k): v for k, v in paths.items()}))


def evict(*paths):
    """Drops these files' pages from the page cache (POSIX_FADV_DONTNEED), and only theirs: a
    global drop_caches would also evict this process's libraries (torch's are hundreds of MB),
    whose pages the next load would then fault back in from the disk and count as its own."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(path):
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass


def populate_ceiling(path):
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    advice = getattr(mmap, "MADV_POPULATE_READ", 22)
    m.madvise(advice)
    return m


FLOOR = "floor: one torch.as_strided view per tensor of memory already loaded (no I/O)"


def touch(out):
    """Reads one byte of every 4 KiB page of what a loader returned: what the first use of the
    tensors costs on top of the load (the reads and page faults a lazily mapped result defers),
    as the main bench's "total" column does. The tensors' byte ranges are merged first, so the
    reads cost the same per page whoever made the tensors."""
    import ctypes

    import numpy as np
    import torch

    if isinstance(out, mmap.mmap):
        return int(np.frombuffer(out, dtype=np.uint8)[::4096].sum())
    if hasattr(out, "export"):  # turboio's LoadedFile: its one export
        out = [torch.from_dlpack(out.export()[0])]
    tensors = out.values() if isinstance(out, dict) else out
    spans = sorted((t.data_ptr(), t.nbytes) for t in tensors)
    merged = []
    for at, n in spans:
        if merged and at <= merged[-1][1] + 4096:
            merged[-1][1] = max(merged[-1][1], at + n)
        else:
            merged.append([at, at + n])
    total = 0
    for start, end in merged:
        start -= start % 4096
        view = np.ctypeslib.as_array((ctypes.c_uint8 * (end - start)).from_address(start))
        total += int(view[::4096].sum())
    return total


def load_runs(path, pt, runs, cold):
    import safetensors.torch
    import torch

    import turboio
    import turboio._torch
    from turboio import _turboio

    loaders = {
        "turboio.load": lambda: turboio.load(path),
        "safetensors.torch.load_file": lambda: safetensors.torch.load_file(path),
        "turboio without tensors: its populated mapping, header parsed": lambda: _turboio.load(path),
        "ceiling: mmap + MADV_POPULATE_READ, 1 thread, no header, no tensor": lambda: populate_ceiling(path),
    }
    # The floor of any loader that returns torch tensors: one view per tensor of memory already
    # loaded (torch.as_strided of a typed view, the arguments computed beforehand), no I/O, no
    # header. Hot, nothing can build the tensors for less.
    # Copied, not mapped: a mapping held for the whole run would keep the file's pages from
    # being evicted before the cold runs.
    held = _turboio.load(path, mode="copied")
    data, _dtypes = held.export()
    base = torch.from_dlpack(data)
    views, args = {}, []
    for name, dt, shape, begin, _end in held.infos():
        td = turboio._torch._viewable(dt)[0]
        if td is None:
            continue
        size = td.itemsize
        if dt not in views:
            views[dt] = base[: base.numel() - base.numel() % size].view(td)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        off = begin // size
        args.append((views[dt], tuple(shape), tuple(strides), off))
    as_strided = torch.as_strided
    loaders[FLOOR] = lambda: [as_strided(b, sh, st, o) for b, sh, st, o in args]
    files = {name: path for name in loaders}
    if pt:
        loaders["turboio.load of the .pt copy"] = lambda: turboio.load(pt)
        files["turboio.load of the .pt copy"] = pt
    times = {name: [] for name in loaders}
    totals = {name: [] for name in loaders}
    names = list(loaders)
    # A first, untimed round: imports, first-touch of code paths.
    for name in names:
        touch(loaders[name]())
    rng = random.Random(1)
    gc.disable()
    for _ in range(runs):
        rng.shuffle(names)
        for name in names:
            if cold:
                evict(files[name])
            else:
                warm(files[name])
            gc.collect()
            t = time.perf_counter()
            out = loaders[name]()
            loaded = time.perf_counter()
            touch(out)
            done = time.perf_counter()
            times[name].append(loaded - t)
            totals[name].append(done - t)
            del out
    print(json.dumps({"load": times, "total": totals}))


def disk_read(path):
    """Bytes read so far from the block device holding `path` (None where unknown)."""
    dev = os.stat(path).st_dev
    try:
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
            return int(f.read().split()[2]) * 512
    except OSError:
        return None


def subset_runs(d, runs):
    import turboio
    from turboio import _turboio

    index = os.path.join(d, "model.safetensors.index.json")
    with open(index) as f:
        names = sorted(json.load(f)["weight_map"])
    chosen = set(names[::10])
    sizes = {}
    shards = _turboio._model_files(d)[1]
    for shard in shards:
        for n, _dt, _shape, b, e in _turboio.read_header(shard)[3]:
            sizes[n] = e - b
    res = {k: {"seconds": [], "disk_bytes": [], "tensor_bytes": 0, "tensors": 0} for k in ("whole", "subset")}
    res["whole"]["tensor_bytes"] = sum(sizes.values())
    res["whole"]["tensors"] = len(names)
    res["subset"]["tensor_bytes"] = sum(sizes[n] for n in chosen)
    res["subset"]["tensors"] = len(chosen)
    # An untimed round: the first torch calls of the process fault its libraries in.
    for what in ("whole", "subset"):
        out = turboio.load_model(d, tensors=chosen if what == "subset" else None)
        del out
    order = ["whole", "subset"]
    rng = random.Random(2)
    for _ in range(runs):
        rng.shuffle(order)
        for what in order:
            evict(index, *shards)
            before = disk_read(index)
            t = time.perf_counter()
            out = turboio.load_model(d, tensors=chosen if what == "subset" else None)
            res[what]["seconds"].append(time.perf_counter() - t)
            after = disk_read(index)
            res[what]["disk_bytes"].append(None if before is None else after - before)
            assert len(out) == res[what]["tensors"], (what, len(out))
            del out
    print(json.dumps(res))


GAPS = [16 << 10, 64 << 10, 256 << 10, 1 << 20]
PAIRS, KEEP = 256, 64 << 10
COALESCE = {"separate": "0", "merged": "16MiB", "default": None}


def gap_file(d, gap):
    import torch
    from safetensors.torch import save_file

    path = os.path.join(d, f"gaps-{gap}.safetensors")
    if not os.path.exists(path):
        out = {}
        for i in range(PAIRS):
            # Names sort in file order (safetensors writes same-dtype tensors by name).
            out[f"p{i:04d}.a.keep"] = torch.full((KEEP // 4,), float(i), dtype=torch.float32)
            out[f"p{i:04d}.b.skip"] = torch.full((gap // 4,), -1.0, dtype=torch.float32)
        save_file(out, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
    return path


def gap_runs(d, runs):
    import turboio

    os.makedirs(d, exist_ok=True)
    res = {"kept_bytes": PAIRS * KEEP}
    rng = random.Random(3)
    for gap in GAPS:
        path = gap_file(d, gap)
        r = res[str(gap)] = {k: {"seconds": [], "disk_bytes": []} for k in COALESCE}
        turboio.load(path, tensors="*.keep")  # untimed: faults the libraries in
        order = list(COALESCE)
        for _ in range(runs):
            rng.shuffle(order)
            for how in order:
                if COALESCE[how] is None:
                    os.environ.pop("TURBOIO_COALESCE_GAP", None)
                else:
                    os.environ["TURBOIO_COALESCE_GAP"] = COALESCE[how]
                evict(path)
                before = disk_read(path)
                t = time.perf_counter()
                out = turboio.load(path, tensors="*.keep")
                r[how]["seconds"].append(time.perf_counter() - t)
                after = disk_read(path)
                r[how]["disk_bytes"].append(None if before is None else after - before)
                assert len(out) == PAIRS and float(out["p0007.a.keep"][0]) == 7.0
                del out
        os.environ.pop("TURBOIO_COALESCE_GAP", None)
    print(json.dumps(res))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["files", "load", "subset", "gaps"])
    p.add_argument("--dir")
    p.add_argument("--size", type=int)
    p.add_argument("--file")
    p.add_argument("--pt")
    p.add_argument("--model")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--cold", action="store_true")
    a = p.parse_args()
    if a.what == "files":
        files(a.dir, a.size)
    elif a.what == "load":
        load_runs(a.file, a.pt, a.runs, a.cold)
    elif a.what == "gaps":
        gap_runs(a.dir, a.runs)
    else:
        subset_runs(a.model, a.runs)


if __name__ == "__main__":
    main()
