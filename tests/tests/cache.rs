//! turboio's loads through the node cache, against a versioned backend of local files: a warm
//! load reads the cached copy while the store is asked whether it is current, and never returns
//! the bytes of a version the store no longer has (the load starts again and reads the new one).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use turboio::cache::{CacheStorage, NodeCache};
use turboio::model::ModelFiles;
use turboio::{load, load_model, Dtype, LoadOptions, SaveOptions, SaveTensor};
use turboio_cache::testing::Versioned;
use turboio_tests::bytes;

type Tensors = Vec<(String, Vec<usize>, Vec<u8>)>;

fn tensors(seed: u64) -> Tensors {
    (0..6).map(|i| (format!("w.{i}"), vec![32, 8 + i], bytes(32 * (8 + i) * 4, seed * 100 + i as u64))).collect()
}

fn views(t: &Tensors) -> Vec<SaveTensor<'_>> {
    t.iter().map(|(n, s, d)| SaveTensor { name: n, dtype: Dtype::F32, shape: s, data: d }).collect()
}

fn setup() -> (tempfile::TempDir, Arc<Versioned>, LoadOptions) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("store")).unwrap();
    let versioned = Arc::new(Versioned::default());
    let cache = CacheStorage::new(versioned.clone(), NodeCache::new(dir.path().join("cache")));
    let opts = LoadOptions { storage: Some(Arc::new(cache)), ..Default::default() };
    (dir, versioned, opts)
}

#[test]
fn a_warm_load_of_a_replaced_file_returns_the_new_version() {
    let (dir, versioned, opts) = setup();
    let path = dir.path().join("store/w.safetensors");
    let first = tensors(1);
    turboio::save(&path, &views(&first), None, &SaveOptions::default()).unwrap();
    let check = |want: &Tensors| {
        let loaded = load(&path, &opts).unwrap();
        for (n, _, d) in want {
            assert_eq!(loaded.tensor(n).unwrap().bytes().unwrap(), d.as_slice(), "{n}");
        }
    };
    check(&first); // fills the cache
    check(&first); // warm: the entry, checked by one HEAD
    assert_eq!(versioned.heads.load(Ordering::Relaxed), 2, "one HEAD per load");

    // Replaced in the store (same names and shapes, other bytes): the warm load reads the old
    // copy while it asks, is told the version changed, and loads again: the new bytes.
    let second = tensors(2);
    turboio::save(&path, &views(&second), None, &SaveOptions::default()).unwrap();
    check(&second);
    check(&second);
    // The old version's entry went when the new one was published.
    assert_eq!(turboio::cache::NodeCache::new(dir.path().join("cache")).entries().unwrap().len(), 1);
}

#[test]
fn a_warm_model_load_with_a_replaced_shard_returns_the_new_model() {
    let (dir, versioned, opts) = setup();
    let model = dir.path().join("store/m");
    let first = tensors(1);
    let groups = vec![vec![0, 1], vec![2, 3], vec![4, 5]];
    turboio::model::save_model_dir_grouped(&model, &views(&first), &groups, None, &SaveOptions::default()).unwrap();
    let check = |want: &Tensors| {
        let loaded = load_model(&model, &opts).unwrap();
        assert_eq!(loaded.len(), want.len());
        for (n, _, d) in want {
            assert_eq!(loaded.tensor(n).unwrap().bytes().unwrap(), d.as_slice(), "{n}");
        }
    };
    check(&first);
    check(&first);
    assert_eq!(versioned.heads.load(Ordering::Relaxed), 6, "one HEAD per shard and load");

    // The middle shard rewritten in place with other bytes for its two tensors.
    let shards = ModelFiles::resolve(&model).unwrap().shards;
    let mut second = first.clone();
    for t in &mut second[2..4] {
        t.2 = bytes(t.2.len(), 77);
    }
    turboio::save(&shards[1], &views(&second[2..4].to_vec()), None, &SaveOptions::default()).unwrap();
    check(&second);
    check(&second);
}

#[test]
fn a_load_that_starts_again_counts_its_bytes_once_in_the_progress_counter() {
    let (dir, _versioned, opts) = setup();
    let path = dir.path().join("store/w.safetensors");
    let model = dir.path().join("store/m");
    let groups = vec![vec![0, 1, 2], vec![3, 4, 5]];
    let first = tensors(1);
    turboio::save(&path, &views(&first), None, &SaveOptions::default()).unwrap();
    turboio::model::save_model_dir_grouped(&model, &views(&first), &groups, None, &SaveOptions::default()).unwrap();
    let counted = |what: &dyn Fn(&LoadOptions)| {
        let progress = Arc::new(std::sync::atomic::AtomicU64::new(0));
        what(&LoadOptions { progress: Some(progress.clone()), ..opts.clone() });
        progress.load(Ordering::Relaxed)
    };
    let file = |o: &LoadOptions| drop(load(&path, o).unwrap());
    let whole = |o: &LoadOptions| drop(load_model(&model, o).unwrap());
    // Cold, then warm: what one load of each adds.
    let (file_once, model_once) = (counted(&file), counted(&whole));
    assert!(file_once > 0 && model_once > 0);
    assert_eq!(counted(&file), file_once);
    assert_eq!(counted(&whole), model_once);

    // Replaced (same sizes, other bytes): the warm load reads the stale copy, is told, and
    // loads again; the counter holds one load's bytes, not two.
    let second = tensors(2);
    turboio::save(&path, &views(&second), None, &SaveOptions::default()).unwrap();
    turboio::model::save_model_dir_grouped(&model, &views(&second), &groups, None, &SaveOptions::default()).unwrap();
    let _cold = (counted(&file), counted(&whole)); // the new versions fill the cache
    turboio::save(&path, &views(&first), None, &SaveOptions::default()).unwrap();
    turboio::model::save_model_dir_grouped(&model, &views(&first), &groups, None, &SaveOptions::default()).unwrap();
    assert_eq!(counted(&file), file_once, "a load of a replaced file");
    assert_eq!(counted(&whole), model_once, "a load of a replaced model");
}
