//! The `turboio._turboio` extension: a thin skin over the `turboio` crate.
//!
//! - Every call that can block (loads, saves, header reads, key look-ups) runs in Rust with the
//!   GIL released, on a worker thread, while the calling thread wakes every 50 ms to run
//!   Python's signal handlers: Ctrl-C cancels the work (a load stops within a chunk; a key
//!   look-up against a dead datapipe or KMS stops at once, its waits and requests abandoned),
//!   frees its memory, and raises `KeyboardInterrupt`. Nothing half-filled is ever handed out.
//! - Tensors leave as DLPack capsules (the `dlpack` module) that keep the load alive; torch and numpy
//!   import them without a copy and without this crate linking either.
//! - Errors map to the exceptions Python users expect: `FileNotFoundError`, `PermissionError`,
//!   `ValueError` for invalid files and arguments, `OSError` for I/O failures, `RuntimeError`
//!   otherwise. Messages name the file.
//!
//! The Python package (`python/turboio`) builds the veTurboIO, fastsafetensors and
//! `safetensors.torch` APIs on these few functions.

mod dlpack;

use dlpack::{DLDataType, Export};
use pyo3::exceptions::{
    PyFileNotFoundError, PyKeyError, PyKeyboardInterrupt, PyMemoryError, PyOSError, PyPermissionError, PyRuntimeError,
    PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use turboio::crypt::{Encryption, Keys};
use turboio::device::{ArenaPool, Device, DeviceId, DeviceKind, StagingPool};
use turboio::format::{FormatError, Header};
use turboio::storage::StorageError;
use turboio::{CachePolicy, Dtype, Error, LoadMode, LoadOptions, SaveOptions, TensorSpec};

/// The one mapping of turboio's errors to Python exceptions. Invalid files raise `ValueError`
/// with two extra attributes that the drop-in APIs use to word their own exceptions as the
/// reference does (`turboio.torch` turns them into `SafetensorError`): `reason`, the format
/// check's message (which starts with the reference's wording), and `filename`.
fn to_py(e: Error) -> PyErr {
    error_to_py(&e)
}

fn error_to_py(e: &Error) -> PyErr {
    // A memory plan's refusal names the keyword arguments that would fit, not the CLI's flags.
    let msg = e.describe_for(turboio::memory::Api::Python);
    let invalid_file = |path: &std::path::Path, reason: String| {
        let err = PyValueError::new_err(msg.clone());
        Python::attach(|py| {
            let v = err.value(py);
            let _ = v.setattr("reason", reason);
            let _ = v.setattr("filename", turboio::storage::shown(path).to_string());
        });
        err
    };
    match e {
        Error::Storage(StorageError::NotFound { .. }) => PyFileNotFoundError::new_err(msg),
        // The object-storage backend refused its configuration or the URL (an unknown storage
        // option, a URL with a query string): a bad argument, as a bad option value already is.
        Error::Storage(StorageError::Setup { path, .. }) if turboio::object::is_object_url(path) => {
            PyValueError::new_err(msg)
        }
        Error::Storage(StorageError::PermissionDenied { .. }) => PyPermissionError::new_err(msg),
        Error::Storage(StorageError::Io { .. } | StorageError::ShortFile { .. } | StorageError::Changed { .. }) => {
            PyOSError::new_err(msg)
        }
        Error::Format { path, source, hint } => invalid_file(
            path,
            match hint {
                Some(h) => format!("{source}; {h}"),
                None => source.to_string(),
            },
        ),
        Error::Decrypted { path, .. } => {
            invalid_file(path, msg[turboio::storage::shown(path).to_string().len() + 2..].to_owned())
        }
        Error::Unsupported { .. } => PyValueError::new_err(msg),
        Error::Cancelled { .. } => PyKeyboardInterrupt::new_err(msg),
        // A selected name the checkpoint does not hold, as a dict lookup would say.
        Error::NoMatch { .. } => PyKeyError::new_err(msg),
        Error::WontFit { .. } => PyMemoryError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

/// Runs `work` on a worker thread with the GIL released. The calling thread takes the GIL
/// back at the start and then every 50 ms to run signal handlers and the optional progress
/// callback (`callback(bytes_done)`); if either raises (Ctrl-C raises `KeyboardInterrupt`),
/// `cancel` is set, the worker is waited for (it stops promptly and frees what it holds) and the
/// exception propagates.
fn interruptible<T: Send>(
    py: Python<'_>,
    cancel: &Arc<AtomicBool>,
    progress: Option<(&Bound<'_, PyAny>, &AtomicU64)>,
    work: impl FnOnce() -> Result<T, Error> + Send,
) -> PyResult<T> {
    std::thread::scope(|s| {
        let caller = std::thread::current();
        // Set by the worker before it wakes the caller: `is_finished()` would still be false
        // between the wake-up and the worker's return, and the caller would sleep out a whole
        // poll interval (50 ms added to a call that took microseconds).
        let finished = Arc::new(AtomicBool::new(false));
        let finished_w = finished.clone();
        let handle = s.spawn(move || {
            let r = work();
            finished_w.store(true, Ordering::Release);
            caller.unpark();
            r
        });
        let mut interrupted: Option<PyErr> = None;
        let poll = |interrupted: &mut Option<PyErr>| {
            if interrupted.is_some() {
                return;
            }
            let mut r = py.check_signals();
            if let (Ok(()), Some((cb, done))) = (&r, progress) {
                r = cb.call1((done.load(Ordering::Relaxed),)).map(|_| ());
            }
            if let Err(e) = r {
                cancel.store(true, Ordering::Relaxed);
                *interrupted = Some(e);
            }
        };
        poll(&mut interrupted);
        while !finished.load(Ordering::Acquire) && !handle.is_finished() {
            py.detach(|| std::thread::park_timeout(Duration::from_millis(50)));
            if !finished.load(Ordering::Acquire) && !handle.is_finished() {
                poll(&mut interrupted);
            }
        }
        let result = py.detach(|| handle.join());
        match (interrupted, result) {
            (Some(e), _) => Err(e),
            (None, Ok(Ok(r))) => {
                // The last call reports where the work ended (every byte, for a load), however
                // the 50 ms polls fell.
                if let Some((cb, done)) = progress {
                    cb.call1((done.load(Ordering::Relaxed),))?;
                }
                Ok(r)
            }
            (None, Ok(Err(e))) => Err(to_py(e)),
            (None, Err(_)) => Err(PyRuntimeError::new_err("turboio: internal error: a worker thread panicked")),
        }
    })
}

/// The device a device string names: `None` for the CPU, a CUDA device, or the error saying why
/// not (no driver, no GPU, an NPU). Every `CudaDevice` of an ordinal shares the process's
/// streams and pinned staging pool, so each call's device is the process's one for that GPU
/// (unless a pool of the caller's own is given). Opening CUDA the first time initialises the
/// driver, so it runs with the GIL released.
fn open_target(py: Python<'_>, device: &str, staging: Option<&PyStagingPool>) -> PyResult<Option<Arc<dyn Device>>> {
    let id = DeviceId::parse(device).map_err(PyValueError::new_err)?;
    match id.kind {
        DeviceKind::Cpu => Ok(None),
        DeviceKind::Cuda if gpu_model::enabled() => gpu_model::device(id.ordinal).map(Some),
        DeviceKind::Cuda => {
            let dev = py
                .detach(|| turboio::device::cuda::CudaDevice::new(id.ordinal))
                .map_err(|e| PyRuntimeError::new_err(format!("turboio: {e}")))?;
            let dev = match staging {
                Some(p) => dev.with_staging_pool(p.pool.clone()),
                None => dev,
            };
            Ok(Some(Arc::new(dev)))
        }
        _ => {
            let e = turboio::device::open_device(id)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_else(|| format!("{id}: not supported"));
            Err(PyRuntimeError::new_err(format!("turboio: {e}")))
        }
    }
}

/// `TURBOIO_GPU_MODEL` (a `GpuModel` spec, e.g. `link=25,pin=1.5`; empty for the defaults): CUDA
/// devices are replaced by the performance model of a GPU (`turboio::device::testing::
/// ModelDevice`), one per ordinal for the process, as the CUDA device's pool is. Every Python
/// path into a GPU then runs unchanged on a machine without one; the tensors it gives back are
/// `meta` tensors (the model keeps no bytes), and `_gpu_model_counters` says what the model
/// counted (pinned allocations, events, synchronisations, link time).
mod gpu_model {
    use super::*;
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    use turboio::device::testing::{GpuModel, ModelDevice};

    pub const ENV: &str = "TURBOIO_GPU_MODEL";

    /// The model's settings, read once per process; `None` when the variable is unset.
    fn settings() -> &'static Option<std::result::Result<GpuModel, String>> {
        static SETTINGS: OnceLock<Option<std::result::Result<GpuModel, String>>> = OnceLock::new();
        SETTINGS.get_or_init(|| std::env::var(ENV).ok().map(|spec| GpuModel::parse(&spec)))
    }

    pub fn enabled() -> bool {
        settings().is_some()
    }

    /// The process's model of GPU `ordinal`.
    pub fn model(ordinal: u32) -> PyResult<Arc<ModelDevice>> {
        let model = match settings() {
            Some(Ok(m)) => *m,
            Some(Err(e)) => return Err(PyValueError::new_err(format!("turboio: {ENV}: {e}"))),
            None => return Err(PyRuntimeError::new_err(format!("turboio: {ENV} is not set"))),
        };
        static DEVICES: OnceLock<Mutex<HashMap<u32, Arc<ModelDevice>>>> = OnceLock::new();
        let mut devices = DEVICES.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        Ok(devices.entry(ordinal).or_insert_with(|| Arc::new(ModelDevice::new(ordinal, model))).clone())
    }

    pub fn device(ordinal: u32) -> PyResult<Arc<dyn Device>> {
        Ok(model(ordinal)? as Arc<dyn Device>)
    }
}

/// Runs the `turboio` command line `argv` (its first item the program's name) with the CLI's
/// own code, the GIL released, and gives its exit status: the `turboio` console script.
#[pyfunction]
fn _cli_main(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> u8 {
    py.detach(|| turboio_cli::run(argv))
}

/// What the model of GPU `device` (`TURBOIO_GPU_MODEL`) counted since the process began:
/// `{"allocations", "uploads", "uploaded_bytes", "pinned_allocations", "pinned_bytes",
/// "pin_s", "events_created", "synchronizations", "upload_waits", "upload_wait_s",
/// "link_busy_s"}`.
#[pyfunction]
fn _gpu_model_counters(device: &str) -> PyResult<BTreeMap<&'static str, f64>> {
    let id = DeviceId::parse(device).map_err(PyValueError::new_err)?;
    if id.kind != DeviceKind::Cuda {
        return Err(PyValueError::new_err(format!("turboio: {device}: the model stands in for CUDA devices")));
    }
    let c = gpu_model::model(id.ordinal)?.counters();
    Ok(BTreeMap::from([
        ("allocations", c.allocations as f64),
        ("uploads", c.uploads as f64),
        ("uploaded_bytes", c.uploaded_bytes as f64),
        ("pinned_allocations", c.pinned_allocations as f64),
        ("pinned_bytes", c.pinned_bytes as f64),
        ("pin_s", c.pin_time.as_secs_f64()),
        ("events_created", c.events_created as f64),
        ("synchronizations", c.synchronizations as f64),
        ("upload_waits", c.upload_waits as f64),
        ("upload_wait_s", c.upload_wait_time.as_secs_f64()),
        ("link_busy_s", c.link_busy.as_secs_f64()),
    ]))
}

/// The object-storage backend with explicit options (endpoint, region, credentials,
/// concurrency, part size, bandwidth cap; see `turboio::object::ObjectOptions`), for the
/// `storage_options=` of the Python API. Its `repr` never shows a secret.
#[pyclass(name = "ObjectStorage", module = "turboio._turboio", frozen)]
struct PyObjectStorage {
    inner: Arc<dyn turboio::storage::Storage>,
    /// The node cache in front of it, if any (the same backend as `inner`).
    cache: Option<turboio::cache::CacheStorage>,
}

#[pymethods]
impl PyObjectStorage {
    /// `cache_dir` puts a node-local cache in front of it (else `TURBOIO_CACHE_DIR`, if set);
    /// `cache_max_size` bounds it in bytes (else `TURBOIO_CACHE_MAX_SIZE`); `cache_revalidate`
    /// (seconds) trusts the version the store reported that long (else
    /// `TURBOIO_CACHE_REVALIDATE`).
    #[new]
    #[pyo3(signature = (options, cache_dir=None, cache_max_size=None, cache_revalidate=None))]
    fn new(
        options: BTreeMap<String, String>,
        cache_dir: Option<std::path::PathBuf>,
        cache_max_size: Option<u64>,
        cache_revalidate: Option<f64>,
    ) -> PyResult<Self> {
        let revalidate = cache_revalidate
            .map(|s| {
                std::time::Duration::try_from_secs_f64(s)
                    .map_err(|_| PyValueError::new_err(format!("cache_revalidate must be seconds >= 0, not {s}")))
            })
            .transpose()?;
        let object: Arc<dyn turboio::storage::Storage> = if options.is_empty() {
            // The environment's backend: its connections are shared with every other call.
            Arc::new(turboio::object::ObjectStorage::global())
        } else {
            let options = turboio::object::ObjectOptions::from_pairs(options).map_err(PyValueError::new_err)?;
            Arc::new(turboio::object::ObjectStorage::new(options))
        };
        let node = turboio::cache::NodeCache::configured(cache_dir, cache_max_size, revalidate)
            .map_err(PyValueError::new_err)?;
        let cache = node.map(|n| turboio::cache::CacheStorage::new(object.clone(), n));
        let inner: Arc<dyn turboio::storage::Storage> = match &cache {
            Some(c) => Arc::new(c.clone()),
            None => object,
        };
        Ok(PyObjectStorage { inner, cache })
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }

    /// True if a node cache is in front of the store.
    fn has_cache(&self) -> bool {
        self.cache.is_some()
    }

    /// The same store without its node cache (for reads of pieces, which a cache would not keep).
    fn without_cache(&self) -> PyObjectStorage {
        match &self.cache {
            Some(c) => PyObjectStorage { inner: c.inner().clone(), cache: None },
            None => PyObjectStorage { inner: self.inner.clone(), cache: None },
        }
    }

    /// Publishes the `nbytes` at `addr` as the node cache's entry of `path` at version
    /// `(len, tag)` (see `CacheStorage::insert`); False without a cache or when nothing was
    /// written. Private to the Python package, which passes the `data_ptr()` of a contiguous CPU
    /// tensor it keeps referenced for the call.
    fn _cache_insert(
        &self,
        py: Python<'_>,
        path: std::path::PathBuf,
        len: u64,
        tag: String,
        addr: usize,
        nbytes: usize,
    ) -> bool {
        let Some(cache) = &self.cache else { return false };
        // SAFETY: the Python layer passes the address of a contiguous CPU tensor of `nbytes`
        // bytes that it keeps alive and does not write during the call.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, nbytes) };
        let version = turboio::storage::Version { len, tag };
        py.detach(|| cache.insert(&path, &version, bytes))
    }
}

/// The storage a call was given.
fn storage_arg(storage: Option<&PyObjectStorage>) -> Option<Arc<dyn turboio::storage::Storage>> {
    storage.map(|s| s.inner.clone())
}

/// The GPUDirect Storage backend for `gds` = `"auto"` / `"on"`, none for `"off"`.
fn gds_storage(gds: &str) -> PyResult<Option<Arc<dyn turboio::storage::Storage>>> {
    use turboio::gds::{GdsConfig, GdsMode, GdsStorage};
    let mode = match gds {
        "off" | "false" | "0" | "no" => return Ok(None),
        "auto" => GdsMode::Auto,
        "on" | "true" | "1" | "yes" => GdsMode::On,
        other => {
            return Err(PyValueError::new_err(format!("unknown GDS setting `{other}` (expected auto, on or off)")))
        }
    };
    Ok(Some(Arc::new(GdsStorage::with_config(GdsConfig { mode, ..Default::default() }))))
}

/// The host-memory plan of a load that allocates `bytes` of host memory itself (a rank of a
/// `fetch="once"` model load): `MemoryError` naming `origin` and the numbers when they exceed
/// `max_host_memory` or the memory available, as every other load's plan says.
#[pyfunction]
#[pyo3(signature = (origin, bytes, max_host_memory=None))]
fn _check_host_memory(
    origin: std::path::PathBuf,
    bytes: u64,
    max_host_memory: Option<Bound<'_, PyAny>>,
) -> PyResult<()> {
    let budget = budget_arg("max_host_memory", max_host_memory.as_ref())?;
    turboio::memory::check_host(&origin, bytes, budget).map_err(to_py)
}

/// Checks that a device string names a device this process can load to; raises otherwise
/// (`RuntimeError` naming the missing library or device, `ValueError` for a bad string).
#[pyfunction]
fn check_device(py: Python<'_>, device: &str) -> PyResult<String> {
    open_target(py, device, None)?;
    Ok(DeviceId::parse(device).map_err(PyValueError::new_err)?.to_string())
}

/// Pinned staging slots kept across GPU loads: a device's process-wide pool
/// (`staging_pool(device)`), or one of the caller's own (`StagingPool()`, given to a load as
/// `staging=`).
#[pyclass(name = "StagingPool", module = "turboio._turboio", frozen)]
struct PyStagingPool {
    pool: StagingPool,
}

#[pymethods]
impl PyStagingPool {
    #[new]
    #[pyo3(signature = (max_buffers=turboio::device::DEFAULT_MAX_BUFFERS))]
    fn new(max_buffers: usize) -> Self {
        PyStagingPool { pool: StagingPool::new(max_buffers) }
    }

    /// Bytes held by free slots.
    fn free_bytes(&self) -> usize {
        self.pool.free_bytes()
    }

    /// Bytes of every slot the pool made that is alive, free or in use: the pinned memory it
    /// holds.
    fn live_bytes(&self) -> usize {
        self.pool.live_bytes()
    }

    /// Slots allocated (pinned) so far.
    fn allocations(&self) -> usize {
        self.pool.allocations()
    }

    /// Slots handed out again without pinning so far.
    fn reuses(&self) -> usize {
        self.pool.reuses()
    }

    /// The most free slots the pool keeps (a load takes at most this many).
    #[getter]
    fn max_buffers(&self) -> usize {
        self.pool.max_buffers()
    }

    /// Keeps at most `n` free slots from now on (frees the smallest beyond that now).
    fn set_max_buffers(&self, n: usize) {
        self.pool.set_max_buffers(n)
    }

    /// Frees the free slots now (slots in use come back, and are kept, when their loads end),
    /// and drops the io_uring registration of slots that cold loads bypassing the page cache
    /// keep (the kernel would hold their pages until the next such load).
    fn release(&self) {
        self.pool.release();
        turboio::posix::release_registered_slots();
    }

    /// Frees the free slots (the older name of `release`).
    fn clear(&self) {
        self.release()
    }

    fn __repr__(&self) -> String {
        format!(
            "StagingPool(free_bytes={}, live_bytes={}, max_buffers={})",
            self.pool.free_bytes(),
            self.pool.live_bytes(),
            self.pool.max_buffers()
        )
    }
}

/// The pinned staging pool of `device` in this process (the one every load to it takes its
/// slots from): `RuntimeError` where the device cannot be opened, `ValueError` for the CPU.
#[pyfunction]
fn staging_pool(py: Python<'_>, device: &str) -> PyResult<PyStagingPool> {
    let Some(dev) = open_target(py, device, None)? else {
        return Err(PyValueError::new_err(format!(
            "turboio: {device} stages nothing (a CPU load reads straight into its memory); give a GPU, e.g. cuda:0"
        )));
    };
    let pool = dev
        .staging_pool()
        .cloned()
        .ok_or_else(|| PyRuntimeError::new_err(format!("turboio: {} keeps no staging pool", dev.id())))?;
    Ok(PyStagingPool { pool })
}

/// Encryption with veTurboIO's key chain (read from the environment now), when asked for.
fn encryption(cipher: bool, header: bool) -> Option<Encryption> {
    cipher.then(|| Encryption { keys: Keys::from_env(), header, check_content: true })
}

fn parse_cache(s: &str) -> PyResult<CachePolicy> {
    s.parse().map_err(PyValueError::new_err)
}

fn parse_mode(s: &str) -> PyResult<LoadMode> {
    s.parse().map_err(PyValueError::new_err)
}

fn dtype_of(s: &str) -> PyResult<Dtype> {
    s.parse().map_err(|e: turboio::format::UnknownDtype| PyValueError::new_err(e.to_string()))
}

/// The DLPack type of a dtype, and whether it is exported as raw bytes (uint8) instead,
/// because DLPack consumers do not all know it (float8, float4, float6).
fn dl_type(d: Dtype) -> (DLDataType, bool) {
    let t = |code: u8, bits: u8| DLDataType { code, bits, lanes: 1 };
    match d {
        Dtype::BOOL => (t(6, 8), false),
        Dtype::U8 => (t(1, 8), false),
        Dtype::I8 => (t(0, 8), false),
        Dtype::I16 => (t(0, 16), false),
        Dtype::U16 => (t(1, 16), false),
        Dtype::F16 => (t(2, 16), false),
        Dtype::BF16 => (t(4, 16), false),
        Dtype::I32 => (t(0, 32), false),
        Dtype::U32 => (t(1, 32), false),
        Dtype::F32 => (t(2, 32), false),
        Dtype::C64 => (t(5, 64), false),
        Dtype::F64 => (t(2, 64), false),
        Dtype::I64 => (t(0, 64), false),
        Dtype::U64 => (t(1, 64), false),
        _ => (t(1, 8), true),
    }
}

/// The shape an export gets, in DLPack's `int64`: the shape itself, or for a raw-bytes export
/// one byte per element for the 8-bit types, the packed shape (last dimension halved) for F4
/// when it is even, else a flat byte count. A dimension above `i64::MAX` (legal in a file when
/// the tensor has no elements) cannot be represented by torch: `TypeError`, as the reference
/// raises for it.
fn export_shape(name: &str, d: Dtype, shape: &[usize], nbytes: usize) -> PyResult<Vec<i64>> {
    let dims: Vec<usize> = match (dl_type(d).1, d.bits()) {
        (false, _) | (true, 8) => shape.to_vec(),
        (true, 4) if shape.last().is_some_and(|l| l % 2 == 0) => {
            let mut s = shape.to_vec();
            if let Some(l) = s.last_mut() {
                *l /= 2;
            }
            s
        }
        _ => vec![nbytes],
    };
    dims.iter().map(|&x| i64::try_from(x)).collect::<Result<Vec<i64>, _>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "tensor `{name}` of shape {shape:?} cannot be represented by torch: a dimension is larger than 2^63 - 1"
        ))
    })
}

