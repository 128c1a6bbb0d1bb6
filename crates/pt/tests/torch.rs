//! Round trips against real torch: files written by `torch.save` (tests/fixtures/make.py) give
//! the tensors `torch.load(weights_only=True)` gives, tensor by tensor (names, dtypes, shapes,
//! strides, offsets, shared storages, bytes), and the files torch or Python's pickle can write
//! that must be refused are refused with the right words, with nothing executed.
//!
//! Needs `TURBOIO_PYTHON` (a Python with torch; `cargo xtask test` sets it up).

mod common;

use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use turboio_pt::{to_little_endian, ByteOrder, PtError, PtIndex, PtOptions};

/// Runs make.py once per test process into target/tmp/pt-fixtures (rewritten each run).
fn make_fixtures() -> Option<&'static Path> {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let py = common::python()?;
    let dir = DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pt-fixtures");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/make.py");
        let out = std::process::Command::new(py).arg(script).arg(&dir).output().expect("run python");
        assert!(out.status.success(), "make.py failed:\n{}", String::from_utf8_lossy(&out.stderr));
        dir
    });
    Some(dir)
}

fn parse(path: &Path, opts: &PtOptions) -> Result<PtIndex, PtError> {
    let bytes = std::fs::read(path).unwrap();
    PtIndex::parse(bytes.as_slice(), opts)
}

/// Gathers every tensor's contiguous bytes from the file.
fn tensor_bytes(file: &[u8], index: &PtIndex, t: &turboio_pt::PtTensor) -> Vec<u8> {
    let span = index.file_span(t);
    let mut out = vec![0u8; t.nbytes() as usize];
    t.gather(&file[span.start as usize..span.end as usize], &mut out).unwrap();
    out
}

