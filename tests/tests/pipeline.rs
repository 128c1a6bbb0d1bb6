//! The load pipeline on every path and device, with the bytes checked against a plain read.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use turboio::device::testing::OpaqueDevice;
use turboio::device::{ArenaPool, Device};
use turboio::{
    CachePolicy, Dtype, Error, Held, LoadMode, LoadOptions, SaveOptions, SaveTensor, TensorData, TensorSpec,
};
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
        for cache in [CachePolicy::Auto, CachePolicy::Keep, CachePolicy::Bypass] {
            for threads in [1, 2, 3] {
                for arenas in [None, Some(pool.clone())] {
                    let label = format!("{mode} cache={cache} threads={threads} pooled={}", arenas.is_some());
                    let opts = LoadOptions { mode, cache, threads, arenas, ..Default::default() };
                    let result = turboio::load(&path, &opts);
                    if matches!(mode, LoadMode::Mapped | LoadMode::Lazy) && cache == CachePolicy::Bypass {
                        let err = result.expect_err(&label).to_string();
                        assert!(err.contains("cannot bypass") && err.contains("sample.safetensors"), "{label}: {err}");
                        continue;
                    }
                    let loaded = result.unwrap_or_else(|e| panic!("{label}: {e}"));
                    let expect_held = match (mode, cache) {
                        (LoadMode::Mapped | LoadMode::Lazy, _) => Held::Mapped,
                        (LoadMode::Copied, _) | (LoadMode::Auto, CachePolicy::Bypass) => Held::Copied,
                        (LoadMode::Auto, _) => Held::Mapped,
                    };
                    assert_eq!(loaded.report().held, expect_held, "{label}");
                    assert_eq!(loaded.report().cache.kept, cache != CachePolicy::Bypass, "{label}");
                    assert_eq!(loaded.report().read.direct, cache == CachePolicy::Bypass, "{label}: O_DIRECT on ext4");
                    assert_matches_plain_read(&loaded, &label);
                }
            }
        }
    }
}

/// The page-cache residency of `path` (mincore on a file we own sees the page cache).
fn cached(path: &Path) -> f64 {
    let file = turboio::posix::PosixStorage::new().open_posix(path).unwrap();
    turboio::storage::StorageFile::cached_fraction(&file).unwrap()
}

/// Drops `path` from the page cache; false if the kernel kept it (then the test cannot tell).
fn evict(path: &Path) -> bool {
    let file = turboio::posix::PosixStorage::new().open_posix(path).unwrap();
    file.evict_cache().unwrap();
    let after = turboio::storage::StorageFile::cached_fraction(&file).unwrap();
    if after > 0.05 {
        eprintln!("skipped: the page cache kept {after:.2} of the file after POSIX_FADV_DONTNEED");
        return false;
    }
    true
}

#[test]
fn default_loads_leave_the_file_in_the_page_cache() {
    let dir = disk_dir();
    let path = sample(dir.path(), 16 << 20);
    for (label, opts) in [
        ("auto", LoadOptions::default()),
        ("copied", LoadOptions { mode: LoadMode::Copied, ..Default::default() }),
        ("copied, 3 threads", LoadOptions { mode: LoadMode::Copied, threads: 3, ..Default::default() }),
        ("copied, keep", LoadOptions { mode: LoadMode::Copied, cache: CachePolicy::Keep, ..Default::default() }),
    ] {
        if !evict(&path) {
            return;
        }
        let cold = turboio::load(&path, &opts).unwrap();
        assert!(cold.report().cache.kept, "{label}");
        assert!(!cold.report().read.direct, "{label}");
        let reason = if opts.cache == CachePolicy::Keep { "asked for" } else { "default" };
        assert_eq!(cold.report().cache.reason, reason, "{label}");
        assert_matches_plain_read(&cold, label);
        drop(cold);
        let after = cached(&path);
        assert!(after > 0.99, "{label}: only {after:.2} of the file is cached after a cold load");
        let hot = turboio::load(&path, &opts).unwrap();
        assert!(hot.report().cached_fraction.unwrap() > 0.99, "{label}");
    }
}

