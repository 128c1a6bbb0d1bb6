//! turboio's SFCS backend: [`SfcsStorage`] implements the [`Storage`] contract over the
//! vendor's CloudFS SDK, `libcloudfs.so`, for veMLP's distributed cache file system (the
//! `sfcs://` paths of veTurboIO).
//!
//! # The library is loaded at run time
//!
//! libcloudfs is a closed vendor binary. It is opened with `dlopen` (libloading) from
//! `LIBCFS_PATH` (default `/usr/lib/libcloudfs.so`) the first time an SFCS path is used, and
//! only then; nothing is linked at build time. If it is missing, every SFCS operation fails
//! with one error naming `LIBCFS_PATH`. turboio never downloads it (veTurboIO fetches it over
//! HTTP at import time, without a checksum). The FFI is in the `ffi` module, in three layers:
//! the raw table of the 19 functions used, checked calls that capture `cfsGetLastError()`, and
//! RAII handles.
//!
//! # Reads
//!
//! [`Storage::open`] connects once (one `cfsFS` per open file, shared by all its readers) and
//! takes the size from `cfsGetPathInfo`. Each reader thread opens its own `cfsFile`
//! (`cfsOpenFile(O_RDONLY)`, as veTurboIO does) and keeps it across chunks, seeking only when
//! the next chunk is not where the last one ended. Bulk reads use the contract's default
//! chunking (8 MiB chunks spread over the worker threads) with the decrypting hook fused in.
//! `cfsRead` is called until the range is full: short reads are continued, `EINTR` ("data
//! temporarily unavailable", cfs.h) is retried, and the end of the file before the expected
//! length is [`StorageError::ShortFile`]. Every other failure carries the C function and the
//! text of `cfsGetLastError()`; `ENOENT` and `EACCES` become `NotFound` / `PermissionDenied`.
//!
//! # Saves are atomic
//!
//! [`Storage::write_file`] never writes the target in place (veTurboIO deletes it first and
//! then writes, so a failure loses the old file):
//!
//! 1. a temporary directory `.{name}.turboio-tmp.{pid}.{random}` is made next to the target
//!    (or in `SFCS_CONCAT_DIR`, veTurboIO's setting, a path or `{group: path}` JSON);
//! 2. files smaller than two blocks (`cfsGetDefaultBlockSize`) are written in one stream;
//!    larger ones in one part per worker thread, each part a whole number of blocks (HDFS
//!    concat wants that of all but the last part), written in parallel over the one
//!    connection, each by its own `cfsFile`;
//! 3. `cfsConcat` joins the parts into the first one, `cfsRename2` moves it over the target,
//!    and the temporary directory is deleted.
//!
//! Any failure before the rename (the source, a write, the concat, the rename, a cancel)
//! deletes the temporary directory and leaves the old file as it was.
//!
//! # Configuration
//!
//! libcloudfs reads a Hadoop-style XML file named by `LIBCLOUDFS_CONF`. It is built exactly as
//! veTurboIO builds it (the `config` module: cache policies from `SFCS_METAINFO_PATH`, access
//! keys from `CREDENTIAL_PATH`, the RDMA network from `MLP_RDMA_*`, `SFCS_*` overrides, the
//! same validation errors and the same properties, byte for byte the same XML), once per
//! "group" (the longest cache-policy key that prefixes the path, else its first component),
//! with veTurboIO's path mapping (`mount_path` → `cache_prefix`). Unlike veTurboIO, which
//! writes `<cwd>/<group>.xml` with the default umask, the file goes into a private directory
//! (mode 0700, under `$XDG_RUNTIME_DIR` or the temporary directory, never the working
//! directory), is written with mode 0600 and renamed into place atomically, and is deleted
//! when the last user of the group is done.
//!
//! Without static credentials (`SFCS_ACCESS_KEY` + `SFCS_SECRET_KEY` +
//! `SFCS_NAMENODE_ENDPOINT_ADDRESS`, or the credential files), the datapipe's `sfcs-sts` task
//! gives temporary ones, and a thread rewrites the XML halfway to each expiry, as veTurboIO
//! does; unlike veTurboIO's daemon thread it stops (and the file goes) with the last user.
//! Connections made before a rewrite are replaced by new ones for later operations.
//!
//! `LIBCLOUDFS_CONF` is one process-wide variable, and changing the environment while other
//! threads may read it is undefined behaviour: it is set once per process (at the first
//! connection, or never if it already holds [`conf_path`]) to a symbolic link in the private
//! directory, which is pointed at the connecting group's XML under a lock held for each
//! `cfsBuilderConnect`. Secrets (secret keys, STS tokens) are zeroized and never appear in
//! errors or `Debug` output.
#![deny(missing_docs)]

