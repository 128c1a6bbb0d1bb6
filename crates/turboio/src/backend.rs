//! Picking the storage backend, by Cargo feature, by option and by path scheme, and the
//! decrypting layer.

use crate::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
pub use turboio_storage::ReadInfo;
use turboio_storage::{IoOptions, ReadRequest, Storage, StorageFile};

/// An open file as the loader sees it: the backend's file, and, for an encrypted file, the
/// layer that shifts offsets past the cipher header and decrypts every chunk on the thread that
/// read it, while the bytes are still in cache.
#[derive(Debug)]
pub(crate) struct Opened {
    file: Box<dyn StorageFile>,
    #[cfg(feature = "cipher")]
    pub(crate) crypt: Option<crate::encryption::Crypt>,
}

impl Opened {
    /// Opens `path` through `storage`, else the backend of its scheme, else the local file
    /// system ([`write_storage`] picks the same one for saves). `unconfirmed`: the caller
    /// calls [`confirm`](Self::confirm) before it hands out anything it read
    /// ([`Storage::open_unconfirmed`]).
    pub(crate) fn open(
        storage: Option<&Arc<dyn Storage>>,
        path: &Path,
        cancel: Option<&AtomicBool>,
        unconfirmed: bool,
    ) -> Result<Opened> {
        let storage = write_storage(storage, path)?;
        let file = open_file(storage.as_ref(), path, cancel, unconfirmed).map_err(|e| Error::storage(path, e))?;
        Ok(Opened {
            file,
            #[cfg(feature = "cipher")]
            crypt: None,
        })
    }

    /// Confirms that what was read is the file's current version (see
    /// [`StorageFile::confirm`]); [`Error::is_changed`] when it is not.
    pub(crate) fn confirm(&self) -> Result<()> {
        self.file.confirm().map_err(|e| Error::storage(self.path(), e))
    }

    /// The backend's file (raw bytes, cipher header included).
    pub(crate) fn raw(&self) -> &dyn StorageFile {
        self.file.as_ref()
    }

    pub(crate) fn path(&self) -> &Path {
        self.raw().path()
    }

