//! `turboio load --device` / `--gds` as a user runs them. Without a GPU (CI), every GPU entry
//! point must exit with status 1 and one line naming what is missing; with `TURBOIO_TEST_CUDA=1`
//! the loads must succeed and match a plain read.

mod common;

use common::{scratch, stderr, turboio};
use std::process::Output;

fn gpu() -> bool {
    std::env::var("TURBOIO_TEST_CUDA").as_deref() == Ok("1")
}

#[test]
fn gpu_options_without_a_gpu_fail_with_one_line() {
    let d = scratch();
    let file = d.path().join("s.safetensors");
    let f = file.to_str().unwrap();
    assert!(turboio(&["gen", f, "--size", "2MiB"]).status.success());
    let one_line = |o: &Output, needles: &[&str]| {
        let err = stderr(o);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        assert!(err.starts_with("turboio: error: "), "{err}");
        for n in needles {
            assert!(err.contains(n), "{n:?} not in {err}");
        }
        assert!(!err.contains("panicked"), "{err}");
    };
    let o = turboio(&["load", f, "--device", "npu:0"]);
    one_line(&o, &["npu:0", "not supported in this build"]);
    let o = turboio(&["load", f, "--gds", "on"]);
    one_line(&o, &["--device cuda"]);
    if gpu() {
        eprintln!("skipped: the no-GPU half (TURBOIO_TEST_CUDA=1)");
        return;
    }
    for device in ["cuda", "cuda:0", "cuda:3"] {
        for gds in ["auto", "on", "off"] {
            let o = turboio(&["load", f, "--device", device, "--gds", gds, "--check"]);
            let err = stderr(&o);
            one_line(&o, &["cuda:", "not available"]);
            assert!(err.contains("libcuda") || err.contains("no CUDA device"), "{err}");
        }
    }
    let o = turboio(&["load", f, "--device", "tpu:0"]);
    assert_eq!(o.status.code(), Some(2), "a bad device string is a usage error");
    // The CPU path is unchanged.
    let o = turboio(&["load", f, "--device", "cpu", "--gds", "off", "--check"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn gpu_loads_match_a_plain_read() {
    if !gpu() {
        eprintln!("skipped: TURBOIO_TEST_CUDA is not 1 (no GPU test)");
        return;
    }
    let d = scratch();
    let file = d.path().join("s.safetensors");
    let f = file.to_str().unwrap();
    assert!(turboio(&["gen", f, "--size", "64MiB"]).status.success());
    for mode in ["auto", "mapped", "copied"] {
        for gds in ["auto", "on", "off"] {
            let o =
                turboio(&["load", f, "--device", "cuda:0", "--mode", mode, "--gds", gds, "--check", "--repeat", "2"]);
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(o.status.success(), "{mode}/{gds}: {}", stderr(&o));
            assert!(out.contains("a plain read of the"), "{out}");
        }
    }
}
