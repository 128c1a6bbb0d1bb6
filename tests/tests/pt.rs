//! PyTorch checkpoints through the load pipeline (`turboio::load_pt`) on every path (mapped,
//! copied, `O_DIRECT`, a device the CPU cannot address, encrypted), each tensor compared with
//! what `torch.load(weights_only=True)` gives; and conversions of the same files. Needs
//! `TURBOIO_PYTHON` (torch), which `cargo xtask test` sets up.

use std::sync::Arc;
use turboio::device::testing::OpaqueDevice;
use turboio::device::Device;
use turboio::pt::PtOptions;
use turboio::{CachePolicy, Held, LoadMode, LoadOptions, SaveOptions};
use turboio_tests::{disk_dir, python, run_python, unhex};

/// Saves a checkpoint with torch (ties, a transposed view, a slice, nested dicts, several
/// dtypes, an empty tensor, a scalar) and prints `{name: hex of its contiguous bytes}` as
/// torch.load(weights_only=True) reads it back.
const MAKE: &str = r#"
import json, sys, torch
g = torch.Generator().manual_seed(5)
w = torch.randn(40, 24, generator=g)
sd = {"model": {"emb": w, "head": w, "wt": w.t(), "rows": w[5:9], "h": torch.randn(9, generator=g).half(),
                "bf": torch.randn(3, 3, generator=g).bfloat16(), "n": torch.arange(11), "e": torch.empty(0, 3),
                "s": torch.tensor(7.5)}, "step": 3}
torch.save(sd, sys.argv[1])
back = torch.load(sys.argv[1], weights_only=True)
def flat(d, p=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from flat(v, p + k + ".")
        elif isinstance(v, torch.Tensor):
            yield p + k, v
print(json.dumps({k: v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex() for k, v in flat(back)}))
"#;

#[test]
fn torch_checkpoints_load_on_every_path_as_torch_reads_them() {
    let Some(py) = python() else { return };
    let d = disk_dir();
    let pt = d.path().join("ckpt.pt");
    let out = run_python(&py, MAKE, &[pt.to_str().unwrap()]);
    let want: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&out).unwrap();
    let dev = Arc::new(OpaqueDevice::new(1));
    let enc = d.path().join("ckpt.enc.pt");
    let key = turboio::crypt::Key::from_base64("YWJjZGVmZ2gxMjM0NTY3OA==").unwrap();
    let iv = turboio::crypt::Iv::from_base64("MTIzNDU2Nzg4NzY1NDMyMQ==").unwrap();
    let encryption = turboio::crypt::Encryption::new(turboio::crypt::Keys::Fixed { key, iv });
    turboio::crypt::encrypt_file(&pt, &enc, &encryption, &SaveOptions::default()).unwrap();
    let cases: Vec<(&str, &std::path::Path, LoadOptions, Held)> = vec![
        ("mapped", &pt, LoadOptions::default(), Held::Mapped),
        ("copied", &pt, LoadOptions { mode: LoadMode::Copied, threads: 3, ..Default::default() }, Held::Copied),
        (
            "O_DIRECT",
            &pt,
            LoadOptions { mode: LoadMode::Copied, cache: CachePolicy::Bypass, ..Default::default() },
            Held::Copied,
        ),
        (
            "device",
            &pt,
            LoadOptions { device: Some(dev.clone() as Arc<dyn Device>), staging_chunk: 4096, ..Default::default() },
            Held::Staged,
        ),
        ("encrypted", &enc, LoadOptions { encryption: Some(encryption.clone()), ..Default::default() }, Held::Copied),
    ];
    for (label, path, opts, held) in cases {
        let loaded = turboio::load_pt(path, &opts, &PtOptions::default()).unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(loaded.report().held, held, "{label}");
        assert_eq!(loaded.len(), want.len(), "{label}");
        for (name, hex) in &want {
            assert_eq!(loaded.tensor_bytes(name).unwrap(), unhex(hex.as_str().unwrap()), "{label}: {name}");
        }
        // Tied weights and views are views of one storage, read once.
        let emb = loaded.tensor("model.emb").unwrap();
        assert_eq!(emb.offset_in_memory(), loaded.tensor("model.head").unwrap().offset_in_memory(), "{label}");
        assert_eq!(emb.offset_in_memory(), loaded.tensor("model.wt").unwrap().offset_in_memory(), "{label}");
        assert!(!loaded.tensor("model.wt").unwrap().is_contiguous());
        if held != Held::Staged {
            assert!(emb.span().is_some());
        }
    }
    assert_eq!(dev.live_allocations(), 0, "device memory freed with the load");

    // A top-level key, and the converter on the same file (validated against the input).
    let opts = PtOptions { top_level_key: Some("model".into()), ..Default::default() };
    let loaded = turboio::load_pt(&pt, &LoadOptions::default(), &opts).unwrap();
    assert!(loaded.tensor("emb").is_some() && loaded.tensor("model.emb").is_none());
    let st = d.path().join("ckpt.safetensors");
    let copts = turboio::convert::ConvertOptions { validate: true, ..Default::default() };
    let r = turboio::convert::convert(&pt, &st, &copts).unwrap();
    assert_eq!(r.aliases, vec![("model.head".to_owned(), "model.emb".to_owned())]);
    assert_eq!(r.skipped, vec!["step: int".to_owned()]);
    let f = turboio::load(&st, &LoadOptions::default()).unwrap();
    for (name, hex) in &want {
        assert_eq!(f.to_host(name).unwrap(), unhex(hex.as_str().unwrap()), "converted {name}");
    }
    // Encrypted input, plain output.
    let st2 = d.path().join("from-enc.safetensors");
    let copts = turboio::convert::ConvertOptions {
        load: LoadOptions { encryption: Some(encryption), ..Default::default() },
        validate: true,
        ..Default::default()
    };
    turboio::convert::convert(&enc, &st2, &copts).unwrap();
    assert_eq!(std::fs::read(&st2).unwrap(), std::fs::read(&st).unwrap());
}

