"""Shared torch plumbing: tensors out of a load, tensors into a save, shared-storage rules."""

from collections import defaultdict
import os

from . import _turboio
from ._dtypes import safetensors_name, torch_dtype_for


def tensor_from(pt):
    """A torch tensor viewing a loaded tensor in place (DLPack, no copy), with the right dtype."""
    import torch

    t = torch.from_dlpack(pt)
    if pt.raw:
        # Exported as bytes; viewed as the torch dtype only where torch can hold the shape
        # (an F4 tensor with an odd last dimension stays flat uint8 bytes).
        td = torch_dtype_for(pt.dtype, pt.shape)
        if td is not None:
            t = t.view(td)
    return t


# Safetensors dtype name -> (torch dtype, element size), for the dtypes whose tensors are plain
# strided views of their bytes (not packed, not bytes-only); filled on first use.
_VIEWABLE = {}


def _viewable(name):
    got = _VIEWABLE.get(name)
    if got is None:
        from ._dtypes import _PACKED, torch_dtype

        td = None if name in _PACKED else torch_dtype(name)
        got = (td, td.itemsize) if td is not None else (None, 0)
        _VIEWABLE[name] = got
    return got


def typed_export(loaded):
    """One DLPack export of a whole load, viewed as each of its tensors' dtypes that torch
    can view: `{dtype name: (the export as that dtype, element size)}`."""
    import torch

    data, dtypes = loaded.export()
    base = torch.from_dlpack(data)
    typed = {}
    for dtype in dtypes:
        td, size = _viewable(dtype)
        if td is not None:
            n = base.numel() - base.numel() % size
            typed[dtype] = (base[:n].view(td), size)
    return typed


