//! The cache directory: its entries, their keys and locks, listing, eviction.

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use turboio_storage::Version;

/// A node-local cache directory (see the crate docs for its layout and rules).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeCache {
    dir: PathBuf,
    max_bytes: Option<u64>,
    revalidate_after: Option<Duration>,
    shared: bool,
}

/// One complete entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The entry's key (hex SHA-256 of URL, length and version).
    pub key: String,
    /// The URL it holds, without query string or credentials.
    pub url: String,
    /// The object's version tag (ETag and version id).
    pub version: String,
    /// Bytes.
    pub len: u64,
    /// When a load last used it (or filled it).
    pub last_used: SystemTime,
    /// The local file holding the object's bytes.
    pub path: PathBuf,
}

/// What [`NodeCache::prune`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PruneReport {
    /// Complete entries removed.
    pub removed: usize,
    /// Their bytes.
    pub freed: u64,
    /// Files of fetches that died before finishing, removed.
    pub stale_parts: usize,
}

/// The process that writes the temporary record `name` (`KEY.PID.json.tmp`,
/// `U-HASH.PID-N.tmp`), if the name is one of those.
fn tmp_writer(name: &str) -> Option<i32> {
    let rest = name.strip_suffix(".tmp")?.split_once('.')?.1;
    rest.split(['.', '-']).next()?.parse().ok()
}

/// True if a process `pid` exists (a reused number counts as alive: its record is kept).
fn process_alive(pid: i32) -> bool {
    !matches!(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None), Err(nix::errno::Errno::ESRCH))
}

/// `U-HASH.seen`: the version of a URL the store last reported, and (its modification time)
/// when: what a load within the revalidation interval trusts instead of asking again.
#[derive(Serialize, Deserialize)]
struct Seen {
    tag: String,
    len: u64,
    /// The entry's key.
    key: String,
}

#[derive(Serialize, Deserialize)]
struct Meta {
    url: String,
    version: String,
    len: u64,
    /// Hex SHA-256 of the entry's bytes, recorded at publication in a shared cache (verified
    /// before a hit is served there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sha256: Option<String>,
}

/// Opens `path` in a cache directory without following a symbolic link at it (`O_NOFOLLOW`: a
/// link planted there must not make this process read or write the file it points to), and
/// refuses what is not a regular file, or (in a private cache) a file of another user.
/// `create`: `Some(true)` creates it new (`O_EXCL`), `Some(false)` creates it if missing;
/// created files get mode 0600 (0644 in a shared cache).
pub(crate) fn open_entry_file(path: &Path, write: bool, create: Option<bool>, shared: bool) -> io::Result<File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let mut o = OpenOptions::new();
    o.read(true).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).mode(if shared { 0o644 } else { 0o600 });
    if write {
        o.write(true);
    }
    match create {
        Some(true) => {
            o.write(true).create_new(true);
        }
        Some(false) => {
            o.write(true).create(true);
        }
        None => {}
    }
    let file = o.open(path).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) => {
            io::Error::new(io::ErrorKind::PermissionDenied, format!("{} is a symbolic link: refused", path.display()))
        }
        _ => e,
    })?;
    let md = file.metadata()?;
    if !md.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{} is not a regular file", path.display()),
        ));
    }
    if !shared && md.uid() != nix::unistd::geteuid().as_raw() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{} belongs to uid {}, not to this user: refused in a private cache", path.display(), md.uid()),
        ));
    }
    Ok(file)
}

/// Hex SHA-256 of a file's bytes.
pub(crate) fn sha256_of(file: &File) -> io::Result<String> {
    use std::os::unix::fs::FileExt;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 8 << 20];
    let mut at = 0u64;
    loop {
        let n = file.read_at(&mut buf, at)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        at += n as u64;
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The files of one key: `KEY.data` (complete, published by rename), `KEY.json` (what it holds),
/// `KEY.lock` (held by the one process fetching it; names that fetch's part file),
/// `KEY.PID-N.part` (a fetch in progress).
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    pub(crate) key: String,
    pub(crate) dir: PathBuf,
    /// The cache is shared between users (see [`NodeCache::with_shared`]).
    pub(crate) shared: bool,
}

/// An exclusive hold on a key: the one fetch of it on this node.
pub(crate) type KeyLock = Flock<File>;

