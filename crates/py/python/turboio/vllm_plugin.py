"""A vLLM model loader on turboio: `vllm serve MODEL --load-format turboio`, no fork.

The wheel declares an entry point in vLLM's `vllm.general_plugins` group; vLLM calls
`register()` at start-up, which registers the loader under the name "turboio" with vLLM's
`register_model_loader`. The loader subclasses vLLM's `BaseModelLoader`:

- `download_model(model_config)`: a local directory is used as it is, and an object-store
  prefix (`s3://bucket/model`, `gs://...`, `az://...`: vLLM's `model_weights` when it pulled
  the config and tokenizer of an `s3://` model itself, else the model path) is read in place;
  otherwise the safetensors files and JSON of the repository are fetched with
  `huggingface_hub`.
- `load_weights(model, model_config)`: feeds `model.load_weights(...)` with `(name, tensor)`
  pairs from the model's shards (the ones `model.safetensors.index.json` lists when it exists,
  stray files beside them ignored, else every `*.safetensors` file), streamed with bounded
  memory: each shard is read in groups of consecutive tensors of at most `window` bytes, the next
  group read while vLLM copies the current one into its parameters, so at most two groups are
  held in host memory, never the model. Then it checks, as vLLM's default loader does (with
  vLLM's own check where the installed vLLM has it, the same rule otherwise), that every
  parameter of the model was loaded: a checkpoint missing a weight is refused ("Following
  weights were not initialized from checkpoint: {...}") instead of served with an uninitialised
  weight. It logs "Loading weights took N seconds (X GB/s, T tensors)" like vLLM's loader.

Options, from `--model-loader-extra-config '{"num_threads": 8, "cache": "keep"}'`:
`num_threads` (readers; default one per core), `cache` ("auto", "keep" or "bypass"), `mode`
("auto", "mapped", "copied" or "lazy"; "auto" is "lazy" under tensor parallelism for a local
model, so that each rank reads only the pages of the slices its weight loaders take, as vLLM's
own mapped safetensors reader does), `storage_options` (a dict, for object-store models: endpoint,
region, credentials, concurrency, ... as `turboio.load` takes them; the environment otherwise),
`cache_dir` (the node-local cache for object-store models), `fetch` ("all", or "once": with
tensor parallelism, the ranks of vLLM's tensor-parallel group each fetch 1/W of the model from
storage and exchange the pieces over that group's gloo group, so `vllm serve s3://bucket/model
--load-format turboio -tp 2` fetches the model once), `tensors` (a name or glob pattern, or a
list of them: only those tensors are read and fed to vLLM, e.g. a draft model's layers; a
pattern that matches nothing is an error naming the closest tensors), `window` (bytes, or a
size such as "1GiB"; default "256MiB"; 0 loads each shard whole), `enable_weights_track`
(vLLM's own option: true or false forces the loaded-weights check on or off; by default it runs
for unquantized models whose `load_weights` returns the names, as vLLM's does), `upload`
("auto", "device" or "host": where the model's parameters are on a GPU, "auto" loads each group
straight into that GPU through turboio's device path (pinned staging buffers, several copy
streams, GPUDirect Storage with `TURBOIO_GDS`) and vLLM copies GPU to GPU, unless tensor
parallelism, `fetch="once"` or a `mode` asks for host tensors; should that load fail, the rest
come as host tensors, with a warning; "device" insists and fails instead; "host" always hands
vLLM host tensors). Unknown keys are an error, so a typo does not pass silently.

vLLM is not a dependency of the wheel. Everything but the two vLLM classes lives in plain
functions here (`weight_files`, `loader_options`, `weights_iterator`), tested without vLLM.
"""

import glob
import json
import logging
import os
import time

INDEX = "model.safetensors.index.json"
OPTIONS = {
    "num_threads": int,
    "cache": str,
    "mode": str,
    "storage_options": dict,
    "cache_dir": str,
    "fetch": str,
    "tensors": (str, list),
    "window": (str, int),
    "enable_weights_track": bool,
    "upload": str,
}
DEFAULT_WINDOW = "256MiB"

