//! Checked cuFile calls: every return value examined, every failure a [`CuFileError`]. All of
//! this crate's calls into libcufile go through here.

use crate::sys::{self, off_t, Api, CUfileDescr, CUfileDescrHandle, CUfileDrvProps, CUfileError, CUfileHandle};
use nix::errno::Errno;
use std::ffi::{c_int, c_void};
use std::fmt;

/// A failed cuFile call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CuFileError {
    /// A `CUfileOpError` (or, for `CU_FILE_CUDA_DRIVER_ERROR`, a `CUresult` in `cu_err`).
    Op {
        /// The function.
        call: &'static str,
        /// The `CUfileOpError`.
        code: c_int,
        /// The `CUresult` for CUDA driver errors.
        cu_err: c_int,
    },
    /// A file system error (`-1` and `errno`).
    Os {
        /// The function.
        call: &'static str,
        /// `errno`.
        errno: i32,
    },
}

impl fmt::Display for CuFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            CuFileError::Op { call, code, cu_err } => match sys::error_name(code) {
                Some(name) if code == sys::CU_FILE_CUDA_DRIVER_ERROR as c_int => {
                    write!(f, "{call} failed: {name} (CUresult {cu_err})")
                }
                Some(name) => write!(f, "{call} failed: {name} ({code})"),
                None => write!(f, "{call} failed: cuFile error {code}"),
            },
            CuFileError::Os { call, errno } => {
                write!(f, "{call} failed: {}", std::io::Error::from_raw_os_error(errno))
            }
        }
    }
}

impl std::error::Error for CuFileError {}

fn check(call: &'static str, e: CUfileError) -> Result<(), CuFileError> {
    if e.err == sys::CU_FILE_SUCCESS {
        Ok(())
    } else {
        // Both are C enums (`CUfileOpError`, `CUresult`): small values that fit an int.
        Err(CuFileError::Op { call, code: e.err as c_int, cu_err: e.cu_err as c_int })
    }
}

/// `cuFileGetVersion`: 1000 * major + 10 * minor (e.g. 1140 for 1.14). Needs no GPU.
pub fn version(api: &Api) -> Result<i32, CuFileError> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer; the call needs no driver state.
    check("cuFileGetVersion", unsafe { api.lib.cuFileGetVersion(&mut v) })?;
    Ok(v)
}

/// `cuFileSetParameterBool(ALLOW_COMPAT_MODE, on)` where the library has it (before the driver
/// is opened). Returns false if the library is too old to set it.
pub fn allow_compat_mode(api: &Api, on: bool) -> Result<bool, CuFileError> {
    if !api.has_set_parameter_bool() {
        return Ok(false);
    }
    // SAFETY: a plain value call (the symbol was checked just above); allowed before the driver
    // is opened.
    let e = unsafe { api.lib.cuFileSetParameterBool(sys::CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE, on) };
    check("cuFileSetParameterBool", e)?;
    Ok(true)
}

/// `cuFileDriverOpen`. **Never call this unless libcuda is loaded and a CUDA device exists**:
/// without a GPU some releases hang in it. "Already open" counts as success.
pub fn driver_open(api: &Api) -> Result<(), CuFileError> {
    // SAFETY: no arguments; the caller checked that a GPU is present.
    let e = unsafe { api.lib.cuFileDriverOpen() };
    if e.err == sys::CU_FILE_DRIVER_ALREADY_OPEN {
        return Ok(());
    }
    check("cuFileDriverOpen", e)
}

/// `cuFileDriverGetProperties` (after [`driver_open`]).
pub fn properties(api: &Api) -> Result<CUfileDrvProps, CuFileError> {
    let mut p = CUfileDrvProps::default();
    // SAFETY: `p` is a valid out-pointer of the header's layout.
    check("cuFileDriverGetProperties", unsafe { api.lib.cuFileDriverGetProperties(&mut p) })?;
    Ok(p)
}

