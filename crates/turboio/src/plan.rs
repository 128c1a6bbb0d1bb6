//! The load pipeline: open a file (with its decrypting layer), parse what it holds, plan how
//! to hold its bytes (mapped, copied or staged; page cache kept or not), allocate, fill, and
//! finish into a [`LoadedFile`]. Dtype conversion is a stage composed after it
//! ([`crate::cast`]); `.pt` files plug their parser in ([`plan_parsed`]); the public entry
//! points are in `load`.

use crate::backend::{Opened, ReadInfo};
use crate::loaded::{CacheUse, Held, LoadReport, LoadedFile};
use crate::options::{CachePolicy, DirectIo, LoadMode, LoadOptions};
use crate::select::Run;
use crate::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;
use turboio_device::{Allocation, CpuDevice, Device, DeviceKind, FileMapping};
use turboio_format::{read_header_len, Header, N_LEN};
use turboio_storage::{IoOptions, ReadRequest};

/// Files less than this much in the page cache are read ahead as a whole when mapped.
const COLD_THRESHOLD: f64 = 0.5;

/// O_DIRECT alignment; copied loads start at the data section rounded down to it.
const ALIGN: u64 = 4096;

/// The first read of a remote file: enough for the headers of nearly all checkpoints, in one
/// request.
const FIRST_READ: u64 = 1 << 20;

/// The first read of a local file: a second read costs a system call, not a round trip, and a
/// load of a few tensors should not read a megabyte of each shard it opens.
const FIRST_READ_LOCAL: u64 = 64 << 10;

/// Reads and validates the header of an open file (only the first `8 + N` bytes are read),
/// with `O_DIRECT` when the load bypasses the page cache (so that even the header leaves the
/// cache as it was).
pub(crate) fn read_header(file: &Opened, bypass: bool) -> Result<Header> {
    let path = file.path();
    let len = file.len();
    let reader = PlainReader { file, bypass };
    let read = |offset: u64, dst: &mut [u8]| reader.read(offset, dst);
    let first = if file.local_file().is_some() { FIRST_READ_LOCAL } else { FIRST_READ };
    let mut prefix = vec![0u8; len.min(first) as usize];
    read(0, &mut prefix)?;
    let format_error = |e| {
        #[cfg(feature = "cipher")]
        if let Some(c) = &file.crypt {
            return Error::Decrypted { path: path.to_owned(), source: e, key_source: c.source.clone() };
        }
        #[cfg(feature = "cipher")]
        return crate::encryption::unkeyed_error(file.raw(), e);
        #[cfg(not(feature = "cipher"))]
        Error::format(path, e)
    };
    if prefix.starts_with(b"PK\x03\x04") {
        return Err(Error::Unsupported {
            path: path.to_owned(),
            message: "this is a PyTorch checkpoint (a torch.save zip), not a safetensors file: load it with \
                      `turboio::load_pt` (CLI: `turboio load`; Python: `turboio.load`) or convert it with \
                      `turboio convert`"
                .into(),
        });
    }
    let n = read_header_len(&prefix, len).map_err(format_error)?;
    let end = N_LEN + n as usize;
    if prefix.len() < end {
        let have = prefix.len();
        prefix.resize(end, 0);
        read(have as u64, &mut prefix[have..])?;
    }
    Header::parse(&prefix, len).map_err(format_error)
}

/// What a planned load parsed before reading any tensor byte.
pub(crate) enum Parsed {
    /// A safetensors header.
    Safetensors(Header),
    /// A torch checkpoint's index (see [`crate::pt`]).
    Pt(Box<turboio_pt::PtIndex>),
}

impl Parsed {
    /// The first byte a load must bring in: the data section, or the first storage.
    fn data_start(&self, file_len: u64) -> u64 {
        match self {
            Parsed::Safetensors(h) => h.data_start(),
            Parsed::Pt(index) => {
                index.storages().iter().filter(|s| !s.meta).map(|s| s.offset).min().unwrap_or(file_len)
            }
        }
    }
}

/// The plain bytes of an open file for the `.pt` parser: buffered reads, or `O_DIRECT` ones
/// when the load bypasses the page cache.
pub(crate) struct PlainReader<'a> {
    pub(crate) file: &'a Opened,
    pub(crate) bypass: bool,
}

impl PlainReader<'_> {
    /// Fills `dst` with the plain bytes at `offset`.
    pub(crate) fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        if self.bypass {
            let io = IoOptions { threads: 1, direct: DirectIo::On, ..Default::default() };
            self.file.read(vec![ReadRequest { offset, dst }], &io).map(drop)
        } else {
            self.file.read_exact_at(offset, dst)
        }
    }
}

