"""turboio: load and save safetensors checkpoints as fast as the storage and memory allow.

Three drop-in APIs on one fast core:

- veTurboIO: `import turboio as veturboio`, then `veturboio.load(...)`, `save_file`,
  `save_model`, `save_pt`, `init_io_helper`, `load_to_shmem`.
- fastsafetensors: `from turboio import SafeTensorsFileLoader, SingleGroup, fastsafe_open`
  (also `turboio.fastsafetensors`).
- safetensors.torch: `import turboio.torch` (`load_file`, `save_file`, `safe_open`, ...).

Whole models (directories of shards with `model.safetensors.index.json`): `load_model`,
`save_model_dir`, `iter_weights` (see `turboio.models`).

Loaded tensors are views into the loader's memory, handed to torch through DLPack without a
copy; the memory is freed when the last tensor viewing it is garbage collected.
"""

import atexit as _atexit
import importlib.util as _importlib_util
import os as _os

if _importlib_util.find_spec("torch") is None:
    raise ImportError(
        "turboio needs PyTorch, which is not installed: install it with `pip install torch` "
        "(or install turboio with its extra, `pip install 'turboio[torch]'`)"
    )

from . import _cuda, _remote, _turboio
from ._turboio import __version__

# Background saves (`save_file(..., blocking=False)`) finish before the interpreter exits.
_atexit.register(_turboio.wait_for_saves)
from ._dtypes import torch_dtype_for as _torch_dtype_for
from ._torch import alias_shared as _alias_shared, pt_tensors as _pt_tensors, tensors_of as _tensors_of, threads as _threads
from .fastsafetensors import AutoLoader, ParallelLoader, SafeTensorsFileLoader, SingleGroup, fastsafe_open
from .models import fetch_report, iter_weights, load_model, save_model_dir

__all__ = [
    "load",
    "load_to_shmem",
    "save_file",
    "save_model",
    "init_io_helper",
    "save_pt",
    "IOHelper",
    "SafeTensorsFileLoader",
    "SingleGroup",
    "fastsafe_open",
    "ParallelLoader",
    "AutoLoader",
    "load_model",
    "fetch_report",
    "save_model_dir",
    "iter_weights",
    "staging_pool",
    "__version__",
]


class IOHelper:
    """Buffers kept across loads (`init_io_helper()`): copied CPU loads reuse one arena instead of
    mapping and faulting in fresh memory each time. GPU loads reuse the pinned staging slots of
    their device's process-wide pool (`staging_pool`), with or without a helper: `free_bytes`
    counts the free slots of the GPUs this helper loaded to, and `clear` releases them too."""

    def __init__(self, max_arenas=1):
        self._pool = _turboio.ArenaPool(max_arenas)
        self._staging = None  # GPU loads use their device's process pool
        self._devices = set()

    def _used(self, device):
        if device not in (None, "cpu"):
            self._devices.add(device)

    def free_bytes(self):
        return self._pool.free_bytes() + sum(staging_pool(d).free_bytes() for d in self._devices)

    def clear(self):
        self._pool.clear()
        for d in self._devices:
            staging_pool(d).release()


def staging_pool(device="cuda:0"):
    """The pinned staging pool of `device` (`"cuda:N"`) in this process: every GPU load of the
    process takes its slots from it (two slots of 8 MiB per reader thread, pinned at the first
    load and reused by every later one). `max_buffers` (and `set_max_buffers(n)`) bounds the
    free slots it keeps, `live_bytes()` is the pinned memory it holds, `release()` frees the free
    slots now (a later load pins them again). Raises `RuntimeError` where the device cannot be
    opened, `ValueError` for the CPU (which stages nothing)."""
    return _turboio.staging_pool(device)


def init_io_helper():
    """A helper whose buffers are reused by every `load(..., helper=helper)`."""
    return IOHelper()


def _not_yet(what):
    return NotImplementedError(f"turboio: {what} is not supported yet")


def _cipher_for_load(use_cipher):
    """veTurboIO's rule for loads: None means "as VETURBOIO_USE_CIPHER says"."""
    if use_cipher is None:
        return _os.environ.get("VETURBOIO_USE_CIPHER", "0") == "1"
    return bool(use_cipher)


def _cipher_for_save(use_cipher):
    """veTurboIO's rule for saves: `use_cipher or VETURBOIO_USE_CIPHER == "1"`, with the 256 KiB
    header (a fresh key wrapped by KMS) iff VETURBOIO_CIPHER_HEADER == "1"."""
    cipher = bool(use_cipher) or _os.environ.get("VETURBOIO_USE_CIPHER", "0") == "1"
    return cipher, cipher and _os.environ.get("VETURBOIO_CIPHER_HEADER", "0") == "1"


