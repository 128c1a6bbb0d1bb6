//! `cargo xtask bench`: turboio's loads against baselines and ceilings, hot and cold, in one
//! run with the loaders in a different shuffled order each run (the machines are noisy; only
//! same-run ratios mean anything).

use crate::ceiling;
use anyhow::{Context, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;
use turboio::crypt::{Encryption, Keys};
use turboio::device::{ArenaPool, FileMapping};
use turboio::{Header, LoadMode, LoadOptions, SaveOptions};

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
    /// Only the whole-model rows: a model directory of 8 shards (the first size, default
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
    /// by turboio against Run:ai Model Streamer and boto3 + safetensors, and the server's
    /// ranged-GET ceiling, with no added latency and with 20 ms per request (default 3 runs);
    /// written to `object.md` in `--out`. (The full bench runs these rows too.)
    #[arg(long)]
    pub object: bool,
    /// Only the training-checkpoint rows: one tensor of the first size (default 1GiB) saved to a
    /// new file and over an existing one, by turboio and by DeepSpeed's DeepNVMe (built on first
    /// use: Debian's libaio-dev as root, deepspeed into `target/bench-tools`), and read cold into
    /// reused memory, with the disk's O_DIRECT ceilings; written to `training.md` in `--out`.
    /// (The full bench runs these rows too, not its --quick smoke run.)
    #[arg(long)]
    pub training: bool,
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Loader {
    TurboAuto,
    TurboMapped,
    TurboCopied,
    TurboCopiedHuge,
    TurboCopiedReuse,
    TurboEncrypted,
    CliCopied,
    CliEncrypted,
    TurboConvert,
    FsRead,
    MmapCopy,
    PopulateCeiling,
    ODirectCeiling,
}

impl Loader {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Loader::TurboAuto => "turboio auto",
            Loader::TurboMapped => "turboio mapped",
            Loader::TurboCopied => "turboio copied",
            Loader::TurboCopiedHuge => "turboio copied, huge pages",
            Loader::TurboCopiedReuse => "turboio copied, arena reused",
            Loader::TurboEncrypted => "turboio, AES-128-CTR encrypted file",
            Loader::CliCopied => "CLI: turboio load --mode copied",
            Loader::CliEncrypted => "CLI: turboio load --key-env (encrypted)",
            Loader::TurboConvert => "turboio auto, converting to BF16",
            Loader::FsRead => "std::fs::read",
            Loader::MmapCopy => "mmap + copy each tensor",
            Loader::PopulateCeiling => "ceiling: mmap + MADV_POPULATE_READ",
            Loader::ODirectCeiling => "ceiling: O_DIRECT QD32 into reused buffer",
        }
    }

    const HOT: [Loader; 12] = [
        Loader::TurboAuto,
        Loader::TurboMapped,
        Loader::TurboCopied,
        Loader::TurboCopiedHuge,
        Loader::TurboCopiedReuse,
        Loader::TurboEncrypted,
        Loader::CliCopied,
        Loader::CliEncrypted,
        Loader::TurboConvert,
        Loader::FsRead,
        Loader::MmapCopy,
        Loader::PopulateCeiling,
    ];
    const COLD: [Loader; 8] = [
        Loader::TurboAuto,
        Loader::TurboMapped,
        Loader::TurboCopied,
        Loader::TurboCopiedHuge,
        Loader::TurboConvert,
        Loader::FsRead,
        Loader::MmapCopy,
        Loader::ODirectCeiling,
    ];
}

pub(crate) fn median_of(v: &[f64]) -> f64 {
    let mut t = v.to_vec();
    t.sort_by(f64::total_cmp);
    t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
}

#[derive(Debug, Default, Clone)]
pub struct Row {
    pub size: u64,
    pub cache: &'static str,
    pub loader: &'static str,
    /// "python" for the rows measured in Python processes; "" for in-process Rust rows.
    pub group: &'static str,
    /// Load plus first touch of every page.
    pub times: Vec<f64>,
    /// Load alone.
    pub load_times: Vec<f64>,
    pub peak_rss: u64,
    pub anon_delta: i64,
    pub how: String,
    pub skipped: Option<String>,
}

