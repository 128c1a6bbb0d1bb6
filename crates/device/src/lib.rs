//! Where loaded tensors live: the [`Device`] trait and the CPU device.
//!
//! # The contract
//!
//! A load asks the device for one [`Allocation`] big enough for the file's tensor data, then
//! fills it in one of two ways:
//!
//! - **Direct**: when [`Allocation::host_mut`] gives host memory (the CPU), storage reads
//!   straight into it. Nothing is staged, nothing is copied twice.
//! - **Staged**: otherwise (CUDA, an NPU, the [`testing`] device), readers fill host
//!   [`Staging`] buffers from [`Device::alloc_staging`] (pinned memory on CUDA) and hand them to
//!   [`Device::upload`], which may return before the copy finishes. The [`Transfer`] it returns
//!   gives the buffer back once the device is done with it, so a few buffers per reader cycle
//!   through the whole load: reading chunk *n+1* overlaps copying chunk *n*.
//!
//! Saves read device memory back with [`Device::download`]. Nothing in this contract assumes
//! the memory is addressable by the CPU; the `testing` feature provides a device whose memory is
//! reachable only through these calls, and the orchestrator's tests run the whole pipeline
//! against it.
//!
//! # The CPU device
//!
//! [`CpuDevice`] holds a load in one of two ways (the orchestrator chooses per file):
//!
//! - a [`FileMapping`]: the file mapped privately and writable (`MAP_PRIVATE`) and populated
//!   with `MADV_POPULATE_READ`. When the file is in the page cache this copies nothing: page
//!   tables point at the cached pages, memory is shared with the page cache and with every
//!   other process that maps the file, and a page is copied only when someone writes to it.
//!   **Hazard:** if the file is truncated *in place* while mapped, touching the lost pages
//!   raises `SIGBUS`. turboio's own saves never do that: they write a new file and rename it
//!   over the old one, so a mapping keeps the old inode alive and stays valid. Writers that
//!   truncate and rewrite in place (`open(path, "wb")`) are the danger.
//! - an [`Arena`]: anonymous memory filled by the readers, which fault it in parallel as they
//!   write. Page faults, not copies, dominate loads into fresh memory. Transparent huge pages
//!   (`MADV_HUGEPAGE`, 2 MiB aligned) cut the number of faults by 512 and win on bare metal, but
//!   on virtual machines that hand freed memory back to the host they measured 2-4x slower than
//!   4 KiB pages, so they are opt-in ([`default_huge_pages`]). Arenas can be kept in an
//!   [`ArenaPool`] and reused by later loads (veTurboIO's `init_io_helper`), which then take no
//!   faults at all.
#![deny(missing_docs)]

mod cpu;
mod error;
mod sys;
#[cfg(feature = "testing")]
pub mod testing;

pub use cpu::{available_memory, default_huge_pages, Arena, ArenaPool, CpuDevice, FileMapping, PooledArena};
pub use error::DeviceError;

use std::any::Any;
use std::fmt;

/// Result of device operations.
pub type Result<T, E = DeviceError> = std::result::Result<T, E>;

/// The kind of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeviceKind {
    /// Host memory.
    Cpu,
    /// An NVIDIA GPU.
    Cuda,
    /// An Ascend NPU.
    Npu,
    /// A device for tests, with memory the CPU cannot address.
    Test,
}

impl DeviceKind {
    /// The name used in device strings (`"cuda"`).
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Npu => "npu",
            DeviceKind::Test => "test",
        }
    }
}

/// A device: its kind and ordinal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceId {
    /// Kind.
    pub kind: DeviceKind,
    /// Ordinal (0 for the CPU).
    pub ordinal: u32,
}

impl DeviceId {
    /// The CPU.
    pub const CPU: DeviceId = DeviceId { kind: DeviceKind::Cpu, ordinal: 0 };
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            DeviceKind::Cpu => f.write_str("cpu"),
            k => write!(f, "{}:{}", k.name(), self.ordinal),
        }
    }
}

