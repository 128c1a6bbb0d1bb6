"""A drop-in for `safetensors.torch`: `import turboio.torch as safetensors_torch`.

Same functions, parameters and exceptions; loads go through turboio (mapped from the page cache
when possible, zero copy), saves are atomic and byte-identical to safetensors' own.
"""

import os
import struct

from . import _cuda, _remote, _turboio
from ._dtypes import torch_dtype_for, torch_shape
from ._torch import (
    alias_shared,
    raw_tensors,
    remove_duplicate_names,
    single_cuda_device,
    tensors_of,
    typed_export,
    view_of,
)

__all__ = ["load_file", "save_file", "load", "save", "save_model", "load_model", "safe_open", "SafetensorError"]


try:
    from safetensors import SafetensorError as _ReferenceError
except ImportError:  # safetensors is not installed: nothing to be caught as
    _ReferenceError = Exception


class SafetensorError(_ReferenceError):
    """Raised for invalid files and misuse, as `safetensors.SafetensorError` is. When the
    `safetensors` package is installed this is a subclass of its `SafetensorError`, so code that
    catches that catches turboio's errors too."""


def _error(e, doing):
    """The one mapping of the extension's errors to `SafetensorError`: the reference's wording
    (`Error while deserializing header: header too large`), then turboio's detail and the file."""
    reason = getattr(e, "reason", None)
    if reason is None:
        return SafetensorError(f"Error while {doing}: {e}")
    filename = getattr(e, "filename", None)
    return SafetensorError(f"Error while {doing}: {reason}" + (f" (file {filename})" if filename else ""))