# A child of vLLM's "vllm" logger, so its lines reach vLLM's handlers and format.
logger = logging.getLogger("vllm.turboio")


def _type_name(t):
    names = [x.__name__ for x in (t if isinstance(t, tuple) else (t,))]
    words = {"int": "an integer", "str": "a string", "dict": "a dict", "list": "a list", "bool": "true or false"}
    return " or ".join(words.get(n, n) for n in names)


def weight_files(model_dir):
    """The safetensors files of a model directory: the index's shards (in the order the index
    first names them) when it has one, else every `*.safetensors` file, sorted."""
    index = os.path.join(model_dir, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map in the index")
        seen = []
        for shard in weight_map.values():
            if shard not in seen:
                seen.append(shard)
        return [os.path.join(model_dir, s) for s in seen]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir}: no {INDEX} and no *.safetensors file")
    return files


def loader_options(extra_config):
    """Checks `--model-loader-extra-config` and fills in the defaults."""
    extra = dict(extra_config or {})
    unknown = sorted(set(extra) - set(OPTIONS))
    if unknown:
        raise ValueError(f"turboio loader: unknown option(s) {unknown}; known: {sorted(OPTIONS)}")
    for k, t in OPTIONS.items():
        v = extra.get(k)
        # (True is an int to Python, not to a user.)
        wrong_bool = isinstance(v, bool) and t is not bool
        if k in extra and (wrong_bool or not isinstance(v, t)):
            raise ValueError(f"turboio loader: {k} must be {_type_name(t)}, not {v!r}")
    window = extra.get("window", DEFAULT_WINDOW)
    if isinstance(window, int):
        if window < 0:
            raise ValueError(f"turboio loader: window must be a size in bytes (0: whole shards), not {window!r}")
        window = window or None
    else:
        from . import _turboio

        try:
            _turboio.parse_shard_size(window)
        except (ValueError, TypeError) as e:
            raise ValueError(f"turboio loader: window must be a size such as \"256MiB\", not {window!r} ({e})") from None
    tensors = extra.get("tensors")
    if isinstance(tensors, list) and not (tensors and all(isinstance(x, str) for x in tensors)):
        raise ValueError(f"turboio loader: tensors must be a name, a pattern or a non-empty list of them, not {tensors!r}")
    if tensors is not None and extra.get("fetch", "all") == "once":
        raise ValueError("turboio loader: tensors cannot be combined with fetch once")
    if extra.get("cache", "auto") not in ("auto", "keep", "bypass"):
        raise ValueError(f"turboio loader: cache must be auto, keep or bypass, not {extra['cache']!r}")
    if extra.get("fetch", "all") not in ("all", "once"):
        raise ValueError(f"turboio loader: fetch must be all or once, not {extra['fetch']!r}")
    if extra.get("mode", "auto") not in ("auto", "mapped", "copied", "lazy"):
        raise ValueError(f"turboio loader: mode must be auto, mapped, copied or lazy, not {extra['mode']!r}")
    if extra.get("upload", "auto") not in ("auto", "device", "host"):
        raise ValueError(f"turboio loader: upload must be auto, device or host, not {extra['upload']!r}")
    if extra.get("upload") == "device" and extra.get("fetch", "all") == "once":
        raise ValueError("turboio loader: upload device cannot be combined with fetch once (the group exchanges host tensors)")
    if extra.get("upload") == "device" and extra.get("mode", "auto") != "auto":
        raise ValueError("turboio loader: upload device loads into GPU memory; mode (how host memory holds the bytes) does not apply")
    return {
        "num_threads": extra.get("num_threads", 0),
        "cache": extra.get("cache", "auto"),
        "mode": extra.get("mode", "auto"),
        "storage_options": extra.get("storage_options"),
        "cache_dir": extra.get("cache_dir"),
        "fetch": extra.get("fetch", "all"),
        "tensors": tensors,
        "window": window,
        "enable_weights_track": extra.get("enable_weights_track"),
        "upload": extra.get("upload", "auto"),
    }


