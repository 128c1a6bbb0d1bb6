//! `cargo xtask bench --gpu-model`: staged loads of a model directory through the performance
//! model of a GPU (`ModelDevice`: the H200 VMs' link and pinning rates, no GPU needed), hot and
//! cold, against ceilings measured in the same run with the same readers and slots:
//!
//! - hot: `pread` from the page cache into locked, reused memory (each reader its own slots);
//! - cold, page cache kept: the same `pread`s led by one `POSIX_FADV_WILLNEED` cursor;
//! - cold, page cache bypassed: `O_DIRECT` through io_uring into locked memory (a ring per
//!   reader, a request in flight per slot).
//!
//! turboio's rows: the steady state (loads in one process sharing one device, as the CLI's
//! `--repeat`, Python and the vLLM plug-in do) and the first load in a new process (a child
//! process made for each run, its pinning included). Each row says its median, GB/s, CPU
//! seconds per GB, and the model's counters per load (pinned allocations and bytes, events
//! created, synchronisations, time readers waited on uploads, link busy). The fixed cost of a
//! load is the intercept of the steady-state hot loads of a small and the big model.

use crate::bench::kit::{
    date, drop_caches, evict, machine, median_of, run_order, sample, sharded_model, size_name, warm,
};
use anyhow::{Context, Result};
use io_uring::{opcode, types, IoUring};
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use turboio::device::testing::{GpuModel, ModelCounters, ModelDevice};
use turboio::device::{Arena, Device};
use turboio::{CachePolicy, LoadMode, LoadOptions};

/// Slots per reader and bytes per slot, as the staging engine's defaults.
const SLOTS: usize = 2;
const CHUNK: usize = 8 << 20;
/// The read-ahead step of the cold, kept ceiling (the engine's).
const STEP: u64 = 32 << 20;

/// The child process of a "first load in a new process" row.
#[derive(clap::Args, Debug)]
pub struct ChildArgs {
    /// The model directory.
    dir: PathBuf,
    #[arg(long)]
    threads: usize,
    #[arg(long, default_value = "")]
    model: String,
    /// A real device (`cuda:0`) instead of the model.
    #[arg(long, default_value = "")]
    device: String,
}

/// One row's measurements.
#[derive(Default)]
struct Row {
    name: &'static str,
    cache: &'static str,
    secs: Vec<f64>,
    cpu: Vec<f64>,
    counters: Option<ModelCounters>,
    how: String,
}

impl Row {
    fn median(&self) -> f64 {
        median_of(&self.secs)
    }
}

/// CPU seconds (user + system) this process has used.
fn cpu_self() -> f64 {
    let u = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF);
    u.map(|u| {
        let t = |v: nix::sys::time::TimeVal| v.tv_sec() as f64 + v.tv_usec() as f64 / 1e6;
        t(u.user_time()) + t(u.system_time())
    })
    .unwrap_or(0.0)
}

fn shards(dir: &Path) -> Result<Vec<(PathBuf, u64)>> {
    let mut out: Vec<(PathBuf, u64)> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| {
            let len = std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
            (p, len)
        })
        .collect();
    out.sort();
    Ok(out)
}

/// Where the staged loads go: the model of a GPU (with its counters), or a real device
/// (`--device cuda:N`: the same rows on a GPU, without counters).
#[derive(Clone)]
enum Target {
    Model(Arc<ModelDevice>),
    Real(Arc<dyn Device>),
}

impl Target {
    /// The model with `spec`'s settings, or the device `device` names.
    fn open(device: Option<&str>, spec: &str) -> Result<Target> {
        match device {
            None | Some("") => {
                let model = GpuModel::parse(spec).map_err(anyhow::Error::msg)?;
                Ok(Target::Model(Arc::new(ModelDevice::new(0, model))))
            }
            Some(d) => {
                let id = turboio::device::DeviceId::parse(d).map_err(anyhow::Error::msg)?;
                Ok(Target::Real(turboio::device::open_device(id)?))
            }
        }
    }

    fn device(&self) -> Arc<dyn Device> {
        match self {
            Target::Model(m) => m.clone(),
            Target::Real(d) => d.clone(),
        }
    }

