//! The page-cache rows of `cargo xtask bench`: what a load leaves behind for the next process,
//! and what several processes loading the same file at once cost, with the bytes read from
//! the disk measured from the block device's statistics (not assumed).
//!
//! Every loader runs in a Python process of its own (`crates/py/bench/py_load.py`, which also
//! touches one byte of every page of the result, so lazily mapped loaders pay for their reads).
//! Two scenarios, each with the file evicted from the page cache first (`POSIX_FADV_DONTNEED`
//! on the file alone: the interpreter and libraries stay cached, and no root is needed):
//!
//! - **next process**: one load, then a second process loads the same file. The second shows
//!   whether the first left the file in the page cache.
//! - **4 at once**: four processes import everything, wait at a common start signal, then load
//!   the same file together. The time is the slowest of the four (they start within
//!   microseconds of each other); the disk bytes show whether the file was read once or four
//!   times.

use crate::bench::kit::run_order;
use crate::test::root;
use anyhow::{bail, Context, Result};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

/// The loaders compared: turboio's default and each forced mode / cache policy (the names
/// `py_load.py` parses), and the peers. Encrypted rows load the encrypted twin.
pub const LOADERS: [&str; 9] = [
    "turboio auto",
    "turboio mapped",
    "turboio copied",
    "turboio copied, cache bypass",
    "turboio auto, encrypted",
    "turboio copied, cache bypass, encrypted",
    "turboio.load",
    "safetensors.torch.load_file",
    "fastsafetensors",
];

/// Concurrent processes in the second scenario (the full bench's; a smoke run takes fewer).
pub const PROCS: usize = 4;

/// One loader's measurements.
#[derive(Debug, Default, Clone)]
pub struct CacheRow {
    pub loader: &'static str,
    /// First (cold) load, load + touch.
    pub cold: Vec<f64>,
    /// The next process's load.
    pub next: Vec<f64>,
    /// Disk bytes read by the two loads.
    pub disk_two: Vec<u64>,
    /// The slowest of the concurrent loads.
    pub together: Vec<f64>,
    /// Disk bytes read by the concurrent loads.
    pub disk_together: Vec<u64>,
    pub how: String,
    pub skipped: Option<String>,
}

fn median<T: Copy + PartialOrd>(v: &[T]) -> Option<T> {
    let mut t = v.to_vec();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    t.get(t.len() / 2).copied()
}

impl CacheRow {
    pub fn cold(&self) -> Option<f64> {
        median(&self.cold)
    }
    pub fn next(&self) -> Option<f64> {
        median(&self.next)
    }
    pub fn together(&self) -> Option<f64> {
        median(&self.together)
    }
}

/// Bytes read so far from the block device holding `path` (`/sys/dev/block/MAJ:MIN/stat`,
/// sectors of 512 bytes), or `None` where the statistics cannot be found (e.g. tmpfs).
pub fn disk_bytes_read(path: &Path) -> Option<u64> {
    let dev = std::fs::metadata(path).ok()?.dev();
    let (major, minor) = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
    let stat = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/stat")).ok()?;
    let sectors: u64 = stat.split_whitespace().nth(2)?.parse().ok()?;
    Some(sectors * 512)
}

fn child(python: &Path, loader: &str, file: &Path, wait: bool) -> Result<Child> {
    let mut cmd = Command::new(python);
    cmd.arg(root().join("crates/py/bench/py_load.py")).args(["--loader", loader, "--file"]).arg(file);
    if wait {
        cmd.arg("--wait");
    }
    cmd.env("VETURBOIO_KEY", crate::bench::kit::KEY_B64)
        .env("VETURBOIO_IV", crate::bench::kit::IV_B64)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("run {loader}"))
}

/// Parses a child's last JSON line: (load + touch seconds, how).
fn parse(loader: &str, text: &str) -> Result<(f64, String)> {
    let v: serde_json::Value =
        serde_json::from_str(text.lines().last().unwrap_or("")).with_context(|| format!("{loader} printed {text}"))?;
    let secs = v["load_s"].as_f64().unwrap_or(f64::NAN) + v["touch_s"].as_f64().unwrap_or(f64::NAN);
    Ok((secs, v["how"].as_str().unwrap_or("").to_owned()))
}

