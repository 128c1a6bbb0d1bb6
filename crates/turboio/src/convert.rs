//! PyTorch checkpoints (`torch.save` `.pt` / `.bin`, one file or a sharded directory with
//! `pytorch_model.bin.index.json`) converted to safetensors without executing their pickle.
//!
//! ```no_run
//! let report = turboio::convert::convert("pytorch_model.bin", "model.safetensors", &Default::default())?;
//! println!("{} tensors, {} aliases", report.tensors, report.aliases.len());
//! # Ok::<(), turboio::Error>(())
//! ```
//!
//! # How
//!
//! The input is indexed by [`turboio_pt`] (the zip directory and the pickle, read through an
//! allow-listed interpreter that refuses anything but tensors and containers); no tensor byte
//! is read to do so. The output's header is planned from the index alone, and the safetensors
//! writers then pull each tensor's bytes from the input as they write (`pread`s of the
//! tensor's byte range, converted to [`ConvertOptions::dtype`] on the way when asked), so the
//! memory a conversion holds is the writers' chunks (threads x 8 MiB), not the checkpoint: the
//! one exception is a strided view (a transposed weight saved as a view), which is gathered
//! whole once and freed as soon as it is written. The output is written to a temporary file,
//! synced and renamed: a failure or a crash leaves any previous output as it was.
//!
//! **Tensors sharing a storage** (tied weights): tensors that are the same view of the same
//! storage (same offset, shape, strides, dtype) are stored once and the others recorded as
//! aliases in `__metadata__` (`alias -> stored name`, as veTurboIO and `safetensors.torch.save_model`
//! write them, and as every turboio load resolves them), unless [`SharedTensors::Clone`] asks
//! for a copy of each; views that overlap without being the same (a slice of another tensor)
//! are always stored as copies, because safetensors has no views.
//!
//! **Directories** (or the index JSON itself) become a safetensors model directory: one
//! `model-0000N-of-0000M.safetensors` per input shard and `model.safetensors.index.json`,
//! committed as a set exactly as [`crate::save_model_dir`] commits one (the index renamed last;
//! a crash leaves the old set loadable).
//!
//! **Validation** ([`ConvertOptions::validate`]) reads the written file back from storage and
//! compares its header (names, dtypes, shapes, aliases) and every byte of every tensor with the
//! input read again, chunk by chunk.

use crate::backend::{Opened, Place};
use crate::plan::open;
use crate::{Error, LoadOptions, Result, SaveOptions};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use turboio_format::{castable, Dtype, Header, TensorSpec};
use turboio_pt::{PtIndex, PtOptions, PtTensor};

/// What to do with tensors that are the same view of one storage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SharedTensors {
    /// Store the bytes once; the other names become aliases in `__metadata__` (the default).
    #[default]
    Alias,
    /// Store a copy under every name.
    Clone,
}

/// Options of [`convert`].
#[derive(Debug, Clone, Default)]
pub struct ConvertOptions {
    /// How the input is read (threads, decryption with `encryption`, the storage backend).
    pub load: LoadOptions,
    /// How the output is written (threads, cache policy, encryption).
    pub save: SaveOptions,
    /// Convert only the tensors under this top-level key of a nested checkpoint
    /// (`"model"`, `"state_dict"`), named relative to it.
    pub top_level_key: Option<String>,
    /// Tied weights: aliases (default) or copies.
    pub shared: SharedTensors,
    /// Convert every floating tensor to this dtype (bit-identical to torch's `.to()`).
    pub dtype: Option<Dtype>,
    /// Read the result back and compare every tensor with the input.
    pub validate: bool,
    /// Replace an existing output (file, or model directory).
    pub overwrite: bool,
}