/// What `__dlpack__`'s `dl_device` and `copy` may ask of an export that lives on `here` and is
/// never copied: the same device, and no copy.
fn check_export_request(here: (i32, i32), dl_device: Option<(i32, i32)>, copy: Option<bool>) -> PyResult<()> {
    if let Some(want) = dl_device {
        if want != here {
            return Err(pyo3::exceptions::PyBufferError::new_err(format!(
                "turboio tensor is on DLPack device {here:?}, not {want:?}; export it there and copy"
            )));
        }
    }
    if copy == Some(true) {
        return Err(pyo3::exceptions::PyBufferError::new_err(
            "turboio exports without copying; copy the result instead",
        ));
    }
    Ok(())
}

/// A tensor of a load, exportable with `__dlpack__` (zero copy; keeps the load alive).
#[pyclass(name = "Tensor", module = "turboio._turboio", frozen)]
struct PyTensor {
    file: Arc<ExportedLoad>,
    device: DeviceId,
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    offset: usize,
    nbytes: usize,
}

#[pymethods]
impl PyTensor {
    /// The tensor's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The safetensors dtype, e.g. "BF16".
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// The shape.
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.shape.clone()
    }

    /// Bytes of data.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// Offset of the tensor's first byte in the load's memory (the whole load's export,
    /// `LoadedFile.export()`).
    #[getter]
    fn offset(&self) -> usize {
        self.offset
    }

    /// True if the DLPack export is raw bytes (uint8) to be viewed as the real dtype.
    #[getter]
    fn raw(&self) -> bool {
        dl_type(self.dtype).1
    }

    /// The DLPack protocol: a capsule viewing this tensor's bytes in place (host memory as
    /// `kDLCPU`, CUDA memory as `kDLCUDA` with the device's ordinal).
    ///
    /// `stream`: the consumer's stream. A load is complete (every copy and kernel synchronised)
    /// before its tensors are handed out, so the data is ready on any stream and nothing needs
    /// to be ordered.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = stream;
        let here = self.__dlpack_device__();
        check_export_request(here, dl_device, copy)?;
        let base = self.file.export_address().ok_or_else(|| {
            PyRuntimeError::new_err(format!("this load is on {}, which DLPack cannot export", self.device))
        })?;
        let dtype = dl_type(self.dtype).0;
        let shape = export_shape(&self.name, self.dtype, &self.shape, self.nbytes)?;
        let owner: Arc<dyn Send + Sync> = self.file.clone();
        let export = Export { owner, data: base.wrapping_add(self.offset), device: here, shape, dtype };
        dlpack::capsule(py, export, max_version.is_some_and(|(major, _)| major >= 1))
    }

    /// The DLPack device: (kDLCPU, 0) or (kDLCUDA, ordinal).
    fn __dlpack_device__(&self) -> (i32, i32) {
        match self.device.kind {
            DeviceKind::Cuda => (dlpack::DEVICE_CUDA, self.device.ordinal as i32),
            _ => (dlpack::DEVICE_CPU, 0),
        }
    }

    /// The device string: "cpu" or "cuda:N".
    #[getter]
    fn device(&self) -> String {
        self.device.to_string()
    }

    fn __repr__(&self) -> String {
        format!("Tensor(name={:?}, dtype={}, shape={:?})", self.name, self.dtype, self.shape)
    }
}

