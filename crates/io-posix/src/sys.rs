//! System calls and aligned memory. Everything `unsafe` outside the ring lives here, each
//! call checked and turned into an `io::Result`. System calls go through nix's wrappers; the
//! few nix does not wrap (`cachestat`, `mincore`, the lease `fcntl`s, a `flock` that outlives no guard) call
//! libc, each saying why at the call.

use crate::plan::ALIGN;
use nix::errno::Errno;
use nix::fcntl::{posix_fadvise, OFlag, PosixFadviseAdvice};
use nix::sys::mman::{self, MapFlags, ProtFlags};
use nix::sys::signal::{kill, Signal};
use nix::unistd::{geteuid, sysconf, Pid, SysconfVar};
use std::alloc::Layout;
use std::ffi::c_int;
use std::fs::{File, OpenOptions};
use std::io;
use std::num::NonZeroUsize;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;

/// Heap memory aligned to [`ALIGN`], zeroed at allocation, for `O_DIRECT` bounce and write
/// buffers.
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `AlignedBuf` owns its allocation exclusively (like a `Box<[u8]>`); moving it to
// another thread moves that ownership.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes (at least one block).
    pub(crate) fn new(len: usize) -> AlignedBuf {
        let len = len.max(ALIGN as usize);
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else { std::alloc::handle_alloc_error(layout) };
        AlignedBuf { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        match Layout::from_size_align(len, ALIGN as usize) {
            Ok(l) => l,
            // Only for lengths near `isize::MAX`, which no caller asks for.
            Err(_) => Layout::new::<[u8; ALIGN as usize]>(),
        }
    }

    /// Address of the first byte, for the kernel to write into.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The bytes.
    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed at allocation) bytes that we own.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout and not freed before.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

/// Opens a second description of the same file with `O_DIRECT` (and `extra` access flags),
/// through `/proc/self/fd` so that a rename of `path` in between cannot swap the file; by path
/// where `/proc` is missing, checking that it is the same inode.
///
/// `Ok(None)` when the file system refuses `O_DIRECT` (`EINVAL`) or the path now names another
/// file.
pub(crate) fn reopen_direct(file: &File, path: &Path, write: bool) -> io::Result<Option<File>> {
    let open = |p: &Path| OpenOptions::new().read(!write).write(write).custom_flags(OFlag::O_DIRECT.bits()).open(p);
    let via_proc = format!("/proc/self/fd/{}", file.as_raw_fd());
    let opened = match open(Path::new(&via_proc)) {
        Err(e) if e.raw_os_error() == Some(Errno::ENOENT as i32) => open(path),
        other => other,
    };
    let direct = match opened {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(Errno::EINVAL as i32) => return Ok(None),
        Err(e) => return Err(e),
    };
    let (a, b) = (file.metadata()?, direct.metadata()?);
    if a.dev() != b.dev() || a.ino() != b.ino() {
        return Ok(None);
    }
    Ok(Some(direct))
}

/// Gives `file` its final length `len` (sparse: blocks are allocated as the data is written),
/// after checking that the file system has room for what it grows by, so that a full disk fails
/// here, before any byte is written (`ENOSPC`), in the common case. (Not a
/// reservation: a disk filled by someone else meanwhile fails the write that finds it full,
/// which leaves the old file just as intact.)
///
/// Why not `fallocate`: it reserves unwritten extents that every write then converts, and it
/// measured 8-15% slower for `O_DIRECT` saves on ext4 here (1 GiB, two writers: 1.89-2.02 GB/s
/// with it against 2.14-2.24 GB/s without, same run), with the same number of extents and the
/// same read speed afterwards (`filefrag`: 9 and 9).
pub(crate) fn size_for_write(file: &File, len: u64) -> io::Result<()> {
    let current = file.metadata()?.len();
    if len <= current {
        return if len == current { Ok(()) } else { file.set_len(len) };
    }
    let grow = len - current;
    if let Ok(st) = nix::sys::statvfs::fstatvfs(file) {
        // Root may use the blocks reserved for it; everyone else what is available.
        let blocks = if geteuid().is_root() { st.blocks_free() } else { st.blocks_available() };
        // The field types differ between targets (u32 on 32-bit ones).
        #[allow(clippy::unnecessary_cast)]
        let free = (blocks as u64).saturating_mul(st.fragment_size() as u64);
        // File systems that report nothing (some FUSE ones say 0 blocks of 0 bytes) are not
        // judged by it.
        if st.blocks() > 0 && free < grow {
            return Err(Errno::ENOSPC.into());
        }
    }
    file.set_len(len)
}

