//! The staging engine against the performance model of a GPU (`ModelDevice`): a steady-state
//! load (the second load in a process, the next shard of a model) pins nothing and creates no
//! event, and a load decides its file's page-cache state once, however many chunks it reads.
//!
//! One test in this binary: the residency probes it counts are process-wide.

use std::path::Path;
use std::sync::Arc;
use turboio::device::testing::{GpuModel, ModelDevice};
use turboio::device::Device;
use turboio::{CachePolicy, Dtype, LoadMode, LoadOptions, SaveOptions, SaveTensor};
use turboio_tests::{bytes, disk_dir};

const CHUNK: usize = 1 << 20;

fn evict(path: &Path) {
    turboio::posix::PosixStorage::new().open_posix(path).unwrap().evict_cache().unwrap();
}

#[test]
fn steady_state_loads_pin_nothing_and_decide_once() {
    let d = disk_dir();
    let file = d.path().join("one.safetensors");
    turboio::sample::write_sample(&file, 12 << 20, 3, &SaveOptions::default()).unwrap();
    // A model of three shards.
    let names: Vec<String> = (0..6).map(|i| format!("layers.{i}.weight")).collect();
    let data: Vec<Vec<u8>> = (0..6).map(|i| bytes(3 << 20, i)).collect();
    const SHAPE: [usize; 1] = [(3 << 20) / 4];
    let views: Vec<SaveTensor<'_>> = names
        .iter()
        .zip(&data)
        .map(|(n, d)| SaveTensor { name: n, dtype: Dtype::F32, shape: &SHAPE, data: d })
        .collect();
    let model = d.path().join("model");
    turboio::save_model_dir(&model, &views, None, 6 << 20, &SaveOptions::default()).unwrap();

    let dev = Arc::new(ModelDevice::new(0, GpuModel::default()));
    let opts = |cache| LoadOptions {
        device: Some(dev.clone() as Arc<dyn Device>),
        staging_chunk: CHUNK,
        threads: 2,
        mode: LoadMode::Copied,
        cache,
        ..Default::default()
    };
    let load = |cache, label: &str| {
        let before = dev.counters();
        let probes = turboio::posix::residency_probes();
        let loaded = turboio::load(&file, &opts(cache)).unwrap();
        let c = dev.counters().since(&before);
        let probes = turboio::posix::residency_probes() - probes;
        assert_eq!(c.uploaded_bytes, loaded.report().bytes, "{label}: every byte went through the link");
        assert!(c.uploads >= 12, "{label}: {} chunks of 1 MiB", c.uploads);
        assert!(probes <= 2, "{label}: {probes} residency probes for {} chunks: decided per chunk", c.uploads);
        (c, loaded.report().read.method)
    };

    // A new process's first load pins its slots (two readers, two slots each).
    evict(&file);
    let (first, method) = load(CachePolicy::Keep, "first, cold");
    assert!(method.contains("read-ahead cursor"), "a cold load kept in the page cache: {method}");
    assert_eq!(first.pinned_allocations, 4, "two readers, two slots each: {first:?}");
    assert_eq!(first.pinned_bytes, 4 * CHUNK as u64);
    assert_eq!(first.events_created, 4, "one event per slot: {first:?}");
    let pool = dev.staging_pool().unwrap();
    assert_eq!(pool.free_buffers() as u64, first.pinned_allocations, "every slot came back to the pool");

    // Every later load: hot, cold kept, cold bypassing the cache; nothing pinned, no new event.
    // Bypassing the cache, the storage's io_uring reads into the slots where there is one.
    let uring = if turboio::posix::io_uring_available() { "O_DIRECT io_uring" } else { "O_DIRECT" };
    for (label, cache, evicted, want) in [
        ("hot", CachePolicy::Keep, false, "hot"),
        ("cold, kept", CachePolicy::Keep, true, "read-ahead cursor"),
        ("cold, bypass", CachePolicy::Bypass, true, uring),
        ("cold, bypass again", CachePolicy::Bypass, true, uring),
    ] {
        let registrations = turboio::posix::slot_registrations();
        if evicted {
            evict(&file);
        }
        let (c, method) = load(cache, label);
        assert!(method.contains(want), "{label}: {method}");
        assert_eq!((c.pinned_allocations, c.pinned_bytes), (0, 0), "{label}: a steady-state load pins nothing");
        assert_eq!(c.events_created, 0, "{label}: events are reused");
        assert_eq!(c.synchronizations, 0, "{label}: every transfer was waited for; no device-wide wait");
        if label == "cold, bypass again" {
            assert_eq!(
                turboio::posix::slot_registrations(),
                registrations,
                "{label}: the slots were registered with io_uring by the load before"
            );
        }
    }

    // A model, shard after shard: only slots the pool lacks are pinned (none: the same chunk).
    for label in ["model", "model again"] {
        let before = dev.counters();
        let probes = turboio::posix::residency_probes();
        let m = turboio::load_model(&model, &opts(CachePolicy::Keep)).unwrap();
        let c = dev.counters().since(&before);
        let probes = turboio::posix::residency_probes() - probes;
        assert_eq!(m.shards().len(), 3, "{label}");
        // The tensors' bytes (and the few bytes of padding each shard's data section may have).
        assert!((18 << 20..(18 << 20) + 3 * 4096).contains(&c.uploaded_bytes), "{label}: {c:?}");
        assert_eq!((c.pinned_allocations, c.events_created), (0, 0), "{label}: shards load back to back: {c:?}");
        assert!(probes <= 6, "{label}: {probes} probes for 3 shards of 6 chunks");
    }
    assert_eq!(pool.allocations() as u64, first.pinned_allocations, "no slot was ever pinned again");

    // A new process's first load pins exactly the slots the next load holds at once, however
    // its readers are timed: a reader that ends early keeps its slots until the fill is done
    // (handed to a late reader, they left the pool one slot short, and the second load of
    // some processes pinned again), and a reader without a share of the slots reads nothing.
    for threads in [2, 3, 4, 8] {
        for round in 0..6 {
            let dev = Arc::new(ModelDevice::new(0, GpuModel::default()));
            let opts = LoadOptions { device: Some(dev.clone() as Arc<dyn Device>), threads, ..opts(CachePolicy::Keep) };
            let mut pinned = Vec::new();
            for _ in 0..3 {
                let before = dev.counters();
                turboio::load(&file, &opts).unwrap();
                pinned.push(dev.counters().since(&before).pinned_allocations);
            }
            let pool = dev.staging_pool().unwrap();
            assert!(pinned[0] > 0, "{threads} readers, round {round}: the first load pins the slots");
            assert_eq!(pinned[1..], [0, 0], "{threads} readers, round {round}: later loads pin nothing: {pinned:?}");
            assert_eq!(pool.allocations() as u64, pinned[0], "{threads} readers, round {round}");
        }
    }
}
