//! Loading some of a checkpoint's tensors ([`LoadOptions::tensors`](crate::LoadOptions::tensors)).
//!
//! A [`Selection`] is a list of names and glob patterns (`*`, `?`, `[...]`, as the `glob`
//! crate reads them; a pattern without those characters is a plain name), or a predicate. A
//! load with one reads only the selected tensors' bytes: their ranges, coalesced where the gap
//! between two is small ([`LOCAL_GAP`] for local files, [`REMOTE_GAP`] for others), are read
//! into one allocation laid out as they come
//! (or, for a mapped load, only their pages are populated). Every name and pattern must match
//! at least one tensor of the file (of the model, for [`load_model`](crate::load_model)):
//! one that matches nothing is an error that lists the closest names. An alias in
//! `__metadata__` selects its target.

use crate::{Error, Result};
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use turboio_format::Header;

/// Two selected byte ranges of a local file at most this far apart are read as one (the bytes
/// between are read and ignored). Measured by `cargo xtask bench --tensors` (256 kept 64 KiB
/// tensors, cold, 2026-11-27, this project's virtio disk): reading each range on its own took
/// 16-18 ms whatever the gap, reading through 16 KiB gaps the same 16 ms, through 64 KiB gaps
/// 30 ms and through 256 KiB gaps 72 ms; a disk with a deep queue serves a second request for
/// less than the bytes of a 64 KiB gap cost (128 KiB, the earlier value, was 1.8x slower than
/// separate reads at 64 KiB gaps).
pub const LOCAL_GAP: u64 = 16 << 10;

/// The same for a remote file (an object store): a request is a round trip of tens of
/// milliseconds, in which a stream delivers several MiB, so ranges up to 4 MiB apart are one
/// request.
pub const REMOTE_GAP: u64 = 4 << 20;

/// One name or pattern of a [`Selection`].
#[derive(Clone, Debug)]
enum Pattern {
    /// A plain name.
    Exact(String),
    /// A glob pattern (its text kept for messages).
    Glob(glob::Pattern, String),
}

impl Pattern {
    fn matches(&self, name: &str) -> bool {
        match self {
            Pattern::Exact(n) => n == name,
            Pattern::Glob(g, _) => g.matches(name),
        }
    }

    fn text(&self) -> &str {
        match self {
            Pattern::Exact(n) | Pattern::Glob(_, n) => n,
        }
    }
}

/// The predicate of a [`Selection`].
pub type Predicate = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// Which tensors a load keeps: names and glob patterns, or a predicate (see the [module
/// docs](self)).
#[derive(Clone)]
pub struct Selection {
    patterns: Vec<Pattern>,
    predicate: Option<Predicate>,
}

impl fmt::Debug for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Selection");
        d.field("patterns", &self.patterns.iter().map(Pattern::text).collect::<Vec<_>>());
        if self.predicate.is_some() {
            d.field("predicate", &"<fn>");
        }
        d.finish()
    }
}

impl Selection {
    /// These exact names (no pattern characters are interpreted).
    pub fn names<I: IntoIterator<Item = S>, S: Into<String>>(names: I) -> Selection {
        Selection { patterns: names.into_iter().map(|n| Pattern::Exact(n.into())).collect(), predicate: None }
    }

    /// Names and glob patterns: `*` (any run of characters, dots and slashes included), `?`
    /// (one character), `[abc]` / `[a-z]` / `[!abc]` (a character class). A pattern without
    /// any of `*?[` is a plain name. A malformed pattern is an error naming it.
    pub fn patterns<I: IntoIterator<Item = S>, S: Into<String>>(patterns: I) -> std::result::Result<Selection, String> {
        let mut out = Vec::new();
        for p in patterns {
            let p: String = p.into();
            if p.contains(['*', '?', '[']) {
                let g = glob::Pattern::new(&p).map_err(|e| format!("bad tensor pattern `{p}`: {e}"))?;
                out.push(Pattern::Glob(g, p));
            } else {
                out.push(Pattern::Exact(p));
            }
        }
        Ok(Selection { patterns: out, predicate: None })
    }

