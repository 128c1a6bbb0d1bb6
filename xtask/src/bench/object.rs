//! `cargo xtask bench --object`: loads from an S3-compatible object store, turboio against the
//! peers a user would otherwise reach for and against what the server itself can deliver.
//!
//! What it measures, and why: turboio's object backend (`turboio.load(url, storage_options=...)`
//! for one safetensors object, `turboio.load_model(prefix, ...)` for a 9-shard model under a key
//! prefix) promises parallel ranged GETs straight into the load's memory; this shows whether that
//! reaches the server's own throughput and beats Run:ai Model Streamer (the peer built for
//! exactly this job, at its default concurrency and at its best of 8/16/32) and the plain way
//! (boto3 `download_file` to a temporary file, then `safetensors.torch.load_file`).
//!
//! - **Server**: s3s-fs 0.14.1 (the newest that builds on the workspace's Rust), installed into
//!   `target/bench-tools` by `cargo install` on first use, serving a root under the data
//!   directory on 127.0.0.1 with signed requests. Objects are uploaded *through* the server (so
//!   it stores their ETags: a file copied into its root makes every GET hash the whole file),
//!   once, and re-uploaded only when their size changed. The server is killed at the end, also
//!   on errors (a guard).
//! - **Loaders** run each in a Python process of their own (`crates/py/bench/py_object.py`),
//!   which prints the load time, a first read of every 4 KiB page of the result and its peak
//!   RSS; the loaders take turns in a shuffled order each run (`bench::run_order`), the median
//!   of `--runs` is reported, and the server's files are in the page cache before every run.
//! - **Ceiling**: the server's throughput for the same bytes with parallel 8 MiB ranged GETs (16
//!   and 32 in flight) whose bodies are counted and dropped (no memory kept or touched), measured
//!   here with object_store directly, same endpoint and credentials; and the same GETs with every
//!   body copied into one fresh buffer as it arrives (the least a loader that returns the bytes
//!   must do: on this 2-core machine the server, the copy and its page faults share the CPUs, so
//!   this row, not the bodies-dropped one, is what a loader can reach). Two rows measure what
//!   work beside the bodies-dropped GETs costs them on these cores: the **floor of a loader**
//!   faults in fresh memory of the bytes' size on a thread beside them (a load into CPU memory
//!   returns them in pages the process has just allocated; nothing is copied), the least any
//!   loader must add. The **floor of a fill** is the ceiling that keeps the bytes (in fresh,
//!   page-aligned memory) with each part written to a local file as soon as it has arrived, by a
//!   thread of its own, with `O_DIRECT` (each object's last, unaligned part through the page
//!   cache), the file synced at the end: the work a node cache's fill adds to a load, done the
//!   plain way on the least a load does (turboio's fill hands its parts over from the backend's
//!   threads and measured faster than it). The "(limit)" check lines compare these rows with
//!   the ceilings: where the floor of a loader is below 0.85x the ceiling, no loader reaches
//!   0.85x of it on this machine. A check line also says whether the ceiling itself is 1.5x
//!   boto3's download + load: when the server sets the pace, the download runs at its speed too
//!   and no loader can be 1.5x faster.
//! - **Fast rows** (the warm node cache, the local files, the HEADs: tens of milliseconds in a
//!   new process) are sampled [`FAST_REPEATS`] times per run, shuffled with the others, and the
//!   rows whose ratios say what filling the cache costs (turboio with and without it, the
//!   ceiling that keeps the bytes with and without the writes; the ceiling too)
//!   [`FILL_REPEATS`] times; those two pairs ([`PAIRS`]) run back to back (which goes first
//!   alternates) and their checks are the median of the pairs' ratios, so that the server's
//!   drift between rows (10-30% here) stays out of a cost of a few percent. A warm load that
//!   asks the store returns when the HEADs have answered, and the first read of its pages
//!   follows: its "(limit of asking)" is the longer of the local row's load and the HEADs alone,
//!   plus the local row's read of the pages. The local files and the server's copies are taken
//!   out of the page cache once first (`kit::evict`) and read back by the warm before each
//!   run, so that they sit in the page cache as the cache's entries do.
//! - **A server that is not the limit**: s3s-fs streams each GET in 4 KiB reads, so its
//!   throughput paces every loader (boto3's download too). The loaders and ceilings run again
//!   against nginx serving the files s3s-fs keeps under its root (the same bytes at the same
//!   URLs: S3's read path is a path-style GET with a Range header and a HEAD; nginx ignores the
//!   signatures and sends with `sendfile`), with and without the added latency.
//! - **Latency**: everything again through a TCP proxy in this process that holds every read
//!   from the client for 20 ms before passing it on, so each request pays about 20 ms, as it
//!   would against a store in another zone. Concurrency, not bandwidth, decides those rows.

use crate::bench::kit::{median_of as median, run_order, size_name, warm};
use crate::test::root;
use anyhow::{bail, Context, Result};
use futures_util::{StreamExt, TryStreamExt};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as Key;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutPayload};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const S3S_FS_VERSION: &str = "0.14.1";
/// Run:ai Model Streamer with its S3 plug-in, as pip requirements: the bench's peer, and what
/// vLLM pulls an `s3://` model's config with (`cargo xtask test --vllm`).
pub(crate) const RUNAI_STREAMER: [&str; 2] = ["runai-model-streamer==0.17.0", "runai-model-streamer-s3==0.17.0"];
const BUCKET: &str = "bench";
const FILE_KEY: &str = "sample.safetensors";
const MODEL_PREFIX: &str = "model";
const MODEL_SHARDS: usize = 9;
const ACCESS_KEY: &str = "turboio-bench";
const SECRET_KEY: &str = "turboio-bench-secret";
const REGION: &str = "us-east-1";
/// Added to every request in the second half of the rows.
const LATENCY: Duration = Duration::from_millis(20);
/// Bytes per ranged GET of the ceiling (turboio's and Run:ai's default part too).
const PART: u64 = 8 << 20;
/// Bytes per uploaded part.
const UPLOAD_PART: usize = 64 << 20;
/// Run:ai concurrencies tried once each; the fastest is measured as a row of its own.
const RUNAI_TRIALS: [usize; 3] = [8, 16, 32];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Loader {
    Turbo,
    RunaiDefault,
    RunaiTuned,
    Boto3,
    Ceiling(usize),
    /// The same GETs, each body copied into one fresh buffer as it arrives: the least any
    /// loader that returns the bytes must do (write them into memory it just allocated).
    CeilingKept(usize),
    /// The same GETs, bodies dropped, while a thread beside them faults in fresh memory of the
    /// bytes' size (nothing copied): the floor of any loader that returns the bytes in memory
    /// it allocates, on this machine's cores.
    CeilingFaulted(usize),
    /// [`Loader::CeilingKept`] into fresh page-aligned memory, each part written to a new local
    /// file as soon as it has arrived (a writer thread, `O_DIRECT`), the file synced at the end:
    /// the work a node cache's fill adds to a load, on the least a load does.
    CeilingFilled(usize),
    /// turboio with an empty node cache (`TURBOIO_CACHE_DIR`): the load fills it.
    TurboCacheCold,
    /// turboio with the node cache holding the objects (filled once before the runs).
    TurboCacheWarm,
    /// The same, trusting the versions seen for an hour (`TURBOIO_CACHE_REVALIDATE`): no
    /// request to the server at all.
    TurboCacheTrusted,
    /// turboio loading the same bytes from local files (the server's own copies, hot).
    LocalFile,
    /// What a warm load that asks the store cannot go below: a new client asks the server for
    /// the version of each object (one HEAD each, all at once) and reads nothing.
    Heads,
}

const LOADERS: [Loader; 14] = [
    Loader::Turbo,
    Loader::TurboCacheCold,
    Loader::TurboCacheWarm,
    Loader::TurboCacheTrusted,
    Loader::LocalFile,
    Loader::Heads,
    Loader::RunaiDefault,
    Loader::RunaiTuned,
    Loader::Boto3,
    Loader::Ceiling(16),
    Loader::Ceiling(32),
    Loader::CeilingKept(16),
    Loader::CeilingFaulted(16),
    Loader::CeilingFilled(16),
];
/// Samples of the rows that take milliseconds (warm node cache, local files, HEADs) per run:
/// their medians are of a few tens of ms in new processes, where one slow start moves a median
/// of three.
const FAST_REPEATS: usize = 5;
/// Samples per run of the rows whose ratios say what filling the node cache costs (turboio with
/// and without it, the ceiling that keeps the bytes with and without the writes) and of the
/// ceiling: a few percent, which a median of three seconds-long samples on this VM does not
/// resolve.
const FILL_REPEATS: usize = 3;
/// Rows measured in pairs, back to back (see `measure`): the first's time over the second's
/// is a fill's cost (turboio without and with the cache; its floor).
const PAIRS: [(Loader, Loader); 2] =
    [(Loader::Turbo, Loader::TurboCacheCold), (Loader::CeilingKept(16), Loader::CeilingFilled(16))];

