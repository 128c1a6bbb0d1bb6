//! The temporary files a save writes next to its target, who owns them, and when someone else
//! may remove them.
//!
//! A save writes `.{name}.turboio-tmp.{pid}.{owner}.{random}` and holds an exclusive `flock` on
//! it until the rename. `{owner}` is 8 hex digits naming the machine's boot and the PID
//! namespace the writer runs in ([`owner_tag`]), so the PID means something only to a process
//! that shares both. A temporary left by a killed writer is removed by a later save of the same
//! name (and by model saves, for shard names that are never saved again) when
//! [`abandoned_temp`] says so:
//!
//! - its lock is held: a writer is alive (on this kernel, or on another host where the file
//!   system shares locks, as NFS does): kept;
//! - else, written by this boot and PID namespace: removed when that PID no longer exists;
//! - else (another host, another container, or a name without an owner): removed once it has
//!   not been modified for [`STALE_AFTER`] (a writer writes it continuously), or for
//!   [`STALE_AFTER_WITHOUT_LOCKS`] on a file system that has no locks to ask.
//!
//! A PID alone (what this module replaced) is wrong across hosts sharing a file system and
//! across PID namespaces: another host's live writer has a PID that is free here, and its
//! temporary file would be deleted under it.
//!
//! A save that replaces a file also gives the old file a second name for a moment,
//! `.{name}.turboio-old.{pid}.{owner}.{random}` (see the writer): an extra link to data that is
//! being replaced, never the only copy of anything still needed, so any process may remove it at
//! any time ([`abandoned_temp`] says yes to it at once).

use crate::sys;
use nix::fcntl::OFlag;
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::{self, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

/// What temporary names contain after the target's name.
pub(crate) const TEMP_MARK: &str = ".turboio-tmp.";
/// What the names of replaced files kept for their deletion contain after the target's name.
pub(crate) const RETIRED_MARK: &str = ".turboio-old.";
/// Longest file-name prefix kept in temporary names (names are limited to 255 bytes).
pub(crate) const MAX_NAME_PREFIX: usize = 200;

/// How long an unlocked temporary file of another host or PID namespace must have gone
/// unmodified before it is taken for abandoned.
pub const STALE_AFTER: Duration = Duration::from_secs(3600);
/// The same, on a file system that has no locks (nothing says whether a writer is alive).
pub const STALE_AFTER_WITHOUT_LOCKS: Duration = Duration::from_secs(24 * 3600);

/// FNV-1a: a hash that every build and version computes alike (std's may change).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// This process's owner tag: 8 hex digits from the kernel's boot id and the inode of its PID
/// namespace. Processes that share both see each other's PIDs; any other writer has another
/// tag. Where neither can be read, a random tag (every other writer then counts as foreign).
pub fn owner_tag() -> &'static str {
    static TAG: OnceLock<String> = OnceLock::new();
    TAG.get_or_init(|| {
        let boot = fs::read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let ns = fs::metadata("/proc/self/ns/pid").map(|m| m.ino()).ok();
        let h = match (boot.is_empty(), ns) {
            (true, None) => RandomState::new().build_hasher().finish(),
            _ => fnv1a(&[&boot, &ns.unwrap_or(0).to_le_bytes()]),
        };
        format!("{:08x}", h as u32)
    })
}

/// The prefix of every name of `name` with `mark`: `.{name}{mark}` (the name cut to
/// [`MAX_NAME_PREFIX`] bytes).
fn prefix_of(name: &OsStr, mark: &str) -> Vec<u8> {
    let bytes = name.as_bytes();
    let mut prefix = Vec::with_capacity(bytes.len().min(MAX_NAME_PREFIX) + mark.len() + 1);
    prefix.push(b'.');
    prefix.extend_from_slice(&bytes[..bytes.len().min(MAX_NAME_PREFIX)]);
    prefix.extend_from_slice(mark.as_bytes());
    prefix
}