mod exported {
    use turboio::device::DeviceKind;
    use turboio::{Header, LoadReport, LoadedFile};

    /// A load whose memory is handed to Python by address (DLPack), where consumers such as
    /// torch may write to it at any time, from any thread: the bytes are shared and mutable.
    ///
    /// So that this is sound by construction, the `LoadedFile` is reachable only through this
    /// type, which never forms a Rust reference (`&[u8]` or `&mut [u8]`) to the loaded bytes:
    /// it gives their address ([`Allocation::address`](turboio::device::Allocation::address),
    /// a raw pointer that creates no reference) and the header, never `host()`, `bytes()` or
    /// `to_host()`. Rust code in this crate therefore never reads memory that Python may be
    /// writing.
    pub struct ExportedLoad(LoadedFile);

    impl ExportedLoad {
        pub fn new(file: LoadedFile) -> Self {
            ExportedLoad(file)
        }

        pub fn header(&self) -> &Header {
            self.0.header()
        }

        pub fn path(&self) -> &std::path::Path {
            self.0.path()
        }

        pub fn report(&self) -> &LoadReport {
            self.0.report()
        }

        pub fn aliases(&self) -> Vec<(&str, &str)> {
            self.0.aliases()
        }

        /// `(name, dtype, shape, offset in memory, bytes)` of every tensor, in file order.
        pub fn tensors(&self) -> impl Iterator<Item = (&str, turboio::Dtype, &[usize], usize, usize)> {
            self.0.tensors().map(|t| (t.name(), t.dtype(), t.shape(), t.offset_in_memory(), t.len()))
        }

        /// The address of the first byte of the load's memory, when DLPack can export it: host
        /// memory, or a CUDA device pointer (valid in the device's primary context, the one
        /// torch uses).
        pub fn export_address(&self) -> Option<*mut u8> {
            let memory = self.0.memory();
            matches!(memory.device().kind, DeviceKind::Cpu | DeviceKind::Cuda)
                .then(|| memory.address() as usize as *mut u8)
        }

        /// Bytes of the load's memory (from [`export_address`](Self::export_address)).
        pub fn memory_len(&self) -> usize {
            self.0.memory().len()
        }

        /// Where the memory is.
        pub fn device_id(&self) -> turboio::device::DeviceId {
            self.0.device_id()
        }
    }
}

use exported::ExportedLoad;

/// A loaded safetensors file.
#[pyclass(name = "LoadedFile", module = "turboio._turboio", frozen)]
struct PyLoaded {
    inner: Arc<ExportedLoad>,
}

fn infos(h: &Header) -> Vec<(&str, &'static str, Vec<usize>, usize, usize)> {
    h.tensors()
        .iter()
        .map(|t| (t.name.as_str(), t.dtype.name(), t.shape.clone(), t.data_offsets.0, t.data_offsets.1))
        .collect()
}

#[pymethods]
impl PyLoaded {
    /// The path.
    #[getter]
    fn path(&self) -> String {
        self.inner.path().display().to_string()
    }

    /// Offset of the data section in the file (`8 + N`).
    #[getter]
    fn data_start(&self) -> u64 {
        self.inner.header().data_start()
    }

    /// `[(name, dtype, shape, begin, end)]` in file order.
    fn infos(&self) -> Vec<(&str, &'static str, Vec<usize>, usize, usize)> {
        infos(self.inner.header())
    }

    /// Whether the load went to the model of a GPU (`TURBOIO_GPU_MODEL`), which keeps no bytes:
    /// its tensors are `meta` tensors.
    fn on_model(&self) -> bool {
        self.inner.device_id().kind == DeviceKind::Test
    }

    /// `__metadata__` or None.
    fn metadata(&self) -> Option<BTreeMap<String, String>> {
        self.inner.header().metadata().cloned()
    }

    /// `[(alias, target)]` recorded in `__metadata__`.
    fn aliases(&self) -> Vec<(String, String)> {
        self.inner.aliases().into_iter().map(|(a, t)| (a.to_owned(), t.to_owned())).collect()
    }

    /// The whole load as one DLPack-exportable byte range (host or CUDA memory), and the names
    /// of the dtypes its tensors have: the Python layer views the export as each dtype and
    /// [`build`](Self::build)s the tensors from those views (no per-tensor export).
    fn export(&self) -> PyResult<(PyFileBytes, Vec<&'static str>)> {
        let addr = self.inner.export_address().ok_or_else(|| {
            PyRuntimeError::new_err(format!("this load is on {}, which DLPack cannot export", self.inner.device_id()))
        })?;
        let device = match self.inner.device_id().kind {
            DeviceKind::Cuda => (dlpack::DEVICE_CUDA, self.inner.device_id().ordinal as i32),
            _ => (dlpack::DEVICE_CPU, 0),
        };
        let owner: Arc<dyn Send + Sync> = self.inner.clone();
        let bytes = PyFileBytes { owner, addr: addr as usize, len: self.inner.memory_len(), device };
        let mut dtypes: Vec<&'static str> = self.inner.tensors().map(|t| t.1.name()).collect();
        dtypes.sort_unstable();
        dtypes.dedup();
        Ok((bytes, dtypes))
    }

