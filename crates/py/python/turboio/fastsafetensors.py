"""A drop-in for fastsafetensors' loader API (`SafeTensorsFileLoader`, `SingleGroup`,
`fastsafe_open`), on turboio's loader.

Differences that make it safer: tensors keep their memory alive (no use-after-free after
`close()`: `close()` only drops this loader's references), and files are validated with the
reference safetensors rules.

Several ranks (a real `torch.distributed` process group; SPMD: every rank makes the same calls
in the same order), two ways to shard, chosen with `shard_mode=` (a turboio extension):

- `"collectives"` (default, fastsafetensors' way): each file is read once, by the rank it was
  added for; `get_tensor` broadcasts it from that rank, `get_sharded` scatters the blocks,
  `push_tensor` sends it to one rank. Best where storage is slower than the interconnect.
- `"direct"`: no rank holds whole files; every rank reads from storage only the bytes it needs:
  for `get_sharded(name, dim)` its own block (one contiguous range for `dim=0`, the strided
  rows for inner dims), for `get_tensor` the tensor. No collective moves tensor data and each
  rank reads about 1/world of a sharded tensor's bytes. Best where every rank sees the same
  fast storage (a local NVMe, a parallel file system) and the interconnect is the bottleneck.

`FilesBufferOnDevice.bytes_read` says how many bytes this rank read from storage.

Collectives move tensors on the process group's device: with an NCCL group (what GPU users
run; NCCL refuses CPU tensors) the loader's CUDA device, where each owner loads its files
straight away; with gloo (and other CPU backends) the CPU, where files are loaded and tensors
moved to the loader's device after they arrive. An NCCL group with a CPU loader is an error.
"""

import math
import os

from . import _cuda, _remote, _turboio
from ._dtypes import load_dtype, torch_dtype, torch_dtype_for
from ._torch import select_across, tensors_of, threads as _threads

__all__ = ["SafeTensorsFileLoader", "FilesBufferOnDevice", "SingleGroup", "fastsafe_open", "ParallelLoader", "AutoLoader"]


class SingleGroup:
    """A process group of one process (rank 0 of 1)."""

    def size(self):
        return 1

    def rank(self):
        return 0


def _check_device(device):
    """A torch.device for "cpu" or "cuda:N"; raises for devices turboio cannot load to (an NPU,
    a missing GPU or driver)."""
    import torch

    return torch.device(_cuda.target(device))


def _check_pg(pg):
    if pg is None:
        return SingleGroup()
    if isinstance(pg, SingleGroup):
        return pg
    if callable(getattr(pg, "size", None)) and callable(getattr(pg, "rank", None)):
        return pg
    raise Exception("pg must be an instance of torch.disributed.ProcessGroup")


def _block_range(size, world, rank):
    """fastsafetensors' split: rank r gets [r*b, (r+1)*b) of ceil(size/world)-sized blocks, the
    last short or empty. Returns (start, length)."""
    block = math.ceil(size / world)
    start = min(rank * block, size)
    return start, max(0, min(block, size - start))


def _distributed(pg):
    """True for a real torch.distributed group of more than one rank."""
    return not isinstance(pg, SingleGroup) and pg.size() > 1


def _collective_device(pg, device):
    """The device `pg`'s collectives move tensors on: the loader's `device` for an NCCL group
    (NCCL moves CUDA tensors only), the CPU for gloo and other backends."""
    import torch
    import torch.distributed as dist

    try:
        backend = str(dist.get_backend(pg)).lower()
    except (AttributeError, ValueError, RuntimeError, TypeError):
        backend = ""
    if backend != "nccl":
        return torch.device("cpu")
    if device is None or torch.device(device).type != "cuda":
        raise ValueError(
            f"an NCCL process group moves CUDA tensors only: give the loader device='cuda:N' (not {device!r}), "
            "or use a gloo group for CPU loads"
        )
    return torch.device(device)


