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
//!   faults at all; a pool's arenas use huge pages unless told not to ([`pool_huge_pages`]):
//!   faulted once, they fill faster (`O_DIRECT` pins fewer, larger pages).
//!
//! # Capabilities beyond the staged contract
//!
//! Devices advertise optional abilities through queries with defaults, so the orchestrator never
//! branches on a device kind:
//!
//! - [`Device::decrypts_after_upload`]: the device XORs the AES-CTR keystream into its own memory
//!   ([`Device::prepare_key`], [`Device::upload_with`] with [`AfterUpload::Keystream`],
//!   [`Device::apply_keystream`]), so encrypted loads cost the CPU no AES work. The CUDA device
//!   runs the kernel of [`aes_kernel`]; the test device runs `turboio-cipher` on its copy engine.
//! - [`Device::uploads_from_host`]: the device copies straight from host memory the caller keeps
//!   alive (a populated page-cache mapping of a hot file), registering it for DMA instead of
//!   staging it ([`Device::upload_from_host`]).
//! - [`Device::borrow`]: a view of memory someone else owns (a PyTorch CUDA tensor being saved).
//!
//! Staging buffers are kept in a [`StagingPool`] and reused across loads (pinned memory is
//! slow to allocate: see the `staging` module docs for what is pinned, when and how much); the
//! CUDA device keeps one per ordinal per process, the test devices take one.
//!
//! # Devices
//!
//! [`CpuDevice`]; `cuda::CudaDevice` (feature `cuda`: cudarc over libcuda and libnvrtc loaded at
//! run time, a clean [`DeviceError::Unavailable`] where either is missing, never a panic);
//! [`NpuDevice`], a stub whose every call says what an NPU build would need; and, with the
//! `testing` feature, `testing::OpaqueDevice`. [`open_device`] makes the right one from a
//! [`DeviceId`] (parsed from `"cuda:1"` by [`DeviceId::parse`]).
#![deny(missing_docs)]

pub mod aes_kernel;
pub mod cast_kernel;
mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod libs;
mod npu;
mod staging;
mod sys;
#[cfg(feature = "testing")]
pub mod testing;

pub use cpu::{
    available_memory, default_huge_pages, pool_huge_pages, Arena, ArenaPool, CpuDevice, FileMapping, PooledArena,
};
pub use error::DeviceError;
pub use libs::cuda_library_dirs;
pub use npu::NpuDevice;
pub use staging::{PooledStaging, StagingPool, DEFAULT_MAX_BUFFERS};

use std::any::Any;
use std::fmt;
use std::sync::Arc;

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

    /// Parses a device string as torch writes them: `cpu`, `cuda` (ordinal 0), `cuda:N`,
    /// `npu:N`.
    pub fn parse(s: &str) -> std::result::Result<DeviceId, String> {
        let s = s.trim();
        let (kind, ordinal) = match s.split_once(':') {
            Some((k, n)) => {
                let n: u32 =
                    n.trim().parse().map_err(|_| format!("invalid device `{s}`: `{n}` is not a device index"))?;
                (k.trim(), Some(n))
            }
            None => (s, None),
        };
        let kind = match kind.to_ascii_lowercase().as_str() {
            "cpu" => DeviceKind::Cpu,
            "cuda" | "gpu" => DeviceKind::Cuda,
            "npu" => DeviceKind::Npu,
            _ => return Err(format!("unknown device `{s}` (expected cpu, cuda, cuda:N or npu:N)")),
        };
        if kind == DeviceKind::Cpu && ordinal.is_some_and(|n| n != 0) {
            return Err(format!("invalid device `{s}`: there is one CPU device"));
        }
        Ok(DeviceId { kind, ordinal: ordinal.unwrap_or(0) })
    }
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

    /// The bytes, when the CPU can address them (`None`, the default, for device memory).
    fn host(&self) -> Option<&[u8]> {
        None
    }

    /// The bytes, writable, when the CPU can address them (`None`, the default, for device
    /// memory).
    fn host_mut(&mut self) -> Option<&mut [u8]> {
        None
    }

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

    /// A number naming this buffer's memory for the whole process, never given to other memory
    /// even after this buffer is freed, or `None` (the default) when the buffer cannot promise
    /// one. A reader may keep state about the memory under it between loads (io_uring's
    /// registered buffers).
    fn serial(&self) -> Option<u64> {
        None
    }
}

/// A staging buffer owned by whoever holds it; it travels into [`Device::upload`] and back out
/// of [`Transfer::wait`].
pub type Staging = Box<dyn HostBuffer>;

/// A copy the device may still be running.
pub trait PendingTransfer: Send {
    /// Blocks until the copy is complete and returns the staging buffer.
    fn wait(self: Box<Self>) -> Result<Staging>;

    /// True when the copy is known to be complete, so [`wait`](Self::wait) would not block;
    /// asked without blocking (the default, `false`, means "not known": wait to find out).
    fn is_complete(&self) -> bool {
        false
    }
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

