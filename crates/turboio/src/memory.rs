//! The memory plan of a load: what it will hold, compared with what is available, before
//! anything is allocated or read.
//!
//! A load knows from the headers alone what it will allocate: host memory for a copy (the
//! selected bytes, or the data section), pinned staging buffers and device memory for a load
//! into a device, the converted arena of a converting load. A mapped load allocates nothing:
//! its pages are the page cache, which the kernel reclaims under pressure (so it is not
//! counted). Host memory available is the smaller of `MemAvailable` and, in a memory cgroup
//! with a limit (v2 `memory.max`, v1 `memory.limit_in_bytes`), that limit less what the cgroup
//! holds that cannot be reclaimed (its usage less its inactive file pages), up the hierarchy
//! (both versions tested against cgroup trees written by the tests; this VM runs v1, whose
//! real files the CLI test uses); device memory available is what the device says
//! ([`Device::free_memory`]). [`LoadOptions::max_host_memory`] and
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
    cgroup_headroom_in(&me, Path::new("/sys/fs/cgroup"))
}

/// [`cgroup_headroom`] for a process whose `/proc/self/cgroup` reads `me`, with the cgroup
/// file systems mounted at `mount` (v2 there; v1's memory controller at `mount/memory`). A
/// memory controller on a v1 hierarchy wins over a v2 line (hybrid systems).
fn cgroup_headroom_in(me: &str, mount: &Path) -> Option<u64> {
    let v1 = me.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "memory").then(|| path.to_owned())
    });
    let (root, rel, files) = match v1 {
        Some(path) => (mount.join("memory"), path, V1),
        None => (mount.to_owned(), me.lines().find_map(|l| l.strip_prefix("0::"))?.to_owned(), V2),
    };
    let mut dir = root.join(rel.trim().trim_start_matches('/'));
    let mut best: Option<u64> = None;
    loop {
        if let Some(room) = headroom_of(&dir, files) {
            best = Some(best.map_or(room, |b| b.min(room)));
        }
        if dir == root || !dir.pop() || !dir.starts_with(&root) {
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

/// The host-memory half of the plan every load runs, for loads that allocate host
/// memory themselves (the ranks of a `fetch="once"` model load): fails with
/// [`Error::WontFit`] when `bytes` of copies exceed `max_host_memory` or the memory available,
/// naming `origin` and the numbers.
pub fn check_host(origin: &Path, bytes: u64, max_host_memory: Option<u64>) -> Result<()> {
    let opts = LoadOptions { max_host_memory, ..Default::default() };
    let needs = Needs { host: bytes, ..Default::default() };
    check(origin, &needs, &opts, &turboio_device::CpuDevice::new())
}

/// Who reads a memory plan's refusal: its remedies are named in that API's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Api {
    /// The Rust crate (`LoadOptions`, `LoadMode`).
    Rust,
    /// The `turboio` command (`--mode`, `--tensors`, ...).
    Cli,
    /// The Python package (keyword arguments of `turboio.load`, `load_model`, `save_file`).
    Python,
}

/// Something that would make a refused load or save fit.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Remedy {
    /// Holding the tensors in the page cache (mapped) instead of this many bytes of copies.
    Mapped {
        /// The copies' bytes a mapped load would not allocate.
        copies: u64,
    },
    /// Loading fewer tensors (a selection).
    FewerTensors,
    /// Smaller pinned staging chunks (device loads).
    SmallerStagingChunk,
    /// A larger budget than the one given.
    LargerBudget,
    /// A blocking save (background saves' snapshots).
    BlockingSave,
    /// Fewer tensors per file (background saves).
    FewerTensorsPerFile,
}

impl Remedy {
    /// The remedy in `api`'s terms; `None` where that API has no such option.
    pub fn describe(&self, api: Api) -> Option<String> {
        Some(match (self, api) {
            (Remedy::Mapped { copies }, Api::Rust) => format!(
                "a mapped load (LoadMode::Mapped: the page cache, which the kernel can reclaim, instead of {} of copies)",
                gb(*copies)
            ),
            (Remedy::Mapped { copies }, Api::Cli) => format!(
                "a mapped load (--mode mapped: the page cache, which the kernel can reclaim, instead of {} of copies)",
                gb(*copies)
            ),
            (Remedy::Mapped { copies }, Api::Python) => format!(
                "a load from the page cache (cache=\"auto\" rather than \"bypass\", no dtype=: the kernel can \
                 reclaim it, instead of {} of copies)",
                gb(*copies)
            ),
            (Remedy::FewerTensors, Api::Rust) => "fewer tensors (a selection: LoadOptions::tensors)".into(),
            (Remedy::FewerTensors, Api::Cli) => "fewer tensors (a selection: --tensors)".into(),
            (Remedy::FewerTensors, Api::Python) => "fewer tensors (a selection: tensors=)".into(),
            (Remedy::SmallerStagingChunk, Api::Rust) => "a smaller staging chunk (LoadOptions::staging_chunk)".into(),
            (Remedy::SmallerStagingChunk, Api::Cli | Api::Python) => return None,
            (Remedy::LargerBudget, Api::Rust) => "a larger budget (the options' max_host_memory)".into(),
            (Remedy::LargerBudget, Api::Cli) => "a larger budget (--max-host-memory)".into(),
            (Remedy::LargerBudget, Api::Python) => "a larger budget (max_host_memory=)".into(),
            (Remedy::BlockingSave, Api::Python) => "a blocking save (blocking=True: it takes no snapshot)".into(),
            (Remedy::BlockingSave, _) => "a blocking save (turboio::save: it takes no snapshot)".into(),
            (Remedy::FewerTensorsPerFile, _) => "fewer tensors per file".into(),
        })
    }
}

