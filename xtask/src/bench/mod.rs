//! `cargo xtask bench`: turboio's loads against baselines and ceilings, hot and cold, in one
//! run with the loaders in a different shuffled order each run (the machines are noisy; only
//! same-run ratios mean anything).

pub mod cache;
pub mod ceiling;
pub mod charts;
pub mod gpu;
pub mod gpu_model;
pub mod kit;
pub mod model;
pub mod object;
pub mod pt;
pub mod python;
pub mod save;
pub mod tensor;
pub mod train;
pub mod vllm;

use crate::bench::kit::{
    date, encrypted_twin, machine, measure, parse_size, ratio, ratio_in, render, sample, size_name, Check, Loader, Row,
};
use anyhow::{Context, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;
use turboio::device::ArenaPool;
use turboio::{LoadMode, LoadOptions, SaveOptions};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Small files and few runs: a smoke test for CI.
    #[arg(long)]
    pub quick: bool,
    /// File sizes (default 1GiB,2GiB,4GiB; 64MiB with --quick).
    #[arg(long, value_delimiter = ',')]
    pub sizes: Vec<String>,
    /// Runs per loader and cache state (default 5; 2 with --quick). The median is reported.
    #[arg(long)]
    pub runs: Option<usize>,
    /// Where sample files are generated and kept between runs.
    #[arg(long, default_value = "target/bench-data")]
    pub dir: PathBuf,
    /// Where the table goes (CSV, JSON, Markdown).
    #[arg(long, default_value = "target/bench")]
    pub out: PathBuf,
    /// Skip the cold-cache rows.
    #[arg(long)]
    pub no_cold: bool,
    /// Delete the sample files afterwards.
    #[arg(long)]
    pub clean: bool,
    /// Skip the Python rows (which set up .venv with torch, safetensors, fastsafetensors and
    /// the turboio wheel).
    #[arg(long)]
    pub no_python: bool,
    /// Skip the save rows.
    #[arg(long)]
    pub no_save: bool,
    /// Only the save rows, with their checks: the first size (default 1GiB) saved by turboio's
    /// savers, the Python peers and the disk's O_DIRECT ceiling, and a process's first
    /// background save against the floor of any snapshot; written to `saves.md` in `--out`.
    /// (The full bench runs these rows too.)
    #[arg(long)]
    pub saves: bool,
    /// Only the Python loaders' rows (hot, cold with the file evicted, cold with every cache
    /// dropped) for each size: the README's table and its charts, written to `load.{md,csv,json}`
    /// and SVGs in `--out` as by the full bench.
    #[arg(long, conflicts_with = "no_python")]
    pub python_only: bool,
    /// Only the whole-model rows: a model directory of 9 shards (the first size, default
    /// 4GiB), loaded as one job by turboio against turboio file after file, safetensors looped
    /// over the shards and fastsafetensors, hot and cold, and a 2-rank gloo run (direct vs
    /// collectives) with the bytes each rank read; written to `model.md` in `--out`.
    #[arg(long)]
    pub model: bool,
    /// Only the `.pt` rows: the sample saved by torch.save (the first size, default 4GiB),
    /// loaded by turboio against torch.load (weights_only, and mmap) and against turboio's
    /// safetensors load, hot and cold; converting loads (to BF16) against copied loads; and the
    /// conversion to safetensors by turboio against torch.load + save_file, with peak RSS;
    /// written to `pt.md` in `--out`. (The full bench runs these rows too.)
    #[arg(long)]
    pub pt: bool,
    /// Only the object-storage rows: the sample (the first size, default 4GiB) and a 9-shard
    /// model uploaded to a local s3s-fs (installed into `target/bench-tools` on first use), loaded
    /// by turboio against Run:ai Model Streamer and boto3 + safetensors, the server's ranged-GET
    /// ceiling, the floor of a loader and the floor of a node cache's fill, with no
    /// added latency and with 20 ms per request, then against nginx (default 3 runs); written to
    /// `object.md` in `--out`. (The full bench runs these rows too.)
    #[arg(long)]
    pub object: bool,
    /// Only the training-checkpoint rows: one tensor of the first size (default 1GiB) saved to a
    /// new file and over an existing one, by turboio and by DeepSpeed's DeepNVMe (built on first
    /// use: Debian's libaio-dev as root, deepspeed into `target/bench-tools`), and read cold into
    /// reused memory, with the disk's O_DIRECT ceilings; written to `training.md` in `--out`.
    /// (The full bench runs these rows too, not its --quick smoke run.)
    #[arg(long)]
    pub training: bool,
    /// Only the per-tensor and selection rows: a 5,000-tensor and a 510-tensor file (the first
    /// size, default 2GiB) loaded hot and cold by turboio.load, safetensors.torch.load_file and
    /// the .pt path against the ceilings that build no tensor; and every 10th tensor of a cold
    /// 9-shard model (4GiB, or the first size) against the whole model, with the bytes read from
    /// the disk; written to `tensors.md` in `--out`. (The full bench runs these rows too, not
    /// its --quick smoke run.)
    #[arg(long)]
    pub tensors: bool,
    /// Only the vLLM rows: weight loading by vLLM's default loader against the turboio plug-in
    /// on the real vLLM for the CPU (installed into `.venv-vllm`), a 1.6 GB float32 Llama, cold
    /// and warm, with the worker's peak RSS, and warm the floor (vLLM's `load_weights` alone over
    /// tensors already in memory) (default 3 runs); written to `vllm.md` in `--out`.
    #[arg(long)]
    pub vllm: bool,
    /// An SFCS directory (`sfcs://...`) for the SFCS rows (a save and copied loads through
    /// libcloudfs); they also need LIBCFS_PATH pointing at the vendor library. Without both,
    /// the rows are skipped with a message.
    #[arg(long)]
    pub sfcs_path: Option<String>,
    /// Also load into this GPU (e.g. cuda:0): turboio staged, from the page-cache mapping, with
    /// GDS, encrypted; the Python peers to the GPU; the pinned host-to-device ceiling. Skipped
    /// with the reason where the device cannot be opened.
    #[arg(long)]
    pub device: Option<String>,
    /// Only the staged loads through the performance model of a GPU (any machine): a model
    /// directory (the first size, default 4GiB) hot and cold, steady state and first load in a
    /// new process, against the pread, read-ahead and O_DIRECT io_uring ceilings with the same
    /// readers, with the model's counters, CPU seconds per GB and a load's fixed cost (against a
    /// 256 MiB model); written to `gpu-model.md` in `--out`. With `--device cuda:N`, the same
    /// rows into that GPU (no model counters).
    #[arg(long)]
    pub gpu_model: bool,
    /// The model's settings for `--gpu-model` (e.g. `link=25,pin=1.5`; see `GpuModel::parse`):
    /// the H200 VMs' measurements by default.
    #[arg(long, default_value = "")]
    pub gpu_model_spec: String,
    /// Only the GPU rows of `--device` (turboio's and the Python peers', hot and cold, with the
    /// ceiling and the GPU checks), for every size: a GPU machine's short lease. Written to
    /// `gpu.md` / `gpu.json` in `--out`.
    #[arg(long, requires = "device")]
    pub gpu_only: bool,
}