def _global_rank(pg, group_rank):
    import torch.distributed as dist

    try:
        return dist.get_global_rank(pg, group_rank)
    except (AttributeError, ValueError, RuntimeError):
        return group_rank


class FilesBufferOnDevice:
    """The loaded files: `get_tensor`, `get_sharded`, ... (see the module docs for the two
    shard modes)."""

    def __init__(
        self, loads, pg, dtype=None, headers=None, owners=None, mode="collectives", device=None, threads=0, storage=None
    ):
        self._pg = pg
        self._storage = storage  # {filename: object-store backend} for URLs given storage_options
        self._dtype = dtype
        self._loads = loads  # {filename: LoadedFile}, this rank's files (collectives)
        self._mode = mode
        self._device = device
        self._threads = threads
        self._where = {}  # name -> (filename, Tensor of a load), this rank's files
        self._info = {}  # name -> (filename, dtype, shape, begin, end, data_start, owner rank)
        # Where collectives move tensors (NCCL: the CUDA device; gloo: the CPU).
        self._comm = _collective_device(pg, device) if mode == "collectives" and _distributed(pg) else None
        self._read = 0
        for filename, (data_start, infos) in (headers or {}).items():
            for name, dt, shape, begin, end in infos:
                if name in self._info:
                    raise Exception(f"FilesBufferOnDevice: key {name} must be unique among files")
                self._info[name] = (filename, dt, list(shape), begin, end, data_start, owners[filename])
        self._held = {}  # name -> (dtype name, shape) of this rank's loaded tensors
        for filename, loaded in loads.items():
            self._read += loaded.report()["bytes"]
            # One export per file: every tensor a view of it.
            views = tensors_of(loaded, aliases=False)
            for name, dt, shape, _b, _e in loaded.infos():
                if name in self._where or (name in self._info and self._info[name][0] != filename):
                    raise Exception(f"FilesBufferOnDevice: key {name} must be unique among files")
                self._where[name] = (filename, views[name])
                self._held[name] = (dt, list(shape))

    @property
    def bytes_read(self):
        """Bytes this rank read from storage (the loads' reports, and the direct reads)."""
        return self._read

    def _check_open(self):
        if self._loads is None:
            raise Exception("FilesBufferOnDevice is closed")

    def _get(self, name):
        self._check_open()
        try:
            return self._where[name][1]
        except KeyError:
            raise ValueError(f"{name} is not found in the loaded files") from None

    def _meta(self, name):
        self._check_open()
        try:
            return self._info[name]
        except KeyError:
            if name in self._where:
                dt, shape = self._held[name]
                return (self._where[name][0], dt, shape, None, None, None, self._pg.rank())
            raise ValueError(f"{name} is not found in the loaded files") from None

    def _finish(self, t, device, dtype):
        if isinstance(dtype, str):
            dtype = torch_dtype(load_dtype(dtype))
        if dtype is None and self._dtype is not None and t.is_floating_point():
            dtype = self._dtype
        if dtype is not None and dtype != t.dtype:
            t = t.to(dtype)
        dev = _check_device(device) if device is not None else self._device
        if dev is not None and dev != t.device:
            t = t.to(dev)
        return t

    def _read_rows(self, name, dim, start, length):
        """Direct mode: reads rows [start, start+length) of `name` along `dim` from storage into
        a new tensor (the strided rows for an inner dim)."""
        import torch

        filename, dt, shape, begin, end, data_start, _ = self._meta(name)
        td = torch_dtype_for(dt, shape)
        if td is None or begin is None:
            raise ValueError(f"{filename}: tensor `{name}` of dtype {dt} cannot be read by rows")
        full = dim is None
        if full:
            dim, start, length = 0, 0, (shape[0] if shape else 1)
        elsize = torch.empty((), dtype=td).element_size()
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim + 1 :]) * elsize
        size = shape[dim] if shape else 1
        out_shape = list(shape) if full else shape[:dim] + [length] + shape[dim + 1 :]
        out = torch.empty(out_shape, dtype=td)
        row = length * inner
        requests = []
        if row:
            base = out.data_ptr()
            for o in range(outer):
                requests.append((data_start + begin + (o * size + start) * inner, base + o * row, row))
        if requests:
            self._read += _turboio._read_into(
                filename, requests, threads=_threads(self._threads), storage=(self._storage or {}).get(filename)
            )
        return out

    def _collective_full(self, name):
        """Collectives mode: the owner's tensor, broadcast to every rank."""
        import torch
        import torch.distributed as dist

        filename, dt, shape, *_rest, owner = self._meta(name)
        if self._pg.rank() == owner:
            t = self._get(name).to(self._comm).contiguous()
        else:
            t = torch.empty(shape, dtype=torch_dtype_for(dt, shape) or torch.uint8, device=self._comm)
        dist.broadcast(t, src=_global_rank(self._pg, owner), group=self._pg)
        return t

    def get_tensor(self, tensor_name, device=None, dtype=None):
        if not _distributed(self._pg) and self._mode != "direct":
            return self._finish(self._get(tensor_name), device, dtype)
        if self._mode == "direct":
            return self._finish(self._read_rows(tensor_name, None, 0, 0), device, dtype)
        return self._finish(self._collective_full(tensor_name), device, dtype)

    def get_sharded(self, tensor_name, dim, device=None, dtype=None):
        """This process's shard along `dim` (rank r of a world of n gets block r of
        ceil(size/n), the last short or empty); the whole tensor when `dim` is -1 or the world
        has one process."""
        import torch

        world, rank = self._pg.size(), self._pg.rank()
        if dim == -1 or world == 1:
            return self.get_tensor(tensor_name, device=device, dtype=dtype)
        filename, dt, shape, *_rest, owner = self._meta(tensor_name)
        if dim < 0:
            dim += len(shape)
        if not 0 <= dim < len(shape):
            raise ValueError(f"{filename}: tensor `{tensor_name}` of shape {shape} has no dimension {dim}")
        start, length = _block_range(shape[dim], world, rank)
        if self._mode == "direct":
            return self._finish(self._read_rows(tensor_name, dim, start, length), device, dtype)
        import torch.distributed as dist

        block = math.ceil(shape[dim] / world)
        td = torch_dtype_for(dt, shape) or torch.uint8
        recv_shape = shape[:dim] + [block] + shape[dim + 1 :]
        recv = torch.empty(recv_shape, dtype=td, device=self._comm)
        scatter = None
        if rank == owner:
            t = self._get(tensor_name).to(self._comm)
            scatter = []
            for r in range(world):
                s, n = _block_range(shape[dim], world, r)
                piece = torch.zeros(recv_shape, dtype=td, device=self._comm)  # equal sizes for scatter; padded
                piece.narrow(dim, 0, n).copy_(t.narrow(dim, s, n))
                scatter.append(piece)
        dist.scatter(recv, scatter, src=_global_rank(self._pg, owner), group=self._pg)
        return self._finish(recv.narrow(dim, 0, length).contiguous(), device, dtype)

    def push_tensor(self, tensor_name, dst_rank, device=None, dtype=None):
        """The tensor on rank `dst_rank` (sent by its owner; read from storage in direct mode);
        None on the other ranks."""
        import torch
        import torch.distributed as dist

        rank = self._pg.rank()
        if not _distributed(self._pg) or self._mode == "direct":
            return self.get_tensor(tensor_name, device, dtype) if rank == dst_rank else None
        filename, dt, shape, *_rest, owner = self._meta(tensor_name)
        if owner == dst_rank:
            return self._finish(self._get(tensor_name), device, dtype) if rank == dst_rank else None
        if rank == owner:
            t = self._get(tensor_name).to(self._comm).contiguous()
            dist.send(t, dst=_global_rank(self._pg, dst_rank), group=self._pg)
            return None
        if rank == dst_rank:
            t = torch.empty(shape, dtype=torch_dtype_for(dt, shape) or torch.uint8, device=self._comm)
            dist.recv(t, src=_global_rank(self._pg, owner), group=self._pg)
            return self._finish(t, device, dtype)
        return None

    def get_multi_cols(self, tensor_names, dim, device=None, dtype=None):
        import torch

        return torch.cat([self.get_sharded(n, dim, device, dtype) for n in tensor_names], dim=dim)

    def get_filename(self, tensor_name):
        entry = self._info.get(tensor_name) or self._where.get(tensor_name)
        return entry[0] if entry else ""

    def get_shape(self, tensor_name):
        return list(self._meta(tensor_name)[2])

    def as_dict(self, tensors):
        return {name: self.get_sharded(name, dim) for name, dim in tensors.items()}

    def close(self):
        self._loads = None
        self._where = {}
        self._info = {}


