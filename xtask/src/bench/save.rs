//! The save rows of `cargo xtask bench`: turboio's saves (durable: `fsync` of the file and its
//! directory, atomic rename) against the Python peers followed by the same `fsync`, and the
//! disk's write ceiling, in one run with the savers in a shuffled order each run.
//!
//! Every row says whether it ends with the data durable and how much of the written file the
//! page cache holds afterwards (measured with `mincore`). The tensors come from the bench
//! sample, copied into ordinary memory first (not timed).

use crate::bench::kit::run_order;
use anyhow::{bail, Context, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use turboio::{CachePolicy, LoadMode, LoadOptions, SaveOptions, SaveTensor};

/// The savers compared. The last two are about a process's first background save (issue 48,
/// item 18): how long it blocks its caller, and the floor of any snapshot, a copy of the
/// tensors into fresh memory (each in a new Python process).
const SAVERS: [&str; 11] = [
    "turboio save (O_DIRECT, default)",
    "turboio save, through the page cache",
    "turboio save_async",
    "turboio.save_file",
    "turboio.torch.save_file",
    "turboio.save_file(blocking=False), buffers reused",
    "safetensors.torch.save_file + fsync",
    "torch.save + fsync",
    "ceiling: O_DIRECT write QD32 + fsync",
    FIRST_BACKGROUND,
    SNAPSHOT_FLOOR,
];

const FIRST_BACKGROUND: &str = "turboio.save_file(blocking=False), first in a new process";
/// Not a save: `torch.empty_like` + `copy_` of every tensor in a new process (torch's threads).
const SNAPSHOT_FLOOR: &str = "floor of a snapshot: copy into fresh memory (no file)";

/// One saver's measurements.
#[derive(Debug, Default, Clone)]
pub struct SaveRow {
    pub saver: &'static str,
    /// Until the data is durable.
    pub times: Vec<f64>,
    /// How long the caller was blocked (asynchronous saves; else the same as `times`).
    pub blocked: Vec<f64>,
    /// Fraction of the written file in the page cache right after.
    pub cached_after: f64,
    pub skipped: Option<String>,
}

fn median(v: &[f64]) -> f64 {
    let mut t = v.to_vec();
    t.sort_by(f64::total_cmp);
    t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
}

impl SaveRow {
    pub fn median(&self) -> f64 {
        median(&self.times)
    }
    pub fn blocked(&self) -> f64 {
        median(&self.blocked)
    }
}

fn cached_fraction(path: &Path) -> f64 {
    turboio::posix::PosixStorage::new()
        .open_posix(path)
        .ok()
        .and_then(|f| turboio::storage::StorageFile::cached_fraction(&f))
        .unwrap_or(f64::NAN)
}

fn python_save(python: &Path, saver: &str, file: &Path, out: &Path) -> Result<(f64, f64)> {
    let name = saver.trim_end_matches(" + fsync");
    let o = Command::new(python)
        .arg(crate::test::root().join("crates/py/bench/py_save.py"))
        .args(["--saver", name, "--file"])
        .arg(file)
        .arg("--out")
        .arg(out)
        .output()
        .with_context(|| format!("run {saver}"))?;
    if !o.status.success() {
        bail!("{saver} failed: {}", String::from_utf8_lossy(&o.stderr));
    }
    let text = String::from_utf8_lossy(&o.stdout);
    let v: serde_json::Value = serde_json::from_str(text.lines().last().unwrap_or(""))?;
    Ok((v["save_s"].as_f64().unwrap_or(f64::NAN), v["blocked_s"].as_f64().unwrap_or(f64::NAN)))
}

/// Measures every saver `runs` times on the tensors of `file`, writing next to it.
pub fn measure(python: Option<&Path>, file: &Path, runs: usize) -> Result<Vec<SaveRow>> {
    let mut rows: Vec<SaveRow> = SAVERS.iter().map(|&saver| SaveRow { saver, ..Default::default() }).collect();
    let out: PathBuf = file.with_extension("saved.safetensors");
    // The tensors, in ordinary memory.
    let loaded = turboio::load(file, &LoadOptions { mode: LoadMode::Copied, ..Default::default() })?;
    let tensors: Vec<SaveTensor<'_>> = loaded
        .tensors()
        .map(|t| SaveTensor { name: t.name(), dtype: t.dtype(), shape: t.shape(), data: t.bytes().unwrap_or(&[]) })
        .collect();
    let len = std::fs::metadata(file)?.len();
    // The asynchronous saves run in steady state, as in a training loop: snapshot buffers warm.
    turboio::save_async(&out, &tensors, loaded.metadata(), &SaveOptions::default())?
        .wait()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for r in 0..runs {
        for i in run_order(SAVERS.len(), r) {
            let saver = SAVERS[i];
            if rows[i].skipped.is_some() {
                continue;
            }
            let _ = std::fs::remove_file(&out);
            // Earlier rows' dirty pages go now, untimed.
            nix::unistd::sync();
            let opts = |cache| SaveOptions { cache, ..Default::default() };
            let (secs, blocked) = match saver {
                "turboio save (O_DIRECT, default)" | "turboio save, through the page cache" => {
                    let cache = if saver.contains("page cache") { CachePolicy::Keep } else { CachePolicy::Auto };
                    let t = Instant::now();
                    turboio::save(&out, &tensors, loaded.metadata(), &opts(cache))?;
                    let s = t.elapsed().as_secs_f64();
                    (s, s)
                }
                "turboio save_async" => {
                    let t = Instant::now();
                    let h = turboio::save_async(&out, &tensors, loaded.metadata(), &SaveOptions::default())?;
                    let blocked = t.elapsed().as_secs_f64();
                    h.wait().map_err(|e| anyhow::anyhow!("{e}"))?;
                    (t.elapsed().as_secs_f64(), blocked)
                }
                "ceiling: O_DIRECT write QD32 + fsync" => {
                    let t = Instant::now();
                    crate::bench::ceiling::odirect_write(&out, len, 32, 1 << 20)?;
                    let s = t.elapsed().as_secs_f64();
                    (s, s)
                }
                _ => match python {
                    Some(py) => python_save(py, saver, file, &out)?,
                    None => {
                        rows[i].skipped = Some("--no-python".into());
                        continue;
                    }
                },
            };
            let row = &mut rows[i];
            row.times.push(secs);
            row.blocked.push(blocked);
            row.cached_after = if saver == SNAPSHOT_FLOOR { f64::NAN } else { cached_fraction(&out) };
        }
    }
    let _ = std::fs::remove_file(&out);
    Ok(rows)
}

/// The table.
pub fn render(rows: &[SaveRow], len: u64, runs: usize) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "### Saves, {:.2} GB file from CPU tensors (median of {runs}; every row ends durable: turboio fsyncs file and directory, the peers get the same fsync inside the timing)\n",
        len as f64 / 1e9
    );
    let base = rows.iter().find(|r| r.saver == SAVERS[0] && r.skipped.is_none()).map(SaveRow::median);
    let _ = writeln!(s, "| saver | s (durable) | GB/s | turboio is | caller blocked s | cached after |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|");
    for r in rows {
        if let Some(why) = &r.skipped {
            let _ = writeln!(s, "| {} | skipped | | | | {why} |", r.saver);
            continue;
        }
        let m = r.median();
        let vs = base.map(|b| format!("{:.2}x", m / b)).unwrap_or_default();
        let cached = if r.cached_after.is_nan() { String::new() } else { format!("{:.0}%", r.cached_after * 100.0) };
        let _ = writeln!(
            s,
            "| {} | {m:.3} | {:.2} | {vs} | {:.3} | {cached} |",
            r.saver,
            len as f64 / m / 1e9,
            r.blocked()
        );
    }
    s
}

