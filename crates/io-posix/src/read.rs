//! Open files and the read paths: buffered threads, threads with `O_DIRECT`, and io_uring
//! (buffered or `O_DIRECT`).

use crate::plan::{aligned_size, plan_buffered, plan_direct, split_aligned, Piece};
use crate::sys::{self, AlignedBuf};
use crate::uring::Ring;
use crate::{io_uring_available, PosixConfig, ReadMethod, ReadReport};
use nix::errno::Errno;
use std::fs::File;
use std::io;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use turboio_storage::{
    for_each_chunk, read_into_slots_one_by_one, run_workers, slot_target, split_requests, Chunk, DirectIo, IoOptions,
    RangeReader, ReadAhead, ReadRequest, SlotFeed, SlotMemory, SlotRead, StorageError, StorageFile,
};

/// Default bytes per chunk handed to a worker.
const DEFAULT_CHUNK: usize = 8 << 20;
/// Bytes asked for per `POSIX_FADV_WILLNEED` call when reading a cold file through the cache.
const READ_AHEAD_STEP: u64 = 64 << 20;
/// Largest block a single request may read (io_uring takes a `u32` length).
const MAX_BLOCK: usize = 64 << 20;

/// A local file opened by [`PosixStorage`](crate::PosixStorage).
#[derive(Debug)]
pub struct PosixFile {
    path: PathBuf,
    file: File,
    len: u64,
    cfg: PosixConfig,
    /// The `O_DIRECT` description, opened on first use; `None` inside when the file system
    /// refuses `O_DIRECT`.
    direct: OnceLock<Option<File>>,
    /// The file system accepted `O_DIRECT` at open but refused a read with `EINVAL`.
    refused_at_read: AtomicBool,
}

impl PosixFile {
    pub(crate) fn open(path: &Path, cfg: PosixConfig) -> Result<PosixFile, StorageError> {
        let file = File::open(path).map_err(|e| StorageError::io(path, "open", e))?;
        let meta = file.metadata().map_err(|e| StorageError::io(path, "stat", e))?;
        if meta.is_dir() {
            return Err(StorageError::Io { path: path.to_owned(), op: "open", source: Errno::EISDIR.into() });
        }
        Ok(PosixFile {
            path: path.to_owned(),
            file,
            len: meta.len(),
            cfg,
            direct: OnceLock::new(),
            refused_at_read: AtomicBool::new(false),
        })
    }

    /// The open file (buffered, read-only), e.g. to memory-map it.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Asks the kernel to drop this file's clean pages from the page cache
    /// (`POSIX_FADV_DONTNEED`), e.g. to measure cold reads without root. Dirty pages stay until
    /// written back.
    pub fn evict_cache(&self) -> Result<(), StorageError> {
        sys::drop_cache(&self.file).map_err(|e| StorageError::io(&self.path, "fadvise", e))
    }

    /// Like [`StorageFile::read_ranges`], and also says which path was taken.
    ///
    /// Every request is checked against [`len`](StorageFile::len) first: one that reaches past
    /// the end fails with [`StorageError::ShortFile`] before anything is read.
    pub fn read_ranges_report(
        &self,
        requests: Vec<ReadRequest<'_>>,
        opts: &IoOptions<'_>,
    ) -> Result<ReadReport, StorageError> {
        for r in &requests {
            self.check_range(r.offset, r.dst.len())?;
        }
        // Asked only when the choice depends on it (a probe costs a few system calls).
        let cold = std::cell::OnceCell::new();
        let is_cold = || *cold.get_or_init(|| self.cached_fraction().is_some_and(|f| f < self.cfg.cached_threshold));
        let (method, want_direct) = self.choose(opts, &is_cold, requests.len());
        let direct_fd =
            if want_direct && !self.refused_at_read.load(Ordering::Relaxed) { self.direct_file()? } else { None };
        let refused_before = want_direct && direct_fd.is_none();
        if opts.sparse && direct_fd.is_none() {
            // Advisory: a kernel that refuses reads around the ranges, as before.
            let _ = sys::random_access(&self.file);
        }
        // A caller that leads the read-ahead itself has decided: no probe, no read-ahead here.
        let read_ahead =
            opts.read_ahead == ReadAhead::Backend && direct_fd.is_none() && method != ReadMethod::IoUring && is_cold();
        let run = Run {
            file: self,
            opts,
            direct_fd: direct_fd.map(AsFd::as_fd),
            refused: AtomicBool::new(false),
            read_ahead,
        };
        let method = match method {
            ReadMethod::IoUring => run.uring(requests)?,
            _ => {
                run.threads(requests)?;
                ReadMethod::Threads
            }
        };
        let refused = refused_before || run.refused.load(Ordering::Relaxed);
        if run.refused.load(Ordering::Relaxed) {
            self.refused_at_read.store(true, Ordering::Relaxed);
        }
        Ok(ReadReport { method, direct: want_direct && !refused, direct_refused: refused })
    }

