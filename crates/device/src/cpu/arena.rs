//! Anonymous arenas (optionally with huge pages) and their pool.

use super::advise_parallel;
use crate::sys::{RawMap, HUGE_PAGE};
use crate::{Allocation, DeviceError, DeviceId, HostBuffer, Result};
use nix::sys::mman::MmapAdvise;
use std::any::Any;
use std::sync::{Arc, Condvar, Mutex};

/// Anonymous memory for one load: 2 MiB aligned with transparent huge pages requested, or
/// page aligned with ordinary pages (see [`default_huge_pages`](super::default_huge_pages)).
///
/// With huge pages its capacity is rounded up to whole huge pages; its length is what the
/// current load uses.
#[derive(Debug)]
pub struct Arena {
    map: RawMap,
    len: usize,
    serial: u64,
}

/// The next [`Arena::serial`]: never reused in a process.
static NEXT_SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Arena {
    /// Maps a new arena of `len` bytes. With `huge_pages`, asks for transparent huge pages
    /// (`MADV_HUGEPAGE`), which this machine's `madvise` THP mode grants only when asked.
    pub fn new(len: usize, huge_pages: bool) -> Result<Arena> {
        let cap = if huge_pages { len.max(1).next_multiple_of(HUGE_PAGE) } else { len.max(1) };
        let align = if huge_pages { HUGE_PAGE } else { 4096 };
        let map = RawMap::anonymous(cap, align).map_err(|source| DeviceError::OutOfMemory {
            device: DeviceId::CPU,
            len,
            source,
        })?;
        if huge_pages {
            // Advisory: a kernel without THP refuses, and 4 KiB pages still work.
            let _ = map.advise(0, map.len(), MmapAdvise::MADV_HUGEPAGE);
        }
        let serial = NEXT_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Arena { map, len, serial })
    }

    /// A number naming this arena's memory for the whole process, never given to another
    /// arena (see [`HostBuffer::serial`]).
    pub fn serial(&self) -> u64 {
        self.serial
    }

    /// Bytes in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if no byte is in use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes mapped.
    pub fn capacity(&self) -> usize {
        self.map.len()
    }

    /// Address of the first byte.
    pub fn addr(&self) -> usize {
        self.map.addr()
    }

    /// Sets the length in use (at most the capacity).
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        crate::check_range(DeviceId::CPU, self.capacity(), 0, len)?;
        self.len = len;
        Ok(())
    }

    /// The bytes in use.
    pub fn as_slice(&self) -> &[u8] {
        &self.map.as_slice()[..self.len]
    }

    /// The bytes in use, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.map.as_mut_slice()[..len]
    }

    /// Faults every page in now, on `threads` threads (`MADV_POPULATE_WRITE`), so the copy that
    /// follows takes no faults. Falls back to doing nothing on kernels without it (the copy
    /// then faults pages as it goes).
    pub fn prefault(&self, threads: usize) {
        let _ = advise_parallel(&self.map, MmapAdvise::MADV_POPULATE_WRITE, threads);
    }

    /// Locks every page in memory (`mlock`, which faults them in first), as pinned memory is.
    /// Fails where the locked-memory limit (`RLIMIT_MEMLOCK`) does not allow it.
    pub fn lock(&self) -> Result<()> {
        self.map.lock().map_err(|source| DeviceError::OutOfMemory {
            device: DeviceId::CPU,
            len: self.map.len(),
            source,
        })
    }
}

impl HostBuffer for Arena {
    fn as_slice(&self) -> &[u8] {
        Arena::as_slice(self)
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        Arena::as_mut_slice(self)
    }

    fn serial(&self) -> Option<u64> {
        Some(self.serial)
    }
}

#[derive(Debug, Default)]
struct Slots {
    /// Arenas kept for reuse.
    free: Vec<Arena>,
    /// Arenas taken and not yet given back.
    in_use: usize,
    /// Bytes those arenas were taken for.
    in_use_bytes: usize,
    /// Threads waiting in [`ArenaPool::take`] for one to come back (bounded pools).
    waiting: usize,
}

impl Slots {
    /// Removes and returns the smallest free arena of at least `len` bytes.
    fn best_fit(&mut self, len: usize) -> Option<Arena> {
        let i = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, a)| a.capacity() >= len)
            .min_by_key(|(_, a)| a.capacity())
            .map(|(i, _)| i)?;
        Some(self.free.swap_remove(i))
    }
}

