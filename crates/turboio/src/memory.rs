//! The memory plan of a load: what it will hold, compared with what is available, before
//! anything is allocated or read.
//!
//! A load knows from the headers alone what it will allocate: host memory for a copy (the
//! selected bytes, or the data section), pinned staging buffers and device memory for a load
//! into a device, the converted arena of a converting load. A mapped load allocates nothing:
//! its pages are the page cache, which the kernel reclaims under pressure (so it is not
//! counted). Host memory available is the smaller of `MemAvailable` and, in a memory cgroup
//! with a limit (v2 `memory.max`, v1 `memory.limit_in_bytes`), that limit less what the cgroup
//! holds that cannot be reclaimed (its usage less its inactive file pages), up the hierarchy; device memory available is what the device
//! says ([`Device::free_memory`]). [`LoadOptions::max_host_memory`] and
//! [`LoadOptions::max_device_memory`] set budgets below those. A load that does not fit fails
//! with [`Error::WontFit`]: what it needs, what is available, and the options that would fit;
//! nothing was allocated and no tensor byte read, so nothing is killed halfway.

use crate::options::LoadOptions;
use crate::{Error, Result};
use std::path::Path;
use turboio_device::Device;

/// What a load will allocate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Needs {
    /// Host memory for copies (arenas), converted arenas included.
    pub host: u64,
    /// Pinned host staging buffers.
    pub pinned: u64,
    /// Device memory.
    pub device: u64,
    /// Bytes a copied load would need that a mapped one would not (local unencrypted files
    /// copied into host memory): what `mode="mapped"` saves.
    pub mappable: u64,
}

impl std::ops::AddAssign for Needs {
    fn add_assign(&mut self, o: Needs) {
        self.host = self.host.saturating_add(o.host);
        self.pinned = self.pinned.saturating_add(o.pinned);
        self.device = self.device.saturating_add(o.device);
        self.mappable = self.mappable.saturating_add(o.mappable);
    }
}

/// Host memory this process can still use: `MemAvailable`, or less in a cgroup with a limit.
pub fn host_available() -> Option<u64> {
    let system = turboio_device::available_memory();
    match (system, cgroup_headroom()) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The smallest headroom of this process's memory cgroup and its ancestors that have a limit:
/// the limit less the usage that cannot be reclaimed (usage less inactive file pages). cgroup
/// v2 (`memory.max`, `memory.current`) and v1 (`memory.limit_in_bytes`,
/// `memory.usage_in_bytes`); `None` outside a limited cgroup.
fn cgroup_headroom() -> Option<u64> {
    let me = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let v1 = me.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "memory").then(|| path.to_owned())
    });
    let (root, rel, files) = match v1 {
        Some(path) => ("/sys/fs/cgroup/memory", path, V1),
        None => ("/sys/fs/cgroup", me.lines().find_map(|l| l.strip_prefix("0::"))?.to_owned(), V2),
    };
    let root = Path::new(root);
    let mut dir = root.join(rel.trim().trim_start_matches('/'));
    let mut best: Option<u64> = None;
    loop {
        if let Some(room) = headroom_of(&dir, files) {
            best = Some(best.map_or(room, |b| b.min(room)));
        }
        if dir == root || !dir.pop() || !dir.starts_with(root) {
            break;
        }
    }
    best
}

/// A cgroup version's file names: limit, usage, and the inactive file pages' key in
/// `memory.stat`.
type CgroupFiles = (&'static str, &'static str, &'static str);
const V2: CgroupFiles = ("memory.max", "memory.current", "inactive_file ");
const V1: CgroupFiles = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file ");

fn headroom_of(dir: &Path, (limit, usage, inactive): CgroupFiles) -> Option<u64> {
    let max: u64 = std::fs::read_to_string(dir.join(limit)).ok()?.trim().parse().ok()?;
    // v1 writes "no limit" as a page-rounded i64::MAX.
    if max >= 1 << 62 {
        return None;
    }
    let current: u64 = std::fs::read_to_string(dir.join(usage)).ok()?.trim().parse().ok()?;
    let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
    let inactive_file: u64 =
        stat.lines().find_map(|l| l.strip_prefix(inactive)).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
    Some(max.saturating_sub(current.saturating_sub(inactive_file)))
}

/// Bytes as "1.23 GB".
fn gb(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.2} GB", n as f64 / 1e9)
    } else {
        format!("{:.1} MB", n as f64 / 1e6)
    }
}

