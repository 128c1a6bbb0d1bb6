//! Interop with the Python `safetensors` package (and torch, for the dtypes numpy lacks):
//! files it writes load with identical bytes; files turboio writes, it reads back exactly.
//! Needs `TURBOIO_PYTHON` (set by `cargo xtask test`, which creates the venv).

use std::collections::BTreeMap;
use turboio::{Dtype, LoadMode, LoadOptions, SaveOptions, SaveTensor};
use turboio_tests::{bytes, disk_dir, python, run_python};

const WRITE: &str = r#"
import json, sys
import numpy as np
from safetensors.numpy import save_file
out = sys.argv[1]
rng = np.random.default_rng(0)
t = {}
for dt in ["bool", "uint8", "int8", "int16", "uint16", "float16", "int32", "uint32", "float32", "float64", "int64", "uint64", "complex64"]:
    a = (rng.random((3, 5)) > 0.5) if dt == "bool" else (rng.random((3, 5)) * 100).astype(dt)
    t["t." + dt] = a
    t["empty." + dt] = np.zeros((0, 5), dtype=dt)
    t["scalar." + dt] = np.array(a.flat[1], dtype=dt)
save_file(t, out, metadata={"framework": "np", "note": "written by python"})
res = {k: {"shape": list(v.shape), "hex": v.tobytes().hex()} for k, v in t.items()}
try:
    import torch
    from safetensors.torch import save_file as tsave
    tt = {}
    for name in ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"]:
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        tt["t." + name] = (torch.rand(4, 3) * 8).to(dt) if dt.is_floating_point else torch.randint(0, 200, (4, 3)).to(dt)
        tt["scalar." + name] = tt["t." + name][1, 1].clone()
    tsave(tt, out + ".torch")
    res["__torch__"] = {k: {"shape": list(v.shape), "hex": v.reshape(-1).view(torch.uint8).numpy().tobytes().hex()} for k, v in tt.items()}
except ImportError:
    pass
print(json.dumps(res))
"#;

const READ: &str = r#"
import json, sys
import safetensors
from safetensors import safe_open
path = sys.argv[1]
with open(path, "rb") as f:
    items = safetensors.deserialize(f.read())
with safe_open(path, framework="np") as f:
    meta = f.metadata()
print(json.dumps({"meta": meta, "tensors": {n: {"dtype": v["dtype"], "shape": list(v["shape"]), "hex": bytes(v["data"]).hex()} for n, v in items}}))
"#;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn check_file(path: &std::path::Path, expected: &serde_json::Map<String, serde_json::Value>) {
    for mode in [LoadMode::Mapped, LoadMode::Copied] {
        let loaded = turboio::load(path, &LoadOptions { mode, ..Default::default() }).unwrap();
        assert_eq!(loaded.len(), expected.len());
        for (name, v) in expected {
            let t = loaded.tensor(name).unwrap_or_else(|| panic!("{name} missing"));
            let shape: Vec<usize> =
                v["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
            assert_eq!(t.shape(), &shape[..], "{name}");
            assert_eq!(t.bytes().unwrap(), &unhex(v["hex"].as_str().unwrap())[..], "{name} ({mode})");
        }
    }
}

#[test]
fn files_written_by_python_load_with_identical_bytes() {
    let Some(py) = python() else { return };
    let d = disk_dir();
    let path = d.path().join("py.safetensors");
    let out = run_python(&py, WRITE, &[path.to_str().unwrap()]);
    let mut doc: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&out).unwrap();
    let torch = doc.remove("__torch__");
    check_file(&path, &doc);
    let loaded = turboio::load(&path, &LoadOptions::default()).unwrap();
    assert_eq!(loaded.metadata().unwrap()["note"], "written by python");
    assert_eq!(loaded.tensor("t.bool").unwrap().dtype(), Dtype::BOOL);
    assert_eq!(loaded.tensor("scalar.complex64").unwrap().dtype(), Dtype::C64);
    match torch {
        Some(serde_json::Value::Object(t)) => check_file(&path.with_extension("safetensors.torch"), &t),
        _ => eprintln!("note: torch not installed, bf16/float8 files from safetensors.torch not checked"),
    }
}

#[test]
fn files_written_by_turboio_read_back_in_python() {
    let Some(py) = python() else { return };
    let d = disk_dir();
    let path = d.path().join("ours.safetensors");
    let mut owned = Vec::new();
    for (i, dt) in Dtype::ALL.into_iter().enumerate() {
        let shape = if dt.bits() % 8 == 0 { vec![2, 3] } else { vec![4, 4] };
        let n = shape.iter().product::<usize>() * dt.bits() / 8;
        owned.push((format!("t.{dt}"), dt, shape, bytes(n, i as u64)));
        owned.push((format!("empty.{dt}"), dt, vec![0], vec![]));
    }
    owned.push(("scalar".into(), Dtype::F64, vec![], bytes(8, 99)));
    let tensors: Vec<SaveTensor<'_>> =
        owned.iter().map(|(n, d, s, b)| SaveTensor { name: n, dtype: *d, shape: s, data: b }).collect();
    let meta = BTreeMap::from([("framework".to_string(), "pt".to_string()), ("b".to_string(), "2".to_string())]);
    turboio::save(&path, &tensors, Some(&meta), &SaveOptions::default()).unwrap();
    let out = run_python(&py, READ, &[path.to_str().unwrap()]);
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["meta"]["framework"], "pt");
    assert_eq!(doc["meta"]["b"], "2");
    let read = doc["tensors"].as_object().unwrap();
    assert_eq!(read.len(), owned.len());
    for (n, d, s, b) in &owned {
        let v = &read[n];
        assert_eq!(v["dtype"].as_str().unwrap().to_ascii_uppercase(), d.name().to_ascii_uppercase(), "{n}");
        let shape: Vec<usize> = v["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
        assert_eq!(&shape, s, "{n}");
        assert_eq!(unhex(v["hex"].as_str().unwrap()), *b, "{n}");
    }
}
