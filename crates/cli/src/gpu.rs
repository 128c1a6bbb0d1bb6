//! `--device` and `--gds` on `load`.

use std::sync::Arc;
use turboio::device::{DeviceId, DeviceKind};
use turboio::LoadOptions;

/// Where to load to, and whether to read with GPUDirect Storage.
#[derive(clap::Args, Debug, Clone)]
pub struct GpuArgs {
    /// Load into this device: cpu, cuda, cuda:N (npu:N is refused: not supported in this build).
    #[arg(long, default_value = "cpu", value_parser = DeviceId::parse)]
    pub device: DeviceId,
    /// GPUDirect Storage for GPU loads: auto (where cuFile does true GPUDirect I/O, for files not
    /// in the page cache), on (cuFile even in its compatibility mode), off. Loads fall back to
    /// staging through host memory when GDS is unusable, and say why.
    #[arg(long, default_value = "auto", value_parser = parse_gds)]
    pub gds: Gds,
}

/// The `--gds` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gds {
    /// Use it where it does true GPUDirect I/O.
    Auto,
    /// Use it wherever cuFile opens.
    On,
    /// Never.
    Off,
}

fn parse_gds(s: &str) -> Result<Gds, String> {
    match s {
        "auto" => Ok(Gds::Auto),
        "on" | "true" | "1" | "yes" => Ok(Gds::On),
        "off" | "false" | "0" | "no" => Ok(Gds::Off),
        other => Err(format!("unknown GDS setting `{other}` (expected auto, on or off)")),
    }
}

impl GpuArgs {
    /// The load options with the device (opened now: a missing driver or device is an error
    /// here) and the storage backend.
    pub fn apply(&self, mut opts: LoadOptions) -> Result<LoadOptions, Box<dyn std::error::Error>> {
        if self.device.kind == DeviceKind::Cpu {
            if self.gds == Gds::On {
                return Err("--gds on reads into GPU memory: add --device cuda:N".into());
            }
            return Ok(opts);
        }
        opts.device = Some(turboio::device::open_device(self.device)?);
        if self.device.kind == DeviceKind::Cuda && self.gds != Gds::Off {
            let mode = if self.gds == Gds::On { turboio::gds::GdsMode::On } else { turboio::gds::GdsMode::Auto };
            let cfg = turboio::gds::GdsConfig { mode, ..Default::default() };
            opts.storage = Some(Arc::new(turboio::gds::GdsStorage::with_config(cfg)));
        }
        Ok(opts)
    }
}