pub mod config;
mod ffi;
mod session;
mod write;

pub use config::{CachePolicy, ConfigError, Properties, SfcsConfiguration, Sources, Vars};
pub use ffi::sys::SYMBOLS;
pub use session::{conf_path, refresh_at, CONF_ENV};

use ffi::{CfsError, Fs, Library};
use nix::errno::Errno;
use session::{Session, SessionError};
use std::collections::HashMap;
use std::ffi::CString;
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, Weak};
use turboio_storage::{IoOptions, RangeReader, Storage, StorageError, StorageFile, WriteSource};

/// Where libcloudfs is looked for when `LIBCFS_PATH` is not set (veTurboIO's default).
pub const DEFAULT_LIBCFS_PATH: &str = "/usr/lib/libcloudfs.so";

/// The SFCS path of an `sfcs://` path, veTurboIO's way: `sfcs://a/b` is `/a/b` (only `sfcs:/`
/// is removed). `None` for other paths (and for `sfcs://` alone, which names nothing).
pub fn sfcs_path(path: &Path) -> Option<String> {
    let s = path.to_str()?;
    let rest = s.strip_prefix("sfcs://")?;
    if rest.is_empty() {
        return None;
    }
    Some(format!("/{}", rest.trim_start_matches('/')))
}

/// True for `sfcs://...` paths.
pub fn is_sfcs_path(path: &Path) -> bool {
    path.to_str().is_some_and(|s| s.starts_with("sfcs://"))
}

fn setup(path: &Path, message: impl Into<String>) -> StorageError {
    StorageError::Setup { path: path.to_owned(), message: message.into() }
}

/// A libcloudfs failure as a storage error of `path`.
pub(crate) fn cfs_err(path: &Path, op: &'static str, e: CfsError) -> StorageError {
    match Errno::from_raw(e.errno) {
        Errno::ENOENT => StorageError::NotFound { path: path.to_owned() },
        Errno::EACCES | Errno::EPERM => StorageError::PermissionDenied { path: path.to_owned() },
        _ => StorageError::Io { path: path.to_owned(), op, source: e.into_io() },
    }
}

/// The SFCS storage backend.
///
/// Cheap to make: nothing is loaded, read or contacted until a file is opened or written.
/// Clones share the library and the per-group sessions.
#[derive(Clone)]
pub struct SfcsStorage {
    inner: Arc<Inner>,
}

struct Inner {
    lib_path: PathBuf,
    lib: Mutex<Option<Library>>,
    vars: Vars,
    sessions: Mutex<HashMap<String, Weak<Session>>>,
}

impl fmt::Debug for SfcsStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SfcsStorage").field("library", &self.inner.lib_path).finish_non_exhaustive()
    }
}

impl Default for SfcsStorage {
    fn default() -> Self {
        SfcsStorage::from_env()
    }
}

impl SfcsStorage {
    /// The backend configured by the process environment (`LIBCFS_PATH` now; the `SFCS_*`,
    /// `MLP_*`, `CREDENTIAL_PATH` and `DATAPIPE_SOCKET_PATH` variables at each operation).
    pub fn from_env() -> SfcsStorage {
        SfcsStorage::with_vars(config::process_vars())
    }

    /// The backend with variables read through `vars` instead of the process environment
    /// (`LIBCLOUDFS_CONF` is still set in the process environment: libcloudfs reads it there).
    pub fn with_vars(vars: Vars) -> SfcsStorage {
        let lib_path = PathBuf::from(vars("LIBCFS_PATH").unwrap_or_else(|| DEFAULT_LIBCFS_PATH.into()));
        SfcsStorage {
            inner: Arc::new(Inner { lib_path, lib: Mutex::new(None), vars, sessions: Mutex::new(HashMap::new()) }),
        }
    }

    /// Where libcloudfs is loaded from.
    pub fn library_path(&self) -> &Path {
        &self.inner.lib_path
    }

    /// Loads libcloudfs now (it is otherwise loaded by the first operation); the error names
    /// `LIBCFS_PATH`.
    pub fn check_library(&self) -> Result<(), String> {
        self.library().map(drop)
    }

