//! Per-group state: the private configuration file libcloudfs reads, the datapipe STS refresh
//! thread, and the connection shared by an operation's threads.
//!
//! A [`Session`] lives as long as something uses it (an open file, a save in progress): when
//! the last user drops it, its refresh thread is stopped and joined and its XML file (which holds
//! credentials) is deleted. The directory holding the XML files is created on first use with
//! mode 0700 under `$XDG_RUNTIME_DIR` or the temporary directory (never the working
//! directory), and removed when no session is left.
//!
//! libcloudfs reads its configuration from the file named by `LIBCLOUDFS_CONF`, one variable
//! for the whole process, while it connects. Changing the environment while other threads may
//! read it (`setenv` against a C library's `getenv`) is undefined behaviour, so the variable
//! is set at most once per process, to a path that never changes ([`conf_path`]): a symbolic
//! link in the private directory that is pointed at the connecting group's XML (an atomic
//! rename) under a lock held for the connect. The one `setenv` happens at the process's first
//! SFCS connection, and not at all if `LIBCLOUDFS_CONF` already holds [`conf_path`] (a
//! program can set it so before it starts threads).

use crate::config::{conf_file_name, ConfigError, Properties, Sources};
use crate::ffi::{CfsError, Fs, Library};
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};
use turboio_kms::{DatapipeClient, KeyError, SfcsSts};

/// The variable libcloudfs reads its configuration file's path from.
pub const CONF_ENV: &str = "LIBCLOUDFS_CONF";

/// Serialises pointing [`conf_path`] at a group's XML + `cfsBuilderConnect`: libcloudfs reads
/// the file while connecting.
static CONNECT_LOCK: Mutex<()> = Mutex::new(());

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn random_u64() -> u64 {
    let mut h = RandomState::new().build_hasher();
    if let Ok(t) = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.write_u32(std::process::id());
    h.finish()
}

/// The private directory of this process's XML files.
#[derive(Debug)]
pub struct ConfDir {
    path: PathBuf,
}

static CONF_DIR: Mutex<Weak<ConfDir>> = Mutex::new(Weak::new());

/// The name of the link libcloudfs is pointed at, in the private directory.
const CONF_LINK: &str = "libcloudfs.xml";

/// This process's private directory path: chosen once per process (a forked child chooses its
/// own), so that [`conf_path`] never changes.
fn conf_dir_path() -> PathBuf {
    static CHOSEN: Mutex<Option<(u32, PathBuf)>> = Mutex::new(None);
    let mut chosen = lock(&CHOSEN);
    let pid = std::process::id();
    match chosen.as_ref() {
        Some((p, path)) if *p == pid => path.clone(),
        _ => {
            let base = std::env::var_os("XDG_RUNTIME_DIR")
                .map(PathBuf::from)
                .filter(|p| p.is_absolute() && private_dir(p).is_ok())
                .unwrap_or_else(std::env::temp_dir);
            let path = base.join(format!("turboio-sfcs-{pid}-{:016x}", random_u64()));
            *chosen = Some((pid, path.clone()));
            path
        }
    }
}

/// The path `LIBCLOUDFS_CONF` holds once this process has connected to SFCS: a symbolic link
/// in the process's private directory, pointed at each connecting group's XML. The same for
/// the whole life of the process, so the variable is set once (or never, if a program sets it
/// to this path before it starts threads).
pub fn conf_path() -> PathBuf {
    conf_dir_path().join(CONF_LINK)
}

impl ConfDir {
    /// The live directory, or a new one (at the same path as any earlier one).
    pub fn get() -> std::io::Result<Arc<ConfDir>> {
        let mut slot = lock(&CONF_DIR);
        if let Some(d) = slot.upgrade() {
            return Ok(d);
        }
        let path = conf_dir_path();
        match std::fs::DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => {
                // The umask can only remove bits; make sure nobody else can read it whatever it is.
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700))?;
            }
            // Left by an earlier ConfDir of this process: used only if it is still private
            // (ours, a real directory, 0700), never changed to be.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
        }
        private_dir(&path)?;
        let d = Arc::new(ConfDir { path });
        *slot = Arc::downgrade(&d);
        Ok(d)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Points [`conf_path`] at `xml` (a symbolic link renamed into place) and makes sure
    /// `LIBCLOUDFS_CONF` names it. Call with `CONNECT_LOCK` held, right before connecting.
    fn point_libcloudfs_at(&self, xml: &Path) -> std::io::Result<()> {
        let link = self.path.join(CONF_LINK);
        let tmp = self.path.join(format!(".link-{:016x}", random_u64()));
        std::os::unix::fs::symlink(xml, &tmp)?;
        if let Err(e) = std::fs::rename(&tmp, &link) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        if std::env::var_os(CONF_ENV).as_deref() != Some(link.as_os_str()) {
            // The process's one change of the environment (see the module docs): the path is
            // the same for the life of the process, so this runs at its first connection only.
            std::env::set_var(CONF_ENV, &link);
        }
        Ok(())
    }
}