/// What [`convert`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConvertReport {
    /// Files written (the output file, or the shards and the index).
    pub outputs: Vec<PathBuf>,
    /// Tensors stored (aliases not counted).
    pub tensors: usize,
    /// `(alias, stored name)` pairs recorded in `__metadata__`.
    pub aliases: Vec<(String, String)>,
    /// Tensors converted to [`ConvertOptions::dtype`].
    pub converted: usize,
    /// Non-tensor entries of the checkpoint that were left out (`name: kind`).
    pub skipped: Vec<String>,
    /// Bytes of tensor data written.
    pub bytes: u64,
    /// Whether the result was read back and compared.
    pub validated: bool,
    /// Wall time.
    pub elapsed: Duration,
}

/// Converts a `.pt` / `.bin` file into a safetensors file, or a directory of them (or its
/// `pytorch_model.bin.index.json`) into a safetensors model directory; see the
/// [module docs](self).
pub fn convert(input: impl AsRef<Path>, output: impl AsRef<Path>, opts: &ConvertOptions) -> Result<ConvertReport> {
    let (input, output) = (input.as_ref(), output.as_ref());
    let started = Instant::now();
    if let Some(d) = opts.dtype {
        crate::cast::check_target(input, d)?;
    }
    let is_dir_input = input.is_dir()
        || input.extension().is_some_and(|e| e == "json")
        || (crate::backend::scheme_storage(input)?.is_some()
            && !input.extension().is_some_and(|e| e == "bin" || e == "pt" || e == "pth"));
    let mut report = if is_dir_input { convert_dir(input, output, opts)? } else { convert_file(input, output, opts)? };
    report.elapsed = started.elapsed();
    Ok(report)
}

fn convert_error(path: &Path, message: impl Into<String>) -> Error {
    Error::Unsupported { path: path.to_owned(), message: message.into() }
}

/// Opens and indexes a `.pt` file.
fn index_pt(path: &Path, opts: &ConvertOptions) -> Result<(Opened, PtIndex)> {
    let opened = open(path, &opts.load)?;
    let pt_opts = PtOptions { top_level_key: opts.top_level_key.clone(), ..Default::default() };
    let index = crate::pt::index(path, &opened, false, &pt_opts, "convert")?;
    Ok((opened, index))
}

/// One output tensor of a `.pt` input.
struct Planned {
    /// Index into `PtIndex::tensors`.
    tensor: usize,
    /// Output dtype.
    dtype: Dtype,
    /// Output bytes.
    len: usize,
}

/// The output of one `.pt` file: tensors to store, aliases, metadata.
struct Plan {
    stored: Vec<Planned>,
    aliases: BTreeMap<String, String>,
    converted: usize,
}

/// What makes two tensors the same view: storage, offset, shape, strides, dtype.
/// (storage, offset, shape, strides, dtype, conjugate bit, negative bit): one logical view.
type ViewKey<'a> = (usize, u64, &'a [usize], &'a [usize], Dtype, bool, bool);

/// Strided views gathered whole, by stored-tensor index: (bytes, bytes served so far).
type Gathered = Mutex<HashMap<usize, (Arc<Vec<u8>>, u64)>>;

/// How many times the bytes it stores a view may expand to when written out (stride-0 views:
/// `x.expand(...)`), beyond [`EXPANSION_FREE`].
const MAX_EXPANSION: u64 = 16;
/// Views whose written size is at most this are converted whatever their expansion.
const EXPANSION_FREE: u64 = 64 << 20;

/// A zeroed buffer of `len` bytes, or an error (never an abort) when it cannot be had.
fn buffer(len: usize, what: &str) -> std::result::Result<Vec<u8>, String> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| format!("{what}: cannot allocate {len} bytes"))?;
    v.resize(len, 0);
    Ok(v)
}