impl turboio_pt::ReadAt for PlainReader<'_> {
    fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> std::io::Result<()> {
        self.read(offset, dst).map_err(std::io::Error::other)
    }

    fn len(&self) -> u64 {
        self.file.len()
    }
}

/// Opens a file for a load, with the decrypting layer when the options ask for it.
pub(crate) fn open(path: &Path, opts: &LoadOptions) -> Result<Opened> {
    open_as(path, opts, false)
}

/// [`open`]; `unconfirmed`: the caller confirms what it read before handing it out
/// ([`Opened::confirm`]), so a node cache may hand out its copy while it checks it.
fn open_as(path: &Path, opts: &LoadOptions, unconfirmed: bool) -> Result<Opened> {
    #[allow(unused_mut)]
    let mut opened = Opened::open(opts.storage.as_ref(), path, opts.cancel.as_deref(), unconfirmed)?;
    #[cfg(feature = "cipher")]
    if let Some(enc) = &opts.encryption {
        let bypass = opts.cache == CachePolicy::Bypass;
        opened.crypt = Some(crate::encryption::for_read(opened.raw(), enc, opts.cancel.as_ref(), bypass)?);
    }
    Ok(opened)
}

/// Loads every tensor of a safetensors file as it is stored (no dtype conversion): plan, fill,
/// finish.
pub(crate) fn load_plain(path: &Path, opts: &LoadOptions) -> Result<LoadedFile> {
    let cpu = cpu_device(opts);
    let device = load_device(opts, &cpu);
    let mut planned = plan(path, opts, device)?;
    let read = planned.fill(device, opts, &io_options(opts))?;
    planned.finish(read, opts)
}

/// The CPU device a load without an explicit device uses (arena pool and huge pages as asked).
pub(crate) fn cpu_device(opts: &LoadOptions) -> CpuDevice {
    let mut cpu = CpuDevice::new();
    if let Some(huge) = opts.huge_pages {
        cpu = cpu.with_huge_pages(huge);
    }
    if let Some(pool) = &opts.arenas {
        cpu = cpu.with_pool(pool.clone());
    }
    cpu
}

/// The device a load goes to: the options' device, else `cpu`.
pub(crate) fn load_device<'a>(opts: &'a LoadOptions, cpu: &'a CpuDevice) -> &'a dyn Device {
    match &opts.device {
        Some(d) => d.as_ref(),
        None => cpu,
    }
}

/// How a planned load brings its bytes in.
enum Fill {
    /// Populate (unless lazy) a private mapping of the whole file; `cold`: read ahead first.
    Mapped { mapping: FileMapping, lazy: bool, cold: bool },
    /// Read `[file_start, file_len)` straight into the host memory of `memory`.
    Host { memory: Box<dyn Allocation> },
    /// Fill device memory (through host staging buffers, from the page-cache mapping, or by
    /// GPUDirect Storage; see `to_device`).
    Staged { memory: Box<dyn Allocation> },
    /// Host or Staged, once `len` bytes are allocated ([`Planned::allocate`]).
    Pending { len: usize },
}

/// A load decided and allocated but not read yet: the file is open, its header validated, the
/// way to hold it chosen (mapped, copied or staged, and whether the page cache is kept) and the
/// memory allocated. [`fill`](Planned::fill) does the I/O, [`finish`](Planned::finish) makes
/// the [`LoadedFile`]. Loads of several files plan each file first, then fill them together.
pub(crate) struct Planned {
    path: PathBuf,
    opened: Opened,
    parsed: Parsed,
    fill: Fill,
    /// First file byte brought in by copied and staged loads (the data section rounded down to
    /// the `O_DIRECT` alignment, so memory and file offsets are congruent).
    file_start: u64,
    /// Bytes from `file_start` to the end of the file.
    span: usize,
    /// Where `file_start` lands in device memory (so that the data section starts 16-byte
    /// aligned there; 0 for host memory).
    shift: usize,
    cached_fraction: Option<f64>,
    cache: CacheUse,
    arena_reused: bool,
    /// Only some tensors are loaded ([`LoadOptions::tensors`]): what to read and where.
    selected: Option<Selected>,
    /// The load goes to host memory (the CPU device).
    on_cpu: bool,
    /// Why faster device paths were not taken (set by `fill`).
    fallbacks: Vec<String>,
    started: Instant,
}

