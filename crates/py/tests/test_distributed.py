"""The fastsafetensors API on a real torch.distributed process group (gloo, CPU, spawned
processes), world sizes 2 and 3, in both shard modes: every rank's results equal slicing the
reference tensors; direct mode reads at most 1/world of the sharded bytes per rank (plus one
alignment block per tensor), measured by the bytes the storage read."""

import json
import math
import os

import pytest
import safetensors.torch as st
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ALIGN = 4096


def reference():
    g = torch.Generator().manual_seed(1)
    return [
        {"a.w": torch.randn(10, 6, generator=g), "a.v": torch.randn(10, 5, generator=g), "a.b": torch.randn(7, generator=g).to(torch.bfloat16)},
        {"b.w": torch.randn(5, 9, generator=g).to(torch.float16), "b.i": torch.arange(22, dtype=torch.int64).reshape(2, 11)},
        {"c.w": torch.randn(4, 3, 2, generator=g), "c.e": torch.empty(0, 5)},
    ]


def block(t, dim, rank, world):
    size = t.shape[dim]
    step = math.ceil(size / world)
    start = min(rank * step, size)
    return t.narrow(dim, start, max(0, min(step, size - start)))


def worker(rank, world, d, prefix=None):
    from turboio.fastsafetensors import SafeTensorsFileLoader

    dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=rank, world_size=world)
    files = [f"{prefix or d}/{i}.safetensors" for i in range(3)]
    ref = {k: v for part in reference() for k, v in part.items()}
    out = {}
    for mode in ("collectives", "direct"):
        loader = SafeTensorsFileLoader(dist.group.WORLD, device="cpu", shard_mode=mode)
        loader.add_filenames({r: [f for i, f in enumerate(files) if i % world == r] for r in range(world)})
        fb = loader.copy_files_to_device()
        sharded_bytes = 0
        n_sharded = 0
        for name in sorted(ref):
            t = ref[name]
            for dim in range(t.dim()):
                got = fb.get_sharded(name, dim)
                want = block(t, dim, rank, world)
                assert got.dtype == want.dtype and torch.equal(got, want), (mode, name, dim, rank)
                sharded_bytes += t.numel() * t.element_size()
                n_sharded += 1
        direct_bytes = fb.bytes_read
        for name in sorted(ref):
            assert torch.equal(fb.get_tensor(name), ref[name]), (mode, name)
            pushed = fb.push_tensor(name, world - 1)
            if rank == world - 1:
                assert torch.equal(pushed, ref[name]), (mode, name)
            else:
                assert pushed is None
        cols = fb.get_multi_cols(["a.w", "a.v"], 1)
        assert torch.equal(cols, torch.cat([block(ref["a.w"], 1, rank, world), block(ref["a.v"], 1, rank, world)], 1))
        out[mode] = {"bytes_read_sharding": direct_bytes, "bound": sharded_bytes / world + ALIGN * n_sharded}
        fb.close()
        loader.close()
    from turboio.fastsafetensors import ParallelLoader

    for mode in ("collectives", "direct"):
        pl = ParallelLoader(dist.group.WORLD, files, shard_mode=mode)
        got = dict(pl.iterate_weights())
        assert got.keys() == ref.keys(), (mode, sorted(got))
        for name, t in got.items():
            assert torch.equal(t, ref[name]), (mode, name)
        pl.close()
    with open(f"{d}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_sharding_on_a_real_process_group(tmp, world):
    d = tmp / f"dist{world}"
    d.mkdir()
    for i, part in enumerate(reference()):
        st.save_file(part, d / f"{i}.safetensors")
    mp.spawn(worker, args=(world, str(d)), nprocs=world, join=True)
    for r in range(world):
        res = json.loads((d / f"rank{r}.json").read_text())
        direct = res["direct"]["bytes_read_sharding"]
        assert 0 < direct <= res["direct"]["bound"], (r, res)


def test_shard_mode_is_checked():
    from turboio.fastsafetensors import SafeTensorsFileLoader

    with pytest.raises(ValueError, match="shard_mode"):
        SafeTensorsFileLoader(None, shard_mode="gossip")


def test_sharding_from_object_storage(tmp, monkeypatch):
    """The same on files in an S3 bucket (moto's server on 127.0.0.1), every rank configured
    from the environment: direct mode fetches only this rank's byte ranges."""
    pytest.importorskip("moto")
    from test_object import ACCESS_KEY, SECRET_KEY, Server

    server = Server()
    try:
        server.client.create_bucket(Bucket="dist-objects")
        d = tmp / "dist-s3"
        d.mkdir()
        for i, part in enumerate(reference()):
            server.client.put_object(Bucket="dist-objects", Key=f"m/{i}.safetensors", Body=st.save(part))
        for k, v in {
            "AWS_ENDPOINT_URL": server.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(k, v)
        mp.spawn(worker, args=(2, str(d), "s3://dist-objects/m"), nprocs=2, join=True)
        for r in range(2):
            res = json.loads((d / f"rank{r}.json").read_text())
            direct = res["direct"]["bytes_read_sharding"]
            assert 0 < direct <= res["direct"]["bound"], (r, res)
    finally:
        server.stop()


def big_model():
    g = torch.Generator().manual_seed(7)
    return {
        "embed": torch.randn(1024, 1024, generator=g),
        "layers.0.w": torch.randn(1024, 768, generator=g).to(torch.bfloat16),
        "layers.0.b": torch.randn(768, generator=g).to(torch.float16),
        "layers.1.w": torch.randn(900, 1000, generator=g),
        "layers.1.i": torch.arange(5000, dtype=torch.int64),
        "head": torch.randn(1000, 1024, generator=g),
        "empty": torch.empty(0, 3),
    }


def once_worker(rank, world, d, url, options):
    import turboio

    dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=rank, world_size=world)
    ref = big_model()
    got = turboio.load_model(url, process_group=dist.group.WORLD, fetch="once", storage_options=options)
    assert got.keys() == ref.keys(), sorted(got)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), (rank, k)
    report = turboio.fetch_report()
    # dtype= after the exchange; a missing model fails on every rank with the same error.
    bf = turboio.load_model(url, process_group=dist.group.WORLD, fetch="once", storage_options=options, dtype="bfloat16")
    assert torch.equal(bf["embed"], ref["embed"].bfloat16()) and bf["layers.1.i"].dtype == torch.int64
    try:
        turboio.load_model(url + "-missing", process_group=dist.group.WORLD, fetch="once", storage_options=options)
        missing = "loaded"
    except (FileNotFoundError, ValueError) as e:
        missing = str(e)
    # With a node cache: the first rank of the host publishes every shard.
    cached = turboio.load_model(url, process_group=dist.group.WORLD, fetch="once", storage_options=options, cache_dir=f"{d}/cache")
    assert torch.equal(cached["head"], ref["head"])
    with open(f"{d}/once{rank}.json", "w") as f:
        json.dump({"report": report, "missing": missing, "cached_files": turboio.fetch_report()["cached_files"]}, f)
    dist.barrier()
    dist.destroy_process_group()