    /// True when the copy is known to be complete ([`PendingTransfer::is_complete`]).
    pub fn is_complete(&self) -> bool {
        match self {
            Transfer::Done(_) => true,
            Transfer::Pending(p) => p.is_complete(),
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

/// AES-CTR key material a device holds for one load ([`Device::prepare_key`]). The device
/// zeroes and frees it when this handle is dropped; `Debug` never shows it.
pub trait DeviceKey: Send + Sync + fmt::Debug {
    /// For the owning device to recognise its own keys.
    fn as_any(&self) -> &dyn Any;
}

/// What a device does to an upload's bytes once they are in its memory, before the transfer
/// completes ([`Device::upload_with`]).
#[derive(Debug, Clone, Copy, Default)]
pub enum AfterUpload<'a> {
    /// Nothing: a plain copy.
    #[default]
    Nothing,
    /// XOR the AES-CTR keystream into them (decrypt in place); the upload's first byte is
    /// keystream byte `pos`.
    Keystream {
        /// The key, on the device.
        key: &'a dyn DeviceKey,
        /// Keystream position of the first byte.
        pos: u64,
    },
}

fn unsupported(device: DeviceId, what: &str) -> DeviceError {
    DeviceError::Unsupported { device, what: what.to_owned() }
}

/// One conversion in device memory ([`Device::cast`]): `elements` elements of `from` at
/// `src_offset` become elements of `to` at `dst_offset`. `from == to` copies (for a dtype the
/// conversion does not cover, give `U8` and the byte count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CastJob {
    /// Offset of the first source byte.
    pub src_offset: usize,
    /// Source dtype.
    pub from: turboio_format::Dtype,
    /// Offset of the first destination byte.
    pub dst_offset: usize,
    /// Destination dtype.
    pub to: turboio_format::Dtype,
    /// Elements converted.
    pub elements: usize,
}

impl CastJob {
    /// Bytes read from the source.
    pub fn src_len(&self) -> usize {
        self.elements * self.from.byte_size().unwrap_or(1)
    }

