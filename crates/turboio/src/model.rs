//! Whole models: a directory of safetensors shards with `model.safetensors.index.json`, loaded
//! as one job, and saved as a set that a crash can never leave half-replaced.
//!
//! # Loading
//!
//! [`load_model`] takes a safetensors file, a directory, or an index JSON:
//!
//! - **an index** (`model.safetensors.index.json`, Hugging Face's format: `{"metadata":
//!   {"total_size": N}, "weight_map": {tensor: shard}}`; a directory holding one uses it): the
//!   shards it names, and only those, are loaded. It is validated against the shards' headers
//!   before any tensor byte is read: a shard it names that is missing, a tensor it names that
//!   its shard does not hold, a tensor a shard holds that it does not name, a tensor held by
//!   two shards, a shard name that leaves the directory (`/`, `..`), or a malformed index is an
//!   error naming the index (or the shard) and what is wrong;
//! - **a directory without an index**: every `*.safetensors` file in it (sorted by name), a
//!   tensor name held by two files being an error;
//! - **a file**: that file (as [`crate::load`]).
//!
//! Then every shard is opened, its header validated and its memory allocated (the plan of
//! [`crate::load`], for each file), and only then are the bytes read, **all shards in one
//! pipeline**: the files are filled concurrently by workers sharing the cores (largest first,
//! so no shard waits for the previous one and small shards do not serialise the load), and cold
//! mapped shards are all asked for from the disk up front. Nothing partial is ever returned.
//!
//! # Saving
//!
//! [`save_model_dir`] writes tensors as shards of at most `max_shard_size` bytes (a larger
//! tensor gets a shard of its own), named as `transformers`' `save_pretrained` names them,
//! `model-0000N-of-0000M.safetensors`, plus the index. Shard names of a new save collide with
//! the old set's, so replacing shards one by one would let a reader (or a crash) see a mix.
//! Instead, in order:
//!
//! 1. the new shards are written under names the current index does not use (the plain names
//!    when they are free, else `model-0000N-of-0000M-<tag>.safetensors` with a fresh random
//!    tag), each through the one atomic writer (temporary file, fsync, rename, directory fsync);
//!    a reader following the index still sees only the old set;
//! 2. the index is written through the same writer: its rename is the commit point. Before it,
//!    the directory loads as the old model; after it, as the new one;
//! 3. the old set's shards (and shards of earlier saves that were killed before their commit:
//!    files named like this module's shards that the new index does not name) are removed.
//!
//! A crash (or `SIGKILL`) at any point leaves a directory that loads as exactly the old or the
//! new model; what a crash leaves behind at worst is unreferenced shards, which the next save
//! removes. The index is always written, even for a single shard, so that this holds for
//! every save.

use crate::backend::{Place, Unconfirmed};
use crate::plan::{cpu_device, load_device, plan_shard, Planned};
use crate::{Error, LoadOptions, LoadReport, LoadedFile, Result, SaveOptions, SaveTensor, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use turboio_storage::{IoOptions, Storage};

/// The index file's name in a model directory.
pub const INDEX_NAME: &str = "model.safetensors.index.json";

fn model_error(path: &Path, message: impl Into<String>) -> Error {
    Error::Unsupported { path: path.to_owned(), message: message.into() }
}

/// The files of a model and, when an index gives it, which tensor each shard must hold.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// The index JSON, when the model has one.
    pub index: Option<PathBuf>,
    /// The shard files, in the order they are listed (index order of first appearance, or by
    /// name).
    pub shards: Vec<PathBuf>,
    /// From the index: tensor name -> position in `shards`.
    pub weight_map: Option<BTreeMap<String, usize>>,
    /// From the index: `metadata` (its values as JSON text when they are not strings).
    pub metadata: BTreeMap<String, String>,
}

impl ModelFiles {
    /// Finds the files of the model at `path` (a file, a directory, or an index JSON) and
    /// parses the index, without reading any shard. URLs of a remote backend (`s3://bucket/model`)
    /// work too: a "directory" is a key prefix.
    pub fn resolve(path: impl AsRef<Path>) -> Result<ModelFiles> {
        Self::resolve_in(path, None)
    }

    /// [`resolve`](Self::resolve) through `storage` (the one a load or save is given, else the
    /// one of the path's scheme, else the local file system).
    pub fn resolve_in(path: impl AsRef<Path>, storage: Option<&Arc<dyn Storage>>) -> Result<ModelFiles> {
        let (files, local, _) = Self::resolve_unchecked(path.as_ref(), storage, false)?;
        if local {
            files.check_shards_exist()?;
        }
        Ok(files)
    }

    /// [`resolve_in`](Self::resolve_in) without looking up the local shards an index names
    /// (a load of some tensors opens only the shards holding them); true if the files are
    /// local. `unconfirmed`: a remote index may be read before its version is confirmed
    /// ([`Storage::open_unconfirmed`]); the file returned must then be confirmed before the
    /// model is handed out.
    pub(crate) fn resolve_unchecked(
        path: &Path,
        storage: Option<&Arc<dyn Storage>>,
        unconfirmed: bool,
    ) -> Result<(ModelFiles, bool, Unconfirmed)> {
        let place = Place::of(storage, path)?;
        let local = matches!(place, Place::Local);
        Self::resolve_place(path, place, unconfirmed).map(|(f, held)| (f, local, held))
    }

