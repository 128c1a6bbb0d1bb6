//! turboio: load and save safetensors checkpoints as fast as the storage and memory allow.
//!
//! ```no_run
//! let file = turboio::load("model.safetensors", &turboio::LoadOptions::default())?;
//! for t in file.tensors() {
//!     println!("{} {} {:?} {} bytes", t.name(), t.dtype(), t.shape(), t.len());
//! }
//! # Ok::<(), turboio::Error>(())
//! ```
//!
//! # How a load works
//!
//! 1. The backend opens the file and the first `8 + N` bytes are read and validated
//!    ([`turboio_format`]); the data section is never read to validate.
//! 2. The file's page-cache residency is probed once (`cachestat(2)`, or a `mincore` sample
//!    where the kernel lacks it; well under a millisecond).
//! 3. The bytes are brought in one pass, one of three ways:
//!    - **mapped** (CPU, the default for local unencrypted files): a private writable mapping
//!      populated with `MADV_POPULATE_READ`. Hot, no byte is copied (about 40 GB/s on the
//!      build machine); cold, the whole range is asked for first (`MADV_WILLNEED`) so the disk
//!      sees a deep queue, the populating threads read one byte of each page as it arrives (on
//!      virtual machines the first CPU access to such a page is expensive, and is better paid
//!      here, in parallel and overlapped with the reads, than by the user's first pass), and the
//!      file ends up in the page cache for the next process. A page
//!      is copied only if written.
//!    - **copied** (CPU, asked for, encrypted files, or a bypassed cache): one arena (4 KiB
//!      pages unless huge pages are asked for, [`LoadOptions::huge_pages`]) filled by parallel
//!      readers: buffered `pread`s with the kernel asked to read ahead of them when the page
//!      cache is kept, io_uring with `O_DIRECT` and a deep queue when it is bypassed. Arenas
//!      can be pooled and reused ([`LoadOptions::arenas`]).
//!    - **device memory** (a GPU, any device the CPU cannot address; `to_device`): straight
//!      from the populated page-cache mapping when the file is hot and the device can DMA from
//!      host memory it registers; straight from storage (GPUDirect Storage) when the file is
//!      cold and the backend can; otherwise **staged**: readers fill host staging buffers (pinned
//!      and pooled on CUDA) that the device copies asynchronously while the next chunk is read.
//!      Encrypted files are decrypted by the device right after each upload when it can (the
//!      CUDA device runs an AES-CTR kernel), so the CPU does no AES work. Every path not taken
//!      for a reason other than the file's state leaves one line in
//!      [`LoadReport::fallbacks`]; the load itself never fails over it.
//!
//!    Whether the page cache is kept is [`CachePolicy`]: by default it is (the next load of the
//!    file, in any process, is then hot, and processes loading it at the same time read it from
//!    the disk once), unless a copy and the file do not both fit in available memory.
//!    [`LoadReport::cache`] says what was done and why.
//! 4. Tensors are views into that one allocation ([`LoadedFile::tensors`]); aliases recorded in
//!    `__metadata__` resolve to their targets ([`LoadedFile::tensor`]).
//!
//! # Saves
//!
//! [`save`] writes byte-for-byte what the reference safetensors writer writes for the same
//! tensors (with `__metadata__` keys sorted), through parallel writers into a temporary file in
//! the same directory, then `fsync` and an atomic rename, then an `fsync` of the directory. A
//! failure at any point leaves the previous file intact and no temporary file behind. Because
//! the old file is replaced by rename and never truncated in place, processes that have it
//! mapped keep a valid mapping.
//!
//! # Backends and features
//!
//! | feature | what |
//! |---|---|
//! | `posix` (default) | local files: threads + io_uring, `O_DIRECT`, atomic saves |
//! | `cipher` | veTurboIO's encrypted files (AES-CTR, KMS) |
//! | `cuda` | NVIDIA GPUs as load targets (`device::cuda`; libcuda and NVRTC loaded at run time) |
//! | `gds` | GPUDirect Storage (`gds::GdsStorage`; libcufile loaded at run time); implies `cuda` |
//! | `sfcs` | `sfcs://` paths: veMLP's SFCS cache through libcloudfs, loaded at run time (`turboio_io_sfcs`) |
//! | `object` | `s3://`, `gs://`, `az://`, `abfs[s]://`, `http(s)://` URLs through object_store ([`object`]) |
//! | `testing` | re-exports the opaque test device |
//!
//! Paths pick their backend through a small scheme registry ([`storage_for`]): `sfcs://...`
//! goes to the SFCS backend (feature `sfcs`), `s3://`, `gs://`, `az://`, `abfs[s]://` and
//! `http(s)://` URLs to the object-storage backend (feature `object`; configured from the
//! environment, or give an [`object::ObjectStorage`] with explicit options as the storage);
//! without the feature such a path is an error naming it. Everything else goes to the local
//! file system. Model directories work on every backend that can list (an object store's
//! "directory" is a key prefix). [`LoadOptions::storage`] and
//! [`SaveOptions::storage`] override the choice (e.g. `gds::GdsStorage` for GPU loads).
//! Nothing CUDA is needed to build any feature. A device or backend left out of the build
//! answers with a clear "not compiled in" error; one compiled in but missing at run time (no
//! driver, no GPU, no libcufile) answers with an error naming what is missing, or, for GDS, a
//! fallback line. Saves of tensors in device memory: [`save_from_device`].
//!
//! # Inside
//!
//! `backend` picks the [`storage::Storage`] of a path (the one given, the scheme's, else the
//! local file system: every open file is a `Box<dyn StorageFile>`, and a mapping is asked for
//! through its `local_file` capability, never by matching on a backend). `encryption` is the
//! cipher layer (keys, the decrypting layer of an open file, the encrypting write source);
//! [`crypt`] is its public face.
//!
//! A load is a few stages, and each module of the load path calls only the ones below it (a
//! test reads the sources and fails on an upward call):
//!
//! | module | stage | may call |
//! |---|---|---|
//! | [`model`] | a model's shards: resolve, plan all, one memory plan, fill together, convert | `load`, `plan`, `cast`, `to_device`, `select` |
//! | `load` | the entry points of a file: plan, memory plan, allocate, fill, convert, place | `plan`, `cast`, `to_device` |
//! | `cast` | convert dtypes (host threads, or the device's kernel) | none of these |
//! | `plan` | what to read and where: open, parse, select, the memory plan's needs, allocate, fill host memory or dispatch to `to_device`, finish | `to_device`, `select` |
//! | `to_device` | fill device memory: page-cache mapping, GPUDirect, or the staging engine; place a host load on a device | `select` |
//! | [`select`] | which tensors and byte runs | `size` |
//! | [`size`] | sizes written by people | nothing |
//!
//! [`pt`] plugs the `.pt` parser into `plan`; `save`, `background` and [`convert`] build on
//! those.
// No unsafe code, but for one promise: the staged load's slots, lent to the storage's
// io_uring (`to_device::by_completion`), are not touched while the kernel reads into them.
#![deny(unsafe_code)]
#![deny(missing_docs)]

