//! Every call into the CUDA driver and NVRTC, through cudarc's `result`/`sys` layers. All of
//! the CUDA device's `unsafe` code lives here.
//!
//! cudarc loads libcuda and libnvrtc at their first use and **panics** when a library is absent
//! (and when a symbol is missing). Nothing here calls cudarc before [`driver`] has checked that
//! libcuda loads and initialises (the check itself runs under `catch_unwind`), and NVRTC is
//! checked the same way by [`nvrtc`], which also finds the copies that pip wheels install
//! outside the loader's path (see [`crate::cuda_library_dirs`]): such a copy is opened by its
//! full path first, and cudarc's later `dlopen` by name then finds it, because the dynamic loader
//! matches names against the sonames of libraries already loaded.

use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

/// Runs `f`, turning a panic (cudarc's reaction to a missing library or symbol) into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        format!("{what}: {msg}")
    })
}

/// The context that was current on the calling thread, made current again when this drops.
///
/// Every driver call turboio makes may run on a caller's thread (a load in torch's main thread,
/// the DLPack deleter on whichever thread drops the last tensor, a reader that runs on the
/// calling thread). CUDA's current context is per thread, and torch relies on it: freeing the
/// last `cuda:1` tensor must not leave device 1 current for torch's next call on `cuda:0`. So
/// each call site saves the current context and restores it after ([`bind`]).
pub(crate) struct Restore {
    prev: Option<sys::CUcontext>,
}

impl Restore {
    /// Saves the calling thread's current context (none is a valid state, restored as none).
    pub(crate) fn save() -> Result<Restore, DriverError> {
        Ok(Restore { prev: result::ctx::get_current()? })
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        let prev = self.prev.unwrap_or(std::ptr::null_mut());
        if result::ctx::get_current().ok().flatten().unwrap_or(std::ptr::null_mut()) != prev {
            // SAFETY: `prev` was current on this thread when saved (or null: no context), and
            // contexts turboio binds are primary contexts it retains for the process's life; a
            // caller's context destroyed meanwhile is the caller's to have unbound.
            let _ = unsafe { result::ctx::set_current(prev) };
        }
    }
}

/// Makes `ctx` current on the calling thread until the returned guard drops, which restores
/// the context that was current before.
pub(crate) fn bind(ctx: &CudaContext) -> Result<Restore, DriverError> {
    let saved = Restore::save()?;
    ctx.bind_to_thread()?;
    Ok(saved)
}

/// `(free, total)` bytes of the device of `ctx` (`cuMemGetInfo` with `ctx` current).
pub(crate) fn mem_get_info(ctx: &CudaContext) -> Result<(usize, usize), DriverError> {
    let _restore = bind(ctx)?;
    result::mem_get_info()
}

/// The CUDA driver: loaded and initialised once per process. `Err` says why it cannot be used,
/// in words for the user (which library is missing, or that no device is visible).
pub(crate) fn driver() -> Result<(), String> {
    static DRIVER: OnceLock<Result<(), String>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: is_culib_present only dlopens (and closes) candidate names of libcuda.
            let present = guarded("looking for libcuda", || unsafe { sys::is_culib_present() })?;
            if !present {
                return Err("the NVIDIA driver library libcuda.so.1 was not found (is the NVIDIA driver \
                            installed, and visible in this container?)"
                    .into());
            }
            match guarded("cuInit", result::init)? {
                Ok(()) => Ok(()),
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => {
                    Err("no CUDA device is visible (cuInit: CUDA_ERROR_NO_DEVICE; check nvidia-smi and \
                     CUDA_VISIBLE_DEVICES)"
                        .into())
                }
                Err(e) => Err(format!("cuInit failed: {}", describe(e))),
            }
        })
        .clone()
}

/// The error's name and description (`CUDA_ERROR_OUT_OF_MEMORY: out of memory`).
pub(crate) fn describe(e: DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    match e.error_string() {
        Ok(s) => format!("{name}: {}", s.to_string_lossy()),
        Err(_) => name,
    }
}

/// How many CUDA devices are visible. Call only after [`driver`] succeeded.
pub(crate) fn device_count() -> Result<u32, String> {
    match guarded("cuDeviceGetCount", result::device::get_count)? {
        Ok(n) => Ok(n.max(0) as u32),
        Err(e) => Err(format!("cuDeviceGetCount failed: {}", describe(e))),
    }
}