fn plan_file(path: &Path, index: &PtIndex, opts: &ConvertOptions) -> Result<Plan> {
    let mut stored = Vec::new();
    let mut aliases = BTreeMap::new();
    let mut converted = 0;
    // The first stored tensor of each distinct view, for aliases.
    let mut views: HashMap<ViewKey<'_>, &str> = HashMap::new();
    for (i, t) in index.tensors().iter().enumerate() {
        if t.name == "__metadata__" {
            return Err(convert_error(path, "a tensor is called `__metadata__`, which safetensors reserves"));
        }
        if t.meta {
            return Err(convert_error(
                path,
                format!(
                    "tensor `{}` is a meta tensor: it has a shape and a dtype but no data to write (torch loads it on \
                     the meta device)",
                    t.name
                ),
            ));
        }
        if opts.shared == SharedTensors::Alias && t.numel() > 0 {
            let key = (t.storage, t.storage_offset, t.shape.as_slice(), t.strides.as_slice(), t.dtype, t.conj, t.neg);
            if let Some(&kept) = views.get(&key) {
                aliases.insert(t.name.clone(), kept.to_owned());
                continue;
            }
            views.insert(key, &t.name);
        }
        let nbytes = usize::try_from(t.nbytes())
            .map_err(|_| convert_error(path, format!("tensor `{}` is too large for this address space", t.name)))?;
        // An expanded view (stride 0) describes far more bytes than the file stores: a few
        // hundred bytes of `.pt` could ask for gigabytes of output. Bounded before anything is
        // written or allocated.
        let stored_bytes = index.file_span(t).end - index.file_span(t).start;
        if t.nbytes() > MAX_EXPANSION.saturating_mul(stored_bytes.max(1)) && t.nbytes() > EXPANSION_FREE {
            return Err(convert_error(
                path,
                format!(
                    "tensor `{}` is an expanded view: {} bytes from {stored_bytes} stored bytes; turboio refuses to \
                     write out more than {MAX_EXPANSION}x the stored bytes of a view above {} MiB",
                    t.name,
                    t.nbytes(),
                    EXPANSION_FREE >> 20
                ),
            ));
        }
        let (dtype, len) = match opts.dtype {
            Some(d) if d != t.dtype && castable(t.dtype) => {
                converted += 1;
                (d, turboio_format::cast_len(nbytes, t.dtype, d).unwrap_or(usize::MAX))
            }
            _ => (t.dtype, nbytes),
        };
        stored.push(Planned { tensor: i, dtype, len });
    }
    Ok(Plan { stored, aliases, converted })
}

/// Tensor bytes for the writers, read from the input as they ask (see the module docs).
struct Source<'a> {
    opened: &'a Opened,
    index: &'a PtIndex,
    plan: &'a [Planned],
    /// Strided views, gathered (and converted) whole: (bytes, bytes served so far).
    gathered: Gathered,
    /// Bytes of tensor data read from the input.
    read: AtomicU64,
    /// Read the input with `O_DIRECT` (the load options ask to bypass the page cache).
    direct: bool,
}

impl Source<'_> {
    fn tensor(&self, i: usize) -> (&PtTensor, &Planned) {
        let p = &self.plan[i];
        (&self.index.tensors()[p.tensor], p)
    }

    fn read_at(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), String> {
        self.read.fetch_add(dst.len() as u64, Ordering::Relaxed);
        if self.direct {
            // The backend's bulk read, which bypasses the page cache where it can (aligned
            // bounce buffers for unaligned heads and tails) and decrypts as usual.
            let io = turboio_storage::IoOptions { threads: 1, direct: crate::DirectIo::On, ..Default::default() };
            return self
                .opened
                .read(vec![turboio_storage::ReadRequest { offset, dst }], &io)
                .map(|_| ())
                .map_err(|e| e.to_string());
        }
        self.opened.read_exact_at(offset, dst).map_err(|e| e.to_string())
    }

    /// The whole tensor `i`, gathered and converted.
    fn whole(&self, i: usize) -> std::result::Result<Vec<u8>, String> {
        let (t, p) = self.tensor(i);
        let span = self.index.file_span(t);
        let what = format!("tensor `{}`", t.name);
        let mut src = buffer((span.end - span.start) as usize, &what)?;
        self.read_at(span.start, &mut src)?;
        let mut out = buffer(t.nbytes() as usize, &what)?;
        t.gather(&src, &mut out).map_err(|e| e.to_string())?;
        drop(src);
        if p.dtype == t.dtype {
            return Ok(out);
        }
        let mut converted = buffer(p.len, &what)?;
        turboio_format::cast(&out, t.dtype, p.dtype, &mut converted)
            .map_err(|e| format!("tensor `{}`: {e}", t.name))?;
        Ok(converted)
    }
}

