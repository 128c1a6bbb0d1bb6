//! Staging buffers kept across loads.

use crate::{HostBuffer, Result, Staging};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

struct Inner {
    free: Mutex<Vec<Staging>>,
    max_buffers: usize,
    allocations: AtomicUsize,
    reuses: AtomicUsize,
}

/// Host staging buffers kept for reuse across loads (veTurboIO's `init_io_helper` for GPUs):
/// pinned memory takes milliseconds per buffer to allocate and register, so a device given a
/// pool takes buffers from it and each buffer comes back when the load drops it.
///
/// A buffer is handed out for any length up to its capacity; the pool keeps at most
/// `max_buffers` free buffers (the largest). Cloning shares the pool.
#[derive(Clone)]
pub struct StagingPool {
    inner: Arc<Inner>,
}

impl fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingPool")
            .field("free_buffers", &self.free_buffers())
            .field("max_buffers", &self.inner.max_buffers)
            .finish()
    }
}

impl Default for StagingPool {
    fn default() -> Self {
        Self::new(16)
    }
}

impl StagingPool {
    /// A pool keeping at most `max_buffers` free buffers.
    pub fn new(max_buffers: usize) -> Self {
        StagingPool {
            inner: Arc::new(Inner {
                free: Mutex::new(Vec::new()),
                max_buffers,
                allocations: AtomicUsize::new(0),
                reuses: AtomicUsize::new(0),
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
                self.inner.allocations.fetch_add(1, Ordering::Relaxed);
                b
            }
        };
        Ok(PooledStaging { buf: Some(buf), pool: Some(self.clone()) })
    }

    fn give(&self, buf: Staging) {
        let mut free = self.inner.free.lock().unwrap_or_else(|p| p.into_inner());
        free.push(buf);
        if free.len() > self.inner.max_buffers {
            free.sort_by_key(|b| std::cmp::Reverse(b.as_slice().len()));
            free.truncate(self.inner.max_buffers);
        }
    }

    /// Free buffers held now.
    pub fn free_buffers(&self) -> usize {
        self.inner.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Bytes held by free buffers.
    pub fn free_bytes(&self) -> usize {
        self.inner.free.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|b| b.as_slice().len()).sum()
    }

    /// Buffers allocated through the pool so far (not reused).
    pub fn allocations(&self) -> usize {
        self.inner.allocations.load(Ordering::Relaxed)
    }

    /// Buffers handed out again from the free list so far.
    pub fn reuses(&self) -> usize {
        self.inner.reuses.load(Ordering::Relaxed)
    }

    /// Frees every free buffer.
    pub fn clear(&self) {
        self.inner.free.lock().unwrap_or_else(|p| p.into_inner()).clear();
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
        pool.clear();
        assert_eq!(pool.free_bytes(), 0);
    }
}
