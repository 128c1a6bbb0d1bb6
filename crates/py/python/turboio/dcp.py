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

- **Writes**: each data file is ``torch.save``'s output for its items, gathered without copying
  the tensors' bytes (torch hands them over as views of the tensors' own memory; only zip
  records and pickles are copied), and written by turboio's parallel writer straight from that
  memory (one copy into aligned buffers, ``O_DIRECT`` where the file system allows it, several
  chunks in flight), synced and given its name atomically. A rank's items go into at least
  ``thread_count`` files (DCP's buckets) and one more per 512 MiB; up to ``max(2,
  thread_count)`` are written at the same time while the next is serialized.
- **Atomic commit**: every save writes data files under names of its own
  (``__{rank}_{n}.{save}.distcp``), never over the files of the checkpoint already there; the
  ``.metadata`` file is written last, after every rank's data is durable, and renamed over the
  old one in one step (DCP's own writer deletes the old ``.metadata`` before renaming, and
  rewrites the old data files in place). A job killed at any point of a save leaves the
  previous checkpoint loadable, exactly, or the new one complete; never a mix. After the
  commit, the coordinator deletes the data files no ``.metadata`` refers to any more.
- **Reads**: a tensor item wanted whole by a contiguous CPU tensor of its dtype and shape (the
  common case: no resharding, or whole tensors on each rank) is read straight from the file into
  that tensor, all of a file's items in one parallel pass, after its ``torch.save`` records are
  checked (the first 4 KiB of the item: the pickle, read without building anything, and the zip
  records; the record's size after the read). Other items (narrowed by resharding, a
  non-contiguous or other-device destination, non-tensor items) are read in parallel up to
  ``window`` bytes at a time and deserialized as DCP does (``torch.load(weights_only=True)``).

- **Encryption**: ``FileSystemWriter(..., use_cipher=True)`` encrypts every data file and the
  metadata with turboio's AES-CTR and key sources (``VETURBOIO_USE_CIPHER=1`` does the same, and
  ``VETURBOIO_CIPHER_HEADER=1`` adds veTurboIO's key header); ``FileSystemReader(...,
  use_cipher=True)`` (or the variable) reads them.
