//! The raw cuFile ABI: the declarations bindgen generates from `cufile.h` ([`cufile`]:
//! `#[repr(C)]` layouts with compile-time layout checks, the constants, and `CuFileLib`, the
//! table of every function this crate calls, resolved from a library opened at run time), and
//! finding and loading `libcufile`.
//!
//! [`cufile`] is written by `cargo xtask bindgen` from the `cufile.h` torch's CUDA wheels install
//! (`nvidia/cu13/include`, beside the `cuda.h` it includes) and never edited by hand; `cargo
//! xtask bindgen --check` (a test of `cargo xtask test`) regenerates it where the header and
//! libclang are present and fails on any difference. Building this crate needs neither.
//!
//! Loaded here rather than through cudarc's `cufile` module: cudarc looks for `libcufile.so`,
//! `.so.12`, `.so.11`, ... but not `libcufile.so.0`, the only name the PyPI wheels
//! (`nvidia-cufile-cu12`, `nvidia-cufile`) and CUDA runtime images ship, and it panics when the
//! library is missing.

// Generated and checked byte for byte: rustfmt leaves it as bindgen wrote it.
#[rustfmt::skip]
pub mod cufile;

pub use cufile::{
    CUfileDrvProps, CUfileError, CUfileHandle_t as CUfileHandle, CuFileLib, CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE,
    CU_FILE_CUDA_DRIVER_ERROR, CU_FILE_DRIVER_ALREADY_OPEN, CU_FILE_HANDLE_TYPE_OPAQUE_FD, CU_FILE_P2P_SUPPORTED,
    CU_FILE_SUCCESS,
};
/// `CUfileDescr_t`: what `cuFileHandleRegister` registers.
pub type CUfileDescr = cufile::CUfileDescr_t;
/// The `handle` union of [`CUfileDescr`].
pub type CUfileDescrHandle = cufile::CUfileDescr_t__bindgen_ty_1;
/// The `nvfs` part of [`CUfileDrvProps`].
pub type CUfileNvfsProps = cufile::CUfileDrvProps__bindgen_ty_1;
/// `off_t` of `cuFileRead` / `cuFileWrite`.
pub use cufile::off_t;

use std::ffi::c_int;
use std::path::{Path, PathBuf};

/// The names of the `CUfileOpError` codes that mean the same in every cuFile release (5001 to
/// 5038). The CUDA 13 header renumbered codes from 5039 on, so those are shown by number.
pub fn error_name(code: c_int) -> Option<&'static str> {
    Some(match code {
        5001 => "CU_FILE_DRIVER_NOT_INITIALIZED (nvidia-fs driver is not loaded)",
        5002 => "CU_FILE_DRIVER_INVALID_PROPS",
        5003 => "CU_FILE_DRIVER_UNSUPPORTED_LIMIT",
        5004 => "CU_FILE_DRIVER_VERSION_MISMATCH",
        5005 => "CU_FILE_DRIVER_VERSION_READ_ERROR",
        5006 => "CU_FILE_DRIVER_CLOSING",
        5007 => "CU_FILE_PLATFORM_NOT_SUPPORTED",
        5008 => "CU_FILE_IO_NOT_SUPPORTED (GPUDirect Storage not supported on this file or file system)",
        5009 => "CU_FILE_DEVICE_NOT_SUPPORTED",
        5010 => "CU_FILE_NVFS_DRIVER_ERROR",
        5011 => "CU_FILE_CUDA_DRIVER_ERROR",
        5012 => "CU_FILE_CUDA_POINTER_INVALID",
        5013 => "CU_FILE_CUDA_MEMORY_TYPE_INVALID",
        5014 => "CU_FILE_CUDA_POINTER_RANGE_ERROR",
        5015 => "CU_FILE_CUDA_CONTEXT_MISMATCH",
        5016 => "CU_FILE_INVALID_MAPPING_SIZE",
        5017 => "CU_FILE_INVALID_MAPPING_RANGE",
        5018 => "CU_FILE_INVALID_FILE_TYPE",
        5019 => "CU_FILE_INVALID_FILE_OPEN_FLAG",
        5020 => "CU_FILE_DIO_NOT_SET",
        5022 => "CU_FILE_INVALID_VALUE",
        5023 => "CU_FILE_MEMORY_ALREADY_REGISTERED",
        5024 => "CU_FILE_MEMORY_NOT_REGISTERED",
        5025 => "CU_FILE_PERMISSION_DENIED",
        5026 => "CU_FILE_DRIVER_ALREADY_OPEN",
        5027 => "CU_FILE_HANDLE_NOT_REGISTERED",
        5028 => "CU_FILE_HANDLE_ALREADY_REGISTERED",
        5029 => "CU_FILE_DEVICE_NOT_FOUND",
        5030 => "CU_FILE_INTERNAL_ERROR",
        5031 => "CU_FILE_GETNEWFD_FAILED",
        5033 => "CU_FILE_NVFS_SETUP_ERROR",
        5034 => "CU_FILE_IO_DISABLED (GPUDirect Storage disabled by config for this file)",
        5035 => "CU_FILE_BATCH_SUBMIT_FAILED",
        5036 => "CU_FILE_GPU_MEMORY_PINNING_FAILED",
        5037 => "CU_FILE_BATCH_FULL",
        5038 => "CU_FILE_ASYNC_NOT_SUPPORTED",
        _ => return None,
    })
}

