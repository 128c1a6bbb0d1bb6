//! Project tasks.
//!
//! - `cargo xtask bench [--quick] [--device cuda:N] [--model]`: load benchmarks against baselines and
//!   ceilings, hot and cold, written to `target/bench/`; with `--device`, GPU rows too; with
//!   `--model`, only the whole-model rows (sharded directories, 2-rank gloo); with `--pt`, only
//!   the `.pt` rows (loads, converting loads, conversions); with `--object`, only the
//!   object-storage rows (S3 on a local s3s-fs, against Run:ai Model Streamer and boto3); with
//!   `--gpu-model`, staged loads through the performance model of a GPU against the ceilings.
//! - `cargo xtask bindgen [--check]`: io-gds's cuFile declarations generated from cufile.h
//!   (`--check`: fail if the committed file differs from a fresh generation).
//! - `cargo xtask test`: everything CI runs (fmt, clippy, tests in every feature set, docs,
//!   Python interop in a venv it creates, a bench smoke run).

mod bench;
mod bindgen;
mod docblocks;
mod docs;
mod test;

use clap::{Parser, Subcommand};

/// The workspace's root directory.
pub fn root() -> std::path::PathBuf {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(std::path::Path::to_path_buf).unwrap_or_default()
}

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Benchmark loads: turboio's modes against std::fs::read, mmap+copy and the machine's ceilings.
    Bench(bench::Args),
    /// Run every check CI runs.
    Test(test::Args),
    /// Run the README's and the book's sh and python blocks (with the test venv's Python and
    /// the wheel's `turboio`), as `cargo xtask test` does.
    DocBlocks,
    /// Build the book (docs/, mdBook; installed into target/tools when missing) into
    /// target/book, after checking the links of the README and every page.
    Docs(docs::Args),
    /// Generate io-gds's cuFile declarations from cufile.h (`--check`: compare instead).
    Bindgen(bindgen::Args),
    /// Draw the SVG charts of a saved bench run (`load.json`), one per table, into a directory.
    Chart {
        /// The run's JSON (`target/bench/load.json`).
        #[arg(long, default_value = "target/bench/load.json")]
        from: std::path::PathBuf,
        /// Where the charts go.
        #[arg(long, default_value = "target/bench")]
        out: std::path::PathBuf,
    },
    /// One load of a model through a new model device, in this new process (`bench
    /// --gpu-model`'s first-load rows).
    #[command(hide = true)]
    GpuModelChild(bench::gpu_model::ChildArgs),
}

fn chart(from: &std::path::Path, out: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context;
    let text = std::fs::read_to_string(from).with_context(|| format!("reading {}", from.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", from.display()))?;
    for p in bench::charts::write(&bench::charts::tables(&json), out)? {
        println!("wrote {}", p.display());
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let result = match Cli::parse().command {
        Command::Bench(a) => bench::run(a),
        Command::Test(a) => test::run(a),
        Command::Docs(a) => docs::run(a),
        Command::DocBlocks => docblocks::run(&root().join(".venv/bin/python")),
        Command::Bindgen(a) => bindgen::run(a),
        Command::Chart { from, out } => chart(&from, &out),
        Command::GpuModelChild(a) => bench::gpu_model::child(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
