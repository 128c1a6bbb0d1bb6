//! Loading some of the tensors (`LoadOptions::tensors`): only their bytes are read, in every
//! mode, onto the CPU and a device, encrypted or not, converted or not, from files and models;
//! a pattern that matches nothing is an error that names the closest tensors.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use turboio::crypt::{Encryption, Iv, Key, Keys};
use turboio::device::testing::OpaqueDevice;
use turboio::device::Device;
use turboio::model::INDEX_NAME;
use turboio::{CachePolicy, Dtype, Error, LoadMode, LoadOptions, SaveOptions, SaveTensor, Selection};
use turboio_tests::{bytes, disk_dir};

/// 40 tensors of 64 KiB to 2 MiB (`layers.N.w` and `layers.N.b`), F32.
fn tensors() -> Vec<(String, Vec<usize>, Vec<u8>)> {
    (0..20)
        .flat_map(|i| {
            let w =
                (format!("layers.{i}.w"), vec![128, 1024 * (1 + i % 4)], bytes(128 * 1024 * (1 + i % 4) * 4, i as u64));
            let b = (format!("layers.{i}.b"), vec![16384], bytes(16384 * 4, 100 + i as u64));
            [w, b]
        })
        .collect()
}

fn views(t: &[(String, Vec<usize>, Vec<u8>)]) -> Vec<SaveTensor<'_>> {
    t.iter().map(|(n, s, d)| SaveTensor { name: n, dtype: Dtype::F32, shape: s, data: d }).collect()
}

fn write(path: &Path, t: &[(String, Vec<usize>, Vec<u8>)], meta: Option<&BTreeMap<String, String>>) {
    turboio::save(path, &views(t), meta, &SaveOptions::default()).unwrap();
}

/// The load holds exactly `names`, each with the file's bytes.
fn assert_holds(f: &turboio::LoadedFile, t: &[(String, Vec<usize>, Vec<u8>)], names: &[&str], what: &str) {
    let mut got: Vec<&str> = f.tensors().map(|v| v.name()).collect();
    got.sort_unstable();
    let mut want = names.to_vec();
    want.sort_unstable();
    assert_eq!(got, want, "{what}");
    for n in names {
        let (_, shape, data) = t.iter().find(|x| x.0 == *n).unwrap();
        let v = f.tensor(n).unwrap();
        assert_eq!(v.shape(), shape.as_slice(), "{what}: {n}");
        assert_eq!(f.to_host(n).unwrap(), *data, "{what}: {n}");
    }
}

fn selected(names: &[&str]) -> LoadOptions {
    LoadOptions { tensors: Some(Selection::names(names.iter().copied())), ..Default::default() }
}

#[test]
fn only_the_selected_tensors_are_read_in_every_cpu_mode() {
    let dir = disk_dir();
    let path = dir.path().join("m.safetensors");
    let t = tensors();
    write(&path, &t, None);
    let file_len = std::fs::metadata(&path).unwrap().len();
    // Two tensors far apart, and a run of neighbours.
    let names = ["layers.1.w", "layers.17.w", "layers.5.b", "layers.6.w", "layers.6.b"];
    let want: u64 = names.iter().map(|n| t.iter().find(|x| x.0 == *n).unwrap().2.len() as u64).sum();
    for mode in [LoadMode::Auto, LoadMode::Mapped, LoadMode::Copied, LoadMode::Lazy] {
        for cache in [CachePolicy::Keep, CachePolicy::Bypass] {
            if cache == CachePolicy::Bypass && mode != LoadMode::Copied {
                continue;
            }
            let progress = Arc::new(AtomicU64::new(0));
            let opts = LoadOptions { mode, cache, progress: Some(progress.clone()), ..selected(&names) };
            let f = turboio::load(&path, &opts).unwrap();
            let what = format!("{mode} {cache}");
            assert_holds(&f, &t, &names, &what);
            let r = f.report();
            if mode != LoadMode::Lazy {
                // The selected bytes, widened to pages and with small gaps read through: far
                // below the file.
                assert!(r.bytes >= want && r.bytes < want + (4 << 20), "{what}: {} bytes for {want}", r.bytes);
                assert!(r.bytes < file_len / 2, "{what}: read {} of {file_len}", r.bytes);
                assert_eq!(progress.load(Ordering::Relaxed), r.bytes, "{what}: progress");
            }
        }
    }
}

