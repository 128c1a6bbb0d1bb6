"""Whole models through the real wheel: sharded directories (turboio's and the official
package's), index errors, per-rank blocks, and the weights iterator."""

import json

import pytest
import safetensors.torch as st
import torch

import turboio


def state_dict():
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(5):
        sd[f"layers.{i}.w"] = torch.randn(7 + i, 16, generator=g)
        sd[f"layers.{i}.b"] = torch.randn(5, generator=g).to(torch.bfloat16)
    sd["embed"] = torch.randint(0, 100, (3, 11), generator=g, dtype=torch.int64)
    return sd


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_save_model_dir_writes_hf_shards_and_loads_back(tmp):
    sd = state_dict()
    index = turboio.save_model_dir(sd, tmp / "m", max_shard_size="1KB", metadata={"format": "pt"})
    doc = json.loads(open(index).read())
    assert doc["metadata"]["format"] == "pt"
    assert doc["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    files = sorted(set(doc["weight_map"].values()))
    n = len(files)
    assert n > 3 and files == [f"model-{i:05}-of-{n:05}.safetensors" for i in range(1, n + 1)]
    for f in files:  # each shard is a valid safetensors file for the reference reader
        st.load_file(tmp / "m" / f)
    same(turboio.load_model(tmp / "m"), sd)
    same(turboio.load_model(index), sd)
    # A re-save of different data replaces the set as a whole.
    sd2 = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
    turboio.save_model_dir(sd2, tmp / "m", max_shard_size=10**9)
    same(turboio.load_model(tmp / "m"), sd2)
    # The old set leaves its names at once; its blocks are freed in the background.
    turboio._turboio.wait_for_saves()
    assert sorted(p.name for p in (tmp / "m").iterdir()) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]


def test_a_directory_of_the_official_package_loads_as_the_unsharded_model(tmp):
    sd = state_dict()
    names = list(sd)
    d = tmp / "hf"
    d.mkdir()
    weight_map = {}
    for i, part in enumerate([names[:4], names[4:9], names[9:]]):
        fn = f"model-{i + 1:05}-of-00003.safetensors"
        st.save_file({k: sd[k] for k in part}, d / fn)
        weight_map.update({k: fn for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    same(turboio.load_model(d), sd)
    # An index naming a tensor its shard does not hold: a clear error, nothing returned.
    weight_map["ghost"] = "model-00001-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: tensor `ghost` is named by the index"):
        turboio.load_model(d)


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_blocks_follow_fastsafetensors_split(tmp, world_size):
    sd = {"a": torch.arange(40.0).reshape(5, 8), "b": torch.arange(4.0).reshape(2, 2), "c": torch.arange(3.0)}
    turboio.save_model_dir(sd, tmp / "r", max_shard_size="1KB")
    dims = {"a": 0, "b": 1, "c": 0}
    got = [turboio.load_model(tmp / "r", rank=r, world_size=world_size, shard_dims=dims) for r in range(world_size)]
    for name, dim in dims.items():
        size = sd[name].shape[dim]
        step = -(-size // world_size)
        for r in range(world_size):
            want = sd[name].narrow(dim, min(r * step, size), max(0, min(step, size - r * step)))
            assert torch.equal(got[r][name], want), (name, r)
        assert torch.equal(torch.cat([g[name] for g in got], dim), sd[name])
    # b (2 columns) and c (3 rows) over 3 ranks leave an empty last block.
    if world_size == 3:
        assert got[2]["b"].shape == (2, 0)
    with pytest.raises(ValueError, match="rank 3 is not in"):
        turboio.load_model(tmp / "r", rank=3, world_size=3, shard_dims=dims)
    with pytest.raises(KeyError, match="nope"):
        turboio.load_model(tmp / "r", rank=0, world_size=2, shard_dims={"nope": 0})


def test_iter_weights_yields_tensors_that_outlive_the_iterator(tmp):
    sd = state_dict()
    turboio.save_model_dir(sd, tmp / "w", max_shard_size="2KB")
    pairs = list(turboio.iter_weights(tmp / "w"))
    import gc

    gc.collect()
    assert sorted(n for n, _ in pairs) == sorted(sd)
    same(dict(pairs), sd)
    files = sorted(str(p) for p in (tmp / "w").glob("*.safetensors"))
    same(dict(turboio.iter_weights(files)), sd)


def test_bad_sizes_and_metadata_are_refused(tmp):
    with pytest.raises(ValueError, match="unknown unit"):
        turboio.save_model_dir(state_dict(), tmp / "x", max_shard_size="5XB")
    with pytest.raises(TypeError, match="str to str"):
        turboio.save_model_dir(state_dict(), tmp / "x", metadata={"a": 1})
    with pytest.raises(FileNotFoundError):
        turboio.load_model(tmp / "does-not-exist")


ALIAS_SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
import safetensors.torch as sft
import turboio
d = sys.argv[1]
sft.save_file({"lm_head.weight": torch.arange(4.0)}, f"{d}/model-00001-of-00002.safetensors", metadata={"format": "pt"})
# Shard 2 aliases lm_head.weight (held by shard 1) to its own tensor.
sft.save_file({"embed.weight": torch.ones(4)}, f"{d}/model-00002-of-00002.safetensors",
              metadata={"format": "pt", "lm_head.weight": "embed.weight"})
json.dump({"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors",
                                          "embed.weight": "model-00002-of-00002.safetensors"}},
          open(f"{d}/model.safetensors.index.json", "w"))
dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
for kw in ({}, {"process_group": dist.group.WORLD, "fetch": "once"}, {"process_group": dist.group.WORLD}):
    try:
        got = turboio.load_model(d, **kw)
        print("LOADED", sorted(kw), got["lm_head.weight"].tolist())
    except ValueError as e:
        print("REFUSED", sorted(kw), e)
dist.destroy_process_group()
"""


def test_an_alias_in_one_shard_never_replaces_another_shards_tensor(tmp):
    """Every model path (one process, fetch="once", fetch="all") refuses an alias that names a
    tensor another shard holds, naming both shards."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", ALIAS_SCRIPT, str(tmp)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3, out.stdout
    for line in lines:
        assert line.startswith("REFUSED"), line
        assert "lm_head.weight is an alias in" in line or "`lm_head.weight` is an alias in" in line, line
        assert "model-00001-of-00002.safetensors" in line, line
