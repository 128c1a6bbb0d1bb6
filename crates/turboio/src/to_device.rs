//! Loads into device memory the CPU cannot address (GPUs, the test device).
//!
//! The device and the storage say what they can do; this module picks, in order:
//!
//! 1. **From the page-cache mapping** ([`Device::uploads_from_page_cache`]): a hot, unencrypted
//!    local file is mapped and populated (no copy) and the device DMAs straight from the
//!    mapping. Auto mode takes this for files at least half cached (unless the page cache is
//!    bypassed) on a device that prefers it ([`Device::prefers_host_uploads`]; CUDA does not:
//!    registering the mapping costs more than staging); `LoadMode::Mapped` asks for it (a device
//!    may still refuse, as CUDA does unless told otherwise), `LoadMode::Copied` never takes it.
//! 2. **From storage straight into device memory** ([`StorageFile::reads_to_device`], GDS) for
//!    files that are not hot (DMA from the disk would re-read a cached file).
//! 3. **Staged** ([`load_staged`]): readers fill pinned slots from the device's pool (pinned once
//!    per process) that the device copies while the next chunk is read; how the file is read
//!    (hot, cold kept in the page cache behind one read-ahead cursor, cold with `O_DIRECT`) is
//!    decided once per load. Cold with `O_DIRECT`, on storage that reads into slots itself
//!    ([`StorageFile::reads_into_slots`](turboio_storage::StorageFile::reads_into_slots): the
//!    local backend's io_uring, the slots registered once as fixed buffers), each reader keeps
//!    a read in flight for every free slot of its own and starts each slot's copy as its read
//!    completes ([`by_completion`]).
//!
//! A path that is refused falls through to the next with one line in
//! [`LoadReport::fallbacks`](crate::LoadReport::fallbacks) saying why; nothing here fails a
//! load that a slower path can do.
//!
//! Encrypted files: when the device decrypts after upload ([`Device::decrypts_after_upload`]),
//! the key goes to the device for the load and the readers hand it ciphertext, each chunk
//! decrypted in device memory right after its copy (or the whole range after a GDS read); the
//! CPU does no AES work. Otherwise the readers decrypt each chunk as they read it.
//!
//! Placement: the data section starts 16-byte aligned in device memory (the allocation is
//! widened by up to 15 bytes), so every tensor whose offset in the file's data section is a
//! multiple of 16 gets a 16-byte-aligned pointer, and no device-side move is ever needed.

use crate::backend::{Opened, ReadInfo};
use crate::options::{CachePolicy, LoadMode, LoadOptions};
use crate::select::Run;
use crate::{Error, Result};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use turboio_device::{AfterUpload, Allocation, Device, DeviceKey, FileMapping, Transfer};
use turboio_storage::{DeviceDst, DeviceReadRequest, DirectIo, IoOptions, ReadAhead, ReadRequest, StorageError};

/// Alignment of the data section in device memory.
pub(crate) const DEVICE_ALIGN: u64 = 16;

/// Files at least this much in the page cache are hot: copied from the page cache (mapping or
/// staging), not DMA'd from the disk.
pub(crate) const HOT: f64 = 0.5;

/// Bytes to leave before `file_start`'s copy so that `data_start` lands on a
/// [`DEVICE_ALIGN`] boundary of a (256-byte aligned) device allocation.
pub(crate) fn shift(data_start: u64) -> usize {
    ((DEVICE_ALIGN - data_start % DEVICE_ALIGN) % DEVICE_ALIGN) as usize
}

/// What filling the device memory did.
pub(crate) struct Filled {
    pub read: ReadInfo,
    pub fallbacks: Vec<String>,
}

/// One file of a fill: `memory[shift + run.mem_offset ..][..run.len]` gets the plain bytes
/// `run.file_offset ..][..run.len]` for every run (the whole data section as one run, or a
/// selection's runs), read with `io` (its `direct` and `sparse` are the file's own).
pub(crate) struct Job<'a> {
    pub opened: &'a Opened,
    pub memory: &'a dyn Allocation,
    pub runs: &'a [Run],
    pub shift: usize,
    /// The file's page-cache residency, as planned.
    pub cached: Option<f64>,
    pub io: IoOptions<'a>,
}

/// Fills one file (see [`Job`]) through one pipeline: one device key, one set of slots and
/// readers, or one GPUDirect call.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fill(
    opened: &Opened,
    device: &dyn Device,
    memory: &dyn Allocation,
    runs: &[Run],
    shift: usize,
    cached: Option<f64>,
    opts: &LoadOptions,
    io: &IoOptions<'_>,
) -> Result<Filled> {
    let job = Job { opened, memory, runs, shift, cached, io: *io };
    let mut filled = fill_all(std::slice::from_ref(&job), device, opts)?;
    filled
        .pop()
        .ok_or_else(|| Error::Unsupported { path: opened.path().to_owned(), message: "internal: no fill".into() })
}