#[test]
fn patterns_and_predicates_select_and_aliases_select_their_targets() {
    let dir = disk_dir();
    let path = dir.path().join("m.safetensors");
    let t = tensors();
    let meta = BTreeMap::from([("lm_head.weight".to_owned(), "layers.0.w".to_owned())]);
    write(&path, &t, Some(&meta));
    let glob = Selection::patterns(["layers.1?.b", "layers.[23].w"]).unwrap();
    let f = turboio::load(&path, &LoadOptions { tensors: Some(glob), ..Default::default() }).unwrap();
    let mut want: Vec<String> = (10..20).map(|i| format!("layers.{i}.b")).collect();
    want.extend(["layers.2.w".to_owned(), "layers.3.w".to_owned()]);
    assert_holds(&f, &t, &want.iter().map(String::as_str).collect::<Vec<_>>(), "glob");

    let only_b = Selection::predicate(|n| n.ends_with(".b") && n.starts_with("layers.1."));
    let f = turboio::load(&path, &LoadOptions { tensors: Some(only_b), ..Default::default() }).unwrap();
    assert_holds(&f, &t, &["layers.1.b"], "predicate");

    // The alias resolves, through its target.
    let f = turboio::load(&path, &selected(&["lm_head.weight"])).unwrap();
    assert_holds(&f, &t, &["layers.0.w"], "alias");
    assert_eq!(f.tensor("lm_head.weight").unwrap().name(), "layers.0.w");
}

