//! turboio's GPUDirect Storage backend: [`GdsStorage`] implements the [`Storage`] contract for
//! local files and adds [`StorageFile::read_to_device`] (and
//! [`Storage::write_file_from_device`]), which DMA between the file and CUDA device memory through
//! NVIDIA's cuFile, without a bounce through host memory.
//!
//! # Shape
//!
//! `GdsStorage` wraps the posix backend: ordinary reads (the header, host destinations) and
//! saves from host memory go through `turboio-io-posix` unchanged, so nothing is lost by choosing
//! it. The orchestrator asks [`StorageFile::reads_to_device`]`("cuda")` and calls
//! `read_to_device`; when that answers [`StorageError::Unsupported`] (no GPU, no libcufile, no
//! nvidia-fs, a file system cuFile refuses, a registration refused) it loads through host
//! staging instead and says why in the load's report. Every GDS failure is reported as
//! `Unsupported` for that reason: a genuine I/O error shows up again on the staged path, with
//! the posix backend's message.
//!
//! # cuFile, carefully
//!
//! - `libcufile` is loaded at run time (`sys`): `TURBOIO_CUFILE_LIB`, else `libcufile.so.0` /
//!   `libcufile.so` on the loader's path, else in [`turboio_device::cuda_library_dirs`], which the
//!   Python package fills with the `lib` directories of the installed `nvidia` wheels
//!   (`nvidia/cufile/lib` of `nvidia-cufile-cu12`, `nvidia/cu13/lib` of the CUDA 13 wheels).
//!   Nothing cuFile is needed to build.
//! - The driver is opened **once per process, and never without a GPU**: `cuFileDriverOpen`
//!   hangs on some releases when no GPU is present, so it is called only after the CUDA device
//!   crate has loaded libcuda and opened the device, on a helper thread, with a timeout
//!   (`TURBOIO_GDS_OPEN_TIMEOUT`, seconds, default 60). It is never closed (closing while
//!   another library in the process uses cuFile breaks it).
//! - Files are registered (`cuFileHandleRegister`) once per open file, on a second descriptor
//!   opened with `O_DIRECT`, and deregistered when the file is dropped.
//! - Large requests are split into pieces ([`GdsConfig::chunk`]) read by several threads, each
//!   with the device's primary context current. The destination range of each request is
//!   registered with `cuFileBufRegister` for the read when [`GdsConfig::register_buffers`] says
//!   so (refusal only costs speed).
//! - [`GdsMode::Auto`] uses cuFile only where it does true GPUDirect I/O: the `nvidia-fs` module
//!   is loaded, or cuFile reports PCI P2PDMA support. Otherwise cuFile would run in its
//!   compatibility mode (POSIX reads into its own bounce buffers, then copies), which the staged
//!   path beats, so the load falls back with that reason. [`GdsMode::On`] uses cuFile anyway.
//!
//! # Alignment
//!
//! The orchestrator asks for file ranges that start on 4 KiB boundaries. A destination whose
//! address has the same offset within 4 KiB as the file range goes straight to the device;
//! otherwise cuFile moves the data through its internal GPU bounce buffers (correct, slower).
//! The orchestrator places the data section so that tensors are 16-byte aligned; for files whose
//! data section starts 16-byte aligned (the safetensors writers pad the header to 8 bytes, so
//! about half of them) that placement is also 4 KiB congruent and no extra copy happens.
//!
//! # Saves
//!
//! `write_file_from_device` goes through the posix backend's one atomic writer
//! ([`PosixStorage::replace_with`]: symbolic links followed, the old file's owner and mode,
//! space reserved with `fallocate`, sync, rename, abandoned temporaries removed); only the data
//! transfer is this backend's. The 4 KiB-aligned middle of each device range goes out through
//! `cuFileWrite` on an `O_DIRECT` descriptor; everything else (the header, partial blocks) is
//! written from the [`WriteSource`] through an ordinary descriptor, so no file block is written
//! by both paths. A save whose device ranges hold no whole aligned block needs no driver.
#![deny(missing_docs)]

pub mod result;
pub mod sys;

use result::CuFileError;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use turboio_io_posix::{PosixConfig, PosixFile, PosixStorage};
use turboio_storage::{
    run_workers, DeviceReadRequest, DeviceWriteRequest, IoOptions, RangeReader, ReadRequest, Storage, StorageError,
    StorageFile, WriteSource,
};

const BACKEND: &str = "gds";
const ALIGN: u64 = 4096;

