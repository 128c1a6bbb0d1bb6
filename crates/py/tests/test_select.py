"""Loading some tensors (`tensors=`) in every Python API, the streaming iterator's bounded
memory (`iter_weights(window=)`), and tensors as views of one export per load."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch as st
import torch

import turboio
import turboio.torch as tt
from conftest import same


def sample():
    g = torch.Generator().manual_seed(7)
    out = {}
    for i in range(12):
        out[f"model.layers.{i}.mlp.weight"] = torch.randn(64, 256, generator=g)
        out[f"model.layers.{i}.norm.weight"] = torch.randn(256, generator=g).to(torch.bfloat16)
    out["lm_head.weight"] = torch.randn(300, 256, generator=g).to(torch.float16)
    out["step"] = torch.tensor(7, dtype=torch.int64)
    return out


@pytest.fixture
def file(tmp):
    path = tmp / "m.safetensors"
    st.save_file(sample(), str(path))
    return path


def test_names_patterns_sets_and_callables_select(file):
    ref = sample()
    got = turboio.load(str(file), tensors=["model.layers.1?.mlp.weight", "lm_head.weight"])
    assert sorted(got) == sorted(["model.layers.10.mlp.weight", "model.layers.11.mlp.weight", "lm_head.weight"])
    for k, v in got.items():
        assert same(v, ref[k]), k
    got = turboio.load(str(file), tensors="model.layers.3.*")
    assert sorted(got) == ["model.layers.3.mlp.weight", "model.layers.3.norm.weight"]
    got = turboio.load(str(file), tensors=lambda n: n.endswith("norm.weight") and "layers.2." in n)
    assert list(got) == ["model.layers.2.norm.weight"]
    got = turboio.load(str(file), tensors={"step"})
    assert same(got["step"], ref["step"])
    got = tt.load_file(str(file), tensors=["lm_head.weight"])
    assert list(got) == ["lm_head.weight"] and same(got["lm_head.weight"], ref["lm_head.weight"])


def test_only_the_selected_bytes_are_read(file):
    seen = []
    size = os.path.getsize(file)
    turboio.load(str(file), tensors=["model.layers.0.norm.weight"], progress=seen.append)
    assert seen and seen[-1] < size // 4, (seen[-1], size)


def test_a_name_that_matches_nothing_is_a_key_error_naming_the_closest(file):
    with pytest.raises(KeyError, match="no tensor matches `lm_head.weights`.*`lm_head.weight`"):
        turboio.load(str(file), tensors=["lm_head.weights"])
    with pytest.raises(ValueError, match="empty list"):
        turboio.load(str(file), tensors=[])
    with pytest.raises(TypeError, match="tensors= takes"):
        turboio.load(str(file), tensors=[3])

    def boom(name):
        raise RuntimeError(f"predicate failed on {name}")

    with pytest.raises(RuntimeError, match="predicate failed on"):
        turboio.load(str(file), tensors=boom)


def test_safe_open_lists_only_the_selection(file):
    with tt.safe_open(str(file), "pt", tensors=["model.layers.4.*"]) as f:
        assert f.keys() == ["model.layers.4.mlp.weight", "model.layers.4.norm.weight"]
        assert same(f.get_tensor("model.layers.4.mlp.weight"), sample()["model.layers.4.mlp.weight"])
        with pytest.raises(Exception, match="does not contain"):
            f.get_tensor("lm_head.weight")


def test_models_open_only_the_shards_holding_the_selection(tmp):
    d = tmp / "model"
    ref = sample()
    turboio.save_model_dir(ref, str(d), max_shard_size="40KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    keep = ["model.layers.0.mlp.weight", "model.layers.0.norm.weight"]
    used = {index["weight_map"][n] for n in keep}
    for shard in set(index["weight_map"].values()) - used:
        os.remove(d / shard)
    got = turboio.load_model(str(d), tensors=keep)
    assert sorted(got) == sorted(keep)
    for k in keep:
        assert same(got[k], ref[k])
    got = dict(turboio.iter_weights(str(d), tensors="model.layers.0.*"))
    assert sorted(got) == sorted(keep)
    with pytest.raises(KeyError, match="model.safetensors.index.json: no tensor matches"):
        turboio.load_model(str(d), tensors=["model.layers.0.mlp.weights"])
    with pytest.raises(ValueError, match="fetch='once'"):
        turboio.load_model(str(d), tensors=keep, process_group=object(), fetch="once")


def test_iter_weights_checks_a_selection_across_files(tmp):
    ref = sample()
    names = list(ref)
    a, b = tmp / "a.safetensors", tmp / "b.safetensors"
    st.save_file({k: ref[k] for k in names[:12]}, str(a))
    st.save_file({k: ref[k] for k in names[12:]}, str(b))
    got = dict(turboio.iter_weights([str(a), str(b)], tensors=["model.layers.1.mlp.weight", "lm_head.weight"]))
    assert sorted(got) == ["lm_head.weight", "model.layers.1.mlp.weight"]
    with pytest.raises(KeyError, match="no tensor matches `nope`"):
        list(turboio.iter_weights([str(a), str(b)], tensors=["lm_head.weight", "nope"]))


def test_windows_stream_every_tensor_in_groups_that_own_their_memory(tmp):
    ref = sample()
    path = tmp / "m.safetensors"
    st.save_file(ref, str(path))
    got = {}
    storages = set()
    for name, t in turboio.iter_weights([str(path)], window="70KiB"):
        got[name] = t
        storages.add(t.untyped_storage().data_ptr())
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert same(got[k], ref[k]), k
    assert len(storages) > 3, "several groups, each its own memory"
    with pytest.raises(ValueError, match="window must be a positive"):
        list(turboio.iter_weights([str(path)], window=0))


def test_a_window_bounds_the_peak_memory_of_a_streamed_model(tmp):
    d = tmp / "big"
    g = torch.Generator().manual_seed(1)
    # 16 tensors of 4 MiB in 4 shards: 64 MiB.
    big = {f"w.{i}": torch.randn(1 << 20, generator=g) for i in range(16)}
    turboio.save_model_dir(big, str(d), max_shard_size="17MB")
    code = textwrap.dedent(
        """
        import sys, torch, turboio
        def hwm():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        dst = torch.empty(1 << 20)
        window = None if sys.argv[2] == "none" else sys.argv[2]
        open("/proc/self/clear_refs", "w").write("5")
        before = hwm()
        total = 0.0
        for name, t in turboio.iter_weights(sys.argv[1], window=window):
            dst.copy_(t)
            total += float(dst[0])
            del t
        print(hwm() - before)
        """
    )

    def peak(window):
        out = subprocess.run([sys.executable, "-c", code, str(d), window], capture_output=True, text=True, check=True)
        return int(out.stdout.strip().splitlines()[-1])

    whole, windowed = peak("none"), peak("4MiB")
    assert whole > 48 << 20, whole
    # Two groups of one 4 MiB tensor at most, plus the interpreter's own growth.
    assert windowed < 20 << 20, (windowed, whole)


def test_tensors_are_views_of_one_export_and_outlive_the_dict(file):
    ref = sample()
    got = turboio.load(str(file))
    ptrs = {t.untyped_storage().data_ptr() for t in got.values()}
    assert len(ptrs) == 1, "one export per load"
    for k, v in got.items():
        assert same(v, ref[k]), k
        assert v.is_contiguous()
    keep = got["model.layers.5.mlp.weight"]
    del got
    assert same(keep, ref["model.layers.5.mlp.weight"])


def test_safe_open_views_one_export(tmp, file):
    ref = sample()
    with tt.safe_open(str(file), framework="pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
        sl = f.get_slice("lm_head.weight")[10:20, ::3]
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1, "one export per file"
    for k, v in got.items():
        assert same(v, ref[k]) and v.is_contiguous(), k
    assert same(sl, ref["lm_head.weight"][10:20, ::3])
    # A tensor at an offset that is not a multiple of its element size is exported on its own.
    odd = {"a": torch.arange(3, dtype=torch.uint8), "b": torch.arange(5, dtype=torch.float32)}
    header = json.dumps({"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "b": {"dtype": "F32", "shape": [5], "data_offsets": [3, 23]}}).encode()
    header += b" " * (-len(header) % 8)
    data = odd["a"].numpy().tobytes() + odd["b"].numpy().tobytes()
    (tmp / "odd.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data)
    assert same(st.load_file(str(tmp / "odd.safetensors"))["b"], odd["b"])
    with tt.safe_open(str(tmp / "odd.safetensors"), framework="pt") as f:
        assert same(f.get_tensor("a"), odd["a"]) and same(f.get_tensor("b"), odd["b"])
        assert same(f.get_slice("b")[1:4], odd["b"][1:4])


def test_the_fastsafetensors_loaders_select_across_files(tmp):
    from turboio.fastsafetensors import ParallelLoader, SafeTensorsFileLoader, SingleGroup, fastsafe_open

    ref = sample()
    names = list(ref)
    a, b = tmp / "a.safetensors", tmp / "b.safetensors"
    st.save_file({k: ref[k] for k in names[:12]}, str(a))
    st.save_file({k: ref[k] for k in names[12:]}, str(b))
    want = ["model.layers.1.mlp.weight", "model.layers.2.norm.weight"]
    loader = SafeTensorsFileLoader(SingleGroup(), tensors=want)
    loader.add_filenames({0: [str(a), str(b)]})
    fb = loader.copy_files_to_device()
    assert sorted(loader.get_keys()) == want
    for k in want:
        assert same(fb.get_tensor(k), ref[k])
    assert list(fb._loads) == [str(a)], "a file holding nothing selected is not loaded"
    fb.close()
    with fastsafe_open([str(a), str(b)], tensors="lm_head.weight") as f:
        assert f.keys() == ["lm_head.weight"] and same(f.get_tensor("lm_head.weight"), ref["lm_head.weight"])
    got = dict(ParallelLoader(SingleGroup(), [str(a), str(b)], tensors=["*.norm.weight"]).iterate_weights())
    assert sorted(got) == sorted(n for n in names if n.endswith("norm.weight"))
    bad = SafeTensorsFileLoader(SingleGroup(), tensors=["model.layers.1.mlp.weights"])
    bad.add_filenames({0: [str(a), str(b)]})
    with pytest.raises(KeyError, match="closest: `model.layers.1.mlp.weight`"):
        bad.copy_files_to_device()


def test_a_load_over_its_memory_budget_raises_memory_error_before_reading(file, tmp):
    seen = []
    with pytest.raises(MemoryError, match="this load needs .* of host memory .* max_host_memory is 256KiB"):
        turboio.load(str(file), cache="bypass", max_host_memory="256KiB", progress=seen.append)
    assert not seen or seen[-1] == 0, seen
    # The remedies are Python's own keyword arguments, never the CLI's flags (issue 49, item 11).
    with pytest.raises(MemoryError) as info:
        turboio.load(str(file), cache="bypass", max_host_memory="256KiB")
    msg = str(info.value)
    assert 'cache="auto"' in msg and "tensors=" in msg and "max_host_memory=" in msg and "--" not in msg, msg
    # A mapped load holds no copy; a selection fits.
    assert len(turboio.load(str(file), max_host_memory="256KiB")) == len(sample())
    got = turboio.load(str(file), cache="bypass", max_host_memory=256 << 10, tensors=["lm_head.weight"])
    assert list(got) == ["lm_head.weight"]
    with pytest.raises(TypeError, match="max_host_memory takes"):
        turboio.load(str(file), max_host_memory=[1])
    d = tmp / "model"
    turboio.save_model_dir(sample(), str(d), max_shard_size="40KB")
    with pytest.raises(MemoryError, match="model.safetensors.index.json: this load needs"):
        turboio.load_model(str(d), cache="bypass", max_host_memory="64KiB")
    # The same for a .pt file: its copy is checked before it is made; mapped, or a selection, fits.
    pt = tmp / "m.pt"
    torch.save(sample(), str(pt))
    with pytest.raises(MemoryError, match=r"m\.pt: this load needs .* max_host_memory is 256KiB"):
        turboio.load(str(pt), cache="bypass", max_host_memory="256KiB")
    assert len(turboio.load(str(pt), max_host_memory="256KiB")) == len(sample())
    got = turboio.load(str(pt), cache="bypass", max_host_memory="256KiB", tensors="lm_head.weight")
    assert same(got["lm_head.weight"], sample()["lm_head.weight"])


def test_pt_loads_read_only_the_storages_of_the_selection(tmp):
    ref = sample()
    ref["tied.weight"] = ref["lm_head.weight"]  # a tied weight: one storage, two names
    path = tmp / "m.pt"
    torch.save(ref, str(path))
    got = turboio.load(str(path), tensors=["lm_head.weight", "tied.weight", "model.layers.3.*"])
    assert sorted(got) == sorted(["lm_head.weight", "tied.weight", "model.layers.3.mlp.weight", "model.layers.3.norm.weight"])
    for k, v in got.items():
        assert same(v, ref[k]), k
    assert got["tied.weight"].data_ptr() == got["lm_head.weight"].data_ptr(), "still one storage"
    with pytest.raises(KeyError, match="closest: `lm_head.weight`"):
        turboio.load(str(path), tensors=["lm_head.weights"])
    # Copied (O_DIRECT): the other storages are never read into the load's memory.
    got = turboio.load(str(path), tensors=["step"], cache="bypass")
    assert list(got) == ["step"] and same(got["step"], ref["step"])
