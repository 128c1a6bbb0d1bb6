//! From the unpickled object graph to the index: storages with their file offsets, tensors with
//! dotted names and views, skipped leaves.

use crate::archive::{self, Archive};
use crate::pickle::{self, Elem, Id, Obj, StorageType, TensorObj, Unpickled, Val};
use crate::{PtError, ReadAt};
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use turboio_format::Dtype;

/// Size and depth limits for untrusted files. Each error that hits one names its field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest `data.pkl` read into memory (default 512 MiB).
    pub max_pickle_bytes: u64,
    /// Deepest nesting: MARKs open at once while unpickling, and containers inside containers
    /// when naming tensors (default 256).
    pub max_depth: usize,
    /// Most memo entries (default 16 Mi).
    pub max_memo: usize,
    /// Most values on the pickle stack (default 1 Mi; torch batches container items by 1000).
    pub max_stack: usize,
    /// Most objects plus container items made while unpickling, and most containers and leaves
    /// visited while naming tensors (default 16 Mi; a state dict of 100k tensors makes ~2 Mi).
    pub max_items: usize,
    /// Naming visits each container once per path to it, so a container shared by several
    /// parents (`{"model": sd, "ema": sd}`) is named under each. A pickle of shared lists can
    /// make that exponential; naming stops after this many times the objects and items the
    /// pickle made (plus 4096) (default 8).
    pub max_name_fanout: u64,
    /// Most bytes of tensor and entry names built while naming (default 64 MiB; a state dict of
    /// 100k tensors with 100-byte names builds 10 MB). Each child's name repeats its parent's,
    /// so a long key over many children (`{'A' * 10**6: [None] * 10**6}`, 105 KB pickled) would
    /// otherwise build terabytes.
    pub max_name_bytes: u64,
    /// Most bytes of memory the unpickler's objects, container items and memo hold together
    /// (default 512 MiB; about 1.2 KB per tensor: 120 MB for a state dict of 100k tensors). Objects are kept
    /// until the end, so a pickle that makes and drops millions of them would otherwise grow
    /// without bound (a 32 MB pickle of `]0` pairs made 16 Mi empty lists).
    pub max_unpickled_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_pickle_bytes: 512 << 20,
            max_depth: 256,
            max_memo: 16 << 20,
            max_stack: 1 << 20,
            max_items: 16 << 20,
            max_name_fanout: 8,
            max_name_bytes: 64 << 20,
            max_unpickled_bytes: 512 << 20,
        }
    }
}

/// How to read a checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PtOptions {
    /// Take the tensors under this key of the top-level dict (e.g. `"model"`, `"state_dict"`,
    /// `"module"`) and name them relative to it. `None`: everything, named from the top.
    pub top_level_key: Option<String>,
    /// Accept files whose `byteorder` record says `big`; the caller then converts each tensor's
    /// bytes with [`crate::to_little_endian`]. Off by default: such a file is refused.
    pub allow_big_endian: bool,
    /// Size and depth limits.
    pub limits: Limits,
}

impl PtOptions {
    /// Options that take the tensors under `key` of the top-level dict.
    pub fn with_top_level_key(key: impl Into<String>) -> Self {
        PtOptions { top_level_key: Some(key.into()), ..Default::default() }
    }
}

/// Byte order of the storages (the archive's `byteorder` record; absent means little).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByteOrder {
    /// Little-endian: the bytes are usable as they are.
    Little,
    /// Big-endian: only with [`PtOptions::allow_big_endian`]; swap with [`crate::to_little_endian`].
    Big,
}

/// One storage: a `data/<key>` record of the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PtStorage {
    /// The storage key (`data/<key>` in the archive).
    pub key: String,
    /// Element type (of the tensors viewing it; torch refuses to save one storage under two).
    pub dtype: Dtype,
    /// Elements of `dtype` the storage holds.
    pub numel: u64,
    /// Absolute byte offset of the storage's first byte in the file (0 for a meta storage).
    pub offset: u64,
    /// Bytes of the storage in the file: `numel * dtype size`, exactly its record's size (as
    /// torch checks); 0 for a meta storage, whose bytes are never read.
    pub len: u64,
    /// Where it was saved from: `cpu`, `cuda`, `cuda:N`, `mps`, `xpu`, `hpu`, `npu`,
    /// `privateuseone` (with or without `:N`), or `meta`. A load puts the bytes where it is asked
    /// to (as `torch.load`'s `map_location` does); other locations are refused, as torch refuses
    /// them.
    pub location: String,
    /// A meta storage (location `meta`, or a meta tensor saved without one): its tensors have
    /// shapes and dtypes but no data, as `torch.load` returns them on the meta device.
    pub meta: bool,
}

