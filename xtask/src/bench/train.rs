//! `cargo xtask bench --training`: a training job's checkpoint I/O, one tensor of the bench
//! size, against DeepSpeed's DeepNVMe (`aio_handle`, built by this bench: Debian's libaio-dev
//! and ninja-build, `deepspeed` from PyPI into `target/bench-tools/deepnvme`, its `async_io` op
//! JIT-compiled for the CPU accelerator once and cached), in one run with the rows in a shuffled
//! order each run.
//!
//! Saves end durable for everyone (turboio fsyncs file and directory; DeepNVMe's write is
//! followed by the same fsyncs inside its timing). Two kinds: to a new file (the old one deleted
//! before the timer) and replacing an existing one of the same size (DeepNVMe overwrites it in
//! place: it opens without `O_TRUNC`; turboio writes a new file and renames it over the old one,
//! which stays intact until then). Reads are cold (the file evicted from the page cache first):
//! turboio's `O_DIRECT` load into an arena reused across loads, and from Python into tensors the
//! caller already has (`state_dict=`), against DeepNVMe's `sync_pread` into its page-locked
//! buffer. The disk's `O_DIRECT` rows (one ring, 32 requests of 1 MiB) are measured in the
//! same run, for context.
//!
//! DeepNVMe's own file operations three ways (its README's table: the `py_*` scripts' Python,
//! DeepSpeed's `aio_handle`, and the same calls on `turboio.deepnvme`): a store of a CPU tensor
//! to a new file and in place (with the same fsyncs), and a cold load into the handle's
//! page-locked buffer.

use crate::bench::kit::run_order;
use anyhow::{bail, Context, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;
use turboio::device::ArenaPool;
use turboio::posix::{PosixConfig, PosixStorage};
use turboio::{CachePolicy, Dtype, LoadMode, LoadOptions, SaveOptions, SaveTensor};

/// What a row measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    SaveNew,
    SaveReplace,
    SaveReplaceInline,
    SaveReplaceReuse,
    DnNew,
    DnOverwrite,
    RefWrite,
    LoadReusedArena,
    LoadStateDict,
    DnRead,
    RefRead,
    TnNew,
    TnOverwrite,
    TnRead,
    PyWrite,
    PyRead,
}

/// The rows, in table order.
const ROWS: [(Kind, &str); 16] = [
    (Kind::SaveNew, "turboio save, new file"),
    (Kind::SaveReplace, "turboio save, replacing (old file deleted after the save)"),
    (Kind::SaveReplaceInline, "turboio save, replacing (old file freed by the rename, as before)"),
    (Kind::SaveReplaceReuse, "turboio save, replacing with reuse_blocks (into the previous version's blocks)"),
    (Kind::DnNew, "DeepNVMe sync_pwrite + fsync, new file"),
    (Kind::DnOverwrite, "DeepNVMe sync_pwrite + fsync, overwriting in place"),
    (Kind::RefWrite, "reference: O_DIRECT write, one ring of 32 x 1 MiB, + fsync, new file"),
    (Kind::LoadReusedArena, "turboio load, O_DIRECT into a reused arena (cold)"),
    (Kind::LoadStateDict, "turboio.load(state_dict=..., use_direct_io=True) into existing tensors (cold)"),
    (Kind::DnRead, "DeepNVMe sync_pread into its page-locked buffer (cold)"),
    (Kind::RefRead, "reference: O_DIRECT read, one ring of 32 x 1 MiB, into a reused buffer (cold)"),
    (Kind::TnNew, "turboio.deepnvme sync_pwrite + fsync, new file"),
    (Kind::TnOverwrite, "turboio.deepnvme sync_pwrite + fsync, overwriting in place"),
    (Kind::TnRead, "turboio.deepnvme sync_pread into its page-locked buffer (cold)"),
    (Kind::PyWrite, "Python, as py_store_cpu_tensor.py: f.write(t.numpy()) + fsync, new file"),
    (Kind::PyRead, "Python, as py_load_cpu_tensor.py: torch.frombuffer(f.read()) (cold)"),
];