impl Loader {
    fn name(self) -> String {
        match self {
            Loader::Turbo => format!(
                "turboio.load / turboio.load_model ({} in flight, {} MiB parts: the defaults)",
                turboio::object::DEFAULT_CONCURRENCY,
                turboio::object::DEFAULT_PART_SIZE >> 20
            ),
            Loader::RunaiDefault => "Run:ai Model Streamer 0.17 (default concurrency)".into(),
            Loader::RunaiTuned => "Run:ai Model Streamer 0.17 (best of concurrency 8/16/32)".into(),
            Loader::Boto3 => "boto3 download_file + safetensors.torch.load_file".into(),
            Loader::Ceiling(n) => format!("ceiling: object_store 8 MiB ranged GETs, {n} in flight, bodies dropped"),
            Loader::CeilingKept(n) => {
                format!("ceiling that keeps the bytes: the same GETs, {n} in flight, copied into one fresh buffer")
            }
            Loader::CeilingFaulted(n) => format!(
                "floor of a loader: the same GETs, {n} in flight, bodies dropped, while fresh memory of their size \
                 is faulted in beside them (nothing copied)"
            ),
            Loader::CeilingFilled(n) => format!(
                "floor of a fill: the ceiling that keeps the bytes ({n} in flight, into fresh aligned memory), \
                 each part written to a local file with O_DIRECT as it arrives (a writer thread), synced at the end"
            ),
            Loader::TurboCacheCold => "turboio, node cache empty (the load fills it)".into(),
            Loader::TurboCacheWarm => "turboio, node cache holding the objects".into(),
            Loader::TurboCacheTrusted => {
                "turboio, node cache holding the objects, versions trusted for an hour (TURBOIO_CACHE_REVALIDATE=1h)"
                    .into()
            }
            Loader::LocalFile => "turboio from local files (the same bytes, in the page cache)".into(),
            Loader::Heads => "limit of a warm cache that asks: a new S3 client, one HEAD per object (index included), \
                 all at once, nothing read"
                .into(),
        }
    }

    /// A row about the node cache (it compares turboio with itself, or is its limit): not
    /// repeated against nginx, which measures the loaders and the ceilings.
    fn cache_row(self) -> bool {
        matches!(
            self,
            Loader::TurboCacheCold
                | Loader::TurboCacheWarm
                | Loader::TurboCacheTrusted
                | Loader::LocalFile
                | Loader::Heads
                | Loader::CeilingFilled(_)
        )
    }

    /// How many times the row is measured per run.
    fn repeats(self) -> usize {
        match self {
            Loader::TurboCacheWarm | Loader::TurboCacheTrusted | Loader::LocalFile | Loader::Heads => FAST_REPEATS,
            Loader::Turbo
            | Loader::TurboCacheCold
            | Loader::Ceiling(16)
            | Loader::CeilingKept(16)
            | Loader::CeilingFilled(_) => FILL_REPEATS,
            _ => 1,
        }
    }

    /// The name the child script knows (None: measured here).
    fn script_name(self) -> Option<&'static str> {
        match self {
            Loader::Turbo | Loader::TurboCacheCold | Loader::TurboCacheWarm | Loader::TurboCacheTrusted => {
                Some("turboio")
            }
            Loader::LocalFile => Some("local"),
            Loader::RunaiDefault | Loader::RunaiTuned => Some("runai"),
            Loader::Boto3 => Some("boto3"),
            Loader::Ceiling(_)
            | Loader::CeilingKept(_)
            | Loader::CeilingFaulted(_)
            | Loader::CeilingFilled(_)
            | Loader::Heads => None,
        }
    }

    /// Measured in this process (no peak RSS of a loader's own).
    fn in_process(self) -> bool {
        self.script_name().is_none()
    }
}

/// The two things loaded: one object, and a model under a key prefix.
const TARGETS: [&str; 2] = ["file", "model"];

#[derive(Default, Clone)]
struct Cell {
    times: Vec<f64>,
    /// The part of each time spent reading the result after the load returned (the Python
    /// rows' first read of every page; 0 for the rows measured here).
    touches: Vec<f64>,
    peak_rss: u64,
    failed: Option<String>,
}

struct Row {
    loader: Loader,
    /// What the name does not say (Run:ai's chosen concurrency).
    note: String,
    cells: [Cell; 2],
    skipped: Option<String>,
}

impl Row {
    /// The cell's samples, if it was measured without a failure.
    fn measured(&self, target: usize) -> Option<&Cell> {
        let c = &self.cells[target];
        (self.skipped.is_none() && c.failed.is_none() && !c.times.is_empty()).then_some(c)
    }

    fn time(&self, target: usize) -> Option<f64> {
        self.measured(target).map(|c| median(&c.times))
    }

    /// The median of the part of each sample after the load returned.
    fn touch(&self, target: usize) -> Option<f64> {
        self.measured(target).map(|c| median(&c.touches))
    }
}