/// Whether `file` is on a local file system whose leases and block reuse behave as this crate
/// relies on (ext2/3/4, XFS, btrfs, F2FS, tmpfs): a lease there sees every opener and mapping
/// on this kernel, and no other host can have the file open.
pub(crate) fn is_local_fs(file: &File) -> bool {
    let Ok(st) = nix::sys::statfs::fstatfs(file) else { return false };
    // The field's type differs between targets.
    #[allow(clippy::unnecessary_cast)]
    let kind = st.filesystem_type().0 as i64;
    const LOCAL: [i64; 5] = [0xEF53, 0x5846_5342, 0x9123_683E, 0xF2F5_2010, 0x0102_1994];
    LOCAL.contains(&kind)
}

/// Whether no other open file description of `file`'s inode exists on this kernel (another
/// process's descriptor, or a mapping whose descriptor was closed): a write lease
/// (`F_SETLEASE`) is granted only then. The lease is given back at once. A process opening the
/// file in between breaks it, and the kernel signals the lease holder: `F_SETSIG` makes that
/// `SIGURG`, which is ignored by default (the default `SIGIO` would end the process). Any
/// refusal, including a file system without leases, is `false`.
pub(crate) fn nobody_else_has_open(file: &File) -> bool {
    // <asm-generic/fcntl.h> (the same on every Linux architecture); neither libc nor nix has it.
    const F_SETSIG: c_int = 10;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own, with integer arguments only.
    unsafe {
        // libc: nix's FcntlArg has no F_SETSIG (and no F_SETLEASE, below).
        if libc::fcntl(fd, F_SETSIG, Signal::SIGURG as c_int) != 0 {
            return false;
        }
        // libc: nix's FcntlArg has no F_SETLEASE.
        if libc::fcntl(fd, libc::F_SETLEASE, libc::F_WRLCK) != 0 {
            return false;
        }
        // libc: nix's FcntlArg has no F_SETLEASE.
        libc::fcntl(fd, libc::F_SETLEASE, libc::F_UNLCK);
    }
    true
}

/// Asks the kernel to start reading `[offset, offset + len)` of `file` into the page cache
/// (`POSIX_FADV_WILLNEED`). It queues the reads of every page not cached yet and returns once
/// they are submitted (it may block while the device's queue is full), without waiting for them.
pub(crate) fn will_need(file: &File, offset: u64, len: u64) -> io::Result<()> {
    // `off_t`, whatever its width on the target.
    let (Ok(off), Ok(len)) = (offset.try_into(), len.try_into()) else {
        return Err(Errno::EINVAL.into());
    };
    Ok(posix_fadvise(file, off, len, PosixFadviseAdvice::POSIX_FADV_WILLNEED)?)
}

/// True if a process with this id exists (`kill(pid, 0)`: permission denied still means it
/// exists).
pub(crate) fn process_exists(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else { return false };
    // No signal: nothing is sent; it only checks that the process exists.
    matches!(kill(Pid::from_raw(pid), None), Ok(()) | Err(Errno::EPERM))
}

