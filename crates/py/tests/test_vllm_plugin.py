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
        "window": "256MiB",
        "enable_weights_track": None,
        "upload": "auto",
    }
    assert vllm_plugin.loader_options({"num_threads": 4, "cache": "keep"})["num_threads"] == 4
    assert vllm_plugin.loader_options({"tensors": ["model.layers.0.*"]})["tensors"] == ["model.layers.0.*"]
    assert vllm_plugin.loader_options({"window": 0})["window"] is None, "0: whole shards"
    assert vllm_plugin.loader_options({"mode": "lazy"})["mode"] == "lazy"
    assert vllm_plugin.loader_options({"window": 4096})["window"] == 4096
    assert vllm_plugin.loader_options({"enable_weights_track": False})["enable_weights_track"] is False
    for bad, msg in [
        ({"num_thread": 4}, "unknown option"),
        ({"cache": "never"}, "cache must"),
        ({"num_threads": "4"}, "num_threads must be an integer, not '4'"),
        ({"num_threads": True}, "num_threads must be an integer, not True"),
        ({"storage_options": "endpoint=x"}, "storage_options must be a dict"),
        ({"cache_dir": 3}, "cache_dir must be a string"),
        ({"fetch": "twice"}, "fetch must be all or once"),
        ({"mode": "fast"}, "mode must be auto, mapped, copied or lazy"),
        ({"tensors": 3}, "tensors must be a string or a list"),
        ({"tensors": []}, "tensors must be a name"),
        ({"tensors": "x", "fetch": "once"}, "tensors cannot be combined"),
        ({"window": -1}, "window must be a size in bytes"),
        ({"window": "lots"}, "window must be a size such as"),
        ({"enable_weights_track": "yes"}, "enable_weights_track must be true or false"),
        ({"upload": "gpu"}, "upload must be auto, device or host"),
        ({"upload": "device", "fetch": "once"}, "upload device cannot be combined with fetch once"),
        ({"upload": "device", "mode": "copied"}, "mode .* does not apply"),
    ]:
        with pytest.raises(ValueError, match=msg):
            vllm_plugin.loader_options(bad)


def torch_model(names_and_shapes, quantized_modules=()):
    """A torch module whose parameters carry these dotted names (as a vLLM model's do)."""
    root = torch.nn.Module()
    for name, shape in names_and_shapes.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape), requires_grad=False))
    for q in quantized_modules:
        root.get_submodule(q).quant_method = types.SimpleNamespace(process_weights_after_loading=lambda layer: None)
    return root


class VllmLikeModel:
    """`load_weights` as vLLM models have it: copies each tensor into the parameter of that name
    and returns the set of names loaded."""

    def __init__(self, module):
        self.module = module
        self.got = {}

    def named_parameters(self):
        return self.module.named_parameters()

    def named_modules(self):
        return self.module.named_modules()

    def load_weights(self, weights):
        params = dict(self.module.named_parameters())
        loaded = set()
        for name, t in weights:
            self.got[name] = t.clone()
            if name in params:
                params[name].data = t.to(torch.float32).reshape(params[name].shape).clone()
                loaded.add(name)
        return loaded


def test_missing_weights_follow_vllms_rule():
    m = torch_model({"x.w": (3, 4), "x.b": (4,), "y.w": (2, 2), "q.scale": (1,)}, quantized_modules=["q"])
    assert vllm_plugin.missing_weights(m, {"x.w", "x.b", "y.w"}) == set(), "quantization-made parameters are exempt"
    assert vllm_plugin.missing_weights(m, {"x.w", "y.w"}) == {"x.b"}
    config = types.SimpleNamespace(quantization=None)
    with pytest.raises(ValueError, match=r"Following weights were not initialized from checkpoint: \{'x.b'\}"):
        vllm_plugin.check_loaded(None, m, config, {"x.w", "y.w"})
    vllm_plugin.check_loaded(None, m, config, {"x.w", "y.w"}, enable=False)
    vllm_plugin.check_loaded(None, m, config, None)  # a model that does not track: nothing to check
    vllm_plugin.check_loaded(None, m, types.SimpleNamespace(quantization="fp8"), {"x.w"})  # off by default
    with pytest.raises(ValueError, match="not initialized"):
        vllm_plugin.check_loaded(None, m, types.SimpleNamespace(quantization="fp8"), {"x.w"}, enable=True)