    /// Builds every tensor as a view of one export: `typed` maps a dtype name to `(the export
    /// viewed as that dtype, its element size)`; `as_strided` is `torch.as_strided`. Returns
    /// `{name: tensor}` in file order and the names it left to the caller (dtypes not in
    /// `typed`, offsets not a multiple of the element size), in file order. The loop runs here
    /// rather than in Python: one call per tensor, with nothing else built.
    fn build<'py>(
        &self,
        py: Python<'py>,
        typed: &Bound<'py, PyDict>,
        as_strided: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyDict>, Vec<String>)> {
        // Per dtype met so far: its typed view of the export and element size, if given.
        type Base<'py> = Option<(Bound<'py, PyAny>, usize)>;
        let mut bases: Vec<(Dtype, Base<'py>)> = Vec::new();
        let out = PyDict::new(py);
        let mut left = Vec::new();
        let mut strides: Vec<usize> = Vec::new();
        for (name, dtype, shape, offset, _) in self.inner.tensors() {
            let base = match bases.iter().find(|b| b.0 == dtype) {
                Some(b) => b.1.clone(),
                None => {
                    let b = match typed.get_item(dtype.name())? {
                        Some(v) => Some(v.extract::<(Bound<'py, PyAny>, usize)>()?),
                        None => None,
                    };
                    bases.push((dtype, b.clone()));
                    b
                }
            };
            match base {
                Some((base, size)) if size > 0 && offset % size == 0 => {
                    strides.clear();
                    strides.resize(shape.len(), 1);
                    for i in (0..shape.len().saturating_sub(1)).rev() {
                        strides[i] = strides[i + 1] * shape[i + 1];
                    }
                    let shape = pyo3::types::PyTuple::new(py, shape)?;
                    let st = pyo3::types::PyTuple::new(py, &strides)?;
                    out.set_item(name, as_strided.call1((base, shape, st, offset / size))?)?;
                }
                _ => left.push(name.to_owned()),
            }
        }
        Ok((out, left))
    }

    /// Every tensor as a DLPack-exportable object, in file order.
    fn tensors(&self) -> Vec<PyTensor> {
        self.inner
            .tensors()
            .map(|(name, dtype, shape, offset, nbytes)| PyTensor {
                file: self.inner.clone(),
                device: self.inner.device_id(),
                name: name.to_owned(),
                dtype,
                shape: shape.to_vec(),
                offset,
                nbytes,
            })
            .collect()
    }

    /// What the load did: held ("mapped"/"copied"), method, direct, cached_fraction, cache
    /// ("kept"/"bypassed") and cache_reason, bytes, seconds.
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.inner.report();
        let d = PyDict::new(py);
        d.set_item("held", r.held.to_string())?;
        d.set_item("method", r.read.method)?;
        d.set_item("direct", r.read.direct)?;
        d.set_item("cached_fraction", r.cached_fraction)?;
        d.set_item("cache", if r.cache.kept { "kept" } else { "bypassed" })?;
        d.set_item("cache_reason", r.cache.reason)?;
        d.set_item("bytes", r.bytes)?;
        d.set_item("seconds", r.elapsed.as_secs_f64())?;
        d.set_item("converted", r.converted)?;
        d.set_item("arena_reused", r.arena_reused)?;
        d.set_item("fallbacks", r.fallbacks.clone())?;
        d.set_item("served_by", r.served_by)?;
        d.set_item("device", self.inner.device_id().to_string())?;
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.inner.header().len()
    }
}

/// Arenas kept across loads (veTurboIO's IOHelper).
#[pyclass(name = "ArenaPool", module = "turboio._turboio", frozen)]
struct PyArenaPool {
    pool: ArenaPool,
}

#[pymethods]
impl PyArenaPool {
    #[new]
    #[pyo3(signature = (max_arenas=1, huge_pages=None))]
    fn new(max_arenas: usize, huge_pages: Option<bool>) -> Self {
        let huge = huge_pages.unwrap_or_else(turboio::device::pool_huge_pages);
        PyArenaPool { pool: ArenaPool::with_huge_pages(max_arenas, huge) }
    }

    /// Bytes held by free arenas.
    fn free_bytes(&self) -> usize {
        self.pool.free_bytes()
    }

    /// Unmaps the free arenas.
    fn clear(&self) {
        self.pool.clear()
    }
}

/// A `dtype=` argument: a safetensors dtype name (the Python layer maps torch dtypes to them).
/// The first exception a selection's callable raised (it then counts as "not selected"), raised
/// again after the load.
type PredicateError = Arc<std::sync::Mutex<Option<PyErr>>>;

/// `tensors=`: `None` (every tensor), a name or glob pattern, a list of them, a set of exact
/// names (taken literally), or a callable taking a name and returning whether to keep it
/// (called from the loader's thread, with the GIL taken for each call).
fn selection_arg(tensors: Option<&Bound<'_, PyAny>>) -> PyResult<(Option<turboio::Selection>, PredicateError)> {
    let error: PredicateError = Arc::new(std::sync::Mutex::new(None));
    let Some(t) = tensors.filter(|t| !t.is_none()) else { return Ok((None, error)) };
    // A set is taken literally: its names, no pattern characters interpreted.
    if t.is_instance_of::<pyo3::types::PySet>() || t.is_instance_of::<pyo3::types::PyFrozenSet>() {
        let names: Vec<String> =
            t.try_iter()?.map(|n| n.and_then(|n| n.extract::<String>())).collect::<PyResult<_>>()?;
        return Ok((Some(turboio::Selection::names(names)), error));
    }
    if let Ok(one) = t.extract::<String>() {
        return turboio::Selection::patterns([one]).map(|s| (Some(s), error)).map_err(PyValueError::new_err);
    }
    if t.is_callable() {
        let f: Py<PyAny> = t.clone().unbind();
        let slot = error.clone();
        let keep = move |name: &str| {
            Python::attach(|py| match f.call1(py, (name,)).and_then(|r| r.is_truthy(py)) {
                Ok(k) => k,
                Err(e) => {
                    let mut first = slot.lock().unwrap_or_else(|p| p.into_inner());
                    first.get_or_insert(e);
                    false
                }
            })
        };
        return Ok((Some(turboio::Selection::predicate(keep)), error));
    }
    let names: Vec<String> =
        t.try_iter()?.map(|n| n.and_then(|n| n.extract::<String>())).collect::<PyResult<_>>().map_err(|_| {
            PyTypeError::new_err("tensors= takes a name or glob pattern, a list of them, or a callable taking a name")
        })?;
    if names.is_empty() {
        return Err(PyValueError::new_err("tensors= is an empty list: it would select nothing"));
    }
    turboio::Selection::patterns(names).map(|s| (Some(s), error)).map_err(PyValueError::new_err)
}

/// The names of `names` that `tensors=` selects (a name or glob pattern, a list of them, or a
/// callable), in order; `KeyError` naming `origin` and the closest names when a name or pattern
/// matches none of them.
#[pyfunction]
#[pyo3(name = "select")]
fn select_names(tensors: Bound<'_, PyAny>, names: Vec<String>, origin: std::path::PathBuf) -> PyResult<Vec<String>> {
    let (selection, raised) = selection_arg(Some(&tensors))?;
    let Some(selection) = selection else { return Ok(names) };
    let checked = selection.check_names(names.iter().map(String::as_str), &origin);
    predicate_raised(&raised)?;
    checked.map_err(to_py)?;
    let kept = names.into_iter().filter(|n| selection.matches(n)).collect();
    predicate_raised(&raised)?;
    Ok(kept)
}

/// A memory budget: `None`, a byte count, or a size string ("8GiB", "500MB").
fn budget_arg(what: &str, v: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    let Some(v) = v.filter(|v| !v.is_none()) else { return Ok(None) };
    if let Ok(n) = v.extract::<u64>() {
        return Ok(Some(n));
    }
    match v.extract::<String>() {
        Ok(s) => parse_shard_size(&s).map(Some),
        Err(_) => Err(PyTypeError::new_err(format!("{what} takes a byte count or a size such as \"8GiB\""))),
    }
}