impl crate::TensorData for Source<'_> {
    fn fill(&self, i: usize, offset: usize, dst: &mut [u8]) -> std::result::Result<(), String> {
        let (t, p) = self.tensor(i);
        if dst.is_empty() {
            return Ok(());
        }
        // Strided views, and views whose logical values differ from the stored ones (the
        // conjugate or negative bit), are gathered whole, bits applied.
        if !t.is_contiguous() || t.conj || t.neg {
            let bytes = {
                let mut cache = self.gathered.lock().map_err(|_| "a writer thread panicked".to_owned())?;
                match cache.get(&i) {
                    Some((b, _)) => b.clone(),
                    None => {
                        let b = Arc::new(self.whole(i)?);
                        cache.insert(i, (b.clone(), 0));
                        b
                    }
                }
            };
            let src = bytes
                .get(offset..offset + dst.len())
                .ok_or_else(|| format!("tensor `{}`: range past its end", t.name))?;
            dst.copy_from_slice(src);
            let mut cache = self.gathered.lock().map_err(|_| "a writer thread panicked".to_owned())?;
            if let Some(entry) = cache.get_mut(&i) {
                entry.1 += dst.len() as u64;
                if entry.1 >= p.len as u64 {
                    cache.remove(&i); // every byte written: free it
                }
            }
            return Ok(());
        }
        let start = self.index.file_span(t).start;
        if p.dtype == t.dtype {
            return self.read_at(start + offset as u64, dst);
        }
        // Converting: the source elements covering dst's bytes (dst may start or end inside an
        // element, since the writers cut the file in fixed chunks).
        let (fs, ts) = (t.dtype.byte_size().unwrap_or(1), p.dtype.byte_size().unwrap_or(1));
        let (first, last) = (offset / ts, (offset + dst.len()).div_ceil(ts));
        let mut src = vec![0u8; (last - first) * fs];
        self.read_at(start + (first * fs) as u64, &mut src)?;
        let skip = offset - first * ts;
        let convert = |out: &mut [u8]| {
            turboio_format::cast(&src, t.dtype, p.dtype, out).map_err(|e| format!("tensor `{}`: {e}", t.name))
        };
        if skip == 0 && dst.len() == (last - first) * ts {
            convert(dst)
        } else {
            let mut out = vec![0u8; (last - first) * ts];
            convert(&mut out)?;
            dst.copy_from_slice(&out[skip..skip + dst.len()]);
            Ok(())
        }
    }
}

/// Writes one `.pt` file as a safetensors file at `output` (atomically); returns the stored
/// tensors `(name, bytes)` and fills the counts of `report`.
fn write_one(
    input: &Path,
    output: &Path,
    opts: &ConvertOptions,
    report: &mut ConvertReport,
) -> Result<Vec<(String, u64)>> {
    let (opened, index) = index_pt(input, opts)?;
    let plan = plan_file(input, &index, opts)?;
    let specs: Vec<TensorSpec<'_>> = plan
        .stored
        .iter()
        .map(|p| {
            let t = &index.tensors()[p.tensor];
            TensorSpec { name: &t.name, dtype: p.dtype, shape: &t.shape, data_len: p.len }
        })
        .collect();
    let metadata = (!plan.aliases.is_empty()).then_some(&plan.aliases);
    let source = Source {
        opened: &opened,
        index: &index,
        plan: &plan.stored,
        gathered: Mutex::new(HashMap::new()),
        read: AtomicU64::new(0),
        direct: opts.load.cache == crate::CachePolicy::Bypass,
    };
    crate::save_with(output, &specs, metadata, &source, &opts.save)?;
    if opts.validate {
        validate(output, &source, &specs, &plan.aliases, opts)?;
        report.validated = true;
    }
    report.tensors += specs.len();
    report.converted += plan.converted;
    report.bytes += specs.iter().map(|s| s.data_len as u64).sum::<u64>();
    report.aliases.extend(plan.aliases.iter().map(|(a, b)| (a.clone(), b.clone())));
    report.skipped.extend(index.skipped().iter().map(|s| format!("{}: {}", s.name, s.kind)));
    report.outputs.push(output.to_owned());
    Ok(specs.iter().map(|s| (s.name.to_owned(), s.data_len as u64)).collect())
}