    /// Which method, and whether to bypass the cache.
    ///
    /// Automatic: io_uring for `O_DIRECT` reads, except one request on one thread (a pipeline's
    /// chunk): that is one `O_DIRECT` `pread` of the whole aligned range, which the kernel
    /// splits and queues at once, where a ring would be set up and torn down for one read.
    fn choose(&self, opts: &IoOptions<'_>, is_cold: &dyn Fn() -> bool, requests: usize) -> (ReadMethod, bool) {
        let direct = match opts.direct {
            DirectIo::Off => false,
            DirectIo::On => true,
            DirectIo::Auto => is_cold(),
        };
        let one_read = requests == 1 && opts.threads == 1;
        let method = match self.cfg.method {
            ReadMethod::Auto if direct && one_read => ReadMethod::Threads,
            ReadMethod::Auto if direct => ReadMethod::IoUring,
            ReadMethod::Auto => ReadMethod::Threads,
            m => m,
        };
        if method == ReadMethod::IoUring && !io_uring_available() {
            return (ReadMethod::Threads, direct);
        }
        (method, direct)
    }

    /// The `O_DIRECT` description, opened once; `None` if the file system refuses it.
    fn direct_file(&self) -> Result<Option<&File>, StorageError> {
        if let Some(d) = self.direct.get() {
            return Ok(d.as_ref());
        }
        let opened = sys::reopen_direct(&self.file, &self.path, false)
            .map_err(|e| StorageError::io(&self.path, "open (O_DIRECT)", e))?;
        Ok(self.direct.get_or_init(|| opened).as_ref())
    }

    fn check_range(&self, offset: u64, len: usize) -> Result<(), StorageError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(()),
            end => Err(StorageError::ShortFile {
                path: self.path.clone(),
                offset,
                end: end.unwrap_or(u64::MAX),
                file_len: self.len,
            }),
        }
    }

    /// Reads exactly `dst.len()` bytes at `offset` with buffered `pread`s: retries interrupted
    /// calls, continues after short reads; the end of the file first is
    /// [`StorageError::ShortFile`].
    fn read_buffered(&self, dst: &mut [u8], offset: u64) -> Result<(), StorageError> {
        let mut done = 0usize;
        while done < dst.len() {
            match self.file.read_at(&mut dst[done..], offset + done as u64) {
                Ok(0) => {
                    // Truncated since it was opened: report the length it has now.
                    let now = self.file.metadata().map_or(self.len, |m| m.len());
                    return Err(StorageError::ShortFile {
                        path: self.path.clone(),
                        offset,
                        end: offset + dst.len() as u64,
                        file_len: now,
                    });
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(StorageError::io(&self.path, "read", e)),
            }
        }
        Ok(())
    }

    fn chunk_size(opts: &IoOptions<'_>) -> usize {
        if opts.chunk_size == 0 {
            DEFAULT_CHUNK
        } else {
            opts.chunk_size
        }
    }

    fn block_size(&self) -> usize {
        aligned_size(self.cfg.block_size, MAX_BLOCK)
    }
}

/// One `read_ranges` call in progress.
struct Run<'f, 'o, 'h> {
    file: &'f PosixFile,
    opts: &'o IoOptions<'h>,
    /// The `O_DIRECT` descriptor when this call bypasses the cache.
    direct_fd: Option<BorrowedFd<'f>>,
    /// The file system refused an `O_DIRECT` read (`EINVAL`) during this call.
    refused: AtomicBool,
    /// Buffered reads of a file mostly not in the page cache: read ahead of the readers.
    read_ahead: bool,
}

