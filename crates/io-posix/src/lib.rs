//! turboio's local-file backend: [`PosixStorage`] implements the
//! [`Storage`] contract for files on local file systems, reading as
//! fast as the page cache or the disk allows and saving atomically.
//!
//! # Read paths, chosen per call
//!
//! **Through the page cache: threads doing buffered `pread`.** A cached file costs a copy from
//! the page cache into the destination plus the page faults of fresh destination memory;
//! spreading chunks (8 MiB by default) over one thread per core spreads both. When the file is
//! mostly *not* cached, one more thread walks ahead of the readers asking the kernel for the
//! chunks they will read next (`POSIX_FADV_WILLNEED`, 64 MiB at a time): a blocked `pread` on
//! its own keeps only a few small reads in flight, the read-ahead thread keeps the disk's queue
//! full. The file stays in the page cache for the next reader, and readers in other processes
//! wait for pages being read instead of reading them again.
//!
//! **Bypassing it: io_uring with `O_DIRECT`.** For a cold file that should not stay cached
//! (the caller says so: [`DirectIo::On`](turboio_storage::DirectIo::On)). Each worker thread
//! owns a ring and keeps it full ([`PosixConfig::queue_depth`] requests of
//! [`PosixConfig::block_size`] bytes), reaping completions and resubmitting, so the disk sees a
//! deep queue while the threads mostly sleep. The kernel writes straight into the destination
//! and the page cache is left as it was.
//!
//! [`ReadMethod::Auto`] with [`DirectIo::Auto`](turboio_storage::DirectIo::Auto) decides with
//! [`StorageFile::cached_fraction`]: at or above [`PosixConfig::cached_threshold`] the threads,
//! below it io_uring with `O_DIRECT`. (turboio's loader decides the cache policy itself and
//! passes `On` or `Off`.) `DirectIo::On` and `Off` force the cache bypass on or off, and
//! [`PosixConfig::method`] forces the method; every combination works (threads with
//! `O_DIRECT`, io_uring through the cache). Where io_uring cannot be set up (an old kernel,
//! seccomp, a container policy), the threads take over silently; [`io_uring_available`] says
//! which.
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
//! # In-place writes
//!
//! [`PosixStorage::write_at`] writes bytes at an offset of a file, in place (created when
//! missing, never truncated): the raw positional write that DeepNVMe-style handles offer, not a
//! save. It shares the savers' chunk writers (io_uring, `O_DIRECT` whole blocks) with a base
//! offset; the head up to the first block boundary and the last partial block go through the
//! page cache.
//!
//! # Atomic saves
//!
//! [`Storage::write_file`] is the one atomic-replace implementation of turboio:
//!
//! 1. A symbolic link at the target is followed (the Hugging Face cache links
//!    `model.safetensors` to a blob): the file it points to is replaced, in its own directory,
//!    and the link stays.
//! 2. `.{name}.turboio-tmp.{pid}.{owner}.{random}` is created next to the target with `O_EXCL`
//!    and locked (`flock`, held until the rename: the mark of a live writer): mode 0600 when a
//!    file is being replaced (never more open than the final file), 0666 less the umask for a
//!    new file (what `open` gives).
//! 3. The file gets its final length, after a check that the file system has that much free
//!    (a full disk fails before any byte is written, in the common case). Not `fallocate`: the
//!    unwritten extents it reserves cost every `O_DIRECT` write a conversion, 8-15% of a save's
//!    time here, for the same layout on disk.
//! 4. Chunks are filled from the source into reusable aligned buffers by one worker per core
//!    and written with `O_DIRECT` (whole blocks; the file's last partial block through the
//!    page cache), each worker keeping several chunks in flight on an io_uring of its own;
//!    with `pwrite` where io_uring is unavailable, and through the page cache where the file
//!    system refuses `O_DIRECT` or the caller asks ([`DirectIo::Off`](turboio_storage::DirectIo::Off):
//!    the file then stays in the page cache, for a load right after).
//! 5. The file is given the replaced file's owner (where permitted) and mode, `fsync`ed (so a
//!    crash after the sync never leaves a 0600 file in place), and renamed over the target; the
//!    directory is `fsync`ed. A file being replaced first gets a second name,
//!    `.{name}.turboio-old.{pid}.{owner}.{random}` (a hard link), so the rename does not free
//!    its blocks; that name is unlinked after the directory sync by a thread of its own
//!    ([`PosixConfig::delete_in_background`], [`wait_for_deletions`]). A kill at any point
//!    leaves the target old or new; a second name left behind is removed by the next save.
//! 6. Temporary files of earlier saves of the same name whose writer is gone (killed mid-save)
//!    are removed: unlocked, and either written on this boot and PID namespace by a process
//!    that no longer exists, or untouched for an hour (see [`abandoned_temp`]; a PID alone is
//!    wrong across hosts sharing a file system and across containers). The directory is listed
//!    for them at the first save into it and then at most once a minute ([`leftover_scans`]):
//!    leftovers a writer killed after a listing leaves are removed by the first save after the
//!    next listing (this process's or another's).
//!
//! Other data paths (GPUDirect Storage writes from device memory) use the same protocol through
//! [`PosixStorage::replace_with`], which hands the temporary file to the caller's transfer.
//!
//! On any error before the rename (the source fails, the disk is full, the caller cancels) the
//! temporary file is removed and the old target is untouched; readers see the old file or the
//! complete new one. Because the target is replaced, not rewritten, existing mappings of the old
//! file stay valid. Hard links to the old file keep the old contents; extended attributes and
//! ACLs are not copied.
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
mod retire;
mod slots;
mod sys;
mod temp;
mod uring;
mod write;

