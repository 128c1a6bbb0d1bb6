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
    /// Mapped when the file is mostly in the page cache ([`MAPPED_THRESHOLD`](crate::MAPPED_THRESHOLD)),
    /// copied otherwise (with `O_DIRECT` when the backend does that for cold files), and
    /// always copied when direct I/O is forced on or the backend has no local file.
    ///
    /// Why not map cold files too: populating a mapping of a cold file reads it into the page
    /// cache quickly, but on virtual machines the first CPU access to each freshly filled page
    /// then costs a second trap, which the load hands to the first use of the tensors. Counting
    /// that first touch, copies with `O_DIRECT` measured 1.3x faster (`cargo xtask bench`, 4 GiB,
    /// 2.96 s against 3.83 s); without it the mapping looked 1.3x faster.
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
    /// Page-cache bypass for copied loads. `Auto` uses `O_DIRECT` for files not in the page cache.
    pub direct: DirectIo,
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
    /// Host staging chunk size for devices the CPU cannot address; 0 means 16 MiB.
    pub staging_chunk: usize,
    /// Bytes read so far are added here (for progress bars).
    pub progress: Option<Arc<AtomicU64>>,
    /// Set to abort the load; it then fails with [`Error::Cancelled`](crate::Error::Cancelled)
    /// and nothing partial is returned.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Decrypt the file (veTurboIO's AES-CTR formats; the header layout is detected).
    #[cfg(feature = "cipher")]
    pub encryption: Option<crate::crypt::Encryption>,
}

impl fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadOptions")
            .field("threads", &self.threads)
            .field("direct", &self.direct)
            .field("mode", &self.mode)
            .field("arenas", &self.arenas.is_some())
            .field("huge_pages", &self.huge_pages)
            .field("device", &self.device.as_ref().map(|d| d.id()))
            .field("storage", &self.storage.as_ref().map(|s| s.name()))
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
    /// Encrypt the file (veTurboIO's AES-CTR formats).
    #[cfg(feature = "cipher")]
    pub encryption: Option<crate::crypt::Encryption>,
}

impl fmt::Debug for SaveOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SaveOptions")
            .field("threads", &self.threads)
            .field("storage", &self.storage.as_ref().map(|s| s.name()))
            .finish_non_exhaustive()
    }
}
