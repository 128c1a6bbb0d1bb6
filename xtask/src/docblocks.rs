//! The README's and the book's code blocks, run (`cargo xtask test` calls [`run`]), so that the
//! examples cannot rot.
//!
//! Every fenced `sh` and `python` block runs, in a scratch directory holding the files the
//! examples name (`model.safetensors`, `a.safetensors`, `b.safetensors`, a sharded model at
//! `path/to/model` and `model/`), with the test venv first on the `PATH` (its `python`, and the
//! wheel's `turboio` console script: the CLI). A block that cannot run here says why in an HTML
//! comment on the line before its fence, `<!-- not run: REASON -->`; one marked
//! `<!-- run on the model of a GPU -->` runs with `TURBOIO_GPU_MODEL` set (the `cuda:N` it
//! names is the performance model of a GPU: the GPU paths run on a machine without one). Rust
//! blocks are the `turboio` crate's doc-tests (`#[doc = include_str!(...)]`), not run here.

use crate::root;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// How a block is treated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mark {
    Run,
    /// Run with `TURBOIO_GPU_MODEL` set.
    GpuModel,
    NotRun(String),
}

/// One fenced block.
#[derive(Debug, Clone)]
pub struct Block {
    pub file: PathBuf,
    pub line: usize,
    pub lang: String,
    pub code: String,
    pub mark: Mark,
}

/// The `sh` and `python` blocks of `text` (a Markdown file), with their marks.
pub fn blocks(file: &Path, text: &str) -> Vec<Block> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(lang) = lines[i].trim_start().strip_prefix("```") else {
            i += 1;
            continue;
        };
        let lang = lang.trim().to_owned();
        let start = i;
        let mut code = String::new();
        i += 1;
        while i < lines.len() && !lines[i].trim_start().starts_with("```") {
            code.push_str(lines[i]);
            code.push('\n');
            i += 1;
        }
        i += 1;
        if lang != "sh" && lang != "python" {
            continue;
        }
        let before = if start > 0 { lines[start - 1].trim() } else { "" };
        let mark = if let Some(reason) =
            before.strip_prefix("<!-- not run:").and_then(|r| r.strip_suffix("-->")).map(str::trim)
        {
            Mark::NotRun(reason.to_owned())
        } else if before == "<!-- run on the model of a GPU -->" {
            Mark::GpuModel
        } else {
            Mark::Run
        };
        out.push(Block { file: file.to_owned(), line: start + 1, lang, code, mark });
    }
    out
}

/// Every block of the README and the book.
pub fn all_blocks() -> Result<Vec<Block>> {
    let root = root();
    let mut out = Vec::new();
    for f in crate::docs::pages()? {
        let text = std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?;
        out.extend(blocks(f.strip_prefix(&root).unwrap_or(&f), &text));
    }
    Ok(out)
}

