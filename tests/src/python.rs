//! The Python interpreter for interop tests, shared by the workspace tests and the crates' own
//! test suites (which include this file by path: they cannot depend on this crate).

use std::path::PathBuf;

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
