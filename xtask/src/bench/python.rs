//! The Python rows of `cargo xtask bench`: each Python loader loads the file in a process of
//! its own (`crates/py/bench/py_load.py`) and then touches one byte of every page of every
//! tensor, so lazily mapped loaders pay for their reads too.

use crate::bench::kit::{drop_caches, warm, Row};
use crate::test::{install_wheel, root, venv};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The loaders compared, by the name the child script knows.
pub const LOADERS: [&str; 5] =
    ["turboio.load", "turboio.torch.load_file", "safetensors.torch.load_file", "torch.load", "fastsafetensors"];

/// Whether a loader reads the `torch.save` copy of the sample rather than the safetensors file.
pub fn on_pt(loader: &str) -> bool {
    loader.starts_with("torch.load") || loader.ends_with(".pt")
}

/// The venv with the peers and the freshly built wheel.
///
/// `TURBOIO_BENCH_PYTHON` names an interpreter to use as it is instead (a GPU machine with no
/// network, whose image has torch and the peers and where the wheel was installed by hand): no
/// venv is made and nothing is installed.
pub fn setup() -> Result<PathBuf> {
    if let Some(python) = std::env::var_os("TURBOIO_BENCH_PYTHON") {
        return Ok(PathBuf::from(python));
    }
    let python = venv(&["crates/py/requirements-test.txt", "crates/py/bench/requirements.txt"])?;
    install_wheel(&python)?;
    Ok(python)
}

/// The same tensors saved with `torch.save`, for `torch.load` (made once, next to the file).
pub fn pt_copy(python: &Path, file: &Path) -> Result<PathBuf> {
    let pt = file.with_extension("pt");
    let fresh = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if pt.exists() && fresh(&pt) >= fresh(file) {
        return Ok(pt);
    }
    eprintln!("writing {} ...", pt.display());
    let status = Command::new(python)
        .args(["-c", "import sys, torch, safetensors.torch as st; torch.save(st.load_file(sys.argv[1]), sys.argv[2])"])
        .arg(file)
        .arg(&pt)
        .status()?;
    if !status.success() {
        bail!("could not write {}", pt.display());
    }
    Ok(pt)
}

/// The `lib` directories of the venv's `nvidia` wheels (libcufile for fastsafetensors' GDS,
/// which looks for `libcufile.so.0` on the loader's path only).
fn nvidia_lib_path(python: &Path) -> Option<String> {
    let venv = python.parent()?.parent()?;
    let mut dirs = Vec::new();
    for lib in std::fs::read_dir(venv.join("lib")).ok()?.flatten() {
        let root = lib.path().join("site-packages/nvidia");
        for pkg in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let d = pkg.path().join("lib");
            if d.is_dir() {
                dirs.push(d.display().to_string());
            }
        }
    }
    if let Ok(old) = std::env::var("LD_LIBRARY_PATH") {
        dirs.push(old);
    }
    (!dirs.is_empty()).then(|| dirs.join(":"))
}