/// The layout of a load of some of a file's tensors (see [`crate::select`]).
struct Selected {
    /// What to read, and where it goes in the load's memory (copied and staged loads) or which
    /// pages to populate (mapped loads: `mem_offset` unused).
    runs: Vec<Run>,
    /// Bytes of memory the runs fill.
    mem_len: usize,
    /// For a safetensors file: the selected tensors at their places in the file's data section
    /// (mapped loads) and in the load's memory (copied and staged loads, the runs back to back).
    /// `None` for a `.pt` file, whose runs land where they would in a whole load (its index
    /// keeps the file's offsets; memory no run fills is never touched).
    headers: Option<(Header, Header)>,
}

impl Selected {
    fn of(path: &Path, selection: &crate::Selection, header: &Header, check: bool, local: bool) -> Result<Selected> {
        if check {
            selection.check_headers(&[header], path)?;
        }
        let positions = selection.positions(header);
        let gap = crate::select::gap(local);
        let (runs, mem_len, packed) =
            crate::select::layout(header, &positions, header.data_start(), header.file_len(), ALIGN, gap);
        let in_place: Vec<(usize, (usize, usize))> =
            positions.iter().map(|&i| (i, header.tensors()[i].data_offsets)).collect();
        let bad =
            || Error::Unsupported { path: path.to_owned(), message: "internal: a selected layout is invalid".into() };
        let headers = (
            header.select(&in_place, header.data_len()).ok_or_else(bad)?,
            header.select(&packed, mem_len as u64).ok_or_else(bad)?,
        );
        Ok(Selected { headers: Some(headers), runs, mem_len })
    }

    /// The selection of a `.pt` checkpoint: its index keeps only the selected tensors, and the
    /// runs cover the storages they view, in place in a load of `[file_start, file_start + span)`.
    fn of_pt(
        path: &Path,
        selection: &crate::Selection,
        index: &mut turboio_pt::PtIndex,
        check: bool,
        local: bool,
        (file_start, span, file_len): (u64, usize, u64),
    ) -> Result<Selected> {
        if check {
            selection.check(index.tensors().iter().map(|t| t.name.as_str()), path)?;
        }
        index.retain_tensors(|n| selection.matches(n));
        let storages = index.storages();
        let ranges: Vec<(u64, u64)> = index
            .used_storages()
            .into_iter()
            .map(|i| &storages[i])
            .filter(|s| !s.meta && s.len > 0)
            .map(|s| (s.offset, s.offset + s.len))
            .collect();
        let runs = crate::select::in_place_runs(ranges, file_start, file_len, ALIGN, crate::select::gap(local));
        Ok(Selected { headers: None, runs, mem_len: span })
    }

    /// Bytes the runs read.
    fn read_bytes(&self) -> u64 {
        self.runs.iter().map(|r| r.len as u64).sum()
    }

    /// The file ranges to bring in, as `(offset, len)` pairs.
    fn ranges(&self) -> Vec<(usize, usize)> {
        self.runs.iter().map(|r| (r.file_offset as usize, r.len)).collect()
    }
}

/// Opens, validates and allocates a load of the safetensors file `path` onto `device` (see
/// [`Planned`]), once the memory plan says it fits ([`crate::memory`]). With
/// [`LoadOptions::tensors`], every name and pattern must match a tensor of this file.
pub(crate) fn plan(path: &Path, opts: &LoadOptions, device: &dyn Device) -> Result<Planned> {
    let mut planned = plan_unallocated(path, opts, device)?;
    crate::memory::check(path, &planned.needs(opts), opts, device)?;
    planned.allocate(device, opts)?;
    Ok(planned)
}

/// [`plan`] without the memory check and the allocation (the caller adds what it will hold
/// besides, checks, then [`allocate`](Planned::allocate)s).
pub(crate) fn plan_unallocated(path: &Path, opts: &LoadOptions, device: &dyn Device) -> Result<Planned> {
    plan_parsed(path, opts, device, &mut |opened, bypass| read_header(opened, bypass).map(Parsed::Safetensors), true)
}

/// [`plan_unallocated`] of one shard of a model: the selection's names and patterns are
/// checked against the whole model by the caller, so a shard may hold none of them (it is then
/// planned with nothing to read); the caller checks the model's memory plan and allocates.
pub(crate) fn plan_shard(path: &Path, opts: &LoadOptions, device: &dyn Device) -> Result<Planned> {
    plan_parsed(path, opts, device, &mut |opened, bypass| read_header(opened, bypass).map(Parsed::Safetensors), false)
}

/// Parses what an opened file holds before any tensor byte is read (`bool`: the load bypasses
/// the page cache).
pub(crate) type Parse<'a> = dyn FnMut(&Opened, bool) -> Result<Parsed> + 'a;