/// Fails with [`Error::WontFit`] when `needs` does not fit in the host memory available (or
/// [`LoadOptions::max_host_memory`]) or in `device`'s free memory (or
/// [`LoadOptions::max_device_memory`]). `origin` names the file or model.
pub(crate) fn check(origin: &Path, needs: &Needs, opts: &LoadOptions, device: &dyn Device) -> Result<()> {
    check_with(origin, needs, opts, device, host_available())
}

fn check_with(
    origin: &Path,
    needs: &Needs,
    opts: &LoadOptions,
    device: &dyn Device,
    host_avail: Option<u64>,
) -> Result<()> {
    let host = needs.host.saturating_add(needs.pinned);
    let what_host = || {
        let mut parts = Vec::new();
        if needs.host > 0 {
            parts.push(format!("{} for copies", gb(needs.host)));
        }
        if needs.pinned > 0 {
            parts.push(format!("{} of pinned staging buffers", gb(needs.pinned)));
        }
        parts.join(" and ")
    };
    let mut fits = Vec::new();
    if needs.mappable > 0 {
        fits.push(format!(
            "a mapped load (mode mapped: the page cache, which the kernel can reclaim, instead of {} of copies)",
            gb(needs.mappable)
        ));
    }
    fits.push("fewer tensors (a selection: tensors= / --tensors)".to_owned());
    if needs.pinned > 0 {
        fits.push("a smaller staging chunk (staging_chunk)".to_owned());
    }
    let refuse = |needed: String, available: String, budget: bool| {
        let option = if budget { "; or a larger budget" } else { "" };
        Error::WontFit {
            path: origin.to_owned(),
            message: format!(
                "this load needs {needed} but {available}; nothing was allocated. What would fit: {}{option}",
                fits.join("; ")
            ),
        }
    };
    if host > 0 {
        if let Some(budget) = opts.max_host_memory.filter(|&b| host > b) {
            return Err(refuse(
                format!("{} of host memory ({})", gb(host), what_host()),
                format!("max_host_memory is {}", gb(budget)),
                true,
            ));
        }
        if let Some(avail) = host_avail.filter(|&a| host > a) {
            return Err(refuse(
                format!("{} of host memory ({})", gb(host), what_host()),
                format!("{} is available (MemAvailable, and the cgroup's memory.max less what it holds)", gb(avail)),
                false,
            ));
        }
    }
    if needs.device > 0 {
        let id = device.id();
        if let Some(budget) = opts.max_device_memory.filter(|&b| needs.device > b) {
            return Err(refuse(
                format!("{} of {id} memory", gb(needs.device)),
                format!("max_device_memory is {}", gb(budget)),
                true,
            ));
        }
        if let Some(free) = device.free_memory().filter(|&f| needs.device > f) {
            return Err(refuse(
                format!("{} of {id} memory", gb(needs.device)),
                format!("{id} has {} free", gb(free)),
                false,
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use turboio_device::CpuDevice;

    #[test]
    fn what_does_not_fit_is_refused_with_the_numbers_and_what_would_fit() {
        let cpu = CpuDevice::new();
        let p = Path::new("m.safetensors");
        let needs = Needs { host: 6_000_000_000, mappable: 6_000_000_000, ..Default::default() };
        let e = check_with(p, &needs, &LoadOptions::default(), &cpu, Some(2_000_000_000)).unwrap_err().to_string();
        assert!(e.starts_with("m.safetensors: this load needs 6.00 GB of host memory (6.00 GB for copies)"), "{e}");
        assert!(e.contains("2.00 GB is available") && e.contains("a mapped load"), "{e}");
        assert!(check_with(p, &needs, &LoadOptions::default(), &cpu, Some(7_000_000_000)).is_ok());
        assert!(check_with(p, &needs, &LoadOptions::default(), &cpu, None).is_ok(), "unknown: not refused");
        let budget = LoadOptions { max_host_memory: Some(1 << 30), ..Default::default() };
        let e = check_with(p, &needs, &budget, &cpu, Some(u64::MAX)).unwrap_err().to_string();
        assert!(e.contains("max_host_memory is 1.07 GB") && e.contains("a larger budget"), "{e}");
        assert!(check_with(p, &Needs::default(), &budget, &cpu, Some(0)).is_ok(), "a mapped load needs nothing");
    }
}