/// Fills every file of `jobs` (a model's shards): each takes the page-cache mapping or
/// GPUDirect Storage where those apply, and all the others go through **one** staging
/// pipeline, their chunks in one queue, so the readers stay busy from the first shard's first
/// chunk to the last shard's last instead of meeting at the end of every shard.
pub(crate) fn fill_all(jobs: &[Job<'_>], device: &dyn Device, opts: &LoadOptions) -> Result<Vec<Filled>> {
    let id = device.id();
    if opts.mode == LoadMode::Lazy {
        if let Some(j) = jobs.first() {
            return Err(Error::Unsupported {
                path: j.opened.path().to_owned(),
                message: format!(
                    "lazy loads map the file into CPU memory; a load to {id} copies it (use auto, mapped or copied)"
                ),
            });
        }
    }
    let mut fallbacks: Vec<Vec<String>> = jobs.iter().map(|_| Vec::new()).collect();
    // The key on the device, for encrypted files, when the device can decrypt; each lives only
    // for the load (dropping waits for the device, then zeroes it).
    let keys: Vec<Option<Box<dyn DeviceKey>>> = jobs
        .iter()
        .zip(&mut fallbacks)
        .map(|(j, fallbacks)| match j.opened.key_material() {
            Some((k, iv)) if device.decrypts_after_upload() => match device.prepare_key(k, &iv) {
                Ok(k) => Some(k),
                Err(e) => {
                    fallbacks.push(format!("decrypting on the CPU: {e}"));
                    None
                }
            },
            _ => None,
        })
        .collect();
    let mut reads: Vec<Option<ReadInfo>> = Vec::with_capacity(jobs.len());
    for ((j, key), fallbacks) in jobs.iter().zip(&keys).zip(&mut fallbacks) {
        let hot = j.cached.is_some_and(|f| f >= HOT);
        reads.push(direct_paths(j, device, hot, opts, key.as_deref(), fallbacks)?);
    }
    let staged: Vec<Staged<'_>> = jobs
        .iter()
        .zip(&keys)
        .zip(&reads)
        .filter(|(_, read)| read.is_none())
        .map(|((j, key), _)| Staged { job: j, hot: j.cached.is_some_and(|f| f >= HOT), key: key.as_deref() })
        .collect();
    let mut staged_reads = load_staged(&staged, device, opts.staging_chunk)?.into_iter();
    drop(keys);
    reads
        .into_iter()
        .zip(fallbacks)
        .zip(jobs)
        .map(|((read, fallbacks), j)| {
            let read = match read {
                Some(r) => r,
                None => staged_reads.next().ok_or_else(|| Error::Unsupported {
                    path: j.opened.path().to_owned(),
                    message: "internal: a staged file was not filled".into(),
                })?,
            };
            Ok(Filled { read, fallbacks })
        })
        .collect()
}

/// The paths that need no staging: from the page-cache mapping, or from storage straight into
/// device memory; `None` when neither applies (the file is staged), with a line in `fallbacks`
/// for each that was refused.
fn direct_paths(
    job: &Job<'_>,
    device: &dyn Device,
    hot: bool,
    opts: &LoadOptions,
    key: Option<&dyn DeviceKey>,
    fallbacks: &mut Vec<String>,
) -> Result<Option<ReadInfo>> {
    let Job { opened, memory, runs, shift, ref io, .. } = *job;
    let path = opened.path();
    let id = device.id();
    let encrypted = opened.encrypted();

    // 1. Straight from the page-cache mapping.
    let want_mapped = match opts.mode {
        LoadMode::Mapped => true,
        LoadMode::Copied | LoadMode::Lazy => false,
        LoadMode::Auto => hot && opts.cache != CachePolicy::Bypass && device.prefers_host_uploads(),
    };
    if want_mapped {
        let why_not = if let Err(why) = device.uploads_from_page_cache() {
            Some(why)
        } else if encrypted {
            Some("an encrypted file cannot be copied from the page cache as it is".to_owned())
        } else if opened.local_file().is_none() {
            Some("the storage backend has no local file to map".to_owned())
        } else {
            None
        };
        match why_not {
            Some(why) if opts.mode == LoadMode::Mapped => fallbacks.push(format!("not mapped: {why}")),
            Some(_) => {}
            None => match upload_mapped(opened, device, memory, runs, shift, io) {
                Ok(()) => {
                    return Ok(Some(ReadInfo {
                        method: "mmap, DMA from the page cache",
                        direct: false,
                        direct_refused: false,
                    }))
                }
                Err(Error::Device { source, .. }) => {
                    fallbacks.push(format!("not copied from the page cache: {source}"))
                }
                Err(e) => return Err(e),
            },
        }
    }

    // 2. Straight from storage into device memory.
    let kind = id.kind.name();
    if opened.raw().reads_to_device(kind) {
        let why_not = if hot && opts.mode == LoadMode::Auto {
            Some("the file is in the page cache, which staging reads faster than DMA from the disk")
        } else if encrypted && key.is_none() {
            Some("the file is encrypted and the device cannot decrypt it")
        } else {
            None
        };
        match why_not {
            Some(why) => fallbacks.push(format!("GPUDirect Storage not used: {why}")),
            None => {
                let reqs: Vec<DeviceReadRequest> = runs
                    .iter()
                    .map(|r| DeviceReadRequest {
                        offset: r.file_offset + opened.offset(),
                        len: r.len as u64,
                        dst: DeviceDst {
                            kind,
                            ordinal: id.ordinal,
                            base: memory.address(),
                            offset: (shift + r.mem_offset) as u64,
                        },
                    })
                    .collect();
                match opened.raw().read_to_device(&reqs, io) {
                    Ok(()) => {
                        if let Some(k) = key {
                            for r in runs {
                                device
                                    .apply_keystream(k, memory, shift + r.mem_offset, r.len, r.file_offset)
                                    .map_err(|e| Error::device(path, e))?;
                            }
                        }
                        device.synchronize().map_err(|e| Error::device(path, e))?;
                        return Ok(Some(ReadInfo { method: "gds", direct: true, direct_refused: false }));
                    }
                    Err(StorageError::Cancelled) => return Err(Error::Cancelled { path: path.to_owned() }),
                    Err(StorageError::Unsupported { what, .. }) => fallbacks.push(what),
                    Err(e) => fallbacks.push(format!("GPUDirect Storage failed ({e}); staged instead")),
                }
            }
        }
    }
    Ok(None)
}

/// Maps the file, populates the runs' pages from the page cache, and has the device copy
/// each run from the mapping.
fn upload_mapped(
    opened: &Opened,
    device: &dyn Device,
    memory: &dyn Allocation,
    runs: &[Run],
    shift: usize,
    io: &IoOptions<'_>,
) -> Result<()> {
    let path = opened.path();
    let file = opened
        .local_file()
        .ok_or_else(|| Error::Unsupported { path: path.to_owned(), message: "no local file to map".into() })?;
    let len = usize::try_from(opened.len()).map_err(|_| Error::Unsupported {
        path: path.to_owned(),
        message: "file too large for this address space".into(),
    })?;
    let mapping = FileMapping::new(file, len).map_err(|e| Error::device(path, e))?;
    let ranges: Vec<(usize, usize)> = runs.iter().map(|r| (r.file_offset as usize, r.len)).collect();
    mapping.populate_ranges(&ranges, io.threads.max(1), false).map_err(|e| Error::device(path, e))?;
    io.check_cancel().map_err(|e| Error::storage(path, e))?;
    for r in runs {
        let start = r.file_offset as usize;
        let src = mapping.as_slice().get(start..start + r.len).ok_or_else(|| Error::Unsupported {
            path: path.to_owned(),
            message: "the file is shorter than its header says".into(),
        })?;
        device.upload_from_host(src, memory, shift + r.mem_offset).map_err(|e| Error::device(path, e))?;
        io.add_progress(r.len as u64);
    }
    Ok(())
}

/// Slots each reader cycles through: one being filled while the device copies the other. Two
/// suffice while the link copies a slot faster than a reader fills one (the H200's 55 GB/s
/// against a few GB/s per reader); where the readers outrun the link, they wait for it, and more
/// slots would only pin more memory.
pub(crate) const SLOTS_PER_READER: usize = 2;

/// Default bytes per staging slot (InstantTensor's chunk): small enough that a reader's next
/// read overlaps its last copy early, large enough that a copy's fixed costs vanish.
pub(crate) const DEFAULT_CHUNK: usize = 8 << 20;

/// The device of `opts` when it is not the CPU (a load there goes through this module).
pub(crate) fn off_host(opts: &LoadOptions) -> Option<&std::sync::Arc<dyn Device>> {
    opts.device.as_ref().filter(|d| d.id().kind != turboio_device::DeviceKind::Cpu)
}

/// Places a load held in host memory (a conversion's arena) on the device of `opts`, when that
/// is not the CPU (else gives it back as it is): its data section is copied into new device
/// memory through the device's staging slots (two in flight: the next slot is filled while the
/// last one's copy runs), and the file is given back held there
/// ([`Held::Staged`](crate::Held::Staged)), its data section at the allocation's start.
pub(crate) fn place(mut file: crate::loaded::LoadedFile, opts: &LoadOptions) -> Result<crate::loaded::LoadedFile> {
    let Some(device) = off_host(opts) else { return Ok(file) };
    let path = file.path.clone();
    let host = file.memory.host().and_then(|m| m.get(file.data_base..)).ok_or_else(|| Error::Unsupported {
        path: path.clone(),
        message: "the upload needs the bytes in host memory".into(),
    })?;
    let memory = upload_host(device.as_ref(), host, opts).map_err(|e| Error::device(&path, e))?;
    file.memory = memory;
    file.data_base = 0;
    file.device = Some(device.clone());
    file.report.held = crate::loaded::Held::Staged;
    Ok(file)
}

/// Copies host bytes into new memory of `device`, through its staging slots.
fn upload_host(
    device: &dyn Device,
    host: &[u8],
    opts: &LoadOptions,
) -> std::result::Result<Box<dyn Allocation>, turboio_device::DeviceError> {
    let memory = device.alloc(host.len().max(1))?;
    if device.uploads_from_host() {
        device.upload_from_host(host, memory.as_ref(), 0)?;
    } else {
        let chunk = if opts.staging_chunk == 0 { DEFAULT_CHUNK } else { opts.staging_chunk };
        let mut pending = None;
        for (i, part) in host.chunks(chunk).enumerate() {
            let mut staging = device.alloc_staging(part.len())?;
            staging.as_mut_slice()[..part.len()].copy_from_slice(part);
            if let Some(t) = pending.take() {
                drop(Transfer::wait(t)?);
            }
            pending = Some(device.upload(staging, part.len(), memory.as_ref(), i * chunk)?);
        }
        if let Some(t) = pending {
            drop(Transfer::wait(t)?);
        }
    }
    device.synchronize()?;
    Ok(memory)
}

/// How far the read-ahead cursor of a cold, cached load runs ahead of the readers.
const READ_AHEAD_WINDOW: u64 = 1 << 30;
/// Bytes asked for per `will_need` call of the cursor.
const READ_AHEAD_STEP: u64 = 32 << 20;

/// How a staged load reads its file, decided once per load (no per-chunk probe).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StageRead {
    /// The file is in the page cache: each reader `pread`s straight into its slots.
    Hot,
    /// Cold, and kept in the page cache (so the next process is hot): buffered reads led by
    /// one read-ahead cursor for the whole load.
    ColdKept,
    /// Cold, the page cache bypassed: `O_DIRECT` reads straight into the slots. A fill of such
    /// files alone, on storage that reads into slots itself, is the storage's (io_uring, each
    /// completion starting its slot's copy: [`by_completion`]); elsewhere it gets a reader per
    /// slot (one `pread` per slot, its copy issued as soon as it is full); a fill mixing them
    /// with others reads a reader's slots in one call.
    ColdDirect,
}