- **Untrusted metadata**: the reader unpickles ``.metadata`` with DCP's metadata classes only,
  and refuses data files outside the checkpoint directory. A non-tensor item (``step``, a config
  dict) whose destination is a tensor is refused; any other is unpickled with
  ``weights_only=True`` first and refused if that refuses it, then handed to DCP's planner, whose
  ``load_bytes`` unpickles it again with ``weights_only=False`` (the same bytes, already shown to
  hold only what ``weights_only`` allows). ``FileSystemReader(..., allow_pickle=True)`` skips the
  check (DCP's own behaviour: code in a pickle runs): only for checkpoints you trust.

- **Object storage**: the path may be an ``s3://``, ``gs://``, ``az://``, ``abfs[s]://`` or
  ``http(s)://`` prefix, with credentials and endpoints from the environment or
  ``storage_options=`` (as every turboio API takes them). Each data file is one object,
  uploaded in parallel parts; ``.metadata`` is uploaded last, after every rank's objects are
  complete, and an object store replaces an object in one step, so the commit is as atomic as
  on a local disk. The objects no ``.metadata`` refers to any more are deleted after it.

- **Hugging Face layout**: ``HuggingFaceStorageWriter`` writes a full state dict saved from one
  process as a servable model directory (safetensors shards and their index; see the class).

``sync_files=False`` is accepted but data files are synced anyway (a save that is
not durable cannot be committed safely). ``_extensions`` and the safetensors serialization are
refused (DCP's own reader cannot load the latter; use ``HuggingFaceStorageWriter`` for a model
directory).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import secrets
import shutil
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import _cipher_for_load, _cipher_for_save, _remote, _turboio

__all__ = ["FileSystemWriter", "FileSystemReader", "HuggingFaceStorageWriter"]

#: Data files turboio's writer names: ``__{rank}_{n}.{save}.distcp``.
_OURS = re.compile(r"^__\d+_\d+\.[0-9a-f]+\.distcp$")
_METADATA = ".metadata"
#: A rank's data is split into files of about this size (at least ``thread_count`` files), so
#: that one is serialized while others are written.
_FILE_BYTES = 512 << 20


def _checked(path, what: str):
    """A checkpoint's location: an object-store URL (kept as a string) or a local directory."""
    p = os.fspath(path)
    if "://" in p and not _remote.is_object_url(p):
        raise ValueError(
            f"{what}: {p}: turboio.dcp takes local directories and object-store URLs "
            f"({', '.join(s[:-3] for s in _remote.OBJECT_SCHEMES)})"
        )
    return p


class _Files(_fs.FileSystem):
    """DCP's file-system operations (the ones its base classes call: paths, ``mkdir``,
    ``exists``, ``rm_file``, ``ls``) for a local directory or an object-store prefix; data and
    metadata are read and written by turboio itself."""

    def __init__(self, storage_options=None):
        self.storage_options = storage_options

    def storage(self, path):
        return _remote.storage(str(path), self.storage_options) if _remote.is_object_url(str(path)) else None

    def init_path(self, path):
        p = os.fspath(path)
        return p.rstrip("/") if _remote.is_object_url(p) else super().init_path(p)

    def concat_path(self, path, suffix):
        return f"{path}/{suffix}" if isinstance(path, str) and _remote.is_object_url(path) else super().concat_path(path, suffix)

    def mkdir(self, path):
        if not _remote.is_object_url(str(path)):  # an object store has no directories
            super().mkdir(path)

    def ls(self, path):
        if _remote.is_object_url(str(path)):
            return _turboio._list_files(str(path), storage=self.storage(path))
        return super().ls(path)

    def exists(self, path):
        p = str(path)
        if _remote.is_object_url(p):
            parent, name = p.rsplit("/", 1)
            return name in {q.rsplit("/", 1)[-1] for q in self.ls(parent)}
        return super().exists(path)

    def rm_file(self, path):
        if _remote.is_object_url(str(path)):
            _turboio._remove_file(str(path), storage=self.storage(path))
        else:
            super().rm_file(path)

    def create_stream(self, path, mode):
        if _remote.is_object_url(str(path)):
            raise NotImplementedError(f"{path}: turboio.dcp reads and writes objects itself")
        return super().create_stream(path, mode)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return _remote.is_object_url(str(checkpoint_id)) or super().validate_checkpoint_id(checkpoint_id)


def _write_file(path: str, segments, cipher=(False, False), storage=None):
    """The concatenation of memory ``segments`` ``[(address, length)]`` to ``path``: written in
    parallel (encrypted when ``cipher[0]``, with veTurboIO's key header when ``cipher[1]``),
    synced, renamed into place, its directory synced (an object: uploaded in parts and
    completed in one step)."""
    _turboio._write_file_segments(str(path), segments, cipher=cipher[0], cipher_header=cipher[1], storage=storage)


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
        *,
        use_cipher: bool = False,
        storage_options: dict | None = None,
    ) -> None:
        if _extensions:
            raise ValueError("turboio.dcp.FileSystemWriter: _extensions are not supported")
        if serialization_format != _fs.SerializationFormat.TORCH_SAVE:
            raise ValueError(
                "turboio.dcp.FileSystemWriter: only SerializationFormat.TORCH_SAVE (DCP's FileSystemReader cannot "
                "load its safetensors format; use turboio.dcp.HuggingFaceStorageWriter for a model directory)"
            )
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"turboio.dcp.FileSystemWriter: thread_count must be a positive integer, not {thread_count!r}")
        path = _checked(path, "turboio.dcp.FileSystemWriter")
        super().__init__(
            path,
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
        )
        self.fs = _Files(storage_options)
        self.path = self.fs.init_path(path)
        # Checked now, where the user sees a bad option first.
        self.fs.storage(self.path)
        self.cipher, self.cipher_header = _cipher_for_save(use_cipher)

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            checkpoint_id = _checked(checkpoint_id, "turboio.dcp.FileSystemWriter")
        super().reset(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return _Files.validate_checkpoint_id(checkpoint_id)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        prefix = plan.storage_data.prefix
        save = secrets.token_hex(6)
        if self.single_file_per_rank:
            # DCP's buckets, and more of them for a large rank (one per _FILE_BYTES), so that
            # serializing the next file overlaps writing the ones before.
            total = sum(_fs._item_size(i) for i in plan.items if i.type != WriteItemType.BYTE_IO)
            bins = max(self.thread_count, -(-total // _FILE_BYTES))
            buckets = [b for b in _fs._split_by_size_and_type(bins, plan.items) if b] or [[]]
        else:
            buckets = [[item] for item in plan.items]
        workers = max(2, self.thread_count)
        in_flight = threading.BoundedSemaphore(workers)
        results: list[WriteResult] = []
        pending = []

        storage = self.fs.storage(self.path)

        def write(path, gathered):
            try:
                _write_file(path, gathered.segments(), (self.cipher, self.cipher_header), storage)
            finally:
                in_flight.release()

        # Items are resolved (and copied to the CPU) in this thread, one file after another, as
        # DCP's planner expects; up to `workers` files are written in the background meanwhile.
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for n, bucket in enumerate(buckets):
                name = f"{prefix}{n}.{save}{_fs.DEFAULT_SUFFIX}"
                buf, file_results = _serialize(bucket, planner, name)
                results.extend(file_results)
                in_flight.acquire()
                pending.append(pool.submit(write, self.fs.concat_path(self.path, name), buf))
                del buf
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
        data = bytearray(pickle.dumps(metadata))
        _write_file(self.fs.concat_path(self.path, name), [(_address(memoryview(data)), len(data))],
                    (self.cipher, self.cipher_header), self.fs.storage(self.path))
        _remove_unreferenced(self.fs, self.path, {info.relative_path for info in storage_md.values()},
                             f"__{self.rank}_" if per_rank else "__")


def _piece_name(fqn: str, offsets) -> str:
    """The name of a rank's piece of tensor `fqn` at `offsets` in a consolidation's staging file."""
    return f"{fqn}@{','.join(map(str, offsets))}"


class HuggingFaceStorageWriter(FileSystemWriter):
    """Writes a DCP save as a Hugging Face model directory: safetensors shards
    (``model-0000N-of-0000M.safetensors``) and ``model.safetensors.index.json``, the layout
    ``transformers``, vLLM and ``turboio.load_model`` serve, and that torch's
    ``HuggingFaceStorageReader`` loads back. Arguments as torch's ``HuggingFaceStorageWriter``:
    ``fqn_to_index_mapping`` (``{name: file number}``, numbers from 1) fixes which shard holds
    each tensor (an existing model's layout); without it shards are cut at ``max_shard_size``
    (a turboio extension, default "5GB", as ``save_pretrained``).

    Two ways in, as torch's:

    - a full state dict saved from one process (``dcp.save(sd, storage_writer=...,
      no_dist=True)``, e.g. after ``get_model_state_dict(model,
      options=StateDictOptions(full_state_dict=True, cpu_offload=True))`` on rank 0): written
      straight as the model directory;
    - tensors sharded over ranks (DTensors, FSDP's sharded state dict) with
      ``save_distributed=True, enable_consolidation=True``: every rank writes its pieces to a
      hidden staging file (``.turboio-sharded/{save}/rank-{r}.safetensors``, in parallel), and
      the coordinator, once all are written, reads them back, assembles each whole tensor in host
      memory (it holds the whole model once) and writes the directory; the staging files are
      removed after the commit. ``save_distributed=True`` without consolidation (torch's per-rank
      files with no index) is refused: it is not a servable directory.

    Every item must be a tensor (non-tensor items are refused). The directory is written as
    ``turboio.save_model_dir`` writes one: shards in parallel, new shards never over the ones
    the current index names, the index last (the commit), the old set removed after; local
    paths or object-store prefixes (``storage_options``)."""

    def __init__(
        self,
        path,
        fqn_to_index_mapping: dict | None = None,
        thread_count: int = 1,
        save_distributed: bool = False,
        enable_consolidation: bool = False,
        thread_count_consolidation: int = 1,
        *,
        max_shard_size="5GB",
        storage_options: dict | None = None,
    ) -> None:
        if save_distributed != enable_consolidation:
            raise ValueError(
                "turboio.dcp.HuggingFaceStorageWriter writes a servable model directory: either a full state dict "
                "from one process (the defaults) or tensors sharded over ranks consolidated at the end "
                "(save_distributed=True, enable_consolidation=True)"
            )
        if fqn_to_index_mapping is not None and not (
            isinstance(fqn_to_index_mapping, dict)
            and all(isinstance(k, str) and isinstance(v, int) and v >= 1 for k, v in fqn_to_index_mapping.items())
        ):
            raise ValueError("turboio.dcp.HuggingFaceStorageWriter: fqn_to_index_mapping must map names to file numbers >= 1")
        super().__init__(path, thread_count=thread_count, storage_options=storage_options)
        self.fqn_to_index_mapping = fqn_to_index_mapping
        self.max_shard_size = max_shard_size
        self.consolidate = bool(enable_consolidation)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        holding = [i for i, p in enumerate(plans) if p.items]
        if len(holding) > 1 and not self.consolidate:
            raise ValueError(
                f"turboio.dcp.HuggingFaceStorageWriter: ranks {holding} all hold items of the save; a full state dict "
                "is written by one process (dcp.save(..., no_dist=True) on one rank), or pass save_distributed=True, "
                "enable_consolidation=True for tensors sharded over ranks"
            )
        tag = secrets.token_hex(6)
        return [dataclasses.replace(p, storage_data={"rank": i, "tag": tag}) for i, p in enumerate(plans)]

    def _tensors(self, plan: SavePlan, planner: SavePlanner):
        out = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                raise ValueError(
                    f"turboio.dcp.HuggingFaceStorageWriter: `{fqn}` is not a tensor (a model directory holds tensors only)"
                )
            out.append((item, planner.resolve_data(item).detach().cpu()))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        from .torch import save_file

        items = self._tensors(plan, planner)
        file_of = {}  # fqn -> the file holding it, relative to the checkpoint's path
        if items and self.consolidate:
            # This rank's pieces to one staging file of this save.
            name = f".turboio-sharded/{plan.storage_data['tag']}/rank-{plan.storage_data['rank']}.safetensors"
            pieces = {_piece_name(item.index.fqn, item.tensor_data.chunk.offsets): t.contiguous() for item, t in items}
            target = self.fs.concat_path(self.path, name)
            if not _remote.is_object_url(str(target)):
                os.makedirs(os.path.dirname(target), exist_ok=True)
            save_file(pieces, str(target), storage_options=self.fs.storage_options)
            file_of = dict.fromkeys((item.index.fqn for item, _ in items), name)
        elif items:
            for item, _ in items:
                chunk, size = item.tensor_data.chunk, item.tensor_data.size
                if any(chunk.offsets) or list(chunk.sizes) != list(size):
                    raise ValueError(
                        f"turboio.dcp.HuggingFaceStorageWriter: `{item.index.fqn}` is a shard {list(chunk.sizes)} of a "
                        f"tensor {list(size)}; save a full state dict, or pass save_distributed=True, "
                        "enable_consolidation=True"
                    )
            file_of = self._write_model({item.index.fqn: t for item, t in items})
        results = []
        for item, t in items:
            nbytes = t.numel() * t.element_size()
            info = _fs._StorageInfo(file_of.get(item.index.fqn, ""), 0, nbytes)
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=info))
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_model(self, tensors: dict) -> dict:
        """Writes the model directory (atomic as a set); returns its `weight_map`."""
        from .models import _save_model_dir

        shard_of = None
        if self.fqn_to_index_mapping is not None:
            missing = sorted(set(tensors) - set(self.fqn_to_index_mapping))
            if missing:
                raise ValueError(f"turboio.dcp.HuggingFaceStorageWriter: fqn_to_index_mapping has no file for {missing[:5]}")
            shard_of = self.fqn_to_index_mapping
        # DCP's thread_count defaults to 1; turboio's writer uses every core unless given more.
        index = _save_model_dir(
            tensors, str(self.path), self.max_shard_size, None, self.thread_count if self.thread_count > 1 else 0, False,
            self.fs.storage_options, shard_of=shard_of,
        )
        data = _turboio.read_all(index, storage=self.fs.storage(self.path), any_content=True)
        return json.loads(bytes(data))["weight_map"]

    def finish(self, metadata: Metadata, results) -> None:
        """With consolidation: each whole tensor assembled from the ranks' staging files, the
        model directory written, the staging files removed. Otherwise nothing is left to do:
        the index `write_data` wrote last was the commit."""
        if not self.consolidate:
            return
        from . import load as _load

        files = sorted({wr.storage_data.relative_path for wrs in results for wr in wrs})
        loaded = {f: _load(str(self.fs.concat_path(self.path, f)), storage_options=self.fs.storage_options) for f in files}
        tensors = {}
        for wrs in results:
            for wr in wrs:
                fqn = wr.index.fqn
                md = metadata.state_dict_metadata[fqn]
                whole = tensors.get(fqn)
                if whole is None:
                    whole = tensors[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
                offsets = list(wr.index.offset) if wr.index.offset is not None else [0] * len(md.size)
                piece = loaded[wr.storage_data.relative_path][_piece_name(fqn, offsets)]
                view = whole
                for dim, (at, n) in enumerate(zip(offsets, piece.shape)):
                    view = view.narrow(dim, at, n)
                view.copy_(piece)
        del loaded
        self._write_model(tensors)
        # The staging files: locally all of them (this save's, and those of saves killed before
        # their commit); under an object prefix this save's (a listing shows no deeper levels).
        staging = self.fs.concat_path(self.path, ".turboio-sharded")
        try:
            if _remote.is_object_url(str(staging)):
                for tag in {f.split("/")[1] for f in files}:
                    for obj in self.fs.ls(self.fs.concat_path(staging, tag)):
                        self.fs.rm_file(obj)
            else:
                shutil.rmtree(staging, ignore_errors=True)
        except OSError:
            pass


class FileSystemReader(_fs.FileSystemReader):
    """DCP's ``FileSystemReader``, reading through turboio (see the module doc); ``window``
    bounds the bytes read ahead of deserialization (default 256 MiB, or one item if larger).
    ``allow_pickle=True`` hands non-tensor items to the planner as DCP's own reader does (its
    ``load_bytes`` unpickles them with ``weights_only=False``: code can run); by default each is
    first unpickled with ``weights_only=True`` and refused if that refuses it."""

    def __init__(
        self,
        path,
        _extension_registry=None,
        *,
        window: int = 256 << 20,
        threads: int = 0,
        use_cipher=None,
        storage_options: dict | None = None,
        allow_pickle: bool = False,
    ) -> None:
        if _extension_registry is not None:
            raise ValueError("turboio.dcp.FileSystemReader: _extension_registry is not supported")
        path = _checked(path, "turboio.dcp.FileSystemReader")
        super().__init__(path)
        self.fs = _Files(storage_options)
        self.path = self.fs.init_path(path)
        self.fs.storage(self.path)
        self.window = window
        self.threads = threads
        self.allow_pickle = allow_pickle
        self.cipher = _cipher_for_load(use_cipher)
        #: Tensor items read straight into their destination (no copy), over this reader's loads.
        self.items_read_directly = 0

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """The checkpoint's ``.metadata``, unpickled with only DCP's metadata classes allowed
        (nothing else is called: a file crafted to run code is refused)."""
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            data = _turboio.read_all(str(path), cipher=self.cipher, any_content=True, storage=self.fs.storage(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no checkpoint metadata (not a DCP checkpoint, or its save never committed)") from None
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as e:
            raise ValueError(f"{path}: not DCP checkpoint metadata: {e}") from None
        except Exception as e:  # noqa: BLE001 - a damaged or foreign file, named
            raise ValueError(f"{path}: damaged checkpoint metadata: {e}") from e
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path}: not DCP checkpoint metadata (a {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = _md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            checkpoint_id = _checked(checkpoint_id, "turboio.dcp.FileSystemReader")
        super().reset(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return _Files.validate_checkpoint_id(checkpoint_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file.setdefault(info.relative_path, []).append(req)
        storage = self.fs.storage(self.path)
        for relative_path, reqs in per_file.items():
            _check_relative(self.path, relative_path)
            path = str(self.fs.concat_path(self.path, relative_path))
            # Each stored item once (several requests may narrow the same one), in file order.
            items: dict[tuple[int, int], list] = {}
            for req in reqs:
                info = self.storage_data[req.storage_index]
                if info.transform_descriptors:
                    raise ValueError(f"{path}: items with stream transforms ({info.transform_descriptors}) are not supported")
                items.setdefault((info.offset, info.length), []).append(req)
            direct = _read_direct(path, items, planner, self.threads, self.cipher, storage)
            self.items_read_directly += len(direct)
            order = sorted(k for k in items if k not in direct)
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
                    _read(path, requests, self.threads, self.cipher, storage)
                raw = memoryview(buf.numpy())
                for (off, length), at in zip(window, spans):
                    data = raw[at : at + length]
                    for req in items[(off, length)]:
                        _deliver(req, data, planner, path, self.allow_pickle)
                start = end
        fut: Future = Future()
        fut.set_result(None)
        return fut


def _check_relative(checkpoint, relative_path) -> None:
    """A data file named by the metadata must be a plain file name inside the checkpoint
    directory: separators, absolute paths, `..` (and empty names) would read another
    checkpoint's, or any file's, bytes."""
    name = str(relative_path)
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(
            f"{checkpoint}: the metadata names the data file {name!r}, which is not a file name inside the "
            "checkpoint directory (separators, absolute paths and '..' are refused)"
        )


#: Bytes read from the start of each item to find its tensor's bytes (the pickle and the zip
#: records before the data: a few hundred bytes for one tensor).
_HEAD = 4096


def _read_direct(path: str, items, planner: LoadPlanner, threads: int, cipher: bool, storage=None) -> set:
    """Reads the items that are whole tensors wanted whole, each into its destination tensor
    straight from the file (no copy in between), all in one parallel pass; returns the keys of
    the items so delivered. The others (narrowed by resharding, non-contiguous destinations,
    byte items, anything not laid out as expected) are left to the copying path."""
    candidates = []
    for key, reqs in items.items():
        req = reqs[0]
        if len(reqs) != 1 or req.type == LoadItemType.BYTE_IO or key[1] < 64:
            continue
        candidates.append(key)
    if not candidates:
        return set()
    heads = torch.empty(len(candidates) * _HEAD, dtype=torch.uint8)
    _read(path, [(off, heads.data_ptr() + i * _HEAD, min(_HEAD, length)) for i, (off, length) in enumerate(candidates)],
          threads, cipher, storage)
    head_bytes = heads.numpy()
    planned = []  # (key, req, target, data offset in the file, nbytes)
    for i, (off, length) in enumerate(candidates):
        req = items[(off, length)][0]
        layout = _tensor_layout(head_bytes[i * _HEAD : i * _HEAD + min(_HEAD, length)].tobytes())
        if layout is None:
            continue
        data_at, dtype, size, nbytes = layout
        if data_at + nbytes + 16 > length or any(req.storage_offsets) or list(req.lengths) != size:
            continue
        target = planner.resolve_tensor(req).detach()
        if (target.device.type != "cpu" or target.dtype != dtype or list(target.shape) != size
                or not target.is_contiguous() or target.numel() * target.element_size() != nbytes):
            continue
        planned.append(((off, length), req, target, off + data_at, nbytes))
    if not planned:
        return set()
    # Each tensor's bytes into its destination, and the 16 bytes after them (the zip record's
    # data descriptor: its sizes confirm where the record ends).
    tails = torch.empty(len(planned) * 16, dtype=torch.uint8)
    requests = []
    for j, (_, _, target, at, nbytes) in enumerate(planned):
        requests.append((at, target.data_ptr(), nbytes))
        requests.append((at + nbytes, tails.data_ptr() + 16 * j, 16))
    _read(path, requests, threads, cipher, storage)
    done = set()
    tail_bytes = tails.numpy().tobytes()
    for j, (key, req, target, _, nbytes) in enumerate(planned):
        sig, _crc, csize, usize = struct.unpack_from("<IIII", tail_bytes, 16 * j)
        if sig != 0x08074B50 or csize != nbytes or usize != nbytes:
            continue  # not where expected: the copying path reads it again, whole
        planner.commit_tensor(req, target)
        done.add(key)
    return done


def _tensor_layout(head: bytes):
    """`(offset of the tensor's bytes in the item, dtype, size, nbytes)` for an item that is one
    ``torch.save`` archive of a contiguous, little-endian tensor filling its storage from
    offset 0, read from the item's first bytes; None for anything else."""
    try:
        data_at = byteorder = None
        at = head.find(b"PK\x03\x04")
        if at != 0:
            return None
        n, e = struct.unpack_from("<HH", head, 26)
        rebuilt = _TensorPickle(io.BytesIO(head[30 + n + e :])).load()
        while at != -1:
            flags, method = struct.unpack_from("<HH", head, at + 6)
            n, e = struct.unpack_from("<HH", head, at + 26)
            name = head[at + 30 : at + 30 + n]
            start = at + 30 + n + e
            if method != 0:
                return None
            if name.endswith(b"/byteorder"):
                byteorder = head[start : start + 6]
            elif name.endswith(b"/data/0"):
                data_at = start
                break
            at = head.find(b"PK\x03\x04", at + 4)
        if data_at is None or byteorder != b"little" or not isinstance(rebuilt, _Rebuilt):
            return None
        (kind, dtype, key, _location, numel), offset, size, stride = rebuilt.args
        size = list(size)
        expect_stride, acc = [], 1
        for d in reversed(size):
            expect_stride.insert(0, acc)
            acc *= d
        if kind != "storage" or key != "0" or offset != 0 or numel != acc or (acc > 1 and list(stride) != expect_stride):
            return None
        nbytes = acc * torch.empty(0, dtype=dtype).element_size()
        return data_at, dtype, size, nbytes
    except Exception:  # noqa: BLE001 - anything unexpected goes the copying way
        return None


class _Rebuilt:
    def __init__(self, *args):
        self.args = args[:4]


class _TensorPickle(pickle.Unpickler):
    """Reads what a one-tensor ``torch.save`` pickle describes, building nothing: the storage's
    (kind, dtype, key, location, numel), the storage offset, size and stride."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Rebuilt
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return tuple(pid)


def _storage_dtypes():
    import warnings

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in dir(torch):
            cls = getattr(torch, name, None)
            if name.endswith("Storage") and isinstance(cls, type) and isinstance(getattr(cls, "dtype", None), torch.dtype):
                out[name] = cls.dtype
    return out


_STORAGE_DTYPES = _storage_dtypes()


def _read(path: str, requests, threads: int, cipher: bool = False, storage=None):
    try:
        # Decrypted content is checked here (the metadata unpickler, the zip records of each
        # item), not by turboio's safetensors-or-torch check.
        _turboio._read_into(path, requests, threads=threads, cipher=cipher, any_content=True, storage=storage)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: a data file of the checkpoint is missing") from None


def _deliver(req, data, planner: LoadPlanner, path: str, allow_pickle: bool = False):
    if req.type == LoadItemType.BYTE_IO:
        fqn = req.dest_index.fqn
        dest = getattr(planner, "state_dict", {}).get(fqn) if isinstance(getattr(planner, "state_dict", None), dict) else None
        if isinstance(dest, torch.Tensor):
            # Crafted metadata: a tensor's key declared as a pickled item.
            raise ValueError(
                f"{path}: item {fqn} is stored as pickled bytes, but its destination is a tensor; "
                "refused (the metadata does not match what was saved)"
            )
        if not allow_pickle:
            try:
                torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - refused, with the file and item named
                raise ValueError(
                    f"{path}: item {fqn} is a pickle that weights_only=True refuses ({e}); "
                    "pass allow_pickle=True to FileSystemReader to load it as DCP does, for checkpoints you trust"
                ) from None
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


class _Gather:
    """A write-only stream for ``torch.save`` that copies nothing large: the tensor bytes
    torch hands over (a view of the tensor's own storage) are kept as references to that
    storage, everything else (zip records, pickles) is copied into small buffers. The file is
    the concatenation of ``segments()``, written by turboio with one copy of each byte."""

    def __init__(self):
        self._parts: list = []  # bytearray (copied) or (address, length) into a kept storage
        self._small = bytearray()
        self._len = 0
        self._storages: list = []  # (start, end) of the storages whose bytes may be referenced
        self.keep: list = []  # tensors referenced, kept alive until the file is written

    def allow(self, tensor):
        storage = tensor.untyped_storage()
        if storage.nbytes():
            self._storages.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        self.keep.append(tensor)

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        if n >= 65536:
            addr = _address(mv)
            if any(lo <= addr and addr + n <= hi for lo, hi in self._storages):
                self._flush_small()
                self._parts.append((addr, n))
                self._len += n
                return n
        self._small += mv
        self._len += n
        return n

    def _flush_small(self):
        if self._small:
            self._parts.append(self._small)
            self._small = bytearray()

    def tell(self) -> int:
        return self._len

    def flush(self):
        pass

    def segments(self):
        self._flush_small()
        out = []
        for part in self._parts:
            if isinstance(part, bytearray):
                out.append((_address(memoryview(part)), len(part)))
            else:
                out.append(part)
        return out


def _address(mv) -> int:
    import numpy as np

    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if mv.nbytes else 0


def _serialize(items, planner: SavePlanner, name: str):
    """One data file, as DCP's writer lays it out (byte items first, then tensors, each tensor
    one ``torch.save`` archive), gathered without copying the tensors' bytes, and its write
    results."""
    out = _Gather()
    results = []

    def record(item, offset):
        length = out.tell() - offset
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_fs._StorageInfo(name, offset, length)))

    for item in (i for i in items if i.type == WriteItemType.BYTE_IO):
        offset = out.tell()
        out.write(planner.resolve_data(item).getbuffer())
        record(item, offset)
    for item in (i for i in items if i.type != WriteItemType.BYTE_IO):
        tensor = planner.resolve_data(item).detach().cpu()
        if tensor.untyped_storage().size() != tensor.nbytes:
            tensor = tensor.clone()
        offset = out.tell()
        out.allow(tensor)
        torch.save(tensor, out)
        record(item, offset)
    return out, results


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata`` and nothing else: its classes, torch's dtypes, ``Size`` and
    layouts, and paths; any other global (a function to call, a class to build) is refused."""

    _CLASSES = {
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module, name):
        if (module, name) in self._CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


_cleanup_lock = threading.Lock()


def _remove_unreferenced(files: _Files, directory, referenced: set[str], prefix: str):
    """Deletes turboio's data files of earlier saves that the new metadata does not name, and the
    temporary files of data files whose saves were killed (local directories; an object store's
    unfinished uploads are never visible as objects)."""
    remote = _remote.is_object_url(str(directory))
    with _cleanup_lock:
        try:
            names = [p.rsplit("/", 1)[-1] for p in files.ls(directory)] if remote else os.listdir(directory)
        except OSError:
            return
        for n in names:
            p = files.concat_path(directory, n)
            if n.startswith(prefix) and _OURS.match(n) and n not in referenced:
                pass
            elif not remote and n.startswith(".") and "turboio" in n:
                # A temporary file of a data file whose save was killed (its writer is gone).
                target = _turboio._abandoned_temp_target(str(p))
                if target is None or not (target.startswith(prefix) and _OURS.match(target)):
                    continue
            else:
                continue
            try:
                files.rm_file(p)
            except FileNotFoundError:
                pass