impl Run<'_, '_, '_> {
    fn bypass(&self) -> Option<BorrowedFd<'_>> {
        self.direct_fd.filter(|_| !self.refused.load(Ordering::Relaxed))
    }

    /// Finishes one piece given the result of its read into `target` (for direct pieces) or
    /// into `bounce` (for bounce pieces): copies out of the bounce buffer, and completes short
    /// or refused reads with buffered `pread`s. `target` is exactly the piece's part of the
    /// chunk.
    fn finish_piece(
        &self,
        piece: &Piece,
        result: io::Result<usize>,
        target: &mut [u8],
        bounce: &[u8],
        direct: bool,
    ) -> Result<(), StorageError> {
        let (_, _, file_off) = piece.target();
        let n = match result {
            Ok(n) => n,
            Err(e) if direct && e.raw_os_error() == Some(Errno::EINVAL as i32) => {
                // The file system took O_DIRECT at open but will not read with it.
                self.refused.store(true, Ordering::Relaxed);
                return self.file.read_buffered(target, file_off);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted || e.raw_os_error() == Some(Errno::EAGAIN as i32) => {
                return self.file.read_buffered(target, file_off);
            }
            Err(e) => return Err(StorageError::io(&self.file.path, "read", e)),
        };
        match *piece {
            Piece::Direct { len, .. } => {
                if n >= len {
                    Ok(())
                } else {
                    // Short (the file shrank, or the kernel stopped early): finish buffered.
                    self.file.read_buffered(&mut target[n..], file_off + n as u64)
                }
            }
            Piece::Bounce { skip, copy_len, .. } => match bounce.get(skip..skip + copy_len) {
                Some(src) if n >= skip + copy_len => {
                    target.copy_from_slice(src);
                    Ok(())
                }
                _ => self.file.read_buffered(target, file_off),
            },
        }
    }

    /// The threaded paths, on [`for_each_chunk`]: buffered `pread` straight into each chunk,
    /// or `O_DIRECT` pieces with a bounce buffer per worker.
    fn threads(&self, requests: Vec<ReadRequest<'_>>) -> Result<(), StorageError> {
        let chunk = PosixFile::chunk_size(self.opts);
        let Some(dfd) = self.direct_fd else {
            let chunks = split_requests(requests, chunk);
            if !self.read_ahead {
                return for_each_chunk(chunks, self.opts, || Ok(()), |_, c| self.file.read_buffered(c.dst, c.offset));
            }
            // A cold file read through the cache: one more thread walks ahead of the readers
            // asking for the chunks they will read next, so the disk sees every read at once
            // instead of the few small ones each blocked `pread` triggers.
            let ranges: Vec<(u64, u64)> = chunks.iter().map(|c| (c.offset, c.dst.len() as u64)).collect();
            let done = AtomicBool::new(false);
            return std::thread::scope(|s| {
                s.spawn(|| self.read_ahead_ranges(&ranges, &done));
                let r = for_each_chunk(chunks, self.opts, || Ok(()), |_, c| self.file.read_buffered(c.dst, c.offset));
                done.store(true, Ordering::Relaxed);
                r
            });
        };
        let block = self.file.block_size();
        let chunks = split_aligned(requests, chunk);
        let direct = DirectFd(dfd);
        for_each_chunk(
            chunks,
            self.opts,
            || Ok(None::<AlignedBuf>),
            |bounce, c| self.threads_direct_chunk(&direct, bounce, block, c),
        )
    }

    /// Asks the kernel to read `ranges` into the page cache, in order, a step at a time,
    /// until they are all asked for or `done` is set (the readers finished or failed).
    fn read_ahead_ranges(&self, ranges: &[(u64, u64)], done: &AtomicBool) {
        for &(offset, len) in ranges {
            let mut at = offset;
            while at < offset + len {
                if done.load(Ordering::Relaxed) || self.opts.check_cancel().is_err() {
                    return;
                }
                let n = READ_AHEAD_STEP.min(offset + len - at);
                // Advisory: if the kernel refuses, the readers read the pages themselves.
                let _ = sys::will_need(&self.file.file, at, n);
                at += n;
            }
        }
    }

    fn threads_direct_chunk(
        &self,
        direct: &DirectFd,
        bounce: &mut Option<AlignedBuf>,
        block: usize,
        c: &mut Chunk<'_>,
    ) -> Result<(), StorageError> {
        if self.bypass().is_none() {
            return self.file.read_buffered(c.dst, c.offset);
        }
        // Where the memory is congruent with the file, one `pread` per aligned run of the chunk
        // (up to MAX_BLOCK): the kernel splits a large O_DIRECT read and queues the pieces at
        // once, where pieces of `block` read one after the other would keep one request in
        // flight per thread. Elsewhere every piece goes through the bounce buffer, `block` at a
        // time.
        let congruent = c.dst.as_ptr() as u64 % crate::plan::ALIGN == c.offset % crate::plan::ALIGN;
        let piece = if congruent { MAX_BLOCK } else { block };
        let pieces = plan_direct(c.offset, c.dst.as_ptr() as usize, c.dst.len(), piece);
        for piece in &pieces {
            let (dst_off, n, _) = piece.target();
            let target = &mut c.dst[dst_off..dst_off + n];
            if self.bypass().is_none() {
                self.file.read_buffered(target, piece.target().2)?;
                continue;
            }
            match *piece {
                Piece::Direct { offset, .. } => {
                    let res = direct.pread(target, offset);
                    self.finish_piece(piece, res, target, &[], true)?;
                }
                Piece::Bounce { offset, len, .. } => {
                    let buf = bounce.get_or_insert_with(|| AlignedBuf::new(block));
                    let res = direct.pread(&mut buf.as_mut_slice()[..len], offset);
                    self.finish_piece(piece, res, target, buf.as_slice(), true)?;
                }
            }
        }
        Ok(())
    }

    /// The io_uring paths. Sets up one ring per worker first; if that fails, falls back to the
    /// threaded path. Returns the method actually used.
    fn uring(&self, requests: Vec<ReadRequest<'_>>) -> Result<ReadMethod, StorageError> {
        let chunk = PosixFile::chunk_size(self.opts);
        let chunks =
            if self.direct_fd.is_some() { split_aligned(requests, chunk) } else { split_requests(requests, chunk) };
        if chunks.is_empty() {
            self.opts.check_cancel()?;
            return Ok(ReadMethod::IoUring);
        }
        let total: u64 = chunks.iter().map(|c| c.dst.len() as u64).sum();
        let largest = chunks.iter().map(|c| c.dst.len()).max().unwrap_or(1);
        let workers = self.opts.worker_count(total, largest).min(chunks.len());
        let mut rings = Vec::with_capacity(workers);
        for _ in 0..workers {
            match Ring::new(self.file.cfg.queue_depth) {
                Ok(r) => rings.push(r),
                Err(_) => {
                    // Forbidden here (seccomp, a container policy, memlock): use threads.
                    drop(rings);
                    let requests = chunks.into_iter().map(|c| ReadRequest { offset: c.offset, dst: c.dst }).collect();
                    self.threads(requests)?;
                    return Ok(ReadMethod::Threads);
                }
            }
        }
        let queue = Mutex::new(chunks.into_iter());
        run_workers(rings, |mut ring, stop| {
            let mut source = Queue { queue: &queue, failed: stop, opts: self.opts };
            UringWorker::new(self, &mut ring).run(&mut source)
        })?;
        Ok(ReadMethod::IoUring)
    }
}