mod backend;
mod background;
mod cast;
pub mod convert;
#[cfg(feature = "cipher")]
pub mod crypt;
#[cfg(feature = "cipher")]
mod encryption;
mod error;
pub mod inspect;
mod load;
mod loaded;
pub mod memory;
pub mod model;
mod options;
mod plan;
pub mod pt;
pub mod sample;
mod save;
pub mod select;
pub mod size;
mod to_device;

#[cfg(feature = "cache")]
pub use backend::with_env_cache;
pub use backend::{storage_for, ReadInfo};
pub use background::{default_snapshot_pool, save_async, wait_for_saves, SaveHandle, DEFAULT_SNAPSHOTS};
pub use error::{Error, Result};
pub use load::{load, read_all, read_header_of, read_into, read_prefix};
pub use loaded::{CacheUse, Held, LoadReport, LoadedFile, TensorView};
pub use model::{
    load_model, save_model_dir, save_model_dir_grouped, LoadedModel, ModelFiles, ModelReport, ModelSaveReport,
};
pub use options::{parse_direct, CachePolicy, DirectIo, LoadMode, LoadOptions, SaveOptions};
pub use pt::{load_pt, LoadedPt, PtView};
pub use save::{
    save, save_from_device, save_with, write_at, write_bytes, write_source, DeviceTensor, SaveReport, SaveTensor,
    TensorData,
};
pub use select::Selection;

