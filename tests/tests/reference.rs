//! Interop with the reference `safetensors` crate: what it writes, turboio loads with
//! identical bytes (every dtype, zero-sized and scalar tensors, metadata), on every load path;
//! what turboio writes is byte-identical to what it writes and it reads it back.

use safetensors::tensor::TensorView as RefView;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use turboio::device::testing::OpaqueDevice;
use turboio::{CachePolicy, Dtype, LoadMode, LoadOptions, SaveOptions, SaveTensor};
use turboio_tests::{bytes, disk_dir};

type Corpus = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

fn ref_dtype(d: Dtype) -> safetensors::Dtype {
    serde_json::from_str(&format!("\"{}\"", d.name())).unwrap()
}

/// (name, dtype, shape, bytes) for every dtype: a regular tensor, a zero-sized one and, for
/// whole-byte dtypes, a scalar.
fn corpus() -> Corpus {
    let mut out = Vec::new();
    for (i, d) in Dtype::ALL.into_iter().enumerate() {
        let shape = match d.bits() {
            4 => vec![2, 4],
            6 => vec![4, 2],
            _ => vec![3, 5],
        };
        let n: usize = shape.iter().product::<usize>() * d.bits() / 8;
        out.push((format!("t.{}", d.name()), d, shape, bytes(n, i as u64 + 1)));
        out.push((format!("empty.{}", d.name()), d, vec![0, 5], vec![]));
        if let Some(size) = d.byte_size() {
            out.push((format!("scalar.{}", d.name()), d, vec![], bytes(size, 100 + i as u64)));
        }
    }
    out
}

