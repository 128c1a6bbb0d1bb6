"""The vLLM plug-in without vLLM: file selection, options, the iterator, and the registration
against a stand-in of vLLM's two classes. `cargo xtask test --vllm` also runs the last test
against the real vLLM, in a venv of its own."""

import json
import sys
import types

import pytest
import safetensors.torch as st
import torch

from turboio import vllm_plugin


def model_dir(tmp):
    d = tmp / "m"
    d.mkdir()
    a = {"x.w": torch.randn(3, 4), "x.b": torch.randn(4)}
    b = {"y.w": torch.randn(2, 2).to(torch.bfloat16)}
    st.save_file(a, d / "model-00001-of-00002.safetensors")
    st.save_file(b, d / "model-00002-of-00002.safetensors")
    st.save_file({"stray": torch.zeros(1)}, d / "consolidated.safetensors")
    wm = {**{k: "model-00001-of-00002.safetensors" for k in a}, **{k: "model-00002-of-00002.safetensors" for k in b}}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return d, {**a, **b}


def test_files_follow_the_index_and_ignore_strays(tmp):
    d, _ = model_dir(tmp)
    assert [p.split("/")[-1] for p in vllm_plugin.weight_files(str(d))] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    (d / "model.safetensors.index.json").unlink()
    assert len(vllm_plugin.weight_files(str(d))) == 3


def test_options_are_checked():
    assert vllm_plugin.loader_options(None) == {
        "num_threads": 0,
        "cache": "auto",
        "mode": "auto",
        "storage_options": None,
        "cache_dir": None,
        "fetch": "all",
        "tensors": None,
    }
    assert vllm_plugin.loader_options({"num_threads": 4, "cache": "keep"})["num_threads"] == 4
    assert vllm_plugin.loader_options({"tensors": ["model.layers.0.*"]})["tensors"] == ["model.layers.0.*"]
    for bad, msg in [
        ({"num_thread": 4}, "unknown option"),
        ({"cache": "never"}, "cache must"),
        ({"num_threads": "4"}, "must be a int"),
        ({"storage_options": "endpoint=x"}, "storage_options must be a dict"),
        ({"cache_dir": 3}, "cache_dir must be a str"),
        ({"fetch": "twice"}, "fetch must be all or once"),
        ({"tensors": 3}, "tensors must be a str or list"),
        ({"tensors": []}, "tensors must be a name"),
        ({"tensors": "x", "fetch": "once"}, "tensors cannot be combined"),
    ]:
        with pytest.raises(ValueError, match=msg):
            vllm_plugin.loader_options(bad)


def test_registered_loader_feeds_model_load_weights(tmp, monkeypatch):
    d, ref = model_dir(tmp)
    registry = {}

    class BaseModelLoader:
        def __init__(self, load_config):
            self.load_config = load_config

    def register_model_loader(name):
        def deco(cls):
            registry[name] = cls
            return cls

        return deco

    loader_mod = types.ModuleType("vllm.model_executor.model_loader")
    loader_mod.register_model_loader = register_model_loader
    base_mod = types.ModuleType("vllm.model_executor.model_loader.base_loader")
    base_mod.BaseModelLoader = BaseModelLoader
    for name, mod in {
        "vllm": types.ModuleType("vllm"),
        "vllm.model_executor": types.ModuleType("vllm.model_executor"),
        "vllm.model_executor.model_loader": loader_mod,
        "vllm.model_executor.model_loader.base_loader": base_mod,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)

    cls = vllm_plugin.register()
    assert registry["turboio"] is cls and issubclass(cls, BaseModelLoader)
    load_config = types.SimpleNamespace(model_loader_extra_config={"num_threads": 2}, download_dir=None)
    model_config = types.SimpleNamespace(model=str(d), revision=None)
    loader = cls(load_config)

    class Model:
        def load_weights(self, weights):
            self.got = dict(weights)

    m = Model()
    loader.download_model(model_config)
    loader.load_weights(m, model_config)
    assert m.got.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(m.got[k], v), k
    with pytest.raises(ValueError, match="unknown option"):
        cls(types.SimpleNamespace(model_loader_extra_config={"bogus": 1}))


