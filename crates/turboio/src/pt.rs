//! Loads of PyTorch `.pt` / `.bin` checkpoints (`torch.save`, torch >= 1.6) through the same
//! pipeline as safetensors files, without executing their pickle.
//!
//! ```no_run
//! let loaded = turboio::load_pt("pytorch_model.bin", &Default::default(), &Default::default())?;
//! for t in loaded.tensors() {
//!     let bytes = loaded.tensor_bytes(t.name())?; // contiguous row-major, any strides
//!     println!("{} {} {:?} {} bytes", t.name(), t.dtype(), t.shape(), bytes.len());
//! }
//! # Ok::<(), turboio::Error>(())
//! ```
//!
//! The file is indexed first by [`turboio_pt`] (the zip directory and the pickle, through an
//! allow-listed interpreter that builds only tensors and containers and refuses everything
//! else; nothing is executed), then its storages are brought in exactly as a safetensors
//! file's data section is ([`crate::load`]): mapped from the page cache by default, copied
//! (with `O_DIRECT` when the cache is bypassed) when asked or when the file is encrypted or
//! remote, or staged into device memory. Every storage is read once, whatever number of
//! tensors views it: tied weights and views stay views of the same bytes. A tensor is a view
//! (offset, shape, strides) into that memory ([`PtView`]); [`LoadedPt::tensor_bytes`] gives
//! its contiguous bytes.
//!
//! Dtype conversion on load is a safetensors feature; convert a checkpoint once with
//! [`crate::convert`] (`--dtype`) instead.

use crate::backend::Opened;
use crate::loaded::LoadReport;
use crate::plan::{cpu_device, io_options, load_device, open, plan_parsed, Parsed, PlainReader, Planned};
use crate::{Error, LoadOptions, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use turboio_device::{Allocation, Device, DeviceId};
use turboio_format::Dtype;
pub use turboio_pt::{PtIndex, PtOptions, PtTensor};

/// A loaded torch checkpoint: its index and every storage's bytes, in one allocation.
#[derive(Debug)]
pub struct LoadedPt {
    path: PathBuf,
    index: PtIndex,
    memory: Box<dyn Allocation>,
    /// Where file byte `data_start` is in `memory`.
    data_base: usize,
    data_start: u64,
    device: Option<Arc<dyn Device>>,
    report: LoadReport,
}

/// One tensor of a [`LoadedPt`]: a view into the load's memory.
#[derive(Debug, Clone, Copy)]
pub struct PtView<'a> {
    tensor: &'a PtTensor,
    offset: usize,
    bytes: Option<&'a [u8]>,
}

impl<'a> PtView<'a> {
    /// The dotted name (`model.layer.0.weight`).
    pub fn name(&self) -> &'a str {
        &self.tensor.name
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.tensor.dtype
    }

    /// Shape.
    pub fn shape(&self) -> &'a [usize] {
        &self.tensor.shape
    }

    /// Strides, in elements.
    pub fn strides(&self) -> &'a [usize] {
        &self.tensor.strides
    }

    /// The index entry (storage, offsets, flags).
    pub fn info(&self) -> &'a PtTensor {
        self.tensor
    }

    /// Whether the view is row-major contiguous (its bytes are then [`span`](Self::span)).
    pub fn is_contiguous(&self) -> bool {
        self.tensor.is_contiguous()
    }

    /// Offset in the load's memory of the view's first element.
    pub fn offset_in_memory(&self) -> usize {
        self.offset
    }

    /// The conjugate bit (`x.conj()` saved): the logical values are the conjugates of the
    /// stored ones. [`LoadedPt::tensor_bytes`] applies it; [`span`](Self::span) is the stored
    /// bytes.
    pub fn is_conj(&self) -> bool {
        self.tensor.conj
    }

    /// The negative bit (`x._neg_view()` saved): the logical values are the negatives of the
    /// stored ones, as for [`is_conj`](Self::is_conj).
    pub fn is_neg(&self) -> bool {
        self.tensor.neg
    }

    /// A meta tensor (a shape and a dtype, no data: torch loads it on the meta device).
    pub fn is_meta(&self) -> bool {
        self.tensor.meta
    }

    /// The storage bytes the view touches (from its first element to just past its last), when
    /// the memory is host memory: exactly the tensor's bytes for a contiguous view. These are
    /// the stored values: with the conjugate or negative bit set, the logical ones differ
    /// ([`LoadedPt::tensor_bytes`]).
    pub fn span(&self) -> Option<&'a [u8]> {
        self.bytes
    }
}

impl LoadedPt {
    /// The file that was loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The checkpoint's index: storages, tensors, skipped entries.
    pub fn index(&self) -> &PtIndex {
        &self.index
    }

    /// What the load did.
    pub fn report(&self) -> &LoadReport {
        &self.report
    }

    /// Where the bytes are.
    pub fn device_id(&self) -> DeviceId {
        self.memory.device()
    }

    /// The allocation holding every storage.
    pub fn memory(&self) -> &dyn Allocation {
        self.memory.as_ref()
    }

    /// Offset in [`memory`](Self::memory) of an absolute file offset (of a storage byte).
    pub fn memory_offset(&self, file_offset: u64) -> usize {
        self.data_base + (file_offset.saturating_sub(self.data_start)) as usize
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.index.tensors().len()
    }