def _check_metadata(metadata):
    """`metadata` must be None or a dict of str to str (TypeError otherwise, as safetensors)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise TypeError(f"argument 'metadata': '{type(metadata).__name__}' object is not an instance of 'dict'")
    for k, v in metadata.items():
        for x in (k, v):
            if not isinstance(x, str):
                what = "'None'" if x is None else f"'{type(x).__name__}' object"
                raise TypeError(f"argument 'metadata': {what} is not an instance of 'str'")
    return metadata


def _check_device(device):
    """`"cpu"` or `"cuda:N"`; raises for a device turboio cannot load to (an NPU, a missing GPU)."""
    return _cuda.target(device)


def _load(filename, mode="auto", device="cpu", storage_options=None, cache_dir=None, tensors=None):
    path = os.fspath(filename)
    storage = _remote.storage(path, storage_options, cache_dir)
    try:
        return _turboio.load(path, mode=mode, device=device, gds=_cuda.gds_setting(), storage=storage, tensors=tensors)
    except FileNotFoundError:
        raise
    except ValueError as e:
        raise _error(e, "deserializing header") from None


def load_file(filename, device="cpu", *, storage_options=None, cache_dir=None, tensors=None):
    """Loads a safetensors file into a dict of tensors (zero-copy views of one load), on the CPU
    or straight into a GPU (`device="cuda:N"`, or an int). `filename` may be an object-store
    URL (`s3://...`, `gs://...`, `az://...`, `https://...`; `storage_options`, a turboio
    extension, as for `turboio.load`; `cache_dir`, the node-local cache, too). `tensors` (a
    turboio extension, as for `turboio.load`) loads only the tensors it selects."""
    dev = _check_device(device)
    loaded = _load(filename, device=dev, storage_options=storage_options, cache_dir=cache_dir, tensors=tensors)
    return tensors_of(loaded, aliases=False)


def save_file(
    tensors, filename, metadata=None, *, blocking=True, storage_options=None, reuse_blocks=False, max_host_memory=None
):
    """Saves a dict of tensors (atomically; byte-identical to safetensors' writer).

    With `blocking=False` (a turboio extension) the tensors are copied into reused host
    buffers and the file is written in the background: the call returns a handle with
    `wait()`, `done()` and `exception()` as soon as the copy is made, and the tensors may then
    be changed or freed. `max_host_memory` (bytes, or "8GiB") bounds those buffers: a save
    whose copy is larger raises `MemoryError` before copying anything, and a save that would
    take the pending saves' buffers past it waits for them first.

    With `reuse_blocks=True` (a turboio extension, for a checkpoint replaced again and again) a
    replacing save of a local file writes into the blocks of the previous version, which the
    last replacing save kept as a hidden copy, instead of into new blocks (faster where new
    blocks are costly, as on ext4; one more copy of the file on disk).

    `filename` may be an object-store URL (`s3://bucket/key.safetensors`): a multipart upload,
    visible only once complete (`storage_options` as for `load_file`)."""
    storage = _remote.storage(os.fspath(filename), storage_options)
    return _write(
        tensors,
        filename,
        metadata,
        blocking=blocking,
        storage=storage,
        reuse_blocks=reuse_blocks,
        max_host_memory=max_host_memory,
    )


def _write(
    tensors,
    filename,
    metadata=None,
    cipher=False,
    cipher_header=False,
    blocking=True,
    storage=None,
    reuse_blocks=False,
    max_host_memory=None,
):
    # CUDA tensors saved while the caller waits are written from device memory; background
    # saves snapshot host copies (the caller may change the tensors as soon as save returns).
    metadata = _check_metadata(metadata)
    if isinstance(max_host_memory, str):
        try:
            max_host_memory = _turboio.parse_shard_size(max_host_memory)
        except ValueError as e:
            raise ValueError(f"max_host_memory: {e}") from None
    device = single_cuda_device(tensors) if blocking else None
    records, keep = raw_tensors(tensors, keep_device=device is not None)
    save = _turboio._save if blocking else _turboio._save_async
    try:
        if device is not None:
            # From device memory (GPUDirect Storage with TURBOIO_GDS, else copied to the host
            # chunk by chunk), once torch's stream has produced the bytes.
            _cuda.synchronize(keep)
            _turboio._save_device(
                os.fspath(filename),
                _cuda.target(device),
                records,
                metadata,
                cipher=cipher,
                cipher_header=cipher_header,
                gds=_cuda.gds_setting(),
            )
            handle = None
        else:
            extra = {} if blocking else {"max_host_memory": max_host_memory}
            handle = save(
                os.fspath(filename),
                records,
                metadata,
                cipher=cipher,
                cipher_header=cipher_header,
                storage=storage,
                reuse_blocks=reuse_blocks,
                **extra,
            )
    except ValueError as e:
        raise _error(e, "serializing") from None
    del keep
    return handle


def save(tensors, metadata=None):
    """Serializes a dict of tensors into bytes."""
    metadata = _check_metadata(metadata)
    records, keep = raw_tensors(tensors)
    try:
        out = _turboio._serialize(records, metadata)
    except ValueError as e:
        raise _error(e, "serializing") from None
    del keep
    return out


def load(data):
    """Deserializes bytes made by `save` (or read from a file) into a dict of tensors."""
    import torch

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected bytes, got {type(data)}")
    try:
        data_start, _, _, infos = _turboio.parse_bytes(bytes(data))
    except ValueError as e:
        raise _error(e, "deserializing") from None
    buf = bytearray(data)
    out = {}
    for name, dtype, shape, begin, end in infos:
        td = torch_dtype_for(dtype, shape) or torch.uint8
        if end == begin:
            out[name] = torch.empty(torch_shape(dtype, shape), dtype=td)
            continue
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=end - begin, offset=data_start + begin)
        out[name] = raw.view(td).reshape(torch_shape(dtype, shape))
    return out


def save_model(model, filename, metadata=None, force_contiguous=True):
    """Saves a model's state dict, storing shared tensors once (aliases go to `__metadata__`)."""
    _save_model(model, filename, metadata, force_contiguous)


def _save_model(model, filename, metadata=None, force_contiguous=True, cipher=False, cipher_header=False):
    state_dict = model.state_dict()
    metadata = alias_shared(state_dict, metadata)
    if force_contiguous:
        state_dict = {k: v.contiguous() for k, v in state_dict.items()}
    try:
        _write(state_dict, filename, metadata, cipher=cipher, cipher_header=cipher_header)
    except ValueError as e:
        raise ValueError(f"{e}\nYou can try setting `force_contiguous=True` to fix this.") from None


def load_model(model, filename, strict=True, device="cpu"):
    """Loads a file saved by `save_model` into `model`; returns `(missing, unexpected)` keys."""
    state_dict = load_file(filename, device=device)
    to_removes = remove_duplicate_names(model.state_dict(), preferred_names=state_dict.keys())
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = set(missing)
    unexpected = list(unexpected)
    for removed in to_removes.values():
        for name in removed:
            if name in missing:
                missing.remove(name)
            else:
                unexpected.append(name)
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(unexpected))
        raise RuntimeError(error)
    return missing, unexpected


