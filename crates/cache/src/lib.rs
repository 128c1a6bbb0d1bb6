//! turboio's node-local cache: a [`Storage`] wrapper that writes a remote object (an `s3://`,
//! `gs://`, `az://` or `http(s)://` URL) through to a local file **while** it is loaded, so that
//! the bytes fetched once serve both the load and the cache, and every later load of the same
//! object version on the node is a local load (mapped, hot from the page cache).
//!
//! # Keys and versions
//!
//! An entry is keyed by the SHA-256 of the URL (query string and credentials removed), the
//! object's length and its version tag (ETag, and version id where the store keeps versions;
//! [`StorageFile::version`]). The store is asked for the current version (one HEAD request,
//! no bytes) on every open: a replaced object has a new key and is a miss; objects whose
//! backend gives no version (local files, SFCS) pass through uncached. The version the store
//! reported last is recorded (`U-HASH.seen`, whose modification time says when), and used two
//! ways:
//!
//! - **Overlapped** (the default, for loads): an open through [`Storage::open_unconfirmed`]
//!   finds the complete entry of that version and hands it out at once, while the HEAD runs
//!   on a thread of its own; the load reads (or maps) the entry meanwhile, and
//!   [`StorageFile::confirm`], which turboio's loads call after reading and before returning,
//!   waits for the answer. A warm load so costs the longer of the local load and one round
//!   trip, not their sum (a model: its index and all its shards asked at once, not the index
//!   first). If the object was replaced, `confirm` answers [`StorageError::Changed`] and the
//!   load starts again, and reads the new version; if it is gone or the store cannot be
//!   reached, `confirm` gives the store's error, as the open would have. Plain
//!   [`Storage::open`]s (a lazy `safe_open`, ranged reads) ask first, as before.
//! - **Trusted**: with a revalidation interval ([`NodeCache::with_revalidate_after`],
//!   `TURBOIO_CACHE_REVALIDATE`), that version is trusted for that long: a complete entry of it
//!   loads with no request at all (no HEAD, no HTTP client built), as fast as a local file; an
//!   object replaced meanwhile is seen at the end of the interval, unless it was saved or
//!   removed through this cache (any process's), which drops the record at once.
//!
//! # Layout (`dir`)
//!
//! - `KEY.data`: a complete entry, the object's bytes. It appears only by `rename` after its
//!   bytes and the directory have been synced (`fdatasync`), so a reader never sees a partial
//!   file, and nothing that looks complete is left by a `kill -9` or a power loss.
//! - `KEY.json`: what the entry holds (URL, version, length), for `turboio cache ls`.
//! - `KEY.lock`: an exclusive `flock` held by the one process of the node fetching the key
//!   (released by the kernel if that process dies); it names the fetch's part file.
//! - `KEY.PID-N.part`: a fetch in progress.
//!
//! # Who may write the directory
//!
//! A private cache (the default) is used only in a directory this user owns and no other user
//! can write; the cache creates it 0700 if missing, and its files 0600. Another directory (one
//! owned by someone else, or writable by group or others) is refused: the load goes on from the
//! store, with one warning. Every file in the directory is opened without following links
//! (`O_NOFOLLOW`; temporary files with `O_EXCL`), and an entry is served only if it is a regular
//! file of this user. To share one directory between users, set `TURBOIO_CACHE_SHARED=1`
//! ([`NodeCache::with_shared`]): the directory's own permissions then decide who writes it,
//! entries are 0644, and an entry is served only after its bytes match the SHA-256 recorded
//! when it was published (one full read per process and entry: the price of trusting files
//! other users wrote).
//!
//! # Writing through
//!
//! Each chunk a load receives is written to the entry's part file by a writer thread of the
//! load's, while the load goes on with its other requests (the writer is at most
//! 16 chunks behind, and the load returns once it has caught up). A load whose own hook
//! decrypts or converts the chunks in place writes each on the thread that runs that hook, before
//! that hook runs: the entry holds the object's bytes as stored. Chunks at offsets, lengths and
//! addresses aligned to 4 KiB (a load's arenas and staging buffers are page-aligned, and its
//! parts start at aligned offsets: everything but the header and the tail) are written with
//! `O_DIRECT` from the load's memory, so the fill copies nothing into the page cache and takes
//! little CPU from the load; the rest goes through the page cache (its writeback started at
//! once). The entry's bytes are therefore on the disk, not in the page cache: the first later
//! load of it reads the local disk, the following ones the page cache. (Reading it into the
//! page cache right after publication, `posix_fadvise(WILLNEED)`, was measured: it slowed the
//! rest of a model load by 15-20% on the 2-core VM, its shards being published one by one while
//! the others still load.)
//!
//! # One fetch per node
//!
//! A miss takes the key's lock. The process that gets it fetches (the load's own reads, each
//! chunk also written to the part file as above). The others wait while that fetch makes
//! progress and then load the published entry locally. Progress is the part file's
//! modification time, which the fetch moves every second while its load reads (a heartbeat:
//! on a slow store a whole chunk can take longer than the waiters' patience to arrive), as
//! well as with every chunk written; if it stands still for [`STALL`] (the fetch died: its lock
//! is gone; or it read only part of the object and then idles), they load from the store
//! without the cache. A load that reads only part of the object (a tensor subset,
//! one rank's block) publishes nothing, unless what is missing is small (at most 16 MiB and an
//! eighth of the object: a `.pt` file's zip records), which it then fetches when the file is
//! closed.
//!
//! # Limits and eviction
//!
//! A new version of an object, once published, replaces the entries of its older versions
//! (they are removed then, not at the next prune). Entries are used most-recently-first: a
//! hit sets the entry's modification time. Before a
//! fill, least recently used entries are removed until the new object fits both the size limit
//! ([`NodeCache::with_max_bytes`], `TURBOIO_CACHE_MAX_SIZE`) and the file system keeps 5% of its
//! size free; an object that cannot fit is loaded without the cache. Removing an entry unlinks
//! it: loads that have it open or mapped keep reading it.
//!
//! # Errors
//!
//! The cache never fails a load: a cache directory that cannot be written, a full disk or a
//! failed rename is reported once per process on standard error and the load goes on from
//! the store. Errors of the store itself are the store's.
#![deny(missing_docs)]
#![deny(unsafe_code)]

