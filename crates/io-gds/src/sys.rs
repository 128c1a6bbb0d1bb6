//! The raw cuFile ABI: `#[repr(C)]` layouts of `cufile.h` (checked against the real header by
//! `tests/layout.rs`), the symbols this crate uses, and loading `libcufile` at run time.
//!
//! Hand-written rather than generated: `cufile.h` includes `cuda.h`, which the cuFile wheels do
//! not ship, and we need about a dozen functions and four structs. Written here rather than
//! taken from cudarc's `cufile` module: cudarc looks for `libcufile.so`, `.so.12`, `.so.11`, ...
//! but not `libcufile.so.0`, the only name the PyPI wheels (`nvidia-cufile-cu12`,
//! `nvidia-cufile`) and CUDA runtime images ship, and it panics when the library is missing.

use std::ffi::{c_int, c_long, c_uint, c_void};
use std::path::{Path, PathBuf};

/// `CUfileError_t`: returned by value from most calls. `err` is a `CUfileOpError` (0 on
/// success, 5000 + n otherwise); when it is `CU_FILE_CUDA_DRIVER_ERROR`, `cu_err` holds the
/// `CUresult`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CUfileError {
    /// `CUfileOpError`.
    pub err: c_int,
    /// `CUresult`.
    pub cu_err: c_int,
}

/// The `handle` union of `CUfileDescr_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union CUfileDescrHandle {
    /// A Linux file descriptor (`CU_FILE_HANDLE_TYPE_OPAQUE_FD`).
    pub fd: c_int,
    /// A Windows handle (unused).
    pub handle: *mut c_void,
}

/// `CUfileDescr_t`: what `cuFileHandleRegister` registers.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUfileDescr {
    /// `enum CUfileFileHandleType`.
    pub type_: c_int,
    /// The descriptor.
    pub handle: CUfileDescrHandle,
    /// `const CUfileFSOps_t *`; NULL for ordinary file systems.
    pub fs_ops: *const c_void,
}

/// The `nvfs` part of [`CUfileDrvProps`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CUfileNvfsProps {
    /// nvidia-fs major version (0 when the module is not loaded).
    pub major_version: c_uint,
    /// nvidia-fs minor version.
    pub minor_version: c_uint,
    /// Poll-mode threshold.
    pub poll_thresh_size: usize,
    /// Largest direct I/O (KiB).
    pub max_direct_io_size: usize,
    /// `CUfileDriverStatusFlags` bits: supported file systems and devices.
    pub dstatusflags: c_uint,
    /// `CUfileDriverControlFlags` bits.
    pub dcontrolflags: c_uint,
}

/// `CUfileDrvProps_t` (`cuFileDriverGetProperties`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CUfileDrvProps {
    /// The nvidia-fs part.
    pub nvfs: CUfileNvfsProps,
    /// `CUfileFeatureFlags` bits.
    pub fflags: c_uint,
    /// Device cache size (KiB).
    pub max_device_cache_size: c_uint,
    /// Per-buffer cache size (KiB).
    pub per_buffer_cache_size: c_uint,
    /// Pinned device memory (KiB).
    pub max_device_pinned_mem_size: c_uint,
    /// Batch size.
    pub max_batch_io_size: c_uint,
    /// Batch timeout.
    pub max_batch_io_timeout_msecs: c_uint,
}

/// `CUfileHandle_t`.
pub type CUfileHandle = *mut c_void;

/// `CU_FILE_HANDLE_TYPE_OPAQUE_FD`.
pub const CU_FILE_HANDLE_TYPE_OPAQUE_FD: c_int = 1;
/// Base of `CUfileOpError`.
pub const CUFILEOP_BASE_ERR: c_int = 5000;
/// `CU_FILE_SUCCESS`.
pub const CU_FILE_SUCCESS: c_int = 0;
/// `CU_FILE_CUDA_DRIVER_ERROR`.
pub const CU_FILE_CUDA_DRIVER_ERROR: c_int = 5011;
/// `CU_FILE_DRIVER_ALREADY_OPEN`.
pub const CU_FILE_DRIVER_ALREADY_OPEN: c_int = 5026;
/// Bit of [`CUfileDrvProps::fflags`]: PCI P2PDMA (GDS without nvidia-fs).
pub const CU_FILE_P2P_SUPPORTED: c_uint = 4;
/// `CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE` of `CUFileBoolConfigParameter_t`.
pub const CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE: c_int = 1;

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

