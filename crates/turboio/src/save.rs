//! The save pipeline.

use crate::backend::write_storage;
use crate::options::SaveOptions;
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;
use turboio_device::{Allocation, Device};
use turboio_format::{plan, Dtype, Layout, TensorSpec};
use turboio_storage::{DeviceDst, DeviceWriteRequest, IoOptions, StorageError, WriteSource};

/// A tensor to save from host memory.
#[derive(Debug, Clone, Copy)]
pub struct SaveTensor<'a> {
    /// Name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: &'a [usize],
    /// The bytes (row-major, little-endian); must be exactly dtype x shape long.
    pub data: &'a [u8],
}

/// Where a save gets tensor bytes from: host memory, device memory, a generator...
pub trait TensorData: Sync {
    /// Fills `dst` with bytes `offset..offset + dst.len()` of tensor `index` (its position in
    /// the spec slice given to [`save_with`]). An error aborts the save; the previous file is
    /// left as it was.
    fn fill(&self, index: usize, offset: usize, dst: &mut [u8]) -> std::result::Result<(), String>;
}

/// Host slices, one per tensor.
struct HostData<'a>(Vec<&'a [u8]>);

impl TensorData for HostData<'_> {
    fn fill(&self, index: usize, offset: usize, dst: &mut [u8]) -> std::result::Result<(), String> {
        let src = self
            .0
            .get(index)
            .and_then(|d| d.get(offset..offset + dst.len()))
            .ok_or_else(|| format!("tensor #{index}: bytes {offset}+{} are missing", dst.len()))?;
        dst.copy_from_slice(src);
        Ok(())
    }
}

/// Saves tensors from host memory as a safetensors file, atomically.
///
/// The file is byte-identical to what the reference writer produces for the same tensors
/// (metadata keys sorted). It is written to a temporary file in the same directory, synced,
/// and renamed over `path`: a crash or an error leaves the previous file intact.
pub fn save(
    path: impl AsRef<Path>,
    tensors: &[SaveTensor<'_>],
    metadata: Option<&BTreeMap<String, String>>,
    opts: &SaveOptions,
) -> Result<()> {
    let path = path.as_ref();
    let specs: Vec<TensorSpec<'_>> = tensors
        .iter()
        .map(|t| TensorSpec { name: t.name, dtype: t.dtype, shape: t.shape, data_len: t.data.len() })
        .collect();
    let data = HostData(tensors.iter().map(|t| t.data).collect());
    save_with(path, &specs, metadata, &data, opts)
}

/// Saves tensors whose bytes come from any [`TensorData`] (device memory, generated data).
/// `specs[i].data_len` must match dtype x shape; the bytes are pulled chunk by chunk as the
/// writers need them, so nothing is buffered whole.
pub fn save_with(
    path: impl AsRef<Path>,
    specs: &[TensorSpec<'_>],
    metadata: Option<&BTreeMap<String, String>>,
    data: &dyn TensorData,
    opts: &SaveOptions,
) -> Result<()> {
    let path = path.as_ref();
    let layout = plan(specs, metadata).map_err(|e| Error::format(path, e))?;
    write_source(path, &FileSource::new(&layout, data), opts)
}

/// A tensor to save from device memory: a view of it from [`Device::borrow`] (or any
/// allocation of the device), whose first `dtype x shape` bytes are the tensor.
#[derive(Debug, Clone, Copy)]
pub struct DeviceTensor<'a> {
    /// Name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: &'a [usize],
    /// The tensor's bytes on the device.
    pub memory: &'a dyn Allocation,
}

/// How a save from device memory went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveReport {
    /// `"gds"` (written straight from device memory) or `"staged"` (copied to host memory
    /// chunk by chunk as the writers need it).
    pub method: &'static str,
    /// Why GPUDirect Storage was not used, when the storage offered it.
    pub fallback: Option<String>,
}

/// Tensor bytes read from device memory as the writers ask for them.
struct DeviceData<'a> {
    device: &'a dyn Device,
    tensors: &'a [DeviceTensor<'a>],
}

impl TensorData for DeviceData<'_> {
    fn fill(&self, index: usize, offset: usize, dst: &mut [u8]) -> std::result::Result<(), String> {
        let t = self.tensors.get(index).ok_or_else(|| format!("no tensor #{index}"))?;
        self.device.download(t.memory, offset, dst).map_err(|e| format!("tensor `{}`: {e}", t.name))
    }
}