pub use turboio_device as device;
pub use turboio_format as format;
pub use turboio_format::{Dtype, Header, TensorInfo, TensorSpec};
pub use turboio_storage as storage;

/// The node-local cache for remote objects (`TURBOIO_CACHE_DIR`): a [`storage::Storage`]
/// wrapper, [`cache::CacheStorage`], and the directory's listing and pruning, [`cache::NodeCache`].
#[cfg(feature = "cache")]
pub use turboio_cache as cache;
/// The object-storage backend (`s3://`, `gs://`, `az://`, `http(s)://`), to give explicit
/// options: `LoadOptions { storage: Some(Arc::new(object::ObjectStorage::new(options))), .. }`.
#[cfg(feature = "object")]
pub use turboio_io_object as object;

#[cfg(feature = "posix")]
pub use turboio_io_posix as posix;
#[cfg(feature = "sfcs")]
pub use turboio_io_sfcs as sfcs;

#[cfg(feature = "gds")]
pub use turboio_io_gds as gds;

/// The book's Rust examples, compiled as doc-tests (`cargo test --doc`), so that they cannot rot.
#[cfg(doctest)]
mod book {
    #[doc = include_str!("../../../docs/src/crates.md")]
    mod crates {}
    #[doc = include_str!("../../../docs/src/dtype.md")]
    mod dtype {}
    #[doc = include_str!("../../../docs/src/selections.md")]
    mod selections {}
}

#[cfg(test)]
mod layers {
    /// The load path's modules, each with the ones it may call (see "Inside" above).
    const LAYERS: &[(&str, &str, &[&str])] = &[
        ("model", include_str!("model.rs"), &["load", "plan", "cast", "to_device", "select", "size"]),
        ("load", include_str!("load.rs"), &["plan", "cast", "to_device", "select", "size"]),
        ("cast", include_str!("cast.rs"), &["select", "size"]),
        ("plan", include_str!("plan.rs"), &["to_device", "select", "size"]),
        ("to_device", include_str!("to_device.rs"), &["select", "size"]),
        ("select", include_str!("select.rs"), &["size"]),
        ("size", include_str!("size.rs"), &[]),
    ];

    /// The load-path modules `source` names in code (comments left out): `crate::m::...` and
    /// `use crate::{m, ...}` / `use crate::{m::x, ...}`.
    fn calls(source: &str) -> std::collections::BTreeSet<&'static str> {
        let code: String = source.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
        let mut named = std::collections::BTreeSet::new();
        for (module, _, _) in LAYERS {
            let direct = format!("crate::{module}::");
            let grouped = |sep: &str| {
                code.match_indices("crate::{").any(|(at, _)| {
                    let group = &code[at..at + code[at..].find('}').unwrap_or(0)];
                    group.split(['{', ',', ' ', '\n']).any(|w| w == *module || w.starts_with(&format!("{module}{sep}")))
                })
            };
            if code.contains(&direct) || code.contains(&format!("use crate::{module};")) || grouped("::") {
                named.insert(*module);
            }
        }
        named
    }

    #[test]
    fn the_load_path_calls_only_downward() {
        for (module, source, allowed) in LAYERS {
            for called in calls(source) {
                assert!(
                    called == *module || allowed.contains(&called),
                    "`{module}` calls `{called}`, which is not below it: the load path's stages call only downward"
                );
            }
        }
    }

    #[test]
    fn the_check_sees_each_way_of_naming_a_module() {
        assert!(calls("use crate::plan::{open, io_options};").contains("plan"));
        assert!(calls("let x = crate::cast::cast_loaded(s);").contains("cast"));
        assert!(calls("use crate::{model::parse, Error};").contains("model"));
        assert!(calls("use crate::{Error,\n    load};").contains("load"));
        assert!(calls("use crate::size;").contains("size"));
        assert!(calls("// crate::model::x in a comment\nuse crate::Error;").is_empty());
    }
}
