//! A thin owner of one io_uring that counts what is in flight and never lets go of the ring
//! (or of the memory the kernel writes into) while anything is.

use io_uring::{opcode, types, IoUring};
use nix::errno::Errno;
use std::io;
use std::os::fd::RawFd;
use std::sync::OnceLock;

/// One ring, used by one thread.
pub(crate) struct Ring {
    ring: IoUring,
    depth: usize,
    in_flight: usize,
}

impl Ring {
    /// Sets up a ring for `depth` requests in flight.
    pub(crate) fn new(depth: u32) -> io::Result<Ring> {
        let depth = depth.clamp(1, 4096);
        let ring = IoUring::new(depth.next_power_of_two())?;
        Ok(Ring { ring, depth: depth as usize, in_flight: 0 })
    }

    /// Requests allowed in flight at once.
    pub(crate) fn depth(&self) -> usize {
        self.depth
    }

    /// Requests queued or in flight whose completion has not been reaped.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Queues a read of `len` bytes at `offset` of `fd` into `buf`. It is submitted by the next
    /// [`submit_and_wait`](Self::submit_and_wait), and done once [`reap`](Self::reap) returns
    /// `user_data`.
    ///
    /// # Safety
    ///
    /// `buf` must be valid for writes of `len` bytes, and nothing else may read or write those
    /// bytes, until `reap` has returned the completion tagged `user_data`. `fd` must stay open
    /// until then.
    pub(crate) unsafe fn push_read(
        &mut self,
        fd: RawFd,
        buf: *mut u8,
        len: u32,
        offset: u64,
        user_data: u64,
    ) -> io::Result<()> {
        let entry = opcode::Read::new(types::Fd(fd), buf, len).offset(offset).build().user_data(user_data);
        // SAFETY: the caller's guarantees are `push`'s.
        unsafe { self.push(&entry) }
    }

    /// [`push_read`](Self::push_read) into registered buffer `index`
    /// ([`register_buffers`](Self::register_buffers)): the kernel skips pinning the pages for
    /// this request.
    ///
    /// # Safety
    ///
    /// As `push_read`; and `buf .. buf + len` must lie inside the memory registered as `index`,
    /// which must still be the memory it was when registered.
    pub(crate) unsafe fn push_read_fixed(
        &mut self,
        fd: RawFd,
        buf: *mut u8,
        len: u32,
        offset: u64,
        index: u16,
        user_data: u64,
    ) -> io::Result<()> {
        let entry = opcode::ReadFixed::new(types::Fd(fd), buf, len, index).offset(offset).build().user_data(user_data);
        // SAFETY: the caller's guarantees are `push`'s.
        unsafe { self.push(&entry) }
    }

    /// Registers `bufs` (address, length) as the ring's fixed buffers, in order (replacing any
    /// registered before): the kernel pins their pages once, here, instead of at every request.
    ///
    /// # Safety
    ///
    /// Each buffer must be mapped for its length. The kernel keeps its own references to the
    /// pages until [`unregister_buffers`](Self::unregister_buffers) or the ring is dropped, so
    /// freeing the memory is safe, but the registration then names pages no longer mapped there:
    /// a caller must never read into an index whose memory is gone.
    pub(crate) unsafe fn register_buffers(&mut self, bufs: &[(*mut u8, usize)]) -> io::Result<()> {
        if self.in_flight > 0 {
            return Err(io::Error::other("io_uring buffers registered while requests are in flight"));
        }
        let _ = self.ring.submitter().unregister_buffers();
        let iov: Vec<libc::iovec> =
            bufs.iter().map(|&(p, len)| libc::iovec { iov_base: p.cast(), iov_len: len }).collect();
        // SAFETY: the caller guarantees the memory is mapped; the kernel pins it.
        unsafe { self.ring.submitter().register_buffers(&iov) }
    }

    /// Drops the registration of [`register_buffers`](Self::register_buffers), unpinning the
    /// pages (nothing may be in flight).
    pub(crate) fn unregister_buffers(&mut self) {
        if self.in_flight == 0 {
            let _ = self.ring.submitter().unregister_buffers();
        }
    }