/// `libcufile`, loaded, with every symbol [`REQUIRED_SYMBOLS`] names resolved (checked when
/// loading, so `lib`'s methods for them never meet a missing symbol); the library stays loaded
/// while this lives.
pub struct Api {
    /// The library's path or name, for messages.
    pub origin: String,
    /// The generated function table. `cuFileSetParameterBool` (cuFile 1.14 and later) may be
    /// missing: see [`Api::has_set_parameter_bool`].
    pub lib: CuFileLib,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api").field("origin", &self.origin).finish_non_exhaustive()
    }
}

/// The symbols [`Api`] requires, in the order they are resolved.
pub const REQUIRED_SYMBOLS: [&str; 11] = [
    "cuFileGetVersion",
    "cuFileDriverOpen",
    "cuFileDriverClose_v2",
    "cuFileDriverGetProperties",
    "cuFileUseCount",
    "cuFileHandleRegister",
    "cuFileHandleDeregister",
    "cuFileBufRegister",
    "cuFileBufDeregister",
    "cuFileRead",
    "cuFileWrite",
];

impl Api {
    /// Loads `libcufile` from `path` and resolves every symbol.
    ///
    /// Loading runs only the library's initialisers; nothing here opens the driver (which,
    /// without a GPU, can hang: see the crate docs).
    pub fn load(path: &Path) -> Result<Api, String> {
        // Some cuFile wheels need shm_open from librt without declaring it (kvikio#1000); on
        // glibc 2.34 and later librt is an empty stub, so this is harmless where not needed.
        // SAFETY: librt's initialisers have no preconditions; the handle is kept open forever
        // (RTLD_GLOBAL makes its symbols available to libcufile).
        unsafe {
            if let Ok(rt) = libloading::os::unix::Library::open(
                Some("librt.so.1"),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            ) {
                std::mem::forget(rt);
            }
        }
        // SAFETY: libcufile's initialisers have no preconditions (it dlopens libcuda only when the
        // driver is opened); every symbol is resolved with the signature bindgen read from cufile.h.
        let lib = unsafe { CuFileLib::new(path) }.map_err(|e| format!("{}: {e}", path.display()))?;
        let resolved: [(&str, Option<&libloading::Error>); 11] = [
            ("cuFileGetVersion", lib.cuFileGetVersion.as_ref().err()),
            ("cuFileDriverOpen", lib.cuFileDriverOpen.as_ref().err()),
            ("cuFileDriverClose_v2", lib.cuFileDriverClose_v2.as_ref().err()),
            ("cuFileDriverGetProperties", lib.cuFileDriverGetProperties.as_ref().err()),
            ("cuFileUseCount", lib.cuFileUseCount.as_ref().err()),
            ("cuFileHandleRegister", lib.cuFileHandleRegister.as_ref().err()),
            ("cuFileHandleDeregister", lib.cuFileHandleDeregister.as_ref().err()),
            ("cuFileBufRegister", lib.cuFileBufRegister.as_ref().err()),
            ("cuFileBufDeregister", lib.cuFileBufDeregister.as_ref().err()),
            ("cuFileRead", lib.cuFileRead.as_ref().err()),
            ("cuFileWrite", lib.cuFileWrite.as_ref().err()),
        ];
        debug_assert!(resolved.iter().map(|r| r.0).eq(REQUIRED_SYMBOLS));
        if let Some((name, Some(e))) = resolved.into_iter().find(|r| r.1.is_some()) {
            return Err(format!("{}: missing symbol {name}: {e}", path.display()));
        }
        Ok(Api { origin: path.display().to_string(), lib })
    }

