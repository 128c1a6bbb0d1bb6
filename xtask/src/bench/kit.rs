//! What every bench section shares: the sample files, the in-process loaders and their
//! measurement, run orders, rows, ratios and checks, and the rendering of a table. The
//! sections (`bench` and its `*bench` siblings) import this module; it imports none of them.

use crate::bench::ceiling;
use anyhow::{Context, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;
use turboio::crypt::{Encryption, Keys};
use turboio::device::{ArenaPool, FileMapping};
use turboio::{Header, LoadMode, LoadOptions, SaveOptions};

/// The GPU section's auto row, the base its table's ratios are taken against.
pub const GPU_AUTO: &str = "turboio -> GPU, auto";

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

    pub(crate) const HOT: [Loader; 12] = [
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
    pub(crate) const COLD: [Loader; 8] = [
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
    pub(crate) fn median(&self) -> f64 {
        median_of(&self.times)
    }
    pub(crate) fn load_median(&self) -> f64 {
        median_of(&self.load_times)
    }
    pub(crate) fn gbps(&self) -> f64 {
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

/// Takes the file's pages out of the page cache (after syncing them), so that the next read
/// brings them back as read-ahead does, in large folios: a file whose cached pages came from
/// its writes sits in small ones, and maps several times slower than one read back (see
/// MACHINE.md), which would make two copies of the same bytes load at different speeds.
pub fn evict(path: &Path) -> Result<()> {
    use nix::fcntl::{posix_fadvise, PosixFadviseAdvice};
    let f = std::fs::File::open(path)?;
    f.sync_data()?;
    posix_fadvise(&f, 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED)
        .with_context(|| format!("evicting {} from the page cache", path.display()))?;
    Ok(())
}

pub fn drop_caches() -> std::result::Result<(), String> {
    nix::unistd::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .map_err(|e| format!("cannot drop caches ({e}); run as root for cold rows"))
}

pub(crate) fn parse_size(s: &str) -> Result<u64> {
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

/// A sharded model directory of about `size` bytes in 9 shards (`turboio gen --shards 9`),
/// generated once under `dir` (a directory generated before `gen` wrote exactly N shards has
/// the 9 that `--shards 8` wrote then).
pub(crate) fn sharded_model(dir: &Path, size: u64) -> Result<PathBuf> {
    let out = dir.join(format!("model-{}", size >> 20));
    if out.join("model.safetensors.index.json").exists() {
        return Ok(out);
    }
    eprintln!("generating {} (9 shards) ...", out.display());
    let status = std::process::Command::new(cli()?)
        .args(["gen", "--shards", "9", "--size"])
        .arg(size.to_string())
        .arg(&out)
        .status()?;
    anyhow::ensure!(status.success(), "turboio gen --shards failed");
    Ok(out)
}

/// What names the `turboio` command the CLI rows run instead of building
/// `target/release/turboio` (`cargo xtask test`'s smoke run gives the wheel's console script,
/// the same code, so that it does not compile the CLI once more).
pub const CLI_VAR: &str = "TURBOIO_BENCH_CLI";

/// The `turboio` binary next to this one: `$TURBOIO_BENCH_CLI` if set, else built once per bench
/// process (a later edit of the sources never lands in the middle of a run; on a machine without
/// cargo, such as a GPU machine running `.ci/gpu` from its bundle, the one already there).
pub(crate) fn cli() -> Result<PathBuf> {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    if let Some(bin) = BUILT.get() {
        return Ok(bin.clone());
    }
    if let Some(given) = std::env::var_os(CLI_VAR) {
        let bin = PathBuf::from(given);
        anyhow::ensure!(bin.is_file(), "{CLI_VAR}={}: no such file", bin.display());
        return Ok(BUILT.get_or_init(|| bin).clone());
    }
    let bin = crate::test::root().join("target/release/turboio");
    let built = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "--quiet", "-p", "turboio-cli", "--bin", "turboio"])
        .current_dir(crate::test::root())
        .status();
    match built {
        Ok(status) => anyhow::ensure!(status.success(), "could not build the turboio binary"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && bin.exists() => {}
        Err(e) => return Err(e.into()),
    }
    Ok(BUILT.get_or_init(|| bin).clone())
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
pub(crate) fn ratio_in(rows: &[Row], size: u64, cache: &str, group: &str, a: &str, b: &str) -> Option<f64> {
    let find = |name: &str| {
        rows.iter()
            .find(|r| r.size == size && r.cache == cache && r.group == group && r.loader == name && r.skipped.is_none())
    };
    Some(find(b)?.median() / find(a)?.median())
}

pub(crate) fn date() -> String {
    std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

pub(crate) fn machine() -> String {
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
            "gpu" => GPU_AUTO,
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
