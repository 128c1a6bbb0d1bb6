//! Checkpoints in object storage, end to end against a real S3 server on 127.0.0.1 (moto's,
//! started by each test through the venv's Python): loads of files, model directories (a key
//! prefix), encrypted files and `.pt` checkpoints give exactly the local file's tensors; saves
//! and model saves to `s3://` read back byte for byte; a save killed mid-upload leaves the old
//! object. (The CLI on URLs: crates/cli/tests/cli_object.rs.)

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use turboio::object::{ObjectOptions, ObjectStorage};
use turboio::pt::PtOptions;
use turboio::storage::{BytesSource, IoOptions, Storage};
use turboio::{LoadOptions, LoadedFile, SaveOptions};
use turboio_tests::s3::S3Server;
use turboio_tests::{disk_dir, python, run_python, unhex};

struct Fixture {
    server: S3Server,
    storage: Arc<dyn Storage>,
}

fn fixture(bucket: &str, extra: &[(&str, &str)]) -> Option<Fixture> {
    let server = S3Server::start(&python()?);
    server.create_bucket(bucket);
    let mut pairs = server.options();
    pairs.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let storage = Arc::new(ObjectStorage::new(ObjectOptions::from_pairs(pairs).unwrap()));
    Some(Fixture { server, storage })
}

impl Fixture {
    fn load_opts(&self) -> LoadOptions {
        LoadOptions { storage: Some(self.storage.clone()), ..Default::default() }
    }

    fn save_opts(&self) -> SaveOptions {
        SaveOptions { storage: Some(self.storage.clone()), ..Default::default() }
    }

    fn upload(&self, local: &Path, url: &str) {
        let bytes = std::fs::read(local).unwrap();
        self.storage.write_file(Path::new(url), &BytesSource(&bytes), &IoOptions::default()).unwrap();
    }

    fn download(&self, url: &str) -> Vec<u8> {
        turboio::read_all(url, &self.load_opts()).unwrap()
    }
}

fn assert_same(a: &LoadedFile, b: &LoadedFile, label: &str) {
    assert!(a.header() == b.header(), "{label}: the headers differ");
    for t in a.tensors() {
        assert!(a.to_host(t.name()).unwrap() == b.to_host(t.name()).unwrap(), "{label}: tensor {}", t.name());
    }
}

