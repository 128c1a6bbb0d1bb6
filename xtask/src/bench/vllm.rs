//! `cargo xtask bench --vllm`: vLLM's weight loading with its default loader against the turboio
//! plug-in, on the real vLLM for the CPU (installed into `.venv-vllm` as `cargo xtask test --vllm`
//! does), cold (the shards evicted from the page cache with `POSIX_FADV_DONTNEED`) and warm, the
//! loaders alternating run by run. Each run is a fresh vLLM start (`crates/py/bench/py_vllm.py`):
//! the weight-loading seconds vLLM logs ("Loading weights took N seconds", which both loaders
//! print), the peak RSS of vLLM's processes (the worker holds the weights) and the first greedy
//! token (equal for both, or the run is an error). The model: a float32 Llama of about 1.6 GB in
//! 4 shards with an index, written once by `test_vllm_real.write_llama`. Warm, a third row is
//! the floor of any loader: vLLM's `load_weights` timed alone over tensors already in memory.

use crate::bench::kit::{date, machine, median_of, run_order, warm};
use crate::test::root;
use anyhow::{bail, Context, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const LOADERS: [&str; 2] = ["auto", "turboio"];
/// Warm only: vLLM's `load_weights` over tensors read into memory before its timer
/// (`py_vllm.py`'s `bench-floor`): what no loader can go below, vLLM's own copies.
const FLOOR: &str = "bench-floor";

/// The load formats measured with a `cold` or `warm` page cache (the floor only warm: its reads
/// are outside its timer either way).
fn loaders_for(cache: &str) -> &'static [&'static str] {
    if cache == "warm" {
        &["auto", "turboio", FLOOR]
    } else {
        &LOADERS
    }
}

/// One start's numbers.
#[derive(Clone, Debug)]
struct Run {
    load_s: f64,
    start_s: f64,
    peak_rss: u64,
    token: Vec<i64>,
}

fn model(python: &Path, dir: &Path) -> Result<PathBuf> {
    let model = dir.join("vllm-llama-1.6g");
    if model.join("model.safetensors.index.json").exists() {
        return Ok(model);
    }
    eprintln!("writing {} (a 1.6 GB float32 Llama) ...", model.display());
    let script = "import sys, pathlib; sys.path.insert(0, 'crates/py/tests'); \
                  from test_vllm_real import write_llama; \
                  write_llama(pathlib.Path(sys.argv[1]), hidden=1024, layers=26, heads=16, shard='500MB')";
    let status = Command::new(python).args(["-c", script]).arg(&model).current_dir(root()).status()?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&model);
        bail!("could not write the vLLM bench model");
    }
    Ok(model)
}

fn shards(model: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(model)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    Ok(v)
}