#[test]
fn bypass_leaves_the_page_cache_as_it_was() {
    let dir = disk_dir();
    let path = sample(dir.path(), 16 << 20);
    for mode in [LoadMode::Auto, LoadMode::Copied] {
        if !evict(&path) {
            return;
        }
        let opts = LoadOptions { mode, cache: CachePolicy::Bypass, ..Default::default() };
        let loaded = turboio::load(&path, &opts).unwrap();
        assert_eq!(loaded.report().held, Held::Copied);
        assert!(!loaded.report().cache.kept);
        assert_eq!(loaded.report().cache.reason, "asked for");
        assert!(loaded.report().read.direct, "O_DIRECT on ext4");
        assert_matches_plain_read(&loaded, "bypass");
        // The check above read the file through the cache: evict it again and load once more.
        drop(loaded);
        if !evict(&path) {
            return;
        }
        drop(turboio::load(&path, &opts).unwrap());
        assert_eq!(cached(&path), 0.0, "{mode}: a bypassing load (header included) cached part of the file");
    }
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

/// Every tensor of a converting load equals the plain bytes converted on their own.
fn assert_converted(loaded: &turboio::LoadedFile, target: Dtype, label: &str) -> usize {
    let plain = std::fs::read(loaded.path()).unwrap();
    let original = turboio::Header::parse(&plain, plain.len() as u64).unwrap();
    let start = original.data_start() as usize;
    let mut converted = 0;
    assert_eq!(loaded.len(), original.len(), "{label}");
    for t in loaded.tensors() {
        let o = original.tensor(t.name()).unwrap();
        let src = &plain[start + o.data_offsets.0..start + o.data_offsets.1];
        let got = loaded.to_host(t.name()).unwrap();
        assert_eq!(t.shape(), o.shape.as_slice(), "{label}: {}", t.name());
        if turboio::format::castable(o.dtype) && o.dtype != target {
            converted += 1;
            assert_eq!(t.dtype(), target, "{label}: {}", t.name());
            let mut want = vec![0u8; got.len()];
            turboio::format::cast(src, o.dtype, target, &mut want).unwrap();
            assert!(got == want, "{label}: tensor {} converted wrongly", t.name());
        } else {
            assert_eq!(t.dtype(), o.dtype, "{label}: {} passes through", t.name());
            assert!(got == src, "{label}: tensor {} changed", t.name());
        }
    }
    converted
}

#[test]
fn converting_loads_convert_every_floating_tensor_on_every_path() {
    let dir = disk_dir();
    let path = sample(dir.path(), 12 << 20);
    let pool = ArenaPool::new(1);
    for target in [Dtype::BF16, Dtype::F16, Dtype::F32, Dtype::F8_E4M3] {
        for (mode, cache) in [
            (LoadMode::Auto, CachePolicy::Auto),
            (LoadMode::Mapped, CachePolicy::Keep),
            (LoadMode::Copied, CachePolicy::Bypass),
            (LoadMode::Lazy, CachePolicy::Auto),
        ] {
            for cold in [false, true] {
                if cold && !evict(&path) {
                    continue;
                }
                let label = format!("{target} {mode} cache={cache} cold={cold}");
                let opts = LoadOptions {
                    mode,
                    cache,
                    threads: 3,
                    dtype: Some(target),
                    arenas: Some(pool.clone()),
                    ..Default::default()
                };
                let loaded = turboio::load(&path, &opts).unwrap_or_else(|e| panic!("{label}: {e}"));
                let n = assert_converted(&loaded, target, &label);
                assert!(n > 0, "{label}: the sample has floating tensors of other dtypes");
                assert_eq!(loaded.report().converted, n, "{label}");
                assert_eq!(loaded.report().held, Held::Copied, "{label}");
            }
        }
    }
    // Onto a device that converts in its own memory: loaded as is, converted by the device.
    let dev = Arc::new(OpaqueDevice::new(1));
    let opts = LoadOptions {
        device: Some(dev.clone() as Arc<dyn Device>),
        dtype: Some(Dtype::F16),
        staging_chunk: (1 << 20) + 3,
        ..Default::default()
    };
    let loaded = turboio::load(&path, &opts).unwrap();
    assert_eq!(loaded.report().held, Held::Staged);
    assert!(loaded.memory().host().is_none());
    assert!(loaded.report().fallbacks.is_empty(), "{:?}", loaded.report().fallbacks);
    assert!(assert_converted(&loaded, Dtype::F16, "device") > 0);
    let data: u64 = loaded.tensors().map(|t| t.len() as u64).sum();
    assert!(dev.cast_elements() > data / 8, "the device converted: {} elements", dev.cast_elements());
    drop(loaded);
    assert_eq!(dev.live_allocations(), 0, "the unconverted load was freed too");
}

#[test]
fn converting_loads_refuse_non_floating_targets_and_skip_needless_copies() {
    let dir = disk_dir();
    let path = dir.path().join("bf16.safetensors");
    let data = bytes(64, 1);
    let ints = bytes(40, 2);
    let tensors = [
        SaveTensor { name: "w", dtype: Dtype::BF16, shape: &[4, 8], data: &data },
        SaveTensor { name: "i", dtype: Dtype::I64, shape: &[5], data: &ints },
    ];
    turboio::save(&path, &tensors, None, &SaveOptions::default()).unwrap();
    let err = turboio::load(&path, &LoadOptions { dtype: Some(Dtype::I32), ..Default::default() }).unwrap_err();
    assert!(err.to_string().contains("bf16.safetensors") && err.to_string().contains("floating"), "{err}");
    // Nothing to convert: the plain (mapped) load, no copy.
    let loaded = turboio::load(&path, &LoadOptions { dtype: Some(Dtype::BF16), ..Default::default() }).unwrap();
    assert_eq!(loaded.report().held, Held::Mapped);
    assert_eq!(loaded.report().converted, 0);
    // A cancelled converting load returns nothing.
    let opts =
        LoadOptions { dtype: Some(Dtype::F32), cancel: Some(Arc::new(AtomicBool::new(true))), ..Default::default() };
    assert!(matches!(turboio::load(&path, &opts), Err(Error::Cancelled { .. })));
    // Whole models convert shard by shard.
    let model = dir.path().join("model");
    turboio::save_model_dir(&model, &tensors, None, 70, &SaveOptions::default()).unwrap();
    let m = turboio::load_model(&model, &LoadOptions { dtype: Some(Dtype::F32), ..Default::default() }).unwrap();
    let w = m.tensor("w").unwrap();
    assert_eq!(w.dtype(), Dtype::F32);
    let mut want = vec![0u8; 128];
    turboio::format::cast(&data, Dtype::BF16, Dtype::F32, &mut want).unwrap();
    assert_eq!(w.bytes().unwrap(), &want[..]);
    assert_eq!(m.tensor("i").unwrap().bytes().unwrap(), &ints[..]);
    // Onto a device that converts: the plain shards through the staging engine, then the
    // device's kernel on each (none on the host), and the unconverted shards freed.
    let dev = Arc::new(OpaqueDevice::new(2));
    let opts =
        LoadOptions { dtype: Some(Dtype::F32), device: Some(dev.clone() as Arc<dyn Device>), ..Default::default() };
    let m = turboio::load_model(&model, &opts).unwrap();
    assert_eq!(m.shards().len(), 2, "one tensor per shard");
    let w = m.tensor("w").unwrap();
    assert_eq!(w.dtype(), Dtype::F32);
    let shard = m.shard_of("w").unwrap();
    assert_eq!(shard.to_host("w").unwrap(), want, "converted on the device");
    assert_eq!(m.shard_of("i").unwrap().to_host("i").unwrap(), ints, "passed through");
    assert_eq!(dev.cast_elements(), 32, "the device converted the 32 bf16 elements");
    assert_eq!(shard.report().converted, 1);
    assert!(m.shards().iter().all(|s| s.report().fallbacks.is_empty()));
    drop(m);
    assert_eq!(dev.live_allocations(), 0, "every shard's memory, converted or not, was freed");
    // A device whose kernel cannot run: converted on the host and placed, and the reports say
    // why; a single file the same.
    let dev = Arc::new(OpaqueDevice::new(3).with_cast_failure("no NVRTC here"));
    let opts = LoadOptions { device: Some(dev.clone() as Arc<dyn Device>), ..opts };
    let m = turboio::load_model(&model, &opts).unwrap();
    assert_eq!(m.shard_of("w").unwrap().to_host("w").unwrap(), want, "converted on the host");
    assert_eq!(m.shard_of("i").unwrap().to_host("i").unwrap(), ints);
    assert_eq!(dev.cast_elements(), 0);
    for s in m.shards() {
        assert!(s.report().fallbacks.iter().any(|f| f.contains("no NVRTC here")), "{:?}", s.report().fallbacks);
    }
    let f = turboio::load(&path, &opts).unwrap();
    assert_eq!(f.to_host("w").unwrap(), want);
    assert!(f.report().fallbacks.iter().any(|f| f.contains("no NVRTC here")), "{:?}", f.report().fallbacks);
    drop((m, f));
    assert_eq!(dev.live_allocations(), 0);
}

#[test]
fn conversions_honour_cache_bypass_for_their_input() {
    let Some(py) = turboio_tests::python() else { return };
    let dir = disk_dir();
    let pt = dir.path().join("in.pt");
    let code = "import sys, torch\ng = torch.Generator().manual_seed(2)\n\
                torch.save({'w': torch.randn(2048, 1024, generator=g), 'b': torch.randn(77, generator=g)}, sys.argv[1])";
    turboio_tests::run_python(&py, code, &[pt.to_str().unwrap()]);
    // Written back, so that its pages can be dropped from the cache.
    std::fs::File::open(&pt).unwrap().sync_all().unwrap();
    for (cache, want_cached) in [(CachePolicy::Bypass, false), (CachePolicy::Keep, true)] {
        if !evict(&pt) {
            return;
        }
        let out = dir.path().join(format!("out-{cache:?}.safetensors"));
        let opts = turboio::convert::ConvertOptions {
            load: LoadOptions { cache, ..Default::default() },
            overwrite: true,
            ..Default::default()
        };
        turboio::convert::convert(&pt, &out, &opts).unwrap();
        let after = cached(&pt);
        if want_cached {
            assert!(after > 0.5, "{cache:?}: the input read through the page cache stays there ({after:.2})");
        } else {
            assert!(after < 0.2, "{cache:?}: the input was read around the page cache ({after:.2} cached)");
        }
        let a = turboio::load(&out, &LoadOptions::default()).unwrap();
        assert_eq!(a.tensor("w").unwrap().bytes().unwrap().len(), 2048 * 1024 * 4);
    }
}