/// The acceptance checks of a save table of a `len`-byte file, named after its size.
pub(crate) fn checks(rows: &[SaveRow], len: u64) -> Vec<crate::bench::kit::Check> {
    let label = crate::bench::kit::size_name(len - len % (64 << 20));
    ratios(rows)
        .into_iter()
        .map(|(what, ratio, need)| crate::bench::kit::Check { what: format!("{label} save: {what}"), ratio, need })
        .collect()
}

/// The acceptance ratios: `(what, ratio, needed)`.
fn ratios(rows: &[SaveRow]) -> Vec<(String, f64, f64)> {
    let find = |n: &str| rows.iter().find(|r| r.saver == n && r.skipped.is_none());
    let mut out = Vec::new();
    if let Some(t) = find(SAVERS[0]) {
        let mut vs = |other: &str, what: &str, need: f64| {
            if let Some(o) = find(other) {
                out.push((what.to_owned(), o.median() / t.median(), need));
            }
        };
        vs(SAVERS[8], "durable save vs O_DIRECT write ceiling", 0.8);
        vs(SAVERS[6], "durable save vs safetensors.torch.save_file + fsync", 2.0);
        vs(SAVERS[7], "durable save vs torch.save + fsync", 3.0);
    }
    if let Some(a) = find(SAVERS[2]) {
        out.push(("save_async: whole save / caller blocked".into(), a.median() / a.blocked(), 1.0 / 0.35));
    }
    // A process's first background save blocks at most 0.35x a blocking save; the floor row
    // says whether any snapshot can on this machine (a snapshot copies every byte into memory
    // the process has never touched).
    if let Some(sync) = find(SAVERS[3]) {
        if let Some(first) = find(FIRST_BACKGROUND) {
            out.push((
                "first background save: turboio.save_file / caller blocked".into(),
                sync.median() / first.blocked(),
                1.0 / 0.35,
            ));
        }
        if let Some(floor) = find(SNAPSHOT_FLOOR) {
            out.push((
                "floor: turboio.save_file / copy into fresh memory (the most a snapshot can reach)".into(),
                sync.median() / floor.blocked(),
                1.0 / 0.35,
            ));
        }
    }
    out
}