/// `n` processes that load `file` at the same moment, once all have imported what they need:
/// the slowest one's time, the first one's description, and the bytes read from the disk
/// between the start signal and the end (imports excluded: they read the interpreter's and
/// torch's files).
fn together(python: &Path, loader: &str, file: &Path, n: usize) -> Result<(f64, String, u64)> {
    let mut children = Vec::with_capacity(n);
    for _ in 0..n {
        let mut c = child(python, loader, file, true)?;
        let stdout: ChildStdout = c.stdout.take().context("child stdout")?;
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        reader.read_line(&mut line)?;
        if !line.contains("ready") {
            let _ = c.kill();
            let mut err = String::new();
            if let Some(mut e) = c.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            bail!("{loader} did not get ready: {line}{err}");
        }
        children.push((c, reader));
    }
    let disk0 = disk_bytes_read(file).unwrap_or(0);
    for (c, _) in &mut children {
        c.stdin.as_mut().context("child stdin")?.write_all(b"go\n")?;
    }
    let (mut slowest, mut how) = (0f64, String::new());
    for (mut c, mut reader) in children {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut reader, &mut rest)?;
        let status = c.wait()?;
        if !status.success() {
            let mut err = String::new();
            if let Some(mut e) = c.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            bail!("{loader} failed: {err}");
        }
        let (secs, h) = parse(loader, &rest)?;
        slowest = slowest.max(secs);
        if how.is_empty() {
            how = h;
        }
    }
    let disk = disk_bytes_read(file).unwrap_or(0).saturating_sub(disk0);
    Ok((slowest, how, disk))
}

/// Drops `file` from the page cache (only it: the interpreter's and libraries' pages stay, so
/// no root is needed and nothing else on the machine is disturbed), and checks it worked.
pub(crate) fn evict(file: &Path) -> Result<()> {
    let f = turboio::posix::PosixStorage::new().open_posix(file)?;
    f.evict_cache()?;
    let left = turboio::storage::StorageFile::cached_fraction(&f).unwrap_or(0.0);
    if left > 0.01 {
        bail!(
            "{}: {:.0}% of the file stayed in the page cache after POSIX_FADV_DONTNEED",
            file.display(),
            left * 100.0
        );
    }
    Ok(())
}

/// Runs both scenarios for every loader, `runs` times, in a shuffled order each run.
pub fn measure(python: &Path, file: &Path, encrypted: &Path, runs: usize, procs: usize) -> Result<Vec<CacheRow>> {
    let mut rows: Vec<CacheRow> = LOADERS.iter().map(|&loader| CacheRow { loader, ..Default::default() }).collect();
    for r in 0..runs {
        for i in run_order(LOADERS.len(), r) {
            let loader = LOADERS[i];
            let target: PathBuf = if loader.contains("encrypted") { encrypted.to_owned() } else { file.to_owned() };
            evict(&target)?;
            let (cold, how, d1) = together(python, loader, &target, 1)?;
            let (next, _, d2) = together(python, loader, &target, 1)?;
            evict(&target)?;
            let (t, _, d3) = together(python, loader, &target, procs)?;
            let row = &mut rows[i];
            row.cold.push(cold);
            row.next.push(next);
            row.disk_two.push(d1 + d2);
            row.together.push(t);
            row.disk_together.push(d3);
            if !how.is_empty() {
                row.how = how;
            }
        }
    }
    Ok(rows)
}

/// The table, with each loader's disk reads as a multiple of the file's size.
pub fn render(rows: &[CacheRow], len: u64, runs: usize, procs: usize) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "### Page cache across processes, {:.2} GB file, cold cache at the start (median of {runs}; each load in its own Python process, load + touch of every page)\n",
        len as f64 / 1e9
    );
    let _ = writeln!(
        s,
        "| loader | cold s | next process s | cold / next | disk read, 2 loads | {procs} at once s | {procs} at once / one cold | disk read, {procs} loads | how |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---|");
    let x = |b: Option<u64>| b.map(|b| format!("{:.2}x file", b as f64 / len as f64)).unwrap_or_default();
    for r in rows {
        if let Some(why) = &r.skipped {
            let _ = writeln!(s, "| {} | skipped | | | | | | | {why} |", r.loader);
            continue;
        }
        let (Some(cold), Some(next), Some(tog)) = (r.cold(), r.next(), r.together()) else { continue };
        let _ = writeln!(
            s,
            "| {} | {cold:.3} | {next:.3} | {:.1}x | {} | {tog:.3} | {:.2}x | {} | {} |",
            r.loader,
            cold / next,
            x(median(&r.disk_two)),
            tog / cold,
            x(median(&r.disk_together)),
            r.how
        );
    }
    s
}
