"""torch.distributed.checkpoint (DCP) storage on turboio: drop-ins for DCP's own
``FileSystemWriter`` and ``FileSystemReader``::

    import torch.distributed.checkpoint as dcp
    from turboio.dcp import FileSystemWriter, FileSystemReader

    dcp.save(state_dict, storage_writer=FileSystemWriter("/ckpt/step-100"))
    fut = dcp.async_save(state_dict, storage_writer=FileSystemWriter("/ckpt/step-200"))
    dcp.load(state_dict, storage_reader=FileSystemReader("/ckpt/step-200"))

The checkpoint is DCP's own format (the same planning, ``.metadata``, item layout and
``torch.save`` serialization), so DCP's own reader loads what turboio writes and turboio's
reader loads what DCP writes; resharding (save with 2 ranks, load with 3) is DCP's planner's,
unchanged. What turboio changes is how the bytes move and how a save is committed:

- **Writes**: each data file is assembled in memory and written by turboio's parallel writer
  (``O_DIRECT`` where the file system allows it, several chunks in flight), synced, and given
  its name atomically; ``thread_count`` files per rank are written at the same time, as DCP's
  buckets are.
- **Atomic commit**: every save writes data files under names of its own
  (``__{rank}_{n}.{save}.distcp``), never over the files of the checkpoint already there; the
  ``.metadata`` file is written last, after every rank's data is durable, and renamed over the
  old one in one step (DCP's own writer deletes the old ``.metadata`` before renaming, and
  rewrites the old data files in place). A job killed at any point of a save leaves the
  previous checkpoint loadable, exactly, or the new one complete; never a mix. After the
  commit, the coordinator deletes the data files no ``.metadata`` refers to any more.
- **Reads**: the byte ranges a rank needs are read in parallel (up to ``window`` bytes at a
  time), then each item is deserialized as DCP does (``torch.load(weights_only=True)``).

Local directories only for now (an ``s3://`` or other URL is refused with a clear error), and
unencrypted; ``sync_files=False`` is accepted but data files are synced anyway (a save that is
not durable cannot be committed safely). ``_extensions`` and the safetensors serialization are
refused (DCP's own reader cannot load the latter; use DCP's Hugging Face storage classes).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import _turboio

__all__ = ["FileSystemWriter", "FileSystemReader"]

#: Data files turboio's writer names: ``__{rank}_{n}.{save}.distcp``.
_OURS = re.compile(r"^__\d+_\d+\.[0-9a-f]+\.distcp$")
_METADATA = ".metadata"


def _local(path, what: str) -> str:
    p = os.fspath(path)
    if "://" in p:
        raise ValueError(f"{what}: {p}: only local directories are supported by turboio.dcp for now")
    return p


def _as_uint8(buffer) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)


def _write_atomic(path: str, buffer, threads: int = 0):
    """``buffer`` (a bytes-like object) to ``path``: written in parallel, synced, renamed."""
    view = _as_uint8(buffer)
    _turboio._write_file_from(path, view.data_ptr() if view.numel() else 0, view.numel(), threads=threads)


class FileSystemWriter(_fs.FileSystemWriter):
    """DCP's ``FileSystemWriter``, same arguments, writing through turboio (see the module doc)."""

    def __init__(
        self,
        path,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions=None,
        serialization_format=_fs.SerializationFormat.TORCH_SAVE,
    ) -> None:
        if _extensions:
            raise ValueError("turboio.dcp.FileSystemWriter: _extensions are not supported")
        if serialization_format != _fs.SerializationFormat.TORCH_SAVE:
            raise ValueError(
                "turboio.dcp.FileSystemWriter: only SerializationFormat.TORCH_SAVE (DCP's FileSystemReader cannot "
                "load its safetensors format; use torch's HuggingFaceStorageWriter for a model directory)"
            )
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"turboio.dcp.FileSystemWriter: thread_count must be a positive integer, not {thread_count!r}")
        super().__init__(
            _local(path, "turboio.dcp.FileSystemWriter"),
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
        )

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            _local(checkpoint_id, "turboio.dcp.FileSystemWriter")
        super().reset(checkpoint_id)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        prefix = plan.storage_data.prefix
        save = secrets.token_hex(6)
        if self.single_file_per_rank:
            buckets = _fs._split_by_size_and_type(self.thread_count, plan.items)
        else:
            buckets = [[item] for item in plan.items]
        names = [f"{prefix}{n}.{save}{_fs.DEFAULT_SUFFIX}" for n in range(len(buckets))]
        # Items are resolved (and copied to the CPU) in this thread, one file after another, as
        # DCP's planner expects; each file's write runs in the background meanwhile.
        results: list[WriteResult] = []
        pending = []
        with ThreadPoolExecutor(max_workers=max(1, min(len(buckets), self.thread_count))) as pool:
            for name, bucket in zip(names, buckets):
                buf, file_results = _serialize(bucket, planner, name)
                results.extend(file_results)
                pending.append(pool.submit(_write_atomic, os.path.join(self.path, name), buf.getbuffer()))
            for f in pending:
                f.result()
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results) -> None:
        metadata.version = _fs.CURRENT_DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        per_rank = not self.use_collectives and self.rank is not None
        name = f"__{self.rank}{_METADATA}" if per_rank else _METADATA
        # The commit: written to a temporary name, synced, renamed over the old one (which stays
        # whole until then), and the directory synced.
        _write_atomic(os.path.join(self.path, name), bytearray(pickle.dumps(metadata)))
        _remove_unreferenced(self.path, {info.relative_path for info in storage_md.values()},
                             f"__{self.rank}_" if per_rank else "__")