#[test]
fn files_models_and_encrypted_files_load_from_s3_as_from_disk() {
    // Small parts so that a few MiB make many parallel GETs and multipart uploads.
    let Some(fx) = fixture("models", &[("part_size", "5MiB"), ("prefix_bytes", "65536")]) else { return };
    let d = disk_dir();
    let local = d.path().join("sample.safetensors");
    turboio::sample::write_sample(&local, 24 << 20, 7, &SaveOptions::default()).unwrap();
    let reference = turboio::load(&local, &LoadOptions::default()).unwrap();

    // A file uploaded, loaded with each thread count; through the scheme's own storage too.
    fx.upload(&local, "s3://models/sample.safetensors");
    for threads in [1, 4] {
        let opts = LoadOptions { threads, ..fx.load_opts() };
        let remote = turboio::load("s3://models/sample.safetensors", &opts).unwrap();
        assert_same(&reference, &remote, &format!("{threads} threads"));
        // The report says what happened: GETs, no page cache of this machine involved.
        let r = remote.report();
        assert_eq!(r.read.method, "ranged GETs");
        assert!(!r.cache.kept && r.cache.reason.contains("not a local file"), "{}", r.cache);
    }
    // Into a device through pinned staging (the opaque test device: memory the CPU cannot
    // address), as a GPU load from a bucket goes; and decrypted on the device.
    let dev = Arc::new(turboio::device::testing::OpaqueDevice::new(0));
    let opts = LoadOptions {
        device: Some(dev.clone() as Arc<dyn turboio::device::Device>),
        staging_chunk: 1 << 20,
        ..fx.load_opts()
    };
    let staged = turboio::load("s3://models/sample.safetensors", &opts).unwrap();
    assert_eq!(staged.report().held, turboio::Held::Staged);
    assert_same(&reference, &staged, "staged into a device");
    drop(staged);
    assert_eq!(dev.live_allocations(), 0);
    // dtype on load: the same conversion as from the local file.
    let bf16 = LoadOptions { dtype: Some(turboio::Dtype::BF16), ..Default::default() };
    let a = turboio::load(&local, &bf16).unwrap();
    let b = turboio::load(
        "s3://models/sample.safetensors",
        &LoadOptions { dtype: Some(turboio::Dtype::BF16), ..fx.load_opts() },
    )
    .unwrap();
    assert_same(&a, &b, "converted to BF16");

    // A save to s3:// is the local save's bytes.
    let tensors: Vec<turboio::SaveTensor<'_>> = reference
        .tensors()
        .map(|t| turboio::SaveTensor { name: t.name(), dtype: t.dtype(), shape: t.shape(), data: t.bytes().unwrap() })
        .collect();
    turboio::save("s3://models/saved.safetensors", &tensors, None, &fx.save_opts()).unwrap();
    let resaved = d.path().join("resaved.safetensors");
    turboio::save(&resaved, &tensors, None, &SaveOptions::default()).unwrap();
    assert!(fx.download("s3://models/saved.safetensors") == std::fs::read(&resaved).unwrap(), "saved bytes");

    // A model directory under a prefix, written and replaced with the commit protocol.
    let report = turboio::save_model_dir("s3://models/llama", &tensors, None, 6 << 20, &fx.save_opts()).unwrap();
    assert!(report.shards.len() >= 3, "{report:?}");
    let model = turboio::load_model("s3://models/llama", &fx.load_opts()).unwrap();
    assert_eq!(model.len(), reference.len());
    for t in reference.tensors() {
        assert!(model.tensor(t.name()).unwrap().bytes().unwrap() == t.bytes().unwrap(), "model {}", t.name());
    }
    let again = turboio::save_model_dir("s3://models/llama", &tensors[..10], None, 1 << 20, &fx.save_opts()).unwrap();
    let left = fx.storage.list(Path::new("s3://models/llama")).unwrap();
    let mut want: Vec<PathBuf> = again.shards.clone();
    want.push(again.index.clone());
    want.sort();
    assert_eq!(left, want, "the old set was removed after the commit");
    assert_eq!(turboio::load_model("s3://models/llama/", &fx.load_opts()).unwrap().len(), 10);
    // Without an index: every *.safetensors object under the prefix.
    fx.upload(&local, "s3://models/plain/a.safetensors");
    assert_eq!(turboio::load_model("s3://models/plain", &fx.load_opts()).unwrap().len(), reference.len());
    let e = turboio::load_model("s3://models/empty-prefix", &fx.load_opts()).unwrap_err().to_string();
    assert!(e.contains("s3://models/empty-prefix") && e.contains("no model.safetensors.index.json"), "{e}");

    // An encrypted file: decrypted on the way in, per part.
    let key = turboio::crypt::Key::from_base64("YWJjZGVmZ2gxMjM0NTY3OA==").unwrap();
    let iv = turboio::crypt::Iv::from_base64("MTIzNDU2Nzg4NzY1NDMyMQ==").unwrap();
    let encryption = turboio::crypt::Encryption::new(turboio::crypt::Keys::Fixed { key, iv });
    let enc = d.path().join("sample.enc");
    turboio::crypt::encrypt_file(&local, &enc, &encryption, &SaveOptions::default()).unwrap();
    fx.upload(&enc, "s3://models/sample.enc.safetensors");
    let opts = LoadOptions { encryption: Some(encryption.clone()), ..fx.load_opts() };
    let decrypted = turboio::load("s3://models/sample.enc.safetensors", &opts).unwrap();
    assert_same(&reference, &decrypted, "encrypted");
    // And an encrypted save to s3:// reads back as the local encrypted save does.
    let save = SaveOptions { encryption: Some(encryption), ..fx.save_opts() };
    turboio::save("s3://models/saved.enc.safetensors", &tensors, None, &save).unwrap();
    let resaved = turboio::load(&resaved, &LoadOptions::default()).unwrap();
    assert_same(&resaved, &turboio::load("s3://models/saved.enc.safetensors", &opts).unwrap(), "encrypted save");
}