impl StageRead {
    fn method(self) -> &'static str {
        match self {
            StageRead::Hot => "staged: hot, pread into pinned slots",
            StageRead::ColdKept => "staged: cold, buffered reads led by one read-ahead cursor",
            StageRead::ColdDirect => "staged: cold, O_DIRECT into pinned slots",
        }
    }
}

/// The shape of a staged load: its readers and slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StagePlan {
    /// Bytes per slot (a multiple of 4 KiB).
    pub chunk: usize,
    pub readers: usize,
    pub slots_per_reader: usize,
}

impl StagePlan {
    /// Readers and slots for `total` bytes: one reader per thread asked for (at most one per
    /// chunk), [`SLOTS_PER_READER`] slots each, all within the device pool's
    /// [`max_buffers`](turboio_device::StagingPool::max_buffers) so that a steady-state load
    /// takes every slot from the pool and pins nothing. `per_slot`: every file is read cold with
    /// `O_DIRECT`, and each slot gets a reader of its own (the same slots in all, so nothing more
    /// is pinned): each reads its slot with one `pread` and uploads it as soon as it is full, so
    /// every slot is being read from the disk but for the moment of its copy (a reader with
    /// several slots, reading them in one call, left them all idle between its calls).
    pub(crate) fn new(chunk: usize, total: u64, threads: usize, device: &dyn Device, per_slot: bool) -> StagePlan {
        let chunk = if chunk == 0 { DEFAULT_CHUNK } else { chunk.next_multiple_of(4096) };
        let chunks = usize::try_from(total.div_ceil(chunk as u64)).unwrap_or(usize::MAX).max(1);
        let mut readers = turboio_storage::threads_or_default(threads).clamp(1, chunks);
        let mut slots_per_reader = SLOTS_PER_READER;
        if let Some(max) = device.staging_pool().map(|p| p.max_buffers().max(1)) {
            if readers * slots_per_reader > max {
                readers = readers.min((max / 2).max(1));
                slots_per_reader = (max / readers).clamp(1, SLOTS_PER_READER);
            }
        }
        if per_slot {
            return StagePlan { chunk, readers: readers * slots_per_reader, slots_per_reader: 1 };
        }
        StagePlan { chunk, readers, slots_per_reader }
    }
}

