//! Picking the storage backend, by Cargo feature and by option, and the decrypting layer.

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
pub(crate) enum Backend {
    #[cfg(feature = "posix")]
    Posix(turboio_io_posix::PosixFile),
    Other(Box<dyn StorageFile>),
}

/// An open file as the loader sees it: the backend's file, and, for an encrypted file, the
/// layer that shifts offsets past the cipher header and decrypts every chunk on the thread that
/// read it, while the bytes are still in cache.
#[derive(Debug)]
pub(crate) struct Opened {
    backend: Backend,
    #[cfg(feature = "cipher")]
    pub(crate) crypt: Option<crate::crypt::Crypt>,
}

impl Opened {
    pub(crate) fn open(storage: Option<&Arc<dyn Storage>>, path: &Path) -> Result<Opened> {
        let backend = if let Some(s) = storage {
            Backend::Other(s.open(path)?)
        } else {
            #[cfg(feature = "posix")]
            {
                Backend::Posix(default_posix().open_posix(path)?)
            }
            #[cfg(not(feature = "posix"))]
            {
                let _ = path;
                return Err(Error::Storage(turboio_storage::StorageError::NotCompiledIn {
                    backend: "posix",
                    feature: "posix",
                }));
            }
        };
        Ok(Opened {
            backend,
            #[cfg(feature = "cipher")]
            crypt: None,
        })
    }

    /// The backend's file (raw bytes, cipher header included).
    pub(crate) fn raw(&self) -> &dyn StorageFile {
        match &self.backend {
            #[cfg(feature = "posix")]
            Backend::Posix(f) => f,
            Backend::Other(f) => f.as_ref(),
        }
    }

    pub(crate) fn path(&self) -> &Path {
        self.raw().path()
    }

    /// Bytes before the plain file starts (the cipher header, if any).
    fn offset(&self) -> u64 {
        #[cfg(feature = "cipher")]
        if let Some(c) = &self.crypt {
            return c.offset;
        }
        0
    }

    /// Length of the plain file.
    pub(crate) fn len(&self) -> u64 {
        self.raw().len().saturating_sub(self.offset())
    }

    /// True if the file is encrypted (so it cannot be mapped).
    pub(crate) fn encrypted(&self) -> bool {
        #[cfg(feature = "cipher")]
        if self.crypt.is_some() {
            return true;
        }
        false
    }

    /// The local file, when the plain bytes can be mapped from it.
    pub(crate) fn local_file(&self) -> Option<&std::fs::File> {
        if self.encrypted() {
            None
        } else {
            self.raw().local_file()
        }
    }

    /// Reads plain bytes at a plain offset.
    pub(crate) fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let path = self.path();
        self.raw().read_exact_at(offset + self.offset(), dst).map_err(|e| Error::storage(path, e))?;
        #[cfg(feature = "cipher")]
        if let Some(c) = &self.crypt {
            c.cipher.apply_at(offset, dst);
        }
        Ok(())
    }

    /// Reads plain ranges in bulk (decrypting each chunk right after it is read).
    pub(crate) fn read(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<ReadInfo> {
        #[cfg(feature = "cipher")]
        if let Some(c) = &self.crypt {
            let user = opts.hook;
            let offset = c.offset;
            let decrypt = move |pos: u64, buf: &mut [u8]| {
                c.cipher.apply_at(pos - offset, buf);
                user.map_or(Ok(()), |h| h(pos - offset, buf))
            };
            let shifted = requests.into_iter().map(|r| ReadRequest { offset: r.offset + offset, dst: r.dst }).collect();
            return self.read_raw(shifted, &IoOptions { hook: Some(&decrypt), ..*opts });
        }
        self.read_raw(requests, opts)
    }

    fn read_raw(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<ReadInfo> {
        let path = self.path().to_owned();
        match &self.backend {
            #[cfg(feature = "posix")]
            Backend::Posix(f) => {
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
            Backend::Other(f) => {
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
