//! Saves are atomic: an error at any point leaves the previous file intact and no temporary
//! file; a file replaced while mapped keeps the mapping valid.

use std::path::Path;
use std::process::Command;
use turboio::{Dtype, LoadMode, LoadOptions, SaveOptions, SaveTensor};
use turboio_tests::{bytes, disk_dir};

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn a_tensor_with_short_bytes_changes_nothing() {
    let d = disk_dir();
    let path = d.path().join("model.safetensors");
    turboio::sample::write_sample(&path, 2 << 20, 1, &SaveOptions::default()).unwrap();
    let old = std::fs::read(&path).unwrap();
    let before = listing(d.path());
    let data = bytes(10, 1);
    let err = turboio::save(
        &path,
        &[SaveTensor { name: "w", dtype: Dtype::F32, shape: &[3], data: &data }],
        None,
        &SaveOptions::default(),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("model.safetensors") && msg.contains("`w`") && msg.contains("need 12 bytes"), "{msg}");
    assert!(std::fs::read(&path).unwrap() == old);
    assert_eq!(listing(d.path()), before);
}

#[test]
fn a_full_disk_changes_nothing() {
    let d = disk_dir();
    let mnt = d.path().join("small");
    std::fs::create_dir(&mnt).unwrap();
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=8m", "tmpfs"])
        .arg(&mnt)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: cannot mount a small tmpfs here (not root?)");
        return;
    }
    let result = std::panic::catch_unwind(|| {
        let path = mnt.join("model.safetensors");
        turboio::sample::write_sample(&path, 3 << 20, 1, &SaveOptions::default()).unwrap();
        let old = std::fs::read(&path).unwrap();
        let before = listing(&mnt);
        let err = turboio::sample::write_sample(&path, 6 << 20, 2, &SaveOptions::default()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("model.safetensors"), "{msg}");
        assert!(std::fs::read(&path).unwrap() == old, "the previous file is intact");
        assert_eq!(listing(&mnt), before, "no temporary file is left");
    });
    let _ = Command::new("umount").arg(&mnt).status();
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

#[test]
fn replacing_a_mapped_file_keeps_the_mapping_valid() {
    let d = disk_dir();
    let path = d.path().join("model.safetensors");
    turboio::sample::write_sample(&path, 4 << 20, 1, &SaveOptions::default()).unwrap();
    let old = std::fs::read(&path).unwrap();
    let loaded = turboio::load(&path, &LoadOptions { mode: LoadMode::Mapped, ..Default::default() }).unwrap();
    // Overwrite with a smaller file: an in-place truncation would make the mapping raise SIGBUS.
    let data = bytes(16, 3);
    turboio::save(
        &path,
        &[SaveTensor { name: "x", dtype: Dtype::U8, shape: &[16], data: &data }],
        None,
        &SaveOptions::default(),
    )
    .unwrap();
    let start = loaded.header().data_start() as usize;
    for t in loaded.tensors() {
        let (b, e) = t.info().data_offsets;
        assert!(t.bytes().unwrap() == &old[start + b..start + e]);
    }
    assert_eq!(turboio::load(&path, &LoadOptions::default()).unwrap().len(), 1);
}

/// Saves `data` as one U8 tensor `w`, in the background.
fn save_u8_async(path: &Path, data: &[u8]) -> turboio::Result<turboio::SaveHandle> {
    let len = [data.len()];
    turboio::save_async(
        path,
        &[SaveTensor { name: "w", dtype: Dtype::U8, shape: &len, data }],
        None,
        &SaveOptions::default(),
    )
}

/// `save_async` snapshots the tensors: changing them after it returns does not change the file.
#[test]
fn async_saves_snapshot_the_tensors() {
    let d = disk_dir();
    let path = d.path().join("a.safetensors");
    let mut data = bytes(5 << 20, 7);
    let expect = data.clone();
    let len = [data.len()];
    let handle = turboio::save_async(
        &path,
        &[SaveTensor { name: "w", dtype: Dtype::U8, shape: &len, data: &data }],
        None,
        &SaveOptions::default(),
    )
    .unwrap();
    data.iter_mut().for_each(|b| *b = !*b);
    drop(data);
    handle.wait().unwrap();
    assert!(handle.done());
    assert_eq!(handle.progress().0, handle.progress().1, "every byte written");
    let loaded = turboio::load(&path, &LoadOptions::default()).unwrap();
    assert!(loaded.tensor("w").unwrap().bytes().unwrap() == &expect[..]);
    // Same bytes as a synchronous save.
    let sync = d.path().join("s.safetensors");
    let len = [expect.len()];
    turboio::save(
        &sync,
        &[SaveTensor { name: "w", dtype: Dtype::U8, shape: &len, data: &expect }],
        None,
        &SaveOptions::default(),
    )
    .unwrap();
    assert!(std::fs::read(&sync).unwrap() == std::fs::read(&path).unwrap());
}

/// Saves of one path land in the order asked for: the file ends as the last one.
#[test]
fn async_saves_of_one_path_land_in_order() {
    let d = disk_dir();
    let path = d.path().join("ordered.safetensors");
    let versions: Vec<Vec<u8>> = (0..6).map(|i| bytes((3 << 20) - i * 4096, i as u64 + 1)).collect();
    let handles: Vec<_> = versions.iter().map(|v| save_u8_async(&path, v).unwrap()).collect();
    turboio::wait_for_saves();
    for h in &handles {
        assert!(h.done());
        h.wait().unwrap();
    }
    let loaded = turboio::load(&path, &LoadOptions::default()).unwrap();
    assert!(loaded.tensor("w").unwrap().bytes().unwrap() == &versions[5][..]);
    assert_eq!(listing(d.path()), vec!["ordered.safetensors"]);
}

/// Bad tensors fail in the caller; a failed write comes back from `wait`, old file intact.
#[test]
fn async_save_errors() {
    let d = disk_dir();
    let data = bytes(10, 1);
    let err = turboio::save_async(
        d.path().join("x.safetensors"),
        &[SaveTensor { name: "w", dtype: Dtype::F32, shape: &[3], data: &data }],
        None,
        &SaveOptions::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("need 12 bytes"), "{err}");
    let h = save_u8_async(&d.path().join("missing/x.safetensors"), &data).unwrap();
    let err = h.wait().unwrap_err();
    assert!(err.is_not_found() && err.to_string().contains("missing"), "{err}");
    assert!(h.done());
}