/// A chunk of a staged fill: which file, its plain position, where it goes in that file's
/// memory, its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Chunk {
    file: usize,
    pos: u64,
    at: usize,
    len: usize,
}

/// The chunks of `runs` of file `file`: chunk boundaries fall on multiples of `chunk` in the
/// stored file (`base` is where the plain file starts in it), so every chunk but a run's first
/// starts 4 KiB aligned, as `O_DIRECT` wants.
fn chunks_of(file: usize, runs: &[Run], chunk: usize, base: u64, out: &mut Vec<Chunk>) {
    for r in runs {
        let mut off = 0usize;
        while off < r.len {
            let raw = base + r.file_offset + off as u64;
            let to_boundary = (chunk as u64 - raw % chunk as u64) as usize;
            let len = to_boundary.min(r.len - off);
            out.push(Chunk { file, pos: r.file_offset + off as u64, at: r.mem_offset + off, len });
            off += len;
        }
    }
}

/// The last `readers` chunks cut in four (4 KiB aligned), so that the readers finish together:
/// whole chunks at the end would leave all but one reader idle for up to a chunk's read.
fn split_tail(chunks: Vec<Chunk>, readers: usize) -> Vec<Chunk> {
    const PIECES: usize = 4;
    if readers < 2 {
        return chunks;
    }
    let cut = chunks.len().saturating_sub(readers);
    let mut out = Vec::with_capacity(chunks.len() + readers * (PIECES - 1));
    for (i, c) in chunks.into_iter().enumerate() {
        let piece = (c.len / PIECES).next_multiple_of(4096);
        if i < cut || c.len < PIECES * 16384 {
            out.push(c);
            continue;
        }
        let mut off = 0;
        while off < c.len {
            let len = piece.min(c.len - off);
            out.push(Chunk { pos: c.pos + off as u64, at: c.at + off, len, ..c });
            off += len;
        }
    }
    out
}

/// A file of a staged fill.
struct Staged<'a> {
    job: &'a Job<'a>,
    hot: bool,
    key: Option<&'a dyn DeviceKey>,
}

/// What the readers of one file use: how it is read, and what they saw.
struct StagedFile<'a> {
    read: StageRead,
    per_read: IoOptions<'a>,
    direct_used: AtomicBool,
    direct_refused: AtomicBool,
}