impl Row {
    fn median(&self) -> f64 {
        median_of(&self.times)
    }
    fn load_median(&self) -> f64 {
        median_of(&self.load_times)
    }
    fn gbps(&self) -> f64 {
        self.size as f64 / self.median() / 1e9
    }
}

fn status_kb(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Reads the file through the page cache into a small reused buffer, so that every page is cached.
pub fn warm(path: &Path) -> Result<()> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 8 << 20];
    while f.read(&mut buf)? > 0 {}
    Ok(())
}

pub fn drop_caches() -> std::result::Result<(), String> {
    // SAFETY: sync() has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .map_err(|e| format!("cannot drop caches ({e}); run as root for cold rows"))
}

fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, u) = t.split_at(split);
    let n: u64 = n.parse().with_context(|| format!("bad size {s}"))?;
    let m = match u.to_ascii_lowercase().as_str() {
        "" => 1,
        "kib" | "k" => 1 << 10,
        "mib" | "m" => 1 << 20,
        "gib" | "g" => 1 << 30,
        other => anyhow::bail!("bad size unit {other} in {s}"),
    };
    Ok(n * m)
}

pub(crate) fn size_name(n: u64) -> String {
    if n.is_multiple_of(1 << 30) {
        format!("{}GiB", n >> 30)
    } else {
        format!("{}MiB", n >> 20)
    }
}

/// Generates (or reuses) the sample for `size`.
pub(crate) fn sample(dir: &Path, size: u64) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("bench-{}.safetensors", size_name(size)));
    let ok = turboio::read_header_of(&path, &LoadOptions::default())
        .map(|h: Header| h.file_len() >= size && h.data_len() + 8 >= size && h.len() > 1)
        .unwrap_or(false);
    if !ok {
        eprintln!("generating {} ...", path.display());
        let t = Instant::now();
        turboio::sample::write_sample(&path, size, 1, &SaveOptions::default())?;
        eprintln!("  {:.1} s", t.elapsed().as_secs_f64());
    }
    Ok(path)
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

/// The bench's key for encrypted rows (veTurboIO's test vectors), also handed to the CLI.
pub const KEY_B64: &str = "YWJjZGVmZ2gxMjM0NTY3OA==";
pub const IV_B64: &str = "MTIzNDU2Nzg4NzY1NDMyMQ==";

pub fn bench_encryption() -> Result<Encryption> {
    let key = turboio::crypt::Key::from_base64(KEY_B64)?;
    let iv = turboio::crypt::Iv::from_base64(IV_B64)?;
    Ok(Encryption::new(Keys::Fixed { key, iv }))
}

/// The encrypted twin of a sample (same tensors), made once.
pub fn encrypted_twin(plain: &Path) -> Result<PathBuf> {
    let path = plain.with_extension("enc.safetensors");
    let fresh = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if !(path.exists() && fresh(&path) >= fresh(plain)) {
        eprintln!("encrypting {} ...", path.display());
        turboio::crypt::encrypt_file(plain, &path, &bench_encryption()?, &SaveOptions::default())?;
    }
    Ok(path)
}

/// The `turboio` binary next to this one (built if needed).
pub(crate) fn cli() -> Result<PathBuf> {
    let status = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "--quiet", "-p", "turboio", "--bin", "turboio"])
        .current_dir(crate::test::root())
        .status()?;
    anyhow::ensure!(status.success(), "could not build the turboio binary");
    Ok(crate::test::root().join("target/release/turboio"))
}

/// Runs `turboio load` and returns the load time it reports.
fn run_cli(args: &[&str], file: &Path) -> Result<(f64, String)> {
    let out = std::process::Command::new(cli()?)
        .arg("load")
        .arg(file)
        .args(args)
        .env("VETURBOIO_KEY", KEY_B64)
        .env("VETURBOIO_IV", IV_B64)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    anyhow::ensure!(out.status.success(), "turboio load failed: {}", String::from_utf8_lossy(&out.stderr));
    // "run 1: N tensors, X GB in S s = G GB/s (how)"
    let secs = text
        .split(" in ")
        .nth(1)
        .and_then(|r| r.split(" s").next())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .with_context(|| format!("unexpected output: {text}"))?;
    let how = text.split('(').nth(1).and_then(|r| r.split(')').next()).unwrap_or("").to_string();
    Ok((secs, format!("own process, time it reports: {how}")))
}

