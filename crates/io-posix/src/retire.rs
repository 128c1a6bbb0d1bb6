//! Deleting replaced files off the save's critical path.
//!
//! On ext4 (and most file systems) the `rename` that replaces a file also frees the old file's
//! blocks before it returns when that was the file's last link: for a multi-GB checkpoint that
//! took 0.6-0.9 s here, as long as writing a third of it. A replacing save therefore first
//! gives the old file a second name (see the writer), renames the new file in, and hands that
//! name to this module: one thread per process unlinks such files in the order they come,
//! while the caller goes on. [`wait_for_deletions`] waits for the queue to empty (before a
//! process exits, or a benchmark's next round); a process that exits first leaves the names
//! behind, and the next save of the same target removes them.

use std::path::PathBuf;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Condvar, Mutex};

/// The deleter of this process: its queue, and the paths not yet unlinked.
struct Deleter {
    /// The process that started the thread (a forked child starts its own).
    pid: u32,
    queue: Sender<PathBuf>,
}

static DELETER: Mutex<Option<Deleter>> = Mutex::new(None);
/// Paths queued and not yet unlinked, signalled when it reaches zero.
static PENDING: (Mutex<(u32, usize)>, Condvar) = (Mutex::new((0, 0)), Condvar::new());

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Unlinks `path` on the deleter thread (started on first use), or right away when no thread
/// can be started.
pub(crate) fn delete_later(path: PathBuf) {
    let pid = std::process::id();
    let mut slot = lock(&DELETER);
    if slot.as_ref().is_none_or(|d| d.pid != pid) {
        let (tx, rx) = channel::<PathBuf>();
        let started = std::thread::Builder::new().name("turboio-delete".into()).spawn(move || {
            for p in rx {
                let _ = std::fs::remove_file(&p);
                let mut pending = lock(&PENDING.0);
                pending.1 = pending.1.saturating_sub(1);
                if pending.1 == 0 {
                    PENDING.1.notify_all();
                }
            }
        });
        if started.is_err() {
            drop(slot);
            let _ = std::fs::remove_file(&path);
            return;
        }
        *slot = Some(Deleter { pid, queue: tx });
        // A forked child inherits the parent's count, for paths its own thread never sees.
        *lock(&PENDING.0) = (pid, 0);
    }
    {
        let mut pending = lock(&PENDING.0);
        pending.1 += 1;
    }
    if let Some(d) = slot.as_ref() {
        if let Err(e) = d.queue.send(path) {
            let mut pending = lock(&PENDING.0);
            pending.1 = pending.1.saturating_sub(1);
            drop(pending);
            let _ = std::fs::remove_file(e.0);
        }
    }
}

/// Removes the file at `path` from its name at once and frees its blocks in the background:
/// it is renamed to a hidden name next to it (`.{name}.turboio-old.…`, which a later save of
/// `name` also cleans up) and that name is unlinked by the deleter thread. A file saved under
/// `path` right after is never touched by the deletion. Falls back to unlinking it here when
/// the rename is refused.
///
/// A file that already has such a hidden name (a temporary or replaced file a killed save left)
/// is unlinked in the background under the name it has: renamed again, it would get a name
/// that no later save recognizes, left for good should this process die before the unlink.
pub fn remove_in_background(path: &std::path::Path) -> std::io::Result<()> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return std::fs::remove_file(path);
    };
    if crate::temp::temp_target(name).is_some() {
        std::fs::symlink_metadata(path)?;
        delete_later(path.to_owned());
        return Ok(());
    }
    let dir = if dir.as_os_str().is_empty() { std::path::Path::new(".") } else { dir };
    remove_in_background_as(path, dir, name)
}

/// [`remove_in_background`] with the hidden name made for `name` (the target whose save
/// removes it: its cleanup then finds what a kill left).
pub(crate) fn remove_in_background_as(
    path: &std::path::Path,
    dir: &std::path::Path,
    name: &std::ffi::OsStr,
) -> std::io::Result<()> {
    for attempt in 0..4 {
        let hidden = crate::temp::retired_name(dir, name, attempt);
        if hidden.exists() {
            continue;
        }
        return match std::fs::rename(path, &hidden) {
            Ok(()) => {
                delete_later(hidden);
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(e),
            Err(_) => std::fs::remove_file(path),
        };
    }
    std::fs::remove_file(path)
}

/// Waits until every replaced file queued for deletion by this process is unlinked.
pub fn wait_for_deletions() {
    let pid = std::process::id();
    let mut pending = lock(&PENDING.0);
    while pending.0 == pid && pending.1 > 0 {
        pending = PENDING.1.wait(pending).unwrap_or_else(|p| p.into_inner());
    }
}

/// Replaced files queued for deletion and not yet unlinked.
pub fn deletions_pending() -> usize {
    let pending = lock(&PENDING.0);
    if pending.0 == std::process::id() {
        pending.1
    } else {
        0
    }
}