#[test]
fn hostile_and_foreign_files_are_clear_errors() {
    let d = disk_dir();
    let st = d.path().join("x.safetensors");
    turboio::sample::write_sample(&st, 1 << 20, 1, &SaveOptions::default()).unwrap();
    let e = turboio::load_pt(&st, &LoadOptions::default(), &PtOptions::default()).unwrap_err().to_string();
    assert!(e.contains("x.safetensors") && e.contains("without executing code"), "{e}");
    let junk = d.path().join("junk.pt");
    std::fs::write(&junk, b"PK\x03\x04 not really a zip").unwrap();
    let e = turboio::load_pt(&junk, &LoadOptions::default(), &PtOptions::default()).unwrap_err().to_string();
    assert!(e.contains("junk.pt"), "{e}");
    let out = d.path().join("junk.safetensors");
    let e = turboio::convert::convert(&junk, &out, &Default::default()).unwrap_err().to_string();
    assert!(e.contains("junk.pt") && !out.exists(), "{e}");
    let e = turboio::load(&junk, &LoadOptions::default()).unwrap_err().to_string();
    assert!(e.contains("PyTorch checkpoint"), "{e}");
}

#[test]
fn expanded_views_convert_within_a_bound_and_leave_nothing_when_refused() {
    let Some(py) = python() else { return };
    let d = disk_dir();
    let bomb = d.path().join("bomb.pt");
    let small = d.path().join("small.pt");
    let code = "import sys, torch\n\
                torch.save({'x': torch.ones(1).expand(2 ** 29)}, sys.argv[1])\n\
                torch.save({'r': torch.arange(1000.).expand(1000, 1000)}, sys.argv[2])";
    run_python(&py, code, &[bomb.to_str().unwrap(), small.to_str().unwrap()]);
    assert!(std::fs::metadata(&bomb).unwrap().len() < 4096, "a tiny file describing 2 GiB");
    let out = d.path().join("bomb.safetensors");
    let e = turboio::convert::convert(&bomb, &out, &Default::default()).unwrap_err().to_string();
    assert!(e.contains("bomb.pt") && e.contains("expanded view") && e.contains("`x`"), "{e}");
    let left: Vec<_> = std::fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 2, "no output and no temporary left: {left:?}");
    // A modest expansion (4 MB from 4 KB) is written out in full.
    let out = d.path().join("small.safetensors");
    turboio::convert::convert(&small, &out, &Default::default()).unwrap();
    let f = turboio::load(&out, &LoadOptions::default()).unwrap();
    let r = f.tensor("r").unwrap();
    assert_eq!(r.shape(), &[1000, 1000]);
    let row: Vec<u8> = (0..1000).flat_map(|i| (i as f32).to_le_bytes()).collect();
    assert!(r.bytes().unwrap().chunks(4000).all(|c| c == row.as_slice()));
}