impl Drop for ConfDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.path.join(CONF_LINK));
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// A directory is private when it is ours, a real directory (not a link) and mode 0700.
fn private_dir(p: &Path) -> std::io::Result<()> {
    let m = std::fs::symlink_metadata(p)?;
    let uid = crate::ffi::euid();
    if !m.is_dir() || m.uid() != uid || m.mode() & 0o777 != 0o700 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("{} is not a private directory (mode 0700, owned by uid {uid})", p.display()),
        ));
    }
    Ok(())
}

/// Writes `xml` to `path` atomically with mode 0600: a temporary file in the same private
/// directory, then a rename over the target.
pub fn write_private(path: &Path, xml: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(".tmp-{:016x}.xml", random_u64()));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        f.write_all(xml)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Why a session cannot be made or used.
#[derive(Debug)]
pub enum SessionError {
    /// The configuration is incomplete or unreadable.
    Config(ConfigError),
    /// The private directory or the XML file cannot be written.
    Io(std::io::Error),
    /// The datapipe `sfcs-sts` task failed.
    Sts(KeyError),
    /// The library refused to connect.
    Connect(CfsError),
    /// The caller cancelled.
    Cancelled,
}

impl std::fmt::Display for SessionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionError::Config(e) => write!(f, "SFCS configuration: {e}"),
            SessionError::Io(e) => write!(f, "SFCS configuration file: {e}"),
            SessionError::Sts(e) => write!(f, "SFCS credentials from the datapipe: {e}"),
            SessionError::Connect(e) => write!(f, "cannot connect to SFCS: {e}"),
            SessionError::Cancelled => f.write_str("cancelled"),
        }
    }
}

/// What the refresh thread and the session share.
#[derive(Debug)]
struct Shared {
    xml_path: PathBuf,
    /// Bumped each time the XML is rewritten; connections made before are replaced.
    generation: AtomicU64,
    /// The last refresh failure, if the credentials have expired since.
    failure: Mutex<Option<(SystemTime, String)>>,
    stop: AtomicBool,
    wake: (Mutex<()>, Condvar),
}

/// One group's configuration file, refresh thread and connection.
#[derive(Debug)]
pub struct Session {
    /// The group (a cache-policy key or the first path component).
    pub group: String,
    /// What the session was made from (non-secret fingerprint), to notice changes.
    pub fingerprint: u64,
    shared: Arc<Shared>,
    lib: Library,
    conn: Mutex<Option<(u64, Arc<Fs>)>>,
    refresher: Mutex<Option<JoinHandle<()>>>,
    dir: Arc<ConfDir>,
}

impl Session {
    /// Writes the group's XML (fetching STS credentials from the datapipe unless the
    /// configuration has its own) and, in datapipe mode, starts the refresh thread.
    pub fn start(
        lib: Library,
        sources: &Sources,
        group: &str,
        fingerprint: u64,
        cancel: Option<&AtomicBool>,
    ) -> Result<Arc<Session>, SessionError> {
        let use_datapipe = !sources.datapipe_needless();
        let config = sources.configuration(group);
        config.validate(use_datapipe).map_err(SessionError::Config)?;
        let base = config.to_properties();
        let dir = ConfDir::get().map_err(SessionError::Io)?;
        let name = format!("{:016x}-{}", random_u64(), conf_file_name(group));
        let shared = Arc::new(Shared {
            xml_path: dir.path().join(name),
            generation: AtomicU64::new(0),
            failure: Mutex::new(None),
            stop: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
        });
        let session = Arc::new(Session {
            group: group.to_string(),
            fingerprint,
            shared: shared.clone(),
            lib,
            conn: Mutex::new(None),
            refresher: Mutex::new(None),
            dir,
        });
        if !use_datapipe {
            write_private(&shared.xml_path, base.to_xml().as_bytes()).map_err(SessionError::Io)?;
            return Ok(session);
        }
        let client = DatapipeClient::new(sources.datapipe());
        let sts = fetch(&client, cancel)?;
        let props = with_sts(&base, &config.fsname, &sts);
        write_private(&shared.xml_path, props.to_xml().as_bytes()).map_err(SessionError::Io)?;
        let (current, expired) = (sts.current_time, sts.expired_time);
        drop(sts);
        let thread_shared = shared.clone();
        let fsname = config.fsname.clone();
        let handle = std::thread::Builder::new()
            .name(format!("turboio-sfcs-sts-{group}"))
            .spawn(move || refresh_loop(&thread_shared, &client, &base, &fsname, current, expired))
            .map_err(SessionError::Io)?;
        *lock(&session.refresher) = Some(handle);
        Ok(session)
    }

    /// The XML file libcloudfs is pointed at.
    pub fn xml_path(&self) -> &Path {
        &self.shared.xml_path
    }