/// "; What would fit: a; b" for the remedies `api` offers ("" when none).
pub(crate) fn describe_remedies(remedies: &[Remedy], api: Api) -> String {
    let named: Vec<String> = remedies.iter().filter_map(|r| r.describe(api)).collect();
    if named.is_empty() {
        String::new()
    } else {
        format!(". What would fit: {}", named.join("; "))
    }
}

/// A budget as the caller most likely wrote it: in GiB or MiB when it is a whole number of
/// them, in GB or MB when it is a whole number of those, else in bytes.
pub(crate) fn budget(n: u64) -> String {
    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    match n {
        0 => "0 bytes".into(),
        n if n.is_multiple_of(GIB) => format!("{}GiB", n / GIB),
        n if n.is_multiple_of(1_000_000_000) => format!("{}GB", n / 1_000_000_000),
        n if n.is_multiple_of(MIB) => format!("{}MiB", n / MIB),
        n if n.is_multiple_of(1_000_000) => format!("{}MB", n / 1_000_000),
        n if n.is_multiple_of(1024) => format!("{}KiB", n / 1024),
        n if n.is_multiple_of(1000) => format!("{}kB", n / 1000),
        n => format!("{n} bytes"),
    }
}

/// Checks a background save's snapshot of `bytes` against `budget` (`max_host_memory`) and,
/// when it maps a new arena (`reusable` false), against the host memory available; the error
/// names the file, the numbers and what would fit.
pub(crate) fn check_snapshot(path: &Path, bytes: u64, budget: Option<u64>, reusable: bool) -> Result<()> {
    check_snapshot_with(path, bytes, budget, reusable, host_available())
}