/// A borrowed `O_DIRECT` descriptor (owned by the [`PosixFile`], which outlives every use).
struct DirectFd<'f>(BorrowedFd<'f>);

impl DirectFd<'_> {
    /// One `pread`, retried when interrupted.
    fn pread(&self, dst: &mut [u8], offset: u64) -> io::Result<usize> {
        // `off_t`, whatever its width on the target.
        let Ok(off) = offset.try_into() else {
            return Err(Errno::EINVAL.into());
        };
        loop {
            match nix::sys::uio::pread(self.0, dst, off) {
                Err(Errno::EINTR) => continue,
                r => return r.map_err(io::Error::from),
            }
        }
    }
}

/// A chunk being read by a ring: its pieces, how many are submitted and how many pending.
///
/// The chunk's `&'c mut [u8]` is taken apart into `base` and `len` when the chunk starts: the
/// kernel and the bounce copies write through `base` while pieces are in flight, and the slice
/// is rebuilt only once every piece is done (for the hook).
struct Active<'c> {
    offset: u64,
    base: *mut u8,
    len: usize,
    _dst: PhantomData<&'c mut [u8]>,
    fd: RawFd,
    direct: bool,
    pieces: Vec<Piece>,
    next: usize,
    pending: usize,
    /// The source's name for the chunk ([`Next::Chunk`]).
    tag: usize,
    /// The registered buffer the chunk's memory lies in.
    fixed: Option<u16>,
}

/// What a [`Source`] gives a ring to read next.
enum Next<'c> {
    /// A chunk, with the source's name for it and the index of the registered buffer its
    /// memory lies in, if any.
    Chunk { chunk: Chunk<'c>, tag: usize, fixed: Option<u16> },
    /// Nothing yet: ask again after a completion.
    Later,
    /// Nothing more.
    End,
}

/// Where a ring's chunks come from and where they go once read.
trait Source<'c> {
    /// The next chunk. `wait`: nothing is in flight, so block until there is one (never
    /// answer [`Next::Later`]).
    fn next(&mut self, wait: bool) -> Result<Next<'c>, StorageError>;
    /// Every byte of `chunk` is in.
    fn done(&mut self, chunk: Chunk<'c>, tag: usize) -> Result<(), StorageError>;
}

/// The chunks of one `read_ranges` call, shared by its workers: the hook and the progress
/// counter see each chunk once it is complete.
struct Queue<'q, 'c, 'o, 'h> {
    queue: &'q Mutex<std::vec::IntoIter<Chunk<'c>>>,
    failed: &'q AtomicBool,
    opts: &'o IoOptions<'h>,
}

impl<'c> Source<'c> for Queue<'_, 'c, '_, '_> {
    fn next(&mut self, _wait: bool) -> Result<Next<'c>, StorageError> {
        if self.failed.load(Ordering::Relaxed) {
            return Ok(Next::End);
        }
        self.opts.check_cancel()?;
        Ok(match self.queue.lock().unwrap_or_else(|p| p.into_inner()).next() {
            Some(chunk) => Next::Chunk { chunk, tag: 0, fixed: None },
            None => Next::End,
        })
    }

    fn done(&mut self, chunk: Chunk<'c>, _tag: usize) -> Result<(), StorageError> {
        self.opts.chunk_read(chunk.offset, chunk.dst)
    }
}