/// s3s-fs, killed when dropped.
struct Server {
    child: Child,
    port: u16,
    start_s: f64,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The s3s-fs binary, installed into `target/bench-tools` if it is not there yet.
fn s3s_fs() -> std::result::Result<PathBuf, String> {
    let tools = root().join("target/bench-tools");
    let bin = tools.join("bin/s3s-fs");
    if bin.exists() {
        return Ok(bin);
    }
    eprintln!("installing s3s-fs {S3S_FS_VERSION} into {} (several minutes on 2 cores) ...", tools.display());
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["install", "s3s-fs", "--version", S3S_FS_VERSION, "--features", "binary", "--locked", "--root"])
        .arg(&tools)
        .status()
        .map_err(|e| format!("cannot run cargo install: {e}"))?;
    if !status.success() || !bin.exists() {
        return Err(format!(
            "`cargo install s3s-fs --version {S3S_FS_VERSION} --features binary --locked` failed ({status})"
        ));
    }
    Ok(bin)
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts s3s-fs on a free port of 127.0.0.1 serving `dir`; returns once it accepts connections.
fn start_server(bin: &Path, dir: &Path) -> Result<Server> {
    std::fs::create_dir_all(dir.join(BUCKET))?;
    let log = dir.with_extension("log");
    let port = free_port()?;
    let t = Instant::now();
    let out = std::fs::File::create(&log)?;
    let child = Command::new(bin)
        .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--access-key", ACCESS_KEY, "--secret-key"])
        .arg(SECRET_KEY)
        .arg(dir)
        .stdout(Stdio::from(out.try_clone()?))
        .stderr(Stdio::from(out))
        .spawn()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    let mut server = Server { child, port, start_s: 0.0 };
    let see = format!("see {}", log.display());
    wait_listening(&mut server.child, port, Duration::from_secs(30), "s3s-fs", || see.clone())?;
    server.start_s = t.elapsed().as_secs_f64();
    Ok(server)
}

/// Returns once something accepts connections on `port` of 127.0.0.1, polling every 5 ms; an
/// error if `child` (`what`) exits first (with `why`'s account of it) or after `limit`.
fn wait_listening(child: &mut Child, port: u16, limit: Duration, what: &str, why: impl Fn() -> String) -> Result<()> {
    let t = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("{what} exited at start ({status}); {}", why());
        }
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        if t.elapsed() > limit {
            bail!("{what} did not listen on port {port} within {} s; {}", limit.as_secs(), why());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// nginx serving the s3s-fs root read-only, killed when dropped.
struct Nginx {
    child: Child,
    port: u16,
}

impl Drop for Nginx {
    /// SIGTERM, which the master passes on to its workers before it exits (SIGKILL would leave
    /// them serving, orphaned); SIGKILL only if it has not exited within 5 s.
    fn drop(&mut self) {
        use nix::sys::signal::{kill, Signal};
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        if kill(pid, Signal::SIGTERM).is_ok() {
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(5) {
                if !matches!(self.child.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts nginx (`bin`) on a free port of 127.0.0.1 with `root` as its document root, its
/// configuration, pid file and logs under `dir`; returns once it accepts connections.
///
/// S3's read path is plain HTTP: a path-style `GET /bucket/key` with a `Range` header and a
/// `HEAD` for the size and ETag. nginx answers both from the files s3s-fs keeps under its root
/// (`ROOT/bucket/key`, the objects' bytes as they were uploaded), with its own ETags, and ignores
/// the request signatures; it sends with `sendfile`, so its throughput is far above a client's.
fn start_nginx(bin: &Path, root: &Path, dir: &Path) -> Result<Nginx> {
    std::fs::create_dir_all(dir.join("tmp"))?;
    // nginx takes relative paths as relative to its prefix.
    let (dir, root) = (std::fs::canonicalize(dir)?, std::fs::canonicalize(root)?);
    let port = free_port()?;
    let d = dir.display();
    // As root, the workers would run as `nobody`, who may not read the files s3s-fs wrote
    // (mode 0600 under directories of 0700); elsewhere nginx ignores `user` with a warning.
    let conf = format!(
        "daemon off; user root root; worker_processes 2; pid {d}/nginx.pid; error_log {d}/error.log;\n\
         events {{ worker_connections 1024; }}\n\
         http {{ access_log off; sendfile on; tcp_nopush on; keepalive_requests 100000; \
         client_body_temp_path {d}/tmp; proxy_temp_path {d}/tmp; fastcgi_temp_path {d}/tmp; \
         uwsgi_temp_path {d}/tmp; scgi_temp_path {d}/tmp;\n\
         server {{ listen 127.0.0.1:{port}; root {}; }} }}\n",
        root.display()
    );
    let conf_path = dir.join("nginx.conf");
    std::fs::write(&conf_path, conf)?;
    let child = Command::new(bin)
        .arg("-p")
        .arg(&dir)
        .arg("-c")
        .arg(&conf_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    let mut nginx = Nginx { child, port };
    // The log goes with the bench's temporary directory: its last line is the reason.
    let last_logged = || {
        let log = std::fs::read_to_string(dir.join("error.log")).unwrap_or_default();
        log.lines().last().unwrap_or("no error.log").to_owned()
    };
    wait_listening(&mut nginx.child, port, Duration::from_secs(10), "nginx", last_logged)?;
    Ok(nginx)
}

fn endpoint(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

/// An object_store client of the bench bucket at `port`.
fn store(port: u16) -> Result<Arc<dyn ObjectStore>> {
    Ok(Arc::new(
        AmazonS3Builder::new()
            .with_bucket_name(BUCKET)
            .with_endpoint(endpoint(port))
            .with_allow_http(true)
            .with_region(REGION)
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .build()?,
    ))
}

/// Uploads `local` as `key` through the server unless an object of its size is there already;
/// returns whether it uploaded.
async fn upload(store: &Arc<dyn ObjectStore>, local: &Path, key: &Key) -> Result<bool> {
    use std::io::Read;
    let len = std::fs::metadata(local)?.len();
    if store.head(key).await.is_ok_and(|m| m.size == len) {
        return Ok(false);
    }
    if len <= UPLOAD_PART as u64 {
        store.put(key, PutPayload::from(std::fs::read(local)?)).await?;
        return Ok(true);
    }
    let mut up = store.put_multipart(key).await?;
    let mut file = std::fs::File::open(local)?;
    let mut inflight = std::collections::VecDeque::new();
    let result: Result<()> = async {
        loop {
            let mut buf = Vec::with_capacity(UPLOAD_PART);
            (&mut file).take(UPLOAD_PART as u64).read_to_end(&mut buf)?;
            if buf.is_empty() {
                break;
            }
            inflight.push_back(tokio::spawn(up.put_part(PutPayload::from(buf))));
            while inflight.len() >= 4 {
                if let Some(h) = inflight.pop_front() {
                    h.await??;
                }
            }
        }
        for h in inflight.drain(..) {
            h.await??;
        }
        Ok(())
    }
    .await;
    match result {
        Ok(()) => {
            up.complete().await?;
            Ok(true)
        }
        Err(e) => {
            let _ = up.abort().await;
            Err(e)
        }
    }
}

/// Reads `objects` (key, size) with 8 MiB ranged GETs, `inflight` at a time, counting the bytes
/// and dropping them; returns the bytes read.
async fn ceiling(store: Arc<dyn ObjectStore>, objects: &[(Key, u64)], inflight: usize) -> Result<u64> {
    let parts: Vec<(Key, u64, u64)> = objects
        .iter()
        .flat_map(|(k, len)| (0..*len).step_by(PART as usize).map(move |a| (k.clone(), a, (a + PART).min(*len))))
        .collect();
    futures_util::stream::iter(parts)
        .map(|(key, a, b)| {
            let store = store.clone();
            tokio::spawn(async move {
                let opts = GetOptions { range: Some(GetRange::Bounded(a..b)), ..Default::default() };
                let mut body = store.get_opts(&key, opts).await?.into_stream();
                let mut n = 0u64;
                while let Some(chunk) = body.next().await {
                    n += chunk?.len() as u64;
                }
                anyhow::ensure!(n == b - a, "{key} bytes {a}..{b}: {n} bytes came");
                Ok(n)
            })
        })
        .buffer_unordered(inflight)
        .map(|joined| joined.map_err(anyhow::Error::from).and_then(|r| r))
        .try_fold(0u64, |sum, n| async move { Ok(sum + n) })
        .await
}

/// [`ceiling`], with every body copied into one buffer of fresh memory (allocated zeroed, so
/// its pages are faulted in by the copy, as a loader's are) as it arrives, by the thread that
/// drives the requests.
async fn ceiling_kept(store: Arc<dyn ObjectStore>, objects: &[(Key, u64)], inflight: usize) -> Result<u64> {
    let mut buf = vec![0u8; usize::try_from(laid_out(objects, 1))?];
    futures_util::stream::iter(split_parts(objects, &mut buf, 1))
        .map(|(key, a, b, _, dst)| {
            let store = store.clone();
            async move { get_into(store.as_ref(), &key, a, b, dst).await }
        })
        .buffer_unordered(inflight)
        .try_fold(0u64, |sum, n| async move { Ok(sum + n) })
        .await
}

/// The bytes `objects` take end to end, each starting at a multiple of `align`.
fn laid_out(objects: &[(Key, u64)], align: u64) -> u64 {
    objects.iter().map(|(_, len)| len.next_multiple_of(align)).sum()
}

/// `mem` ([`laid_out`] bytes) cut into the ceiling's parts: for each [`PART`] of each object,
/// its key, its bytes `a..b`, its offset in `mem` and the slice of `mem` it goes to.
fn split_parts<'m>(objects: &[(Key, u64)], mem: &'m mut [u8], align: u64) -> Vec<(Key, u64, u64, u64, &'m mut [u8])> {
    let mut parts = Vec::new();
    let mut rest = mem;
    let mut at = 0u64;
    for (key, len) in objects {
        let (object, tail) = std::mem::take(&mut rest).split_at_mut(len.next_multiple_of(align) as usize);
        rest = tail;
        let mut left: &mut [u8] = &mut object[..*len as usize];
        for a in (0..*len).step_by(PART as usize) {
            let b = (a + PART).min(*len);
            let (dst, tail) = std::mem::take(&mut left).split_at_mut((b - a) as usize);
            left = tail;
            parts.push((key.clone(), a, b, at + a, dst));
        }
        at += len.next_multiple_of(align);
    }
    parts
}

/// One ranged GET of `key`'s bytes `a..b`, its body copied into `dst` (their length) as it
/// arrives; returns the bytes received.
async fn get_into(store: &dyn ObjectStore, key: &Key, a: u64, b: u64, dst: &mut [u8]) -> Result<u64> {
    let opts = GetOptions { range: Some(GetRange::Bounded(a..b)), ..Default::default() };
    let mut body = store.get_opts(key, opts).await?.into_stream();
    let mut n = 0usize;
    while let Some(chunk) = body.next().await {
        let chunk = chunk?;
        let end = n + chunk.len();
        anyhow::ensure!(end <= dst.len(), "{key} bytes {a}..{b}: more bytes came");
        dst[n..end].copy_from_slice(&chunk);
        n = end;
    }
    anyhow::ensure!(n as u64 == b - a, "{key} bytes {a}..{b}: {n} bytes came");
    Ok(n as u64)
}

/// Maps `len` bytes of fresh anonymous memory (4 KiB pages, as turboio's arenas), faults every
/// page in (`MADV_POPULATE_WRITE`, one thread) and unmaps it: what a process pays to place `len`
/// bytes in memory it has just allocated, before a byte is copied.
fn fault_fresh(len: u64) -> Result<()> {
    let arena = turboio::device::Arena::new(usize::try_from(len)?, false)?;
    arena.prefault(1);
    Ok(())
}

/// The latency proxy: accepts on 127.0.0.1, relays to the server, and holds every read from
/// the client `delay` before passing it on (the answers flow back untouched). Its listener stops
/// when dropped; relayed connections end with their clients.
struct Proxy {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn start_proxy(rt: &tokio::runtime::Runtime, upstream: u16, delay: Duration) -> Result<Proxy> {
    start_counting_proxy(rt, upstream, delay, Arc::new(AtomicU64::new(0)))
}

/// [`start_proxy`], adding the bytes the server sends to `served`.
fn start_counting_proxy(
    rt: &tokio::runtime::Runtime,
    upstream: u16,
    delay: Duration,
    served: Arc<AtomicU64>,
) -> Result<Proxy> {
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let port = listener.local_addr()?.port();
    let task = rt.spawn(async move {
        loop {
            match listener.accept().await {
                Ok((client, _)) => {
                    tokio::spawn(relay(client, upstream, delay, served.clone()));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    });
    Ok(Proxy { port, task })
}

async fn relay(client: tokio::net::TcpStream, upstream: u16, delay: Duration, served: Arc<AtomicU64>) {
    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut from_client, mut to_client) = client.into_split();
    let (from_server, mut to_server) = server.into_split();
    let up = async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match from_client.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            tokio::time::sleep(delay).await;
            if to_server.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = to_server.shutdown().await;
    };
    let down = async move {
        let mut from_server = from_server;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = match from_server.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            served.fetch_add(n as u64, Ordering::Relaxed);
            if to_client.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = to_client.shutdown().await;
    };
    futures_util::future::join(up, down).await;
}

/// The 9-shard model directory, generated once by `turboio gen --shards`.
fn model_dir(dir: &Path, size: u64) -> Result<PathBuf> {
    let out = dir.join(format!("model{MODEL_SHARDS}-{}", size >> 20));
    if out.join("model.safetensors.index.json").exists() {
        return Ok(out);
    }
    eprintln!("generating {} ({MODEL_SHARDS} shards) ...", out.display());
    let status = Command::new(crate::bench::kit::cli()?)
        .args(["gen", "--shards", &MODEL_SHARDS.to_string(), "--size", &size.to_string()])
        .arg(&out)
        .status()?;
    if !status.success() {
        bail!("turboio gen --shards {MODEL_SHARDS} failed");
    }
    Ok(out)
}

/// The shard file names of a model directory, in the index's order.
fn shard_names(dir: &Path) -> Result<Vec<String>> {
    let index = dir.join("model.safetensors.index.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&index)?)?;
    let mut names: Vec<String> = Vec::new();
    for s in v["weight_map"].as_object().with_context(|| format!("{}: no weight_map", index.display()))?.values() {
        let s = s.as_str().unwrap_or_default().to_owned();
        if !names.contains(&s) {
            names.push(s);
        }
    }
    Ok(names)
}

/// One child run's result.
struct Sample {
    secs: f64,
    /// The part of `secs` after the load returned (the first read of every page).
    touch: f64,
    peak_rss: u64,
}

/// How a Python run is started: the interpreter, the environment, the scratch directory.
struct Py<'a> {
    python: &'a Path,
    tmp: PathBuf,
    timeout: Duration,
}

impl Py<'_> {
    /// Runs the child script for `loader` on `target`; Err is the reason it failed.
    fn run(
        &self,
        loader: &str,
        target: &str,
        args: &[String],
        env: &[(String, String)],
    ) -> std::result::Result<Sample, String> {
        let out = self.tmp.join("child.out");
        let err = self.tmp.join("child.err");
        let file = |p: &Path| std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()));
        let mut cmd = Command::new(self.python);
        cmd.arg(root().join("crates/py/bench/py_object.py"))
            .args(["--loader", loader, "--target", target, "--tmp"])
            .arg(&self.tmp)
            .args(args)
            .stdout(Stdio::from(file(&out)?))
            .stderr(Stdio::from(file(&err)?));
        for var in [
            "AWS_PROFILE",
            "AWS_SESSION_TOKEN",
            "AWS_ENDPOINT_URL_S3",
            "AWS_CONFIG_FILE",
            "AWS_SHARED_CREDENTIALS_FILE",
            "RUNAI_STREAMER_CONCURRENCY",
            "RUNAI_STREAMER_OBJ_CONCURRENCY",
            "TURBOIO_OBJECT_CONCURRENCY",
            "TURBOIO_OBJECT_PART_SIZE",
            "TURBOIO_OBJECT_MAX_BANDWIDTH",
        ] {
            cmd.env_remove(var);
        }
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        let child = cmd.spawn().map_err(|e| format!("cannot start {}: {e}", self.python.display()))?;
        let v = self.result_of(child, &out, &err, Instant::now())?;
        let touch = v["touch_s"].as_f64().unwrap_or(f64::NAN);
        let secs = v["load_s"].as_f64().unwrap_or(f64::NAN) + touch;
        Ok(Sample { secs, touch, peak_rss: v["peak_rss_bytes"].as_u64().unwrap_or(0) })
    }
}

impl Py<'_> {
    /// Waits for a child of the script started at `started` (killed past the timeout) and
    /// gives the JSON line it printed to `out`, or why it failed (the end of `err`).
    fn result_of(
        &self,
        mut child: Child,
        out: &Path,
        err: &Path,
        started: Instant,
    ) -> std::result::Result<serde_json::Value, String> {
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if started.elapsed() > self.timeout => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("no result after {:.0} s (killed)", self.timeout.as_secs_f64()));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => return Err(e.to_string()),
            }
        };
        let stdout = std::fs::read_to_string(out).unwrap_or_default();
        if !status.success() {
            let stderr = std::fs::read_to_string(err).unwrap_or_default();
            let last: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
            let tail = last[last.len().saturating_sub(3)..].join(" / ");
            return Err(format!("{status}: {tail}"));
        }
        let line = stdout.lines().rev().find(|l| l.starts_with('{')).unwrap_or("");
        serde_json::from_str(line).map_err(|_| format!("unexpected output: {}", stdout.trim()))
    }

    /// Runs `envs.len()` children of the script at once (child `i` with `envs[i]` added); the
    /// JSON line each printed, or the first failure.
    fn run_together(
        &self,
        target: &str,
        args: &[String],
        envs: &[Vec<(String, String)>],
    ) -> std::result::Result<Vec<serde_json::Value>, String> {
        let mut children = Vec::new();
        for (i, env) in envs.iter().enumerate() {
            let out = self.tmp.join(format!("together{i}.out"));
            let err = self.tmp.join(format!("together{i}.err"));
            let file = |p: &Path| std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()));
            let mut cmd = Command::new(self.python);
            cmd.arg(root().join("crates/py/bench/py_object.py"))
                .args(["--loader", "turboio", "--target", target, "--tmp"])
                .arg(&self.tmp)
                .args(args)
                .env_remove("TURBOIO_CACHE_DIR")
                .envs(env.iter().map(|(k, v)| (k, v)))
                .stdout(Stdio::from(file(&out)?))
                .stderr(Stdio::from(file(&err)?));
            children.push((cmd.spawn().map_err(|e| e.to_string())?, out, err));
        }
        let t = Instant::now();
        children.into_iter().map(|(child, out, err)| self.result_of(child, &out, &err, t)).collect()
    }
}

/// The rows of several processes on one node: N processes loading the same object at once
/// without and with a (cold) node cache, and 2 ranks each fetching the whole model vs
/// `fetch="once"`; bytes the server sent counted by a proxy in front of it.
fn cluster_rows(setup: &Setup<'_>, server_port: u16) -> Result<String> {
    let mut s = String::from(
        "### Several processes on one node (through a proxy that counts the bytes the server sends)

",
    );
    let Some(py) = setup.py.as_ref() else {
        s.push_str(
            "Skipped: no Python.

",
        );
        return Ok(s);
    };
    if let Some(why) = &setup.skip_turbo {
        let _ = writeln!(
            s,
            "Skipped: {why}.
"
        );
        return Ok(s);
    }
    let served = Arc::new(AtomicU64::new(0));
    let proxy = start_counting_proxy(setup.rt, server_port, Duration::ZERO, served.clone())?;
    let lens: [u64; 2] = [setup.objects[0].iter().map(|o| o.1).sum(), setup.objects[1].iter().map(|o| o.1).sum()];
    #[derive(Clone, Copy)]
    enum Case {
        Plain(usize),
        Cached(usize),
        EachAll,
        Once,
    }
    let cases = [Case::Plain(2), Case::Cached(2), Case::Plain(4), Case::Cached(4), Case::EachAll, Case::Once];
    let name = |c: Case| match c {
        Case::Plain(n) => format!("{n} processes load the file at once, no cache"),
        Case::Cached(n) => format!("{n} processes load the file at once, empty node cache"),
        Case::EachAll => "2 ranks load the model, each fetching all of it".to_owned(),
        Case::Once => "2 gloo ranks load the model with fetch=\"once\"".to_owned(),
    };
    let mut results: Vec<Vec<(f64, u64, Vec<u64>)>> = vec![Vec::new(); cases.len()];
    let cache = setup.cache_cold.with_file_name("node-cache-together");
    for r in 0..setup.runs {
        for k in run_order(cases.len(), r) {
            let case = cases[k];
            let (target, n) = match case {
                Case::Plain(n) | Case::Cached(n) => (0, n),
                Case::EachAll | Case::Once => (1, 2),
            };
            setup.warm(target)?;
            let mut base = setup.env(proxy.port);
            if let Case::Cached(_) = case {
                let _ = std::fs::remove_dir_all(&cache);
                base.push(("TURBOIO_CACHE_DIR".into(), cache.display().to_string()));
            }
            let master = free_port()?;
            let envs: Vec<Vec<(String, String)>> = (0..n)
                .map(|rank| {
                    let mut e = base.clone();
                    if let Case::Once = case {
                        e.extend([
                            ("RANK".to_owned(), rank.to_string()),
                            ("WORLD_SIZE".to_owned(), n.to_string()),
                            ("MASTER_ADDR".to_owned(), "127.0.0.1".to_owned()),
                            ("MASTER_PORT".to_owned(), master.to_string()),
                        ]);
                    }
                    e
                })
                .collect();
            let mut args = if target == 0 {
                vec!["--url".to_owned(), setup.file_url.clone()]
            } else {
                vec!["--url".to_owned(), setup.model_url.clone()]
            };
            if let Case::Once = case {
                args.push("--fetch-once".into());
            }
            served.store(0, Ordering::Relaxed);
            eprintln!("  {} (run {}) ...", name(case), r + 1);
            match py.run_together(TARGETS[target], &args, &envs) {
                Ok(out) => {
                    let secs = out.iter().filter_map(|v| v["load_s"].as_f64()).fold(0.0, f64::max);
                    let per_rank = out.iter().filter_map(|v| v["fetched_bytes"].as_u64()).collect();
                    results[k].push((secs, served.load(Ordering::Relaxed), per_rank));
                }
                Err(e) => eprintln!("  {} failed: {e}", name(case)),
            }
        }
    }
    drop(proxy);
    let _ = std::fs::remove_dir_all(&cache);
    let _ = writeln!(
        s,
        "| case | s (slowest process, median) | bytes the server sent / the object's size | bytes fetched per rank |\n|---|---:|---:|---|"
    );
    for (k, case) in cases.iter().enumerate() {
        let runs = &results[k];
        if runs.is_empty() {
            let _ = writeln!(s, "| {} | failed | | |", name(*case));
            continue;
        }
        let times: Vec<f64> = runs.iter().map(|r| r.0).collect();
        let len = lens[if matches!(case, Case::Plain(_) | Case::Cached(_)) { 0 } else { 1 }];
        let served_x = runs.iter().map(|r| r.1 as f64 / len as f64).fold(0.0, f64::max);
        let per_rank = runs
            .last()
            .map(|r| r.2.iter().map(|b| format!("{:.2} GB", *b as f64 / 1e9)).collect::<Vec<_>>().join(", "))
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "| {} | {:.3} | {served_x:.2}x (most of {} runs) | {per_rank} |",
            name(*case),
            median(&times),
            runs.len()
        );
    }
    s.push('\n');
    Ok(s)
}

