"""`python -m turboio.convert -i model.pt -o model.safetensors`: veTurboIO's converter.

Converts a `torch.save` checkpoint (`.pt` / `.bin`; a directory of shards or its
`pytorch_model.bin.index.json` becomes a safetensors model directory) with turboio's Rust
converter: the pickle is interpreted by an allow-listed reader, never executed (a file calling
anything but torch's tensor-rebuilding functions is refused), and tensors stream from the input
to the output (memory stays near the writers' chunks, not the checkpoint), written atomically.
Nested dicts become dotted names; non-tensor entries are left out; tensors that are the same
view of one storage (tied weights) are stored once with aliases in `__metadata__`.
`--validate-result` reads the result back and compares every tensor with the input.
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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m turboio.convert", description=__doc__.splitlines()[0])
    p.add_argument("--input", "-i", required=True, help="the .pt / .bin file, a directory of them, or its index JSON")
    p.add_argument("--output", "-o", help="the .safetensors file or model directory (default: input with .pt replaced)")
    p.add_argument("--dry-run", "-d", action="store_true", help="only log what would be done")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument(
        "--enable-to-valid-state-dict",
        action="store_true",
        help="drop non-tensors and store shared tensors once (what the converter always does)",
    )
    p.add_argument("--clone-shared", action="store_true", help="store a copy of every tied tensor instead of aliases")
    p.add_argument("--top-level-key", help='convert only the tensors under this key of a nested checkpoint ("model")')
    p.add_argument("--dtype", help="convert every floating tensor to this dtype (bfloat16, float16, ...)")
    p.add_argument("--validate-result", action="store_true", help="read the result back and compare every tensor")
    p.add_argument("--use-direct-io", action="store_true", help="read the input with O_DIRECT")
    p.add_argument("--use-cipher", action="store_true", help="the input is encrypted (keys from veTurboIO's sources)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        from . import _turboio
        from ._dtypes import load_dtype

        src = args.input
        directory = not src.startswith("sfcs://") and (os.path.isdir(src) or src.endswith(".json"))
        if not directory and not src.endswith((".pt", ".bin", ".pth")):
            raise Exception(f"{src}: the input must be a .pt / .bin file, a directory of them, or its index JSON")
        if not src.startswith("sfcs://") and not os.path.exists(src):
            raise FileNotFoundError(f"{src}: no such file")
        if args.output:
            out = args.output
        elif directory:
            raise Exception(f"{src}: give --output, the model directory to write")
        else:
            out = os.path.splitext(src)[0] + ".safetensors"
        if not out.startswith("sfcs://"):
            out = os.path.abspath(out)
        elif args.overwrite:
            raise Exception(f"{out}: --overwrite is refused for sfcs:// outputs (as in veTurboIO)")
        if not directory and not out.endswith(".safetensors"):
            raise Exception(f"{out}: the output must end with .safetensors")
        if not directory and not out.startswith("sfcs://") and os.path.exists(out) and not args.overwrite:
            raise Exception(f"{out} exists; pass --overwrite to replace it")
        logger.info("converting %s -> %s", src, out)
        if args.dry_run:
            return 0
        r = _turboio.convert(
            src,
            out,
            top_level_key=args.top_level_key,
            clone_shared=args.clone_shared,
            dtype=load_dtype(args.dtype),
            validate=args.validate_result,
            overwrite=args.overwrite,
            threads=_available_cpus(),
            cipher=args.use_cipher,
            cache="bypass" if args.use_direct_io else "auto",
        )
        logger.info(
            "%d tensors (%d bytes), %d aliases, %d converted, in %.2f s; no pickle was executed",
            r["tensors"],
            r["bytes"],
            len(r["aliases"]),
            r["converted"],
            r["seconds"],
        )
        for s in r["skipped"]:
            logger.info("skipped (not a tensor): %s", s)
        if r["validated"]:
            logger.info("validated %d tensors", r["tensors"])
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