    /// The tensors whose name `keep` accepts.
    pub fn predicate(keep: impl Fn(&str) -> bool + Send + Sync + 'static) -> Selection {
        Selection { patterns: Vec::new(), predicate: Some(Arc::new(keep)) }
    }

    /// True if the tensor `name` is selected.
    pub fn matches(&self, name: &str) -> bool {
        self.patterns.iter().any(|p| p.matches(name)) || self.predicate.as_ref().is_some_and(|f| f(name))
    }

    /// The selected tensors of `header`, by position, with the targets of selected aliases.
    pub(crate) fn positions(&self, header: &Header) -> Vec<usize> {
        let mut keep: Vec<bool> = header.tensors().iter().map(|t| self.matches(&t.name)).collect();
        for (alias, target) in header.aliases() {
            if self.matches(alias) {
                if let Some(i) = header.position(target) {
                    keep[i] = true;
                }
            }
        }
        keep.iter().enumerate().filter(|(_, &k)| k).map(|(i, _)| i).collect()
    }

    /// [`check`](Self::check) against the tensors and aliases of `headers` (a file's, or every
    /// shard's of a model without an index).
    pub(crate) fn check_headers(&self, headers: &[&Header], origin: &Path) -> Result<()> {
        let aliases: Vec<(&str, &str)> = headers.iter().flat_map(|h| h.aliases()).collect();
        let names = headers.iter().flat_map(|h| h.tensors().iter().map(|t| t.name.as_str()));
        self.check(names.chain(aliases.iter().map(|a| a.0)), origin)
    }

    /// Checks that every name and pattern matches at least one of `names` and that the
    /// selection keeps something, for a caller that lists the names itself (a set of files
    /// loaded one at a time, checked as one); the error names `origin` and the closest names.
    pub fn check_names<'a>(&self, names: impl Iterator<Item = &'a str> + Clone, origin: &Path) -> Result<()> {
        self.check(names, origin)
    }

    /// Checks that every name and pattern matches at least one of `names` (a file's or a
    /// model's tensors and aliases), and that the selection keeps something; the error names
    /// `origin`, the first pattern that matches nothing and the names closest to it.
    pub(crate) fn check<'a>(&self, names: impl Iterator<Item = &'a str> + Clone, origin: &Path) -> Result<()> {
        for p in &self.patterns {
            if !names.clone().any(|n| p.matches(n)) {
                return Err(Error::NoMatch {
                    path: origin.to_owned(),
                    pattern: p.text().to_owned(),
                    close: close(p.text(), names),
                });
            }
        }
        if !names.clone().any(|n| self.matches(n)) {
            return Err(Error::NoMatch {
                path: origin.to_owned(),
                pattern: "the selection".to_owned(),
                close: Vec::new(),
            });
        }
        Ok(())
    }
}

/// Up to five of `names` closest to `wanted` (Jaro-Winkler similarity over 0.7, best first;
/// a name that contains `wanted`, or that `wanted` contains, counts as close).
fn close<'a>(wanted: &str, names: impl Iterator<Item = &'a str>) -> Vec<String> {
    let plain: String = wanted.chars().filter(|c| !"*?[]!".contains(*c)).collect();
    let mut scored: Vec<(f64, &str)> = names
        .map(|n| {
            let score = if !plain.is_empty() && (n.contains(&plain) || plain.contains(n)) {
                1.0
            } else {
                strsim::jaro_winkler(&plain, n)
            };
            (score, n)
        })
        .filter(|(s, _)| *s > 0.7)
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    scored.dedup_by(|a, b| a.1 == b.1);
    scored.into_iter().take(5).map(|(_, n)| n.to_owned()).collect()
}

/// One contiguous read of a selected load: `len` file bytes at `file_offset` go to `mem_offset`
/// of the load's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub file_offset: u64,
    pub len: usize,
    pub mem_offset: usize,
}

/// The environment variable that overrides [`LOCAL_GAP`] and [`REMOTE_GAP`] (bytes, or a size
/// such as `1MiB`; `0` reads every range on its own): for measuring where coalescing pays on a
/// given disk or store (`cargo xtask bench --tensors` sweeps it). An unreadable value is ignored.
pub const COALESCE_GAP_ENV: &str = "TURBOIO_COALESCE_GAP";