    fn counters(&self) -> Option<ModelCounters> {
        match self {
            Target::Model(m) => Some(m.counters()),
            Target::Real(_) => None,
        }
    }
}

fn opts(device: &Target, threads: usize, cache: CachePolicy) -> LoadOptions {
    LoadOptions { device: Some(device.device()), threads, mode: LoadMode::Copied, cache, ..Default::default() }
}

/// The ceilings' chunks: (file, offset, length) in file order, boundaries every [`CHUNK`].
fn chunks(files: &[(PathBuf, u64)]) -> Vec<(usize, u64, usize)> {
    let mut out = Vec::new();
    for (i, (_, len)) in files.iter().enumerate() {
        let mut at = 0;
        while at < *len {
            let n = (CHUNK as u64).min(len - at) as usize;
            out.push((i, at, n));
            at += n as u64;
        }
    }
    out
}

/// Locked, faulted-in slots for one reader.
fn slots() -> Result<Vec<Arena>> {
    (0..SLOTS)
        .map(|_| {
            let a = Arena::new(CHUNK, false)?;
            if a.lock().is_err() {
                a.prefault(1);
            }
            Ok(a)
        })
        .collect()
}

/// Reads every chunk with `pread` (`O_DIRECT` when `direct`) into `readers` threads' own
/// locked slots; with `lead`, one more thread asks the kernel for the chunks ahead. Returns the
/// seconds it took (the slots are made before the clock starts).
fn pread_ceiling(files: &[(PathBuf, u64)], readers: usize, direct: bool, lead: bool) -> Result<f64> {
    let flags = if direct { nix::fcntl::OFlag::O_DIRECT.bits() } else { 0 };
    let handles: Vec<File> = files
        .iter()
        .map(|(p, _)| OpenOptions::new().read(true).custom_flags(flags).open(p))
        .collect::<std::io::Result<_>>()?;
    let list = chunks(files);
    let mut all_slots: Vec<Vec<Arena>> = (0..readers).map(|_| slots()).collect::<Result<_>>()?;
    let next = AtomicUsize::new(0);
    let done = std::sync::atomic::AtomicBool::new(false);
    let t = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        if lead {
            // Every chunk asked for in order, a step at a time (the kernel blocks the call while
            // the device's queue is full): no window, the most read-ahead can do.
            s.spawn(|| {
                for &(f, off, _) in list.iter().step_by(STEP as usize / CHUNK) {
                    if done.load(Ordering::Relaxed) {
                        return;
                    }
                    let _ = nix::fcntl::posix_fadvise(
                        &handles[f],
                        off as i64,
                        STEP as i64,
                        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_WILLNEED,
                    );
                }
            });
        }
        let workers: Vec<_> = all_slots
            .iter_mut()
            .map(|mine| {
                let (list, handles, next) = (&list, &handles, &next);
                s.spawn(move || -> std::io::Result<()> {
                    let mut k = 0;
                    while let Some(&(f, off, n)) = list.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let buf = mine[k % SLOTS].as_mut_slice();
                        // O_DIRECT reads whole blocks (the last comes back short).
                        let want = if direct { n.next_multiple_of(4096) } else { n };
                        let mut got = 0;
                        while got < n {
                            let r = handles[f].read_at(&mut buf[got..want], off + got as u64)?;
                            if r == 0 {
                                break;
                            }
                            got += r;
                        }
                        k += 1;
                    }
                    Ok(())
                })
            })
            .collect();
        let mut result = Ok(());
        for w in workers {
            let r = w.join().map_err(|_| anyhow::anyhow!("a ceiling reader panicked"))?;
            result = result.and(r.map_err(anyhow::Error::from));
        }
        done.store(true, Ordering::Relaxed);
        result
    })?;
    Ok(t.elapsed().as_secs_f64())
}