mod entries;
mod fill;
mod ranges;
#[allow(unsafe_code)]
mod sys;
#[cfg(feature = "testing")]
pub mod testing;

pub use entries::{parse_interval, parse_size, Entry, NodeCache, PruneReport};

use entries::{Locking, Slot};
use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, Instant, SystemTime};
use turboio_io_posix::PosixStorage;
use turboio_storage::{
    DeviceWriteRequest, IoOptions, RangeReader, ReadRequest, Result, Storage, StorageError, StorageFile, Version,
    WriteSource,
};

/// The environment variable naming the cache directory (unset or empty: no cache).
pub const ENV_DIR: &str = "TURBOIO_CACHE_DIR";
/// The environment variable bounding its size (`500G`, `2TiB`, bytes).
pub const ENV_MAX_SIZE: &str = "TURBOIO_CACHE_MAX_SIZE";
/// The environment variable setting how long a version the store reported is trusted
/// (`300`, `5m`; unset or 0: the store is asked on every open).
pub const ENV_REVALIDATE: &str = "TURBOIO_CACHE_REVALIDATE";
/// The environment variable that shares the cache between users (`1`; see
/// [`NodeCache::with_shared`]).
pub const ENV_SHARED: &str = "TURBOIO_CACHE_SHARED";
/// How long a waiting process waits for a fetch of the same object that writes nothing.
pub const STALL: Duration = Duration::from_secs(5);
/// How often a waiting process looks at the fetch it waits for.
const POLL: Duration = Duration::from_millis(10);

/// A remote backend with a node-local cache in front of it. Reads go through the cache; saves,
/// listings and removals go straight to the backend.
#[derive(Clone)]
pub struct CacheStorage {
    inner: Arc<dyn Storage>,
    cache: NodeCache,
    local: PosixStorage,
}

impl fmt::Debug for CacheStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CacheStorage").field("inner", &self.inner).field("cache", &self.cache).finish()
    }
}

