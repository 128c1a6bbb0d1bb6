"""turboio.torch against the official safetensors.torch: interop both ways, byte-identical
files, the same exceptions."""

import os

import pytest
import safetensors
import safetensors.torch as st
import torch

import turboio.torch as tt
from conftest import TORCH_DTYPES, TiedLinears, make, same, sample_dict


def test_files_written_by_safetensors_load_identically(tmp):
    sd = sample_dict()
    path = tmp / "ref.safetensors"
    st.save_file(sd, path, metadata={"framework": "pt"})
    ours = tt.load_file(path)
    assert set(ours) == set(sd)
    for k in sd:
        assert same(ours[k], sd[k]), k
    with tt.safe_open(path, "pt") as f:
        assert f.metadata() == {"framework": "pt"}


def test_files_written_by_turboio_load_in_safetensors(tmp):
    sd = sample_dict(7)
    path = tmp / "ours.safetensors"
    tt.save_file(sd, path, metadata={"k": "v"})
    back = st.load_file(path)
    assert set(back) == set(sd)
    for k in sd:
        assert same(back[k], sd[k]), k
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata() == {"k": "v"}


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"x\"y": "ünï/\\code\n"}])
def test_byte_identical_to_safetensors(tmp, metadata):
    sd = sample_dict(3)
    a, b = tmp / "a.safetensors", tmp / "b.safetensors"
    st.save_file(sd, a, metadata=metadata)
    tt.save_file(sd, b, metadata=metadata)
    assert a.read_bytes() == b.read_bytes()
    assert tt.save(sd, metadata) == st.save(sd, metadata)


def test_load_and_save_bytes():
    sd = sample_dict(5)
    data = tt.save(sd)
    assert data == st.save(sd)
    back = tt.load(data)
    assert all(same(back[k], sd[k]) for k in sd)
    # safetensors.torch.load itself does not know F8_E8M0 (its _TYPES lacks it).
    known = {k: v for k, v in sd.items() if "e8m0" not in k}
    back = st.load(tt.save(known))
    assert all(same(back[k], known[k]) for k in known)


def test_float4(tmp):
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("torch has no float4_e2m1fn_x2")
    t = make(torch.uint8, (4, 6), 1).view(torch.float4_e2m1fn_x2)
    path = tmp / "f4.safetensors"
    st.save_file({"w": t}, path)
    back = tt.load_file(path)["w"]
    assert back.dtype == torch.float4_e2m1fn_x2 and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    tt.save_file({"w": t}, tmp / "f4b.safetensors")
    assert (tmp / "f4b.safetensors").read_bytes() == path.read_bytes()


def test_safe_open_and_slices(tmp):
    sd = {"m": torch.arange(6 * 7 * 5, dtype=torch.float32).reshape(6, 7, 5), "v": torch.arange(10, dtype=torch.int64)}
    path = tmp / "s.safetensors"
    st.save_file(sd, path)
    with tt.safe_open(path, framework="pt", device="cpu") as f:
        assert f.keys() == ["m", "v"]
        assert same(f.get_tensor("m"), sd["m"])
        sl = f.get_slice("m")
        assert sl.get_shape() == [6, 7, 5]
        assert sl.get_dtype() == "F32"
        for idx in [
            slice(None),
            slice(1, 3),
            (slice(None), 2),
            (2, slice(1, 6, 2)),
            (slice(None), slice(None), slice(2, 4)),
            (-1, -2),
            (Ellipsis, 3),
            (slice(4, 2),),
            (1, 2, 3),
            (slice(0, 6, 3), slice(None), 0),
        ]:
            assert same(sl[idx], sd["m"][idx]), idx
        assert same(f.get_slice("v")[3:8], sd["v"][3:8])
        with pytest.raises(tt.SafetensorError):
            f.get_tensor("nope")
        # As the reference (torch indexing): IndexError, not SafetensorError.
        with pytest.raises(IndexError):
            sl[10]
        with pytest.raises(IndexError):
            sl[1, 2, 3, 4]
    with pytest.raises(tt.SafetensorError, match="closed"):
        f.keys()


def test_slices_come_from_what_safe_open_holds(tmp):
    # The file is atomically replaced (as every saver here does) while a safe_open is open:
    # get_tensor and get_slice both keep giving the file as it was opened, as safetensors does.
    old = torch.arange(1024 * 16, dtype=torch.float32).reshape(1024, 16)
    path = tmp / "m.safetensors"
    st.save_file({"t": old}, path)
    for new in [old + 1, old[:4] + 1]:  # same size, then shorter
        with tt.safe_open(path, "pt") as ours, safetensors.safe_open(path, "pt") as ref:
            st.save_file({"t": new}, tmp / "new.safetensors")
            os.replace(tmp / "new.safetensors", path)
            for f in (ours, ref):
                assert same(f.get_tensor("t")[:3], old[:3])
                assert same(f.get_slice("t")[:3], old[:3])
                assert same(f.get_slice("t")[1000:1024, ::2], old[1000:1024, ::2])
        st.save_file({"t": old}, path)


def test_save_model_and_load_model_with_tied_weights(tmp):
    m = TiedLinears()
    path = tmp / "m.safetensors"
    tt.save_model(m, path)
    # The official loader agrees.
    m2 = TiedLinears()
    missing, unexpected = st.load_model(m2, path)
    assert not missing and not unexpected
    m3 = TiedLinears()
    missing, unexpected = tt.load_model(m3, path)
    assert not missing and not unexpected
    assert torch.equal(m3.a.weight, m.a.weight) and torch.equal(m3.b.bias, m.b.bias)
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata() == {"b.weight": "a.weight"}
    # Files from safetensors' save_model load through ours too.
    st.save_model(m, tmp / "ref.safetensors")
    assert (tmp / "ref.safetensors").read_bytes() == path.read_bytes()


def test_save_errors_match_safetensors(tmp):
    t = torch.zeros(4, 4)
    cases = [
        ("not a dict", ValueError),
        ({"a": {"x": 1}}, ValueError),
        ({"a": t, "b": t}, RuntimeError),
        ({"a": t.t()}, ValueError),
        ({"a": torch.zeros(2, device="meta")}, (RuntimeError, NotImplementedError)),
        ({"a": torch.zeros(2, 2).to_sparse()}, ValueError),
    ]
    for value, exc in cases:
        with pytest.raises(exc):
            st.save_file(value, tmp / "x.safetensors")
        with pytest.raises(exc):
            tt.save_file(value, tmp / "y.safetensors")
    assert not (tmp / "y.safetensors").exists()


def test_bad_input_raises(tmp):
    with pytest.raises(FileNotFoundError):
        tt.load_file(tmp / "missing.safetensors")
    with pytest.raises(FileNotFoundError):
        tt.safe_open(tmp / "missing.safetensors", "pt")
    bad = tmp / "bad.safetensors"
    for content in [b"", b"1234", b"\x10" + b"\x00" * 7 + b"{\"a\": oops}     ", (8).to_bytes(8, "little") + b"{}      x"]:
        bad.write_bytes(content)
        with pytest.raises(tt.SafetensorError) as e:
            tt.load_file(bad)
        assert "bad.safetensors" in str(e.value)
        with pytest.raises(tt.SafetensorError):
            tt.safe_open(bad, "pt")
        with pytest.raises(tt.SafetensorError):
            tt.load(content)
    with pytest.raises(tt.SafetensorError):
        tt.safe_open(bad, framework="jax")
    with pytest.raises(RuntimeError, match="not supported in this build"):
        tt.load_file(bad, device="npu:0")