/// Checks that a Python snippet runs (the reason when it does not).
fn python_ok(python: &Path, code: &str) -> std::result::Result<(), String> {
    let out = Command::new(python).args(["-c", code]).output().map_err(|e| e.to_string())?;
    if out.status.success() {
        return Ok(());
    }
    let e = String::from_utf8_lossy(&out.stderr);
    Err(e.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("failed").to_owned())
}

/// Why Run:ai cannot run here, if it cannot (installing it at the pinned versions first).
fn runai_ready(python: &Path) -> Option<String> {
    let check = "import runai_model_streamer, runai_model_streamer_s3";
    if python_ok(python, check).is_ok() {
        return None;
    }
    eprintln!("installing runai-model-streamer 0.17.0 with its S3 plugin ...");
    let _ = Command::new(python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-cache-dir"])
        .args(RUNAI_STREAMER)
        .status();
    python_ok(python, check).err().map(|e| format!("Run:ai Model Streamer cannot be imported: {e}"))
}

fn date() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or_else(String::new, |kb| format!(", {} GiB RAM", kb >> 20));
    format!("{cpus} vCPU{mem}")
}

/// What one latency setting measured.
struct Table {
    title: String,
    rows: Vec<Row>,
}

/// Everything the runs share.
struct Setup<'a> {
    rt: &'a tokio::runtime::Runtime,
    py: Option<Py<'a>>,
    skip_turbo: Option<String>,
    skip_runai: Option<String>,
    skip_boto3: Option<String>,
    file_url: String,
    model_url: String,
    shard_urls: String,
    /// (key, size) of the file, and of the model's objects.
    objects: [Vec<(Key, u64)>; 2],
    /// The server's copies, warmed before every run.
    stored: [Vec<PathBuf>; 2],
    /// The local file and the local model directory (the bench's own, uploaded from), and
    /// their files (warmed before each run).
    local: [PathBuf; 2],
    local_files: [Vec<PathBuf>; 2],
    /// Node caches: filled by each run (emptied before it), and filled once.
    cache_cold: PathBuf,
    cache_warm: PathBuf,
    runs: usize,
    trials: &'static [usize],
}

