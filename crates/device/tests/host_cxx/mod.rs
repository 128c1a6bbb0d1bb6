//! Builds a kernel source of `src/cuda/` as a host shared library with the system C++ compiler
//! (`$CXX`, else `g++`) and the CUDA shim of `tests/aes_host/shim.h`, for the kernel tests.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Compiles `src/cuda/<cu>` (which must equal `source`, the text the device compiles) with
/// `tests/aes_host/<harness>`, passing the source's path as `-D<define>="..."`. `None` when no
/// compiler can run (a failure instead with `TURBOIO_REQUIRE_CXX=1`, as CI sets).
pub fn build(cu: &str, source: &str, harness: &str, define: &str) -> Option<libloading::Library> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let stem = cu.trim_end_matches(".cu");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{stem}-host-{}.so", std::process::id()));
    let cu = here.join("src/cuda").join(cu);
    assert_eq!(std::fs::read_to_string(&cu).unwrap(), source, "the test compiles the source the device uses");
    let status = Command::new(&cxx)
        .args(["-O2", "-std=c++17", "-shared", "-fPIC", "-fno-strict-aliasing", "-Wall", "-Werror"])
        .arg(format!("-D{define}=\"{}\"", cu.display()))
        .arg("-I")
        .arg(here.join("tests/aes_host"))
        .arg(here.join("tests/aes_host").join(harness))
        .arg("-o")
        .arg(&out)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{cxx} failed to compile the kernel source for the host ({s})"),
        Err(e) => {
            assert!(
                std::env::var_os("TURBOIO_REQUIRE_CXX").is_none(),
                "TURBOIO_REQUIRE_CXX is set but {cxx} cannot run: {e}"
            );
            eprintln!("skipped: no C++ compiler ({cxx}: {e}); the kernel's host comparison did not run");
            return None;
        }
    }
    // SAFETY: a library we just built from our own sources; its only initialisers are the C++
    // runtime's.
    let lib = unsafe { libloading::Library::new(&out) }.expect("load the host kernel");
    let _ = std::fs::remove_file(&out);
    Some(lib)
}