#[test]
fn a_name_that_matches_nothing_names_the_closest_and_reads_nothing() {
    let dir = disk_dir();
    let path = dir.path().join("m.safetensors");
    write(&path, &tensors(), None);
    let progress = Arc::new(AtomicU64::new(0));
    let opts = LoadOptions { progress: Some(progress.clone()), ..selected(&["layers.1.w", "layers.3.weight"]) };
    let e = turboio::load(&path, &opts).unwrap_err();
    assert!(matches!(e, Error::NoMatch { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.starts_with(&format!("{}: no tensor matches `layers.3.weight`", path.display())), "{msg}");
    assert!(msg.contains("`layers.3.w`"), "{msg}");
    assert_eq!(progress.load(Ordering::Relaxed), 0);
    let bad = Selection::patterns(["layers.[1"]).unwrap_err();
    assert!(bad.contains("layers.[1"), "{bad}");
}

#[test]
fn selected_loads_of_encrypted_files_decrypt_only_what_they_read() {
    let dir = disk_dir();
    let plain = dir.path().join("p.safetensors");
    let enc_path = dir.path().join("e.safetensors");
    let t = tensors();
    write(&plain, &t, None);
    let enc =
        Encryption::new(Keys::Fixed { key: Key::new(b"abcdefgh12345678").unwrap(), iv: Iv(*b"1234567887654321") });
    turboio::crypt::encrypt_file(&plain, &enc_path, &enc, &SaveOptions::default()).unwrap();
    let names = ["layers.3.w", "layers.11.b", "layers.19.w"];
    for cache in [CachePolicy::Keep, CachePolicy::Bypass] {
        let opts = LoadOptions { encryption: Some(enc.clone()), cache, ..selected(&names) };
        let f = turboio::load(&enc_path, &opts).unwrap();
        assert_holds(&f, &t, &names, &format!("encrypted, {cache}"));
    }
}

#[test]
fn selected_loads_onto_a_device_read_each_run_into_place() {
    let dir = disk_dir();
    let path = dir.path().join("m.safetensors");
    let t = tensors();
    write(&path, &t, None);
    let names = ["layers.0.b", "layers.7.w", "layers.8.b", "layers.19.w"];
    let dev = Arc::new(OpaqueDevice::new(0));
    for mode in [LoadMode::Auto, LoadMode::Copied] {
        let opts = LoadOptions {
            mode,
            device: Some(dev.clone() as Arc<dyn Device>),
            staging_chunk: 1 << 20,
            ..selected(&names)
        };
        let f = turboio::load(&path, &opts).unwrap();
        assert_holds(&f, &t, &names, &format!("device {mode}"));
    }
    // Encrypted, decrypted on the device: the scattered runs go through one pipeline (one key
    // for the load), and only their bytes are uploaded and decrypted.
    let enc_path = dir.path().join("e.safetensors");
    let enc =
        Encryption::new(Keys::Fixed { key: Key::new(b"abcdefgh12345678").unwrap(), iv: Iv(*b"1234567887654321") });
    turboio::crypt::encrypt_file(&path, &enc_path, &enc, &SaveOptions::default()).unwrap();
    let dev = Arc::new(OpaqueDevice::new(0).with_decryption());
    let opts = LoadOptions {
        device: Some(dev.clone() as Arc<dyn Device>),
        encryption: Some(enc),
        staging_chunk: 1 << 20,
        ..selected(&names)
    };
    let f = turboio::load(&enc_path, &opts).unwrap();
    assert_holds(&f, &t, &names, "device, encrypted");
    assert_eq!(dev.keys_prepared(), 1, "one pipeline for all the runs");
    let selected_bytes: u64 = names.iter().map(|n| t.iter().find(|x| x.0 == *n).unwrap().2.len() as u64).sum();
    assert_eq!(dev.decrypted_bytes(), dev.uploaded_bytes());
    assert!(
        dev.uploaded_bytes() >= selected_bytes && dev.uploaded_bytes() < selected_bytes + (1 << 20),
        "{} uploaded for {selected_bytes} selected",
        dev.uploaded_bytes()
    );
}

#[test]
fn selected_loads_convert_only_what_they_hold() {
    let dir = disk_dir();
    let path = dir.path().join("m.safetensors");
    let t = tensors();
    write(&path, &t, None);
    let names = ["layers.2.b", "layers.12.w"];
    let f = turboio::load(&path, &LoadOptions { dtype: Some(Dtype::BF16), ..selected(&names) }).unwrap();
    assert_eq!(f.len(), 2);
    for n in names {
        let (_, _, data) = t.iter().find(|x| x.0 == n).unwrap();
        let mut want = vec![0u8; data.len() / 2];
        turboio::format::cast(data, Dtype::F32, Dtype::BF16, &mut want).unwrap();
        assert_eq!(f.tensor(n).unwrap().dtype(), Dtype::BF16);
        assert_eq!(f.to_host(n).unwrap(), want, "{n}");
    }
}

#[test]
fn models_open_only_the_shards_that_hold_selected_tensors() {
    let dir = disk_dir();
    let t = tensors();
    // About 8 shards of ~2 MiB.
    turboio::save_model_dir(dir.path(), &views(&t), None, 2 << 20, &SaveOptions::default()).unwrap();
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join(INDEX_NAME)).unwrap()).unwrap();
    let shard_of = |n: &str| index["weight_map"][n].as_str().unwrap().to_owned();
    let names = ["layers.0.w", "layers.0.b", "layers.1.w"];
    let wanted: std::collections::BTreeSet<String> = names.iter().map(|n| shard_of(n)).collect();
    let all: std::collections::BTreeSet<String> =
        index["weight_map"].as_object().unwrap().values().map(|v| v.as_str().unwrap().to_owned()).collect();
    assert!(wanted.len() < all.len(), "the test needs shards holding nothing selected");
    // Shards holding nothing selected are not even opened: removing them changes nothing.
    for s in all.difference(&wanted) {
        std::fs::remove_file(dir.path().join(s)).unwrap();
    }
    for mode in [LoadMode::Auto, LoadMode::Copied] {
        let m = turboio::load_model(dir.path(), &LoadOptions { mode, ..selected(&names) }).unwrap();
        assert_eq!(m.len(), names.len(), "{mode}");
        assert_eq!(m.shards().len(), wanted.len(), "{mode}");
        for n in names {
            let (_, _, data) = t.iter().find(|x| x.0 == n).unwrap();
            assert_eq!(m.tensor(n).unwrap().bytes().unwrap(), data.as_slice(), "{mode} {n}");
        }
    }
    // A name the model does not hold: the closest names, from the index.
    let e = turboio::load_model(dir.path(), &selected(&["layers.0.weight"])).unwrap_err().to_string();
    assert!(e.contains("no tensor matches `layers.0.weight`") && e.contains("`layers.0.w`"), "{e}");
    assert!(e.contains(INDEX_NAME), "{e}");
}

#[test]
fn models_without_an_index_check_names_across_every_shard() {
    let dir = disk_dir();
    let t = tensors();
    let (a, b) = t.split_at(20);
    write(&dir.path().join("model-a.safetensors"), a, None);
    write(&dir.path().join("model-b.safetensors"), b, None);
    let m = turboio::load_model(dir.path(), &selected(&["layers.15.b"])).unwrap();
    assert_eq!(m.len(), 1);
    assert_eq!(m.shards().len(), 1, "the shard holding nothing selected is dropped");
    let sel = Selection::patterns(["layers.1*.w"]).unwrap();
    let m = turboio::load_model(dir.path(), &LoadOptions { tensors: Some(sel), ..Default::default() }).unwrap();
    assert_eq!(m.len(), 11, "layers.1.w and layers.10-19.w");
    let e = turboio::load_model(dir.path(), &selected(&["layers.15.b", "nope"])).unwrap_err();
    assert!(matches!(e, Error::NoMatch { .. }), "{e:?}");
}