def test_the_window_streams_every_tensor_unchanged(tmp):
    d, ref = model_dir(tmp)
    for window in (1, 0, "1MiB"):
        got = dict(vllm_plugin.weights_iterator(str(d), vllm_plugin.loader_options({"window": window})))
        assert got.keys() == ref.keys(), window
        for k, v in ref.items():
            assert torch.equal(got[k], v), (window, k)


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
    model_config = types.SimpleNamespace(model=str(d), revision=None, quantization=None)
    loader = cls(load_config)

    m = VllmLikeModel(torch_model({k: tuple(v.shape) for k, v in ref.items()}))
    loader.download_model(model_config)
    with caplog_at_info() as records:
        loader.load_weights(m, model_config)
    assert m.got.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(m.got[k], v), k
    took = [r.getMessage() for r in records if "Loading weights took" in r.getMessage()]
    assert len(took) == 1 and "3 tensors" in took[0], took
    with pytest.raises(ValueError, match="unknown option"):
        cls(types.SimpleNamespace(model_loader_extra_config={"bogus": 1}))

    # A checkpoint missing a weight the model has is refused, naming it.
    short = VllmLikeModel(torch_model({**{k: tuple(v.shape) for k, v in ref.items()}, "model.norm.weight": (4,)}))
    with pytest.raises(ValueError, match=r"not initialized from checkpoint: \{'model.norm.weight'\}"):
        loader.load_weights(short, model_config)
    # ... unless the check is turned off, as vLLM's enable_weights_track allows.
    off = cls(types.SimpleNamespace(model_loader_extra_config={"enable_weights_track": False}, download_dir=None))
    off.load_weights(short, model_config)


class caplog_at_info:
    """Collects the records of the plug-in's logger (a child of vLLM's "vllm" logger)."""

    def __enter__(self):
        import logging

        self.records = []
        self.handler = logging.Handler()
        self.handler.emit = self.records.append
        self.logger = logging.getLogger("vllm.turboio")
        self.level = self.logger.level
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        return self.records

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


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

    loader = cls(types.SimpleNamespace(model_loader_extra_config={}, download_dir=None))
    m = VllmLikeModel(torch_model({k: tuple(v.shape) for k, v in ref.items()}))
    loader.load_weights(m, types.SimpleNamespace(model=str(d), revision=None, quantization=None))
    assert m.got.keys() == ref.keys()
    # vLLM's own check refuses a checkpoint missing a weight.
    short = VllmLikeModel(torch_model({**{k: tuple(v.shape) for k, v in ref.items()}, "model.norm.weight": (4,)}))
    with pytest.raises(ValueError, match="Following weights were not initialized from checkpoint"):
        loader.load_weights(short, types.SimpleNamespace(model=str(d), revision=None, quantization=None))


@pytest.mark.skipif(not __import__("os").environ.get("TURBOIO_REAL_VLLM"), reason="needs the real vLLM: cargo xtask test --vllm")
def test_real_vllm_checks_options_when_its_configuration_is_built():
    """A bad option fails in `EngineArgs.create_load_config`, in the user's process, before any
    engine or worker starts; other load formats and good options pass through unchanged."""
    from vllm.engine.arg_utils import EngineArgs

    vllm_plugin.register()
    vllm_plugin.register()  # idempotent: one wrapper
    wrapped = EngineArgs.create_load_config
    assert wrapped._turboio_checks_options and not getattr(wrapped.__wrapped__, "_turboio_checks_options", False)
    args = EngineArgs(model="m", load_format="turboio", model_loader_extra_config={"num_threads": "eight"})
    with pytest.raises(ValueError, match="num_threads must be an integer, not 'eight'"):
        args.create_load_config()
    args = EngineArgs(model="m", load_format="turboio", model_loader_extra_config={"bogus": 1})
    with pytest.raises(ValueError, match="bogus"):
        args.create_load_config()
    ok = EngineArgs(model="m", load_format="turboio", model_loader_extra_config={"num_threads": 2})
    assert ok.create_load_config().model_loader_extra_config == {"num_threads": 2}
    other = EngineArgs(model="m", load_format="auto", model_loader_extra_config={"bogus": 1})
    assert other.create_load_config().load_format == "auto"


