//! The CPU device.

mod arena;
mod mapping;

pub use arena::{Arena, ArenaPool, PooledArena};
pub use mapping::FileMapping;

use crate::sys::{RawMap, HUGE_PAGE};
use crate::{check_range, Allocation, Device, DeviceError, DeviceId, Result, Staging, Transfer};
use nix::sys::mman::MmapAdvise;

/// Runs `madvise(advice)` over `map` split into `threads` pieces at huge-page boundaries, one
/// thread each, so that page faults are taken on every core at once.
pub(crate) fn advise_parallel(map: &RawMap, advice: MmapAdvise, threads: usize) -> std::io::Result<()> {
    let len = map.len();
    let pieces = threads.max(1).min(len.div_ceil(HUGE_PAGE)).max(1);
    if pieces == 1 {
        return map.advise(0, len, advice);
    }
    let step = len.div_ceil(pieces).next_multiple_of(HUGE_PAGE);
    std::thread::scope(|s| {
        let handles: Vec<_> = (1..pieces).map(|i| s.spawn(move || map.advise(i * step, step, advice))).collect();
        let first = map.advise(0, step, advice);
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(std::io::Error::other("populate thread panicked"))))
            .fold(first, |acc, r| acc.and(r))
    })
}

/// Whether new arenas ask for transparent huge pages when nobody says: the environment variable
/// `TURBOIO_HUGE_PAGES` (`1`/`on`/`true` or `0`/`off`/`false`), else off.
///
/// Off by default because of what was measured on the machines this project runs on (virtual
/// machines with free page reporting): memory that the guest has freed is handed back to the
/// host, and the first touch of such memory as 2 MiB pages ran at 0.35-0.8 GB/s against
/// 1.2-2.6 GB/s as 4 KiB pages (64 MiB and larger allocations; small ones come from memory the
/// host still backs, where huge pages ran at 6-9 GB/s). Copies into fresh 4 KiB arenas on two
/// threads were 1.5-2.5x faster than into fresh huge-page arenas there. On bare metal, where
/// huge pages fault 3-5x faster than small ones, set `TURBOIO_HUGE_PAGES=1`.
pub fn default_huge_pages() -> bool {
    match std::env::var("TURBOIO_HUGE_PAGES").as_deref() {
        Ok("1" | "on" | "true" | "yes") => true,
        Ok(_) | Err(_) => false,
    }
}

/// Whether arenas kept for reuse ([`ArenaPool`]) ask for transparent huge pages: the
/// environment variable `TURBOIO_HUGE_PAGES` when it is set, else on.
///
/// A pool's arena is faulted in once and then filled again and again, so what counts is the
/// fill, not the first touch (slower as huge pages on these VMs, see [`default_huge_pages`]).
/// Filled with `O_DIRECT`, the kernel pins every destination page for each request: a cold
/// load of 1 GiB into a reused arena read at 1.78 GB/s with huge pages against 1.38 GB/s with
/// 4 KiB pages here (`examples/readbench`, `uring-warm` against `uring-warm-4k`, median of 5),
/// and page-cache copies into it take fewer TLB misses.
pub fn pool_huge_pages() -> bool {
    match std::env::var("TURBOIO_HUGE_PAGES").as_deref() {
        Ok("0" | "off" | "false" | "no") => false,
        Ok(_) | Err(_) => true,
    }
}

/// Bytes of host memory the kernel estimates are available for new allocations without
/// swapping (`MemAvailable` in `/proc/meminfo`: free memory plus the page cache and slabs it
/// can reclaim), or `None` where it cannot be read.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 =
        info.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// Host memory as a device.
///
/// Loads go straight into its allocations (they are host memory), so [`Device::upload`] is
/// never needed and answers an error; the staging machinery exists for devices the CPU cannot
/// address.
#[derive(Debug, Clone)]
pub struct CpuDevice {
    pool: Option<ArenaPool>,
    huge_pages: bool,
}

impl Default for CpuDevice {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuDevice {
    /// A CPU device whose arenas follow [`default_huge_pages`] and are not kept after a load.
    pub fn new() -> Self {
        CpuDevice { pool: None, huge_pages: default_huge_pages() }
    }

    /// Keeps arenas in `pool` after the loads that used them end, for reuse by later loads.
    pub fn with_pool(mut self, pool: ArenaPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// Turns transparent huge pages on or off for new unpooled arenas (default:
    /// [`default_huge_pages`]; a pool has its own setting).
    pub fn with_huge_pages(mut self, on: bool) -> Self {
        self.huge_pages = on;
        self
    }

    /// The pool, if any.
    pub fn pool(&self) -> Option<&ArenaPool> {
        self.pool.as_ref()
    }

    /// An arena of `len` bytes, from the pool when one fits.
    pub fn arena(&self, len: usize) -> Result<PooledArena> {
        match &self.pool {
            Some(pool) => pool.take(len),
            None => Ok(PooledArena::unpooled(Arena::new(len, self.huge_pages)?)),
        }
    }
}

impl Device for CpuDevice {
    fn id(&self) -> DeviceId {
        DeviceId::CPU
    }

    fn alloc(&self, len: usize) -> Result<Box<dyn Allocation>> {
        Ok(Box::new(self.arena(len)?))
    }

    fn alloc_staging(&self, len: usize) -> Result<Staging> {
        Ok(Box::new(Arena::new(len, false)?))
    }

    fn upload(&self, _src: Staging, _len: usize, _dst: &dyn Allocation, _dst_offset: usize) -> Result<Transfer> {
        Err(DeviceError::Driver {
            device: DeviceId::CPU,
            message: "CPU allocations are host memory: read into Allocation::host_mut instead of staging".into(),
        })
    }

    fn download(&self, src: &dyn Allocation, src_offset: usize, dst: &mut [u8]) -> Result<()> {
        let bytes = src.host().ok_or(DeviceError::ForeignAllocation { device: DeviceId::CPU, other: src.device() })?;
        check_range(DeviceId::CPU, bytes.len(), src_offset, dst.len())?;
        dst.copy_from_slice(&bytes[src_offset..src_offset + dst.len()]);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn available_memory_is_read_from_meminfo() {
        let bytes = super::available_memory().expect("/proc/meminfo has MemAvailable on Linux >= 3.14");
        assert!(bytes > 0 && bytes.is_multiple_of(1024), "{bytes}");
    }
}