def upload_device(options, device):
    """The CUDA device the weights are loaded straight into (turboio's device path), or None
    (host tensors, which vLLM copies into its parameters). `device` is where the model's
    parameters are. "auto" uploads when they are on a GPU and nothing asks for host tensors: no
    tensor parallelism (each rank's weight loaders narrow every tensor to the rank's slice, so
    uploading whole tensors would move W times the bytes over PCIe; the lazy mapping reads only
    the slices), no `fetch="once"` (the group exchanges host tensors), `mode` left at "auto"."""
    upload = options.get("upload", "auto")
    on_gpu = device is not None and getattr(device, "type", str(device).partition(":")[0]) == "cuda"
    if upload == "host":
        return None
    if not on_gpu:
        if upload == "device":
            raise ValueError(
                f"turboio loader: upload is device, but the model's parameters are on {device or 'no device'}, not a GPU"
            )
        return None
    if upload == "device":
        return device
    if options.get("fetch") == "once" or options.get("mode", "auto") != "auto" or _tensor_parallel_size() > 1:
        return None
    return device


def model_device(model):
    """The device of the model's first parameter (None for a model without parameters)."""
    for _name, p in model.named_parameters():
        return p.device
    return None


def weights_iterator(model_dir, options, device=None):
    """`(name, tensor)` for every tensor of the model (the index's shards, or every file),
    streamed in groups of at most `options["window"]` bytes (see `turboio.iter_weights`), or,
    with `fetch="once"` under tensor parallelism, the whole model fetched once by the group;
    tensors stay valid after the iterator moves on. With `device` (where the model's
    parameters are) a CUDA device and `upload_device` agreeing, the groups are loaded straight
    into that GPU and the tensors are CUDA tensors; if that fails with `upload` "auto", the
    failure is logged and the tensors not yet yielded come as host tensors instead."""
    dev = upload_device(options, device)
    if dev is None:
        yield from _host_weights(model_dir, options)
        return
    logger.info(
        "turboio loader: loading the weights straight into %s (turboio's device path; upload=\"host\" "
        "hands vLLM host tensors instead)",
        dev,
    )
    done = set()
    try:
        for name, t in _iter(model_dir, options, options.get("tensors"), device=dev):
            done.add(name)
            yield name, t
        return
    except (RuntimeError, MemoryError) as e:  # the extension's device errors; the GPU too full
        if options.get("upload") == "device":
            raise
        logger.warning(
            "turboio loader: loading the weights into %s failed (%s); the %s are loaded into host memory "
            "(vLLM copies them to the GPU); upload=\"host\" skips the attempt",
            dev,
            e,
            "rest" if done else "weights",
        )
    if not done:
        yield from _host_weights(model_dir, options)
        return
    selection = options.get("tensors")
    # What is left: without a selection, only the tensors not yet yielded are read; with one,
    # its groups are read again and those already yielded skipped.
    rest = (lambda n: n not in done) if selection is None else selection
    try:
        for name, t in _iter(model_dir, options, rest):
            if name not in done:
                yield name, t
    except KeyError:
        if selection is None:
            return  # nothing was left to load
        raise


def _host_weights(model_dir, options):
    from . import _remote

    group = _tensor_parallel_group() if options.get("fetch") == "once" else None
    if group is not None:
        from .models import fetch_report, load_model

        state_dict = load_model(
            model_dir,
            num_thread=options["num_threads"],
            cache=options["cache"],
            storage_options=options.get("storage_options"),
            cache_dir=options.get("cache_dir"),
            process_group=group,
            fetch="once",
        )
        r = fetch_report()
        logger.info(
            "turboio loader: fetch once over the tensor-parallel group of %d ranks: this rank fetched "
            "%.3f GB of the model's %.3f GB from storage and received %.3f GB over the group",
            r.get("world_size", 0),
            r.get("fetched_bytes", 0) / 1e9,
            r.get("bytes", 0) / 1e9,
            r.get("received_bytes", 0) / 1e9,
        )
        yield from state_dict.items()
        return
    mode, window = options.get("mode", "auto"), options.get("window")
    remote = _remote.is_remote(model_dir)
    if mode == "auto" and not remote and options.get("cache", "auto") != "bypass" and _tensor_parallel_size() > 1:
        # Under tensor parallelism each rank's weight loaders narrow every tensor to the rank's
        # slice before copying it: a lazy mapping of each shard reads only the pages they touch
        # (as vLLM's own safetensors reader, a mapping too), not the whole model on every rank,
        # and holds no memory of its own.
        mode, window = "lazy", None
        logger.info("turboio loader: tensor parallel, each rank reads the pages of its slices only (lazy mapping)")
    yield from _iter(model_dir, options, options.get("tensors"), mode=mode, window=window)


