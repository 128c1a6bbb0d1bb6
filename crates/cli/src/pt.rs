//! `.pt` / `.bin` checkpoints in the CLI: `inspect`, `load` and `convert`.

use crate::out::{outln, Shown};
use crate::{count, gb, median, progress, CliResult};
use std::collections::BTreeMap;
use std::path::Path;
use turboio::convert::{ConvertOptions, SharedTensors};
use turboio::pt::PtOptions;
use turboio::{CachePolicy, LoadOptions};

/// Whether `file` (decrypted when the options say so) is a torch checkpoint.
pub fn is_pt(file: &Path, opts: &LoadOptions) -> bool {
    let plain =
        LoadOptions { encryption: opts.encryption.clone(), storage: opts.storage.clone(), ..Default::default() };
    turboio::read_prefix(file, 4, &plain).is_ok_and(|(p, _)| turboio::pt::looks_like_pt(&p))
}

fn pt_options(top_level_key: Option<&str>) -> PtOptions {
    PtOptions { top_level_key: top_level_key.map(str::to_owned), ..Default::default() }
}

/// `inspect x.pt`: tensors (name, dtype, shape, strides, storage), shared storages, skipped
/// entries; only the zip directory and the pickle are read.
pub fn inspect(file: &Path, json: bool, opts: &LoadOptions, top_level_key: Option<&str>) -> CliResult {
    let index = &turboio::pt::read_index(file, opts, &pt_options(top_level_key))?;
    let mut users: BTreeMap<usize, Vec<&str>> = BTreeMap::new();
    for t in index.tensors() {
        users.entry(t.storage).or_default().push(&t.name);
    }
    let shared: Vec<&Vec<&str>> = users.values().filter(|v| v.len() > 1).collect();
    let bytes: u64 = index.storages().iter().map(|s| s.len).sum();
    if json {
        let tensors: Vec<serde_json::Value> = index
            .tensors()
            .iter()
            .map(|t| {
                serde_json::json!({
                    "name": t.name,
                    "dtype": t.dtype.name(),
                    "shape": t.shape,
                    "strides": t.strides,
                    "storage": index.storages()[t.storage].key,
                    "storage_offset": t.storage_offset,
                    "bytes": t.nbytes(),
                    "contiguous": t.is_contiguous(),
                    "conj": t.conj,
                    "neg": t.neg,
                    "meta": t.meta,
                    "location": index.storages()[t.storage].location,
                })
            })
            .collect();
        let skipped: Vec<serde_json::Value> =
            index.skipped().iter().map(|s| serde_json::json!({"name": s.name, "kind": s.kind})).collect();
        let doc = serde_json::json!({
            "path": file.shown().to_string(),
            "format": "torch.save zip",
            "archive": index.archive_name(),
            "storages": index.storages().len(),
            "storage_bytes": bytes,
            "shared_storages": shared,
            "skipped": skipped,
            "tensors": tensors,
        });
        outln!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    outln!(
        "{}: torch.save checkpoint (archive `{}`), {} tensors in {} storages, {}",
        file.shown(),
        index.archive_name(),
        index.tensors().len(),
        index.storages().len(),
        gb(bytes)
    );
    let w = index.tensors().iter().map(|t| t.name.len()).max().unwrap_or(4).max(4);
    outln!("{:<w$}  {:<8} {:<20} {:<16} {:>12}", "name", "dtype", "shape", "strides", "bytes");
    for t in index.tensors() {
        let shape = format!("{:?}", t.shape);
        let strides = if t.is_contiguous() { "contiguous".to_owned() } else { format!("{:?}", t.strides) };
        let mut bits = Vec::new();
        if t.conj {
            bits.push("conjugate view");
        }
        if t.neg {
            bits.push("negative view");
        }
        if t.meta {
            bits.push("meta tensor, no data");
        }
        let bits = if bits.is_empty() { String::new() } else { format!("  ({})", bits.join(", ")) };
        outln!("{:<w$}  {:<8} {:<20} {:<16} {:>12}{bits}", t.name, t.dtype.name(), shape, strides, t.nbytes());
    }
    for group in shared {
        outln!("shared storage: {}", group.join(", "));
    }
    for s in index.skipped() {
        outln!("skipped (not a tensor): {} ({})", s.name, s.kind);
    }
    Ok(())
}

/// `load x.pt`: the checkpoint loaded as the library does, `--check`ed against a plain read.
pub fn load(file: &Path, mut opts: LoadOptions, repeat: usize, check: bool, top_level_key: Option<&str>) -> CliResult {
    // (A remote file's bytes are known once loaded.)
    let mut file_len = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
    let pt = pt_options(top_level_key);
    let mut times = Vec::new();
    for run in 1..=repeat {
        let bar = progress::Bar::start(file_len, &format!("loading {}", file.shown()));
        opts.progress = bar.counter();
        let loaded = turboio::load_pt(file, &opts, &pt);
        bar.finish();
        let loaded = loaded?;
        let r = loaded.report();
        if file_len == 0 {
            file_len = r.bytes;
        }
        times.push(r.elapsed.as_secs_f64());
        let cached = r.cached_fraction.map(|f| format!(", {:.0}% cached before", f * 100.0)).unwrap_or_default();
        outln!(
            "run {run}: {} tensors (torch.save checkpoint, no pickle executed), {} in {:.3} s = {:.2} GB/s ({}, {}{}; {})",
            loaded.len(),
            gb(file_len),
            r.elapsed.as_secs_f64(),
            r.gb_per_s(file_len),
            r.held,
            r.read.method,
            cached,
            r.cache,
        );
        for why in &r.fallbacks {
            println!("  fallback: {why}");
        }
        if check {
            let plain = turboio::read_all(
                file,
                &LoadOptions {
                    encryption: opts.encryption.clone(),
                    storage: opts.storage.clone(),
                    cache: CachePolicy::Keep,
                    ..Default::default()
                },
            )?;
            let again = turboio::pt::PtIndex::parse(plain.as_slice(), &pt)?;
            if again.tensors() != loaded.index().tensors() {
                return Err(format!("{}: the file changed during the check; nothing was compared", file.shown()).into());
            }
            for t in again.tensors().iter().filter(|t| !t.meta) {
                let span = again.file_span(t);
                let mut want = vec![0u8; t.nbytes() as usize];
                t.gather(&plain[span.start as usize..span.end as usize], &mut want)?;
                if loaded.tensor_bytes(&t.name)? != want {
                    return Err(format!("{}: tensor `{}` differs from a plain read", file.shown(), t.name).into());
                }
            }
            let meta = again.tensors().iter().filter(|t| t.meta).count();
            let note = if meta > 0 { format!(" ({meta} meta tensors have no data to compare)") } else { String::new() };
            outln!(
                "check: {}: {} a plain read of the file{note}",
                file.shown(),
                count(loaded.len() - meta, "tensor matches", "all {n} tensors match")
            );
        }
    }
    if times.len() > 1 {
        let m = median(times);
        outln!("median: {m:.3} s = {:.2} GB/s", file_len as f64 / m / 1e9);
    }
    Ok(())
}

/// `convert IN OUT`.
#[allow(clippy::too_many_arguments)]
pub fn convert(
    input: &Path,
    output: &Path,
    opts: &LoadOptions,
    save: turboio::SaveOptions,
    top_level_key: Option<String>,
    clone_shared: bool,
    dtype: Option<turboio::Dtype>,
    validate: bool,
    overwrite: bool,
) -> CliResult {
    let copts = ConvertOptions {
        load: LoadOptions { threads: save.threads, ..opts.clone() },
        save,
        top_level_key,
        shared: if clone_shared { SharedTensors::Clone } else { SharedTensors::Alias },
        dtype,
        validate,
        overwrite,
    };
    let r = turboio::convert::convert(input, output, &copts)?;
    let converted = match dtype {
        Some(d) if r.converted > 0 => format!(", {} converted to {d}", r.converted),
        _ => String::new(),
    };
    outln!(
        "converted {} -> {}: {} tensors ({}){}, {} aliases, in {:.2} s; no pickle was executed",
        input.shown(),
        output.shown(),
        r.tensors,
        gb(r.bytes),
        converted,
        r.aliases.len(),
        r.elapsed.as_secs_f64(),
    );
    for (alias, target) in &r.aliases {
        outln!("  alias: {alias} -> {target}");
    }
    for s in &r.skipped {
        outln!("  skipped (not a tensor): {s}");
    }
    if r.validated {
        outln!("validated: every tensor of the output matches the input");
    }
    Ok(())
}