    fn resolve_place(path: &Path, place: Place, unconfirmed: bool) -> Result<(ModelFiles, Unconfirmed)> {
        let Place::Remote(remote) = &place else { return Self::resolve_local(path).map(|f| (f, None)) };
        if path.to_string_lossy().ends_with(".json") {
            return Self::from_index_held(path, &place, unconfirmed);
        }
        if names_a_checkpoint_file(path) {
            return Ok((ModelFiles::single(path), None));
        }
        let index = path.join(INDEX_NAME);
        if let Some((text, held)) = place.read_held(&index, unconfirmed)? {
            return Self::from_index_text(&index, &text).map(|f| (f, held));
        }
        let shards: Vec<PathBuf> = remote
            .list(path)
            .map_err(|e| model_error(path, format!("cannot list the model's objects: {e}")))?
            .into_iter()
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        if shards.is_empty() {
            return Err(model_error(path, format!("no {INDEX_NAME} and no *.safetensors object under this prefix")));
        }
        Ok((ModelFiles { index: None, shards, weight_map: None, metadata: BTreeMap::new() }, None))
    }

    fn single(path: &Path) -> ModelFiles {
        ModelFiles { index: None, shards: vec![path.to_owned()], weight_map: None, metadata: BTreeMap::new() }
    }

    fn resolve_local(path: &Path) -> Result<ModelFiles> {
        let meta =
            std::fs::metadata(path).map_err(|e| model_error(path, format!("cannot read the model path: {e}")))?;
        if meta.is_dir() {
            let index = path.join(INDEX_NAME);
            if index.is_file() {
                return Self::from_index(&index, &Place::Local);
            }
            let mut shards: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| model_error(path, format!("cannot list the directory: {e}")))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors") && p.is_file())
                .collect();
            shards.sort();
            if shards.is_empty() {
                return Err(model_error(path, format!("no {INDEX_NAME} and no *.safetensors file in this directory")));
            }
            return Ok(ModelFiles { index: None, shards, weight_map: None, metadata: BTreeMap::new() });
        }
        if path.to_string_lossy().ends_with(".json") {
            return Self::from_index(path, &Place::Local);
        }
        Ok(ModelFiles::single(path))
    }

    fn from_index(index: &Path, place: &Place) -> Result<ModelFiles> {
        Self::from_index_held(index, place, false).map(|(files, _)| files)
    }

    /// [`from_index`](Self::from_index); `unconfirmed`: see [`Place::read_held`].
    fn from_index_held(index: &Path, place: &Place, unconfirmed: bool) -> Result<(ModelFiles, Unconfirmed)> {
        let (text, held) = place
            .read_held(index, unconfirmed)?
            .ok_or_else(|| model_error(index, "cannot read the index: it does not exist"))?;
        Self::from_index_text(index, &text).map(|files| (files, held))
    }

    /// The model an index's JSON (already read from `index`) describes.
    fn from_index_text(index: &Path, text: &[u8]) -> Result<ModelFiles> {
        let json: serde_json::Value = serde_json::from_slice(text)
            .map_err(|e| model_error(index, format!("the index is not valid JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| model_error(index, "the index has no \"weight_map\" object"))?;
        let mut metadata = BTreeMap::new();
        match json.get("metadata") {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::Object(m)) => {
                for (k, v) in m {
                    let v = v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string());
                    metadata.insert(k.clone(), v);
                }
            }
            Some(_) => return Err(model_error(index, "the index's \"metadata\" is not an object")),
        }
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut shards: Vec<PathBuf> = Vec::new();
        let mut position: HashMap<&str, usize> = HashMap::new();
        let mut weight_map = BTreeMap::new();
        for (tensor, shard) in map {
            let shard = shard
                .as_str()
                .ok_or_else(|| model_error(index, format!("weight_map[{tensor:?}] is not a file name")))?;
            if shard.is_empty() || shard.contains('/') || shard.contains('\\') || shard == "." || shard == ".." {
                return Err(model_error(
                    index,
                    format!("weight_map[{tensor:?}] = {shard:?} is not a file name in the index's directory"),
                ));
            }
            let i = *position.entry(shard).or_insert_with(|| {
                shards.push(dir.join(shard));
                shards.len() - 1
            });
            weight_map.insert(tensor.clone(), i);
        }
        if shards.is_empty() {
            return Err(model_error(index, "the index's weight_map is empty"));
        }
        Ok(ModelFiles { index: Some(index.to_owned()), shards, weight_map: Some(weight_map), metadata })
    }

    /// Every shard the index names exists (local files only: a remote shard that is missing
    /// fails naming it when opened).
    fn check_shards_exist(&self) -> Result<()> {
        let Some(index) = &self.index else { return Ok(()) };
        match self.shards.iter().find(|s| !s.is_file()) {
            Some(s) => Err(model_error(
                index,
                format!(
                    "shard {} named by the index does not exist",
                    s.file_name().unwrap_or_default().to_string_lossy()
                ),
            )),
            None => Ok(()),
        }
    }

    /// Where errors about the model as a whole point: the index, else the first shard.
    /// These files with only the shards `keep` says (the index's names of the others dropped).
    fn keep_shards(self, keep: &[bool]) -> ModelFiles {
        let mut position = Vec::with_capacity(self.shards.len());
        let mut shards = Vec::new();
        for (i, s) in self.shards.into_iter().enumerate() {
            position.push(keep.get(i).copied().unwrap_or(true).then_some(shards.len()));
            if position[i].is_some() {
                shards.push(s);
            }
        }
        let weight_map = self
            .weight_map
            .map(|m| m.into_iter().filter_map(|(n, i)| position.get(i).copied().flatten().map(|j| (n, j))).collect());
        ModelFiles { index: self.index, shards, weight_map, metadata: self.metadata }
    }

    fn origin(&self) -> &Path {
        self.index.as_deref().unwrap_or(&self.shards[0])
    }

    /// Checks the shards' tensor lists (one per shard, in `shards` order) against the index and
    /// against each other; returns tensor name -> shard. `aliases` (one list per shard, the
    /// aliases of its `__metadata__`) are names too: an alias naming a tensor another shard
    /// holds, or a name aliased in two shards, is an error (a load would hand out the alias in
    /// the tensor's place).
    fn check<'a>(&self, names: &[Vec<&'a str>], aliases: &[Vec<&'a str>]) -> Result<HashMap<&'a str, usize>> {
        let mut owner: HashMap<&'a str, usize> = HashMap::new();
        for (i, list) in names.iter().enumerate() {
            for &name in list {
                if let Some(j) = owner.insert(name, i) {
                    return Err(model_error(
                        self.origin(),
                        format!(
                            "tensor `{name}` is held by two shards: {} and {}",
                            file_name(&self.shards[j]),
                            file_name(&self.shards[i])
                        ),
                    ));
                }
            }
        }
        let mut aliased: HashMap<&str, usize> = HashMap::new();
        for (i, list) in aliases.iter().enumerate() {
            for &alias in list {
                if let Some(&j) = owner.get(alias) {
                    return Err(model_error(
                        self.origin(),
                        format!(
                            "`{alias}` is an alias in {}'s metadata, but {} holds a tensor of that name",
                            file_name(&self.shards[i]),
                            file_name(&self.shards[j])
                        ),
                    ));
                }
                if let Some(j) = aliased.insert(alias, i) {
                    return Err(model_error(
                        self.origin(),
                        format!(
                            "`{alias}` is an alias in two shards: {} and {}",
                            file_name(&self.shards[j]),
                            file_name(&self.shards[i])
                        ),
                    ));
                }
            }
        }
        if let (Some(index), Some(map)) = (&self.index, &self.weight_map) {
            for (name, &i) in map {
                match owner.get(name.as_str()) {
                    Some(&j) if j == i => {}
                    Some(&j) => {
                        return Err(model_error(
                            index,
                            format!(
                                "the index puts tensor `{name}` in {}, but {} holds it",
                                file_name(&self.shards[i]),
                                file_name(&self.shards[j])
                            ),
                        ))
                    }
                    None => {
                        return Err(model_error(
                            index,
                            format!(
                                "tensor `{name}` is named by the index but {} does not hold it",
                                file_name(&self.shards[i])
                            ),
                        ))
                    }
                }
            }
            if let Some((name, &i)) = owner.iter().find(|(n, _)| !map.contains_key(**n)) {
                return Err(model_error(
                    index,
                    format!("{} holds tensor `{name}`, which the index does not name", file_name(&self.shards[i])),
                ));
            }
        }
        Ok(owner)
    }
}

