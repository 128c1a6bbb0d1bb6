use std::io;
use std::path::{Path, PathBuf};

/// The error of every storage operation. Backends fold their own detail into it, keeping
/// "not found", "permission denied" and "not supported" distinct so callers (and the Python
/// layer) can map them to the right exception.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StorageError {
    /// The file (or its directory) does not exist.
    #[error("{}: no such file or directory", crate::shown(path))]
    NotFound {
        /// The path asked for.
        path: PathBuf,
    },
    /// The OS refused access.
    #[error("{}: permission denied", crate::shown(path))]
    PermissionDenied {
        /// The path asked for.
        path: PathBuf,
    },
    /// A read asked for bytes past the end of the file (the file is shorter than expected, e.g.
    /// truncated while being read).
    #[error(
        "{}: file is too short: wanted bytes {offset}..{end} but the file has {file_len} bytes",
        crate::shown(path)
    )]
    ShortFile {
        /// The file.
        path: PathBuf,
        /// Start of the range asked for.
        offset: u64,
        /// End of the range asked for.
        end: u64,
        /// The file's length.
        file_len: u64,
    },
    /// The backend cannot do this (a destination kind, an option, an operation).
    #[error("{backend}: not supported: {what}")]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// What was asked.
        what: String,
    },
    /// The backend was left out of this build.
    #[error("the `{backend}` storage backend is not compiled in (enable the `{feature}` feature of turboio)")]
    NotCompiledIn {
        /// The backend.
        backend: &'static str,
        /// The Cargo feature that enables it.
        feature: &'static str,
    },
    /// The backend cannot serve this path as set up: its native library is missing, or its
    /// configuration is incomplete or invalid (the message says which and how to fix it).
    #[error("{}: {message}", crate::shown(path))]
    Setup {
        /// The path asked for.
        path: PathBuf,
        /// What is missing or wrong.
        message: String,
    },
    /// The bytes read are not the file's current version: it was replaced while (or before)
    /// they were read, and the backend found out only afterwards ([`crate::StorageFile::confirm`] of
    /// a file opened with [`crate::Storage::open_unconfirmed`]: a cached copy whose currency was
    /// being checked while it was read). Reading it again gives the current version.
    #[error("{}: changed while it was read: {message}", crate::shown(path))]
    Changed {
        /// The file.
        path: PathBuf,
        /// What was read and what is current.
        message: String,
    },
    /// The operation was cancelled by the caller.
    #[error("cancelled")]
    Cancelled,
    /// The data source of a write failed (e.g. a tensor whose bytes are short).
    #[error("{}: {message}", crate::shown(path))]
    Source {
        /// The file being written.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// Any other I/O failure, with the operation that failed.
    #[error("{}: {op} failed: {source}", crate::shown(path))]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done ("open", "read", "write", "fsync", "rename", ...).
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

impl StorageError {
    /// Wraps an OS error, turning ENOENT and EACCES/EPERM into their own variants.
    pub fn io(path: &Path, op: &'static str, source: io::Error) -> Self {
        match source.kind() {
            io::ErrorKind::NotFound => StorageError::NotFound { path: path.to_owned() },
            io::ErrorKind::PermissionDenied => StorageError::PermissionDenied { path: path.to_owned() },
            _ => StorageError::Io { path: path.to_owned(), op, source },
        }
    }

    /// True for [`StorageError::NotFound`].
    pub fn is_not_found(&self) -> bool {
        matches!(self, StorageError::NotFound { .. })
    }

    /// True for [`StorageError::Changed`]: reading the file again gives its current version.
    pub fn is_changed(&self) -> bool {
        matches!(self, StorageError::Changed { .. })
    }
}