fn reference_serialize(t: &[(String, Dtype, Vec<usize>, Vec<u8>)], meta: Option<HashMap<String, String>>) -> Vec<u8> {
    let views: Vec<(String, RefView<'_>)> =
        t.iter().map(|(n, d, s, b)| (n.clone(), RefView::new(ref_dtype(*d), s.clone(), b).unwrap())).collect();
    safetensors::serialize(views, meta).unwrap()
}

fn all_paths() -> Vec<(&'static str, LoadOptions)> {
    let opaque: Arc<dyn turboio::device::Device> = Arc::new(OpaqueDevice::new(0));
    vec![
        ("auto", LoadOptions::default()),
        ("mapped", LoadOptions { mode: LoadMode::Mapped, ..Default::default() }),
        ("copied", LoadOptions { mode: LoadMode::Copied, cache: CachePolicy::Keep, threads: 2, ..Default::default() }),
        (
            "copied O_DIRECT",
            LoadOptions { mode: LoadMode::Copied, cache: CachePolicy::Bypass, threads: 2, ..Default::default() },
        ),
        ("staged", LoadOptions { device: Some(opaque), staging_chunk: 4096, ..Default::default() }),
    ]
}

fn assert_loads_like_reference(path: &Path, file: &[u8]) {
    let reference = safetensors::SafeTensors::deserialize(file).unwrap();
    let (_, ref_meta) = safetensors::SafeTensors::read_metadata(file).unwrap();
    for (label, opts) in all_paths() {
        let loaded = turboio::load(path, &opts).unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(loaded.len(), reference.len(), "{label}");
        for (name, view) in reference.tensors() {
            let t = loaded.tensor(&name).unwrap_or_else(|| panic!("{label}: {name} missing"));
            assert_eq!(t.dtype().name(), format!("{:?}", view.dtype()), "{label}: {name}");
            assert_eq!(t.shape(), view.shape(), "{label}: {name}");
            assert_eq!(loaded.to_host(&name).unwrap(), view.data(), "{label}: bytes of {name}");
        }
        let ours: Option<BTreeMap<String, String>> = loaded.metadata().cloned();
        let theirs: Option<BTreeMap<String, String>> = ref_meta.metadata().clone().map(|m| m.into_iter().collect());
        assert_eq!(ours, theirs, "{label}: metadata");
    }
}

#[test]
fn every_dtype_written_by_the_reference_loads_with_identical_bytes() {
    let dir = disk_dir();
    let tensors = corpus();
    for (i, meta) in [None, Some(HashMap::from([("framework".to_string(), "pt".to_string())]))].into_iter().enumerate()
    {
        let file = reference_serialize(&tensors, meta);
        let path = dir.path().join(format!("ref{i}.safetensors"));
        std::fs::write(&path, &file).unwrap();
        assert_loads_like_reference(&path, &file);
    }
}

#[test]
fn every_dtype_one_file_each() {
    let dir = disk_dir();
    for (name, d, shape, data) in corpus() {
        let file = reference_serialize(&[(name.clone(), d, shape, data)], None);
        let path = dir.path().join(format!("{name}.safetensors"));
        std::fs::write(&path, &file).unwrap();
        assert_loads_like_reference(&path, &file);
    }
}

#[test]
fn empty_file_and_only_empty_tensors() {
    let dir = disk_dir();
    let cases: Vec<Corpus> =
        vec![vec![], vec![("a".into(), Dtype::F32, vec![0], vec![]), ("b".into(), Dtype::U8, vec![2, 0, 3], vec![])]];
    for (i, t) in cases.iter().enumerate() {
        let file = reference_serialize(t, Some(HashMap::from([("k".to_string(), "v".to_string())])));
        let path = dir.path().join(format!("e{i}.safetensors"));
        std::fs::write(&path, &file).unwrap();
        assert_loads_like_reference(&path, &file);
    }
}

#[test]
fn turboio_writes_what_the_reference_writes() {
    let dir = disk_dir();
    let tensors = corpus();
    let save: Vec<SaveTensor<'_>> =
        tensors.iter().map(|(n, d, s, b)| SaveTensor { name: n, dtype: *d, shape: s, data: b }).collect();
    for meta in [None, Some(("framework", "pt")), Some(("x\"y\\z\n", "ünïcode / \u{1}"))] {
        let ours_meta = meta.map(|(k, v)| BTreeMap::from([(k.to_string(), v.to_string())]));
        let ref_meta = meta.map(|(k, v)| HashMap::from([(k.to_string(), v.to_string())]));
        let path = dir.path().join("ours.safetensors");
        turboio::save(&path, &save, ours_meta.as_ref(), &SaveOptions::default()).unwrap();
        let ours = std::fs::read(&path).unwrap();
        let theirs = reference_serialize(&tensors, ref_meta);
        assert!(ours == theirs, "turboio's file differs from the reference writer's (metadata {meta:?})");
        let back = safetensors::SafeTensors::deserialize(&ours).unwrap();
        for (n, _, _, b) in &tensors {
            assert_eq!(back.tensor(n).unwrap().data(), &b[..]);
        }
    }
}

#[test]
fn several_metadata_keys_are_sorted_and_read_by_the_reference() {
    let dir = disk_dir();
    let meta: BTreeMap<String, String> = (0..20).map(|i| (format!("key{:02}", 19 - i), format!("v{i}"))).collect();
    let data = bytes(64, 9);
    let t = [SaveTensor { name: "w", dtype: Dtype::F32, shape: &[4, 4], data: &data }];
    let path = dir.path().join("meta.safetensors");
    turboio::save(&path, &t, Some(&meta), &SaveOptions::default()).unwrap();
    let file = std::fs::read(&path).unwrap();
    let (_, m) = safetensors::SafeTensors::read_metadata(&file).unwrap();
    let theirs: BTreeMap<String, String> = m.metadata().clone().unwrap().into_iter().collect();
    assert_eq!(theirs, meta);
    let text = String::from_utf8_lossy(&file[8..]).into_owned();
    let positions: Vec<usize> = meta.keys().map(|k| text.find(&format!("\"{k}\"")).unwrap()).collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "metadata keys are written sorted");
}