/// When to use cuFile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GdsMode {
    /// Only where cuFile does true GPUDirect I/O (nvidia-fs loaded, or PCI P2PDMA); otherwise
    /// refuse, so the load falls back to staging with the reason.
    #[default]
    Auto,
    /// Use cuFile wherever it opens, compatibility mode included.
    On,
}

/// Settings of [`GdsStorage`].
#[derive(Debug, Clone)]
pub struct GdsConfig {
    /// When to use cuFile.
    pub mode: GdsMode,
    /// Bytes per `cuFileRead` / `cuFileWrite` handed to a worker (default 32 MiB; 4 KiB
    /// multiples).
    pub chunk: usize,
    /// Register each request's device range with `cuFileBufRegister` for the read.
    pub register_buffers: bool,
    /// The posix backend used for everything else.
    pub posix: PosixConfig,
}

impl Default for GdsConfig {
    fn default() -> Self {
        GdsConfig { mode: GdsMode::Auto, chunk: 32 << 20, register_buffers: true, posix: PosixConfig::default() }
    }
}

/// What the opened cuFile driver reports.
#[derive(Debug, Clone, Copy)]
pub struct DriverInfo {
    /// `cuFileGetVersion` (1000 * major + 10 * minor).
    pub version: i32,
    /// The nvidia-fs kernel module is loaded.
    pub nvidia_fs: bool,
    /// cuFile reports PCI P2PDMA support (GDS without nvidia-fs).
    pub p2pdma: bool,
}

struct Driver {
    api: Arc<sys::Api>,
    info: DriverInfo,
}

/// `cuFileDriverOpen` calls made by this process (tests check it stays 0 without a GPU).
static DRIVER_OPEN_CALLS: AtomicUsize = AtomicUsize::new(0);

/// How many times this process called `cuFileDriverOpen` (0 or 1).
pub fn driver_open_calls() -> usize {
    DRIVER_OPEN_CALLS.load(Ordering::SeqCst)
}

/// Loads libcufile (without opening the driver) and returns its version and where it came from.
/// Needs no GPU.
pub fn library_version() -> Result<(i32, String), String> {
    let api = sys::Api::find()?;
    let v = result::version(&api).map_err(|e| e.to_string())?;
    Ok((v, api.origin.clone()))
}

fn open_timeout() -> Duration {
    let secs = std::env::var("TURBOIO_GDS_OPEN_TIMEOUT").ok().and_then(|v| v.parse().ok()).unwrap_or(60u64);
    Duration::from_secs(secs.max(1))
}

/// The process's cuFile driver, opened on first use with the context of `cuda:ordinal`.
fn driver(ordinal: u32) -> Result<Arc<Driver>, String> {
    type Slot = Mutex<Option<Result<Arc<Driver>, String>>>;
    static DRIVER: OnceLock<Slot> = OnceLock::new();
    let mut slot = DRIVER.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(r) = slot.as_ref() {
        return r.clone();
    }
    // Never touch cuFileDriverOpen unless libcuda loads and the device exists. A missing GPU is
    // not cached: it is cheap to ask again and says the same.
    turboio_device::cuda::check_device(ordinal).map_err(|e| e.to_string())?;
    let r = open_driver(ordinal);
    *slot = Some(r.clone());
    r
}

fn open_driver(ordinal: u32) -> Result<Arc<Driver>, String> {
    let api = sys::Api::find()?;
    let version = result::version(&api).map_err(|e| e.to_string())?;
    let api = Arc::new(api);
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let api = api.clone();
        // A helper thread, so that a driver that hangs costs a timeout, not the process.
        std::thread::Builder::new()
            .name("turboio-cufile-open".into())
            .spawn(move || {
                let r = turboio_device::cuda::bind_context(ordinal).map_err(|e| e.to_string()).and_then(|_bound| {
                    DRIVER_OPEN_CALLS.fetch_add(1, Ordering::SeqCst);
                    result::driver_open(&api).map_err(|e| e.to_string())
                });
                let _ = tx.send(r);
            })
            .map_err(|e| format!("cannot start a thread to open cuFile: {e}"))?;
    }
    let timeout = open_timeout();
    match rx.recv_timeout(timeout) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            return Err(format!(
                "cuFileDriverOpen did not return within {} s (TURBOIO_GDS_OPEN_TIMEOUT)",
                timeout.as_secs()
            ))
        }
    }
    let props = result::properties(&api).unwrap_or_default();
    let info = DriverInfo {
        version,
        nvidia_fs: Path::new("/proc/driver/nvidia-fs").exists() || props.nvfs.major_version > 0,
        p2pdma: props.fflags & (1 << sys::CU_FILE_P2P_SUPPORTED) != 0,
    };
    Ok(Arc::new(Driver { api, info }))
}

