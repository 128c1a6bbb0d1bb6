"""`.pt` files where turboio must give what `torch.load(weights_only=True)` gives, or refuse
where torch refuses (issue 29): conjugate and negative views, meta tensors, record sizes,
storage locations, the archive's version record, the metadata argument, and pickle protocols.
Every file is built here: by torch.save, or by rewriting one record of a torch.save file."""

import io
import struct
import zipfile

import pytest
import torch

import turboio


def torch_result(path, **kw):
    """`{name: tensor}` from torch.load(weights_only=True), or the exception."""
    try:
        return torch.load(path, weights_only=True, **kw)
    except Exception as e:  # noqa: BLE001 - any refusal counts
        return e


def turboio_result(path):
    try:
        return turboio.load(str(path))
    except Exception as e:  # noqa: BLE001
        return e


def logical(t):
    return t.resolve_conj().resolve_neg()


def assert_parity(path, **torch_kw):
    """Both refuse, or both give the same tensors: values, dtypes, shapes, strides, the
    conjugate and negative bits, and the meta device."""
    want, got = torch_result(path, **torch_kw), turboio_result(path)
    if isinstance(want, Exception):
        assert isinstance(got, Exception), f"{path}: torch refuses ({want}) but turboio gave {got}"
        return want, got
    assert not isinstance(got, Exception), f"{path}: torch loads it but turboio refuses: {got}"
    assert sorted(want) == sorted(got)
    for k, w in want.items():
        g = got[k]
        assert (w.dtype, w.shape, w.stride()) == (g.dtype, g.shape, g.stride()), k
        assert (w.is_conj(), w.is_neg(), w.device.type) == (g.is_conj(), g.is_neg(), g.device.type), k
        if w.device.type != "meta":
            assert torch.equal(logical(w), logical(g)), k
    return want, got