pub(crate) fn plan_parsed(
    path: &Path,
    opts: &LoadOptions,
    device: &dyn Device,
    parse: &mut Parse<'_>,
    check_selection: bool,
) -> Result<Planned> {
    let started = Instant::now();
    // Every planned load ends in `done`, which confirms what was read.
    let opened = open_as(path, opts, true)?;
    let mut parsed = parse(&opened, opts.cache == CachePolicy::Bypass)?;
    let file_len = opened.len();
    let data_start = parsed.data_start(file_len);
    let on_cpu = device.id().kind == DeviceKind::Cpu;
    let local = opened.local_file();
    let cached_fraction = opened.raw().cached_fraction();
    let file_start = data_start - data_start % ALIGN;
    let span = usize::try_from(file_len - file_start).map_err(|_| Error::Unsupported {
        path: path.to_owned(),
        message: "file too large for this address space".into(),
    })?;
    // Device memory starts the data section 16-byte aligned (see to_device).
    let shift = if on_cpu { 0 } else { crate::to_device::shift(data_start) };
    let is_local = local.is_some();
    let selected = match (&opts.tensors, &mut parsed) {
        (Some(selection), Parsed::Safetensors(h)) => Some(Selected::of(path, selection, h, check_selection, is_local)?),
        (Some(selection), Parsed::Pt(index)) => {
            Some(Selected::of_pt(path, selection, index, check_selection, is_local, (file_start, span, file_len))?)
        }
        _ => None,
    };

    let mapped = on_cpu
        && match opts.mode {
            LoadMode::Mapped | LoadMode::Lazy => {
                if local.is_none() {
                    let message = if opened.encrypted() {
                        "an encrypted file cannot be mapped (its bytes must be decrypted); use copied mode"
                    } else {
                        "mapped mode needs a local file; use copied mode with this storage backend"
                    };
                    return Err(Error::Unsupported { path: path.to_owned(), message: message.into() });
                }
                if opts.cache == CachePolicy::Bypass {
                    return Err(Error::Unsupported {
                        path: path.to_owned(),
                        message:
                            "a mapping is the page cache and cannot bypass it; use copied mode to bypass the cache"
                                .into(),
                    });
                }
                true
            }
            LoadMode::Copied => false,
            LoadMode::Auto => local.is_some() && opts.cache != CachePolicy::Bypass,
        };
    check_cancel(path, opts)?;
    // A file system that cannot map files (mmap fails) gets the copy in auto mode.
    let mapping = match local.filter(|_| mapped).map(|f| FileMapping::new(f, file_len as usize)) {
        Some(Ok(m)) => Some(m),
        Some(Err(_)) if opts.mode == LoadMode::Auto => None,
        Some(Err(e)) => return Err(Error::device(path, e)),
        None => None,
    };
    let (fill, cache, arena_reused) = match mapping {
        Some(mapping) => {
            let reason = if opts.mode == LoadMode::Auto { "default" } else { "mapped loads share it" };
            let lazy = opts.mode == LoadMode::Lazy;
            let cold = !cached_fraction.is_some_and(|f| f >= COLD_THRESHOLD);
            (Fill::Mapped { mapping, lazy, cold }, CacheUse { kept: true, reason }, false)
        }
        None => {
            // A selection reads its runs into memory laid out as they come.
            let span = selected.as_ref().map_or(span, |s| s.mem_len);
            let read = selected.as_ref().map_or(file_len, Selected::read_bytes);
            let dest = if on_cpu { span as u64 } else { 0 };
            let cache = if opened.raw().local_file().is_none() && cached_fraction.is_none() {
                // An object store, SFCS: nothing of this machine's page cache is involved.
                CacheUse { kept: false, reason: "not a local file: read from its storage, not through the page cache" }
            } else {
                copy_cache_use(opts.cache, read, cached_fraction, dest, turboio_device::available_memory())
            };
            // Allocated by `allocate`, once the memory plan says it fits.
            (Fill::Pending { len: (span + shift).max(1) }, cache, false)
        }
    };
    Ok(Planned {
        path: path.to_owned(),
        opened,
        parsed,
        fill,
        file_start,
        span,
        shift,
        cached_fraction,
        cache,
        arena_reused,
        selected,
        on_cpu,
        fallbacks: Vec::new(),
        started,
    })
}

fn check_cancel(path: &Path, opts: &LoadOptions) -> Result<()> {
    if opts.cancel.as_deref().is_some_and(|c| c.load(Ordering::Relaxed)) {
        Err(Error::Cancelled { path: path.to_owned() })
    } else {
        Ok(())
    }
}