impl PtStorage {
    /// The storage's bytes in the file.
    pub fn file_range(&self) -> Range<u64> {
        self.offset..self.offset + self.len
    }
}

/// One tensor: a view (offset, shape, strides) of a storage.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PtTensor {
    /// Dotted name: dict keys and list/tuple indices joined by `.` (relative to the top-level
    /// key when one was chosen). A checkpoint that is a single tensor names it `""`.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape; empty for a 0-d scalar.
    pub shape: Vec<usize>,
    /// Strides in elements, one per dimension.
    pub strides: Vec<usize>,
    /// Index into [`PtIndex::storages`]. Tensors sharing a storage (tied weights, views) have
    /// the same index.
    pub storage: usize,
    /// Offset of element 0 in the storage, in elements.
    pub storage_offset: u64,
    /// `requires_grad` as saved.
    pub requires_grad: bool,
    /// Saved as an `nn.Parameter`.
    pub is_parameter: bool,
    /// The conjugate bit (`x.conj()` of a complex tensor): the logical values are the
    /// conjugates of the stored ones. [`PtTensor::gather`] gives the logical values; the
    /// storage bytes ([`PtTensor::byte_span`]) are the stored ones.
    pub conj: bool,
    /// The negative bit (`x._neg_view()`): the logical values are the negatives of the stored
    /// ones, as for [`conj`](Self::conj).
    pub neg: bool,
    /// On a meta storage: no data ([`PtStorage::meta`]).
    pub meta: bool,
    /// Bytes of the view's span in the storage (see [`PtTensor::byte_span`]).
    span: Range<u64>,
}

/// A non-tensor leaf that was skipped (an int, a string, an optimizer's hyper-parameter...).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Skipped {
    /// Dotted name of the leaf.
    pub name: String,
    /// What it is: `int`, `float`, `str`, `bytes`, `bool`, `None`, `storage`, `class or function`,
    /// or `entry with a non-string key`.
    pub kind: &'static str,
}

/// The index of a `torch.save` checkpoint: everything needed to read its tensors, nothing read
/// yet but the pickle.
#[derive(Debug, Clone)]
pub struct PtIndex {
    storages: Vec<PtStorage>,
    tensors: Vec<PtTensor>,
    skipped: Vec<Skipped>,
    archive_name: String,
    byte_order: ByteOrder,
}

