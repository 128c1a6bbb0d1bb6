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
  pairs from the model's shards: the ones `model.safetensors.index.json` lists when it exists
  (stray files beside them are ignored), else every `*.safetensors` file; the whole set is
  loaded as one turboio job (every shard validated first, then read in one pipeline).

Options, from `--model-loader-extra-config '{"num_threads": 8, "cache": "keep"}'`:
`num_threads` (readers; default one per core), `cache` ("auto", "keep" or "bypass"), `mode`
("auto", "mapped" or "copied"), `storage_options` (a dict, for object-store models: endpoint,
region, credentials, concurrency, ... as `turboio.load` takes them; the environment otherwise),
`cache_dir` (the node-local cache for object-store models), `fetch` ("all", or "once": with
tensor parallelism, the ranks of vLLM's tensor-parallel group each fetch 1/W of the model from
storage and exchange the pieces over that group's gloo group, so `vllm serve s3://bucket/model
--load-format turboio -tp 2` fetches the model once), `tensors` (a name or glob pattern, or a
list of them: only those tensors are read and fed to vLLM, e.g. a draft model's layers; a
pattern that matches nothing is an error naming the closest tensors). Unknown keys are an
error, so a typo does not pass silently.

vLLM is not a dependency of the wheel. Everything but the two vLLM classes lives in plain
functions here (`weight_files`, `loader_options`, `weights_iterator`), tested without vLLM.
"""

import glob
import json
import os

INDEX = "model.safetensors.index.json"
OPTIONS = {
    "num_threads": int,
    "cache": str,
    "mode": str,
    "storage_options": dict,
    "cache_dir": str,
    "fetch": str,
    "tensors": (str, list),
}


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
        if k in extra and not isinstance(extra[k], t):
            kind = " or ".join(x.__name__ for x in t) if isinstance(t, tuple) else t.__name__
            raise ValueError(f"turboio loader: {k} must be a {kind}, not {extra[k]!r}")
    tensors = extra.get("tensors")
    if isinstance(tensors, list) and not (tensors and all(isinstance(x, str) for x in tensors)):
        raise ValueError(f"turboio loader: tensors must be a name, a pattern or a non-empty list of them, not {tensors!r}")
    if tensors is not None and extra.get("fetch", "all") == "once":
        raise ValueError("turboio loader: tensors cannot be combined with fetch once")
    if extra.get("cache", "auto") not in ("auto", "keep", "bypass"):
        raise ValueError(f"turboio loader: cache must be auto, keep or bypass, not {extra['cache']!r}")
    if extra.get("fetch", "all") not in ("all", "once"):
        raise ValueError(f"turboio loader: fetch must be all or once, not {extra['fetch']!r}")
    if extra.get("mode", "auto") not in ("auto", "mapped", "copied"):
        raise ValueError(f"turboio loader: mode must be auto, mapped or copied, not {extra['mode']!r}")
    return {
        "num_threads": extra.get("num_threads", 0),
        "cache": extra.get("cache", "auto"),
        "mode": extra.get("mode", "auto"),
        "storage_options": extra.get("storage_options"),
        "cache_dir": extra.get("cache_dir"),
        "fetch": extra.get("fetch", "all"),
        "tensors": tensors,
    }


def weights_iterator(model_dir, options):
    """`(name, tensor)` for every tensor of the model (the index's shards, or every file),
    loaded as one job; tensors stay valid after the iterator moves on."""
    from . import _remote, _turboio
    from ._torch import tensors_of, threads

    group = _tensor_parallel_group() if options.get("fetch") == "once" else None
    if group is not None:
        from .models import load_model

        yield from load_model(
            model_dir,
            num_thread=options["num_threads"],
            cache=options["cache"],
            storage_options=options.get("storage_options"),
            cache_dir=options.get("cache_dir"),
            process_group=group,
            fetch="once",
        ).items()
        return
    storage = _remote.storage(model_dir, options.get("storage_options"), options.get("cache_dir"))
    index = os.path.join(model_dir, INDEX)
    if _remote.is_remote(model_dir) or os.path.isfile(index):
        # One job: the index (or, for a prefix without one, every *.safetensors object under it).
        sources = [model_dir]
    else:
        sources = weight_files(model_dir)
    tensors = options.get("tensors")
    if tensors is not None and len(sources) > 1:
        # Several files without an index: the selection is checked against all of them.
        from .models import iter_weights

        yield from iter_weights(
            sources, storage_options=options.get("storage_options"), cache_dir=options.get("cache_dir"), tensors=tensors
        )
        return
    for source in sources:
        for loaded in _turboio.load_model(
            source,
            threads=threads(options["num_threads"]),
            cache=options["cache"],
            mode=options["mode"],
            storage=storage,
            tensors=tensors,
        ):
            yield from tensors_of(loaded).items()


def _tensor_parallel_group():
    """vLLM's tensor-parallel group's gloo group when there are several ranks, else None."""
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
    return getattr(group, "cpu_group", None)


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


def register():
    """vLLM's plug-in hook: registers the "turboio" model loader."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

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
            model.load_weights(weights_iterator(model_dir, self.options))

    return TurboioModelLoader
