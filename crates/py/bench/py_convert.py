"""One `.pt` -> safetensors conversion, timed, for `cargo xtask bench --pt` (each in its own
process). Prints one JSON line: {"seconds", "peak_rss"} (peak resident memory of the process
that converted: the CLI child, or this interpreter).

--how cli: `turboio convert` (the binary given by --cli); module: `python -m turboio.convert`'s
main() in this process; torch: veTurboIO's way, `torch.load(weights_only=True)` then
`safetensors.torch.save_file`.
"""

import argparse
import json
import resource
import subprocess
import time

from py_load import peak_rss as vm_hwm


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--how", required=True, choices=["cli", "module", "torch"])
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--cli")
    a = p.parse_args()
    if a.how == "cli":
        t0 = time.perf_counter()
        subprocess.run([a.cli, "convert", a.input, a.output, "--overwrite"], check=True, capture_output=True)
        secs = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    elif a.how == "module":
        import turboio.convert

        t0 = time.perf_counter()
        if turboio.convert.main(["-i", a.input, "-o", a.output, "--overwrite"]) != 0:
            raise SystemExit("python -m turboio.convert failed")
        secs = time.perf_counter() - t0
        peak = vm_hwm()
    else:
        import safetensors.torch
        import torch

        t0 = time.perf_counter()
        sd = torch.load(a.input, weights_only=True)
        safetensors.torch.save_file(sd, a.output)
        secs = time.perf_counter() - t0
        peak = vm_hwm()
    print(json.dumps({"seconds": secs, "peak_rss": peak}))


if __name__ == "__main__":
    main()