fn fresh_name(dir: &Path, name: &OsStr, mark: &str, attempt: u32) -> PathBuf {
    let mut h = RandomState::new().build_hasher();
    h.write_u32(attempt);
    if let Ok(t) = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    let mut tmp = prefix_of(name, mark);
    tmp.extend_from_slice(format!("{}.{}.{:016x}", std::process::id(), owner_tag(), h.finish()).as_bytes());
    dir.join(OsString::from_vec(tmp))
}

/// A fresh temporary name for `name` in `dir`.
pub(crate) fn temp_name(dir: &Path, name: &OsStr, attempt: u32) -> PathBuf {
    fresh_name(dir, name, TEMP_MARK, attempt)
}

/// What the name of the file kept for its blocks (block reuse) contains after the target's name.
pub(crate) const SPARE_MARK: &str = ".turboio-spare";

/// The name of the file a replacing save of `name` in `dir` keeps for the next save's blocks.
pub(crate) fn spare_name(dir: &Path, name: &OsStr) -> PathBuf {
    dir.join(OsString::from_vec(prefix_of(name, SPARE_MARK)))
}

/// A fresh name for the replaced file of a save of `name` in `dir`, kept until its deletion.
pub(crate) fn retired_name(dir: &Path, name: &OsStr, attempt: u32) -> PathBuf {
    fresh_name(dir, name, RETIRED_MARK, attempt)
}

/// The target name (possibly cut to 200 bytes) a temporary file name, or the
/// name of a replaced file awaiting deletion, belongs to; `None` for other names.
pub fn temp_target(file_name: &OsStr) -> Option<&OsStr> {
    parse(file_name).or_else(|| parse_with(file_name, RETIRED_MARK)).map(|(target, _, _)| target)
}

/// Whether `file_name` names a replaced file awaiting deletion.
fn is_retired(file_name: &OsStr) -> bool {
    parse_with(file_name, RETIRED_MARK).is_some()
}

/// `(target, pid, owner tag)` of a temporary name; the tag is `None` in names written before
/// tags existed (`{pid}.{random}`).
fn parse(file_name: &OsStr) -> Option<(&OsStr, u32, Option<&str>)> {
    parse_with(file_name, TEMP_MARK)
}

fn parse_with<'a>(file_name: &'a OsStr, mark: &str) -> Option<(&'a OsStr, u32, Option<&'a str>)> {
    let bytes = file_name.as_bytes().strip_prefix(b".")?;
    let mark = mark.as_bytes();
    let at = bytes.windows(mark.len()).rposition(|w| w == mark)?;
    let rest = std::str::from_utf8(&bytes[at + mark.len()..]).ok()?;
    let parts: Vec<&str> = rest.split('.').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let pid = parts.first()?.parse::<u32>().ok()?;
    let tag = match parts.as_slice() {
        [_, random] if hex(random, 16) => None,
        [_, tag, random] if hex(tag, 8) && hex(random, 16) => Some(*tag),
        _ => return None,
    };
    Some((OsStr::from_bytes(&bytes[..at]), pid, tag))
}

/// Whether the temporary file at `path` was left by a writer that is gone (see the module
/// docs), or is a replaced file awaiting deletion (always removable). `false` for anything that
/// is not a regular file with such a name, and whenever in doubt.
pub fn abandoned_temp(path: &Path) -> bool {
    let Some(file_name) = path.file_name() else { return false };
    if is_retired(file_name) {
        return fs::symlink_metadata(path).is_ok_and(|m| m.is_file());
    }
    let Some((_, pid, tag)) = parse(file_name) else { return false };
    // O_NONBLOCK: a FIFO given a temporary name must not block the open.
    let Ok(file) =
        OpenOptions::new().read(true).custom_flags((OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK).bits()).open(path)
    else {
        return false;
    };
    let Ok(meta) = file.metadata() else { return false };
    if !meta.is_file() {
        return false;
    }
    let ours = tag == Some(owner_tag());
    let age = meta.modified().ok().and_then(|m| SystemTime::now().duration_since(m).ok()).unwrap_or_default();
    match sys::lock_exclusive(&file, false) {
        // A writer holds it.
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
        // Nobody holds it (the lock goes when `file` closes, right after the caller decides).
        Ok(()) => {
            if ours {
                pid != std::process::id() && !sys::process_exists(pid)
            } else {
                age >= STALE_AFTER
            }
        }
        // No locks here: what this host knows, else a long age.
        Err(_) => (ours && pid != std::process::id() && !sys::process_exists(pid)) || age >= STALE_AFTER_WITHOUT_LOCKS,
    }
}