/// Reads `output` back and compares it with the input, chunk by chunk.
fn validate(
    output: &Path,
    source: &Source<'_>,
    specs: &[TensorSpec<'_>],
    aliases: &BTreeMap<String, String>,
    opts: &ConvertOptions,
) -> Result<()> {
    let fail = |msg: String| convert_error(output, format!("--validate-result: {msg}"));
    let read_opts =
        LoadOptions { threads: opts.load.threads, storage: opts.save.storage.clone(), ..Default::default() };
    #[cfg(feature = "cipher")]
    let read_opts = LoadOptions { encryption: opts.save.encryption.clone(), ..read_opts };
    let written = open(output, &read_opts)?;
    let header: Header = crate::plan::read_header(&written, false)?;
    if header.len() != specs.len() {
        return Err(fail(format!("{} tensors written, {} expected", header.len(), specs.len())));
    }
    let got_aliases: BTreeMap<String, String> =
        header.aliases().into_iter().map(|(a, b)| (a.to_owned(), b.to_owned())).collect();
    if &got_aliases != aliases {
        return Err(fail("the aliases in `__metadata__` differ from the input's shared tensors".into()));
    }
    const CHUNK: usize = 8 << 20;
    let mut want = Vec::new();
    let mut got = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let info = header.tensor(spec.name).map_err(|e| fail(e.to_string()))?;
        if info.dtype != spec.dtype || info.shape != spec.shape || info.len() != spec.data_len {
            return Err(fail(format!("tensor `{}` has another dtype or shape than the input's", spec.name)));
        }
        let base = header.data_start() + info.data_offsets.0 as u64;
        let mut at = 0usize;
        while at < spec.data_len {
            let n = CHUNK.min(spec.data_len - at);
            want.resize(n, 0);
            got.resize(n, 0);
            crate::TensorData::fill(source, i, at, &mut want)
                .map_err(|e| fail(format!("re-reading the input: {e}")))?;
            written.read_exact_at(base + at as u64, &mut got)?;
            if want != got {
                return Err(fail(format!("tensor `{}` differs from the input", spec.name)));
            }
            at += n;
        }
    }
    Ok(())
}

fn convert_file(input: &Path, output: &Path, opts: &ConvertOptions) -> Result<ConvertReport> {
    if output.is_dir() {
        return Err(convert_error(output, "is a directory; a .pt file converts to a .safetensors file"));
    }
    if Place::of(opts.save.storage.as_ref(), output)?.exists(output)? && !opts.overwrite {
        return Err(convert_error(output, "exists; pass --overwrite (ConvertOptions::overwrite) to replace it"));
    }
    let mut report = ConvertReport::default();
    write_one(input, output, opts, &mut report)?;
    Ok(report)
}