/// Raises what a selection's callable raised, if it did.
fn predicate_raised(error: &PredicateError) -> PyResult<()> {
    match error.lock().unwrap_or_else(|p| p.into_inner()).take() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn parse_dtype(dtype: Option<&str>) -> PyResult<Option<Dtype>> {
    dtype.map(|d| d.parse::<Dtype>().map_err(|e| PyValueError::new_err(e.to_string()))).transpose()
}

/// Loads every tensor of a safetensors file (GIL released, Ctrl-C cancels), into the CPU or a
/// CUDA device (`device="cuda:N"`; `gds` = "auto"/"on"/"off" for GPUDirect Storage; `staging`
/// keeps pinned buffers across loads).
#[pyfunction]
#[pyo3(signature = (path, threads=0, cache="auto", mode="auto", pool=None, huge_pages=None, progress=None, cipher=false, device="cpu", gds="off", staging=None, dtype=None, storage=None, tensors=None, max_host_memory=None, max_device_memory=None))]
#[allow(clippy::too_many_arguments)]
fn load(
    py: Python<'_>,
    path: std::path::PathBuf,
    threads: usize,
    cache: &str,
    mode: &str,
    pool: Option<&PyArenaPool>,
    huge_pages: Option<bool>,
    progress: Option<Bound<'_, PyAny>>,
    cipher: bool,
    device: &str,
    gds: &str,
    staging: Option<&PyStagingPool>,
    dtype: Option<&str>,
    storage: Option<&PyObjectStorage>,
    tensors: Option<Bound<'_, PyAny>>,
    max_host_memory: Option<Bound<'_, PyAny>>,
    max_device_memory: Option<Bound<'_, PyAny>>,
) -> PyResult<PyLoaded> {
    let dtype = parse_dtype(dtype)?;
    let (tensors, raised) = selection_arg(tensors.as_ref())?;
    let cancel = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let target = open_target(py, device, staging)?;
    // The storage given (an object store with explicit options), else GDS for local files
    // loaded to a GPU; scheme paths (sfcs://, s3://...) otherwise keep their own backend.
    let local = !path.to_str().is_some_and(|p| p.contains("://"));
    let gds = gds_storage(gds)?;
    let storage = match storage_arg(storage) {
        Some(s) => Some(s),
        None if target.is_some() && local => gds,
        None => None,
    };
    let opts = LoadOptions {
        device: target,
        storage,
        progress: Some(done.clone()),
        threads,
        cache: parse_cache(cache)?,
        mode: parse_mode(mode)?,
        arenas: pool.map(|p| p.pool.clone()),
        huge_pages,
        cancel: Some(cancel.clone()),
        encryption: encryption(cipher, false),
        dtype,
        tensors,
        max_host_memory: budget_arg("max_host_memory", max_host_memory.as_ref())?,
        max_device_memory: budget_arg("max_device_memory", max_device_memory.as_ref())?,
        ..Default::default()
    };
    let selected = opts.tensors.is_some();
    let loaded = interruptible(py, &cancel, progress.as_ref().map(|cb| (cb, &*done)), || {
        let loaded = turboio::load(&path, &opts)?;
        // Progress counts the bytes read; the header (and, for an unaligned data section, the
        // bytes before it) were read too: the total is the whole file (or what a selection read).
        let total = if selected { loaded.report().bytes } else { loaded.header().file_len() };
        done.store(total, Ordering::Relaxed);
        Ok(loaded)
    });
    predicate_raised(&raised)?;
    Ok(PyLoaded { inner: Arc::new(ExportedLoad::new(loaded?)) })
}

/// Loads a whole model (a safetensors file, a directory of shards, or an index JSON) as one
/// job into the CPU (GIL released, Ctrl-C cancels): every shard validated and the index checked
/// first, then all shards read in one pipeline. Returns one `LoadedFile` per shard.
#[pyfunction]
#[pyo3(signature = (path, threads=0, cache="auto", mode="auto", progress=None, cipher=false, dtype=None, storage=None, tensors=None, max_host_memory=None))]
#[allow(clippy::too_many_arguments)]
fn load_model(
    py: Python<'_>,
    path: std::path::PathBuf,
    threads: usize,
    cache: &str,
    mode: &str,
    progress: Option<Bound<'_, PyAny>>,
    cipher: bool,
    dtype: Option<&str>,
    storage: Option<&PyObjectStorage>,
    tensors: Option<Bound<'_, PyAny>>,
    max_host_memory: Option<Bound<'_, PyAny>>,
) -> PyResult<Vec<PyLoaded>> {
    let dtype = parse_dtype(dtype)?;
    let (tensors, raised) = selection_arg(tensors.as_ref())?;
    let cancel = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let opts = LoadOptions {
        storage: storage_arg(storage),
        progress: Some(done.clone()),
        threads,
        cache: parse_cache(cache)?,
        mode: parse_mode(mode)?,
        cancel: Some(cancel.clone()),
        encryption: encryption(cipher, false),
        dtype,
        tensors,
        max_host_memory: budget_arg("max_host_memory", max_host_memory.as_ref())?,
        ..Default::default()
    };
    let selected = opts.tensors.is_some();
    let model = interruptible(py, &cancel, progress.as_ref().map(|cb| (cb, &*done)), || {
        let model = turboio::load_model(&path, &opts)?;
        let total = match selected {
            true => model.shards().iter().map(|s| s.report().bytes).sum(),
            false => model.shards().iter().map(|s| s.header().file_len()).sum(),
        };
        done.store(total, Ordering::Relaxed);
        Ok(model)
    });
    predicate_raised(&raised)?;
    let model = model?;
    Ok(model.into_shards().into_iter().map(|f| PyLoaded { inner: Arc::new(ExportedLoad::new(f)) }).collect())
}

/// Saves tensors given by address as a sharded model directory with its index, atomically as a
/// set (GIL released): shards of at most `max_shard_size`, or, with `groups`, the shards the
/// caller chose (positions in `tensors`). Returns `(index path, [shard paths])`.
///
/// Private to the Python package, which passes only `data_ptr()`s of contiguous CPU tensors it
/// keeps referenced for the call.
#[pyfunction]
#[pyo3(signature = (dir, tensors, max_shard_size, metadata=None, threads=0, cipher=false, storage=None, groups=None))]
#[allow(clippy::too_many_arguments)]
fn _save_model_dir(
    py: Python<'_>,
    dir: std::path::PathBuf,
    tensors: Vec<RawTensor>,
    max_shard_size: u64,
    metadata: Option<BTreeMap<String, String>>,
    threads: usize,
    cipher: bool,
    storage: Option<&PyObjectStorage>,
    groups: Option<Vec<Vec<usize>>>,
) -> PyResult<(String, Vec<String>)> {
    let dtypes = tensors.iter().map(|t| dtype_of(&t.1)).collect::<PyResult<Vec<_>>>()?;
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = SaveOptions {
        storage: storage_arg(storage),
        threads,
        cancel: Some(cancel.clone()),
        encryption: encryption(cipher, false),
        ..Default::default()
    };
    let report = interruptible(py, &cancel, None, || {
        // SAFETY: see this function's doc: each address holds `t.4` readable bytes, kept alive
        // and unchanged by the caller for the call.
        let views = unsafe { host_views(&tensors, &dtypes) };
        match &groups {
            Some(g) => turboio::save_model_dir_grouped(&dir, &views, g, metadata.as_ref(), &opts),
            None => turboio::save_model_dir(&dir, &views, metadata.as_ref(), max_shard_size, &opts),
        }
    })?;
    let shards = report.shards.iter().map(|p| p.display().to_string()).collect();
    Ok((report.index.display().to_string(), shards))
}

/// `max_shard_size` as `transformers` takes it ("5GB", "500MB", "2GiB", or a byte count).
#[pyfunction]
fn parse_shard_size(s: &str) -> PyResult<u64> {
    turboio::model::parse_shard_size(s).map_err(PyValueError::new_err)
}

/// The bytes of a `.pt` load (the file mapped privately and populated from the page cache, or a
/// copy: decrypted, `O_DIRECT`, remote), or a range of them ([`slice`](Self::slice): one per
/// storage). Exported to torch as one flat uint8 DLPack tensor (zero copy); the `.pt` tensors are
/// strided views of their storage's slice, so each tensor's torch storage is its own (as after
/// `torch.load`: saving one tensor writes its storage, not the whole file).
///
/// Like `ExportedLoad`, nothing in Rust reads the bytes once this exists: only the address is
/// used, so torch may write to them.
#[pyclass(name = "FileBytes", module = "turboio._turboio", frozen)]
struct PyFileBytes {
    owner: Arc<dyn Send + Sync>,
    addr: usize,
    len: usize,
    /// The DLPack device: (kDLCPU, 0) or (kDLCUDA, ordinal).
    device: (i32, i32),
}

#[pymethods]
impl PyFileBytes {
    /// Bytes.
    fn __len__(&self) -> usize {
        self.len
    }

    /// `len` bytes from `offset`, sharing the memory (which stays alive while any slice does).
    fn slice(&self, offset: usize, len: usize) -> PyResult<PyFileBytes> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(PyValueError::new_err(format!(
                "bytes {offset}..{offset}+{len} are outside the {} bytes held",
                self.len
            )));
        }
        Ok(PyFileBytes { owner: self.owner.clone(), addr: self.addr + offset, len, device: self.device })
    }

    /// The DLPack protocol: one flat uint8 tensor of every byte held (host memory, or a CUDA
    /// load's device memory).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = stream;
        check_export_request(self.__dlpack_device__(), dl_device, copy)?;
        let export = dlpack::Export {
            owner: self.owner.clone(),
            data: self.addr as *mut u8,
            device: self.device,
            shape: vec![self.len as i64],
            dtype: dl_type(Dtype::U8).0,
        };
        dlpack::capsule(py, export, max_version.is_some_and(|(major, _)| major >= 1))
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        self.device
    }
}

/// `(storages, tensors, skipped)` of a loaded `.pt` file: storages `(offset, nbytes, dtype,
/// meta elements)` (offsets in the load's memory; the element count of a meta storage, which
/// has no bytes, else `None`), tensors `(name, dtype, shape, strides, storage, storage_offset,
/// conj, neg)` (offsets in elements; the conjugate and negative bits as saved), skipped
/// `(name, kind)`.
type PtTables = (
    Vec<(usize, u64, &'static str, Option<u64>)>,
    Vec<(String, &'static str, Vec<usize>, Vec<usize>, usize, u64, bool, bool)>,
    Vec<(String, &'static str)>,
);

fn pt_tables(loaded: &turboio::LoadedPt) -> PtTables {
    let index = loaded.index();
    let storages = index
        .storages()
        .iter()
        .map(|s| {
            let at = if s.meta { 0 } else { loaded.memory_offset(s.offset) };
            (at, s.len, s.dtype.name(), s.meta.then_some(s.numel))
        })
        .collect();
    let tensors = index
        .tensors()
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dtype.name(),
                t.shape.clone(),
                t.strides.clone(),
                t.storage,
                t.storage_offset,
                t.conj,
                t.neg,
            )
        })
        .collect();
    let skipped = index.skipped().iter().map(|s| (s.name.clone(), s.kind)).collect();
    (storages, tensors, skipped)
}

/// Loads a PyTorch `.pt` / `.bin` checkpoint without executing its pickle (GIL released,
/// Ctrl-C cancels) through turboio's load pipeline (`turboio::load_pt`): the zip and the pickle
/// are read by turboio-pt's allow-listed reader, which refuses anything but the objects
/// `torch.save` writes for tensors and containers; the storages are then mapped from the page
/// cache, or copied (`O_DIRECT` with `cache="bypass"`; always for encrypted and `sfcs://`
/// files). Returns the load's bytes and the tables the Python layer builds tensors from.
#[pyfunction]
#[pyo3(signature = (path, top_level_key=None, cipher=false, threads=0, cache="auto", mode="auto", storage=None, tensors=None, max_host_memory=None))]
#[allow(clippy::too_many_arguments)]
fn load_pt(
    py: Python<'_>,
    path: std::path::PathBuf,
    top_level_key: Option<String>,
    cipher: bool,
    threads: usize,
    cache: &str,
    mode: &str,
    storage: Option<&PyObjectStorage>,
    tensors: Option<Bound<'_, PyAny>>,
    max_host_memory: Option<Bound<'_, PyAny>>,
) -> PyResult<(PyFileBytes, PtTables)> {
    let cancel = Arc::new(AtomicBool::new(false));
    let (tensors, raised) = selection_arg(tensors.as_ref())?;
    let pt = turboio::pt::PtOptions { top_level_key, ..Default::default() };
    let opts = LoadOptions {
        storage: storage_arg(storage),
        threads,
        cache: parse_cache(cache)?,
        mode: parse_mode(mode)?,
        cancel: Some(cancel.clone()),
        encryption: encryption(cipher, false),
        tensors,
        max_host_memory: budget_arg("max_host_memory", max_host_memory.as_ref())?,
        ..Default::default()
    };
    let loaded = interruptible(py, &cancel, None, || turboio::load_pt(&path, &opts, &pt));
    predicate_raised(&raised)?;
    let loaded = loaded?;
    let tables = pt_tables(&loaded);
    // From here on only the address is used (see PyFileBytes).
    let (addr, len) = (loaded.memory().address() as usize, loaded.memory().len());
    Ok((PyFileBytes { owner: Arc::new(loaded), addr, len, device: (dlpack::DEVICE_CPU, 0) }, tables))
}

/// Converts a PyTorch checkpoint (a `.pt` / `.bin` file, a directory of them, or
/// `pytorch_model.bin.index.json`) to safetensors without executing its pickle (GIL released,
/// Ctrl-C cancels); see `turboio::convert`. Returns a report dict.
#[pyfunction]
#[pyo3(signature = (input, output, top_level_key=None, clone_shared=false, dtype=None, validate=false, overwrite=false, threads=0, cipher=false, cache="auto", storage=None))]
#[allow(clippy::too_many_arguments)]
fn convert<'py>(
    py: Python<'py>,
    input: std::path::PathBuf,
    output: std::path::PathBuf,
    top_level_key: Option<String>,
    clone_shared: bool,
    dtype: Option<&str>,
    validate: bool,
    overwrite: bool,
    threads: usize,
    cipher: bool,
    cache: &str,
    storage: Option<&PyObjectStorage>,
) -> PyResult<Bound<'py, PyDict>> {
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = turboio::convert::ConvertOptions {
        load: LoadOptions {
            storage: storage_arg(storage),
            threads,
            cache: parse_cache(cache)?,
            cancel: Some(cancel.clone()),
            encryption: encryption(cipher, false),
            ..Default::default()
        },
        save: SaveOptions {
            threads,
            storage: storage_arg(storage),
            cancel: Some(cancel.clone()),
            ..Default::default()
        },
        top_level_key,
        shared: if clone_shared {
            turboio::convert::SharedTensors::Clone
        } else {
            turboio::convert::SharedTensors::Alias
        },
        dtype: parse_dtype(dtype)?,
        validate,
        overwrite,
    };
    let r = interruptible(py, &cancel, None, || turboio::convert::convert(&input, &output, &opts))?;
    let d = PyDict::new(py);
    d.set_item("outputs", r.outputs.iter().map(|p| p.display().to_string()).collect::<Vec<_>>())?;
    d.set_item("tensors", r.tensors)?;
    d.set_item("aliases", r.aliases.clone())?;
    d.set_item("converted", r.converted)?;
    d.set_item("skipped", r.skipped.clone())?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("validated", r.validated)?;
    d.set_item("seconds", r.elapsed.as_secs_f64())?;
    Ok(d)
}

