//! The GPU rows of `cargo xtask bench --device cuda:N`, hot and cold, in the same run as the CPU
//! rows: turboio into the GPU (auto, staged through pinned buffers, straight from the page-cache
//! mapping, GPUDirect Storage, an encrypted file decrypted on the GPU) against the ceiling, a
//! pinned host-to-device copy of 1 GiB over the device's copy streams, with the machine's rates
//! at the staging engine's sizes beside it: the copy in 8 MiB pieces (one staging slot) and
//! pinning fresh memory in 8 MiB slots (what the pool pays once per process; both rates are
//! printed as the model device's settings, `--gpu-model-spec link=...,pin=...`). The Python
//! peers (safetensors, fastsafetensors with and without GDS, InstantTensor, torch.load) are in
//! `python`.
//!
//! Where the device cannot be opened (no GPU, no driver) every row is skipped with the reason,
//! so the bench runs everywhere.

use crate::bench::kit::{drop_caches, run_order, warm, Row};
use anyhow::Result;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;
use turboio::device::{Device, DeviceId};
use turboio::gds::{GdsConfig, GdsMode, GdsStorage};
use turboio::{LoadMode, LoadOptions};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GpuLoader {
    Auto,
    Staged,
    Mapped,
    Gds,
    Encrypted,
    Ceiling,
    /// The link at the staging slot's size: what one slot's copy can reach.
    CeilingSlot,
    /// Pinning fresh memory in slots, as the staging pool does once per process.
    Pinning,
}

impl GpuLoader {
    fn name(self) -> &'static str {
        match self {
            GpuLoader::Auto => "turboio -> GPU, auto",
            GpuLoader::Staged => "turboio -> GPU, staged (pinned buffers)",
            GpuLoader::Mapped => "turboio -> GPU, DMA from the page-cache mapping",
            GpuLoader::Gds => "turboio -> GPU, GPUDirect Storage",
            GpuLoader::Encrypted => "turboio -> GPU, encrypted, decrypted on the GPU",
            GpuLoader::Ceiling => "ceiling: pinned H2D copy, 1 GiB, all streams",
            GpuLoader::CeilingSlot => "ceiling: pinned H2D copy, 8 MiB pieces (a staging slot)",
            GpuLoader::Pinning => "pinning the file's size in 8 MiB slots (cuMemHostRegister)",
        }
    }

    const HOT: [GpuLoader; 8] = [
        GpuLoader::Auto,
        GpuLoader::Staged,
        GpuLoader::Mapped,
        GpuLoader::Gds,
        GpuLoader::Encrypted,
        GpuLoader::Ceiling,
        GpuLoader::CeilingSlot,
        GpuLoader::Pinning,
    ];

    /// Rows that measure the machine, not a load (no warm-up load, no file to warm).
    fn is_ceiling(self) -> bool {
        matches!(self, GpuLoader::Ceiling | GpuLoader::CeilingSlot | GpuLoader::Pinning)
    }
    const COLD: [GpuLoader; 4] = [GpuLoader::Auto, GpuLoader::Staged, GpuLoader::Gds, GpuLoader::Encrypted];
}

/// The name of the hot auto row and of the ceiling row (for the bench's checks).
pub const AUTO: &str = crate::bench::kit::GPU_AUTO;
/// See [`AUTO`].
pub const STAGED: &str = "turboio -> GPU, staged (pinned buffers)";
/// See [`AUTO`].
pub const ENCRYPTED: &str = "turboio -> GPU, encrypted, decrypted on the GPU";
/// See [`AUTO`].
pub const CEILING: &str = "ceiling: pinned H2D copy, 1 GiB, all streams";

/// The device, or why it cannot be used.
pub fn open(device: &str) -> std::result::Result<(DeviceId, Arc<dyn Device>), String> {
    let id = DeviceId::parse(device)?;
    let dev = turboio::device::open_device(id).map_err(|e| e.to_string())?;
    Ok((id, dev))
}

