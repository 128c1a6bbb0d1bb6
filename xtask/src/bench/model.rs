//! `cargo xtask bench --model`: a sharded model directory (9 shards of about 480 MiB at the
//! default 4 GiB, mixed dtypes, written by `turboio gen --shards 9`) loaded hot and cold, each
//! run in a process of its own (`crates/py/bench/py_model.py`) with the loaders in a shuffled
//! order: turboio's one-job `load_model` against turboio loading the shards one after another,
//! `safetensors.torch.load_file` looped over the shards, and fastsafetensors with all the files;
//! then a 2-rank gloo run of turboio's fastsafetensors API, direct against collectives, with the
//! bytes each rank read from storage.

use crate::bench::kit::{drop_caches, median_of as median, warm};
use crate::test::root;
use anyhow::{bail, Context, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const LOADERS: [&str; 6] = [
    "turboio.load_model (one job)",
    "turboio.load, file after file",
    "safetensors.torch.load_file, looped",
    "fastsafetensors, all files",
    "gloo 2 ranks: direct",
    "gloo 2 ranks: collectives",
];

/// The disk-ceiling row's name.
const CEILING: &str = "ceiling: O_DIRECT of every shard at once (no memory touched)";

struct Row {
    loader: &'static str,
    cache: &'static str,
    times: Vec<f64>,
    bytes_read: Option<Vec<u64>>,
}

fn run_child(python: &Path, loader: &str, dir: &Path) -> Result<(f64, Option<Vec<u64>>)> {
    let out = Command::new(python)
        .arg(root().join("crates/py/bench/py_model.py"))
        .args(["--loader", loader, "--dir"])
        .arg(dir)
        .output()
        .with_context(|| format!("run {loader}"))?;
    if !out.status.success() {
        bail!("{loader} failed on {}: {}", dir.display(), String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value =
        serde_json::from_str(text.lines().last().unwrap_or("")).with_context(|| format!("{loader} printed {text}"))?;
    let t = v["load_s"].as_f64().unwrap_or(f64::NAN) + v["touch_s"].as_f64().unwrap_or(f64::NAN);
    let bytes = v["bytes_read"].as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).collect());
    Ok((t, bytes))
}

/// Runs the model rows; returns the Markdown section (table and checks).
pub fn run(python: &Path, data_dir: &Path, size: u64, runs: usize, no_cold: bool) -> Result<String> {
    let dir = crate::bench::kit::sharded_model(data_dir, size)?;
    let shards: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    let total: u64 = shards.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
    let mut rows = Vec::new();
    for cache in ["hot", "cold"] {
        if cache == "cold" && no_cold {
            continue;
        }
        eprintln!("model {}: {cache}, {runs} runs ...", dir.display());
        let mut these: Vec<Row> =
            LOADERS.iter().map(|&loader| Row { loader, cache, times: Vec::new(), bytes_read: None }).collect();
        for r in 0..runs {
            for i in crate::bench::kit::run_order(LOADERS.len(), r) {
                if cache == "cold" {
                    drop_caches().map_err(|e| anyhow::anyhow!("cold rows: {e}"))?;
                } else {
                    for s in &shards {
                        warm(s)?;
                    }
                }
                let (t, bytes) = run_child(python, LOADERS[i], &dir)?;
                these[i].times.push(t);
                if bytes.is_some() {
                    these[i].bytes_read = bytes;
                }
            }
        }
        rows.extend(these);
    }
    // The disk's ceiling for the same bytes: every shard read at once with O_DIRECT (queue depth
    // 32 each, 1 MiB blocks, into reused buffers: no page cache, no page of fresh memory touched).
    let mut ceiling = Vec::new();
    if !no_cold {
        for _ in 0..runs {
            drop_caches().map_err(|e| anyhow::anyhow!("cold rows: {e}"))?;
            let t = std::time::Instant::now();
            std::thread::scope(|sc| {
                let hs: Vec<_> = shards
                    .iter()
                    .map(|p| sc.spawn(move || crate::bench::ceiling::odirect_sequential(p, 32, 1 << 20)))
                    .collect();
                hs.into_iter()
                    .try_for_each(|h| h.join().map_err(|_| anyhow::anyhow!("ceiling thread panicked"))?.map(drop))
            })?;
            ceiling.push(t.elapsed().as_secs_f64());
        }
        rows.push(Row { loader: CEILING, cache: "cold", times: ceiling.clone(), bytes_read: None });
    }
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n### Whole model: {} in {} shards (median of {runs}; each load in its own Python process, load + touch of every page)\n",
        crate::bench::kit::size_name(total),
        shards.len()
    );
    let _ = writeln!(s, "| loader | cache | s | GB/s | one job is | bytes read per rank |");
    let _ = writeln!(s, "|---|---|---:|---:|---:|---|");
    let get = |loader: &str, cache: &str| {
        rows.iter().find(|r| r.loader == loader && r.cache == cache).map(|r| median(&r.times))
    };
    for r in &rows {
        let m = median(&r.times);
        let base = get(LOADERS[0], r.cache).unwrap_or(f64::NAN);
        let bytes = r
            .bytes_read
            .as_ref()
            .map(|b| {
                b.iter()
                    .map(|x| format!("{:.2} GB ({:.2}x of the model)", *x as f64 / 1e9, *x as f64 / total as f64))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "| {} | {} | {m:.3} | {:.2} | {:.2}x | {bytes} |",
            r.loader,
            r.cache,
            total as f64 / m / 1e9,
            m / base
        );
    }
    let _ = writeln!(s, "\n| check | ratio | needed | |\n|---|---:|---:|---|");
    let mut check = |what: &str, a: Option<f64>, b: Option<f64>, need: f64| {
        if let (Some(a), Some(b)) = (a, b) {
            let ratio = b / a;
            let verdict = if ratio >= need { "ok" } else { "BELOW" };
            let _ = writeln!(s, "| model {what} | {ratio:.2}x | {need}x | {verdict} |");
        }
    };
    check("cold: one job vs file after file", get(LOADERS[0], "cold"), get(LOADERS[1], "cold"), 1.3);
    // What any loader could gain over file after file: the disk's time for the bytes.
    check(
        "cold: disk ceiling vs file after file (the most one job could gain)",
        get(CEILING, "cold"),
        get(LOADERS[1], "cold"),
        1.3,
    );
    check("cold: one job vs safetensors looped", get(LOADERS[0], "cold"), get(LOADERS[2], "cold"), 1.5);
    check(
        "cold: disk ceiling vs safetensors looped (the most any loader could gain)",
        get(CEILING, "cold"),
        get(LOADERS[2], "cold"),
        1.5,
    );
    check("cold: one job vs the disk ceiling", get(LOADERS[0], "cold"), get(CEILING, "cold"), 0.9);
    let best_hot_peer = [LOADERS[2], LOADERS[3]].iter().filter_map(|l| get(l, "hot")).fold(f64::INFINITY, f64::min);
    check("hot: one job vs the best peer", get(LOADERS[0], "hot"), Some(best_hot_peer), 1.0);
    Ok(s)
}
