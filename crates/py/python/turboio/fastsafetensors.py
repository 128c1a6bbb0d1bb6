"""A drop-in for fastsafetensors' loader API (`SafeTensorsFileLoader`, `SingleGroup`,
`fastsafe_open`), on turboio's loader.

Differences that make it safer: tensors keep their memory alive (no use-after-free after
`close()`: `close()` only drops this loader's references), and files are validated with the
reference safetensors rules.
"""

import math
import os

from . import _cuda, _turboio
from ._torch import tensor_from, threads as _threads

__all__ = ["SafeTensorsFileLoader", "FilesBufferOnDevice", "SingleGroup", "fastsafe_open"]


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


class FilesBufferOnDevice:
    """The loaded files: `get_tensor`, `get_sharded`, ... (views into the loads)."""

    def __init__(self, loads, pg, dtype=None):
        self._pg = pg
        self._dtype = dtype
        self._loads = loads  # {filename: LoadedFile}
        self._where = {}
        for filename, loaded in loads.items():
            for pt in loaded.tensors():
                if pt.name in self._where:
                    raise Exception(f"FilesBufferOnDevice: key {pt.name} must be unique among files")
                self._where[pt.name] = (filename, pt)

    def _get(self, name):
        if self._loads is None:
            raise Exception("FilesBufferOnDevice is closed")
        try:
            return self._where[name][1]
        except KeyError:
            raise ValueError(f"{name} is not found in the loaded files") from None

    def get_tensor(self, tensor_name, device=None, dtype=None):
        t = tensor_from(self._get(tensor_name))
        if dtype is None and self._dtype is not None and t.is_floating_point():
            dtype = self._dtype
        if dtype is not None and dtype != t.dtype:
            t = t.to(dtype)
        if device is not None:
            dev = _check_device(device)
            if dev != t.device:
                t = t.to(dev)
        return t

    def get_sharded(self, tensor_name, dim, device=None, dtype=None):
        """This process's shard along `dim` (rank r of a world of n gets block r of
        ceil(size/n)); the whole tensor when `dim` is -1 or the world has one process."""
        t = self.get_tensor(tensor_name, device=device, dtype=dtype)
        world, rank = self._pg.size(), self._pg.rank()
        if dim == -1 or world == 1:
            return t
        if dim < 0:
            dim += t.dim()
        block = math.ceil(t.shape[dim] / world)
        return t.narrow(dim, min(rank * block, t.shape[dim]), max(0, min(block, t.shape[dim] - rank * block)))

    def get_multi_cols(self, tensor_names, dim, device=None, dtype=None):
        import torch

        return torch.cat([self.get_sharded(n, dim, device, dtype) for n in tensor_names], dim=dim)

    def get_filename(self, tensor_name):
        entry = self._where.get(tensor_name)
        return entry[0] if entry else ""

    def get_shape(self, tensor_name):
        return list(self._get(tensor_name).shape)

    def as_dict(self, tensors):
        return {name: self.get_sharded(name, dim) for name, dim in tensors.items()}

    def close(self):
        self._loads = None
        self._where = {}


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
        **kwargs,
    ):
        if framework not in ("pt", "pytorch", "torch"):
            raise NotImplementedError(f"turboio: framework {framework} is not supported (pytorch only)")
        self.pg = _check_pg(pg)
        self.device = _check_device(device)
        self.max_threads = max_threads
        self.nogds = nogds
        self._staging = _turboio.StagingPool()  # pinned buffers reused by every file of this loader
        self.meta = {}  # filename -> (metadata, rank)
        self._headers = {}

    def add_filenames(self, filenames):
        for rank, files in filenames.items():
            for f in files:
                path = os.fspath(f)
                _, _, metadata, infos = _turboio.read_header(path)
                self.meta[path] = (metadata, rank)
                self._headers[path] = infos

    def get_keys(self):
        return [name for infos in self._headers.values() for name, *_ in infos]

    def get_shape(self, tensor_name):
        for infos in self._headers.values():
            for name, _, shape, _, _ in infos:
                if name == tensor_name:
                    return list(shape)
        raise ValueError(f"{tensor_name} is not found in the added files")

    def copy_files_to_device(self, dtype=None, use_buf_register=True, max_copy_block_size=16 * 1024**3):
        """Loads every added file into `device` (the CPU, or a GPU: GPUDirect Storage unless
        `nogds`, falling back to pinned staging where GDS is unusable; the reason is in each
        load's `report()["fallbacks"]`)."""
        loads = {}
        device = "cpu" if self.device.type == "cpu" else str(self.device)
        gds = "off" if self.nogds or device == "cpu" else "auto"
        for path in sorted(self.meta):
            loads[path] = _turboio.load(
                path, threads=_threads(self.max_threads), device=device, gds=gds, staging=self._staging
            )
        return FilesBufferOnDevice(loads, self.pg, dtype)

    def reset(self):
        self.meta = {}
        self._headers = {}

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
    ):
        if isinstance(filenames, (str, os.PathLike)):
            filenames = {0: [filenames]}
        elif isinstance(filenames, list):
            filenames = {0: filenames}
        self._loader = SafeTensorsFileLoader(pg, device=device, nogds=nogds, debug_log=debug_log, framework=framework)
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
