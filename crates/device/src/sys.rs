//! Raw memory mappings. Every `unsafe` block of this crate lives here.

use nix::errno::Errno;
use nix::sys::mman::{self, MapFlags, MmapAdvise, ProtFlags};
use nix::unistd::{sysconf, SysconfVar};
use std::ffi::c_void;
use std::fs::File;
use std::io;
use std::num::NonZeroUsize;
use std::ptr::NonNull;

/// The page size.
pub(crate) fn page_size() -> usize {
    match sysconf(SysconfVar::PAGE_SIZE) {
        Ok(Some(n)) if n > 0 => n as usize,
        _ => 4096,
    }
}

/// Size of a transparent huge page on x86-64 and arm64 with 4 KiB pages.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// A memory mapping this value owns exclusively; unmapped on drop.
#[derive(Debug)]
pub(crate) struct RawMap {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: RawMap owns its mapping (like a Vec<u8> owns its buffer); the memory is plain bytes
// with no thread affinity, so moving or sharing the owner between threads is sound. Within Rust
// the bytes are mutated only through &mut self (`as_mut_slice`). Its address (`addr`, a plain
// integer: no reference is created) may also be exported to foreign code that writes through it
// (DLPack consumers such as torch); whoever exports it must not read the memory through
// `as_slice` while such writes can happen (see `Allocation::address`), and RawMap itself never
// reads or writes the bytes.
unsafe impl Send for RawMap {}
// SAFETY: see Send; &RawMap hands out shared byte slices (under the rule above), the address,
// or calls madvise, which the kernel serializes.
unsafe impl Sync for RawMap {}

impl RawMap {
    /// An anonymous private mapping of `len` bytes (rounded up to pages) whose start is aligned
    /// to `align` (a power of two, at least the page size). Zero-length maps are not allowed.
    pub(crate) fn anonymous(len: usize, align: usize) -> io::Result<RawMap> {
        let page = page_size();
        let align = align.max(page);
        let len = len.max(1).next_multiple_of(page);
        let over = len.checked_add(align - page).ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        let over_nz = NonZeroUsize::new(over).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing; no existing
        // memory is affected.
        let p = unsafe {
            mman::mmap_anonymous(
                None,
                over_nz,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE,
            )
        }?;
        let start = p.as_ptr() as usize;
        let aligned = start.next_multiple_of(align);
        let head = aligned - start;
        let tail = over - head - len;
        if head > 0 {
            // SAFETY: [start, start+head) lies inside the mapping just created and nothing
            // refers to it; unmapping it trims the mapping's head.
            let _ = unsafe { mman::munmap(p, head) };
        }
        if let Some(tail_start) = NonNull::new((aligned + len) as *mut c_void).filter(|_| tail > 0) {
            // SAFETY: [aligned+len, start+over) lies inside the mapping just created and nothing
            // refers to it; unmapping it leaves [aligned, aligned+len).
            let _ = unsafe { mman::munmap(tail_start, tail) };
        }
        Ok(RawMap {
            // aligned is inside a successful mapping, hence non-null.
            ptr: NonNull::new(aligned as *mut u8).ok_or_else(|| io::Error::from(io::ErrorKind::Other))?,
            len,
        })
    }

