//! turboio's local-file backend: [`PosixStorage`] implements the
//! [`Storage`] contract for files on local file systems, reading as
//! fast as the page cache or the disk allows and saving atomically.
//!
//! # Two read paths, chosen per call
//!
//! **Hot files (mostly in the page cache): threads doing buffered `pread`.** The data is already
//! in memory; a read is a copy from the page cache into the destination, and its cost is the
//! copy plus the page faults of fresh destination memory. Spreading chunks (8 MiB by default)
//! over one thread per core spreads both. `O_DIRECT` would be wrong here: it ignores the cache
//! and reads the disk again.
//!
//! **Cold files: io_uring with `O_DIRECT`.** Buffered reads of a cold file go through
//! readahead, which on this class of machine tops out well below the disk (about 3.3 GB/s
//! against 5 GB/s with a deep queue of direct reads), and they copy every byte twice (disk →
//! page cache → destination) while filling the cache with a file that is usually read once.
//! Each worker thread owns a ring and keeps it full ([`PosixConfig::queue_depth`] requests of
//! [`PosixConfig::block_size`] bytes), reaping completions and resubmitting, so the disk sees a
//! deep queue while the threads mostly sleep. The kernel writes straight into the destination.
//!
//! [`ReadMethod::Auto`] with [`DirectIo::Auto`](turboio_storage::DirectIo::Auto) decides with
//! [`StorageFile::cached_fraction`]: at or above
//! [`PosixConfig::cached_threshold`] the threads, below it io_uring with `O_DIRECT`.
//! `DirectIo::On` and `Off` force the cache bypass on or off, and [`PosixConfig::method`] forces
//! the method; every combination works (threads with `O_DIRECT`, io_uring through the cache).
//! Where io_uring cannot be set up (an old kernel, seccomp, a container policy), the threads
//! take over silently; [`io_uring_available`] says which.
//!
//! # The residency probe
//!
//! `cached_fraction` maps the file read-only without populating it, asks `mincore` about a
//! sample (64 spans of 16 pages spread over the file, or the whole file when it is smaller than
//! that) and unmaps it: a handful of system calls and no I/O, well under a millisecond even for
//! a multi-GiB file (about 0.1 ms for 4 GiB here). It never reads, faults or caches a page.
//! Since Linux 5.2, `mincore` reports the page cache only for files the caller owns or may
//! write; other files look cold, so `Auto` reads them with `O_DIRECT`: correct, but slower than
//! a copy when they are in fact cached. Callers that know better force `DirectIo::Off`.
//!
//! # `O_DIRECT` alignment
//!
//! `O_DIRECT` wants file offsets, lengths and buffer addresses aligned to the logical block
//! size; we align to 4096, a multiple of every common one. Requests are cut into chunks at
//! aligned file offsets, and each chunk into pieces:
//!
//! - When the destination address and the file offset are congruent modulo 4096, the aligned
//!   middle is read straight into the destination, and the unaligned head and tail (under
//!   4096 bytes each) are read as whole blocks into a small aligned bounce buffer and copied.
//!   **Callers that want the fastest cold reads place destinations this way**, e.g. read a
//!   safetensors data section starting at file offset `d` into an arena at offset `d % 4096`.
//! - Otherwise the whole chunk is read through aligned bounce buffers and copied (a memory copy
//!   at tens of GB/s, small next to the disk).
//!
//! Bounce reads of the last block of the file come back short at the end of the file; only the
//! bytes asked for are copied, and direct reads never extend past the destination. A short read
//! anywhere else is completed with buffered `pread`s; reaching the end of the file early (a file
//! truncated while being read) is [`StorageError::ShortFile`]. Requests are checked against the
//! length before anything is read.
//!
//! A file system that refuses `O_DIRECT` (`EINVAL`, at open as ramfs does, or at the first
//! read) gets buffered reads instead, and [`ReadReport::direct_refused`] says so. (tmpfs on
//! recent kernels accepts `O_DIRECT`, serving it from memory.)
//!
//! # io_uring safety
//!
//! The kernel writes into a destination until the completion of its request arrives. A ring's
//! owner never returns, unwinds or drops the ring while anything is in flight: on an error it
//! stops submitting and keeps reaping until nothing is, and its `Drop` waits likewise (so a
//! panicking hook cannot free memory under the kernel). All ring code is in the `uring` module,
//! all other raw system calls in `sys`.
//!
//! # Atomic saves
//!
//! [`Storage::write_file`] creates
//! `.{name}.turboio-tmp.{pid}.{random}` in the target's directory with `O_EXCL` (mode 0644 less
//! the umask), reserves the final size with `fallocate` (so a full disk fails before any byte is
//! written), writes chunks in parallel (each worker fills its own reusable aligned buffer from
//! the source and `pwrite`s it, with `O_DIRECT` if [`PosixConfig::direct_writes`]), `fsync`s the
//! file, renames it over the target, and `fsync`s the directory. On any error before the rename
//! (the source fails, the disk is full, the caller cancels) the temporary file is removed and
//! the old target is untouched; readers see the old file or the complete new one. Because the
//! target is replaced, not rewritten, existing mappings of the old file stay valid. Nothing of
//! the old file is preserved: not its permissions, owner, extended attributes or hard links (a
//! symbolic link at the target is replaced by the new file, not followed).
//!
//! # Measured (4 GiB file, this 2-vCPU VM, medians of 5 shuffled runs; `examples/readbench.rs`)
//!
//! Cold: raw `O_DIRECT` at queue depth 32 into a reused buffer 1.96 GB/s; io_uring + `O_DIRECT`
//! into an already-faulted arena 2.34 GB/s (1.19x), into a fresh huge-page arena 1.18 GB/s;
//! buffered threads 0.46 GB/s. Loads into fresh memory are capped by its first touch here
//! (faulting the fresh arena alone: 1.14 GB/s on 2 threads), not by the I/O path.
//! Hot: `std::fs::read` 0.64 GB/s, buffered threads into a fresh huge-page arena 1.68 GB/s
//! (2.6x). Queue depth 8 to 32, blocks of 256 KiB to 4 MiB and 1 to 4 rings all measured within
//! noise of each other; the defaults are 16 x 1 MiB per ring, one ring per core.
#![deny(missing_docs)]