def upload_big_model(server, bucket):
    """`big_model()` saved in several shards under s3://BUCKET/model; returns the URL, the
    number of shards, and the bytes of the shards and of the index."""
    import turboio

    server.client.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/model"
    turboio.save_model_dir(big_model(), url, max_shard_size="6MB", storage_options=server.options)
    objects = server.client.list_objects_v2(Bucket=bucket, Prefix="model/")["Contents"]
    shards = [o for o in objects if o["Key"].endswith(".safetensors")]
    index_bytes = sum(o["Size"] for o in objects if o["Key"].endswith(".json"))
    assert len(shards) >= 3
    return url, len(shards), sum(o["Size"] for o in shards), index_bytes


@pytest.mark.parametrize("world", [2, 3])
def test_fetch_once_replicates_a_model_and_the_store_serves_it_once(tmp, world):
    pytest.importorskip("moto")
    import turboio
    from test_object import Server

    server = Server()
    try:
        url, shards, shard_bytes, index_bytes = upload_big_model(server, f"once{world}")
        d = tmp / f"once{world}"
        d.mkdir()
        server.faults("{}")
        mp.spawn(once_worker, args=(world, str(d), url, server.options), nprocs=world, join=True)
        served = server.stats()["get_bytes"]
        part = 8 << 20
        fetched = []
        for r in range(world):
            res = json.loads((d / f"once{r}.json").read_text())
            rep = res["report"]
            fetched.append(rep["fetched_bytes"])
            assert rep["bytes"] == shard_bytes and rep["world_size"] == world
            assert rep["fetched_bytes"] <= shard_bytes / world + part, rep
            assert rep["fetched_bytes"] + rep["received_bytes"] == shard_bytes, rep
            assert "missing" in res["missing"] or "no " in res["missing"], res["missing"]
        # Three loads (plain, dtype=, with a cache) served about once each: the shards' bytes,
        # plus each rank's opening GETs (1 MiB at most per shard it reads from) and the index.
        print(f"W={world}: shards {shard_bytes} B; fetched per rank {fetched}; server sent {served} B for three loads")
        opening = 3 * world * (1 << 20) * 2
        assert served <= 3 * shard_bytes + opening + 6 * index_bytes, (served, shard_bytes)
        assert sum(json.loads((d / f"once{r}.json").read_text())["cached_files"] for r in range(world)) == shards
        urls = [json.loads(p.read_text())["url"] for p in (d / "cache").glob("*.json")]
        assert sum(u.endswith(".safetensors") for u in urls) == shards, urls  # (and the index)
        server.faults("{}")
        warm = turboio.load_model(url, storage_options=server.options, cache_dir=d / "cache")
        assert torch.equal(warm["embed"], big_model()["embed"])
        assert server.stats()["get_bytes"] <= index_bytes, "the shards came from the node cache"
    finally:
        server.stop()