/// The GPU rows for one file: turboio's (hot, and cold unless `no_cold`) and the Python peers'.
fn gpu_rows(
    device: &str,
    python: Option<&Path>,
    path: &Path,
    len: u64,
    runs: usize,
    no_cold: bool,
) -> Result<Vec<Row>> {
    let mut all = Vec::new();
    let enc = encrypted_twin(path)?;
    // The sample's nominal size (its length is a little more: the header).
    let label = size_name(len - len % (64 << 20));
    eprintln!("{label}: GPU ({device}), hot, {runs} runs ...");
    all.extend(crate::bench::gpu::measure(device, path, &enc, len, runs, false)?);
    if !no_cold {
        eprintln!("{label}: GPU ({device}), cold, {runs} runs ...");
        all.extend(crate::bench::gpu::measure(device, path, &enc, len, runs, true)?);
    }
    if let Some(py) = python {
        let pt = crate::bench::python::pt_copy(py, path)?;
        let caches: &[bool] = if no_cold { &[false] } else { &[false, true] };
        for &cold in caches {
            eprintln!("{label}: Python to {device}, {}, {runs} runs ...", if cold { "cold" } else { "hot" });
            let mut rows = crate::bench::python::measure_on(
                py,
                path,
                &pt,
                len,
                runs,
                cold,
                device,
                &crate::bench::python::GPU_LOADERS,
                "python, gpu",
            )?;
            if crate::bench::gpu::open(device).is_err() {
                for r in &mut rows {
                    r.skipped = Some(format!("{device} cannot be opened here"));
                }
            }
            all.extend(rows);
        }
    }
    Ok(all)
}