/// The files the examples name, made in `dir` with the CLI and the venv's Python.
fn fixtures(dir: &Path, python: &Path, turboio: &Path) -> Result<()> {
    let run = |cmd: &mut Command, what: &str| -> Result<()> {
        let out = cmd.current_dir(dir).output().with_context(|| format!("{what}: cannot start"))?;
        if !out.status.success() {
            bail!("{what}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    };
    run(Command::new(turboio).args(["gen", "model.safetensors", "--size", "16MiB"]), "gen model.safetensors")?;
    std::fs::create_dir_all(dir.join("path/to"))?;
    run(Command::new(turboio).args(["gen", "path/to/model", "--size", "24MiB", "--shards", "3"]), "gen path/to/model")?;
    run(Command::new(turboio).args(["gen", "model", "--size", "24MiB", "--shards", "3"]), "gen model")?;
    let small = "import torch, safetensors.torch as st\n\
                 st.save_file({'w': torch.arange(12, dtype=torch.float32).reshape(3, 4)}, 'a.safetensors')\n\
                 st.save_file({'b': torch.ones(4, dtype=torch.bfloat16)}, 'b.safetensors')\n";
    run(Command::new(python).args(["-c", small]), "a.safetensors, b.safetensors")?;
    Ok(())
}

/// Runs every block that is not marked; prints what ran and what did not, and why.
pub fn run(python: &Path) -> Result<()> {
    let blocks = all_blocks()?;
    let bin = python.parent().context("the venv's bin directory")?.to_owned();
    let turboio = bin.join("turboio");
    if !turboio.exists() {
        bail!("{} is missing: install the wheel first", turboio.display());
    }
    let scratch = root().join("target/docblocks");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)?;
    fixtures(&scratch, python, &turboio)?;
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let (mut ran, mut skipped, mut failed) = (0, Vec::new(), Vec::new());
    for (n, b) in blocks.iter().enumerate() {
        let at = format!("{}:{} ({})", b.file.display(), b.line, b.lang);
        if let Mark::NotRun(reason) = &b.mark {
            skipped.push(format!("{at}: {reason}"));
            continue;
        }
        // Each block in a directory of its own, holding the fixtures (hard links: no copy).
        let dir = scratch.join(format!("block-{n:02}"));
        copy_tree(&scratch, &dir)?;
        // Five minutes at most a block (`timeout`: a hung example fails instead of hanging CI).
        let mut cmd = Command::new("timeout");
        cmd.args(["-k", "5", "300"]);
        match b.lang.as_str() {
            "sh" => cmd.args(["bash", "-euo", "pipefail", "-c", &b.code]),
            _ => cmd.arg(python).args(["-c", &b.code]),
        };
        cmd.current_dir(&dir).env("PATH", &path).env_remove("TURBOIO_GPU_MODEL");
        if b.mark == Mark::GpuModel {
            cmd.env("TURBOIO_GPU_MODEL", "");
        }
        let started = std::time::Instant::now();
        // Its own process group: whatever the block leaves running (a server started with `&`)
        // is killed with it.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .with_context(|| format!("{at}: cannot run"))?;
        let pgid = child.id();
        let out = child.wait_with_output().with_context(|| format!("{at}: cannot run"))?;
        // killpg(2) itself: procps-ng 4.0.2's `kill -KILL -PGID` signals process group 2 instead
        // (it misreads a negative PID), which killed whatever ran there.
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid as i32), nix::sys::signal::Signal::SIGKILL);
        if out.status.success() {
            ran += 1;
            eprintln!("ran {at} in {:.1} s", started.elapsed().as_secs_f64());
        } else {
            let tail: String =
                String::from_utf8_lossy(&out.stderr).lines().rev().take(12).collect::<Vec<_>>().join("\n");
            failed.push(format!("{at}: {}\n{tail}", out.status));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    eprintln!("\ndoc blocks: {ran} run, {} not run:", skipped.len());
    for s in &skipped {
        eprintln!("  {s}");
    }
    if !failed.is_empty() {
        bail!("{} doc block(s) failed:\n{}", failed.len(), failed.join("\n\n"));
    }
    Ok(())
}

/// `from`'s files (not its `block-*` directories) hard-linked into `to`, directories made.
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let name = e.file_name();
        if name.to_string_lossy().starts_with("block-") {
            continue;
        }
        let (src, dst) = (e.path(), to.join(&name));
        if e.file_type()?.is_dir() {
            copy_tree(&src, &dst)?;
        } else {
            std::fs::hard_link(&src, &dst).or_else(|_| std::fs::copy(&src, &dst).map(|_| ()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_and_their_marks_are_read() {
        let text = "intro\n```sh\necho hi\n```\n<!-- not run: needs a GPU -->\n```python\nimport x\n```\n\
                    <!-- run on the model of a GPU -->\n```python\ny = 1\n```\n```rust\nfn f() {}\n```\n```\nplain\n```\n";
        let b = blocks(Path::new("p.md"), text);
        assert_eq!(b.len(), 3);
        assert_eq!((b[0].line, b[0].lang.as_str(), b[0].code.as_str(), &b[0].mark), (2, "sh", "echo hi\n", &Mark::Run));
        assert_eq!(b[1].mark, Mark::NotRun("needs a GPU".into()));
        assert_eq!(b[2].mark, Mark::GpuModel);
    }

    #[test]
    fn every_block_that_is_not_run_says_why() {
        let all = all_blocks().unwrap();
        assert!(all.len() >= 20, "{} blocks", all.len());
        for b in &all {
            if let Mark::NotRun(reason) = &b.mark {
                assert!(reason.len() > 10, "{}:{}: a reason, not {reason:?}", b.file.display(), b.line);
            }
        }
    }
}