/// `cuFileGetVersion`.
pub type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> CUfileError;
/// `cuFileDriverOpen` / `cuFileDriverClose_v2`.
pub type DriverFn = unsafe extern "C" fn() -> CUfileError;
/// `cuFileDriverGetProperties`.
pub type GetPropertiesFn = unsafe extern "C" fn(*mut CUfileDrvProps) -> CUfileError;
/// `cuFileUseCount`.
pub type UseCountFn = unsafe extern "C" fn() -> c_long;
/// `cuFileHandleRegister`.
pub type HandleRegisterFn = unsafe extern "C" fn(*mut CUfileHandle, *mut CUfileDescr) -> CUfileError;
/// `cuFileHandleDeregister`.
pub type HandleDeregisterFn = unsafe extern "C" fn(CUfileHandle);
/// `cuFileBufRegister`.
pub type BufRegisterFn = unsafe extern "C" fn(*const c_void, usize, c_int) -> CUfileError;
/// `cuFileBufDeregister`.
pub type BufDeregisterFn = unsafe extern "C" fn(*const c_void) -> CUfileError;
/// `cuFileRead`.
pub type ReadFn = unsafe extern "C" fn(CUfileHandle, *mut c_void, usize, libc::off_t, libc::off_t) -> isize;
/// `cuFileWrite`.
pub type WriteFn = unsafe extern "C" fn(CUfileHandle, *const c_void, usize, libc::off_t, libc::off_t) -> isize;
/// `cuFileSetParameterBool`.
pub type SetParameterBoolFn = unsafe extern "C" fn(c_int, bool) -> CUfileError;

/// Every symbol this crate calls, resolved once; the library stays loaded while this lives.
pub struct Api {
    /// The library's path or name, for messages.
    pub origin: String,
    /// `cuFileGetVersion`.
    pub get_version: GetVersionFn,
    /// `cuFileDriverOpen`.
    pub driver_open: DriverFn,
    /// `cuFileDriverClose_v2` (what `cuFileDriverClose` means in the header).
    pub driver_close: DriverFn,
    /// `cuFileDriverGetProperties`.
    pub get_properties: GetPropertiesFn,
    /// `cuFileUseCount`.
    pub use_count: UseCountFn,
    /// `cuFileHandleRegister`.
    pub handle_register: HandleRegisterFn,
    /// `cuFileHandleDeregister`.
    pub handle_deregister: HandleDeregisterFn,
    /// `cuFileBufRegister`.
    pub buf_register: BufRegisterFn,
    /// `cuFileBufDeregister`.
    pub buf_deregister: BufDeregisterFn,
    /// `cuFileRead`.
    pub read: ReadFn,
    /// `cuFileWrite`.
    pub write: WriteFn,
    /// `cuFileSetParameterBool` (cuFile 1.14 and later; `None` before).
    pub set_parameter_bool: Option<SetParameterBoolFn>,
    _lib: libloading::Library,
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
        // driver is opened).
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| format!("{}: {e}", path.display()))?;
        macro_rules! sym {
            ($name:literal, $ty:ty) => {{
                // SAFETY: the symbol's C signature in cufile.h is `$ty`; the pointer is used only
                // while `lib` (stored in the returned Api) stays loaded.
                let s: libloading::Symbol<'_, $ty> = unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{}: missing symbol {}: {e}", path.display(), $name))?;
                *s
            }};
        }
        let get_version = sym!("cuFileGetVersion", GetVersionFn);
        let driver_open = sym!("cuFileDriverOpen", DriverFn);
        let driver_close = sym!("cuFileDriverClose_v2", DriverFn);
        let get_properties = sym!("cuFileDriverGetProperties", GetPropertiesFn);
        let use_count = sym!("cuFileUseCount", UseCountFn);
        let handle_register = sym!("cuFileHandleRegister", HandleRegisterFn);
        let handle_deregister = sym!("cuFileHandleDeregister", HandleDeregisterFn);
        let buf_register = sym!("cuFileBufRegister", BufRegisterFn);
        let buf_deregister = sym!("cuFileBufDeregister", BufDeregisterFn);
        let read = sym!("cuFileRead", ReadFn);
        let write = sym!("cuFileWrite", WriteFn);
        // SAFETY: as in sym!, for an optional symbol.
        let set_parameter_bool = unsafe { lib.get::<SetParameterBoolFn>(b"cuFileSetParameterBool\0") }.ok().map(|s| *s);
        Ok(Api {
            origin: path.display().to_string(),
            get_version,
            driver_open,
            driver_close,
            get_properties,
            use_count,
            handle_register,
            handle_deregister,
            buf_register,
            buf_deregister,
            read,
            write,
            set_parameter_bool,
            _lib: lib,
        })
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

    /// The x86-64 / aarch64 layouts of cufile.h (also checked against the real header, with a
    /// C compiler, by tests/layout.rs).
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