_FRAMEWORKS = {"pt", "torch", "pytorch"}


class safe_open:
    """Lazy access to a safetensors file: `with safe_open(path, framework="pt") as f: f.get_tensor(name)`.

    The file is mapped, not read: only the pages of the tensors you ask for are read.
    `get_slice(name)[...]` reads just the byte ranges of the slice. `tensors` (a turboio
    extension, as for `turboio.load`) limits `keys()` and `get_tensor` to the selected tensors
    (checked when opening: a name or pattern that matches nothing raises `KeyError`); for an
    object-store URL, which is copied rather than mapped, only their bytes are read.
    """

    def __init__(self, filename, framework="pt", device="cpu", *, storage_options=None, cache_dir=None, tensors=None):
        if framework not in _FRAMEWORKS:
            raise SafetensorError(f"framework {framework} is invalid (turboio.torch supports pt)")
        self._device = _check_device(device)
        self._path = os.fspath(filename)
        remote = _remote.is_remote(self._path)
        if not remote and not os.path.exists(self._path):
            raise FileNotFoundError(f"No such file or directory: {self._path}")
        # Lazy loads map a local file; sfcs:// files and object-store URLs are copied.
        mode = "copied" if remote else "lazy"
        self._loaded = _load(
            self._path, mode=mode, storage_options=storage_options, cache_dir=cache_dir, tensors=tensors
        )
        self._infos = {n: (d, s, b, e) for n, d, s, b, e in self._loaded.infos()}
        self._order = [n for n, *_ in self._loaded.infos()]
        self._tensors = self._typed = None
        self._data_start = self._loaded.data_start

    def _check_open(self):
        if self._loaded is None:
            raise SafetensorError("File is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._loaded = None
        self._tensors = self._typed = None

    def metadata(self):
        self._check_open()
        return self._loaded.metadata()

    def keys(self):
        self._check_open()
        return sorted(self._infos)

    def offset_keys(self):
        self._check_open()
        return list(self._order)

    def _view(self, name):
        """Tensor `name` as a view of the one export of this file's load (made on first use),
        not an export of its own: a file of thousands of tensors costs one export."""
        if self._tensors is None:
            self._tensors = {pt.name: pt for pt in self._loaded.tensors()}
            self._typed = typed_export(self._loaded)
        return view_of(self._typed, self._tensors[name])

    def get_tensor(self, name):
        self._check_open()
        if name not in self._infos:
            raise SafetensorError(f"File does not contain tensor {name}")
        t = self._view(name)
        return t if self._device == "cpu" else t.to(self._device)

    def get_tensors(self):
        self._check_open()
        return {n: self.get_tensor(n) for n in self._order}

    def get_slice(self, name):
        self._check_open()
        if name not in self._infos:
            raise SafetensorError(f"File does not contain tensor {name}")
        dtype, shape, _, _ = self._infos[name]
        return _Slice(lambda: self._view(name), dtype, shape, self._device)


class _Slice:
    """`safe_open(...).get_slice(name)`: `[...]` indexes the tensor as torch does (the
    reference's semantics for every index form: ints, slices, None, Ellipsis, bools, lists,
    tensors), on the bytes this `safe_open` holds (its mapping of the file as it was opened,
    even if the file was replaced since). Basic indexing returns a view: only the pages the
    slice covers are ever read."""

    def __init__(self, view, dtype, shape, device="cpu"):
        self._view, self._dtype, self._shape = view, dtype, list(shape)
        self._device = device

    def get_shape(self):
        return list(self._shape)

    def get_dtype(self):
        return self._dtype

    def __getitem__(self, index):
        if self._dtype in ("F6_E2M3", "F6_E3M2"):
            raise SafetensorError(f"Dtype not understood: {self._dtype}")
        if self._dtype == "F4" and torch_dtype_for(self._dtype, self._shape) is None:
            # It comes out as flat bytes: indexing them by the logical shape would be wrong.
            raise SafetensorError(
                f"cannot slice an F4 tensor of shape {list(self._shape)}: torch packs two F4 values per byte"
                " along the last dimension, which must be even (get_tensor gives its bytes as uint8)"
            )
        out = self._view()[index]
        return out if self._device == "cpu" else out.to(self._device)