impl Planned {
    /// The validated header (of a safetensors file).
    pub(crate) fn header(&self) -> Option<&Header> {
        match &self.parsed {
            Parsed::Safetensors(h) => Some(h),
            Parsed::Pt(_) => None,
        }
    }

    /// Tensors a selected load keeps (`None` without a selection; `Some(0)`: nothing of this
    /// file is selected).
    pub(crate) fn selected_tensors(&self) -> Option<usize> {
        match (&self.selected, &self.parsed) {
            (Some(Selected { headers: Some((_, packed)), .. }), _) => Some(packed.len()),
            (Some(_), Parsed::Pt(index)) => Some(index.tensors().len()),
            _ => None,
        }
    }

    /// True if the fill stages through host slots into device memory (after
    /// [`allocate`](Self::allocate)).
    pub(crate) fn is_staged(&self) -> bool {
        matches!(self.fill, Fill::Staged { .. })
    }

    /// The requests in flight one fill of this file keeps (see
    /// `StorageFile::requests_in_flight`).
    pub(crate) fn requests_in_flight(&self) -> usize {
        self.opened.raw().requests_in_flight()
    }

    /// For a cold mapped load, asks the kernel for the whole file now, without waiting (a
    /// model load asks for every shard before it fills any).
    pub(crate) fn read_ahead(&self) {
        if let Fill::Mapped { mapping, lazy: false, cold: true } = &self.fill {
            match &self.selected {
                Some(s) => mapping.will_need_ranges(&s.ranges()),
                None => mapping.will_need(),
            }
        }
    }

    /// For a cold mapped load: asks the kernel for the whole file now and leaves the mapping
    /// unpopulated, so that whoever reads it next (a converting load) reads each page as it
    /// arrives. True if it did.
    pub(crate) fn defer_cold_populate(&mut self) -> bool {
        if let Fill::Mapped { mapping, lazy: lazy @ false, cold: true } = &mut self.fill {
            match &self.selected {
                Some(s) => mapping.will_need_ranges(&s.ranges()),
                None => mapping.will_need(),
            }
            *lazy = true;
            return true;
        }
        false
    }

    /// Bytes this load brings into memory when filled.
    pub(crate) fn bytes(&self) -> u64 {
        match (&self.fill, &self.selected) {
            (Fill::Mapped { lazy: true, .. }, _) => 0,
            (Fill::Mapped { .. }, Some(s)) => s.read_bytes(),
            (Fill::Mapped { .. }, None) => self.opened.len(),
            (Fill::Host { .. } | Fill::Staged { .. } | Fill::Pending { .. }, Some(s)) if s.headers.is_some() => {
                s.mem_len as u64
            }
            (Fill::Host { .. } | Fill::Staged { .. } | Fill::Pending { .. }, Some(s)) => s.read_bytes(),
            (Fill::Host { .. } | Fill::Staged { .. } | Fill::Pending { .. }, None) => self.span as u64,
        }
    }

    /// What this load will allocate once planned ([`crate::memory`]): host memory for a copy
    /// (none when a free pooled arena holds it), or device memory and pinned staging buffers;
    /// nothing for a mapped load.
    pub(crate) fn needs(&self, opts: &LoadOptions) -> crate::memory::Needs {
        let Fill::Pending { len } = self.fill else { return Default::default() };
        let len = len as u64;
        if self.on_cpu {
            let pooled = opts.arenas.as_ref().is_some_and(|p| p.free_bytes() as u64 >= len);
            // Host pages a run never writes are never touched: an in-place selection holds its runs.
            let held = match &self.selected {
                Some(s) if s.headers.is_none() => s.read_bytes(),
                _ => len,
            };
            let host = if pooled { 0 } else { held };
            let mappable = if self.opened.local_file().is_some() { host } else { 0 };
            crate::memory::Needs { host, mappable, ..Default::default() }
        } else {
            // The slots of a staged load (see `to_device::StagePlan`), pinned once per process.
            let threads = turboio_storage::threads_or_default(opts.threads);
            let pinned = (threads * crate::to_device::SLOTS_PER_READER * staging_chunk(opts)) as u64;
            crate::memory::Needs { device: len, pinned: pinned.min(len), ..Default::default() }
        }
    }