/// A request in flight.
struct InFlight {
    slot: usize,
    piece: Piece,
    bounce: Option<usize>,
}

/// One worker thread's ring and everything the kernel may write into.
struct UringWorker<'r, 'f, 'o, 'h, 'c> {
    run: &'r Run<'f, 'o, 'h>,
    ring: &'r mut Ring,
    block: usize,
    /// Bounce buffers, allocated on demand, at most one per request in flight.
    bounce: Vec<AlignedBuf>,
    free_bounce: Vec<usize>,
    inflight: Vec<Option<InFlight>>,
    free_ids: Vec<usize>,
    active: Vec<Option<Active<'c>>>,
    free_slots: Vec<usize>,
}

impl Drop for UringWorker<'_, '_, '_, '_, '_> {
    fn drop(&mut self) {
        // Before the bounce buffers are freed and before the destinations' borrows end (also on
        // unwinding out of a hook), wait for everything the kernel may still be writing.
        self.ring.drain();
    }
}

impl<'r, 'f, 'o, 'h, 'c> UringWorker<'r, 'f, 'o, 'h, 'c> {
    fn new(run: &'r Run<'f, 'o, 'h>, ring: &'r mut Ring) -> Self {
        UringWorker {
            run,
            ring,
            block: run.file.block_size(),
            bounce: Vec::new(),
            free_bounce: Vec::new(),
            inflight: Vec::new(),
            free_ids: Vec::new(),
            active: Vec::new(),
            free_slots: Vec::new(),
        }
    }

    /// Starts a chunk: plans its pieces. A chunk in a registered buffer is read in as few
    /// requests as the plan allows (the kernel splits a large one and queues its parts at once).
    fn activate(&mut self, chunk: Chunk<'c>, tag: usize, fixed: Option<u16>) -> usize {
        let (fd, direct) = match self.run.bypass() {
            Some(fd) => (fd.as_raw_fd(), true),
            None => (self.run.file.file.as_raw_fd(), false),
        };
        let (offset, len, base) = (chunk.offset, chunk.dst.len(), chunk.dst.as_mut_ptr());
        let congruent = base as u64 % crate::plan::ALIGN == offset % crate::plan::ALIGN;
        let block = if fixed.is_some() && congruent { MAX_BLOCK } else { self.block };
        let pieces =
            if direct { plan_direct(offset, base as usize, len, block) } else { plan_buffered(offset, len, block) };
        let a = Active { offset, base, len, _dst: PhantomData, fd, direct, pieces, next: 0, pending: 0, tag, fixed };
        match self.free_slots.pop() {
            Some(i) => {
                self.active[i] = Some(a);
                i
            }
            None => {
                self.active.push(Some(a));
                self.active.len() - 1
            }
        }
    }

    /// Queues the next piece of the chunk in `slot`. Returns true when that was its last.
    fn submit_next(&mut self, slot: usize) -> Result<bool, StorageError> {
        let Some(a) = self.active.get_mut(slot).and_then(Option::as_mut) else {
            return Ok(true);
        };
        let Some(&piece) = a.pieces.get(a.next) else {
            return Ok(true);
        };
        let fixed = a.fixed;
        let (buf, len, offset, bounce) = match piece {
            Piece::Direct { offset, dst_off, len } => {
                // SAFETY: `dst_off + len <= chunk.dst.len()` (the plan stays inside the chunk),
                // so the pointer stays inside the destination.
                (unsafe { a.base.add(dst_off) }, len, offset, None)
            }
            Piece::Bounce { offset, len, .. } => {
                let b = match self.free_bounce.pop() {
                    Some(b) => b,
                    None => {
                        self.bounce.push(AlignedBuf::new(self.block));
                        self.bounce.len() - 1
                    }
                };
                (self.bounce[b].as_mut_ptr(), len, offset, Some(b))
            }
        };
        let fd = a.fd;
        let last = a.next + 1 == a.pieces.len();
        let id = match self.free_ids.pop() {
            Some(i) => i,
            None => {
                self.inflight.push(None);
                self.inflight.len() - 1
            }
        };
        let Ok(len32) = u32::try_from(len) else {
            return Err(StorageError::io(&self.run.file.path, "read", Errno::EINVAL.into()));
        };
        // SAFETY: `buf` is either this piece's own part of the destination (disjoint from every
        // other piece, and not touched by Rust until the chunk completes: see `Active::base`),
        // or a bounce buffer taken off the free list, used by no other request. Both outlive
        // the request: destinations are borrowed for the whole call, bounce buffers belong to
        // `self`, and `Drop` waits for the ring to drain before either goes away. `fd` is owned
        // by the `PosixFile`, which outlives the call. A piece read into the chunk's memory lies
        // inside it, so inside the registered buffer the source named for the chunk (the
        // source guarantees that buffer is this memory).
        let pushed = unsafe {
            match (fixed, bounce) {
                (Some(index), None) => self.ring.push_read_fixed(fd, buf, len32, offset, index, id as u64),
                _ => self.ring.push_read(fd, buf, len32, offset, id as u64),
            }
        };
        if let Err(e) = pushed {
            self.free_ids.push(id);
            if let Some(b) = bounce {
                self.free_bounce.push(b);
            }
            return Err(StorageError::io(&self.run.file.path, "read (io_uring)", e));
        }
        self.inflight[id] = Some(InFlight { slot, piece, bounce });
        if let Some(a) = self.active.get_mut(slot).and_then(Option::as_mut) {
            a.next += 1;
            a.pending += 1;
        }
        Ok(last)
    }