def nccl_once_worker(rank, world, d, url, options):
    import turboio

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{d}/init", rank=rank, world_size=world)
    ref = big_model()
    got = turboio.load_model(url, process_group=dist.group.WORLD, fetch="once", storage_options=options, cache_dir=f"{d}/cache")
    assert got.keys() == ref.keys(), sorted(got)
    for k, v in ref.items():
        assert got[k].device.type == "cuda", (rank, k, got[k].device)
        assert got[k].dtype == v.dtype and torch.equal(got[k].cpu(), v), (rank, k)
    with open(f"{d}/once{rank}.json", "w") as f:
        json.dump(turboio.fetch_report(), f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(os.environ.get("TURBOIO_TEST_CUDA") != "1", reason="TURBOIO_TEST_CUDA is not 1 (no GPU test)")
def test_fetch_once_on_nccl(tmp):
    """NCCL: every rank ends with the model on its GPU, each fetched about 1/W of it, and the
    host's first rank published every shard to the node cache from GPU memory."""
    pytest.importorskip("moto")
    import turboio
    from test_object import Server

    world = min(2, torch.cuda.device_count())
    assert world >= 1, "TURBOIO_TEST_CUDA=1 without a visible GPU"
    server = Server()
    try:
        url, shards, shard_bytes, _ = upload_big_model(server, "nccl")
        d = tmp / "nccl"
        d.mkdir()
        mp.spawn(nccl_once_worker, args=(world, str(d), url, server.options), nprocs=world, join=True)
        reports = [json.loads((d / f"once{r}.json").read_text()) for r in range(world)]
        for rep in reports:
            assert rep["fetched_bytes"] <= shard_bytes / world + (8 << 20), rep
            assert rep["fetched_bytes"] + rep["received_bytes"] == shard_bytes, rep
        assert sum(rep["cached_files"] for rep in reports) == shards, reports
        server.faults("{}")
        before = server.stats()["get_bytes"]
        warm = turboio.load_model(url, storage_options=server.options, cache_dir=d / "cache")
        assert torch.equal(warm["head"], big_model()["head"])
        assert server.stats()["get_bytes"] - before < shard_bytes / 2, "the shards came from the node cache"
    finally:
        server.stop()


def mismatch_worker(rank, world, d):
    import turboio

    dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=rank, world_size=world)
    try:
        # Rank 1 asks for another model than rank 0: every rank refuses, none loads rank 0's.
        with pytest.raises(ValueError, match=r"rank 1 asked for .*model-b.* but rank 0 for .*model-a"):
            turboio.load_model(f"{d}/model-{'ab'[rank]}", process_group=dist.group.WORLD, fetch="once")
    finally:
        dist.destroy_process_group()