def test_object_store_models_are_read_in_place(tmp):
    """`vllm serve s3://bucket/model`: vLLM keeps the weights' URL in `model_weights` (its own
    copy of the config lives in a local directory); the plug-in reads the shards from the bucket."""
    pytest.importorskip("moto")
    from test_object import Server

    d, ref = model_dir(tmp)
    server = Server()
    try:
        server.client.create_bucket(Bucket="vllm-models")
        for f in d.iterdir():
            server.client.upload_file(str(f), "vllm-models", f"llama/{f.name}")
        url = "s3://vllm-models/llama"
        config = types.SimpleNamespace(model=str(tmp), model_weights=url, revision=None)
        assert vllm_plugin._local_dir(config) == url
        cache = tmp / "node-cache"
        options = vllm_plugin.loader_options({"storage_options": server.options, "cache_dir": str(cache)})
        for _ in range(2):  # the second time from the node cache
            got = dict(vllm_plugin.weights_iterator(url, options))
            assert got.keys() == ref.keys(), "the index's shards, not the stray file"
            for k, v in ref.items():
                assert torch.equal(got[k], v), k
        assert any(p.name.endswith(".data") for p in cache.iterdir()), "the shards went through the cache"
    finally:
        server.stop()


def test_the_wheel_declares_the_entry_point():
    import importlib.metadata

    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "turboio" and ep.value == "turboio.vllm_plugin:register" for ep in eps)


@pytest.mark.skipif(not __import__("os").environ.get("TURBOIO_REAL_VLLM"), reason="needs the real vLLM: cargo xtask test --vllm")
def test_real_vllm_registers_the_loader(tmp):
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    cls = vllm_plugin.register()
    assert issubclass(cls, BaseModelLoader)
    d, ref = model_dir(tmp)

    class Model:
        def load_weights(self, weights):
            self.got = dict(weights)

    loader = cls(types.SimpleNamespace(model_loader_extra_config={}, download_dir=None))
    m = Model()
    loader.load_weights(m, types.SimpleNamespace(model=str(d), revision=None))
    assert m.got.keys() == ref.keys()


def _tp_worker(rank, world, d, url, options):
    import torch.distributed as dist

    import turboio

    dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=rank, world_size=world)
    # vLLM's tensor-parallel group, as the plug-in finds it (vllm.distributed.get_tp_group).
    fake = types.ModuleType("vllm.distributed")
    fake.get_tp_group = lambda: types.SimpleNamespace(world_size=world, cpu_group=dist.group.WORLD)
    sys.modules["vllm"] = types.ModuleType("vllm")
    sys.modules["vllm.distributed"] = fake
    opts = vllm_plugin.loader_options({"storage_options": options, "fetch": "once"})
    got = dict(vllm_plugin.weights_iterator(url, opts))
    with open(f"{d}/tp{rank}.json", "w") as f:
        json.dump({"names": sorted(got), "sums": {k: float(v.double().sum()) for k, v in got.items()}, "report": turboio.fetch_report()}, f)
    dist.barrier()
    dist.destroy_process_group()


def test_fetch_once_uses_the_tensor_parallel_group(tmp):
    import torch.multiprocessing as mp

    from test_object import Server

    d, ref = model_dir(tmp)
    server = Server()
    try:
        server.client.create_bucket(Bucket="vllm-tp")
        for f in d.iterdir():
            server.client.upload_file(str(f), "vllm-tp", f"llama/{f.name}")
        run = tmp / "tp"
        run.mkdir()
        mp.spawn(_tp_worker, args=(2, str(run), "s3://vllm-tp/llama", server.options), nprocs=2, join=True)
        total = 0
        for r in range(2):
            res = json.loads((run / f"tp{r}.json").read_text())
            assert res["names"] == sorted(ref)
            for k, v in ref.items():
                assert res["sums"][k] == pytest.approx(float(v.double().sum())), k
            total += res["report"]["fetched_bytes"]
            assert res["report"]["received_bytes"] > 0
        assert total == res["report"]["bytes"], "the two ranks fetched the model once between them"
    finally:
        server.stop()


def test_the_tensors_option_feeds_only_the_selection(tmp):
    d, ref = model_dir(tmp)
    names = sorted(ref)
    keep = names[:2]
    got = dict(vllm_plugin.weights_iterator(str(d), vllm_plugin.loader_options({"tensors": keep})))
    assert sorted(got) == keep
    for k in keep:
        assert torch.equal(got[k], ref[k])
    with pytest.raises(KeyError, match="no tensor matches"):
        dict(vllm_plugin.weights_iterator(str(d), vllm_plugin.loader_options({"tensors": ["no.such.weight"]})))