/// Fills device memory the CPU cannot address through pinned slots, for every file of
/// `files` in one pipeline: each reader takes its share of slots from the device's pool (pinned
/// once per process), then chunks from one queue (every file's, in order), reading each into a
/// slot and handing it to the device as soon as it is full, so reading chunk *n+1* overlaps
/// copying chunk *n*. How each file is read is decided here, once ([`StageRead`]); cold files
/// kept in the page cache get one read-ahead cursor for the whole fill. With a device key, the
/// readers hand over ciphertext and each chunk is decrypted on the device right after its copy.
fn load_staged(files: &[Staged<'_>], device: &dyn Device, chunk: usize) -> Result<Vec<ReadInfo>> {
    let Some(first) = files.first() else { return Ok(Vec::new()) };
    let io = &first.job.io;
    let total: u64 = files.iter().flat_map(|f| f.job.runs).map(|r| r.len as u64).sum();
    let ctx: Vec<StagedFile<'_>> = files
        .iter()
        .map(|f| {
            let read = match (f.hot, f.job.io.direct) {
                (true, _) => StageRead::Hot,
                (false, DirectIo::On) => StageRead::ColdDirect,
                (false, _) => StageRead::ColdKept,
            };
            StagedFile {
                read,
                // One call per chunk, on its reader's thread, with everything decided: no
                // probe, no read-ahead of its own.
                per_read: IoOptions {
                    threads: 1,
                    direct: if read == StageRead::ColdDirect { DirectIo::On } else { DirectIo::Off },
                    read_ahead: ReadAhead::Caller,
                    ..f.job.io
                },
                direct_used: AtomicBool::new(false),
                direct_refused: AtomicBool::new(false),
            }
        })
        .collect();
    let per_slot = ctx.iter().all(|c| c.read == StageRead::ColdDirect);
    // Every file cold with O_DIRECT, on storage that reads into slots itself (io_uring): a ring
    // per reader, every slot's read in flight, each copy started as its read completes.
    let by_completion = per_slot
        && files.iter().zip(&ctx).all(|(f, c)| {
            (f.key.is_some() || !f.job.opened.encrypted()) && f.job.opened.raw().reads_into_slots(&c.per_read)
        });
    if by_completion {
        let plan = StagePlan::new(chunk, total, io.threads, device, false);
        return by_completion::fill(files, &ctx, device, &plan);
    }
    let plan = StagePlan::new(chunk, total, io.threads, device, per_slot);
    let mut chunks = Vec::new();
    for (i, f) in files.iter().enumerate() {
        chunks_of(i, f.job.runs, plan.chunk, f.job.opened.offset(), &mut chunks);
    }
    let chunks = split_tail(chunks, plan.readers);
    let ctx: Vec<StagedFile<'_>> = ctx
        .into_iter()
        .map(|c| StagedFile { per_read: IoOptions { chunk_size: plan.chunk, ..c.per_read }, ..c })
        .collect();
    let next = AtomicUsize::new(0);
    // Slots handed out in all: every reader's share, but never more than there are chunks, the
    // same for every load of the same files, so that a steady-state load finds them all pooled.
    let slots = AtomicUsize::new((plan.readers * plan.slots_per_reader).min(chunks.len()));
    let cursor = Cursor::default();
    let lead = ctx.iter().any(|c| c.read == StageRead::ColdKept);
    // The slots of readers that are done wait here until the whole fill is: a reader that ends
    // early must not hand its slots to one that starts late, or the fill would pin fewer slots
    // than the next load of the same files holds at once (and that load would pin again).
    let parked = Mutex::new(Vec::new());
    let pipeline = Pipeline {
        files,
        ctx: &ctx,
        device,
        chunks: &chunks,
        next: &next,
        slots: &slots,
        plan: &plan,
        parked: &parked,
    };
    let result = std::thread::scope(|s| {
        if lead {
            s.spawn(|| cursor.lead(&pipeline, io));
        }
        let r = turboio_storage::run_workers(vec![(); plan.readers], |(), failed| {
            let r = pipeline.read_chunks(failed, &cursor);
            cursor.moved();
            r
        });
        cursor.finish();
        r
    });
    // Every reader waited for each of its transfers (each copy, and the decryption after it,
    // complete): nothing of this fill is left on the device, and no device-wide
    // synchronisation is needed. The slots go back to the pool now.
    drop(parked);
    result?;
    Ok(ctx
        .iter()
        .map(|c| ReadInfo {
            method: c.read.method(),
            direct: c.direct_used.load(Ordering::Relaxed),
            direct_refused: c.direct_refused.load(Ordering::Relaxed),
        })
        .collect())
}

/// What every reader of a staged fill shares.
struct Pipeline<'p, 'a> {
    files: &'p [Staged<'a>],
    ctx: &'p [StagedFile<'a>],
    device: &'p dyn Device,
    chunks: &'p [Chunk],
    next: &'p AtomicUsize,
    slots: &'p AtomicUsize,
    plan: &'p StagePlan,
    /// The slots of the readers that are done (see [`load_staged`]).
    parked: &'p Mutex<Vec<turboio_device::Staging>>,
}

impl Pipeline<'_, '_> {
    /// One reader: takes its share of slots from the device's pool, then takes the next chunk,
    /// reads it into a free slot (else the oldest in flight, once its copy is done), and hands
    /// it to the device.
    fn read_chunks(&self, failed: &AtomicBool, cursor: &Cursor) -> Result<()> {
        let (device, plan) = (self.device, self.plan);
        let first_path = self.files[0].job.opened.path();
        let mut inflight: VecDeque<(usize, Transfer)> = VecDeque::with_capacity(plan.slots_per_reader);
        let mut free = Vec::with_capacity(plan.slots_per_reader);
        let result = (|| -> Result<()> {
            let share = self
                .slots
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n - n.min(plan.slots_per_reader)))
                .map_or(0, |n| n.min(plan.slots_per_reader));
            if share == 0 {
                // Every slot of the fill is some other reader's: the chunks are theirs too
                // (a reader with no slot would pin one more than the fill's share).
                return Ok(());
            }
            for _ in 0..share {
                free.push(device.alloc_staging(plan.chunk).map_err(|e| Error::device(first_path, e))?);
            }
            loop {
                if failed.load(Ordering::Relaxed) {
                    return Ok(());
                }
                let i = self.next.fetch_add(1, Ordering::Relaxed);
                let Some(&first) = self.chunks.get(i) else {
                    cursor.moved();
                    return Ok(());
                };
                let (f, c) = (&self.files[first.file], &self.ctx[first.file]);
                // Cold with O_DIRECT: a batch of the next chunks of the same file, one per
                // slot, in one call (io_uring: every block of them in flight at once), where one
                // synchronous read per chunk would keep a single request queued per reader.
                let mut batch = vec![first];
                let mut at = i + 1;
                while c.read == StageRead::ColdDirect && batch.len() < share {
                    match self.chunks.get(at) {
                        Some(n)
                            if n.file == first.file
                                && self
                                    .next
                                    .compare_exchange(at, at + 1, Ordering::Relaxed, Ordering::Relaxed)
                                    .is_ok() =>
                        {
                            batch.push(*n);
                            at += 1;
                        }
                        _ => break,
                    }
                }
                cursor.moved();
                let path = f.job.opened.path();
                let mut bufs = Vec::with_capacity(batch.len());
                for _ in 0..batch.len() {
                    bufs.push(match free.pop() {
                        Some(b) => b,
                        None => match inflight.pop_front() {
                            Some((k, t)) => t.wait().map_err(|e| Error::device(self.files[k].job.opened.path(), e))?,
                            None => device.alloc_staging(plan.chunk).map_err(|e| Error::device(path, e))?,
                        },
                    });
                }
                let mut reqs = Vec::with_capacity(batch.len());
                for (buf, ch) in bufs.iter_mut().zip(&batch) {
                    let len = ch.len;
                    let dst = buf.as_mut_slice().get_mut(..len).ok_or_else(|| Error::Unsupported {
                        path: path.to_owned(),
                        message: format!("{} gave a staging buffer smaller than {len} bytes", device.id()),
                    })?;
                    reqs.push(ReadRequest { offset: ch.pos, dst });
                }
                let r = match f.key {
                    Some(_) => f.job.opened.read_undecrypted(reqs, &c.per_read)?,
                    None => f.job.opened.read(reqs, &c.per_read)?,
                };
                if r.direct {
                    c.direct_used.store(true, Ordering::Relaxed);
                }
                if r.direct_refused {
                    c.direct_refused.store(true, Ordering::Relaxed);
                }
                for (buf, ch) in bufs.into_iter().zip(&batch) {
                    let after = match f.key {
                        Some(key) => AfterUpload::Keystream { key, pos: ch.pos },
                        None => AfterUpload::Nothing,
                    };
                    let t = device
                        .upload_with(buf, ch.len, f.job.memory, f.job.shift + ch.at, after)
                        .map_err(|e| Error::device(path, e))?;
                    inflight.push_back((ch.file, t));
                }
            }
        })();
        // Every transfer still running is waited for, success or not: the device may be
        // reading those buffers. The slots are parked until the fill is done.
        let mut drained = Ok(());
        for (k, t) in inflight {
            match t.wait() {
                Ok(buf) => free.push(buf),
                Err(e) => drained = drained.and(Err(Error::device(self.files[k].job.opened.path(), e))),
            }
        }
        self.parked.lock().unwrap_or_else(|p| p.into_inner()).append(&mut free);
        result.and(drained)
    }
}

