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
//! 3. **Staged**: readers fill host staging buffers that the device copies while the next
//!    chunk is read.
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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use turboio_device::{AfterUpload, Allocation, Device, DeviceKey, FileMapping, Transfer};
use turboio_storage::{DeviceDst, DeviceReadRequest, IoOptions, ReadRequest, StorageError};

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
    load_staged(opened, device, memory, runs, shift, opts.staging_chunk, io, key)
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

/// Fills device memory the CPU cannot address: each worker reads chunks into its own host
/// staging buffers and hands them to the device; with two buffers per worker, reading the next
/// chunk overlaps the device's copy of the previous one. With a device key, the readers hand
/// over ciphertext and each chunk is decrypted on the device right after its copy.
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_staged(
    opened: &Opened,
    device: &dyn Device,
    memory: &dyn Allocation,
    runs: &[Run],
    shift: usize,
    chunk: usize,
    io: &IoOptions<'_>,
    key: Option<&dyn DeviceKey>,
) -> Result<ReadInfo> {
    const ALIGN: usize = 4096;
    let path = opened.path();
    let chunk = if chunk == 0 { 16 << 20 } else { chunk.next_multiple_of(ALIGN) };
    // (file position, memory offset, bytes) of every chunk of every run.
    let chunks: Vec<(u64, usize, usize)> = runs
        .iter()
        .flat_map(|r| {
            (0..r.len)
                .step_by(chunk)
                .map(move |off| (r.file_offset + off as u64, r.mem_offset + off, chunk.min(r.len - off)))
        })
        .collect();
    let total: u64 = runs.iter().map(|r| r.len as u64).sum();
    let workers = io.worker_count(total, chunk).min(chunks.len().max(1));
    let next = AtomicUsize::new(0);
    let info: Mutex<ReadInfo> = Mutex::new(ReadInfo::default());
    let per_read = IoOptions { threads: 1, ..*io };

    turboio_storage::run_workers(vec![(); workers], |(), failed| {
        let mut inflight: VecDeque<Transfer> = VecDeque::new();
        let result = (|| -> Result<()> {
            let mut free = Vec::with_capacity(2);
            for _ in 0..2 {
                free.push(device.alloc_staging(chunk).map_err(|e| Error::device(path, e))?);
            }
            loop {
                if failed.load(Ordering::Relaxed) {
                    return Ok(());
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(pos, at, len)) = chunks.get(i) else {
                    return Ok(());
                };
                let mut buf = match free.pop() {
                    Some(b) => b,
                    None => match inflight.pop_front() {
                        Some(t) => t.wait().map_err(|e| Error::device(path, e))?,
                        None => device.alloc_staging(chunk).map_err(|e| Error::device(path, e))?,
                    },
                };
                let dst = &mut buf.as_mut_slice()[..len];
                let reqs = vec![ReadRequest { offset: pos, dst }];
                let r = match key {
                    Some(_) => opened.read_undecrypted(reqs, &per_read)?,
                    None => opened.read(reqs, &per_read)?,
                };
                *info.lock().unwrap_or_else(|p| p.into_inner()) = r;
                let after = match key {
                    Some(key) => AfterUpload::Keystream { key, pos },
                    None => AfterUpload::Nothing,
                };
                let t = device.upload_with(buf, len, memory, shift + at, after).map_err(|e| Error::device(path, e))?;
                inflight.push_back(t);
            }
        })();
        // Every transfer still running is waited for, success or not: the device may be
        // writing from those buffers.
        let mut drained = Ok(());
        for t in inflight {
            if let Err(e) = t.wait() {
                drained = drained.and(Err(Error::device(path, e)));
            }
        }
        result.and(drained)
    })?;
    device.synchronize().map_err(|e| Error::device(path, e))?;
    let info = *info.lock().unwrap_or_else(|p| p.into_inner());
    Ok(info)
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