/// The gap under which two selected ranges are read as one: [`LOCAL_GAP`] for a local file,
/// [`REMOTE_GAP`] for a remote one, unless [`COALESCE_GAP_ENV`] says otherwise.
pub(crate) fn gap(local: bool) -> u64 {
    gap_with(local, std::env::var(COALESCE_GAP_ENV).ok().as_deref())
}

fn gap_with(local: bool, env: Option<&str>) -> u64 {
    if let Some(v) = env.map(str::trim) {
        if v == "0" {
            return 0;
        }
        if let Ok(g) = crate::size::parse_size(v) {
            return g;
        }
    }
    if local {
        LOCAL_GAP
    } else {
        REMOTE_GAP
    }
}

/// Byte ranges `[begin, end)` of a file sorted, merged across gaps under `gap` (at least twice
/// `align`, so that widened they still do not overlap), widened to `align` and clipped to
/// `file_len`.
fn coalesce(mut ranges: Vec<(u64, u64)>, file_len: u64, align: u64, gap: u64) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (b, e) in ranges {
        match merged.last_mut() {
            Some(last) if b <= last.1 + gap.max(2 * align) => last.1 = last.1.max(e),
            _ => merged.push((b, e)),
        }
    }
    merged.into_iter().map(|(b, e)| (b - b % align, e.next_multiple_of(align).min(file_len))).collect()
}

/// The runs that read byte ranges `[begin, end)` of a file (see [`coalesce`]) into a load of the
/// file from `file_start` on, each where it would be in a load of the whole
/// (`mem_offset = file_offset - file_start`).
pub(crate) fn in_place_runs(ranges: Vec<(u64, u64)>, file_start: u64, file_len: u64, align: u64, gap: u64) -> Vec<Run> {
    coalesce(ranges, file_len, align, gap)
        .into_iter()
        .map(|(start, end)| {
            let start = start.max(file_start);
            Run { file_offset: start, len: (end - start) as usize, mem_offset: (start - file_start) as usize }
        })
        .collect()
}

/// Selected tensors by position in a header, each with its `[BEGIN, END)` in a load's memory.
pub(crate) type Picks = Vec<(usize, (usize, usize))>;