    fn library(&self) -> Result<Library, String> {
        let mut slot = self.inner.lib.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = slot.as_ref() {
            return Ok(l.clone());
        }
        let lib = Library::open(&self.inner.lib_path).map_err(|e| {
            format!(
                "cannot load the SFCS SDK (libcloudfs) from LIBCFS_PATH={}: {e}; install it there or set \
                 LIBCFS_PATH to its path (turboio never downloads it)",
                self.inner.lib_path.display()
            )
        })?;
        *slot = Some(lib.clone());
        Ok(lib)
    }

    /// The SFCS path behind `path`: `sfcs://...` paths, or absolute paths given to this backend
    /// directly (veTurboIO's `VETURBOIO_USE_SFCS_SDK=1`).
    fn resolve(path: &Path) -> Result<String, StorageError> {
        let p = match sfcs_path(path) {
            Some(p) => p,
            None if is_sfcs_path(path) => return Err(setup(path, "the SFCS path names no file")),
            None => match path.to_str() {
                Some(s) if s.starts_with('/') => s.to_string(),
                _ => return Err(setup(path, "not an SFCS path (expected sfcs://... or an absolute path)")),
            },
        };
        if p.contains('\0') || p.split('/').any(|c| c == "..") {
            return Err(setup(path, "an SFCS path may not contain `..` or NUL"));
        }
        Ok(p)
    }

    /// The session of `path`'s group and the mapped SFCS path.
    fn session(&self, path: &Path, cancel: Option<&AtomicBool>) -> Result<Resolved, StorageError> {
        let raw = Self::resolve(path)?;
        let lib = self.library().map_err(|m| setup(path, m))?;
        let sources =
            Sources::read(self.inner.vars.clone()).map_err(|e| setup(path, format!("SFCS configuration: {e}")))?;
        let group = sources.group_of(&raw);
        let mapped = sources.map_path(&raw, &group);
        let fingerprint = fingerprint(&sources, &group);
        let mut sessions = self.inner.sessions.lock().unwrap_or_else(|p| p.into_inner());
        sessions.retain(|_, w| w.strong_count() > 0);
        let live = sessions.get(&group).and_then(Weak::upgrade).filter(|s| s.fingerprint == fingerprint);
        let session = match live {
            Some(s) => s,
            None => {
                let s = Session::start(lib, &sources, &group, fingerprint, cancel).map_err(|e| match e {
                    SessionError::Cancelled => StorageError::Cancelled,
                    other => setup(path, other.to_string()),
                })?;
                sessions.insert(group.clone(), Arc::downgrade(&s));
                s
            }
        };
        drop(sessions);
        let fs = session.connection().map_err(|e| setup(path, e.to_string()))?;
        let c_path = CString::new(mapped.clone()).map_err(|_| setup(path, "the SFCS path contains NUL"))?;
        Ok(Resolved { session, fs, mapped, c_path, concat_dir: sources.concat_dir(&group) })
    }

    /// The XML file of `path`'s group while some operation uses it (for tests and
    /// diagnostics): opens nothing, but connects like an operation would.
    pub fn config_file_of(&self, path: &Path) -> Result<PathBuf, StorageError> {
        Ok(self.session(path, None)?.session.xml_path().to_path_buf())
    }

    /// Opens `path`, giving up early (with [`StorageError::Cancelled`]) once `cancel` is set
    /// while credentials are fetched from the datapipe.
    pub fn open_sfcs(&self, path: &Path, cancel: Option<&AtomicBool>) -> Result<SfcsFile, StorageError> {
        let r = self.session(path, cancel)?;
        let info = r.fs.path_info(&r.c_path).map_err(|e| cfs_err(path, "stat", e))?;
        if info.is_dir {
            return Err(StorageError::Io { path: path.to_owned(), op: "open", source: io::Error::from(Errno::EISDIR) });
        }
        Ok(SfcsFile {
            path: path.to_owned(),
            mapped: r.mapped,
            c_path: r.c_path,
            len: info.size,
            fs: r.fs,
            session: r.session,
        })
    }
}

/// What an operation needs: its group's session, a connection and the mapped path.
pub(crate) struct Resolved {
    session: Arc<Session>,
    pub(crate) fs: Arc<Fs>,
    pub(crate) mapped: String,
    pub(crate) c_path: CString,
    pub(crate) concat_dir: Option<String>,
}

/// What a session depends on: the group's configuration (secrets hashed, never stored) and
/// where credentials come from.
fn fingerprint(sources: &Sources, group: &str) -> u64 {
    let c = sources.configuration(group);
    let mut h = DefaultHasher::new();
    group.hash(&mut h);
    format!("{c:?}").hash(&mut h);
    c.secret_key.expose().hash(&mut h);
    sources.datapipe_needless().hash(&mut h);
    sources.datapipe().socket_path.hash(&mut h);
    h.finish()
}

