//! The `turboio` binary, as a user runs it.

use std::path::Path;
use std::process::{Command, Output};

fn turboio(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_turboio")).args(args).env("RUST_BACKTRACE", "1").output().expect("run turboio")
}

fn scratch() -> tempfile::TempDir {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-scratch");
    std::fs::create_dir_all(&base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

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
            assert!(out.contains("GB/s") && out.contains("check: all") && out.contains("median"), "{out}");
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
