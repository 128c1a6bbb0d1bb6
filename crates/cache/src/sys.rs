//! The two system calls this crate makes outside nix, which nix 0.30 does not wrap:
//! `sync_file_range` and the `FS_IOC_GETVERSION` ioctl.

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

/// The file's generation number (`FS_IOC_GETVERSION`): a file created in place of a deleted one
/// may get its inode number back, never its generation (ext4, XFS, Btrfs draw a new one);
/// `None` where the file system keeps none.
pub(crate) fn generation(file: &File) -> Option<u32> {
    let mut generation: libc::c_long = 0;
    // SAFETY: FS_IOC_GETVERSION writes at most one `long` (the file systems that have it write
    // an `int`) into `generation`, which outlives the call; the descriptor is borrowed from
    // `file` for the duration of the call.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::FS_IOC_GETVERSION, &mut generation) };
    // The kernel wrote an `int`: its 32 bits are the low ones of the zeroed `long`.
    (r == 0).then_some(generation as u32)
}