impl Storage for SfcsStorage {
    fn name(&self) -> &'static str {
        "sfcs"
    }

    fn open(&self, path: &Path) -> Result<Box<dyn StorageFile>, StorageError> {
        Ok(Box::new(self.open_sfcs(path, None)?))
    }

    fn open_cancellable(&self, path: &Path, cancel: Option<&AtomicBool>) -> Result<Box<dyn StorageFile>, StorageError> {
        Ok(Box::new(self.open_sfcs(path, cancel)?))
    }

    fn write_file(&self, path: &Path, source: &dyn WriteSource, opts: &IoOptions<'_>) -> Result<(), StorageError> {
        let r = self.session(path, opts.cancel)?;
        write::write_file(path, &r, source, opts)
    }
}

/// An open SFCS file.
pub struct SfcsFile {
    path: PathBuf,
    mapped: String,
    c_path: CString,
    len: u64,
    fs: Arc<Fs>,
    session: Arc<Session>,
}

impl fmt::Debug for SfcsFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SfcsFile")
            .field("path", &self.path)
            .field("sfcs_path", &self.mapped)
            .field("len", &self.len)
            .finish()
    }
}

impl SfcsFile {
    /// The path on the file system (after veTurboIO's path mapping).
    pub fn sfcs_path(&self) -> &str {
        &self.mapped
    }

    /// The configuration group the file belongs to (a cache-policy key, or the first
    /// component of the path).
    pub fn group(&self) -> &str {
        &self.session.group
    }

    /// The XML file libcloudfs was pointed at for this file's group (it exists as long as the
    /// group is in use).
    pub fn config_file(&self) -> &Path {
        self.session.xml_path()
    }
}

impl StorageFile for SfcsFile {
    fn path(&self) -> &Path {
        &self.path
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn reader(&self) -> Result<Box<dyn RangeReader + '_>, StorageError> {
        Ok(Box::new(Reader { file: self, handle: None, pos: 0 }))
    }
}

/// Largest single `cfsRead`.
const MAX_READ: usize = 1 << 30;
/// Consecutive `EINTR` answers tolerated before a read fails.
const MAX_EINTR: u32 = 1000;

/// One thread's reader: its own `cfsFile`, opened on first use.
struct Reader<'a> {
    file: &'a SfcsFile,
    handle: Option<ffi::safe::File<'a>>,
    pos: u64,
}

impl RangeReader for Reader<'_> {
    fn read_exact_at(&mut self, offset: u64, dst: &mut [u8]) -> Result<(), StorageError> {
        let f = self.file;
        let end = offset.checked_add(dst.len() as u64).filter(|&e| e <= f.len).ok_or(StorageError::ShortFile {
            path: f.path.clone(),
            offset,
            end: offset.saturating_add(dst.len() as u64),
            file_len: f.len,
        })?;
        if dst.is_empty() {
            return Ok(());
        }
        let result = self.read_at(offset, dst);
        match &result {
            Ok(()) => self.pos = end,
            // The position is unknown after a failure: reopen next time.
            Err(_) => self.handle = None,
        }
        result
    }
}

impl Reader<'_> {
    fn read_at(&mut self, offset: u64, dst: &mut [u8]) -> Result<(), StorageError> {
        let f = self.file;
        let path = &f.path;
        if self.handle.is_none() {
            self.handle = Some(f.fs.open_read(&f.c_path).map_err(|e| cfs_err(path, "open", e))?);
            self.pos = 0;
        }
        let Some(h) = self.handle.as_mut() else { unreachable!("opened above") };
        if self.pos != offset {
            h.seek(offset).map_err(|e| cfs_err(path, "seek", e))?;
        }
        let mut got = 0usize;
        let mut eintr = 0u32;
        while got < dst.len() {
            let want = (dst.len() - got).min(MAX_READ);
            match h.read(&mut dst[got..got + want]) {
                Ok(0) => {
                    return Err(StorageError::ShortFile {
                        path: path.clone(),
                        offset,
                        end: offset + dst.len() as u64,
                        file_len: offset + got as u64,
                    })
                }
                Ok(n) => {
                    got += n;
                    eintr = 0;
                }
                Err(e) if e.errno == Errno::EINTR as i32 && eintr < MAX_EINTR => eintr += 1,
                Err(e) => return Err(cfs_err(path, "read", e)),
            }
        }
        Ok(())
    }
}
