"""DeepSpeed DeepNVMe's tensor I/O handles, on turboio's engine.

A drop-in for DeepSpeed's ``async_io`` and ``gds`` ops: change the import and keep the code::

    from turboio.deepnvme import AsyncIOBuilder          # was: from deepspeed.ops.op_builder import ...

    h = AsyncIOBuilder().load().aio_handle(block_size=1 << 20, queue_depth=128,
                                           single_submit=False, overlap_events=False,
                                           intra_op_parallelism=1)
    buf = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
    h.sync_pwrite(buf, "/nvme/x.bin")           # 1
    h.sync_pread(buf, "/nvme/x.bin", 4096)      # 1
    h.async_pread(buf, "/nvme/x.bin"); h.wait() # 0, then 1

Same methods, arguments (``example_tenosr`` spelled as DeepSpeed spells it), defaults and return
values as DeepSpeed 0.19's handles: ``sync_*`` return 1 (the operations completed), ``async_*``
return 0 once queued and ``wait()`` the number completed; -1 when the file cannot be opened or
stat'ed, or when the size is not a multiple of ``intra_op_parallelism``, with the reason logged
(logger ``turboio.deepnvme``). Nothing to build: no libaio, no ninja, no JIT.

Where turboio differs, on purpose:

- **Any offset and length.** Bytes go with ``O_DIRECT`` in whole blocks and the unaligned head
  and tail through the page cache, from and into any buffer. DeepSpeed's handle writes nothing
  and reads nothing for an unaligned offset, length or buffer, and still returns success.
- **Errors are raised, never swallowed or fatal.** A read past the end of the file raises
  ``ValueError`` and ``wait()`` with nothing pending raises ``RuntimeError`` (DeepSpeed's
  asserts end the process); an I/O error raises ``OSError`` naming the file (from the sync call,
  or from ``wait()`` once every pending operation finished; DeepSpeed ignores them); a buffer
  that is not contiguous raises ``ValueError`` (DeepSpeed reads into the storage behind it).
  The one exception is DeepSpeed's own contract: a file that cannot be opened (missing, no
  permission, a directory) makes the call return -1, as DeepSpeed's does, with the reason logged
  at ERROR to the ``turboio.deepnvme`` logger (which Python prints to standard error when no
  logging is configured); code written for DeepSpeed checks that -1.
- **Threads.** Each operation is read or written by turboio's parallel engine (io_uring with
  ``O_DIRECT``, 1 MiB chunks by default); ``intra_op_parallelism`` > 1 sets its thread count,
  ``block_size`` the chunk size of writes, the other settings are kept for the getters only. Queued
  (async) operations run one after another in the order queued, each in parallel, while the
  caller goes on; the GIL is released during I/O.
- **Locked memory.** ``new_cpu_locked_tensor`` returns page-aligned memory, page-locked with
  CUDA (``pin_memory``) when a GPU is present, else ``mlock``-ed where the limit allows (a
  warning once when it does not). ``free_cpu_locked_tensor`` unlocks it; the memory itself lives
  as long as the tensor (DeepSpeed frees it under the tensor).
- **GPU tensors** go through a page-locked bounce buffer of the tensor's size, for both
  handles. ``gds_handle`` keeps its device-memory methods (``new_pinned_device_tensor``,
  ``pin_device_tensor``, ...) for code written against it, but does not read through cuFile:
  turboio's GDS path serves whole loads and saves (``gds=`` in ``turboio.load``).

Writes are raw positional writes, as DeepSpeed's: in place, the file created with mode 0600
when missing (DeepSpeed's mode; turboio's own saves create files with the umask's mode, as
``open`` does) and never truncated, not synced. For checkpoints that must survive a crash, use
``turboio.save_file`` (atomic) or ``turboio.dcp``.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import types
from concurrent.futures import Future, ThreadPoolExecutor

from . import _turboio

__all__ = ["AsyncIOBuilder", "GDSBuilder", "aio_handle", "gds_handle"]

_log = logging.getLogger("turboio.deepnvme")

#: What ``get_alignment`` reports per thread, as DeepSpeed does (its ``O_DIRECT`` unit).
_O_DIRECT_ALIGNMENT = 512


def _torch():
    import torch

    return torch


class _Failed(Exception):
    """A check that DeepSpeed answers with -1 (logged, not raised)."""


def _nbytes(buffer) -> int:
    return buffer.numel() * buffer.element_size()


def _check_buffer(buffer, what: str):
    torch = _torch()
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{what}: buffer must be a torch.Tensor, not {type(buffer).__name__}")
    if not buffer.is_contiguous():
        raise ValueError(f"{what}: buffer must be contiguous (call .contiguous() and copy back)")


def _path(filename) -> str:
    if isinstance(filename, (bytes, bytearray)):
        return os.fsdecode(filename)
    return os.fspath(filename)


class aio_handle:  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's ``aio_handle``: reads and writes between tensors and files (see the module doc)."""

    def __init__(
        self,
        block_size: int = 1048576,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
    ):
        for name, v in (("block_size", block_size), ("queue_depth", queue_depth)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"aio_handle: {name} must be a positive integer, not {v!r}")
        if not isinstance(intra_op_parallelism, int) or intra_op_parallelism <= 0:
            raise ValueError(f"aio_handle: intra_op_parallelism must be a positive integer, not {intra_op_parallelism!r}")
        self._block_size = block_size
        self._queue_depth = queue_depth
        self._single_submit = bool(single_submit)
        self._overlap_events = bool(overlap_events)
        self._intra = intra_op_parallelism
        self._lock = threading.Lock()
        self._pending: list[Future] = []
        self._executor: ThreadPoolExecutor | None = None
        self._locked: dict[int, tuple[object, int, bool]] = {}

    # -- getters ------------------------------------------------------------------------------

    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra

    def get_alignment(self) -> int:
        return self._intra * _O_DIRECT_ALIGNMENT

    # -- reads and writes ---------------------------------------------------------------------

    def sync_pread(self, buffer, filename, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer, filename, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, False, False, file_offset)

    def async_pread(self, buffer, filename, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, False, True, file_offset)

    def async_pwrite(self, buffer, filename=None, file_offset: int = 0, *, fd: int | None = None) -> int:
        """Queues a write of ``buffer`` to ``filename``, or to an open descriptor (``fd``, or an
        ``int`` in place of the name, as DeepSpeed's overload takes it)."""
        target = fd if fd is not None else filename
        return self.pwrite(buffer, target, False, True, file_offset)

    def pread(self, buffer, filename, validate, is_async=None, file_offset: int = 0, **kw) -> int:
        """Reads ``buffer.nbytes`` bytes of ``filename`` from ``file_offset`` (``async`` as the
        fourth argument, as in DeepSpeed)."""
        is_async = _async_arg("pread", is_async, kw)
        _check_buffer(buffer, "pread")
        path = _path(filename)
        try:
            self._check_read(path, file_offset, _nbytes(buffer))
        except _Failed as e:
            _log.error("%s", e)
            return -1
        if not _can_open(path, os.O_RDONLY):
            return -1
        return self._run(lambda: self._do_read(buffer, path, file_offset, validate), is_async, path)

    def pwrite(self, buffer, filename, validate, is_async=None, file_offset: int = 0, **kw) -> int:
        """Writes ``buffer`` into ``filename`` at ``file_offset``, in place (``async`` as the
        fourth argument, as in DeepSpeed)."""
        is_async = _async_arg("pwrite", is_async, kw)
        _check_buffer(buffer, "pwrite")
        if isinstance(filename, int) and not isinstance(filename, bool):
            if filename < 0:
                raise ValueError(f"pwrite: file descriptor must not be negative, not {filename}")
            path = f"/proc/self/fd/{filename}"
        else:
            path = _path(filename)
        if file_offset < 0:
            raise ValueError(f"{path}: file_offset must not be negative, not {file_offset}")
        n = _nbytes(buffer)
        if n % self._intra:
            _log.error("%s: write of %d bytes is not divisible by intra_op_parallelism = %d", path, n, self._intra)
            return -1
        # Opened (and created) now, as DeepSpeed's handle does before queueing: a file that
        # cannot be opened is -1 from this call, not an error from wait().
        if not _can_open(path, os.O_WRONLY | os.O_CREAT):
            return -1
        return self._run(lambda: self._do_write(buffer, path, file_offset, validate), is_async, path)

    def read(self, buffer, filename, validate, file_offset: int = 0) -> int:
        """Reads the whole file into ``buffer``, whose size must be the file's; returns 0."""
        _check_buffer(buffer, "read")
        path = _path(filename)
        try:
            size = os.stat(path).st_size
        except OSError as e:
            _log.error("%s: fstat for read failed: %s", path, e.strerror)
            return -1
        if _nbytes(buffer) != size:
            raise ValueError(f"{path}: read needs a buffer of the file's size: {_nbytes(buffer)} bytes != {size}")
        r = self._run(lambda: self._do_read(buffer, path, file_offset, validate), False, path)
        return 0 if r == 1 else r

    def write(self, buffer, filename, validate, file_offset: int = 0) -> int:
        """Writes ``buffer`` into ``filename`` at ``file_offset``; returns 0."""
        _check_buffer(buffer, "write")
        path = _path(filename)
        r = self._run(lambda: self._do_write(buffer, path, file_offset, validate), False, path)
        return 0 if r == 1 else r

    def wait(self) -> int:
        """Waits for every queued operation and returns how many completed; raises the first
        error among them after all finished."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            raise RuntimeError("wait(): no operation is pending (DeepSpeed's handle asserts here)")
        first = None
        for f in pending:
            e = f.exception()
            if e is not None and first is None:
                first = e
        if first is not None:
            raise first
        return len(pending)

    # -- locked memory ------------------------------------------------------------------------

    def new_cpu_locked_tensor(self, num_elem: int, example_tenosr):  # noqa: D401 - DeepSpeed's spelling
        """A page-aligned, page-locked CPU tensor of ``num_elem`` elements of ``example_tenosr``'s dtype."""
        torch = _torch()
        if not isinstance(num_elem, int) or num_elem < 0:
            raise ValueError(f"new_cpu_locked_tensor: num_elem must be a non-negative integer, not {num_elem!r}")
        dtype = example_tenosr.dtype
        nbytes = num_elem * torch.empty(0, dtype=dtype).element_size()
        if torch.cuda.is_available():
            t = torch.empty(num_elem, dtype=dtype, pin_memory=True)
            with self._lock:
                self._locked[t.data_ptr()] = (None, nbytes, False)
            return t
        page = mmap.PAGESIZE
        region = mmap.mmap(-1, max(page, -(-nbytes // page) * page))
        t = torch.frombuffer(region, dtype=torch.uint8, count=nbytes).view(dtype) if nbytes else torch.empty(0, dtype=dtype)
        locked = bool(nbytes) and _mlock(t.data_ptr(), nbytes)
        with self._lock:
            self._locked[t.data_ptr()] = (region, nbytes, locked)
        return t

    def free_cpu_locked_tensor(self, tensor) -> bool:
        """Unlocks a tensor of ``new_cpu_locked_tensor``; False for any other tensor."""
        with self._lock:
            entry = self._locked.pop(tensor.data_ptr(), None)
        if entry is None:
            return False
        _region, nbytes, locked = entry
        if locked:
            _munlock(tensor.data_ptr(), nbytes)
        return True

    def is_pinned(self, buffer) -> bool:
        with self._lock:
            if buffer.data_ptr() in self._locked:
                return True
        try:
            return bool(buffer.is_pinned())
        except RuntimeError:  # no accelerator in this torch build
            return False

    # -- internals ----------------------------------------------------------------------------

    def _threads(self) -> int:
        return self._intra if self._intra > 1 else 0

    def _check_read(self, path: str, file_offset: int, n: int):
        if file_offset < 0:
            raise ValueError(f"{path}: file_offset must not be negative, not {file_offset}")
        try:
            size = os.stat(path).st_size
        except OSError as e:
            raise _Failed(f"{path}: fstat for read failed: {e.strerror}") from None
        if file_offset + n > size:
            raise ValueError(f"{path}: file_offset + buffer nbytes > file bytes: {file_offset + n} > {size}")
        if n % self._intra:
            raise _Failed(f"{path}: read of {n} bytes is not divisible by intra_op_parallelism = {self._intra}")

    def _run(self, op, is_async: bool, path: str) -> int:
        if not is_async:
            try:
                op()
            except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as e:
                _log.error("open failed: %s", e)
                return -1
            return 1
        with self._lock:
            if self._executor is None:
                # One operation after another, in the order queued (each one parallel inside).
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="turboio-deepnvme")
            self._pending.append(self._executor.submit(op))
        return 0

    def _read(self, path: str, file_offset: int, addr: int, n: int):
        # As DeepSpeed's handle: `queue_depth` requests of `block_size` bytes in flight per thread.
        _turboio._read_into(path, [(file_offset, addr, n)], threads=self._threads(), cache="bypass",
                            queue_depth=self._queue_depth, block_size=self._block_size)

    def _do_read(self, buffer, path: str, file_offset: int, validate: bool):
        n = _nbytes(buffer)
        if n == 0:
            return
        if buffer.device.type == "cpu":
            self._read(path, file_offset, buffer.data_ptr(), n)
            host = buffer
        else:
            host = _bounce(n)
            self._read(path, file_offset, host.data_ptr(), n)
            buffer.view(-1).view(_torch().uint8).copy_(host)
        if validate:
            _validate(path, file_offset, host, "read")

    def _do_write(self, buffer, path: str, file_offset: int, validate: bool):
        n = _nbytes(buffer)
        if buffer.device.type == "cpu":
            host = buffer
        else:
            host = _bounce(n)
            host.copy_(buffer.view(-1).view(_torch().uint8))
        _turboio._write_at(path, file_offset, host.data_ptr() if n else 0, n, threads=self._threads(), cache="bypass",
                           chunk=self._block_size)
        if validate:
            _validate(path, file_offset, host, "write")

    def __del__(self):
        ex = getattr(self, "_executor", None)
        if ex is not None:
            ex.shutdown(wait=True)


class gds_handle(aio_handle):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's ``gds_handle``: ``aio_handle``'s methods plus its device-memory ones (see the
    module doc: device tensors go through a page-locked bounce buffer, not cuFile)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._device: set[int] = set()

    def new_pinned_device_tensor(self, num_elem: int, example_tenosr, device: str = "cuda"):
        torch = _torch()
        if not torch.cuda.is_available():
            raise RuntimeError("new_pinned_device_tensor: no CUDA device (torch.cuda.is_available() is False)")
        t = torch.empty(num_elem, dtype=example_tenosr.dtype, device=device)
        self._device.add(t.data_ptr())
        return t

    def free_pinned_device_tensor(self, tensor) -> bool:
        return self.unpin_device_tensor(tensor)

    def pin_device_tensor(self, tensor) -> bool:
        if tensor.device.type != "cuda":
            return False
        self._device.add(tensor.data_ptr())
        return True

    def unpin_device_tensor(self, tensor) -> bool:
        try:
            self._device.remove(tensor.data_ptr())
        except KeyError:
            return False
        return True


class AsyncIOBuilder:
    """``AsyncIOBuilder().load()`` gives a module-like object with ``aio_handle``, as DeepSpeed's
    JIT-built op does; nothing is compiled."""

    NAME = "async_io"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = True):
        return types.SimpleNamespace(aio_handle=aio_handle)


class GDSBuilder:
    """``GDSBuilder().load()`` gives a module-like object with ``gds_handle``."""

    NAME = "gds"

    def is_compatible(self, verbose: bool = False) -> bool:
        return _torch().cuda.is_available()

    def load(self, verbose: bool = True):
        return types.SimpleNamespace(gds_handle=gds_handle)


def _async_arg(what: str, is_async, kw) -> bool:
    if "async" in kw:
        is_async = kw.pop("async")
    if kw:
        raise TypeError(f"{what}() got unexpected keyword arguments: {', '.join(sorted(kw))}")
    if is_async is None:
        raise TypeError(f"{what}() missing required argument: 'async'")
    return bool(is_async)


def _can_open(path: str, flags: int) -> bool:
    try:
        os.close(os.open(path, flags | os.O_CLOEXEC, 0o600))
    except OSError as e:
        _log.error("%s: open failed: %s", path, e.strerror)
        return False
    return True


def _bounce(n: int):
    torch = _torch()
    return torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def _validate(path: str, file_offset: int, host, what: str):
    with open(path, "rb") as f:
        f.seek(file_offset)
        got = f.read(_nbytes(host))
    if got != host.view(-1).view(_torch().uint8).numpy().tobytes():
        raise OSError(f"{path}: validation after {what} failed: the file's bytes differ from the buffer's")


_libc = None
_warned_mlock = False


def _mlock(addr: int, n: int) -> bool:
    global _libc, _warned_mlock
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(n)) == 0:
        return True
    if not _warned_mlock:
        _warned_mlock = True
        err = ctypes.get_errno()
        _log.warning(
            "new_cpu_locked_tensor: mlock of %d bytes failed (%s); the memory is page-aligned but not locked "
            "(raise `ulimit -l` to lock it)",
            n,
            os.strerror(err),
        )
    return False


def _munlock(addr: int, n: int):
    if _libc is not None:
        _libc.munlock(ctypes.c_void_p(addr), ctypes.c_size_t(n))
