"""One load by one Python loader, timed, for `cargo xtask bench` (each run in its own process).

Prints one JSON line: {"load_s", "touch_s", "tensors", "peak_rss"}. "touch" reads one byte of
every 4 KiB page of every tensor after the load returns, which is when lazily mapped loaders
actually read the file.
"""

import argparse
import json
import time


def touch(tensors):
    import torch

    s = 0
    for t in tensors:
        if t.numel():
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
    a = p.parse_args()
    import torch  # imported before timing: every loader needs it

    if a.loader == "turboio.load":
        import turboio

        t0 = time.perf_counter()
        sd = turboio.load(a.file)
    elif a.loader == "turboio.torch.load_file":
        import turboio.torch

        t0 = time.perf_counter()
        sd = turboio.torch.load_file(a.file)
    elif a.loader == "safetensors.torch.load_file":
        import safetensors.torch

        t0 = time.perf_counter()
        sd = safetensors.torch.load_file(a.file)
    elif a.loader == "torch.load":
        t0 = time.perf_counter()
        sd = torch.load(a.file, weights_only=True)
    elif a.loader == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        t0 = time.perf_counter()
        loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
        loader.add_filenames({0: [a.file]})
        fb = loader.copy_files_to_device()
        sd = {k: fb.get_tensor(k) for k in loader.get_keys()}
    else:
        raise SystemExit(f"unknown loader {a.loader}")
    t1 = time.perf_counter()
    touch(sd.values())
    t2 = time.perf_counter()
    print(json.dumps({"load_s": t1 - t0, "touch_s": t2 - t1, "tensors": len(sd), "peak_rss": peak_rss()}))


if __name__ == "__main__":
    main()
