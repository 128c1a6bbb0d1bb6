//! The result of a load.

use crate::backend::ReadInfo;
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use turboio_device::{Allocation, Device, DeviceId};
use turboio_format::{Dtype, Header, TensorInfo};

/// How the bytes of a load are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// A private mapping of the file (zero copy).
    Mapped,
    /// A copy in a CPU arena.
    Copied,
    /// Device memory (filled through host staging buffers, from the page-cache mapping, or by
    /// GPUDirect Storage: see [`LoadReport::read`]).
    Staged,
}

impl std::fmt::Display for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Held::Mapped => "mapped",
            Held::Copied => "copied",
            Held::Staged => "staged",
        })
    }
}

/// Whether a load read through the page cache, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheUse {
    /// True if the file was read through the page cache (and so stays there); false if it was
    /// read with `O_DIRECT` (see [`ReadInfo::direct_refused`] for a file system that refused).
    pub kept: bool,
    /// Why, in a few words ("default", "asked for", "the file and its copy do not both fit in
    /// memory: 3.1 GB available", ...).
    pub reason: &'static str,
}

impl std::fmt::Display for CacheUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = if self.kept { "page cache kept" } else { "page cache bypassed" };
        write!(f, "{what} ({})", self.reason)
    }
}

/// What a load did and how long it took.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadReport {
    /// How the bytes are held.
    pub held: Held,
    /// How they were read (`"mmap"` for mapped loads).
    pub read: ReadInfo,
    /// The page-cache residency measured before choosing, when the backend could tell.
    pub cached_fraction: Option<f64>,
    /// Whether the page cache was used, and why.
    pub cache: CacheUse,
    /// Bytes brought into memory.
    pub bytes: u64,
    /// Whether the arena came from a pool (already faulted in).
    pub arena_reused: bool,
    /// Why a faster path was not taken, one line each (GPUDirect Storage refused, decryption on
    /// the device unavailable, the page-cache mapping not usable). Empty when nothing fell back.
    pub fallbacks: Vec<String>,
    /// Tensors converted to [`LoadOptions::dtype`](crate::LoadOptions::dtype) on the way in
    /// (0 when no dtype was asked for or every tensor already had it).
    pub converted: usize,
    /// Wall time of the whole load, header included.
    pub elapsed: Duration,
    /// Where a caching layer served the file from (`"node cache: hit"`, ...;
    /// [`StorageFile::served_by`](crate::storage::StorageFile::served_by)); `None` otherwise.
    pub served_by: Option<&'static str>,
}

impl LoadReport {
    /// Throughput in GB/s (10^9 bytes per second) over the file's size.
    pub fn gb_per_s(&self, file_len: u64) -> f64 {
        file_len as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

/// A loaded safetensors file: its header and every tensor's bytes, in one allocation.
///
/// Tensors are views into that allocation; dropping the `LoadedFile` frees it (or returns the
/// arena to its pool).
#[derive(Debug)]
pub struct LoadedFile {
    pub(crate) path: PathBuf,
    pub(crate) header: Header,
    pub(crate) memory: Box<dyn Allocation>,
    /// Where the data section starts in `memory`.
    pub(crate) data_base: usize,
    pub(crate) device: Option<Arc<dyn Device>>,
    pub(crate) report: LoadReport,
}

/// One tensor of a [`LoadedFile`].
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    info: &'a TensorInfo,
    bytes: Option<&'a [u8]>,
    offset: usize,
}

impl<'a> TensorView<'a> {
    /// Name (as in the header; for an alias, the name of the tensor it points to).
    pub fn name(&self) -> &'a str {
        &self.info.name
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.info.dtype
    }

