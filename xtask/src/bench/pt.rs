//! The `.pt` rows of `cargo xtask bench` (alone with `--pt`): the bench sample saved by
//! `torch.save` and loaded, hot and cold, each load in a Python process of its own, by turboio
//! (no pickle executed) against `torch.load(weights_only=True)`, `torch.load(mmap=True)` and
//! turboio's safetensors load of the same tensors; converting loads (to BF16) against plain
//! copied loads, in process; and the conversion of the `.pt` to safetensors by `turboio convert`,
//! `python -m turboio.convert` and veTurboIO's way (`torch.load` + `save_file`), with the peak
//! memory of each.

use crate::bench::kit::{measure, median_of as median, ratio, warm, Check, Loader, Row};
use crate::test::root;
use anyhow::{bail, Context, Result};
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use turboio::device::ArenaPool;

/// The Python loaders of the `.pt` rows (names `py_load.py` knows).
pub const PY_LOADERS: [&str; 4] = ["turboio.load .pt", "torch.load", "torch.load, mmap", "turboio.load"];

/// The conversions compared.
const CONVERSIONS: [(&str, &str); 3] = [
    ("cli", "turboio convert (CLI)"),
    ("module", "python -m turboio.convert"),
    ("torch", "torch.load + safetensors save_file (veTurboIO's way)"),
];

struct Conversion {
    name: &'static str,
    seconds: Vec<f64>,
    peak_rss: u64,
}

fn convert_once(python: &Path, cli: &Path, how: &str, pt: &Path, out: &Path) -> Result<(f64, u64)> {
    let o = Command::new(python)
        .arg(root().join("crates/py/bench/py_convert.py"))
        .args(["--how", how, "--input"])
        .arg(pt)
        .arg("--output")
        .arg(out)
        .arg("--cli")
        .arg(cli)
        .output()
        .with_context(|| format!("run conversion {how}"))?;
    if !o.status.success() {
        bail!("conversion {how} failed: {}", String::from_utf8_lossy(&o.stderr));
    }
    let text = String::from_utf8_lossy(&o.stdout);
    let v: serde_json::Value = serde_json::from_str(text.lines().last().unwrap_or(""))
        .with_context(|| format!("conversion {how} printed {text}"))?;
    Ok((v["seconds"].as_f64().unwrap_or(f64::NAN), v["peak_rss"].as_u64().unwrap_or(0)))
}

/// Runs the `.pt` rows for the sample of `size`; returns the Markdown section and, with
/// `verdicts` (not for a smoke run), its checks.
pub fn run(
    python: &Path,
    data_dir: &Path,
    size: u64,
    runs: usize,
    conversions: usize,
    no_cold: bool,
    verdicts: bool,
) -> Result<String> {
    let file = crate::bench::kit::sample(data_dir, size)?;
    let pt = crate::bench::python::pt_copy(python, &file)?;
    let len = std::fs::metadata(&file)?.len();
    let mut rows: Vec<Row> = Vec::new();
    let label = crate::bench::kit::size_name(size);
    for cold in [false, true] {
        if cold && no_cold {
            continue;
        }
        let cache = if cold { "cold" } else { "hot" };
        eprintln!("{label}: .pt loads, {cache}, {runs} runs ...");
        rows.extend(crate::bench::python::measure_on(
            python,
            &file,
            &pt,
            len,
            runs,
            cold,
            "cpu",
            &PY_LOADERS,
            "python",
        )?);
        eprintln!("{label}: converting loads, {cache}, {runs} runs ...");
        let loaders = [Loader::TurboCopied, Loader::TurboConvert];
        let mut these: Vec<Row> =
            loaders.iter().map(|l| Row { size: len, cache, loader: l.name(), ..Default::default() }).collect();
        measure(&mut these, &loaders, &file, runs, cold, &ArenaPool::new(1))?;
        rows.extend(these);
    }

    eprintln!("{label}: conversions, {conversions} runs ...");
    let out = pt.with_extension("converted.safetensors");
    let cli = crate::bench::kit::cli()?;
    let mut convs: Vec<Conversion> =
        CONVERSIONS.iter().map(|&(_, name)| Conversion { name, seconds: Vec::new(), peak_rss: 0 }).collect();
    for r in 0..conversions {
        for i in crate::bench::kit::run_order(CONVERSIONS.len(), r) {
            warm(&pt)?;
            let _ = std::fs::remove_file(&out);
            let (s, peak) = convert_once(python, &cli, CONVERSIONS[i].0, &pt, &out)?;
            convs[i].seconds.push(s);
            convs[i].peak_rss = convs[i].peak_rss.max(peak);
        }
    }
    let _ = std::fs::remove_file(&out);
    let header = turboio::read_header_of(&file, &turboio::LoadOptions::default())?;
    let largest = header.tensors().iter().map(|t| t.len() as u64).max().unwrap_or(0);

    let mut checks = Vec::new();
    let mut add = |what: &str, cache: &str, a: &str, b: &str, need: f64| {
        if let Some(r) = ratio(&rows, len, cache, a, b) {
            checks.push(Check { what: format!("{label} {cache}: {what}"), ratio: r, need });
        }
    };
    add(".pt: turboio.load vs torch.load(weights_only)", "hot", "turboio.load .pt", "torch.load", 20.0);
    add(".pt vs safetensors, both turboio.load (within 1.5x)", "hot", "turboio.load .pt", "turboio.load", 1.0 / 1.5);
    add(".pt vs safetensors, both turboio.load (within 1.3x)", "cold", "turboio.load .pt", "turboio.load", 1.0 / 1.3);
    let (copied, converting) = (Loader::TurboCopied.name(), Loader::TurboConvert.name());
    add("converting to BF16 vs plain copied load (< 1.5x)", "hot", converting, copied, 1.0 / 1.5);
    add("converting to BF16 vs plain copied load (< 1.5x)", "cold", converting, copied, 1.0 / 1.5);
    let bound = largest as f64 * 1.5 + (512u64 << 20) as f64;
    if let Some(cli) = convs.first().filter(|c| c.peak_rss > 0) {
        checks.push(Check {
            what: format!("{label} conversion: (largest tensor x 1.5 + 512 MiB) / peak RSS of turboio convert"),
            ratio: bound / cli.peak_rss as f64,
            need: 1.0,
        });
        checks.push(Check {
            what: format!("{label} conversion: turboio convert vs torch.load + save_file"),
            ratio: median(&convs[2].seconds) / median(&cli.seconds),
            need: 1.0,
        });
    }

    if !verdicts {
        checks.clear();
    }
    let mut s = crate::bench::kit::render(&rows, &checks, runs);
    let _ = writeln!(
        s,
        "\n### Converting the {label} `.pt` to safetensors (input hot, median of {conversions}; largest tensor {:.0} MiB)\n",
        largest as f64 / (1u64 << 20) as f64
    );
    let _ = writeln!(s, "| conversion | s | turboio convert is | peak RSS |");
    let _ = writeln!(s, "|---|---:|---:|---:|");
    let base = median(&convs[0].seconds);
    for c in &convs {
        let m = median(&c.seconds);
        let _ = writeln!(
            s,
            "| {} | {m:.2} | {:.2}x | {:.2} GiB |",
            c.name,
            m / base,
            c.peak_rss as f64 / (1u64 << 30) as f64
        );
    }
    Ok(s)
}
