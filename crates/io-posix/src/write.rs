//! Atomic saves: a temporary file in the target's directory, filled in parallel, synced, and
//! renamed over the target.

use crate::plan::{aligned_size, ALIGN};
use crate::sys::{self, AlignedBuf};
use crate::PosixConfig;
use std::collections::hash_map::RandomState;
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use turboio_storage::{run_workers, IoOptions, StorageError, WriteSource};

/// Default bytes per chunk of a save.
const DEFAULT_CHUNK: usize = 8 << 20;
/// Largest chunk (one buffer of this size per worker).
const MAX_CHUNK: usize = 256 << 20;
/// Longest file-name prefix kept in temporary names (names are limited to 255 bytes).
const MAX_NAME_PREFIX: usize = 200;

/// Removes the temporary file unless the save went through.
struct TempGuard {
    path: PathBuf,
    armed: bool,
}

impl Drop for TempGuard {
    fn drop(&mut self) {
        if self.armed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

fn io_err(path: &Path, op: &'static str, source: io::Error) -> StorageError {
    StorageError::io(path, op, source)
}

/// A fresh name `.{file_name}.turboio-tmp.{pid}.{random}` in `dir`.
fn temp_name(dir: &Path, name: &std::ffi::OsStr, attempt: u32) -> PathBuf {
    let mut h = RandomState::new().build_hasher();
    h.write_u32(attempt);
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    let bytes = name.as_bytes();
    let prefix = &bytes[..bytes.len().min(MAX_NAME_PREFIX)];
    let mut tmp = Vec::with_capacity(prefix.len() + 48);
    tmp.push(b'.');
    tmp.extend_from_slice(prefix);
    tmp.extend_from_slice(format!(".turboio-tmp.{}.{:016x}", std::process::id(), h.finish()).as_bytes());
    dir.join(OsString::from_vec(tmp))
}

/// Creates the temporary file with `O_EXCL`, mode 0644 (less the umask).
fn create_temp(target: &Path, dir: &Path, name: &std::ffi::OsStr) -> Result<(PathBuf, File), StorageError> {
    let mut attempt = 0;
    loop {
        let tmp = temp_name(dir, name, attempt);
        match OpenOptions::new().write(true).create_new(true).mode(0o644).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt < 16 => attempt += 1,
            // ENOENT here means the directory is missing: reported for the target path.
            Err(e) => return Err(io_err(target, "create", e)),
        }
    }
}

/// Writes `source` to `path` atomically (see the crate docs for the protocol).
pub(crate) fn write_file(
    cfg: &PosixConfig,
    path: &Path,
    source: &dyn WriteSource,
    opts: &IoOptions<'_>,
) -> Result<(), StorageError> {
    let Some(name) = path.file_name() else {
        return Err(io_err(path, "write", io::Error::new(io::ErrorKind::InvalidInput, "the path names no file")));
    };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match fs::metadata(path) {
        Ok(m) if m.is_dir() => return Err(io_err(path, "write", io::Error::from_raw_os_error(libc::EISDIR))),
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(path, "stat", e)),
    }
    opts.check_cancel()?;
    let (tmp, file) = create_temp(path, dir, name)?;
    let mut guard = TempGuard { path: tmp, armed: true };
    let len = source.len();
    sys::allocate(&file, len).map_err(|e| io_err(path, "allocate", e))?;
    let direct = if cfg.direct_writes && len >= ALIGN {
        sys::reopen_direct(&file, &guard.path, true).map_err(|e| io_err(path, "open (O_DIRECT)", e))?
    } else {
        None
    };
    write_chunks(path, &file, direct.as_ref(), source, opts)?;
    drop(direct);
    if cfg.fsync {
        file.sync_all().map_err(|e| io_err(path, "fsync", e))?;
    }
    drop(file);
    opts.check_cancel()?;
    fs::rename(&guard.path, path).map_err(|e| io_err(path, "rename", e))?;
    guard.armed = false;
    if cfg.fsync {
        // The new name must be durable too. (If this fails the new file is already in place.)
        File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io_err(path, "fsync directory", e))?;
    }
    Ok(())
}

/// Fills and writes the file in chunks, spread over `opts.worker_count` threads, each with its
/// own reusable aligned buffer.
fn write_chunks(
    path: &Path,
    file: &File,
    direct: Option<&File>,
    source: &dyn WriteSource,
    opts: &IoOptions<'_>,
) -> Result<(), StorageError> {
    let len = source.len();
    if len == 0 {
        return opts.check_cancel();
    }
    let chunk = aligned_size(if opts.chunk_size == 0 { DEFAULT_CHUNK } else { opts.chunk_size }, MAX_CHUNK);
    let chunks = len.div_ceil(chunk as u64);
    let workers = opts.worker_count(len, chunk);
    let next = AtomicU64::new(0);
    let direct_failed = AtomicBool::new(false);

    run_workers(vec![(); workers], |(), failed| -> Result<(), StorageError> {
        let mut buf = AlignedBuf::new(chunk.min(usize::try_from(len).unwrap_or(chunk)));
        loop {
            if failed.load(Ordering::Relaxed) {
                return Ok(());
            }
            opts.check_cancel()?;
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= chunks {
                return Ok(());
            }
            let offset = i * chunk as u64;
            let n = (len - offset).min(chunk as u64) as usize;
            let data = &mut buf.as_mut_slice()[..n];
            source.fill(offset, data).map_err(|message| StorageError::Source { path: path.to_owned(), message })?;
            // Whole blocks with O_DIRECT where allowed; the rest (the file's last partial
            // block) through the page cache.
            let mut done = 0usize;
            if let Some(d) = direct.filter(|_| !direct_failed.load(Ordering::Relaxed)) {
                let aligned = n & !(ALIGN as usize - 1);
                match d.write_all_at(&data[..aligned], offset) {
                    Ok(()) => done = aligned,
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        direct_failed.store(true, Ordering::Relaxed);
                    }
                    Err(e) => return Err(io_err(path, "write", e)),
                }
            }
            file.write_all_at(&data[done..], offset + done as u64).map_err(|e| io_err(path, "write", e))?;
            opts.add_progress(n as u64);
        }
    })
}
