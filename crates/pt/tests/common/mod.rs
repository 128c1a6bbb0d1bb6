//! Shared test helpers: the Python interpreter, a torch-shaped zip writer, a tiny pickle
//! emitter for hand-built hostile files.
#![allow(dead_code)]

use std::io::Write;

#[path = "../../../../tests/src/python.rs"]
mod python;
#[allow(unused_imports)]
pub use python::python;

/// A zip laid out as torch writes it: `archive/<name>` records, STORED, 64-byte aligned.
pub fn torch_zip(records: &[(&str, &[u8])]) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored).with_alignment(64);
    for (name, data) in records {
        w.start_file(format!("archive/{name}"), opts).unwrap();
        w.write_all(data).unwrap();
    }
    w.finish().unwrap().into_inner()
}

/// A torch-shaped zip around `pkl`, with `byteorder` and the given storages.
pub fn with_pickle(pkl: &[u8], storages: &[(&str, &[u8])]) -> Vec<u8> {
    let mut recs: Vec<(String, &[u8])> = vec![("data.pkl".into(), pkl), ("byteorder".into(), b"little")];
    for (k, d) in storages {
        recs.push((format!("data/{k}"), d));
    }
    recs.push(("version".into(), b"3\n"));
    let refs: Vec<(&str, &[u8])> = recs.iter().map(|(n, d)| (n.as_str(), *d)).collect();
    torch_zip(&refs)
}

/// A minimal pickle writer (protocol 2 opcodes), enough to hand-build torch state dicts and
/// hostile payloads.
#[derive(Default)]
pub struct Pickle(pub Vec<u8>);

impl Pickle {
    pub fn new() -> Self {
        Pickle(vec![0x80, 2])
    }
    pub fn op(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    pub fn global(&mut self, module: &str, name: &str) -> &mut Self {
        self.0.push(b'c');
        self.0.extend_from_slice(format!("{module}\n{name}\n").as_bytes());
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.0.push(b'X');
        self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    pub fn int(&mut self, v: i32) -> &mut Self {
        self.0.push(b'J');
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn ints(&mut self, v: &[i32]) -> &mut Self {
        self.0.push(b'(');
        for &x in v {
            self.int(x);
        }
        self.0.push(b't');
        self
    }
    /// `_rebuild_tensor_v2(('storage', torch.<ty>, key, 'cpu', numel), offset, size, stride,
    /// False, OrderedDict())`
    pub fn tensor(&mut self, ty: &str, key: &str, numel: i32, offset: i32, size: &[i32], stride: &[i32]) -> &mut Self {
        self.global("torch._utils", "_rebuild_tensor_v2").op(b"((");
        self.str("storage").global("torch", ty).str(key).str("cpu").int(numel).op(b"tQ");
        self.int(offset).ints(size).ints(stride).op(&[0x89]);
        self.global("collections", "OrderedDict").op(b")R").op(b"tR")
    }
    pub fn stop(&mut self) -> Vec<u8> {
        self.0.push(b'.');
        std::mem::take(&mut self.0)
    }
}

/// `{"w": <4 f32 at offset 0>, "v": <view of the same storage>}` and its storage bytes.
pub fn small_state_dict() -> (Vec<u8>, Vec<u8>) {
    let mut p = Pickle::new();
    p.op(b"}(").str("w").tensor("FloatStorage", "0", 6, 0, &[2, 3], &[3, 1]);
    p.str("v").tensor("FloatStorage", "0", 6, 1, &[2], &[3]).op(b"u");
    let data: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    (p.stop(), data)
}