    /// Shape.
    pub fn shape(&self) -> &'a [usize] {
        &self.info.shape
    }

    /// The header entry.
    pub fn info(&self) -> &'a TensorInfo {
        self.info
    }

    /// Byte length.
    pub fn len(&self) -> usize {
        self.info.len()
    }

    /// True if the tensor has no bytes.
    pub fn is_empty(&self) -> bool {
        self.info.is_empty()
    }

    /// The bytes, when the memory is host memory.
    pub fn bytes(&self) -> Option<&'a [u8]> {
        self.bytes
    }

    /// Offset of the tensor's first byte within the load's allocation.
    pub fn offset_in_memory(&self) -> usize {
        self.offset
    }
}

impl LoadedFile {
    /// The file that was loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parsed header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// `__metadata__`, if any.
    pub fn metadata(&self) -> Option<&BTreeMap<String, String>> {
        self.header.metadata()
    }

    /// Number of tensors (aliases not counted).
    pub fn len(&self) -> usize {
        self.header.len()
    }

    /// True if the file has no tensor.
    pub fn is_empty(&self) -> bool {
        self.header.is_empty()
    }

    /// What the load did.
    pub fn report(&self) -> &LoadReport {
        &self.report
    }

    /// Where the bytes are.
    pub fn device_id(&self) -> DeviceId {
        self.memory.device()
    }

    /// The allocation holding every tensor.
    pub fn memory(&self) -> &dyn Allocation {
        self.memory.as_ref()
    }

    /// Offset of the data section within [`memory`](Self::memory).
    pub fn data_base(&self) -> usize {
        self.data_base
    }

    fn view<'a>(&'a self, info: &'a TensorInfo) -> TensorView<'a> {
        let offset = self.data_base + info.data_offsets.0;
        TensorView { info, bytes: self.memory.host().map(|m| &m[offset..offset + info.len()]), offset }
    }

    /// Every tensor, in file order (aliases not included; see [`aliases`](Self::aliases)).
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> {
        self.header.tensors().iter().map(|t| self.view(t))
    }

    /// A tensor by name; an alias recorded in `__metadata__` resolves to its target.
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        if let Some(t) = self.header.get(name) {
            return Some(self.view(t));
        }
        let target = self.header.aliases().into_iter().find(|(alias, _)| *alias == name)?.1;
        self.header.get(target).map(|t| self.view(t))
    }

    /// `(alias, target)` pairs from `__metadata__` (veTurboIO's and `save_model`'s shared tensors).
    pub fn aliases(&self) -> Vec<(&str, &str)> {
        self.header.aliases()
    }

    /// The bytes of a tensor, writable (CPU loads; a mapped page is copied when first written).
    pub fn tensor_bytes_mut(&mut self, name: &str) -> Option<&mut [u8]> {
        let info = self.header.get(name)?;
        let offset = self.data_base + info.data_offsets.0;
        let len = info.len();
        self.memory.host_mut().map(|m| &mut m[offset..offset + len])
    }

    /// Copies a tensor's bytes to host memory, from whatever device holds them.
    pub fn to_host(&self, name: &str) -> Result<Vec<u8>> {
        let view = self
            .tensor(name)
            .ok_or_else(|| Error::format(&self.path, turboio_format::FormatError::TensorNotFound(name.to_owned())))?;
        match view.bytes() {
            Some(b) => Ok(b.to_vec()),
            None => download(&self.path, self.device.as_ref(), self.memory(), view.offset_in_memory(), view.len()),
        }
    }
}

/// Copies `len` bytes at `offset` of device memory to the host (loads whose memory the CPU
/// cannot address).
pub(crate) fn download(
    path: &Path,
    device: Option<&Arc<dyn Device>>,
    memory: &dyn Allocation,
    offset: usize,
    len: usize,
) -> Result<Vec<u8>> {
    let device =
        device.ok_or_else(|| Error::Unsupported { path: path.to_owned(), message: "no device to copy from".into() })?;
    let mut out = vec![0u8; len];
    device.download(memory, offset, &mut out).map_err(|e| Error::device(path, e))?;
    Ok(out)
}
