//! NVIDIA GPUs through the CUDA driver API (feature `cuda`).
//!
//! Built on cudarc with dynamic loading: nothing CUDA is needed to build, libcuda is opened at the
//! first [`CudaDevice::new`], and NVRTC (for the decryption kernel) at the first encrypted load.
//! A missing library, a machine without a GPU and an ordinal out of range are each a clean
//! [`DeviceError::Unavailable`] that says which; cudarc's panics on a missing library are never
//! reached (see the `ffi` module).
//!
//! # Design
//!
//! - **Memory** is allocated with `cuMemAlloc` in the device's **primary context**, the one the
//!   CUDA runtime (and so PyTorch) uses: pointers are valid in torch, and DLPack hands them over
//!   without a copy. An allocation is freed with `cuMemFree` when the load (or the last tensor
//!   viewing it) is dropped.
//! - **Uploads** go round-robin over a few non-blocking streams (`TURBOIO_CUDA_STREAMS`, default
//!   4). Each [`upload`](Device::upload) queues `cuMemcpyHtoDAsync` from a pinned staging buffer
//!   and records an event; the [`Transfer`] waits on that event and hands the buffer back. With
//!   two buffers per reader thread, reading chunk *n+1* overlaps copying chunk *n*, and the
//!   copies of several readers run on several DMA queues at once.
//! - **Staging buffers** are fresh anonymous memory registered with the driver
//!   (`cuMemHostRegister`; never zeroed by us, not write-combined, since the save path reads
//!   them back) and come from the process's [`StagingPool`] for this ordinal, which every
//!   `CudaDevice` of the ordinal shares: pinning runs at about 2 GB/s on the H200 VMs, so a
//!   buffer is pinned once per process and reused by every later load.
//!   [`CudaDevice::with_pinned_staging`] turns pinning off (veTurboIO's `use_pinmem=False`).
//!   Events are made once and recorded again by later uploads.
//! - **Decryption after upload**: [`prepare_key`](Device::prepare_key) compiles the kernel of
//!   [`aes_kernel`](crate::aes_kernel) with NVRTC for the device's architecture (once per
//!   device), expands the key on the host and copies the round keys to device memory;
//!   [`AfterUpload::Keystream`] launches the kernel on the upload's stream right after its copy,
//!   so the chunk is decrypted before its event fires and the CPU does no AES work. Dropping the
//!   key zeroes the device copy (after the streams drain) and frees it; the host copy is zeroed
//!   as soon as it is uploaded.
//! - **Hot files without staging**: [`upload_from_host`](Device::upload_from_host) registers
//!   host memory (the populated page-cache mapping of a cached file) with `cuMemHostRegister`,
//!   read-only where the device supports it, and DMAs straight from it on every stream: no CPU
//!   copy at all. Whether this beats pinned staging depends on the machine (page pinning cost
//!   against a memcpy at memory bandwidth); `cargo xtask bench --device cuda:0` measures both.
//!   Registration goes window by window (8 MiB, then 64 MiB) and is abandoned, for staging,
//!   when it runs below [`REGISTER_FLOOR`]: on some VMs pinning a page-cache mapping crawls.
//! - **Downloads** (saves, `--check`) wait for the device's streams, then copy synchronously.
//!
//! Streams, the context and the compiled kernel are shared by every [`CudaDevice`] of one
//! ordinal in a process, and so is the staging pool unless a device is given its own.
//!
//! **The calling thread's current context is left as it was.** Every driver call may run on a
//! caller's thread (torch's main thread, or whichever thread drops the last tensor of a load and
//! so frees its memory), and torch relies on the current context: each call site saves it,
//! binds the device's primary context, and restores the saved one (or none) afterwards.

mod ffi;

use crate::aes_kernel::{iv_halves, RoundKeys, KERNEL_NAME, SOURCE};
use crate::{
    check_range, AfterUpload, Allocation, Arena, CastJob, Device, DeviceError, DeviceId, DeviceKey, DeviceKind,
    HostBuffer, PendingTransfer, Result, Staging, StagingPool, Transfer,
};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Bytes per copy when uploading straight from host memory.
const HOST_UPLOAD_CHUNK: usize = 64 << 20;

/// The slowest registration of host memory ([`Device::upload_from_host`]) worth waiting for, in
/// bytes per second: below it, staging through pinned buffers (a memcpy at several GB/s) is
/// certainly faster, and registering the rest could take minutes.
pub const REGISTER_FLOOR: f64 = 256e6;

/// The environment variable that lets [`Device::upload_from_host`] register page-cache
/// mappings (`1`); see [`page_cache_registration`].
pub const REGISTER_PAGE_CACHE_ENV: &str = "TURBOIO_CUDA_REGISTER_PAGE_CACHE";

/// Whether a load may register a mapping of a cached file for DMA, given the value of
/// [`REGISTER_PAGE_CACHE_ENV`]; `Err` says why not, for the load's report.
///
/// Off by default, from measurements on lent H200 VMs (driver 580, kernel 6.18, 2026-11-26/27):
/// on three machines, `cuMemHostRegister` of a 1.07 GB mapping, or of its first 8 MiB window,
/// did not return within 60 s once the file had been read by earlier loads (the loading thread
/// at 100% CPU, no kernel wait, nothing pinned), while the same machine registered a file that
/// only its own faults had brought in within a second. Where it worked it was slower than
/// staging: 0.59-0.91 s against 0.17-0.21 s for a hot 1.07 GB file. A hang is worse than any
/// speed, and the registration call cannot be interrupted, so loads stage unless asked.
pub fn page_cache_registration(env: Option<&std::ffi::OsStr>) -> std::result::Result<(), String> {
    if env.is_some_and(|v| v == "1") {
        return Ok(());
    }
    Err(format!(
        "registering a page-cache mapping for DMA is off on CUDA devices: cuMemHostRegister of a \
         cached file's pages hung on the machines it was tried on, and staging was faster there; \
         {REGISTER_PAGE_CACHE_ENV}=1 turns it on"
    ))
}