impl CacheStorage {
    /// `inner` with `cache` in front of it.
    pub fn new(inner: Arc<dyn Storage>, cache: NodeCache) -> CacheStorage {
        CacheStorage { inner, cache, local: PosixStorage::new() }
    }

    /// The cache.
    pub fn cache(&self) -> &NodeCache {
        &self.cache
    }

    /// The backend behind it.
    pub fn inner(&self) -> &Arc<dyn Storage> {
        &self.inner
    }

    /// The complete entry for `version` of `path`, opened, its use recorded; `None` on a miss.
    /// Only a regular file (never a link) of this user in a private cache; in a shared one,
    /// only bytes that match the hash recorded at publication.
    fn hit(&self, path: &Path, slot: &Slot, version: &Version) -> Option<Box<Hit>> {
        use std::os::unix::fs::MetadataExt;
        let data = slot.data();
        let named = match std::fs::symlink_metadata(&data) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                warn(&self.cache, &format!("opening {}: {e}", data.display()));
                return None;
            }
        };
        if !named.is_file() {
            warn(&self.cache, &format!("{} is not a regular file: not served", data.display()));
            return None;
        }
        let file = match self.local.open_posix(&data) {
            Ok(f) => f,
            Err(e) if e.is_not_found() => return None,
            Err(e) => {
                warn(&self.cache, &format!("opening {}: {e}", data.display()));
                return None;
            }
        };
        let opened = file.local_file().and_then(|f| f.metadata().ok());
        let Some(opened) = opened.filter(|m| m.dev() == named.dev() && m.ino() == named.ino()) else {
            return None; // replaced between the two looks: a miss
        };
        if !self.cache.shared() && opened.uid() != nix::unistd::geteuid().as_raw() {
            warn(
                &self.cache,
                &format!("{} belongs to uid {}, not to this user: not served", data.display(), opened.uid()),
            );
            return None;
        }
        if file.len() != version.len {
            // Cannot be written by this crate (the length is part of the key): not ours to use.
            warn(&self.cache, &format!("{} has {} bytes, not {}", data.display(), file.len(), version.len));
            return None;
        }
        if self.cache.shared() && !verified(slot, file.local_file()?, &opened) {
            warn(&self.cache, &format!("{}: its bytes do not match the hash recorded at publication", data.display()));
            return None;
        }
        if let Some(f) = file.local_file() {
            let _ = f.set_modified(SystemTime::now());
        }
        Some(Box::new(Hit { url: path.to_owned(), tag: version.tag.clone(), file: Box::new(file), check: None }))
    }

    /// Publishes `bytes`, obtained some other way (a replicated load: the pieces came from other
    /// ranks), as the entry of `path` at `version`, atomically as a fill would. The caller
    /// vouches that `bytes` are that version's; their length must be `version.len`. True if
    /// the entry was written; false if it exists already, another process is filling it, or
    /// the cache cannot take it (then reported once on standard error, as for fills).
    pub fn insert(&self, path: &Path, version: &Version, bytes: &[u8]) -> bool {
        use std::os::unix::fs::FileExt;
        let Some(url) = path.to_str() else { return false };
        if bytes.len() as u64 != version.len {
            return false;
        }
        if let Err(e) = self.cache.check_dir() {
            warn(&self.cache, &e.to_string());
            return false;
        }
        let slot = self.cache.slot(NodeCache::key(url, version));
        if self.hit(path, &slot, version).is_some() {
            return false;
        }
        let mut lock = match slot.try_lock() {
            Ok(Locking::Held(lock)) => lock,
            Ok(Locking::Busy) => return false,
            Err(e) => {
                warn(&self.cache, &format!("locking an entry in {}: {e}", self.cache.dir().display()));
                return false;
            }
        };
        if slot.data().exists() || !self.cache.make_room(version.len, &slot.key) {
            return false;
        }
        let (part_path, part) = match slot.start_part(&mut lock) {
            Ok(made) => made,
            Err(e) => {
                warn(&self.cache, &format!("writing {}: {e}", slot.data().display()));
                return false;
            }
        };
        let result = part.write_all_at(bytes, 0).and_then(|()| {
            fill::publish_part(&slot, &part, &part_path, &entries::clean_url(url), &version.tag, version.len)
        });
        drop(lock);
        match result {
            Ok(()) => {
                self.cache.drop_superseded(&entries::clean_url(url), &slot.key);
                self.cache.enforce_limit(&slot.key);
                true
            }
            Err(e) => {
                let _ = std::fs::remove_file(&part_path);
                warn(&self.cache, &format!("writing {}: {e}", slot.data().display()));
                false
            }
        }
    }

    /// Opens `path` through the cache; `unconfirmed`: the caller confirms what it read
    /// ([`Storage::open_unconfirmed`]), so a complete entry of the version seen last can be
    /// handed out while the store is asked whether it is still current.
    fn open_through(
        &self,
        path: &Path,
        cancel: Option<&AtomicBool>,
        unconfirmed: bool,
    ) -> Result<Box<dyn StorageFile>> {
        let Some(url) = path.to_str() else { return self.inner.open_cancellable(path, cancel) };
        if let Err(e) = self.cache.check_dir() {
            warn(&self.cache, &e.to_string());
            return self.inner.open_cancellable(path, cancel);
        }
        if let Some((version, age)) = self.cache.last_seen(url) {
            let slot = self.cache.slot(NodeCache::key(url, &version));
            if self.cache.trusts(age) {
                // Within the revalidation interval, the version the store reported last is
                // trusted: a complete entry of it loads without a request.
                if let Some(f) = self.hit(path, &slot, &version) {
                    return Ok(f);
                }
            } else if unconfirmed {
                // Its entry is read while a HEAD asks the store whether it is still current;
                // the caller's `confirm` waits for the answer.
                if let Some(mut f) = self.hit(path, &slot, &version) {
                    if let Some(check) = Check::start(self.inner.clone(), self.cache.clone(), path, version) {
                        f.check = Some(check);
                        return Ok(f);
                    }
                }
            }
        }
        let Some(version) = self.inner.current_version(path)? else {
            return self.inner.open_cancellable(path, cancel);
        };
        self.cache.saw(url, &version);
        let slot = self.cache.slot(NodeCache::key(url, &version));
        if let Some(f) = self.hit(path, &slot, &version) {
            return Ok(f);
        }
        let mut last = (Instant::now(), None);
        loop {
            if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                return Err(StorageError::Cancelled);
            }
            if filled_by_this_thread(&slot.key) {
                // A second open of an object this thread is filling (waiting would wait on itself).
                return self.inner.open_cancellable(path, cancel);
            }
            let lock = match slot.try_lock() {
                Ok(Locking::Held(lock)) => lock,
                Ok(Locking::Busy) => {
                    // Another process (or thread) fetches it: wait while it makes progress.
                    let progress = slot.progress();
                    if progress != last.1 {
                        last = (Instant::now(), progress);
                    } else if last.0.elapsed() >= STALL {
                        return self.inner.open_cancellable(path, cancel);
                    }
                    std::thread::sleep(POLL);
                    if let Some(f) = self.hit(path, &slot, &version) {
                        return Ok(f);
                    }
                    continue;
                }
                Err(e) => {
                    warn(&self.cache, &format!("locking an entry in {}: {e}", self.cache.dir().display()));
                    return self.inner.open_cancellable(path, cancel);
                }
            };
            if let Some(f) = self.hit(path, &slot, &version) {
                return Ok(f);
            }
            let file = self.inner.open_cancellable(path, cancel)?;
            let tag = file.version();
            if tag.as_deref() != Some(version.tag.as_str()) || file.len() != version.len {
                // Replaced between the HEAD and the GET: this load reads the new version uncached.
                return Ok(file);
            }
            if !self.cache.make_room(version.len, &slot.key) {
                return Ok(file);
            }
            let clean = entries::clean_url(url);
            return match fill::Filling::start(file, clean, version.tag.clone(), slot, self.cache.clone(), lock) {
                Ok(f) => Ok(Box::new(f)),
                Err((file, e)) => {
                    warn(&self.cache, &format!("starting an entry in {}: {e}", self.cache.dir().display()));
                    Ok(file)
                }
            };
        }
    }
}