// The memory plan: what a load will hold, checked before anything is allocated.

#[test]
fn a_copy_over_the_host_budget_fails_before_reading_with_the_numbers() {
    let dir = disk_dir();
    let path = dir.path().join("m.safetensors");
    let t = tensors();
    write(&path, &t, None);
    let progress = Arc::new(AtomicU64::new(0));
    let opts = LoadOptions {
        mode: LoadMode::Copied,
        max_host_memory: Some(4 << 20),
        progress: Some(progress.clone()),
        ..Default::default()
    };
    let e = turboio::load(&path, &opts).unwrap_err();
    assert!(matches!(e, Error::WontFit { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("needs") && msg.contains("of host memory") && msg.contains("max_host_memory is 4MiB"),
        "{msg}"
    );
    assert!(msg.contains("a mapped load") && msg.contains("fewer tensors"), "{msg}");
    assert_eq!(progress.load(Ordering::Relaxed), 0, "nothing read");
    // What would fit does: a mapped load holds no copy, a selection a smaller one.
    let mapped = LoadOptions { mode: LoadMode::Mapped, max_host_memory: Some(4 << 20), ..Default::default() };
    assert_eq!(turboio::load(&path, &mapped).unwrap().len(), t.len());
    let few = LoadOptions { max_host_memory: Some(4 << 20), mode: LoadMode::Copied, ..selected(&["layers.3.w"]) };
    assert_holds(&turboio::load(&path, &few).unwrap(), &t, &["layers.3.w"], "selected under the budget");
    // A converting load counts its converted arena.
    let convert = LoadOptions { dtype: Some(Dtype::BF16), max_host_memory: Some(4 << 20), ..Default::default() };
    assert!(matches!(turboio::load(&path, &convert), Err(Error::WontFit { .. })));
}

#[test]
fn a_device_load_that_does_not_fit_allocates_nothing() {
    let dir = disk_dir();
    let path = dir.path().join("m.safetensors");
    let t = tensors();
    write(&path, &t, None);
    let dev = Arc::new(OpaqueDevice::new(0).with_capacity(8 << 20));
    let opts =
        LoadOptions { device: Some(dev.clone() as Arc<dyn Device>), staging_chunk: 1 << 20, ..Default::default() };
    let e = turboio::load(&path, &opts).unwrap_err().to_string();
    assert!(e.contains("memory but") && e.contains("free") && e.contains("fewer tensors"), "{e}");
    assert_eq!(dev.allocated_bytes(), 0);
    let budget = LoadOptions { max_device_memory: Some(1 << 20), ..opts.clone() };
    let e = turboio::load(&path, &LoadOptions { tensors: None, ..budget }).unwrap_err().to_string();
    assert!(e.contains("max_device_memory is"), "{e}");
    // A selection that fits loads.
    let f = turboio::load(&path, &LoadOptions { ..selected(&["layers.0.w", "layers.1.b"]) }).unwrap();
    assert_eq!(f.len(), 2);
    let on_dev = turboio::load(&path, &LoadOptions { tensors: selected(&["layers.0.w"]).tensors, ..opts }).unwrap();
    assert_holds(&on_dev, &t, &["layers.0.w"], "fits on the device");
}

#[test]
fn a_model_is_planned_whole_before_any_shard_is_allocated() {
    let dir = disk_dir();
    let t = tensors();
    turboio::save_model_dir(dir.path(), &views(&t), None, 2 << 20, &SaveOptions::default()).unwrap();
    let total: u64 = t.iter().map(|x| x.2.len() as u64).sum();
    // Room for a few shards, not the model: nothing may be allocated.
    let dev = Arc::new(OpaqueDevice::new(0).with_capacity(total / 2));
    let opts =
        LoadOptions { device: Some(dev.clone() as Arc<dyn Device>), staging_chunk: 1 << 20, ..Default::default() };
    let e = turboio::load_model(dir.path(), &opts).unwrap_err();
    assert!(matches!(e, Error::WontFit { .. }), "{e:?}");
    assert!(e.to_string().contains(INDEX_NAME), "{e}");
    assert_eq!(dev.allocated_bytes(), 0);
    let host = LoadOptions { mode: LoadMode::Copied, max_host_memory: Some(total / 2), ..Default::default() };
    assert!(matches!(turboio::load_model(dir.path(), &host), Err(Error::WontFit { .. })));
    let host = LoadOptions { mode: LoadMode::Copied, max_host_memory: Some(total * 2), ..Default::default() };
    assert_eq!(turboio::load_model(dir.path(), &host).unwrap().len(), t.len());
}
