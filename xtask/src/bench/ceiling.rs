//! The machine's ceilings, measured without turboio: a raw O_DIRECT sequential read at a fixed
//! queue depth into one reused buffer (cold), and a map + `MADV_POPULATE_READ` of the whole
//! file (hot).

use anyhow::{bail, Context, Result};
use io_uring::{opcode, types, IoUring};
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use turboio::device::{Arena, FileMapping};

/// Reads the whole file with O_DIRECT, `depth` requests of `block` bytes in flight, into a
/// reused `depth * block` buffer. Returns bytes read.
pub fn odirect_sequential(path: &Path, depth: usize, block: usize) -> Result<u64> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
        .open(path)
        .with_context(|| format!("{}: open with O_DIRECT", path.display()))?;
    let len = file.metadata()?.len();
    let mut buf = Arena::new(depth * block, false)?;
    buf.prefault(1);
    ring_sequential(&file, len, &mut buf, depth, block, false)
        .with_context(|| format!("{}: O_DIRECT read", path.display()))
}

/// Keeps `depth` sequential requests of `block` bytes in flight over `[0, len)` of `file`
/// (reads into, or writes from, slot `i` of `buf`) until all are done; returns the bytes moved.
fn ring_sequential(
    file: &std::fs::File,
    len: u64,
    buf: &mut Arena,
    depth: usize,
    block: usize,
    write: bool,
) -> Result<u64> {
    anyhow::ensure!(buf.len() >= depth * block, "buffer too small");
    let base = buf.as_mut_slice().as_mut_ptr();
    let mut ring: IoUring = IoUring::new(depth as u32 * 2)?;
    let fd = types::Fd(file.as_raw_fd());
    let (mut next, mut inflight, mut done) = (0u64, 0usize, 0u64);
    let submit = |ring: &mut IoUring, slot: usize, next: &mut u64| -> Result<bool> {
        if *next >= len {
            return Ok(false);
        }
        let n = (block as u64).min(len - *next) as u32;
        // SAFETY: slot < depth, so the block lies inside `buf`, which outlives every request:
        // this function reaps all in-flight requests before returning.
        let ptr = unsafe { base.add(slot * block) };
        let e = if write {
            opcode::Write::new(fd, ptr, n).offset(*next).build()
        } else {
            // A read of a whole block: the last one comes back short at the end of the file.
            opcode::Read::new(fd, ptr, block as u32).offset(*next).build()
        };
        // SAFETY: the entry points at memory valid until its completion is reaped (see above).
        unsafe { ring.submission().push(&e.user_data(slot as u64)) }
            .map_err(|_| anyhow::anyhow!("submission queue full"))?;
        *next += if write { u64::from(n) } else { block as u64 };
        Ok(true)
    };
    for slot in 0..depth {
        if submit(&mut ring, slot, &mut next)? {
            inflight += 1;
        }
    }
    let mut error = None;
    while inflight > 0 {
        ring.submit_and_wait(1)?;
        let completed: Vec<(u64, i32)> = ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (slot, res) in completed {
            inflight -= 1;
            if res < 0 {
                error.get_or_insert(std::io::Error::from_raw_os_error(-res));
                continue;
            }
            done += res as u64;
            if error.is_none() && submit(&mut ring, slot as usize, &mut next)? {
                inflight += 1;
            }
        }
    }
    if let Some(e) = error {
        bail!("{e}");
    }
    Ok(done)
}

/// Maps the whole file privately and populates it (one thread), the zero-copy ceiling.
pub fn map_populate(path: &Path) -> Result<FileMapping> {
    let file = std::fs::File::open(path)?;
    let len = file.metadata()?.len() as usize;
    let m = FileMapping::new(&file, len)?;
    m.populate(1)?;
    Ok(m)
}

/// Writes `len` bytes (rounded up to 4 KiB) to a new file with O_DIRECT, `depth` requests of
/// `block` bytes in flight from one reused buffer, then `fsync`s it: the disk's write ceiling.
pub fn odirect_write(path: &Path, len: u64, depth: usize, block: usize) -> Result<u64> {
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
        .open(path)
        .with_context(|| format!("{}: open with O_DIRECT", path.display()))?;
    let mut buf = Arena::new(depth * block, false)?;
    buf.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8);
    let done = ring_sequential(&file, len.next_multiple_of(4096), &mut buf, depth, block, true)
        .with_context(|| format!("{}: O_DIRECT write", path.display()))?;
    file.sync_all()?;
    Ok(done)
}