impl PtTensor {
    /// Elements in the tensor (1 for a 0-d scalar, 0 when a dimension is 0).
    pub fn numel(&self) -> u64 {
        // Checked at parse time to fit; saturating only guards fields changed since.
        self.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64)).unwrap_or(u64::MAX)
    }

    /// Bytes of the tensor's contiguous (row-major) form.
    pub fn nbytes(&self) -> u64 {
        self.numel().saturating_mul(elem_size(self.dtype))
    }

    /// The bytes of its storage the view touches: from its first element to just past its last
    /// (for a contiguous tensor exactly its bytes; for a strided view it includes the gaps).
    /// Empty for a tensor with no element. Checked at parse time to lie inside the storage.
    pub fn byte_span(&self) -> Range<u64> {
        self.span.clone()
    }

    /// Whether the view is row-major contiguous (torch's `is_contiguous()`: dimensions of size 1
    /// and empty tensors do not count), so its bytes are exactly [`PtTensor::byte_span`].
    pub fn is_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut expected: usize = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 {
                if s != expected {
                    return false;
                }
                expected = expected.saturating_mul(d);
            }
        }
        true
    }

    /// Writes the tensor's logical values, contiguous and row-major, into `out` (`nbytes()`
    /// long), reading the view from `src`, which holds the storage bytes of
    /// [`PtTensor::byte_span`] (so `src[0]` is the element at `storage_offset`); the conjugate
    /// and negative bits are applied. Works for any strides, zero-size dimensions and 0-d
    /// scalars. A meta tensor has no values: an error.
    pub fn gather(&self, src: &[u8], out: &mut [u8]) -> Result<(), PtError> {
        if self.meta && self.numel() > 0 {
            return Err(PtError::Gather {
                name: self.name.clone(),
                msg: "a meta tensor has no data (torch returns it on the meta device)".into(),
            });
        }
        self.gather_stored(src, out)?;
        if !crate::bits::apply(self.dtype, self.conj, self.neg, out) {
            return Err(PtError::Gather {
                name: self.name.clone(),
                msg: format!("the conjugate or negative bit cannot apply to {}", self.dtype),
            });
        }
        Ok(())
    }

    /// [`gather`](Self::gather) without the bits: the stored values.
    fn gather_stored(&self, src: &[u8], out: &mut [u8]) -> Result<(), PtError> {
        let span_len = self.span.end.saturating_sub(self.span.start);
        if src.len() as u64 != span_len {
            return Err(PtError::Gather {
                name: self.name.clone(),
                msg: format!("source has {} bytes, the view spans {span_len}", src.len()),
            });
        }
        if out.len() as u64 != self.nbytes() {
            return Err(PtError::Gather {
                name: self.name.clone(),
                msg: format!("destination has {} bytes, the tensor has {}", out.len(), self.nbytes()),
            });
        }
        if out.is_empty() {
            return Ok(());
        }
        let es = elem_size(self.dtype) as usize;
        let Some((&last, outer)) = self.shape.split_last() else {
            out.copy_from_slice(src); // 0-d: one element
            return Ok(());
        };
        // Parsing checked that every index below fits in the span; the checked arithmetic only
        // turns fields changed since into an error instead of a panic.
        let bad = || PtError::Gather { name: self.name.clone(), msg: "view outside its span".into() };
        let (Some(&last_stride), Some(outer_strides)) = (self.strides.last(), self.strides.get(..outer.len())) else {
            return Err(bad());
        };
        let row = last.checked_mul(es).ok_or_else(bad)?;
        let mut idx = vec![0usize; outer.len()];
        for chunk in out.chunks_exact_mut(row) {
            // Element offset of this row's first element.
            let base = idx
                .iter()
                .zip(outer_strides)
                .try_fold(0usize, |acc, (i, s)| acc.checked_add(i.checked_mul(*s)?))
                .ok_or_else(bad)?;
            if last_stride == 1 {
                let at = base.checked_mul(es).ok_or_else(bad)?;
                chunk.copy_from_slice(src.get(at..at.saturating_add(row)).ok_or_else(bad)?);
            } else {
                for (j, dst) in chunk.chunks_exact_mut(es).enumerate() {
                    let at = j
                        .checked_mul(last_stride)
                        .and_then(|x| x.checked_add(base))
                        .and_then(|x| x.checked_mul(es))
                        .ok_or_else(bad)?;
                    dst.copy_from_slice(src.get(at..at.saturating_add(es)).ok_or_else(bad)?);
                }
            }
            // Next row: odometer over the outer dimensions.
            for k in (0..idx.len()).rev() {
                idx[k] += 1;
                if idx[k] < outer[k] {
                    break;
                }
                idx[k] = 0;
            }
        }
        Ok(())
    }
}

fn elem_size(d: Dtype) -> u64 {
    // Only whole-byte dtypes are ever mapped from torch.
    d.byte_size().unwrap_or(1) as u64
}

