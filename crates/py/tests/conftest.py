import os
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture
def tmp(tmp_path_factory):
    """A directory on the real disk (target/test-scratch), not tmpfs."""
    base = ROOT / "target" / "test-scratch"
    base.mkdir(parents=True, exist_ok=True)
    import tempfile

    d = tempfile.mkdtemp(dir=base)
    yield pathlib.Path(d)
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def same(a, b):
    """Bitwise equality of two tensors (dtype, shape and bytes; NaNs included)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.uint16,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.uint32,
    torch.float32,
    torch.complex64,
    torch.float64,
    torch.int64,
    torch.uint64,
    torch.float8_e5m2,
    torch.float8_e4m3fn,
]
for name in ("float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, name):
        TORCH_DTYPES.append(getattr(torch, name))


def make(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw[:n] & 1).to(torch.bool).reshape(shape)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def sample_dict(seed=0):
    """Every dtype torch has, regular / zero-sized / scalar."""
    out = {}
    for i, dt in enumerate(TORCH_DTYPES):
        name = str(dt).replace("torch.", "")
        out[f"t.{name}"] = make(dt, (3, 5), seed + i)
        out[f"empty.{name}"] = make(dt, (0, 4), seed + i)
        out[f"scalar.{name}"] = make(dt, (), seed + 100 + i)
    return out


class TiedLinears(torch.nn.Module):
    """Two linear layers sharing one weight (tied weights): `b.weight` is `a.weight`."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")