    /// A private, writable (copy-on-write) mapping of the first `len` bytes of `file`, starting
    /// on a 2 MiB boundary: then every 2 MiB folio the page cache holds for the file lines up
    /// with a huge-page boundary of the mapping and can be mapped by one page-table entry
    /// instead of 512 (populating a cached 4 GiB file took 3-8 ms aligned against 250-500 ms
    /// at an arbitrary address, measured here).
    ///
    /// How it gets the aligned address without ever unmapping memory it does not own: it
    /// reserves an over-sized anonymous range to find a free aligned address, gives the whole
    /// reservation back, and maps the file there with `MAP_FIXED_NOREPLACE`, which fails
    /// (`EEXIST`) instead of replacing anything another thread may have mapped in between; it
    /// then tries again with a new reservation, and after a few lost races maps the file at an
    /// address of the kernel's choosing (correct, only slower to populate). A plain `MAP_FIXED`
    /// over a reservation would be shorter, but on some kernels a failed `MAP_FIXED` has already
    /// unmapped the range, and dropping the reservation would then unmap whatever another thread
    /// mapped there.
    pub(crate) fn file_private(file: &File, len: usize) -> io::Result<RawMap> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "cannot map an empty file"));
        }
        let len_nz = NonZeroUsize::new(len).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let map_at = |addr: Option<NonZeroUsize>, flags: MapFlags| -> nix::Result<usize> {
            // SAFETY: either the kernel picks the address (no flags), or MAP_FIXED_NOREPLACE
            // asks for `addr` and fails rather than replace an existing mapping: no memory
            // anyone owns is affected. MAP_PRIVATE means writes through the mapping never
            // reach the file; the fd only needs to be valid for the call.
            let p = unsafe {
                mman::mmap(
                    addr,
                    len_nz,
                    ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                    MapFlags::MAP_PRIVATE | flags,
                    file,
                    0,
                )
            }?;
            Ok(p.as_ptr() as usize)
        };
        for _ in 0..4 {
            // Find a free aligned range, then give it back (dropping the reservation unmaps
            // exactly what it mapped: it owns that range until then).
            let aligned = RawMap::anonymous(len, HUGE_PAGE)?.addr();
            #[cfg(test)]
            tests::race(aligned);
            match map_at(NonZeroUsize::new(aligned), MapFlags::MAP_FIXED_NOREPLACE) {
                // (A kernel older than 4.17 takes the flag as a hint and may map elsewhere:
                // that mapping is ours too, only unaligned.)
                Ok(p) => return RawMap::owning(p, len),
                // Another thread mapped something into the range meanwhile: try again.
                Err(Errno::EEXIST) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        RawMap::owning(map_at(None, MapFlags::empty())?, len)
    }

    /// Takes ownership of the mapping `[addr, addr + len)` just returned by `mmap`.
    fn owning(addr: usize, len: usize) -> io::Result<RawMap> {
        Ok(RawMap { ptr: NonNull::new(addr as *mut u8).ok_or_else(|| io::Error::from(io::ErrorKind::Other))?, len })
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is len bytes, readable, and alive as long as self. Within Rust it
        // is mutated only through &mut self; foreign writers reach it only through an exported
        // address, whose exporter must not call this meanwhile (see the Send impl above).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// `madvise` on `[offset, offset + len)`, clipped to the mapping and widened to pages.
    pub(crate) fn advise(&self, offset: usize, len: usize, advice: MmapAdvise) -> io::Result<()> {
        let page = page_size();
        let start = (offset.min(self.len) / page) * page;
        let end = offset.saturating_add(len).min(self.len);
        if end <= start {
            return Ok(());
        }
        // Inside the mapping, hence non-null.
        let at =
            NonNull::new((self.addr() + start) as *mut c_void).ok_or_else(|| io::Error::from(io::ErrorKind::Other))?;
        // SAFETY: the range lies inside our mapping. The advice values used by this crate
        // (HUGEPAGE, WILLNEED, RANDOM, POPULATE_READ, POPULATE_WRITE) never change the contents visible to Rust:
        // they only change how and when pages are faulted in.
        unsafe { mman::madvise(at, end - start, advice) }?;
        Ok(())
    }
}

impl RawMap {
    /// Locks the mapping's pages in memory (`mlock`: faulted in now, never swapped out), as
    /// pinned memory is.
    pub(crate) fn lock(&self) -> io::Result<()> {
        // SAFETY: the range is exactly our live mapping; mlock changes residency, not contents.
        unsafe { mman::mlock(self.ptr.cast::<c_void>(), self.len) }?;
        Ok(())
    }
}

impl Drop for RawMap {
    fn drop(&mut self) {
        // SAFETY: we own the mapping and nothing borrows it any more (&mut self).
        let _ = unsafe { mman::munmap(self.ptr.cast::<c_void>(), self.len) };
    }
}

/// Reads one byte of every page in `bytes` so that each page is mapped (a fallback for kernels
/// without `MADV_POPULATE_READ`).
pub(crate) fn touch_pages(bytes: &[u8]) {
    let page = page_size();
    let mut sum = 0u8;
    for i in (0..bytes.len()).step_by(page) {
        // SAFETY: i < bytes.len(); a volatile read keeps the compiler from dropping it.
        sum ^= unsafe { std::ptr::read_volatile(bytes.as_ptr().add(i)) };
    }
    std::hint::black_box(sum);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::io::Write;

    thread_local! {
        /// Addresses a simulated other thread maps into, between the reservation being given
        /// back and the file being mapped (each entry used once).
        static RACES: Cell<u32> = const { Cell::new(0) };
        static TAKEN: std::cell::RefCell<Vec<RawMap>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// Called by `file_private` after it gave its reservation back: while races are pending,
    /// maps a page of "someone else's" memory at the address it is about to use, and marks it.
    pub(super) fn race(addr: usize) {
        if RACES.get() == 0 {
            return;
        }
        RACES.set(RACES.get() - 1);
        let len = NonZeroUsize::new(page_size()).unwrap();
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; the range is free (the
        // reservation was just given back), and the new mapping is owned by the RawMap below.
        let p = unsafe {
            mman::mmap_anonymous(
                NonZeroUsize::new(addr),
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_FIXED_NOREPLACE,
            )
        }
        .unwrap_or_else(|e| panic!("the simulated racer could not map at {addr:#x}: {e}"));
        let mut other = RawMap::owning(p.as_ptr() as usize, page_size()).unwrap();
        other.as_mut_slice().fill(0xA5);
        TAKEN.with_borrow_mut(|t| t.push(other));
    }

    /// Issue 15 item 11: memory another thread mapped where a file mapping was about to go is
    /// never replaced or unmapped, whether the mapper retries (a lost race) or gives up on
    /// alignment (every race lost).
    #[test]
    fn a_lost_race_never_touches_foreign_memory() {
        let path = std::env::temp_dir().join(format!("turboio-race-{}", std::process::id()));
        let mut f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        f.write_all(&vec![7u8; 3 << 20]).unwrap();
        for races in [1, 4] {
            RACES.set(races);
            let map = RawMap::file_private(&f, 3 << 20).unwrap();
            assert!(map.as_slice().iter().all(|&b| b == 7), "the file's bytes");
            let taken = TAKEN.take();
            assert_eq!(taken.len(), races as usize);
            for other in &taken {
                assert!(other.as_slice().iter().all(|&b| b == 0xA5), "foreign memory was replaced");
                let (a, b) = (other.addr(), map.addr());
                assert!(a + other.len() <= b || b + map.len() <= a, "the file was mapped over foreign memory");
            }
        }
    }
}