/// The primary context of device `ordinal` (shared with PyTorch and every other user of the
/// runtime API). Call only after [`driver`] succeeded and with an ordinal below the count.
pub(crate) fn primary_context(ordinal: u32) -> Result<Arc<CudaContext>, String> {
    // CudaContext::new makes the context current: the caller's stays current.
    let _restore = Restore::save().map_err(|e| format!("cuCtxGetCurrent failed: {}", describe(e)))?;
    match guarded("creating the CUDA context", || CudaContext::new(ordinal as usize))? {
        Ok(ctx) => Ok(ctx),
        Err(e) => Err(format!("cannot retain the primary context: {}", describe(e))),
    }
}

/// `len` bytes of device memory (`cuMemAlloc`), at least 256-byte aligned.
pub(crate) fn mem_alloc(ctx: &CudaContext, len: usize) -> Result<u64, DriverError> {
    let _bound = bind(ctx)?;
    // SAFETY: a fresh allocation in the context just made current; the memory is owned by the
    // caller's CudaAllocation, which frees it exactly once.
    unsafe { result::malloc_sync(len.max(1)) }
}

/// Frees memory from [`mem_alloc`].
///
/// # Safety
/// `ptr` came from `mem_alloc` in `ctx`, is freed once, and nothing uses it afterwards (the
/// driver waits for work still reading it: cuMemFree synchronises).
pub(crate) unsafe fn mem_free(ctx: &CudaContext, ptr: u64) {
    let _bound = bind(ctx);
    // SAFETY: guaranteed by the caller.
    let _ = unsafe { result::free_sync(ptr) };
}

/// Zeroes `len` bytes at `ptr`, and waits.
///
/// # Safety
/// `ptr .. ptr + len` is device memory of `ctx` that nothing else uses meanwhile.
pub(crate) unsafe fn mem_zero(ctx: &CudaContext, ptr: u64, len: usize) -> Result<(), DriverError> {
    let _bound = bind(ctx)?;
    // SAFETY: guaranteed by the caller.
    unsafe { result::memset_d8_sync(ptr, 0, len) }
}

/// Queues a host-to-device copy of `src` to `dst` on `stream`.
///
/// # Safety
/// `dst .. dst + src.len()` is device memory of the stream's context, and `src` stays valid
/// and unmodified until the copy completes (the caller waits on an event recorded after it).
pub(crate) unsafe fn htod_async(dst: u64, src: &[u8], stream: &CudaStream) -> Result<(), DriverError> {
    let _bound = bind(stream.context())?;
    // SAFETY: guaranteed by the caller.
    unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
}

/// Copies `src .. src + dst.len()` of device memory into `dst`, and waits.
///
/// # Safety
/// The device range is memory of `ctx` that nothing writes meanwhile.
pub(crate) unsafe fn dtoh(ctx: &CudaContext, dst: &mut [u8], src: u64) -> Result<(), DriverError> {
    let _bound = bind(ctx)?;
    // SAFETY: guaranteed by the caller; dst is a valid exclusive host slice.
    unsafe { result::memcpy_dtoh_sync(dst, src) }
}

/// Copies `src` into device memory at `dst`, and waits.
///
/// # Safety
/// `dst .. dst + src.len()` is device memory of `ctx` that nothing else uses meanwhile.
pub(crate) unsafe fn htod(ctx: &CudaContext, dst: u64, src: &[u8]) -> Result<(), DriverError> {
    let _bound = bind(ctx)?;
    // SAFETY: guaranteed by the caller.
    unsafe { result::memcpy_htod_sync(dst, src) }
}

/// An event: recorded on a stream, the point a transfer is complete. Events are made once and
/// recorded again for later transfers (creating and destroying one per chunk costs driver calls
/// on every chunk).
pub(crate) struct Event {
    event: sys::CUevent,
    ctx: Arc<CudaContext>,
    /// Recorded and not waited for since.
    pending: bool,
}

// SAFETY: a CUevent handle may be used from any thread once the owning context is bound (every
// method binds it); this value owns the handle exclusively.
unsafe impl Send for Event {}

