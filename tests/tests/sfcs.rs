//! Checkpoints on SFCS through the orchestrator, over the fake libcloudfs: saves and loads,
//! encrypted files that interoperate with local ones, and `sfcs://` routing.

#[path = "../../crates/io-sfcs/tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use support::{in_child, Cluster};
use turboio::crypt::{Encryption, Iv, Key, Keys};
use turboio::{Error, LoadMode, LoadOptions, SaveOptions};

fn fixed() -> Encryption {
    Encryption::new(Keys::Fixed { key: Key::new(b"abcdefgh12345678").unwrap(), iv: Iv(*b"1234567887654321") })
}

fn sfcs(p: &Path) -> PathBuf {
    PathBuf::from(format!("sfcs:/{}", p.display()))
}

fn same(a: &turboio::LoadedFile, b: &turboio::LoadedFile) {
    assert_eq!(a.len(), b.len());
    for t in a.tensors() {
        assert_eq!(a.to_host(t.name()).unwrap(), b.to_host(t.name()).unwrap(), "{}", t.name());
    }
}

#[test]
fn save_and_load_through_sfcs_with_and_without_encryption() {
    let c = Cluster::new();
    let storage: Arc<dyn turboio::storage::Storage> = Arc::new(c.storage());
    let dir = c.scratch("orchestrator");
    let local = dir.join("local.safetensors");
    turboio::sample::write_sample(&local, 5 << 20, 3, &SaveOptions::default()).unwrap();
    let reference = turboio::load(&local, &LoadOptions::default()).unwrap();
    for enc in [None, Some(fixed())] {
        let remote = sfcs(&dir.join("remote.safetensors"));
        let save =
            SaveOptions { storage: Some(storage.clone()), threads: 3, encryption: enc.clone(), ..Default::default() };
        turboio::sample::write_sample(&remote, 5 << 20, 3, &save).unwrap();
        let load =
            LoadOptions { storage: Some(storage.clone()), threads: 3, encryption: enc.clone(), ..Default::default() };
        let loaded = turboio::load(&remote, &load).unwrap();
        assert_eq!(loaded.path(), remote.as_path());
        same(&reference, &loaded);
        // Mapping needs a local file: a clear error, not a wrong answer.
        let err = turboio::load(&remote, &LoadOptions { mode: LoadMode::Mapped, ..load.clone() }).unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
    }
}

#[test]
fn encrypted_files_interoperate_with_local_ones() {
    let c = Cluster::new();
    let storage: Arc<dyn turboio::storage::Storage> = Arc::new(c.storage());
    let dir = c.scratch("interop");
    // The fake serves SFCS path P from local path P, so the same bytes are seen both ways.
    let written_locally = dir.join("a.safetensors");
    let enc_save = SaveOptions { encryption: Some(fixed()), ..Default::default() };
    turboio::sample::write_sample(&written_locally, 3 << 20, 5, &enc_save).unwrap();
    let via_sfcs = LoadOptions { storage: Some(storage.clone()), encryption: Some(fixed()), ..Default::default() };
    let a = turboio::load(sfcs(&written_locally), &via_sfcs).unwrap();
    let written_via_sfcs = dir.join("b.safetensors");
    let save = SaveOptions { storage: Some(storage.clone()), encryption: Some(fixed()), ..Default::default() };
    turboio::sample::write_sample(sfcs(&written_via_sfcs), 3 << 20, 5, &save).unwrap();
    assert_eq!(std::fs::read(&written_locally).unwrap(), std::fs::read(&written_via_sfcs).unwrap());
    let b = turboio::load(&written_via_sfcs, &LoadOptions { encryption: Some(fixed()), ..Default::default() }).unwrap();
    same(&a, &b);
}

#[test]
fn sfcs_paths_route_to_the_sfcs_backend() {
    let c = Cluster::new();
    let extra: Vec<(String, String)> = c.vars.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let extra: Vec<(&str, &str)> = extra.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    if !in_child("sfcs_paths_route_to_the_sfcs_backend", "", &extra) {
        return;
    }
    let dir = c.scratch("routing");
    let path = sfcs(&dir.join("m.safetensors"));
    let (storage, _) = turboio::storage_for(&path).unwrap();
    assert_eq!(storage.name(), "sfcs");
    assert_eq!(turboio::storage_for(&dir.join("m.safetensors")).unwrap().0.name(), "posix");
    turboio::sample::write_sample(&path, 1 << 20, 1, &SaveOptions::default()).unwrap();
    let loaded = turboio::load(&path, &LoadOptions::default()).unwrap();
    let local = turboio::load(dir.join("m.safetensors"), &LoadOptions::default()).unwrap();
    same(&local, &loaded);
    assert_eq!(loaded.report().read.method, "storage");
    let err = turboio::load(sfcs(&dir.join("missing.safetensors")), &LoadOptions::default()).unwrap_err();
    assert!(err.is_not_found(), "{err:?}");
}

#[test]
fn without_the_library_an_sfcs_path_names_libcfs_path() {
    if !in_child(
        "without_the_library_an_sfcs_path_names_libcfs_path",
        "",
        &[("LIBCFS_PATH", "/nonexistent/libcloudfs.so")],
    ) {
        return;
    }
    let err = turboio::load("sfcs://models/m.safetensors", &LoadOptions::default()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("sfcs://models/m.safetensors: "), "{msg}");
    assert!(msg.contains("LIBCFS_PATH=/nonexistent/libcloudfs.so"), "{msg}");
    let err = turboio::sample::write_sample(Path::new("sfcs://models/m.safetensors"), 1000, 1, &SaveOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("LIBCFS_PATH=/nonexistent/libcloudfs.so"), "{err}");
    // Local paths are unaffected.
    let d = tempfile::tempdir().unwrap();
    turboio::sample::write_sample(d.path().join("x.safetensors"), 1000, 1, &SaveOptions::default()).unwrap();
}
