//! The pinned staging pool: host buffers kept across loads.
//!
//! # What is pinned, when, and how much
//!
//! A staged load (a GPU, the test and model devices) reads the file into host *slots* and has
//! the device copy each slot as soon as it is full. On a GPU the slots must be page-locked
//! (pinned), and pinning is slow: the H200 VMs measured about 2 GB/s, so pinning 256 MiB costs
//! about 0.13 s, as much as loading a 1 GB hot file at the link's speed. So slots are pinned
//! **once per process and device** and kept:
//!
//! - A load takes `readers x slots per reader` slots of `chunk` bytes (defaults: one reader per
//!   core, 3 slots each, 8 MiB: 48 MiB on 2 cores, 384 MiB on 16), allocating a slot only when
//!   the pool has no free one of that size, and gives every slot back when it ends. Each reader
//!   pins its own slots as it first needs them, so a new process's pinning overlaps the other
//!   readers' reads; every later load pins nothing.
//! - The pool keeps at most [`StagingPool::max_buffers`] free slots (default
//!   [`DEFAULT_MAX_BUFFERS`], enough for 16 readers of 4 slots); a load never takes more slots
//!   than that, so a steady-state load never pins.
//! - [`StagingPool::release`] frees every free slot now (e.g. before a phase that wants the
//!   host memory); [`StagingPool::set_max_buffers`] resizes it. Cold loads that bypass the page
//!   cache also register the slots with the local storage's io_uring, once (the kernel then
//!   holds their pages until the registration is dropped); `turboio::posix::release_registered_slots`
//!   drops it, and the Python pool's `release()` calls both.
//! - Buffers are never zeroed by turboio: the CUDA device maps fresh anonymous memory (zero
//!   pages from the kernel) and registers it, the test devices use plain anonymous memory.
//!
//! The CUDA device keeps one pool per ordinal per process (every `CudaDevice` of that ordinal
//! shares it, so does the Python package's every call); [`Device::staging_pool`](crate::Device::staging_pool)
//! gives it to callers that size or release it.

use crate::{HostBuffer, Result, Staging};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Free slots a pool keeps by default: 16 readers of 4 slots.
pub const DEFAULT_MAX_BUFFERS: usize = 64;

struct Inner {
    free: Mutex<Vec<Staging>>,
    max_buffers: AtomicUsize,
    allocations: AtomicUsize,
    allocated_bytes: AtomicUsize,
    reuses: AtomicUsize,
    /// Bytes of every buffer the pool made that is alive (free or taken).
    live_bytes: Arc<AtomicUsize>,
}

/// Host staging buffers kept for reuse across loads (veTurboIO's `init_io_helper` for GPUs);
/// see the module docs for what is pinned and when.
///
/// A buffer is handed out for any length up to its capacity; the pool keeps at most
/// [`max_buffers`](Self::max_buffers) free buffers (the largest). Cloning shares the pool.
#[derive(Clone)]
pub struct StagingPool {
    inner: Arc<Inner>,
}

impl fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingPool")
            .field("free_buffers", &self.free_buffers())
            .field("max_buffers", &self.max_buffers())
            .field("live_bytes", &self.live_bytes())
            .finish()
    }
}

impl Default for StagingPool {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_BUFFERS)
    }
}

/// A buffer the pool made: counts its bytes out of the pool's live bytes when it is freed.
struct Counted {
    buf: Staging,
    live: Arc<AtomicUsize>,
}

impl fmt::Debug for Counted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.buf.fmt(f)
    }
}

impl HostBuffer for Counted {
    fn as_slice(&self) -> &[u8] {
        self.buf.as_slice()
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.buf.as_mut_slice()
    }

    fn serial(&self) -> Option<u64> {
        self.buf.serial()
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.live.fetch_sub(self.buf.as_slice().len(), Ordering::Relaxed);
    }
}

impl StagingPool {
    /// A pool keeping at most `max_buffers` free buffers.
    pub fn new(max_buffers: usize) -> Self {
        StagingPool {
            inner: Arc::new(Inner {
                free: Mutex::new(Vec::new()),
                max_buffers: AtomicUsize::new(max_buffers),
                allocations: AtomicUsize::new(0),
                allocated_bytes: AtomicUsize::new(0),
                reuses: AtomicUsize::new(0),
                live_bytes: Arc::new(AtomicUsize::new(0)),
            }),
        }
    }