/// The GPU checks for one size (the rows of [`gpu_rows`]).
fn gpu_checks(all: &[Row], len: u64, size: u64, checks: &mut Vec<Check>) {
    use crate::bench::gpu::{AUTO, CEILING, ENCRYPTED, STAGED};
    let mut add = |what: &str, a: &str, b: &str, need: f64| {
        if let Some(r) = ratio(all, len, "hot", a, b) {
            checks.push(Check { what: format!("{} hot: {what}", size_name(size)), ratio: r, need });
        }
    };
    add("GPU: turboio auto vs the pinned H2D ceiling", AUTO, CEILING, 0.7);
    add("GPU: encrypted vs staged plain", ENCRYPTED, STAGED, 0.8);
    // Issue 47's bars for Python into the GPU; InstantTensor's rows stand beside ours.
    for (cache, peer, need) in [
        ("hot", "safetensors.torch.load_file", 3.0),
        ("cold", "fastsafetensors", 1.0),
        ("hot", "instanttensor", 1.0),
        ("cold", "instanttensor", 1.0),
    ] {
        if let Some(r) = ratio_in(all, len, cache, "python, gpu", "turboio.load", peer) {
            checks.push(Check {
                what: format!("{} {cache}: GPU turboio.load vs {peer} (device=cuda)", size_name(size)),
                ratio: r,
                need,
            });
        }
    }
}

/// The JSON form of a run's rows and checks (`load.json`, `gpu.json`).
fn report_json(all: &[Row], checks: &[Check], runs: usize) -> serde_json::Value {
    serde_json::json!({
        "date": date(),
        "machine": machine(),
        "runs": runs,
        "rows": all.iter().map(|r| serde_json::json!({
            "size_bytes": r.size, "cache": r.cache, "loader": r.loader, "group": r.group, "times_s": r.times,
            "load_times_s": r.load_times, "median_s": r.median(), "gb_per_s": r.gbps(),
            "peak_rss_bytes": r.peak_rss, "anon_delta_bytes": r.anon_delta, "how": r.how, "skipped": r.skipped,
        })).collect::<Vec<_>>(),
        "checks": checks.iter().map(|c| serde_json::json!({"what": c.what, "ratio": c.ratio, "need": c.need, "pass": c.ratio >= c.need})).collect::<Vec<_>>(),
    })
}

/// `--gpu-only`: the GPU rows and checks alone, for every size.
fn run_gpu_only(args: &Args, device: &str, sizes: &[u64], runs: usize) -> Result<()> {
    let python = if args.no_python { None } else { Some(crate::bench::python::setup()?) };
    let mut all: Vec<Row> = Vec::new();
    let mut checks = Vec::new();
    for &size in sizes {
        let path = sample(&args.dir, size)?;
        let len = std::fs::metadata(&path)?.len();
        all.extend(gpu_rows(device, python.as_deref(), &path, len, runs, args.no_cold)?);
        gpu_checks(&all, len, size, &mut checks);
    }
    let report = render(&all, &checks, runs);
    println!("{report}");
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("gpu.md"), &report)?;
    let json = report_json(&all, &checks, runs);
    std::fs::write(args.out.join("gpu.json"), serde_json::to_string_pretty(&json)?)?;
    eprintln!("wrote {}/gpu.{{md,json}}", args.out.display());
    Ok(())
}

