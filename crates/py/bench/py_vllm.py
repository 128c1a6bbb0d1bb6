"""One vLLM start for `cargo xtask bench --vllm`: `LLM(model, load_format=...)` on the CPU, then
one greedy token, then prints one JSON line: the weight-loading seconds vLLM logged ("Loading
weights took N seconds", both loaders print it), the engine's start-up seconds, and the peak RSS
(VmHWM) of every process under this one (vLLM's engine core and its worker), read before exit.

    python py_vllm.py MODEL_DIR auto|turboio|bench-floor [EXTRA_CONFIG_JSON]

The loader's log goes to this process's stderr through vLLM's own logging; the parent parses it
from there.

`bench-floor` is the floor of any loader, registered here (not a product): every shard is read
into memory (`safetensors.torch.load_file`, each tensor copied into memory this process has
faulted in) before its timer starts, and only vLLM's
`model.load_weights` over those tensors is timed, so what it measures is vLLM's own work (its
weight loaders' copies into its parameters, which take their first page faults then); it reads
nothing while timed and holds the whole model twice, so its peak RSS is not a loader's."""

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


FLOOR = "bench-floor"


def register_floor():
    """Registers the `bench-floor` load format with vLLM (in this process; a forked engine
    process inherits it, a spawned one imports this module again, which calls this again)."""
    import logging

    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    logger = logging.getLogger("vllm.bench_floor")

    @register_model_loader(FLOOR)
    class FloorLoader(BaseModelLoader):
        def download_model(self, model_config):
            pass

        def load_weights(self, model, model_config):
            import glob

            from safetensors.torch import load_file

            # Copies in memory this process has faulted in, not views of the files' mappings.
            tensors = {}
            for f in sorted(glob.glob(os.path.join(model_config.model, "*.safetensors"))):
                tensors.update((name, t.clone()) for name, t in load_file(f).items())
            start = time.perf_counter()
            model.load_weights(iter(tensors.items()))
            took = time.perf_counter() - start
            logger.info("Loading weights took %.2f seconds (bench floor: the tensors already in memory)", took)


if os.environ.get("TURBOIO_BENCH_VLLM_FLOOR") == "1":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    register_floor()


def main():
    model, load_format = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import psutil
    from vllm import LLM, SamplingParams

    if load_format == FLOOR and os.environ.get("TURBOIO_BENCH_VLLM_FLOOR") != "1":
        os.environ["TURBOIO_BENCH_VLLM_FLOOR"] = "1"  # for vLLM's processes
        register_floor()

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