/// Leftovers (temporary files and second names of replaced files) seen by this process's last
/// scan of each directory it saved into, by the target name they belong to (cut to
/// [`MAX_NAME_PREFIX`] bytes, as in the leftovers' names), and when that scan was made.
type Leftovers = HashMap<PathBuf, (Instant, HashMap<Vec<u8>, Vec<OsString>>)>;

/// How long a scan of a directory stands: the first save into it after this lists it again, so
/// that a long-lived process also removes what writers killed after its last scan left behind.
/// At most one listing a minute per directory: 35 ms among 80,000 files.
pub(crate) const RESCAN_AFTER: Duration = Duration::from_secs(60);

/// Directories remembered at most; past this the memory starts over (a later save into a
/// forgotten directory scans it again: correct, only slower).
const MAX_DIRECTORIES: usize = 4096;

static SCANNED: Mutex<Option<Leftovers>> = Mutex::new(None);
pub(crate) static SCANS: AtomicU64 = AtomicU64::new(0);

/// The leftovers of `dir`, grouped by target, from one listing of it.
fn scan(dir: &Path) -> HashMap<Vec<u8>, Vec<OsString>> {
    SCANS.fetch_add(1, Ordering::Relaxed);
    let mut found: HashMap<Vec<u8>, Vec<OsString>> = HashMap::new();
    let Ok(entries) = fs::read_dir(dir) else { return found };
    for entry in entries.flatten() {
        let n = entry.file_name();
        if let Some(target) = temp_target(&n) {
            found.entry(target.as_bytes().to_vec()).or_default().push(n.clone());
        }
    }
    found
}

