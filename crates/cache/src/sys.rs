//! The one system call this crate makes outside nix: `sync_file_range`, which nix 0.30 does
//! not wrap (it has `fdatasync`'s and `posix_fadvise`'s, not this one).

use std::fs::File;
use std::os::fd::AsRawFd;

/// Starts writing back `len` bytes at `offset` of `file` without waiting for them, so that
/// the `fdatasync` that publishes an entry finds most of the object already on disk.
/// Best effort: an error only means the final sync does more of the work.
pub(crate) fn start_writeback(file: &File, offset: u64, len: u64) {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else { return };
    // SAFETY: sync_file_range only reads its integer arguments; the descriptor is valid for the
    // duration of the call (borrowed from `file`), and the call touches no memory of ours.
    unsafe {
        // libc: nix has no wrapper for sync_file_range(2).
        libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE);
    }
}
