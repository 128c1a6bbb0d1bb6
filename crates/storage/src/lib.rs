//! The `Storage` contract: every turboio backend (local files, GPUDirect Storage, the SFCS SDK)
//! implements it, and the orchestrator composes it with a `Device` without knowing which
//! backend it talks to.
//!
//! # Shape of the contract
//!
//! - [`Storage::open`] gives a [`StorageFile`]: a file of known length that can be read at any
//!   offset from many threads at once.
//! - Each thread that reads takes its own [`RangeReader`] from [`StorageFile::reader`]. A local
//!   file hands out cheap shared descriptors; an SDK whose file handles must not be shared
//!   between threads opens one per reader. Nothing above the backend needs to know.
//! - [`StorageFile::read_ranges`] is the bulk path: many `(offset, destination)` pairs read in
//!   parallel into host memory. The default implementation splits the ranges into chunks and
//!   spreads them over threads, one reader each; backends override it when they can do better
//!   (io_uring with a deep queue and `O_DIRECT`, for the local backend).
//! - A per-chunk [`ChunkHook`] runs on the reading thread right after each chunk lands, while
//!   the bytes are still in cache: decryption is fused into the read this way, and wrappers
//!   pass it through so they never hide the inner backend's fast path.
//! - [`StorageFile::read_to_device`] is for backends that DMA straight into device memory (GDS);
//!   others answer [`StorageError::Unsupported`] and the orchestrator stages through host memory.
//!   [`Storage::write_file_from_device`] is the same for saves.
//! - [`Storage::open_unconfirmed`] lets a backend hand out a file before it knows that it is
//!   the current version (a node cache's copy, checked by a request that overlaps the read);
//!   the caller calls [`StorageFile::confirm`] after reading and reads again on
//!   [`StorageError::Changed`]. Backends without such a copy open as usual.
//! - [`Storage::write_file`] writes a whole file atomically from a [`WriteSource`] that fills
//!   chunks on demand (copying from host tensors, from device memory, or encrypting on the way),
//!   so a save never needs a second full-size buffer.
//!
//! # Errors
//!
//! One [`StorageError`] with the path in every message and "not found", "permission denied" and
//! "not supported" kept distinct.
//!
//! # Conformance
//!
//! With the `conformance` feature, the `conformance` module exports the checks every backend's tests run
//! (round trips, odd offsets, short and missing files, concurrent readers, failed writes).
#![deny(missing_docs)]
// No unsafe code here; the one unsafe item is a trait declaration (`SlotFeed`), whose promise
// the local backend's io_uring relies on.
#![deny(unsafe_code)]

mod error;
mod parallel;
mod shown;

#[cfg(feature = "conformance")]
pub mod conformance;

pub use error::StorageError;
pub use parallel::{default_threads, for_each_chunk, run_workers, split_requests, threads_or_default, Chunk};
pub use shown::{shown, Shown};

use std::fmt::Debug;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Result of storage operations.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;

/// Bytes to read at `offset` into `dst` (exactly `dst.len()` bytes).
#[derive(Debug)]
pub struct ReadRequest<'a> {
    /// Absolute offset in the file.
    pub offset: u64,
    /// Destination; filled completely or the read fails.
    pub dst: &'a mut [u8],
}

/// Runs on the reading thread after a chunk has been read: `(file_offset, bytes)`.
/// Used to decrypt in place while the bytes are hot in cache.
pub type ChunkHook<'h> = &'h (dyn Fn(u64, &mut [u8]) -> Result<()> + Sync);

/// Whether to bypass the page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectIo {
    /// Let the backend decide (the local backend uses `O_DIRECT` for files not in the page cache).
    #[default]
    Auto,
    /// Bypass the cache where the file system allows it; fall back to buffered I/O where it refuses.
    On,
    /// Always go through the page cache.
    Off,
}

/// Who decides how a cold file is read ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadAhead {
    /// The backend: the local backend probes the file's page-cache state and, when it is cold,
    /// reads ahead of the call's own readers.
    #[default]
    Backend,
    /// The caller: it has decided once, for a whole load, how the file is read, and leads any
    /// read-ahead itself ([`StorageFile::will_need`]). The backend neither probes nor reads ahead
    /// (a pipeline that reads a file a chunk per call would otherwise pay both per chunk).
    Caller,
}

