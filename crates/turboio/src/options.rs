//! Options of loads and saves.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use turboio_device::{ArenaPool, Device};
use turboio_storage::Storage;

pub use turboio_storage::DirectIo;

/// How a load holds the file's bytes in CPU memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadMode {
    /// Mapped whenever the file is kept in the page cache ([`CachePolicy`]) and can be mapped
    /// (a local, unencrypted file): hot, that copies nothing; cold, the populate reads the file
    /// into the page cache with the whole range asked for at once, which measured faster than
    /// `O_DIRECT` copies into fresh memory and leaves the file cached and shared. Copied
    /// otherwise (with `O_DIRECT` when the cache is bypassed).
    #[default]
    Auto,
    /// A private, writable mapping of the file populated from the page cache: zero copy.
    Mapped,
    /// A copy into a private arena (O_DIRECT when the file is cold).
    Copied,
    /// A private mapping that is not populated: nothing is read until a tensor's bytes are
    /// touched, and then only their pages (what `safe_open` wants for reading a few tensors
    /// of a big file). Pages come from the page cache or the disk on first touch.
    Lazy,
}

impl FromStr for LoadMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(LoadMode::Auto),
            "mapped" => Ok(LoadMode::Mapped),
            "copied" => Ok(LoadMode::Copied),
            "lazy" => Ok(LoadMode::Lazy),
            other => Err(format!("unknown mode `{other}` (expected auto, mapped, copied or lazy)")),
        }
    }
}

impl fmt::Display for LoadMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LoadMode::Auto => "auto",
            LoadMode::Mapped => "mapped",
            LoadMode::Copied => "copied",
            LoadMode::Lazy => "lazy",
        })
    }
}

/// Whether a load leaves the file in the page cache for the next reader.
///
/// The page cache is what makes the second load of a checkpoint (a restarted server, the next
/// rank on the same node, a notebook cell run again) a memory copy or a mapping instead of a
/// disk read, and what lets several processes loading the same file at once read it from the
/// disk once. Bypassing it (`O_DIRECT`) only wins when the file cannot stay cached anyway.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CachePolicy {
    /// Keep, unless a copied load's destination and the part of the file not yet cached do not
    /// both fit in the memory available (`MemAvailable`): then bypass, so that caching the file
    /// does not push out the copy being made (or anything else).
    #[default]
    Auto,
    /// Read through the page cache (mapped loads always do): the file stays cached.
    Keep,
    /// Read with `O_DIRECT` where the file system allows it: the page cache is left as it was
    /// (copied loads only; a mapping is the page cache).
    Bypass,
}

impl FromStr for CachePolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(CachePolicy::Auto),
            "keep" => Ok(CachePolicy::Keep),
            "bypass" => Ok(CachePolicy::Bypass),
            other => Err(format!("unknown cache policy `{other}` (expected auto, keep or bypass)")),
        }
    }
}

impl fmt::Display for CachePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CachePolicy::Auto => "auto",
            CachePolicy::Keep => "keep",
            CachePolicy::Bypass => "bypass",
        })
    }
}

impl From<DirectIo> for CachePolicy {
    /// The older spelling: `O_DIRECT` on is bypass, off is keep.
    fn from(d: DirectIo) -> Self {
        match d {
            DirectIo::Auto => CachePolicy::Auto,
            DirectIo::On => CachePolicy::Bypass,
            DirectIo::Off => CachePolicy::Keep,
        }
    }
}

/// Parses `auto`, `on`/`true`/`1`, `off`/`false`/`0`.
pub fn parse_direct(s: &str) -> Result<DirectIo, String> {
    match s {
        "auto" => Ok(DirectIo::Auto),
        "on" | "true" | "1" | "yes" => Ok(DirectIo::On),
        "off" | "false" | "0" | "no" => Ok(DirectIo::Off),
        other => Err(format!("unknown direct I/O setting `{other}` (expected auto, on or off)")),
    }
}

