"""The fastsafetensors API (single process), against the tensors safetensors reads."""

import pytest
import safetensors.torch as st
import torch

from turboio import SafeTensorsFileLoader, SingleGroup, fastsafe_open
from conftest import same


class FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.fixture
def files(tmp):
    a = {"w1": torch.randn(10, 6), "b1": torch.arange(7, dtype=torch.int32)}
    b = {"w2": torch.randn(4, 9).to(torch.bfloat16)}
    pa, pb = str(tmp / "a.safetensors"), str(tmp / "b.safetensors")
    st.save_file(a, pa, metadata={"shard": "a"})
    st.save_file(b, pb)
    return pa, pb, {**a, **b}


def test_loader(files):
    pa, pb, ref = files
    loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
    loader.add_filenames({0: [pa, pb]})
    assert sorted(loader.get_keys()) == sorted(ref)
    assert loader.get_shape("w1") == [10, 6]
    fb = loader.copy_files_to_device()
    for k in ref:
        assert same(fb.get_tensor(k), ref[k]), k
        assert same(fb.get_sharded(k, 0), ref[k]), "world of one: the whole tensor"
    assert fb.get_filename("w2") == pb and fb.get_filename("nope") == ""
    assert fb.get_tensor("w1", dtype=torch.float16).dtype == torch.float16
    kept = fb.get_tensor("w1")
    fb.close()
    loader.close()
    assert same(kept, ref["w1"]), "tensors stay valid after close()"


@pytest.mark.parametrize("world", [2, 3, 4, 11])
def test_get_sharded_gives_this_rank_its_block(files, world):
    pa, _, ref = files
    for rank in range(world):
        # Direct mode needs no collectives: each simulated rank reads its own block.
        loader = SafeTensorsFileLoader(FakeGroup(world, rank), device="cpu", shard_mode="direct")
        loader.add_filenames({0: [pa]})
        fb = loader.copy_files_to_device()
        for dim in (0, 1):
            want = torch.chunk(ref["w1"], world, dim=dim) if ref["w1"].shape[dim] >= world else None
            got = fb.get_sharded("w1", dim)
            block = -(-ref["w1"].shape[dim] // world)
            assert same(got, ref["w1"].narrow(dim, min(rank * block, ref["w1"].shape[dim]), got.shape[dim])), (rank, dim)
            if want is not None and rank < len(want):
                assert same(got, want[rank])
        assert same(fb.get_sharded("b1", -1), ref["b1"])
        fb.close()


def test_fastsafe_open(files):
    pa, pb, ref = files
    with fastsafe_open([pa, pb]) as f:
        assert sorted(f.keys()) == sorted(ref)
        assert f.metadata()[pa] == {"shard": "a"}
        assert same(f.get_tensor("w2"), ref["w2"])
    with fastsafe_open(pa, framework="pt", pg=SingleGroup(), device="cpu", nogds=False) as f:
        assert same(f.get_tensor("b1"), ref["b1"])


def test_errors(files):
    pa, pb, _ = files
    with pytest.raises(RuntimeError, match="not supported in this build"):
        SafeTensorsFileLoader(SingleGroup(), "npu:0")
    with pytest.raises(Exception, match="ProcessGroup"):
        SafeTensorsFileLoader(object(), "cpu")
    import shutil

    copy = pa.replace("a.safetensors", "a2.safetensors")
    shutil.copy(pa, copy)
    loader = SafeTensorsFileLoader(SingleGroup(), "cpu")
    loader.add_filenames({0: [pa, copy]})
    with pytest.raises(Exception, match="unique"):
        loader.copy_files_to_device()


def test_parallel_and_auto_loaders_in_one_process(files, tmp, monkeypatch):
    from turboio.fastsafetensors import AutoLoader, ParallelLoader

    pa, pb, ref = files
    for loader in (ParallelLoader(SingleGroup(), [pa, pb]), AutoLoader(SingleGroup(), [pa, pb])):
        got = dict(loader.iterate_weights())
        assert got.keys() == ref.keys()
        for name, t in got.items():
            assert same(t, ref[name]), name
        loader.close()
    cfg = tmp / "fst.json"
    cfg.write_text('{"loader": "3fs"}')
    monkeypatch.setenv("FASTSAFETENSORS_CONFIG", str(cfg))
    with pytest.raises(NotImplementedError, match="3fs"):
        AutoLoader(SingleGroup(), [pa])


def test_collectives_move_tensors_on_the_groups_device(files, monkeypatch):
    """NCCL refuses CPU tensors in broadcast / scatter / send: with a group whose backend is
    NCCL, every tensor a collective gets lives on the loader's CUDA device; gloo keeps the CPU.
    (Checked here without a GPU: the backend is reported by a stand-in, and the device the
    tensors are moved to is the meta device, which needs no memory.)"""
    import torch.distributed as dist

    from turboio import fastsafetensors as fst

    backend = {"name": "nccl"}
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend["name"])
    assert fst._collective_device(FakeGroup(2, 0), torch.device("cuda:1")) == torch.device("cuda:1")
    with pytest.raises(ValueError, match="NCCL process group moves CUDA tensors only"):
        fst._collective_device(FakeGroup(2, 0), torch.device("cpu"))
    backend["name"] = "gloo"
    assert fst._collective_device(FakeGroup(2, 0), torch.device("cuda:1")) == torch.device("cpu")

    # An NCCL group with a CPU loader is a clear error before anything is loaded.
    backend["name"] = "nccl"
    pa, pb, ref = files
    loader = SafeTensorsFileLoader(FakeGroup(2, 0), device="cpu")
    loader.add_filenames({0: [pa], 1: [pb]})
    with pytest.raises(ValueError, match="device='cuda:N'"):
        loader.copy_files_to_device()

    # The collectives themselves: every tensor handed to them is on the group's device.
    seen = []

    def record(op):
        def f(t, *args, **kwargs):
            seen.append((op, t.device))
            for x in args[0] if op == "scatter" and args and args[0] else []:
                seen.append(("scatter piece", x.device))

        return f

    for op in ("broadcast", "scatter", "send", "recv"):
        monkeypatch.setattr(dist, op, record(op))
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: r, raising=False)
    monkeypatch.setattr(fst, "_collective_device", lambda pg, device: torch.device("meta"))
    # Meta tensors cannot come back to the CPU: what arrives is returned as it is.
    monkeypatch.setattr(fst.FilesBufferOnDevice, "_finish", lambda self, t, device, dtype: t)
    for rank in (0, 1):
        loader = SafeTensorsFileLoader(FakeGroup(2, rank), device="cpu")
        loader.add_filenames({0: [pa], 1: [pb]})
        fb = loader.copy_files_to_device()
        fb.get_tensor("w1")  # owner 0
        fb.get_sharded("w1", 0)
        fb.push_tensor("w2", 0)  # owner 1 sends to 0
        fb.close()
    assert {op for op, _ in seen} >= {"broadcast", "scatter", "scatter piece", "send", "recv"}, seen
    assert all(d == torch.device("meta") for _, d in seen), seen