/// What a loader produced, kept alive while memory is measured and its pages are touched.
enum Output {
    Loaded(Box<turboio::LoadedFile>),
    Bytes(Vec<u8>),
    Copies(Vec<Vec<u8>>),
    Mapping(FileMapping),
    Nothing,
}

fn touch_pages(bytes: &[u8], sum: &mut u64) {
    for i in (0..bytes.len()).step_by(4096) {
        *sum = sum.wrapping_add(u64::from(std::hint::black_box(bytes[i])));
    }
}

impl Output {
    /// Reads one byte of every 4 KiB page of the data, as a user's first pass over the tensors
    /// would: lazily mapped pages are read now, and first touches of fresh memory are paid.
    fn touch(&self) -> u64 {
        let mut sum = 0u64;
        match self {
            Output::Loaded(f) => f.tensors().filter_map(|t| t.bytes()).for_each(|b| touch_pages(b, &mut sum)),
            Output::Bytes(v) => touch_pages(v, &mut sum),
            Output::Copies(v) => v.iter().for_each(|b| touch_pages(b, &mut sum)),
            Output::Mapping(m) => touch_pages(m.as_slice(), &mut sum),
            Output::Nothing => {}
        }
        sum
    }
}

/// Runs one loader once; returns (seconds, what it did, its output).
fn run_one(loader: Loader, path: &Path, pool: &ArenaPool) -> Result<(f64, String, Output)> {
    let turbo =
        |mode: LoadMode, arenas: Option<ArenaPool>, huge_pages: Option<bool>| -> Result<(f64, String, Output)> {
            let t = Instant::now();
            let f = turboio::load(path, &LoadOptions { mode, arenas, huge_pages, ..Default::default() })?;
            let secs = t.elapsed().as_secs_f64();
            let r = f.report();
            let how = format!(
                "{} via {}{}{}",
                r.held,
                r.read.method,
                if r.read.direct { " O_DIRECT" } else { "" },
                if r.arena_reused { ", reused" } else { "" }
            );
            Ok((secs, how, Output::Loaded(Box::new(f))))
        };
    match loader {
        Loader::TurboAuto => turbo(LoadMode::Auto, None, None),
        Loader::TurboMapped => turbo(LoadMode::Mapped, None, None),
        Loader::TurboCopied => turbo(LoadMode::Copied, None, None),
        Loader::TurboCopiedHuge => turbo(LoadMode::Copied, None, Some(true)),
        Loader::TurboCopiedReuse => turbo(LoadMode::Copied, Some(pool.clone()), None),
        Loader::TurboEncrypted => {
            let enc = encrypted_twin(path)?;
            let t = Instant::now();
            let f = turboio::load(&enc, &LoadOptions { encryption: Some(bench_encryption()?), ..Default::default() })?;
            let secs = t.elapsed().as_secs_f64();
            let how = format!("{} via {}, decrypted by the readers", f.report().held, f.report().read.method);
            Ok((secs, how, Output::Loaded(Box::new(f))))
        }
        Loader::TurboConvert => {
            let t = Instant::now();
            let opts = LoadOptions { dtype: Some(turboio::Dtype::BF16), ..Default::default() };
            let f = turboio::load(path, &opts)?;
            let secs = t.elapsed().as_secs_f64();
            let r = f.report();
            let how = format!("{} tensors converted, {} via {}", r.converted, r.held, r.read.method);
            Ok((secs, how, Output::Loaded(Box::new(f))))
        }
        Loader::CliCopied => {
            let (secs, how) = run_cli(&["--mode", "copied"], path)?;
            Ok((secs, how, Output::Nothing))
        }
        Loader::CliEncrypted => {
            let (secs, how) = run_cli(&["--key-env"], &encrypted_twin(path)?)?;
            Ok((secs, how, Output::Nothing))
        }
        Loader::FsRead => {
            let t = Instant::now();
            let v = std::fs::read(path)?;
            Ok((t.elapsed().as_secs_f64(), "read into a new Vec".into(), Output::Bytes(v)))
        }
        Loader::MmapCopy => {
            let t = Instant::now();
            let file = std::fs::File::open(path)?;
            let len = file.metadata()?.len() as usize;
            let m = FileMapping::new(&file, len)?;
            let h = Header::from_file_bytes(m.as_slice())?;
            let start = h.data_start() as usize;
            let copies: Vec<Vec<u8>> = h
                .tensors()
                .iter()
                .map(|t| m.as_slice()[start + t.data_offsets.0..start + t.data_offsets.1].to_vec())
                .collect();
            Ok((t.elapsed().as_secs_f64(), format!("{} tensor copies", copies.len()), Output::Copies(copies)))
        }
        Loader::PopulateCeiling => {
            let t = Instant::now();
            let m = ceiling::map_populate(path)?;
            Ok((t.elapsed().as_secs_f64(), format!("{} bytes, 1 thread", m.len()), Output::Mapping(m)))
        }
        Loader::ODirectCeiling => {
            let t = Instant::now();
            let n = ceiling::odirect_sequential(path, 32, 1 << 20)?;
            Ok((t.elapsed().as_secs_f64(), format!("{n} bytes, io_uring, 1 MiB blocks"), Output::Nothing))
        }
    }
}