/// Removes the abandoned temporary files of `name` in `dir`, and replaced files of earlier
/// saves left by writers killed before deleting them (handed to the background deleter: they
/// may be large). Best effort: a save never fails because of it.
///
/// The directory is listed at the first save into it and then at most once per
/// [`RESCAN_AFTER`]: a save used to list its whole directory each time, 4 ms in an empty
/// directory and 35 ms among 80,000 files, which made saving many files into one directory
/// quadratic. Saves between two listings recheck the leftovers of their name the last listing
/// saw and a live writer still held; leftovers a writer killed after a listing leaves behind
/// are removed by the first save after the next one (in this process or another).
pub(crate) fn remove_abandoned(dir: &Path, name: &OsStr) {
    let key = name.as_bytes()[..name.len().min(MAX_NAME_PREFIX)].to_vec();
    let candidates = {
        let mut scanned = SCANNED.lock().unwrap_or_else(|p| p.into_inner());
        let scanned = scanned.get_or_insert_with(HashMap::new);
        if scanned.get(dir).is_none_or(|(at, _)| at.elapsed() >= RESCAN_AFTER) {
            if scanned.len() >= MAX_DIRECTORIES && !scanned.contains_key(dir) {
                scanned.clear();
            }
            // Listing under the lock: saves into one directory from several threads wait for
            // the one listing instead of each making their own.
            scanned.insert(dir.to_owned(), (Instant::now(), scan(dir)));
        }
        scanned.get_mut(dir).and_then(|(_, d)| d.remove(&key)).unwrap_or_default()
    };
    let (temps, retired) = (prefix_of(name, TEMP_MARK), prefix_of(name, RETIRED_MARK));
    let mut kept = Vec::new();
    for n in candidates {
        // The key groups names cut to the same prefix: only this name's own leftovers.
        if !(n.as_bytes().starts_with(&temps) || n.as_bytes().starts_with(&retired)) {
            kept.push(n);
            continue;
        }
        let path = dir.join(&n);
        if abandoned_temp(&path) {
            if is_retired(&n) {
                crate::retire::delete_later(path);
            } else {
                let _ = fs::remove_file(&path);
            }
        } else if fs::symlink_metadata(&path).is_ok() {
            // A live writer's (or one not stale yet): looked at again by the next save.
            kept.push(n);
        }
    }
    if !kept.is_empty() {
        let mut scanned = SCANNED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, d)) = scanned.as_mut().and_then(|s| s.get_mut(dir)) {
            d.entry(key).or_default().extend(kept);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        let dir = Path::new("/d");
        let p = temp_name(dir, OsStr::new("model.safetensors"), 0);
        let (target, pid, tag) = parse(p.file_name().unwrap()).unwrap();
        assert_eq!((target, pid, tag), (OsStr::new("model.safetensors"), std::process::id(), Some(owner_tag())));
        // Names written before owner tags, and a target that contains the mark itself.
        let old = OsStr::new(".m.bin.turboio-tmp.123.00000000deadbeef");
        assert_eq!(parse(old), Some((OsStr::new("m.bin"), 123, None)));
        let nested = OsStr::new(".a.turboio-tmp.b.turboio-tmp.7.0badc0de.00000000deadbeef");
        assert_eq!(temp_target(nested), Some(OsStr::new("a.turboio-tmp.b")));
        let retired = retired_name(dir, OsStr::new("m.bin"), 3);
        assert!(is_retired(retired.file_name().unwrap()) && parse(retired.file_name().unwrap()).is_none());
        assert_eq!(temp_target(retired.file_name().unwrap()), Some(OsStr::new("m.bin")));
        for not in [
            ".m.bin",
            "m.bin.turboio-tmp.1.00000000deadbeef",
            ".m.turboio-tmp.x.00000000deadbeef",
            ".m.turboio-tmp.1.2",
        ] {
            assert_eq!(parse(OsStr::new(not)), None, "{not}");
        }
        assert_eq!(owner_tag().len(), 8);
    }

    /// The temporary name a writer with `pid` (and this process's owner tag) gives `name`.
    fn temp_of(dir: &Path, name: &str, pid: u32) -> PathBuf {
        dir.join(format!(".{name}{TEMP_MARK}{pid}.{}.00000000deadbeef", owner_tag()))
    }

    #[test]
    fn a_long_lived_process_lists_a_directory_again_after_a_while() {
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path();
        let name = OsStr::new("m.bin");
        // The first save into the directory lists it.
        let before = SCANS.load(Ordering::Relaxed);
        remove_abandoned(dir, name);
        assert!(SCANS.load(Ordering::Relaxed) > before);
        // Then a writer of this host dies mid-save (a process that has exited: its PID is free).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let left = temp_of(dir, "m.bin", dead);
        fs::write(&left, b"partial").unwrap();
        assert!(abandoned_temp(&left), "a dead writer's temporary");
        // A save right after does not list the directory again: the leftover stays ...
        remove_abandoned(dir, name);
        assert!(left.exists());
        // ... until the listing is older than RESCAN_AFTER: the next save lists again and
        // removes it.
        {
            let mut scanned = SCANNED.lock().unwrap();
            let (at, _) = scanned.as_mut().unwrap().get_mut(dir).unwrap();
            *at = Instant::now().checked_sub(RESCAN_AFTER).unwrap();
        }
        remove_abandoned(dir, name);
        assert!(!left.exists(), "the leftover of a writer killed after the first listing is removed");
    }
}