/// The first window registered: small, so a machine where pinning crawls finds out in well
/// under a second (8 MiB at 17 MB/s, the slowest seen, is half a second).
const FIRST_REGISTER_WINDOW: usize = 8 << 20;

/// Every later window (also the copy size).
const REGISTER_WINDOW: usize = 64 << 20;

/// `(offset, len)` windows covering `[0, len)` of memory at `address`: the first about
/// [`FIRST_REGISTER_WINDOW`] bytes, then about [`REGISTER_WINDOW`], each inner edge on a
/// `page` boundary of the address, so neighbouring windows never share a page (a page
/// registered twice is an error).
fn register_windows(address: usize, len: usize, page: usize) -> Vec<(usize, usize)> {
    let end = address + len;
    let mut out = Vec::new();
    let mut at = address;
    while at < end {
        let want = if out.is_empty() { FIRST_REGISTER_WINDOW } else { REGISTER_WINDOW };
        let edge = (at + want).next_multiple_of(page).min(end);
        out.push((at - address, edge - at));
        at = edge;
    }
    out
}

/// Registration speed so far, against [`REGISTER_FLOOR`].
#[derive(Default)]
struct RegisterPace {
    bytes: usize,
    secs: f64,
}

impl RegisterPace {
    /// Adds one window's registration; `Some(why)` once the rate so far is under the floor
    /// (judged only after 5 ms, so a short window's timer noise is not a verdict).
    fn add(&mut self, bytes: usize, took: std::time::Duration) -> Option<String> {
        self.bytes += bytes;
        self.secs += took.as_secs_f64();
        let rate = self.bytes as f64 / self.secs.max(1e-9);
        (self.secs >= 0.005 && rate < REGISTER_FLOOR).then(|| {
            format!(
                "registering the file's mapping for DMA (cuMemHostRegister) ran at {:.0} MB/s ({} MiB in {:.2} s), \
                 below {:.0} MB/s: pinning pages is slow on this machine",
                rate / 1e6,
                self.bytes >> 20,
                self.secs,
                REGISTER_FLOOR / 1e6
            )
        })
    }
}

/// Threads per block of the decryption kernel.
const AES_BLOCK: u32 = 256;

/// Threads per block of the conversion kernel (one element each).
const CAST_BLOCK: u32 = 256;

/// How many CUDA devices this process sees; `Err` says why CUDA is unusable (no libcuda, no
/// device), in words for the user.
pub fn device_count() -> std::result::Result<u32, String> {
    ffi::driver()?;
    ffi::device_count()
}

/// Checks that `cuda:ordinal` exists and can be used, without allocating anything.
pub fn check_device(ordinal: u32) -> Result<()> {
    Shared::get(ordinal).map(|_| ())
}

/// Makes the primary context of `cuda:ordinal` current on the calling thread (for libraries
/// such as cuFile that act on the current context) until the returned guard drops, which makes
/// the thread's previous context (or none) current again.
pub fn bind_context(ordinal: u32) -> Result<BoundContext> {
    let shared = Shared::get(ordinal)?;
    ffi::bind(&shared.ctx)
        .map(|restore| BoundContext { _restore: restore })
        .map_err(|e| shared.driver_error("binding the context", e))
}

/// A device's context made current by [`bind_context`]; dropping it restores the thread's
/// previous context.
#[must_use = "the context is current only while the guard lives"]
pub struct BoundContext {
    _restore: ffi::Restore,
}

impl fmt::Debug for BoundContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BoundContext")
    }
}

/// The decryption kernel, compiled to PTX for `arch` (e.g. `compute_90`; `None` for NVRTC's
/// default) without touching a GPU: only NVRTC is needed.
pub fn compile_kernel_ptx(arch: Option<&str>) -> std::result::Result<String, String> {
    ffi::nvrtc()?;
    Ok(ffi::compile_ptx(SOURCE, arch.map(str::to_owned))?.to_src())
}

/// The dtype conversion kernel, compiled to PTX for `arch` like
/// [`compile_kernel_ptx`] (only NVRTC is needed).
pub fn compile_cast_kernel_ptx(arch: Option<&str>) -> std::result::Result<String, String> {
    ffi::nvrtc()?;
    Ok(ffi::compile_ptx(crate::cast_kernel::SOURCE, arch.map(str::to_owned))?.to_src())
}

struct Kernel {
    func: CudaFunction,
}

/// What every `CudaDevice` of one ordinal shares.
struct Shared {
    id: DeviceId,
    ctx: Arc<CudaContext>,
    streams: Vec<Arc<CudaStream>>,
    next: AtomicUsize,
    kernel: OnceLock<std::result::Result<Kernel, String>>,
    cast_kernel: OnceLock<std::result::Result<Kernel, String>>,
    read_only_register: bool,
    sm_count: u32,
    arch: (i32, i32),
    /// The process's pinned staging pool for this ordinal (see the `staging` module docs).
    pool: StagingPool,
    /// Events no transfer uses now, recorded again by the next uploads.
    events: Mutex<Vec<ffi::Event>>,
}