/// The read-ahead cursor of a cold load kept in the page cache: one thread asks the storage for
/// the chunks the readers will read next ([`StorageFile::will_need`](turboio_storage::StorageFile::will_need)),
/// at most [`READ_AHEAD_WINDOW`] ahead of them, so the disk sees a deep queue of sequential
/// reads instead of the few small ones each blocked `pread` would start.
#[derive(Default)]
struct Cursor {
    state: Mutex<bool>,
    moved: Condvar,
}

impl Cursor {
    /// A reader took a chunk (or stopped). The lock orders this with the cursor's check, so no
    /// wake-up is lost.
    fn moved(&self) {
        drop(self.state.lock().unwrap_or_else(|p| p.into_inner()));
        self.moved.notify_one();
    }

    /// The readers are done.
    fn finish(&self) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.moved.notify_all();
    }

    /// Asks for the chunks of the cold, kept files ahead of the readers, a step of contiguous
    /// chunks at a time, at most [`READ_AHEAD_WINDOW`] bytes of the queue ahead of the chunk the
    /// readers take next.
    fn lead(&self, p: &Pipeline<'_, '_>, io: &IoOptions<'_>) {
        let chunks = p.chunks;
        // Bytes of the queue before each chunk.
        let mut before = Vec::with_capacity(chunks.len());
        let mut sum = 0u64;
        for c in chunks {
            before.push(sum);
            sum += c.len as u64;
        }
        let mut ahead = 0usize;
        while ahead < chunks.len() {
            if p.ctx[chunks[ahead].file].read != StageRead::ColdKept {
                ahead += 1;
                continue;
            }
            // Wait while the cursor is a window ahead of the chunk the readers take next.
            {
                let mut done = self.state.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if *done || io.check_cancel().is_err() {
                        return;
                    }
                    let reading = p.next.load(Ordering::Relaxed).min(chunks.len() - 1);
                    if before[ahead] < before[reading] + READ_AHEAD_WINDOW {
                        break;
                    }
                    done = self.moved.wait(done).unwrap_or_else(|p| p.into_inner());
                }
            }
            // The next step: contiguous chunks of one file, up to READ_AHEAD_STEP bytes.
            let Chunk { file, pos: start, len, .. } = chunks[ahead];
            let mut end = start + len as u64;
            ahead += 1;
            while ahead < chunks.len()
                && chunks[ahead].file == file
                && chunks[ahead].pos == end
                && end - start < READ_AHEAD_STEP
            {
                end += chunks[ahead].len as u64;
                ahead += 1;
            }
            let opened = p.files[file].job.opened;
            opened.raw().will_need(opened.offset() + start, end - start);
        }
    }
}

/// Cold files read with `O_DIRECT` by the storage itself into the slots
/// ([`StorageFile::read_into_slots`](turboio_storage::StorageFile::read_into_slots)): each
/// reader (a *lane*: its own slots, its own io_uring in the local backend, the slots registered
/// as its fixed buffers) keeps a read in flight for every free slot of its own and is told as
/// each completes, which starts that slot's copy at once; a slot is read again as soon as its
/// copy is done. The lanes take chunks from one queue, every file's in order, so they read the
/// same file side by side and one lane starts the next file while the other finishes the last
/// reads of the one before (a single ring would drain at every file's end). No CPU copy.
mod by_completion {
    use super::{Chunk, Error, Result, StagePlan, StageRead, Staged, StagedFile};
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Mutex;
    use turboio_device::{AfterUpload, Device, Staging, Transfer};
    use turboio_storage::{ReadInfo, SlotFeed, SlotMemory, SlotRead, StorageError};