impl Storage for CacheStorage {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn open(&self, path: &Path) -> Result<Box<dyn StorageFile>> {
        self.open_through(path, None, false)
    }

    fn open_cancellable(&self, path: &Path, cancel: Option<&AtomicBool>) -> Result<Box<dyn StorageFile>> {
        self.open_through(path, cancel, false)
    }

    fn open_unconfirmed(&self, path: &Path, cancel: Option<&AtomicBool>) -> Result<Box<dyn StorageFile>> {
        self.open_through(path, cancel, true)
    }

    fn write_file(&self, path: &Path, source: &dyn WriteSource, opts: &IoOptions<'_>) -> Result<()> {
        let r = self.inner.write_file(path, source, opts);
        self.forget(path);
        r
    }

    fn writes_from_device(&self, kind: &str) -> bool {
        self.inner.writes_from_device(kind)
    }

    fn write_file_from_device(
        &self,
        path: &Path,
        source: &dyn WriteSource,
        device: &[DeviceWriteRequest],
        opts: &IoOptions<'_>,
    ) -> Result<()> {
        let r = self.inner.write_file_from_device(path, source, device, opts);
        self.forget(path);
        r
    }

    fn list(&self, dir: &Path) -> Result<Vec<std::path::PathBuf>> {
        self.inner.list(dir)
    }