/// The SFCS rows: a save through libcloudfs (parts, concat, rename), then copied loads of that
/// file, `runs` times each; skipped, with the reason, unless LIBCFS_PATH and `--sfcs-path`
/// are given and the library loads.
fn sfcs_rows(dir: Option<&str>, size: u64, runs: usize) -> Result<Vec<Row>> {
    let mut save = Row { size, cache: "sfcs", loader: "turboio save (sfcs)", ..Default::default() };
    let mut load = Row { size, cache: "sfcs", loader: "turboio copied (sfcs)", ..Default::default() };
    let skip = match (std::env::var_os("LIBCFS_PATH"), dir) {
        (None, _) | (_, None) => {
            Some("needs LIBCFS_PATH (the vendor libcloudfs.so) and --sfcs-path sfcs://DIR".to_string())
        }
        (Some(_), Some(d)) if !d.starts_with("sfcs://") => Some(format!("--sfcs-path {d} is not an sfcs:// path")),
        _ => turboio::sfcs::SfcsStorage::from_env().check_library().err(),
    };
    if let Some(why) = skip {
        eprintln!("SFCS rows skipped: {why}");
        save.skipped = Some(why.clone());
        load.skipped = Some(why);
        return Ok(vec![save, load]);
    }
    let path = PathBuf::from(format!(
        "{}/bench-{}.safetensors",
        dir.unwrap_or_default().trim_end_matches('/'),
        size_name(size)
    ));
    eprintln!("{}: sfcs {}, {runs} runs ...", size_name(size), path.display());
    for _ in 0..runs {
        let t = Instant::now();
        turboio::sample::write_sample(&path, size, 1, &SaveOptions::default())?;
        save.times.push(t.elapsed().as_secs_f64());
        save.load_times.push(save.times[save.times.len() - 1]);
    }
    for _ in 0..runs {
        let t = Instant::now();
        let loaded = turboio::load(&path, &LoadOptions { mode: LoadMode::Copied, ..Default::default() })?;
        load.load_times.push(t.elapsed().as_secs_f64());
        drop(loaded);
        load.times.push(t.elapsed().as_secs_f64());
    }
    save.how = "temporary directory, one part per thread, cfsConcat, cfsRename2".into();
    load.how = "one connection, one cfsFile per reader thread".into();
    Ok(vec![save, load])
}