    /// Queues a write of `len` bytes from `buf` at `offset` of `fd`, like
    /// [`push_read`](Self::push_read).
    ///
    /// # Safety
    ///
    /// `buf` must be valid for reads of `len` bytes, and nothing may write those bytes, until
    /// `reap` has returned the completion tagged `user_data`. `fd` must stay open until then.
    pub(crate) unsafe fn push_write(
        &mut self,
        fd: RawFd,
        buf: *const u8,
        len: u32,
        offset: u64,
        user_data: u64,
    ) -> io::Result<()> {
        let entry = opcode::Write::new(types::Fd(fd), buf, len).offset(offset).build().user_data(user_data);
        // SAFETY: the caller's guarantees are `push`'s.
        unsafe { self.push(&entry) }
    }

    /// Queues one entry, handing queued ones to the kernel first if the submission ring is full.
    ///
    /// # Safety
    ///
    /// Every buffer and descriptor the entry refers to must stay valid (and buffers untouched
    /// by anything else) until `reap` has returned its completion.
    unsafe fn push(&mut self, entry: &io_uring::squeue::Entry) -> io::Result<()> {
        if self.in_flight >= self.depth {
            return Err(io::Error::other("io_uring queue is full"));
        }
        // SAFETY: the caller guarantees that what the entry refers to outlives the request; the
        // entry itself is copied into the submission ring.
        let pushed = unsafe { self.ring.submission().push(entry) };
        if pushed.is_err() {
            // The submission ring is full of entries the kernel has not taken yet: hand them
            // over and try once more.
            self.ring.submit()?;
            // SAFETY: as above.
            unsafe { self.ring.submission().push(entry) }
                .map_err(|_| io::Error::other("io_uring submission queue is full"))?;
        }
        self.in_flight += 1;
        Ok(())
    }

    /// Submits what is queued and waits for at least one completion (when anything is in
    /// flight). Interrupted waits are retried.
    pub(crate) fn submit_and_wait(&mut self) -> io::Result<()> {
        let want = usize::from(self.in_flight > 0);
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(Errno::EINTR as i32) => continue,
                // Completions must be reaped first (EBUSY) or the kernel is short of memory
                // for a moment (EAGAIN): the caller reaps and calls again.
                Err(e) if matches!(e.raw_os_error().map(Errno::from_raw), Some(Errno::EBUSY | Errno::EAGAIN)) => {
                    return Ok(())
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Moves every available completion, `(user_data, result)`, into `out`.
    pub(crate) fn reap(&mut self, out: &mut Vec<(u64, i32)>) {
        for cqe in self.ring.completion() {
            out.push((cqe.user_data(), cqe.result()));
            self.in_flight = self.in_flight.saturating_sub(1);
        }
    }

    /// Waits until nothing is in flight, discarding the completions.
    pub(crate) fn drain(&mut self) {
        let mut sink = Vec::new();
        while self.in_flight > 0 {
            if self.submit_and_wait().is_err() {
                // The kernel may still write into buffers we are about to give back, and we
                // cannot wait for it: stopping the process is the only memory-safe way out.
                // (The wait fails only on a broken ring, e.g. EBADF or EFAULT.)
                std::process::abort();
            }
            self.reap(&mut sink);
            sink.clear();
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Also on unwinding: the buffers of requests in flight belong to our callers, so the
        // ring must not go away (closing it does not wait for the kernel) before they are done.
        self.drain();
    }
}

/// True if a ring can be set up and completes a no-op here (probed once).
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let Ok(mut ring) = Ring::new(2) else {
            return false;
        };
        let nop = opcode::Nop::new().build().user_data(7);
        // SAFETY: a no-op references no memory.
        if unsafe { ring.ring.submission().push(&nop) }.is_err() {
            return false;
        }
        ring.in_flight = 1;
        if ring.submit_and_wait().is_err() {
            // Nothing can be in flight if submission failed; the no-op has no buffer anyway.
            ring.in_flight = 0;
            return false;
        }
        let mut out = Vec::new();
        ring.reap(&mut out);
        ring.drain();
        out.first().is_some_and(|&(ud, res)| ud == 7 && res == 0)
    })
}