/// How a bulk read or write is done. Backends ignore what does not apply to them.
#[derive(Clone, Copy, Default)]
pub struct IoOptions<'h> {
    /// Worker threads; 0 means one per available core.
    pub threads: usize,
    /// Page-cache bypass.
    pub direct: DirectIo,
    /// Bytes per chunk handed to a worker; 0 means the backend's default.
    pub chunk_size: usize,
    /// Called on the worker thread after each chunk is read (reads only), once per chunk,
    /// when its bytes are complete: a backend writes no more to a chunk once its hook has run
    /// (the node cache's write-behind reads chunks after the hook, until the call returns).
    pub hook: Option<ChunkHook<'h>>,
    /// Progress: bytes completed so far are added here.
    pub progress: Option<&'h AtomicU64>,
    /// Set by the caller to abort; the operation then fails with [`StorageError::Cancelled`].
    pub cancel: Option<&'h AtomicBool>,
    /// Saves that replace a file may write the new file into the blocks of the file the
    /// previous replace kept (the local backend's block reuse: faster on file systems where
    /// new blocks are expensive, at the price of one more copy of the file on disk). Backends
    /// that cannot ignore it.
    pub reuse_blocks: bool,
    /// The requests are a few ranges of a larger file (a load of some of its tensors): read
    /// nothing around them. The local backend turns the kernel's read-ahead off for the file
    /// (`POSIX_FADV_RANDOM`), which would otherwise read up to its window (often MiBs) past
    /// each range. Backends that cannot ignore it.
    pub sparse: bool,
    /// Who reads ahead of a cold file ([`ReadAhead`]).
    pub read_ahead: ReadAhead,
}

impl Debug for IoOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoOptions")
            .field("threads", &self.threads)
            .field("direct", &self.direct)
            .field("chunk_size", &self.chunk_size)
            .field("hook", &self.hook.is_some())
            .finish_non_exhaustive()
    }
}

impl IoOptions<'_> {
    /// Fails with [`StorageError::Cancelled`] once the caller has asked to stop.
    pub fn check_cancel(&self) -> Result<()> {
        match self.cancel {
            Some(c) if c.load(Ordering::Relaxed) => Err(StorageError::Cancelled),
            _ => Ok(()),
        }
    }

    /// A chunk of a read is complete (`dst`, read at `offset`): runs the hook on it, then counts
    /// it as progress. Every read path calls this once per chunk.
    pub fn chunk_read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        if let Some(hook) = self.hook {
            hook(offset, dst)?;
        }
        self.add_progress(dst.len() as u64);
        Ok(())
    }

    /// Adds `n` bytes to the progress counter.
    pub fn add_progress(&self, n: u64) {
        if let Some(p) = self.progress {
            p.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The worker count to use for `total` bytes in chunks of `chunk` bytes.
    pub fn worker_count(&self, total: u64, chunk: usize) -> usize {
        let want = threads_or_default(self.threads);
        let chunks = total.div_ceil(chunk.max(1) as u64).max(1);
        want.clamp(1, usize::try_from(chunks).unwrap_or(usize::MAX))
    }
}

/// A device-memory destination for backends that read straight into it (GDS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceDst {
    /// Device kind, e.g. `"cuda"`.
    pub kind: &'static str,
    /// Device ordinal.
    pub ordinal: u32,
    /// Base address of the allocation.
    pub base: u64,
    /// Offset of the destination from `base`.
    pub offset: u64,
}

/// A range of the file to read into device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceReadRequest {
    /// Absolute offset in the file.
    pub offset: u64,
    /// Bytes to read.
    pub len: u64,
    /// Where they go.
    pub dst: DeviceDst,
}

/// Bytes of a file being written that are in device memory, for backends that write straight
/// from it ([`Storage::write_file_from_device`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceWriteRequest {
    /// Absolute offset in the file.
    pub offset: u64,
    /// Bytes to write.
    pub len: u64,
    /// Where they are.
    pub src: DeviceDst,
}