def _local_path(file):
    """veTurboIO's routing (`is_sfcs_path`): `sfcs://...` goes to SFCS, `/dev/shm/...` always
    stays local, and with VETURBOIO_USE_SFCS_SDK=1 every other path goes to SFCS. SFCS paths
    are handed to the extension as `sfcs://...` (a plain path routed by the variable becomes
    `sfcs:/` + its absolute form, the same SFCS path veTurboIO uses)."""
    path = _os.fspath(file)
    if isinstance(path, bytes):
        path = _os.fsdecode(path)
    if len(path) > 7 and path.startswith("sfcs://"):
        return path
    if _remote.is_object_url(path):
        return path
    if len(path) > 9 and path.startswith("/dev/shm/"):
        return path
    if _os.environ.get("VETURBOIO_USE_SFCS_SDK", "0") == "1":
        return "sfcs:/" + _os.path.abspath(path)
    return path


def _is_remote(path):
    """sfcs:// and object-store URLs: read through their backends, never with `open()`."""
    return _remote.is_remote(path)


def _cache_policy(use_direct_io, cache):
    """veTurboIO's `use_direct_io=True` means bypass the page cache; `cache` says it directly."""
    if cache is None:
        return "bypass" if use_direct_io else "auto"
    if use_direct_io and cache != "bypass":
        raise ValueError(f"use_direct_io=True bypasses the page cache, but cache={cache!r} was given")
    return cache


def _is_safetensors(path, use_cipher=False, storage=None):
    """True if the file's content (decrypted with `use_cipher`) is a safetensors file, which
    tells it from a torch pickle whatever its name."""
    return _turboio.file_kind(_os.fspath(path), cipher=bool(use_cipher), storage=storage) == "safetensors"


def _kind(path, cipher, storage=None):
    kind = _turboio.file_kind(path, cipher=cipher, storage=storage)
    if kind == "unknown":
        if cipher:
            raise ValueError(
                f"{path}: the decrypted file is neither a safetensors file nor a torch file: wrong key?"
            )
        # Let the safetensors parser say precisely what is wrong with it.
        return "safetensors"
    return kind