impl Setup<'_> {
    fn env(&self, port: u16) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT_URL", endpoint(port)),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.into()),
            ("AWS_REGION", REGION.into()),
            ("AWS_DEFAULT_REGION", REGION.into()),
            ("AWS_EC2_METADATA_DISABLED", "true".into()),
            ("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    fn warm(&self, target: usize) -> Result<()> {
        self.stored[target].iter().try_for_each(|p| warm(p))
    }

    /// Reads every complete entry of the warm node cache (none before its first fill).
    fn warm_entries(&self) -> Result<()> {
        let Ok(dir) = std::fs::read_dir(&self.cache_warm) else { return Ok(()) };
        for e in dir {
            let p = e?.path();
            if p.extension().is_some_and(|x| x == "data") {
                warm(&p)?;
            }
        }
        Ok(())
    }

    /// One run of `loader` on `target` (0 file, 1 model) against the server or proxy at `port`.
    fn run_once(
        &self,
        loader: Loader,
        target: usize,
        port: u16,
        runai_concurrency: Option<usize>,
    ) -> std::result::Result<Sample, String> {
        self.warm(target).map_err(|e| e.to_string())?;
        if loader == Loader::Heads {
            // The client is built inside the timing, as a new process's first load builds it.
            let t = Instant::now();
            let s = store(port).map_err(|e| e.to_string())?;
            let mut keys: Vec<Key> = self.objects[target].iter().map(|(k, _)| k.clone()).collect();
            if target == 1 {
                keys.push(Key::from(format!("{MODEL_PREFIX}/model.safetensors.index.json")));
            }
            let heads = futures_util::future::try_join_all(keys.iter().map(|k| s.head(k)));
            self.rt.block_on(heads).map_err(|e| format!("{e:#}"))?;
            return Ok(Sample { secs: t.elapsed().as_secs_f64(), touch: 0.0, peak_rss: 0 });
        }
        if let Loader::Ceiling(n) | Loader::CeilingKept(n) | Loader::CeilingFaulted(n) | Loader::CeilingFilled(n) =
            loader
        {
            let s = store(port).map_err(|e| e.to_string())?;
            let objects = &self.objects[target];
            let t = Instant::now();
            let total: u64 = objects.iter().map(|(_, len)| len).sum();
            let got = match loader {
                Loader::CeilingKept(_) => self.rt.block_on(ceiling_kept(s, objects, n)),
                Loader::CeilingFaulted(_) => self.ceiling_beside(s, objects, n, || fault_fresh(total)),
                Loader::CeilingFilled(_) => {
                    let path = self.cache_cold.with_file_name("ceiling-filled");
                    let got = self.ceiling_filled(s, objects, n, &path);
                    let _ = std::fs::remove_file(&path);
                    got
                }
                _ => self.rt.block_on(ceiling(s, objects, n)),
            };
            got.map_err(|e| format!("{e:#}"))?;
            return Ok(Sample { secs: t.elapsed().as_secs_f64(), touch: 0.0, peak_rss: 0 });
        }
        let py = self.py.as_ref().ok_or("no Python")?;
        let mut env = self.env(port);
        if let Some(c) = runai_concurrency {
            env.push(("RUNAI_STREAMER_CONCURRENCY".into(), c.to_string()));
            env.push(("RUNAI_STREAMER_OBJ_CONCURRENCY".into(), c.to_string()));
        }
        match loader {
            Loader::TurboCacheCold => {
                let _ = std::fs::remove_dir_all(&self.cache_cold);
                env.push(("TURBOIO_CACHE_DIR".into(), self.cache_cold.display().to_string()));
            }
            Loader::TurboCacheWarm | Loader::TurboCacheTrusted => {
                // The entries are read into the page cache as the local rows' files are, so
                // that the two rows differ only by the cache's own work.
                self.warm_entries().map_err(|e| e.to_string())?;
                env.push(("TURBOIO_CACHE_DIR".into(), self.cache_warm.display().to_string()));
                if loader == Loader::TurboCacheTrusted {
                    env.push(("TURBOIO_CACHE_REVALIDATE".into(), "1h".into()));
                }
            }
            _ => {}
        }
        let args = if loader == Loader::LocalFile {
            self.local_files[target].iter().try_for_each(|p| warm(p)).map_err(|e| e.to_string())?;
            vec!["--url".to_owned(), self.local[target].display().to_string()]
        } else if target == 0 {
            vec!["--url".to_owned(), self.file_url.clone()]
        } else {
            vec!["--url".to_owned(), self.model_url.clone(), "--shards".to_owned(), self.shard_urls.clone()]
        };
        py.run(loader.script_name().unwrap_or_default(), TARGETS[target], &args, &env)
    }

    /// The ceiling's GETs while `work` runs on a thread beside them: what a loader that must do
    /// that work too cannot go below on these cores.
    fn ceiling_beside(
        &self,
        s: Arc<dyn ObjectStore>,
        objects: &[(Key, u64)],
        n: usize,
        work: impl FnOnce() -> Result<()> + Send,
    ) -> Result<u64> {
        std::thread::scope(|scope| {
            let beside = scope.spawn(work);
            let got = self.rt.block_on(ceiling(s, objects, n));
            let beside = beside.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the thread beside the GETs panicked")));
            got.and_then(|n| beside.map(|()| n))
        })
    }

    /// [`ceiling_kept`] into fresh page-aligned memory (each object at a 4 KiB boundary, as in
    /// a file of its own), each part handed to a writer thread as soon as its body has arrived
    /// and written at its offset in a new file at `path`: with `O_DIRECT` from that memory where
    /// aligned (every part but an object's last), through the page cache otherwise; the file
    /// synced at the end. The hand-over (a channel of 16 parts, the sender waiting when it is
    /// full) and the writes are the node cache's fill's.
    fn ceiling_filled(
        &self,
        store: Arc<dyn ObjectStore>,
        objects: &[(Key, u64)],
        inflight: usize,
        path: &Path,
    ) -> Result<u64> {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        const ALIGN: u64 = 4096;
        let total = laid_out(objects, ALIGN);
        let mut arena = turboio::device::Arena::new(usize::try_from(total)?, false)?;
        let file = std::fs::File::options().write(true).create(true).truncate(true).open(path)?;
        file.set_len(total)?;
        let direct = std::fs::File::options()
            .write(true)
            .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
            .open(path)
            .with_context(|| format!("{}: open with O_DIRECT", path.display()))?;
        let parts = split_parts(objects, arena.as_mut_slice(), ALIGN);
        std::thread::scope(|scope| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<(u64, &[u8])>(16);
            let writer = scope.spawn(move || -> Result<()> {
                for (offset, bytes) in rx {
                    if (bytes.len() as u64).is_multiple_of(ALIGN) {
                        direct.write_all_at(bytes, offset)?;
                    } else {
                        file.write_all_at(bytes, offset)?;
                    }
                }
                file.sync_data()?;
                Ok(())
            });
            let gets = futures_util::stream::iter(parts)
                .map(|(key, a, b, offset, dst)| {
                    let store = store.clone();
                    let tx = tx.clone();
                    async move {
                        let n = get_into(store.as_ref(), &key, a, b, &mut *dst).await?;
                        let done: &[u8] = dst;
                        tx.send((offset, done)).map_err(|_| anyhow::anyhow!("the writer thread stopped"))?;
                        Ok(n)
                    }
                })
                .buffer_unordered(inflight)
                .try_fold(0u64, |sum, n| async move { Ok(sum + n) });
            let got = self.rt.block_on(gets);
            drop(tx);
            let written = writer.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the writer thread panicked")));
            got.and_then(|n| written.map(|()| n))
        })
    }

    /// The rows of `loaders` at one latency: Run:ai's trials, then `runs` rounds in shuffled
    /// orders.
    fn measure(&self, port: u16, title: String, loaders: &[Loader]) -> Table {
        let mut rows: Vec<Row> = loaders
            .iter()
            .map(|&loader| Row {
                loader,
                note: String::new(),
                cells: [Cell::default(), Cell::default()],
                skipped: match loader.script_name() {
                    None => None,
                    Some("runai") => self.skip_runai.clone(),
                    Some("boto3") => self.skip_boto3.clone(),
                    Some(_) => self.skip_turbo.clone(),
                },
            })
            .collect();
        let tuned_at = loaders.iter().position(|&l| l == Loader::RunaiTuned);
        let mut tuned = [None, None];
        if let Some(tuned_at) = tuned_at.filter(|&i| rows[i].skipped.is_none()) {
            let mut notes = Vec::new();
            for (target, best) in tuned.iter_mut().enumerate() {
                let mut tried = Vec::new();
                for &c in self.trials {
                    eprintln!("  Run:ai trial, {}, concurrency {c} ...", TARGETS[target]);
                    match self.run_once(Loader::RunaiTuned, target, port, Some(c)) {
                        Ok(s) => {
                            tried.push(format!("{c}: {:.2} s", s.secs));
                            if best.is_none_or(|(_, t)| s.secs < t) {
                                *best = Some((c, s.secs));
                            }
                        }
                        Err(e) => tried.push(format!("{c}: failed ({e})")),
                    }
                }
                match best {
                    Some((c, _)) => {
                        notes.push(format!("{}: {c} (one trial each, {})", TARGETS[target], tried.join(", ")))
                    }
                    None => {
                        rows[tuned_at].cells[target].failed = Some(format!("every trial failed: {}", tried.join("; ")))
                    }
                }
            }
            rows[tuned_at].note = format!("concurrency chosen: {}", notes.join("; "));
        }
        // The warm cache's entries, filled once (untimed), and the versions seen recorded for
        // the trusting row.
        for (target, what) in TARGETS.iter().enumerate() {
            if self.skip_turbo.is_none() {
                let cached = [Loader::TurboCacheWarm, Loader::TurboCacheTrusted];
                for l in cached.into_iter().filter(|l| loaders.contains(l)) {
                    if let Err(e) = self.run_once(l, target, port, None) {
                        eprintln!("  filling the warm node cache ({what}) failed: {e}");
                    }
                }
            }
        }
        // The units of a run's shuffled order: one sample, or a pair of the rows whose ratio says
        // what a fill costs, measured back to back (which goes first alternates), so that the
        // server's drift between rows does not enter the ratio.
        let at = |l: Loader| loaders.iter().position(|&x| x == l);
        let partner = |i: usize| PAIRS.iter().find(|(a, _)| *a == loaders[i]).and_then(|&(_, b)| at(b));
        let paired = |i: usize| PAIRS.iter().any(|&(a, b)| b == loaders[i] && at(a).is_some());
        let mut units: Vec<Vec<(usize, usize)>> = Vec::new();
        for i in (0..loaders.len()).filter(|&i| !paired(i)) {
            for n in 0..loaders[i].repeats() {
                for target in 0..TARGETS.len() {
                    units.push(match partner(i) {
                        Some(j) if n % 2 == 0 => vec![(i, target), (j, target)],
                        Some(j) => vec![(j, target), (i, target)],
                        None => vec![(i, target)],
                    });
                }
            }
        }
        for r in 0..self.runs {
            eprintln!("  run {} of {} ...", r + 1, self.runs);
            let order = run_order(units.len(), r);
            for &(i, target) in order.iter().flat_map(|&k| &units[k]) {
                let row = &rows[i];
                if row.skipped.is_some() || row.cells[target].failed.is_some() {
                    continue;
                }
                let concurrency = match row.loader {
                    Loader::RunaiTuned => tuned[target].map(|(c, _)| c),
                    _ => None,
                };
                let result = self.run_once(row.loader, target, port, concurrency);
                let cell = &mut rows[i].cells[target];
                match result {
                    Ok(s) => {
                        cell.times.push(s.secs);
                        cell.touches.push(s.touch);
                        cell.peak_rss = cell.peak_rss.max(s.peak_rss);
                    }
                    Err(e) => {
                        eprintln!("  {} ({}) failed: {e}", loaders[i].name(), TARGETS[target]);
                        cell.failed = Some(e);
                    }
                }
            }
        }
        Table { title, rows }
    }
}