#[derive(Debug)]
struct PoolInner {
    slots: Mutex<Slots>,
    /// Signalled when an arena comes back.
    returned: Condvar,
    max_arenas: usize,
    /// For bounded pools: at most this many arenas in use at once.
    max_in_use: Option<usize>,
    huge_pages: bool,
}

/// Arenas kept for reuse across loads (the equivalent of veTurboIO's `init_io_helper`).
///
/// A load takes the smallest free arena that is big enough (or maps a new one); when the
/// load's result is dropped the arena comes back. Reused arenas are already faulted in, so a
/// load into one costs only the copy. Cloning shares the pool.
///
/// A [bounded](ArenaPool::bounded) pool also caps the arenas in use: [`take`](ArenaPool::take)
/// waits for one to come back, which bounds the memory of work queued behind it (background
/// saves' snapshots).
#[derive(Debug, Clone)]
pub struct ArenaPool {
    inner: Arc<PoolInner>,
}

impl Default for ArenaPool {
    fn default() -> Self {
        Self::new(2)
    }
}

impl ArenaPool {
    /// A pool keeping at most `max_arenas` free arenas (the largest are kept), whose arenas
    /// follow [`pool_huge_pages`](super::pool_huge_pages) (huge pages unless
    /// `TURBOIO_HUGE_PAGES=0`: a reused arena fills faster with them).
    pub fn new(max_arenas: usize) -> Self {
        Self::with_huge_pages(max_arenas, super::pool_huge_pages())
    }

    /// A pool whose new arenas use huge pages or not.
    pub fn with_huge_pages(max_arenas: usize, huge_pages: bool) -> Self {
        Self::make(max_arenas, None, huge_pages)
    }

    /// A pool of at most `max_arenas` arenas in all, in use or kept: [`take`](Self::take)
    /// waits while that many are in use, until one comes back. Whoever takes must not hold an
    /// arena of the pool while waiting for another (that could wait forever).
    pub fn bounded(max_arenas: usize) -> Self {
        Self::bounded_with_huge_pages(max_arenas, super::pool_huge_pages())
    }

    /// A [bounded](Self::bounded) pool whose new arenas use huge pages or not.
    pub fn bounded_with_huge_pages(max_arenas: usize, huge_pages: bool) -> Self {
        Self::make(max_arenas, Some(max_arenas.max(1)), huge_pages)
    }