def rewrite(src, dst, change):
    """A copy of the zip `src` with `change(suffix, data)` applied to each record (`None`
    drops it); records keep torch's layout closely enough for both readers."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            prefix, _, suffix = info.filename.partition("/")
            data = change(suffix, zin.read(info.filename))
            if data is not None:
                zout.writestr(info.filename, data)
    return dst


def test_conjugate_and_negative_views_and_meta_tensors(tmp_path):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(3, 4, dtype=torch.complex64, generator=g)
    x = torch.randn(5, 2, generator=g)
    sd = {
        "conj": z.conj(),
        "neg": x._neg_view(),
        "conj_neg": z.conj()._neg_view(),
        "neg_int": torch.arange(-3, 6)._neg_view(),
        "neg_bf16": x.bfloat16()._neg_view(),
        "neg_strided": x.t()._neg_view(),
        "meta": torch.empty(4, 3, device="meta"),
        "meta_strided": torch.empty(4, 3, device="meta").t(),
        "plain": x,
    }
    path = tmp_path / "bits.pt"
    torch.save(sd, path)
    want, got = assert_parity(path)
    assert got["conj"].is_conj() and got["neg"].is_neg() and got["meta"].device.type == "meta"
    # The storage is the stored values, as torch's: only the view reads them conjugated.
    assert got["conj"].untyped_storage().data_ptr() == got["conj_neg"].untyped_storage().data_ptr()


# One tensor `w` of 4 float32 values in storage `0`, hand-pickled (protocol 2) so that single
# arguments can be changed: the metadata argument of _rebuild_tensor_v2, the storage's class,
# its location.
def pickle_w(metadata=b"N", storage=b"FloatStorage", location=b"cpu", numel=4, dtype_global=None):
    def s(text):
        return b"X" + struct.pack("<I", len(text)) + text

    p = b"\x80\x02}" + s(b"w")
    p += b"ctorch._utils\n_rebuild_tensor_v2\n("
    p += b"(" + s(b"storage") + b"ctorch\n" + storage + b"\n" + s(b"0") + s(location) + b"J" + struct.pack("<i", numel)
    p += b"tQ"
    p += b"K\x00" + b"K\x04\x85" + b"K\x01\x85" + b"\x89" + b"ccollections\nOrderedDict\n)R" + metadata + b"tR"
    return p + b"s."


@pytest.fixture
def base(tmp_path):
    path = tmp_path / "base.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    return path


def with_pickle(base, dst, pkl, data=None):
    def change(suffix, d):
        if suffix == "data.pkl":
            return pkl
        if suffix == "data/0" and data is not None:
            return data
        return d

    return rewrite(base, dst, change)


@pytest.mark.parametrize(
    "name, metadata",
    [
        ("none", b"N"),
        ("empty dict", b"}"),
        ("false", b"\x89"),
        ("zero", b"K\x00"),
        ("unknown key", b"}X\x05\x00\x00\x00bogus\x88s"),
        ("neg false still sets the bit", b"}X\x03\x00\x00\x00neg\x89s"),
        ("neg as int", b"}X\x03\x00\x00\x00negK\x01s"),
        ("conj on float", b"}X\x04\x00\x00\x00conj\x88s"),
        ("a class", b"ccollections\nOrderedDict\n"),
        ("a non-empty list", b"]K\x01a"),
        ("a string value", b"}X\x03\x00\x00\x00negX\x03\x00\x00\x00yess"),
        ("an int key", b"}K\x01\x88s"),
    ],
)
def test_the_metadata_argument_as_torch_reads_it(base, tmp_path, name, metadata):
    path = with_pickle(base, tmp_path / "m.pt", pickle_w(metadata=metadata))
    assert_parity(path)


def test_record_sizes_are_exact(base, tmp_path):
    # A record longer than the storage, and a storage relabelled to a smaller dtype (float32
    # bytes read as float16 values): torch refuses both; so does turboio.
    longer = with_pickle(base, tmp_path / "longer.pt", pickle_w(), data=struct.pack("<4f", 0, 1, 2, 3) + b"\0" * 8)
    want, got = assert_parity(longer)
    assert "record size" in str(got)
    half = with_pickle(base, tmp_path / "half.pt", pickle_w(storage=b"HalfStorage"))
    want, got = assert_parity(half)
    assert "record size (16 bytes) does not match expected size (8 bytes" in str(got)
    exact = with_pickle(base, tmp_path / "exact.pt", pickle_w())
    assert_parity(exact)


@pytest.mark.parametrize("location", [b"meta", b"bogus", b"x" * 5000, b"cuda:0", b"cuda", b"cpu", b"cuda:x", b"mps"])
def test_storage_locations(base, tmp_path, location):
    path = with_pickle(base, tmp_path / "loc.pt", pickle_w(location=location))
    if location.startswith(b"cuda") and location != b"cuda:x" and not torch.cuda.is_available():
        # turboio loads to the device asked for (the CPU by default), as torch does with
        # map_location="cpu"; without it torch needs a GPU.
        assert_parity(path, map_location="cpu")
        return
    if location == b"mps":
        # torch knows the location but cannot restore it here ("Storage device not
        # recognized"); turboio, like map_location="cpu", loads it on the CPU.
        assert_parity(path, map_location="cpu")
        return
    want, got = assert_parity(path)
    if location in (b"bogus", b"x" * 5000, b"cuda:x"):
        assert "location" in str(got)


@pytest.mark.parametrize("version", [None, b"", b"abc", b"0", b"-1", b"11", b"99", b"3abc", b" 3", b"+3", b"10", b"1"])
def test_the_version_record(base, tmp_path, version):
    path = rewrite(base, tmp_path / "v.pt", lambda suffix, d: (version if suffix == "version" else d))
    assert_parity(path)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_protocol_4_files_load_as_torch_reads_them_by_executing_them(tmp_path):
    """Documented leniency (ATTACKS.md): torch.save(..., pickle_protocol=4) files use opcodes
    torch's weights_only reader refuses, so torch reads them only by executing the pickle;
    turboio reads them without executing anything, to the same tensors."""
    x = torch.randn(3, 3)
    path = tmp_path / "p4.pt"
    torch.save({"w": x, "t": x.t()}, path, pickle_protocol=4)
    assert isinstance(torch_result(path), Exception)
    ref = torch.load(path, weights_only=False)
    got = turboio.load(str(path))
    for k in ref:
        assert torch.equal(ref[k], got[k]) and ref[k].stride() == got[k].stride(), k


@pytest.mark.parametrize("ops", [b"N0", b"N(1", b"N2", b"(l", b"(d", b"T\x01\x00\x00\x00a", b"\x8b\x01\x00\x00\x00\x01"])
def test_opcodes_torch_refuses_are_refused(base, tmp_path, ops):
    """POP, POP_MARK, DUP, LIST, DICT, BINSTRING, LONG4: no torch writer emits them and torch's
    weights_only reader refuses them; so does turboio."""
    pkl = b"\x80\x02" + ops + b"."
    path = with_pickle(base, tmp_path / "op.pt", pkl)
    assert_parity(path)