pub fn run(args: Args) -> Result<()> {
    let sizes: Vec<u64> = if args.sizes.is_empty() {
        if args.quick {
            vec![64 << 20]
        } else {
            vec![1 << 30, 2 << 30, 4 << 30]
        }
    } else {
        args.sizes.iter().map(|s| parse_size(s)).collect::<Result<_>>()?
    };
    let runs = args.runs.unwrap_or(if args.quick { 2 } else { 5 }).max(1);
    if args.model {
        let size = if args.sizes.is_empty() && !args.quick { 4 << 30 } else { sizes[0] };
        let python = crate::bench::python::setup()?;
        let report = crate::bench::model::run(&python, &args.dir, size, runs, args.no_cold)?;
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("model.md"), &report)?;
        println!("{report}\nwrote {}", args.out.join("model.md").display());
        return Ok(());
    }
    if args.gpu_model {
        let size = if args.sizes.is_empty() && !args.quick { 4 << 30 } else { sizes[0] };
        let small = (256u64 << 20).min(size / 4).max(64 << 20);
        let on = args.device.as_deref();
        let report =
            crate::bench::gpu_model::run(&args.dir, size, small, runs, args.no_cold, &args.gpu_model_spec, on)?;
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("gpu-model.md"), &report)?;
        println!("{report}\nwrote {}", args.out.join("gpu-model.md").display());
        return Ok(());
    }
    if args.object {
        let size = if args.sizes.is_empty() && !args.quick { 4 << 30 } else { sizes[0] };
        let runs = args.runs.unwrap_or(if args.quick { 2 } else { 3 }).max(1);
        let python = if args.no_python { None } else { Some(crate::bench::python::setup()?) };
        let report = crate::bench::object::run(python.as_deref(), &args.dir, size, runs, args.quick)?;
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("object.md"), &report)?;
        println!("{report}\nwrote {}", args.out.join("object.md").display());
        return Ok(());
    }
    if args.training {
        let size = if args.sizes.is_empty() && !args.quick { 1 << 30 } else { sizes[0] };
        let python = if args.no_python { None } else { Some(crate::bench::python::setup()?) };
        let report = crate::bench::train::run(python.as_deref(), &args.dir, size, runs)?;
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("training.md"), &report)?;
        println!("{report}\nwrote {}", args.out.join("training.md").display());
        return Ok(());
    }
    if args.vllm {
        let runs = args.runs.unwrap_or(3).max(1);
        let report = crate::bench::vllm::run(&args.dir, runs)?;
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("vllm.md"), &report)?;
        println!("{report}\nwrote {}", args.out.join("vllm.md").display());
        return Ok(());
    }
    if args.tensors {
        let size = if args.sizes.is_empty() && !args.quick { 2 << 30 } else { sizes[0] };
        let model = if args.sizes.is_empty() && !args.quick { 4 << 30 } else { sizes[0] };
        let python = crate::bench::python::setup()?;
        let report = crate::bench::tensor::run(&python, &args.dir, size, model, runs, args.no_cold)?;
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("tensors.md"), &report)?;
        println!("{report}\nwrote {}", args.out.join("tensors.md").display());
        return Ok(());
    }
    // The sections that start many Python processes (each imports torch) run once in a smoke run.
    let process_runs = if args.quick { 1 } else { runs };
    // Processes loading at once in the page-cache table (each imports torch: 2 in a smoke run).
    let together = if args.quick { 2 } else { crate::bench::cache::PROCS };
    if args.pt {
        let size = if args.sizes.is_empty() && !args.quick { 4 << 30 } else { sizes[0] };
        let python = crate::bench::python::setup()?;
        let report = crate::bench::pt::run(&python, &args.dir, size, runs, process_runs, args.no_cold, !args.quick)?;
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("pt.md"), &report)?;
        println!("{report}\nwrote {}", args.out.join("pt.md").display());
        return Ok(());
    }
    if args.saves {
        let size = if args.sizes.is_empty() && !args.quick { 1 << 30 } else { sizes[0] };
        let python = if args.no_python { None } else { Some(crate::bench::python::setup()?) };
        let path = sample(&args.dir, size)?;
        let len = std::fs::metadata(&path)?.len();
        eprintln!("{}: saves, {runs} runs ...", size_name(size));
        let rows = crate::bench::save::measure(python.as_deref(), &path, runs)?;
        let checks = crate::bench::save::checks(&rows, len);
        let mut report = render(&[], &checks, runs);
        report.push('\n');
        report.push_str(&crate::bench::save::render(&rows, len, runs));
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("saves.md"), &report)?;
        println!("{report}\nwrote {}", args.out.join("saves.md").display());
        return Ok(());
    }
    if args.gpu_only {
        let device = args.device.as_deref().context("--gpu-only needs --device cuda:N")?;
        return run_gpu_only(&args, device, &sizes, runs);
    }
    let pool = ArenaPool::with_huge_pages(1, false);
    // The CLI rows' binary, built before the first measurement (not in the middle of the run).
    if !args.python_only {
        crate::bench::kit::cli()?;
    }
    let python = if args.no_python { None } else { Some(crate::bench::python::setup()?) };
    let mut all: Vec<Row> = Vec::new();
    let mut cache_tables: Vec<(u64, Vec<crate::bench::cache::CacheRow>)> = Vec::new();
    let mut save_tables: Vec<(u64, Vec<crate::bench::save::SaveRow>)> = Vec::new();
    let mut pt_sections: Vec<String> = Vec::new();
    for &size in &sizes {
        let path = sample(&args.dir, size)?;
        let len = std::fs::metadata(&path)?.len();
        if let Some(py) = &python {
            let pt = crate::bench::python::pt_copy(py, &path)?;
            eprintln!("{}: python, hot, {runs} runs ...", size_name(size));
            all.extend(crate::bench::python::measure(py, &path, &pt, len, runs, false)?);
            if !args.no_cold {
                eprintln!("{}: python, cold (file evicted), {runs} runs ...", size_name(size));
                all.extend(crate::bench::python::measure_file_evicted(py, &path, &pt, len, runs)?);
                eprintln!("{}: python, cold (every cache dropped), {runs} runs ...", size_name(size));
                all.extend(crate::bench::python::measure(py, &path, &pt, len, runs, true)?);
            }
            if args.python_only {
                continue;
            }
            eprintln!("{}: .pt rows ...", size_name(size));
            pt_sections.push(crate::bench::pt::run(
                py,
                &args.dir,
                size,
                runs,
                process_runs,
                args.no_cold,
                !args.quick,
            )?);
            if args.clean {
                std::fs::remove_file(&pt)?;
            }
            if !args.no_cold {
                eprintln!("{}: page cache across processes, {process_runs} runs ...", size_name(size));
                let enc = encrypted_twin(&path)?;
                let rows = crate::bench::cache::measure(py, &path, &enc, process_runs, together)?;
                cache_tables.push((len, rows));
            }
        }
        let mut hot: Vec<Row> = Loader::HOT
            .iter()
            .map(|l| Row { size: len, cache: "hot", loader: l.name(), ..Default::default() })
            .collect();
        eprintln!("{}: hot, {runs} runs ...", size_name(size));
        measure(&mut hot, &Loader::HOT, &path, runs, false, &pool)?;
        pool.clear();
        all.extend(hot);
        let mut cold: Vec<Row> = Loader::COLD
            .iter()
            .map(|l| Row { size: len, cache: "cold", loader: l.name(), ..Default::default() })
            .collect();
        if args.no_cold {
            for r in &mut cold {
                r.skipped = Some("--no-cold".into());
            }
        } else {
            eprintln!("{}: cold, {runs} runs ...", size_name(size));
            measure(&mut cold, &Loader::COLD, &path, runs, true, &pool)?;
        }
        all.extend(cold);
        if !args.no_save {
            eprintln!("{}: saves, {process_runs} runs ...", size_name(size));
            save_tables.push((len, crate::bench::save::measure(python.as_deref(), &path, process_runs)?));
        }
        all.extend(sfcs_rows(args.sfcs_path.as_deref(), size, runs)?);
        if let Some(device) = &args.device {
            all.extend(gpu_rows(device, python.as_deref(), &path, len, runs, args.no_cold)?);
        }
        if args.clean {
            std::fs::remove_file(&path)?;
        }
    }

    // The object-storage rows, for the first size (skipped with the reason when the server
    // cannot be installed or started). Not in the smoke run: it builds s3s-fs and installs
    // Run:ai (minutes on a fresh machine); `cargo xtask bench --object --quick` is its smoke run.
    let not_in_this_run =
        |what: &str, command: &str| format!("## {what}\n\nNot in this run (--python-only): `{command}`.\n");
    let object_section = if args.python_only {
        not_in_this_run("Object storage", "cargo xtask bench --object")
    } else if args.quick {
        "## Object storage\n\nNot in the --quick smoke run (it builds s3s-fs and installs Run:ai Model Streamer): \
         `cargo xtask bench --object --quick`.\n"
            .to_owned()
    } else {
        let object_runs = args.runs.unwrap_or(3).max(1);
        eprintln!("{}: object storage, {object_runs} runs ...", size_name(sizes[0]));
        crate::bench::object::run(python.as_deref(), &args.dir, sizes[0], object_runs, false).unwrap_or_else(|e| {
            eprintln!("object rows skipped: {e:#}");
            format!("## Object storage\n\nSkipped: {e:#}.\n")
        })
    };
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("object.md"), &object_section)?;

    // The training-checkpoint rows against DeepNVMe, for the first size. Not in the smoke run:
    // DeepSpeed's op takes minutes to build on a fresh machine.
    let training_section = if args.python_only {
        not_in_this_run("Training checkpoints", "cargo xtask bench --training")
    } else if args.quick {
        "## Training checkpoints\n\nNot in the --quick smoke run (it builds DeepSpeed's async_io op): \
         `cargo xtask bench --training --quick`.\n"
            .to_owned()
    } else {
        eprintln!("{}: training checkpoints, {runs} runs ...", size_name(sizes[0]));
        crate::bench::train::run(python.as_deref(), &args.dir, sizes[0], runs).unwrap_or_else(|e| {
            eprintln!("training rows skipped: {e:#}");
            format!("## Training checkpoints\n\nSkipped: {e:#}.\n")
        })
    };
    std::fs::write(args.out.join("training.md"), &training_section)?;

    // Per-tensor cost and selection, for the first size (not in the smoke run: it writes files
    // of 5,000 and 510 tensors and a 9-shard model).
    let tensors_section = match (&python, args.quick || args.python_only) {
        (Some(py), false) => crate::bench::tensor::run(py, &args.dir, sizes[0], sizes[0], runs, args.no_cold)
            .unwrap_or_else(|e| {
                eprintln!("tensor rows skipped: {e:#}");
                format!("\nSkipped: {e:#}.\n")
            }),
        _ => "\nNot in this run (--quick, --python-only or --no-python): `cargo xtask bench --tensors`.\n".to_owned(),
    };
    std::fs::write(args.out.join("tensors.md"), &tensors_section)?;

    let mut checks = Vec::new();
    for &size in &sizes {
        let Some(len) = all.iter().find(|r| r.size >= size && r.size < size + (64 << 20)).map(|r| r.size) else {
            continue;
        };
        let mut add = |what: &str, cache: &str, a: &str, b: &str, need: f64| {
            if let Some(r) = ratio(&all, len, cache, a, b) {
                checks.push(Check { what: format!("{} {cache}: {what}", size_name(size)), ratio: r, need });
            }
        };
        add("auto vs map+populate ceiling", "hot", Loader::TurboAuto.name(), Loader::PopulateCeiling.name(), 0.6);
        add("auto vs std::fs::read", "hot", Loader::TurboAuto.name(), Loader::FsRead.name(), 3.0);
        add("copied vs std::fs::read", "hot", Loader::TurboCopied.name(), Loader::FsRead.name(), 1.5);
        add("copied vs mmap+copy", "hot", Loader::TurboCopied.name(), Loader::MmapCopy.name(), 1.5);
        add("encrypted vs copied (plain)", "hot", Loader::TurboEncrypted.name(), Loader::TurboCopied.name(), 0.6);
        add("CLI --key-env vs CLI --mode copied", "hot", Loader::CliEncrypted.name(), Loader::CliCopied.name(), 0.6);
        add("auto vs O_DIRECT QD32 ceiling", "cold", Loader::TurboAuto.name(), Loader::ODirectCeiling.name(), 0.8);
        add("auto vs std::fs::read", "cold", Loader::TurboAuto.name(), Loader::FsRead.name(), 1.0);
        add(
            "converting to BF16 vs copied (< 1.5x)",
            "hot",
            Loader::TurboConvert.name(),
            Loader::TurboCopied.name(),
            1.0 / 1.5,
        );
        add(
            "converting to BF16 vs copied (< 1.5x)",
            "cold",
            Loader::TurboConvert.name(),
            Loader::TurboCopied.name(),
            1.0 / 1.5,
        );
        add("turboio.load vs safetensors.torch.load_file", "hot", "turboio.load", "safetensors.torch.load_file", 3.0);
        add("turboio.load vs safetensors.torch.load_file", "cold", "turboio.load", "safetensors.torch.load_file", 2.0);
        add("turboio.load vs torch.load", "hot", "turboio.load", "torch.load", 8.0);
        if args.device.is_some() {
            gpu_checks(&all, len, size, &mut checks);
        }
    }

    for (len, rows) in &cache_tables {
        let find = |name: &str| rows.iter().find(|r| r.loader == name && r.skipped.is_none());
        let label = size_name(*len - *len % (64 << 20));
        let mut add = |what: &str, ratio: Option<f64>, need: f64| {
            if let Some(ratio) = ratio {
                checks.push(Check { what: format!("{label} page cache: {what}"), ratio, need });
            }
        };
        let auto = find("turboio auto");
        let best_forced = [find("turboio mapped"), find("turboio copied, cache bypass")]
            .into_iter()
            .flatten()
            .filter_map(|r| r.cold())
            .reduce(f64::min);
        add(
            "default cold vs faster of mapped and O_DIRECT copied",
            auto.and_then(|a| Some(best_forced? / a.cold()?)),
            0.9,
        );
        add("default: cold / next process", auto.and_then(|a| Some(a.cold()? / a.next()?)), 10.0);
        add("default: one cold / 4 at once", auto.and_then(|a| Some(a.cold()? / a.together()?)), 1.0 / 1.3);
        let disk = auto.and_then(|a| {
            let mut d = a.disk_together.clone();
            d.sort_unstable();
            d.get(d.len() / 2).copied()
        });
        add("default: file size / disk read by 4 at once", disk.map(|d| *len as f64 / d.max(1) as f64), 1.0 / 1.1);
        let enc = find("turboio auto, encrypted");
        add("encrypted default: cold / next process", enc.and_then(|e| Some(e.cold()? / e.next()?)), 3.0);
    }

    for (len, rows) in &save_tables {
        checks.extend(crate::bench::save::checks(rows, *len));
    }

    // The checks' thresholds are about 1-4 GiB files; a --quick smoke run (64 MiB, 2 runs) only
    // shows that every loader works, so it prints no pass/fail verdicts it could not stand by.
    if args.quick {
        checks.clear();
    }
    let mut report = render(&all, &checks, runs);
    if args.quick {
        report.push_str("\nSmoke run (--quick): timings only, no checks (their thresholds are for 1-4 GiB files).\n");
    }
    for (len, rows) in &save_tables {
        report.push('\n');
        report.push_str(&crate::bench::save::render(rows, *len, process_runs));
    }
    for (len, rows) in &cache_tables {
        report.push('\n');
        report.push_str(&crate::bench::cache::render(rows, *len, process_runs, together));
    }
    for section in &pt_sections {
        report.push_str("\n## PyTorch `.pt` checkpoints and dtype conversion\n\n");
        report.push_str(section);
    }
    report.push('\n');
    report.push_str(&object_section);
    report.push('\n');
    report.push_str(&training_section);
    report.push_str("\n## Per-tensor cost and selection\n");
    report.push_str(&tensors_section);
    println!("{report}");
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("load.md"), &report)?;
    let mut csv = String::from(
        "size_bytes,cache,loader,runs,load_median_s,median_s,gb_per_s,min_s,max_s,peak_rss_bytes,anon_delta_bytes,how,skipped\n",
    );
    for r in &all {
        let (mn, mx) = r.times.iter().fold((f64::INFINITY, 0f64), |(a, b), &t| (a.min(t), b.max(t)));
        let _ = writeln!(
            csv,
            "{},{},{},{},{:.4},{:.4},{:.3},{:.4},{:.4},{},{},\"{}\",\"{}\"",
            r.size,
            r.cache,
            r.loader,
            r.times.len(),
            r.load_median(),
            r.median(),
            r.gbps(),
            mn,
            mx,
            r.peak_rss,
            r.anon_delta,
            r.how,
            r.skipped.clone().unwrap_or_default()
        );
    }
    std::fs::write(args.out.join("load.csv"), csv)?;
    let json = report_json(&all, &checks, runs);
    std::fs::write(args.out.join("load.json"), serde_json::to_string_pretty(&json)?)?;
    // One SVG chart per table, beside the Markdown (the Benchmarks page, docs/src/benchmarks.md, shows them).
    for p in crate::bench::charts::write(&crate::bench::charts::tables(&json), &args.out)? {
        eprintln!("wrote {}", p.display());
    }
    eprintln!("wrote {}/load.{{md,csv,json}}", args.out.display());
    Ok(())
}
