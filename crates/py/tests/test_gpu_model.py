"""The Python paths into a GPU, measured through the model of a GPU (`TURBOIO_GPU_MODEL`) on a
machine without one: the staging pool is pinned once per process and device, whatever API
loads (turboio.load, safetensors.torch's drop-in, the fastsafetensors drop-in, an IOHelper,
`iter_weights`, the vLLM plug-in's iterator, shard after shard), and no later load pins,
creates an event or synchronises the device.

Each case runs in a process of its own (the model is chosen once per process, as a real
device would be), which prints the model's counters as JSON."""

import json
import os
import subprocess
import sys
import textwrap

import torch
import safetensors.torch as st

MiB = 1 << 20


def run_child(script, **env):
    """Runs `script` in a new Python process on the model of a GPU; returns its last JSON line."""
    code = textwrap.dedent(
        """
        import json, sys
        import turboio, turboio._turboio as _t

        def counters():
            return _t._gpu_model_counters("cuda:0")

        def delta(after, before):
            return {k: after[k] - before[k] for k in after}

        """
    ) + textwrap.dedent(script)
    full_env = {**os.environ, "TURBOIO_GPU_MODEL": "", **env}
    out = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def sample(path, mib=40, seed=0):
    """A file of about `mib` MiB in tensors of several dtypes and shapes."""
    g = torch.Generator().manual_seed(seed)
    n = mib * MiB // 4 // 8
    tensors = {f"layer.{i}.w": torch.randn(n // 64, 64, generator=g) for i in range(6)}
    tensors.update({f"layer.{i}.b": torch.randn(n, generator=g).to(torch.bfloat16) for i in range(2)})
    tensors["step"] = torch.tensor([7], dtype=torch.int64)
    st.save_file(tensors, str(path))
    return tensors


def model_dir(d, shards=3, mib=24):
    """A model of `shards` shards with an index."""
    d.mkdir()
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = sample(d / name, mib, seed=s)
        tensors = {f"s{s}.{k}": v for k, v in tensors.items()}
        st.save_file(tensors, str(d / name))
        weight_map.update({k: name for k in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


def data_bytes(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - n


def test_every_python_api_pins_once_per_process_and_loads_the_whole_file(tmp):
    f = tmp / "m.safetensors"
    ref = sample(f)
    got = run_child(
        f"""
        import turboio.torch
        from turboio.fastsafetensors import SafeTensorsFileLoader, SingleGroup
        path = {str(f)!r}
        steps = {{}}
        before = counters()
        sd = turboio.load(path, map_location="cuda:0")
        shapes = {{k: [str(v.device), str(v.dtype), list(v.shape)] for k, v in sd.items()}}
        steps["first turboio.load"] = delta(counters(), before)

        def step(name, load):
            before = counters()
            load()
            steps[name] = delta(counters(), before)

        step("turboio.load again", lambda: turboio.load(path, map_location="cuda:0"))
        step("safetensors.torch drop-in", lambda: turboio.torch.load_file(path, device="cuda:0"))

        def fast():
            loader = SafeTensorsFileLoader(SingleGroup(), "cuda:0", nogds=True)
            loader.add_filenames({{0: [path]}})
            loader.copy_files_to_device().get_tensor("step")

        step("fastsafetensors drop-in", fast)
        helper = turboio.init_io_helper()
        step("an IOHelper", lambda: turboio.load(path, map_location="cuda:0", helper=helper))

        def cold_bypass():
            import os
            os.sync()
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            turboio.load(path, map_location="cuda:0", cache="bypass")

        step("turboio.load cold, cache bypassed", cold_bypass)
        step("turboio.load cold, cache bypassed, again", cold_bypass)
        pool = turboio.staging_pool("cuda:0")
        out = {{"steps": steps, "shapes": shapes, "pool_allocations": pool.allocations(),
               "pool_bytes": pool.live_bytes(), "max_buffers": pool.max_buffers}}
        pool.release()
        out["pool_bytes_after_release"] = pool.live_bytes()
        print(json.dumps(out))
        """
    )
    for name, t in ref.items():
        assert got["shapes"][name] == ["meta", str(t.dtype), list(t.shape)], name
    first = got["steps"].pop("first turboio.load")
    assert first["pinned_allocations"] > 0 and first["pinned_bytes"] > 0, first
    # The whole data section crossed the modelled link (from the aligned offset before it).
    assert data_bytes(f) <= first["uploaded_bytes"] <= os.path.getsize(f), first
    for name, c in got["steps"].items():
        assert c["pinned_allocations"] == 0 and c["pinned_bytes"] == 0, (name, c)
        assert c["events_created"] == 0, (name, c)
        assert c["synchronizations"] == 0, (name, c)
        assert c["uploaded_bytes"] == first["uploaded_bytes"], (name, c)
    assert got["pool_allocations"] == first["pinned_allocations"], "the pool's slots are the ones first pinned"
    assert got["pool_allocations"] <= got["max_buffers"]
    assert got["pool_bytes"] > 0 and got["pool_bytes_after_release"] == 0, "release() frees every free slot"


def test_shard_after_shard_the_iterators_pin_nothing_after_the_first(tmp):
    d = tmp / "model"
    weight_map = model_dir(d)
    got = run_child(
        f"""
        import torch
        from turboio import vllm_plugin
        from turboio.models import iter_weights
        out = {{}}
        for name, iterate in [
            ("iter_weights", lambda: iter_weights({str(d)!r}, device="cuda:0")),
            ("vllm plug-in", lambda: vllm_plugin.weights_iterator(
                {str(d)!r}, vllm_plugin.loader_options({{"upload": "device"}}), device=torch.device("cuda:0"))),
        ]:
            start = counters()
            first = None
            names = {{}}
            for n, t in iterate():
                if first is None:
                    first = counters()
                names[n] = [str(t.device), list(t.shape)]
            out[name] = {{"first_shard": delta(first, start), "later_shards": delta(counters(), first),
                         "names": names}}
        print(json.dumps(out))
        """
    )
    shards = set(weight_map.values())
    data = sum(data_bytes(d / f) for f in shards)
    whole = sum(os.path.getsize(d / f) for f in shards)
    first_pass = True
    for name, r in got.items():
        assert set(r["names"]) == set(weight_map), name
        assert all(dev == "meta" for dev, _ in r["names"].values()), name
        later = r["later_shards"]
        # The later shards were loaded after the first tensor was handed out, and pinned nothing.
        assert later["allocations"] >= 1 and later["uploaded_bytes"] > 0, (name, later)
        assert later["pinned_allocations"] == 0 and later["events_created"] == 0, (name, later)
        assert data <= r["first_shard"]["uploaded_bytes"] + later["uploaded_bytes"] <= whole, name
        if first_pass:
            assert r["first_shard"]["pinned_allocations"] > 0, "the process's first load pins the pool"
            first_pass = False
        else:
            assert r["first_shard"]["pinned_allocations"] == 0, (name, "the pool was pinned by the first iterator")


def test_a_bad_model_setting_is_a_clear_error(tmp):
    f = tmp / "m.safetensors"
    sample(f, mib=1)
    code = f"import turboio; turboio.load({str(f)!r}, map_location='cuda:0')"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TURBOIO_GPU_MODEL": "link=fast"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "TURBOIO_GPU_MODEL" in out.stderr and "link" in out.stderr, out.stderr[-2000:]
    assert "Traceback" in out.stderr and "panicked" not in out.stderr


def test_counters_need_the_model():
    code = "import turboio._turboio as t; t._gpu_model_counters('cuda:0')"
    env = {k: v for k, v in os.environ.items() if k != "TURBOIO_GPU_MODEL"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "TURBOIO_GPU_MODEL is not set" in out.stderr, out.stderr[-2000:]