def view_of(typed, pt):
    """Tensor `pt` of a load (a `_turboio.Tensor`) as a view of the load's export (`typed`, from
    `typed_export`), or exported on its own where it cannot be one (a dtype torch has not or
    packs, an offset that is not a multiple of its element size)."""
    import torch

    got = typed.get(pt.dtype)
    if got is None or pt.offset % got[1]:
        return tensor_from(pt)
    shape = pt.shape
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return torch.as_strided(got[0], shape, strides, pt.offset // got[1])


def tensors_of(loaded, aliases=True):
    """`{name: tensor}` of a load, in file order, plus aliases from `__metadata__`.

    One DLPack export of the whole load, and each tensor a strided view of it (`as_strided`
    of a typed view of the export: dtype, shape, strides, storage offset), so a load of
    thousands of tensors costs one export and one small call per tensor. Every tensor's
    storage is then the load's memory (which stays alive while any tensor does): `torch.save`
    of one tensor alone would write all of it, so `.clone()` a tensor first to save it alone.
    A tensor whose offset is not a multiple of its element size, and dtypes torch has not or
    packs (F4, F6), are exported on their own (as bytes where torch has no dtype)."""
    import torch

    if loaded.on_model():
        out = _meta_tensors(loaded)
        if aliases:
            for alias, target in loaded.aliases():
                out[alias] = out[target]
        return out
    out, odd = loaded.build(typed_export(loaded), torch.as_strided)
    if odd:
        exported = {pt.name: pt for pt in loaded.tensors()}
        for name in odd:
            out[name] = tensor_from(exported[name])
        order = [name for name, *_ in loaded.infos()]
        out = {name: out[name] for name in order}
    if aliases:
        for alias, target in loaded.aliases():
            out[alias] = out[target]
    return out


def _meta_tensors(loaded):
    """`meta` tensors of a load the model of a GPU took (`TURBOIO_GPU_MODEL`: no bytes kept),
    with the dtypes and shapes the real load would give."""
    import torch
    from ._dtypes import torch_shape

    out = {}
    for name, dtype, shape, begin, end in loaded.infos():
        td = torch_dtype_for(dtype, shape)
        if td is None:
            out[name] = torch.empty(end - begin, dtype=torch.uint8, device="meta")
        else:
            out[name] = torch.empty(torch_shape(dtype, shape), dtype=td, device="meta")
    return out


def select_across(tensors, names_by_file, origin):
    """`{file: frozenset of the names tensors= selects}`, the selection checked against every
    file's names together (a name or pattern need match in one file only; one that matches in
    none raises `KeyError` naming `origin` and the closest names)."""
    everything = [n for names in names_by_file.values() for n in names]
    keep = set(_turboio.select(tensors, everything, origin))
    return {f: frozenset(n for n in names if n in keep) for f, names in names_by_file.items()}


def storage_key(t):
    s = t.untyped_storage()
    return (t.device, s.data_ptr(), s.nbytes())


def find_shared(tensors):
    """Groups of names whose tensors overlap in memory (as safetensors defines sharing)."""
    import torch

    by_storage = defaultdict(set)
    for name, t in tensors.items():
        if t.device == torch.device("meta"):
            continue
        key = storage_key(t)
        if key[1] != 0 and key[2] != 0:
            by_storage[key].add(name)
    groups = []
    for names in by_storage.values():
        if len(names) < 2:
            continue
        spans = sorted(
            (tensors[n].data_ptr(), tensors[n].data_ptr() + tensors[n].numel() * tensors[n].element_size(), n)
            for n in names
        )
        current, end = {spans[0][2]}, spans[0][1]
        for start, stop, n in spans[1:]:
            if start >= end:
                if len(current) > 1:
                    groups.append(current)
                current, end = {n}, stop
            else:
                current.add(n)
                end = max(end, stop)
        if len(current) > 1:
            groups.append(current)
    return groups


def is_complete(t):
    s = t.untyped_storage()
    return t.data_ptr() == s.data_ptr() and t.nelement() * t.element_size() == s.nbytes()


def remove_duplicate_names(state_dict, preferred_names=None, discard_names=None):
    """For each group of shared tensors, the name to keep and the names to drop."""
    preferred = set(preferred_names or [])
    discard = set(discard_names or [])
    result = defaultdict(list)
    for group in find_shared(state_dict):
        complete = {n for n in group if is_complete(state_dict[n])}
        if not complete:
            raise RuntimeError(
                "Error while trying to find names to remove to save state dict, but found no suitable name to keep"
                f" for saving amongst: {sorted(group)}. None is covering the entire storage. Refusing to save/load"
                " the model since you could be storing much more memory than needed."
            )
        keep = sorted(complete)[0]
        kept_not_discarded = complete - discard
        if kept_not_discarded:
            keep = sorted(kept_not_discarded)[0]
        if preferred & complete:
            keep = sorted(preferred & complete)[0]
        for n in sorted(group):
            if n != keep:
                result[keep].append(n)
    return result


def alias_shared(state_dict, metadata, clone=False):
    """Stores each group of shared tensors once: every other name of the group is recorded in
    `metadata` as an alias of the kept one and removed from `state_dict` (replaced by a clone
    with `clone`). Returns the metadata (a new dict if it was None and aliases were found)."""
    for kept, removed in remove_duplicate_names(state_dict).items():
        for name in removed:
            if metadata is None:
                metadata = {}
            metadata.setdefault(name, kept)
            if clone:
                state_dict[name] = state_dict[name].clone()
            else:
                del state_dict[name]
    return metadata


def single_cuda_device(tensors):
    """`"cuda:N"` when every tensor of the dict is on that one CUDA device, else None."""
    import torch

    devices = {v.device for v in tensors.values() if isinstance(v, torch.Tensor)} if isinstance(tensors, dict) else set()
    if len(devices) == 1:
        (d,) = devices
        if d.type == "cuda":
            return f"cuda:{d.index if d.index is not None else torch.cuda.current_device()}"
    return None


def raw_tensors(tensors, what="tensors", keep_device=False):
    """Checks a `{name: tensor}` dict the way safetensors does and returns the records the
    extension writes from, plus the tensors to keep alive while it does. With `keep_device`,
    CUDA tensors stay where they are (their records hold device addresses); otherwise they are
    copied to the CPU."""
    import torch

    if not isinstance(tensors, dict):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    invalid = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if invalid:
        k = invalid[0]
        raise ValueError(f"Key `{k}` is invalid, expected torch.Tensor but received {type(tensors[k])}")
    sparse = [k for k, v in tensors.items() if v.layout != torch.strided]
    if sparse:
        raise ValueError(
            f"You are trying to save a sparse tensors: `{sparse}` which this library does not support. You can"
            " make it a dense tensor before saving with `.to_dense()` but be aware this might make a much larger file"
            " than needed."
        )
    shared = find_shared(tensors)
    if shared:
        raise RuntimeError(
            f"Some tensors share memory, this will lead to duplicate memory on disk and potential differences when"
            f" loading them again: {[sorted(g) for g in shared]}.\nA potential way to correctly save your model is to"
            " use `save_model`.\nMore information at https://huggingface.co/docs/safetensors/torch_shared_tensors"
        )
    records, keep = [], []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise ValueError(f"Key `{name}` is invalid, expected a str")
        if t.device.type == "meta":
            raise RuntimeError(f"Cannot copy out of meta tensor `{name}`")
        if t.device.type != "cpu" and not (keep_device and t.device.type == "cuda"):
            t = t.to("cpu")
        if not t.is_contiguous():
            raise ValueError(
                f"You are trying to save a non contiguous tensor: `{name}` which is not allowed. It either means you"
                " are trying to save tensors which are reference of each other in which case it's recommended to save"
                " only the full tensors, and reslice at load time, or simply call `.contiguous()` on your tensor to"
                " pack it before saving."
            )
        dtype = safetensors_name(t.dtype)
        shape = list(t.shape)
        if dtype == "F4":
            shape[-1] *= 2
        nbytes = t.numel() * t.element_size()
        records.append((name, dtype, shape, t.data_ptr() if nbytes else 0, nbytes))
        keep.append(t)
    return records, keep


def threads(num_thread):
    n = os.cpu_count() or 1
    return max(1, min(int(num_thread or n), n))


def _check_device_memory(path, storages, used, device, dtype, budget):
    """Raises `MemoryError` when the used storages of a `.pt` load, moved to `device` (and
    converted to `dtype` there, the largest briefly in both forms), would not fit in `budget`
    (bytes, or a size string) or in the device's free memory."""
    import torch

    from ._dtypes import CASTABLE, torch_dtype

    held, transient = 0, 0
    for i in used:
        _offset, nbytes, dtype_name, meta_numel = storages[i]
        if meta_numel is not None:
            continue
        if dtype is not None and dtype_name in CASTABLE and dtype_name != dtype:
            size = torch_dtype(dtype_name).itemsize
            converted = nbytes // size * torch_dtype(dtype).itemsize
            held += converted
            transient = max(transient, nbytes)
        else:
            held += nbytes
    needs = held + transient
    dev = torch.device(device)
    if budget is not None:
        limit = _turboio.parse_shard_size(budget) if isinstance(budget, str) else int(budget)
        available = f"max_device_memory is {_gb(limit)}"
    elif dev.type == "cuda":
        limit = torch.cuda.mem_get_info(dev)[0]
        available = f"{dev} has {_gb(limit)} free"
    else:
        return
    if needs > limit:
        option = "; or a larger budget" if budget is not None else ""
        raise MemoryError(
            f"{path}: this load needs {_gb(needs)} of {dev} memory but {available}; nothing was "
            f"allocated on {dev}. What would fit: fewer tensors (a selection: tensors=){option}"
        )


def _gb(n):
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def pt_tensors(
    path,
    cipher=False,
    top_level_key=None,
    threads=0,
    cache="auto",
    storage=None,
    device=None,
    dtype=None,
    tensors=None,
    max_host_memory=None,
    max_device_memory=None,
):
    """The tensors of a `torch.save` checkpoint, read without executing its pickle (turboio's
    allow-listed reader): `{dotted name: tensor}`, each a strided view of the load's bytes (the
    file mapped from the page cache, or copied, with O_DIRECT for `cache="bypass"`, or
    decrypted into memory), so tensors that shared a storage when saved (tied weights, views)
    share memory again.

    `device` (other than the CPU) and `dtype` (a safetensors dtype name: floating storages are
    converted as `.to()` would) apply to each storage once, before the views are made: tied
    weights stay one tensor's memory on the device, as after `torch.load(map_location=...)`,
    and nothing is moved or converted twice.

    `max_host_memory` bounds the load's copies (checked by the loader before it allocates);
    onto a device, what the storages will take there is checked against `max_device_memory`
    and the device's free memory before the first is moved (`MemoryError`, with the numbers)."""
    import torch

    from ._dtypes import CASTABLE, torch_dtype

    data, (storages, tensors, _skipped) = _turboio.load_pt(
        path,
        top_level_key=top_level_key,
        cipher=cipher,
        threads=threads,
        cache=cache,
        storage=storage,
        tensors=tensors,
        max_host_memory=max_host_memory,
    )
    # Only the storages the (selected) tensors view: a selection read no other.
    used = {t[4] for t in tensors}
    if device is not None and torch.device(device).type != "cpu":
        _check_device_memory(path, storages, used, device, dtype, max_device_memory)
    views = []
    for i, (offset, nbytes, dtype_name, meta_numel) in enumerate(storages):
        if i not in used:
            views.append(None)
            continue
        td = torch_dtype(dtype_name)
        if td is None:
            raise ValueError(f"{path}: torch dtype {dtype_name} is not available in this torch")
        if meta_numel is not None:
            # A meta storage: shapes and dtypes, no data (as torch.load returns it).
            views.append(torch.empty(meta_numel, dtype=td, device="meta"))
            continue
        # One export per storage: each keeps the load alive, and a tensor's torch storage is
        # its own storage's bytes, not the whole file's.
        v = torch.from_dlpack(data.slice(offset, nbytes)).view(td)
        if device is not None and torch.device(device) != v.device:
            v = v.to(device)
        if dtype is not None and dtype_name in CASTABLE and dtype_name != dtype:
            v = v.to(torch_dtype(dtype))
        views.append(v)
    out = {}
    for name, _dtype, shape, strides, storage, storage_offset, conj, neg in tensors:
        s = views[storage]
        t = torch.as_strided(s, shape, strides, s.storage_offset() + storage_offset)
        # The bits torch records for x._neg_view() and x.conj(): the same lazy views torch.load
        # returns (the stored values, read negated or conjugated).
        if neg:
            t = t._neg_view()
        if conj:
            t = t.conj()
        out[name] = t
    return out
