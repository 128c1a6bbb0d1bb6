"""Whole models: sharded checkpoint directories (`model.safetensors.index.json` + shards).

- `load_model(path, device="cpu", rank=None, world_size=None, shard_dims=None)`: a file, a
  model directory or its index JSON, loaded as one job (every shard validated and the index
  checked against the shards' headers first, then all shards read in one pipeline); with
  `rank`/`world_size`, each tensor named in `shard_dims` comes back as this rank's block.
- `save_model_dir(state_dict, dir, max_shard_size="5GB", metadata=None)`: shards named as
  `transformers`' `save_pretrained` names them plus the index, written atomically as a set (a
  crash at any point leaves the old model or the new one, never a mix).
- `iter_weights(files_or_dir, device="cpu")`: `(name, tensor)` pairs, shard by shard, as
  serving engines' weight iterators yield them.
"""

import os

from . import _remote, _turboio
from ._torch import raw_tensors, remove_duplicate_names, tensors_of, threads


def _paths(files_or_dir):
    if isinstance(files_or_dir, (str, os.PathLike)):
        return [os.fspath(files_or_dir)]
    return [os.fspath(f) for f in files_or_dir]


def _block(t, dim, rank, world_size):
    """Rank `rank`'s block of `t` along `dim`: fastsafetensors' split (blocks of
    ceil(size / world_size); the last may be short or empty)."""
    size = t.shape[dim]
    step = -(-size // world_size)
    start = min(rank * step, size)
    return t.narrow(dim, start, min(step, size - start))


def load_model(
    path,
    device="cpu",
    rank=None,
    world_size=None,
    shard_dims=None,
    *,
    num_thread=0,
    cache="auto",
    use_cipher=False,
    dtype=None,
    storage_options=None,
    cache_dir=None,
):
    """Loads a whole model into a dict of tensors: `path` is a safetensors file, a directory of
    shards (with or without `model.safetensors.index.json`), or the index JSON itself.

    Every shard is opened and validated, and the index checked against the shards' headers
    (a tensor it names that no shard holds, a missing shard, a tensor in two shards, a shard
    tensor it does not name: `ValueError` naming the index), before any tensor byte is read;
    then all shards are read in one pipeline over all cores. Tensors are zero-copy views of the
    shards' loads (mapped from the page cache where possible).

    `rank` and `world_size` with `shard_dims` (`{name: dim}`) give each rank its block of those
    tensors along `dim` (fastsafetensors' split); other tensors come back whole. `device` other
    than "cpu" moves the tensors there after the load. `dtype` (e.g. `torch.bfloat16`) converts
    every floating tensor on the way in, as `turboio.load` does.

    `path` may be an object-store URL: `s3://bucket/models/llama` is the model under that key
    prefix (its index, else every `*.safetensors` object directly under it); `storage_options`
    and `cache_dir` (the node-local cache) as for `turboio.load`.
    """
    import torch

    if (rank is None) != (world_size is None):
        raise ValueError("give both rank and world_size, or neither")
    if world_size is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    path = os.fspath(path)
    if not _remote.is_remote(path) and not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    from ._dtypes import load_dtype

    shards = _turboio.load_model(
        path,
        threads=threads(num_thread),
        cache=cache,
        cipher=bool(use_cipher),
        dtype=load_dtype(dtype),
        storage=_remote.storage(path, storage_options, cache_dir),
    )
    out = {}
    for loaded in shards:
        out.update(tensors_of(loaded))
    if shard_dims:
        missing = sorted(set(shard_dims) - set(out))
        if missing:
            raise KeyError(f"{path}: shard_dims names tensors the model does not hold: {missing}")
        if world_size is not None:
            for name, dim in shard_dims.items():
                out[name] = _block(out[name], dim, rank, world_size)
    dev = torch.device(device)
    if dev.type != "cpu":
        out = {k: v.to(dev) for k, v in out.items()}
    return out


def save_model_dir(
    state_dict, dir, max_shard_size="5GB", metadata=None, *, num_thread=0, use_cipher=False, storage_options=None
):
    """Saves a dict of tensors as a sharded model directory: shards of at most `max_shard_size`
    (`"5GB"`, `"500MB"`, `"2GiB"` or a byte count; a larger tensor gets a shard of its own)
    named `model-0000N-of-0000M.safetensors`, and `model.safetensors.index.json` (`metadata`
    with `total_size`, and `weight_map`), as `transformers`' `save_pretrained` writes them.

    Atomic as a set: new shards never overwrite the ones the current index names (they get a
    tagged name when the plain one is taken), the index is written last (its rename is the
    commit point), and the old set is removed after. A crash at any point leaves a directory
    that loads as the old model or the new one. Tensors sharing memory are stored once (the
    other names are dropped, as `safetensors.torch.save_model` does). Returns the index's path.

    `dir` may be an object-store prefix (`s3://bucket/models/run1`): the same protocol, with
    each shard a multipart upload visible only when complete and the index the commit point
    (`storage_options` as for `turboio.load`).
    """
    if isinstance(max_shard_size, str):
        max_shard_size = _turboio.parse_shard_size(max_shard_size)
    if not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ValueError(f"max_shard_size must be a size such as '5GB' or a positive byte count, not {max_shard_size!r}")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must be a dict of str to str")
    tensors = dict(state_dict)
    for kept, dropped in remove_duplicate_names(tensors).items():
        for name in dropped:
            del tensors[name]
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    records, keep = raw_tensors(tensors)
    dir = os.fspath(dir)
    index, _shards = _turboio._save_model_dir(
        dir,
        records,
        max_shard_size,
        metadata,
        threads=threads(num_thread),
        cipher=bool(use_cipher),
        storage=_remote.storage(dir, storage_options),
    )
    del keep
    return index


def iter_weights(files_or_dir, device="cpu", *, storage_options=None, cache_dir=None):
    """Yields `(name, tensor)` for every tensor of a model directory (or index JSON) or of a list
    of safetensors files, shard by shard, in the shape of vLLM's safetensors weight iterators.
    Each tensor owns a reference to its shard's memory, so it stays valid after the iterator
    moves on (and that memory is freed when the last tensor of the shard is dropped). Paths may
    be object-store URLs (`storage_options` and `cache_dir` as for `turboio.load`)."""
    import torch

    dev = torch.device(device)
    for path in _paths(files_or_dir):
        storage = _remote.storage(path, storage_options, cache_dir)
        for loaded in _turboio.load_model(path, threads=threads(0), storage=storage):
            for name, t in tensors_of(loaded).items():
                yield name, (t if dev.type == "cpu" else t.to(dev))