fn unsupported(what: impl Into<String>) -> StorageError {
    StorageError::Unsupported { backend: BACKEND, what: what.into() }
}

/// Local files with GPUDirect Storage reads and writes. See the crate docs.
#[derive(Debug, Clone)]
pub struct GdsStorage {
    posix: PosixStorage,
    cfg: Arc<GdsConfig>,
}

impl Default for GdsStorage {
    fn default() -> Self {
        Self::new()
    }
}

impl GdsStorage {
    /// With [`GdsConfig::default`] ([`GdsMode::Auto`]).
    pub fn new() -> Self {
        Self::with_config(GdsConfig::default())
    }

    /// With the given settings.
    pub fn with_config(cfg: GdsConfig) -> Self {
        GdsStorage { posix: PosixStorage::with_config(cfg.posix.clone()), cfg: Arc::new(cfg) }
    }

    /// The settings.
    pub fn config(&self) -> &GdsConfig {
        &self.cfg
    }

    /// Whether GDS can be used with `cuda:ordinal` in this storage's mode: opens the driver (once
    /// per process, only if the GPU is there) and says why not if it cannot.
    pub fn probe(&self, ordinal: u32) -> Result<DriverInfo, String> {
        let d = driver(ordinal)?;
        self.usable(&d)?;
        Ok(d.info)
    }

    fn usable(&self, d: &Driver) -> Result<(), String> {
        if self.cfg.mode == GdsMode::Auto && !d.info.nvidia_fs && !d.info.p2pdma {
            return Err("the nvidia-fs module is not loaded and cuFile reports no PCI P2PDMA support, so cuFile \
                        would only run in compatibility mode (POSIX reads and copies), which the staged path does \
                        faster; use GDS mode `on` to force cuFile"
                .into());
        }
        Ok(())
    }

    fn driver_for(&self, ordinal: u32) -> Result<Arc<Driver>, StorageError> {
        let d = driver(ordinal).map_err(|e| unsupported(format!("GPUDirect Storage is not available: {e}")))?;
        self.usable(&d).map_err(|e| unsupported(format!("GPUDirect Storage is not used: {e}")))?;
        Ok(d)
    }

    /// Opens `path` as a [`GdsFile`].
    pub fn open_gds(&self, path: &Path) -> Result<GdsFile, StorageError> {
        let inner = self.posix.open_posix(path)?;
        Ok(GdsFile { inner, storage: self.clone(), handle: OnceLock::new() })
    }
}

/// A file registered with cuFile: its `O_DIRECT` descriptor and handle.
struct Handle {
    driver: Arc<Driver>,
    h: sys::CUfileHandle,
    _fd: OwnedFd,
}

// SAFETY: a cuFile handle may be used by several threads at once (cuFileRead/Write are
// thread-safe on one handle); this value owns it and deregisters it once, in Drop, after every
// user (borrowing &self) is gone.
unsafe impl Send for Handle {}
// SAFETY: see Send.
unsafe impl Sync for Handle {}

impl Handle {
    /// The raw handle (a method, so closures capture the whole `Handle`, which is `Sync`).
    fn raw(&self) -> sys::CUfileHandle {
        self.h
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered once here; the descriptor closes after.
        unsafe { result::handle_deregister(&self.driver.api, self.h) };
    }
}

fn register(driver: &Arc<Driver>, path: &Path, write: bool) -> Result<Handle, String> {
    let mut o = OpenOptions::new();
    if write {
        o.write(true);
    } else {
        o.read(true);
    }
    let file = o
        .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
        .open(path)
        .map_err(|e| format!("cannot open {} with O_DIRECT: {e}", path.display()))?;
    let fd: OwnedFd = file.into();
    let h = result::handle_register(&driver.api, fd.as_raw_fd()).map_err(|e| e.to_string())?;
    Ok(Handle { driver: driver.clone(), h, _fd: fd })
}

/// A file opened by [`GdsStorage`]: the posix file for ordinary reads, and a cuFile handle,
/// registered at the first device read.
pub struct GdsFile {
    inner: PosixFile,
    storage: GdsStorage,
    handle: OnceLock<Result<Arc<Handle>, String>>,
}

