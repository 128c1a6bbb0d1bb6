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
- `load_model(..., process_group=pg, fetch="once")`: every rank of a torch.distributed group
  fetches about 1/W of the model's bytes from storage and the ranks exchange them with
  broadcasts, so every rank ends with the whole model and the store serves it once.
"""

import os

from . import _remote, _turboio
from ._torch import raw_tensors, remove_duplicate_names, select_across, tensors_of, threads


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
    process_group=None,
    fetch="all",
    tensors=None,
    max_host_memory=None,
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

    `fetch="once"` with a torch.distributed `process_group` (every rank calls it; gloo on CPUs,
    NCCL on GPUs): each of the W ranks fetches a contiguous 1/W of the model's bytes (the shards
    taken end to end, headers included) from storage, and the ranks exchange their pieces with
    broadcasts over the group, so every rank ends with the whole model (CPU tensors viewing one
    buffer per shard; CUDA tensors with NCCL) and the store serves each byte once instead of W
    times. Each shard's header and the index are checked as for a normal load, after the
    exchange. `turboio.fetch_report()` gives this rank's bytes fetched from storage and received
    over the group. With a node cache (`cache_dir` or `TURBOIO_CACHE_DIR`), the first rank of each
    host publishes the shards there after the exchange (with NCCL, each shard copied back from
    the GPU to host memory first, one at a time). An object replaced during the load fails
    it on every rank. Not with `use_cipher` (the pieces would travel encrypted); `dtype` and
    `shard_dims` apply after the exchange. Use it when the store, not the network between the
    ranks, is the bottleneck (object storage shared by many nodes); on a local disk each rank
    reading everything is faster.

    `tensors` loads only some tensors (a name or glob pattern, a list of them, or a callable;
    see `turboio.load`): only their bytes are read, shards the index says hold none of them are
    not opened, and a name or pattern that matches no tensor of the model raises `KeyError`
    naming the closest. Not with `fetch="once"`. The memory plan covers the whole model before
    any shard is allocated (`MemoryError` with the numbers; `max_host_memory` a budget), as for
    `turboio.load`.
    """
    import torch

    if fetch not in ("all", "once"):
        raise ValueError(f"fetch must be 'all' or 'once', not {fetch!r}")
    if fetch == "once" and tensors is not None:
        raise ValueError("tensors= cannot be combined with fetch='once' (the ranks exchange whole shards)")
    if fetch == "once":
        if process_group is None:
            raise ValueError("fetch='once' needs a process_group (every rank of it calls load_model)")
        if use_cipher:
            raise ValueError("fetch='once' does not take use_cipher (the exchanged pieces would be encrypted bytes)")

    if (rank is None) != (world_size is None):
        raise ValueError("give both rank and world_size, or neither")
    if world_size is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    path = os.fspath(path)
    from ._dtypes import load_dtype

    def setup():
        if not _remote.is_remote(path) and not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such file or directory")
        return _remote.storage(path, storage_options, cache_dir)

    if fetch == "once":
        # Every step a rank can fail alone joins the ranks' agreement (a rank raising here
        # while the others wait in a collective would block them for the group's timeout).
        out = _load_replicated(path, process_group, setup, threads(num_thread), cache, max_host_memory)
        if dtype is not None:
            from ._dtypes import CASTABLE, torch_dtype

            td = torch_dtype(load_dtype(dtype))
            castable = {torch_dtype(n) for n in CASTABLE}
            out = {k: (v.to(td) if v.dtype in castable else v) for k, v in out.items()}
    else:
        shards = _turboio.load_model(
            path,
            threads=threads(num_thread),
            cache=cache,
            cipher=bool(use_cipher),
            dtype=load_dtype(dtype),
            storage=setup(),
            tensors=tensors,
            max_host_memory=max_host_memory,
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


_last_fetch = {}


def fetch_report():
    """What this rank's last `load_model(..., fetch="once")` did: `{"files", "bytes",
    "fetched_bytes", "received_bytes", "sent_bytes", "world_size", "cached_files"}` (bytes
    fetched from storage, received from other ranks, sent to them by broadcasts this rank was the
    source of; shards this rank published in the node cache)."""
    return dict(_last_fetch)


def _pieces(lens, world, rank):
    """Rank `rank`'s contiguous share of the files taken end to end: [(file, offset, length)]."""
    total = sum(lens)
    share = -(-total // world) if total else 0
    start, end = min(rank * share, total), min((rank + 1) * share, total)
    out, base = [], 0
    for i, n in enumerate(lens):
        lo, hi = max(start, base), min(end, base + n)
        if lo < hi:
            out.append((i, lo - base, hi - lo))
        base += n
    return out


_BUILTIN_ERRORS = {
    e.__name__: e
    for e in (FileNotFoundError, PermissionError, IsADirectoryError, OSError, ValueError, KeyError, TypeError, MemoryError)
}


def _agree(pg, world, step, share=None):
    """Runs this rank's `step()` and agrees on the outcome with every rank of `pg` in one
    `all_gather_object`: returns `(result, [every rank's share])`, or raises on every rank the
    first failing rank's error (`rank R: message`, its type kept for built-in errors) so that no
    rank is left waiting in a later collective for the group's timeout."""
    import torch.distributed as dist

    result, failure = None, None
    try:
        result = step()
    except Exception as e:  # noqa: BLE001 -- every rank raises it below
        failure = (type(e).__name__, str(e))
    gathered = [None] * world
    dist.all_gather_object(gathered, (failure, share), group=pg)
    for r, (f, _) in enumerate(gathered):
        if f is not None:
            raise _BUILTIN_ERRORS.get(f[0], RuntimeError)(f"rank {r}: {f[1]}")
    return result, [sh for _, sh in gathered]


def _load_replicated(path, pg, setup, num_thread, cache, max_host_memory=None):
    import torch
    import torch.distributed as dist

    from ._dtypes import torch_dtype_for, torch_shape

    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    src0 = dist.get_global_rank(pg, 0) if pg is not dist.group.WORLD else 0

    def local_setup():
        storage = setup()
        if storage is None and _remote.is_object_url(path) and os.environ.get("TURBOIO_CACHE_DIR"):
            storage = _turboio.ObjectStorage({})  # the environment's store and node cache
        return storage

    # Agreement 1: this rank's path check and storage, and every rank's request (rank 0's plan
    # serves them all, so every rank must ask for the same model).
    storage, asked = _agree(pg, world, local_setup, share=str(path))
    other = next((r for r, a in enumerate(asked) if a != asked[0]), None)
    if other is not None:
        raise ValueError(
            f"fetch='once': rank {other} asked for {_remote.shown(asked[other])!r} but rank 0 for {_remote.shown(asked[0])!r}; "
            "every rank of the group must load the same model"
        )
    # One plan for every rank: rank 0 resolves the model and the shards' lengths (no shard byte).
    plan = [None]
    if rank == 0:
        try:
            index, shards, weight_map = _turboio._model_files(path, storage=storage)
            versions = [_turboio._file_version(s, storage=storage) for s in shards]
            plan = [("ok", index, shards, weight_map, versions)]
        except Exception as e:  # every rank raises it, not only rank 0
            plan = [("error", type(e).__name__, str(e))]
    dist.broadcast_object_list(plan, src=src0, group=pg)
    if plan[0][0] == "error":
        raise _BUILTIN_ERRORS.get(plan[0][1], RuntimeError)(plan[0][2])
    _, index, shards, weight_map, versions = plan[0]
    lens = [n for n, _ in versions]
    on_gpu = dist.get_backend(pg) == "nccl"

    # Agreement 2: the memory plan every load runs (the whole model in host memory on every
    # rank; on NCCL the shards are in device memory) and the allocation of the shards' buffers,
    # checked by each rank: if one rank's does not fit or fails, every rank raises its error.
    def allocate():
        _turboio._check_host_memory(index or path, 0 if on_gpu else sum(lens), max_host_memory)
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        return [torch.empty(n, dtype=torch.uint8, device=device) for n in lens]

    bufs, _ = _agree(pg, world, allocate)
    # Pieces are read past the node cache (it keeps whole objects only; ranks of one host would
    # otherwise wait on each other's fills of the same shard).
    reader = storage.without_cache() if storage is not None else None
    fetched, failure = 0, None
    try:
        for i, off, n in _pieces(lens, world, rank):
            dst = bufs[i] if not on_gpu else torch.empty(n, dtype=torch.uint8, pin_memory=True)
            at = off if not on_gpu else 0
            fetched += n
            _turboio._read_into(shards[i], [(off, dst.data_ptr() + at, n)], threads=num_thread, cache=cache, storage=reader)
            if on_gpu:
                bufs[i][off : off + n].copy_(dst)
            # Each rank's reads are pinned to the version its open saw: the same as the plan's
            # unless the object was replaced since, which this rank sees now.
            if _turboio._file_version(shards[i], storage=reader) != tuple(versions[i]):
                raise RuntimeError(f"{_remote.shown(shards[i])}: the object changed while the ranks were reading it; load again")
    except Exception as e:  # reported on every rank below, so that none waits in a broadcast
        failure = f"{type(e).__name__}: {e}"
    failures = [None] * world
    dist.all_gather_object(failures, failure, group=pg)
    failed = [(r, f) for r, f in enumerate(failures) if f]
    if failed:
        r, f = failed[0]
        raise RuntimeError(f"fetch='once': rank {r} failed: {f}")
    received = sent = 0
    for r in range(world):
        src = dist.get_global_rank(pg, r) if pg is not dist.group.WORLD else r
        for i, off, n in _pieces(lens, world, r):
            dist.broadcast(bufs[i][off : off + n], src=src, group=pg)
            if r == rank:
                sent += n * (world - 1)
            else:
                received += n
    # With a node cache, the first rank of each host publishes every shard there (all the
    # ranks hold all the bytes now): later loads on the host are local. On NCCL the shards are
    # on the GPU: each is copied back to host memory first, one at a time.
    cached = 0
    if storage is not None and storage.has_cache():
        import socket

        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=pg)
        if hosts.index(hosts[rank]) == rank:
            for shard, (n, tag), buf in zip(shards, versions, bufs):
                if tag is None:
                    continue
                host = buf.cpu() if on_gpu else buf
                if storage._cache_insert(shard, n, tag, host.data_ptr(), n):
                    cached += 1
                del host
    _last_fetch.clear()
    _last_fetch.update(
        files=len(shards),
        bytes=sum(lens),
        fetched_bytes=fetched,
        received_bytes=received,
        sent_bytes=sent,
        world_size=world,
        cached_files=cached,
    )
    out, where, aliased = {}, {}, {}
    for i, (shard, buf) in enumerate(zip(shards, bufs)):
        n = len(buf)
        head = buf[: min(n, 8)].cpu()
        header_len = int.from_bytes(bytes(head.tolist()), "little") if n >= 8 else 0
        prefix = bytes(buf[: min(n, 8 + header_len)].cpu().numpy().tobytes())
        try:
            data_start, _, metadata, infos = _turboio.parse_header(prefix, n)
        except ValueError as e:
            raise ValueError(f"{_remote.shown(shard)}: {e}") from None
        names = {i[0] for i in infos}
        # Aliases in __metadata__ (as load_model returns them): a key that is no tensor of the
        # shard, naming one that is.
        aliases = {k: v for k, v in (metadata or {}).items() if v in names and k not in names}
        for name, dtype, shape, begin, end in infos:
            if name in where:
                raise ValueError(f"{_remote.shown(index or path)}: tensor {name} is in both {_remote.shown(where[name])} and {_remote.shown(shard)}")
            if name in aliased:
                raise ValueError(f"{_remote.shown(index or path)}: {name} is an alias in {_remote.shown(aliased[name])}, but {_remote.shown(shard)} holds a tensor of that name")
            where[name] = shard
            raw = buf[data_start + begin : data_start + end]
            td = torch_dtype_for(dtype, shape)
            if td is None:
                out[name] = raw
                continue
            size = torch.empty((), dtype=td).element_size()
            if raw.data_ptr() % size:
                raw = raw.clone()  # an offset torch cannot view at this dtype: copied, as loads do
            out[name] = raw.view(td).reshape(torch_shape(dtype, shape))
        for alias, target in aliases.items():
            # Aliases are names too: one never replaces another shard's tensor or alias.
            if alias in where:
                raise ValueError(f"{_remote.shown(index or path)}: {alias} is an alias in {_remote.shown(shard)}, but {_remote.shown(where[alias])} holds a tensor of that name")
            if alias in aliased:
                raise ValueError(f"{_remote.shown(index or path)}: {alias} is an alias in two shards: {_remote.shown(aliased[alias])} and {_remote.shown(shard)}")
            aliased[alias] = shard
            out[alias] = out[target]
    if weight_map is not None:
        for name, pos in weight_map.items():
            if where.get(name) != shards[pos]:
                raise ValueError(f"{_remote.shown(index)}: the index puts {name} in {_remote.shown(shards[pos])}, which does not hold it")
        extra = sorted(set(where) - set(weight_map))
        if extra:
            raise ValueError(f"{_remote.shown(index)}: shard tensors the index does not name: {extra[:5]}")
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
    return _save_model_dir(state_dict, dir, max_shard_size, metadata, num_thread, use_cipher, storage_options)


def _save_model_dir(state_dict, dir, max_shard_size, metadata, num_thread, use_cipher, storage_options, shard_of=None):
    """`save_model_dir`; with `shard_of` (`{name: shard number}`, every kept tensor named) the
    shards are those groups, in the order of their numbers, instead of `max_shard_size`'s."""
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
    groups = None
    if shard_of is not None:
        numbers = sorted({shard_of[n] for n in tensors})
        where = {k: i for i, k in enumerate(numbers)}
        groups = [[] for _ in numbers]
        for j, name in enumerate(tensors):
            groups[where[shard_of[name]]].append(j)
    dir = os.fspath(dir)
    index, _shards = _turboio._save_model_dir(
        dir,
        records,
        max_shard_size,
        metadata,
        threads=threads(num_thread),
        cipher=bool(use_cipher),
        storage=_remote.storage(dir, storage_options),
        groups=groups,
    )
    del keep
    return index


def iter_weights(
    files_or_dir,
    device="cpu",
    *,
    storage_options=None,
    cache_dir=None,
    tensors=None,
    window=None,
    num_thread=0,
    cache="auto",
    mode="auto",
):
    """Yields `(name, tensor)` for every tensor of a model directory (or index JSON) or of a list
    of safetensors files, shard by shard, in the shape of vLLM's safetensors weight iterators.
    Each tensor owns a reference to its shard's memory, so it stays valid after the iterator
    moves on (and that memory is freed when the last tensor of the shard is dropped). Paths may
    be object-store URLs (`storage_options` and `cache_dir` as for `turboio.load`).

    `tensors` yields only some tensors (a name or glob pattern, a list of them, or a callable;
    see `turboio.load`), checked against every file given: only their bytes are read.

    `window` (bytes, or a size string such as "512MiB") streams with bounded memory: each shard
    is loaded in groups of consecutive tensors of at most `window` bytes (a larger tensor is a
    group of its own), the next group read while the current one is consumed, so at most two
    groups are held at once, not the model; each tensor owns its group's memory (never a view
    into a reused buffer), which is freed when the group's last tensor is dropped. For engines
    that copy each tensor into their own parameters as it comes.

    `device`: "cpu" (default), or a CUDA device (`"cuda"`, `"cuda:N"`, a `torch.device`), into
    which each shard (or each group, with `window`) is loaded straight through turboio's device
    path, as `turboio.load(map_location="cuda:N")` loads a file: pinned staging buffers (one
    pool, reused from group to group), several copy streams, GPUDirect Storage with
    `TURBOIO_GDS`; the tensors are CUDA tensors viewing their group's device memory, freed with
    the group's last tensor. Without CUDA it raises the `RuntimeError` that names what is
    missing. Another device gets each CPU tensor moved with `.to(device)`.

    `num_thread`, `cache` and `mode` are `turboio.load`'s (readers, the page-cache policy, how
    the bytes are held; `mode` applies to CPU loads)."""
    import torch

    dev = torch.device(device)
    paths = _paths(files_or_dir)
    upload = {}
    if dev.type == "cuda":
        from . import _cuda

        # Checked before anything is read: a machine without CUDA fails here, naming why.
        # Pinned slots from the device's process pool (`turboio.staging_pool`).
        upload = {"device": _cuda.target(dev), "gds": _cuda.gds_setting(), "staging": None}
        mode = "auto"
    move = (lambda t: t) if dev.type in ("cpu", "cuda") else (lambda t: t.to(dev))
    if not upload and window is None and (tensors is None or len(paths) == 1):
        for path in paths:
            storage = _remote.storage(path, storage_options, cache_dir)
            for loaded in _turboio.load_model(
                path, threads=threads(num_thread), cache=cache, mode=mode, storage=storage, tensors=tensors
            ):
                for name, t in tensors_of(loaded).items():
                    yield name, move(t)
        return
    # Every shard's header first (a few KiB each): the selection is checked against all of
    # them, and a window groups each shard's tensors.
    shards = []
    for path in paths:
        storage = _remote.storage(path, storage_options, cache_dir)
        _index, files, _map = _turboio._model_files(path, storage=storage)
        for f in files:
            _start, _len, _meta, infos = _turboio.read_header(f, storage=storage)
            shards.append((f, storage, [(n, e - b) for n, _d, _s, b, e in sorted(infos, key=lambda i: i[3])]))
    if tensors is not None:
        origin = paths[0] if len(paths) == 1 else f"{paths[0]} (and {len(paths) - 1} more)"
        keep = select_across(tensors, {f: [n for n, _ in infos] for f, _s, infos in shards}, origin)
        shards = [(f, st, [(n, size) for n, size in infos if n in keep[f]]) for f, st, infos in shards]
    limit = None if window is None else (_turboio.parse_shard_size(window) if isinstance(window, str) else int(window))
    if limit is not None and limit <= 0:
        raise ValueError(f"window must be a positive number of bytes, not {window!r}")
    groups = []
    for f, storage, infos in shards:
        current, size = [], 0
        for name, n in infos:
            if current and limit is not None and size + n > limit:
                groups.append((f, storage, frozenset(current)))
                current, size = [], 0
            current.append(name)
            size += n
        if current:
            groups.append((f, storage, frozenset(current)))
    if not groups:
        return
    from concurrent.futures import ThreadPoolExecutor

    def load(group):
        f, storage, names = group
        return _turboio.load(
            f, threads=threads(num_thread), cache=cache, mode=mode, storage=storage, tensors=names, **upload
        )

    # The next group is read (GIL released) while the current one is consumed.
    with ThreadPoolExecutor(max_workers=1) as ahead:
        pending = ahead.submit(load, groups[0])
        for i in range(len(groups)):
            loaded = pending.result()
            pending = ahead.submit(load, groups[i + 1]) if i + 1 < len(groups) else None
            out = tensors_of(loaded, aliases=False)
            del loaded
            for name in list(out):
                yield name, move(out.pop(name))
            del out