    /// Allocates the memory of a copied or staged load (after the memory plan).
    pub(crate) fn allocate(&mut self, device: &dyn Device, opts: &LoadOptions) -> Result<()> {
        let Fill::Pending { len } = self.fill else { return Ok(()) };
        let pool_before = opts.arenas.as_ref().map(|p| p.free_arenas()).unwrap_or(0);
        let mut memory = device.alloc(len).map_err(|e| Error::device(&self.path, e))?;
        self.arena_reused =
            self.on_cpu && opts.device.is_none() && opts.arenas.as_ref().is_some_and(|p| p.free_arenas() < pool_before);
        self.fill = if memory.host_mut().is_some() { Fill::Host { memory } } else { Fill::Staged { memory } };
        Ok(())
    }

    /// Brings the bytes in, with `io`'s threads, progress and cancellation (the cache choice
    /// made when planning decides `O_DIRECT`).
    pub(crate) fn fill(&mut self, device: &dyn Device, opts: &LoadOptions, io: &IoOptions<'_>) -> Result<ReadInfo> {
        self.allocate(device, opts)?;
        // A host budget bounds the staging buffers too.
        let budgeted;
        let opts = match opts.max_host_memory {
            Some(budget) if !self.on_cpu => {
                budgeted = LoadOptions { staging_chunk: budget_chunk(opts, budget), ..opts.clone() };
                &budgeted
            }
            _ => opts,
        };
        let threads = turboio_storage::threads_or_default(io.threads);
        let direct = if self.cache.kept { DirectIo::Off } else { DirectIo::On };
        let io = IoOptions { threads, direct, ..*io };
        let path = self.path.clone();
        let info = match &mut self.fill {
            Fill::Mapped { mapping, lazy, cold } => {
                if !*lazy {
                    let bytes = match &self.selected {
                        Some(s) => {
                            mapping
                                .populate_ranges(&s.ranges(), threads, *cold)
                                .map_err(|e| Error::device(&path, e))?;
                            s.read_bytes()
                        }
                        None => {
                            if *cold { mapping.populate_cold(threads) } else { mapping.populate(threads) }
                                .map_err(|e| Error::device(&path, e))?;
                            self.opened.len()
                        }
                    };
                    io.add_progress(bytes);
                }
                ReadInfo { method: if *lazy { "mmap, lazy" } else { "mmap" }, direct: false, direct_refused: false }
            }
            Fill::Host { memory } => {
                let dst = memory.host_mut().ok_or_else(|| Error::Unsupported {
                    path: path.clone(),
                    message: "host memory went away".into(),
                })?;
                match &self.selected {
                    Some(s) => self.opened.read(run_requests(&s.runs, dst), &IoOptions { sparse: true, ..io })?,
                    None => self.opened.read(vec![ReadRequest { offset: self.file_start, dst }], &io)?,
                }
            }
            Fill::Pending { .. } => {
                return Err(Error::Unsupported {
                    path,
                    message: "internal: a load was filled before it was allocated".into(),
                })
            }
            Fill::Staged { memory } => {
                // A selection's runs, or the data section as one run; one pipeline either way.
                let whole = [crate::select::Run { file_offset: self.file_start, len: self.span, mem_offset: 0 }];
                let (runs, io) = match &self.selected {
                    Some(s) => (&s.runs[..], IoOptions { sparse: true, ..io }),
                    None => (&whole[..], io),
                };
                let filled = crate::to_device::fill(
                    &self.opened,
                    device,
                    memory.as_ref(),
                    runs,
                    self.shift,
                    self.cached_fraction,
                    opts,
                    &io,
                )?;
                self.fallbacks = filled.fallbacks;
                filled.read
            }
        };
        check_cancel(&path, opts)?;
        Ok(info)
    }