    /// What the lanes share.
    struct Shared<'p, 'a> {
        files: &'p [Staged<'a>],
        ctx: &'p [StagedFile<'a>],
        device: &'p dyn Device,
        /// Every file's chunks, in order; `next` is the first no lane has taken.
        chunks: &'p [Chunk],
        next: &'p AtomicUsize,
        /// Per file: how its reads went (merged over the lanes).
        infos: &'p [Mutex<Option<ReadInfo>>],
    }

    /// Fills every file of `files` (all cold, `O_DIRECT`, on storage that reads into slots).
    pub(super) fn fill(
        files: &[Staged<'_>],
        ctx: &[StagedFile<'_>],
        device: &dyn Device,
        plan: &StagePlan,
    ) -> Result<Vec<ReadInfo>> {
        let first = files[0].job.opened.path();
        let mut chunks = Vec::new();
        for (i, f) in files.iter().enumerate() {
            super::chunks_of(i, f.job.runs, plan.chunk, f.job.opened.offset(), &mut chunks);
        }
        // Every lane's share of slots (the same slots a hot load takes, so nothing more is pinned).
        let lanes = plan.readers.clamp(1, chunks.len().max(1));
        let per_lane = plan.slots_per_reader.max(1);
        // Never more slots than chunks: the same count a hot load of the same files takes.
        let total = (lanes * per_lane).min(chunks.len().max(1));
        let mut bufs = slots(device, total, plan.chunk).map_err(|e| Error::device(first, e))?;
        let next = AtomicUsize::new(0);
        let infos: Vec<Mutex<Option<ReadInfo>>> = files.iter().map(|_| Mutex::new(None)).collect();
        let shared = Shared { files, ctx, device, chunks: &chunks, next: &next, infos: &infos };
        // The same slots go to the same lane at every load (the pool hands them out in any
        // order), so each lane's slots are the ones its ring registered before.
        bufs.sort_by_key(|b| b.serial().unwrap_or(u64::MAX));
        let mut shares = Vec::with_capacity(lanes);
        while !bufs.is_empty() {
            let rest = bufs.split_off(per_lane.min(bufs.len()));
            shares.push(std::mem::replace(&mut bufs, rest));
        }
        // A lane that fails sets `failed`: the others stop asking for chunks.
        turboio_storage::run_workers(shares, |share, failed| lane(&shared, share, failed))?;
        Ok(infos
            .into_iter()
            .map(|m| {
                m.into_inner().unwrap_or_else(|p| p.into_inner()).map_or(
                    // Nothing of it to read (an empty selection).
                    ReadInfo { method: StageRead::ColdDirect.method(), direct: false, direct_refused: false },
                    reported,
                )
            })
            .collect())
    }

    /// One lane: reads the queue's chunks, a file's run at a time, through its own slots, until
    /// they run out or another lane `failed`.
    fn lane(shared: &Shared<'_, '_>, bufs: Vec<Staging>, failed: &AtomicBool) -> Result<()> {
        let mut feed = Feed::new(shared, bufs, failed);
        let result = (|| -> Result<()> {
            loop {
                if failed.load(Ordering::Relaxed) {
                    return Ok(());
                }
                let Some(&Chunk { file, .. }) = shared.chunks.get(shared.next.load(Ordering::Relaxed)) else {
                    return Ok(());
                };
                feed.file = file;
                let opened = shared.files[file].job.opened;
                match opened.raw().read_into_slots(&mut feed, &shared.ctx[file].per_read) {
                    Ok(r) => merge(&shared.infos[file], r),
                    Err(e) => {
                        return Err(feed.error.take().unwrap_or_else(|| match e {
                            StorageError::Cancelled => Error::Cancelled { path: opened.path().to_owned() },
                            e => Error::storage(opened.path(), e),
                        }))
                    }
                }
            }
        })();
        // Every copy is waited for, success or not (the device may be reading the slots); the
        // slots go back to the pool when `feed` is dropped.
        let drained = feed.drain();
        result.and(drained)
    }

    /// The report's method for each way the storage read (its `ReadInfo::method`), the least
    /// of them first; any other is reported as [`StageRead::ColdDirect`]'s.
    const METHODS: [(&str, &str); 2] = [
        ("io_uring", "staged: cold, O_DIRECT io_uring into pinned slots, each copy started as its read completes"),
        (
            "io_uring, registered buffers",
            "staged: cold, O_DIRECT io_uring into registered pinned slots, each copy started as its read completes",
        ),
    ];

    /// Adds one call's report to a file's: the least of the lanes' methods (a lane whose slots
    /// could not be registered says so), direct only if every call was.
    fn merge(info: &Mutex<Option<ReadInfo>>, r: ReadInfo) {
        let rank = |storage: &str| METHODS.iter().position(|(m, _)| *m == storage).map_or(0, |i| i + 1);
        let mut info = info.lock().unwrap_or_else(|p| p.into_inner());
        let merged = match *info {
            None => r,
            Some(i) => ReadInfo {
                method: if rank(i.method) <= rank(r.method) { i.method } else { r.method },
                direct: i.direct && r.direct,
                direct_refused: i.direct_refused || r.direct_refused,
            },
        };
        *info = Some(merged);
    }

    /// What a file's report says of how it was read (the storage's method put in its words).
    fn reported(r: ReadInfo) -> ReadInfo {
        let method =
            METHODS.iter().find(|(m, _)| *m == r.method).map_or(StageRead::ColdDirect.method(), |(_, ours)| ours);
        ReadInfo { method, ..r }
    }

    /// `n` slots of `chunk` bytes from the device's pool; the ones the pool does not have are
    /// pinned on several threads at once (a new process's first load).
    fn slots(device: &dyn Device, n: usize, chunk: usize) -> turboio_device::Result<Vec<Staging>> {
        let pooled = device.staging_pool().map_or(0, |p| p.free_buffers());
        let threads = if pooled >= n { 1 } else { turboio_storage::default_threads().clamp(1, n) };
        if threads == 1 {
            return (0..n).map(|_| device.alloc_staging(chunk)).collect();
        }
        let per = n.div_ceil(threads);
        let parts: Vec<turboio_device::Result<Vec<Staging>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let count = per.min(n.saturating_sub(t * per));
                    s.spawn(move || (0..count).map(|_| device.alloc_staging(chunk)).collect())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        let mut out = Vec::with_capacity(n);
        for p in parts {
            out.extend(p?);
        }
        Ok(out)
    }

    /// One lane's slots and copies in flight, as the storage's [`SlotFeed`] for the file `file`.
    struct Feed<'s, 'p, 'a> {
        shared: &'s Shared<'p, 'a>,
        /// Set when a lane failed.
        failed: &'s AtomicBool,
        /// Each slot's buffer, while it is here (not in a copy).
        bufs: Vec<Option<Staging>>,
        memory: Vec<SlotMemory>,
        free: Vec<usize>,
        /// The chunk each slot is being read for.
        reading: Vec<Option<Chunk>>,
        /// Copies in flight, oldest first: (slot, file).
        copies: VecDeque<(usize, usize, Transfer)>,
        /// The file the current call reads.
        file: usize,
        /// A device error met in a callback (the storage sees a stand-in).
        error: Option<Error>,
    }

    impl<'s, 'p, 'a> Feed<'s, 'p, 'a> {
        fn new(shared: &'s Shared<'p, 'a>, mut bufs: Vec<Staging>, failed: &'s AtomicBool) -> Self {
            let memory = bufs
                .iter_mut()
                .map(|b| {
                    let serial = b.serial();
                    let s = b.as_mut_slice();
                    SlotMemory { ptr: s.as_mut_ptr(), len: s.len(), serial }
                })
                .collect();
            let n = bufs.len();
            Feed {
                shared,
                failed,
                bufs: bufs.into_iter().map(Some).collect(),
                memory,
                free: (0..n).rev().collect(),
                reading: vec![None; n],
                copies: VecDeque::with_capacity(n),
                file: 0,
                error: None,
            }
        }

        /// Takes back the slot of the oldest copy, waiting for it.
        fn reclaim(&mut self) -> Result<()> {
            if let Some((slot, file, t)) = self.copies.pop_front() {
                let buf = t.wait().map_err(|e| Error::device(self.shared.files[file].job.opened.path(), e))?;
                self.bufs[slot] = Some(buf);
                self.free.push(slot);
            }
            Ok(())
        }

        /// Waits for every copy in flight.
        fn drain(&mut self) -> Result<()> {
            let mut result = Ok(());
            while !self.copies.is_empty() {
                if let Err(e) = self.reclaim() {
                    result = result.and(Err(e));
                }
            }
            result
        }

        /// Keeps a device error for the caller; the storage gets a stand-in that names it.
        fn fail(&mut self, e: Error) -> StorageError {
            let what = e.to_string();
            self.error.get_or_insert(e);
            StorageError::Unsupported { backend: "device", what }
        }

        /// The index of the queue's next chunk if it is of this call's file.
        fn peek(&self) -> Option<usize> {
            let i = self.shared.next.load(Ordering::Relaxed);
            let ours = self.shared.chunks.get(i).is_some_and(|c| c.file == self.file);
            (ours && !self.failed.load(Ordering::Relaxed)).then_some(i)
        }
    }

    // SAFETY: every slot's memory is its `Staging` buffer, owned by `bufs` (or by a copy, which
    // gives it back) until the feed is dropped, after the storage's calls have returned; the
    // pointers in `memory` were taken from those buffers, whose heap memory never moves. A slot
    // is handed out by `next` only from `free` and is not touched again until `filled`, which
    // starts its copy; it returns to `free` only once that copy is done.
    #[allow(unsafe_code)]
    unsafe impl SlotFeed for Feed<'_, '_, '_> {
        fn slots(&self) -> usize {
            self.memory.len()
        }

        fn slot_memory(&self, slot: usize) -> SlotMemory {
            self.memory[slot]
        }

        fn slot_mut(&mut self, slot: usize) -> &mut [u8] {
            match self.bufs.get_mut(slot).and_then(Option::as_mut) {
                Some(b) => b.as_mut_slice(),
                None => &mut [],
            }
        }

        fn next(&mut self, wait: bool) -> turboio_storage::Result<SlotRead> {
            if self.peek().is_none() {
                return Ok(SlotRead::End);
            }
            // A free slot first (the copies done take theirs back without waiting), so that a
            // chunk taken from the queue is read at once.
            while self.copies.front().is_some_and(|(_, _, t)| t.is_complete()) {
                if let Err(e) = self.reclaim() {
                    return Err(self.fail(e));
                }
            }
            if self.free.is_empty() {
                if !wait {
                    return Ok(SlotRead::Later);
                }
                if let Err(e) = self.reclaim() {
                    return Err(self.fail(e));
                }
            }
            let Some(slot) = self.free.pop() else {
                return Err(StorageError::Unsupported { backend: "device", what: "no staging slot".into() });
            };
            // Take the queue's next chunk if it is still of this file (another lane may have
            // taken it meanwhile).
            loop {
                let Some(i) = self.peek() else {
                    self.free.push(slot);
                    return Ok(SlotRead::End);
                };
                if self.shared.next.compare_exchange(i, i + 1, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
                    let chunk = self.shared.chunks[i];
                    self.reading[slot] = Some(chunk);
                    let offset = self.shared.files[self.file].job.opened.offset() + chunk.pos;
                    return Ok(SlotRead::Read { slot, offset, len: chunk.len });
                }
            }
        }

        fn filled(&mut self, slot: usize, _offset: u64, len: usize) -> turboio_storage::Result<()> {
            let (Some(chunk), Some(buf)) =
                (self.reading.get_mut(slot).and_then(Option::take), self.bufs.get_mut(slot).and_then(Option::take))
            else {
                return Err(StorageError::Unsupported { backend: "device", what: format!("slot {slot} was not read") });
            };
            let f = &self.shared.files[chunk.file];
            let after = match f.key {
                Some(key) => AfterUpload::Keystream { key, pos: chunk.pos },
                None => AfterUpload::Nothing,
            };
            match self.shared.device.upload_with(buf, len.min(chunk.len), f.job.memory, f.job.shift + chunk.at, after) {
                Ok(t) => {
                    self.copies.push_back((slot, chunk.file, t));
                    Ok(())
                }
                Err(e) => {
                    let e = Error::device(f.job.opened.path(), e);
                    Err(self.fail(e))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::shift;

    #[test]
    fn the_data_section_lands_16_byte_aligned() {
        for data_start in [8u64, 16, 24, 4096, 4104, 12345] {
            let aligned_start = data_start - data_start % 4096;
            let at = shift(data_start) as u64 + (data_start - aligned_start);
            assert_eq!(at % 16, 0, "data_start {data_start}");
            assert!(shift(data_start) < 16);
        }
        assert_eq!(shift(4096), 0, "an aligned data section keeps GDS reads 4 KiB congruent");
    }
}