def load(
    file,
    map_location="cpu",
    enable_fast_mode=True,
    num_thread=32,
    helper=None,
    use_pinmem=False,
    use_direct_io=False,
    use_cipher=None,
    state_dict=None,
    progress=None,
    cache=None,
    top_level_key=None,
    unsafe_pickle_fallback=False,
    dtype=None,
    storage_options=None,
    cache_dir=None,
    tensors=None,
    max_host_memory=None,
    max_device_memory=None,
):
    """Loads a safetensors or torch `.pt` file (detected by content) into a dict of tensors.

    Safetensors tensors are zero-copy views of one load (mapped from the page cache when
    possible); aliases recorded in `__metadata__` come back as the same tensor object.

    `.pt` / `.bin` files (`torch.save`) are read without executing their pickle: turboio's
    allow-listed reader understands only what `torch.save` writes for tensors and containers and
    refuses anything else (`ValueError` naming the opcode or global; nothing runs). The file goes
    through the same load pipeline as safetensors files (mapped from the page cache by default,
    copied with O_DIRECT for `cache="bypass"`, decrypted into memory when encrypted), and tensors
    are strided views of the load's bytes, so tied weights share memory as they did when saved; nested dicts come back flat with dotted
    names (`"model.layer.0.weight"`), or relative to `top_level_key` (e.g. "state_dict");
    non-tensor entries (an epoch number, a config string) are left out.
    `unsafe_pickle_fallback=True` hands files the reader refuses to `torch.load(weights_only=True)`,
    which executes the pickle (restricted): only for files you trust. With `state_dict`, the file is read
    straight into those pre-allocated tensors (which must be contiguous, of the same dtype and
    large enough) and the same dict is returned.

    `cache` (a turboio extension): "auto" (default: the file stays in the page cache for the
    next load unless it cannot fit beside its copy), "keep", or "bypass" (O_DIRECT, copied
    loads; what `use_direct_io=True` asks for).

    `progress` (a turboio extension) is called as `progress(bytes_done)` about every 50 ms
    from the calling thread, and a last time with the file's size when the load is done; an
    exception it raises aborts the load. Ctrl-C aborts it too.

    With `state_dict`, entries that share memory (tied weights) are filled once: where
    destinations overlap, the tensor stored later in the file wins, as if each were read in
    turn.

    `map_location="cuda"` / `"cuda:N"` loads straight into that GPU (pinned staging buffers,
    several copy streams, decryption on the GPU for encrypted files) and returns CUDA tensors
    viewing one device allocation (zero copy, freed with the last tensor). `use_pinmem` is
    accepted; staging buffers are always pinned (they are small and, with `helper`, reused).
    `TURBOIO_GDS=auto|on` reads cold files with GPUDirect Storage where available. An NPU
    (`"npu:N"`) raises a RuntimeError: not supported in this build.

    `dtype` (a turboio extension; a torch dtype such as `torch.bfloat16`, or its name) converts
    every float64/float32/float16/bfloat16/float8 tensor to that dtype on the way in, bit for bit
    as torch's `.to()` would; other tensors (integers, bool) are returned as stored. For
    safetensors files the conversion is done by the reader (one pass, into one new buffer); for
    `.pt` files it is a `.to()` after the load.

    `file` may be an object-store URL (`s3://bucket/key`, `gs://`, `az://`, `https://`): the
    header comes with one ranged GET and the data with parallel ranged GETs straight into the
    load's memory, pinned to the object's version. Credentials and endpoints come from the
    environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`) or from `storage_options` (a turboio extension:
    `{"endpoint": ..., "region": ..., "access_key_id": ..., "secret_access_key": ...,
    "concurrency": 16, "part_size": "8MiB", "max_bandwidth": "500MB"}`). `cache_dir` (a turboio
    extension; default `TURBOIO_CACHE_DIR`) is a node-local cache for such URLs: the first load
    of an object version writes it through to a local file there while loading it; later loads
    of that version are local loads; processes loading it at the same time fetch it once.

    `tensors` (a turboio extension) loads only some tensors: a name or glob pattern (`*`, `?`,
    `[a-z]`), a list of them, or a callable taking a name and returning whether to keep it. Only
    the selected tensors' bytes are read (mapped pages populated, or byte ranges copied, from
    any backend, decrypted or converted on the way); an alias selects its target; a name or
    pattern that matches nothing raises `KeyError` naming the closest tensors, before anything
    is read. For `.pt` files only the storages the selected tensors view are read (tied weights
    share a storage); the `unsafe_pickle_fallback` path applies the selection after `torch.load`.

    Before allocating anything, a load compares what it will hold (a copy's host memory, a
    GPU load's device memory and pinned staging buffers, a converted arena; a mapped load holds
    only page cache, which the kernel can reclaim) with what is available: host memory
    (`MemAvailable`, or less in a memory cgroup with a limit) and the GPU's free memory, or the
    budgets `max_host_memory` / `max_device_memory` (a turboio extension: bytes, or "8GiB").
    A load that does not fit raises `MemoryError` saying what it needs, what is available and
    what would fit (a mapped load, fewer tensors, a smaller staging chunk), instead of failing
    halfway or being killed; a budget also shrinks a GPU load's staging buffers to fit.
    """
    import torch

    import io

    from ._dtypes import convert as _convert, load_dtype as _load_dtype

    dtype = _load_dtype(dtype)
    if dtype is not None and state_dict:
        raise ValueError("dtype= cannot be combined with state_dict= (the tensors given keep their dtype)")
    if tensors is not None and state_dict:
        raise ValueError("tensors= cannot be combined with state_dict= (the dict given says what to load)")

    path = _local_path(file)
    cipher = _cipher_for_load(use_cipher)
    device = _cuda.target(map_location)
    cache = _cache_policy(use_direct_io, cache)
    n = _threads(num_thread)
    storage = _remote.storage(path, storage_options, cache_dir)
    remote = _is_remote(path)
    if not remote and not _os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    if not remote and _os.path.isdir(path):
        raise IsADirectoryError(
            f"{path}: is a directory; a model directory (its index and shards) loads with "
            f"turboio.load_model({path!r}), one file with turboio.load(<the file>)"
        )

    def load_pt():
        try:
            # Each storage moved (and converted) once: tied weights stay shared on the device.
            sd = _pt_tensors(
                path,
                cipher=cipher,
                top_level_key=top_level_key,
                threads=n,
                cache=cache,
                storage=storage,
                device=None if device == "cpu" else device,
                dtype=dtype,
                tensors=tensors,
                max_host_memory=max_host_memory,
                max_device_memory=max_device_memory,
            )
        except ValueError:
            if not unsafe_pickle_fallback:
                raise
        else:
            return sd
        # Only when asked: torch.load executes the pickle (restricted by weights_only=True).
        if cipher or remote:
            data = _turboio.read_all(path, cipher=cipher, threads=n, storage=storage)
            sd = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
        else:
            # A file object, not the path: recent torch guesses the format from the file name.
            with open(path, "rb") as f:
                sd = torch.load(f, map_location=device, weights_only=True)
        if tensors is not None and isinstance(sd, dict):
            sd = {k: sd[k] for k in _turboio.select(tensors, list(sd), path)}
        return _convert(sd, dtype) if isinstance(sd, dict) else sd

    # A local file's kind is read from its first bytes (in the page cache); a remote object is
    # opened once: loaded as safetensors straight away, and its kind asked only if that load
    # fails on its content (a torch checkpoint then goes the torch way; anything else raises
    # the safetensors error).
    if (state_dict or not remote) and _kind(path, cipher, storage) == "torch":
        return load_pt()
    if state_dict:
        return _load_into(path, state_dict, n, cache, cipher, helper, storage)
    pool = helper._pool if isinstance(helper, IOHelper) else None
    staging = None  # the device's process pool
    if isinstance(helper, IOHelper):
        helper._used(device)
    try:
        loaded = _turboio.load(
            path,
            threads=n,
            cache=cache,
            pool=pool,
            progress=progress,
            cipher=cipher,
            device=device,
            gds=_cuda.gds_setting(),
            staging=staging,
            dtype=dtype,
            storage=storage,
            tensors=tensors,
            max_host_memory=max_host_memory,
            max_device_memory=max_device_memory,
        )
    except ValueError:
        if remote and _kind(path, cipher, storage) == "torch":
            return load_pt()
        raise
    except FileNotFoundError as e:
        # A model's key prefix is no object: say what loads it.
        if remote and not _turboio._names_a_checkpoint_file(path):
            raise FileNotFoundError(
                f"{e}; if {_remote.shown(path)} is a model's prefix (its index and shards under it), "
                f"load it with turboio.load_model"
            ) from None
        raise
    return _tensors_of(loaded, aliases=enable_fast_mode)