def _iter(model_dir, options, tensors, device="cpu", mode=None, window=False):
    """`turboio.iter_weights` over the model's shards with the loader's options."""
    from . import _remote
    from .models import iter_weights

    if _remote.is_remote(model_dir) or os.path.isfile(os.path.join(model_dir, INDEX)):
        # The index (or, for a prefix without one, every *.safetensors object under it).
        sources = model_dir
    else:
        sources = weight_files(model_dir)
    return iter_weights(
        sources,
        device,
        storage_options=options.get("storage_options"),
        cache_dir=options.get("cache_dir"),
        tensors=tensors,
        window=options.get("window") if window is False else window,
        num_thread=options.get("num_threads", 0),
        cache=options.get("cache", "auto"),
        mode=options.get("mode", "auto") if mode is None else mode,
    )


def missing_weights(model, loaded):
    """The parameters of `model` that `loaded` (the names `model.load_weights` returned) leaves
    out, by the rule of vLLM's default loader for unquantized models: every parameter must be
    loaded, except those of modules whose quantization method makes them after loading."""
    want = {name for name, _ in model.named_parameters()}
    got = set(loaded)
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "uses_meta_device", False) or getattr(method, "process_weights_after_loading", None):
            for pname, _ in module.named_parameters():
                got.add(f"{name}.{pname}" if name else pname)
    return want - got


def check_loaded(loader, model, model_config, loaded, enable=None):
    """Refuses a model some of whose parameters the checkpoint did not provide, as vLLM's
    default loader does: by default for unquantized models whose `load_weights` returns the loaded
    names; `enable` (the `enable_weights_track` option) forces it on or off. Uses vLLM's own
    check where the installed vLLM has it, so the rule and the message are vLLM's."""
    quantization = getattr(model_config, "quantization", None)
    if enable is None:
        enable = quantization is None and loaded is not None
    if not enable or loaded is None:
        return
    try:
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        track = DefaultModelLoader.track_weights_loading
    except (ImportError, AttributeError):
        track = None
    if track is not None:
        track(loader, model, set(loaded), quantized=quantization is not None)
        return
    missing = missing_weights(model, loaded)
    if missing:
        raise ValueError(f"Following weights were not initialized from checkpoint: {missing}")


class _Counted:
    """Passes `(name, tensor)` pairs through, counting tensors and bytes."""

    def __init__(self, pairs):
        self.pairs = pairs
        self.tensors = 0
        self.bytes = 0

    def __iter__(self):
        for name, t in self.pairs:
            self.tensors += 1
            self.bytes += t.numel() * t.element_size()
            yield name, t


def _tp_group():
    """vLLM's tensor-parallel group coordinator when there are several ranks, else None."""
    try:
        from vllm.distributed import get_tp_group
    except ImportError:
        return None
    try:
        group = get_tp_group()
    except (AssertionError, RuntimeError):  # not initialised (a single process)
        return None
    if getattr(group, "world_size", 1) <= 1:
        return None
    return group


def _tensor_parallel_group():
    """vLLM's tensor-parallel group's gloo group when there are several ranks, else None."""
    group = _tp_group()
    return None if group is None else getattr(group, "cpu_group", None)


def _tensor_parallel_size():
    """The number of vLLM's tensor-parallel ranks (1 outside a group)."""
    group = _tp_group()
    return 1 if group is None else int(group.world_size)