/// The order of the loaders in run `r`: a fixed pseudo-random permutation per run, so that no
/// loader always runs right after the same one. (On these VMs a load that follows one which
/// freed gigabytes gets memory the host has not reclaimed yet and runs much faster; a plain
/// rotation would hand that advantage to the same loader every run.)
pub fn run_order(n: usize, r: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut state = 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(r as u64 + 1);
    for k in (1..n).rev() {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        order.swap(k, (z % (k as u64 + 1)) as usize);
    }
    order
}

pub(crate) fn measure(
    rows: &mut [Row],
    loaders: &[Loader],
    path: &Path,
    runs: usize,
    cold: bool,
    pool: &ArenaPool,
) -> Result<()> {
    for r in 0..runs {
        for i in run_order(loaders.len(), r) {
            if rows[i].skipped.is_some() {
                continue;
            }
            if cold {
                if let Err(why) = drop_caches() {
                    for row in rows.iter_mut() {
                        row.skipped = Some(why.clone());
                    }
                    return Ok(());
                }
            } else {
                // Hot means the whole file is in the page cache when the run starts (the
                // machines reclaim idle page cache in the background, so check every time).
                match loaders[i] {
                    Loader::TurboEncrypted | Loader::CliEncrypted => warm(&encrypted_twin(path)?)?,
                    _ => warm(path)?,
                }
                if loaders[i] == Loader::TurboCopiedReuse && pool.free_arenas() == 0 {
                    // Give the reuse row its warm arena first (not timed).
                    drop(run_one(loaders[i], path, pool)?);
                }
            }
            let anon_before = status_kb("RssAnon:") as i64 * 1024;
            let rss_before = status_kb("VmRSS:") * 1024;
            reset_peak_rss();
            let (secs, how, output) = run_one(loaders[i], path, pool)?;
            let t = Instant::now();
            std::hint::black_box(output.touch());
            let touch = t.elapsed().as_secs_f64();
            let peak = (status_kb("VmHWM:") * 1024).saturating_sub(rss_before);
            let anon = status_kb("RssAnon:") as i64 * 1024 - anon_before;
            drop(output);
            let row = &mut rows[i];
            row.times.push(secs + touch);
            row.load_times.push(secs);
            row.peak_rss = row.peak_rss.max(peak);
            row.anon_delta = row.anon_delta.max(anon);
            row.how = how;
        }
    }
    Ok(())
}

pub(crate) struct Check {
    pub(crate) what: String,
    pub(crate) ratio: f64,
    pub(crate) need: f64,
}

pub(crate) fn ratio(rows: &[Row], size: u64, cache: &str, a: &str, b: &str) -> Option<f64> {
    let find = |name: &str| {
        rows.iter().find(|r| r.size == size && r.cache == cache && r.loader == name && r.skipped.is_none())
    };
    Some(find(b)?.median() / find(a)?.median())
}