impl Event {
    /// A new event of `ctx`. It blocks (rather than spins) the thread that waits on it, leaving
    /// the cores to the readers.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Event, DriverError> {
        let _bound = bind(ctx)?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        let flags =
            sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32 | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: `event` is a valid out-pointer; the context is current.
        unsafe { sys::cuEventCreate(&mut event, flags).result()? };
        Ok(Event { event, ctx: ctx.clone(), pending: false })
    }

    /// Records the work queued on `stream` so far (a stream of this event's context).
    pub(crate) fn record(&mut self, stream: &CudaStream) -> Result<(), DriverError> {
        let _bound = bind(&self.ctx)?;
        // SAFETY: both handles are live and belong to the current context.
        unsafe { sys::cuEventRecord(self.event, stream.cu_stream()).result()? };
        self.pending = true;
        Ok(())
    }

    /// True when the recorded work is done (`cuEventQuery`, which does not block); false
    /// while it runs, and on any error (the wait that follows reports it).
    pub(crate) fn is_done(&self) -> bool {
        let Ok(_bound) = bind(&self.ctx) else { return false };
        // SAFETY: the event is live (destroyed only in Drop).
        unsafe { sys::cuEventQuery(self.event) == sys::CUresult::CUDA_SUCCESS }
    }

    /// Blocks until the recorded work is done.
    pub(crate) fn wait(&mut self) -> Result<(), DriverError> {
        self.pending = false;
        let _bound = bind(&self.ctx)?;
        // SAFETY: the event is live (destroyed only in Drop).
        unsafe { sys::cuEventSynchronize(self.event).result() }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _bound = bind(&self.ctx);
        // SAFETY: the handle is live and owned. An event dropped unwaited (an error path) is
        // waited for first: the memory of its transfer may be freed right after.
        unsafe {
            if self.pending {
                let _ = sys::cuEventSynchronize(self.event);
            }
            let _ = sys::cuEventDestroy_v2(self.event);
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`, portable, **not** write-combined: the CPU reads it
/// back on the save path, and write-combined memory reads at a fraction of normal speed).
pub(crate) struct PinnedMemory {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is owned exclusively by this value (like a Box<[u8]>); pinned host memory
// has no thread affinity.
unsafe impl Send for PinnedMemory {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<PinnedMemory, DriverError> {
        let _bound = bind(ctx)?;
        let len = len.max(1);
        // SAFETY: a fresh allocation owned by the returned value, freed once in Drop.
        let ptr = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }? as *mut u8;
        // SAFETY: `ptr` is valid for `len` writable bytes; zeroing makes every byte initialised
        // before any slice of it is formed.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedMemory { ptr, len, ctx: ctx.clone() })
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: valid, initialised, owned for the life of self; mutation needs &mut self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        let _bound = bind(&self.ctx);
        // SAFETY: allocated by cuMemHostAlloc in new and freed only here. No copy still reads
        // it: a staging buffer is only dropped after the transfer that used it was waited for.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

/// Host memory registered (page-locked) for DMA for as long as this value lives.
pub(crate) struct Registered {
    ptr: *mut c_void,
    ctx: Arc<CudaContext>,
}

// SAFETY: the value only remembers which pages it registered; unregistering may happen on any
// thread once the owning context is bound (Drop binds it).
unsafe impl Send for Registered {}

impl Registered {
    /// Registers the pages covering `bytes`, read-only where the device supports it (then the
    /// driver pins them without asking for write access, so a private file mapping is not
    /// copied page by page).
    ///
    /// # Safety
    /// The memory must stay mapped, and unchanged, until the value is dropped, which the caller
    /// does only after every copy from it completed.
    pub(crate) unsafe fn new(ctx: &Arc<CudaContext>, bytes: &[u8], read_only: bool) -> Result<Registered, DriverError> {
        let _bound = bind(ctx)?;
        let page = crate::sys::page_size();
        let start = bytes.as_ptr() as usize / page * page;
        let end = (bytes.as_ptr() as usize + bytes.len()).next_multiple_of(page);
        let flags = if read_only { sys::CU_MEMHOSTREGISTER_READ_ONLY } else { 0 };
        // SAFETY: [start, end) covers whole pages of a live mapping (the caller's guarantee);
        // registration only pins them.
        unsafe { sys::cuMemHostRegister_v2(start as *mut c_void, end - start, flags).result()? };
        Ok(Registered { ptr: start as *mut c_void, ctx: ctx.clone() })
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let _bound = bind(&self.ctx);
        // SAFETY: registered in new, unregistered once here, after the copies completed.
        let _ = unsafe { sys::cuMemHostUnregister(self.ptr) };
    }
}

/// Makes NVRTC loadable by cudarc: already on the loader's path, named by `TURBOIO_NVRTC_LIB`,
/// or in one of [`crate::cuda_library_dirs`] (opened there by full path and kept open). `Err`
/// lists what was tried.
pub(crate) fn nvrtc() -> Result<(), String> {
    static NVRTC: OnceLock<Result<(), String>> = OnceLock::new();
    static KEEP: OnceLock<libloading::Library> = OnceLock::new();
    NVRTC
        .get_or_init(|| {
            let mut tried = Vec::new();
            let explicit = std::env::var_os("TURBOIO_NVRTC_LIB").map(std::path::PathBuf::from);
            let mut candidates: Vec<std::path::PathBuf> = explicit.into_iter().collect();
            for dir in crate::cuda_library_dirs() {
                for name in ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"] {
                    candidates.push(dir.join(name));
                }
            }
            // SAFETY: is_culib_present only dlopens (and closes) candidate names of libnvrtc.
            let on_path = guarded("looking for libnvrtc", || unsafe { cudarc::nvrtc::sys::is_culib_present() })?;
            if !on_path {
                for path in candidates.iter().filter(|p| p.exists()) {
                    // SAFETY: NVRTC's initialisers have no preconditions; the library stays
                    // loaded for the life of the process (kept in KEEP).
                    match unsafe { libloading::Library::new(path) } {
                        Ok(lib) => {
                            let _ = KEEP.set(lib);
                            break;
                        }
                        Err(e) => tried.push(format!("{}: {e}", path.display())),
                    }
                }
            }
            // SAFETY: as above.
            if guarded("looking for libnvrtc", || unsafe { cudarc::nvrtc::sys::is_culib_present() })? {
                return Ok(());
            }
            let dirs: Vec<String> = crate::cuda_library_dirs().iter().map(|d| d.display().to_string()).collect();
            Err(format!(
                "NVRTC (libnvrtc.so.13 or .12) was not found on the loader's path, in TURBOIO_NVRTC_LIB or in {}{}; \
                 install the nvidia-cuda-nvrtc wheel or the CUDA toolkit",
                dirs.join(", "),
                if tried.is_empty() { String::new() } else { format!(" (failed: {})", tried.join("; ")) }
            ))
        })
        .clone()
}

/// Compiles CUDA C++ to PTX for `arch` (e.g. `compute_90`) with NVRTC. Call after [`nvrtc`].
pub(crate) fn compile_ptx(src: &str, arch: Option<String>) -> Result<cudarc::nvrtc::Ptx, String> {
    let opts = cudarc::nvrtc::CompileOptions {
        options: arch.map(|a| vec![format!("--gpu-architecture={a}")]).unwrap_or_default(),
        ..Default::default()
    };
    guarded("NVRTC", || cudarc::nvrtc::compile_ptx_with_opts(src, opts))?.map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            format!("NVRTC could not compile the kernel: {}", log.to_string_lossy())
        }
        other => format!("NVRTC failed: {other}"),
    })
}

/// The arguments of `turboio_aes_ctr_xor` (see `aes_kernel`).
pub(crate) struct AesArgs {
    pub data: u64,
    pub len: u64,
    pub round_keys: u64,
    pub rounds: u32,
    pub iv_hi: u64,
    pub iv_lo: u64,
    pub pos: u64,
}

/// The arguments of `turboio_cast` (see `cast_kernel`).
pub(crate) struct CastArgs {
    pub src: u64,
    pub dst: u64,
    pub n: u64,
    pub from: u32,
    pub to: u32,
}

/// Queues the dtype conversion kernel on `stream`.
///
/// # Safety
/// `func` is `turboio_cast` from the kernel source; the `n` elements at `src` and `dst` (sizes
/// by their dtype codes) are device memory of the stream's context that stays allocated until
/// the stream has run the kernel.
pub(crate) unsafe fn launch_cast(
    func: &cudarc::driver::CudaFunction,
    stream: &CudaStream,
    args: &CastArgs,
    grid: u32,
    block: u32,
) -> Result<(), DriverError> {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let _bound = bind(stream.context())?;
    let mut b = stream.launch_builder(func);
    b.arg(&args.src).arg(&args.dst).arg(&args.n).arg(&args.from).arg(&args.to);
    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the argument list matches the kernel's signature (const u8*, u8*, u64, u32, u32);
    // memory validity is the caller's guarantee.
    unsafe { b.launch(cfg) }.map(|_| ())
}

/// Queues the AES-CTR kernel on `stream`.
///
/// # Safety
/// `func` is `turboio_aes_ctr_xor` from the kernel source; `data .. data + len` and the round
/// keys (`4 * (rounds + 1)` words) are device memory of the stream's context that stays
/// allocated until the stream has run the kernel.
pub(crate) unsafe fn launch_aes(
    func: &cudarc::driver::CudaFunction,
    stream: &CudaStream,
    args: &AesArgs,
    grid: u32,
    block: u32,
) -> Result<(), DriverError> {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let _bound = bind(stream.context())?;
    let mut b = stream.launch_builder(func);
    b.arg(&args.data)
        .arg(&args.len)
        .arg(&args.round_keys)
        .arg(&args.rounds)
        .arg(&args.iv_hi)
        .arg(&args.iv_lo)
        .arg(&args.pos);
    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the argument list matches the kernel's signature (u8*, u64, const u32*, u32, u64,
    // u64, u64); memory validity is the caller's guarantee.
    unsafe { b.launch(cfg) }.map(|_| ())
}