impl Shared {
    fn get(ordinal: u32) -> Result<Arc<Shared>> {
        static ALL: OnceLock<Mutex<HashMap<u32, Arc<Shared>>>> = OnceLock::new();
        let name = format!("cuda:{ordinal}");
        let unavailable = |reason: String| DeviceError::Unavailable { device: name.clone(), reason };
        let mut all = ALL.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = all.get(&ordinal) {
            return Ok(s.clone());
        }
        ffi::driver().map_err(&unavailable)?;
        let count = ffi::device_count().map_err(&unavailable)?;
        if ordinal >= count {
            return Err(unavailable(match count {
                0 => "no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)".into(),
                1 => "this machine has 1 CUDA device (cuda:0)".into(),
                n => format!("this machine has {n} CUDA devices (cuda:0 to cuda:{})", n - 1),
            }));
        }
        let ctx = ffi::primary_context(ordinal).map_err(&unavailable)?;
        // Streams and attributes bind the context: the caller's current one comes back after.
        let _bound = ffi::bind(&ctx).map_err(|e| unavailable(format!("binding the context: {}", ffi::describe(e))))?;
        let id = DeviceId { kind: DeviceKind::Cuda, ordinal };
        let err = |what: &str, e| DeviceError::Driver { device: id, message: format!("{what}: {}", ffi::describe(e)) };
        let n = std::env::var("TURBOIO_CUDA_STREAMS").ok().and_then(|v| v.parse().ok()).unwrap_or(4usize).clamp(1, 64);
        let streams = (0..n)
            .map(|_| ctx.new_stream())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| err("creating streams", e))?;
        use cudarc::driver::sys::CUdevice_attribute as A;
        let attr = |a| ctx.attribute(a).unwrap_or(0);
        let shared = Arc::new(Shared {
            id,
            read_only_register: attr(A::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED) > 0,
            sm_count: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).max(1) as u32,
            arch: (
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            ),
            ctx,
            streams,
            pool: StagingPool::default(),
            events: Mutex::new(Vec::new()),
            next: AtomicUsize::new(0),
            kernel: OnceLock::new(),
            cast_kernel: OnceLock::new(),
        });
        all.insert(ordinal, shared.clone());
        Ok(shared)
    }

    fn driver_error(&self, what: &str, e: cudarc::driver::DriverError) -> DeviceError {
        DeviceError::Driver { device: self.id, message: format!("{what}: {}", ffi::describe(e)) }
    }

    fn stream(&self) -> &Arc<CudaStream> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len();
        &self.streams[i]
    }

    fn synchronize(&self) -> Result<()> {
        let _bound = ffi::bind(&self.ctx).map_err(|e| self.driver_error("binding the context", e))?;
        for s in &self.streams {
            s.synchronize().map_err(|e| self.driver_error("synchronizing a stream", e))?;
        }
        Ok(())
    }

    /// The decryption kernel, compiled and loaded on first use.
    fn kernel(&self) -> std::result::Result<&Kernel, String> {
        self.compiled(&self.kernel, SOURCE, KERNEL_NAME)
    }

    /// The dtype conversion kernel, compiled and loaded on first use.
    fn cast_kernel(&self) -> std::result::Result<&Kernel, String> {
        self.compiled(&self.cast_kernel, crate::cast_kernel::SOURCE, crate::cast_kernel::KERNEL_NAME)
    }

    fn compiled<'a>(
        &self,
        slot: &'a OnceLock<std::result::Result<Kernel, String>>,
        source: &str,
        name: &str,
    ) -> std::result::Result<&'a Kernel, String> {
        slot.get_or_init(|| {
            ffi::nvrtc()?;
            let arch = (self.arch.0 > 0).then(|| format!("compute_{}{}", self.arch.0, self.arch.1));
            let ptx = ffi::compile_ptx(source, arch)?;
            let _bound = ffi::bind(&self.ctx).map_err(ffi::describe)?;
            let module = self.ctx.load_module(ptx).map_err(|e| {
                format!(
                    "the driver could not load the kernel NVRTC compiled ({}); NVRTC may be newer than the driver",
                    ffi::describe(e)
                )
            })?;
            let func = module.load_function(name).map_err(ffi::describe)?;
            Ok(Kernel { func })
        })
        .as_ref()
        .map_err(Clone::clone)
    }
}

/// An NVIDIA GPU. See the module docs.
#[derive(Clone)]
pub struct CudaDevice {
    shared: Arc<Shared>,
    pool: StagingPool,
    pinned: bool,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("id", &self.shared.id)
            .field("streams", &self.shared.streams.len())
            .field("pinned", &self.pinned)
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Opens `cuda:ordinal`. Fails cleanly ([`DeviceError::Unavailable`]) when libcuda is
    /// missing, no device is visible, or the ordinal is out of range.
    pub fn new(ordinal: u32) -> Result<CudaDevice> {
        let shared = Shared::get(ordinal)?;
        Ok(CudaDevice { pool: shared.pool.clone(), shared, pinned: true })
    }

    /// Uses `pool` for staging buffers instead of the process's pool for this ordinal (which
    /// every `CudaDevice::new` of the ordinal shares).
    pub fn with_staging_pool(mut self, pool: StagingPool) -> Self {
        self.pool = pool;
        self
    }

    /// Page-locked staging buffers (default) or ordinary ones (slower copies; veTurboIO's
    /// `use_pinmem=False`).
    pub fn with_pinned_staging(mut self, pinned: bool) -> Self {
        if pinned != self.pinned {
            // Pageable buffers never join the pinned pool (nor the other way round).
            self.pool = if pinned { self.shared.pool.clone() } else { StagingPool::default() };
        }
        self.pinned = pinned;
        self
    }