/// An exclusive `flock` on `file`: waiting for it when `wait`, else `EWOULDBLOCK` if another
/// open file description holds it. Held until every descriptor of this description closes
/// (or the process dies: the kernel drops it). Works across processes and PID namespaces on
/// one kernel, and across hosts on NFS (Linux emulates it with POSIX locks there); file
/// systems without locks say `ENOLCK`, `EOPNOTSUPP` or `ENOSYS`.
///
/// Raw `flock`: nix's `Flock` takes the `File` and unlocks when dropped (panicking if that
/// fails), while these locks last as long as the caller's `File` (a save's temporary file keeps
/// its lock while it is written); nix's plain `flock` function is deprecated.
pub(crate) fn lock_exclusive(file: &File, wait: bool) -> io::Result<()> {
    // libc: LOCK_* for the raw flock below (nix's FlockArg serves only its Flock guard).
    let op = if wait { libc::LOCK_EX } else { libc::LOCK_EX | libc::LOCK_NB };
    loop {
        // SAFETY: plain syscall on a descriptor we own; no memory is passed.
        // libc: nix's Flock guard cannot express a lock that lives as long as `file` (see above).
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Tells the kernel that `file` is read at random (`POSIX_FADV_RANDOM`): no read-ahead around
/// the reads of this open file description.
pub(crate) fn random_access(file: &File) -> io::Result<()> {
    Ok(posix_fadvise(file, 0, 0, PosixFadviseAdvice::POSIX_FADV_RANDOM)?)
}

/// Tells the kernel to drop the clean cached pages of `file` (`POSIX_FADV_DONTNEED`).
pub(crate) fn drop_cache(file: &File) -> io::Result<()> {
    Ok(posix_fadvise(file, 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED)?)
}

fn page_size() -> u64 {
    let p = sysconf(SysconfVar::PAGE_SIZE).ok().flatten().unwrap_or(0);
    u64::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// Residency probes run by this process ([`cached_fraction`]).
pub(crate) static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Sample spans of the residency probe.
const SPANS: u64 = 64;
/// Pages per span.
const SPAN_PAGES: u64 = 16;

/// The spans `(first_page, pages)` the probe looks at: the whole file when small, else
/// [`SPANS`] spans of [`SPAN_PAGES`] spread evenly from the first page to the last.
fn sample_spans(pages: u64) -> Vec<(u64, u64)> {
    if pages <= SPANS * SPAN_PAGES {
        return vec![(0, pages)];
    }
    (0..SPANS).map(|i| ((pages - SPAN_PAGES) * i / (SPANS - 1), SPAN_PAGES)).collect()
}

/// Estimates the fraction of the file's pages in the page cache from a sample (see
/// [`sample_spans`]): `cachestat` per span where the kernel has it, else `mmap` without
/// populating, `mincore`, `munmap`; no page is read, faulted or brought into the cache.
///
/// Since Linux 5.2, `mincore` reports page-cache residency only for files the caller owns or
/// may write; for others it sees only pages mapped into this process, i.e. none, and the file
/// looks cold. (`preadv2(RWF_NOWAIT)` probes would see through that, but measured here they
/// start reading the probed pages in the background, so the probe would change what it
/// measures; `cachestat` has the same permission rule as `mincore`.)
pub(crate) fn cached_fraction(file: &File, len: u64) -> Option<f64> {
    PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if len == 0 {
        return Some(1.0);
    }
    let page = page_size();
    let pages = len.div_ceil(page);
    let spans = sample_spans(pages);
    let sampled: u64 = spans.iter().map(|s| s.1).sum();
    let resident = cachestat_sample(file, page, &spans).or_else(|| mincore_sample(file, len, page, &spans))?;
    Some(resident as f64 / sampled as f64)
}

/// `cachestat(2)`'s number: 451 on every architecture (it came after the syscall tables were
/// unified); the libc crate does not define it for glibc targets.
const SYS_CACHESTAT: libc::c_long = 451;

/// `struct cachestat_range` of <linux/mman.h>.
#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

/// `struct cachestat` of <linux/mman.h>.
#[repr(C)]
#[derive(Default)]
struct Cachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// Set once `cachestat` answered `ENOSYS` (a kernel before 6.5): only `mincore` is tried then.
static NO_CACHESTAT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The sample's resident pages by `cachestat(2)` (Linux 6.5+): a system call per span, no
/// mapping. The `mmap`/`munmap` pair of the `mincore` probe takes the process's mmap lock for
/// writing and shoots down TLBs: hundreds of microseconds to milliseconds while other threads
/// fault or the driver pins memory. `None` where the kernel lacks it or refuses (the caller
/// falls back to `mincore`).
fn cachestat_sample(file: &File, page: u64, spans: &[(u64, u64)]) -> Option<u64> {
    use std::sync::atomic::Ordering;
    if NO_CACHESTAT.load(Ordering::Relaxed) {
        return None;
    }
    let mut resident = 0u64;
    for &(first, n) in spans {
        let range = CachestatRange { off: first * page, len: n * page };
        let mut stat = Cachestat::default();
        // SAFETY: a plain system call on a descriptor we own; `range` and `stat` are live,
        // correctly laid out (repr(C), the kernel's structs) and `stat` is writable.
        // libc: neither libc nor nix wraps cachestat.
        let ret = unsafe {
            libc::syscall(
                SYS_CACHESTAT,
                file.as_raw_fd(),
                &range as *const CachestatRange,
                &mut stat as *mut Cachestat,
                0,
            )
        };
        if ret != 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
                NO_CACHESTAT.store(true, Ordering::Relaxed);
            }
            return None;
        }
        resident += stat.nr_cache.min(n);
    }
    Some(resident)
}

fn mincore_sample(file: &File, len: u64, page: u64, spans: &[(u64, u64)]) -> Option<u64> {
    let map_len = usize::try_from(len).ok()?;
    // SAFETY: a fresh shared read-only mapping of our descriptor, at an address the kernel
    // picks; nothing is read through it, and it is unmapped below on every path.
    let addr =
        unsafe { mman::mmap(None, NonZeroUsize::new(map_len)?, ProtFlags::PROT_READ, MapFlags::MAP_SHARED, file, 0) }
            .ok()?;
    let mut vec = vec![0u8; spans.iter().map(|s| s.1).max().unwrap_or(0) as usize];
    let mut resident = Some(0u64);
    for &(first, n) in spans {
        let (Ok(off), Ok(bytes), Ok(n)) =
            (usize::try_from(first * page), usize::try_from(n * page), usize::try_from(n))
        else {
            resident = None;
            break;
        };
        // SAFETY: `[addr + off, addr + off + bytes)` lies inside the mapping (spans cover only
        // pages of the file, and the mapping covers them all); `vec` has room for `n` bytes,
        // one per page.
        // libc: nix has no wrapper for mincore(2).
        let ret = unsafe { libc::mincore(addr.as_ptr().cast::<u8>().add(off).cast(), bytes, vec.as_mut_ptr()) };
        if ret != 0 {
            resident = None;
            break;
        }
        resident = resident.map(|r| r + vec[..n].iter().filter(|&&b| b & 1 == 1).count() as u64);
    }
    // SAFETY: unmaps exactly the mapping made above, which nothing references any more.
    let _ = unsafe { mman::munmap(addr, map_len) };
    resident
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_cover_small_files_whole_and_sample_big_ones() {
        assert_eq!(sample_spans(10), vec![(0, 10)]);
        let s = sample_spans(1 << 20);
        assert_eq!(s.len(), SPANS as usize);
        assert_eq!(s[0], (0, SPAN_PAGES));
        assert_eq!(s.last().copied(), Some(((1 << 20) - SPAN_PAGES, SPAN_PAGES)));
        assert!(s.windows(2).all(|w| w[0].0 + SPAN_PAGES <= w[1].0));
    }

    #[test]
    fn aligned_buffers_are_aligned() {
        let mut b = AlignedBuf::new(10);
        assert_eq!(b.as_slice().len(), ALIGN as usize);
        assert_eq!(b.as_mut_ptr() as usize % ALIGN as usize, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[0] = 1;
        assert_eq!(b.as_slice()[0], 1);
    }
}
