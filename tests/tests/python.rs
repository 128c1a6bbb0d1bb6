//! Interop with the Python `safetensors` package (and torch, for the dtypes numpy lacks):
//! files it writes load with identical bytes; files turboio writes, it reads back exactly.
//! Needs `TURBOIO_PYTHON` (set by `cargo xtask test`, which creates the venv).

use std::collections::BTreeMap;
use turboio::{Dtype, LoadMode, LoadOptions, SaveOptions, SaveTensor};
use turboio_tests::{bytes, disk_dir, python, run_python, unhex};

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

const ENCRYPT: &str = r#"
import json, sys, base64
import numpy as np
from safetensors.numpy import save_file
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
plain_path, out_path, layout = sys.argv[1], sys.argv[2], sys.argv[3]
key, iv = b"abcdefgh12345678", b"1234567887654321"
rng = np.random.default_rng(1)
t = {"w": rng.random((300, 7)).astype(np.float32), "i": np.arange(1001, dtype=np.int64), "b": rng.random(33) > 0.5}
save_file(t, plain_path, metadata={"who": "python"})
data = open(plain_path, "rb").read()
enc = Cipher(algorithms.AES(key), modes.CTR(iv)).encryptor()
ct = enc.update(data) + enc.finalize()
if layout == "header":
    h = json.dumps({"mode": "CTR-128", "iv": base64.b64encode(iv).decode(), "meta_data_key": "not-a-kms-blob", "file_timestamp": 1700000000})
    prefix = b"Byte3ncryptM0del" + h.encode() + b"\0" * (262144 - 16 - len(h))
    ct = prefix + ct
open(out_path, "wb").write(ct)
print(json.dumps({k: v.tobytes().hex() for k, v in t.items()}))
"#;

const DECRYPT: &str = r#"
import json, sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from safetensors.numpy import load_file
enc_path, out_path = sys.argv[1], sys.argv[2]
dec = Cipher(algorithms.AES(b"abcdefgh12345678"), modes.CTR(b"1234567887654321")).decryptor()
open(out_path, "wb").write(dec.update(open(enc_path, "rb").read()) + dec.finalize())
print(json.dumps({k: v.tobytes().hex() for k, v in load_file(out_path).items()}))
"#;

fn env_keys() -> turboio::crypt::Keys {
    // veTurboIO's chain with nothing but VETURBOIO_KEY / VETURBOIO_IV available: a header's KMS
    // blob cannot be unwrapped (no KMS configured) and the chain falls back to the environment.
    let socket = std::env::temp_dir().join("turboio-no-datapipe/missing.sock");
    let resolver = turboio::crypt::KeyResolver::from_vars(|_| None)
        .with_socket_path(socket)
        .with_env_key_iv(Some("YWJjZGVmZ2gxMjM0NTY3OA=="), Some("MTIzNDU2Nzg4NzY1NDMyMQ=="));
    turboio::crypt::Keys::Chain(std::sync::Arc::new(resolver))
}

#[test]
fn files_encrypted_by_python_cryptography_load() {
    let Some(py) = python() else { return };
    let d = disk_dir();
    for layout in ["headerless", "header"] {
        let plain = d.path().join(format!("{layout}.plain.safetensors"));
        let enc = d.path().join(format!("{layout}.enc.safetensors"));
        let out = run_python(&py, ENCRYPT, &[plain.to_str().unwrap(), enc.to_str().unwrap(), layout]);
        let want: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&out).unwrap();
        let encryption = turboio::crypt::Encryption::new(env_keys());
        for mode in [LoadMode::Auto, LoadMode::Copied] {
            let opts = LoadOptions { mode, encryption: Some(encryption.clone()), ..Default::default() };
            let loaded = turboio::load(&enc, &opts).unwrap_or_else(|e| panic!("{layout}: {e}"));
            assert_eq!(loaded.metadata().unwrap()["who"], "python");
            for (name, hex) in &want {
                assert_eq!(loaded.to_host(name).unwrap(), unhex(hex.as_str().unwrap()), "{layout} {name}");
            }
        }
    }
}

#[test]
fn files_encrypted_by_turboio_decrypt_with_python_cryptography() {
    let Some(py) = python() else { return };
    let d = disk_dir();
    let enc = d.path().join("ours.enc.safetensors");
    let w: Vec<u8> = (0..4000u32).flat_map(|i| (i as f32 * 0.5).to_le_bytes()).collect();
    let n: Vec<u8> = (0..77i64).flat_map(|i| i.to_le_bytes()).collect();
    let tensors = [
        SaveTensor { name: "w", dtype: Dtype::F32, shape: &[40, 100], data: &w },
        SaveTensor { name: "n", dtype: Dtype::I64, shape: &[77], data: &n },
    ];
    let opts = SaveOptions { encryption: Some(turboio::crypt::Encryption::new(env_keys())), ..Default::default() };
    turboio::save(&enc, &tensors, None, &opts).unwrap();
    let out = run_python(&py, DECRYPT, &[enc.to_str().unwrap(), d.path().join("dec.safetensors").to_str().unwrap()]);
    let got: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(unhex(got["w"].as_str().unwrap()), w);
    assert_eq!(unhex(got["n"].as_str().unwrap()), n);
}
