//! Malformed files: every rejection rule of the format, through the whole loader, gives an
//! error that names the file and the problem; no input makes the loader panic or hang.

use std::path::Path;
use turboio::format::FormatError;
use turboio::{Error, LoadMode, LoadOptions};
use turboio_tests::{bytes, disk_dir};

fn file_with(json: &str, data_len: usize) -> Vec<u8> {
    let mut f = (json.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(json.as_bytes());
    f.extend(std::iter::repeat_n(7u8, data_len));
    f
}

fn load_err(dir: &Path, name: &str, content: &[u8]) -> (Error, String) {
    let path = dir.join(name);
    std::fs::write(&path, content).unwrap();
    for mode in [LoadMode::Auto, LoadMode::Mapped, LoadMode::Copied] {
        let err = turboio::load(&path, &LoadOptions { mode, ..Default::default() }).expect_err(name);
        let msg = err.to_string();
        assert!(msg.contains(name), "the message names the file: {msg}");
        assert!(!msg.contains('\n'), "one line: {msg}");
    }
    let err = turboio::load(&path, &LoadOptions::default()).unwrap_err();
    let msg = err.to_string();
    (err, msg)
}

macro_rules! rejects {
    ($dir:expr, $name:expr, $content:expr, $pat:pat) => {{
        let (err, msg) = load_err($dir, $name, &$content);
        assert!(matches!(err, Error::Format { source: $pat, .. }), "{}: got {err:?}", $name);
        msg
    }};
}

#[test]
fn every_rejection_rule_through_the_loader() {
    let d = disk_dir();
    let dir = d.path();
    rejects!(dir, "empty.safetensors", [], FormatError::HeaderTooSmall { .. });
    rejects!(dir, "seven.safetensors", [1u8; 7], FormatError::HeaderTooSmall { .. });
    rejects!(dir, "huge_n.safetensors", u64::MAX.to_le_bytes(), FormatError::HeaderTooLarge { .. });
    rejects!(dir, "big_n.safetensors", 100_000_001u64.to_le_bytes(), FormatError::HeaderTooLarge { .. });
    let mut short = 100u64.to_le_bytes().to_vec();
    short.extend_from_slice(b"{}");
    rejects!(dir, "short_header.safetensors", short, FormatError::InvalidHeaderLength { .. });
    let mut utf = 8u64.to_le_bytes().to_vec();
    utf.extend_from_slice(&[b'{', 0xFF, 0xFE, b'}', b' ', b' ', b' ', b' ']);
    rejects!(dir, "utf8.safetensors", utf, FormatError::InvalidHeader(_));
    for (i, json) in [
        "{",
        "[]",
        "null",
        "{\"a\":1}",
        "{\"a\":{\"dtype\":\"F33\",\"shape\":[1],\"data_offsets\":[0,4]}}",
        "{\"a\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
        "{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}",
        "{\"__metadata__\":{\"k\":1}}",
        "{\"__metadata__\":{},\"__metadata__\":{}}",
        "{}\0\0\0\0\0\0",
    ]
    .iter()
    .enumerate()
    {
        rejects!(
            dir,
            &format!("json{i}.safetensors"),
            file_with(json, 4),
            FormatError::InvalidHeaderDeserialization(_)
        );
    }
    let msg = rejects!(
        dir,
        "hole.safetensors",
        file_with(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}}"#,
            12
        ),
        FormatError::InvalidOffset { .. }
    );
    assert!(msg.contains("`b`"), "{msg}");
    rejects!(
        dir,
        "overlap.safetensors",
        file_with(
            r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}}"#,
            12
        ),
        FormatError::InvalidOffset { .. }
    );
    rejects!(
        dir,
        "not_zero.safetensors",
        file_with(r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#, 8),
        FormatError::InvalidOffset { .. }
    );
    rejects!(
        dir,
        "backwards.safetensors",
        file_with(
            r#"{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#,
            4
        ),
        FormatError::InvalidOffset { .. }
    );
    rejects!(
        dir,
        "overflow.safetensors",
        file_with(r#"{"a":{"dtype":"U8","shape":[18446744073709551615,2],"data_offsets":[0,4]}}"#, 4),
        FormatError::ValidationOverflow { .. }
    );
    rejects!(
        dir,
        "bits_overflow.safetensors",
        file_with(r#"{"a":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,4]}}"#, 4),
        FormatError::ValidationOverflow { .. }
    );
    rejects!(
        dir,
        "f4_odd.safetensors",
        file_with(r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#, 2),
        FormatError::MisalignedSlice { .. }
    );
    let msg = rejects!(
        dir,
        "size.safetensors",
        file_with(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#, 4),
        FormatError::TensorInvalidInfo { .. }
    );
    assert!(msg.contains("need 8 bytes") && msg.contains("give 4"), "{msg}");
    rejects!(
        dir,
        "trailing.safetensors",
        file_with(r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#, 5),
        FormatError::MetadataIncompleteBuffer { .. }
    );
    let msg = rejects!(
        dir,
        "truncated.safetensors",
        file_with(r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#, 3),
        FormatError::MetadataIncompleteBuffer { .. }
    );
    assert!(msg.contains("incomplete"), "{msg}");
}

#[test]
fn a_missing_file_and_a_directory_are_clear_errors() {
    let d = disk_dir();
    let err = turboio::load(d.path().join("nope.safetensors"), &LoadOptions::default()).unwrap_err();
    assert!(err.is_not_found(), "{err:?}");
    assert!(err.to_string().contains("nope.safetensors"));
    let err = turboio::load(d.path(), &LoadOptions::default()).unwrap_err();
    assert!(err.to_string().contains(&d.path().display().to_string()), "{err}");
}

#[test]
fn mutated_files_never_panic() {
    let d = disk_dir();
    let path = d.path().join("m.safetensors");
    let w = bytes(4096, 5);
    let base_tensors = [
        turboio::SaveTensor { name: "w", dtype: turboio::Dtype::BF16, shape: &[32, 32], data: &w[..2048] },
        turboio::SaveTensor { name: "b", dtype: turboio::Dtype::F32, shape: &[512], data: &w[2048..] },
    ];
    turboio::save(&path, &base_tensors, None, &turboio::SaveOptions::default()).unwrap();
    let base = std::fs::read(&path).unwrap();
    let header_end = 8 + u64::from_le_bytes(base[..8].try_into().unwrap()) as usize;
    let noise = bytes(20_000, 77);
    for i in 0..400usize {
        let mut f = base.clone();
        let r = noise[i * 3] as usize | (noise[i * 3 + 1] as usize) << 8;
        match i % 5 {
            0 => f[r % header_end] = noise[i * 3 + 2],
            1 => f.truncate(r % f.len()),
            2 => f.insert(r % header_end, noise[i * 3 + 2]),
            3 => {
                f.remove(r % header_end);
            }
            _ => f.extend_from_slice(&noise[..r % 64 + 1]),
        }
        std::fs::write(&path, &f).unwrap();
        for mode in [LoadMode::Mapped, LoadMode::Copied] {
            if let Ok(loaded) = turboio::load(&path, &LoadOptions { mode, ..Default::default() }) {
                let start = loaded.header().data_start() as usize;
                for t in loaded.tensors() {
                    let (b, e) = t.info().data_offsets;
                    assert_eq!(t.bytes().unwrap(), &f[start + b..start + e]);
                }
            }
        }
    }
}