fn check_snapshot_with(path: &Path, bytes: u64, budget: Option<u64>, reusable: bool, avail: Option<u64>) -> Result<()> {
    let refuse = |available: String, larger: bool| {
        let mut remedies = vec![Remedy::BlockingSave, Remedy::FewerTensorsPerFile];
        if larger {
            remedies.push(Remedy::LargerBudget);
        }
        Error::WontFit {
            path: path.to_owned(),
            message: format!(
                "this background save's snapshot needs {} of host memory but {available}; nothing was copied",
                gb(bytes)
            ),
            remedies,
        }
    };
    if let Some(b) = budget.filter(|&b| bytes > b) {
        return Err(refuse(format!("max_host_memory is {}", self::budget(b)), true));
    }
    if let Some(a) = avail.filter(|&a| !reusable && bytes > a) {
        return Err(refuse(
            format!("{} is available (MemAvailable, and the cgroup's memory.max less what it holds)", gb(a)),
            false,
        ));
    }
    Ok(())
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
        fits.push(Remedy::Mapped { copies: needs.mappable });
    }
    fits.push(Remedy::FewerTensors);
    if needs.pinned > 0 {
        fits.push(Remedy::SmallerStagingChunk);
    }
    let refuse = |needed: String, available: String, budget: bool| {
        let mut remedies = fits.clone();
        if budget {
            remedies.push(Remedy::LargerBudget);
        }
        Error::WontFit {
            path: origin.to_owned(),
            message: format!("this load needs {needed} but {available}; nothing was allocated"),
            remedies,
        }
    };
    if host > 0 {
        if let Some(budget) = opts.max_host_memory.filter(|&b| host > b) {
            return Err(refuse(
                format!("{} of host memory ({})", gb(host), what_host()),
                format!("max_host_memory is {}", self::budget(budget)),
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
                format!("max_device_memory is {}", self::budget(budget)),
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

    /// Writes `files` (path relative to `root`, contents) under `root`.
    fn tree(root: &Path, files: &[(&str, &str)]) {
        for (p, text) in files {
            let p = root.join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
    }

    #[test]
    fn cgroup_v2_headroom_is_the_tightest_limit_up_the_hierarchy_less_what_cannot_be_reclaimed() {
        let d = tempfile::tempdir().unwrap();
        let m = d.path();
        tree(
            m,
            &[
                // The pod: 1 GiB limit, 512 MiB used of which 128 MiB inactive file pages.
                ("kubepods/pod1/memory.max", "1073741824\n"),
                ("kubepods/pod1/memory.current", "536870912\n"),
                (
                    "kubepods/pod1/memory.stat",
                    "anon 402653184\nfile 134217728\nactive_file 0\ninactive_file 134217728\n",
                ),
                // The container: no limit of its own.
                ("kubepods/pod1/c1/memory.max", "max\n"),
                ("kubepods/pod1/c1/memory.current", "536870912\n"),
                // Above: a looser limit.
                ("kubepods/memory.max", "8589934592\n"),
                ("kubepods/memory.current", "1073741824\n"),
            ],
        );
        let me = "0::/kubepods/pod1/c1\n";
        assert_eq!(cgroup_headroom_in(me, m), Some((1 << 30) - ((512 << 20) - (128 << 20))));
        // A tighter parent limit wins; a child's own limit too.
        tree(m, &[("kubepods/memory.max", "600000000\n"), ("kubepods/memory.current", "500000000\n")]);
        assert_eq!(cgroup_headroom_in(me, m), Some(100_000_000), "the parent's 100 MB");
        tree(m, &[("kubepods/pod1/c1/memory.max", "550000000\n")]);
        assert_eq!(cgroup_headroom_in(me, m), Some(13_129_088), "the container's own limit less its usage");
        // The root cgroup (no memory.max there) and unlimited cgroups: no limit.
        assert_eq!(cgroup_headroom_in("0::/\n", m), None);
        assert_eq!(cgroup_headroom_in("0::/elsewhere\n", m), None);
        assert_eq!(cgroup_headroom_in("", m), None, "no cgroup at all");
    }

    #[test]
    fn cgroup_v1_memory_controller_wins_on_hybrid_systems() {
        let d = tempfile::tempdir().unwrap();
        let m = d.path();
        tree(
            m,
            &[
                // v1's "no limit" is a page-rounded i64::MAX.
                ("memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n"),
                ("memory/docker/abc/memory.usage_in_bytes", "1000\n"),
                ("memory/docker/memory.limit_in_bytes", "2000000000\n"),
                ("memory/docker/memory.usage_in_bytes", "1500000000\n"),
                ("memory/docker/memory.stat", "cache 1\ninactive_file 7\ntotal_inactive_file 500000000\n"),
                // A v2 hierarchy with a tighter limit that does not govern memory here.
                ("unified/memory.max", "1\n"),
                ("unified/memory.current", "0\n"),
            ],
        );
        let me = "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n0::/unified\n";
        assert_eq!(cgroup_headroom_in(me, m), Some(1_000_000_000), "total_inactive_file, not inactive_file");
        assert_eq!(cgroup_headroom_in("0::/unified\n", m), Some(1), "v2 alone");
    }

    #[test]
    fn a_snapshot_over_the_budget_or_the_memory_available_is_refused() {
        let p = Path::new("ckpt.safetensors");
        let e = check_snapshot_with(p, 3_000_000_000, Some(2_000_000_000), true, None).unwrap_err().to_string();
        assert!(
            e.starts_with("ckpt.safetensors: this background save's snapshot needs 3.00 GB of host memory but max_host_memory is 2GB; nothing was copied"),
            "{e}"
        );
        assert!(e.contains("a blocking save") && e.contains("a larger budget"), "{e}");
        let e = check_snapshot_with(p, 3_000_000_000, None, false, Some(1_000_000_000)).unwrap_err().to_string();
        assert!(e.contains("1.00 GB is available") && !e.contains("larger budget"), "{e}");
        assert!(check_snapshot_with(p, 3_000_000_000, None, true, Some(1)).is_ok(), "a kept arena is reused");
        assert!(check_snapshot_with(p, 3_000_000_000, Some(3_000_000_000), false, Some(4_000_000_000)).is_ok());
    }

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
        assert!(e.contains("max_host_memory is 1GiB") && e.contains("a larger budget"), "{e}");
        assert!(e.contains("LoadMode::Mapped") && e.contains("LoadOptions::tensors"), "{e}");
        // Each API reads its own remedies (issue 49, item 11).
        let refused = check_with(p, &needs, &budget, &cpu, None).unwrap_err();
        let cli = refused.describe_for(Api::Cli);
        assert!(
            cli.contains("--mode mapped") && cli.contains("--tensors") && cli.contains("--max-host-memory"),
            "{cli}"
        );
        let py = refused.describe_for(Api::Python);
        assert!(py.contains("cache=\"auto\"") && py.contains("tensors=") && py.contains("max_host_memory="), "{py}");
        assert!(!py.contains("--") && !py.contains("LoadMode"), "{py}");
        for (n, shown) in [(256 << 10, "256KiB"), (8 << 30, "8GiB"), (5_000_000_000, "5GB"), (1500, "1500 bytes")] {
            assert_eq!(super::budget(n), shown);
        }
        assert!(check_with(p, &Needs::default(), &budget, &cpu, Some(0)).is_ok(), "a mapped load needs nothing");
    }
}
