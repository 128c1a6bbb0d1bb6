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
//!    decided once per load.
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

/// Fills `memory[shift + run.mem_offset ..][..run.len]` with the plain bytes
/// `run.file_offset ..][..run.len]` for every run: the whole data section as one run, or a
/// selection's runs, all through one pipeline (one device key, one set of staging buffers and
/// readers, one GPUDirect call).
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
    let path = opened.path();
    let id = device.id();
    if opts.mode == LoadMode::Lazy {
        return Err(Error::Unsupported {
            path: path.to_owned(),
            message: format!(
                "lazy loads map the file into CPU memory; a load to {id} copies it (use auto, mapped or copied)"
            ),
        });
    }
    let mut fallbacks = Vec::new();

    // The key on the device, for encrypted files, when the device can decrypt.
    let key: Option<Box<dyn DeviceKey>> = match opened.key_material() {
        Some((k, iv)) if device.decrypts_after_upload() => match device.prepare_key(k, &iv) {
            Ok(k) => Some(k),
            Err(e) => {
                fallbacks.push(format!("decrypting on the CPU: {e}"));
                None
            }
        },
        _ => None,
    };
    let hot = cached.is_some_and(|f| f >= HOT);
    let result = fill_with(opened, device, memory, runs, shift, hot, opts, io, key.as_deref(), &mut fallbacks);
    // Device keys live only for the load (dropping waits for the device, then zeroes them).
    drop(key);
    Ok(Filled { read: result?, fallbacks })
}

#[allow(clippy::too_many_arguments)]
fn fill_with(
    opened: &Opened,
    device: &dyn Device,
    memory: &dyn Allocation,
    runs: &[Run],
    shift: usize,
    hot: bool,
    opts: &LoadOptions,
    io: &IoOptions<'_>,
    key: Option<&dyn DeviceKey>,
    fallbacks: &mut Vec<String>,
) -> Result<ReadInfo> {
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
                    return Ok(ReadInfo {
                        method: "mmap, DMA from the page cache",
                        direct: false,
                        direct_refused: false,
                    })
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
                        return Ok(ReadInfo { method: "gds", direct: true, direct_refused: false });
                    }
                    Err(StorageError::Cancelled) => return Err(Error::Cancelled { path: path.to_owned() }),
                    Err(StorageError::Unsupported { what, .. }) => fallbacks.push(what),
                    Err(e) => fallbacks.push(format!("GPUDirect Storage failed ({e}); staged instead")),
                }
            }
        }
    }

    // 3. Staged.
    load_staged(opened, device, memory, runs, shift, opts.staging_chunk, hot, io, key)
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

/// Slots each reader cycles through: one being filled while the device copies the others.
pub(crate) const SLOTS_PER_READER: usize = 3;

/// Default bytes per staging slot (InstantTensor's chunk): small enough that a reader's next
/// read overlaps its last copy early, large enough that a copy's fixed costs vanish.
pub(crate) const DEFAULT_CHUNK: usize = 8 << 20;

/// How far the read-ahead cursor of a cold, cached load runs ahead of the readers.
const READ_AHEAD_WINDOW: u64 = 256 << 20;
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
    /// Cold, the page cache bypassed: `O_DIRECT` reads straight into the slots.
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

/// The shape of a staged load: how it reads, and its readers and slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StagePlan {
    pub read: StageRead,
    /// Bytes per slot (a multiple of 4 KiB).
    pub chunk: usize,
    pub readers: usize,
    pub slots_per_reader: usize,
}

impl StagePlan {
    /// Readers and slots for `total` bytes: one reader per thread asked for (at most one per
    /// chunk), [`SLOTS_PER_READER`] slots each, all within the device pool's
    /// [`max_buffers`](turboio_device::StagingPool::max_buffers) so that a steady-state load
    /// takes every slot from the pool and pins nothing.
    pub(crate) fn new(read: StageRead, chunk: usize, total: u64, threads: usize, device: &dyn Device) -> StagePlan {
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
        StagePlan { read, chunk, readers, slots_per_reader }
    }
}