    /// Fills every planned staged load of `planned` (a model's shards, each allocated here)
    /// through one pipeline (see [`crate::to_device::fill_all`]): the readers take every shard's
    /// chunks from one queue. The read of each, in `planned`'s order.
    pub(crate) fn fill_together(
        planned: &mut [Planned],
        device: &dyn Device,
        opts: &LoadOptions,
        io: &IoOptions<'_>,
    ) -> Result<Vec<ReadInfo>> {
        for p in planned.iter_mut() {
            p.allocate(device, opts)?;
        }
        let budgeted;
        let opts = match opts.max_host_memory {
            Some(budget) => {
                budgeted = LoadOptions { staging_chunk: budget_chunk(opts, budget), ..opts.clone() };
                &budgeted
            }
            None => opts,
        };
        let threads = turboio_storage::threads_or_default(io.threads);
        let wholes: Vec<[crate::select::Run; 1]> = planned
            .iter()
            .map(|p| [crate::select::Run { file_offset: p.file_start, len: p.span, mem_offset: 0 }])
            .collect();
        let mut jobs = Vec::with_capacity(planned.len());
        for (p, whole) in planned.iter().zip(&wholes) {
            let Fill::Staged { memory } = &p.fill else {
                return Err(Error::Unsupported {
                    path: p.path.clone(),
                    message: "internal: a shard filled together is not staged".into(),
                });
            };
            let direct = if p.cache.kept { DirectIo::Off } else { DirectIo::On };
            let (runs, sparse) = match &p.selected {
                Some(s) => (&s.runs[..], true),
                None => (&whole[..], false),
            };
            jobs.push(crate::to_device::Job {
                opened: &p.opened,
                memory: memory.as_ref(),
                runs,
                shift: p.shift,
                cached: p.cached_fraction,
                io: IoOptions { threads, direct, sparse, ..*io },
            });
        }
        let filled = crate::to_device::fill_all(&jobs, device, opts)?;
        drop(jobs);
        let mut reads = Vec::with_capacity(filled.len());
        for (p, f) in planned.iter_mut().zip(filled) {
            p.fallbacks = f.fallbacks;
            reads.push(f.read);
        }
        if let Some(p) = planned.first() {
            check_cancel(&p.path, opts)?;
        }
        Ok(reads)
    }

    /// The loaded safetensors file (call after [`fill`](Self::fill)).
    pub(crate) fn finish(self, read: ReadInfo, opts: &LoadOptions) -> Result<LoadedFile> {
        let path = self.path.clone();
        let done = self.done(read, opts)?;
        match done.parsed {
            Parsed::Safetensors(header) => Ok(LoadedFile {
                path: done.path,
                header,
                memory: done.memory,
                data_base: done.data_base,
                device: done.device,
                report: done.report,
            }),
            Parsed::Pt(_) => {
                Err(Error::Unsupported { path, message: "a torch checkpoint is not a safetensors file".into() })
            }
        }
    }

    /// What a filled load holds (call after [`fill`](Self::fill)).
    pub(crate) fn done(self, read: ReadInfo, opts: &LoadOptions) -> Result<Done> {
        // A file opened before its version was confirmed (a node cache's copy) is confirmed
        // now, after everything was read and before any of it is handed out.
        self.opened.confirm()?;
        let bytes = self.bytes();
        let data_start = self.parsed.data_start(self.opened.len());
        // A selected load's header places its tensors relative to the start of its memory
        // (after the device shift), else the file's data section lands after `file_start`.
        let base = |shift: usize| match &self.selected {
            Some(Selected { headers: Some(_), .. }) => shift,
            _ => shift + (data_start - self.file_start) as usize,
        };
        let (held, memory, data_base, device): (_, Box<dyn Allocation>, _, _) = match self.fill {
            Fill::Mapped { mapping, .. } => (Held::Mapped, Box::new(mapping), data_start as usize, None),
            Fill::Host { memory } => (Held::Copied, memory, base(self.shift), opts.device.clone()),
            Fill::Staged { memory } => (Held::Staged, memory, base(self.shift), opts.device.clone()),
            // `fill` allocates first: an unfilled load is never finished.
            Fill::Pending { .. } => {
                return Err(Error::Unsupported {
                    path: self.path,
                    message: "internal: a load was finished before it was filled".into(),
                })
            }
        };
        let parsed = match (self.selected.and_then(|s| s.headers), self.parsed) {
            (Some((in_place, _)), Parsed::Safetensors(_)) if held == Held::Mapped => Parsed::Safetensors(in_place),
            (Some((_, packed)), Parsed::Safetensors(_)) => Parsed::Safetensors(packed),
            (_, parsed) => parsed,
        };
        Ok(Done {
            path: self.path,
            parsed,
            memory,
            data_base,
            data_start,
            device,
            report: LoadReport {
                held,
                read,
                cached_fraction: self.cached_fraction,
                cache: self.cache,
                bytes,
                arena_reused: self.arena_reused,
                fallbacks: self.fallbacks,
                converted: 0,
                elapsed: self.started.elapsed(),
                served_by: self.opened.raw().served_by(),
            },
        })
    }
}

/// A filled load: what it parsed and the memory holding its bytes.
pub(crate) struct Done {
    pub(crate) path: PathBuf,
    pub(crate) parsed: Parsed,
    pub(crate) memory: Box<dyn Allocation>,
    /// Where file byte `data_start` is in `memory`.
    pub(crate) data_base: usize,
    pub(crate) data_start: u64,
    pub(crate) device: Option<std::sync::Arc<dyn Device>>,
    pub(crate) report: LoadReport,
}

