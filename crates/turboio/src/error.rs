use std::path::PathBuf;
use turboio_device::DeviceError;
use turboio_format::FormatError;
use turboio_storage::StorageError;

/// Everything a load or save can fail with. Every message names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The file is not a valid safetensors file (or the tensors given to a save are inconsistent).
    #[error("{}: invalid safetensors file: {source}{}", turboio_storage::shown(path), hint.as_deref().map(|h| format!("; {h}")).unwrap_or_default())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: FormatError,
        /// For a file read without a key that looks encrypted (or may be): why, and how to pass
        /// a key.
        hint: Option<Box<str>>,
    },
    /// Reading or writing failed (not found, permission, short file, I/O error, ...).
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The device failed (allocation, copy, mapping).
    #[error("{}: {source}", turboio_storage::shown(path))]
    Device {
        /// The file being loaded or saved.
        path: PathBuf,
        /// What failed.
        #[source]
        source: DeviceError,
    },
    /// An option that cannot be honoured for this file or build.
    #[error("{}: {message}", turboio_storage::shown(path))]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// No key could be found or made for an encrypted file (the message lists every source
    /// tried and why each failed).
    #[error("{}: {message}", turboio_storage::shown(path))]
    Key {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// An encrypted file decrypted to neither a valid safetensors file nor a torch file: almost
    /// always a wrong key or IV. Nothing was written or returned.
    #[error("{}: the decrypted file is neither a valid safetensors file ({source}) nor a torch file: wrong key or IV? ({key_source})", turboio_storage::shown(path))]
    Decrypted {
        /// The file.
        path: PathBuf,
        /// What the format check found.
        #[source]
        source: FormatError,
        /// Where the key came from.
        key_source: String,
    },
    /// A name or pattern of [`LoadOptions::tensors`](crate::LoadOptions::tensors) matches no
    /// tensor of the file (or of the model); nothing was read.
    #[error("{}: no tensor matches `{pattern}`{}", turboio_storage::shown(path), closest(close))]
    NoMatch {
        /// The file, or the model's index or first shard.
        path: PathBuf,
        /// The name or pattern.
        pattern: String,
        /// The closest names, best first (at most five).
        close: Vec<String>,
    },
    /// The load does not fit in the memory available (or the budget given); it failed before
    /// allocating anything. The message says what was needed, what is available and what would
    /// fit.
    #[error(
        "{}: {message}{}",
        turboio_storage::shown(path),
        crate::memory::describe_remedies(remedies, crate::memory::Api::Rust)
    )]
    WontFit {
        /// The file, or the model's index or first shard.
        path: PathBuf,
        /// Needed vs available ("this load needs 4.30 GB of host memory but ...").
        message: String,
        /// What would fit, for the message to name in the caller's own API
        /// ([`Error::describe_for`]).
        remedies: Vec<crate::memory::Remedy>,
    },
    /// The operation was cancelled.
    #[error("{}: cancelled", turboio_storage::shown(path))]
    Cancelled {
        /// The file.
        path: PathBuf,
    },
}

impl Error {
    /// The message as a caller of `api` reads it: a memory plan's refusal names the remedies
    /// that API offers (the CLI's flags, Python's keyword arguments) and no other; every other
    /// error reads as its `Display`.
    pub fn describe_for(&self, api: crate::memory::Api) -> String {
        match self {
            Error::WontFit { path, message, remedies } => format!(
                "{}: {message}{}",
                turboio_storage::shown(path),
                crate::memory::describe_remedies(remedies, api)
            ),
            other => other.to_string(),
        }
    }

    pub(crate) fn format(path: &std::path::Path, source: FormatError) -> Self {
        Error::Format { path: path.to_owned(), source, hint: None }
    }

    pub(crate) fn device(path: &std::path::Path, source: DeviceError) -> Self {
        Error::Device { path: path.to_owned(), source }
    }

    pub(crate) fn storage(path: &std::path::Path, source: StorageError) -> Self {
        match source {
            StorageError::Cancelled => Error::Cancelled { path: path.to_owned() },
            other => Error::Storage(other),
        }
    }

    /// True if the file does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::Storage(e) if e.is_not_found())
    }

    /// True if a file was replaced while it was read ([`StorageError::Changed`]): loading it
    /// again gives the current version.
    pub fn is_changed(&self) -> bool {
        matches!(self, Error::Storage(e) if e.is_changed())
    }
}

/// Result of turboio operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// "; closest: `a`, `b`" for a non-empty list.
fn closest(names: &[String]) -> String {
    if names.is_empty() {
        return String::new();
    }
    let list: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    format!("; closest: {}", list.join(", "))
}