class FileSystemReader(_fs.FileSystemReader):
    """DCP's ``FileSystemReader``, reading through turboio (see the module doc); ``window``
    bounds the bytes read ahead of deserialization (default 256 MiB, or one item if larger)."""

    def __init__(self, path, _extension_registry=None, *, window: int = 256 << 20, threads: int = 0) -> None:
        if _extension_registry is not None:
            raise ValueError("turboio.dcp.FileSystemReader: _extension_registry is not supported")
        super().__init__(_local(path, "turboio.dcp.FileSystemReader"))
        self.window = window
        self.threads = threads

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            _local(checkpoint_id, "turboio.dcp.FileSystemReader")
        super().reset(checkpoint_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file.setdefault(info.relative_path, []).append(req)
        for relative_path, reqs in per_file.items():
            path = os.path.join(self.path, relative_path)
            # Each stored item once (several requests may narrow the same one), in file order.
            items: dict[tuple[int, int], list] = {}
            for req in reqs:
                info = self.storage_data[req.storage_index]
                if info.transform_descriptors:
                    raise ValueError(f"{path}: items with stream transforms ({info.transform_descriptors}) are not supported")
                items.setdefault((info.offset, info.length), []).append(req)
            order = sorted(items)
            start = 0
            while start < len(order):
                end, total = start, 0
                while end < len(order) and (end == start or total + order[end][1] <= self.window):
                    total += order[end][1]
                    end += 1
                window = order[start:end]
                buf = torch.empty(total, dtype=torch.uint8)
                at, requests, spans = 0, [], []
                for off, length in window:
                    requests.append((off, buf.data_ptr() + at, length))
                    spans.append(at)
                    at += length
                if total:
                    _read(path, requests, self.threads)
                raw = memoryview(buf.numpy())
                for (off, length), at in zip(window, spans):
                    data = raw[at : at + length]
                    for req in items[(off, length)]:
                        _deliver(req, data, planner, path)
                start = end
        fut: Future = Future()
        fut.set_result(None)
        return fut


def _read(path: str, requests, threads: int):
    try:
        _turboio._read_into(path, requests, threads=threads)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: a data file of the checkpoint is missing") from None


def _deliver(req, data, planner: LoadPlanner, path: str):
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(data))
        return
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file and item named
        raise ValueError(f"{path}: item {req.storage_index.fqn} cannot be read: {e}") from e
    tensor = _fs.narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise ValueError(f"{path}: item {req.storage_index.fqn}: size {tuple(tensor.size())} != {tuple(target.size())}")
    target.copy_(tensor)
    planner.commit_tensor(req, target)


def _serialize(items, planner: SavePlanner, name: str):
    """One data file's bytes, as DCP's writer lays them out (byte items first, then tensors,
    each tensor one ``torch.save`` archive), and its write results."""
    buf = io.BytesIO()
    results = []

    def record(item, offset):
        length = buf.tell() - offset
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_fs._StorageInfo(name, offset, length)))

    for item in (i for i in items if i.type == WriteItemType.BYTE_IO):
        offset = buf.tell()
        buf.write(planner.resolve_data(item).getbuffer())
        record(item, offset)
    for item in (i for i in items if i.type != WriteItemType.BYTE_IO):
        tensor = planner.resolve_data(item).detach().cpu()
        if tensor.untyped_storage().size() != tensor.nbytes:
            tensor = tensor.clone()
        offset = buf.tell()
        torch.save(tensor, buf)
        record(item, offset)
    return buf, results


_cleanup_lock = threading.Lock()


def _remove_unreferenced(directory: str, referenced: set[str], prefix: str):
    """Deletes turboio's data files of earlier saves that the new metadata does not name, and the
    temporary files of data files whose saves were killed."""
    with _cleanup_lock:
        try:
            names = os.listdir(directory)
        except OSError:
            return
        for n in names:
            p = os.path.join(directory, n)
            if n.startswith(prefix) and _OURS.match(n) and n not in referenced:
                pass
            elif n.startswith(".") and "turboio" in n:
                # A temporary file of a data file whose save was killed (its writer is gone).
                target = _turboio._abandoned_temp_target(p)
                if target is None or not (target.startswith(prefix) and _OURS.match(target)):
                    continue
            else:
                continue
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
