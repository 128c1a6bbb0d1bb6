"""The veTurboIO API: code written for veturboio runs unchanged after `import turboio as veturboio`."""

import os
import subprocess
import sys

import pytest
import safetensors.torch as st
import torch

import turboio as veturboio
from conftest import TiedLinears, same, sample_dict


def test_readme_example(tmp):
    # veTurboIO's own README usage, unchanged.
    tensors = {"weight1": torch.zeros((1024, 1024)), "weight2": torch.zeros((1024, 1024))}
    path = str(tmp / "model.safetensors")
    veturboio.save_file(tensors, path)
    new_tensors = veturboio.load(path, map_location="cpu")
    helper = veturboio.init_io_helper()
    new_tensors = veturboio.load(path, map_location="cpu", use_pinmem=False, helper=helper)
    assert set(new_tensors) == {"weight1", "weight2"}
    assert all(torch.equal(new_tensors[k], tensors[k]) for k in tensors)
    pt = str(tmp / "model.pt")
    veturboio.save_pt(tensors, pt)
    new_tensors = veturboio.load(pt, map_location="cpu")
    assert all(torch.equal(new_tensors[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("kwargs", [{}, {"use_direct_io": True}, {"num_thread": 1}, {"enable_fast_mode": False}])
def test_load_matches_safetensors(tmp, kwargs):
    sd = sample_dict(11)
    path = tmp / "m.safetensors"
    st.save_file(sd, path)
    out = veturboio.load(str(path), **kwargs)
    assert set(out) == set(sd)
    for k in sd:
        assert same(out[k], sd[k]), k
        assert out[k].device.type == "cpu"


def test_pt_files_are_detected_by_content(tmp):
    sd = {"a": torch.arange(10), "b": torch.ones(2, 2, dtype=torch.bfloat16)}
    weird = tmp / "model.safetensors"  # a torch pickle with a misleading name
    torch.save(sd, weird)
    out = veturboio.load(str(weird))
    assert all(same(out[k], sd[k]) for k in sd)
    st.save_file(sd, tmp / "model.pt")  # and the reverse
    out = veturboio.load(str(tmp / "model.pt"))
    assert all(same(out[k], sd[k]) for k in sd)


def test_shared_tensors_and_aliases(tmp):
    w = torch.randn(8, 8)
    path = str(tmp / "shared.safetensors")
    with pytest.raises(RuntimeError, match="share memory"):
        veturboio.save_file({"a": w, "b": w}, path)
    sd = {"linear2.weight": w, "linear3.weight": w, "bias": torch.ones(3)}
    veturboio.save_file(sd, path, force_save_shared_tensor=True)
    assert set(sd) == {"linear2.weight", "bias"}, "the alias is removed from the caller's dict"
    out = veturboio.load(path)
    assert out["linear3.weight"] is out["linear2.weight"]
    assert torch.equal(out["linear3.weight"], w)
    # Non-fast mode restores no alias (as veTurboIO's pure-python loader).
    assert "linear3.weight" not in veturboio.load(path, enable_fast_mode=False)
    # The official loader sees one tensor and the alias in the metadata.
    assert set(st.load_file(path)) == {"linear2.weight", "bias"}
    sd = {"linear2.weight": w, "linear3.weight": w}
    veturboio.save_file(sd, path, force_save_shared_tensor=True, force_clone_shared_tensor=True)
    assert set(sd) == {"linear2.weight", "linear3.weight"} and sd["linear3.weight"].data_ptr() != w.data_ptr()
    out = veturboio.load(path)
    assert torch.equal(out["linear3.weight"], w)


def test_save_model(tmp):
    m = TiedLinears()
    path = str(tmp / "model.safetensors")
    veturboio.save_model(m, path)
    out = veturboio.load(path)
    assert out["b.weight"] is out["a.weight"]
    m2 = TiedLinears()
    m2.load_state_dict(out)
    assert torch.equal(m2.b.weight, m.a.weight)


def test_non_contiguous(tmp):
    t = torch.randn(4, 6).t()
    path = str(tmp / "nc.safetensors")
    with pytest.raises(ValueError, match="contiguous"):
        veturboio.save_file({"t": t}, path, force_contiguous=False)
    veturboio.save_file({"t": t}, path)
    assert torch.equal(veturboio.load(path)["t"], t)


def test_state_dict_is_filled_in_place(tmp):
    sd = {"w": torch.randn(16, 16), "b": torch.arange(5, dtype=torch.int64), "e": torch.empty(0)}
    path = str(tmp / "sd.safetensors")
    veturboio.save_file(sd, path)
    pre = {"w": torch.zeros(16, 16), "b": torch.zeros(5, dtype=torch.int64), "e": torch.empty(0)}
    ptrs = {k: v.data_ptr() for k, v in pre.items()}
    out = veturboio.load(path, state_dict=pre)
    assert out is pre
    assert all(out[k].data_ptr() == ptrs[k] for k in ("w", "b"))
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    big = {"w": torch.zeros(300), "b": torch.zeros(5, dtype=torch.int64), "e": torch.empty(0)}
    out = veturboio.load(path, state_dict=big)
    assert out["w"].shape == (16, 16) and torch.equal(out["w"], sd["w"])
    with pytest.raises(KeyError):
        veturboio.load(path, state_dict={"w": torch.zeros(16, 16)})
    with pytest.raises(RuntimeError, match="not contiguous"):
        veturboio.load(path, state_dict={**pre, "w": torch.zeros(16, 16).t()})
    with pytest.raises(RuntimeError, match="dtype not match"):
        veturboio.load(path, state_dict={**pre, "w": torch.zeros(16, 16, dtype=torch.float64)})
    with pytest.raises(RuntimeError, match="size not enough"):
        veturboio.load(path, state_dict={**pre, "w": torch.zeros(10)})


def test_load_to_shmem(tmp):
    sd = sample_dict(2)
    path = str(tmp / "shm.safetensors")
    st.save_file(sd, path)
    shm = veturboio.load_to_shmem(path, use_cipher=False)
    try:
        assert len(shm.name) == 10 and shm.name.isalpha()
        assert bytes(shm.buf[: os.path.getsize(path)]) == open(path, "rb").read()
        out = veturboio.load("/dev/shm/" + shm.name, enable_fast_mode=False, use_cipher=False)
        assert all(same(out[k], sd[k]) for k in sd)
    finally:
        shm.close()
        shm.unlink()


def test_not_yet_supported_is_clear(tmp):
    path = str(tmp / "x.safetensors")
    veturboio.save_file({"a": torch.ones(2)}, path)
    # GPUs: test_gpu.py. NPUs are refused (veTurboIO would return CPU tensors).
    with pytest.raises(RuntimeError, match="not supported in this build"):
        veturboio.load(path, map_location="npu:0")


def test_bad_files_raise_clear_errors(tmp):
    with pytest.raises(FileNotFoundError):
        veturboio.load(str(tmp / "missing.safetensors"))
    bad = tmp / "bad.safetensors"
    header = b'{"a":{"dtype":"F32","shape":[100],"data_offsets":[0,400]}}'
    header += b" " * (-len(header) % 8)
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\x00" * 100)
    with pytest.raises(ValueError) as e:
        veturboio.load(str(bad))
    assert "bad.safetensors" in str(e.value) and "incomplete" in str(e.value)
    with pytest.raises(ValueError):
        veturboio.load_to_shmem(str(bad))


def test_convert(tmp):
    w = torch.randn(4, 4)
    sd = {"a": w, "tied": w, "n": torch.arange(3), "step": 7}
    src = str(tmp / "model.pt")
    torch.save(sd, src)
    run = lambda *a: subprocess.run([sys.executable, "-m", "turboio.convert", *a], capture_output=True, text=True)
    r = run("-i", src, "--dry-run")
    assert r.returncode == 0 and not (tmp / "model.safetensors").exists(), r.stderr
    r = run("-i", src, "--enable-to-valid-state-dict", "--validate-result")
    assert r.returncode == 0, r.stderr
    out = veturboio.load(str(tmp / "model.safetensors"))
    assert torch.equal(out["a"], w) and out["tied"] is out["a"] and torch.equal(out["n"], torch.arange(3))
    r = run("-i", src, "-o", str(tmp / "model.safetensors"))
    assert r.returncode == 1 and "exists" in r.stderr
    r = run("-i", src, "-o", str(tmp / "model.safetensors"), "--overwrite", "--enable-to-valid-state-dict")
    assert r.returncode == 0, r.stderr
    r = run("-i", str(tmp / "model.txt"))
    assert r.returncode == 1