/// True for a path whose extension names one checkpoint file (`.safetensors`, `.pt`, `.pth`,
/// `.bin`): an object-store URL without one is a model prefix.
pub fn names_a_checkpoint_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| ["safetensors", "pt", "pth", "bin"].iter().any(|x| e == *x))
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| turboio_storage::shown(p).to_string())
}

/// What a model load did: one line for the whole model, the shards' own reports beside it.
#[derive(Debug)]
pub struct ModelReport {
    /// Shards loaded.
    pub files: usize,
    /// Bytes brought into memory, all shards together.
    pub bytes: u64,
    /// Wall time of the whole load (opening and validating every shard included).
    pub elapsed: Duration,
    /// Concurrent shard fills (workers) and threads per fill.
    pub workers: usize,
    /// Threads each worker's fill used.
    pub threads_per_fill: usize,
}

impl ModelReport {
    /// Throughput in GB/s (10^9 bytes per second) over the bytes brought in.
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

/// A loaded model: every shard's [`LoadedFile`] and which one holds each tensor.
#[derive(Debug)]
pub struct LoadedModel {
    files: ModelFiles,
    shards: Vec<LoadedFile>,
    owner: HashMap<String, usize>,
    report: ModelReport,
}

impl LoadedModel {
    /// The files the model was loaded from.
    pub fn files(&self) -> &ModelFiles {
        &self.files
    }

    /// The loaded shards, in [`ModelFiles::shards`] order.
    pub fn shards(&self) -> &[LoadedFile] {
        &self.shards
    }