mod plan;
mod read;
mod sys;
mod uring;
mod write;

pub use read::PosixFile;

use std::path::Path;
use turboio_storage::{IoOptions, Storage, StorageError, StorageFile, WriteSource};

/// How bulk reads are issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadMethod {
    /// Threads for cached files, io_uring for cold ones (see the crate docs).
    #[default]
    Auto,
    /// Worker threads doing `pread`.
    Threads,
    /// A ring per worker thread, kept full (falls back to threads where io_uring is missing).
    IoUring,
}

/// Settings of [`PosixStorage`].
#[derive(Debug, Clone)]
pub struct PosixConfig {
    /// How bulk reads are issued.
    pub method: ReadMethod,
    /// io_uring requests in flight per worker thread.
    pub queue_depth: u32,
    /// Bytes per `O_DIRECT` or io_uring request (rounded to a multiple of 4096, at most 64 MiB).
    pub block_size: usize,
    /// Saves `fsync` the file and its directory.
    pub fsync: bool,
    /// Saves write whole blocks with `O_DIRECT` where the file system allows it (on by
    /// default: measured 1.9 GB/s against 0.5 GB/s for buffered writes of a 2 GiB file here,
    /// where buffered writes are throttled by writeback). The saved file is then not left in
    /// the page cache, so loading it right away is a cold read.
    pub direct_writes: bool,
    /// `DirectIo::Auto` bypasses the page cache when less than this fraction of the file is
    /// cached.
    pub cached_threshold: f64,
}

impl Default for PosixConfig {
    fn default() -> Self {
        PosixConfig {
            method: ReadMethod::Auto,
            queue_depth: 16,
            block_size: 1 << 20,
            fsync: true,
            direct_writes: true,
            cached_threshold: 0.5,
        }
    }
}

/// What a read did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadReport {
    /// [`ReadMethod::Threads`] or [`ReadMethod::IoUring`], never `Auto`.
    pub method: ReadMethod,
    /// `O_DIRECT` was used.
    pub direct: bool,
    /// `O_DIRECT` was asked for but the file system refused it, so the read went through the
    /// page cache.
    pub direct_refused: bool,
}

/// Whether io_uring works here (probed once, then cached).
pub fn io_uring_available() -> bool {
    uring::available()
}

/// The local-file storage backend.
#[derive(Debug, Clone, Default)]
pub struct PosixStorage {
    cfg: PosixConfig,
}

impl PosixStorage {
    /// A backend with the default [`PosixConfig`].
    pub fn new() -> Self {
        Self::default()
    }

    /// A backend with the given settings.
    pub fn with_config(cfg: PosixConfig) -> Self {
        PosixStorage { cfg }
    }

    /// Its settings.
    pub fn config(&self) -> &PosixConfig {
        &self.cfg
    }

    /// Opens a file, with the local-only extras of [`PosixFile`].
    pub fn open_posix(&self, path: &Path) -> Result<PosixFile, StorageError> {
        PosixFile::open(path, self.cfg.clone())
    }
}

impl Storage for PosixStorage {
    fn name(&self) -> &'static str {
        "posix"
    }

    fn open(&self, path: &Path) -> Result<Box<dyn StorageFile>, StorageError> {
        Ok(Box::new(self.open_posix(path)?))
    }

    fn write_file(&self, path: &Path, source: &dyn WriteSource, opts: &IoOptions<'_>) -> Result<(), StorageError> {
        write::write_file(&self.cfg, path, source, opts)
    }
}