/// Runs the object-storage rows for a sample of `size` bytes (and a model of as many); returns
/// the Markdown section (tables and checks). Python rows are skipped without `python`; the whole
/// section is a skip message when the server cannot be installed or started.
pub fn run(python: Option<&Path>, data_dir: &Path, size: u64, runs: usize, quick: bool) -> Result<String> {
    let command = format!("cargo xtask {}", std::env::args().skip(1).collect::<Vec<_>>().join(" "));
    let mut s = format!("## Object storage: S3 (s3s-fs {S3S_FS_VERSION}) on 127.0.0.1\n\n");
    let bin = match s3s_fs() {
        Ok(b) => b,
        Err(why) => {
            eprintln!("object rows skipped: {why}");
            let _ = writeln!(s, "Skipped: {why}.");
            return Ok(s);
        }
    };
    let file = crate::bench::kit::sample(data_dir, size)?;
    let model = model_dir(data_dir, size)?;
    let shards = shard_names(&model)?;
    let s3_root = data_dir.join("s3");
    let server = match start_server(&bin, &s3_root) {
        Ok(server) => server,
        Err(why) => {
            eprintln!("object rows skipped: {why:#}");
            let _ = writeln!(s, "Skipped: {why:#}.");
            return Ok(s);
        }
    };
    eprintln!("s3s-fs listening on 127.0.0.1:{} after {:.3} s", server.port, server.start_s);
    // turboio's backend installs the TLS provider object_store's HTTP client needs (even for
    // plain HTTP) when it builds its first store: list the bucket through it once.
    let opts = turboio::object::ObjectOptions::from_pairs([
        ("endpoint", endpoint(server.port).as_str()),
        ("region", REGION),
        ("access_key_id", ACCESS_KEY),
        ("secret_access_key", SECRET_KEY),
    ])
    .map_err(anyhow::Error::msg)?;
    turboio::object::ObjectStorage::new(opts)
        .list(Path::new(&format!("s3://{BUCKET}/")))
        .context("listing the bench bucket through turboio")?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let direct = store(server.port)?;

    // Uploads, through the server, of what is not there yet.
    let file_key = Key::from(FILE_KEY);
    let mut model_files = vec!["model.safetensors.index.json".to_owned()];
    model_files.extend(shards.iter().cloned());
    let t = Instant::now();
    let mut uploaded = 0u64;
    let mut todo: Vec<(PathBuf, Key)> = vec![(file.clone(), file_key.clone())];
    todo.extend(model_files.iter().map(|n| (model.join(n), Key::from(format!("{MODEL_PREFIX}/{n}")))));
    for (local, key) in &todo {
        if rt
            .block_on(upload(&direct, local, key))
            .with_context(|| format!("uploading {} as {key}", local.display()))?
        {
            eprintln!("uploaded {} as s3://{BUCKET}/{key}", local.display());
            uploaded += std::fs::metadata(local)?.len();
        }
    }
    // Objects of an earlier model (another size) under the prefix go.
    let listed: Vec<Key> = rt.block_on(async {
        direct.list(Some(&Key::from(MODEL_PREFIX))).map_ok(|m| m.location).try_collect::<Vec<_>>().await
    })?;
    for k in listed {
        if !model_files.iter().any(|n| k.as_ref() == format!("{MODEL_PREFIX}/{n}")) {
            rt.block_on(direct.delete(&k))?;
        }
    }
    let upload_note = if uploaded > 0 {
        format!("{:.2} GB uploaded through the server in {:.1} s", uploaded as f64 / 1e9, t.elapsed().as_secs_f64())
    } else {
        "objects already on the server (same sizes), not uploaded again".to_owned()
    };

    let file_len = std::fs::metadata(&file)?.len();
    let model_objects: Vec<(Key, u64)> = shards
        .iter()
        .map(|n| Ok((Key::from(format!("{MODEL_PREFIX}/{n}")), std::fs::metadata(model.join(n))?.len())))
        .collect::<Result<_>>()?;
    let model_len: u64 = model_objects.iter().map(|(_, l)| l).sum();
    let bucket_dir = s3_root.join(BUCKET);
    let tmp = data_dir.join("object-tmp");
    std::fs::create_dir_all(&tmp)?;
    let (py, skip_turbo, skip_runai, skip_boto3) = match python {
        None => {
            let why = Some("no Python (--no-python)".to_owned());
            (None, why.clone(), why.clone(), why)
        }
        Some(p) => (
            Some(Py {
                python: p,
                tmp: tmp.clone(),
                // A load at 5 MB/s would be broken, not slow.
                timeout: Duration::from_secs_f64((file_len.max(model_len) as f64 / 5e6).max(300.0)),
            }),
            python_ok(p, "import turboio._turboio as t; t.ObjectStorage")
                .err()
                .map(|e| format!("the installed turboio wheel has no object-storage support ({e})")),
            runai_ready(p),
            python_ok(p, "import boto3, safetensors.torch").err(),
        ),
    };
    let setup = Setup {
        rt: &rt,
        py,
        skip_turbo,
        skip_runai,
        skip_boto3,
        file_url: format!("s3://{BUCKET}/{FILE_KEY}"),
        model_url: format!("s3://{BUCKET}/{MODEL_PREFIX}"),
        shard_urls: shards.iter().map(|n| format!("s3://{BUCKET}/{MODEL_PREFIX}/{n}")).collect::<Vec<_>>().join(","),
        objects: [vec![(file_key, file_len)], model_objects],
        stored: [
            vec![bucket_dir.join(FILE_KEY)],
            shards.iter().map(|n| bucket_dir.join(MODEL_PREFIX).join(n)).collect(),
        ],
        runs,
        trials: if quick { &RUNAI_TRIALS[1..2] } else { &RUNAI_TRIALS },
        local: [file.clone(), model.clone()],
        local_files: [vec![file.clone()], shards.iter().map(|n| model.join(n)).collect()],
        cache_cold: tmp.join("node-cache-cold"),
        cache_warm: tmp.join("node-cache-warm"),
    };

    // The local files (written by the bench's generator) and the server's copies (written by
    // its uploads) are taken out of the page cache once, and read back by the warm before each
    // run, as the warm cache's entries are (written with O_DIRECT, then read): the same bytes
    // then sit in the page cache alike, in read-ahead's large folios, and the local rows compare
    // the cache's work, not how each file got into memory.
    for p in setup.local_files.iter().chain(&setup.stored).flatten() {
        crate::bench::kit::evict(p)?;
    }
    eprintln!("object rows, no added latency, {runs} runs ...");
    let plain = setup.measure(server.port, "No added latency (loopback)".into(), &LOADERS);
    let proxy = start_proxy(&rt, server.port, LATENCY)?;
    eprintln!("object rows, {} ms added to every request, {runs} runs ...", LATENCY.as_millis());
    let slow = setup.measure(
        proxy.port,
        format!("{} ms added to every request (a TCP proxy holds each read from the client)", LATENCY.as_millis()),
        &LOADERS,
    );
    drop(proxy);
    eprintln!("object rows, several processes ...");
    let together = cluster_rows(&setup, server.port)?;
    let server_start = server.start_s;
    drop(server);
    // The same objects from a server that is not the limit.
    let fast = match crate::test::nginx() {
        None => Err("nginx is not installed (Debian's nginx-light; `cargo xtask test` installs it as root)".to_owned()),
        Some(bin) => start_nginx(&bin, &s3_root, &tmp.join("nginx")).map_err(|e| format!("{e:#}")),
    };
    let nginx_loaders: Vec<Loader> = LOADERS.into_iter().filter(|l| !l.cache_row()).collect();
    let fast = fast.map(|nginx| {
        eprintln!("object rows against nginx, no added latency, {runs} runs ...");
        let plain = setup.measure(nginx.port, "nginx, no added latency (loopback)".into(), &nginx_loaders);
        let slow = start_proxy(&rt, nginx.port, LATENCY).map(|proxy| {
            eprintln!("object rows against nginx, {} ms added to every request, {runs} runs ...", LATENCY.as_millis());
            setup.measure(
                proxy.port,
                format!("nginx, {} ms added to every request (the same proxy)", LATENCY.as_millis()),
                &nginx_loaders,
            )
        });
        (plain, slow)
    });
    let _ = std::fs::remove_dir_all(&tmp);

    let _ = writeln!(
        s,
        "`{command}`, {} ({}). Server: s3s-fs {S3S_FS_VERSION}, signed requests, path style; started \
         (listening) in {:.3} s; {upload_note}. File: s3://{BUCKET}/{FILE_KEY}, {:.2} GB ({}); model: \
         s3://{BUCKET}/{MODEL_PREFIX}/, {} shards + index, {:.2} GB. Median of {runs} runs; each Python \
         load in a process of its own, all loaders (and the ceilings) in a shuffled order each run, the \
         server's files in the page cache before each. s = from the call to a dict of CPU tensors holding \
         everything, plus a first read of one byte of every 4 KiB page. Peak RSS: the process's \
         ru_maxrss (file / model; importing torch alone is about 0.3 GiB). \"vs ceiling\": the faster \
         ceiling's time / this time (1.00x = the server's own speed); \"vs Run:ai\": the faster Run:ai \
         row's time / this time.\n",
        date(),
        machine(),
        server_start,
        file_len as f64 / 1e9,
        size_name(size),
        shards.len(),
        model_len as f64 / 1e9,
    );
    let lens = [file_len, model_len];
    for t in [&plain, &slow] {
        render(&mut s, t, lens);
    }
    s.push_str(&together);
    let _ = writeln!(
        s,
        "### The same objects served by nginx, a server faster than the client\n\n\
         s3s-fs streams every GET in 4 KiB reads: its own throughput (the ceiling rows above) sets \
         the pace of every loader, boto3's download included. S3's read path is plain HTTP (a \
         path-style GET with a Range header, a HEAD), so nginx serves the files s3s-fs keeps under \
         its root, the same bytes at the same URLs (its own ETags; signatures ignored; sendfile). \
         The same loaders, processes, order and median; the node cache's rows are not repeated.\n"
    );
    let mut fast_tables = Vec::new();
    match &fast {
        Err(why) => {
            let _ = writeln!(s, "Skipped: {why}.\n");
        }
        Ok((plain, slow)) => {
            render(&mut s, plain, lens);
            fast_tables.push(("nginx, 0 ms", plain));
            match slow {
                Ok(t) => {
                    render(&mut s, t, lens);
                    fast_tables.push(("nginx, 20 ms", t));
                }
                Err(e) => {
                    let _ = writeln!(s, "The 20 ms rows: the proxy did not start ({e:#}).\n");
                }
            }
        }
    }
    let mut checks: Vec<(String, Option<f64>, f64)> = Vec::new();
    let tables = [("0 ms", &plain), ("20 ms", &slow)].into_iter().chain(fast_tables);
    for (lat, t) in tables {
        for (target, what) in TARGETS.iter().enumerate() {
            let time = |l| find(t, l).and_then(|r| r.time(target));
            let me = time(Loader::Turbo);
            let ratio = |other: Option<f64>| Some(other? / me?);
            let ceiling = best_ceiling(t, target);
            checks.push((format!("{lat}, {what}: turboio vs the ceiling"), ratio(ceiling), 0.85));
            checks.push((format!("{lat}, {what}: turboio vs Run:ai (faster row)"), ratio(best_runai(t, target)), 1.0));
            checks.push((
                format!("{lat}, {what}: turboio vs boto3 download + load_file"),
                ratio(time(Loader::Boto3)),
                1.5,
            ));
            // What is reachable here: the ceiling that writes the bytes into memory as a loader
            // must; and whether even the ceiling is 1.5x boto3 (on a server-bound machine the
            // download runs at the server's speed too).
            let kept = time(Loader::CeilingKept(16));
            checks.push((format!("{lat}, {what}: turboio vs the ceiling that keeps the bytes"), ratio(kept), 0.85));
            let faulted = time(Loader::CeilingFaulted(16));
            checks.push((
                format!("{lat}, {what}: turboio vs the floor of a loader (GETs + fresh memory faulted)"),
                ratio(faulted),
                0.85,
            ));
            checks.push((
                format!("{lat}, {what}: (limit) the floor of a loader vs the ceiling"),
                ceiling.zip(faulted).map(|(c, f)| c / f),
                0.85,
            ));
            let boto3 = time(Loader::Boto3);
            checks.push((
                format!("{lat}, {what}: (limit) the ceiling itself vs boto3 download + load_file"),
                boto3.zip(ceiling).map(|(b, c)| b / c),
                1.5,
            ));
            // The node cache (its rows are not in the nginx tables): a cold load that fills it
            // within 1.1x of one without it, a warm one within 1.2x of a local file (ratios as
            // "faster is higher": 1/1.1, 1/1.2).
            if find(t, Loader::TurboCacheWarm).is_none() {
                continue;
            }
            let pairs = |a, b| paired_ratio(find(t, a)?, find(t, b)?, target);
            checks.push((
                format!(
                    "{lat}, {what}: turboio without the cache vs with an empty cache it fills (median of the \
                     back-to-back pairs' ratios)"
                ),
                pairs(Loader::Turbo, Loader::TurboCacheCold),
                1.0 / 1.1,
            ));
            checks.push((
                format!(
                    "{lat}, {what}: turboio filling the cache vs the floor of a fill (the kept-bytes ceiling doing \
                     the same writes)"
                ),
                time(Loader::CeilingFilled(16)).zip(time(Loader::TurboCacheCold)).map(|(a, b)| a / b),
                1.0 / 1.1,
            ));
            checks.push((
                format!(
                    "{lat}, {what}: (limit of a fill) the ceiling that keeps the bytes vs the same with each part \
                     written to a local file as it arrives (pairs, as above)"
                ),
                pairs(Loader::CeilingKept(16), Loader::CeilingFilled(16)),
                1.0 / 1.1,
            ));
            checks.push((
                format!("{lat}, {what}: a local file vs turboio with a warm node cache"),
                time(Loader::LocalFile).zip(time(Loader::TurboCacheWarm)).map(|(a, b)| a / b),
                1.0 / 1.2,
            ));
            // A load that asks returns when the HEADs have answered, at the earliest, and the
            // first read of its pages comes after that: its floor is the longer of the local
            // load and the HEADs, plus the local row's read of the pages.
            let touch = find(t, Loader::LocalFile).and_then(|r| r.touch(target));
            let floor = time(Loader::LocalFile)
                .zip(touch)
                .zip(time(Loader::Heads))
                .map(|((l, touch), heads)| (l - touch).max(heads) + touch);
            checks.push((
                format!(
                    "{lat}, {what}: (limit of asking) a local file vs the longer of its load and the HEADs alone, \
                     plus its first read of the pages"
                ),
                time(Loader::LocalFile).zip(floor).map(|(a, b)| a / b),
                1.0 / 1.2,
            ));
            checks.push((
                format!("{lat}, {what}: a local file vs turboio with a warm node cache trusted for an hour"),
                time(Loader::LocalFile).zip(time(Loader::TurboCacheTrusted)).map(|(a, b)| a / b),
                1.0 / 1.2,
            ));
        }
    }
    if quick {
        let _ = writeln!(s, "Smoke run (--quick): timings only, no checks (their thresholds are for 1-4 GiB).");
    } else {
        let _ = writeln!(s, "| check | ratio | needed | |\n|---|---:|---:|---|");
        for (what, ratio, need) in checks {
            match ratio {
                Some(r) => {
                    let verdict = if r >= need { "ok" } else { "BELOW" };
                    let _ = writeln!(s, "| {what} | {r:.2}x | {need:.2}x | {verdict} |");
                }
                None => {
                    let _ = writeln!(s, "| {what} | | {need:.2}x | not measured |");
                }
            }
        }
    }
    Ok(s)
}

