"""One load by one Python loader, timed, for `cargo xtask bench` (each run in its own process).

Prints one JSON line: {"load_s", "touch_s", "tensors", "peak_rss"}. "touch" reads one byte of
every 4 KiB page of every tensor after the load returns, which is when lazily mapped loaders
actually read the file.
"""

import argparse
import json
import sys
import time


def touch(tensors):
    import torch

    s = 0
    for t in tensors:
        if t.numel() and t.device.type == "cpu":
            s += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return s


def peak_rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--loader", required=True)
    p.add_argument("--file", required=True)
    p.add_argument(
        "--wait",
        action="store_true",
        help='print {"ready": true} once imports are done, then load when a line arrives on stdin',
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (GPU rows: the load ends when the GPU has the bytes)")
    a = p.parse_args()
    import torch  # imported before timing: every loader needs it

    dev = a.device
    gpu = dev != "cpu"
    if gpu:
        torch.empty(1, device=dev)  # the CUDA context exists before timing, as in a training job
    if a.loader.startswith("turboio"):
        import turboio
        import turboio.torch
        from turboio._torch import tensors_of
    elif a.loader == "safetensors.torch.load_file":
        import safetensors.torch
    elif a.loader.startswith("fastsafetensors"):
        import fastsafetensors  # noqa: F401
    elif a.loader == "instanttensor":
        import instanttensor  # noqa: F401
    if a.wait:
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()

    report = None
    if a.loader.startswith("turboio ") or a.loader.startswith("turboio,"):
        # The page-cache rows: turboio.load's default and each forced mode / cache policy,
        # "turboio MODE[, cache POLICY][, encrypted]" (encrypted files take the key from
        # VETURBOIO_KEY / VETURBOIO_IV).
        words = [w.strip() for w in a.loader[len("turboio"):].replace(",", " ").split()]
        mode = words[0] if words and words[0] in ("auto", "mapped", "copied") else "auto"
        cache = words[words.index("cache") + 1] if "cache" in words else "auto"
        t0 = time.perf_counter()
        loaded = turboio._turboio.load(a.file, mode=mode, cache=cache, cipher="encrypted" in words)
        sd = tensors_of(loaded)
        report = loaded.report()
    elif a.loader == "turboio.load":
        import turboio

        t0 = time.perf_counter()
        sd = turboio.load(a.file, map_location=dev)
    elif a.loader == "turboio.torch.load_file":
        t0 = time.perf_counter()
        sd = turboio.torch.load_file(a.file, device=dev)
    elif a.loader == "safetensors.torch.load_file":
        t0 = time.perf_counter()
        sd = safetensors.torch.load_file(a.file, device=dev)
    elif a.loader == "turboio.load .pt":
        import turboio

        t0 = time.perf_counter()
        sd = turboio.load(a.file, map_location=dev)
    elif a.loader == "torch.load":
        t0 = time.perf_counter()
        sd = torch.load(a.file, weights_only=True, map_location=dev)
    elif a.loader == "torch.load, mmap":
        t0 = time.perf_counter()
        sd = torch.load(a.file, weights_only=True, mmap=True, map_location=dev)
    elif a.loader in ("fastsafetensors", "fastsafetensors (GDS)"):
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        t0 = time.perf_counter()
        loader = SafeTensorsFileLoader(SingleGroup(), dev, nogds=a.loader == "fastsafetensors")
        loader.add_filenames({0: [a.file]})
        fb = loader.copy_files_to_device()
        sd = {k: fb.get_tensor(k) for k in loader.get_keys()}
    elif a.loader == "instanttensor":
        # Its default (copy=True): every yielded tensor owns its GPU memory, as the others' do.
        from instanttensor import safe_open

        if not gpu:
            raise SystemExit("instanttensor loads into a GPU only")
        t0 = time.perf_counter()
        with safe_open(a.file, framework="pt", device=torch.device(dev).index or 0) as f:
            sd = dict(f.tensors())
    else:
        raise SystemExit(f"unknown loader {a.loader}")
    if gpu:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    touch(sd.values())
    t2 = time.perf_counter()
    out = {"load_s": t1 - t0, "touch_s": t2 - t1, "tensors": len(sd), "peak_rss": peak_rss()}
    if report is not None:
        out["how"] = f"{report['held']} via {report['method']}, cache {report['cache']} ({report['cache_reason']})"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