/// The layout of a selected load of a safetensors file whose data section starts at
/// `data_start`: the runs to read (the selected tensors' ranges, see [`coalesce`]) laid out back
/// to back, the bytes of memory they fill, and for each selected tensor its `[BEGIN, END)`
/// relative to the start of that memory.
pub(crate) fn layout(
    header: &Header,
    positions: &[usize],
    data_start: u64,
    file_len: u64,
    align: u64,
    gap: u64,
) -> (Vec<Run>, usize, Picks) {
    let tensors = header.tensors();
    let in_file = |i: usize| {
        let (b, e) = tensors[i].data_offsets;
        (data_start + b as u64, data_start + e as u64)
    };
    let mut runs = Vec::new();
    let mut mem = 0usize;
    for (start, end) in coalesce(positions.iter().map(|&i| in_file(i)).collect(), file_len, align, gap) {
        runs.push(Run { file_offset: start, len: (end - start) as usize, mem_offset: mem });
        mem += (end - start) as usize;
    }
    let picks = positions
        .iter()
        .map(|&i| {
            let (b, e) = in_file(i);
            // The run holding the tensor: the first that ends at or after its start.
            let r = &runs[runs.partition_point(|r| r.file_offset + (r.len as u64) < b)];
            let at = r.mem_offset + (b - r.file_offset) as usize;
            (i, (at, at + (e - b) as usize))
        })
        .collect();
    (runs, mem, picks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn header(tensors: &[(&str, usize)]) -> Header {
        let specs: Vec<turboio_format::TensorSpec> = tensors
            .iter()
            .map(|&(name, len)| turboio_format::TensorSpec {
                name,
                dtype: turboio_format::Dtype::U8,
                shape: std::slice::from_ref(&tensors.iter().find(|t| t.0 == name).unwrap().1),
                data_len: len,
            })
            .collect();
        let layout = turboio_format::plan(&specs, None).unwrap();
        Header::parse(&layout.header, layout.file_len()).unwrap()
    }

    #[test]
    fn the_coalescing_gap_can_be_set_from_the_environment() {
        assert_eq!((gap_with(true, None), gap_with(false, None)), (LOCAL_GAP, REMOTE_GAP));
        assert_eq!(gap_with(true, Some("0")), 0);
        assert_eq!(gap_with(false, Some(" 1MiB ")), 1 << 20);
        assert_eq!(gap_with(true, Some("65536")), 65536);
        assert_eq!(gap_with(true, Some("lots")), LOCAL_GAP, "unreadable: the default");
    }

    #[test]
    fn patterns_names_and_predicates_select() {
        let s = Selection::patterns(["model.layers.1.*", "lm_head.weight"]).unwrap();
        assert!(s.matches("model.layers.1.mlp.up_proj.weight"));
        assert!(!s.matches("model.layers.10.mlp.up_proj.weight"));
        assert!(s.matches("lm_head.weight"));
        let s = Selection::names(["a*"]);
        assert!(s.matches("a*") && !s.matches("ab"), "names are not patterns");
        let s = Selection::predicate(|n| n.ends_with(".bias"));
        assert!(s.matches("x.bias") && !s.matches("x.weight"));
        assert!(Selection::patterns(["[a"]).unwrap_err().contains("[a"));
    }

    #[test]
    fn a_pattern_that_matches_nothing_names_the_closest_tensors() {
        let names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"];
        let s = Selection::patterns(["model.embed_token.weight"]).unwrap();
        let e = s.check(names.iter().copied(), &PathBuf::from("m.safetensors")).unwrap_err().to_string();
        assert!(e.starts_with("m.safetensors: no tensor matches `model.embed_token.weight`"), "{e}");
        assert!(e.contains("model.embed_tokens.weight"), "{e}");
        let s = Selection::predicate(|_| false);
        let e = s.check(names.iter().copied(), &PathBuf::from("m")).unwrap_err().to_string();
        assert!(e.contains("the selection"), "{e}");
    }

    #[test]
    fn runs_coalesce_small_gaps_and_stay_aligned() {
        // a: 100 B, b: 3 MiB, c: 100 B, d: 100 B.
        let h = header(&[("a", 100), ("b", 3 << 20), ("c", 100), ("d", 100)]);
        let all = |n: &str| h.position(n).unwrap();
        let start = h.data_start();
        // a and c: 3 MiB apart (not coalesced); c and d: adjacent (one run).
        let (runs, mem, picks) = layout(&h, &[all("a"), all("c"), all("d")], start, h.file_len(), 4096, LOCAL_GAP);
        assert_eq!(runs.len(), 2, "{runs:?}");
        for r in &runs {
            assert_eq!(r.file_offset % 4096, 0);
            assert!(r.file_offset + r.len as u64 <= h.file_len());
        }
        assert_eq!(mem, runs.iter().map(|r| r.len).sum::<usize>());
        for (i, (b, e)) in picks {
            let t = &h.tensors()[i];
            let run = runs.iter().find(|r| r.mem_offset <= b && e <= r.mem_offset + r.len).unwrap();
            assert_eq!(run.file_offset + (b - run.mem_offset) as u64, start + t.data_offsets.0 as u64);
        }
        // Everything: one run.
        let (runs, _, _) = layout(&h, &[0, 1, 2, 3], start, h.file_len(), 4096, LOCAL_GAP);
        assert_eq!(runs.len(), 1);
    }

    #[test]
    fn aliases_select_their_targets() {
        let specs =
            [turboio_format::TensorSpec { name: "w", dtype: turboio_format::Dtype::U8, shape: &[4], data_len: 4 }];
        let meta = std::collections::BTreeMap::from([("tied".to_owned(), "w".to_owned())]);
        let layout = turboio_format::plan(&specs, Some(&meta)).unwrap();
        let h = Header::parse(&layout.header, layout.file_len()).unwrap();
        assert_eq!(Selection::names(["tied"]).positions(&h), vec![0]);
    }
}
