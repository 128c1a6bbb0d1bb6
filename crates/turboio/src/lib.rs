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
//! 2. The file's page-cache residency is probed (a `mincore` sample, well under a millisecond).
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
//! | `cli` (default) | the `turboio` binary (with `posix`, `cipher`, `cuda`, `gds`, `object`) |
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
//! The orchestrator's modules form no cycle. `backend` picks the [`storage::Storage`] of a path
//! (the one given, the scheme's, else the local file system: every open file is a
//! `Box<dyn StorageFile>`, and a mapping is asked for through its `local_file` capability, never
//! by matching on a backend). `encryption` is the cipher layer (keys, the decrypting layer of an
//! open file, the encrypting write source); [`crypt`] is its public face. `plan` is the load
//! pipeline (open, parse, plan, fill, finish); `cast` is dtype conversion, a stage after it;
//! [`pt`] plugs the `.pt` parser into it; `load` holds the entry points that compose them.
//! `to_device`, [`model`], `save`, `background` and [`convert`] build on those.
#![forbid(unsafe_code)]
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