    /// The compute capability, e.g. `(9, 0)` for an H100.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.shared.arch
    }

    /// The number of copy streams.
    pub fn streams(&self) -> usize {
        self.shared.streams.len()
    }

    fn own<'a>(&self, a: &'a dyn Allocation) -> Result<&'a CudaAllocation> {
        a.as_any()
            .downcast_ref::<CudaAllocation>()
            .filter(|c| c.device == self.shared.id)
            .ok_or(DeviceError::ForeignAllocation { device: self.shared.id, other: a.device() })
    }

    fn own_key<'a>(&self, k: &'a dyn DeviceKey) -> Result<&'a CudaKey> {
        k.as_any()
            .downcast_ref::<CudaKey>()
            .filter(|c| c.device == self.shared.id)
            .ok_or(DeviceError::Driver { device: self.shared.id, message: "a key prepared by another device".into() })
    }

    fn queue_keystream(&self, key: &CudaKey, stream: &CudaStream, data: u64, len: usize, pos: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let kernel = self
            .shared
            .kernel()
            .map_err(|reason| DeviceError::Unavailable { device: self.shared.id.to_string(), reason })?;
        let blocks = (len as u64 / 16 + 2).div_ceil(u64::from(AES_BLOCK));
        let grid = blocks.min(u64::from(self.shared.sm_count) * 8).max(1) as u32;
        let args = ffi::AesArgs {
            data,
            len: len as u64,
            round_keys: key.round_keys,
            rounds: key.rounds,
            iv_hi: key.iv.0,
            iv_lo: key.iv.1,
            pos,
        };
        // SAFETY: `kernel.func` is turboio_aes_ctr_xor; `data .. data + len` lies in an
        // allocation of this device (range-checked by the callers) that outlives the stream's
        // work (allocations are freed with cuMemFree, which waits for it); the round keys live
        // until the key is dropped, which first drains every stream.
        unsafe { ffi::launch_aes(&kernel.func, stream, &args, grid, AES_BLOCK) }
            .map_err(|e| self.shared.driver_error("launching the decryption kernel", e))
    }

    /// Measures host-to-device bandwidth from one pinned buffer of `bytes` copied in `chunk`
    /// pieces over every stream, `repeats` times (the ceiling a staged load can reach); returns
    /// GB/s (10^9 bytes per second) of the median run.
    pub fn pinned_h2d_gbps(&self, bytes: usize, chunk: usize, repeats: usize) -> Result<f64> {
        let src = ffi::PinnedMemory::new(&self.shared.ctx, bytes)
            .map_err(|e| self.shared.driver_error("cuMemHostAlloc", e))?;
        let dst = self.alloc(bytes)?;
        let dst = self.own(dst.as_ref())?;
        let mut times = Vec::new();
        for _ in 0..repeats.max(1) {
            self.shared.synchronize()?;
            let t = std::time::Instant::now();
            for (i, piece) in src.as_slice().chunks(chunk.max(1)).enumerate() {
                let stream = &self.shared.streams[i % self.shared.streams.len()];
                // SAFETY: the destination range lies inside `dst` (same offsets as `src`), and
                // `src` outlives the copies (synchronized below, before it is dropped).
                unsafe { ffi::htod_async(dst.ptr + (i * chunk) as u64, piece, stream) }
                    .map_err(|e| self.shared.driver_error("cuMemcpyHtoDAsync", e))?;
            }
            self.shared.synchronize()?;
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        Ok(bytes as f64 / times[times.len() / 2] / 1e9)
    }

    /// Measures the pinning rate as the staging pool pays it: `bytes` of fresh anonymous memory
    /// in slots of `slot` bytes, each registered with the driver (`cuMemHostRegister`) the way
    /// a pool slot is made, in GB/s (the slots are released afterwards, outside the time).
    pub fn pinning_gbps(&self, bytes: usize, slot: usize) -> Result<f64> {
        let slot = slot.max(4096);
        let mut kept = Vec::new();
        let t = std::time::Instant::now();
        for _ in 0..bytes.div_ceil(slot).max(1) {
            kept.push(PinnedStaging::new(&self.shared.ctx, slot, self.shared.id)?);
        }
        let secs = t.elapsed().as_secs_f64();
        let pinned = kept.len() * slot;
        drop(kept);
        Ok(pinned as f64 / secs / 1e9)
    }
}

/// Device memory from [`CudaDevice::alloc`] (owned, freed on drop) or [`Device::borrow`]
/// (a view of someone else's memory).
pub struct CudaAllocation {
    device: DeviceId,
    ptr: u64,
    len: usize,
    owned: bool,
    ctx: Arc<CudaContext>,
}

impl fmt::Debug for CudaAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaAllocation")
            .field("device", &self.device)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("owned", &self.owned)
            .finish()
    }
}

impl Drop for CudaAllocation {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: allocated by mem_alloc in this context and freed only here; nothing of
            // ours uses it any more (the load or the last tensor viewing it is gone).
            unsafe { ffi::mem_free(&self.ctx, self.ptr) };
        }
    }
}

impl Allocation for CudaAllocation {
    fn len(&self) -> usize {
        self.len
    }

    fn device(&self) -> DeviceId {
        self.device
    }