impl PtIndex {
    /// Reads the archive's directory, `byteorder` and `data.pkl` from `src`, runs the pickle in
    /// the allow-listed VM, and checks every tensor against its storage. Reads only the zip
    /// directory, the local headers and the small records, never the tensor data.
    pub fn parse<R: ReadAt + ?Sized>(src: &R, opts: &PtOptions) -> Result<PtIndex, PtError> {
        let archive = archive::open(src)?;
        let byte_order = match archive.read(src, "byteorder", 64, "max_pickle_bytes")? {
            None => ByteOrder::Little,
            Some(b) if b == b"little" => ByteOrder::Little,
            Some(b) if b == b"big" => {
                if !opts.allow_big_endian {
                    return Err(PtError::BigEndian);
                }
                ByteOrder::Big
            }
            Some(b) => {
                return Err(PtError::Archive(format!(
                    "byteorder record is {:?} (\"little\" or \"big\" expected)",
                    String::from_utf8_lossy(&b)
                )))
            }
        };
        check_version(archive.read(src, "version", 64, "max_pickle_bytes")?)?;
        let Some(pkl) = archive.read(src, "data.pkl", opts.limits.max_pickle_bytes, "max_pickle_bytes")? else {
            return Err(PtError::Archive("no data.pkl record".into()));
        };
        let graph = pickle::unpickle(&pkl, &opts.limits)?;
        drop(pkl);
        let mut b = Builder {
            g: &graph,
            archive: &archive,
            limits: &opts.limits,
            storages: Vec::new(),
            by_key: HashMap::new(),
            tensors: Vec::new(),
            skipped: Vec::new(),
            names: HashSet::new(),
            on_path: Vec::new(),
            visited: 0,
            name_bytes: 0,
            budget: graph.items.saturating_mul(opts.limits.max_name_fanout).saturating_add(4096),
        };
        let root = match &opts.top_level_key {
            None => graph.root,
            Some(key) => b.top_level(key)?,
        };
        b.walk(root, String::new(), 0)?;
        Ok(PtIndex {
            storages: b.storages,
            tensors: b.tensors,
            skipped: b.skipped,
            archive_name: archive.prefix.clone(),
            byte_order,
        })
    }

    /// Storages referenced by the tensors, in order of first use.
    pub fn storages(&self) -> &[PtStorage] {
        &self.storages
    }

    /// Tensors in pickle order (a tied weight appears once per name).
    pub fn tensors(&self) -> &[PtTensor] {
        &self.tensors
    }

    /// Keeps only the tensors `keep` accepts (a load of some of a checkpoint's tensors). The
    /// storages stay as they are, so tensor indices into them stay valid; a storage no tensor
    /// views any more is simply not read by a load that asks only for the kept tensors' bytes
    /// ([`PtIndex::used_storages`]).
    pub fn retain_tensors(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.tensors.retain(|t| keep(&t.name));
    }

