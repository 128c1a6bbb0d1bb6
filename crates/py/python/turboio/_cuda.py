"""Devices for the three APIs: parsing torch-style device arguments, finding the NVIDIA libraries
that pip wheels install, and the stream discipline around CUDA tensors.

The extension loads libcuda, NVRTC and libcufile at run time. The last two usually come from pip
wheels (`nvidia-cuda-nvrtc`, `nvidia-cufile`, the CUDA 13 `nvidia/cu13` bundle torch pulls in),
whose `lib` directories are not on the loader's path; `library_dirs()` lists them and they are
handed to the extension through `TURBOIO_CUDA_LIB_DIRS` before the first GPU call.
"""

import os
import sys

_DIRS_SET = False


def library_dirs():
    """The `lib` directories of the installed `nvidia` wheels (cu13 bundle, cufile, nvrtc...)."""
    dirs = []
    seen = set()
    for base in sys.path:
        root = os.path.join(base or ".", "nvidia")
        if not os.path.isdir(root):
            continue
        try:
            names = sorted(os.listdir(root))
        except OSError:
            continue
        for name in names:
            lib = os.path.join(root, name, "lib")
            if os.path.isdir(lib) and lib not in seen:
                seen.add(lib)
                dirs.append(lib)
    return dirs


def _set_library_dirs():
    global _DIRS_SET
    if _DIRS_SET:
        return
    _DIRS_SET = True
    found = library_dirs()
    if not found:
        return
    current = os.environ.get("TURBOIO_CUDA_LIB_DIRS", "")
    parts = [p for p in current.split(os.pathsep) if p]
    for d in found:
        if d not in parts:
            parts.append(d)
    os.environ["TURBOIO_CUDA_LIB_DIRS"] = os.pathsep.join(parts)


def _current_cuda_index():
    """torch's current CUDA device where torch can tell, else 0 (the extension then says
    precisely what is missing)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.current_device()
    except Exception:
        pass
    return 0


def target(device):
    """A torch-style device argument (`"cpu"`, `"cuda"`, `"cuda:1"`, `torch.device`, an int
    meaning a CUDA ordinal, None) as the extension's device string: `"cpu"` or `"cuda:N"`.

    Anything else (an NPU, a typo) raises the extension's error: `RuntimeError` naming what an
    NPU build would need, `ValueError` for a string that names no device.
    """
    if device is None:
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        kind, index = "cuda", device
    else:
        kind = getattr(device, "type", None)
        index = getattr(device, "index", None)
        if kind is None:
            text = str(device).strip()
            kind, _, rest = text.partition(":")
            index = int(rest) if rest.strip().isdigit() else (None if not rest else rest)
        kind = kind.lower()
    if kind == "cpu":
        return "cpu"
    if kind == "cuda":
        if index is None:
            index = _current_cuda_index()
        dev = f"cuda:{index}"
        from . import _turboio

        _set_library_dirs()
        _turboio.check_device(dev)
        return dev
    from . import _turboio

    return _turboio.check_device(f"{kind}:{index}" if index is not None else kind)


def synchronize(tensors):
    """Waits for torch's current stream on every CUDA device among `tensors`, so that the bytes
    the extension reads on its own streams are the finished ones (what DLPack asks of a producer
    before handing memory to another stream)."""
    import torch

    done = set()
    for t in tensors:
        if t.device.type == "cuda" and t.device.index not in done:
            done.add(t.device.index)
            torch.cuda.current_stream(t.device).synchronize()


def gds_setting(default="off"):
    """`TURBOIO_GDS` (auto, on, off) for the APIs that have no GDS argument."""
    return os.environ.get("TURBOIO_GDS", default)