/// Saves tensors that live in device memory (a GPU's), atomically, byte-identical to [`save`].
///
/// When the storage writes straight from device memory ([`Storage::writes_from_device`](turboio_storage::Storage::writes_from_device), GDS)
/// and the file is not encrypted, the tensors go out that way; otherwise (or when it refuses,
/// reported in [`SaveReport::fallback`]) the writers copy each chunk to host memory as they
/// need it, so no host copy of the whole model is ever made. The caller must make sure the
/// device memory is ready (e.g. synchronise the framework's stream) and stays unchanged.
pub fn save_from_device(
    path: impl AsRef<Path>,
    device: &dyn Device,
    tensors: &[DeviceTensor<'_>],
    metadata: Option<&BTreeMap<String, String>>,
    opts: &SaveOptions,
) -> Result<SaveReport> {
    let path = path.as_ref();
    let mut specs = Vec::with_capacity(tensors.len());
    for t in tensors {
        let spec = TensorSpec::new(t.name, t.dtype, t.shape).map_err(|e| Error::format(path, e))?;
        let want = spec.data_len;
        if t.memory.len() < want {
            return Err(Error::Unsupported {
                path: path.to_owned(),
                message: format!("tensor `{}` needs {want} bytes but its memory has {}", t.name, t.memory.len()),
            });
        }
        if t.memory.device() != device.id() {
            return Err(Error::Unsupported {
                path: path.to_owned(),
                message: format!("tensor `{}` is on {}, not {}", t.name, t.memory.device(), device.id()),
            });
        }
        specs.push(spec);
    }
    let layout = plan(&specs, metadata).map_err(|e| Error::format(path, e))?;
    let data = DeviceData { device, tensors };
    let source = FileSource::new(&layout, &data);
    device.synchronize().map_err(|e| Error::device(path, e))?;

    #[cfg(feature = "cipher")]
    let encrypted = opts.encryption.is_some();
    #[cfg(not(feature = "cipher"))]
    let encrypted = false;
    let storage = write_storage(opts.storage.as_ref(), path)?;
    let kind = device.id().kind.name();
    let mut fallback = None;
    if !encrypted && storage.writes_from_device(kind) {
        let requests: Vec<DeviceWriteRequest> = layout
            .entries
            .iter()
            .filter(|e| !e.info.is_empty())
            .map(|e| {
                let m = tensors[e.input_index].memory;
                DeviceWriteRequest {
                    offset: layout.file_offset(e),
                    len: e.info.len() as u64,
                    src: DeviceDst { kind, ordinal: device.id().ordinal, base: m.address(), offset: 0 },
                }
            })
            .collect();
        let io = IoOptions {
            threads: opts.threads,
            chunk_size: opts.chunk_size,
            progress: opts.progress.as_deref(),
            cancel: opts.cancel.as_deref(),
            ..Default::default()
        };
        match storage.write_file_from_device(path, &source, &requests, &io) {
            Ok(()) => return Ok(SaveReport { method: "gds", fallback: None }),
            Err(StorageError::Unsupported { what, .. }) => fallback = Some(what),
            Err(e) => return Err(Error::storage(path, e)),
        }
    }
    write_source(path, &source, opts)?;
    Ok(SaveReport { method: "staged", fallback })
}

/// Writes `data` into the local file `path` at byte `offset`, in place: the raw positional
/// write of DeepNVMe-style handles (`turboio.deepnvme`), **not** a save. The file is created
/// (mode 0600 before the umask) when missing and never truncated; bytes outside the range stay;
/// nothing is synced; a crash can leave the range partly written. Whole blocks go with
/// `O_DIRECT` unless `opts.cache` is [`CachePolicy::Keep`](crate::CachePolicy::Keep), in parallel
/// (`opts.threads`, `opts.chunk_size`), the unaligned head and tail through the page cache.
/// Local files only, unencrypted: other storage and `opts.encryption` are refused.
pub fn write_at(path: impl AsRef<Path>, offset: u64, data: &[u8], opts: &SaveOptions) -> Result<()> {
    let path = path.as_ref();
    let refuse = |message: &str| Err(Error::Unsupported { path: path.to_owned(), message: message.to_owned() });
    #[cfg(feature = "cipher")]
    if opts.encryption.is_some() {
        return refuse("in-place writes are not encrypted (save the file whole to encrypt it)");
    }
    if opts.storage.is_some() || crate::backend::scheme_storage(path)?.is_some() {
        return refuse("in-place writes need a local file");
    }
    #[cfg(feature = "posix")]
    {
        let io = IoOptions {
            threads: opts.threads,
            direct: match opts.cache {
                crate::CachePolicy::Keep => turboio_storage::DirectIo::Off,
                _ => turboio_storage::DirectIo::On,
            },
            chunk_size: opts.chunk_size,
            progress: opts.progress.as_deref(),
            cancel: opts.cancel.as_deref(),
            ..Default::default()
        };
        crate::backend::local_posix()
            .write_at(path, offset, &turboio_storage::BytesSource(data), &io)
            .map_err(|e| Error::storage(path, e))
    }
    #[cfg(not(feature = "posix"))]
    {
        let _ = (offset, data);
        refuse("in-place writes need the posix feature")
    }
}

/// Writes any bytes (a torch pickle, a file being converted) to `path` atomically, encrypted
/// when the options ask for it.
pub fn write_bytes(path: impl AsRef<Path>, data: &[u8], opts: &SaveOptions) -> Result<()> {
    write_source(path.as_ref(), &turboio_storage::BytesSource(data), opts)
}

/// Writes the bytes `plain` produces to `path` atomically, encrypted when the options ask for
/// it: [`write_bytes`] for bytes that are not in one slice (gathered from several buffers).
pub fn write_source(path: &Path, plain: &dyn WriteSource, opts: &SaveOptions) -> Result<()> {
    #[cfg(feature = "cipher")]
    let encrypted = match &opts.encryption {
        Some(enc) => {
            let (cipher, prefix) = crate::encryption::for_write(path, enc, opts.cancel.as_ref())?;
            Some(crate::encryption::EncryptingSource { prefix, inner: plain, cipher })
        }
        None => None,
    };
    #[cfg(feature = "cipher")]
    let source: &dyn WriteSource = match &encrypted {
        Some(e) => e,
        None => plain,
    };
    #[cfg(not(feature = "cipher"))]
    let source: &dyn WriteSource = plain;
    let storage = write_storage(opts.storage.as_ref(), path)?;
    let io = IoOptions {
        threads: opts.threads,
        direct: match opts.cache {
            crate::CachePolicy::Auto => turboio_storage::DirectIo::Auto,
            crate::CachePolicy::Keep => turboio_storage::DirectIo::Off,
            crate::CachePolicy::Bypass => turboio_storage::DirectIo::On,
        },
        chunk_size: opts.chunk_size,
        progress: opts.progress.as_deref(),
        cancel: opts.cancel.as_deref(),
        reuse_blocks: opts.reuse_blocks,
        ..Default::default()
    };
    storage.write_file(path, source, &io).map_err(|e| Error::storage(path, e))
}

/// The bytes of a whole file, produced on demand from a layout and tensor data.
struct FileSource<'a> {
    header: &'a [u8],
    /// (absolute start, length, input index), sorted by start, empty tensors left out.
    spans: Vec<(u64, u64, usize)>,
    len: u64,
    data: &'a dyn TensorData,
}