/// The `.pt` shards of a directory or an index JSON: the index's `weight_map` values in order
/// of first appearance, or every `*.bin` / `*.pt` file in name order.
fn pt_shards(input: &Path, place: &Place) -> Result<Vec<PathBuf>> {
    let index = if input.extension().is_some_and(|e| e == "json") {
        Some(input.to_owned())
    } else {
        let mut found = None;
        for n in ["pytorch_model.bin.index.json", "model.bin.index.json"] {
            if place.exists(&input.join(n))? {
                found = Some(input.join(n));
                break;
            }
        }
        found
    };
    if let Some(index) = index {
        let dir = index.parent().unwrap_or(Path::new("."));
        let text =
            place.read(&index)?.ok_or_else(|| convert_error(&index, "cannot read the index: it does not exist"))?;
        let json: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| convert_error(&index, format!("the index is not JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| convert_error(&index, "the index has no \"weight_map\" object"))?;
        let mut shards: Vec<PathBuf> = Vec::new();
        for (tensor, file) in map {
            let name = file
                .as_str()
                .filter(|f| !f.is_empty() && !f.contains('/') && !f.contains('\\') && *f != "." && *f != "..")
                .ok_or_else(|| {
                    convert_error(&index, format!("tensor `{tensor}`: the shard name is not a plain file name"))
                })?;
            let p = dir.join(name);
            if !shards.contains(&p) {
                if !place.exists(&p)? {
                    return Err(convert_error(&index, format!("names shard {name}, which does not exist")));
                }
                shards.push(p);
            }
        }
        return Ok(shards);
    }
    let local = matches!(place, Place::Local);
    let mut shards: Vec<PathBuf> = place
        .list(input)?
        .into_iter()
        .filter(|p| (!local || p.is_file()) && p.extension().is_some_and(|x| x == "bin" || x == "pt" || x == "pth"))
        .collect();
    shards.sort();
    if shards.is_empty() {
        return Err(convert_error(input, "holds no .bin, .pt or .pth file and no pytorch_model.bin.index.json"));
    }
    Ok(shards)
}

fn convert_dir(input: &Path, output: &Path, opts: &ConvertOptions) -> Result<ConvertReport> {
    let shards = pt_shards(input, &Place::of(opts.load.storage.as_ref(), input)?)?;
    if output.is_file() {
        return Err(convert_error(output, "is a file; a directory of shards converts to a model directory"));
    }
    let occupied = match Place::of(opts.save.storage.as_ref(), output)? {
        Place::Local => output.read_dir().map(|mut d| d.next().is_some()).unwrap_or(false),
        remote => !remote.list(output)?.is_empty(),
    };
    if occupied && !opts.overwrite {
        return Err(convert_error(
            output,
            "is not empty; pass --overwrite (ConvertOptions::overwrite) to replace the model in it",
        ));
    }
    let mut report = ConvertReport::default();
    let mut seen: HashMap<String, PathBuf> = HashMap::new();
    let saved = crate::model::save_shard_set(output, shards.len(), None, &opts.save, &mut |i, path| {
        let stored = write_one(&shards[i], path, opts, &mut report)?;
        for (name, _) in &stored {
            if let Some(other) = seen.insert(name.clone(), shards[i].clone()) {
                return Err(convert_error(
                    &shards[i],
                    format!(
                        "tensor `{name}` is also in {}; a model's shards must not share names",
                        turboio_storage::shown(&other)
                    ),
                ));
            }
        }
        Ok(stored)
    })?;
    report.outputs = saved.shards;
    report.outputs.push(saved.index);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_lists_refuse_paths_outside_the_directory() {
        let d = tempfile::tempdir().unwrap();
        let index = d.path().join("pytorch_model.bin.index.json");
        std::fs::write(&index, r#"{"weight_map": {"a": "../escape.bin"}}"#).unwrap();
        let e = pt_shards(d.path(), &Place::Local).unwrap_err().to_string();
        assert!(e.contains("plain file name") && e.contains("pytorch_model.bin.index.json"), "{e}");
        std::fs::write(&index, r#"{"weight_map": {"a": "missing.bin"}}"#).unwrap();
        let e = pt_shards(d.path(), &Place::Local).unwrap_err().to_string();
        assert!(e.contains("missing.bin") && e.contains("does not exist"), "{e}");
        std::fs::remove_file(&index).unwrap();
        let e = pt_shards(d.path(), &Place::Local).unwrap_err().to_string();
        assert!(e.contains("no .bin"), "{e}");
    }
}
