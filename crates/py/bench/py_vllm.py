"""One vLLM start for `cargo xtask bench --vllm`: `LLM(model, load_format=...)` on the CPU, then
one greedy token, then prints one JSON line: the weight-loading seconds vLLM logged ("Loading
weights took N seconds", both loaders print it), the engine's start-up seconds, and the peak RSS
(VmHWM) of every process under this one (vLLM's engine core and its worker), read before exit.

    python py_vllm.py MODEL_DIR auto|turboio [EXTRA_CONFIG_JSON]

The loader's log goes to this process's stderr through vLLM's own logging; the parent parses it
from there."""

import json
import os
import sys
import time


def vmhwm(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main():
    model, load_format = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import psutil
    from vllm import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(
        model=model,
        load_format=load_format,
        model_loader_extra_config=extra,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=1,
        seed=0,
    )
    started = time.perf_counter() - t
    out = llm.generate(["the quick brown fox"], SamplingParams(temperature=0.0, max_tokens=1))
    peaks = {p.pid: vmhwm(p.pid) for p in psutil.Process().children(recursive=True)}
    print(
        "BENCH "
        + json.dumps(
            {
                "started_s": started,
                "token": list(out[0].outputs[0].token_ids),
                "worker_peak_rss": max(peaks.values(), default=0),
                "parent_peak_rss": vmhwm(os.getpid()),
            }
        ),
        flush=True,
    )
    # vLLM's shutdown can take long and everything measured is printed: end vLLM's processes
    # (they would outlive a plain exit and hold the parent's pipes) and this one.
    children = psutil.Process().children(recursive=True)
    for p in children:
        p.kill()
    psutil.wait_procs(children, timeout=30)
    os._exit(0)


if __name__ == "__main__":
    main()