    /// Bytes written to the destination.
    pub fn dst_len(&self) -> usize {
        self.elements * self.to.byte_size().unwrap_or(1)
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

    /// The pool [`alloc_staging`](Self::alloc_staging) takes from, when the device keeps one
    /// (`None`, the default: every buffer is new). A staged load takes at most
    /// [`StagingPool::max_buffers`] slots so that a steady-state load allocates none; callers
    /// size or release it through this.
    fn staging_pool(&self) -> Option<&StagingPool> {
        None
    }

    /// Starts copying `src[..len]` into `dst` at `dst_offset`. The copy may still be running
    /// when this returns; [`Transfer::wait`] finishes it and returns `src`. Several uploads into
    /// disjoint ranges of one allocation may run at once, from several threads.
    fn upload(&self, src: Staging, len: usize, dst: &dyn Allocation, dst_offset: usize) -> Result<Transfer>;

    /// Copies `dst.len()` bytes of `src` at `src_offset` into host memory, and waits.
    fn download(&self, src: &dyn Allocation, src_offset: usize, dst: &mut [u8]) -> Result<()>;

    /// Waits for every copy started on this device.
    fn synchronize(&self) -> Result<()>;

    /// True if the device can decrypt AES-CTR in its own memory after an upload
    /// ([`prepare_key`](Self::prepare_key) may still fail, e.g. when its compiler is missing; the
    /// caller then decrypts on the CPU).
    fn decrypts_after_upload(&self) -> bool {
        false
    }

    /// Puts an AES-128 (16-byte) or AES-256 (32-byte) key and its IV on the device for one load.
    fn prepare_key(&self, _key: &[u8], _iv: &[u8; 16]) -> Result<Box<dyn DeviceKey>> {
        Err(unsupported(self.id(), "decrypting in device memory"))
    }

    /// [`upload`](Self::upload), then `after` on the uploaded bytes, in order, before the
    /// transfer completes.
    fn upload_with(
        &self,
        src: Staging,
        len: usize,
        dst: &dyn Allocation,
        dst_offset: usize,
        after: AfterUpload<'_>,
    ) -> Result<Transfer> {
        match after {
            AfterUpload::Nothing => self.upload(src, len, dst, dst_offset),
            AfterUpload::Keystream { .. } => Err(unsupported(self.id(), "decrypting in device memory")),
        }
    }

    /// XORs keystream bytes `pos .. pos + len` into `dst[offset .. offset + len]` (bytes that
    /// reached device memory some other way, e.g. GPUDirect Storage), and waits.
    fn apply_keystream(
        &self,
        _key: &dyn DeviceKey,
        _dst: &dyn Allocation,
        _offset: usize,
        _len: usize,
        _pos: u64,
    ) -> Result<()> {
        Err(unsupported(self.id(), "decrypting in device memory"))
    }

    /// Bytes of memory this device can still allocate (CUDA: the driver's free memory), or
    /// `None` when it cannot tell (the CPU device: host memory is checked by the caller). A load
    /// compares what it will allocate with this before allocating anything.
    fn free_memory(&self) -> Option<u64> {
        None
    }

    /// True if the device converts element types in its own memory ([`cast`](Self::cast); it
    /// may still fail, e.g. when its compiler is missing, and the caller then converts on the
    /// host).
    fn casts(&self) -> bool {
        false
    }

    /// Runs each [`CastJob`] from `src` into `dst` (allocations of this device), bit-identical
    /// to [`turboio_format::cast()`], and waits.
    fn cast(&self, _src: &dyn Allocation, _dst: &dyn Allocation, _jobs: &[CastJob]) -> Result<()> {
        Err(unsupported(self.id(), "converting dtypes in device memory"))
    }

    /// True if [`upload_from_host`](Self::upload_from_host) works: the device copies straight
    /// from host memory the caller keeps alive (e.g. a populated mapping of a cached file),
    /// without staging buffers.
    fn uploads_from_host(&self) -> bool {
        false
    }

    /// `Ok` if [`upload_from_host`](Self::upload_from_host) may be given a mapping of a cached
    /// file (the page cache's own pages, shared with every other reader of the file), else why
    /// not, in words for a load report. Defaults to [`uploads_from_host`](Self::uploads_from_host);
    /// a device that uploads anonymous host memory fine but cannot be trusted with file pages
    /// says no here.
    fn uploads_from_page_cache(&self) -> std::result::Result<(), String> {
        if self.uploads_from_host() {
            Ok(())
        } else {
            Err(format!("{} cannot copy straight from the page cache", self.id()))
        }
    }

    /// True if, for a file already in the page cache, an automatic load should copy straight
    /// from the populated mapping ([`upload_from_host`](Self::upload_from_host)) rather than
    /// through staging buffers. Defaults to [`uploads_from_host`](Self::uploads_from_host); a
    /// device where registering host memory costs more than staging it says false, and the
    /// mapping is then used only when a load asks for it (`LoadMode::Mapped`).
    fn prefers_host_uploads(&self) -> bool {
        self.uploads_from_host()
    }

    /// Copies `src` into `dst` at `dst_offset` straight from where it is (registering it for
    /// DMA as needed, read-only where the device allows), and waits.
    fn upload_from_host(&self, _src: &[u8], _dst: &dyn Allocation, _dst_offset: usize) -> Result<()> {
        Err(unsupported(self.id(), "uploading straight from host memory"))
    }

    /// A view of `len` bytes of device memory at `address` that someone else owns (a framework's
    /// tensor being saved), usable with [`download`](Self::download). Dropping it frees nothing.
    ///
    /// # Safety
    /// `address .. address + len` must be memory of this device that stays allocated, and is
    /// not written, while the view is used.
    unsafe fn borrow(&self, _address: u64, _len: usize) -> Result<Box<dyn Allocation>> {
        Err(unsupported(self.id(), "viewing memory it did not allocate"))
    }
}

/// Opens the device `id` names, ready for loads: the CPU, a CUDA device (feature `cuda`; a clean
/// error where the driver, the device or the ordinal is missing), or an error for an NPU
/// ([`NpuDevice`] says what would be needed).
pub fn open_device(id: DeviceId) -> Result<Arc<dyn Device>> {
    match id.kind {
        DeviceKind::Cpu => Ok(Arc::new(CpuDevice::new())),
        DeviceKind::Cuda => {
            #[cfg(feature = "cuda")]
            {
                Ok(Arc::new(cuda::CudaDevice::new(id.ordinal)?))
            }
            #[cfg(not(feature = "cuda"))]
            {
                Err(DeviceError::NotCompiledIn { device: id.to_string(), feature: "cuda" })
            }
        }
        DeviceKind::Npu => Err(NpuDevice::new(id.ordinal).error()),
        DeviceKind::Test => Err(unsupported(id, "test devices are made by turboio_device::testing::OpaqueDevice::new")),
    }
}

/// The first `len` bytes of staging buffer `src`, for an upload to `device`; an upload of more
/// than the buffer holds is [`DeviceError::OutOfBounds`].
pub fn staged_bytes(device: DeviceId, src: &dyn HostBuffer, len: usize) -> Result<&[u8]> {
    let have = src.as_slice().len();
    src.as_slice().get(..len).ok_or(DeviceError::OutOfBounds { device, offset: 0, len, alloc_len: have })
}

/// Checks that `offset + len` lies within an allocation of `alloc_len` bytes.
pub fn check_range(device: DeviceId, alloc_len: usize, offset: usize, len: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= alloc_len => Ok(()),
        _ => Err(DeviceError::OutOfBounds { device, offset, len, alloc_len }),
    }
}
