//! The load pipeline on every path and device, with the bytes checked against a plain read.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use turboio::device::testing::OpaqueDevice;
use turboio::device::{ArenaPool, Device};
use turboio::{DirectIo, Dtype, Error, Held, LoadMode, LoadOptions, SaveOptions, SaveTensor, TensorData, TensorSpec};
use turboio_tests::{bytes, disk_dir};

fn sample(dir: &Path, size: u64) -> std::path::PathBuf {
    let path = dir.join("sample.safetensors");
    turboio::sample::write_sample(&path, size, 3, &SaveOptions::default()).unwrap();
    path
}

fn assert_matches_plain_read(loaded: &turboio::LoadedFile, label: &str) {
    let plain = std::fs::read(loaded.path()).unwrap();
    let start = loaded.header().data_start() as usize;
    assert!(loaded.len() > 10, "{label}: sample has many tensors");
    for t in loaded.tensors() {
        let (b, e) = t.info().data_offsets;
        let got = loaded.to_host(t.name()).unwrap();
        assert!(got == plain[start + b..start + e], "{label}: tensor {} differs", t.name());
    }
}

#[test]
fn cpu_paths_load_identical_bytes() {
    let dir = disk_dir();
    let path = sample(dir.path(), 24 << 20);
    // Saves write with O_DIRECT, so a new file is not in the page cache: read it once.
    drop(std::fs::read(&path).unwrap());
    let pool = ArenaPool::new(1);
    for mode in [LoadMode::Auto, LoadMode::Mapped, LoadMode::Copied, LoadMode::Lazy] {
        for direct in [DirectIo::Auto, DirectIo::On, DirectIo::Off] {
            for threads in [1, 2, 3] {
                for arenas in [None, Some(pool.clone())] {
                    let label = format!("{mode} direct={direct:?} threads={threads} pooled={}", arenas.is_some());
                    let opts = LoadOptions { mode, direct, threads, arenas, ..Default::default() };
                    let loaded = turboio::load(&path, &opts).unwrap_or_else(|e| panic!("{label}: {e}"));
                    let expect_held = match (mode, direct) {
                        (LoadMode::Mapped | LoadMode::Lazy, _) => Held::Mapped,
                        (LoadMode::Copied, _) | (LoadMode::Auto, DirectIo::On) => Held::Copied,
                        // Read just before: the file is in the page cache.
                        (LoadMode::Auto, _) => Held::Mapped,
                    };
                    assert_eq!(loaded.report().held, expect_held, "{label}");
                    if loaded.report().held == Held::Copied && direct == DirectIo::On {
                        assert!(loaded.report().read.direct, "{label}: O_DIRECT on ext4");
                    }
                    assert_matches_plain_read(&loaded, &label);
                }
            }
        }
    }
}

#[test]
fn auto_maps_hot_files_and_copies_cold_ones() {
    let dir = disk_dir();
    let path = sample(dir.path(), 16 << 20);
    drop(std::fs::read(&path).unwrap());
    let hot = turboio::load(&path, &LoadOptions::default()).unwrap();
    assert_eq!(hot.report().held, Held::Mapped);
    assert!(hot.report().cached_fraction.unwrap() >= turboio::MAPPED_THRESHOLD);
    drop(hot);
    let file = turboio::posix::PosixStorage::new().open_posix(&path).unwrap();
    file.evict_cache().unwrap();
    let after = turboio::storage::StorageFile::cached_fraction(&file).unwrap();
    if after >= turboio::MAPPED_THRESHOLD {
        eprintln!("skipped: the page cache kept {after:.2} of the file after POSIX_FADV_DONTNEED");
        return;
    }
    let cold = turboio::load(&path, &LoadOptions::default()).unwrap();
    assert_eq!(cold.report().held, Held::Copied);
    assert!(cold.report().read.direct, "cold files are read with O_DIRECT");
    assert_matches_plain_read(&cold, "cold auto");
}

#[test]
fn lazy_loads_read_nothing_up_front() {
    let dir = disk_dir();
    let path = sample(dir.path(), 8 << 20);
    let lazy = turboio::load(&path, &LoadOptions { mode: LoadMode::Lazy, ..Default::default() }).unwrap();
    assert_eq!(lazy.report().bytes, 0);
    assert_eq!(lazy.report().read.method, "mmap, lazy");
    assert_matches_plain_read(&lazy, "lazy");
}

#[test]
fn pooled_arenas_are_reused() {
    let dir = disk_dir();
    let path = sample(dir.path(), 8 << 20);
    let pool = ArenaPool::new(1);
    let opts = LoadOptions { mode: LoadMode::Copied, arenas: Some(pool.clone()), ..Default::default() };
    let first = turboio::load(&path, &opts).unwrap();
    assert!(!first.report().arena_reused);
    let addr = first.memory().address();
    drop(first);
    assert_eq!(pool.free_arenas(), 1);
    let second = turboio::load(&path, &opts).unwrap();
    assert!(second.report().arena_reused);
    assert_eq!(second.memory().address(), addr);
    assert_matches_plain_read(&second, "reused arena");
    // While the second load is alive the arena is not free: a third load maps its own.
    let third = turboio::load(&path, &opts).unwrap();
    assert_ne!(third.memory().address(), addr);
}

