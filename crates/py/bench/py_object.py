"""One load from an S3-compatible server by one loader, timed, for `cargo xtask bench --object`
(each run in its own process, so every loader starts with fresh connections and fresh memory).

What it measures: the time from nothing to a dict of CPU tensors holding the whole checkpoint
(one safetensors object, or every shard of a model under a key prefix), as each loader's user
would write it, plus a first read of one byte of every 4 KiB page of the result (free for
copied tensors; what a lazily mapped result costs at first use), and the process's peak RSS.

Loaders (`--loader`):
  "turboio"  `turboio.load(url, storage_options=...)` / `turboio.load_model(prefix, ...)`;
  "runai"    Run:ai Model Streamer: `SafetensorsStreamer().stream_files(urls)` and every tensor
             of `get_tensors()` kept (owned tensors); its concurrency comes from the environment
             (RUNAI_STREAMER_CONCURRENCY) as the bench sets it;
  "local"    `turboio.load(path)` / `turboio.load_model(dir)` of local files (`--url` is a path);
  "boto3"    `boto3` `download_file` of each object to a temporary file under `--tmp`, then
             `safetensors.torch.load_file` (download and load timed together; the file is
             deleted afterwards, untimed).

The endpoint and credentials come from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_REGION), set by the bench, as is the node cache (TURBOIO_CACHE_DIR)
for the cache rows. Prints one JSON line:
{"load_s", "touch_s", "bytes", "tensors", "peak_rss_bytes"}.
"""

import argparse
import json
import os
import resource
import time

from py_load import touch  # one byte of every 4 KiB page of every CPU tensor


def storage_options():
    return {
        "endpoint": os.environ["AWS_ENDPOINT_URL"],
        "region": os.environ.get("AWS_REGION", "us-east-1"),
        "access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
        "secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
    }


def split_url(url):
    rest = url[len("s3://"):]
    bucket, _, key = rest.partition("/")
    return bucket, key


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--loader", required=True, choices=["turboio", "local", "runai", "boto3"])
    p.add_argument("--target", required=True, choices=["file", "model"])
    p.add_argument("--url", required=True, help="the file's URL, or the model's key prefix")
    p.add_argument("--shards", default="", help="the model's shard URLs, comma-separated")
    p.add_argument("--tmp", default="", help="directory for boto3's downloads")
    p.add_argument(
        "--fetch-once",
        action="store_true",
        help="turboio only: join the gloo group of the environment (RANK, WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT) and load the model with fetch='once'",
    )
    a = p.parse_args()
    import torch  # noqa: F401  (imported before timing: every loader needs it)

    group = None
    if a.fetch_once:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        group = dist.group.WORLD
        dist.barrier()  # every rank starts its clock together

    urls = [a.url] if a.target == "file" else [u for u in a.shards.split(",") if u]
    if a.loader in ("turboio", "local"):
        import turboio

        opts = storage_options() if a.loader == "turboio" else None
    elif a.loader == "runai":
        from runai_model_streamer import SafetensorsStreamer
    else:
        import boto3
        import safetensors.torch

        s3 = boto3.client(
            "s3",
            endpoint_url=os.environ["AWS_ENDPOINT_URL"],
            region_name=os.environ.get("AWS_REGION", "us-east-1"),
            aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        )
    tmp_files = []
    t0 = time.perf_counter()
    if a.loader in ("turboio", "local"):
        if group is not None:
            sd = turboio.load_model(a.url, storage_options=opts, process_group=group, fetch="once")
        elif a.target == "file":
            sd = turboio.load(a.url, storage_options=opts)
        else:
            sd = turboio.load_model(a.url, storage_options=opts)
    elif a.loader == "runai":
        sd = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(urls)
            for name, tensor in streamer.get_tensors():
                sd[name] = tensor
    else:
        sd = {}
        for i, u in enumerate(urls):
            bucket, key = split_url(u)
            dst = os.path.join(a.tmp, f"py_object-{os.getpid()}-{i}.safetensors")
            tmp_files.append(dst)
            s3.download_file(bucket, key, dst)
            sd.update(safetensors.torch.load_file(dst))
    t1 = time.perf_counter()
    touch(sd.values())
    t2 = time.perf_counter()
    for f in tmp_files:
        os.remove(f)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = turboio.fetch_report() if group is not None else {}
    print(json.dumps({
        "fetched_bytes": report.get("fetched_bytes"),
        "received_bytes": report.get("received_bytes"),
        "load_s": t1 - t0,
        "touch_s": t2 - t1,
        "bytes": nbytes,
        "tensors": len(sd),
        "peak_rss_bytes": peak,
    }))


if __name__ == "__main__":
    main()
