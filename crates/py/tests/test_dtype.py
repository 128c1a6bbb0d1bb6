"""dtype conversion on load (`turboio.load(dtype=...)`, fastsafetensors' `dtype=`, `.pt` files):
every result bit-identical to torch's own `.to()` on random bits, NaNs, infinities, subnormals
and exact ties, through the real wheel."""

import pytest
import safetensors.torch
import torch

import turboio
import turboio.models
from turboio.fastsafetensors import SafeTensorsFileLoader, SingleGroup

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def bits(t):
    return t.contiguous().reshape(-1).view(INT_OF[t.element_size()])


def hard_values(dtype, n=4096, seed=0):
    """`n` values of `dtype` (n a multiple of 64, so torch's vectorised kernels cover every
    element): random bit patterns (NaNs with payloads, infinities, subnormals of every width),
    the special values themselves, and exact round-to-even ties of every narrower dtype."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    it = INT_OF[size]
    raw = torch.randint(torch.iinfo(it).min if it != torch.uint8 else 0, torch.iinfo(it).max, (n,), generator=g, dtype=it)
    t = raw.view(dtype).clone()
    special = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-45, 65504.0, 65520.0, 448.0, 464.0, 1e38, 3.4e38],
        dtype=torch.float64,
    ).to(dtype)
    t[: len(special)] = special
    if size >= 2:
        # Ties: a value with exactly the half-way bit pattern below the kept bits of BF16 and F16.
        base = torch.randn(512, generator=g, dtype=torch.float32)
        b = base.view(torch.int32)
        tie_bf16 = ((b & ~0xFFFF) | 0x8000).view(torch.float32)
        tie_f16 = ((b & ~0x1FFF) | 0x1000).view(torch.float32)
        tie_e4m3 = ((b & ~0xFFFFF) | 0x80000).view(torch.float32)
        ties = torch.cat([tie_bf16, tie_f16, tie_e4m3])
        t[64 : 64 + len(ties)] = ties.to(dtype) if dtype != torch.float32 else ties
    return t


def check_same(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    assert torch.equal(bits(got), bits(want)), f"{what}: {int((bits(got) != bits(want)).sum())} elements differ"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("dtype")
    sd = {f"t_{str(dt).split('.')[1]}": hard_values(dt, seed=i).reshape(64, -1) for i, dt in enumerate(FLOATS)}
    sd["ints"] = torch.arange(-50, 50, dtype=torch.int64)
    sd["mask"] = torch.arange(10) % 3 == 0
    sd["odd_length"] = torch.randn(7, 3, dtype=torch.float32)  # 21 elements: not a multiple of 8
    path = d / "hard.safetensors"
    safetensors.torch.save_file(sd, str(path))
    return path, sd


@pytest.mark.parametrize("target", FLOATS, ids=lambda t: str(t).split(".")[1])
@pytest.mark.parametrize("cache", ["auto", "bypass"])
def test_converting_load_is_bit_identical_to_torch(checkpoint, target, cache):
    path, sd = checkpoint
    got = turboio.load(str(path), dtype=target, cache=cache)
    assert got.keys() == sd.keys()
    for name, t in sd.items():
        if t.dtype in FLOATS:
            want = t.to(target)
            if name == "odd_length":
                # torch's scalar tail (the last len % 8 elements) gives other NaN bits for some
                # pairs; there are no NaNs here, so every bit is compared.
                assert not t.isnan().any()
            check_same(got[name], want, f"{name} {t.dtype} -> {target}")
        else:
            assert torch.equal(got[name], t) and got[name].dtype == t.dtype, name


def test_dtype_by_name_and_refusals(checkpoint, tmp_path):
    path, sd = checkpoint
    got = turboio.load(str(path), dtype="bfloat16")
    check_same(got["t_float32"], sd["t_float32"].to(torch.bfloat16), "by torch name")
    got = turboio.load(str(path), dtype="F16")
    check_same(got["t_float64"], sd["t_float64"].to(torch.float16), "by safetensors name")
    with pytest.raises(ValueError, match="floating dtype"):
        turboio.load(str(path), dtype=torch.int32)
    with pytest.raises(ValueError, match="state_dict"):
        turboio.load(str(path), dtype=torch.float16, state_dict={"ints": torch.empty(100, dtype=torch.int64)})


def test_a_file_already_in_the_dtype_is_not_copied(tmp_path):
    path = tmp_path / "bf16.safetensors"
    safetensors.torch.save_file({"a": torch.randn(64, 64).to(torch.bfloat16), "i": torch.arange(5)}, str(path))
    loaded = turboio._turboio.load(str(path), dtype="BF16")
    r = loaded.report()
    assert r["converted"] == 0 and r["held"] == "mapped", r
    loaded = turboio._turboio.load(str(path), dtype="F32")
    r = loaded.report()
    assert r["converted"] == 1 and r["held"] == "copied", r


def test_pt_and_model_and_fastsafetensors_loads_convert_too(checkpoint, tmp_path):
    path, sd = checkpoint
    pt = tmp_path / "hard.pt"
    torch.save(sd, pt)
    got = turboio.load(str(pt), dtype=torch.float16)
    for name, t in sd.items():
        want = t.to(torch.float16) if t.dtype in FLOATS else t
        check_same(got[name], want, f".pt {name}") if t.dtype in FLOATS else None
        assert got[name].dtype == want.dtype, name

    model = tmp_path / "model"
    turboio.models.save_model_dir(sd, model, max_shard_size="20KB")
    got = turboio.models.load_model(model, dtype=torch.bfloat16)
    for name, t in sd.items():
        if t.dtype in FLOATS:
            check_same(got[name], t.to(torch.bfloat16), f"model {name}")

    loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
    loader.add_filenames({0: [str(path)]})
    fb = loader.copy_files_to_device(dtype=torch.bfloat16)
    for name, t in sd.items():
        got = fb.get_tensor(name)
        if t.dtype in FLOATS:
            check_same(got, t.to(torch.bfloat16), f"fastsafetensors {name}")
        else:
            assert got.dtype == t.dtype and torch.equal(got, t), name
    check_same(fb.get_tensor("t_float32", dtype="float16"), sd["t_float32"].to(torch.bfloat16).to(torch.float16), "get_tensor")
    fb.close()