    fn address(&self) -> u64 {
        self.ptr
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A pinned staging buffer: fresh anonymous memory (zero pages from the kernel; nothing here
/// writes it) registered with the driver (`cuMemHostRegister`, as InstantTensor does: faster
/// than `cuMemHostAlloc` plus the memset its memory would need).
struct PinnedStaging {
    // Fields drop in order: unregistered before unmapped.
    _registered: ffi::Registered,
    arena: Arena,
}

impl PinnedStaging {
    /// `len` bytes of fresh anonymous memory, registered with the driver.
    fn new(ctx: &Arc<CudaContext>, len: usize, device: DeviceId) -> Result<PinnedStaging> {
        let arena = Arena::new(len, false)?;
        // SAFETY: the arena's pages stay mapped until the registration is dropped (the
        // struct's field order), and the driver only pins them.
        let registered =
            unsafe { ffi::Registered::new(ctx, arena.as_slice(), false) }.map_err(|e| DeviceError::OutOfMemory {
                device,
                len,
                source: std::io::Error::other(format!("pinning host memory: {}", ffi::describe(e))),
            })?;
        Ok(PinnedStaging { _registered: registered, arena })
    }
}

impl fmt::Debug for PinnedStaging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PinnedStaging({} bytes)", self.arena.len())
    }
}

impl HostBuffer for PinnedStaging {
    fn as_slice(&self) -> &[u8] {
        self.arena.as_slice()
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.arena.as_mut_slice()
    }

    fn serial(&self) -> Option<u64> {
        Some(self.arena.serial())
    }
}

/// An upload in flight: the event after its copy (and kernel), and the buffer it reads.
struct CudaPending {
    event: Option<ffi::Event>,
    staging: Option<Staging>,
    shared: Arc<Shared>,
}

impl PendingTransfer for CudaPending {
    fn wait(mut self: Box<Self>) -> Result<Staging> {
        let device = self.shared.id;
        if let Some(mut e) = self.event.take() {
            e.wait()
                .map_err(|e| DeviceError::Driver { device, message: format!("copy failed: {}", ffi::describe(e)) })?;
            // Done with: the next upload records it again.
            self.shared.events.lock().unwrap_or_else(|p| p.into_inner()).push(e);
        }
        self.staging.take().ok_or(DeviceError::Driver { device, message: "transfer waited twice".into() })
    }

    fn is_complete(&self) -> bool {
        self.event.as_ref().is_none_or(ffi::Event::is_done)
    }
}

impl Drop for CudaPending {
    fn drop(&mut self) {
        // Never free a staging buffer under a running copy: dropping the event waits for it,
        // and fields drop in order (event, then staging).
        self.event.take();
    }
}

/// AES round keys in device memory for one load.
struct CudaKey {
    device: DeviceId,
    shared: Arc<Shared>,
    round_keys: u64,
    rounds: u32,
    iv: (u64, u64),
}

impl fmt::Debug for CudaKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaKey").field("device", &self.device).field("rounds", &self.rounds).finish_non_exhaustive()
    }
}

impl DeviceKey for CudaKey {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaKey {
    fn drop(&mut self) {
        // Let every kernel that reads the keys finish, then zero and free them.
        let _ = self.shared.synchronize();
        // SAFETY: 240 bytes allocated by mem_alloc in prepare_key, no longer read by any kernel
        // (streams drained above); zeroed then freed exactly once.
        unsafe {
            let _ = ffi::mem_zero(&self.shared.ctx, self.round_keys, 240);
            ffi::mem_free(&self.shared.ctx, self.round_keys);
        }
    }
}

impl Device for CudaDevice {
    fn id(&self) -> DeviceId {
        self.shared.id
    }

    fn free_memory(&self) -> Option<u64> {
        ffi::mem_get_info(&self.shared.ctx).ok().map(|(free, _total)| free as u64)
    }

    fn alloc(&self, len: usize) -> Result<Box<dyn Allocation>> {
        let ptr = ffi::mem_alloc(&self.shared.ctx, len).map_err(|e| DeviceError::OutOfMemory {
            device: self.shared.id,
            len,
            source: std::io::Error::other(ffi::describe(e)),
        })?;
        Ok(Box::new(CudaAllocation { device: self.shared.id, ptr, len, owned: true, ctx: self.shared.ctx.clone() }))
    }

    fn staging_pool(&self) -> Option<&StagingPool> {
        Some(&self.pool)
    }

    fn alloc_staging(&self, len: usize) -> Result<Staging> {
        let pinned = self.pinned;
        let ctx = self.shared.ctx.clone();
        let events = &self.shared.events;
        let id = self.shared.id;
        let buf = self.pool.take(len, |len| -> Result<Staging> {
            if pinned {
                let slot = PinnedStaging::new(&ctx, len, id)?;
                // An event per slot, made with it: a transfer holds one slot and one event, so
                // uploads find a free event and never create one.
                let event = ffi::Event::new(&ctx).map_err(|e| DeviceError::Driver {
                    device: id,
                    message: format!("creating an event: {}", ffi::describe(e)),
                })?;
                events.lock().unwrap_or_else(|p| p.into_inner()).push(event);
                Ok(Box::new(slot))
            } else {
                Ok(Box::new(Arena::new(len, false)?))
            }
        })?;
        Ok(Box::new(buf))
    }

    fn upload(&self, src: Staging, len: usize, dst: &dyn Allocation, dst_offset: usize) -> Result<Transfer> {
        self.upload_with(src, len, dst, dst_offset, AfterUpload::Nothing)
    }