class SafeTensorsFileLoader:
    """fastsafetensors' loader: `add_filenames({rank: [files]})`, then `copy_files_to_device()`."""

    def __init__(
        self,
        pg,
        device="cpu",
        bbuf_size_kb=16 * 1024,
        max_threads=16,
        nogds=False,
        set_numa=True,
        disable_cache=True,
        debug_log=False,
        framework="pytorch",
        shard_mode="collectives",
        storage_options=None,
        cache_dir=None,
        tensors=None,
        **kwargs,
    ):
        """`storage_options` (a turboio extension) configures the object-store backend for
        `s3://`, `gs://`, `az://` and `https://` files (as for `turboio.load`); without it the
        environment does. Direct mode then fetches only this rank's byte ranges. `cache_dir`
        (default `TURBOIO_CACHE_DIR`) is the node-local cache, as for `turboio.load`: files this
        loader reads whole are kept there. `tensors` (a turboio extension: a name or glob
        pattern, a list of them, or a callable, as for `turboio.load`) keeps only the tensors it
        selects among every file added, checked when the files are copied (`KeyError` naming the
        closest names for one that matches nothing): only their bytes are read, and files
        holding none are not loaded."""
        if shard_mode not in ("collectives", "direct"):
            raise ValueError(f"shard_mode must be 'collectives' or 'direct', not {shard_mode!r}")
        self.shard_mode = shard_mode
        if framework not in ("pt", "pytorch", "torch"):
            raise NotImplementedError(f"turboio: framework {framework} is not supported (pytorch only)")
        self.pg = _check_pg(pg)
        self.device = _check_device(device)
        self.max_threads = max_threads
        self.nogds = nogds
        self._staging = None  # pinned slots: the device's process pool, reused by every file
        self.meta = {}  # filename -> (metadata, rank)
        self._headers = {}
        self._storage_options = storage_options
        self._cache_dir = cache_dir
        self._storage = {}  # filename -> object-store backend (URLs with storage_options)
        self._selection = tensors
        self._selected = None  # filename -> frozenset of selected names, once checked

    def add_filenames(self, filenames):
        for rank, files in filenames.items():
            for f in files:
                path = os.fspath(f)
                storage = _remote.storage(path, self._storage_options, self._cache_dir)
                if storage is not None:
                    self._storage[path] = storage
                data_start, _, metadata, infos = _turboio.read_header(path, storage=storage)
                self.meta[path] = (metadata, rank)
                self._headers[path] = (data_start, infos)

    def _select(self):
        """Applies `tensors=` to every file added (once): each file's header keeps only the
        selected tensors."""
        if self._selection is None or self._selected is not None:
            return
        names = {path: [i[0] for i in infos] for path, (_, infos) in self._headers.items()}
        self._selected = select_across(self._selection, names, next(iter(self._headers), "the added files"))
        for path, (data_start, infos) in list(self._headers.items()):
            self._headers[path] = (data_start, [i for i in infos if i[0] in self._selected[path]])

    def get_keys(self):
        self._select()
        return [name for _, infos in self._headers.values() for name, *_ in infos]

    def get_shape(self, tensor_name):
        for _, infos in self._headers.values():
            for name, _, shape, _, _ in infos:
                if name == tensor_name:
                    return list(shape)
        raise ValueError(f"{tensor_name} is not found in the added files")

    def copy_files_to_device(self, dtype=None, use_buf_register=True, max_copy_block_size=16 * 1024**3):
        """Loads every added file into `device` (the CPU, or a GPU: GPUDirect Storage unless
        `nogds`, falling back to pinned staging where GDS is unusable; the reason is in each
        load's `report()["fallbacks"]`). `dtype` (a torch dtype): every floating tensor comes
        out converted to it (bit for bit as `.to()`), others as stored; unlike fastsafetensors,
        widening conversions are allowed too."""
        name = load_dtype(dtype)  # a clear error now for a dtype nothing converts to
        self._select()
        dtype = torch_dtype(name) if name is not None else None
        loads = {}
        device = "cpu" if self.device.type == "cpu" else str(self.device)
        gds = "off" if self.nogds or device == "cpu" else "auto"
        distributed = _distributed(self.pg)
        # Several ranks: collectives load the files added for this rank (the others receive
        # broadcasts and scatters); direct mode loads nothing whole (each rank reads its bytes).
        # Tensors travel on the group's device: an NCCL group's CUDA device, where each owner
        # loads its files straight away; gloo's CPU, moved to `device` at the end.
        comm = None
        if distributed and self.shard_mode == "collectives":
            comm = _collective_device(self.pg, self.device)
        load_device = device if not distributed or (comm is not None and comm.type == "cuda") else "cpu"
        for path in sorted(self.meta):
            if distributed and (self.shard_mode == "direct" or self.meta[path][1] != self.pg.rank()):
                continue
            if not distributed and self.shard_mode == "direct":
                continue
            selected = None if self._selected is None else self._selected.get(path, frozenset())
            if selected is not None and not selected:
                continue  # nothing of this file is selected
            loads[path] = _turboio.load(
                path,
                threads=_threads(self.max_threads),
                device=load_device,
                gds=gds if load_device != "cpu" else "off",
                staging=self._staging,
                # One process: floating tensors are converted by the reader, in one pass. With
                # several, every rank converts what it receives (the owners send stored dtypes).
                dtype=None if distributed else name,
                storage=self._storage.get(path),
                tensors=selected,
            )
        owners = {path: rank for path, (_, rank) in self.meta.items()}
        return FilesBufferOnDevice(
            loads,
            self.pg,
            dtype,
            headers=self._headers,
            owners=owners,
            mode=self.shard_mode,
            device=self.device if (distributed or self.shard_mode == "direct") else None,
            threads=self.max_threads,
            storage=self._storage,
        )

    def reset(self):
        self.meta = {}
        self._headers = {}
        self._storage = {}
        self._selected = None

    def close(self):
        self.reset()