type HeaderInfo = (u64, u64, Option<BTreeMap<String, String>>, Vec<(String, &'static str, Vec<usize>, usize, usize)>);

fn header_info(h: &Header) -> HeaderInfo {
    (
        h.data_start(),
        h.file_len(),
        h.metadata().cloned(),
        infos(h).into_iter().map(|(n, d, s, b, e)| (n.to_owned(), d, s, b, e)).collect(),
    )
}

/// Reads and validates a file's header only: `(data_start, file_len, metadata, [(name, dtype, shape, begin, end)])`
/// (offsets of the plain file, when `cipher` decrypts it).
#[pyfunction]
#[pyo3(signature = (path, cipher=false, storage=None))]
fn read_header(
    py: Python<'_>,
    path: std::path::PathBuf,
    cipher: bool,
    storage: Option<&PyObjectStorage>,
) -> PyResult<HeaderInfo> {
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = LoadOptions {
        storage: storage_arg(storage),
        encryption: encryption(cipher, false),
        cancel: Some(cancel.clone()),
        ..Default::default()
    };
    let h = interruptible(py, &cancel, None, || turboio::read_header_of(&path, &opts))?;
    Ok(header_info(&h))
}

/// True if `path` names a checkpoint file by its extension (`.safetensors`, `.pt`, `.pth`,
/// `.bin`), as the CLI decides whether a URL is a file or a model's prefix. Private.
#[pyfunction]
fn _names_a_checkpoint_file(path: std::path::PathBuf) -> bool {
    turboio::model::names_a_checkpoint_file(&path)
}

/// `path` as errors show it: a URL without user info or query string (the one rule the Rust
/// errors follow, `turboio::storage::shown`). Private to the Python package.
#[pyfunction]
fn _shown(path: std::path::PathBuf) -> String {
    turboio::storage::shown(&path).to_string()
}

/// What the plain file (decrypted with `cipher`) is, by content: `"safetensors"` (a plausible
/// header length followed by `{` after optional whitespace), `"torch"` (a zip archive or a
/// pickle, as `torch.save` writes), or `"unknown"`.
#[pyfunction]
#[pyo3(signature = (path, cipher=false, storage=None))]
fn file_kind(
    py: Python<'_>,
    path: std::path::PathBuf,
    cipher: bool,
    storage: Option<&PyObjectStorage>,
) -> PyResult<&'static str> {
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = LoadOptions {
        storage: storage_arg(storage),
        encryption: encryption(cipher, false),
        cancel: Some(cancel.clone()),
        ..Default::default()
    };
    let (prefix, len) = interruptible(py, &cancel, None, || turboio::read_prefix(&path, 4096, &opts))?;
    Ok(if looks_like_safetensors(&prefix, len) {
        "safetensors"
    } else if prefix.starts_with(b"PK\x03\x04") || prefix.first() == Some(&0x80) {
        "torch"
    } else {
        "unknown"
    })
}

/// The whole plain file (decrypted with `cipher`), e.g. an encrypted torch pickle. With
/// `any_content`, a decrypted file is not checked to be a safetensors or torch file (the caller
/// checks what it got).
#[pyfunction]
#[pyo3(signature = (path, cipher=false, threads=0, storage=None, any_content=false))]
fn read_all<'py>(
    py: Python<'py>,
    path: std::path::PathBuf,
    cipher: bool,
    threads: usize,
    storage: Option<&PyObjectStorage>,
    any_content: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = LoadOptions {
        storage: storage_arg(storage),
        threads,
        encryption: encryption(cipher, false).map(|e| Encryption { check_content: !any_content, ..e }),
        cancel: Some(cancel.clone()),
        ..Default::default()
    };
    let data = interruptible(py, &cancel, None, || turboio::read_all(&path, &opts))?;
    Ok(PyBytes::new(py, &data))
}

/// A model's files without reading any shard: `(index or None, [shard paths], {tensor: shard
/// position} or None)`, as `load_model` finds them (a directory, an index JSON, a file, or an
/// object-store key prefix).
#[pyfunction]
#[pyo3(signature = (path, storage=None))]
#[allow(clippy::type_complexity)]
fn _model_files(
    py: Python<'_>,
    path: std::path::PathBuf,
    storage: Option<&PyObjectStorage>,
) -> PyResult<(Option<String>, Vec<String>, Option<BTreeMap<String, usize>>)> {
    let storage = storage_arg(storage);
    let cancel = Arc::new(AtomicBool::new(false));
    let files = interruptible(py, &cancel, None, || turboio::ModelFiles::resolve_in(&path, storage.as_ref()))?;
    let text = |p: &std::path::Path| p.to_string_lossy().into_owned();
    Ok((files.index.as_deref().map(text), files.shards.iter().map(|p| text(p)).collect(), files.weight_map))
}

/// A file's length and version tag without reading it: `(len, tag or None)`; an object's from a
/// HEAD request (its ETag), a local file's size (no tag).
#[pyfunction]
#[pyo3(signature = (path, storage=None))]
fn _file_version(
    py: Python<'_>,
    path: std::path::PathBuf,
    storage: Option<&PyObjectStorage>,
) -> PyResult<(u64, Option<String>)> {
    let storage = storage_arg(storage);
    let cancel = Arc::new(AtomicBool::new(false));
    interruptible(py, &cancel, None, || {
        let (default, _) = turboio::storage_for(&path)?;
        let s = storage.filter(|_| turboio::object::is_object_url(&path)).unwrap_or(default);
        match s.current_version(&path)? {
            Some(v) => Ok((v.len, Some(v.tag))),
            None => Ok((s.open(&path)?.len(), None)),
        }
    })
}

/// Validates a safetensors header from the file's first bytes (at least `8 + N`) and its
/// length; same result as `read_header`.
#[pyfunction]
fn parse_header(prefix: &[u8], file_len: u64) -> PyResult<HeaderInfo> {
    let h = Header::parse(prefix, file_len).map_err(|e: FormatError| PyValueError::new_err(e.to_string()))?;
    Ok(header_info(&h))
}

/// Validates a whole safetensors file held in memory; same result as `read_header`.
#[pyfunction]
fn parse_bytes(data: &[u8]) -> PyResult<HeaderInfo> {
    let h = Header::from_file_bytes(data).map_err(|e: FormatError| PyValueError::new_err(e.to_string()))?;
    Ok(header_info(&h))
}

/// Reads file ranges into memory given by address: `[(file_offset, address, nbytes)]`.
/// Returns the bytes the storage read (as its progress counted them).
///
/// Private to the Python package, which passes only `data_ptr()`s of contiguous CPU tensors
/// (or shared-memory buffers) it has checked and keeps referenced for the call.
///
/// `queue_depth` and `block_size` (0: the backend's defaults) set the requests each worker keeps
/// in flight and their size, for a local file read with io_uring (`turboio.deepnvme` passes
/// its handle's, as DeepSpeed's handle keeps `queue_depth` blocks in flight per thread).
#[pyfunction]
#[pyo3(signature = (path, requests, threads=0, cache="auto", cipher=false, storage=None, any_content=false,
                    queue_depth=0, block_size=0))]
#[allow(clippy::too_many_arguments)]
fn _read_into(
    py: Python<'_>,
    path: std::path::PathBuf,
    requests: Vec<(u64, usize, usize)>,
    threads: usize,
    cache: &str,
    cipher: bool,
    storage: Option<&PyObjectStorage>,
    any_content: bool,
    queue_depth: u32,
    block_size: usize,
) -> PyResult<u64> {
    let cancel = Arc::new(AtomicBool::new(false));
    let read = Arc::new(AtomicU64::new(0));
    let storage = match storage_arg(storage) {
        None if (queue_depth > 0 || block_size > 0)
            && turboio::storage_for(&path).map_err(to_py)?.0.name() == "posix" =>
        {
            let defaults = turboio::posix::PosixConfig::default();
            let cfg = turboio::posix::PosixConfig {
                // A ring's size: beyond 1024 requests in flight nothing is gained, and a ring the kernel
                // refuses would only send the read to the threaded path.
                queue_depth: if queue_depth > 0 { queue_depth.min(1024) } else { defaults.queue_depth },
                block_size: if block_size > 0 { block_size } else { defaults.block_size },
                ..defaults
            };
            Some(Arc::new(turboio::posix::PosixStorage::with_config(cfg)) as Arc<dyn turboio::storage::Storage>)
        }
        s => s,
    };
    let opts = LoadOptions {
        storage,
        threads,
        cache: parse_cache(cache)?,
        encryption: encryption(cipher, false).map(|e| Encryption { check_content: !any_content, ..e }),
        cancel: Some(cancel.clone()),
        progress: Some(read.clone()),
        ..Default::default()
    };
    let plan = plan_destinations(&requests);
    interruptible(py, &cancel, None, move || {
        // Overlaid requests are read into buffers of their own, in the same parallel pass.
        let mut own: Vec<Vec<u8>> = plan.overlaid.iter().map(|&i| vec![0u8; requests[i].2]).collect();
        let mut reqs: Vec<turboio::storage::ReadRequest<'_>> = plan
            .direct
            .iter()
            .map(|&i| {
                let (offset, addr, len) = requests[i];
                turboio::storage::ReadRequest {
                    offset,
                    // SAFETY: see this function's doc: the Python layer owns these buffers for
                    // the whole call and nothing else touches them meanwhile; and the direct
                    // destinations are pairwise disjoint and disjoint from every overlaid one
                    // (`plan_destinations`), so no two of these `&mut` alias.
                    dst: unsafe { dlpack::host_slice_mut(addr, len) },
                }
            })
            .collect();
        for (&i, buf) in plan.overlaid.iter().zip(own.iter_mut()) {
            reqs.push(turboio::storage::ReadRequest { offset: requests[i].0, dst: buf });
        }
        turboio::read_into(&path, reqs, &opts)?;
        // Every `&mut` of the parallel pass is gone. Destinations shared by several requests
        // get their bytes now, one request after another in the order given, so the last one
        // wins exactly as if each tensor had been read in turn.
        for (&i, buf) in plan.overlaid.iter().zip(&own) {
            let (_, addr, len) = requests[i];
            // SAFETY: `addr` holds `len` writable bytes owned by the caller for the call (see
            // above); `buf` is our own allocation, so the two do not overlap; no reference to
            // the destination exists while this copies.
            unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), addr as *mut u8, len) };
        }
        Ok(read.load(Ordering::Relaxed))
    })
}