/// `cuFileHandleRegister` of an `O_DIRECT` file descriptor.
pub fn handle_register(api: &Api, fd: c_int) -> Result<CUfileHandle, CuFileError> {
    let mut descr = CUfileDescr {
        type_: sys::CU_FILE_HANDLE_TYPE_OPAQUE_FD,
        handle: CUfileDescrHandle { handle: std::ptr::null_mut() },
        fs_ops: std::ptr::null(),
    };
    descr.handle.fd = fd;
    let mut h: CUfileHandle = std::ptr::null_mut();
    // SAFETY: both pointers are valid for the call; the descriptor is read, not kept.
    check("cuFileHandleRegister", unsafe { api.lib.cuFileHandleRegister(&mut h, &mut descr) })?;
    Ok(h)
}

/// `cuFileHandleDeregister`.
///
/// # Safety
/// `h` came from [`handle_register`] and is deregistered once, after its last I/O.
pub unsafe fn handle_deregister(api: &Api, h: CUfileHandle) {
    // SAFETY: guaranteed by the caller.
    unsafe { api.lib.cuFileHandleDeregister(h) }
}

/// `cuFileBufRegister` of device memory.
///
/// # Safety
/// `ptr .. ptr + len` is device memory of the current context that stays allocated until
/// [`buf_deregister`].
pub unsafe fn buf_register(api: &Api, ptr: u64, len: usize) -> Result<(), CuFileError> {
    // SAFETY: guaranteed by the caller.
    check("cuFileBufRegister", unsafe { api.lib.cuFileBufRegister(ptr as *const c_void, len, 0) })
}

/// `cuFileBufDeregister`.
///
/// # Safety
/// `ptr` was registered with [`buf_register`] and no I/O on it is running.
pub unsafe fn buf_deregister(api: &Api, ptr: u64) {
    // SAFETY: guaranteed by the caller.
    let _ = unsafe { api.lib.cuFileBufDeregister(ptr as *const c_void) };
}

fn io_result(call: &'static str, n: isize) -> Result<usize, CuFileError> {
    if n >= 0 {
        Ok(n as usize)
    } else if n == -1 {
        Err(CuFileError::Os {
            call,
            errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(Errno::EIO as i32),
        })
    } else {
        Err(CuFileError::Op { call, code: (-n) as c_int, cu_err: 0 })
    }
}

/// `cuFileRead`: up to `size` bytes at `file_offset` into device memory at `base + buf_offset`;
/// returns the bytes read (fewer at the end of the file).
///
/// # Safety
/// `h` is a live handle; `base + buf_offset .. + size` is device memory of the current context
/// that nothing else uses during the call.
pub unsafe fn read(
    api: &Api,
    h: CUfileHandle,
    base: u64,
    size: usize,
    file_offset: u64,
    buf_offset: u64,
) -> Result<usize, CuFileError> {
    // SAFETY: guaranteed by the caller.
    let n = unsafe { api.lib.cuFileRead(h, base as *mut c_void, size, file_offset as off_t, buf_offset as off_t) };
    io_result("cuFileRead", n)
}

/// `cuFileWrite`: up to `size` bytes from device memory at `base + buf_offset` to
/// `file_offset`; returns the bytes written.
///
/// # Safety
/// As for [`read`], with the device memory only read.
pub unsafe fn write(
    api: &Api,
    h: CUfileHandle,
    base: u64,
    size: usize,
    file_offset: u64,
    buf_offset: u64,
) -> Result<usize, CuFileError> {
    // SAFETY: guaranteed by the caller.
    let n = unsafe { api.lib.cuFileWrite(h, base as *const c_void, size, file_offset as off_t, buf_offset as off_t) };
    io_result("cuFileWrite", n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_read_well() {
        let e = CuFileError::Op { call: "cuFileHandleRegister", code: 5027, cu_err: 0 };
        assert_eq!(e.to_string(), "cuFileHandleRegister failed: CU_FILE_HANDLE_NOT_REGISTERED (5027)");
        let e = CuFileError::Op { call: "cuFileRead", code: 5044, cu_err: 0 };
        assert_eq!(e.to_string(), "cuFileRead failed: cuFile error 5044");
        let e = CuFileError::Op { call: "cuFileRead", code: 5011, cu_err: 700 };
        assert!(e.to_string().contains("CUresult 700"));
        assert_eq!(io_result("cuFileRead", 7), Ok(7));
        assert_eq!(io_result("cuFileRead", -5019), Err(CuFileError::Op { call: "cuFileRead", code: 5019, cu_err: 0 }));
        assert!(matches!(io_result("cuFileRead", -1), Err(CuFileError::Os { .. })));
    }
}
