//! The `turboio` binary, as a user runs it.

mod common;

use common::{scratch, stderr, stdout, turboio};
use std::path::Path;
use std::process::{Command, Output};

#[test]
fn gen_inspect_load_check() {
    let d = scratch();
    let file = d.path().join("s.safetensors");
    let f = file.to_str().unwrap();
    let o = turboio(&["gen", f, "--size", "8MiB", "--seed", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("wrote"), "{}", stdout(&o));

    let o = turboio(&["inspect", f]);
    assert!(o.status.success());
    let out = stdout(&o);
    for needle in ["BF16", "F32", "F16", "I64", "BOOL", "model.embed_tokens.weight", "metadata", "generator"] {
        assert!(out.contains(needle), "inspect lacks {needle}:\n{out}");
    }

    let o = turboio(&["inspect", f, "--json"]);
    assert!(o.status.success());
    let doc: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let header = turboio::read_header_of(&file, &turboio::LoadOptions::default()).unwrap();
    assert_eq!(doc["tensors"].as_array().unwrap().len(), header.len());
    assert_eq!(doc["file_len"].as_u64().unwrap(), std::fs::metadata(&file).unwrap().len());
    assert_eq!(doc["metadata"]["format"], "pt");

    for mode in ["auto", "mapped", "copied"] {
        for cache in ["auto", "keep", "bypass"] {
            let o =
                turboio(&["load", f, "--mode", mode, "--cache", cache, "--check", "--repeat", "2", "--threads", "2"]);
            if mode == "mapped" && cache == "bypass" {
                assert_eq!(o.status.code(), Some(1));
                assert!(stderr(&o).contains("cannot bypass"), "{}", stderr(&o));
                continue;
            }
            assert!(o.status.success(), "{mode}/{cache}: {}", stderr(&o));
            let out = stdout(&o);
            assert!(
                out.contains("GB/s") && out.contains("all 186 tensors match") && out.contains("median of 2 runs"),
                "{out}"
            );
            assert!(out.contains(&format!("check: {f}: ")), "the check names the file: {out}");
            let kept = if cache == "bypass" { "page cache bypassed" } else { "page cache kept" };
            assert!(out.contains(kept), "{mode}/{cache}: {out}");
        }
    }
    // The older spelling still works: --direct on is --cache bypass.
    let o = turboio(&["load", f, "--mode", "copied", "--direct", "on"]);
    assert!(o.status.success() && stdout(&o).contains("page cache bypassed (asked for)"), "{}", stdout(&o));
    let o = turboio(&["load", f, "--mode", "copied", "--reuse-arena", "--repeat", "2"]);
    assert!(stdout(&o).contains("arena reused"), "{}", stdout(&o));
}

#[test]
fn bad_input_is_one_clear_line_and_a_failure() {
    let d = scratch();
    let bad = d.path().join("bad.safetensors");
    std::fs::write(&bad, b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":oops}      ").unwrap();
    let trunc = d.path().join("trunc.safetensors");
    let mut t = 64u64.to_le_bytes().to_vec();
    let json = r#"{"a":{"dtype":"F32","shape":[100],"data_offsets":[0,400]}}"#;
    let mut j = json.as_bytes().to_vec();
    j.resize(64, b' ');
    t.extend_from_slice(&j);
    t.extend_from_slice(&[0u8; 100]);
    std::fs::write(&trunc, &t).unwrap();
    let missing = d.path().join("missing.safetensors");
    for (file, needle) in [(&bad, "invalid JSON"), (&trunc, "incomplete"), (&missing, "no such file")] {
        for cmd in ["inspect", "load"] {
            let o = turboio(&[cmd, file.to_str().unwrap()]);
            assert_eq!(o.status.code(), Some(1), "{cmd} {}", file.display());
            let err = stderr(&o);
            assert_eq!(err.lines().count(), 1, "one line: {err}");
            assert!(err.starts_with("turboio: error: "), "{err}");
            assert!(err.contains(file.file_name().unwrap().to_str().unwrap()) && err.contains(needle), "{err}");
            assert!(!err.contains("panicked") && !err.contains("backtrace"), "{err}");
        }
    }
    let o = turboio(&["load", bad.to_str().unwrap(), "--mode", "sideways"]);
    assert_eq!(o.status.code(), Some(2), "usage errors exit 2");
    assert!(stderr(&o).contains("sideways"));
}

#[test]
fn help_describes_every_command() {
    let o = turboio(&["--help"]);
    let out = stdout(&o);
    for c in ["inspect", "load", "gen", "demo"] {
        assert!(out.contains(c), "{out}");
    }
    let o = turboio(&["load", "--help"]);
    let out = stdout(&o);
    for flag in ["--threads", "--cache", "--mode", "--repeat", "--check"] {
        assert!(out.contains(flag), "{out}");
    }
}

/// A safetensors file of zero-sized F32 tensors with these names.
fn empty_tensors_file(path: &Path, names: &[String]) {
    let entries: Vec<String> =
        names.iter().map(|n| format!(r#""{n}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}"#)).collect();
    let json = format!("{{{}}}", entries.join(","));
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    std::fs::write(path, bytes).unwrap();
}

/// Runs turboio with its standard output closed by the reader before it writes anything.
fn with_closed_stdout(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_turboio"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run turboio");
    drop(child.stdout.take());
    child.wait_with_output().unwrap()
}

#[test]
fn a_closed_pipe_ends_every_command_quietly() {
    let d = scratch();
    // A table and a JSON document far larger than a pipe's buffer.
    let big = d.path().join("many.safetensors");
    empty_tensors_file(&big, &(0..5000).map(|i| format!("layer.{i}.weight")).collect::<Vec<_>>());
    let sample = d.path().join("s.safetensors");
    let o = turboio(&["gen", sample.to_str().unwrap(), "--size", "1MiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (b, s) = (big.to_str().unwrap(), sample.to_str().unwrap());
    let gen_out = d.path().join("g.safetensors");
    let dir = d.path().join("demo");
    let runs: Vec<Vec<&str>> = vec![
        vec!["inspect", b],
        vec!["inspect", b, "--json"],
        vec!["load", s, "--check", "--repeat", "3"],
        vec!["gen", gen_out.to_str().unwrap(), "--size", "1MiB"],
        vec!["demo", "--size", "1MiB", "--runs", "1", "--dir", dir.to_str().unwrap()],
        vec!["--help"],
        vec!["load", "--help"],
    ];
    for args in runs {
        let o = with_closed_stdout(&args);
        let err = stderr(&o);
        assert!(matches!(o.status.code(), Some(0) | Some(141)), "{args:?}: {:?} {err}", o.status);
        assert!(err.is_empty(), "{args:?} printed to stderr: {err}");
    }
}

#[test]
fn inspect_prints_names_of_any_length() {
    let d = scratch();
    let file = d.path().join("long.safetensors");
    let name = "n".repeat(65_536);
    empty_tensors_file(&file, &[name.clone(), "short".into()]);
    for extra in [None, Some("--json")] {
        let mut args = vec!["inspect", file.to_str().unwrap()];
        args.extend(extra);
        let o = turboio(&args);
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        assert!(stdout(&o).contains(&name), "{extra:?}");
    }
}

#[test]
fn gen_refuses_sizes_it_cannot_honour() {
    let d = scratch();
    let out = d.path().join("g.safetensors");
    let f = out.to_str().unwrap();
    for size in ["1", "10KiB"] {
        let o = turboio(&["gen", f, "--size", size]);
        assert_eq!(o.status.code(), Some(1), "{size}: {}", stdout(&o));
        let err = stderr(&o);
        assert!(err.contains("at least") && err.lines().count() == 1, "{err}");
        assert!(!out.exists());
    }
    for cmd in [vec!["gen", f, "--size", "-1GiB"], vec!["demo", "--size", "-1GiB"]] {
        let o = turboio(&cmd);
        assert_eq!(o.status.code(), Some(2));
        let err = stderr(&o);
        assert!(err.contains("negative") && !err.contains("-- -1"), "{err}");
    }
    // A small size is honoured, and reported in the unit that fits it.
    let o = turboio(&["gen", f, "--size", "1MiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let len = std::fs::metadata(&out).unwrap().len();
    assert!((1 << 20..(1 << 20) + 65536).contains(&len), "{len}");
    assert!(stdout(&o).contains(" MB") && !stdout(&o).contains("0.00 GB"), "{}", stdout(&o));
}

#[test]
fn zero_counts_are_refused() {
    let d = scratch();
    let file = d.path().join("s.safetensors");
    let o = turboio(&["gen", file.to_str().unwrap(), "--size", "1MiB"]);
    assert!(o.status.success());
    for args in [vec!["demo", "--runs", "0"], vec!["load", file.to_str().unwrap(), "--repeat", "0"]] {
        let o = turboio(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stdout(&o));
        assert!(stderr(&o).contains("at least 1"), "{}", stderr(&o));
        assert!(stdout(&o).is_empty());
    }
}

#[test]
fn help_speaks_to_users() {
    let o = turboio(&["--help"]);
    assert!(!stdout(&o).contains("orchestrator"), "{}", stdout(&o));
    let o = turboio(&["load", "--help"]);
    let out = stdout(&o);
    assert!(out.contains("lazy") && out.contains("--key-env"), "{out}");
    assert!(!out.contains("--cipher-header") && !out.contains("When writing"), "{out}");
    let o = turboio(&["inspect", "--help"]);
    assert!(stdout(&o).contains("--key-env") && stdout(&o).contains("--cipher"));
}

const KEY: &str = "YWJjZGVmZ2gxMjM0NTY3OA=="; // abcdefgh12345678
const IV: &str = "MTIzNDU2Nzg4NzY1NDMyMQ=="; // 1234567887654321
const WRONG_KEY: &str = "MDAwMDAwMDAwMDAwMDAwMA=="; // 0000000000000000

fn turboio_env(args: &[&str], key: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_turboio"));
    c.args(args).env("RUST_BACKTRACE", "1");
    for (k, _) in std::env::vars() {
        if k.starts_with("VETURBOIO_") {
            c.env_remove(k);
        }
    }
    c.env("DATAPIPE_SOCKET_PATH", "/nonexistent/turboio-test/datapipe.sock");
    if let Some(key) = key {
        c.env("VETURBOIO_KEY", key).env("VETURBOIO_IV", IV);
    }
    c.output().expect("run turboio")
}

#[test]
fn encrypted_files_say_so_and_inspect_takes_a_key() {
    let d = scratch();
    let plain = d.path().join("m.safetensors");
    let enc = d.path().join("m.enc.safetensors");
    let (p, e) = (plain.to_str().unwrap(), enc.to_str().unwrap());
    assert!(turboio(&["gen", p, "--size", "1MiB"]).status.success());
    let o = turboio_env(&["encrypt", p, e, "--key-env"], Some(KEY));
    assert!(o.status.success(), "{}", stderr(&o));

    // Without a key: the error says the file looks encrypted and how to pass a key.
    for key in [Some(KEY), None] {
        for cmd in ["inspect", "load"] {
            let o = turboio_env(&[cmd, e], key);
            assert_eq!(o.status.code(), Some(1));
            let err = stderr(&o);
            assert_eq!(err.lines().count(), 1, "{err}");
            assert!(err.contains("encrypted") && err.contains("--cipher") && err.contains("--key-env"), "{err}");
            if key.is_some() {
                assert!(err.contains("decrypts"), "{err}");
            }
        }
    }
    // With the key, inspect shows the plain file's tensors.
    let o = turboio_env(&["inspect", e, "--key-env", "--json"], Some(KEY));
    assert!(o.status.success(), "{}", stderr(&o));
    let doc: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let header = turboio::read_header_of(&plain, &turboio::LoadOptions::default()).unwrap();
    assert_eq!(doc["tensors"].as_array().unwrap().len(), header.len());

    // No key anywhere: the file is named once, the sources tried are listed.
    let o = turboio_env(&["load", e, "--cipher"], None);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert_eq!(err.matches("m.enc.safetensors").count(), 1, "{err}");
    assert!(err.contains("VETURBOIO_KEY"), "{err}");

    // A wrong key: "wrong key", and the message does not talk of "the given key" twice.
    let o = turboio_env(&["load", e, "--key-env"], Some(WRONG_KEY));
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("wrong key") && !err.contains("key from the given key"), "{err}");
}

#[test]
fn a_wrong_key_never_replaces_the_output_of_decrypt() {
    let d = scratch();
    let plain = d.path().join("m.safetensors");
    let enc = d.path().join("m.enc.safetensors");
    let out = d.path().join("out.safetensors");
    let (p, e, o_) = (plain.to_str().unwrap(), enc.to_str().unwrap(), out.to_str().unwrap());
    assert!(turboio(&["gen", p, "--size", "1MiB"]).status.success());
    assert!(turboio_env(&["encrypt", p, e, "--key-env"], Some(KEY)).status.success());
    let o = turboio_env(&["decrypt", e, o_, "--key-env"], Some(KEY));
    assert!(o.status.success(), "{}", stderr(&o));
    let good = std::fs::read(&out).unwrap();
    assert_eq!(good, std::fs::read(&plain).unwrap());

    let o = turboio_env(&["decrypt", e, o_, "--key-env"], Some(WRONG_KEY));
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    let err = stderr(&o);
    assert!(err.contains("wrong key") && err.lines().count() == 1, "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), good, "a wrong key replaced the output");

    // A .pt file (a zip archive) round-trips; with a wrong key it is refused the same way.
    let pt = d.path().join("m.pt");
    let mut zip = b"PK\x03\x04".to_vec();
    zip.extend_from_slice(&[7u8; 5000]);
    zip.extend_from_slice(b"PK\x05\x06");
    zip.extend_from_slice(&[0u8; 18]);
    std::fs::write(&pt, &zip).unwrap();
    let pt_enc = d.path().join("m.pt.enc");
    let pt_out = d.path().join("m.pt.out");
    assert!(turboio_env(&["encrypt", pt.to_str().unwrap(), pt_enc.to_str().unwrap(), "--key-env"], Some(KEY))
        .status
        .success());
    let o = turboio_env(&["decrypt", pt_enc.to_str().unwrap(), pt_out.to_str().unwrap(), "--key-env"], Some(KEY));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read(&pt_out).unwrap(), zip);
    let o = turboio_env(&["decrypt", pt_enc.to_str().unwrap(), pt_out.to_str().unwrap(), "--key-env"], Some(WRONG_KEY));
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(std::fs::read(&pt_out).unwrap(), zip);
}

#[test]
fn check_reports_a_file_rewritten_during_the_load() {
    let d = scratch();
    let file = d.path().join("race.safetensors");
    let (a, b) = (d.path().join("a.safetensors"), d.path().join("b.safetensors"));
    assert!(turboio(&["gen", a.to_str().unwrap(), "--size", "8MiB", "--seed", "1"]).status.success());
    assert!(turboio(&["gen", b.to_str().unwrap(), "--size", "12MiB", "--seed", "2"]).status.success());
    std::fs::copy(&a, &file).unwrap();
    // A writer that rewrites the file in place (truncate, then write), alternating two
    // versions, for as long as the loads below run; it pauses between rewrites so that some
    // loads complete and then meet a rewrite during their check.
    let stop = d.path().join("stop");
    let script = format!(
        "while [ ! -e '{stop}' ]; do cat '{a}' > '{f}'; sleep 0.03; cat '{b}' > '{f}'; sleep 0.03; done",
        stop = stop.display(),
        a = a.display(),
        b = b.display(),
        f = file.display()
    );
    let mut writer = Command::new("sh").args(["-c", &script]).spawn().unwrap();
    let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
    for round in 0..60 {
        let mode = ["copied", "auto", "mapped"][round % 3];
        let o = turboio(&["load", file.to_str().unwrap(), "--check", "--mode", mode, "--repeat", "3"]);
        let err = stderr(&o);
        assert!(!err.contains("panicked"), "{mode}: {err}");
        match o.status.code() {
            Some(0) => *outcomes.entry("ok".into()).or_default() += 1,
            Some(1) => {
                assert_eq!(err.lines().count(), 1, "{mode}: {err}");
                assert!(err.starts_with("turboio: error: ") && err.contains("race.safetensors"), "{err}");
                let kind = if err.contains("changed") || err.contains("rewritten") { "changed" } else { "other" };
                *outcomes.entry(kind.into()).or_default() += 1;
            }
            other => panic!("{mode}: exit {other:?} ({:?}): {err}", o.status),
        }
    }
    std::fs::write(&stop, b"").unwrap();
    writer.wait().unwrap();
    eprintln!("outcomes: {outcomes:?}");
    assert!(outcomes.get("changed").copied().unwrap_or(0) > 0, "the race was never seen: {outcomes:?}");
}

#[test]
fn model_directories_generate_inspect_and_load() {
    let d = scratch();
    let dir = d.path().join("model");
    let m = dir.to_str().unwrap();
    let o = turboio(&["gen", m, "--shards", "4", "--size", "8MiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("in 4 shards"), "{}", stdout(&o));
    let index = dir.join("model.safetensors.index.json");
    assert!(index.is_file());

    let o = turboio(&["inspect", m]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("in 4 shards") && out.contains("model-00001-of-00004.safetensors") && out.contains("dtypes:"),
        "{out}"
    );
    // Shards listed in order; counts in words ("1 tensor", never "1 tensors").
    let at = |n: usize| out.find(&format!("model-0000{n}-of-00004")).unwrap();
    assert!(at(1) < at(2) && at(2) < at(3) && at(3) < at(4), "{out}");
    assert!(!out.contains(" 1 tensors"), "{out}");
    // Issue 49: `gen --shards N` writes exactly N shards (it wrote N + 1).
    for n in [3usize, 4, 8] {
        let other = d.path().join(format!("model{n}"));
        let o = turboio(&["gen", other.to_str().unwrap(), "--shards", &n.to_string(), "--size", "10MiB"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let shards = std::fs::read_dir(&other)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".safetensors"))
            .count();
        assert_eq!(shards, n, "{}", stdout(&o));
    }
    let o = turboio(&["inspect", index.to_str().unwrap(), "--json"]);
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["shards"].as_array().unwrap().len(), 4);
    let dtype_bytes: u64 = doc["dtypes"].as_object().unwrap().values().map(|v| v["bytes"].as_u64().unwrap()).sum();
    assert_eq!(dtype_bytes, doc["bytes"].as_u64().unwrap());

    for mode in ["auto", "copied"] {
        let o = turboio(&["load", m, "--mode", mode, "--check"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = stdout(&o);
        assert!(out.contains("in 4 shards"), "{out}");
        assert_eq!(out.matches("a plain read of the file").count(), 4, "{out}");
        let at = |n: usize| out.find(&format!("model-0000{n}-of-00004.safetensors: ")).unwrap();
        assert!(at(1) < at(2) && at(2) < at(3) && at(3) < at(4), "shards checked in order: {out}");
    }

    // A broken index: one clear line naming it, exit 1.
    std::fs::write(&index, "{\"weight_map\": {\"nope\": \"model-00001-of-00004.safetensors\"}}").unwrap();
    for cmd in ["load", "inspect"] {
        let o = turboio(&[cmd, m]);
        assert_eq!(o.status.code(), Some(1));
        let e = stderr(&o);
        assert!(
            e.contains("model.safetensors.index.json") && e.contains("tensor `nope` is named by the index but"),
            "{e}"
        );
        assert_eq!(e.lines().count(), 1, "{e}");
    }
}

/// `.pt` checkpoints: inspect, load --check (mapped and O_DIRECT), convert --validate-result,
/// and the result read by torch. Needs TURBOIO_PYTHON (torch and safetensors; `cargo xtask
/// test` sets it); skipped without.
#[test]
fn torch_checkpoints_inspect_load_and_convert() {
    let Some(python) = std::env::var_os("TURBOIO_PYTHON") else {
        assert!(std::env::var_os("TURBOIO_REQUIRE_PYTHON").is_none(), "TURBOIO_PYTHON is not set");
        eprintln!("skipped: TURBOIO_PYTHON is not set");
        return;
    };
    let d = scratch();
    let pt = d.path().join("ckpt.pt");
    let py = |code: &str, args: &[&Path]| {
        let o = Command::new(&python).arg("-c").arg(code).args(args).output().expect("run python");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    py(
        "import sys, torch; g = torch.Generator().manual_seed(3); w = torch.randn(64, 48, generator=g); \
         torch.save({'state_dict': {'emb': w, 'head': w, 'wt': w.t(), 'b': torch.randn(7).half(), 'n': torch.arange(5)}, 'epoch': 4}, sys.argv[1])",
        &[&pt],
    );
    let f = pt.to_str().unwrap();

    let o = turboio(&["inspect", f]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in
        ["torch.save checkpoint", "state_dict.emb", "[1, 48]", "shared storage", "skipped (not a tensor): epoch"]
    {
        assert!(out.contains(needle), "inspect lacks {needle}:\n{out}");
    }
    let o = turboio(&["inspect", f, "--json", "--top-level-key", "state_dict"]);
    let doc: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(doc["tensors"].as_array().unwrap().len(), 5);
    assert_eq!(doc["tensors"][0]["name"], "emb");

    for (mode, cache) in [("auto", "auto"), ("copied", "bypass"), ("copied", "keep")] {
        let o = turboio(&["load", f, "--mode", mode, "--cache", cache, "--check"]);
        assert!(o.status.success(), "{mode} {cache}: {}", stderr(&o));
        assert!(stdout(&o).contains("all 5 tensors match a plain read"), "{}", stdout(&o));
    }

    let st = d.path().join("ckpt.safetensors");
    let s = st.to_str().unwrap();
    let o = turboio(&["convert", f, s, "--validate-result", "--dtype", "bf16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("alias: state_dict.head -> state_dict.emb"), "{}", stdout(&o));
    assert!(stdout(&o).contains("validated"), "{}", stdout(&o));
    let o = turboio(&["convert", f, s]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("exists"), "{}", stderr(&o));
    // torch agrees: every tensor equals torch.load's, converted by torch itself.
    let verdict = py(
        "import sys, torch, safetensors.torch as st; a = torch.load(sys.argv[1], weights_only=True)['state_dict']; \
         b = st.load_file(sys.argv[2]); \
         print(all(torch.equal(b['state_dict.' + k], (v.to(torch.bfloat16) if v.is_floating_point() else v)) for k, v in a.items() if k != 'head') and 'state_dict.head' not in b)",
        &[&pt, &st],
    );
    assert_eq!(verdict.trim(), "True");

    // A safetensors load of a .pt file says what it is.
    let err = turboio::load(&pt, &turboio::LoadOptions::default()).unwrap_err().to_string();
    assert!(err.contains("PyTorch checkpoint") && err.contains("ckpt.pt"), "{err}");
}

/// Issue 49, item 6: `turboio -h` gives one line per command; the options every command takes
/// are listed apart from a command's own; the page cache and the node cache cannot be confused;
/// the writing commands describe encryption as writing it.
#[test]
fn help_is_short_and_says_what_each_option_is_for() {
    let o = turboio(&["-h"]);
    let out = stdout(&o);
    let commands: Vec<&str> =
        out.lines().skip_while(|l| !l.starts_with("Commands:")).skip(1).take_while(|l| !l.is_empty()).collect();
    assert!(commands.len() >= 8, "{out}");
    for line in &commands {
        assert!(line.len() <= 110, "one short line per command: {line}");
    }
    let o = turboio(&["load", "-h"]);
    let out = stdout(&o);
    assert!(out.contains("--page-cache <POLICY>") && out.contains("not the node cache"), "{out}");
    assert!(out.contains("Object storage and the node cache:"), "{out}");
    let own = out.split("Object storage and the node cache").next().unwrap();
    assert!(!own.lines().any(|l| l.trim_start().starts_with("--cache-dir")), "the global options are apart: {out}");
    for cmd in ["gen", "encrypt"] {
        let out = stdout(&turboio(&[cmd, "-h"]));
        assert!(out.contains("Encrypt what is written"), "{cmd}: {out}");
        assert!(!out.contains("The file is encrypted"), "{cmd}: {out}");
    }
    let out = stdout(&turboio(&["cache", "prune", "-h"]));
    assert!(out.contains("--max-size <SIZE>") && out.contains("e.g. 50GiB"), "{out}");
    // `cache` lists only what means something there: the cache's directory.
    for args in [&["cache", "-h"][..], &["cache", "ls", "-h"], &["cache", "prune", "-h"], &["cache", "du", "--help"]] {
        let out = stdout(&turboio(args));
        assert!(out.contains("--cache-dir"), "{args:?}: {out}");
        for other in ["--storage-option", "--cache-max-size", "--cache-revalidate"] {
            assert!(!out.contains(other), "{args:?} lists {other}: {out}");
        }
    }
    let out = stdout(&turboio(&["load", "-h"]));
    assert!(out.contains("--storage-option") && out.contains("--cache-revalidate"), "{out}");
    // Given before the subcommand, they are still accepted (and ignored by `cache`).
    let d = scratch();
    let dir = d.path().join("cache");
    let o = turboio(&["--cache-dir", dir.to_str().unwrap(), "--cache-revalidate", "5m", "cache", "du"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // The older spelling still works.
    let d = scratch();
    let f = d.path().join("s.safetensors");
    assert!(turboio(&["gen", f.to_str().unwrap(), "--size", "1MiB"]).status.success());
    assert!(turboio(&["load", f.to_str().unwrap(), "--cache", "keep"]).status.success());
}
