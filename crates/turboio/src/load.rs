//! The public load entry points: a whole file ([`load`], the plan of `plan` followed, when
//! [`LoadOptions::dtype`] asks for it, by the conversion stage of `cast`), its header, its
//! first bytes, all of it, or ranges of it.

use crate::backend::ReadInfo;
use crate::loaded::LoadedFile;
use crate::options::{CachePolicy, LoadOptions};
use crate::plan::{io_options, load_plain, open, read_header};
use crate::{Error, Result};
use std::path::Path;
use std::sync::atomic::Ordering;
use turboio_format::Header;
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
        Some(target) => crate::cast::load_cast(path.as_ref(), opts, target),
        None => load_plain(path.as_ref(), opts),
    })
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