/// [`ratio`] within one group of rows (loader names repeat across groups).
fn ratio_in(rows: &[Row], size: u64, cache: &str, group: &str, a: &str, b: &str) -> Option<f64> {
    let find = |name: &str| {
        rows.iter()
            .find(|r| r.size == size && r.cache == cache && r.group == group && r.loader == name && r.skipped.is_none())
    };
    Some(find(b)?.median() / find(a)?.median())
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
        let python = crate::pybench::setup()?;
        let report = crate::modelbench::run(&python, &args.dir, size, runs, args.no_cold)?;
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("model.md"), &report)?;
        println!("{report}\nwrote {}", args.out.join("model.md").display());
        return Ok(());
    }
    if args.object {
        let size = if args.sizes.is_empty() && !args.quick { 4 << 30 } else { sizes[0] };
        let runs = args.runs.unwrap_or(if args.quick { 2 } else { 3 }).max(1);
        let python = if args.no_python { None } else { Some(crate::pybench::setup()?) };
        let report = crate::objectbench::run(python.as_deref(), &args.dir, size, runs, args.quick)?;
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("object.md"), &report)?;
        println!("{report}\nwrote {}", args.out.join("object.md").display());
        return Ok(());
    }
    if args.training {
        let size = if args.sizes.is_empty() && !args.quick { 1 << 30 } else { sizes[0] };
        let python = if args.no_python { None } else { Some(crate::pybench::setup()?) };
        let report = crate::trainbench::run(python.as_deref(), &args.dir, size, runs)?;
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("training.md"), &report)?;
        println!("{report}\nwrote {}", args.out.join("training.md").display());
        return Ok(());
    }
    // The sections that start many Python processes (each imports torch) run once in a smoke run.
    let process_runs = if args.quick { 1 } else { runs };
    if args.pt {
        let size = if args.sizes.is_empty() && !args.quick { 4 << 30 } else { sizes[0] };
        let python = crate::pybench::setup()?;
        let report = crate::ptbench::run(&python, &args.dir, size, runs, process_runs, args.no_cold, !args.quick)?;
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("pt.md"), &report)?;
        println!("{report}\nwrote {}", args.out.join("pt.md").display());
        return Ok(());
    }
    let pool = ArenaPool::with_huge_pages(1, false);
    let python = if args.no_python { None } else { Some(crate::pybench::setup()?) };
    let mut all: Vec<Row> = Vec::new();
    let mut cache_tables: Vec<(u64, Vec<crate::cachebench::CacheRow>)> = Vec::new();
    let mut save_tables: Vec<(u64, Vec<crate::savebench::SaveRow>)> = Vec::new();
    let mut pt_sections: Vec<String> = Vec::new();
    for &size in &sizes {
        let path = sample(&args.dir, size)?;
        let len = std::fs::metadata(&path)?.len();
        if let Some(py) = &python {
            let pt = crate::pybench::pt_copy(py, &path)?;
            eprintln!("{}: python, hot, {runs} runs ...", size_name(size));
            all.extend(crate::pybench::measure(py, &path, &pt, len, runs, false)?);
            if !args.no_cold {
                eprintln!("{}: python, cold, {runs} runs ...", size_name(size));
                all.extend(crate::pybench::measure(py, &path, &pt, len, runs, true)?);
            }
            eprintln!("{}: .pt rows ...", size_name(size));
            pt_sections.push(crate::ptbench::run(py, &args.dir, size, runs, process_runs, args.no_cold, !args.quick)?);
            if args.clean {
                std::fs::remove_file(&pt)?;
            }
            if !args.no_cold {
                eprintln!("{}: page cache across processes, {process_runs} runs ...", size_name(size));
                let enc = encrypted_twin(&path)?;
                let rows = crate::cachebench::measure(py, &path, &enc, process_runs)?;
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
            save_tables.push((len, crate::savebench::measure(python.as_deref(), &path, process_runs)?));
        }
        all.extend(sfcs_rows(args.sfcs_path.as_deref(), size, runs)?);
        if let Some(device) = &args.device {
            let enc = encrypted_twin(&path)?;
            eprintln!("{}: GPU ({device}), hot, {runs} runs ...", size_name(size));
            all.extend(crate::gpubench::measure(device, &path, &enc, len, runs, false)?);
            if !args.no_cold {
                eprintln!("{}: GPU ({device}), cold, {runs} runs ...", size_name(size));
                all.extend(crate::gpubench::measure(device, &path, &enc, len, runs, true)?);
            }
            if let Some(py) = &python {
                let pt = crate::pybench::pt_copy(py, &path)?;
                let caches: &[bool] = if args.no_cold { &[false] } else { &[false, true] };
                for &cold in caches {
                    let mut rows = crate::pybench::measure_on(
                        py,
                        &path,
                        &pt,
                        len,
                        runs,
                        cold,
                        device,
                        &crate::pybench::GPU_LOADERS,
                        "python, gpu",
                    )?;
                    if crate::gpubench::open(device).is_err() {
                        for r in &mut rows {
                            r.skipped = Some(format!("{device} cannot be opened here"));
                        }
                    }
                    all.extend(rows);
                }
            }
        }
        if args.clean {
            std::fs::remove_file(&path)?;
        }
    }

    // The object-storage rows, for the first size (skipped with the reason when the server
    // cannot be installed or started). Not in the smoke run: it builds s3s-fs and installs
    // Run:ai (minutes on a fresh machine); `cargo xtask bench --object --quick` is its smoke run.
    let object_section = if args.quick {
        "## Object storage\n\nNot in the --quick smoke run (it builds s3s-fs and installs Run:ai Model Streamer): \
         `cargo xtask bench --object --quick`.\n"
            .to_owned()
    } else {
        let object_runs = args.runs.unwrap_or(3).max(1);
        eprintln!("{}: object storage, {object_runs} runs ...", size_name(sizes[0]));
        crate::objectbench::run(python.as_deref(), &args.dir, sizes[0], object_runs, false).unwrap_or_else(|e| {
            eprintln!("object rows skipped: {e:#}");
            format!("## Object storage\n\nSkipped: {e:#}.\n")
        })
    };
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("object.md"), &object_section)?;

    // The training-checkpoint rows against DeepNVMe, for the first size. Not in the smoke run:
    // DeepSpeed's op takes minutes to build on a fresh machine.
    let training_section = if args.quick {
        "## Training checkpoints\n\nNot in the --quick smoke run (it builds DeepSpeed's async_io op): \
         `cargo xtask bench --training --quick`.\n"
            .to_owned()
    } else {
        eprintln!("{}: training checkpoints, {runs} runs ...", size_name(sizes[0]));
        crate::trainbench::run(python.as_deref(), &args.dir, sizes[0], runs).unwrap_or_else(|e| {
            eprintln!("training rows skipped: {e:#}");
            format!("## Training checkpoints\n\nSkipped: {e:#}.\n")
        })
    };
    std::fs::write(args.out.join("training.md"), &training_section)?;

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
            use crate::gpubench::{AUTO, CEILING, ENCRYPTED, STAGED};
            add("GPU: turboio auto vs the pinned H2D ceiling", "hot", AUTO, CEILING, 0.7);
            add("GPU: encrypted vs staged plain", "hot", ENCRYPTED, STAGED, 0.8);
            let g = |l: &str| ratio_in(&all, len, "hot", "python, gpu", l, "safetensors.torch.load_file");
            if let Some(r) = g("turboio.load") {
                checks.push(Check {
                    what: format!(
                        "{} hot: GPU turboio.load vs safetensors.torch.load_file(device=cuda)",
                        size_name(size)
                    ),
                    ratio: r,
                    need: 2.0,
                });
            }
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
        let label = size_name(*len - *len % (64 << 20));
        for (what, ratio, need) in crate::savebench::checks(rows) {
            checks.push(Check { what: format!("{label} save: {what}"), ratio, need });
        }
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
        report.push_str(&crate::savebench::render(rows, *len, process_runs));
    }
    for (len, rows) in &cache_tables {
        report.push('\n');
        report.push_str(&crate::cachebench::render(rows, *len, process_runs));
    }
    for section in &pt_sections {
        report.push_str("\n## PyTorch `.pt` checkpoints and dtype conversion\n\n");
        report.push_str(section);
    }
    report.push('\n');
    report.push_str(&object_section);
    report.push('\n');
    report.push_str(&training_section);
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
    let json = serde_json::json!({
        "date": date(),
        "machine": machine(),
        "runs": runs,
        "rows": all.iter().map(|r| serde_json::json!({
            "size_bytes": r.size, "cache": r.cache, "loader": r.loader, "times_s": r.times, "load_times_s": r.load_times,
            "median_s": r.median(), "gb_per_s": r.gbps(), "peak_rss_bytes": r.peak_rss,
            "anon_delta_bytes": r.anon_delta, "how": r.how, "skipped": r.skipped,
        })).collect::<Vec<_>>(),
        "checks": checks.iter().map(|c| serde_json::json!({"what": c.what, "ratio": c.ratio, "need": c.need, "pass": c.ratio >= c.need})).collect::<Vec<_>>(),
    });
    std::fs::write(args.out.join("load.json"), serde_json::to_string_pretty(&json)?)?;
    eprintln!("wrote {}/load.{{md,csv,json}}", args.out.display());
    Ok(())
}