#[test]
fn staged_device_loads_identical_bytes() {
    let dir = disk_dir();
    let path = sample(dir.path(), 24 << 20);
    for (chunk, threads) in [(0, 0), (4096, 2), (1 << 20, 1), ((3 << 20) + 5, 3)] {
        let dev = Arc::new(OpaqueDevice::new(1));
        let opts = LoadOptions {
            device: Some(dev.clone() as Arc<dyn Device>),
            staging_chunk: chunk,
            threads,
            ..Default::default()
        };
        let loaded = turboio::load(&path, &opts).unwrap();
        assert_eq!(loaded.report().held, Held::Staged);
        assert!(loaded.memory().host().is_none(), "device memory is opaque");
        assert!(loaded.tensors().all(|t| t.bytes().is_none()));
        assert!(dev.uploads() >= 1);
        assert_matches_plain_read(&loaded, &format!("staged chunk={chunk} threads={threads}"));
        drop(loaded);
        assert_eq!(dev.live_allocations(), 0, "device memory freed with the load");
    }
}

#[test]
fn a_failing_device_copy_fails_the_load_and_frees_memory() {
    let dir = disk_dir();
    let path = sample(dir.path(), 8 << 20);
    let dev = Arc::new(OpaqueDevice::new(0));
    dev.fail_after_bytes(3 << 20);
    let opts =
        LoadOptions { device: Some(dev.clone() as Arc<dyn Device>), staging_chunk: 1 << 20, ..Default::default() };
    let err = turboio::load(&path, &opts).unwrap_err();
    assert!(err.to_string().contains("injected copy failure"), "{err}");
    assert!(err.to_string().contains("sample.safetensors"), "names the file: {err}");
    assert_eq!(dev.live_allocations(), 0);
}

#[test]
fn cancelled_loads_return_nothing() {
    let dir = disk_dir();
    let path = sample(dir.path(), 8 << 20);
    for mode in [LoadMode::Mapped, LoadMode::Copied] {
        let opts = LoadOptions { mode, cancel: Some(Arc::new(AtomicBool::new(true))), ..Default::default() };
        let err = turboio::load(&path, &opts).unwrap_err();
        assert!(matches!(err, Error::Cancelled { .. }), "{mode}: {err:?}");
    }
    let dev = Arc::new(OpaqueDevice::new(0));
    let opts = LoadOptions {
        device: Some(dev.clone() as Arc<dyn Device>),
        cancel: Some(Arc::new(AtomicBool::new(true))),
        ..Default::default()
    };
    assert!(matches!(turboio::load(&path, &opts), Err(Error::Cancelled { .. })));
    assert_eq!(dev.live_allocations(), 0);
}

#[test]
fn aliases_in_metadata_resolve() {
    let dir = disk_dir();
    let path = dir.path().join("alias.safetensors");
    let w = bytes(24, 1);
    let meta = BTreeMap::from([
        ("lm_head.weight".to_string(), "embed.weight".to_string()),
        ("format".to_string(), "pt".to_string()),
        ("dangling".to_string(), "no_such_tensor".to_string()),
    ]);
    turboio::save(
        &path,
        &[SaveTensor { name: "embed.weight", dtype: Dtype::F32, shape: &[2, 3], data: &w }],
        Some(&meta),
        &SaveOptions::default(),
    )
    .unwrap();
    let loaded = turboio::load(&path, &LoadOptions::default()).unwrap();
    assert_eq!(loaded.aliases(), vec![("lm_head.weight", "embed.weight")]);
    let a = loaded.tensor("lm_head.weight").unwrap();
    assert_eq!(a.name(), "embed.weight");
    assert_eq!(a.bytes().unwrap(), &w[..]);
    assert!(loaded.tensor("dangling").is_none());
    assert!(loaded.tensor("format").is_none());
}

#[test]
fn loaded_tensors_are_writable_without_touching_the_file() {
    let dir = disk_dir();
    let path = sample(dir.path(), 4 << 20);
    let before = std::fs::read(&path).unwrap();
    for mode in [LoadMode::Mapped, LoadMode::Copied] {
        let mut loaded = turboio::load(&path, &LoadOptions { mode, ..Default::default() }).unwrap();
        let name = loaded.tensors().next().unwrap().name().to_owned();
        let t = loaded.tensor_bytes_mut(&name).unwrap();
        t.fill(0x42);
        assert!(loaded.tensor(&name).unwrap().bytes().unwrap().iter().all(|&b| b == 0x42));
    }
    assert!(std::fs::read(&path).unwrap() == before, "the file on disk is unchanged");
}

/// Saving from memory the CPU cannot address: bytes are pulled through the device's copy calls.
struct DeviceTensors<'a> {
    device: &'a OpaqueDevice,
    loaded: &'a turboio::LoadedFile,
    names: Vec<String>,
}

impl TensorData for DeviceTensors<'_> {
    fn fill(&self, index: usize, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        let t = self.loaded.tensor(&self.names[index]).ok_or("missing")?;
        self.device.download(self.loaded.memory(), t.offset_in_memory() + offset, dst).map_err(|e| e.to_string())
    }
}

#[test]
fn save_from_device_memory_round_trips() {
    let dir = disk_dir();
    let path = sample(dir.path(), 6 << 20);
    let dev = Arc::new(OpaqueDevice::new(0));
    let loaded =
        turboio::load(&path, &LoadOptions { device: Some(dev.clone() as Arc<dyn Device>), ..Default::default() })
            .unwrap();
    let specs: Vec<TensorSpec<'_>> = loaded
        .tensors()
        .map(|t| TensorSpec { name: t.name(), dtype: t.dtype(), shape: t.shape(), data_len: t.len() })
        .collect();
    let data =
        DeviceTensors { device: &dev, loaded: &loaded, names: loaded.tensors().map(|t| t.name().to_owned()).collect() };
    let out = dir.path().join("copy.safetensors");
    turboio::save_with(&out, &specs, loaded.metadata(), &data, &SaveOptions::default()).unwrap();
    assert!(std::fs::read(&out).unwrap() == std::fs::read(&path).unwrap(), "device round trip is byte-identical");
}