    /// The storages the tensors view (by position in [`storages`](Self::storages)), in order,
    /// each once.
    pub fn used_storages(&self) -> Vec<usize> {
        let mut used: Vec<usize> = self.tensors.iter().map(|t| t.storage).collect();
        used.sort_unstable();
        used.dedup();
        used
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&PtTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The storage a tensor views.
    pub fn storage_of(&self, t: &PtTensor) -> &PtStorage {
        &self.storages[t.storage]
    }

    /// The absolute file range of a tensor's [`PtTensor::byte_span`].
    pub fn file_span(&self, t: &PtTensor) -> Range<u64> {
        let base = self.storages[t.storage].offset;
        base + t.span.start..base + t.span.end
    }

    /// Non-tensor leaves that were skipped, in pickle order.
    pub fn skipped(&self) -> &[Skipped] {
        &self.skipped
    }

    /// The archive's top-level directory (`archive`, or the name torch derived from the file).
    pub fn archive_name(&self) -> &str {
        &self.archive_name
    }

    /// The storages' byte order.
    pub fn byte_order(&self) -> ByteOrder {
        self.byte_order
    }
}

/// The file format versions torch reads (`caffe2/serialize/inline_container.h`).
const VERSIONS: std::ops::RangeInclusive<i64> = 1..=10;

/// The archive's `version` record, read as torch reads it (`std::stoll`: leading blanks, a sign,
/// digits, anything after them ignored), must be there and within [`VERSIONS`].
fn check_version(record: Option<Vec<u8>>) -> Result<(), PtError> {
    let Some(bytes) = record else {
        return Err(PtError::Archive("no version record (torch writes one and refuses a file without it)".into()));
    };
    let text = String::from_utf8_lossy(&bytes);
    let t = text.trim_start();
    let (sign, digits) = match t.as_bytes().first() {
        Some(b'-') => (-1i64, &t[1..]),
        Some(b'+') => (1, &t[1..]),
        _ => (1, t),
    };
    let n: String = digits.chars().take_while(char::is_ascii_digit).collect();
    let shown: String = text.chars().take(20).collect();
    let value = n.parse::<i64>().map(|v| sign * v).map_err(|_| {
        PtError::Archive(format!("the version record {shown:?} is not a number (torch cannot read it either)"))
    })?;
    if !VERSIONS.contains(&value) {
        return Err(PtError::Archive(format!(
            "file format version {value}: torch reads versions {} to {}",
            VERSIONS.start(),
            VERSIONS.end()
        )));
    }
    Ok(())
}

/// Whether a storage location is one torch restores, and whether it is `meta` (torch returns
/// such a storage on the meta device, without its data). torch's registry knows `cpu`, `meta`
/// and device types followed by an optional `:N`; anything else fails `torch.load` with "don't
/// know how to restore data location".
fn location_is_meta(location: &str) -> Result<bool, String> {
    const DEVICES: [&str; 6] = ["cuda", "mps", "xpu", "hpu", "npu", "privateuseone"];
    match location {
        "cpu" => return Ok(false),
        "meta" => return Ok(true),
        _ => {}
    }
    let (kind, index) = location.split_once(':').map_or((location, None), |(k, i)| (k, Some(i)));
    let index_ok = index.is_none_or(|i| !i.is_empty() && i.len() <= 9 && i.bytes().all(|b| b.is_ascii_digit()));
    if DEVICES.contains(&kind) && index_ok {
        return Ok(false);
    }
    let shown: String = location.chars().take(40).collect();
    let more = if location.chars().count() > 40 { "..." } else { "" };
    Err(format!(
        "its storage is tagged with location `{shown}{more}`, which torch does not know how to restore (cpu, meta, cuda[:N], mps, xpu, hpu, npu or privateuseone expected)"
    ))
}

struct Builder<'a> {
    g: &'a Unpickled,
    archive: &'a Archive,
    limits: &'a crate::Limits,
    storages: Vec<PtStorage>,
    by_key: HashMap<String, usize>,
    tensors: Vec<PtTensor>,
    skipped: Vec<Skipped>,
    names: HashSet<String>,
    /// Containers on the current path (cycle detection).
    on_path: Vec<Id>,
    visited: u64,
    /// Visits allowed by `max_name_fanout`.
    budget: u64,
    /// Bytes of names built so far (bounded by `max_name_bytes`).
    name_bytes: u64,
}

fn join(prefix: &str, part: &str) -> String {
    if prefix.is_empty() {
        part.to_owned()
    } else {
        format!("{prefix}.{part}")
    }
}