/// Whether a key could be locked.
pub(crate) enum Locking {
    Held(KeyLock),
    Busy,
}

const SUFFIX_DATA: &str = ".data";
const SUFFIX_META: &str = ".json";
const SUFFIX_LOCK: &str = ".lock";
const SUFFIX_PART: &str = ".part";
const SUFFIX_SEEN: &str = ".seen";

impl Slot {
    pub(crate) fn data(&self) -> PathBuf {
        self.dir.join(format!("{}{SUFFIX_DATA}", self.key))
    }

    pub(crate) fn meta(&self) -> PathBuf {
        self.dir.join(format!("{}{SUFFIX_META}", self.key))
    }

    fn lock_path(&self) -> PathBuf {
        self.dir.join(format!("{}{SUFFIX_LOCK}", self.key))
    }

    /// A part file name of this process's own, so two fetchers never write one file.
    pub(crate) fn new_part(&self) -> PathBuf {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        self.dir.join(format!("{}.{}-{n}{SUFFIX_PART}", self.key, std::process::id()))
    }

    /// Takes the key's lock without waiting (creating the directory and the lock file).
    pub(crate) fn try_lock(&self) -> io::Result<Locking> {
        let file = open_entry_file(&self.lock_path(), true, Some(false), self.shared)?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(Locking::Held(lock)),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(Locking::Busy),
            Err((_, e)) => Err(io::Error::from(e)),
        }
    }

    /// Writes the part file's name into the held lock file, for waiters to watch its progress.
    pub(crate) fn announce(lock: &mut KeyLock, part: &Path) -> io::Result<()> {
        lock.set_len(0)?;
        use std::os::unix::fs::FileExt;
        lock.write_all_at(part.as_os_str().as_encoded_bytes(), 0)
    }

    /// Starts this process's part file under the held `lock`: the parts of fetches that died
    /// removed, a new one created and named in the lock file for waiters.
    pub(crate) fn start_part(&self, lock: &mut KeyLock) -> io::Result<(PathBuf, File)> {
        self.remove_parts();
        let path = self.new_part();
        let made = open_entry_file(&path, true, Some(true), self.shared)
            .and_then(|part| Slot::announce(lock, &path).map(|()| part));
        match made {
            Ok(part) => Ok((path, part)),
            Err(e) => {
                let _ = fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// When the fetch holding the lock last wrote a byte (its part file's modification time).
    pub(crate) fn progress(&self) -> Option<SystemTime> {
        let mut name = Vec::new();
        open_entry_file(&self.lock_path(), false, None, self.shared).ok()?.read_to_end(&mut name).ok()?;
        let part = PathBuf::from(String::from_utf8(name).ok()?);
        fs::metadata(part).ok()?.modified().ok()
    }

    /// Removes part files of this key; only called while holding its lock (so no fetch of it is
    /// running).
    pub(crate) fn remove_parts(&self) -> usize {
        let prefix = format!("{}.", self.key);
        let mut removed = 0;
        for name in dir_names(&self.dir) {
            if name.starts_with(&prefix) && name.ends_with(SUFFIX_PART) && fs::remove_file(self.dir.join(&name)).is_ok()
            {
                removed += 1;
            }
        }
        removed
    }

    /// The content hash recorded for the entry (shared caches), if any.
    pub(crate) fn recorded_sha256(&self) -> Option<String> {
        let mut body = Vec::new();
        open_entry_file(&self.meta(), false, None, self.shared).ok()?.read_to_end(&mut body).ok()?;
        serde_json::from_slice::<Meta>(&body).ok()?.sha256
    }

    /// Records what the entry holds, atomically.
    pub(crate) fn write_meta(&self, url: &str, version: &str, len: u64, sha256: Option<String>) -> io::Result<()> {
        let meta = Meta { url: url.to_owned(), version: version.to_owned(), len, sha256 };
        let tmp = self.dir.join(format!("{}.{}{SUFFIX_META}.tmp", self.key, std::process::id()));
        let _ = fs::remove_file(&tmp); // one a killed process of this pid left
        let mut f = open_entry_file(&tmp, true, Some(true), self.shared)?;
        f.write_all(&serde_json::to_vec(&meta).map_err(io::Error::other)?)?;
        f.sync_data()?;
        fs::rename(&tmp, self.meta()).inspect_err(|_| {
            let _ = fs::remove_file(&tmp);
        })
    }
}

fn dir_names(dir: &Path) -> Vec<String> {
    match fs::read_dir(dir) {
        Ok(rd) => rd.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect(),
        Err(_) => Vec::new(),
    }
}

/// The URL as a cache records it: no query string or fragment (presigned URLs carry secrets
/// there) and no user or password.
pub(crate) fn clean_url(url: &str) -> String {
    let end = url.find(['?', '#']).unwrap_or(url.len());
    let url = &url[..end];
    match url.find("://") {
        Some(i) => {
            let rest = &url[i + 3..];
            let authority_end = rest.find('/').unwrap_or(rest.len());
            match rest[..authority_end].rfind('@') {
                Some(at) => format!("{}{}", &url[..i + 3], &rest[at + 1..]),
                None => url.to_owned(),
            }
        }
        None => url.to_owned(),
    }
}

impl NodeCache {
    /// A cache in `dir` (created on first use), without a size limit.
    pub fn new(dir: impl Into<PathBuf>) -> NodeCache {
        NodeCache { dir: dir.into(), max_bytes: None, revalidate_after: None, shared: false }
    }

    /// Shares the cache between the users of the node (`TURBOIO_CACHE_SHARED=1`). A private
    /// cache (the default) is used only in a directory this user owns that no other user can
    /// write (created 0700 if missing), and uses only files of this user; its entries are
    /// 0600. A shared one takes a directory others write too (its permissions, set up by
    /// whoever shares it, decide who), makes entries 0644, and serves an entry only after its
    /// bytes match the SHA-256 recorded when it was published (a full read of the entry per
    /// process that first uses it, at SHA-256's speed: the price of trusting other users'
    /// files).
    pub fn with_shared(mut self, shared: bool) -> NodeCache {
        self.shared = shared;
        self
    }

    /// True for a cache shared between users ([`with_shared`](Self::with_shared)).
    pub fn shared(&self) -> bool {
        self.shared
    }

    /// Makes the directory if missing (0700; 02770 when shared) and checks that it may be used:
    /// a private cache's must belong to this user and be writable by nobody else. The error
    /// says why not (the load then goes on without the cache).
    pub(crate) fn check_dir(&self) -> io::Result<()> {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        if fs::symlink_metadata(&self.dir).is_err() {
            if let Some(parent) = self.dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                fs::create_dir_all(parent)?;
            }
            match fs::DirBuilder::new().mode(if self.shared { 0o2770 } else { 0o700 }).create(&self.dir) {
                Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
                _ => {}
            }
        }
        if self.shared {
            return Ok(());
        }
        let md = fs::metadata(&self.dir)?;
        let me = nix::unistd::geteuid().as_raw();
        let why = if !md.is_dir() {
            Some("is not a directory".to_owned())
        } else if md.uid() != me {
            Some(format!("belongs to uid {}, not to this user (uid {me})", md.uid()))
        } else if md.mode() & 0o022 != 0 {
            Some(format!("is writable by other users (mode {:o})", md.mode() & 0o7777))
        } else {
            None
        };
        match why {
            None => Ok(()),
            Some(why) => Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{why}: not used as a private cache (another user could plant entries or links in it); use a \
                     directory of your own, or set {}=1 to share one between users",
                    crate::ENV_SHARED
                ),
            )),
        }
    }

    /// Trusts the version the store reported for a URL for `interval` after asking (the
    /// entry then loads without a request to the store: no HEAD, no client built); `None` (the
    /// default) or zero asks on every open. An object replaced within the interval is loaded
    /// in its cached version until the interval ends: for immutable or versioned objects, or
    /// where a few minutes of staleness are acceptable.
    pub fn with_revalidate_after(mut self, interval: Option<Duration>) -> NodeCache {
        self.revalidate_after = interval.filter(|d| !d.is_zero());
        self
    }

    /// The revalidation interval, if any ([`with_revalidate_after`](Self::with_revalidate_after)).
    pub fn revalidate_after(&self) -> Option<Duration> {
        self.revalidate_after
    }

    fn seen_path(&self, url: &str) -> PathBuf {
        let hex = sha256_hex(&format!("turboio-cache-url-1\n{}", clean_url(url)));
        self.dir.join(format!("U-{hex}{SUFFIX_SEEN}"))
    }

    /// The version the store reported for `url` last, and how long ago.
    pub(crate) fn last_seen(&self, url: &str) -> Option<(Version, Duration)> {
        let path = self.seen_path(url);
        let mut f = open_entry_file(&path, false, None, self.shared).ok()?;
        let age = f.metadata().ok()?.modified().ok()?.elapsed().unwrap_or_default();
        let mut body = Vec::new();
        f.read_to_end(&mut body).ok()?;
        let seen: Seen = serde_json::from_slice(&body).ok()?;
        Some((Version { len: seen.len, tag: seen.tag }, age))
    }

    /// True if `age` is within the revalidation interval (a version seen that long ago is
    /// trusted without asking the store).
    pub(crate) fn trusts(&self, age: Duration) -> bool {
        self.revalidate_after.is_some_and(|interval| age < interval)
    }

    /// Drops the record of `url`'s version (a save or a removal through the cache changed the
    /// object): the next open asks the store, whatever the revalidation interval.
    pub(crate) fn forget(&self, url: &str) {
        let _ = fs::remove_file(self.seen_path(url));
    }

    /// Records that the store reported `version` for `url` now: what the next open trusts
    /// within the revalidation interval, and otherwise opens at once while it asks the store
    /// again. Written when the version changes, and (to restart the interval) on every report
    /// when an interval is set. Atomic (a reader sees the old record or the new one); a
    /// failure only means the next open asks the store before reading.
    pub(crate) fn saw(&self, url: &str, version: &Version) {
        let path = self.seen_path(url);
        if self.revalidate_after.is_none() {
            let mut body = Vec::new();
            let same = open_entry_file(&path, false, None, self.shared)
                .and_then(|mut f| f.read_to_end(&mut body))
                .ok()
                .and_then(|_| serde_json::from_slice::<Seen>(&body).ok())
                .is_some_and(|s| s.tag == version.tag && s.len == version.len);
            if same {
                return;
            }
        }
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("{}-{n}.tmp", std::process::id()));
        let seen = Seen { tag: version.tag.clone(), len: version.len, key: NodeCache::key(url, version) };
        let body = serde_json::to_vec(&seen).unwrap_or_default();
        let written = open_entry_file(&tmp, true, Some(true), self.shared)
            .and_then(|mut f| f.write_all(&body))
            .and_then(|()| fs::rename(&tmp, &path));
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
    }

    /// Bounds the bytes of complete entries: least recently used entries are removed to stay
    /// within it, and an object larger than the limit is not cached.
    pub fn with_max_bytes(mut self, max_bytes: Option<u64>) -> NodeCache {
        self.max_bytes = max_bytes;
        self
    }

    /// The cache of the environment: `TURBOIO_CACHE_DIR` (none if unset or empty),
    /// `TURBOIO_CACHE_MAX_SIZE` (bytes, or with a unit: `500GiB`, `2TB`, ...; see [`parse_size`])
    /// and `TURBOIO_CACHE_REVALIDATE` (an interval: `300`, `90s`, `5m`, `1h`; see
    /// [`parse_interval`]).
    pub fn from_env() -> Result<Option<NodeCache>, String> {
        let Some(dir) = std::env::var_os(crate::ENV_DIR).filter(|d| !d.is_empty()) else { return Ok(None) };
        let max = match std::env::var(crate::ENV_MAX_SIZE) {
            Ok(v) if !v.trim().is_empty() => {
                Some(parse_size(&v).map_err(|e| format!("{}={v:?}: {e}", crate::ENV_MAX_SIZE))?)
            }
            _ => None,
        };
        Ok(Some(
            NodeCache::new(dir).with_max_bytes(max).with_revalidate_after(env_revalidate()?).with_shared(env_shared()?),
        ))
    }

    /// The cache a caller configured: `dir` (else `TURBOIO_CACHE_DIR`; none if neither) bounded
    /// by `max_bytes` (else `TURBOIO_CACHE_MAX_SIZE`), revalidating after `revalidate` (else
    /// `TURBOIO_CACHE_REVALIDATE`). For options given beside the environment (the CLI's
    /// `--cache-dir`, Python's `cache_dir=`).
    pub fn configured(
        dir: Option<PathBuf>,
        max_bytes: Option<u64>,
        revalidate: Option<Duration>,
    ) -> Result<Option<NodeCache>, String> {
        let env = NodeCache::from_env()?;
        let max = max_bytes.or(env.as_ref().and_then(|c| c.max_bytes));
        let revalidate = match revalidate {
            Some(r) => Some(r),
            None => env_revalidate()?,
        };
        let shared = env_shared()?;
        Ok(dir
            .or(env.map(|c| c.dir))
            .map(|d| NodeCache::new(d).with_max_bytes(max).with_revalidate_after(revalidate).with_shared(shared)))
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The size limit, if any.
    pub fn max_bytes(&self) -> Option<u64> {
        self.max_bytes
    }

    /// The key of an object: hex SHA-256 of its cleaned URL, its length and its version tag.
    pub fn key(url: &str, version: &Version) -> String {
        sha256_hex(&format!("turboio-cache-1\n{}\n{}\n{}", clean_url(url), version.len, version.tag))
    }

    pub(crate) fn slot(&self, key: String) -> Slot {
        Slot { key, dir: self.dir.clone(), shared: self.shared }
    }

    /// The complete entries, most recently used first. A missing directory has none.
    pub fn entries(&self) -> io::Result<Vec<Entry>> {
        let names = match fs::read_dir(&self.dir) {
            Ok(rd) => rd.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect::<Vec<_>>(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut out = Vec::new();
        for name in names {
            let Some(key) = name.strip_suffix(SUFFIX_DATA) else { continue };
            let slot = self.slot(key.to_owned());
            let Ok(md) = fs::metadata(slot.data()) else { continue };
            let meta: Option<Meta> = fs::read(slot.meta()).ok().and_then(|b| serde_json::from_slice(&b).ok());
            let (url, version) = meta.map(|m| (m.url, m.version)).unwrap_or_default();
            out.push(Entry {
                key: key.to_owned(),
                url,
                version,
                len: md.len(),
                last_used: md.modified().unwrap_or(UNIX_EPOCH),
                path: slot.data(),
            });
        }
        out.sort_by(|a, b| b.last_used.cmp(&a.last_used).then_with(|| a.key.cmp(&b.key)));
        Ok(out)
    }

    /// Removes least recently used entries until the complete ones hold at most `max_bytes`,
    /// the files of fetches that died, and records half-written by processes that died.
    /// Entries in use by a running load stay readable to
    /// it (their files are unlinked, not overwritten).
    pub fn prune(&self, max_bytes: u64) -> io::Result<PruneReport> {
        self.check_dir()?;
        let mut report = self.remove_stale()?;
        let evicted = self.evict_lru(None, |total| total <= max_bytes)?;
        (report.removed, report.freed) = (evicted.removed, evicted.freed);
        self.remove_orphan_records();
        Ok(report)
    }

    /// Removes the revalidation records of URLs whose entry is gone (evicted, or never
    /// completed).
    fn remove_orphan_records(&self) {
        for name in dir_names(&self.dir) {
            if !name.ends_with(SUFFIX_SEEN) {
                continue;
            }
            let path = self.dir.join(&name);
            let seen: Option<Seen> = fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok());
            if !seen.is_some_and(|s| self.slot(s.key).data().exists()) {
                let _ = fs::remove_file(&path);
            }
        }
    }

    /// Removes the part files and lock files of keys no process is fetching.
    fn remove_stale(&self) -> io::Result<PruneReport> {
        let mut report = PruneReport::default();
        let names = dir_names(&self.dir);
        for name in &names {
            let Some(key) = name.strip_suffix(SUFFIX_LOCK) else { continue };
            let slot = self.slot(key.to_owned());
            if let Ok(Locking::Held(lock)) = slot.try_lock() {
                report.stale_parts += slot.remove_parts();
                if !slot.data().exists() {
                    let _ = fs::remove_file(slot.meta());
                    let _ = fs::remove_file(slot.lock_path());
                }
                drop(lock);
            }
        }
        // Parts whose lock file is gone (removed by hand) belong to no fetch either.
        for name in &names {
            if let Some(stem) = name.strip_suffix(SUFFIX_PART) {
                let key = stem.split('.').next().unwrap_or(stem);
                if !self.dir.join(format!("{key}{SUFFIX_LOCK}")).exists()
                    && fs::remove_file(self.dir.join(name)).is_ok()
                {
                    report.stale_parts += 1;
                }
            }
        }
        // Records being written (an entry's description, a version seen) are temporary files
        // named after the writing process until renamed; a process killed in between leaves one.
        for name in &names {
            if name.ends_with(".tmp") && tmp_writer(name).is_some_and(|pid| !process_alive(pid)) {
                let _ = fs::remove_file(self.dir.join(name));
            }
        }
        Ok(report)
    }

    /// Makes room for `len` more bytes: within the size limit, and leaving the file system 5% of
    /// its size free, removing least recently used entries (never `keep`). False if that is not
    /// possible (the object is then loaded without the cache).
    pub(crate) fn make_room(&self, len: u64, keep: &str) -> bool {
        if self.max_bytes.is_some_and(|max| len > max) {
            return false;
        }
        // Bytes the file system has for `len` beyond its 5% reserve, if `freed` more were free.
        let space = |freed: u64| match nix::sys::statvfs::statvfs(&self.dir) {
            Ok(s) => {
                let unit = s.fragment_size();
                let free = s.blocks_available().saturating_mul(unit).saturating_add(freed);
                let reserve = s.blocks().saturating_mul(unit) / 20;
                free >= len.saturating_add(reserve)
            }
            Err(_) => false,
        };
        // Evict nothing when even evicting every other entry could not make room (a server that
        // claims a 10 TB object must not empty the cache).
        let Ok(entries) = self.entries() else { return false };
        let evictable: u64 = entries.iter().filter(|e| e.key != keep).map(|e| e.len).sum();
        let kept: u64 = entries.iter().map(|e| e.len).sum::<u64>() - evictable;
        if self.max_bytes.is_some_and(|max| kept + len > max) || !space(evictable) {
            return false;
        }
        let fits = |total: u64| self.max_bytes.is_none_or(|max| total + len <= max) && space(0);
        self.evict_lru(Some(keep), fits).is_ok_and(|e| e.satisfied)
    }

    /// After `keep` was published for `url` (as entries record it: no query, no user info):
    /// removes the entries of `url`'s other versions, which no load asks for any more (an
    /// object replaced in the store). Returns how many were removed.
    pub(crate) fn drop_superseded(&self, url: &str, keep: &str) -> usize {
        let Ok(entries) = self.entries() else { return 0 };
        entries
            .iter()
            .filter(|e| e.url == url && e.key != keep)
            .filter(|e| remove_entry(&self.slot(e.key.clone())))
            .count()
    }

    /// After a fill: removes least recently used entries beyond the size limit (never `keep`).
    pub(crate) fn enforce_limit(&self, keep: &str) {
        if let Some(max) = self.max_bytes {
            let _ = self.evict_lru(Some(keep), |total| total <= max);
        }
    }

    /// Removes complete entries, least recently used first and never `keep`, until `satisfied`
    /// holds for the bytes of the entries left (`keep`'s included).
    fn evict_lru(&self, keep: Option<&str>, mut satisfied: impl FnMut(u64) -> bool) -> io::Result<Eviction> {
        let mut entries = self.entries()?;
        let mut total: u64 = entries.iter().map(|e| e.len).sum();
        entries.retain(|e| Some(e.key.as_str()) != keep);
        let mut done = Eviction::default();
        loop {
            if satisfied(total) {
                done.satisfied = true;
                return Ok(done);
            }
            let Some(e) = entries.pop() else { return Ok(done) };
            if remove_entry(&self.slot(e.key)) {
                total -= e.len;
                done.removed += 1;
                done.freed += e.len;
            }
        }
    }
}

/// What [`NodeCache::evict_lru`] did.
#[derive(Default)]
struct Eviction {
    satisfied: bool,
    removed: usize,
    freed: u64,
}

/// Unlinks an entry's data (then its description, and its lock file unless a fetch holds it);
/// true if the data was removed.
fn remove_entry(slot: &Slot) -> bool {
    let removed = fs::remove_file(slot.data()).is_ok();
    let _ = fs::remove_file(slot.meta());
    if let Ok(Locking::Held(lock)) = slot.try_lock() {
        // Nobody fetches the key: the lock file goes too (a fetch starting now makes a new one).
        let _ = fs::remove_file(slot.lock_path());
        drop(lock);
    }
    removed
}

/// Lowercase hex of the SHA-256 of `text`.
fn sha256_hex(text: &str) -> String {
    Sha256::digest(text.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// A number and the unit after it (`"1.5GiB"` -> `(1.5, "GiB")`); `None` when the number does
/// not parse.
fn number_and_unit(text: &str) -> Option<(f64, &str)> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    Some((num.parse().ok()?, unit.trim()))
}

/// `TURBOIO_CACHE_SHARED`: `1`/`true`/`yes` shares the cache, `0`/`false`/`no`/unset does not.
fn env_shared() -> Result<bool, String> {
    match std::env::var(crate::ENV_SHARED) {
        Err(_) => Ok(false),
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "" | "0" | "false" | "no" | "off" => Ok(false),
            "1" | "true" | "yes" | "on" => Ok(true),
            _ => Err(format!("{}={v:?}: expected 1 or 0", crate::ENV_SHARED)),
        },
    }
}

fn env_revalidate() -> Result<Option<Duration>, String> {
    match std::env::var(crate::ENV_REVALIDATE) {
        Ok(v) if !v.trim().is_empty() => {
            Ok(Some(parse_interval(&v).map_err(|e| format!("{}={v:?}: {e}", crate::ENV_REVALIDATE))?))
        }
        _ => Ok(None),
    }
}

/// Parses an interval: seconds (`300`, `1.5`), or with a unit `s`, `m`, `h`, `d` (`90s`, `5m`).
pub fn parse_interval(text: &str) -> Result<Duration, String> {
    let (num, unit) =
        number_and_unit(text).ok_or_else(|| format!("`{text}` is not an interval (e.g. 300, 90s, 5m, 1h)"))?;
    let mult = match unit {
        "" | "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        other => return Err(format!("`{text}`: unknown unit `{other}` (use s, m, h or d)")),
    };
    Duration::try_from_secs_f64(num * mult).map_err(|_| format!("`{text}` is out of range"))
}

/// Parses a byte count as the CLI does: `1073741824`, `512M` / `512MiB` (powers of 1024),
/// `500GB` (powers of 1000).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let (num, unit) =
        number_and_unit(text).ok_or_else(|| format!("`{text}` is not a size (e.g. 500GiB, 2TB, 1073741824)"))?;
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => return Err(format!("`{text}`: unknown unit `{other}` (use KiB, MiB, GiB, TiB, KB, MB, GB or TB)")),
    };
    let bytes = num * mult;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("`{text}` is out of range"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_secrets() {
        assert_eq!(clean_url("https://u:p@host/a/b?X-Amz-Signature=s#f"), "https://host/a/b");
        assert_eq!(clean_url("s3://bucket/k@ey.safetensors"), "s3://bucket/k@ey.safetensors");
        assert_eq!(clean_url("gs://b/k"), "gs://b/k");
    }

    #[test]
    fn keys_change_with_url_length_and_version_but_not_with_the_query() {
        let v = |len, tag: &str| Version { len, tag: tag.into() };
        let k = NodeCache::key("s3://b/k", &v(10, "e1"));
        assert_eq!(k.len(), 64);
        assert_eq!(k, NodeCache::key("s3://b/k", &v(10, "e1")));
        assert_eq!(k, NodeCache::key("s3://b/k?sig=1", &v(10, "e1")));
        assert_ne!(k, NodeCache::key("s3://b/k2", &v(10, "e1")));
        assert_ne!(k, NodeCache::key("s3://b/k", &v(11, "e1")));
        assert_ne!(k, NodeCache::key("s3://b/k", &v(10, "e2")));
    }

    #[test]
    fn intervals_parse_with_units() {
        assert_eq!(parse_interval("300").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_interval("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_interval("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_interval("1.5h").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_interval("0").unwrap(), Duration::ZERO);
        assert!(parse_interval("soon").unwrap_err().contains("not an interval"));
        assert!(parse_interval("5w").unwrap_err().contains("unknown unit"));
        assert!(NodeCache::new("/x").with_revalidate_after(Some(Duration::ZERO)).revalidate_after().is_none());
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("1024").unwrap(), 1024);
        assert_eq!(parse_size("2K").unwrap(), 2048);
        assert_eq!(parse_size("500G").unwrap(), 500 << 30);
        assert_eq!(parse_size("2TiB").unwrap(), 2 << 40);
        assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert!(parse_size("lots").unwrap_err().contains("not a size"));
        assert!(parse_size("5X").unwrap_err().contains("unknown unit"));
    }
}