/// One thread's handle on an open file.
pub trait RangeReader: Send {
    /// Reads exactly `dst.len()` bytes at `offset`; a file too short is [`StorageError::ShortFile`].
    fn read_exact_at(&mut self, offset: u64, dst: &mut [u8]) -> Result<()>;
}

/// How a bulk read brought its bytes in (see [`StorageFile::read_ranges_reported`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReadInfo {
    /// The read path: `"threads"`, `"io_uring"`, `"gds"`, `"mmap"`..., or `"storage"` for a
    /// backend that does not say.
    pub method: &'static str,
    /// `O_DIRECT` was used.
    pub direct: bool,
    /// `O_DIRECT` was asked for but the file system refused it; buffered reads were used.
    pub direct_refused: bool,
}

/// One slot of a [`SlotFeed`]: caller memory a backend reads chunks into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotMemory {
    /// The first byte (page-aligned where the feed can, so `O_DIRECT` reads go straight in).
    pub ptr: *mut u8,
    /// Bytes usable.
    pub len: usize,
    /// A number that names this memory for the whole process and is never given to other
    /// memory, even after this memory is freed (`None` when the feed cannot promise one). A
    /// backend may keep state about the memory between calls under it (the local backend keeps
    /// slots registered with its io_uring, so a steady-state load registers nothing).
    pub serial: Option<u64>,
}

/// What a [`SlotFeed`] wants read next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotRead {
    /// Read `len` bytes at file `offset` into the first bytes of slot `slot`.
    Read {
        /// Index of the slot (below [`SlotFeed::slots`]).
        slot: usize,
        /// Absolute offset in the file.
        offset: u64,
        /// Bytes (at most the slot's length).
        len: usize,
    },
    /// No slot is free yet (only when asked without waiting).
    Later,
    /// Nothing more to read.
    End,
}

/// The caller's side of [`StorageFile::read_into_slots`]: a fixed set of memory slots, and a
/// queue of reads into them that the backend pulls one at a time, telling the feed as each is
/// complete (so the feed can hand the slot's bytes on, e.g. start a device copy, and give the
/// slot back through a later [`next`](Self::next)).
///
/// # Safety
///
/// An implementation promises that every slot's memory ([`slot_memory`](Self::slot_memory),
/// the same for the whole call) is valid for writes of its length until the call returns, and
/// that from the moment [`next`](Self::next) hands out a slot until [`filled`](Self::filled)
/// is called for it (or the call returns) nothing but the backend reads or writes that slot,
/// and it is not handed out again.
#[allow(unsafe_code)]
pub unsafe trait SlotFeed {
    /// How many slots there are.
    fn slots(&self) -> usize;
    /// Slot `slot`'s memory, for a backend whose reads complete after it returns (io_uring).
    fn slot_memory(&self, slot: usize) -> SlotMemory;
    /// Slot `slot`'s memory as a slice (empty for a slot that does not exist), for a backend
    /// that reads into it before asking for anything else.
    fn slot_mut(&mut self, slot: usize) -> &mut [u8];
    /// The next read. `wait`: nothing is in flight, so block until a slot is free (never
    /// answer [`SlotRead::Later`]); otherwise answer `Later` when none is.
    fn next(&mut self, wait: bool) -> Result<SlotRead>;
    /// The read handed out with `slot` is complete: its `len` bytes at `offset` are in the slot.
    fn filled(&mut self, slot: usize, offset: u64, len: usize) -> Result<()>;
}

/// An open file.
pub trait StorageFile: Send + Sync + Debug {
    /// The path it was opened with.
    fn path(&self) -> &Path;

    /// Its length in bytes, as of opening.
    fn len(&self) -> u64;

    /// True if the file is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A reader for the calling thread.
    fn reader(&self) -> Result<Box<dyn RangeReader + '_>>;

