//! `.pt` checkpoints whose logical values differ from their stored bytes, through the real
//! binary (issue 29): conjugate and negative views convert to their logical values and
//! `inspect` says what they are; meta tensors have no data to convert; record sizes, storage
//! locations and the version record are checked as torch checks them. Needs `TURBOIO_PYTHON`
//! (torch) for the files torch writes; the hand-built ones need nothing.

mod common;

#[path = "../../pt/tests/common/mod.rs"]
#[allow(unused_imports)]
mod pt_files;

use common::{scratch, stderr, stdout, turboio};
use pt_files::{python, torch_zip, with_pickle, Pickle};
use std::process::Command;

fn run_python(code: &str, args: &[&str]) -> String {
    let py = python().expect("checked by the caller");
    let out = Command::new(py).arg("-c").arg(code).args(args).output().expect("run python");
    assert!(out.status.success(), "python failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// torch.save of conjugate and negative views, printing `name hex` of each logical value.
const BITS: &str = r#"
import sys, torch
g = torch.Generator().manual_seed(7)
z = torch.randn(3, 4, dtype=torch.complex64, generator=g)
x = torch.randn(5, 2, generator=g)
sd = {"conj": z.conj(), "neg": x._neg_view(), "conj_neg": z.conj()._neg_view(), "neg_int": torch.arange(-3, 6)._neg_view(),
      "neg_t": x.t()._neg_view(), "plain": x}
torch.save(sd, sys.argv[1])
torch.save({"m": torch.empty(4, 3, device="meta"), "x": x}, sys.argv[2])
back = torch.load(sys.argv[1], weights_only=True)
for k, v in back.items():
    print(k, v.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex())
"#;

#[test]
fn conjugate_and_negative_views_convert_to_their_logical_values() {
    if python().is_none() {
        return;
    }
    let d = scratch();
    let bits = d.path().join("bits.pt");
    let meta = d.path().join("meta.pt");
    let out = run_python(BITS, &[bits.to_str().unwrap(), meta.to_str().unwrap()]);
    let f = bits.to_str().unwrap();

    let o = turboio(&["inspect", f]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    for (name, what) in
        [("conj ", "conjugate view"), ("neg ", "negative view"), ("conj_neg", "conjugate view, negative view")]
    {
        let line = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name}: {text}"));
        assert!(line.contains(what), "{line}");
    }
    let o = turboio(&["inspect", f, "--json"]);
    let doc: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let conj = doc["tensors"].as_array().unwrap().iter().find(|t| t["name"] == "conj").unwrap();
    assert_eq!((conj["conj"].as_bool(), conj["neg"].as_bool()), (Some(true), Some(false)));

    let o = turboio(&["load", f, "--check"]);
    assert!(o.status.success() && stdout(&o).contains("all 6 tensors match"), "{}{}", stdout(&o), stderr(&o));

    // The conversion writes the logical values (safetensors has no bits).
    let st = d.path().join("bits.safetensors");
    let o = turboio(&["convert", f, st.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let loaded = turboio::load(&st, &turboio::LoadOptions::default()).unwrap();
    for line in out.lines() {
        let (name, hex) = line.split_once(' ').unwrap();
        assert_eq!(loaded.tensor(name).unwrap().bytes().unwrap(), unhex(hex), "{name}");
    }

    // A meta tensor has no data: inspect says so, load --check skips it, convert refuses and
    // leaves nothing.
    let m = meta.to_str().unwrap();
    let o = turboio(&["inspect", m]);
    assert!(stdout(&o).contains("meta tensor, no data"), "{}", stdout(&o));
    let o = turboio(&["load", m, "--check"]);
    assert!(o.status.success() && stdout(&o).contains("1 meta tensors have no data"), "{}{}", stdout(&o), stderr(&o));
    let mst = d.path().join("meta.safetensors");
    let o = turboio(&["convert", m, mst.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("meta.pt") && stderr(&o).contains("meta tensor"), "{}", stderr(&o));
    assert!(!mst.exists());
}

/// `{"w": <4 f32 in storage 0>}`, hand-pickled, with the storage's class and location given.
fn one_tensor(storage: &str, location: &str) -> Vec<u8> {
    let mut p = Pickle::new();
    p.op(b"}(").str("w");
    p.global("torch._utils", "_rebuild_tensor_v2").op(b"((");
    p.str("storage").global("torch", storage).str("0").str(location).int(4).op(b"tQ");
    p.int(0).ints(&[4]).ints(&[1]).op(&[0x89]);
    p.global("collections", "OrderedDict").op(b")R").op(b"tR").op(b"u");
    p.stop()
}

#[test]
fn record_sizes_locations_and_versions_are_checked_as_torch_checks_them() {
    let d = scratch();
    let data: Vec<u8> = (0..4).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let longer: Vec<u8> = data.iter().copied().chain([0u8; 8]).collect();
    let cases: Vec<(&str, Vec<u8>, Option<&str>)> = vec![
        ("ok.pt", with_pickle(&one_tensor("FloatStorage", "cpu"), &[("0", &data)]), None),
        (
            "longer.pt",
            with_pickle(&one_tensor("FloatStorage", "cpu"), &[("0", &longer)]),
            Some("record size (24 bytes)"),
        ),
        ("half.pt", with_pickle(&one_tensor("HalfStorage", "cpu"), &[("0", &data)]), Some("record size (16 bytes)")),
        ("bogus.pt", with_pickle(&one_tensor("FloatStorage", "bogus"), &[("0", &data)]), Some("location `bogus`")),
        ("cuda.pt", with_pickle(&one_tensor("FloatStorage", "cuda:3"), &[("0", &data)]), None),
        ("meta.pt", with_pickle(&one_tensor("FloatStorage", "meta"), &[("0", &data)]), None),
        (
            "noversion.pt",
            torch_zip(&[("data.pkl", &one_tensor("FloatStorage", "cpu")), ("data/0", &data)]),
            Some("no version record"),
        ),
        (
            "v99.pt",
            torch_zip(&[("data.pkl", &one_tensor("FloatStorage", "cpu")), ("data/0", &data), ("version", b"99\n")]),
            Some("version 99"),
        ),
    ];
    // torch's verdict on each file, where a Python with torch is set up: it must refuse what
    // turboio refuses and load the rest (map_location="cpu" only where torch asks for a GPU
    // this machine may not have: turboio loads where it is asked to).
    let torch_loads = |path: &std::path::Path| -> Option<bool> {
        python()?;
        let code = "import sys, torch\ndef load(**kw):\n    return torch.load(sys.argv[1], weights_only=True, **kw)\ntry:\n    try:\n        load()\n    except RuntimeError as e:\n        if 'CUDA' not in str(e):\n            raise\n        load(map_location='cpu')\n    print('ok')\nexcept Exception:\n    print('refused')";
        Some(run_python(code, &[path.to_str().unwrap()]).trim() == "ok")
    };
    for (name, bytes, refused) in cases {
        let path = d.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        if let Some(ok) = torch_loads(&path) {
            assert_eq!(ok, refused.is_none(), "{name}: torch and turboio disagree");
        }
        let o = turboio(&["load", path.to_str().unwrap(), "--check"]);
        match refused {
            Some(words) => {
                assert_eq!(o.status.code(), Some(1), "{name}: {}", stdout(&o));
                let e = stderr(&o);
                assert!(e.contains(name) && e.contains(words), "{name}: {e}");
            }
            None => assert!(o.status.success(), "{name}: {}", stderr(&o)),
        }
    }
    // A storage tagged `meta` is a meta tensor, as torch loads it.
    let o = turboio(&["inspect", d.path().join("meta.pt").to_str().unwrap()]);
    assert!(stdout(&o).contains("meta tensor, no data"), "{}", stdout(&o));
}