def test_fetch_once_refuses_ranks_that_ask_for_different_models(tmp):
    d = tmp / "mismatch"
    for name in ("model-a", "model-b"):
        (d / name).mkdir(parents=True)
        st.save_file({"w": torch.arange(4.0)}, str(d / name / "model.safetensors"))
    mp.spawn(mismatch_worker, args=(2, str(d)), nprocs=2, join=True)


def budget_worker(rank, world, d):
    import turboio

    dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=rank, world_size=world)
    try:
        # Only rank 1 has a budget, too small for the model: every rank raises rank 1's verdict.
        budget = 10 if rank == 1 else None
        with pytest.raises(MemoryError, match=r"rank 1: .*max_host_memory is"):
            turboio.load_model(f"{d}/model-a", process_group=dist.group.WORLD, fetch="once", max_host_memory=budget)
        # Within the budget, the model loads on both.
        got = turboio.load_model(f"{d}/model-a", process_group=dist.group.WORLD, fetch="once", max_host_memory="1MiB")
        assert torch.equal(got["w"], torch.arange(4.0))
    finally:
        dist.destroy_process_group()


def test_fetch_once_runs_the_memory_plan_and_the_ranks_agree(tmp):
    d = tmp / "budget"
    (d / "model-a").mkdir(parents=True)
    st.save_file({"w": torch.arange(4.0)}, str(d / "model-a" / "model.safetensors"))
    mp.spawn(budget_worker, args=(2, str(d)), nprocs=2, join=True)


def lone_failure_worker(rank, world, d):
    import datetime

    import turboio

    # A short collective timeout: before every local step joined the agreement, rank 0 waited
    # here for the group's timeout (30 minutes by default) while rank 1 had already raised.
    dist.init_process_group(
        "gloo", init_method=f"file://{d}/init", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        # The same relative path on both ranks, but only rank 0's working directory holds it:
        # rank 1 fails its local check, and every rank raises rank 1's error.
        os.chdir(f"{d}/r{rank}")
        with pytest.raises(FileNotFoundError, match=r"rank 1: model-a: no such file"):
            turboio.load_model("model-a", process_group=dist.group.WORLD, fetch="once")
        # A failed allocation on rank 1 (after the plan): the same.
        real_empty = torch.empty
        shard = os.path.getsize(f"{d}/r0/model-a/model.safetensors")

        def failing_empty(*a, **k):
            if rank == 1 and a == (shard,):  # the shard's buffer, not the collectives' own
                raise RuntimeError("simulated allocation failure")
            return real_empty(*a, **k)

        torch.empty = failing_empty
        try:
            with pytest.raises(RuntimeError, match=r"rank 1: simulated allocation failure"):
                turboio.load_model(f"{d}/r0/model-a", process_group=dist.group.WORLD, fetch="once")
        finally:
            torch.empty = real_empty
        # And the group still works: the next load succeeds on both.
        got = turboio.load_model(f"{d}/r0/model-a", process_group=dist.group.WORLD, fetch="once")
        assert torch.equal(got["w"], torch.arange(4.0))
    finally:
        dist.destroy_process_group()


def test_a_rank_failing_alone_fails_every_rank_at_once(tmp):
    d = tmp / "lone"
    (d / "r0" / "model-a").mkdir(parents=True)
    (d / "r1").mkdir()
    st.save_file({"w": torch.arange(4.0)}, str(d / "r0" / "model-a" / "model.safetensors"))
    mp.spawn(lone_failure_worker, args=(2, str(d)), nprocs=2, join=True)


def test_fetch_once_is_checked():
    import turboio

    with pytest.raises(ValueError, match="fetch must be"):
        turboio.load_model("x", fetch="sometimes")
    with pytest.raises(ValueError, match="process_group"):
        turboio.load_model("x", fetch="once")