/// `O_DIRECT` through io_uring: a ring per reader, one request in flight per slot (the slots
/// registered as the ring's fixed buffers), each completion resubmitting its slot for the next
/// chunk. Returns the seconds it took.
fn uring_ceiling(files: &[(PathBuf, u64)], readers: usize) -> Result<f64> {
    let handles: Vec<File> = files
        .iter()
        .map(|(p, _)| OpenOptions::new().read(true).custom_flags(nix::fcntl::OFlag::O_DIRECT.bits()).open(p))
        .collect::<std::io::Result<_>>()?;
    let list = chunks(files);
    let mut all_slots: Vec<Vec<Arena>> = (0..readers).map(|_| slots()).collect::<Result<_>>()?;
    let next = AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<_> = all_slots
            .iter_mut()
            .map(|mine| {
                let (list, handles, next) = (&list, &handles, &next);
                s.spawn(move || -> Result<()> {
                    let mut ring: IoUring = IoUring::new(SLOTS as u32 * 2)?;
                    let ptrs: Vec<*mut u8> = mine.iter_mut().map(|a| a.as_mut_slice().as_mut_ptr()).collect();
                    // The slots as the ring's fixed buffers, as the engine's are (the kernel pins
                    // them once, not at every read); plain reads where the kernel refuses.
                    let iov: Vec<libc::iovec> =
                        ptrs.iter().map(|&p| libc::iovec { iov_base: p.cast(), iov_len: CHUNK }).collect();
                    // SAFETY: every slot is a live arena of CHUNK bytes, kept until the ring is
                    // dropped at the end of this thread.
                    let fixed = unsafe { ring.submitter().register_buffers(&iov) }.is_ok();
                    let submit = |ring: &mut IoUring, slot: usize| -> Result<bool> {
                        let Some(&(f, off, n)) = list.get(next.fetch_add(1, Ordering::Relaxed)) else {
                            return Ok(false);
                        };
                        let (fd, len) = (types::Fd(handles[f].as_raw_fd()), n.next_multiple_of(4096) as u32);
                        let e = if fixed {
                            opcode::ReadFixed::new(fd, ptrs[slot], len, slot as u16).offset(off).build()
                        } else {
                            opcode::Read::new(fd, ptrs[slot], len).offset(off).build()
                        }
                        .user_data(slot as u64);
                        // SAFETY: the slot (CHUNK bytes, locked) outlives the request: every
                        // request is reaped before this thread returns, and a slot is
                        // resubmitted only after its completion.
                        unsafe { ring.submission().push(&e) }.map_err(|_| anyhow::anyhow!("queue full"))?;
                        Ok(true)
                    };
                    let mut inflight = 0;
                    for slot in 0..SLOTS {
                        if submit(&mut ring, slot)? {
                            inflight += 1;
                        }
                    }
                    while inflight > 0 {
                        ring.submit_and_wait(1)?;
                        let done: Vec<(u64, i32)> = ring.completion().map(|c| (c.user_data(), c.result())).collect();
                        for (slot, res) in done {
                            inflight -= 1;
                            anyhow::ensure!(res >= 0, "O_DIRECT read: {}", std::io::Error::from_raw_os_error(-res));
                            if submit(&mut ring, slot as usize)? {
                                inflight += 1;
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().map_err(|_| anyhow::anyhow!("a ceiling reader panicked"))??;
        }
        Ok(())
    })?;
    Ok(t.elapsed().as_secs_f64())
}

/// One staged load of the single file `path` through `device`; returns its seconds.
fn staged_file(path: &Path, device: &Target, threads: usize) -> Result<f64> {
    let t = Instant::now();
    let f = turboio::load(path, &opts(device, threads, CachePolicy::Keep))?;
    let secs = t.elapsed().as_secs_f64();
    anyhow::ensure!(f.report().read.method.starts_with("staged"), "{}: {}", path.display(), f.report().read.method);
    Ok(secs)
}

/// Hot single-file loads of two sizes, turboio's and the ceiling's medians.
#[derive(Default)]
struct Fixed {
    bytes: [u64; 2],
    ours: [f64; 2],
    ceiling: [f64; 2],
}

impl Fixed {
    /// The intercepts of t = a + bytes / rate: turboio's and the ceiling's.
    fn intercepts(&self) -> (f64, f64) {
        let at = |t: [f64; 2]| {
            let slope = (t[1] - t[0]) / (self.bytes[1] - self.bytes[0]) as f64;
            t[0] - slope * self.bytes[0] as f64
        };
        (at(self.ours), at(self.ceiling))
    }
}

/// One staged load of the model through `device`; returns (seconds, CPU seconds, counters).
fn staged(
    dir: &Path,
    device: &Target,
    threads: usize,
    cache: CachePolicy,
) -> Result<(f64, f64, Option<ModelCounters>)> {
    let before = device.counters();
    let cpu = cpu_self();
    let t = Instant::now();
    let m = turboio::load_model(dir, &opts(device, threads, cache))?;
    let secs = t.elapsed().as_secs_f64();
    let cpu = cpu_self() - cpu;
    let c = device.counters().zip(before).map(|(after, before)| after.since(&before));
    anyhow::ensure!(m.shards().len() > 1, "{}: not a sharded model", dir.display());
    anyhow::ensure!(c.is_none_or(|c| c.uploaded_bytes > 0), "nothing went through the model device");
    drop(m);
    Ok((secs, cpu, c))
}

/// `xtask gpu-model-child`: one load of the model in this new process, through a new model
/// device; prints its seconds, CPU seconds and counters as one JSON line.
pub fn child(args: ChildArgs) -> Result<()> {
    let device = Target::open(Some(&args.device), &args.model)?;
    let (secs, cpu, c) = staged(&args.dir, &device, args.threads, CachePolicy::Keep)?;
    let counters = c.map(|c| counters_json(&c));
    println!("{}", serde_json::json!({"secs": secs, "cpu": cpu, "counters": counters}));
    Ok(())
}

fn counters_json(c: &ModelCounters) -> serde_json::Value {
    serde_json::json!({
        "uploads": c.uploads, "uploaded_bytes": c.uploaded_bytes, "pinned_allocations": c.pinned_allocations,
        "pinned_bytes": c.pinned_bytes, "pin_s": c.pin_time.as_secs_f64(), "events_created": c.events_created,
        "synchronizations": c.synchronizations, "upload_waits": c.upload_waits,
        "upload_wait_s": c.upload_wait_time.as_secs_f64(), "link_busy_s": c.link_busy.as_secs_f64(),
    })
}

fn counters_from(v: &serde_json::Value) -> ModelCounters {
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let d = |k: &str| Duration::from_secs_f64(v[k].as_f64().unwrap_or(0.0));
    ModelCounters {
        allocations: 0,
        uploads: n("uploads"),
        uploaded_bytes: n("uploaded_bytes"),
        pinned_allocations: n("pinned_allocations"),
        pinned_bytes: n("pinned_bytes"),
        pin_time: d("pin_s"),
        events_created: n("events_created"),
        synchronizations: n("synchronizations"),
        upload_waits: n("upload_waits"),
        upload_wait_time: d("upload_wait_s"),
        link_busy: d("link_busy_s"),
    }
}

fn first_in_new_process(
    dir: &Path,
    threads: usize,
    model: &str,
    device: Option<&str>,
) -> Result<(f64, f64, Option<ModelCounters>)> {
    let exe = std::env::current_exe()?;
    let out = std::process::Command::new(exe)
        .args(["gpu-model-child", "--threads", &threads.to_string(), "--model", model])
        .args(["--device", device.unwrap_or_default()])
        .arg(dir)
        .output()?;
    anyhow::ensure!(out.status.success(), "the child load failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("the child's JSON")?;
    let counters = (!v["counters"].is_null()).then(|| counters_from(&v["counters"]));
    Ok((v["secs"].as_f64().unwrap_or(f64::NAN), v["cpu"].as_f64().unwrap_or(0.0), counters))
}

const CEIL_HOT: &str = "ceiling: pread into locked memory";
const CEIL_KEPT: &str = "ceiling: pread + one WILLNEED cursor";
const CEIL_DIRECT: &str = "ceiling: O_DIRECT io_uring into locked memory";
const STEADY: &str = "turboio staged, steady state";
const FIRST: &str = "turboio staged, first load in a new process";
const STEADY_DIRECT: &str = "turboio staged, steady state, cache=bypass";

/// The bench: returns its Markdown.
pub fn run(
    data_dir: &Path,
    size: u64,
    small: u64,
    runs: usize,
    no_cold: bool,
    model_spec: &str,
    on: Option<&str>,
) -> Result<String> {
    let model = GpuModel::parse(model_spec).map_err(anyhow::Error::msg)?;
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let big = sharded_model(data_dir, size)?;
    let little = sharded_model(data_dir, small)?;
    let files = shards(&big)?;
    let total: u64 = files.iter().map(|f| f.1).sum();
    let device = Target::open(on, model_spec)?;
    // Hot files as a read leaves them (large folios), not as their writes did (see `evict`).
    let little_files = shards(&little)?;
    for f in files.iter().chain(&little_files) {
        evict(&f.0)?;
        warm(&f.0)?;
    }
    // The steady state: the device's pool already holds the slots.
    staged(&big, &device, threads, CachePolicy::Keep)?;

    let mut rows: Vec<Row> = Vec::new();
    let row = |rows: &mut Vec<Row>, name, cache, how: &str| {
        rows.push(Row { name, cache, how: how.to_owned(), ..Default::default() });
        rows.len() - 1
    };
    let chunk_how = format!("{threads} readers x {SLOTS} slots of {} MiB", CHUNK >> 20);
    // Hot.
    let hot = [
        row(&mut rows, CEIL_HOT, "hot", &chunk_how),
        row(&mut rows, STEADY, "hot", "one ModelDevice for every load (its pool warm)"),
        row(&mut rows, FIRST, "hot", "a child process per run: new device, new pool"),
    ];
    eprintln!("gpu model, {}: hot, {runs} runs ...", big.display());
    for r in 0..runs {
        for k in run_order(hot.len(), r) {
            let i = hot[k];
            let (secs, cpu, c) = match rows[i].name {
                CEIL_HOT => {
                    let cpu = cpu_self();
                    let s = pread_ceiling(&files, threads, false, false)?;
                    (s, cpu_self() - cpu, None)
                }
                STEADY => staged(&big, &device, threads, CachePolicy::Keep)?,
                _ => first_in_new_process(&big, threads, model_spec, on)?,
            };
            rows[i].secs.push(secs);
            rows[i].cpu.push(cpu);
            rows[i].counters = c.or(rows[i].counters);
        }
    }
    // The fixed cost: steady-state hot loads of the small model and of two single files, and
    // the ceiling's reads of the same files.
    let small_total: u64 = little_files.iter().map(|f| f.1).sum();
    staged(&little, &device, threads, CachePolicy::Keep)?;
    let (mut small_secs, mut small_ceiling) = (Vec::new(), Vec::new());
    for _ in 0..runs.max(3) {
        small_secs.push(staged(&little, &device, threads, CachePolicy::Keep)?.0);
        small_ceiling.push(pread_ceiling(&little_files, threads, false, false)?);
    }
    eprintln!("gpu model: single files of {} and {}, hot ...", size_name(small), size_name(size));
    let singles = [sample(data_dir, small)?, sample(data_dir, size)?];
    let mut fixed = Fixed::default();
    for (k, path) in singles.iter().enumerate() {
        evict(path)?;
        warm(path)?;
        let len = std::fs::metadata(path)?.len();
        fixed.bytes[k] = len;
        let one = [(path.clone(), len)];
        staged_file(path, &device, threads)?;
        let (mut ours, mut ceiling) = (Vec::new(), Vec::new());
        for _ in 0..runs.max(3) {
            ours.push(staged_file(path, &device, threads)?);
            ceiling.push(pread_ceiling(&one, threads, false, false)?);
        }
        fixed.ours[k] = median_of(&ours);
        fixed.ceiling[k] = median_of(&ceiling);
    }

    // Cold.
    let mut cold_note = None;
    if !no_cold {
        let cold = [
            row(
                &mut rows,
                CEIL_KEPT,
                "cold",
                &format!("{chunk_how}; one POSIX_FADV_WILLNEED cursor over the whole model"),
            ),
            row(&mut rows, STEADY, "cold", "cache=keep: buffered reads behind the engine's read-ahead cursor"),
            row(&mut rows, CEIL_DIRECT, "cold", &format!("{chunk_how}: a ring per reader, {SLOTS} requests in flight, the slots its fixed buffers")),
            row(
                &mut rows,
                STEADY_DIRECT,
                "cold",
                "cache=bypass: O_DIRECT io_uring into the registered slots (a ring per reader), each copy started as its read completes",
            ),
        ];
        eprintln!("gpu model: cold, {runs} runs ...");
        let root = drop_caches().is_ok();
        if !root {
            cold_note = Some("not root: the shards' pages evicted with POSIX_FADV_DONTNEED, not drop_caches");
        }
        for r in 0..runs {
            for k in run_order(cold.len(), r) {
                let i = cold[k];
                if root {
                    drop_caches().map_err(anyhow::Error::msg)?;
                } else {
                    for f in &files {
                        evict(&f.0)?;
                    }
                }
                let (secs, cpu, c) = match rows[i].name {
                    CEIL_KEPT => {
                        let cpu = cpu_self();
                        (pread_ceiling(&files, threads, false, true)?, cpu_self() - cpu, None)
                    }
                    CEIL_DIRECT => {
                        let cpu = cpu_self();
                        (uring_ceiling(&files, threads)?, cpu_self() - cpu, None)
                    }
                    STEADY => staged(&big, &device, threads, CachePolicy::Keep)?,
                    _ => staged(&big, &device, threads, CachePolicy::Bypass)?,
                };
                rows[i].secs.push(secs);
                rows[i].cpu.push(cpu);
                rows[i].counters = c.or(rows[i].counters);
            }
        }
    }
    let target = on.map_or_else(|| model_line(&model), |d| format!("Into {d} (a real device: no model counters)."));
    Ok(render(
        &rows,
        total,
        small_total,
        (&small_secs, &small_ceiling),
        &fixed,
        &target,
        threads,
        runs,
        cold_note,
        &big,
    ))
}

fn model_line(model: &GpuModel) -> String {
    format!(
        "Model: link {:.0} GB/s, pinning {:.1} GB/s + {} µs a call, event wake-up {} µs, {} streams.",
        model.link_bytes_per_s / 1e9,
        model.pin_bytes_per_s / 1e9,
        model.pin_call.as_micros(),
        model.event_wake.as_micros(),
        model.streams
    )
}

fn shard_count(dir: &Path) -> usize {
    shards(dir).map_or(0, |s| s.len())
}

#[allow(clippy::too_many_arguments)]
fn render(
    rows: &[Row],
    total: u64,
    small_total: u64,
    (small_secs, small_ceiling): (&[f64], &[f64]),
    fixed: &Fixed,
    target: &str,
    threads: usize,
    runs: usize,
    cold_note: Option<&str>,
    dir: &Path,
) -> String {
    let mut s = String::new();
    let _ =
        writeln!(s, "### Staged loads into a GPU or its model ({}, {}), median of {runs} runs\n", date(), machine());
    let _ = writeln!(
        s,
        "{target} {} ({:.2} GB, {} readers).{}\n",
        dir.display(),
        total as f64 / 1e9,
        threads,
        cold_note.map(|n| format!(" Cold: {n}.")).unwrap_or_default()
    );
    let _ = writeln!(s, "| cache | row | s | GB/s | CPU s/GB | pinned allocs / MiB per load | events created | syncs | waits on uploads s | link busy s | how |");
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for r in rows {
        let gb = total as f64 / 1e9;
        let c = r.counters.map_or_else(
            || "| | | | | ".to_owned(),
            |c| {
                format!(
                    "{} / {} | {} | {} | {:.3} | {:.3} |",
                    c.pinned_allocations,
                    c.pinned_bytes >> 20,
                    c.events_created,
                    c.synchronizations,
                    c.upload_wait_time.as_secs_f64(),
                    c.link_busy.as_secs_f64()
                )
            },
        );
        let _ = writeln!(
            s,
            "| {} | {} | {:.3} | {:.2} | {:.2} | {c} {} |",
            r.cache,
            r.name,
            r.median(),
            gb / r.median(),
            median_of(&r.cpu) / gb,
            r.how
        );
    }
    let find = |cache: &str, name: &str| rows.iter().find(|r| r.cache == cache && r.name == name).map(Row::median);
    // Each round's ratio (the ceiling's time over ours, samples of the same round, minutes
    // apart at most), then their median: this VM's disk drifts by up to 2x between rounds,
    // which a ratio of the two rows' medians would take from different rounds.
    let paired = |cache: &str, ours: &str, ceiling: &str| {
        let row = |name: &str| rows.iter().find(|r| r.cache == cache && r.name == name);
        let (a, b) = (row(ours)?, row(ceiling)?);
        let ratios: Vec<f64> = a.secs.iter().zip(&b.secs).filter(|(o, _)| **o > 0.0).map(|(o, c)| c / o).collect();
        (!ratios.is_empty()).then(|| median_of(&ratios))
    };
    let _ = writeln!(
        s,
        "\n| check | ratio (speed vs the ceiling; median of each round's ratio) | need | |\n|---|---:|---:|---|"
    );
    let mut check = |what: &str, r: Option<f64>, need: f64| {
        if let Some(r) = r {
            let _ = writeln!(s, "| {what} | {r:.2}x | {need:.2}x | {} |", if r >= need { "ok" } else { "BELOW" });
        }
    };
    check("hot, steady state vs pread into locked memory", paired("hot", STEADY, CEIL_HOT), 0.9);
    check("hot, first load in a new process vs the same ceiling", paired("hot", FIRST, CEIL_HOT), 0.8);
    check("cold, cache kept vs pread + read-ahead cursor", paired("cold", STEADY, CEIL_KEPT), 0.9);
    check("cold, cache bypassed vs O_DIRECT io_uring", paired("cold", STEADY_DIRECT, CEIL_DIRECT), 0.9);
    // The intercept of t = a + bytes / rate through the small and the big model's hot loads.
    let intercept = |small: f64, big: f64| {
        let slope = (big - small) / (total - small_total) as f64;
        small - slope * small_total as f64
    };
    if let (Some(big), Some(big_ceiling)) = (find("hot", STEADY), find("hot", CEIL_HOT)) {
        let (small, small_ceiling) = (median_of(small_secs), median_of(small_ceiling));
        let (ours, theirs) = (intercept(small, big), intercept(small_ceiling, big_ceiling));
        let (file_ours, file_theirs) = fixed.intercepts();
        let _ = writeln!(
            s,
            "\nFixed cost of a load: the intercept of steady-state hot loads of one file of {:.2} GB ({:.4} s) and one of {:.2} GB ({:.3} s) is {:.1} ms (need <= 5 ms: {}); the ceiling's reads of the same files ({:.4} s, {:.3} s) give {:.1} ms. Models of {} shards ({:.2} GB in {small:.3} s, {:.2} GB in {big:.3} s): {:.1} ms; the ceiling's {:.1} ms ({small_ceiling:.3} s, {big_ceiling:.3} s).",
            fixed.bytes[0] as f64 / 1e9,
            fixed.ours[0],
            fixed.bytes[1] as f64 / 1e9,
            fixed.ours[1],
            file_ours * 1e3,
            if file_ours <= 0.005 { "ok" } else { "ABOVE" },
            fixed.ceiling[0],
            fixed.ceiling[1],
            file_theirs * 1e3,
            shard_count(dir),
            small_total as f64 / 1e9,
            total as f64 / 1e9,
            ours * 1e3,
            theirs * 1e3,
        );
    }
    if let (Some(steady), Some(ceiling)) =
        (rows.iter().find(|r| r.name == STEADY && r.cache == "hot"), find("hot", CEIL_HOT))
    {
        if let Some(c) = steady.counters {
            let _ = writeln!(
                s,
                "Steady state: {} pinned allocations, {} pinned bytes and {} events created per load (need 0). Per reader here: {:.2} GB/s from the page cache (the ceiling's {:.2} GB/s over {threads} readers).",
                c.pinned_allocations,
                c.pinned_bytes,
                c.events_created,
                total as f64 / ceiling / 1e9 / threads as f64,
                total as f64 / ceiling / 1e9,
            );
        }
    }
    s
}