    /// True if the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.index.tensors().is_empty()
    }

    fn view<'a>(&'a self, t: &'a PtTensor) -> PtView<'a> {
        let span = self.index.file_span(t);
        let offset = self.memory_offset(span.start);
        let len = (span.end - span.start) as usize;
        PtView { tensor: t, offset, bytes: self.memory.host().and_then(|m| m.get(offset..offset + len)) }
    }

    /// Every tensor, in the checkpoint's order.
    pub fn tensors(&self) -> impl Iterator<Item = PtView<'_>> {
        self.index.tensors().iter().map(|t| self.view(t))
    }

    /// A tensor by its dotted name.
    pub fn tensor(&self, name: &str) -> Option<PtView<'_>> {
        self.index.tensor(name).map(|t| self.view(t))
    }

    /// A tensor's logical values as contiguous row-major bytes (gathered for a strided view,
    /// conjugated or negated where its bits say so), copied to host memory from whatever device
    /// holds them. A meta tensor has none: an error.
    pub fn tensor_bytes(&self, name: &str) -> Result<Vec<u8>> {
        let view = self.tensor(name).ok_or_else(|| Error::Unsupported {
            path: self.path.clone(),
            message: format!("the checkpoint holds no tensor `{name}`"),
        })?;
        let downloaded;
        let src = match view.bytes {
            Some(b) => b,
            None => {
                let span = self.index.file_span(view.tensor);
                let len = (span.end - span.start) as usize;
                downloaded =
                    crate::loaded::download(&self.path, self.device.as_ref(), self.memory(), view.offset, len)?;
                &downloaded
            }
        };
        let mut out = vec![0u8; view.tensor.nbytes() as usize];
        view.tensor
            .gather(src, &mut out)
            .map_err(|e| Error::Unsupported { path: self.path.clone(), message: e.to_string() })?;
        Ok(out)
    }
}

/// [`plan`](crate::plan::plan) for a torch checkpoint (`.pt` / `.bin`), indexed with `pt`.
pub(crate) fn plan_pt(
    path: &Path,
    opts: &LoadOptions,
    device: &dyn Device,
    pt: &turboio_pt::PtOptions,
) -> Result<Planned> {
    plan_parsed(
        path,
        opts,
        device,
        &mut |opened, bypass| index(path, opened, bypass, pt, "load").map(|i| Parsed::Pt(Box::new(i))),
        true,
    )
}

/// Indexes an open checkpoint (the zip directory and the pickle; no tensor byte is read);
/// `doing` words the error ("load", "convert", "read").
pub(crate) fn index(path: &Path, opened: &Opened, bypass: bool, pt: &PtOptions, doing: &str) -> Result<PtIndex> {
    PtIndex::parse(&PlainReader { file: opened, bypass }, pt).map_err(|e| Error::Unsupported {
        path: path.to_owned(),
        message: format!("cannot {doing} this torch checkpoint without executing code: {e}"),
    })
}

/// Reads only the index of a PyTorch checkpoint (decrypting when the options ask for it): its
/// storages, tensors and skipped entries, without reading any tensor byte.
pub fn read_index(path: impl AsRef<Path>, opts: &LoadOptions, pt: &PtOptions) -> Result<PtIndex> {
    let path = path.as_ref();
    index(path, &open(path, opts)?, opts.cache == crate::CachePolicy::Bypass, pt, "read")
}

/// Loads every tensor of a PyTorch checkpoint (`.pt` / `.bin`) without executing its pickle;
/// see the [module docs](self). `pt` chooses a top-level key and the parser's limits.
pub fn load_pt(path: impl AsRef<Path>, opts: &LoadOptions, pt: &PtOptions) -> Result<LoadedPt> {
    crate::load::again_if_changed(opts, || load_pt_once(path.as_ref(), opts, pt))
}

fn load_pt_once(path: &Path, opts: &LoadOptions, pt: &PtOptions) -> Result<LoadedPt> {
    if opts.dtype.is_some() {
        return Err(Error::Unsupported {
            path: path.to_owned(),
            message: "dtype conversion on load is for safetensors files; convert this checkpoint once with \
                      `turboio convert --dtype` (or load it from Python, which converts after the load)"
                .into(),
        });
    }
    let cpu = cpu_device(opts);
    let device = load_device(opts, &cpu);
    let mut planned = plan_pt(path, opts, device, pt)?;
    crate::memory::check(path, &planned.needs(opts), opts, device)?;
    let read = planned.fill(device, opts, &io_options(opts))?;
    let done = planned.done(read, opts)?;
    match done.parsed {
        Parsed::Pt(index) => Ok(LoadedPt {
            path: done.path,
            index: *index,
            memory: done.memory,
            data_base: done.data_base,
            data_start: done.data_start,
            device: done.device,
            report: done.report,
        }),
        Parsed::Safetensors(_) => {
            Err(Error::Unsupported { path: path.to_owned(), message: "not a torch checkpoint".into() })
        }
    }
}

/// Whether the plain file starts like a zip archive (a `torch.save` checkpoint) rather than a
/// safetensors header.
pub fn looks_like_pt(prefix: &[u8]) -> bool {
    prefix.starts_with(b"PK\x03\x04")
}
