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