    /// Reads one range (convenience for small reads such as the header).
    fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.reader()?.read_exact_at(offset, dst)
    }

    /// Reads many ranges in parallel into host memory; each destination is filled completely or
    /// the call fails. The hook, if any, runs on every chunk right after it is read.
    ///
    /// The default spreads chunks of `opts.chunk_size` (default 8 MiB) over `opts.threads`
    /// workers, each with its own [`reader`](Self::reader).
    fn read_ranges(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<()> {
        let chunk = if opts.chunk_size == 0 { 8 << 20 } else { opts.chunk_size };
        let chunks = split_requests(requests, chunk);
        for_each_chunk(chunks, opts, || self.reader(), |reader, c| reader.read_exact_at(c.offset, c.dst))
    }

    /// [`read_ranges`](Self::read_ranges), saying how the bytes were read (for reports). The
    /// default says `"storage"`; a backend with several read paths names the one it took.
    fn read_ranges_reported(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<ReadInfo> {
        self.read_ranges(requests, opts)?;
        Ok(ReadInfo { method: "storage", direct: false, direct_refused: false })
    }

    /// True if [`read_into_slots`](Self::read_into_slots) is this backend's own, faster way to
    /// read a file a slot at a time with `opts` (the local backend: `O_DIRECT` through io_uring,
    /// each completion handed on as it comes, the slots registered once as fixed buffers). A
    /// caller that reads into slots with many threads of its own asks first and keeps its
    /// threads where this is false (the default).
    fn reads_into_slots(&self, _opts: &IoOptions<'_>) -> bool {
        false
    }

    /// Reads what `feed` asks for into its slots, a read at a time, telling it as each one is
    /// complete. Every read fills its slot completely or the call fails; on an error (the
    /// backend's, or one `feed` returned) nothing more is asked for, the reads in flight are
    /// waited for, and the error is returned. `opts.threads` and `opts.chunk_size` do not
    /// apply; `opts.hook` runs on each read's bytes before the feed is told.
    ///
    /// The default reads one slot at a time with [`read_ranges`](Self::read_ranges) on the
    /// calling thread (correct everywhere; see [`reads_into_slots`](Self::reads_into_slots)).
    fn read_into_slots(&self, feed: &mut dyn SlotFeed, opts: &IoOptions<'_>) -> Result<ReadInfo> {
        read_into_slots_one_by_one(self, feed, opts)
    }

    /// True if [`read_to_device`](Self::read_to_device) can write into memory of this device kind.
    fn reads_to_device(&self, _kind: &str) -> bool {
        false
    }

    /// Reads ranges straight into device memory. Backends without that ability answer
    /// [`StorageError::Unsupported`].
    fn read_to_device(&self, _requests: &[DeviceReadRequest], _opts: &IoOptions<'_>) -> Result<()> {
        Err(StorageError::Unsupported { backend: "storage", what: "reading into device memory".into() })
    }

    /// How many requests one bulk read of this file keeps in flight at most: 1 for local files
    /// (their parallelism is the reader threads), a remote store's concurrency for object
    /// storage. A model load fills up to this many files at once, so that many small files do
    /// not leave a remote backend idle (the backend bounds its requests in flight itself).
    fn requests_in_flight(&self) -> usize {
        1
    }

    /// Asks the backend to start bringing `[offset, offset + len)` in, without waiting for it
    /// (the local backend: `POSIX_FADV_WILLNEED` into the page cache). Advisory: the default, and
    /// any backend that cannot, does nothing. Leads the reads of a caller that reads ahead itself
    /// ([`ReadAhead::Caller`]).
    fn will_need(&self, _offset: u64, _len: u64) {}

    /// The local file descriptor, for backends whose files can be memory-mapped.
    fn local_file(&self) -> Option<&std::fs::File> {
        None
    }

    /// The fraction (0 to 1) of the file's pages already in the page cache, estimated cheaply,
    /// or `None` if the backend cannot tell.
    fn cached_fraction(&self) -> Option<f64> {
        None
    }

    /// For a file opened with [`Storage::open_unconfirmed`]: waits until the backend knows
    /// whether the bytes read through this handle are the file's current version, and says
    /// so. [`StorageError::Changed`] when they are not (the caller drops what it read, opens
    /// the file again and reads it again); any other error is what opening the file would
    /// have answered (the file is gone, the store cannot be reached). A caller calls it once
    /// it has read what it needs and before it hands any of it out. Files opened otherwise,
    /// and backends that never open optimistically, answer `Ok` at once (the default).
    fn confirm(&self) -> Result<()> {
        Ok(())
    }

    /// The version of the bytes this handle reads (an object's ETag, with its version id where
    /// the store keeps versions): a tag that changes whenever the content does, so a cache can
    /// key on it. `None` for backends without one (local files; a cache does not keep those).
    fn version(&self) -> Option<String> {
        None
    }

    /// Where a caching layer served this file from, for reports (`"node cache: hit"`, `"node
    /// cache: miss, written through"`); `None` for a plain backend (the default).
    fn served_by(&self) -> Option<&'static str> {
        None
    }
}