/// The staging chunk a load into a device uses (8 MiB unless asked otherwise).
fn staging_chunk(opts: &LoadOptions) -> usize {
    if opts.staging_chunk == 0 {
        crate::to_device::DEFAULT_CHUNK
    } else {
        opts.staging_chunk
    }
}

/// The staging chunk under a host budget: the slots of every reader within half the budget, at
/// least 1 MiB.
fn budget_chunk(opts: &LoadOptions, budget: u64) -> usize {
    let threads = turboio_storage::threads_or_default(opts.threads);
    let fit = (budget / 2 / (threads * crate::to_device::SLOTS_PER_READER) as u64) as usize;
    staging_chunk(opts).min(fit.max(1 << 20) / ALIGN as usize * ALIGN as usize)
}

/// One request per run of a selected load, each into its part of `dst` (runs in memory order,
/// back to back).
fn run_requests<'a>(runs: &[Run], mut dst: &'a mut [u8]) -> Vec<ReadRequest<'a>> {
    let mut requests = Vec::with_capacity(runs.len());
    let mut at = 0;
    for r in runs {
        let rest = std::mem::take(&mut dst);
        let (_, rest) = rest.split_at_mut(r.mem_offset - at);
        let (mine, rest) = rest.split_at_mut(r.len);
        requests.push(ReadRequest { offset: r.file_offset, dst: mine });
        dst = rest;
        at = r.mem_offset + r.len;
    }
    requests
}

/// Whether a copied or staged load keeps the page cache: as asked, or by default unless the
/// part of the file not cached yet and the host memory the copy needs (`dest_bytes`) do not
/// both fit in the memory available; then caching the file would push out the copy being made
/// (or whatever else the host holds), and `O_DIRECT` wins.
fn copy_cache_use(
    policy: CachePolicy,
    file_len: u64,
    cached: Option<f64>,
    dest_bytes: u64,
    available: Option<u64>,
) -> CacheUse {
    match policy {
        CachePolicy::Keep => CacheUse { kept: true, reason: "asked for" },
        CachePolicy::Bypass => CacheUse { kept: false, reason: "asked for" },
        CachePolicy::Auto => {
            let uncached = (file_len as f64 * (1.0 - cached.unwrap_or(0.0).clamp(0.0, 1.0))) as u64;
            let need = uncached.saturating_add(dest_bytes);
            match available {
                Some(avail) if need > avail => {
                    CacheUse { kept: false, reason: "the file and its copy do not both fit in available memory" }
                }
                _ => CacheUse { kept: true, reason: "default" },
            }
        }
    }
}

/// The storage options of a load (without the cache choice, which needs the file).
pub(crate) fn io_options(opts: &LoadOptions) -> IoOptions<'_> {
    IoOptions {
        threads: opts.threads,
        direct: match opts.cache {
            CachePolicy::Auto | CachePolicy::Keep => DirectIo::Off,
            CachePolicy::Bypass => DirectIo::On,
        },
        progress: opts.progress.as_deref(),
        cancel: opts.cancel.as_deref(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_keep_the_cache_unless_file_and_copy_do_not_fit() {
        let gb = 1u64 << 30;
        let keep = |c: CacheUse| c.kept;
        // Asked for: whatever the memory says.
        assert!(keep(copy_cache_use(CachePolicy::Keep, 8 * gb, None, 8 * gb, Some(gb))));
        assert!(!keep(copy_cache_use(CachePolicy::Bypass, gb, None, gb, Some(100 * gb))));
        // Default: 4 GiB cold file + 4 GiB copy fit in 10 GiB, not in 6.
        assert!(keep(copy_cache_use(CachePolicy::Auto, 4 * gb, Some(0.0), 4 * gb, Some(10 * gb))));
        let c = copy_cache_use(CachePolicy::Auto, 4 * gb, Some(0.0), 4 * gb, Some(6 * gb));
        assert!(!c.kept && c.reason.contains("do not both fit"), "{c}");
        // Already cached: only the copy needs room.
        assert!(keep(copy_cache_use(CachePolicy::Auto, 4 * gb, Some(1.0), 4 * gb, Some(6 * gb))));
        // Staged loads (no host copy) and an unknown memory size keep it.
        assert!(keep(copy_cache_use(CachePolicy::Auto, 4 * gb, Some(0.0), 0, Some(6 * gb))));
        assert!(keep(copy_cache_use(CachePolicy::Auto, 64 * gb, None, 64 * gb, None)));
    }
}