    fn make(max_arenas: usize, max_in_use: Option<usize>, huge_pages: bool) -> Self {
        ArenaPool {
            inner: Arc::new(PoolInner {
                slots: Mutex::new(Slots::default()),
                returned: Condvar::new(),
                max_arenas,
                max_in_use,
                huge_pages,
            }),
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.inner.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes an arena of at least `len` bytes, set to length `len`; in a bounded pool, waits
    /// first while the most arenas are in use.
    pub fn take(&self, len: usize) -> Result<PooledArena> {
        self.take_within(len, None)
    }

    /// Like [`take`](Self::take), within a byte budget: waits while the arenas in use and
    /// `len` together would exceed `max_bytes` (unless none is in use: one arena alone is the
    /// caller's to check against the budget), then drops free arenas until the ones in use
    /// and the ones kept fit in it. The budget is the caller's, per call (the pool is shared).
    pub fn take_within(&self, len: usize, max_bytes: Option<u64>) -> Result<PooledArena> {
        let over = |slots: &Slots| {
            self.inner.max_in_use.is_some_and(|max| slots.in_use >= max)
                || max_bytes.is_some_and(|b| slots.in_use > 0 && (slots.in_use_bytes + len) as u64 > b)
        };
        let mut slots = self.slots();
        while over(&slots) {
            slots.waiting += 1;
            slots = self.inner.returned.wait(slots).unwrap_or_else(|p| p.into_inner());
            slots.waiting -= 1;
        }
        if let Some(b) = max_bytes {
            // Beside the arena this take reuses (the smallest that fits), keep the free
            // arenas that fit in what the budget leaves, smallest first.
            let mut room = (b as usize).saturating_sub(slots.in_use_bytes + len);
            let reused = slots.best_fit(len);
            slots.free.sort_by_key(Arena::capacity);
            slots.free.retain(|a| {
                let keep = a.capacity() <= room;
                if keep {
                    room -= a.capacity();
                }
                keep
            });
            slots.free.extend(reused);
        }
        self.take_locked(slots, len)
    }

    /// Like [`take`](Self::take), but `None` instead of waiting when a bounded pool has the
    /// most arenas in use.
    pub fn try_take(&self, len: usize) -> Result<Option<PooledArena>> {
        let slots = self.slots();
        if self.inner.max_in_use.is_some_and(|max| slots.in_use >= max) {
            return Ok(None);
        }
        self.take_locked(slots, len).map(Some)
    }

    fn take_locked(&self, mut slots: std::sync::MutexGuard<'_, Slots>, len: usize) -> Result<PooledArena> {
        slots.in_use += 1;
        slots.in_use_bytes += len;
        let found = slots.best_fit(len);
        if found.is_none() {
            // Drop the free arenas that are too small before mapping a bigger one, so the pool
            // does not hold memory that no longer fits.
            slots.free.clear();
        }
        drop(slots);
        // From here the slot is ours: give it back on any error.
        let mut taken = PooledArena { arena: None, pool: Some(self.clone()), reserved: len };
        let mut arena = match found {
            Some(a) => a,
            None => Arena::new(len, self.inner.huge_pages)?,
        };
        arena.set_len(len)?;
        taken.arena = Some(arena);
        Ok(taken)
    }

    /// A slot comes back, with its arena (if it got one).
    fn give(&self, arena: Option<Arena>, reserved: usize) {
        let mut slots = self.slots();
        slots.in_use = slots.in_use.saturating_sub(1);
        slots.in_use_bytes = slots.in_use_bytes.saturating_sub(reserved);
        if let Some(arena) = arena {
            slots.free.push(arena);
            if slots.free.len() > self.inner.max_arenas {
                slots.free.sort_by_key(|a| std::cmp::Reverse(a.capacity()));
                slots.free.truncate(self.inner.max_arenas);
            }
        }
        drop(slots);
        // Every waiter: a byte budget may let one through that a count did not.
        self.inner.returned.notify_all();
    }

    /// Free arenas held now.
    pub fn free_arenas(&self) -> usize {
        self.slots().free.len()
    }

    /// Whether a free arena of at least `len` bytes is kept (a take of `len` maps nothing new).
    pub fn can_reuse(&self, len: usize) -> bool {
        self.slots().free.iter().any(|a| a.capacity() >= len)
    }

    /// Bytes held by free arenas.
    pub fn free_bytes(&self) -> usize {
        self.slots().free.iter().map(Arena::capacity).sum()
    }

    /// Arenas taken and not yet given back.
    pub fn in_use(&self) -> usize {
        self.slots().in_use
    }

    /// The most arenas in use at once, for a [bounded](Self::bounded) pool.
    pub fn limit(&self) -> Option<usize> {
        self.inner.max_in_use
    }

    /// Bytes the arenas in use were taken for.
    pub fn in_use_bytes(&self) -> usize {
        self.slots().in_use_bytes
    }

    /// Threads waiting in [`take`](Self::take) for an arena of a bounded pool to come back.
    pub fn waiting(&self) -> usize {
        self.slots().waiting
    }

    /// Unmaps every free arena.
    pub fn clear(&self) {
        self.slots().free.clear();
    }
}

/// An arena that goes back to its pool (if it has one) when dropped.
#[derive(Debug)]
pub struct PooledArena {
    arena: Option<Arena>,
    pool: Option<ArenaPool>,
    /// The bytes it was taken for (the pool's in-use count).
    reserved: usize,
}

impl PooledArena {
    /// An arena that belongs to no pool.
    pub fn unpooled(arena: Arena) -> Self {
        PooledArena { arena: Some(arena), pool: None, reserved: 0 }
    }

    /// The arena.
    pub fn arena(&self) -> &Arena {
        // Only None during drop.
        self.arena.as_ref().expect("arena present until drop")
    }

    /// The arena, mutable.
    pub fn arena_mut(&mut self) -> &mut Arena {
        self.arena.as_mut().expect("arena present until drop")
    }
}

impl Drop for PooledArena {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.give(self.arena.take(), self.reserved);
        }
    }
}

impl Allocation for PooledArena {
    fn len(&self) -> usize {
        self.arena().len()
    }

    fn device(&self) -> DeviceId {
        DeviceId::CPU
    }

    fn host(&self) -> Option<&[u8]> {
        Some(self.arena().as_slice())
    }

    fn host_mut(&mut self) -> Option<&mut [u8]> {
        Some(self.arena_mut().as_mut_slice())
    }