/// How [`_read_into`] fills its destinations.
#[derive(Debug, Default, PartialEq, Eq)]
struct DestinationPlan {
    /// Requests read straight into their destination, in parallel: pairwise disjoint, and
    /// disjoint from every other request's destination.
    direct: Vec<usize>,
    /// Requests whose destination overlaps another's (e.g. tied weights in a `state_dict`):
    /// read into a buffer, then copied into place one after another, in request order.
    overlaid: Vec<usize>,
}

/// Sorts requests `(file_offset, address, len)` into direct and overlaid ones. A request whose
/// destination is exactly that of a later request is dropped: the later one would overwrite
/// all of it, so a shared destination is filled once. Empty requests are dropped.
fn plan_destinations(requests: &[(u64, usize, usize)]) -> DestinationPlan {
    let mut last_for = std::collections::HashMap::new();
    for (i, &(_, addr, len)) in requests.iter().enumerate() {
        if len > 0 {
            last_for.insert((addr, len), i);
        }
    }
    let mut kept: Vec<usize> = last_for.into_values().collect();
    kept.sort_by_key(|&i| (requests[i].1, i));
    let mut shared = vec![false; requests.len()];
    let mut group: Vec<usize> = Vec::new();
    let mut group_end = 0usize;
    let mut close = |group: &mut Vec<usize>| {
        if group.len() > 1 {
            for &i in group.iter() {
                shared[i] = true;
            }
        }
        group.clear();
    };
    for &i in &kept {
        let (_, addr, len) = requests[i];
        if !group.is_empty() && addr >= group_end {
            close(&mut group);
        }
        if group.is_empty() {
            group_end = addr;
        }
        group.push(i);
        group_end = group_end.max(addr.saturating_add(len));
    }
    close(&mut group);
    let mut plan = DestinationPlan::default();
    kept.sort_unstable();
    for i in kept {
        if shared[i] {
            plan.overlaid.push(i);
        } else {
            plan.direct.push(i);
        }
    }
    plan
}

/// A tensor to write: `(name, dtype, shape, address, nbytes)`.
type RawTensor = (String, String, Vec<usize>, usize, usize);

struct RawData(Vec<(usize, usize)>);

impl turboio::TensorData for RawData {
    fn fill(&self, index: usize, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        let &(addr, len) = self.0.get(index).ok_or("no such tensor")?;
        if offset + dst.len() > len {
            return Err(format!("tensor #{index} has {len} bytes, not {}", offset + dst.len()));
        }
        // SAFETY: see `_save`'s doc: the address holds `len` readable bytes for the call.
        let src = unsafe { dlpack::host_slice(addr, len) };
        dst.copy_from_slice(&src[offset..offset + dst.len()]);
        Ok(())
    }
}

/// Save views of tensors given by address (`RawTensor`s) with their parsed dtypes.
///
/// # Safety
/// Each tensor's address must hold its `nbytes` readable bytes, unchanged, for as long as the
/// views live (the Python layer passes `data_ptr()`s of contiguous CPU tensors it keeps
/// referenced for the call).
unsafe fn host_views<'a>(tensors: &'a [RawTensor], dtypes: &[Dtype]) -> Vec<turboio::SaveTensor<'a>> {
    tensors
        .iter()
        .zip(dtypes)
        .map(|(t, &dtype)| turboio::SaveTensor {
            name: &t.0,
            dtype,
            shape: &t.2,
            // SAFETY: guaranteed by the caller (see above).
            data: unsafe { dlpack::host_slice(t.3, t.4) },
        })
        .collect()
}

fn specs_of(tensors: &[RawTensor]) -> PyResult<Vec<TensorSpec<'_>>> {
    tensors
        .iter()
        .map(|(name, dtype, shape, _, len)| Ok(TensorSpec { name, dtype: dtype_of(dtype)?, shape, data_len: *len }))
        .collect()
}

/// Saves tensors given by address atomically (GIL released).
///
/// Private to the Python package, which passes only `data_ptr()`s of contiguous CPU tensors it
/// keeps referenced for the call.
#[pyfunction]
#[pyo3(signature = (path, tensors, metadata=None, threads=0, cipher=false, cipher_header=false, storage=None, reuse_blocks=false))]
#[allow(clippy::too_many_arguments)]
fn _save(
    py: Python<'_>,
    path: std::path::PathBuf,
    tensors: Vec<RawTensor>,
    metadata: Option<BTreeMap<String, String>>,
    threads: usize,
    cipher: bool,
    cipher_header: bool,
    storage: Option<&PyObjectStorage>,
    reuse_blocks: bool,
) -> PyResult<()> {
    let specs = specs_of(&tensors)?;
    let data = RawData(tensors.iter().map(|t| (t.3, t.4)).collect());
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = SaveOptions {
        storage: storage_arg(storage),
        threads,
        cancel: Some(cancel.clone()),
        encryption: encryption(cipher, cipher_header),
        reuse_blocks,
        ..Default::default()
    };
    interruptible(py, &cancel, None, || turboio::save_with(&path, &specs, metadata.as_ref(), &data, &opts))
}

/// A save running in the background (`save_file(..., blocking=False)`).
#[pyclass(name = "SaveHandle", module = "turboio._turboio", frozen)]
struct PySaveHandle {
    inner: turboio::SaveHandle,
}

#[pymethods]
impl PySaveHandle {
    /// Waits until the file is written (the GIL is released meanwhile); raises the save's
    /// error if it failed (the previous file is then intact). Safe to call more than once.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.wait()).map_err(|e| error_to_py(&e))
    }

    /// True once the save has finished, successfully or not.
    fn done(&self) -> bool {
        self.inner.done()
    }

    /// The save's error, once it has failed; None while running or after a success.
    fn exception(&self) -> Option<PyErr> {
        if !self.inner.done() {
            return None;
        }
        self.inner.wait().err().map(|e| error_to_py(&e))
    }

    /// `(bytes written, file size)`.
    fn progress(&self) -> (u64, u64) {
        self.inner.progress()
    }

    /// The file being written.
    #[getter]
    fn path(&self) -> String {
        self.inner.path().display().to_string()
    }

    fn __repr__(&self) -> String {
        let state = if self.inner.done() { "done" } else { "running" };
        format!("SaveHandle({:?}, {state})", self.inner.path())
    }
}

/// Saves tensors given by address in the background: they are copied into reused host
/// buffers before this returns (the caller may then change or free them), and the file is
/// written atomically by a thread of its own. Saves of one path land in order.
///
/// Private to the Python package, like `_save`.
#[pyfunction]
#[pyo3(signature = (path, tensors, metadata=None, threads=0, cipher=false, cipher_header=false, storage=None, reuse_blocks=false, max_host_memory=None))]
#[allow(clippy::too_many_arguments)]
fn _save_async(
    py: Python<'_>,
    path: std::path::PathBuf,
    tensors: Vec<RawTensor>,
    metadata: Option<BTreeMap<String, String>>,
    threads: usize,
    cipher: bool,
    cipher_header: bool,
    storage: Option<&PyObjectStorage>,
    reuse_blocks: bool,
    max_host_memory: Option<Bound<'_, PyAny>>,
) -> PyResult<PySaveHandle> {
    let dtypes = tensors.iter().map(|t| dtype_of(&t.1)).collect::<PyResult<Vec<_>>>()?;
    let opts = SaveOptions {
        storage: storage_arg(storage),
        threads,
        encryption: encryption(cipher, cipher_header),
        reuse_blocks,
        max_host_memory: budget_arg("max_host_memory", max_host_memory.as_ref())?,
        ..Default::default()
    };
    let handle = py.detach(|| {
        // SAFETY: see `_save`'s doc: each address holds `t.4` readable bytes for the call, and
        // `save_async` copies them before it returns.
        let views = unsafe { host_views(&tensors, &dtypes) };
        turboio::save_async(&path, &views, metadata.as_ref(), &opts)
    });
    Ok(PySaveHandle { inner: handle.map_err(to_py)? })
}

/// Waits for every background save of the process (called at interpreter exit).
#[pyfunction]
fn wait_for_saves(py: Python<'_>) {
    py.detach(turboio::wait_for_saves)
}

/// Saves tensors that live in CUDA memory, given by device address, atomically (GIL released):
/// straight from device memory with GPUDirect Storage when `gds` allows and works, else copied
/// to host memory chunk by chunk as the writers need it. Returns `(method, fallback)`.
///
/// Private to the Python package, which passes only `data_ptr()`s of contiguous CUDA tensors of
/// that device, after synchronising torch's current stream, and keeps them referenced for the
/// call.
#[pyfunction]
#[pyo3(signature = (path, device, tensors, metadata=None, threads=0, cipher=false, cipher_header=false, gds="off"))]
#[allow(clippy::too_many_arguments)]
fn _save_device(
    py: Python<'_>,
    path: std::path::PathBuf,
    device: &str,
    tensors: Vec<RawTensor>,
    metadata: Option<BTreeMap<String, String>>,
    threads: usize,
    cipher: bool,
    cipher_header: bool,
    gds: &str,
) -> PyResult<(&'static str, Option<String>)> {
    let dev =
        open_target(py, device, None)?.ok_or_else(|| PyValueError::new_err("_save_device needs a CUDA device"))?;
    let mut views = Vec::with_capacity(tensors.len());
    for t in &tensors {
        // SAFETY: see this function's doc: each address is the data_ptr() of a live CUDA tensor
        // of this device holding `nbytes` bytes, kept referenced and unmodified for the call.
        views.push(unsafe { dev.borrow(t.3 as u64, t.4) }.map_err(|e| PyRuntimeError::new_err(e.to_string()))?);
    }
    let dtypes = tensors.iter().map(|t| dtype_of(&t.1)).collect::<PyResult<Vec<_>>>()?;
    let list: Vec<turboio::DeviceTensor<'_>> = tensors
        .iter()
        .zip(&views)
        .zip(&dtypes)
        .map(|((t, v), d)| turboio::DeviceTensor { name: &t.0, dtype: *d, shape: &t.2, memory: v.as_ref() })
        .collect();
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = SaveOptions {
        threads,
        cancel: Some(cancel.clone()),
        encryption: encryption(cipher, cipher_header),
        storage: gds_storage(gds)?,
        ..Default::default()
    };
    let r = interruptible(py, &cancel, None, || {
        turboio::save_from_device(&path, dev.as_ref(), &list, metadata.as_ref(), &opts)
    })?;
    Ok((r.method, r.fallback))
}