/// Options of [`load`](crate::load).
#[derive(Clone, Default)]
pub struct LoadOptions {
    /// Reader threads; 0 (the default) means one per core.
    pub threads: usize,
    /// Whether the file stays in the page cache ([`CachePolicy`]; default: keep it unless it
    /// cannot fit beside its copy).
    pub cache: CachePolicy,
    /// Mapped or copied (CPU only).
    pub mode: LoadMode,
    /// Keep and reuse arenas across loads (veTurboIO's `init_io_helper`). Without it every copied
    /// load maps a fresh arena and unmaps it when the result is dropped.
    pub arenas: Option<ArenaPool>,
    /// Transparent huge pages for new CPU arenas; `None` follows
    /// [`default_huge_pages`](turboio_device::default_huge_pages) (`TURBOIO_HUGE_PAGES`, else off).
    /// Arenas from [`arenas`](Self::arenas) follow the pool's own setting.
    pub huge_pages: Option<bool>,
    /// Where to load to; the CPU when `None`.
    pub device: Option<Arc<dyn Device>>,
    /// The storage backend; the local file system when `None`.
    pub storage: Option<Arc<dyn Storage>>,
    /// Bytes per pinned staging slot for devices the CPU cannot address; 0 means 8 MiB.
    pub staging_chunk: usize,
    /// Bytes read so far are added here (for progress bars).
    pub progress: Option<Arc<AtomicU64>>,
    /// Set to abort the load; it then fails with [`Error::Cancelled`](crate::Error::Cancelled)
    /// and nothing partial is returned.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Decrypt the file (veTurboIO's AES-CTR formats; the header layout is detected).
    #[cfg(feature = "cipher")]
    pub encryption: Option<crate::encryption::Encryption>,
    /// Convert every floating tensor (F64, F32, F16, BF16, F8_E4M3, F8_E5M2) to this dtype on
    /// the way in, bit-identical to torch's `.to()` ([`turboio_format::cast()`]); other tensors
    /// pass through. `None` (the default): tensors keep their dtype.
    pub dtype: Option<turboio_format::Dtype>,
    /// Load only these tensors ([`Selection`](crate::Selection): names, glob patterns or a
    /// predicate): only their bytes are read, and a name or pattern that matches nothing is an
    /// error listing the closest names. `None` (the default): every tensor.
    pub tensors: Option<crate::Selection>,
    /// A budget of host memory (bytes) for what the load allocates (copies, converted arenas,
    /// pinned staging): a load that would need more fails before allocating anything
    /// ([`Error::WontFit`](crate::Error::WontFit)), and a load into a device shrinks its staging
    /// chunk to fit. Without it, the limit is the memory available (`MemAvailable`, or less in
    /// a cgroup with a `memory.max`). See [`crate::memory`].
    pub max_host_memory: Option<u64>,
    /// A budget of device memory (bytes) for a load into a device; without it, the limit is
    /// what the device has free.
    pub max_device_memory: Option<u64>,
}

impl fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadOptions")
            .field("threads", &self.threads)
            .field("cache", &self.cache)
            .field("mode", &self.mode)
            .field("arenas", &self.arenas.is_some())
            .field("huge_pages", &self.huge_pages)
            .field("device", &self.device.as_ref().map(|d| d.id()))
            .field("storage", &self.storage.as_ref().map(|s| s.name()))
            .field("dtype", &self.dtype)
            .field("tensors", &self.tensors)
            .field("max_host_memory", &self.max_host_memory)
            .field("max_device_memory", &self.max_device_memory)
            .finish_non_exhaustive()
    }
}

/// Options of [`save`](crate::save).
#[derive(Clone, Default)]
pub struct SaveOptions {
    /// Writer threads; 0 means one per core.
    pub threads: usize,
    /// The storage backend; the local file system when `None`.
    pub storage: Option<Arc<dyn Storage>>,
    /// Bytes written so far are added here.
    pub progress: Option<Arc<AtomicU64>>,
    /// Set to abort the save; the previous file is then left as it was.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Whether the written file stays in the page cache: `Keep` writes through it (a load
    /// right after, on this machine, is then hot), `Bypass` writes with `O_DIRECT` (faster
    /// here, and it does not push other data out of the cache), `Auto` is the backend's
    /// default (`O_DIRECT` for local files).
    pub cache: CachePolicy,
    /// Bytes per chunk handed to a writer thread; 0 means the backend's default (1 MiB for
    /// local files).
    pub chunk_size: usize,
    /// Replacing a local file writes the new file into the blocks of the copy the previous
    /// replacing save kept (`.NAME.turboio-spare`), instead of into new blocks: on ext4 new
    /// blocks cost a third of a save (they are allocated and converted as the data lands), and
    /// a training loop that replaces the same checkpoint all day needs none. The price is one
    /// more copy of the file on disk (the previous version, hidden). The spare is used only
    /// when nobody has it open or mapped on this machine and it has no other name; otherwise
    /// the save writes a new file as usual. Off by default; a save with it off frees a spare.
    pub reuse_blocks: bool,
    /// Where [`save_async`](crate::save_async) keeps its snapshots; when `None`, a process-wide
    /// pool of at most two ([`default_snapshot_pool`](crate::default_snapshot_pool)): a third
    /// background save waits for one of them to come back. A pool made with
    /// [`ArenaPool::bounded`] bounds the memory of queued saves; an unbounded one does not.
    pub snapshots: Option<ArenaPool>,
    /// A host-memory budget for [`save_async`](crate::save_async)'s snapshots: one larger
    /// than it is refused ([`Error::WontFit`](crate::Error::WontFit)) before anything is
    /// copied, and the snapshots of pending saves together with the ones kept for reuse stay
    /// within it (a save waits for pending ones to finish first). Without it a snapshot is
    /// still checked against the host memory available (`MemAvailable`, the memory cgroup).
    /// Blocking saves take no snapshot and ignore it.
    pub max_host_memory: Option<u64>,
    /// Encrypt the file (veTurboIO's AES-CTR formats).
    #[cfg(feature = "cipher")]
    pub encryption: Option<crate::encryption::Encryption>,
}

impl fmt::Debug for SaveOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SaveOptions")
            .field("threads", &self.threads)
            .field("cache", &self.cache)
            .field("storage", &self.storage.as_ref().map(|s| s.name()))
            .finish_non_exhaustive()
    }
}