    fn upload_with(
        &self,
        src: Staging,
        len: usize,
        dst: &dyn Allocation,
        dst_offset: usize,
        after: AfterUpload<'_>,
    ) -> Result<Transfer> {
        let dst = self.own(dst)?;
        check_range(self.shared.id, dst.len, dst_offset, len)?;
        let bytes = crate::staged_bytes(self.shared.id, src.as_ref(), len)?;
        let stream = self.shared.stream();
        let at = dst.ptr + dst_offset as u64;
        // SAFETY: the destination range was checked against the allocation; `src` moves into
        // the returned transfer, which waits for the event recorded below (after the copy)
        // before handing it back or dropping it.
        unsafe { ffi::htod_async(at, bytes, stream) }.map_err(|e| self.shared.driver_error("cuMemcpyHtoDAsync", e))?;
        if let AfterUpload::Keystream { key, pos } = after {
            self.queue_keystream(self.own_key(key)?, stream, at, len, pos)?;
        }
        let reused = self.shared.events.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut event = match reused {
            Some(e) => e,
            None => ffi::Event::new(&self.shared.ctx).map_err(|e| self.shared.driver_error("creating an event", e))?,
        };
        event.record(stream).map_err(|e| self.shared.driver_error("recording an event", e))?;
        Ok(Transfer::Pending(Box::new(CudaPending {
            event: Some(event),
            staging: Some(src),
            shared: self.shared.clone(),
        })))
    }

    fn download(&self, src: &dyn Allocation, src_offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = self.own(src)?;
        check_range(self.shared.id, src.len, src_offset, dst.len())?;
        self.shared.synchronize()?;
        // SAFETY: the range was checked; our streams are drained, and a borrowed range is the
        // caller's to keep unwritten (Device::borrow's contract).
        unsafe { ffi::dtoh(&self.shared.ctx, dst, src.ptr + src_offset as u64) }
            .map_err(|e| self.shared.driver_error("cuMemcpyDtoH", e))
    }

    fn synchronize(&self) -> Result<()> {
        self.shared.synchronize()
    }

    fn decrypts_after_upload(&self) -> bool {
        true
    }