/// Memory on a device that holds (part of) a load.
pub trait Allocation: Send + Sync + fmt::Debug {
    /// Usable bytes.
    fn len(&self) -> usize;

    /// True if the allocation has no usable byte.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device it lives on.
    fn device(&self) -> DeviceId;

    /// The bytes, when the CPU can address them.
    fn host(&self) -> Option<&[u8]>;

    /// The bytes, writable, when the CPU can address them.
    fn host_mut(&mut self) -> Option<&mut [u8]>;

    /// The address of the first byte in the device's address space (a host pointer for the
    /// CPU, a device pointer for CUDA), for DLPack export and DMA engines.
    ///
    /// Getting it creates no reference to the memory. Code that hands it to a foreign writer
    /// (a DLPack consumer such as torch may write through it, from any thread, while the
    /// allocation lives) makes the memory shared and mutable: from then on it must not read
    /// the memory through [`Allocation::host`] (or anything built on it), since a `&[u8]` may
    /// not coexist with writes. The Python extension is built that way: it only ever uses the
    /// address.
    fn address(&self) -> u64;

    /// For the owning device to recognise its own allocations.
    fn as_any(&self) -> &dyn Any;
}

/// Host memory used to move bytes to and from a device (page-aligned; pinned where the device
/// needs that for DMA).
pub trait HostBuffer: Send + fmt::Debug {
    /// The bytes.
    fn as_slice(&self) -> &[u8];
    /// The bytes, writable.
    fn as_mut_slice(&mut self) -> &mut [u8];
}

/// A staging buffer owned by whoever holds it; it travels into [`Device::upload`] and back out
/// of [`Transfer::wait`].
pub type Staging = Box<dyn HostBuffer>;

/// A copy the device may still be running.
pub trait PendingTransfer: Send {
    /// Blocks until the copy is complete and returns the staging buffer.
    fn wait(self: Box<Self>) -> Result<Staging>;
}

/// The handle [`Device::upload`] returns.
pub enum Transfer {
    /// Already complete.
    Done(Staging),
    /// Still running.
    Pending(Box<dyn PendingTransfer>),
}

impl Transfer {
    /// Waits for the copy and gets the staging buffer back.
    pub fn wait(self) -> Result<Staging> {
        match self {
            Transfer::Done(s) => Ok(s),
            Transfer::Pending(p) => p.wait(),
        }
    }
}

impl fmt::Debug for Transfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Transfer::Done(_) => f.write_str("Transfer::Done"),
            Transfer::Pending(_) => f.write_str("Transfer::Pending"),
        }
    }
}

/// A place loads go to.
pub trait Device: Send + Sync + fmt::Debug {
    /// Which device.
    fn id(&self) -> DeviceId;

    /// Allocates `len` bytes of device memory for a load.
    fn alloc(&self, len: usize) -> Result<Box<dyn Allocation>>;

    /// A host buffer of `len` bytes for staging copies (page-aligned; pinned on GPUs).
    fn alloc_staging(&self, len: usize) -> Result<Staging>;

    /// Starts copying `src[..len]` into `dst` at `dst_offset`. The copy may still be running
    /// when this returns; [`Transfer::wait`] finishes it and returns `src`. Several uploads into
    /// disjoint ranges of one allocation may run at once, from several threads.
    fn upload(&self, src: Staging, len: usize, dst: &dyn Allocation, dst_offset: usize) -> Result<Transfer>;

    /// Copies `dst.len()` bytes of `src` at `src_offset` into host memory, and waits.
    fn download(&self, src: &dyn Allocation, src_offset: usize, dst: &mut [u8]) -> Result<()>;

    /// Waits for every copy started on this device.
    fn synchronize(&self) -> Result<()>;
}

/// Checks that `offset + len` lies within an allocation of `alloc_len` bytes.
pub fn check_range(device: DeviceId, alloc_len: usize, offset: usize, len: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= alloc_len => Ok(()),
        _ => Err(DeviceError::OutOfBounds { device, offset, len, alloc_len }),
    }
}