    fn address(&self) -> u64 {
        self.arena().addr() as u64
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_is_aligned_zeroed_and_writable() {
        let mut a = Arena::new(3 << 20, true).unwrap();
        assert_eq!(a.addr() % HUGE_PAGE, 0);
        assert_eq!(a.capacity(), 4 << 20);
        assert_eq!(a.len(), 3 << 20);
        assert!(a.as_slice().iter().all(|&b| b == 0));
        a.prefault(2);
        a.as_mut_slice()[12345] = 7;
        assert_eq!(a.as_slice()[12345], 7);
        let small = Arena::new(100, false).unwrap();
        assert_eq!(small.addr() % 4096, 0);
        assert_eq!(small.len(), 100);
    }

    #[test]
    fn pool_reuses_the_smallest_fitting_arena() {
        let pool = ArenaPool::new(2);
        let a = pool.take(5 << 20).unwrap();
        let addr = a.address();
        drop(a);
        assert_eq!(pool.free_arenas(), 1);
        let b = pool.take(1 << 20).unwrap();
        assert_eq!(b.address(), addr, "the free arena is reused");
        assert_eq!(b.len(), 1 << 20);
        assert_eq!(pool.free_arenas(), 0);
        // Too big for anything free: the small free ones are dropped and a new one mapped.
        let c = pool.take(9 << 20).unwrap();
        assert_ne!(c.address(), addr);
        drop(b);
        drop(c);
        assert_eq!(pool.free_arenas(), 2);
        let d = pool.take(100).unwrap();
        let e = pool.take(100).unwrap();
        let f = pool.take(100).unwrap();
        drop((d, e, f));
        assert_eq!(pool.free_arenas(), 2, "the pool keeps at most max_arenas");
        pool.clear();
        assert_eq!(pool.free_bytes(), 0);
    }

    #[test]
    fn a_bounded_pool_caps_the_arenas_in_use() {
        let pool = ArenaPool::bounded(2);
        let a = pool.take(1 << 20).unwrap();
        let b = pool.take(1 << 20).unwrap();
        assert_eq!(pool.in_use(), 2);
        assert!(pool.try_take(100).unwrap().is_none(), "the third waits");
        // A taker blocked in `take` goes on when one comes back.
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.take(3 << 20).map(|c| c.len()))
        };
        while pool.waiting() == 0 {
            std::thread::yield_now();
        }
        drop(a);
        assert_eq!(waiter.join().unwrap().unwrap(), 3 << 20);
        assert_eq!(pool.in_use(), 1);
        drop(b);
        assert_eq!((pool.in_use(), pool.waiting()), (0, 0));
        assert!(pool.free_arenas() <= 2);
        // An unbounded pool never waits.
        let open = ArenaPool::new(1);
        let held: Vec<_> = (0..4).map(|_| open.take(100).unwrap()).collect();
        assert!(open.try_take(100).unwrap().is_some());
        assert_eq!(open.in_use(), 4);
        drop(held);
    }

    #[test]
    fn a_byte_budget_waits_for_room_and_keeps_only_what_fits() {
        // Multiples of 2 MiB: arenas may be rounded up to huge pages.
        let mib = 1usize << 20;
        let pool = ArenaPool::bounded(4);
        let budget = Some(10 * mib as u64);
        let a = pool.take_within(6 * mib, budget).unwrap();
        assert_eq!(pool.in_use_bytes(), 6 * mib);
        // 6 + 6 MiB is over 10: the second waits until the first comes back, then reuses it.
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.take_within(6 * mib, budget).map(|c| (c.len(), c.arena().addr())))
        };
        while pool.waiting() == 0 {
            std::thread::yield_now();
        }
        assert_eq!(pool.in_use(), 1, "still waiting, not taken");
        let addr = a.arena().addr();
        drop(a);
        assert_eq!(waiter.join().unwrap().unwrap(), (6 * mib, addr), "the arena given back, reused");
        assert_eq!((pool.in_use(), pool.in_use_bytes()), (0, 0));
        // Kept arenas of 6 and 4 MiB. Without a budget a 4 MiB take keeps the 6 MiB one free;
        // within 8 MiB there is no room for it beside the 4 in use.
        let (x, y) = (pool.take(6 * mib).unwrap(), pool.take(4 * mib).unwrap());
        drop((x, y));
        assert_eq!(pool.free_bytes(), 10 * mib);
        let open = pool.take(4 * mib).unwrap();
        assert_eq!(pool.free_bytes(), 6 * mib);
        drop(open);
        let tight = pool.take_within(4 * mib, Some(8 * mib as u64)).unwrap();
        assert_eq!(pool.free_bytes(), 0, "the 6 MiB arena dropped");
        drop(tight);
        // One arena alone is never made to wait (the caller checks it against the budget).
        assert_eq!(pool.take_within(16 * mib, budget).unwrap().len(), 16 * mib);
    }
}