    fn prepare_key(&self, key: &[u8], iv: &[u8; 16]) -> Result<Box<dyn DeviceKey>> {
        self.shared
            .kernel()
            .map_err(|reason| DeviceError::Unavailable { device: self.shared.id.to_string(), reason })?;
        let rk = RoundKeys::expand(key).ok_or(DeviceError::Driver {
            device: self.shared.id,
            message: format!("AES keys are 16 or 32 bytes, not {}", key.len()),
        })?;
        let ptr =
            ffi::mem_alloc(&self.shared.ctx, 240).map_err(|e| self.shared.driver_error("allocating the key", e))?;
        let cuda_key = CudaKey {
            device: self.shared.id,
            shared: self.shared.clone(),
            round_keys: ptr,
            rounds: rk.rounds(),
            iv: iv_halves(iv),
        };
        let mut bytes = rk.to_ne_bytes();
        // SAFETY: `ptr` holds 240 bytes, more than the 176 or 240 of the schedule; nothing else
        // uses it yet.
        let r = unsafe { ffi::htod(&self.shared.ctx, ptr, &bytes) };
        for b in bytes.iter_mut() {
            // SAFETY: a valid exclusive reference; volatile so the zeroing is not elided.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
        r.map_err(|e| self.shared.driver_error("copying the key", e))?;
        Ok(Box::new(cuda_key))
    }

    fn apply_keystream(
        &self,
        key: &dyn DeviceKey,
        dst: &dyn Allocation,
        offset: usize,
        len: usize,
        pos: u64,
    ) -> Result<()> {
        let key = self.own_key(key)?;
        let dst = self.own(dst)?;
        check_range(self.shared.id, dst.len, offset, len)?;
        // Split over the streams so several kernels run at once on big ranges.
        let per = len.div_ceil(self.shared.streams.len()).next_multiple_of(16).max(16);
        let mut done = 0;
        while done < len {
            let n = per.min(len - done);
            self.queue_keystream(key, self.shared.stream(), dst.ptr + (offset + done) as u64, n, pos + done as u64)?;
            done += n;
        }
        self.shared.synchronize()
    }

    fn casts(&self) -> bool {
        true
    }

    fn cast(&self, src: &dyn Allocation, dst: &dyn Allocation, jobs: &[CastJob]) -> Result<()> {
        let (src, dst) = (self.own(src)?, self.own(dst)?);
        let kernel = self
            .shared
            .cast_kernel()
            .map_err(|reason| DeviceError::Unavailable { device: self.shared.id.to_string(), reason })?;
        for j in jobs {
            check_range(self.shared.id, src.len, j.src_offset, j.src_len())?;
            check_range(self.shared.id, dst.len, j.dst_offset, j.dst_len())?;
            let codes = (crate::cast_kernel::code(j.from), crate::cast_kernel::code(j.to));
            let (Some(from), Some(to)) = codes else {
                return Err(DeviceError::Unsupported {
                    device: self.shared.id,
                    what: format!("converting {} to {} in device memory", j.from, j.to),
                });
            };
            if j.elements == 0 {
                continue;
            }
            let grid =
                (j.elements as u64).div_ceil(u64::from(CAST_BLOCK)).min(u64::from(self.shared.sm_count) * 8).max(1);
            let args = ffi::CastArgs {
                src: src.ptr + j.src_offset as u64,
                dst: dst.ptr + j.dst_offset as u64,
                n: j.elements as u64,
                from,
                to,
            };
            // SAFETY: `kernel.func` is turboio_cast; both ranges were checked against allocations
            // of this device above, which outlive the stream's work (cuMemFree waits for it), and
            // the jobs' destinations do not overlap their sources (separate allocations).
            unsafe { ffi::launch_cast(&kernel.func, self.shared.stream(), &args, grid as u32, CAST_BLOCK) }
                .map_err(|e| self.shared.driver_error("launching the conversion kernel", e))?;
        }
        self.shared.synchronize()
    }

    fn uploads_from_host(&self) -> bool {
        true
    }

    /// Refused unless [`REGISTER_PAGE_CACHE_ENV`] is `1`: registering a page-cache mapping hung
    /// (see [`page_cache_registration`]); anonymous host memory (a converted arena) still uploads
    /// from where it is.
    fn uploads_from_page_cache(&self) -> std::result::Result<(), String> {
        page_cache_registration(std::env::var_os(REGISTER_PAGE_CACHE_ENV).as_deref())
    }

    /// Measured on an H200 (PCIe 5 x16, driver 580, 2026-11-26) with `turboio load --device
    /// cuda:0` on hot 1.07 GB files: copying from the registered page-cache mapping took
    /// 0.68-0.91 s (five loads: `cuMemHostRegister` pins and maps every 4 KiB page of the file
    /// for each load), staging through pinned buffers 0.17-0.35 s (six loads). So automatic loads
    /// stage; `LoadMode::Mapped` takes the mapping only where registration is allowed
    /// (`TURBOIO_CUDA_REGISTER_PAGE_CACHE=1`), and stages otherwise.
    fn prefers_host_uploads(&self) -> bool {
        false
    }

    /// Registers `src` window by window (8 MiB first, then 64 MiB, each
    /// edge on a page boundary), queueing each window's copies as soon as it is registered. A
    /// registration slower than [`REGISTER_FLOOR`] (measured on a lent H200 VM, 2026-11-27:
    /// registering a 1 GiB page-cache mapping did not return within 60 s, three times, where
    /// another VM of the same kind took under a second) ends the attempt with
    /// [`DeviceError::Unsupported`] after the copies already queued complete, so the load
    /// stages instead (and says so in its report) rather than spending minutes pinning pages.
    fn upload_from_host(&self, src: &[u8], dst: &dyn Allocation, dst_offset: usize) -> Result<()> {
        let dst = self.own(dst)?;
        check_range(self.shared.id, dst.len, dst_offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let mut held = Vec::new();
        let mut result = Ok(());
        let mut pace = RegisterPace::default();
        'windows: for (start, len) in register_windows(src.as_ptr() as usize, src.len(), crate::sys::page_size()) {
            let window = &src[start..start + len];
            let t = std::time::Instant::now();
            // SAFETY: `src` is borrowed for this whole call and every registration is dropped
            // below, after every copy from it has completed.
            let reg = unsafe { ffi::Registered::new(&self.shared.ctx, window, self.shared.read_only_register) };
            match reg {
                Ok(r) => held.push(r),
                Err(e) => {
                    result = Err(DeviceError::Unsupported {
                        device: self.shared.id,
                        what: format!(
                            "registering the file's mapping for DMA (cuMemHostRegister) was refused: {}",
                            ffi::describe(e)
                        ),
                    });
                    break;
                }
            }
            let slow = pace.add(len, t.elapsed());
            for (i, piece) in window.chunks(HOST_UPLOAD_CHUNK).enumerate() {
                let at = dst.ptr + (dst_offset + start + i * HOST_UPLOAD_CHUNK) as u64;
                // SAFETY: inside the checked destination range; the window is registered and
                // borrowed until the synchronize below.
                if let Err(e) = unsafe { ffi::htod_async(at, piece, self.shared.stream()) } {
                    result = Err(self.shared.driver_error("cuMemcpyHtoDAsync", e));
                    break 'windows;
                }
            }
            if let Some(why) = slow {
                result = Err(DeviceError::Unsupported { device: self.shared.id, what: why });
                break;
            }
        }
        let synced = self.shared.synchronize();
        drop(held);
        result.and(synced)
    }

    unsafe fn borrow(&self, address: u64, len: usize) -> Result<Box<dyn Allocation>> {
        Ok(Box::new(CudaAllocation {
            device: self.shared.id,
            ptr: address,
            len,
            owned: false,
            ctx: self.shared.ctx.clone(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hardware tests run only with `TURBOIO_TEST_CUDA=1`.
    fn gpu() -> Option<CudaDevice> {
        if std::env::var("TURBOIO_TEST_CUDA").as_deref() != Ok("1") {
            eprintln!("skipped: TURBOIO_TEST_CUDA is not 1 (no GPU test)");
            return None;
        }
        Some(CudaDevice::new(0).expect("TURBOIO_TEST_CUDA=1 but cuda:0 cannot be opened"))
    }

    #[test]
    fn page_cache_registration_is_off_unless_asked() {
        use std::ffi::OsStr;
        for off in [None, Some(OsStr::new("0")), Some(OsStr::new("")), Some(OsStr::new("yes"))] {
            let why = page_cache_registration(off).unwrap_err();
            assert!(why.contains("TURBOIO_CUDA_REGISTER_PAGE_CACHE=1") && why.contains("hung"), "{why}");
        }
        assert_eq!(page_cache_registration(Some(OsStr::new("1"))), Ok(()));
    }

    #[test]
    fn register_windows_cover_the_range_on_page_edges() {
        let page = 4096;
        for (address, len) in
            [(0x1000_0010usize, (200 << 20) + 5), (0x2000_0000, 4096), (0x3000_0007, 1), (0x4000_0000, 8 << 20)]
        {
            let w = register_windows(address, len, page);
            assert_eq!(w[0].0, 0);
            assert!(w[0].1 <= FIRST_REGISTER_WINDOW + page, "{w:?}");
            let mut next = 0;
            for (i, &(at, n)) in w.iter().enumerate() {
                assert_eq!(at, next, "contiguous: {w:?}");
                assert!(n > 0 && n <= REGISTER_WINDOW + page);
                next = at + n;
                if i + 1 < w.len() {
                    assert_eq!((address + next) % page, 0, "inner edges on pages: {w:?}");
                }
            }
            assert_eq!(next, len, "covers the range: {w:?}");
        }
        assert_eq!(register_windows(0x1000, 200 << 20, 4096).len(), 4, "8 MiB, then 64 MiB windows");
    }

    #[test]
    fn a_crawling_registration_is_abandoned_with_its_rate() {
        use std::time::Duration;
        let mut fast = RegisterPace::default();
        assert!(fast.add(8 << 20, Duration::from_millis(6)).is_none(), "1.4 GB/s");
        assert!(fast.add(64 << 20, Duration::from_millis(50)).is_none());
        let mut tiny = RegisterPace::default();
        assert!(tiny.add(4096, Duration::from_millis(1)).is_none(), "too short to judge");
        let mut slow = RegisterPace::default();
        let why = slow.add(8 << 20, Duration::from_millis(500)).expect("17 MB/s is below the floor");
        assert!(why.contains("17 MB/s") && why.contains("8 MiB in 0.50 s") && why.contains("below 256 MB/s"), "{why}");
    }

    #[test]
    fn without_a_gpu_opening_fails_cleanly() {
        if std::env::var("TURBOIO_TEST_CUDA").as_deref() == Ok("1") {
            eprintln!("skipped: this test is for machines without a GPU");
            return;
        }
        let err = CudaDevice::new(0).unwrap_err().to_string();
        assert!(err.starts_with("cuda:0 is not available: "), "{err}");
        assert!(err.contains("libcuda") || err.contains("no CUDA device"), "names what is missing: {err}");
        let err = CudaDevice::new(7).unwrap_err().to_string();
        assert!(err.contains("cuda:7"), "{err}");
        assert!(device_count().is_err());
        assert!(crate::open_device(DeviceId::parse("cuda:1").unwrap()).is_err());
    }

    #[test]
    fn gpu_round_trip_decrypt_and_host_uploads() {
        let Some(dev) = gpu() else { return };
        let n = (40 << 20) + 77;
        let data: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        let a = dev.alloc(n + 16).unwrap();
        let mut s = dev.alloc_staging(n).unwrap();
        s.as_mut_slice()[..n].copy_from_slice(&data);
        dev.upload(s, n, a.as_ref(), 16).unwrap().wait().unwrap();
        let mut back = vec![0u8; n];
        dev.download(a.as_ref(), 16, &mut back).unwrap();
        assert!(back == data);
        dev.upload_from_host(&data[..1 << 20], a.as_ref(), 3).unwrap();
        let mut small = vec![0u8; 1 << 20];
        dev.download(a.as_ref(), 3, &mut small).unwrap();
        assert!(small[..] == data[..1 << 20]);
        // Decrypt after upload against the CPU cipher.
        let key = [3u8; 32];
        let iv = [0xff; 16];
        let mut enc = data.clone();
        turboio_cipher_ref(&key, &iv, 777, &mut enc);
        let k = dev.prepare_key(&key, &iv).unwrap();
        let mut s = dev.alloc_staging(n).unwrap();
        s.as_mut_slice()[..n].copy_from_slice(&enc);
        dev.upload_with(s, n, a.as_ref(), 5, AfterUpload::Keystream { key: k.as_ref(), pos: 777 })
            .unwrap()
            .wait()
            .unwrap();
        dev.download(a.as_ref(), 5, &mut back).unwrap();
        assert!(back == data, "GPU decryption matches the CPU cipher");
        drop(k);
        assert!(dev.pinned_h2d_gbps(64 << 20, 8 << 20, 2).unwrap() > 0.0);
    }

    /// The calling thread's current context is the same after every call (torch relies on it):
    /// here none is current, and allocating, uploading, downloading, synchronising, freeing and
    /// binding for cuFile all leave none current. (Before, the device's context stayed current.)
    #[test]
    fn calls_leave_the_threads_current_context_as_it_was() {
        let Some(dev) = gpu() else { return };
        use cudarc::driver::result::ctx;
        // SAFETY: unbinding any context from this test thread; nothing of this thread uses one.
        unsafe { ctx::set_current(std::ptr::null_mut()) }.unwrap();
        let a = dev.alloc(1 << 20).unwrap();
        assert_eq!(ctx::get_current().unwrap(), None, "alloc");
        let mut s = dev.alloc_staging(4096).unwrap();
        s.as_mut_slice()[..4].copy_from_slice(b"abcd");
        dev.upload(s, 4096, a.as_ref(), 0).unwrap().wait().unwrap();
        assert_eq!(ctx::get_current().unwrap(), None, "upload");
        let mut back = [0u8; 4];
        dev.download(a.as_ref(), 0, &mut back).unwrap();
        assert_eq!(&back, b"abcd");
        dev.synchronize().unwrap();
        assert_eq!(ctx::get_current().unwrap(), None, "download and synchronize");
        drop(a);
        assert_eq!(ctx::get_current().unwrap(), None, "free (the DLPack deleter's path)");
        {
            let _bound = bind_context(0).unwrap();
            assert!(ctx::get_current().unwrap().is_some());
        }
        assert_eq!(ctx::get_current().unwrap(), None, "bind_context's guard");
    }

    fn turboio_cipher_ref(key: &[u8], iv: &[u8; 16], pos: u64, buf: &mut [u8]) {
        turboio_cipher::CtrCipher::new(&turboio_cipher::Key::new(key).unwrap(), &turboio_cipher::Iv(*iv))
            .apply_at(pos, buf);
    }
}
