//! Checked calls: every libcloudfs call that can fail is made here, its status checked, and a
//! failure captured with `errno` and the text of `cfsGetLastError()` (read right away, on the
//! same thread, before anything else can overwrite them).

use super::sys::Api;
use std::ffi::CStr;
use std::fmt;
use std::io;

/// A failed libcloudfs call.
#[derive(Debug, Clone)]
pub struct CfsError {
    /// The C function, e.g. `cfsOpenFile`.
    pub call: &'static str,
    /// `errno` after the call (0 when the library did not set it).
    pub errno: i32,
    /// `cfsGetLastError()` after the call.
    pub message: String,
}

impl CfsError {
    /// Captures `errno` and `cfsGetLastError()` after `call` failed.
    pub fn last(api: &Api, call: &'static str) -> CfsError {
        let errno = io::Error::last_os_error().raw_os_error().unwrap_or(0);
        // SAFETY: cfsGetLastError takes no arguments and returns a NUL-terminated string owned
        // by the library (cfs.h: "Caller can only read this message ... No need to free it"),
        // valid until the next call on this thread; it is copied before any other call.
        let text = unsafe {
            let p = (api.get_last_error)();
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        CfsError { call, errno, message: text.trim().to_string() }
    }

    /// A failure detected by turboio rather than reported by the library.
    pub fn ours(call: &'static str, errno: i32, message: impl Into<String>) -> CfsError {
        CfsError { call, errno, message: message.into() }
    }

    /// The matching OS error kind.
    pub fn kind(&self) -> io::ErrorKind {
        if self.errno == 0 {
            io::ErrorKind::Other
        } else {
            io::Error::from_raw_os_error(self.errno).kind()
        }
    }

    /// As an `io::Error` whose text is this error's.
    pub fn into_io(self) -> io::Error {
        io::Error::new(self.kind(), self.to_string())
    }
}

impl fmt::Display for CfsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let msg = if self.message.is_empty() { "(cfsGetLastError() is empty)" } else { &self.message };
        write!(f, "{}: {msg}", self.call)?;
        if self.errno != 0 {
            write!(f, " (errno {}: {})", self.errno, io::Error::from_raw_os_error(self.errno).kind())?;
        }
        Ok(())
    }
}

impl std::error::Error for CfsError {}

/// `Ok(v)` when `ok(v)`, else the captured error of `call`.
pub fn check<T>(api: &Api, call: &'static str, v: T, ok: impl FnOnce(&T) -> bool) -> Result<T, CfsError> {
    if ok(&v) {
        Ok(v)
    } else {
        Err(CfsError::last(api, call))
    }
}
