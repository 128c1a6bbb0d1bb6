//! Where the optional NVIDIA libraries are looked for.

use std::path::PathBuf;

/// Directories searched for the NVIDIA libraries that pip wheels and toolkits ship outside the
/// loader's default path (`libnvrtc`, `libcufile`), in order:
///
/// 1. `TURBOIO_CUDA_LIB_DIRS` (colon-separated). The Python package sets it at import to the
///    `lib` directories of the installed `nvidia` wheels (`nvidia/cu13/lib`, `nvidia/cufile/lib`,
///    `nvidia/cuda_nvrtc/lib`, ...), so a pip-installed torch's copies are found.
/// 2. `$CUDA_HOME/lib64`, `$CUDA_PATH/lib64`, `/usr/local/cuda/lib64`.
///
/// Libraries on the loader's default path (`LD_LIBRARY_PATH`, ld.so.cache) are found before any
/// of these.
pub fn cuda_library_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("TURBOIO_CUDA_LIB_DIRS") {
        dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            dirs.push(PathBuf::from(home).join("lib64"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.clone()));
    dirs
}