    /// The loaded shards, taken out (e.g. to hand each to a consumer that owns it).
    pub fn into_shards(self) -> Vec<LoadedFile> {
        self.shards
    }

    /// What the load did, for the whole model.
    pub fn report(&self) -> &ModelReport {
        &self.report
    }

    /// Every shard's own report.
    pub fn shard_reports(&self) -> impl Iterator<Item = &LoadReport> {
        self.shards.iter().map(|s| s.report())
    }

    /// Number of tensors, all shards together.
    pub fn len(&self) -> usize {
        self.owner.len()
    }

    /// True if the model has no tensor.
    pub fn is_empty(&self) -> bool {
        self.owner.is_empty()
    }

    /// A tensor by name, from whichever shard holds it.
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.shards[*self.owner.get(name)?].tensor(name)
    }

    /// The shard holding a tensor.
    pub fn shard_of(&self, name: &str) -> Option<&LoadedFile> {
        self.owner.get(name).map(|&i| &self.shards[i])
    }

    /// Every tensor, shard after shard, each in file order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> {
        self.shards.iter().flat_map(|s| s.tensors())
    }

    /// Total bytes of the tensors' data.
    pub fn data_bytes(&self) -> u64 {
        self.tensors().map(|t| t.len() as u64).sum()
    }
}

/// Loads a whole model (a file, a directory of shards, or an index JSON) as one job; see the
/// [module docs](self).
pub fn load_model(path: impl AsRef<Path>, opts: &LoadOptions) -> Result<LoadedModel> {
    let started = Instant::now();
    crate::load::again_if_changed(opts, || load_model_once(path.as_ref(), opts, started))
}

fn load_model_once(path: &Path, opts: &LoadOptions, started: Instant) -> Result<LoadedModel> {
    // A remote index may come from a node cache's copy while the store is asked whether it is
    // current (as each shard may). It is confirmed before the model is handed out, and also
    // when the load failed: a stale index names shards that may be gone, and the answer is
    // then to load again with the new index, not the error.
    let (files, local, index_file) = ModelFiles::resolve_unchecked(path, opts.storage.as_ref(), true)?;
    let loaded = load_files(files, local, opts, started);
    if let Some(f) = &index_file {
        f.confirm().map_err(|e| Error::storage(f.path(), e))?;
    }
    loaded
}