fn date() -> String {
    std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let mem = status_line("/proc/meminfo", "MemTotal:");
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cpus} vCPU {model}, {mem}, kernel {}", kernel.trim())
}

fn status_line(file: &str, key: &str) -> String {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| format!("{} GiB RAM", kb >> 20))
        .unwrap_or_default()
}

pub(crate) fn render(rows: &[Row], checks: &[Check], runs: usize) -> String {
    let mut s = String::new();
    let _ =
        writeln!(s, "turboio load benchmark, {} ({}), median of {runs} runs, loaders in a shuffled order each run. \"total\" is the load plus a first read of one byte of every 4 KiB page of the result (what lazily mapped or freshly faulted memory costs at first use); ratios use it.\n", date(), machine());
    let mut keys: Vec<(u64, &str, &str)> = rows.iter().map(|r| (r.size, r.group, r.cache)).collect();
    keys.dedup();
    for (size, kind, cache) in keys {
        let group: Vec<&Row> = rows.iter().filter(|r| r.size == size && r.cache == cache && r.group == kind).collect();
        let title = match kind {
            "python" => "Python loaders (tensors in torch), ",
            "gpu" => "Into the GPU, ",
            "python, gpu" => "Python loaders into the GPU (tensors in torch), ",
            _ => "",
        };
        let _ = writeln!(s, "### {title}{:.2} GB file, {cache} page cache\n", size as f64 / 1e9);
        let base = |name: &str| group.iter().find(|r| r.loader == name && r.skipped.is_none()).map(|r| r.median());
        let auto = base(match kind {
            "python" | "python, gpu" => "turboio.load",
            "gpu" => crate::gpubench::AUTO,
            _ => Loader::TurboAuto.name(),
        });
        let _ = writeln!(s, "| loader | load s | total s | GB/s (total) | turboio is | peak RSS | +anon RSS | how |");
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---|");
        for r in group {
            if let Some(why) = &r.skipped {
                let _ = writeln!(s, "| {} | skipped | | | | | | {why} |", r.loader);
                continue;
            }
            let vs = auto.map(|a| format!("{:.2}x", r.median() / a)).unwrap_or_default();
            let _ = writeln!(
                s,
                "| {} | {:.3} | {:.3} | {:.2} | {vs} | {:.2} GiB | {:.1} MiB | {} |",
                r.loader,
                r.load_median(),
                r.median(),
                r.gbps(),
                r.peak_rss as f64 / (1u64 << 30) as f64,
                r.anon_delta as f64 / (1u64 << 20) as f64,
                r.how
            );
        }
        let _ = writeln!(s);
    }
    if !checks.is_empty() {
        let _ = writeln!(s, "| check | ratio | needed | |");
        let _ = writeln!(s, "|---|---:|---:|---|");
        for c in checks {
            let _ = writeln!(
                s,
                "| {} | {:.2}x | {:.1}x | {} |",
                c.what,
                c.ratio,
                c.need,
                if c.ratio >= c.need { "ok" } else { "BELOW" }
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::run_order;

    #[test]
    fn run_orders_are_permutations_that_vary_the_predecessors() {
        let n = 11;
        let mut follows = std::collections::HashSet::new();
        for r in 0..5 {
            let order = run_order(n, r);
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "run {r}: {order:?}");
            // Which loader runs right before loader 5 (the encrypted row's slot).
            let at = order.iter().position(|&i| i == 5).unwrap();
            follows.insert(if at == 0 { None } else { Some(order[at - 1]) });
        }
        assert!(follows.len() >= 3, "loader 5 followed the same loaders every run: {follows:?}");
        assert_eq!(run_order(n, 3), run_order(n, 3), "orders are reproducible");
        assert_eq!(run_order(1, 0), vec![0]);
        assert!(run_order(0, 0).is_empty());
    }
}