def test_object_store_models_pass_vllms_load_format_check(monkeypatch):
    """vLLM 0.32's `VllmConfig.try_verify_and_update_config` refuses weights on object storage
    unless the load format is Run:ai's (or ModelExpress); the plug-in lets "turboio" through that
    one check and nothing else: the URL is back after the call, other formats are still refused,
    and installing twice wraps once. (A stand-in with vLLM's rule; the real vLLM runs it in
    `test_vllm_real.py::test_an_s3_model_on_two_ranks_is_fetched_once`.)"""

    class VllmConfig:
        def __init__(self, load_format, weights):
            self.load_config = types.SimpleNamespace(load_format=load_format)
            self.model_config = types.SimpleNamespace(model_weights=weights)

        def try_verify_and_update_config(self):
            w = self.model_config.model_weights
            self.seen = w
            if w.startswith(("s3://", "gs://", "az://")) and self.load_config.load_format not in (
                "modelexpress",
                "runai_streamer",
                "runai_streamer_sharded",
            ):
                raise ValueError("To load a model from object storage (S3/GCS/Azure), 'load_format' must be ...")

    mod = types.ModuleType("vllm.config.vllm")
    mod.VllmConfig = VllmConfig
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.config", types.ModuleType("vllm.config"))
    monkeypatch.setitem(sys.modules, "vllm.config.vllm", mod)
    vllm_plugin._allow_object_store_models()
    vllm_plugin._allow_object_store_models()
    assert not getattr(VllmConfig.try_verify_and_update_config.__wrapped__, "_turboio_allows_object_stores", False)
    c = VllmConfig("turboio", "s3://models/llama")
    c.try_verify_and_update_config()
    assert c.seen == "" and c.model_config.model_weights == "s3://models/llama"
    with pytest.raises(ValueError, match="object storage"):
        VllmConfig("auto", "s3://models/llama").try_verify_and_update_config()
    local = VllmConfig("turboio", "")
    local.try_verify_and_update_config()
    assert local.seen == ""
    # An error of the check's method leaves the URL in place too.
    def failing(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(VllmConfig, "try_verify_and_update_config", failing)
    vllm_plugin._allow_object_store_models()
    c = VllmConfig("turboio", "gs://b/m")
    with pytest.raises(RuntimeError, match="boom"):
        c.try_verify_and_update_config()
    assert c.model_config.model_weights == "gs://b/m"


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


def _read_bytes():
    """Bytes this process has had read from storage (`/proc/self/io`)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def _evict(paths):
    import os

    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_tensor_parallel_ranks_read_only_their_slices(tmp, monkeypatch):
    """Under tensor parallelism (vLLM's group stubbed at 2 ranks) the iterator reads nothing
    itself: a rank reads only the pages its weight loaders touch (narrow to its half, then
    copy), no more than vLLM's own reader (safetensors' mapping) reads for the same slices. How
    much that is depends on the device's read-ahead (8 MiB here reads nearly all of it for
    both); a single rank streams every byte, so the measure can tell the two apart."""
    d = tmp / "tp"
    d.mkdir()
    ref = {f"layers.{i}.w": torch.randn(1024, 1024) for i in range(8)}
    files = []
    for s in range(2):
        f = d / f"model-0000{s + 1}-of-00002.safetensors"
        st.save_file({k: v for i, (k, v) in enumerate(ref.items()) if i % 2 == s}, f)
        files.append(str(f))
    total = sum(v.numel() * 4 for v in ref.values())
    opts = vllm_plugin.loader_options(None)

    def rank0_slices(pairs):
        # What a column-parallel weight loader does on rank 0 of 2: narrow, then copy.
        return {name: t.narrow(0, 0, t.shape[0] // 2).clone() for name, t in pairs}

    def measured(pairs_fn):
        _evict(files)
        before = _read_bytes()
        got = rank0_slices(pairs_fn())
        return got, _read_bytes() - before

    def safetensors_reader():
        for f in files:
            with st.safe_open(f, "pt") as h:
                for k in h.keys():
                    yield k, h.get_tensor(k)

    whole, n_whole = measured(lambda: vllm_plugin.weights_iterator(str(d), opts))
    if n_whole == 0:
        pytest.skip("this file system does not count reads in /proc/self/io")
    assert n_whole >= 0.95 * total, "one rank reads the whole model"
    fake = types.ModuleType("vllm.distributed")
    fake.get_tp_group = lambda: types.SimpleNamespace(world_size=2, cpu_group=None)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", fake)
    _evict(files)
    before = _read_bytes()
    held = list(vllm_plugin.weights_iterator(str(d), opts))
    assert _read_bytes() - before <= len(files) << 20, "the iterator itself reads headers only"
    del held
    got, n_ours = measured(lambda: vllm_plugin.weights_iterator(str(d), opts))
    _, n_theirs = measured(safetensors_reader)
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v[:512]), k
        assert torch.equal(whole[k], v[:512]), k
    assert n_ours <= 1.1 * n_theirs + (1 << 20), (n_ours, n_theirs)


class StubbedCuda:
    """The extension as a GPU machine has it, for the plug-in's device path without a GPU:
    loads asked for a CUDA device are recorded and done on the CPU (the bytes are the same);
    with `fail_after`, device loads after that many raise as a failing GPU load would."""

    def __init__(self, real, fail_after=None, error=RuntimeError):
        self.real, self.fail_after, self.error, self.calls = real, fail_after, error, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def load(self, path, **kw):
        device = kw.pop("device", "cpu")
        staging, gds = kw.pop("staging", None), kw.pop("gds", None)
        self.calls.append({"device": device, "staging": staging, "gds": gds, "mode": kw.get("mode"), "names": kw.get("tensors")})
        if device != "cpu" and self.fail_after is not None and len(self.calls) > self.fail_after:
            raise self.error(f"turboio: {device}: out of memory (stub)")
        return self.real.load(path, **kw)


@pytest.fixture
def stub_cuda(monkeypatch):
    from turboio import _cuda, models

    monkeypatch.setattr(_cuda, "target", lambda d: f"cuda:{torch.device(d).index or 0}")

    def install(**kw):
        stub = StubbedCuda(models._turboio, **kw)
        monkeypatch.setattr(models, "_turboio", stub)
        return stub

    return install


def test_upload_goes_to_the_gpu_only_where_nothing_asks_for_host_tensors(monkeypatch):
    gpu, cpu = torch.device("cuda", 1), torch.device("cpu")
    opts = vllm_plugin.loader_options
    assert vllm_plugin.upload_device(opts(None), gpu) == gpu
    assert vllm_plugin.upload_device(opts(None), cpu) is None
    assert vllm_plugin.upload_device(opts(None), None) is None
    assert vllm_plugin.upload_device(opts({"upload": "host"}), gpu) is None
    assert vllm_plugin.upload_device(opts({"mode": "copied"}), gpu) is None, "a host mode asked for"
    assert vllm_plugin.upload_device(opts({"fetch": "once"}), gpu) is None, "the group exchanges host tensors"
    assert vllm_plugin.upload_device(opts({"upload": "device"}), gpu) == gpu
    with pytest.raises(ValueError, match="upload is device, but the model's parameters are on cpu"):
        vllm_plugin.upload_device(opts({"upload": "device"}), cpu)
    assert vllm_plugin.model_device(torch_model({"a.w": (2,)})) == cpu
    assert vllm_plugin.model_device(torch.nn.Module()) is None
    # Under tensor parallelism whole tensors would cross PCIe on every rank: host tensors.
    fake = types.ModuleType("vllm.distributed")
    fake.get_tp_group = lambda: types.SimpleNamespace(world_size=2, cpu_group=None)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", fake)
    assert vllm_plugin.upload_device(opts(None), gpu) is None
    assert vllm_plugin.upload_device(opts({"upload": "device"}), gpu) == gpu


@pytest.mark.parametrize("window", [1, 0])
def test_a_gpu_model_gets_its_weights_through_the_device_path(tmp, stub_cuda, window):
    d, ref = model_dir(tmp)
    stub = stub_cuda()
    opts = vllm_plugin.loader_options({"window": window})
    with caplog_at_info() as records:
        got = dict(vllm_plugin.weights_iterator(str(d), opts, torch.device("cuda", 0)))
    said = [r.getMessage() for r in records]
    assert any("straight into cuda:0 (turboio's device path" in m for m in said), said
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    assert stub.calls and all(c["device"] == "cuda:0" for c in stub.calls), stub.calls
    # Every group's slots come from the device's process pool: no pool of its own per shard.
    assert all(c["staging"] is None for c in stub.calls), "the device's process pool"
    # window 1: a group per tensor; 0: a group per shard (the index's two, not the stray file).
    assert len(stub.calls) == (3 if window else 2)


@pytest.mark.parametrize("error", [RuntimeError, MemoryError])
def test_a_failing_gpu_load_hands_over_the_rest_as_host_tensors(tmp, stub_cuda, error):
    d, ref = model_dir(tmp)
    stub = stub_cuda(fail_after=1, error=error)
    opts = vllm_plugin.loader_options({"window": 1})
    with caplog_at_info() as records:
        got = list(vllm_plugin.weights_iterator(str(d), opts, torch.device("cuda", 0)))
    names = [n for n, _ in got]
    assert sorted(names) == sorted(ref), "every tensor exactly once"
    for n, t in got:
        assert torch.equal(t, ref[n]), n
    first = stub.calls[0]["names"]
    host = [c for c in stub.calls if c["device"] == "cpu"]
    assert host and all(not (c["names"] & first) for c in host), "what reached vLLM is not read again"
    warned = [r.getMessage() for r in records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "out of memory (stub)" in warned[0] and "the rest are loaded into host memory" in warned[0]

    # At the first group: everything comes from the host path.
    stub = stub_cuda(fail_after=0, error=error)
    got = dict(vllm_plugin.weights_iterator(str(d), opts, torch.device("cuda", 0)))
    assert got.keys() == ref.keys()
    # "device" insists: the failure is the answer.
    stub = stub_cuda(fail_after=0, error=error)
    with pytest.raises(error, match="out of memory"):
        list(vllm_plugin.weights_iterator(str(d), vllm_plugin.loader_options({"upload": "device"}), torch.device("cuda", 0)))