impl std::fmt::Debug for GdsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GdsFile").field("path", &self.inner.path()).finish_non_exhaustive()
    }
}

impl GdsFile {
    fn handle(&self, driver: &Arc<Driver>) -> Result<Arc<Handle>, StorageError> {
        self.handle
            .get_or_init(|| register(driver, self.inner.path(), false).map(Arc::new))
            .clone()
            .map_err(|e| unsupported(format!("cuFile refused {}: {e}", self.inner.path().display())))
    }
}

/// A piece of a device transfer: `len` bytes at `file_offset`, at `buf_offset` from `base`.
#[derive(Debug, Clone, Copy)]
struct Piece {
    base: u64,
    buf_offset: u64,
    file_offset: u64,
    len: usize,
}

/// Cuts `[file_offset, + len)` into pieces of at most `chunk` bytes whose file offsets after the
/// first are `chunk`-aligned.
fn pieces(base: u64, file_offset: u64, len: u64, chunk: u64, out: &mut Vec<Piece>) {
    let mut done = 0u64;
    while done < len {
        let at = file_offset + done;
        let n = (chunk - at % chunk).min(len - done);
        out.push(Piece { base, buf_offset: done, file_offset: at, len: n as usize });
        done += n;
    }
}

fn one_ordinal<'a>(mut dsts: impl Iterator<Item = &'a turboio_storage::DeviceDst>) -> Result<u32, StorageError> {
    let first = dsts.next().ok_or_else(|| unsupported("nothing to transfer"))?;
    if first.kind != "cuda" {
        return Err(unsupported(format!("GPUDirect Storage reads into CUDA memory, not `{}` memory", first.kind)));
    }
    for d in dsts {
        if d.kind != "cuda" || d.ordinal != first.ordinal {
            return Err(unsupported("one transfer goes to one CUDA device"));
        }
    }
    Ok(first.ordinal)
}

/// Runs `op` on every piece over the workers, each with the device's context current.
fn run_pieces(
    ordinal: u32,
    list: Vec<Piece>,
    opts: &IoOptions<'_>,
    op: impl Fn(&Piece) -> Result<(), StorageError> + Sync,
) -> Result<(), StorageError> {
    if list.is_empty() {
        return opts.check_cancel();
    }
    let total: u64 = list.iter().map(|p| p.len as u64).sum();
    let largest = list.iter().map(|p| p.len).max().unwrap_or(1);
    let workers = opts.worker_count(total, largest).min(list.len());
    let queue = Mutex::new(list.into_iter());
    run_workers(vec![(); workers], |(), stop| {
        // Restored when the worker returns (a worker may run on the caller's thread).
        let _bound = turboio_device::cuda::bind_context(ordinal).map_err(|e| unsupported(e.to_string()))?;
        loop {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            opts.check_cancel()?;
            let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
            let Some(p) = next else { return Ok(()) };
            op(&p)?;
            opts.add_progress(p.len as u64);
        }
    })
}

fn cufile_failed(path: &Path, e: CuFileError) -> StorageError {
    unsupported(format!("{}: {e}", path.display()))
}

impl StorageFile for GdsFile {
    fn path(&self) -> &Path {
        self.inner.path()
    }

    fn len(&self) -> u64 {
        self.inner.len()
    }