/// Loads the model `files` (resolved, not yet checked if `local`).
fn load_files(files: ModelFiles, local: bool, opts: &LoadOptions, started: Instant) -> Result<LoadedModel> {
    // A device that converts in its own memory: the plain load onto it (the staging engine,
    // shard after shard), then its kernel on each shard; where the kernel cannot run, the
    // shards are converted on the host instead, and the reports say why.
    let Some((target, device)) = opts.dtype.zip(crate::to_device::off_host(opts).filter(|d| d.casts())) else {
        return load_files_once(files, local, opts, started);
    };
    crate::cast::check_target(files.origin(), target)?;
    let LoadedModel { files: loaded_files, shards: plain, owner, mut report } =
        load_files_once(files.clone(), local, &LoadOptions { dtype: None, ..opts.clone() }, started)?;
    let mut shards = Vec::with_capacity(plain.len());
    let mut failed = None;
    for s in plain {
        match crate::cast::convert_on_device(s, target, device) {
            Ok(c) => shards.push(c),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    if let Some(e) = failed {
        // Every shard's device memory is freed by now (the host load below places on it too).
        drop(shards);
        let why = crate::cast::ran_on_the_host(&e);
        let mut m = load_files_once(files, local, opts, started)?;
        for s in &mut m.shards {
            s.report.fallbacks.push(why.clone());
        }
        return Ok(m);
    }
    report.elapsed = started.elapsed();
    Ok(LoadedModel { files: loaded_files, shards, owner, report })
}

/// [`load_files`] in one pass: converting loads convert each shard on the host.
fn load_files_once(mut files: ModelFiles, local: bool, opts: &LoadOptions, started: Instant) -> Result<LoadedModel> {
    // A selection with an index: the names are known before any shard is opened, and shards
    // holding none of the selected tensors are not opened at all (nor need they exist).
    if let (Some(selection), Some(map)) = (&opts.tensors, &files.weight_map) {
        selection.check(map.keys().map(String::as_str), files.origin())?;
        let keep: Vec<bool> =
            (0..files.shards.len()).map(|i| map.iter().any(|(n, &j)| j == i && selection.matches(n))).collect();
        files = files.keep_shards(&keep);
    }
    if local {
        files.check_shards_exist()?;
    }
    let cpu = cpu_device(opts);
    // Converting loads read each shard into host memory and convert it there (see `cast`).
    let host;
    let (opts, device, target) = match opts.dtype {
        Some(t) => {
            crate::cast::check_target(files.origin(), t)?;
            host = LoadOptions { device: None, dtype: None, ..opts.clone() };
            (&host, &cpu as &dyn turboio_device::Device, Some((t, opts)))
        }
        None => (opts, load_device(opts, &cpu), None),
    };

    // Open, validate and allocate every shard before reading any tensor byte; several at once
    // (opening a remote shard is a request: a model of many shards would otherwise pay one
    // round trip per shard in turn).
    let mut planned = plan_all(&files.shards, opts, device)?;
    let names: Vec<Vec<&str>> = planned
        .iter()
        .map(|p| p.header().map(|h| h.tensors().iter().map(|t| t.name.as_str()).collect()).unwrap_or_default())
        .collect();
    let aliases: Vec<Vec<&str>> = planned
        .iter()
        .map(|p| p.header().map(|h| h.aliases().into_iter().map(|(a, _)| a).collect()).unwrap_or_default())
        .collect();
    files.check(&names, &aliases)?;
    drop((names, aliases));
    if let Some(selection) = &opts.tensors {
        // Without an index, the names are checked against every shard's (aliases included),
        // and shards holding nothing selected are dropped before any byte is read.
        if files.weight_map.is_none() {
            let headers: Vec<&turboio_format::Header> = planned.iter().filter_map(Planned::header).collect();
            selection.check_headers(&headers, files.origin())?;
        }
        let keep: Vec<bool> = planned.iter().map(|p| p.selected_tensors() != Some(0)).collect();
        files = files.keep_shards(&keep);
        let mut keep = keep.into_iter();
        planned.retain(|_| keep.next().unwrap_or(true));
    }

    // The memory plan of the whole model, before any shard's memory is allocated.
    let mut needs = crate::memory::Needs::default();
    for p in &planned {
        needs += p.needs(opts);
    }
    if let Some((t, _)) = target {
        // Each shard is also converted into a new arena.
        for h in planned.iter().filter_map(Planned::header) {
            needs.host = needs.host.saturating_add(crate::cast::converted_bytes(h, t, opts.tensors.as_ref()));
        }
    }
    crate::memory::check(files.origin(), &needs, opts, device)?;
    for p in &mut planned {
        p.allocate(device, opts)?;
    }

    // Fill every shard in one pipeline: `workers` fills at a time, largest first, sharing the
    // cores; cold mapped shards are all asked for from the disk first.
    // A remote backend keeps many requests in flight per file: fill that many shards at once, so
    // small shards do not leave it idle (it bounds its requests itself).
    let threads = turboio_storage::threads_or_default(opts.threads);
    let streams = planned.iter().map(Planned::requests_in_flight).max().unwrap_or(1);
    // Staged shards of local files fill together: one pipeline, every shard's chunks in one
    // queue, so the readers share one set of pinned slots and stay busy to the model's last
    // chunk (shards filled side by side would leave one reader alone on the largest one's tail,
    // shards one after another would meet at the end of each).
    let together = streams == 1 && planned.len() > 1 && planned.iter().all(Planned::is_staged);
    let workers = planned.len().clamp(1, threads.max(streams));
    let per_fill = (threads / workers).max(1);
    for p in &planned {
        p.read_ahead();
    }
    let mut order: Vec<usize> = (0..planned.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(planned[i].bytes()));
    let io = IoOptions {
        threads: if together { threads } else { per_fill },
        progress: opts.progress.as_deref(),
        cancel: opts.cancel.as_deref(),
        ..Default::default()
    };
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    // Each shard with the result of its fill (None: not filled, because another one failed).
    type Slot = std::sync::Mutex<(Planned, Option<Result<crate::ReadInfo>>)>;
    let slots: Vec<Slot> = if together {
        let reads = Planned::fill_together(&mut planned, device, opts, &io)?;
        planned.into_iter().zip(reads).map(|(p, r)| std::sync::Mutex::new((p, Some(Ok(r))))).collect()
    } else {
        let slots: Vec<Slot> = planned.into_iter().map(|p| std::sync::Mutex::new((p, None))).collect();
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    while let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                        if failed.load(Ordering::Relaxed) {
                            break;
                        }
                        let mut slot = slots[i].lock().unwrap_or_else(|e| e.into_inner());
                        let r = slot.0.fill(device, opts, &io);
                        failed.fetch_or(r.is_err(), Ordering::Relaxed);
                        slot.1 = Some(r);
                    }
                });
            }
        });
        slots
    };
    let filled: Vec<(Planned, Option<Result<crate::ReadInfo>>)> =
        slots.into_iter().map(|s| s.into_inner().unwrap_or_else(|e| e.into_inner())).collect();
    // Nothing partial: the first failure (in shard order) is the answer, and every load is
    // dropped with it.
    let mut done = Vec::with_capacity(filled.len());
    for (p, r) in filled {
        match r {
            Some(Ok(read)) => done.push((p, read)),
            Some(Err(e)) => return Err(e),
            None => {}
        }
    }
    if done.len() != files.shards.len() {
        return Err(model_error(files.origin(), "a shard was not loaded"));
    }
    let bytes = done.iter().map(|(p, _)| p.bytes()).sum();
    let mut shards = done.into_iter().map(|(p, read)| p.finish(read, opts)).collect::<Result<Vec<_>>>()?;
    if let Some((t, asked)) = target {
        shards = shards
            .into_iter()
            .map(|s| crate::to_device::place(crate::cast::cast_loaded(s, t, asked, &cpu, false)?, asked))
            .collect::<Result<Vec<_>>>()?;
    }
    let owner: HashMap<String, usize> = shards
        .iter()
        .enumerate()
        .flat_map(|(i, s)| s.header.tensors().iter().map(move |t| (t.name.clone(), i)))
        .collect();
    let report =
        ModelReport { files: shards.len(), bytes, elapsed: started.elapsed(), workers, threads_per_fill: per_fill };
    Ok(LoadedModel { files, shards, owner, report })
}