/// Writes `data` to `path` atomically, encrypted with `cipher` (e.g. a `torch.save` pickle).
#[pyfunction]
#[pyo3(signature = (path, data, cipher=false, cipher_header=false, storage=None))]
fn write_file(
    py: Python<'_>,
    path: std::path::PathBuf,
    data: &[u8],
    cipher: bool,
    cipher_header: bool,
    storage: Option<&PyObjectStorage>,
) -> PyResult<()> {
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = SaveOptions {
        storage: storage_arg(storage),
        encryption: encryption(cipher, cipher_header),
        cancel: Some(cancel.clone()),
        ..Default::default()
    };
    interruptible(py, &cancel, None, || turboio::write_bytes(&path, data, &opts))
}

/// The name of the file that `path`, a temporary file of turboio's atomic writer, was to become,
/// when the writer that made it is gone (killed mid-save); `None` for any other file or while
/// its writer may still be running. For `turboio.dcp`, whose data files have a name per save
/// and so are never replaced by a later save that would remove such leftovers.
#[pyfunction]
fn _abandoned_temp_target(path: std::path::PathBuf) -> Option<String> {
    if !turboio::posix::abandoned_temp(&path) {
        return None;
    }
    let name = path.file_name()?;
    turboio::posix::temp_target(name).map(|t| t.to_string_lossy().into_owned())
}

/// The concatenation of memory segments `(address, length)`, as a save's source.
struct Segments {
    /// `(start in the file, address, length)`, in file order.
    parts: Vec<(u64, usize, usize)>,
    len: u64,
}

impl turboio::storage::WriteSource for Segments {
    fn len(&self) -> u64 {
        self.len
    }

    fn fill(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
        let mut i = self.parts.partition_point(|&(start, _, len)| start + len as u64 <= offset);
        let (mut at, mut done) = (offset, 0usize);
        while done < dst.len() {
            let &(start, addr, len) = self.parts.get(i).ok_or("a segment past the end was asked for")?;
            let skip = (at - start) as usize;
            let n = (len - skip).min(dst.len() - done);
            // SAFETY: see `_write_file_segments`: every segment is `len` readable bytes at
            // `addr` that the caller keeps alive and unchanged for the call; `dst` is the
            // writer's own buffer, so the two do not overlap.
            unsafe { std::ptr::copy_nonoverlapping((addr + skip) as *const u8, dst[done..].as_mut_ptr(), n) };
            done += n;
            at += n as u64;
            i += 1;
        }
        Ok(())
    }
}

/// Writes the concatenation of memory segments `[(address, length)]` to `path` atomically (as
/// [`write_file`]), in parallel: a DCP data file whose tensors' bytes are copied once, from
/// their own memory into the writer's aligned buffers.
///
/// Private to the Python package (`turboio.dcp`), which passes the addresses of buffers and
/// tensor storages it keeps referenced and unchanged for the call.
#[pyfunction]
#[pyo3(signature = (path, segments, cipher=false, cipher_header=false, threads=0, storage=None))]
#[allow(clippy::too_many_arguments)]
fn _write_file_segments(
    py: Python<'_>,
    path: std::path::PathBuf,
    segments: Vec<(usize, usize)>,
    cipher: bool,
    cipher_header: bool,
    threads: usize,
    storage: Option<&PyObjectStorage>,
) -> PyResult<()> {
    let mut parts = Vec::with_capacity(segments.len());
    let mut len = 0u64;
    for (addr, n) in segments {
        if n > 0 {
            parts.push((len, addr, n));
            len += n as u64;
        }
    }
    let source = Segments { parts, len };
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = SaveOptions {
        encryption: encryption(cipher, cipher_header),
        threads,
        cancel: Some(cancel.clone()),
        storage: storage_arg(storage),
        ..Default::default()
    };
    interruptible(py, &cancel, None, move || turboio::write_source(&path, &source, &opts))
}

/// The backend that serves `path`: the one given, else the one its scheme names (the local
/// file system for a plain path).
fn backend_for(
    storage: Option<&PyObjectStorage>,
    path: &std::path::Path,
) -> PyResult<Arc<dyn turboio::storage::Storage>> {
    match storage_arg(storage) {
        Some(s) => Ok(s),
        None => Ok(turboio::storage_for(path).map_err(to_py)?.0),
    }
}

/// The files directly under `path` (the objects under a URL's key prefix `path/`), as full
/// paths, sorted.
///
/// Private to the Python package (`turboio.dcp`: a checkpoint's data files on object storage).
#[pyfunction]
#[pyo3(signature = (path, storage=None))]
fn _list_files(py: Python<'_>, path: std::path::PathBuf, storage: Option<&PyObjectStorage>) -> PyResult<Vec<String>> {
    let backend = backend_for(storage, &path)?;
    let mut files = py.detach(|| backend.list(&path)).map_err(|e| to_py(Error::Storage(e)))?;
    files.sort();
    Ok(files.into_iter().map(|p| p.to_string_lossy().into_owned()).collect())
}

/// Removes the file (object) at `path`; one that does not exist is not an error.
///
/// Private to the Python package (`turboio.dcp`: data files no checkpoint refers to any more).
#[pyfunction]
#[pyo3(signature = (path, storage=None))]
fn _remove_file(py: Python<'_>, path: std::path::PathBuf, storage: Option<&PyObjectStorage>) -> PyResult<()> {
    let backend = backend_for(storage, &path)?;
    py.detach(|| backend.remove_file(&path)).map_err(|e| to_py(Error::Storage(e)))
}

/// Writes `nbytes` bytes at address `addr` into the local file `path` at `offset`, in place
/// (`turboio::write_at`: created 0600 when missing, never truncated, not synced); whole blocks
/// with `O_DIRECT` unless `cache` is "keep". Returns the bytes written.
///
/// Private to the Python package (`turboio.deepnvme`), which passes only the `data_ptr()` of a
/// contiguous CPU tensor it keeps referenced for the call.
#[pyfunction]
#[pyo3(signature = (path, offset, addr, nbytes, threads=0, cache="bypass", chunk=0))]
#[allow(clippy::too_many_arguments)]
fn _write_at(
    py: Python<'_>,
    path: std::path::PathBuf,
    offset: u64,
    addr: usize,
    nbytes: usize,
    threads: usize,
    cache: &str,
    chunk: usize,
) -> PyResult<u64> {
    let cancel = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let opts = SaveOptions {
        threads,
        cache: parse_cache(cache)?,
        chunk_size: chunk,
        cancel: Some(cancel.clone()),
        progress: Some(written.clone()),
        ..Default::default()
    };
    interruptible(py, &cancel, None, move || {
        // SAFETY: see this function's doc: the Python layer keeps the tensor whose `nbytes`
        // bytes start at `addr` alive and unchanged by it for the call; the slice is only read.
        let data: &[u8] =
            if nbytes == 0 { &[] } else { unsafe { std::slice::from_raw_parts(addr as *const u8, nbytes) } };
        turboio::write_at(&path, offset, data, &opts)?;
        Ok(written.load(Ordering::Relaxed))
    })
}

/// Serializes tensors given by address into `bytes` (same layout as a saved file).
#[pyfunction]
#[pyo3(signature = (tensors, metadata=None))]
fn _serialize<'py>(
    py: Python<'py>,
    tensors: Vec<RawTensor>,
    metadata: Option<BTreeMap<String, String>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let specs = specs_of(&tensors)?;
    let pairs: Vec<(TensorSpec<'_>, &[u8])> = specs
        .iter()
        .zip(&tensors)
        // SAFETY: see `_save`'s doc.
        .map(|(s, t)| (*s, unsafe { dlpack::host_slice(t.3, t.4) }))
        .collect();
    let bytes =
        turboio::format::serialize(&pairs, metadata.as_ref()).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(PyBytes::new(py, &bytes))
}

/// Whether the file starts like a safetensors file (a plausible header length followed by `{`
/// after optional whitespace). Used to tell safetensors from torch pickles by content.
#[pyfunction]
fn looks_like_safetensors(prefix: &[u8], file_len: u64) -> bool {
    turboio::crypt::looks_like_safetensors(prefix, file_len)
}

/// The extension module.
#[pymodule]
fn _turboio(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyObjectStorage>()?;
    m.add_class::<PyLoaded>()?;
    m.add_class::<PyTensor>()?;
    m.add_class::<PyArenaPool>()?;
    m.add_class::<PyStagingPool>()?;
    m.add_function(wrap_pyfunction!(staging_pool, m)?)?;
    m.add_function(wrap_pyfunction!(_check_host_memory, m)?)?;
    m.add_function(wrap_pyfunction!(check_device, m)?)?;
    m.add_function(wrap_pyfunction!(_save_device, m)?)?;
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(select_names, m)?)?;
    m.add_function(wrap_pyfunction!(load_model, m)?)?;
    m.add_function(wrap_pyfunction!(load_pt, m)?)?;
    m.add_function(wrap_pyfunction!(convert, m)?)?;
    m.add_class::<PyFileBytes>()?;
    m.add_function(wrap_pyfunction!(_save_model_dir, m)?)?;
    m.add_function(wrap_pyfunction!(parse_shard_size, m)?)?;
    m.add_function(wrap_pyfunction!(_gpu_model_counters, m)?)?;
    m.add_function(wrap_pyfunction!(_cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(read_header, m)?)?;
    m.add_function(wrap_pyfunction!(_model_files, m)?)?;
    m.add_function(wrap_pyfunction!(_file_version, m)?)?;
    m.add_function(wrap_pyfunction!(parse_header, m)?)?;
    m.add_function(wrap_pyfunction!(file_kind, m)?)?;
    m.add_function(wrap_pyfunction!(_shown, m)?)?;
    m.add_function(wrap_pyfunction!(_names_a_checkpoint_file, m)?)?;
    m.add_function(wrap_pyfunction!(read_all, m)?)?;
    m.add_function(wrap_pyfunction!(write_file, m)?)?;
    m.add_function(wrap_pyfunction!(_write_at, m)?)?;
    m.add_function(wrap_pyfunction!(_write_file_segments, m)?)?;
    m.add_function(wrap_pyfunction!(_list_files, m)?)?;
    m.add_function(wrap_pyfunction!(_remove_file, m)?)?;
    m.add_function(wrap_pyfunction!(_abandoned_temp_target, m)?)?;
    m.add_function(wrap_pyfunction!(parse_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(_read_into, m)?)?;
    m.add_function(wrap_pyfunction!(_save, m)?)?;
    m.add_class::<PySaveHandle>()?;
    m.add_function(wrap_pyfunction!(_save_async, m)?)?;
    m.add_function(wrap_pyfunction!(wait_for_saves, m)?)?;
    m.add_function(wrap_pyfunction!(_serialize, m)?)?;
    m.add_function(wrap_pyfunction!(looks_like_safetensors, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
