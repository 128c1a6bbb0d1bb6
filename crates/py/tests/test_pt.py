"""`.pt` checkpoints through the real wheel, read by turboio's allow-listed reader (no pickle
executed), compared tensor by tensor with `torch.load(weights_only=True)`."""

import os

import pytest
import torch

import turboio


def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, name + "."))
        elif isinstance(v, torch.Tensor):
            out[name] = v
    return out


def same(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        x, y = a[k], b[k]
        assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride(), (k, x.dtype, y.dtype, x.shape, y.shape, x.stride(), y.stride())
        assert torch.equal(x.reshape(-1).view(torch.uint8) if x.numel() else x, y.reshape(-1).view(torch.uint8) if y.numel() else y) if x.dtype.is_floating_point and x.element_size() == 1 else torch.equal(x, y), k


def every_dtype():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    sd = {}
    for dt in [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]:
        sd[str(dt).split(".")[1]] = base.to(dt)
    for dt in [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64]:
        sd[str(dt).split(".")[1]] = torch.randint(0, 100, (3, 5), generator=g).to(dt)
    sd["bool"] = base > 0
    sd["complex64"] = torch.randn(3, 2, generator=g, dtype=torch.complex64)
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.empty(0, 7)
    return sd


def test_every_dtype_scalars_and_empty_tensors_match_torch_load(tmp):
    sd = every_dtype()
    p = tmp / "dtypes.pt"
    torch.save(sd, p)
    same(turboio.load(str(p)), torch.load(p, weights_only=True))


def test_views_offsets_strides_and_shared_storages(tmp):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    sd = {"base": base, "rows": base[2:5], "cols": base[:, 3:7], "strided": base[1:, ::3], "t": base.T, "same": base}
    p = tmp / "views.pt"
    torch.save(sd, p)
    got = turboio.load(str(p))
    same(got, torch.load(p, weights_only=True))
    # One storage, as when saved: the views share memory with "base" (not copies).
    ptr = got["base"].untyped_storage().data_ptr()
    assert all(got[k].untyped_storage().data_ptr() == ptr for k in sd)
    got["base"][2, 3] = -1
    assert got["rows"][0, 3] == -1 and got["same"][2, 3] == -1
    # Each storage is its own torch storage, as after torch.load: saving one tensor writes its
    # storage (240 bytes here), not the whole file.
    assert got["base"].untyped_storage().nbytes() == 60 * 4
    other = tmp / "other.pt"
    torch.save({"x": torch.ones(3), "y": torch.zeros(1000)}, other)
    got2 = turboio.load(str(other))
    assert got2["x"].untyped_storage().nbytes() == 12 and got2["y"].untyped_storage().nbytes() == 4000


def test_module_state_dict_with_tied_weights_and_nested_dicts(tmp):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(11, 4)
            self.proj = torch.nn.Linear(4, 11, bias=False)
            self.proj.weight = self.embed.weight
            self.norm = torch.nn.LayerNorm(4)

    m = Tied()
    ckpt = {"model": m.state_dict(), "optimizer": {"state": {"0": {"exp_avg": torch.ones(3)}}}, "epoch": 7}
    p = tmp / "ckpt.pt"
    torch.save(ckpt, p)
    ref = flat(torch.load(p, weights_only=True))
    got = turboio.load(str(p))
    same(got, ref)
    assert got["model.embed.weight"].data_ptr() == got["model.proj.weight"].data_ptr()
    only = turboio.load(str(p), top_level_key="model")
    same(only, flat(torch.load(p, weights_only=True)["model"]))


def test_storages_move_and_convert_once_so_tied_weights_stay_shared(tmp, monkeypatch):
    """A load to a device moves each storage once (tied weights, views and transposes stay one
    storage there, as with torch.load(map_location=...)); the loader used to copy each tensor
    with its own `.to(device)`. Without a GPU the meta device stands in: it keeps the sharing
    and the count of moves visible."""
    from turboio import _torch

    w = torch.randn(6, 4)
    torch.save({"emb": w, "head": w, "wt": w.t(), "other": torch.ones(3)}, tmp / "tied.pt")
    moved = []
    real_to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        moved.append(tuple(self.shape))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    sd = _torch.pt_tensors(str(tmp / "tied.pt"), device="meta")
    assert len(moved) == 2, f"one move per storage, not per tensor: {moved}"
    assert all(t.device.type == "meta" for t in sd.values())
    storage = lambda t: t.untyped_storage()._cdata  # noqa: E731
    assert storage(sd["emb"]) == storage(sd["head"]) == storage(sd["wt"]) != storage(sd["other"])
    assert sd["wt"].shape == (4, 6) and sd["wt"].stride() == (1, 4)
    # Converting on load converts each storage once too, and keeps the sharing.
    moved.clear()
    sd = _torch.pt_tensors(str(tmp / "tied.pt"), dtype="BF16")
    assert len(moved) == 2, moved
    assert storage(sd["emb"]) == storage(sd["head"]) == storage(sd["wt"])
    assert torch.equal(sd["wt"], w.t().to(torch.bfloat16))
    monkeypatch.undo()
    got = turboio.load(str(tmp / "tied.pt"), dtype=torch.bfloat16)
    assert got["emb"].data_ptr() == got["head"].data_ptr()
    assert torch.equal(got["head"], w.to(torch.bfloat16))


def test_hostile_pickles_execute_nothing(tmp):
    marker = tmp / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    p = tmp / "evil.pt"
    torch.save({"w": torch.ones(2), "x": Evil()}, p)
    with pytest.raises(ValueError, match=r"(posix|os)\.system.* is not allowed"):
        turboio.load(str(p))
    assert not marker.exists()

    class Eval:
        def __reduce__(self):
            return (eval, (f"open({str(marker)!r}, 'w')",))

    p2 = tmp / "eval.pt"
    torch.save({"x": Eval()}, p2)
    with pytest.raises(ValueError, match=r"(__builtin__|builtins)\.eval.* is not allowed"):
        turboio.load(str(p2))
    # The explicit fallback is torch.load(weights_only=True), which refuses these too.
    with pytest.raises(Exception):
        turboio.load(str(p2), unsafe_pickle_fallback=True)
    assert not marker.exists()


def test_legacy_and_broken_files_are_clear_errors(tmp):
    p = tmp / "legacy.pt"
    torch.save({"w": torch.ones(2)}, p, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="legacy"):
        turboio.load(str(p))
    good = tmp / "good.pt"
    torch.save({"w": torch.ones(1000)}, good)
    data = good.read_bytes()
    cut = tmp / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.pt"):
        turboio.load(str(cut))
