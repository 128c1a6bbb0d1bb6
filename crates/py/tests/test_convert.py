""".pt -> safetensors conversion without executing the pickle (`python -m turboio.convert`,
`turboio._turboio.convert`, the Rust converter), checked against real torch and the official
`safetensors` package: every dtype, views, tied weights, nested dicts, empty tensors, scalars,
sharded directories with their index, dtype conversion, hostile files, and streaming memory."""

import json
import os
import subprocess
import sys

import pytest
import safetensors
import safetensors.torch
import torch

import turboio
import turboio.models
from turboio import _turboio


def run(*args):
    return subprocess.run([sys.executable, "-m", "turboio.convert", *map(str, args)], capture_output=True, text=True)


def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def zoo():
    """A checkpoint with every dtype torch saves that safetensors has, views, ties, nesting."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 10, generator=g)
    model = torch.nn.Sequential(torch.nn.Embedding(12, 8), torch.nn.Linear(8, 12, bias=False))
    model[1].weight = model[0].weight  # tied, as language models tie embeddings and heads
    sd = {
        "model": model.state_dict(),
        "dtypes": {str(dt).split(".")[1]: base.to(dt) for dt in [torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]},
        "ints": {str(dt).split(".")[1]: torch.randint(0, 200, (3, 4), generator=g).to(dt) for dt in [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64]},
        "bool": base > 0,
        "complex": torch.randn(2, 3, generator=g, dtype=torch.complex64),
        "transposed": base.t(),
        "slice": base[2:5],
        "strided": base[:, ::3],
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(2.5),
        "step": 1000,
        "name": "run-7",
    }
    sd["whole"] = sd["transposed"].t()  # a contiguous view of the storage the views above share
    return sd


@pytest.fixture()
def pt(tmp_path):
    sd = zoo()
    path = tmp_path / "zoo.pt"
    torch.save(sd, path)
    return path, flat(torch.load(path, weights_only=True))


def test_conversion_equals_torch_load_tensor_by_tensor(pt, tmp_path):
    path, want = pt
    out = tmp_path / "zoo.safetensors"
    r = run("-i", path, "-o", out, "--validate-result")
    assert r.returncode == 0, r.stderr
    assert "validated" in r.stderr and "no pickle was executed" in r.stderr, r.stderr
    stored = safetensors.torch.load_file(out)  # the official reader
    with safetensors.safe_open(out, "pt") as f:
        meta = f.metadata() or {}
    # Tied weights are stored once; the other name is an alias in __metadata__.
    assert meta.get("model.1.weight") == "model.0.weight", meta
    assert "model.1.weight" not in stored
    for name, t in want.items():
        got = stored[meta[name]] if name in meta else stored[name]
        assert same_bits(got, t), name
    assert set(stored) | set(meta) >= set(want)
    # turboio resolves the aliases: every name comes back, tied ones as one tensor.
    loaded = turboio.load(str(out))
    assert set(loaded) == set(want)
    assert loaded["model.1.weight"] is loaded["model.0.weight"]


def test_clone_shared_dtype_and_top_level_key(pt, tmp_path):
    path, want = pt
    out = tmp_path / "clone.safetensors"
    r = _turboio.convert(str(path), str(out), clone_shared=True, validate=True)
    assert r["aliases"] == [] and r["validated"]
    stored = safetensors.torch.load_file(out)
    assert set(stored) == set(want)
    for name, t in want.items():
        assert same_bits(stored[name], t), name

    out = tmp_path / "bf16.safetensors"
    r = _turboio.convert(str(path), str(out), dtype="BF16", validate=True)
    stored = safetensors.torch.load_file(out)
    floating = (torch.float64, torch.float32, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
    for name, t in want.items():
        if name in stored:
            expect = t.to(torch.bfloat16) if t.dtype in floating else t
            assert same_bits(stored[name], expect), name
    assert r["converted"] == sum(1 for n, t in want.items() if n in stored and t.dtype in floating)

    out = tmp_path / "model.safetensors"
    r = run("-i", path, "-o", out, "--top-level-key", "model")
    assert r.returncode == 0, r.stderr
    stored = safetensors.torch.load_file(out)
    assert set(stored) == {"0.weight"}
    assert same_bits(stored["0.weight"], want["model.0.weight"])


def test_existing_outputs_and_failures_leave_nothing_half_written(pt, tmp_path):
    path, _ = pt
    out = tmp_path / "x.safetensors"
    out.write_bytes(b"old")
    r = run("-i", path, "-o", out)
    assert r.returncode == 1 and "exists" in r.stderr
    assert out.read_bytes() == b"old"
    # A hostile input: refused, nothing executed, the old output untouched, no temporary left.
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": Evil()}, evil)
    r = run("-i", evil, "-o", out, "--overwrite")
    assert r.returncode == 1 and "evil.pt" in r.stderr and "system" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 2  # the INFO line and the one-line error
    assert not marker.exists() and out.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.pt", "x.safetensors", "zoo.pt"]


def test_sharded_bin_directories_become_safetensors_model_directories(tmp_path):
    g = torch.Generator().manual_seed(2)
    sd = {f"layers.{i}.weight": torch.randn(16, 16, generator=g) for i in range(5)}
    sd["embed.weight"] = torch.randn(30, 16, generator=g).to(torch.bfloat16)
    src = tmp_path / "hf"
    src.mkdir()
    shards = [["layers.0.weight", "layers.1.weight"], ["layers.2.weight", "layers.3.weight"], ["layers.4.weight", "embed.weight"]]
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin"
        torch.save({n: sd[n] for n in names}, src / fname)
        weight_map.update({n: fname for n in names})
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    out = tmp_path / "st"
    r = run("-i", src, "-o", out, "--validate-result")
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert set(index["weight_map"]) == set(sd)
    got = turboio.models.load_model(out)
    assert set(got) == set(sd) and all(same_bits(got[k], sd[k]) for k in sd)
    for shard in files[:3]:
        safetensors.torch.load_file(out / shard)  # the official reader accepts every shard
    # Again over the same directory: refused without --overwrite, replaced as a set with it.
    r = run("-i", src / "pytorch_model.bin.index.json", "-o", out)
    assert r.returncode == 1 and "not empty" in r.stderr, r.stderr
    r = run("-i", src / "pytorch_model.bin.index.json", "-o", out, "--overwrite", "--dtype", "float16")
    assert r.returncode == 0, r.stderr
    got = turboio.models.load_model(out)
    assert all(same_bits(got[k], sd[k].to(torch.float16)) for k in sd)
    # An index naming a missing shard, and two shards holding one name: clear errors.
    bad = dict(weight_map, extra="missing.bin")
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": bad}))
    r = run("-i", src, "-o", tmp_path / "st2")
    assert r.returncode == 1 and "missing.bin" in r.stderr, r.stderr
    torch.save({"layers.0.weight": sd["layers.0.weight"]}, src / "pytorch_model-00002-of-00003.bin")
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    r = run("-i", src, "-o", tmp_path / "st3")
    assert r.returncode == 1 and "layers.0.weight" in r.stderr and "also in" in r.stderr, r.stderr
    assert not (tmp_path / "st3" / "model.safetensors.index.json").exists()


def test_pt_loads_through_the_pipeline_with_every_cache_policy(pt):
    path, want = pt
    for cache in ("auto", "keep", "bypass"):
        got = turboio.load(str(path), cache=cache)
        assert set(got) == set(want), cache
        for name, t in want.items():
            assert same_bits(got[name], t) and got[name].stride() == t.stride(), (cache, name)
        # Views of one storage share memory after the load as they did when saved.
        assert got["model.1.weight"].data_ptr() == got["model.0.weight"].data_ptr()
        assert got["transposed"].data_ptr() == got["slice"].data_ptr() - 2 * 10 * 4


def test_conversion_streams(tmp_path):
    """Peak memory of a conversion stays near the writers' chunks, not the checkpoint: 24
    tensors of 16 MiB (384 MiB) convert within the largest tensor x 1.5 + 96 MiB (the
    interpreter included), with and without dtype conversion."""
    big = {f"w{i:02d}": torch.full((4 << 20,), float(i)) for i in range(24)}
    src = tmp_path / "big.pt"
    torch.save(big, src)
    del big
    code = (
        "import resource, sys; from turboio import _turboio; "
        "_turboio.convert(sys.argv[1], sys.argv[2], dtype=sys.argv[3] or None, validate=True); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    for dtype in ("", "BF16"):
        base = subprocess.run([sys.executable, "-c", "import resource; from turboio import _turboio; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"], capture_output=True, text=True, check=True)
        out = tmp_path / f"big{dtype}.safetensors"
        r = subprocess.run([sys.executable, "-c", code, str(src), str(out), dtype], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        added = int(r.stdout) - int(base.stdout)
        assert added < 16 * 1.5 * 2**20 + (96 << 20), f"peak RSS grew by {added >> 20} MiB converting a 384 MiB checkpoint"
        assert os.path.getsize(out) > (192 << 20)
