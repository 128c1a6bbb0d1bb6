//! Test helpers (the `testing` feature): a versioned backend of local files to put a cache in
//! front of, for this crate's tests and the workspace's.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use turboio_io_posix::PosixStorage;
use turboio_storage::{IoOptions, RangeReader, ReadRequest, Result, Storage, StorageFile, Version, WriteSource};

/// Local files with versions (inode, modification time and length), counting the bytes read
/// from them and the HEADs, optionally slow (a pause per chunk, so a test can kill a fetch
/// midway).
#[derive(Debug, Default)]
pub struct Versioned {
    posix: PosixStorage,
    /// Bytes read from the files.
    pub read: Arc<AtomicU64>,
    /// [`Storage::current_version`] calls.
    pub heads: Arc<AtomicU64>,
    /// A pause before each chunk read.
    pub pause: Option<Duration>,
    head_gate: (Mutex<bool>, Condvar),
}

impl Versioned {
    /// A versioned backend whose reads pause `pause` before each chunk.
    pub fn with_pause(pause: Option<Duration>) -> Versioned {
        Versioned { pause, ..Default::default() }
    }

    /// Closed (true), the store's HEADs wait until it opens again (10 s at most, so that a HEAD
    /// asked for on a test's own thread fails its assertions instead of hanging the test).
    pub fn hold_heads(&self, closed: bool) {
        *self.head_gate.0.lock().unwrap_or_else(|p| p.into_inner()) = closed;
        self.head_gate.1.notify_all();
    }
}

/// The version of a local file (inode, modification time, length).
fn tag_of(path: &Path) -> std::io::Result<Version> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok(Version { len: m.len(), tag: format!("{}-{}.{}", m.ino(), m.mtime(), m.mtime_nsec()) })
}

#[derive(Debug)]
struct VFile {
    inner: Box<dyn StorageFile>,
    tag: String,
    read: Arc<AtomicU64>,
    pause: Option<Duration>,
}

struct VReader<'a> {
    inner: Box<dyn RangeReader + 'a>,
    file: &'a VFile,
}

impl RangeReader for VReader<'_> {
    fn read_exact_at(&mut self, offset: u64, dst: &mut [u8]) -> Result<()> {
        if let Some(p) = self.file.pause {
            std::thread::sleep(p);
        }
        self.inner.read_exact_at(offset, dst)?;
        self.file.read.fetch_add(dst.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

impl StorageFile for VFile {
    fn path(&self) -> &Path {
        self.inner.path()
    }
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn reader(&self) -> Result<Box<dyn RangeReader + '_>> {
        Ok(Box::new(VReader { inner: self.inner.reader()?, file: self }))
    }
    fn read_ranges(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<()> {
        // Through the readers (the contract's default), so the count and the pause apply.
        let chunk = if opts.chunk_size == 0 { 1 << 20 } else { opts.chunk_size };
        let chunks = turboio_storage::split_requests(requests, chunk);
        turboio_storage::for_each_chunk(chunks, opts, || self.reader(), |r, c| r.read_exact_at(c.offset, c.dst))
    }
    fn version(&self) -> Option<String> {
        Some(self.tag.clone())
    }
}

impl Storage for Versioned {
    fn name(&self) -> &'static str {
        "versioned"
    }
    fn open(&self, path: &Path) -> Result<Box<dyn StorageFile>> {
        let inner = self.posix.open(path)?;
        let tag = tag_of(path).map_err(|e| turboio_storage::StorageError::io(path, "stat", e))?.tag;
        Ok(Box::new(VFile { inner, tag, read: self.read.clone(), pause: self.pause }))
    }
    fn write_file(&self, path: &Path, source: &dyn WriteSource, opts: &IoOptions<'_>) -> Result<()> {
        self.posix.write_file(path, source, opts)
    }
    fn list(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        self.posix.list(dir)
    }
    fn remove_file(&self, path: &Path) -> Result<()> {
        self.posix.remove_file(path)
    }
    fn current_version(&self, path: &Path) -> Result<Option<Version>> {
        let (closed, opened) = &self.head_gate;
        let closed = closed.lock().unwrap_or_else(|p| p.into_inner());
        drop(opened.wait_timeout_while(closed, Duration::from_secs(10), |c| *c));
        self.heads.fetch_add(1, Ordering::Relaxed);
        match tag_of(path) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(turboio_storage::StorageError::NotFound { path: path.to_owned() })
            }
            Err(e) => Err(turboio_storage::StorageError::io(path, "stat", e)),
        }
    }
}