/// The chunks of `runs` as (file position, memory offset, bytes): chunk boundaries fall on
/// multiples of `chunk` in the stored file (`base` is where the plain file starts in it), so
/// every chunk but a run's first starts 4 KiB aligned, as `O_DIRECT` wants.
fn chunks_of(runs: &[Run], chunk: usize, base: u64) -> Vec<(u64, usize, usize)> {
    let mut out = Vec::new();
    for r in runs {
        let mut off = 0usize;
        while off < r.len {
            let raw = base + r.file_offset + off as u64;
            let to_boundary = (chunk as u64 - raw % chunk as u64) as usize;
            let n = to_boundary.min(r.len - off);
            out.push((r.file_offset + off as u64, r.mem_offset + off, n));
            off += n;
        }
    }
    out
}

/// Fills device memory the CPU cannot address through pinned slots: each reader reads chunks
/// into its slots (taken from the device's pool: pinned once per process) and hands each to
/// the device as soon as it is full, so reading chunk *n+1* overlaps copying chunk *n*. How the
/// file is read is decided here, once ([`StageRead`]); a cold load kept in the page cache gets
/// one read-ahead cursor for the whole load. With a device key, the readers hand over
/// ciphertext and each chunk is decrypted on the device right after its copy.
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_staged(
    opened: &Opened,
    device: &dyn Device,
    memory: &dyn Allocation,
    runs: &[Run],
    shift: usize,
    chunk: usize,
    hot: bool,
    io: &IoOptions<'_>,
    key: Option<&dyn DeviceKey>,
) -> Result<ReadInfo> {
    let path = opened.path();
    let read = match (hot, io.direct) {
        (true, _) => StageRead::Hot,
        (false, DirectIo::On) => StageRead::ColdDirect,
        (false, _) => StageRead::ColdKept,
    };
    let total: u64 = runs.iter().map(|r| r.len as u64).sum();
    let plan = StagePlan::new(read, chunk, total, io.threads, device);
    let chunks = chunks_of(runs, plan.chunk, opened.offset());
    let next = AtomicUsize::new(0);
    // Slots handed out in all: every reader's share, but never more than there are chunks, the
    // same for every load of the same file, so that a steady-state load finds them all pooled.
    let slots = AtomicUsize::new((plan.readers * plan.slots_per_reader).min(chunks.len()));
    let direct_used = AtomicBool::new(false);
    let direct_refused = AtomicBool::new(false);
    // One call per chunk, on its reader's thread, with everything decided: no probe, no
    // read-ahead of its own.
    let per_read = IoOptions {
        threads: 1,
        chunk_size: plan.chunk,
        direct: if read == StageRead::ColdDirect { DirectIo::On } else { DirectIo::Off },
        read_ahead: ReadAhead::Caller,
        ..*io
    };
    let cursor = Cursor::default();
    let result = std::thread::scope(|s| {
        if read == StageRead::ColdKept {
            s.spawn(|| cursor.lead(opened, &chunks, &next, io));
        }
        let r = turboio_storage::run_workers(vec![(); plan.readers], |(), failed| {
            let r = read_chunks(
                opened,
                device,
                memory,
                &chunks,
                &next,
                &slots,
                &plan,
                shift,
                &per_read,
                key,
                failed,
                &cursor,
                (&direct_used, &direct_refused),
            );
            cursor.moved();
            r
        });
        cursor.finish();
        r
    });
    result?;
    device.synchronize().map_err(|e| Error::device(path, e))?;
    Ok(ReadInfo {
        method: read.method(),
        direct: direct_used.load(Ordering::Relaxed),
        direct_refused: direct_refused.load(Ordering::Relaxed),
    })
}