/// What a backend says of a file without opening it: its length and the tag of
/// [`StorageFile::version`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    /// Length in bytes.
    pub len: u64,
    /// The content's tag (see [`StorageFile::version`]).
    pub tag: String,
}

/// Produces the bytes of a file being written, a chunk at a time.
pub trait WriteSource: Sync {
    /// Total bytes.
    fn len(&self) -> u64;

    /// True if there is nothing to write.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fills `dst` with the bytes at `offset..offset + dst.len()`. Errors abort the write and
    /// leave any previous file in place.
    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), String>;

    /// The bytes at `offset..offset + len` where they already sit in memory, unchanged for as
    /// long as the source is borrowed, so that a backend can write straight from them instead
    /// of filling a buffer of its own (the local backend does for `O_DIRECT` writes from an
    /// aligned address). `None`, the default, when the bytes must be `fill`ed.
    fn slice(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let _ = (offset, len);
        None
    }
}

/// A [`WriteSource`] backed by one slice in memory.
#[derive(Debug, Clone, Copy)]
pub struct BytesSource<'a>(pub &'a [u8]);

impl WriteSource for BytesSource<'_> {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }

    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), String> {
        let start = usize::try_from(offset).map_err(|e| e.to_string())?;
        let src = start
            .checked_add(dst.len())
            .and_then(|end| self.0.get(start..end))
            .ok_or_else(|| format!("range {start}+{} is outside the {} source bytes", dst.len(), self.0.len()))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn slice(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let start = usize::try_from(offset).ok()?;
        self.0.get(start..start.checked_add(len)?)
    }
}

/// A storage backend.
pub trait Storage: Send + Sync + Debug {
    /// A short name for messages, e.g. `"posix"`.
    fn name(&self) -> &'static str;

    /// Opens a file for reading.
    fn open(&self, path: &Path) -> Result<Box<dyn StorageFile>>;

    /// Opens a file for reading, giving up with [`StorageError::Cancelled`] once `cancel` is
    /// set, for backends whose open can wait on the network (credentials, a connection). The
    /// default ignores `cancel`.
    fn open_cancellable(&self, path: &Path, cancel: Option<&AtomicBool>) -> Result<Box<dyn StorageFile>> {
        let _ = cancel;
        self.open(path)
    }

    /// Opens a file for reading, possibly before the backend knows that what it opens is the
    /// file's current version: a node cache hands out its complete copy of the version seen
    /// last at once, while the request that checks it is still in flight, so that the check
    /// overlaps the read instead of preceding it. The caller must call
    /// [`StorageFile::confirm`] after reading and before using what it read, and read again
    /// on [`StorageError::Changed`]. The default is [`open_cancellable`](Self::open_cancellable)
    /// (a confirmed file).
    fn open_unconfirmed(&self, path: &Path, cancel: Option<&AtomicBool>) -> Result<Box<dyn StorageFile>> {
        self.open_cancellable(path, cancel)
    }