    /// A free buffer of at least `len` bytes (the smallest that fits), or a new one from `alloc`.
    /// The buffer returns to the pool when dropped.
    pub fn take(&self, len: usize, alloc: impl FnOnce(usize) -> Result<Staging>) -> Result<PooledStaging> {
        let found = {
            let mut free = self.inner.free.lock().unwrap_or_else(|p| p.into_inner());
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.as_slice().len() >= len)
                .min_by_key(|(_, b)| b.as_slice().len())
                .map(|(i, _)| i);
            best.map(|i| free.swap_remove(i))
        };
        let buf = match found {
            Some(b) => {
                self.inner.reuses.fetch_add(1, Ordering::Relaxed);
                b
            }
            None => {
                let b = alloc(len)?;
                let n = b.as_slice().len();
                self.inner.allocations.fetch_add(1, Ordering::Relaxed);
                self.inner.allocated_bytes.fetch_add(n, Ordering::Relaxed);
                self.inner.live_bytes.fetch_add(n, Ordering::Relaxed);
                Box::new(Counted { buf: b, live: self.inner.live_bytes.clone() })
            }
        };
        Ok(PooledStaging { buf: Some(buf), pool: Some(self.clone()) })
    }

    fn give(&self, buf: Staging) {
        let mut free = self.inner.free.lock().unwrap_or_else(|p| p.into_inner());
        free.push(buf);
        let max = self.max_buffers();
        if free.len() > max {
            free.sort_by_key(|b| std::cmp::Reverse(b.as_slice().len()));
            free.truncate(max);
        }
    }

    /// The most free buffers kept (a load takes at most this many).
    pub fn max_buffers(&self) -> usize {
        self.inner.max_buffers.load(Ordering::Relaxed)
    }

    /// Keeps at most `n` free buffers from now on (frees the smallest beyond that now).
    pub fn set_max_buffers(&self, n: usize) {
        self.inner.max_buffers.store(n, Ordering::Relaxed);
        let mut free = self.inner.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() > n {
            free.sort_by_key(|b| std::cmp::Reverse(b.as_slice().len()));
            free.truncate(n);
        }
    }

    /// Free buffers held now.
    pub fn free_buffers(&self) -> usize {
        self.inner.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Free buffers of at least `len` bytes held now (what a load of that chunk size can take
    /// without allocating).
    pub fn free_buffers_of(&self, len: usize) -> usize {
        self.inner.free.lock().unwrap_or_else(|p| p.into_inner()).iter().filter(|b| b.as_slice().len() >= len).count()
    }

    /// Bytes held by free buffers.
    pub fn free_bytes(&self) -> usize {
        self.inner.free.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|b| b.as_slice().len()).sum()
    }

    /// Bytes of every buffer this pool made that is still alive, free or taken (the pinned
    /// memory it holds on a GPU).
    pub fn live_bytes(&self) -> usize {
        self.inner.live_bytes.load(Ordering::Relaxed)
    }

    /// Buffers allocated through the pool so far (not reused).
    pub fn allocations(&self) -> usize {
        self.inner.allocations.load(Ordering::Relaxed)
    }

    /// Bytes allocated through the pool so far.
    pub fn allocated_bytes(&self) -> usize {
        self.inner.allocated_bytes.load(Ordering::Relaxed)
    }

    /// Buffers handed out again from the free list so far.
    pub fn reuses(&self) -> usize {
        self.inner.reuses.load(Ordering::Relaxed)
    }

    /// Frees every free buffer (buffers taken now come back, and are kept, when their loads
    /// end).
    pub fn release(&self) {
        self.inner.free.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Frees every free buffer (the older name of [`release`](Self::release)).
    pub fn clear(&self) {
        self.release()
    }
}

/// A staging buffer that goes back to its pool when dropped.
#[derive(Debug)]
pub struct PooledStaging {
    buf: Option<Staging>,
    pool: Option<StagingPool>,
}

impl PooledStaging {
    /// A buffer that belongs to no pool.
    pub fn unpooled(buf: Staging) -> Self {
        PooledStaging { buf: Some(buf), pool: None }
    }
}

impl HostBuffer for PooledStaging {
    fn as_slice(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], |b| b.as_slice())
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.buf.as_mut().map_or(&mut [], |b| b.as_mut_slice())
    }

    fn serial(&self) -> Option<u64> {
        self.buf.as_ref().and_then(|b| b.serial())
    }
}

impl Drop for PooledStaging {
    fn drop(&mut self) {
        if let (Some(buf), Some(pool)) = (self.buf.take(), self.pool.take()) {
            pool.give(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Arena;

    fn arena(len: usize) -> Result<Staging> {
        Ok(Box::new(Arena::new(len, false)?))
    }

    #[test]
    fn buffers_come_back_and_are_reused() {
        let pool = StagingPool::new(2);
        let a = pool.take(4096, arena).unwrap();
        let b = pool.take(8192, arena).unwrap();
        let a_ptr = a.as_slice().as_ptr();
        assert_eq!((pool.allocations(), pool.free_buffers()), (2, 0));
        drop(a);
        drop(b);
        assert_eq!(pool.free_buffers(), 2);
        let c = pool.take(100, arena).unwrap();
        assert_eq!(c.as_slice().as_ptr(), a_ptr, "the smallest fitting buffer is reused");
        assert_eq!(pool.allocations(), 2);
        assert_eq!(pool.reuses(), 1);
        let d = pool
            .take(1 << 20, |_| Err(crate::DeviceError::Driver { device: crate::DeviceId::CPU, message: "no".into() }));
        assert!(d.is_err(), "allocation errors surface");
        let e = pool.take(1, arena).unwrap();
        let f = pool.take(1, arena).unwrap();
        drop((c, e, f));
        assert_eq!(pool.free_buffers(), 2, "at most max_buffers are kept");
        assert_eq!(pool.live_bytes(), 4096 + 8192, "the two kept buffers are alive, the third was freed");
        pool.release();
        assert_eq!(pool.free_bytes(), 0);
        assert_eq!(pool.live_bytes(), 0, "released buffers are freed");
    }

    #[test]
    fn a_smaller_maximum_frees_the_smallest_free_buffers() {
        let pool = StagingPool::new(4);
        let bufs: Vec<_> = [4096, 8192, 12288].iter().map(|&n| pool.take(n, arena).unwrap()).collect();
        drop(bufs);
        assert_eq!(pool.free_buffers(), 3);
        pool.set_max_buffers(1);
        assert_eq!((pool.free_buffers(), pool.free_bytes(), pool.max_buffers()), (1, 12288, 1));
        assert_eq!(pool.free_buffers_of(8192), 1);
        assert_eq!(pool.allocated_bytes(), 4096 + 8192 + 12288);
    }
}