impl Builder<'_> {
    /// `prefix.part`, counted against `max_name_bytes`.
    fn join(&mut self, prefix: &str, part: &str) -> Result<String, PtError> {
        let len = (prefix.len() + 1 + part.len()) as u64;
        self.name_bytes = self.name_bytes.saturating_add(len);
        if self.name_bytes > self.limits.max_name_bytes {
            let shown: String = prefix.chars().take(40).collect();
            return Err(PtError::Limit {
                what: format!("bytes of names built while naming tensors (under `{shown}...`)"),
                limit: self.limits.max_name_bytes,
                field: "max_name_bytes",
            });
        }
        Ok(join(prefix, part))
    }

    fn key_name(&self, k: Val) -> Option<String> {
        match k {
            Val::Int(i) => Some(i.to_string()),
            Val::Obj(id) => match self.g.obj(id) {
                Obj::Str(s) => Some(s.clone()),
                _ => None,
            },
            _ => None,
        }
    }

    fn top_level(&self, key: &str) -> Result<Val, PtError> {
        let Val::Obj(id) = self.g.root else {
            return Err(PtError::TopLevelKey { key: key.into(), found: "a scalar at the top level".into() });
        };
        let Obj::Dict(pairs) = self.g.obj(id) else {
            return Err(PtError::TopLevelKey {
                key: key.into(),
                found: format!("a {} at the top level, not a dict", self.g.obj(id).kind()),
            });
        };
        if let Some((_, v)) = pairs.iter().find(|(k, _)| self.key_name(*k).as_deref() == Some(key)) {
            return Ok(*v);
        }
        let keys: Vec<String> =
            pairs.iter().take(20).filter_map(|(k, _)| self.key_name(*k)).map(|k| format!("`{k}`")).collect();
        let more = if pairs.len() > 20 { ", ..." } else { "" };
        Err(PtError::TopLevelKey { key: key.into(), found: format!("keys {}{more}", keys.join(", ")) })
    }

    fn skip(&mut self, name: String, kind: &'static str) {
        self.skipped.push(Skipped { name, kind });
    }

    fn walk(&mut self, v: Val, name: String, depth: usize) -> Result<(), PtError> {
        self.visited += 1;
        if self.visited > self.limits.max_items as u64 {
            return Err(PtError::Limit {
                what: "containers and leaves visited while naming tensors".into(),
                limit: self.limits.max_items as u64,
                field: "max_items",
            });
        }
        if self.visited > self.budget {
            return Err(PtError::Limit {
                what: format!(
                    "naming tensors through shared containers ({} visits for the pickle's {} objects and items)",
                    self.visited, self.g.items
                ),
                limit: self.limits.max_name_fanout,
                field: "max_name_fanout",
            });
        }
        let leaf = match v {
            Val::None => "None",
            Val::Bool(_) => "bool",
            Val::Int(_) => "int",
            Val::Float => "float",
            Val::Obj(_) => "",
        };
        let Val::Obj(id) = v else {
            self.skip(name, leaf);
            return Ok(());
        };
        let obj = self.g.obj(id);
        match obj {
            Obj::Dict(_) | Obj::List(_) | Obj::Tuple(_) => {
                if depth >= self.limits.max_depth {
                    return Err(PtError::Limit {
                        what: format!("nesting of containers (at `{name}`)"),
                        limit: self.limits.max_depth as u64,
                        field: "max_depth",
                    });
                }
                if self.on_path.contains(&id) {
                    return Err(PtError::Archive(format!("the pickle's containers form a cycle (at `{name}`)")));
                }
                self.on_path.push(id);
                match obj {
                    Obj::Dict(pairs) => {
                        for &(k, v) in pairs {
                            match self.key_name(k) {
                                Some(k) => {
                                    let child = self.join(&name, &k)?;
                                    self.walk(v, child, depth + 1)?
                                }
                                None => {
                                    let child = self.join(&name, "?")?;
                                    self.skip(child, "entry with a non-string key")
                                }
                            }
                        }
                    }
                    Obj::List(items) | Obj::Tuple(items) => {
                        for (i, &v) in items.iter().enumerate() {
                            let child = self.join(&name, &i.to_string())?;
                            self.walk(v, child, depth + 1)?;
                        }
                    }
                    _ => {}
                }
                self.on_path.pop();
                Ok(())
            }
            Obj::Tensor(t) => self.add_tensor(t, name),
            other => {
                let kind = other.kind();
                self.skip(name, kind);
                Ok(())
            }
        }
    }

    fn add_tensor(&mut self, t: &TensorObj, name: String) -> Result<(), PtError> {
        let bad = |msg: String| PtError::Tensor { name: name.clone(), msg };
        if !self.names.insert(name.clone()) {
            return Err(bad("two tensors have this name".into()));
        }
        let Obj::Storage(s) = self.g.obj(t.storage) else {
            return Err(bad("its storage is not a storage".into()));
        };
        let dtype = match t.elem {
            Elem::Known(d) => d,
            Elem::Unsupported(n) => {
                return Err(bad(format!("unsupported dtype torch.{n}: safetensors and turboio have no such dtype")))
            }
        };
        let es = elem_size(dtype);
        if let StorageType::Typed(e, n) = s.ty {
            if e != t.elem {
                return Err(bad(format!("its dtype {dtype} differs from its storage's type torch.{n}")));
            }
        }
        // The storage's bytes: typed storages count elements, untyped ones bytes.
        let storage_bytes = match s.ty {
            StorageType::Typed(..) => s.numel.checked_mul(es),
            StorageType::Untyped => Some(s.numel),
        }
        .ok_or_else(|| bad(format!("storage `{}` of {} elements overflows", s.key, s.numel)))?;
        if storage_bytes % es != 0 {
            return Err(bad(format!("storage `{}` has {storage_bytes} bytes, not a whole number of {dtype}", s.key)));
        }
        let index = match self.by_key.get(&s.key) {
            Some(&i) => {
                let st = &self.storages[i];
                if st.dtype != dtype {
                    return Err(bad(format!("storage `{}` is viewed as both {} and {dtype}", s.key, st.dtype)));
                }
                if st.numel.saturating_mul(es) != storage_bytes {
                    return Err(bad(format!(
                        "storage `{}` is described with two sizes ({} and {storage_bytes} bytes)",
                        s.key,
                        st.numel.saturating_mul(es)
                    )));
                }
                i
            }
            None if !s.record => {
                // A meta tensor saved without a storage: nothing in the archive.
                self.storages.push(PtStorage {
                    key: String::new(),
                    dtype,
                    numel: storage_bytes / es,
                    offset: 0,
                    len: 0,
                    location: s.location.clone(),
                    meta: true,
                });
                self.storages.len() - 1
            }
            None => {
                let meta = location_is_meta(&s.location).map_err(bad)?;
                let rec_name = format!("data/{}", s.key);
                let Some(rec) = self.archive.records.get(&rec_name) else {
                    return Err(bad(format!("its storage record `{rec_name}` is not in the archive")));
                };
                if rec.len != storage_bytes {
                    return Err(bad(format!(
                        "storage `{rec_name}`: record size ({} bytes) does not match expected size ({storage_bytes} bytes = {} elements of {dtype}), as torch checks",
                        rec.len, s.numel
                    )));
                }
                self.storages.push(PtStorage {
                    key: s.key.clone(),
                    dtype,
                    numel: storage_bytes / es,
                    offset: if meta { 0 } else { rec.offset },
                    len: if meta { 0 } else { storage_bytes },
                    location: s.location.clone(),
                    meta,
                });
                self.by_key.insert(s.key.clone(), self.storages.len() - 1);
                self.storages.len() - 1
            }
        };
        // Views are checked against the storage's logical size (a meta storage has no bytes in
        // the file, but torch checks its tensors' views against its size all the same).
        let meta = self.storages[index].meta;
        let storage_len = self.storages[index].numel.saturating_mul(es);
        // numel, and the span [offset, offset + sum((size-1)*stride) + 1) elements.
        let mut numel: u64 = 1;
        let mut last: u64 = 0;
        for (&d, &s) in t.shape.iter().zip(&t.strides) {
            numel = numel.checked_mul(d as u64).ok_or_else(|| bad("its element count overflows".into()))?;
            if d > 0 {
                last = (d as u64 - 1)
                    .checked_mul(s as u64)
                    .and_then(|x| x.checked_add(last))
                    .ok_or_else(|| bad("its view overflows".into()))?;
            }
        }
        numel.checked_mul(es).ok_or_else(|| bad("its byte size overflows".into()))?;
        let start = t.storage_offset_bytes(es).ok_or_else(|| bad("its storage offset overflows".into()))?;
        let span = if numel == 0 {
            start.min(storage_len)..start.min(storage_len)
        } else {
            let end = t
                .offset
                .checked_add(last)
                .and_then(|x| x.checked_add(1))
                .and_then(|x| x.checked_mul(es))
                .ok_or_else(|| bad("its view overflows".into()))?;
            if end > storage_len {
                return Err(bad(format!(
                    "storage `{}` is shorter than the tensor claims: the view (offset {}, shape {:?}, strides {:?}) needs bytes {start}..{end} but the storage has {storage_len}",
                    self.storages[index].key, t.offset, t.shape, t.strides
                )));
            }
            start..end
        };
        // usize indexing in gather: the span fits in memory terms only if it fits usize.
        if usize::try_from(span.end).is_err() {
            return Err(bad("its view is larger than this machine's address space".into()));
        }
        // A meta tensor reads nothing.
        let span = if meta { 0..0 } else { span };
        self.tensors.push(PtTensor {
            name,
            dtype,
            shape: t.shape.clone(),
            strides: t.strides.clone(),
            storage: index,
            storage_offset: t.offset,
            requires_grad: t.requires_grad,
            is_parameter: t.parameter,
            conj: t.conj,
            neg: t.neg,
            meta,
            span,
        });
        Ok(())
    }
}

impl TensorObj {
    fn storage_offset_bytes(&self, es: u64) -> Option<u64> {
        self.offset.checked_mul(es)
    }
}
