//! The real CUDA dialect of the decryption and conversion kernels: compiled to PTX with NVRTC, which needs no
//! GPU. NVRTC comes from `TURBOIO_NVRTC_LIB` (CI points it at the venv's
//! `nvidia/cu13/lib/libnvrtc.so.13`); without it the test prints that it was skipped.
#![cfg(feature = "cuda")]

use std::path::PathBuf;

fn nvrtc_lib() -> Option<PathBuf> {
    match std::env::var_os("TURBOIO_NVRTC_LIB") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            eprintln!("skipped: TURBOIO_NVRTC_LIB is not set (the NVRTC compile of the kernel did not run)");
            None
        }
    }
}

#[test]
fn kernel_compiles_to_ptx_with_nvrtc() {
    let Some(lib) = nvrtc_lib() else { return };
    assert!(lib.exists(), "TURBOIO_NVRTC_LIB={} does not exist", lib.display());
    for arch in ["compute_80", "compute_90"] {
        let ptx = turboio_device::cuda::compile_kernel_ptx(Some(arch)).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(ptx.contains(".visible .entry turboio_aes_ctr_xor("), "{arch}: no kernel entry in:\n{ptx}");
        assert!(ptx.contains(&format!(".target sm_{}", &arch["compute_".len()..])), "{arch}: wrong target");
        // The T-table and S-box live in shared memory, the round keys are read from global memory.
        assert!(ptx.contains(".shared"), "{arch}: tables in shared memory");
    }
    // The dtype conversion kernel too (doubles, unions and byte loads in the CUDA dialect).
    for arch in ["compute_80", "compute_90"] {
        let ptx = turboio_device::cuda::compile_cast_kernel_ptx(Some(arch)).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(ptx.contains(".visible .entry turboio_cast("), "{arch}: no kernel entry in:\n{ptx}");
    }
    // A compile error is reported with NVRTC's log, not a panic.
    let err = turboio_device::cuda::compile_kernel_ptx(Some("compute_1")).unwrap_err();
    assert!(err.contains("NVRTC"), "{err}");
}