def _load_into(path, state_dict, num_thread, cache, cipher, helper=None, storage=None):
    data_start, _, _, infos = _turboio.read_header(path, cipher=cipher, storage=storage)
    gpu = {state_dict[name].device for name, *_ in infos if state_dict[name].device.type == "cuda"}
    if gpu:
        return _load_into_cuda(path, state_dict, infos, num_thread, cache, cipher, helper, gpu, storage)
    requests, resize = [], []
    for name, dtype, shape, begin, end in infos:
        t = state_dict[name]
        if t.device.type != "cpu":
            raise _not_yet(f"loading into {t.device} tensors")
        if not t.is_contiguous():
            raise RuntimeError("allocated tensor not contiguous")
        if t.dtype != _torch_dtype_for(dtype, shape):
            raise RuntimeError("allocated tensor dtype not match")
        if t.numel() * t.element_size() < end - begin:
            raise RuntimeError("allocated tensor size not enough")
        if end > begin:
            requests.append((data_start + begin, t.data_ptr(), end - begin))
        resize.append((t, shape))
    _turboio._read_into(path, requests, threads=num_thread, cache=cache, cipher=cipher, storage=storage)
    for t, shape in resize:
        if list(t.shape) != list(shape):
            t.resize_(shape)
    return state_dict


def _load_into_cuda(path, state_dict, infos, num_thread, cache, cipher, helper, devices, storage=None):
    """Pre-allocated CUDA tensors: the file is loaded to their GPU, then copied into them on the
    device (veTurboIO's checks first, so nothing is half-filled on a mismatch)."""
    if len(devices) > 1 or any(state_dict[name].device.type != "cuda" for name, *_ in infos):
        raise _not_yet("loading into tensors on several devices")
    device = str(next(iter(devices)))
    for name, dtype, shape, begin, end in infos:
        t = state_dict[name]
        if not t.is_contiguous():
            raise RuntimeError("allocated tensor not contiguous")
        if t.dtype != _torch_dtype_for(dtype, shape):
            raise RuntimeError("allocated tensor dtype not match")
        if t.numel() * t.element_size() < end - begin:
            raise RuntimeError("allocated tensor size not enough")
    if isinstance(helper, IOHelper):
        helper._used(_cuda.target(device))
    loaded = _turboio.load(
        path,
        threads=num_thread,
        cache=cache,
        cipher=cipher,
        device=_cuda.target(device),
        storage=storage,
    )
    src = _tensors_of(loaded, aliases=False)
    for name, dtype, shape, begin, end in infos:
        t = state_dict[name]
        if list(t.shape) != list(shape):
            t.resize_(shape)
        if end > begin:
            t.copy_(src[name])
    return state_dict


