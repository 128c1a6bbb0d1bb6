//! What the CLI tests share: running the real binary and a scratch directory under `target/`.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

/// Runs the `turboio` binary built for these tests.
pub fn turboio(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_turboio")).args(args).env("RUST_BACKTRACE", "1").output().expect("run turboio")
}

/// A fresh directory under `target/test-scratch` (on the project's disk, where `O_DIRECT` works,
/// unlike tmpfs).
pub fn scratch() -> tempfile::TempDir {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-scratch");
    std::fs::create_dir_all(&base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