/// Plans every shard (see [`plan`]), up to 16 at a time; the first failure in shard order is
/// the answer.
fn plan_all(shards: &[PathBuf], opts: &LoadOptions, device: &dyn turboio_device::Device) -> Result<Vec<Planned>> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let slots: Vec<std::sync::Mutex<Option<Result<Planned>>>> = shards.iter().map(|_| Default::default()).collect();
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    std::thread::scope(|scope| {
        for _ in 0..shards.len().clamp(1, 16) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= shards.len() || failed.load(Ordering::Relaxed) {
                    break;
                }
                let r = plan_shard(&shards[i], opts, device);
                failed.fetch_or(r.is_err(), Ordering::Relaxed);
                *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            });
        }
    });
    let results: Vec<Option<Result<Planned>>> =
        slots.into_iter().map(|s| s.into_inner().unwrap_or_else(|e| e.into_inner())).collect();
    if let Some(i) = results.iter().position(|r| matches!(r, Some(Err(_)))) {
        return match results.into_iter().nth(i) {
            Some(Some(Err(e))) => Err(e),
            _ => Err(model_error(&shards[i], "a shard was not opened")),
        };
    }
    results
        .into_iter()
        .zip(shards)
        .map(|(r, shard)| r.unwrap_or_else(|| Err(model_error(shard, "a shard was not opened"))))
        .collect()
}

/// Parses a shard size (see [`crate::size::parse_size`]): a byte count or a number with a unit,
/// as `transformers`' `max_shard_size` takes them.
pub use crate::size::parse_size as parse_shard_size;

/// Splits tensors (their byte sizes, in order) into shards of at most `max` bytes each, as
/// `transformers` does: a tensor that does not fit in the current shard starts a new one, and
/// a tensor larger than `max` gets a shard of its own.
pub fn plan_shards(sizes: &[u64], max: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut used = 0u64;
    for (i, &n) in sizes.iter().enumerate() {
        if !current.is_empty() && used.saturating_add(n) > max {
            shards.push(std::mem::take(&mut current));
            used = 0;
        }
        current.push(i);
        used = used.saturating_add(n);
    }
    if !current.is_empty() || shards.is_empty() {
        shards.push(current);
    }
    shards
}

/// Whether a file name is one this module writes as a shard (`model-NNNNN-of-NNNNN.safetensors`,
/// optionally with `-<hex tag>` before the extension).
fn is_shard_name(name: &str) -> bool {
    let Some(stem) = name.strip_prefix("model-").and_then(|s| s.strip_suffix(".safetensors")) else {
        return false;
    };
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    let parts: Vec<&str> = stem.split('-').collect();
    let tag_ok = match parts.get(3) {
        None => true,
        Some(t) => !t.is_empty() && t.bytes().all(|b| b.is_ascii_hexdigit()),
    };
    (parts.len() == 3 || parts.len() == 4) && digits(parts[0]) && parts[1] == "of" && digits(parts[2]) && tag_ok
}

/// Whether a file is the temporary file of a shard whose writer is gone: a temporary name of
/// the atomic writer for a shard name, abandoned by the writer's own rule
/// (`turboio_io_posix::abandoned_temp`: unlocked, and a dead process of this host or untouched
/// for an hour). Shard names of killed saves may never be saved again, and the index's writer
/// looks for leftovers of its name once per process and directory (`turboio_io_posix`'s
/// leftover scan), so it never sees those of a saver that died after this process's first save
/// there: the model save, which lists the directory anyway, removes both.
fn is_dead_writers_temp(path: &Path) -> bool {
    #[cfg(feature = "posix")]
    {
        let shard = path.file_name().and_then(turboio_io_posix::temp_target).and_then(|t| t.to_str());
        shard.is_some_and(|n| is_shard_name(n) || n == INDEX_NAME) && turboio_io_posix::abandoned_temp(path)
    }
    #[cfg(not(feature = "posix"))]
    {
        let _ = path;
        false
    }
}

/// A random hex tag for shard names that must not collide with the current set.
fn fresh_tag() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    h.write_u32(std::process::id());
    format!("{:08x}", h.finish() as u32)
}

/// What [`save_model_dir`] wrote.
#[derive(Debug, Clone)]
pub struct ModelSaveReport {
    /// The index written (the commit point).
    pub index: PathBuf,
    /// The shards written, in order.
    pub shards: Vec<PathBuf>,
    /// Files of older sets removed after the commit.
    pub removed: Vec<PathBuf>,
    /// Sum of the tensors' data bytes (`metadata.total_size` in the index).
    pub total_size: u64,
}

