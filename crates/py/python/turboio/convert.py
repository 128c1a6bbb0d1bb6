"""`python -m turboio.convert -i model.pt -o model.safetensors`: veTurboIO's converter.

Reads a `torch.save` checkpoint with turboio's allow-listed reader (the pickle is interpreted,
never executed: a file calling anything but torch's tensor-rebuilding functions is refused),
optionally turns it into a valid state dict (stores shared tensors once), saves it as
safetensors (shared tensors become aliases in `__metadata__`), and optionally checks that the
result loads back equal. Nested dicts become dotted names.
"""

import argparse
import logging
import os
import sys
import traceback

logger = logging.getLogger("turboio.convert")


def _available_cpus():
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period = int(f.read())
        if quota > 0 and period > 0:
            return max(1, quota // period)
    except (OSError, ValueError):
        pass
    return os.cpu_count() or 1


def to_valid_state_dict(state_dict):
    """Drops non-tensor values; tensors sharing memory must be identical views, and are stored
    once (a partial view is cloned)."""
    import torch

    from ._torch import find_shared, is_complete

    sd = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    for group in find_shared(sd):
        names = sorted(group)
        first = sd[names[0]]
        for n in names[1:]:
            if sd[n].data_ptr() != first.data_ptr() or sd[n].shape != first.shape:
                raise Exception(f"shared tensors {names} are not identical views; cannot convert")
        if not is_complete(first):
            first = first.clone()
        for n in names:
            sd[n] = first
    return sd


def _same_bytes(x, y):
    """Bitwise equality (NaNs included)."""
    import torch

    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m turboio.convert", description=__doc__.splitlines()[0])
    p.add_argument("--input", "-i", required=True, help="the .pt file")
    p.add_argument("--output", "-o", help="the .safetensors file (default: input with .pt replaced)")
    p.add_argument("--dry-run", "-d", action="store_true", help="only log what would be done")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--enable-to-valid-state-dict", action="store_true", help="drop non-tensors, dedupe shared tensors")
    p.add_argument("--validate-result", action="store_true", help="load both files and compare every tensor")
    p.add_argument("--use-direct-io", action="store_true", help="read the input with O_DIRECT")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        import torch

        import turboio

        src = args.input
        if not src.endswith(".pt"):
            raise Exception(f"{src}: the input must be a .pt file")
        if not src.startswith("sfcs://") and not os.path.exists(src):
            raise FileNotFoundError(f"{src}: no such file")
        out = args.output or src.replace(".pt", ".safetensors")
        if not out.startswith("sfcs://"):
            out = os.path.abspath(out)
        elif args.overwrite:
            raise Exception(f"{out}: --overwrite is refused for sfcs:// outputs (as in veTurboIO)")
        if not out.endswith(".safetensors"):
            raise Exception(f"{out}: the output must end with .safetensors")
        if not out.startswith("sfcs://") and os.path.exists(out) and not args.overwrite:
            raise Exception(f"{out} exists; pass --overwrite to replace it")
        logger.info("converting %s -> %s", src, out)
        if args.dry_run:
            return 0
        sd = turboio.load(src, num_thread=_available_cpus(), use_direct_io=args.use_direct_io)
        if args.enable_to_valid_state_dict:
            sd = to_valid_state_dict(sd)
        turboio.save_file(sd, out, force_save_shared_tensor=True)
        if args.validate_result:
            a = turboio.load(src)
            b = turboio.load(out)
            a = {k: v for k, v in a.items() if isinstance(v, torch.Tensor)}
            if set(a) != set(b):
                raise Exception(f"keys differ: {sorted(set(a) ^ set(b))}")
            for k in a:
                if not _same_bytes(a[k], b[k]):
                    raise Exception(f"tensor {k} differs")
            logger.info("validated %d tensors", len(a))
        return 0
    except Exception as e:
        # One line, like the turboio CLI: the message names the file and the problem.
        # TURBOIO_TRACEBACK=1 shows where it came from.
        if os.environ.get("TURBOIO_TRACEBACK") == "1":
            traceback.print_exc()
        what = "" if type(e) is Exception else f"{type(e).__name__}: "
        print(f"python -m turboio.convert: error: {what}{e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