    fn remove_file(&self, path: &Path) -> Result<()> {
        let r = self.inner.remove_file(path);
        self.forget(path);
        r
    }

    fn current_version(&self, path: &Path) -> Result<Option<Version>> {
        self.inner.current_version(path)
    }
}

impl CacheStorage {
    /// A save or a removal of `path` went through the cache (whether it succeeded or not, the
    /// object may have changed): the version recorded for it is no longer trusted, so this
    /// process, like any other, loads what the store now holds.
    fn forget(&self, path: &Path) {
        if let Some(url) = path.to_str() {
            self.cache.forget(url);
        }
    }
}

/// A complete entry, read as a local file under the object's URL.
#[derive(Debug)]
struct Hit {
    url: std::path::PathBuf,
    tag: String,
    file: Box<dyn StorageFile>,
    /// Opened before the store confirmed the version: the check in flight.
    check: Option<Check>,
}

/// A HEAD asking the store whether the version of an entry handed out is still current, on a
/// thread of its own, so that it overlaps the reading of the entry.
#[derive(Debug)]
struct Check {
    url: std::path::PathBuf,
    expected: Version,
    state: Mutex<Checked>,
}

#[derive(Debug)]
enum Checked {
    InFlight(std::thread::JoinHandle<Result<Option<Version>>>),
    Current,
    /// The answer (a changed version, or the store's error), already given once.
    Answered(String),
}

impl Check {
    /// The check started; `None` if no thread could be started for it (the open then asks
    /// the store itself, first).
    fn start(inner: Arc<dyn Storage>, cache: NodeCache, path: &Path, expected: Version) -> Option<Check> {
        let url = path.to_owned();
        let asked = url.clone();
        let thread = std::thread::Builder::new().name("turboio-revalidate".into()).spawn(move || {
            let current = inner.current_version(&asked)?;
            if let (Some(v), Some(u)) = (&current, asked.to_str()) {
                cache.saw(u, v);
            }
            Ok(current)
        });
        let handle = thread.ok()?;
        Some(Check { url, expected, state: Mutex::new(Checked::InFlight(handle)) })
    }

    /// The store's answer: `Ok` if the version handed out is current.
    fn wait(&self) -> Result<()> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let answered = match std::mem::replace(&mut *state, Checked::Current) {
            Checked::Current => return Ok(()),
            Checked::Answered(message) => {
                *state = Checked::Answered(message.clone());
                return Err(StorageError::Changed { path: self.url.clone(), message });
            }
            Checked::InFlight(handle) => handle.join().unwrap_or_else(|_| {
                Err(StorageError::Io {
                    path: self.url.clone(),
                    op: "ask for the current version",
                    source: std::io::Error::other("the request's thread panicked"),
                })
            }),
        };
        let message = match answered {
            Ok(Some(v)) if v == self.expected => return Ok(()),
            Ok(Some(v)) => format!(
                "the node cache's copy is version {} ({} bytes), the store now has {} ({} bytes)",
                self.expected.tag, self.expected.len, v.tag, v.len
            ),
            Ok(None) => "the store no longer reports a version for it".to_owned(),
            Err(e) => {
                // The store's own error (the object is gone, the store cannot be reached) is
                // what an open would have answered; later calls only say it was not confirmed.
                *state = Checked::Answered(format!("not confirmed: {e}"));
                return Err(e);
            }
        };
        *state = Checked::Answered(message.clone());
        Err(StorageError::Changed { path: self.url.clone(), message })
    }
}