class fastsafe_open:
    """`with fastsafe_open(files) as f: f.get_tensor(name)`."""

    def __init__(
        self,
        filenames,
        framework="pt",
        pg=None,
        device="cpu",
        nogds=False,
        debug_log=False,
        max_copy_block_size=16 * 1024**3,
        tensors=None,
    ):
        if isinstance(filenames, (str, os.PathLike)):
            filenames = {0: [filenames]}
        elif isinstance(filenames, list):
            filenames = {0: filenames}
        self._loader = SafeTensorsFileLoader(
            pg, device=device, nogds=nogds, debug_log=debug_log, framework=framework, tensors=tensors
        )
        self._loader.add_filenames(filenames)
        self._fb = self._loader.copy_files_to_device(max_copy_block_size=max_copy_block_size)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def metadata(self):
        return {f: m for f, (m, _) in self._loader.meta.items()}

    def keys(self):
        return self._loader.get_keys()

    def get_tensor(self, name):
        return self._fb.get_tensor(name)

    def get_tensor_wrapped(self, name):
        return self.get_tensor(name)

    def close(self):
        self._fb.close()
        self._loader.close()


class ParallelLoader:
    """fastsafetensors' `ParallelLoader`: the files in batches of `pg.size()` (rank i loads file i
    of each batch), `iterate_weights()` yielding `(name, tensor)` for every tensor of every file
    on every rank (broadcast from the loading rank; in `shard_mode="direct"`, read by each
    rank). Tensors own their memory, so they stay valid after the iterator moves on. Batches are
    loaded one after another (`queue_size` and `max_concurrent_producers` are accepted)."""

    def __init__(
        self,
        pg,
        hf_weights_files,
        max_concurrent_producers=1,
        queue_size=0,
        use_tqdm_on_load=True,
        device="cpu",
        bbuf_size_kb=16 * 1024,
        max_threads=16,
        nogds=False,
        set_numa=True,
        debug_log=False,
        framework="pytorch",
        **kwargs,
    ):
        if max_concurrent_producers != 1:
            raise ValueError("max_concurrent_producers must be 1")
        self.pg = _check_pg(pg)
        self.files = [os.fspath(f) for f in hf_weights_files]
        # `tensors` (a turboio extension) is checked against every file, then each batch
        # loads the selected names it holds.
        self._selection = kwargs.pop("tensors", None)
        self._loader_args = dict(device=device, max_threads=max_threads, nogds=nogds, framework=framework, **kwargs)
        self._closed = False

    def _kept(self):
        """`{file: selected names}` (`tensors=`, checked against every file), or None."""
        if self._selection is None:
            return None
        storage = self._loader_args.get("storage_options")
        names = {}
        for f in self.files:
            st = _remote.storage(f, storage, self._loader_args.get("cache_dir"))
            names[f] = [n for n, *_ in _turboio.read_header(f, storage=st)[3]]
        return select_across(self._selection, names, self.files[0] if self.files else "no files")

    def iterate_weights(self):
        world = self.pg.size()
        kept = self._kept()
        for i in range(0, len(self.files), world):
            if self._closed:
                return
            batch = self.files[i : i + world]
            args = self._loader_args
            if kept is not None:
                chosen = frozenset().union(*(kept[f] for f in batch))
                if not chosen:
                    continue  # every rank skips it alike
                args = dict(args, tensors=chosen)
            loader = SafeTensorsFileLoader(self.pg, **args)
            loader.add_filenames({r: [f] for r, f in enumerate(batch)})
            fb = loader.copy_files_to_device()
            try:
                for name in loader.get_keys():
                    yield name, fb.get_tensor(name)
            finally:
                fb.close()
                loader.close()

    def close(self):
        self._closed = True


class AutoLoader(ParallelLoader):
    """fastsafetensors' `AutoLoader`: a `ParallelLoader` configured from `$FASTSAFETENSORS_CONFIG`,
    else `./fastsafetensors.json`, else defaults (`base.copier_type` "gds" unless set otherwise:
    anything else means nogds). Only the "base" loader exists here."""

    def __init__(self, pg, hf_weights_files, device="cpu"):
        import json

        path = os.environ.get("FASTSAFETENSORS_CONFIG") or ("fastsafetensors.json" if os.path.exists("fastsafetensors.json") else None)
        config = {}
        if path:
            with open(path) as f:
                config = json.load(f)
        self.config = config
        if config.get("loader", "base") != "base":
            raise NotImplementedError(f"turboio: loader {config.get('loader')!r} is not supported (only 'base')")
        base = config.get("base", {})
        nogds = base.get("copier_type", "gds") != "gds"
        super().__init__(pg, hf_weights_files, device=device, nogds=nogds)
