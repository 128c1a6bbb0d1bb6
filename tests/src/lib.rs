//! Shared helpers for the workspace integration tests.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A directory on a real disk (not tmpfs) for test files, removed on drop.
pub fn disk_dir() -> tempfile::TempDir {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-scratch");
    std::fs::create_dir_all(&base).expect("create target/test-scratch");
    tempfile::tempdir_in(base).expect("tempdir")
}

/// Deterministic bytes.
pub fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

/// The Python interpreter for interop tests: `TURBOIO_PYTHON`, set by `cargo xtask test` to
/// the venv it creates. `None` means "skip" unless `TURBOIO_REQUIRE_PYTHON=1`, in which case a
/// missing interpreter is a failure.
pub fn python() -> Option<PathBuf> {
    match std::env::var_os("TURBOIO_PYTHON") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            assert!(
                std::env::var_os("TURBOIO_REQUIRE_PYTHON").is_none(),
                "TURBOIO_REQUIRE_PYTHON is set but TURBOIO_PYTHON is not"
            );
            eprintln!("skipped: TURBOIO_PYTHON is not set (cargo xtask test sets it up)");
            None
        }
    }
}

/// Runs a Python snippet with arguments; panics with its stderr on failure. Returns stdout.
pub fn run_python(python: &Path, code: &str, args: &[&str]) -> String {
    let out = Command::new(python).arg("-c").arg(code).args(args).output().expect("run python");
    assert!(out.status.success(), "python failed: {}\n{}", String::from_utf8_lossy(&out.stderr), code);
    String::from_utf8_lossy(&out.stdout).into_owned()
}
