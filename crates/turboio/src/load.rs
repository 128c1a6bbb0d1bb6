//! The public load entry points: a whole file ([`load`], the plan of `plan` followed, when
//! [`LoadOptions::dtype`] asks for it, by the conversion stage of `cast`), its header, its
//! first bytes, all of it, or ranges of it.

use crate::backend::ReadInfo;
use crate::cast;
use crate::loaded::LoadedFile;
use crate::options::{CachePolicy, LoadOptions};
use crate::plan::{cpu_device, io_options, load_plain, open, plan_unallocated, read_header};
use crate::to_device::{off_host, place};
use crate::{Error, Result};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Instant;
use turboio_format::{Dtype, Header};
use turboio_storage::ReadRequest;

/// Reads only the header of a safetensors file (decrypting it when the options ask for it).
pub fn read_header_of(path: impl AsRef<Path>, opts: &LoadOptions) -> Result<Header> {
    read_header(&open(path.as_ref(), opts)?, opts.cache == CachePolicy::Bypass)
}

/// Reads the first `n` bytes of the plain file (decrypted when the options ask for it) and
/// gives the plain file's length, e.g. to tell a safetensors file from a torch pickle.
pub fn read_prefix(path: impl AsRef<Path>, n: usize, opts: &LoadOptions) -> Result<(Vec<u8>, u64)> {
    let opened = open(path.as_ref(), opts)?;
    let mut buf = vec![0u8; (opened.len().min(n as u64)) as usize];
    opened.read_exact_at(0, &mut buf)?;
    Ok((buf, opened.len()))
}

/// Reads the whole plain file into memory (decrypted when the options ask for it), e.g. an
/// encrypted torch pickle on its way to `torch.load`.
pub fn read_all(path: impl AsRef<Path>, opts: &LoadOptions) -> Result<Vec<u8>> {
    let opened = open(path.as_ref(), opts)?;
    let len = usize::try_from(opened.len()).map_err(|_| Error::Unsupported {
        path: path.as_ref().to_owned(),
        message: "file too large for this address space".into(),
    })?;
    let mut buf = vec![0u8; len];
    opened.read(vec![ReadRequest { offset: 0, dst: &mut buf }], &io_options(opts))?;
    Ok(buf)
}

/// Loads every tensor of a safetensors file.
///
/// The header is read and validated first (a few KiB); then the data section is brought into
/// memory in one pass: mapped from the page cache, copied into an arena (with
/// `O_DIRECT` for cold files), or staged into device memory, as [`LoadOptions`] and the file's
/// page-cache residency decide. Nothing partial is ever returned: on any error the memory is
/// released and the error names the file.
pub fn load(path: impl AsRef<Path>, opts: &LoadOptions) -> Result<LoadedFile> {
    again_if_changed(opts, || match opts.dtype {
        Some(target) => load_cast(path.as_ref(), opts, target),
        None => load_plain(path.as_ref(), opts),
    })
}

/// [`load`] with [`LoadOptions::dtype`] set: the stages in order, each called from here
/// (plan, memory plan, allocate, fill, convert, place on the device).
pub(crate) fn load_cast(path: &Path, opts: &LoadOptions, target: Dtype) -> Result<LoadedFile> {
    cast::check_target(path, target)?;
    let started = Instant::now();
    // A device that converts in its own memory: the plain load onto it, then its kernel.
    let mut fallback = None;
    if let Some(device) = off_host(opts).filter(|d| d.casts()) {
        let src = load_plain(path, &LoadOptions { dtype: None, ..opts.clone() })?;
        match cast::convert_on_device(src, target, device) {
            Ok(mut out) => {
                out.report.elapsed = started.elapsed();
                return Ok(out);
            }
            // The kernel cannot run (no NVRTC...): convert on the host, and say why.
            Err(e) => fallback = Some(cast::ran_on_the_host(&e)),
        }
    }
    let cpu = cpu_device(opts);
    let host = LoadOptions { device: None, dtype: None, ..opts.clone() };
    let mut planned = plan_unallocated(path, &host, &cpu)?;
    // The memory plan: the source (a copy, unless mapped) and the converted arena.
    let mut needs = planned.needs(&host);
    if let Some(h) = planned.header() {
        needs.host = needs.host.saturating_add(cast::converted_bytes(h, target, opts.tensors.as_ref()));
    }
    crate::memory::check(path, &needs, &host, &cpu)?;
    planned.allocate(&cpu, &host)?;
    if !planned.header().is_some_and(|h| cast::converts_any(h, target)) {
        // Nothing to convert: the plain load, onto the asked-for device (the CPU one is planned).
        if off_host(opts).is_some() {
            drop(planned);
            return load_plain(path, &LoadOptions { dtype: None, ..opts.clone() });
        }
        let read = planned.fill(&cpu, &host, &io_options(&host))?;
        return planned.finish(read, &host);
    }
    // Cold mapped: ask for everything, then let the converting threads read as pages arrive.
    let fused = planned.defer_cold_populate();
    let read = planned.fill(&cpu, &host, &io_options(&host))?;
    let src = planned.finish(read, &host)?;
    let mut out = place(cast::cast_loaded(src, target, opts, &cpu, fused)?, opts)?;
    out.report.elapsed = started.elapsed();
    out.report.fallbacks.extend(fallback);
    Ok(out)
}

/// How many times a load is tried when a file it read turns out to have been replaced.
const ATTEMPTS: usize = 3;

/// Runs `load` again when a file it read turned out to have been replaced meanwhile (a node
/// cache's copy of an object, read while a request checked that it was current, found stale:
/// the next attempt reads the new version), up to [`ATTEMPTS`] times in all.
///
/// The bytes a discarded attempt added to `opts.progress` are taken off again before the next
/// one, so a progress bar counts the load once (it steps back, then fills again).
pub(crate) fn again_if_changed<T>(opts: &LoadOptions, mut load: impl FnMut() -> Result<T>) -> Result<T> {
    let mut attempt = 1;
    loop {
        let before = opts.progress.as_ref().map(|p| p.load(Ordering::Relaxed));
        match load() {
            Err(e) if e.is_changed() && attempt < ATTEMPTS => {
                attempt += 1;
                if let (Some(p), Some(before)) = (&opts.progress, before) {
                    let added = p.load(Ordering::Relaxed).saturating_sub(before);
                    p.fetch_sub(added, Ordering::Relaxed);
                }
            }
            other => return other,
        }
    }
}

/// Reads plain ranges of a file (decrypted when the options ask for it) into the given
/// buffers, in parallel: `(plain_offset, destination)` pairs.
pub fn read_into(path: impl AsRef<Path>, requests: Vec<ReadRequest<'_>>, opts: &LoadOptions) -> Result<ReadInfo> {
    open(path.as_ref(), opts)?.read(requests, &io_options(opts))
}