/// Compares one case with torch's view of it; `prefix` is stripped from torch's names (for a
/// top-level key). Returns the number of tensors compared.
fn compare(dir: &Path, case: &str, opts: &PtOptions, prefix: &str) -> usize {
    let file = std::fs::read(dir.join(format!("{case}.pt"))).unwrap();
    let index = PtIndex::parse(file.as_slice(), opts).unwrap_or_else(|e| panic!("{case}: {e}"));
    let want: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{case}.json"))).unwrap()).unwrap();
    let blob = std::fs::read(dir.join(format!("{case}.bin"))).unwrap();
    let rows: Vec<&Value> = want["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["name"].as_str().unwrap().starts_with(prefix))
        .collect();
    let names: Vec<String> = rows.iter().map(|r| r["name"].as_str().unwrap()[prefix.len()..].to_owned()).collect();
    let ours: Vec<&str> = index.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(ours, names, "{case}: tensor names in pickle order");

    let mut storage_map: HashMap<u64, usize> = HashMap::new();
    let mut seen: HashMap<usize, u64> = HashMap::new();
    for (t, r) in index.tensors().iter().zip(&rows) {
        let ctx = format!("{case}: `{}`", t.name);
        assert_eq!(t.dtype.name(), r["dtype"].as_str().unwrap(), "{ctx} dtype");
        let shape: Vec<usize> = r["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        let stride: Vec<usize> = r["stride"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        assert_eq!(t.shape, shape, "{ctx} shape");
        assert_eq!(t.strides, stride, "{ctx} strides");
        assert_eq!(t.storage_offset, r["offset"].as_u64().unwrap(), "{ctx} offset");
        assert_eq!(t.requires_grad, r["requires_grad"].as_bool().unwrap(), "{ctx} requires_grad");
        assert_eq!(t.is_parameter, r["parameter"].as_bool().unwrap(), "{ctx} parameter");
        // Storage identity: the same partition of tensors into storages as torch's.
        let sid = r["storage"].as_u64().unwrap();
        assert_eq!(
            *storage_map.entry(sid).or_insert(t.storage),
            t.storage,
            "{ctx}: storage sharing differs from torch"
        );
        assert_eq!(*seen.entry(t.storage).or_insert(sid), sid, "{ctx}: storage sharing differs from torch");
        let d = r["data"].as_array().unwrap();
        let (start, len) = (d[0].as_u64().unwrap() as usize, d[1].as_u64().unwrap() as usize);
        let got = tensor_bytes(&file, &index, t);
        assert!(got == blob[start..start + len], "{ctx}: bytes differ from torch's");
        if t.is_contiguous() {
            let span = index.file_span(t);
            assert!(file[span.start as usize..span.end as usize] == got[..], "{ctx}: contiguous span is not its bytes");
        }
        let st = index.storage_of(t);
        assert!(st.offset.is_multiple_of(64), "{ctx}: torch aligns storages to 64 bytes");
        assert!(index.file_span(t).end <= st.offset + st.len);
    }
    if prefix.is_empty() {
        let skipped: Vec<&str> = index.skipped().iter().map(|s| s.name.as_str()).collect();
        let want_skipped: Vec<&str> = want["skipped"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        assert_eq!(skipped, want_skipped, "{case}: skipped leaves");
    }
    rows.len()
}

fn expect_error(dir: &Path, case: &str) {
    let words = std::fs::read_to_string(dir.join(format!("{case}.err"))).unwrap();
    let err = match parse(&dir.join(format!("{case}.pt")), &PtOptions::default()) {
        Ok(i) => panic!("{case}: accepted, {} tensors", i.tensors().len()),
        Err(e) => e.to_string(),
    };
    for w in words.split('|') {
        assert!(err.contains(w), "{case}: error `{err}` does not mention `{w}`");
    }
    eprintln!("{case}: {err}");
}

#[test]
fn torch_checkpoints_match_torch_load() {
    let Some(dir) = make_fixtures() else { return };
    let d = dir;
    let mut n = 0;
    for case in ["dtypes", "dtypes_proto4", "views", "tied", "nested", "params", "single", "proto5", "little"] {
        n += compare(d, case, &PtOptions::default(), "");
    }
    // A top-level key picks the model out of a training checkpoint.
    n += compare(d, "nested", &PtOptions::with_top_level_key("model"), "model.");
    n += compare(d, "nested", &PtOptions::with_top_level_key("deeper"), "deeper.");
    eprintln!("{n} tensors identical to torch.load");

    // Tied weights: two names, one storage, the same bytes of the file.
    let tied = parse(&d.join("tied.pt"), &PtOptions::default()).unwrap();
    let (emb, head) = (tied.tensor("emb.weight").unwrap(), tied.tensor("head.weight").unwrap());
    assert_eq!(emb.storage, head.storage);
    assert_eq!(tied.file_span(emb), tied.file_span(head));
    assert!(tied.tensors().iter().all(|t| !t.name.contains("_metadata")));

    // Every dtype in the dtypes case is there.
    let dt = parse(&d.join("dtypes.pt"), &PtOptions::default()).unwrap();
    assert_eq!(dt.tensors().len(), 19);
    assert_eq!(dt.byte_order(), ByteOrder::Little);
    assert_eq!(dt.archive_name(), "dtypes");

    let missing = parse(&d.join("nested.pt"), &PtOptions::with_top_level_key("state_dict")).unwrap_err().to_string();
    assert!(missing.contains("`state_dict` not found") && missing.contains("`model`"), "{missing}");
}

#[test]
fn big_endian_files_are_refused_or_swapped() {
    let Some(dir) = make_fixtures() else { return };
    let d = dir;
    let err = parse(&d.join("big.pt"), &PtOptions::default()).unwrap_err();
    assert!(matches!(err, PtError::BigEndian), "{err}");
    assert!(err.to_string().contains("big-endian"));
    let opts = PtOptions { allow_big_endian: true, ..Default::default() };
    let file = std::fs::read(d.join("big.pt")).unwrap();
    let big = PtIndex::parse(file.as_slice(), &opts).unwrap();
    assert_eq!(big.byte_order(), ByteOrder::Big);
    let little_file = std::fs::read(d.join("little.pt")).unwrap();
    let little = PtIndex::parse(little_file.as_slice(), &PtOptions::default()).unwrap();
    for (b, l) in big.tensors().iter().zip(little.tensors()) {
        let mut got = tensor_bytes(&file, &big, b);
        assert_ne!(got, tensor_bytes(&little_file, &little, l));
        to_little_endian(b.dtype, &mut got).unwrap();
        assert_eq!(got, tensor_bytes(&little_file, &little, l), "{}", b.name);
    }
}

#[test]
fn refused_files_say_why_and_run_nothing() {
    let Some(dir) = make_fixtures() else { return };
    let d = dir;
    let mut cases: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".err").map(str::to_owned))
        .collect();
    cases.sort();
    assert!(cases.len() >= 14, "{cases:?}");
    for case in &cases {
        expect_error(d, case);
    }
    assert!(!d.join("PWNED").exists(), "a payload ran");
    // The payloads are real: Python's own unpickler would have run them.
    assert!(std::fs::read(d.join("os_system.pt")).unwrap().windows(5).any(|w| w == b"touch"));
}

#[test]
fn damaged_torch_files_never_panic() {
    let Some(d) = make_fixtures() else { return };
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut accepted = 0;
    for case in ["nested", "views", "params", "dtypes_proto4"] {
        let good = std::fs::read(d.join(format!("{case}.pt"))).unwrap();
        for round in 0..1500 {
            let mut file = good.clone();
            for _ in 0..1 + next() % 4 {
                let at = (next() % file.len() as u64) as usize;
                file[at] = next() as u8;
            }
            if round % 5 == 0 {
                file.truncate((next() % file.len() as u64) as usize);
            }
            if let Ok(index) = PtIndex::parse(file.as_slice(), &PtOptions::default()) {
                accepted += 1;
                for t in index.tensors() {
                    let span = index.file_span(t);
                    assert!(span.end <= file.len() as u64);
                    let mut out = vec![0u8; t.nbytes() as usize];
                    t.gather(&file[span.start as usize..span.end as usize], &mut out).unwrap();
                }
            }
        }
    }
    // Flips in tensor data leave a valid file: the accepted branch was exercised.
    assert!(accepted > 0);
}

/// The differential mode (issue 29): random checkpoints varying what torch checks or applies
/// when it rebuilds a tensor (the metadata argument with its conjugate and negative bits, the
/// storage's class against its record's size, the storage's location, the view), each loaded by
/// torch (`weights_only=True`; `map_location="cpu"` where torch needs a GPU it lacks) and by
/// turboio. Both refuse, or both give the same logical values with the same bits and device.
#[test]
fn random_views_bits_sizes_and_locations_match_torch() {
    use common::{one_view, VIEW_CLASSES, VIEW_LOCATIONS, VIEW_METADATA};
    let Some(py) = common::python() else { return };
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pt-differential");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // The record holds 8 float32 (32 bytes), read through the storage class drawn.
    let record: Vec<u8> = (0..8).flat_map(|i| ((i as f32) - 3.5).to_le_bytes()).collect();
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let cases = 240;
    for i in 0..cases {
        let (class, es) = VIEW_CLASSES[next(VIEW_CLASSES.len() as u64) as usize];
        // Mostly the numel that fits the record exactly; sometimes one off.
        let exact = (record.len() / es) as i32;
        let numel = match next(6) {
            0 => exact + 1,
            1 => (exact - 1).max(0),
            _ => exact,
        };
        let len = next(numel.max(1) as u64 + 1) as i32;
        let offset = next((numel - len).max(0) as u64 + 1) as i32;
        let location = VIEW_LOCATIONS[next(VIEW_LOCATIONS.len() as u64) as usize];
        let metadata = VIEW_METADATA[next(VIEW_METADATA.len() as u64) as usize];
        let file = one_view(class, location, numel, offset, len, metadata, &record);
        std::fs::write(dir.join(format!("{i}.pt")), file).unwrap();
    }
    let code = r#"
import json, sys, torch
for i in range(int(sys.argv[2])):
    path = f"{sys.argv[1]}/{i}.pt"
    try:
        try:
            sd = torch.load(path, weights_only=True)
        except RuntimeError as e:
            if "CUDA" not in str(e):
                raise
            sd = torch.load(path, weights_only=True, map_location="cpu")
        t = sd["w"]
        hexed = "" if t.device.type == "meta" else t.resolve_conj().resolve_neg().contiguous().view(torch.uint8).numpy().tobytes().hex()
        print(json.dumps({"ok": True, "conj": t.is_conj(), "neg": t.is_neg(), "meta": t.device.type == "meta", "hex": hexed}))
    except Exception as e:
        print(json.dumps({"ok": False, "error": str(e).splitlines()[0][:200]}))
"#;
    let out = std::process::Command::new(py)
        .arg("-c")
        .arg(code)
        .arg(&dir)
        .arg(cases.to_string())
        .output()
        .expect("run python");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let (mut accepted, mut refused) = (0, 0);
    for (i, line) in text.lines().enumerate() {
        let want: Value = serde_json::from_str(line).unwrap();
        let file = std::fs::read(dir.join(format!("{i}.pt"))).unwrap();
        let ours = PtIndex::parse(file.as_slice(), &PtOptions::default());
        if want["ok"] == false {
            assert!(ours.is_err(), "case {i}: torch refuses ({}) but turboio accepts", want["error"]);
            refused += 1;
            continue;
        }
        let index = ours.unwrap_or_else(|e| panic!("case {i}: torch loads it but turboio refuses: {e}"));
        let t = index.tensor("w").unwrap();
        assert_eq!(
            (t.conj, t.neg, t.meta),
            (want["conj"] == true, want["neg"] == true, want["meta"] == true),
            "case {i}"
        );
        if !t.meta {
            let span = index.file_span(t);
            let mut got = vec![0u8; t.nbytes() as usize];
            t.gather(&file[span.start as usize..span.end as usize], &mut got).unwrap();
            let hex: String = got.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(hex, want["hex"].as_str().unwrap(), "case {i}");
        }
        accepted += 1;
    }
    assert_eq!(accepted + refused, cases, "torch answered every case");
    assert!(accepted > 30 && refused > 30, "both outcomes are exercised: {accepted} accepted, {refused} refused");
}