fn one(
    loader: GpuLoader,
    id: DeviceId,
    dev: &Arc<dyn Device>,
    path: &Path,
    encrypted: &Path,
    len: u64,
) -> Result<(f64, String, Option<String>)> {
    // The staging slot's size (the engine's default chunk).
    const SLOT: usize = 8 << 20;
    match loader {
        GpuLoader::Ceiling | GpuLoader::CeilingSlot => {
            let cuda = turboio::device::cuda::CudaDevice::new(id.ordinal)?;
            let piece = if loader == GpuLoader::Ceiling { 64 << 20 } else { SLOT };
            let gbps = cuda.pinned_h2d_gbps(1 << 30, piece, 3)?;
            // The model device's link setting from this machine (`--gpu-model-spec`).
            let how = format!("{gbps:.1} GB/s over {} streams (model: link={gbps:.1})", cuda.streams());
            return Ok((len as f64 / (gbps * 1e9), how, None));
        }
        GpuLoader::Pinning => {
            let cuda = turboio::device::cuda::CudaDevice::new(id.ordinal)?;
            let bytes = usize::try_from(len).unwrap_or(usize::MAX).min(1 << 30);
            let gbps = cuda.pinning_gbps(bytes, SLOT)?;
            return Ok((len as f64 / (gbps * 1e9), format!("{gbps:.2} GB/s (model: pin={gbps:.2})"), None));
        }
        _ => {}
    }
    let gds = |mode| {
        Some(Arc::new(GdsStorage::with_config(GdsConfig { mode, ..Default::default() }))
            as Arc<dyn turboio::storage::Storage>)
    };
    let base = LoadOptions { device: Some(dev.clone()), ..Default::default() };
    let (file, opts) = match loader {
        GpuLoader::Auto => (path, LoadOptions { storage: gds(GdsMode::Auto), ..base }),
        GpuLoader::Staged => (path, LoadOptions { mode: LoadMode::Copied, ..base }),
        GpuLoader::Mapped => (path, LoadOptions { mode: LoadMode::Mapped, ..base }),
        GpuLoader::Gds => (path, LoadOptions { mode: LoadMode::Copied, storage: gds(GdsMode::On), ..base }),
        GpuLoader::Encrypted => {
            (encrypted, LoadOptions { encryption: Some(crate::bench::kit::bench_encryption()?), ..base })
        }
        GpuLoader::Ceiling | GpuLoader::CeilingSlot | GpuLoader::Pinning => unreachable!(),
    };
    let t = Instant::now();
    let f = turboio::load(file, &opts)?;
    let secs = t.elapsed().as_secs_f64();
    let r = f.report();
    let how = format!("{} via {}", r.held, r.read.method);
    // A row whose path was not taken measures another row's path: skip it with the reason.
    let refused = match loader {
        GpuLoader::Gds if r.read.method != "gds" => Some(r.fallbacks.join("; ")),
        GpuLoader::Mapped if !r.fallbacks.is_empty() => Some(r.fallbacks.join("; ")),
        GpuLoader::Encrypted if !r.fallbacks.is_empty() => Some(r.fallbacks.join("; ")),
        _ => None,
    };
    let how = if r.fallbacks.is_empty() { how } else { format!("{how}; fell back: {}", r.fallbacks.join("; ")) };
    Ok((secs, how, refused))
}

/// The GPU rows for one file, hot or cold.
pub fn measure(device: &str, path: &Path, encrypted: &Path, len: u64, runs: usize, cold: bool) -> Result<Vec<Row>> {
    let loaders: &[GpuLoader] = if cold { &GpuLoader::COLD } else { &GpuLoader::HOT };
    let cache = if cold { "cold" } else { "hot" };
    let mut rows: Vec<Row> = loaders
        .iter()
        .map(|l| Row { size: len, cache, loader: l.name(), group: "gpu", ..Default::default() })
        .collect();
    // Rows named in TURBOIO_BENCH_SKIP (comma-separated parts of their names) are reported as
    // skipped: a path that hangs on one machine must not cost the rest of the run.
    let skip = std::env::var("TURBOIO_BENCH_SKIP").unwrap_or_default();
    for r in &mut rows {
        if skip.split(',').any(|s| !s.trim().is_empty() && r.loader.contains(s.trim())) {
            r.skipped = Some("skipped by TURBOIO_BENCH_SKIP".into());
        }
    }
    let (id, dev) = match open(device) {
        Ok(d) => d,
        Err(why) => {
            eprintln!("GPU rows skipped: {why}");
            for r in &mut rows {
                r.skipped = Some(why.clone());
            }
            return Ok(rows);
        }
    };
    // Hot rows measure the steady state of a process that loads again: one untimed load per
    // loader first pays the process's one-time costs (the staging pool's pinning, NVRTC's
    // compile of the decryption kernel: 0.44 s of a 0.64 s first encrypted load on an H200).
    if !cold {
        for (i, &loader) in loaders.iter().enumerate() {
            if rows[i].skipped.is_none() && !loader.is_ceiling() {
                one(loader, id, &dev, path, encrypted, len)?;
            }
        }
    }
    for r in 0..runs {
        for i in run_order(loaders.len(), r) {
            if rows[i].skipped.is_some() {
                continue;
            }
            let target = if loaders[i] == GpuLoader::Encrypted { encrypted } else { path };
            if cold {
                if let Err(why) = drop_caches() {
                    for row in rows.iter_mut() {
                        row.skipped = Some(why.clone());
                    }
                    return Ok(rows);
                }
            } else if !loaders[i].is_ceiling() {
                warm(target)?;
            }
            let (secs, how, refused) = one(loaders[i], id, &dev, path, encrypted, len)?;
            if let Some(why) = refused {
                rows[i].skipped = Some(format!("not taken here: {why}"));
                continue;
            }
            rows[i].times.push(secs);
            rows[i].load_times.push(secs);
            rows[i].how = how;
        }
    }
    Ok(rows)
}