/// The median of `a`'s time over `b`'s, sample by sample: the rows measured in pairs
/// ([`PAIRS`]), whose k-th samples ran back to back.
fn paired_ratio(a: &Row, b: &Row, target: usize) -> Option<f64> {
    let (a, b) = (&a.measured(target)?.times, &b.measured(target)?.times);
    (a.len() == b.len()).then(|| median(&a.iter().zip(b).map(|(x, y)| x / y).collect::<Vec<_>>()))
}

fn find(t: &Table, loader: Loader) -> Option<&Row> {
    t.rows.iter().find(|r| r.loader == loader)
}

fn best_ceiling(t: &Table, target: usize) -> Option<f64> {
    t.rows.iter().filter(|r| matches!(r.loader, Loader::Ceiling(_))).filter_map(|r| r.time(target)).reduce(f64::min)
}

fn best_runai(t: &Table, target: usize) -> Option<f64> {
    t.rows
        .iter()
        .filter(|r| matches!(r.loader, Loader::RunaiDefault | Loader::RunaiTuned))
        .filter_map(|r| r.time(target))
        .reduce(f64::min)
}

fn render(s: &mut String, t: &Table, lens: [u64; 2]) {
    let _ = writeln!(s, "### {}\n", t.title);
    let _ = writeln!(
        s,
        "| loader | file s | file GB/s | model s | model GB/s | peak RSS GiB | vs ceiling | vs Run:ai | notes |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---|");
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    for r in &t.rows {
        if let Some(why) = &r.skipped {
            let _ = writeln!(s, "| {} | skipped | | | | | | | {why} |", r.loader.name());
            continue;
        }
        let mut cols = Vec::new();
        let mut notes = Vec::new();
        if !r.note.is_empty() {
            notes.push(r.note.clone());
        }
        let mut vs_ceiling = Vec::new();
        let mut vs_runai = Vec::new();
        for target in 0..2 {
            match r.time(target) {
                Some(m) => {
                    cols.push(format!("{m:.3}"));
                    cols.push(format!("{:.2}", lens[target] as f64 / m / 1e9));
                    vs_ceiling.push(best_ceiling(t, target).map_or("-".into(), |c| format!("{:.2}x", c / m)));
                    vs_runai.push(best_runai(t, target).map_or("-".into(), |c| format!("{:.2}x", c / m)));
                }
                None => {
                    cols.push("failed".into());
                    cols.push(String::new());
                    vs_ceiling.push("-".into());
                    vs_runai.push("-".into());
                    if let Some(e) = &r.cells[target].failed {
                        notes.push(format!("{} failed: {}", TARGETS[target], e.replace('|', "/")));
                    }
                }
            }
        }
        let rss = if r.loader.in_process() {
            "n/a".to_owned()
        } else {
            format!("{:.2} / {:.2}", gib(r.cells[0].peak_rss), gib(r.cells[1].peak_rss))
        };
        let _ = writeln!(
            s,
            "| {} | {} | {rss} | {} | {} | {} |",
            r.loader.name(),
            cols.join(" | "),
            vs_ceiling.join(" / "),
            vs_runai.join(" / "),
            notes.join("; ")
        );
    }
    let _ = writeln!(s);
}