fn run_child(python: &Path, loader: &str, file: &Path, device: &str) -> Result<(f64, f64, u64)> {
    let mut cmd = Command::new(python);
    cmd.arg(root().join("crates/py/bench/py_load.py"))
        .args(["--loader", loader, "--device", device, "--file"])
        .arg(file);
    if device != "cpu" {
        if let Some(p) = nvidia_lib_path(python) {
            cmd.env("LD_LIBRARY_PATH", p);
        }
    }
    let out = cmd.output().with_context(|| format!("run {loader}"))?;
    if !out.status.success() {
        bail!("{loader} failed on {}: {}", file.display(), String::from_utf8_lossy(&out.stderr));
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value =
        serde_json::from_str(line.lines().last().unwrap_or("")).with_context(|| format!("{loader} printed {line}"))?;
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    Ok((f("load_s"), f("touch_s"), v["peak_rss"].as_u64().unwrap_or(0)))
}

/// The loaders compared on a GPU (`--device cuda:N`). InstantTensor (`instanttensor` on PyPI)
/// is GPU-only and not in the CPU venv: `.ci/gpu-bundle` carries its wheel to the GPU machine,
/// and where it is missing its row says why.
pub const GPU_LOADERS: [&str; 7] = [
    "turboio.load",
    "turboio.torch.load_file",
    "safetensors.torch.load_file",
    "torch.load",
    "fastsafetensors",
    "fastsafetensors (GDS)",
    "instanttensor",
];

/// Measures every Python loader `runs` times, in a shuffled order each run, hot or cold.
pub fn measure(python: &Path, file: &Path, pt: &Path, len: u64, runs: usize, cold: bool) -> Result<Vec<Row>> {
    measure_on(python, file, pt, len, runs, cold, "cpu", &LOADERS, "python")
}

/// [`measure`] with only the file evicted before each run (`POSIX_FADV_DONTNEED`): the disk
/// read, while the file system's metadata, the interpreter's and the libraries' pages stay
/// cached (a model loaded again on a busy node). `cold` rows evict everything
/// (`drop_caches`: a fresh node after a boot). Issue 48, item 19, compares the two.
pub fn measure_file_evicted(python: &Path, file: &Path, pt: &Path, len: u64, runs: usize) -> Result<Vec<Row>> {
    measure_state(python, file, pt, len, runs, State::FileEvicted, "cpu", &LOADERS, "python")
}

/// What is in the page cache when a run starts.
#[derive(Clone, Copy, PartialEq)]
enum State {
    Hot,
    /// Only the loaded file evicted.
    FileEvicted,
    /// Every cache dropped.
    Cold,
}

/// [`measure`] for `loaders` loading into `device` (rows in `group`).
#[allow(clippy::too_many_arguments)]
pub fn measure_on(
    python: &Path,
    file: &Path,
    pt: &Path,
    len: u64,
    runs: usize,
    cold: bool,
    device: &str,
    loaders: &[&'static str],
    group: &'static str,
) -> Result<Vec<Row>> {
    let state = if cold { State::Cold } else { State::Hot };
    measure_state(python, file, pt, len, runs, state, device, loaders, group)
}

#[allow(clippy::too_many_arguments)]
fn measure_state(
    python: &Path,
    file: &Path,
    pt: &Path,
    len: u64,
    runs: usize,
    state: State,
    device: &str,
    loaders: &[&'static str],
    group: &'static str,
) -> Result<Vec<Row>> {
    let cache = match state {
        State::Hot => "hot",
        State::FileEvicted => "cold (file evicted)",
        State::Cold => "cold",
    };
    let mut rows: Vec<Row> =
        loaders.iter().map(|l| Row { size: len, cache, loader: l, group, ..Default::default() }).collect();
    for r in 0..runs {
        for i in crate::bench::kit::run_order(loaders.len(), r) {
            if rows[i].skipped.is_some() {
                continue;
            }
            let target = if on_pt(loaders[i]) { pt } else { file };
            match state {
                State::Cold => {
                    if let Err(why) = drop_caches() {
                        for row in rows.iter_mut() {
                            row.skipped = Some(why.clone());
                        }
                        return Ok(rows);
                    }
                }
                State::FileEvicted => crate::bench::kit::evict(target)?,
                State::Hot => warm(target)?,
            }
            let (load, touch, peak) = match run_child(python, loaders[i], target, device) {
                Ok(r) => r,
                // A GPU loader that cannot run here (fastsafetensors without GDS support) is a
                // skipped row, not a failed bench.
                Err(e) if device != "cpu" => {
                    rows[i].skipped = Some(format!("{e:#}").lines().last().unwrap_or("failed").to_owned());
                    continue;
                }
                Err(e) => return Err(e),
            };
            let row = &mut rows[i];
            row.times.push(load + touch);
            row.load_times.push(load);
            row.peak_rss = row.peak_rss.max(peak);
            row.how = "own process; peak RSS includes the interpreter and torch".into();
        }
    }
    Ok(rows)
}