#[derive(Debug, Default, Clone)]
struct Row {
    name: &'static str,
    times: Vec<f64>,
    skipped: Option<String>,
}

fn median(v: &[f64]) -> f64 {
    let mut t = v.to_vec();
    t.sort_by(f64::total_cmp);
    t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The `PYTHONPATH` directory holding deepspeed, with its `async_io` op built; `Err` says why
/// the DeepNVMe rows are skipped.
pub(crate) fn deepnvme(python: &Path) -> std::result::Result<(PathBuf, PathBuf), String> {
    let tools = crate::test::root().join("target/bench-tools");
    let site = tools.join("deepnvme");
    let extensions = tools.join("torch-extensions");
    if !crate::test::ensure_debian_package(
        "libaio-dev",
        "the DeepNVMe rows (DeepSpeed's async_io op links -laio)",
        &["/usr/include/libaio.h"],
    ) {
        return Err("libaio-dev is missing (run as root to have it installed)".into());
    }
    // torch's extension builder runs `ninja`; PyPI's ninja wheel loses its binary when
    // installed with --target, so Debian's.
    if !crate::test::ensure_debian_package(
        "ninja-build",
        "the DeepNVMe rows (torch JIT builds with ninja)",
        &["/usr/bin/ninja"],
    ) {
        return Err("ninja is missing (run as root to have Debian's ninja-build installed)".into());
    }
    if !site.join("deepspeed").is_dir() {
        eprintln!("installing deepspeed 0.19.8 into {} ...", site.display());
        let pip = |args: &[&str]| -> std::result::Result<(), String> {
            let o = Command::new(python)
                .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-cache-dir", "--target"])
                .arg(&site)
                .args(args)
                .output()
                .map_err(|e| format!("pip: {e}"))?;
            if o.status.success() {
                Ok(())
            } else {
                Err(format!("pip install {}: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim()))
            }
        };
        // deepspeed without its dependencies (torch and numpy come from the venv), then the
        // small ones it imports.
        pip(&["--no-deps", "deepspeed==0.19.8"])?;
        pip(&["hjson", "py-cpuinfo", "msgpack", "psutil", "pydantic>=2", "einops", "tqdm", "packaging"])?;
    }
    let o = deepnvme_cmd(python, &site, &extensions)
        .args(["--op", "build"])
        .output()
        .map_err(|e| format!("run py_training.py: {e}"))?;
    if !o.status.success() {
        let err = String::from_utf8_lossy(&o.stderr);
        let tail: Vec<&str> = err.lines().rev().take(6).collect();
        return Err(format!(
            "DeepSpeed's async_io op did not build: {}",
            tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
        ));
    }
    Ok((site, extensions))
}

fn deepnvme_cmd(python: &Path, site: &Path, extensions: &Path) -> Command {
    let mut c = Command::new(python);
    let venv_bin = python.parent().map(Path::to_path_buf).unwrap_or_default();
    let path =
        format!("{}:{}:{}", site.join("bin").display(), venv_bin.display(), std::env::var("PATH").unwrap_or_default());
    c.arg(crate::test::root().join("crates/py/bench/py_training.py"))
        .env("PYTHONPATH", site)
        .env("PATH", path)
        .env("DS_ACCELERATOR", "cpu")
        .env("TORCH_EXTENSIONS_DIR", extensions);
    c
}

/// Runs one timed operation of a bench script and returns the number `field` of the JSON
/// object it printed last; `what` names it in errors.
fn timed(cmd: &mut Command, what: &str, field: &str) -> Result<f64> {
    let o = cmd.output().with_context(|| format!("run {what}"))?;
    if !o.status.success() {
        bail!("{what}: {}", String::from_utf8_lossy(&o.stderr));
    }
    let text = String::from_utf8_lossy(&o.stdout);
    let v: serde_json::Value = serde_json::from_str(text.lines().rfind(|l| l.starts_with('{')).unwrap_or(""))?;
    v[field].as_f64().with_context(|| format!("{what} printed no {field}"))
}

/// One timed operation of `py_training.py` without DeepSpeed (turboio's handle, or plain Python).
fn py_op(python: &Path, args: &[&str]) -> Result<f64> {
    let mut cmd = Command::new(python);
    cmd.arg(crate::test::root().join("crates/py/bench/py_training.py")).args(args);
    timed(&mut cmd, &format!("py_training.py {}", args.join(" ")), "s")
}

fn deepnvme_op(python: &Path, dirs: &(PathBuf, PathBuf), args: &[&str]) -> Result<f64> {
    timed(deepnvme_cmd(python, &dirs.0, &dirs.1).args(args), &format!("DeepNVMe {}", args.join(" ")), "s")
}

/// Evicts `path` from the page cache (only it; no root needed) and checks it worked.
fn evict(path: &Path) -> Result<()> {
    let f = PosixStorage::new().open_posix(path)?;
    f.evict_cache()?;
    let left = turboio::storage::StorageFile::cached_fraction(&f).unwrap_or(0.0);
    if left > 0.01 {
        bail!("{}: {:.0}% stayed in the page cache", path.display(), left * 100.0);
    }
    Ok(())
}

fn sync() {
    nix::unistd::sync();
}

/// Removes `path` (untimed) and waits for its blocks to be freed and everything to be on disk.
fn remove(path: &Path) {
    let _ = std::fs::remove_file(path);
    turboio::wait_for_saves();
    sync();
}

/// Runs every row `runs` times; returns the Markdown section with its checks.
pub fn run(python: Option<&Path>, dir: &Path, size: u64, runs: usize) -> Result<String> {
    std::fs::create_dir_all(dir)?;
    let size = size.next_multiple_of(4096);
    let st = dir.join("train.safetensors");
    let spare = dir.join(".train.safetensors.turboio-spare");
    let raw = dir.join("train.bin");
    let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let shape = [size as usize];
    let tensors = [SaveTensor { name: "t", dtype: Dtype::U8, shape: &shape, data: &data }];
    let save = |background: bool, reuse_blocks: bool| -> Result<()> {
        let cfg = PosixConfig { delete_in_background: background, ..Default::default() };
        let storage = Some(Arc::new(PosixStorage::with_config(cfg)) as Arc<dyn turboio::storage::Storage>);
        let opts = SaveOptions { storage, reuse_blocks, ..Default::default() };
        turboio::save(&st, &tensors, None, &opts)?;
        Ok(())
    };
    // The file the reads and replacing saves start from, whole and on disk.
    let ensure_saved = || -> Result<()> {
        if !st.exists() || std::fs::metadata(&st)?.len() < size {
            save(true, false)?;
            turboio::wait_for_saves();
            sync();
        }
        Ok(())
    };
    let mut rows: Vec<Row> = ROWS.iter().map(|&(_, name)| Row { name, ..Default::default() }).collect();
    let dn = match python {
        None => Err("--no-python".to_string()),
        Some(py) => {
            eprintln!("DeepNVMe: building DeepSpeed's async_io op (cached after the first time) ...");
            deepnvme(py)
        }
    };
    if let Err(why) = &dn {
        for r in rows.iter_mut().filter(|r| r.name.starts_with("DeepNVMe")) {
            r.skipped = Some(why.clone());
        }
    }
    if python.is_none() {
        for (r, (kind, _)) in rows.iter_mut().zip(ROWS) {
            if matches!(
                kind,
                Kind::LoadStateDict | Kind::TnNew | Kind::TnOverwrite | Kind::TnRead | Kind::PyWrite | Kind::PyRead
            ) {
                r.skipped = Some("--no-python".into());
            }
        }
    }
    let pool = ArenaPool::new(1);
    let load_opts = LoadOptions {
        mode: LoadMode::Copied,
        cache: CachePolicy::Bypass,
        arenas: Some(pool.clone()),
        ..Default::default()
    };
    let size_arg = size.to_string();
    for r in 0..runs {
        for i in run_order(ROWS.len(), r) {
            if rows[i].skipped.is_some() {
                continue;
            }
            let (kind, name) = ROWS[i];
            let dn_python = || -> Result<(&Path, &(PathBuf, PathBuf))> {
                Ok((python.context("python")?, dn.as_ref().map_err(|e| anyhow::anyhow!("{e}"))?))
            };
            let raw_written = |py: &Path, dirs: &(PathBuf, PathBuf)| -> Result<()> {
                if !raw.exists() || std::fs::metadata(&raw)?.len() != size {
                    deepnvme_op(py, dirs, &["--op", "pwrite", "--out", raw.to_str().unwrap(), "--size", &size_arg])?;
                    sync();
                }
                Ok(())
            };
            let secs = match kind {
                Kind::SaveNew | Kind::SaveReplace | Kind::SaveReplaceInline | Kind::SaveReplaceReuse => {
                    if kind == Kind::SaveNew {
                        remove(&st);
                    } else {
                        ensure_saved()?;
                    }
                    let reuse = kind == Kind::SaveReplaceReuse;
                    if reuse && !spare.exists() {
                        // The first save with reuse keeps the old file as the spare (untimed).
                        save(true, true)?;
                        turboio::wait_for_saves();
                        sync();
                    }
                    let t = Instant::now();
                    save(kind != Kind::SaveReplaceInline, reuse)?;
                    let s = t.elapsed().as_secs_f64();
                    // The old file's deletion goes on after the save; not in the next row's time.
                    turboio::wait_for_saves();
                    s
                }
                Kind::DnNew | Kind::DnOverwrite => {
                    let (py, dirs) = dn_python()?;
                    if kind == Kind::DnNew {
                        remove(&raw);
                    } else {
                        raw_written(py, dirs)?;
                    }
                    deepnvme_op(py, dirs, &["--op", "pwrite", "--out", raw.to_str().unwrap(), "--size", &size_arg])?
                }
                Kind::TnNew | Kind::TnOverwrite | Kind::PyWrite => {
                    let py = python.context("python")?;
                    let out = dir.join("train.turboio.bin");
                    if kind == Kind::TnOverwrite {
                        if !out.exists() || std::fs::metadata(&out)?.len() != size {
                            py_op(
                                py,
                                &[
                                    "--impl",
                                    "turboio",
                                    "--op",
                                    "pwrite",
                                    "--out",
                                    out.to_str().unwrap(),
                                    "--size",
                                    &size_arg,
                                ],
                            )?;
                            sync();
                        }
                    } else {
                        remove(&out);
                    }
                    let imp = if kind == Kind::PyWrite { "python" } else { "turboio" };
                    let s = py_op(
                        py,
                        &["--impl", imp, "--op", "pwrite", "--out", out.to_str().unwrap(), "--size", &size_arg],
                    )?;
                    if kind == Kind::PyWrite {
                        remove(&out);
                    }
                    s
                }
                Kind::TnRead | Kind::PyRead => {
                    let py = python.context("python")?;
                    let file = dir.join("train.read.bin");
                    if !file.exists() || std::fs::metadata(&file)?.len() != size {
                        py_op(
                            py,
                            &[
                                "--impl",
                                "turboio",
                                "--op",
                                "pwrite",
                                "--out",
                                file.to_str().unwrap(),
                                "--size",
                                &size_arg,
                            ],
                        )?;
                        sync();
                    }
                    evict(&file)?;
                    let imp = if kind == Kind::PyRead { "python" } else { "turboio" };
                    py_op(py, &["--impl", imp, "--op", "pread", "--file", file.to_str().unwrap()])?
                }
                Kind::RefWrite => {
                    let reference = dir.join("train.reference");
                    remove(&reference);
                    let t = Instant::now();
                    crate::bench::ceiling::odirect_write(&reference, size, 32, 1 << 20)?;
                    let s = t.elapsed().as_secs_f64();
                    remove(&reference);
                    s
                }
                Kind::LoadReusedArena => {
                    ensure_saved()?;
                    if pool.free_arenas() == 0 {
                        drop(turboio::load(&st, &load_opts)?); // the arena, faulted in once (untimed)
                    }
                    evict(&st)?;
                    let t = Instant::now();
                    let loaded = turboio::load(&st, &load_opts)?;
                    let s = t.elapsed().as_secs_f64();
                    std::hint::black_box(loaded.tensor("t").and_then(|t| t.bytes().map(|b| b[b.len() / 2])));
                    s
                }
                Kind::LoadStateDict => {
                    let py = python.context("python")?;
                    ensure_saved()?;
                    evict(&st)?;
                    py_op(py, &["--op", "turboio-into", "--file", st.to_str().context("bench path")?])?
                }
                Kind::DnRead => {
                    let (py, dirs) = dn_python()?;
                    raw_written(py, dirs)?;
                    evict(&raw)?;
                    deepnvme_op(py, dirs, &["--op", "pread", "--file", raw.to_str().unwrap()])?
                }
                Kind::RefRead => {
                    ensure_saved()?;
                    evict(&st)?;
                    let t = Instant::now();
                    crate::bench::ceiling::odirect_sequential(&st, 32, 1 << 20)?;
                    t.elapsed().as_secs_f64()
                }
            };
            eprintln!("  {name}: {secs:.3} s");
            rows[i].times.push(secs);
        }
    }
    for p in [&st, &spare, &raw, &dir.join("train.turboio.bin"), &dir.join("train.read.bin")] {
        let _ = std::fs::remove_file(p);
    }
    turboio::wait_for_saves();
    let mut report = render(&rows, size, runs);
    match python {
        Some(py) => report.push_str(&run_dcp(py, dir, 4 * size, runs)?),
        None => report.push_str("\n### torch.distributed.checkpoint\n\nSkipped: --no-python.\n"),
    }
    Ok(report)
}

/// The DCP rows: (label, py_dcp.py arguments but --dir and --size, JSON field).
const DCP_ROWS: [(&str, &[&str], &str); 10] = [
    ("DCP FileSystemWriter, thread_count=1 (its default)", &["--op", "save", "--writer", "dcp", "--threads", "1"], "s"),
    ("DCP FileSystemWriter, thread_count=2", &["--op", "save", "--writer", "dcp", "--threads", "2"], "s"),
    ("DCP FileSystemWriter, thread_count=4", &["--op", "save", "--writer", "dcp", "--threads", "4"], "s"),
    ("DCP FileSystemWriter, thread_count=8", &["--op", "save", "--writer", "dcp", "--threads", "8"], "s"),
    ("turboio.dcp.FileSystemWriter (defaults)", &["--op", "save", "--writer", "turboio", "--threads", "1"], "s"),
    (
        "DCP FileSystemWriter async_save, caller blocked",
        &["--op", "async", "--writer", "dcp", "--threads", "1"],
        "blocked_s",
    ),
    (
        "turboio.dcp.FileSystemWriter async_save, caller blocked",
        &["--op", "async", "--writer", "turboio", "--threads", "1"],
        "blocked_s",
    ),
    ("DCP FileSystemReader, cold", &["--op", "load", "--reader", "dcp"], "s"),
    ("turboio.dcp.FileSystemReader, cold", &["--op", "load", "--reader", "turboio"], "s"),
    ("reference: O_DIRECT write of the same bytes, one ring of 32 x 1 MiB, + fsync", &[], "s"),
];

/// torch.distributed.checkpoint from 2 gloo ranks (`py_dcp.py`): a state dict of `size` bytes
/// (16 float32 tensors per rank and a few other items), saved durable by DCP's own
/// `FileSystemWriter` at thread counts 1 to 8 and by turboio's, `async_save`'s blocked time, and
/// cold loads by both readers; the rows alternate in a shuffled order each run.
fn run_dcp(python: &Path, dir: &Path, size: u64, runs: usize) -> Result<String> {
    let script = crate::test::root().join("crates/py/bench/py_dcp.py");
    let ckpt = |writer: &str| dir.join(format!("dcp-{writer}"));
    let size_arg = size.to_string();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); DCP_ROWS.len()];
    let op = |args: &[&str], path: &Path, field: &str| -> Result<f64> {
        let mut cmd = Command::new(python);
        cmd.arg(&script).args(args).arg("--dir").arg(path).args(["--size", &size_arg]);
        timed(&mut cmd, &format!("py_dcp.py {}", args.join(" ")), field)
    };
    eprintln!("DCP: {:.1} GB state dict from 2 ranks, {runs} runs ...", size as f64 / 1e9);
    for r in 0..runs {
        for i in run_order(DCP_ROWS.len(), r) {
            let (name, args, field) = DCP_ROWS[i];
            let secs = if args.is_empty() {
                let reference = dir.join("dcp.reference");
                remove(&reference);
                let t = Instant::now();
                crate::bench::ceiling::odirect_write(&reference, size, 32, 1 << 20)?;
                let s = t.elapsed().as_secs_f64();
                remove(&reference);
                s
            } else if args[1] == "load" {
                let which = if args[3] == "turboio" { "turboio" } else { "dcp" };
                let path = ckpt(which);
                if !path.join(".metadata").exists() {
                    op(&["--op", "save", "--writer", which, "--threads", "1"], &path, "s")?;
                }
                op(args, &path, field)?
            } else {
                let path = ckpt("save");
                let _ = std::fs::remove_dir_all(&path);
                let s = op(args, &path, field)?;
                let _ = std::fs::remove_dir_all(&path);
                s
            };
            eprintln!("  {name}: {secs:.3} s");
            times[i].push(secs);
        }
    }
    for w in ["turboio", "dcp", "save"] {
        let _ = std::fs::remove_dir_all(ckpt(w));
    }
    let m: Vec<f64> = times.iter().map(|t| median(t)).collect();
    let mut s = format!(
        "\n### torch.distributed.checkpoint: {:.1} GB from 2 gloo ranks (median of {runs}; saves durable)\n\n\
         | row | s | GB/s |\n|---|---:|---:|\n",
        size as f64 / 1e9
    );
    for ((name, _, field), t) in DCP_ROWS.iter().zip(&m) {
        let rate = if *field == "s" { format!("{:.2}", size as f64 / t / 1e9) } else { "-".into() };
        let _ = writeln!(s, "| {name} | {t:.3} | {rate} |");
    }
    let best_dcp = m[..4].iter().copied().fold(f64::INFINITY, f64::min);
    let ours = m[4];
    let ceiling = m[9];
    let _ = writeln!(s, "\n| check | ratio | needed | |\n|---|---:|---:|---|");
    let verdict = |ok: bool| if ok { "ok" } else { "BELOW" };
    let vs_best = best_dcp / ours;
    let vs_ceiling = ceiling / ours;
    let _ = writeln!(
        s,
        "| turboio save speed / DCP's at its best thread_count | {vs_best:.2}x | >= 1.3x (or >= 0.85x of the ceiling) | {} |",
        verdict(vs_best >= 1.3 || vs_ceiling >= 0.85)
    );
    let _ = writeln!(s, "| turboio save speed / one-ring O_DIRECT write + fsync | {vs_ceiling:.2}x | (context) | |");
    let _ = writeln!(
        s,
        "| DCP's best save speed / one-ring O_DIRECT write + fsync | {:.2}x | (context) | |",
        ceiling / best_dcp
    );
    let _ = writeln!(s, "| async_save blocked: DCP / turboio | {:.2}x | (context) | |", m[5] / m[6]);
    let _ = writeln!(s, "| cold load speed: turboio / DCP | {:.2}x | (context) | |", m[7] / m[8]);
    Ok(s)
}

fn render(rows: &[Row], size: u64, runs: usize) -> String {
    let mut s = String::from("## Training checkpoints\n\n");
    let _ =
        writeln!(s, "### One {:.2} GB tensor (median of {runs}; saves end durable for everyone)\n", size as f64 / 1e9);
    let _ = writeln!(s, "| row | s | GB/s |");
    let _ = writeln!(s, "|---|---:|---:|");
    for r in rows {
        match &r.skipped {
            Some(why) => {
                let _ = writeln!(s, "| {} | skipped | {why} |", r.name);
            }
            None => {
                let m = median(&r.times);
                let _ = writeln!(s, "| {} | {m:.3} | {:.2} |", r.name, size as f64 / m / 1e9);
            }
        }
    }
    let m = |kind: Kind| {
        let i = ROWS.iter().position(|&(k, _)| k == kind)?;
        rows[i].skipped.is_none().then(|| median(&rows[i].times))
    };
    let ratio = |a: Kind, b: Kind| m(a).zip(m(b)).map(|(a, b)| a / b);
    // (what, ratio, bound, the ratio must be at most the bound); a NaN bound is context.
    let checks: Vec<(&str, Option<f64>, f64, bool)> = vec![
        ("replacing save / new-file save", ratio(Kind::SaveReplace, Kind::SaveNew), 1.15, true),
        ("replacing save / DeepNVMe overwrite in place", ratio(Kind::SaveReplace, Kind::DnOverwrite), 1.2, true),
        (
            "replacing save with reuse_blocks / DeepNVMe overwrite in place",
            ratio(Kind::SaveReplaceReuse, Kind::DnOverwrite),
            1.2,
            true,
        ),
        ("new-file save / DeepNVMe new file", ratio(Kind::SaveNew, Kind::DnNew), 1.0, true),
        ("reused-arena load speed / DeepNVMe sync_pread speed", ratio(Kind::DnRead, Kind::LoadReusedArena), 0.9, false),
        ("state_dict= load speed / DeepNVMe sync_pread speed", ratio(Kind::DnRead, Kind::LoadStateDict), 0.9, false),
        // What an atomic replace into new blocks can reach: the old ones stay intact until the
        // rename, which DeepNVMe's own new-file write against its overwrite prices.
        (
            "the price of new blocks: DeepNVMe new file / DeepNVMe overwrite in place",
            ratio(Kind::DnNew, Kind::DnOverwrite),
            f64::NAN,
            true,
        ),
        ("replacing save / DeepNVMe new file", ratio(Kind::SaveReplace, Kind::DnNew), 1.0, true),
        ("new-file save / one-ring O_DIRECT write", ratio(Kind::SaveNew, Kind::RefWrite), f64::NAN, true),
        (
            "reused-arena load speed / one-ring O_DIRECT read",
            ratio(Kind::RefRead, Kind::LoadReusedArena),
            f64::NAN,
            false,
        ),
        // DeepNVMe's API on turboio against DeepSpeed's own, the same calls (issue 25).
        ("turboio.deepnvme / DeepNVMe sync_pwrite, new file", ratio(Kind::TnNew, Kind::DnNew), 1.0, true),
        ("turboio.deepnvme / DeepNVMe sync_pwrite, in place", ratio(Kind::TnOverwrite, Kind::DnOverwrite), 1.0, true),
        ("turboio.deepnvme sync_pread speed / DeepNVMe's", ratio(Kind::DnRead, Kind::TnRead), 1.0, false),
        (
            "turboio.deepnvme sync_pwrite speed / one-ring O_DIRECT write",
            ratio(Kind::RefWrite, Kind::TnNew),
            0.85,
            false,
        ),
        ("turboio.deepnvme sync_pread speed / one-ring O_DIRECT read", ratio(Kind::RefRead, Kind::TnRead), 0.85, false),
        ("turboio.deepnvme sync_pwrite speed / Python's", ratio(Kind::PyWrite, Kind::TnNew), f64::NAN, false),
        ("turboio.deepnvme sync_pread speed / Python's", ratio(Kind::PyRead, Kind::TnRead), f64::NAN, false),
    ];
    let _ = writeln!(s, "\n| check | ratio | needed | |\n|---|---:|---:|---|");
    for (what, ratio, bound, at_most) in checks {
        let Some(r) = ratio else {
            let _ = writeln!(s, "| {what} | - | | skipped |");
            continue;
        };
        if bound.is_nan() {
            let _ = writeln!(s, "| {what} | {r:.2}x | | (context) |");
            continue;
        }
        let ok = if at_most { r <= bound } else { r >= bound };
        let need = if at_most { format!("<= {bound}x") } else { format!(">= {bound}x") };
        let _ = writeln!(s, "| {what} | {r:.2}x | {need} | {} |", if ok { "ok" } else { "BELOW" });
    }
    s
}
