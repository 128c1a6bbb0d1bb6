//! Picking the storage backend, by Cargo feature and by option.

use crate::{Error, Result};
use std::path::Path;
use std::sync::Arc;
use turboio_storage::{IoOptions, ReadRequest, Storage, StorageFile};

/// What a bulk read did (for reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReadInfo {
    /// `"threads"`, `"io_uring"`, or `"storage"` for a backend that does not say.
    pub method: &'static str,
    /// `O_DIRECT` was used.
    pub direct: bool,
    /// `O_DIRECT` was asked for but the file system refused it; buffered reads were used.
    pub direct_refused: bool,
}

/// An open file on whichever backend.
#[derive(Debug)]
pub(crate) enum Opened {
    #[cfg(feature = "posix")]
    Posix(turboio_io_posix::PosixFile),
    Other(Box<dyn StorageFile>),
}

impl Opened {
    pub(crate) fn open(storage: Option<&Arc<dyn Storage>>, path: &Path) -> Result<Opened> {
        if let Some(s) = storage {
            return Ok(Opened::Other(s.open(path)?));
        }
        #[cfg(feature = "posix")]
        {
            Ok(Opened::Posix(default_posix().open_posix(path)?))
        }
        #[cfg(not(feature = "posix"))]
        {
            let _ = path;
            Err(Error::Storage(turboio_storage::StorageError::NotCompiledIn { backend: "posix", feature: "posix" }))
        }
    }

    pub(crate) fn file(&self) -> &dyn StorageFile {
        match self {
            #[cfg(feature = "posix")]
            Opened::Posix(f) => f,
            Opened::Other(f) => f.as_ref(),
        }
    }

    pub(crate) fn read(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<ReadInfo> {
        let path = self.file().path().to_owned();
        match self {
            #[cfg(feature = "posix")]
            Opened::Posix(f) => {
                let r = f.read_ranges_report(requests, opts).map_err(|e| Error::storage(&path, e))?;
                Ok(ReadInfo {
                    method: match r.method {
                        turboio_io_posix::ReadMethod::IoUring => "io_uring",
                        _ => "threads",
                    },
                    direct: r.direct,
                    direct_refused: r.direct_refused,
                })
            }
            Opened::Other(f) => {
                f.read_ranges(requests, opts).map_err(|e| Error::storage(&path, e))?;
                Ok(ReadInfo { method: "storage", direct: false, direct_refused: false })
            }
        }
    }
}

#[cfg(feature = "posix")]
pub(crate) fn default_posix() -> &'static turboio_io_posix::PosixStorage {
    static POSIX: std::sync::OnceLock<turboio_io_posix::PosixStorage> = std::sync::OnceLock::new();
    POSIX.get_or_init(turboio_io_posix::PosixStorage::new)
}

/// The storage a save writes through.
pub(crate) fn write_storage(storage: Option<&Arc<dyn Storage>>) -> Result<&dyn Storage> {
    if let Some(s) = storage {
        return Ok(s.as_ref());
    }
    #[cfg(feature = "posix")]
    {
        Ok(default_posix())
    }
    #[cfg(not(feature = "posix"))]
    {
        Err(Error::Storage(turboio_storage::StorageError::NotCompiledIn { backend: "posix", feature: "posix" }))
    }
}