/// Saves tensors as a sharded model directory with its index, atomically as a set; see the
/// [module docs](self) for the steps and what a reader (or a crash) sees at each.
///
/// `metadata` goes into every shard's header (`__metadata__`) and the index's `metadata`
/// (beside `total_size`). `opts` applies to the shards (encryption included); the index is
/// always plain JSON.
pub fn save_model_dir(
    dir: impl AsRef<Path>,
    tensors: &[SaveTensor<'_>],
    metadata: Option<&BTreeMap<String, String>>,
    max_shard_size: u64,
    opts: &SaveOptions,
) -> Result<ModelSaveReport> {
    let dir = dir.as_ref();
    let index = dir.join(INDEX_NAME);
    let mut seen = std::collections::HashSet::new();
    for t in tensors {
        if !seen.insert(t.name) {
            return Err(model_error(&index, format!("tensor `{}` is given twice", t.name)));
        }
    }
    let sizes: Vec<u64> = tensors.iter().map(|t| t.data.len() as u64).collect();
    let groups = plan_shards(&sizes, max_shard_size.max(1));
    save_model_dir_grouped(dir, tensors, &groups, metadata, opts)
}

/// [`save_model_dir`] with the shards chosen by the caller: `groups[i]` lists the positions in
/// `tensors` of shard `i`'s tensors (every tensor in exactly one group; empty groups are
/// dropped and the shards numbered without them). For a layout fixed elsewhere, such as an
/// existing model's `weight_map` (DCP's `fqn_to_index_mapping`).
pub fn save_model_dir_grouped(
    dir: impl AsRef<Path>,
    tensors: &[SaveTensor<'_>],
    groups: &[Vec<usize>],
    metadata: Option<&BTreeMap<String, String>>,
    opts: &SaveOptions,
) -> Result<ModelSaveReport> {
    let dir = dir.as_ref();
    let index = dir.join(INDEX_NAME);
    let mut placed = vec![false; tensors.len()];
    for &j in groups.iter().flatten() {
        match placed.get_mut(j) {
            Some(p) if !*p => *p = true,
            Some(_) => return Err(model_error(&index, format!("tensor `{}` is in two shards", tensors[j].name))),
            None => return Err(model_error(&index, format!("shard group names tensor {j} of {}", tensors.len()))),
        }
    }
    if let Some(j) = placed.iter().position(|p| !p) {
        return Err(model_error(&index, format!("tensor `{}` is in no shard", tensors[j].name)));
    }
    let groups: Vec<&Vec<usize>> = groups.iter().filter(|g| !g.is_empty()).collect();
    save_shard_set(dir, groups.len(), metadata, opts, &mut |i, path| {
        let list: Vec<SaveTensor<'_>> = groups[i].iter().map(|&j| tensors[j]).collect();
        crate::save(path, &list, metadata, opts)?;
        Ok(list.iter().map(|t| (t.name.to_owned(), t.data.len() as u64)).collect())
    })
}

/// Writes shard `i` at a path and returns its tensors `(name, bytes)` (see [`save_shard_set`]).
pub(crate) type ShardWriter<'a> = dyn FnMut(usize, &Path) -> Result<Vec<(String, u64)>> + 'a;

/// Writes a set of `m` shards into `dir` and commits it with the index, as [`save_model_dir`]
/// does (see the module docs): `write(i, path)` writes shard `i` at `path` atomically and
/// returns its tensors `(name, bytes)` for the index's `weight_map` and `total_size`.
pub(crate) fn save_shard_set(
    dir: &Path,
    m: usize,
    metadata: Option<&BTreeMap<String, String>>,
    opts: &SaveOptions,
    write: &mut ShardWriter<'_>,
) -> Result<ModelSaveReport> {
    let place = Place::of(opts.storage.as_ref(), dir)?;
    if let Place::Local = place {
        std::fs::create_dir_all(dir)
            .map_err(|e| model_error(dir, format!("cannot create the model directory: {e}")))?;
    }
    let index = dir.join(INDEX_NAME);
    let index_exists = place.read(&index)?.is_some();
    // Names the current index uses: the new set must not overwrite any of them. (An unreadable
    // old index: its shards are unknown, so every new name gets a tag.)
    let old: Vec<PathBuf> = match ModelFiles::from_index(&index, &place) {
        Ok(f) => f.shards,
        Err(_) => Vec::new(),
    };
    let plain: Vec<String> = (1..=m).map(|i| format!("model-{i:05}-of-{m:05}.safetensors")).collect();
    let taken = |n: &str| old.iter().any(|p| p.file_name().is_some_and(|f| f == n));
    let names: Vec<String> = if plain.iter().any(|n| taken(n)) || (index_exists && old.is_empty()) {
        let tag = fresh_tag();
        (1..=m).map(|i| format!("model-{i:05}-of-{m:05}-{tag}.safetensors")).collect()
    } else {
        plain
    };

    // 1. The new shards, each atomic and durable; the index still names the old set.
    let mut shards = Vec::with_capacity(m);
    let mut weight_map = serde_json::Map::new();
    let mut total_size = 0u64;
    for (i, name) in names.iter().enumerate() {
        let path = dir.join(name);
        for (tensor, bytes) in write(i, &path)? {
            if weight_map.insert(tensor.clone(), serde_json::Value::String(name.clone())).is_some() {
                return Err(model_error(&index, format!("tensor `{tensor}` is in two shards")));
            }
            total_size += bytes;
        }
        shards.push(path);
    }

    // 2. The index: its atomic rename is the commit point.
    let mut meta = serde_json::Map::new();
    if let Some(md) = metadata {
        for (k, v) in md {
            meta.insert(k.clone(), serde_json::Value::String(v.clone()));
        }
    }
    meta.insert("total_size".into(), serde_json::Value::from(total_size));
    let json = serde_json::json!({ "metadata": meta, "weight_map": weight_map });
    let text = serde_json::to_vec_pretty(&json).map_err(|e| model_error(&index, e.to_string()))?;
    #[allow(unused_mut)]
    let mut index_opts = opts.clone();
    #[cfg(feature = "cipher")]
    {
        index_opts.encryption = None;
    }
    crate::write_bytes(&index, &text, &index_opts)?;

    // 3. The old set and shards of killed saves, now unreferenced.
    let mut removed = Vec::new();
    let keep: std::collections::HashSet<&str> = names.iter().map(String::as_str).collect();
    let stale = place.list(dir)?.into_iter().filter(|p| {
        p.file_name().and_then(|n| n.to_str()).is_some_and(|n| !keep.contains(n) && is_shard_name(n))
            || is_dead_writers_temp(p)
    });
    // Only files this protocol writes: an old index that names `config.json` or a file of
    // another writer never gets it deleted.
    let ours = |p: &PathBuf| p.file_name().and_then(|n| n.to_str()).is_some_and(is_shard_name);
    for p in old.into_iter().filter(|p| !shards.contains(p) && ours(p)).chain(stale) {
        if !removed.contains(&p) && place.remove(&p) {
            removed.push(p);
        }
    }
    Ok(ModelSaveReport { index, shards, removed, total_size })
}

/// A summary of a model's files for `inspect`: per shard (name, tensors, bytes) and a dtype
/// histogram (dtype -> (tensors, bytes)), from the headers only.
pub fn summarize(files: &ModelFiles, opts: &LoadOptions) -> Result<ModelSummary> {
    let mut shards = Vec::new();
    let mut dtypes: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    let mut names: Vec<Vec<String>> = Vec::new();
    let mut aliases: Vec<Vec<String>> = Vec::new();
    for path in &files.shards {
        let header = crate::read_header_of(path, opts)?;
        let mut bytes = 0u64;
        for t in header.tensors() {
            let e = dtypes.entry(t.dtype.name().to_owned()).or_default();
            e.0 += 1;
            e.1 += t.len() as u64;
            bytes += t.len() as u64;
        }
        names.push(header.tensors().iter().map(|t| t.name.clone()).collect());
        aliases.push(header.aliases().into_iter().map(|(a, _)| a.to_owned()).collect());
        shards.push((path.clone(), header.len(), bytes));
    }
    let refs: Vec<Vec<&str>> = names.iter().map(|v| v.iter().map(String::as_str).collect()).collect();
    let alias_refs: Vec<Vec<&str>> = aliases.iter().map(|v| v.iter().map(String::as_str).collect()).collect();
    files.check(&refs, &alias_refs)?;
    Ok(ModelSummary { shards, dtypes })
}

/// What [`summarize`] found.
#[derive(Debug, Clone)]
pub struct ModelSummary {
    /// Per shard: path, tensors, data bytes.
    pub shards: Vec<(PathBuf, usize, u64)>,
    /// Per dtype: tensors, data bytes.
    pub dtypes: BTreeMap<String, (usize, u64)>,
}

impl ModelSummary {
    /// Tensors, all shards together.
    pub fn tensors(&self) -> usize {
        self.shards.iter().map(|s| s.1).sum()
    }

    /// Data bytes, all shards together.
    pub fn bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.2).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_split_as_transformers_does() {
        assert_eq!(plan_shards(&[4, 4, 4], 8), vec![vec![0, 1], vec![2]]);
        assert_eq!(plan_shards(&[10, 1, 1], 8), vec![vec![0], vec![1, 2]]);
        assert_eq!(plan_shards(&[1, 10, 1], 8), vec![vec![0], vec![1], vec![2]]);
        assert_eq!(plan_shards(&[], 8), vec![Vec::<usize>::new()]);
    }

    #[test]
    fn shard_sizes_parse_like_transformers() {
        assert_eq!(parse_shard_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_shard_size("500MB"), Ok(500_000_000));
        assert_eq!(parse_shard_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_shard_size("1234"), Ok(1234));
        assert!(parse_shard_size("5XB").is_err());
        assert!(parse_shard_size("0").is_err());
        assert!(parse_shard_size("-1GB").is_err());
    }

    #[test]
    fn shard_names_are_recognised() {
        assert!(is_shard_name("model-00001-of-00002.safetensors"));
        assert!(is_shard_name("model-00001-of-00002-1a2b3c4d.safetensors"));
        assert!(!is_shard_name("model.safetensors"));
        assert!(!is_shard_name("model-00001-of-00002.bin"));
        assert!(!is_shard_name("model-1-of-2.safetensors"));
        assert!(!is_shard_name("model-00001-xx-00002.safetensors"));
        assert!(!is_shard_name("model-00001-of-00002-notahex!.safetensors"));
    }
}