fn one(python: &Path, model: &Path, loader: &str) -> Result<Run> {
    let out = Command::new(python)
        .arg(root().join("crates/py/bench/py_vllm.py"))
        .arg(model)
        .arg(loader)
        .current_dir(root())
        .output()
        .context("cannot start python for the vLLM bench")?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let tail = || text.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    if !out.status.success() {
        bail!("vLLM with load_format={loader} failed ({}):\n{}", out.status, tail());
    }
    let load_s = text
        .lines()
        .find_map(|l| {
            let rest = l.split("Loading weights took ").nth(1)?;
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .with_context(|| format!("no \"Loading weights took\" line from load_format={loader}:\n{}", tail()))?;
    let json = text
        .lines()
        .find_map(|l| l.strip_prefix("BENCH "))
        .with_context(|| format!("no BENCH line from load_format={loader}:\n{}", tail()))?;
    let v: serde_json::Value = serde_json::from_str(json)?;
    Ok(Run {
        load_s,
        start_s: v["started_s"].as_f64().unwrap_or(0.0),
        peak_rss: v["worker_peak_rss"].as_u64().unwrap_or(0).max(v["parent_peak_rss"].as_u64().unwrap_or(0)),
        token: v["token"].as_array().map(|a| a.iter().filter_map(|x| x.as_i64()).collect()).unwrap_or_default(),
    })
}

/// Runs the comparison and returns the Markdown report.
pub fn run(dir: &Path, runs: usize) -> Result<String> {
    crate::bench::python::setup()?; // builds the wheel into target/wheels, which vllm_venv installs
    let python = crate::test::vllm_venv()?;
    std::fs::create_dir_all(dir)?;
    let model = model(&python, dir)?;
    let files = shards(&model)?;
    let bytes: u64 = files.iter().map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0)).sum();
    let mut results: Vec<(&str, &str, Run)> = Vec::new();
    for r in 0..runs {
        for cache in ["cold", "warm"] {
            let loaders = loaders_for(cache);
            for i in run_order(loaders.len(), r) {
                let loader = loaders[i];
                if cache == "cold" {
                    // Dirty pages (a model just written) are not dropped by POSIX_FADV_DONTNEED.
                    nix::unistd::sync();
                    files.iter().try_for_each(|f| crate::bench::cache::evict(f))?;
                } else {
                    files.iter().try_for_each(|f| warm(f))?;
                }
                eprintln!("vLLM, {cache}, load_format={loader}, run {} of {runs} ...", r + 1);
                results.push((cache, loader, one(&python, &model, loader)?));
            }
        }
    }
    let tokens: Vec<&Vec<i64>> = results.iter().map(|(_, _, r)| &r.token).collect();
    if tokens.windows(2).any(|w| w[0] != w[1]) {
        bail!("the loaders produced different first tokens: {tokens:?}");
    }
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## vLLM weight loading\n\n{} ({}), {} (CPU), a {:.2} GB float32 Llama in {} shards, \
         median of {runs} runs, loaders alternating. \"weights s\" is vLLM's own \"Loading weights took\" \
         line; peak RSS is the highest VmHWM of vLLM's processes (the worker holds the weights).\n",
        date(),
        machine(),
        crate::test::VLLM_CPU,
        bytes as f64 / 1e9,
        files.len()
    );
    md.push_str(
        "| cache | loader | weights s | every run, s | GB/s | engine start s | peak RSS GiB |\n\
         |---|---|---:|---|---:|---:|---:|\n",
    );
    let runs_of = |cache: &str, loader: &str| {
        results.iter().filter(move |(c, l, _)| *c == cache && *l == loader).map(|(_, _, r)| r).collect::<Vec<_>>()
    };
    let med = |cache: &str, loader: &str, f: &dyn Fn(&Run) -> f64| {
        median_of(&runs_of(cache, loader).into_iter().map(f).collect::<Vec<_>>())
    };
    let mut checks = Vec::new();
    for cache in ["cold", "warm"] {
        let loaders = loaders_for(cache);
        for &loader in loaders {
            let load = med(cache, loader, &|r| r.load_s);
            let every: Vec<String> = runs_of(cache, loader).iter().map(|r| format!("{:.2}", r.load_s)).collect();
            let _ = writeln!(
                md,
                "| {cache} | {} | {load:.2} | {} | {:.2} | {:.1} | {:.2} |",
                match loader {
                    "auto" => "vLLM default (safetensors)",
                    FLOOR => "floor: vLLM's load_weights alone, the tensors read into memory before the timer",
                    _ => "turboio plug-in",
                },
                every.join(", "),
                bytes as f64 / load / 1e9,
                med(cache, loader, &|r| r.start_s),
                med(cache, loader, &|r| r.peak_rss as f64) / (1u64 << 30) as f64,
            );
        }
        let time = med(cache, "turboio", &|r| r.load_s) / med(cache, "auto", &|r| r.load_s);
        let rss = med(cache, "turboio", &|r| r.peak_rss as f64) / med(cache, "auto", &|r| r.peak_rss as f64);
        checks.push((
            format!("{cache}: turboio / default weight-loading time"),
            time,
            if cache == "cold" { 0.85 } else { 1.0 },
        ));
        checks.push((format!("{cache}: turboio / default peak RSS"), rss, 1.1));
        if cache == "warm" {
            // How far above the floor each loader is, fastest run against fastest run (a floor
            // is what a run can reach; on this VM a run now and then takes several times longer,
            // whatever it loads): where the default loader is at it, 1.0x asks turboio to tie
            // with vLLM's own copies.
            let fastest = |loader: &str| runs_of(cache, loader).iter().map(|r| r.load_s).fold(f64::INFINITY, f64::min);
            for (loader, what) in [("auto", "the default loader"), ("turboio", "turboio")] {
                let above = fastest(loader) / fastest(FLOOR);
                checks.push((
                    format!("(limit) warm, fastest runs: {what} / the floor (vLLM's copies alone)"),
                    above,
                    1.0,
                ));
            }
        }
    }
    md.push_str("\n| check | ratio | need | |\n|---|---:|---:|---|\n");
    for (what, ratio, need) in &checks {
        if what.starts_with("(limit)") {
            let _ = writeln!(md, "| {what} | {ratio:.2}x | | no loader goes below 1.0x |");
            continue;
        }
        let _ = writeln!(md, "| {what} | {ratio:.2}x | <= {need}x | {} |", if ratio <= need { "ok" } else { "FAIL" });
    }
    let _ = writeln!(md, "\nFirst greedy token equal for every run: {:?}.", tokens.first());
    Ok(md)
}