    /// Bytes before the plain file starts (the cipher header, if any).
    pub(crate) fn offset(&self) -> u64 {
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

    /// The AES key and IV of an encrypted file, for a device that decrypts in its own memory.
    pub(crate) fn key_material(&self) -> Option<(&[u8], [u8; 16])> {
        #[cfg(feature = "cipher")]
        if let Some(c) = &self.crypt {
            return Some((c.key.expose(), c.iv.0));
        }
        None
    }

    /// Reads ranges at plain offsets without decrypting them (the device decrypts).
    pub(crate) fn read_undecrypted(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<ReadInfo> {
        let offset = self.offset();
        let shifted = requests.into_iter().map(|r| ReadRequest { offset: r.offset + offset, dst: r.dst }).collect();
        self.read_raw(shifted, opts)
    }

    fn read_raw(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<ReadInfo> {
        self.file.read_ranges_reported(requests, opts).map_err(|e| Error::storage(self.path(), e))
    }
}

/// The storage a save to `path` writes through: the one given, the one of the path's scheme,
/// or the local file system.
pub(crate) fn write_storage(storage: Option<&Arc<dyn Storage>>, path: &Path) -> Result<Arc<dyn Storage>> {
    if let Some(s) = storage {
        return Ok(s.clone());
    }
    if let Some(s) = scheme_storage(path)? {
        return Ok(s);
    }
    #[cfg(feature = "posix")]
    {
        Ok(local_storage())
    }
    #[cfg(not(feature = "posix"))]
    {
        Err(Error::Storage(turboio_storage::StorageError::NotCompiledIn { backend: "posix", feature: "posix" }))
    }
}

/// The local file system's backend, shared by the process.
#[cfg(feature = "posix")]
fn local_storage() -> Arc<dyn Storage> {
    local_posix().clone()
}

/// The same, with the local-only operations of its own type (in-place writes).
#[cfg(feature = "posix")]
pub(crate) fn local_posix() -> &'static Arc<turboio_io_posix::PosixStorage> {
    static POSIX: std::sync::OnceLock<Arc<turboio_io_posix::PosixStorage>> = std::sync::OnceLock::new();
    POSIX.get_or_init(|| Arc::new(turboio_io_posix::PosixStorage::new()))
}

/// A path scheme served by a backend of its own.
struct Scheme {
    /// The prefix, e.g. `sfcs://`.
    prefix: &'static str,
    /// The Cargo feature that compiles the backend in.
    feature: &'static str,
    /// The backend, when compiled in.
    storage: Option<MakeStorage>,
}

/// Builds a scheme's backend, or says why its configuration (the environment) is wrong.
type MakeStorage = fn() -> std::result::Result<Arc<dyn Storage>, String>;

/// Every scheme turboio knows, compiled in or not (so that a missing feature is a clear error,
/// not a local file named `sfcs:`).
const SCHEMES: &[Scheme] = &[
    Scheme {
        prefix: "sfcs://",
        feature: "sfcs",
        #[cfg(feature = "sfcs")]
        storage: Some(sfcs_storage),
        #[cfg(not(feature = "sfcs"))]
        storage: None,
    },
    object_scheme("s3://"),
    object_scheme("gs://"),
    object_scheme("az://"),
    object_scheme("abfs://"),
    object_scheme("abfss://"),
    object_scheme("http://"),
    object_scheme("https://"),
];

/// A URL scheme of the object-storage backend (`object` feature).
const fn object_scheme(prefix: &'static str) -> Scheme {
    Scheme {
        prefix,
        feature: "object",
        #[cfg(feature = "object")]
        storage: Some(object_storage),
        #[cfg(not(feature = "object"))]
        storage: None,
    }
}

/// The process-wide object-storage backend (configured from the environment; stores built on
/// first use of each bucket), behind the node cache of `TURBOIO_CACHE_DIR` when it is set.
#[cfg(feature = "object")]
fn object_storage() -> std::result::Result<Arc<dyn Storage>, String> {
    static OBJECT: std::sync::OnceLock<Arc<dyn Storage>> = std::sync::OnceLock::new();
    let object = OBJECT.get_or_init(|| Arc::new(turboio_io_object::ObjectStorage::global())).clone();
    with_env_cache(object)
}

/// `storage` behind the node cache the environment names (`TURBOIO_CACHE_DIR`,
/// `TURBOIO_CACHE_MAX_SIZE`), or as it is when none is named. Read at each call, so a process
/// that sets the variables before a load gets the cache.
#[cfg(feature = "cache")]
pub fn with_env_cache(storage: Arc<dyn Storage>) -> std::result::Result<Arc<dyn Storage>, String> {
    Ok(match turboio_cache::NodeCache::from_env()? {
        Some(cache) => Arc::new(turboio_cache::CacheStorage::new(storage, cache)),
        None => storage,
    })
}

/// The process-wide SFCS backend (configured from the environment at each operation; the
/// library is loaded on first use).
#[cfg(feature = "sfcs")]
fn sfcs_storage() -> std::result::Result<Arc<dyn Storage>, String> {
    static SFCS: std::sync::OnceLock<Arc<dyn Storage>> = std::sync::OnceLock::new();
    Ok(SFCS.get_or_init(|| Arc::new(turboio_io_sfcs::SfcsStorage::from_env())).clone())
}

/// The backend of `path`'s scheme, `None` for a local path.
pub(crate) fn scheme_storage(path: &Path) -> Result<Option<Arc<dyn Storage>>> {
    let Some(text) = path.to_str() else { return Ok(None) };
    match SCHEMES.iter().find(|s| text.starts_with(s.prefix)) {
        None => Ok(None),
        Some(Scheme { storage: Some(make), .. }) => {
            make().map(Some).map_err(|message| Error::Unsupported { path: path.to_owned(), message })
        }
        Some(s) => Err(Error::Unsupported {
            path: path.to_owned(),
            message: format!("{} paths need turboio built with the `{}` feature", s.prefix, s.feature),
        }),
    }
}

/// For a path with a scheme of its own (`s3://...`, `sfcs://...`): the backend to reach it
/// through (the one given, else the scheme's); `None` for a local path.
pub(crate) fn remote_storage(storage: Option<&Arc<dyn Storage>>, path: &Path) -> Result<Option<Arc<dyn Storage>>> {
    Ok(scheme_storage(path)?.map(|s| storage.cloned().unwrap_or(s)))
}

/// Where a model's files are: the local file system (read and listed with `std::fs`, as
/// directories, symbolic links and the writer's temporaries need), or a backend of its own
/// (an object store's key prefix, SFCS), reached through the `Storage` contract.
pub(crate) enum Place {
    Local,
    Remote(Arc<dyn Storage>),
}

impl Place {
    pub(crate) fn of(storage: Option<&Arc<dyn Storage>>, path: &Path) -> Result<Place> {
        Ok(match remote_storage(storage, path)? {
            Some(s) => Place::Remote(s),
            None => Place::Local,
        })
    }

    /// A small file's bytes (an index), `None` if it does not exist.
    pub(crate) fn read(&self, path: &Path) -> Result<Option<Vec<u8>>> {
        Ok(self.read_held(path, false)?.map(|(bytes, _)| bytes))
    }

    /// [`read`](Self::read); `unconfirmed`: a remote file may be read before its version is
    /// confirmed ([`Storage::open_unconfirmed`]), and is returned with its bytes, for the caller
    /// to [`confirm`](StorageFile::confirm) before it uses them.
    pub(crate) fn read_held(&self, path: &Path, unconfirmed: bool) -> Result<Option<(Vec<u8>, Unconfirmed)>> {
        match self {
            Place::Local => match std::fs::read(path) {
                Ok(b) => Ok(Some((b, None))),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => {
                    Err(Error::Unsupported { path: path.to_owned(), message: format!("cannot read the file: {e}") })
                }
            },
            Place::Remote(s) => {
                let f = match open_file(s.as_ref(), path, None, unconfirmed) {
                    Ok(f) => f,
                    Err(e) if e.is_not_found() => return Ok(None),
                    Err(e) => return Err(Error::storage(path, e)),
                };
                let len = usize::try_from(f.len()).unwrap_or(usize::MAX);
                if len > MAX_INDEX_BYTES {
                    return Err(Error::Unsupported {
                        path: path.to_owned(),
                        message: format!("{len} bytes, more than an index file can be"),
                    });
                }
                let mut buf = vec![0u8; len];
                f.read_exact_at(0, &mut buf).map_err(|e| Error::storage(path, e))?;
                Ok(Some((buf, Some(f))))
            }
        }
    }

    /// The files directly in `dir`.
    pub(crate) fn list(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        match self {
            Place::Local => Ok(std::fs::read_dir(dir)
                .map_err(|e| Error::Unsupported {
                    path: dir.to_owned(),
                    message: format!("cannot list the directory: {e}"),
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .collect()),
            Place::Remote(s) => s.list(dir).map_err(|e| Error::storage(dir, e)),
        }
    }

    /// True if a file exists at `path`.
    pub(crate) fn exists(&self, path: &Path) -> Result<bool> {
        match self {
            Place::Local => Ok(path.exists()),
            Place::Remote(s) => match s.open(path) {
                Ok(_) => Ok(true),
                Err(e) if e.is_not_found() => Ok(false),
                Err(e) => Err(Error::storage(path, e)),
            },
        }
    }

    /// Removes a file; true if it is gone. Local files leave their name at once and are
    /// unlinked in the background (a large shard's blocks take a while to free).
    pub(crate) fn remove(&self, path: &Path) -> bool {
        match self {
            #[cfg(feature = "posix")]
            Place::Local => turboio_io_posix::remove_in_background(path).is_ok(),
            #[cfg(not(feature = "posix"))]
            Place::Local => std::fs::remove_file(path).is_ok(),
            Place::Remote(s) => s.remove_file(path).is_ok(),
        }
    }
}

/// Opens `path` through `storage`: [`Storage::open_unconfirmed`] if `unconfirmed` (the caller
/// confirms what it read), else a plain, cancellable open.
fn open_file(
    storage: &dyn Storage,
    path: &Path,
    cancel: Option<&AtomicBool>,
    unconfirmed: bool,
) -> turboio_storage::Result<Box<dyn StorageFile>> {
    if unconfirmed {
        storage.open_unconfirmed(path, cancel)
    } else {
        storage.open_cancellable(path, cancel)
    }
}

/// A file read before its version was confirmed ([`Storage::open_unconfirmed`]), to
/// [`confirm`](StorageFile::confirm) before what was read from it is used; `None`: nothing to
/// confirm.
pub(crate) type Unconfirmed = Option<Box<dyn StorageFile>>;

/// The largest index JSON read from a remote store (an index of a million tensors is ~100 MB).
const MAX_INDEX_BYTES: usize = 256 << 20;

/// The storage backend that serves `path` when no backend is given explicitly, and the path
/// to hand it: the scheme's backend (`sfcs://...` with the `sfcs` feature) or the local file
/// system. A scheme whose backend is not compiled in is an error naming the feature.
pub fn storage_for(path: &Path) -> Result<(Arc<dyn Storage>, PathBuf)> {
    Ok((write_storage(None, path)?, path.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sfcs_paths_need_the_sfcs_feature() {
        let p = Path::new("sfcs://models/m.safetensors");
        match scheme_storage(p) {
            #[cfg(feature = "sfcs")]
            Ok(Some(s)) => assert_eq!(s.name(), "sfcs"),
            #[cfg(not(feature = "sfcs"))]
            Err(e) => assert_eq!(
                e.to_string(),
                "sfcs://models/m.safetensors: sfcs:// paths need turboio built with the `sfcs` feature"
            ),
            other => panic!("{other:?}"),
        }
        assert!(scheme_storage(Path::new("/models/sfcs://x")).unwrap().is_none());
        assert!(scheme_storage(Path::new("models/m.safetensors")).unwrap().is_none());
    }
}