    /// The connection for the current credentials: the shared one, or a new one when the XML
    /// has been rewritten since it was made.
    pub fn connection(&self) -> Result<Arc<Fs>, SessionError> {
        if let Some((when, why)) = lock(&self.shared.failure).as_ref() {
            if SystemTime::now() >= *when {
                return Err(SessionError::Sts(KeyError::Datapipe {
                    socket: PathBuf::new(),
                    task: "sfcs-sts",
                    status: None,
                    detail: format!("the credentials expired and refreshing them failed: {why}"),
                }));
            }
        }
        let generation = self.shared.generation.load(Ordering::Acquire);
        let mut slot = lock(&self.conn);
        if let Some((g, fs)) = slot.as_ref() {
            if *g == generation {
                return Ok(fs.clone());
            }
        }
        let fs = {
            let _env = lock(&CONNECT_LOCK);
            self.dir.point_libcloudfs_at(&self.shared.xml_path).map_err(SessionError::Io)?;
            Arc::new(self.lib.connect().map_err(SessionError::Connect)?)
        };
        *slot = Some((generation, fs.clone()));
        Ok(fs)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            let _g = lock(&self.shared.wake.0);
            self.shared.wake.1.notify_all();
        }
        if let Some(h) = lock(&self.refresher).take() {
            let _ = h.join();
        }
        lock(&self.conn).take();
        let _ = std::fs::remove_file(&self.shared.xml_path);
    }
}

fn fetch(client: &DatapipeClient, cancel: Option<&AtomicBool>) -> Result<SfcsSts, SessionError> {
    match client.sfcs_sts_cancellable(cancel) {
        Ok(s) => Ok(s),
        Err(KeyError::Cancelled) => Err(SessionError::Cancelled),
        Err(e) => Err(SessionError::Sts(e)),
    }
}

/// veTurboIO's datapipe properties: the validated configuration's, then the STS access key,
/// secret key and token, and the name node address the datapipe gives.
pub fn with_sts(base: &Properties, fsname: &str, sts: &SfcsSts) -> Properties {
    let mut p = base.clone();
    p.set("cfs.access.key", &sts.access_key);
    p.set("cfs.secret.key", sts.secret_key.expose());
    p.set("cfs.security.token", sts.session_token.expose());
    p.set(&format!("cfs.namenode.endpoint.address.{fsname}"), &sts.namenode_address);
    p
}

/// When veTurboIO refreshes: halfway between `CurrentTime` and `ExpiredTime`.
pub fn refresh_at(current: SystemTime, expired: SystemTime) -> SystemTime {
    match expired.duration_since(current) {
        Ok(d) => current + d / 2,
        Err(_) => current,
    }
}

/// Rewrites the XML halfway to each expiry until the session stops. A failed refresh is retried
/// (every 2 s, or sooner near the expiry); once the credentials have expired, connections fail
/// with the refresh error instead of using stale credentials.
fn refresh_loop(
    shared: &Shared,
    client: &DatapipeClient,
    base: &Properties,
    fsname: &str,
    mut current: SystemTime,
    mut expired: SystemTime,
) {
    // The datapipe may report times in another clock than ours: keep the intervals, anchored at
    // our clock when the answer arrived.
    let mut anchor = SystemTime::now();
    loop {
        let due = anchor + refresh_at(current, expired).duration_since(current).unwrap_or_default();
        if !wait_until(shared, due) {
            return;
        }
        match client.sfcs_sts_cancellable(Some(&shared.stop)) {
            Ok(sts) => {
                let props = with_sts(base, fsname, &sts);
                match write_private(&shared.xml_path, props.to_xml().as_bytes()) {
                    Ok(()) => {
                        current = sts.current_time;
                        expired = sts.expired_time;
                        anchor = SystemTime::now();
                        *lock(&shared.failure) = None;
                        shared.generation.fetch_add(1, Ordering::AcqRel);
                        continue;
                    }
                    Err(e) => note_failure(shared, anchor, current, expired, &e.to_string()),
                }
            }
            Err(KeyError::Cancelled) => return,
            Err(e) => note_failure(shared, anchor, current, expired, &e.to_string()),
        }
        if !wait_until(shared, SystemTime::now() + Duration::from_secs(2)) {
            return;
        }
        // Retry at once on the next turn.
        current = SystemTime::UNIX_EPOCH;
        expired = SystemTime::UNIX_EPOCH;
        anchor = SystemTime::now();
    }
}

fn note_failure(shared: &Shared, anchor: SystemTime, current: SystemTime, expired: SystemTime, why: &str) {
    let mut f = lock(&shared.failure);
    if f.is_none() {
        let expiry = anchor + expired.duration_since(current).unwrap_or_default();
        *f = Some((expiry, why.to_string()));
    } else if let Some((_, w)) = f.as_mut() {
        *w = why.to_string();
    }
}

/// Waits until `due` or until the session stops; false when it stopped.
fn wait_until(shared: &Shared, due: SystemTime) -> bool {
    let mut g = lock(&shared.wake.0);
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return false;
        }
        let Ok(left) = due.duration_since(SystemTime::now()) else { return true };
        if left.is_zero() {
            return true;
        }
        g = match shared.wake.1.wait_timeout(g, left) {
            Ok((g, _)) => g,
            Err(p) => p.into_inner().0,
        };
    }
}
