//! Atomic saves: parts in a temporary directory, `cfsConcat`, `cfsRename2` over the target.

use crate::ffi::{CfsError, Fs};
use crate::{cfs_err, Resolved};
use nix::errno::Errno;
use std::ffi::CString;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use turboio_storage::{run_workers, IoOptions, StorageError, WriteSource};

/// Bytes filled from the source and handed to `cfsWrite` at a time.
const CHUNK: usize = 8 << 20;
/// Part alignment when the library does not tell its block size.
const FALLBACK_BLOCK: u64 = 64 << 20;

/// Deletes the temporary directory unless the save went through.
struct TempDir<'a> {
    fs: &'a Fs,
    path: CString,
    armed: bool,
}

impl Drop for TempDir<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.fs.delete(&self.path, true);
        }
    }
}

fn c(path: &Path, s: String) -> Result<CString, StorageError> {
    CString::new(s).map_err(|_| StorageError::Setup { path: path.to_owned(), message: "the path contains NUL".into() })
}

fn io_err(path: &Path, op: &'static str, errno: Errno) -> StorageError {
    StorageError::Io { path: path.to_owned(), op, source: io::Error::from(errno) }
}

fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.finish()
}

/// `(offset, len)` of each part: one stream for files under two blocks (or one worker), else
/// one part per worker, each a whole number of blocks but the last.
pub(crate) fn plan_parts(len: u64, workers: usize, block: u64) -> Vec<(u64, u64)> {
    let block = block.max(1);
    if workers <= 1 || len < 2 * block {
        return vec![(0, len)];
    }
    let per = len.div_ceil(workers as u64).div_ceil(block) * block;
    (0..len).step_by(per as usize).map(|off| (off, per.min(len - off))).collect()
}

/// Writes `source` to the resolved target atomically (see the crate docs).
pub(crate) fn write_file(
    path: &Path,
    r: &Resolved,
    source: &dyn WriteSource,
    opts: &IoOptions<'_>,
) -> Result<(), StorageError> {
    let fs = &*r.fs;
    let (parent, name) = match r.mapped.rsplit_once('/') {
        Some(("", n)) => ("/", n),
        Some((p, n)) => (p, n),
        None => ("/", r.mapped.as_str()),
    };
    if name.is_empty() {
        return Err(io_err(path, "write", Errno::EISDIR));
    }
    match fs.path_info(&c(path, parent.to_string())?) {
        Ok(i) if i.is_dir => {}
        Ok(_) => return Err(io_err(path, "write", Errno::ENOTDIR)),
        Err(e) => return Err(cfs_err(path, "stat directory", e)),
    }
    match fs.path_info(&r.c_path) {
        Ok(i) if i.is_dir => return Err(io_err(path, "write", Errno::EISDIR)),
        Ok(_) => {}
        Err(e) if e.errno == Errno::ENOENT as i32 => {}
        Err(e) => return Err(cfs_err(path, "stat", e)),
    }
    opts.check_cancel()?;
    let base = r.concat_dir.as_deref().unwrap_or(parent).trim_end_matches('/');
    let tmp = format!("{base}/.{name}.turboio-tmp.{}.{:016x}", std::process::id(), random_u64());
    let tmp_c = c(path, tmp.clone())?;
    fs.create_directory(&tmp_c).map_err(|e| temp_err(path, "create temporary directory", e))?;
    let mut guard = TempDir { fs, path: tmp_c.clone(), armed: true };

    let len = source.len();
    let block = fs.default_block_size().unwrap_or(FALLBACK_BLOCK);
    let parts = plan_parts(len, opts.worker_count(len, usize::try_from(block).unwrap_or(usize::MAX)), block);
    let names: Vec<CString> = (0..parts.len()).map(|i| c(path, format!("{tmp}/{i}"))).collect::<Result<_, _>>()?;
    let work: Vec<(usize, (u64, u64))> = parts.iter().copied().enumerate().collect();
    run_workers(work, |(i, (offset, n)), failed| write_part(path, fs, &names[i], source, offset, n, opts, failed))?;
    opts.check_cancel()?;
    if names.len() > 1 {
        fs.concat(&names[0], &names[1..]).map_err(|e| temp_err(path, "concat", e))?;
    }
    opts.check_cancel()?;
    fs.rename2(&names[0], &r.c_path).map_err(|e| temp_err(path, "rename", e))?;
    guard.armed = false;
    fs.delete(&tmp_c, true).map_err(|e| StorageError::Io {
        path: path.to_owned(),
        op: "remove the temporary directory (the new file is in place)",
        source: io::Error::new(e.kind(), format!("{tmp}: {e}")),
    })
}

/// Errors about the temporary files are never "not found" of the target.
fn temp_err(path: &Path, op: &'static str, e: CfsError) -> StorageError {
    StorageError::Io { path: path.to_owned(), op, source: e.into_io() }
}

/// One part, in one stream: chunks filled from the source and written in order.
#[allow(clippy::too_many_arguments)]
fn write_part(
    path: &Path,
    fs: &Fs,
    name: &CString,
    source: &dyn WriteSource,
    offset: u64,
    len: u64,
    opts: &IoOptions<'_>,
    failed: &AtomicBool,
) -> Result<(), StorageError> {
    let mut file = fs.open_write(name).map_err(|e| temp_err(path, "create part", e))?;
    let mut buf = vec![0u8; (len.min(CHUNK as u64)) as usize];
    let mut done = 0u64;
    while done < len {
        if failed.load(Ordering::Relaxed) {
            return Ok(());
        }
        opts.check_cancel()?;
        let n = (len - done).min(CHUNK as u64) as usize;
        let data = &mut buf[..n];
        source.fill(offset + done, data).map_err(|message| StorageError::Source { path: path.to_owned(), message })?;
        let mut written = 0usize;
        while written < n {
            let w = file.write(&data[written..]).map_err(|e| temp_err(path, "write", e))?;
            if w == 0 {
                return Err(temp_err(path, "write", CfsError::ours("cfsWrite", Errno::EIO as i32, "wrote nothing")));
            }
            written += w;
        }
        done += n as u64;
        opts.add_progress(n as u64);
    }
    file.close().map_err(|e| temp_err(path, "close", e))
}

#[cfg(test)]
mod tests {
    use super::plan_parts;

    #[test]
    fn parts_are_whole_blocks_but_the_last() {
        assert_eq!(plan_parts(10, 4, 4), vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(plan_parts(7, 4, 4), vec![(0, 7)]);
        assert_eq!(plan_parts(100, 1, 4), vec![(0, 100)]);
        assert_eq!(plan_parts(0, 8, 4), vec![(0, 0)]);
        let p = plan_parts((9 << 20) + 5, 4, 1 << 20);
        assert_eq!(p, vec![(0, 3 << 20), (3 << 20, 3 << 20), (6 << 20, 3 << 20), (9 << 20, 5)]);
        for w in p.windows(2) {
            assert_eq!(w[0].0 + w[0].1, w[1].0);
        }
    }
}