def load_to_shmem(
    file,
    num_thread=32,
    helper=None,
    use_direct_io=False,
    use_cipher=None,
    cache=None,
    storage_options=None,
    cache_dir=None,
):
    """Copies a file into a new `multiprocessing.shared_memory.SharedMemory` (named with 10
    random letters); the caller must `close()` and `unlink()` it. `file` may be an object-store
    URL (`storage_options` and `cache_dir` as for `load`)."""
    import ctypes
    import random
    import string
    from multiprocessing import shared_memory

    path = _local_path(file)
    cipher = _cipher_for_load(use_cipher)
    storage = _remote.storage(path, storage_options, cache_dir)
    data = None
    if _kind(path, cipher, storage) == "safetensors":
        _, size, _, _ = _turboio.read_header(path, cipher=cipher, storage=storage)  # validates before copying
    elif cipher or _is_remote(path):
        data = _turboio.read_all(path, cipher=cipher, storage=storage)
        size = len(data)
    else:
        size = _os.path.getsize(path)
    name = "".join(random.sample(string.ascii_letters, 10))
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
    try:
        if data is not None:
            shm.buf[:size] = data
        elif size:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(shm.buf))
            policy = _cache_policy(use_direct_io, cache)
            _turboio._read_into(
                path, [(0, addr, size)], threads=_threads(num_thread), cache=policy, cipher=cipher, storage=storage
            )
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    return shm


def save_file(
    state_dict,
    file,
    force_contiguous=True,
    force_save_shared_tensor=False,
    force_clone_shared_tensor=False,
    metadata=None,
    use_cipher=False,
    helper=None,
    enable_fast_mode=False,
    blocking=True,
    storage_options=None,
    reuse_blocks=False,
    max_host_memory=None,
):
    """Saves a dict of tensors as safetensors, atomically (the old file survives any failure).

    With `blocking=False` (a turboio extension) the call returns once the tensors are copied
    into reused host buffers, with a handle (`wait()`, `done()`, `exception()`, `progress()`)
    while the file is written in the background; saves of one path land in order, and the
    interpreter waits for pending saves at exit. `max_host_memory` (bytes, or "8GiB") bounds
    those buffers: a larger copy raises `MemoryError` before anything is copied, and a save
    that would take the pending saves' buffers past it waits for them first.

    With `force_save_shared_tensor`, tensors sharing memory are stored once and the others
    recorded as aliases in `__metadata__` (they are removed from `state_dict`, or cloned with
    `force_clone_shared_tensor`), exactly as veTurboIO does.

    `file` may be an object-store URL (`s3://bucket/key.safetensors`, `gs://`, `az://`): a
    multipart upload from the tensors, visible only once complete (an error or a kill leaves
    the previous object as it was); `storage_options` as for `load`.

    `reuse_blocks=True` (a turboio extension) writes a replacing save of a local file into the
    blocks of the previous version, kept hidden by the last replacing save, instead of new
    blocks (see `turboio.torch.save_file`).
    """
    path = _local_path(file)
    cipher, header = _cipher_for_save(use_cipher)
    if force_clone_shared_tensor and not force_save_shared_tensor:
        import warnings

        warnings.warn("force_clone_shared_tensor has no effect without force_save_shared_tensor")
    if force_save_shared_tensor:
        metadata = _alias_shared(state_dict, metadata, clone=force_clone_shared_tensor)
    tensors = state_dict
    if force_contiguous:
        tensors = {k: (v.contiguous() if hasattr(v, "contiguous") else v) for k, v in state_dict.items()}
    from .torch import _write

    storage = _remote.storage(path, storage_options)
    return _write(
        tensors,
        path,
        metadata,
        cipher=cipher,
        cipher_header=header,
        blocking=blocking,
        storage=storage,
        reuse_blocks=reuse_blocks,
        max_host_memory=max_host_memory,
    )


def save_model(model, file, use_cipher=False):
    """Saves a model's state dict; shared parameters are stored once (aliases in `__metadata__`)."""
    from . import torch as st

    path = _local_path(file)
    cipher, header = _cipher_for_save(use_cipher)
    st._save_model(model, path, cipher=cipher, cipher_header=header)


def save_pt(state_dict, file, use_cipher=False, storage_options=None):
    """`torch.save`, written atomically (and encrypted with `use_cipher`, as veTurboIO does).
    `file` may be an object-store URL (`storage_options` as for `save_file`)."""
    import io

    import torch

    path = _local_path(file)
    cipher, header = _cipher_for_save(use_cipher)
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    storage = _remote.storage(path, storage_options)
    _turboio.write_file(path, buf.getvalue(), cipher=cipher, cipher_header=header, storage=storage)