    /// Handles one completion. Returns the chunk, and its tag, if it is now complete.
    fn complete(&mut self, id: u64, res: i32, skip_work: bool) -> Result<Option<(Chunk<'c>, usize)>, StorageError> {
        let Some(f) = usize::try_from(id).ok().and_then(|i| self.inflight.get_mut(i)).and_then(Option::take) else {
            return Ok(None);
        };
        self.free_ids.push(id as usize);
        let Some(a) = self.active.get_mut(f.slot).and_then(Option::as_mut) else {
            return Ok(None);
        };
        a.pending -= 1;
        let result = if skip_work {
            Ok(())
        } else {
            let (dst_off, n, _) = f.piece.target();
            // SAFETY: the kernel is done with this piece (its completion is here); its target
            // range lies inside the destination and is disjoint from every other piece's, so
            // no other reference to these bytes exists while this one lives.
            let target = unsafe { std::slice::from_raw_parts_mut(a.base.add(dst_off), n) };
            let res = if res < 0 { Err(io::Error::from_raw_os_error(-res)) } else { Ok(res as usize) };
            let bounce = f.bounce.and_then(|b| self.bounce.get(b)).map_or(&[][..], AlignedBuf::as_slice);
            self.run.finish_piece(&f.piece, res, target, bounce, a.direct)
        };
        if let Some(b) = f.bounce {
            self.free_bounce.push(b);
        }
        let done = a.pending == 0 && a.next == a.pieces.len();
        result?;
        if !done {
            return Ok(None);
        }
        self.free_slots.push(f.slot);
        Ok(self.active[f.slot].take().map(|a| {
            let chunk = Chunk {
                offset: a.offset,
                // SAFETY: `base` and `len` come from the chunk's `&'c mut [u8]`, which was given
                // up in `activate`; every piece is complete, so neither the kernel nor any other
                // reference touches these bytes any more.
                dst: unsafe { std::slice::from_raw_parts_mut(a.base, a.len) },
            };
            (chunk, a.tag)
        }))
    }