impl StorageFile for Hit {
    fn served_by(&self) -> Option<&'static str> {
        Some("node cache: hit")
    }

    fn path(&self) -> &Path {
        &self.url
    }

    fn len(&self) -> u64 {
        self.file.len()
    }

    fn reader(&self) -> Result<Box<dyn RangeReader + '_>> {
        self.file.reader()
    }

    fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.file.read_exact_at(offset, dst)
    }

    fn read_ranges(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<()> {
        self.file.read_ranges(requests, opts)
    }

    fn read_ranges_reported(
        &self,
        requests: Vec<ReadRequest<'_>>,
        opts: &IoOptions<'_>,
    ) -> Result<turboio_storage::ReadInfo> {
        self.file.read_ranges_reported(requests, opts)
    }

    fn local_file(&self) -> Option<&std::fs::File> {
        self.file.local_file()
    }

    fn cached_fraction(&self) -> Option<f64> {
        self.file.cached_fraction()
    }

    fn version(&self) -> Option<String> {
        Some(self.tag.clone())
    }

    fn confirm(&self) -> Result<()> {
        match &self.check {
            Some(check) => check.wait(),
            None => Ok(()),
        }
    }
}

/// Keys being filled by this process, and by which thread.
fn fills() -> std::sync::MutexGuard<'static, HashMap<String, ThreadId>> {
    static FILLS: std::sync::OnceLock<Mutex<HashMap<String, ThreadId>>> = std::sync::OnceLock::new();
    FILLS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner())
}

fn filled_by_this_thread(key: &str) -> bool {
    fills().get(key) == Some(&std::thread::current().id())
}

pub(crate) fn filling_here(key: &str, on: bool) {
    if on {
        fills().insert(key.to_owned(), std::thread::current().id());
    } else {
        fills().remove(key);
    }
}

/// The identity of a file checked once: its inode with what changes whenever another file
/// takes its place (a new file may get a deleted one's inode number back, at once on ext4).
type FileIdentity = (u64, u64, Option<u32>, u64, (i64, i64), (i64, i64));

/// True if the bytes of a shared cache's entry match the hash recorded at its publication
/// (each file checked once per process: entries are never rewritten in place, a new version
/// is a new file). A file is known by its inode number, its generation, its size and its
/// change and modification times, so that a file planted in place of a checked one is checked
/// too, even when it got the same inode number.
fn verified(slot: &Slot, file: &std::fs::File, md: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    static DONE: Mutex<Vec<FileIdentity>> = Mutex::new(Vec::new());
    let id: FileIdentity = (
        md.dev(),
        md.ino(),
        sys::generation(file),
        md.size(),
        (md.ctime(), md.ctime_nsec()),
        (md.mtime(), md.mtime_nsec()),
    );
    if DONE.lock().unwrap_or_else(|p| p.into_inner()).contains(&id) {
        return true;
    }
    let ok = match (slot.recorded_sha256(), entries::sha256_of(file)) {
        (Some(want), Ok(got)) => want == got,
        _ => false,
    };
    if ok {
        let mut done = DONE.lock().unwrap_or_else(|p| p.into_inner());
        if done.len() >= 4096 {
            done.clear();
        }
        done.push(id);
    }
    ok
}

/// Reports a cache problem once per process and directory (the load goes on without it).
pub(crate) fn warn(cache: &NodeCache, what: &str) {
    static SEEN: Mutex<Vec<std::path::PathBuf>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if !seen.iter().any(|d| d == cache.dir()) {
        seen.push(cache.dir().to_owned());
        eprintln!("turboio: node cache {}: {what}; loading without it", cache.dir().display());
    }
}
