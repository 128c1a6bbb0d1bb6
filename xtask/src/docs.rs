//! `cargo xtask docs`: the book under `docs/` (mdBook) built into `target/book`, with mdBook
//! installed first where it is missing (`cargo install`, pinned, into `target/tools`: nothing
//! outside the checkout), and the links of the README and every page checked.
//!
//! The link check alone (`check_links`) runs in `cargo xtask test`, without mdBook: every page
//! `SUMMARY.md` names exists, and every relative link of the README and the book names a file
//! that exists and, with `#anchor`, a heading of that page.

use crate::root;
use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

/// The mdBook release the book is built with.
pub const MDBOOK: &str = "0.5.4";

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Only check the links (no mdBook needed).
    #[arg(long)]
    pub check: bool,
}

pub fn run(args: Args) -> Result<()> {
    check_links()?;
    println!("links: every page and anchor the README and the book link to exists");
    if args.check {
        return Ok(());
    }
    let mdbook = mdbook()?;
    crate::test::step("mdbook build docs", Command::new(&mdbook).args(["build", "docs"]))?;
    println!("the book is in {}", root().join("target/book/index.html").display());
    Ok(())
}

/// mdBook: on the PATH at the pinned version, else in `target/tools` (installed there once).
fn mdbook() -> Result<PathBuf> {
    let local = root().join("target/tools/bin/mdbook");
    for candidate in [local.clone(), PathBuf::from("mdbook")] {
        if let Ok(out) = Command::new(&candidate).arg("--version").output() {
            if out.status.success() && String::from_utf8_lossy(&out.stdout).contains(MDBOOK) {
                return Ok(candidate);
            }
        }
    }
    eprintln!("installing mdBook {MDBOOK} into target/tools (a few minutes, once) ...");
    crate::test::step(
        "cargo install mdbook",
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["install", "mdbook", "--locked", "--version", MDBOOK, "--root"])
            .arg(root().join("target/tools")),
    )?;
    Ok(local)
}

/// The README, then every page of the book (`docs/src/*.md`) in name order.
pub fn pages() -> Result<Vec<PathBuf>> {
    let mut book = Vec::new();
    for e in std::fs::read_dir(root().join("docs/src")).context("reading docs/src")? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "md") {
            book.push(p);
        }
    }
    book.sort();
    Ok([vec![root().join("README.md")], book].concat())
}

/// The README and every page of the book, checked (see the module docs).
pub fn check_links() -> Result<()> {
    let root = root();
    let src = root.join("docs/src");
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).context("reading docs/src/SUMMARY.md")?;
    let mut errors = Vec::new();
    for (target, _) in links(&summary) {
        if !target.is_empty() && !src.join(&target).is_file() {
            errors.push(format!("docs/src/SUMMARY.md names {target}, which does not exist"));
        }
    }
    for page in &pages()? {
        let text = std::fs::read_to_string(page)?;
        let shown = page.strip_prefix(&root).unwrap_or(page).display().to_string();
        for (target, anchor) in links(&text) {
            let file = if target.is_empty() { page.clone() } else { page.parent().unwrap_or(&root).join(&target) };
            if !file.exists() {
                errors.push(format!("{shown}: the link to {target} names nothing"));
                continue;
            }
            if let Some(anchor) = anchor {
                if file.extension().is_some_and(|x| x == "md") {
                    let headings = anchors(&std::fs::read_to_string(&file)?);
                    if !headings.contains(&anchor) {
                        errors.push(format!("{shown}: {target}#{anchor} is no heading of that page"));
                    }
                }
            }
        }
    }
    if !errors.is_empty() {
        bail!("{} broken link(s):\n  {}", errors.len(), errors.join("\n  "));
    }
    Ok(())
}

/// The lines of a Markdown text outside its fenced code blocks.
fn prose(text: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    text.lines().filter(move |line| {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            return false;
        }
        !fenced
    })
}

/// The relative links of a Markdown text (`[text](target#anchor)`), outside code blocks and
/// code spans: `(path, anchor)`; web links and mail addresses are left out.
fn links(text: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    for line in prose(text) {
        // Code spans hold no links.
        let mut plain = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                plain.push_str(part);
            }
        }
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = rest[..end].split_whitespace().next().unwrap_or("");
            rest = &rest[end..];
            if target.contains("://") || target.starts_with("mailto:") || target.is_empty() {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p.to_owned(), Some(a.to_owned())),
                None => (target.to_owned(), None),
            };
            out.push((path, anchor));
        }
    }
    out
}

/// The anchors mdBook gives a page's headings: lower case, spaces to `-`, only letters, digits,
/// `-` and `_` kept; a repeated heading gets `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for line in prose(text) {
        let Some(title) = line.strip_prefix('#') else { continue };
        let title = title.trim_start_matches('#').trim();
        let slug: String = title
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c.to_ascii_lowercase()),
                _ => None,
            })
            .collect();
        let mut unique = slug.clone();
        let mut n = 1;
        while seen.contains(&unique) {
            unique = format!("{slug}-{n}");
            n += 1;
        }
        seen.insert(unique);
    }
    seen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_and_anchors_are_read_as_mdbook_does() {
        let text = "See [a](loads.md#the-page-cache), [b](https://x.y/z.md), `[c](code.md)`,\n\
                    [d](#local) and [e](img/x.svg \"title\").\n```\n[f](fenced.md)\n```\n";
        assert_eq!(
            links(text),
            vec![
                ("loads.md".into(), Some("the-page-cache".into())),
                ("".into(), Some("local".into())),
                ("img/x.svg".into(), None)
            ]
        );
        let a = anchors(
            "# Loads and the page cache\n## `--cache` (the page cache)\n## Limits\n## Limits\n```\n# no\n```\n",
        );
        let want: BTreeSet<String> = ["loads-and-the-page-cache", "--cache-the-page-cache", "limits", "limits-1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(a, want);
    }

    #[test]
    fn the_readme_and_the_book_link_only_to_what_exists() {
        check_links().unwrap();
    }
}