    /// Keeps the ring full with pieces of chunks pulled from `source` until they run out, an
    /// error occurs, or the caller cancels; hands each chunk back to `source` once complete;
    /// then waits for everything in flight.
    fn run(mut self, source: &mut dyn Source<'c>) -> Result<(), StorageError> {
        let mut current: Option<usize> = None;
        let mut exhausted = false;
        let mut error: Option<StorageError> = None;
        let mut cqes = Vec::with_capacity(self.ring.depth());
        loop {
            while error.is_none() && self.ring.in_flight() < self.ring.depth() {
                let slot = match current {
                    Some(s) => s,
                    None => {
                        if exhausted {
                            break;
                        }
                        match source.next(self.ring.in_flight() == 0) {
                            Ok(Next::Chunk { chunk, tag, fixed }) => self.activate(chunk, tag, fixed),
                            Ok(Next::Later) => break,
                            Ok(Next::End) => {
                                exhausted = true;
                                break;
                            }
                            Err(e) => {
                                error = Some(e);
                                break;
                            }
                        }
                    }
                };
                match self.submit_next(slot) {
                    Ok(true) => current = None,
                    Ok(false) => current = Some(slot),
                    Err(e) => error = Some(e),
                }
            }
            if self.ring.in_flight() == 0 {
                if exhausted || error.is_some() {
                    break;
                }
                // A source answered `Later` with nothing in flight: ask again, waiting.
                continue;
            }
            if let Err(e) = self.ring.submit_and_wait() {
                error.get_or_insert(StorageError::io(&self.run.file.path, "read (io_uring)", e));
                self.ring.drain();
                break;
            }
            self.ring.reap(&mut cqes);
            for (id, res) in cqes.drain(..) {
                match self.complete(id, res, error.is_some()) {
                    Ok(Some((chunk, tag))) if error.is_none() => {
                        if let Err(e) = source.done(chunk, tag) {
                            error = Some(e);
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        error.get_or_insert(e);
                    }
                }
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl StorageFile for PosixFile {
    fn path(&self) -> &Path {
        &self.path
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn reader(&self) -> Result<Box<dyn RangeReader + '_>, StorageError> {
        Ok(Box::new(PosixReader { file: self }))
    }

    fn read_ranges(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<(), StorageError> {
        self.read_ranges_report(requests, opts).map(|_| ())
    }

    fn read_ranges_reported(
        &self,
        requests: Vec<ReadRequest<'_>>,
        opts: &IoOptions<'_>,
    ) -> Result<turboio_storage::ReadInfo, StorageError> {
        let r = self.read_ranges_report(requests, opts)?;
        Ok(turboio_storage::ReadInfo {
            method: match r.method {
                ReadMethod::IoUring => "io_uring",
                _ => "threads",
            },
            direct: r.direct,
            direct_refused: r.direct_refused,
        })
    }

    fn reads_into_slots(&self, opts: &IoOptions<'_>) -> bool {
        opts.direct == DirectIo::On
            && self.cfg.method != ReadMethod::Threads
            && io_uring_available()
            && !self.refused_at_read.load(Ordering::Relaxed)
            && matches!(self.direct_file(), Ok(Some(_)))
    }

    fn read_into_slots(
        &self,
        feed: &mut dyn SlotFeed,
        opts: &IoOptions<'_>,
    ) -> Result<turboio_storage::ReadInfo, StorageError> {
        let direct = match self.direct_file() {
            Ok(Some(direct)) if self.reads_into_slots(opts) => direct,
            _ => return read_into_slots_one_by_one(self, feed, opts),
        };
        let slots: Vec<SlotMemory> = (0..feed.slots()).map(|i| feed.slot_memory(i)).collect();
        // Every slot's read in flight, and room for the bounce pieces of unaligned ones.
        let depth = u32::try_from(slots.len().saturating_mul(2)).unwrap_or(u32::MAX).clamp(16, 1024);
        let Ok(mut lease) = crate::slots::take(depth, &slots) else {
            // No ring here (seccomp, a container policy): one slot at a time.
            return read_into_slots_one_by_one(self, feed, opts);
        };
        let fixed = lease.index.iter().any(Option::is_some);
        let run = Run {
            file: self,
            opts,
            direct_fd: Some(direct.as_fd()),
            refused: AtomicBool::new(false),
            read_ahead: false,
        };
        let index = std::mem::take(&mut lease.index);
        let result = {
            let mut source = Fed { file: self, feed, index: &index, opts };
            UringWorker::new(&run, &mut lease.ring).run(&mut source)
        };
        crate::slots::give_back(lease);
        let refused = run.refused.load(Ordering::Relaxed);
        if refused {
            self.refused_at_read.store(true, Ordering::Relaxed);
        }
        result?;
        Ok(turboio_storage::ReadInfo {
            method: if fixed { "io_uring, registered buffers" } else { "io_uring" },
            direct: !refused,
            direct_refused: refused,
        })
    }

    fn local_file(&self) -> Option<&File> {
        Some(&self.file)
    }

    fn cached_fraction(&self) -> Option<f64> {
        sys::cached_fraction(&self.file, self.len)
    }

    fn will_need(&self, offset: u64, len: u64) {
        let len = len.min(self.len.saturating_sub(offset));
        if len > 0 {
            // Advisory: if the kernel refuses, the readers read the pages themselves.
            let _ = sys::will_need(&self.file, offset, len);
        }
    }
}

/// The chunks of a [`SlotFeed`] as a ring's [`Source`]: each read the feed asks for becomes a
/// chunk over its slot's memory, named by the slot, and the feed is told once it is in.
struct Fed<'a, 'o, 'h> {
    file: &'a PosixFile,
    feed: &'a mut dyn SlotFeed,
    /// Each slot's registered buffer, if any.
    index: &'a [Option<u16>],
    opts: &'o IoOptions<'h>,
}

impl<'a> Source<'a> for Fed<'a, '_, '_> {
    fn next(&mut self, wait: bool) -> Result<Next<'a>, StorageError> {
        self.opts.check_cancel()?;
        let (slot, offset, len) = match self.feed.next(wait)? {
            SlotRead::Read { slot, offset, len } => (slot, offset, len),
            SlotRead::Later if !wait => return Ok(Next::Later),
            SlotRead::Later => {
                return Err(StorageError::Unsupported {
                    backend: "posix",
                    what: "a slot feed that answers `Later` when told to wait".into(),
                })
            }
            SlotRead::End => return Ok(Next::End),
        };
        // The same memory as registered: a feed's slots stay put for the whole call.
        let mem = slot_target(&*self.feed, slot, len, &self.file.path)?;
        self.file.check_range(offset, len)?;
        // SAFETY: the `SlotFeed` contract: the slot's memory is valid for writes of `mem.len >=
        // len` bytes for the whole call, and nothing but this read touches it until `filled` is
        // called for it (in `done`, once every piece is in), nor is it handed out again before.
        let dst = unsafe { std::slice::from_raw_parts_mut(mem.ptr, len) };
        Ok(Next::Chunk { chunk: Chunk { offset, dst }, tag: slot, fixed: self.index.get(slot).copied().flatten() })
    }

    fn done(&mut self, chunk: Chunk<'a>, slot: usize) -> Result<(), StorageError> {
        self.opts.chunk_read(chunk.offset, chunk.dst)?;
        self.feed.filled(slot, chunk.offset, chunk.dst.len())
    }
}

/// A thread's reader: buffered `pread`s on the shared descriptor.
struct PosixReader<'f> {
    file: &'f PosixFile,
}

impl RangeReader for PosixReader<'_> {
    fn read_exact_at(&mut self, offset: u64, dst: &mut [u8]) -> Result<(), StorageError> {
        self.file.check_range(offset, dst.len())?;
        self.file.read_buffered(dst, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turboio_storage::conformance::pattern;

    fn fixture() -> (tempfile::TempDir, PosixFile, Vec<u8>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.bin");
        let data = pattern(20_000, 1);
        std::fs::write(&path, &data).unwrap();
        let f = PosixFile::open(&path, PosixConfig::default()).unwrap();
        (dir, f, data)
    }

    /// `EINVAL` from an `O_DIRECT` read (a file system that accepted the open but will not
    /// read) falls back to buffered reads and is remembered.
    #[test]
    fn einval_at_read_falls_back_to_buffered() {
        let (_dir, f, data) = fixture();
        let opts = IoOptions::default();
        let run = Run {
            file: &f,
            opts: &opts,
            direct_fd: Some(f.file.as_fd()),
            refused: AtomicBool::new(false),
            read_ahead: false,
        };
        let piece = Piece::Direct { offset: 4096, dst_off: 0, len: 4096 };
        let mut target = vec![0u8; 4096];
        let einval = Err(Errno::EINVAL.into());
        run.finish_piece(&piece, einval, &mut target, &[], true).unwrap();
        assert_eq!(target, data[4096..8192]);
        assert!(run.refused.load(Ordering::Relaxed));
        assert!(run.bypass().is_none());
    }

    /// Short reads are completed with buffered reads; other errors name the file.
    #[test]
    fn short_reads_complete_and_errors_name_the_file() {
        let (_dir, f, data) = fixture();
        let opts = IoOptions::default();
        let run = Run { file: &f, opts: &opts, direct_fd: None, refused: AtomicBool::new(false), read_ahead: false };
        // A direct piece that got only its first 100 bytes.
        let piece = Piece::Direct { offset: 8192, dst_off: 0, len: 8192 };
        let mut target = vec![0u8; 8192];
        target[..100].copy_from_slice(&data[8192..8292]);
        run.finish_piece(&piece, Ok(100), &mut target, &[], true).unwrap();
        assert_eq!(target, data[8192..16384]);
        // A bounce piece whose read stopped before the wanted bytes.
        let piece = Piece::Bounce { offset: 16384, len: 4096, skip: 5, dst_off: 0, copy_len: 100 };
        let mut target = vec![0u8; 100];
        run.finish_piece(&piece, Ok(10), &mut target, &[0u8; 4096], true).unwrap();
        assert_eq!(target, data[16389..16489]);
        // The bounce read came back complete: copied from the bounce buffer.
        let mut bounce = vec![0u8; 4096];
        bounce[5..105].fill(7);
        run.finish_piece(&piece, Ok(4096), &mut target, &bounce, true).unwrap();
        assert!(target.iter().all(|&b| b == 7));
        // Past the end of the file, even when the kernel said "short".
        let piece = Piece::Direct { offset: 16384, dst_off: 0, len: 8192 };
        let mut target = vec![0u8; 8192];
        let err = run.finish_piece(&piece, Ok(0), &mut target, &[], true).unwrap_err();
        assert!(matches!(err, StorageError::ShortFile { .. }), "{err:?}");
        let eio = Err(Errno::EIO.into());
        let err = run.finish_piece(&piece, eio, &mut target, &[], true).unwrap_err();
        assert!(err.to_string().contains("f.bin"), "{err}");
        assert!(!run.refused.load(Ordering::Relaxed));
    }
}