/// One reader: takes its share of slots from the device's pool, then takes the next chunk,
/// reads it into a free slot (else the oldest in flight, once its copy is done), and hands it to
/// the device.
#[allow(clippy::too_many_arguments)]
fn read_chunks(
    opened: &Opened,
    device: &dyn Device,
    memory: &dyn Allocation,
    chunks: &[(u64, usize, usize)],
    next: &AtomicUsize,
    slots: &AtomicUsize,
    plan: &StagePlan,
    shift: usize,
    per_read: &IoOptions<'_>,
    key: Option<&dyn DeviceKey>,
    failed: &AtomicBool,
    cursor: &Cursor,
    (direct_used, direct_refused): (&AtomicBool, &AtomicBool),
) -> Result<()> {
    let path = opened.path();
    let mut inflight: VecDeque<Transfer> = VecDeque::with_capacity(plan.slots_per_reader);
    let mut free = Vec::with_capacity(plan.slots_per_reader);
    let result = (|| -> Result<()> {
        let share = slots
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n - n.min(plan.slots_per_reader)))
            .map_or(0, |n| n.min(plan.slots_per_reader));
        for _ in 0..share {
            free.push(device.alloc_staging(plan.chunk).map_err(|e| Error::device(path, e))?);
        }
        loop {
            if failed.load(Ordering::Relaxed) {
                return Ok(());
            }
            let i = next.fetch_add(1, Ordering::Relaxed);
            cursor.moved();
            let Some(&(pos, at, len)) = chunks.get(i) else {
                return Ok(());
            };
            let mut buf = match free.pop() {
                Some(b) => b,
                None => match inflight.pop_front() {
                    Some(t) => t.wait().map_err(|e| Error::device(path, e))?,
                    None => device.alloc_staging(plan.chunk).map_err(|e| Error::device(path, e))?,
                },
            };
            let dst = buf.as_mut_slice().get_mut(..len).ok_or_else(|| Error::Unsupported {
                path: path.to_owned(),
                message: format!("{} gave a staging buffer smaller than {len} bytes", device.id()),
            })?;
            let reqs = vec![ReadRequest { offset: pos, dst }];
            let r = match key {
                Some(_) => opened.read_undecrypted(reqs, per_read)?,
                None => opened.read(reqs, per_read)?,
            };
            if r.direct {
                direct_used.store(true, Ordering::Relaxed);
            }
            if r.direct_refused {
                direct_refused.store(true, Ordering::Relaxed);
            }
            let after = match key {
                Some(key) => AfterUpload::Keystream { key, pos },
                None => AfterUpload::Nothing,
            };
            let t = device.upload_with(buf, len, memory, shift + at, after).map_err(|e| Error::device(path, e))?;
            inflight.push_back(t);
        }
    })();
    // Every transfer still running is waited for, success or not: the device may be reading
    // those buffers. The slots go back to the pool as they drop.
    let mut drained = Ok(());
    for t in inflight {
        if let Err(e) = t.wait() {
            drained = drained.and(Err(Error::device(path, e)));
        }
    }
    result.and(drained)
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

    fn lead(&self, opened: &Opened, chunks: &[(u64, usize, usize)], next: &AtomicUsize, io: &IoOptions<'_>) {
        let base = opened.offset();
        let mut ahead = 0usize;
        while ahead < chunks.len() {
            // Wait while the cursor is a window ahead of the chunk the readers take next.
            {
                let mut done = self.state.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if *done || io.check_cancel().is_err() {
                        return;
                    }
                    let reading = next.load(Ordering::Relaxed).min(chunks.len() - 1);
                    if chunks[ahead].0 < chunks[reading].0 + READ_AHEAD_WINDOW {
                        break;
                    }
                    done = self.moved.wait(done).unwrap_or_else(|p| p.into_inner());
                }
            }
            // The next step: contiguous chunks up to READ_AHEAD_STEP bytes.
            let (start, _, first) = chunks[ahead];
            let mut end = start + first as u64;
            ahead += 1;
            while ahead < chunks.len() && chunks[ahead].0 == end && end - start < READ_AHEAD_STEP {
                end += chunks[ahead].2 as u64;
                ahead += 1;
            }
            opened.raw().will_need(base + start, end - start);
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