    /// Writes `source` to `path` atomically: readers see the old file or the complete new one,
    /// never a mix; on any error the old file is untouched and nothing is left behind.
    fn write_file(&self, path: &Path, source: &dyn WriteSource, opts: &IoOptions<'_>) -> Result<()>;

    /// True if [`write_file_from_device`](Self::write_file_from_device) can read memory of this
    /// device kind (e.g. `"cuda"`).
    fn writes_from_device(&self, _kind: &str) -> bool {
        false
    }

    /// Like [`write_file`](Self::write_file), atomically, with the ranges in `device` written
    /// straight from device memory where the backend can (GDS). `source` can still produce
    /// every byte of the file, device ranges included, so a backend may take any range from it
    /// instead. Backends without that ability answer [`StorageError::Unsupported`] and the
    /// caller uses `write_file`.
    fn write_file_from_device(
        &self,
        _path: &Path,
        _source: &dyn WriteSource,
        _device: &[DeviceWriteRequest],
        _opts: &IoOptions<'_>,
    ) -> Result<()> {
        Err(StorageError::Unsupported { backend: self.name(), what: "writing from device memory".into() })
    }

    /// The files directly in the directory `dir` (for object stores: the objects under the key
    /// prefix `dir/`), as full paths, sorted. Used for model directories. Backends that cannot
    /// list answer [`StorageError::Unsupported`].
    fn list(&self, dir: &Path) -> Result<Vec<std::path::PathBuf>> {
        let _ = dir;
        Err(StorageError::Unsupported { backend: self.name(), what: "listing a directory".into() })
    }

    /// The file's current [`Version`] (length and tag) from a metadata request (an object
    /// store's HEAD), for a cache to find out whether what it holds is still current without
    /// reading any of the bytes. `Ok(None)` for backends without versions.
    fn current_version(&self, path: &Path) -> Result<Option<Version>> {
        let _ = path;
        Ok(None)
    }

    /// Removes the file at `path`; a file that does not exist is not an error. Used to remove
    /// a model directory's replaced shards. Backends that cannot answer
    /// [`StorageError::Unsupported`].
    fn remove_file(&self, path: &Path) -> Result<()> {
        let _ = path;
        Err(StorageError::Unsupported { backend: self.name(), what: "removing a file".into() })
    }
}

/// The memory of `slot` of `feed`, checked to hold `len` bytes (for backends implementing
/// [`StorageFile::read_into_slots`]).
pub fn slot_target(feed: &dyn SlotFeed, slot: usize, len: usize, path: &Path) -> Result<SlotMemory> {
    let mem = if slot < feed.slots() { Some(feed.slot_memory(slot)) } else { None };
    match mem {
        Some(m) if m.len >= len && !m.ptr.is_null() => Ok(m),
        _ => Err(StorageError::Unsupported {
            backend: "storage",
            what: format!(
                "reading {len} bytes of {} into slot {slot} of {} (missing or too small)",
                shown(path),
                feed.slots()
            ),
        }),
    }
}

/// [`StorageFile::read_into_slots`]'s default: one slot at a time with
/// [`read_ranges_reported`](StorageFile::read_ranges_reported) on the calling thread (for a
/// backend whose own way does not apply to a call).
pub fn read_into_slots_one_by_one<F: StorageFile + ?Sized>(
    file: &F,
    feed: &mut dyn SlotFeed,
    opts: &IoOptions<'_>,
) -> Result<ReadInfo> {
    let mut info = ReadInfo { method: "storage", direct: false, direct_refused: false };
    loop {
        opts.check_cancel()?;
        let (slot, offset, len) = match feed.next(true)? {
            SlotRead::Read { slot, offset, len } => (slot, offset, len),
            SlotRead::End => return Ok(info),
            SlotRead::Later => {
                return Err(StorageError::Unsupported {
                    backend: "storage",
                    what: "a slot feed that answers `Later` when told to wait".into(),
                })
            }
        };
        slot_target(feed, slot, len, file.path())?;
        let dst = feed.slot_mut(slot).get_mut(..len).ok_or_else(|| StorageError::Unsupported {
            backend: "storage",
            what: format!("slot {slot} is smaller than its {len}-byte read"),
        })?;
        info = file.read_ranges_reported(vec![ReadRequest { offset, dst }], &IoOptions { threads: 1, ..*opts })?;
        feed.filled(slot, offset, len)?;
    }
}