    fn reader(&self) -> Result<Box<dyn RangeReader + '_>, StorageError> {
        self.inner.reader()
    }

    fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), StorageError> {
        self.inner.read_exact_at(offset, dst)
    }

    fn read_ranges(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<(), StorageError> {
        self.inner.read_ranges(requests, opts)
    }

    fn reads_to_device(&self, kind: &str) -> bool {
        kind == "cuda"
    }

    fn read_to_device(&self, requests: &[DeviceReadRequest], opts: &IoOptions<'_>) -> Result<(), StorageError> {
        let path = self.inner.path();
        if requests.is_empty() {
            return opts.check_cancel();
        }
        let ordinal = one_ordinal(requests.iter().map(|r| &r.dst))?;
        let file_len = self.inner.len();
        for r in requests {
            if r.offset.checked_add(r.len).is_none_or(|end| end > file_len) {
                return Err(StorageError::ShortFile {
                    path: path.to_owned(),
                    offset: r.offset,
                    end: r.offset.saturating_add(r.len),
                    file_len,
                });
            }
        }
        let driver = self.storage.driver_for(ordinal)?;
        let handle = self.handle(&driver)?;
        let cfg = &self.storage.cfg;
        let chunk = (if opts.chunk_size == 0 { cfg.chunk } else { opts.chunk_size }).max(1) as u64;
        let chunk = chunk.next_multiple_of(ALIGN);

        // Register each destination range for the transfer (refusal only costs speed).
        let mut registered = Vec::new();
        if cfg.register_buffers {
            let _bound = turboio_device::cuda::bind_context(ordinal).map_err(|e| unsupported(e.to_string()))?;
            for r in requests.iter().filter(|r| r.len > 0) {
                let base = r.dst.base + r.dst.offset;
                // SAFETY: the orchestrator hands us device memory of this device that stays
                // allocated for the whole call; it is deregistered below before returning.
                if unsafe { result::buf_register(&driver.api, base, r.len as usize) }.is_ok() {
                    registered.push(base);
                }
            }
        }
        let mut list = Vec::new();
        for r in requests {
            pieces(r.dst.base + r.dst.offset, r.offset, r.len, chunk, &mut list);
        }
        let read = run_pieces(ordinal, list, opts, |p| {
            let mut done = 0usize;
            while done < p.len {
                // SAFETY: the handle is live (borrowed from self); the destination range lies in
                // the request's device memory, which the caller keeps allocated and untouched
                // during the call; this thread has the device's context current.
                let n = unsafe {
                    result::read(
                        &driver.api,
                        handle.raw(),
                        p.base,
                        p.len - done,
                        p.file_offset + done as u64,
                        p.buf_offset + done as u64,
                    )
                }
                .map_err(|e| cufile_failed(path, e))?;
                if n == 0 {
                    return Err(StorageError::ShortFile {
                        path: path.to_owned(),
                        offset: p.file_offset,
                        end: p.file_offset + p.len as u64,
                        file_len: self.inner.len(),
                    });
                }
                done += n;
            }
            Ok(())
        });
        if !registered.is_empty() {
            let _bound = turboio_device::cuda::bind_context(ordinal);
            for base in registered {
                // SAFETY: registered above; every read has returned.
                unsafe { result::buf_deregister(&driver.api, base) };
            }
        }
        read
    }

    fn local_file(&self) -> Option<&File> {
        self.inner.local_file()
    }

    fn cached_fraction(&self) -> Option<f64> {
        self.inner.cached_fraction()
    }
}

/// Splits the file into the ranges cuFile writes (4 KiB-aligned middles of device ranges) and
/// the rest, written from the source.
fn split_write(len: u64, device: &[DeviceWriteRequest]) -> (Vec<Piece>, Vec<(u64, u64)>) {
    let mut direct: Vec<Piece> = Vec::new();
    for r in device {
        let start = r.offset.next_multiple_of(ALIGN);
        let end = (r.offset + r.len) / ALIGN * ALIGN;
        if end > start {
            direct.push(Piece {
                base: r.src.base + r.src.offset,
                buf_offset: start - r.offset,
                file_offset: start,
                len: (end - start) as usize,
            });
        }
    }
    direct.sort_by_key(|p| p.file_offset);
    let mut host = Vec::new();
    let mut at = 0u64;
    for p in &direct {
        if p.file_offset > at {
            host.push((at, p.file_offset));
        }
        at = at.max(p.file_offset + p.len as u64);
    }
    if at < len {
        host.push((at, len));
    }
    (direct, host)
}

impl Storage for GdsStorage {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn open(&self, path: &Path) -> Result<Box<dyn StorageFile>, StorageError> {
        Ok(Box::new(self.open_gds(path)?))
    }

    fn write_file(&self, path: &Path, source: &dyn WriteSource, opts: &IoOptions<'_>) -> Result<(), StorageError> {
        self.posix.write_file(path, source, opts)
    }

    fn list(&self, dir: &Path) -> Result<Vec<std::path::PathBuf>, StorageError> {
        self.posix.list(dir)
    }

    fn remove_file(&self, path: &Path) -> Result<(), StorageError> {
        self.posix.remove_file(path)
    }

    fn writes_from_device(&self, kind: &str) -> bool {
        kind == "cuda"
    }