pub use read::PosixFile;
pub use retire::{deletions_pending, remove_in_background, wait_for_deletions};
pub use slots::{release_registered_slots, slot_registrations};
pub use temp::{abandoned_temp, owner_tag, temp_target, STALE_AFTER, STALE_AFTER_WITHOUT_LOCKS};
pub use write::{Faults, Step, TempFile};

use std::path::Path;
use turboio_storage::{IoOptions, Storage, StorageError, StorageFile, WriteSource};

/// How bulk reads are issued (and saves: `Threads` makes them `pwrite` instead of io_uring).
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
    /// A save that replaces a file gives the old file a second name before the rename and
    /// deletes it after the save returns, on a thread of its own ([`wait_for_deletions`]
    /// waits for it): on ext4 the rename over a file's last link frees its blocks before it
    /// returns, 0.6-0.9 s for 1 GiB here, on the caller's time. On by default; off, the rename
    /// frees the old file itself.
    pub delete_in_background: bool,
    /// For tests: OS errors a save meets on purpose (none by default).
    pub faults: Faults,
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
            delete_in_background: true,
            faults: Faults::default(),
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

/// How many page-cache residency probes (a whole-file `mmap`, `mincore` over a sample,
/// `munmap`; [`StorageFile::cached_fraction`]) this process has run: a load decides its file's
/// state once, so tests and reports count them per load.
pub fn residency_probes() -> u64 {
    sys::PROBES.load(std::sync::atomic::Ordering::Relaxed)
}

/// How many times this process has listed a directory for the leftovers of earlier saves
/// (at the first save into a directory, then at most once a minute; see step 6 of the write protocol).
pub fn leftover_scans() -> u64 {
    temp::SCANS.load(std::sync::atomic::Ordering::Relaxed)
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

    /// Replaces `path` atomically with a file of `len` bytes that `transfer` writes into the
    /// temporary file it is given (already created, locked and sized): the protocol of
    /// [`Storage::write_file`] (links followed, the old file's owner and mode, sync, rename,
    /// directory sync, abandoned temporaries removed), with another data path. On any error
    /// of `transfer` or of the protocol, the temporary file is removed and the old file stays.
    pub fn replace_with(
        &self,
        path: &Path,
        len: u64,
        opts: &IoOptions<'_>,
        transfer: &mut dyn FnMut(&TempFile<'_>) -> Result<(), StorageError>,
    ) -> Result<(), StorageError> {
        write::replace_with(&self.cfg, path, len, opts, transfer)
    }

    /// Writes `source` into `path` at `offset`, in place (created with mode 0600 when missing,
    /// never truncated, grown when the range ends past its end), whole blocks with `O_DIRECT`
    /// where allowed: the raw positional write that DeepNVMe-style handles offer. **Not** a
    /// save: not atomic and not synced (a crash leaves a partly written range); checkpoints
    /// go through [`Storage::write_file`].
    pub fn write_at(
        &self,
        path: &Path,
        offset: u64,
        source: &dyn WriteSource,
        opts: &IoOptions<'_>,
    ) -> Result<(), StorageError> {
        write::write_at(&self.cfg, path, offset, source, opts)
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

    fn list(&self, dir: &Path) -> Result<Vec<std::path::PathBuf>, StorageError> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| StorageError::io(dir, "read_dir", e))? {
            let entry = entry.map_err(|e| StorageError::io(dir, "read_dir", e))?;
            // Files, and symbolic links to files (as `Path::is_file` follows them).
            if entry.path().is_file() {
                out.push(entry.path());
            }
        }
        out.sort();
        Ok(out)
    }

    fn remove_file(&self, path: &Path) -> Result<(), StorageError> {
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(StorageError::io(path, "unlink", e)),
            _ => Ok(()),
        }
    }
}