def _local_dir(model_config, load_config=None):
    from . import _remote

    # vLLM pulls an object-store model's config and tokenizer into a local directory itself and
    # keeps the weights' URL in `model_weights`; the weights are read from there, in place.
    weights = getattr(model_config, "model_weights", None) or ""
    if _remote.is_object_url(weights):
        return weights
    path = model_config.model
    if _remote.is_object_url(path) or os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    return snapshot_download(
        path,
        revision=getattr(model_config, "revision", None),
        cache_dir=getattr(load_config, "download_dir", None),
        allow_patterns=["*.safetensors", "*.json"],
    )


def _check_options_at_parse_time():
    """Makes vLLM's `EngineArgs.create_load_config` (run in the process the user started, when
    the engine's configuration is built, before any worker or engine process exists) check
    turboio's options when `load_format` is "turboio": a bad `--model-loader-extra-config` is
    then an error in the user's terminal within seconds, not in a worker's log after the engine
    started. Installed once; a vLLM without that method is left as it is (the loader checks the
    options again when it is made)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # noqa: BLE001 - any vLLM that lacks it: the loader checks later
        return
    original = getattr(EngineArgs, "create_load_config", None)
    if original is None or getattr(original, "_turboio_checks_options", False):
        return

    def create_load_config(self):
        if str(getattr(self, "load_format", "")).lower() == "turboio":
            loader_options(getattr(self, "model_loader_extra_config", None))
        return original(self)

    create_load_config._turboio_checks_options = True
    create_load_config.__wrapped__ = original
    EngineArgs.create_load_config = create_load_config


def _allow_object_store_models():
    """vLLM (0.32) refuses a model whose weights are on object storage (`vllm serve
    s3://bucket/model`: vLLM pulls the config and tokenizer and keeps the weights' URL in
    `model_weights`) unless `load_format` is one of the loaders it knows can read such a URL
    (Run:ai's, ModelExpress). turboio reads them: with `load_format` "turboio", that one check
    of `VllmConfig.try_verify_and_update_config` is passed by hiding the URL from it for the
    call (the check is the method's only use of it; the URL is back in place when it returns).
    Installed once; a vLLM without that method is left as it is."""
    try:
        from vllm.config.vllm import VllmConfig
    except Exception:  # noqa: BLE001 - another vLLM layout: nothing to pass
        return
    original = getattr(VllmConfig, "try_verify_and_update_config", None)
    if original is None or getattr(original, "_turboio_allows_object_stores", False):
        return

    def try_verify_and_update_config(self):
        from . import _remote

        load, model = getattr(self, "load_config", None), getattr(self, "model_config", None)
        weights = getattr(model, "model_weights", None) or ""
        ours = str(getattr(load, "load_format", "")).lower() == "turboio"
        if not (ours and _remote.is_object_url(weights)):
            return original(self)
        model.model_weights = ""
        try:
            return original(self)
        finally:
            model.model_weights = weights

    try_verify_and_update_config._turboio_allows_object_stores = True
    try_verify_and_update_config.__wrapped__ = original
    VllmConfig.try_verify_and_update_config = try_verify_and_update_config


def register():
    """vLLM's plug-in hook: registers the "turboio" model loader, has vLLM check its options
    when the engine's configuration is built, and lets it serve object-store models."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    _check_options_at_parse_time()
    _allow_object_store_models()

    @register_model_loader("turboio")
    class TurboioModelLoader(BaseModelLoader):
        """Loads the model's safetensors shards with turboio."""

        def __init__(self, load_config):
            super().__init__(load_config)
            self.options = loader_options(getattr(load_config, "model_loader_extra_config", None))

        def download_model(self, model_config):
            _local_dir(model_config, self.load_config)

        def load_weights(self, model, model_config):
            model_dir = _local_dir(model_config, self.load_config)
            start = time.perf_counter()
            weights = _Counted(weights_iterator(model_dir, self.options, model_device(model)))
            loaded = model.load_weights(weights)
            took = time.perf_counter() - start
            logger.info(
                "Loading weights took %.2f seconds (turboio: %.2f GB/s, %d tensors, %.2f GB)",
                took,
                weights.bytes / max(took, 1e-9) / 1e9,
                weights.tensors,
                weights.bytes / 1e9,
            )
            check_loaded(self, model, model_config, loaded, self.options.get("enable_weights_track"))

    return TurboioModelLoader