#[test]
fn torch_checkpoints_load_and_convert_from_s3() {
    let Some(fx) = fixture("ptfiles", &[("part_size", "5MiB"), ("prefix_bytes", "4096")]) else { return };
    let Some(py) = python() else { return };
    let d = disk_dir();
    let pt = d.path().join("ckpt.pt");
    let make = r#"
import json, sys, torch
g = torch.Generator().manual_seed(3)
w = torch.randn(1500, 1024, generator=g)
sd = {"emb": w, "head": w, "wt": w.t(), "h": torch.randn(77, generator=g).half(), "n": torch.arange(5)}
torch.save(sd, sys.argv[1])
back = torch.load(sys.argv[1], weights_only=True)
print(json.dumps({k: v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex() for k, v in back.items()}))
"#;
    let want: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&run_python(&py, make, &[pt.to_str().unwrap()])).unwrap();
    fx.upload(&pt, "s3://ptfiles/ckpt.pt");
    let loaded = turboio::load_pt("s3://ptfiles/ckpt.pt", &fx.load_opts(), &PtOptions::default()).unwrap();
    assert_eq!(loaded.len(), want.len());
    for (name, hex) in &want {
        assert_eq!(loaded.tensor_bytes(name).unwrap(), unhex(hex.as_str().unwrap()), "{name}");
    }
    // Converted from the bucket into the bucket; validated by reading the output back.
    let copts = turboio::convert::ConvertOptions {
        load: fx.load_opts(),
        save: fx.save_opts(),
        validate: true,
        ..Default::default()
    };
    turboio::convert::convert("s3://ptfiles/ckpt.pt", "s3://ptfiles/ckpt.safetensors", &copts).unwrap();
    let st = turboio::load("s3://ptfiles/ckpt.safetensors", &fx.load_opts()).unwrap();
    for (name, hex) in want.iter().filter(|(n, _)| n.as_str() != "head") {
        assert_eq!(st.to_host(name).unwrap(), unhex(hex.as_str().unwrap()), "converted {name}");
    }
    // The output exists now: converting again needs --overwrite.
    let e = turboio::convert::convert("s3://ptfiles/ckpt.pt", "s3://ptfiles/ckpt.safetensors", &copts).unwrap_err();
    assert!(e.to_string().contains("overwrite"), "{e}");
}

#[test]
fn a_save_killed_mid_upload_leaves_the_old_object() {
    let Some(fx) = fixture("kills", &[]) else { return };
    let d = disk_dir();
    let local = d.path().join("old.safetensors");
    turboio::sample::write_sample(&local, 4 << 20, 1, &SaveOptions::default()).unwrap();
    fx.upload(&local, "s3://kills/ckpt.safetensors");
    let before = fx.download("s3://kills/ckpt.safetensors");
    for round in 0..3 {
        // The saver stops producing bytes halfway through a 40 MiB multipart upload and says so;
        // it is killed there, with parts uploaded and the upload never completed.
        let mut child = Command::new(env!("CARGO_BIN_EXE_object_saver"))
            .args([&fx.server.endpoint(), "s3://kills/ckpt.safetensors", &(40u64 << 20).to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the saver");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "HALF", "round {round}");
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(fx.download("s3://kills/ckpt.safetensors") == before, "round {round}: the old object changed");
    }
    // The killed uploads are incomplete uploads the store lists (a lifecycle rule cleans them
    // up); none of them became the object.
    let (_, body) = fx.server.request("GET", "/kills?uploads", b"");
    assert!(String::from_utf8_lossy(&body).contains("<UploadId>"), "the killed uploads were never completed");
}

#[test]
fn http_urls_read_ranges_from_a_web_server() {
    let Some(web) = turboio_tests::s3::Nginx::start() else { return };
    let d = disk_dir();
    let local = d.path().join("sample.safetensors");
    turboio::sample::write_sample(&local, 12 << 20, 3, &SaveOptions::default()).unwrap();
    std::fs::copy(&local, web.root.join("sample.safetensors")).unwrap();
    let reference = turboio::load(&local, &LoadOptions::default()).unwrap();
    // Through the scheme registry, configured by nothing: a plain web server.
    let url = web.url("sample.safetensors");
    let remote = turboio::load(&url, &LoadOptions::default()).unwrap();
    assert_same(&reference, &remote, "http");
    // Explicit options: small parts, many ranged GETs.
    let storage: Arc<dyn Storage> = Arc::new(ObjectStorage::new(
        ObjectOptions::from_pairs([("part_size", "5MiB"), ("prefix_bytes", "4096")]).unwrap(),
    ));
    let opts = LoadOptions { storage: Some(storage.clone()), threads: 3, ..Default::default() };
    assert_same(&reference, &turboio::load(&url, &opts).unwrap(), "http, small parts");
    // Missing, replaced while open, and read-only.
    let e = turboio::load(web.url("nope.safetensors"), &opts).unwrap_err();
    assert!(e.to_string().contains("nope.safetensors"), "{e}");
    let f = storage.open(Path::new(&url)).unwrap();
    std::fs::write(web.root.join("sample.safetensors"), b"replaced").unwrap();
    let mut buf = vec![0u8; 6 << 20];
    let e =
        f.read_ranges(vec![turboio::storage::ReadRequest { offset: 1 << 20, dst: &mut buf }], &IoOptions::default());
    assert!(e.unwrap_err().to_string().contains("changed while it was being read"));
    let e = turboio::save(&url, &[], None, &SaveOptions::default()).unwrap_err();
    assert!(e.to_string().contains("read-only"), "{e}");
}