impl<'a> FileSource<'a> {
    fn new(layout: &'a Layout, data: &'a dyn TensorData) -> Self {
        let spans = layout
            .entries
            .iter()
            .filter(|e| !e.info.is_empty())
            .map(|e| (layout.file_offset(e), e.info.len() as u64, e.input_index))
            .collect();
        FileSource { header: &layout.header, spans, len: layout.file_len(), data }
    }
}

impl WriteSource for FileSource<'_> {
    fn len(&self) -> u64 {
        self.len
    }

    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), String> {
        let mut pos = offset;
        let mut out = dst;
        while !out.is_empty() {
            let n;
            if pos < self.header.len() as u64 {
                let h = &self.header[pos as usize..];
                n = h.len().min(out.len());
                out[..n].copy_from_slice(&h[..n]);
            } else {
                let i = self.spans.partition_point(|&(start, _, _)| start <= pos);
                let &(start, len, index) = i
                    .checked_sub(1)
                    .and_then(|i| self.spans.get(i))
                    .filter(|&&(start, len, _)| pos < start + len)
                    .ok_or_else(|| format!("offset {pos} is past the end of the file being written"))?;
                let within = pos - start;
                n = ((len - within) as usize).min(out.len());
                self.data.fill(index, within as usize, &mut out[..n])?;
            }
            pos += n as u64;
            out = &mut out[n..];
        }
        Ok(())
    }
}