    fn write_file_from_device(
        &self,
        path: &Path,
        source: &dyn WriteSource,
        device: &[DeviceWriteRequest],
        opts: &IoOptions<'_>,
    ) -> Result<(), StorageError> {
        let ordinal = one_ordinal(device.iter().map(|r| &r.src))?;
        let len = source.len();
        if device.iter().any(|r| r.offset.checked_add(r.len).is_none_or(|e| e > len)) {
            return Err(StorageError::Source {
                path: path.to_owned(),
                message: "a device range lies past the end of the file".into(),
            });
        }
        let (direct, host) = split_write(len, device);
        // The driver only when cuFile has something to write: ranges too small for a whole
        // aligned block go from the source like the header.
        let driver = if direct.is_empty() { None } else { Some(self.driver_for(ordinal)?) };
        // The one atomic writer's protocol (links followed, the old file's owner and mode,
        // space reserved, sync, rename, abandoned temporaries removed); only the data transfer
        // is this backend's.
        self.posix.replace_with(path, len, opts, &mut |tmp| {
            // The source's ranges through the ordinary descriptor.
            let mut buf = vec![0u8; (8 << 20).min(len as usize).max(1)];
            for &(start, end) in &host {
                let mut at = start;
                while at < end {
                    opts.check_cancel()?;
                    let n = ((end - at) as usize).min(buf.len());
                    source
                        .fill(at, &mut buf[..n])
                        .map_err(|message| StorageError::Source { path: path.to_owned(), message })?;
                    tmp.file().write_all_at(&buf[..n], at).map_err(|e| StorageError::io(path, "write", e))?;
                    opts.add_progress(n as u64);
                    at += n as u64;
                }
            }
            // The aligned device ranges through cuFile, on its own O_DIRECT descriptor.
            let Some(driver) = &driver else { return Ok(()) };
            let handle = register(driver, tmp.path(), true)
                .map_err(|e| unsupported(format!("cuFile refused {}: {e}", tmp.path().display())))?;
            let chunk = (self.cfg.chunk.max(1) as u64).next_multiple_of(ALIGN);
            let mut list = Vec::new();
            for d in &direct {
                let mut sub = Vec::new();
                pieces(d.base, d.file_offset, d.len as u64, chunk, &mut sub);
                list.extend(sub.into_iter().map(|p| Piece { buf_offset: d.buf_offset + p.buf_offset, ..p }));
            }
            run_pieces(ordinal, list, opts, |p| {
                let mut done = 0usize;
                while done < p.len {
                    // SAFETY: the handle is live for this call; the source range is device
                    // memory the caller keeps allocated and unwritten during the save; this
                    // thread has the device's context current.
                    let n = unsafe {
                        result::write(
                            &driver.api,
                            handle.raw(),
                            p.base,
                            p.len - done,
                            p.file_offset + done as u64,
                            p.buf_offset + done as u64,
                        )
                    }
                    .map_err(|e| cufile_failed(path, e))?;
                    if n == 0 {
                        return Err(unsupported(format!("{}: cuFileWrite wrote nothing", path.display())));
                    }
                    done += n;
                }
                Ok(())
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_range_on_chunk_boundaries() {
        let mut out = Vec::new();
        pieces(1000, 4096 * 3 + 100, 20_000, 8192, &mut out);
        let total: usize = out.iter().map(|p| p.len).sum();
        assert_eq!(total, 20_000);
        assert_eq!(out[0].file_offset, 4096 * 3 + 100);
        assert!(out[1..].iter().all(|p| p.file_offset % 8192 == 0));
        let mut at = 0;
        for p in &out {
            assert_eq!(p.buf_offset, at);
            at += p.len as u64;
        }
    }

    #[test]
    fn writes_split_into_aligned_device_middles_and_host_rest() {
        let dst = |offset: u64, len: u64| DeviceWriteRequest {
            offset,
            len,
            src: turboio_storage::DeviceDst { kind: "cuda", ordinal: 0, base: 1 << 20, offset: 0 },
        };
        // A header of 100 bytes, then a 10000-byte tensor and a 300-byte one.
        let (direct, host) = split_write(10_400, &[dst(100, 10_000), dst(10_100, 300)]);
        assert_eq!(direct.len(), 1, "the small tensor has no whole block");
        assert_eq!((direct[0].file_offset, direct[0].len, direct[0].buf_offset), (4096, 4096, 3996));
        assert_eq!(host, vec![(0, 4096), (8192, 10_400)]);
        let covered: u64 =
            host.iter().map(|(a, b)| b - a).sum::<u64>() + direct.iter().map(|p| p.len as u64).sum::<u64>();
        assert_eq!(covered, 10_400);
    }
}