    /// Whether `cuFileSetParameterBool` (cuFile 1.14 and later) is there.
    pub fn has_set_parameter_bool(&self) -> bool {
        self.lib.cuFileSetParameterBool.is_ok()
    }

    /// Finds and loads `libcufile`: `TURBOIO_CUFILE_LIB` (a path) if set, else `libcufile.so.0`
    /// and `libcufile.so` on the loader's path, else in each of
    /// [`turboio_device::cuda_library_dirs`] (where the Python package lists the `lib`
    /// directories of installed `nvidia` wheels, `nvidia/cufile/lib` and `nvidia/cu13/lib`).
    pub fn find() -> Result<Api, String> {
        let mut tried = Vec::new();
        if let Some(p) = std::env::var_os("TURBOIO_CUFILE_LIB") {
            return Api::load(Path::new(&p)).map_err(|e| format!("TURBOIO_CUFILE_LIB: {e}"));
        }
        let mut candidates: Vec<PathBuf> = vec!["libcufile.so.0".into(), "libcufile.so".into()];
        for dir in turboio_device::cuda_library_dirs() {
            candidates.push(dir.join("libcufile.so.0"));
            candidates.push(dir.join("libcufile.so"));
        }
        for c in &candidates {
            // Bare names go to the loader's search; paths must exist.
            if c.components().count() > 1 && !c.exists() {
                continue;
            }
            match Api::load(c) {
                Ok(api) => return Ok(api),
                Err(e) => tried.push(e),
            }
        }
        let dirs: Vec<String> = turboio_device::cuda_library_dirs().iter().map(|d| d.display().to_string()).collect();
        Err(format!(
            "libcufile.so.0 was not found on the loader's path or in {} (install the nvidia-cufile-cu12 or \
             nvidia-cufile wheel, or the CUDA toolkit; or set TURBOIO_CUFILE_LIB){}",
            dirs.join(", "),
            if tried.is_empty() { String::new() } else { format!("; tried: {}", tried.join("; ")) }
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    /// The x86-64 / aarch64 layouts (the generated file checks them against the header at
    /// compile time; this pins the ABI io-gds was written for).
    #[test]
    fn layouts_match_the_lp64_abi() {
        assert_eq!((size_of::<CUfileError>(), align_of::<CUfileError>()), (8, 4));
        assert_eq!(size_of::<CUfileDescr>(), 24);
        assert_eq!(offset_of!(CUfileDescr, handle), 8);
        assert_eq!(offset_of!(CUfileDescr, fs_ops), 16);
        assert_eq!(size_of::<CUfileDrvProps>(), 56);
        assert_eq!(offset_of!(CUfileDrvProps, fflags), 32);
        assert_eq!(offset_of!(CUfileDrvProps, max_batch_io_timeout_msecs), 52);
    }

    #[test]
    fn error_names_cover_the_stable_codes_only() {
        assert!(error_name(5027).unwrap().contains("HANDLE_NOT_REGISTERED"));
        assert!(error_name(5039).is_none(), "renumbered in CUDA 13: shown by number");
        assert!(error_name(0).is_none());
    }

    #[test]
    fn a_missing_library_is_an_error_not_a_panic() {
        let err = Api::load(Path::new("/nonexistent/libcufile.so.0")).unwrap_err();
        assert!(err.contains("/nonexistent/libcufile.so.0"), "{err}");
    }
}
