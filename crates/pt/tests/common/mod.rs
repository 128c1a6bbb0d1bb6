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

/// `{"w": _rebuild_tensor_v2(('storage', torch.<class>, '0', location, numel), offset, (len,),
/// (1,), False, OrderedDict(), <metadata ops>)}` over the record `data/0` = `record`: one view
/// with everything torch checks or applies when it rebuilds a tensor open to variation.
pub fn one_view(
    class: &str,
    location: &str,
    numel: i32,
    offset: i32,
    len: i32,
    metadata: &[u8],
    record: &[u8],
) -> Vec<u8> {
    let mut p = Pickle::new();
    p.op(b"}(").str("w");
    p.global("torch._utils", "_rebuild_tensor_v2").op(b"((");
    p.str("storage").global("torch", class).str("0").str(location).int(numel).op(b"tQ");
    p.int(offset).ints(&[len]).ints(&[1]).op(&[0x89]);
    p.global("collections", "OrderedDict").op(b")R");
    p.op(metadata).op(b"tR").op(b"u");
    with_pickle(&p.stop(), &[("0", record)])
}

/// Storage classes with their element size, metadata arguments and locations the differential
/// tests and the fuzz target draw from (valid and not, as torch sees them).
pub const VIEW_CLASSES: [(&str, usize); 6] = [
    ("FloatStorage", 4),
    ("HalfStorage", 2),
    ("ComplexFloatStorage", 8),
    ("LongStorage", 8),
    ("BoolStorage", 1),
    ("BFloat16Storage", 2),
];
/// See [`VIEW_CLASSES`].
pub const VIEW_METADATA: [&[u8]; 10] = [
    b"N",
    b"}",
    b"}X\x04\x00\x00\x00conj\x88s",
    b"}X\x03\x00\x00\x00neg\x88s",
    b"}X\x03\x00\x00\x00neg\x89s",
    b"}(X\x04\x00\x00\x00conj\x88X\x03\x00\x00\x00neg\x88u",
    b"ccollections\nOrderedDict\n",
    b"]K\x01a",
    b"}X\x01\x00\x00\x00xK\x01s",
    b"K\x00",
];
/// See [`VIEW_CLASSES`].
pub const VIEW_LOCATIONS: [&str; 7] = ["cpu", "cpu", "meta", "bogus", "cuda:0", "cuda", "cuda:"];

/// `{"w": <4 f32 at offset 0>, "v": <view of the same storage>}` and its storage bytes.
pub fn small_state_dict() -> (Vec<u8>, Vec<u8>) {
    let mut p = Pickle::new();
    p.op(b"}(").str("w").tensor("FloatStorage", "0", 6, 0, &[2, 3], &[3, 1]);
    p.str("v").tensor("FloatStorage", "0", 6, 1, &[2], &[3]).op(b"u");
    let data: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    (p.stop(), data)
}

/// The hostile shapes an outside review found (issue 22), built with parameters so that the
/// property tests and the fuzz target can vary them.
pub mod hostile {
    use super::{small_state_dict, with_pickle, Pickle};

    /// A valid two-storage checkpoint whose `data/1` is renamed `data/0` in its local header and
    /// its directory entry: two entries with one name (the zip crate keeps the last; torch reads
    /// the first). `flip` changes the second storage's bytes so the two differ.
    pub fn duplicate_names(flip: u8) -> Vec<u8> {
        let (pkl, data) = small_state_dict();
        let other: Vec<u8> = data.iter().map(|b| b ^ flip.max(1)).collect();
        let mut file = with_pickle(&pkl, &[("0", &data), ("1", &other)]);
        let from = b"archive/data/1";
        let spots: Vec<usize> =
            file.windows(from.len()).enumerate().filter(|(_, w)| *w == from).map(|(i, _)| i).collect();
        for at in spots {
            file[at..at + from.len()].copy_from_slice(b"archive/data/0");
        }
        file
    }

    /// `{'A' * key_len: [None] * leaves}`: naming every leaf copies the key `leaves` times.
    pub fn long_names(key_len: usize, leaves: usize) -> Vec<u8> {
        let mut p = Pickle::new();
        p.op(b"}(").str(&"A".repeat(key_len)).op(b"](").op(&vec![b'N'; leaves]).op(b"eu");
        with_pickle(&p.stop(), &[])
    }

    /// A checkpoint followed by `records` end-of-central-directory records whose directory
    /// offset (`dir_offset`) does not point at a directory.
    pub fn stacked_directory_records(records: usize, dir_offset: u32) -> Vec<u8> {
        let (pkl, data) = small_state_dict();
        let good = with_pickle(&pkl, &[("0", &data)]);
        let mut eocd = good[good.len() - 22..].to_vec();
        eocd[16..20].copy_from_slice(&dir_offset.to_le_bytes());
        let mut file = good[..good.len() - 22].to_vec();
        for _ in 0..records {
            file.extend_from_slice(&eocd);
        }
        file
    }

    /// `{'x': view}` of a one-element float storage with this shape and these strides (all 0
    /// for a pure expansion): torch's `ones(1).expand(...)`.
    pub fn expanded_view(shape: &[i32], strides: &[i32]) -> Vec<u8> {
        let mut p = Pickle::new();
        p.op(b"}(").str("x").tensor("FloatStorage", "0", 1, 0, shape, strides).op(b"u");
        with_pickle(&p.stop(), &[("0", &1f32.to_le_bytes())])
    }

    /// One dict key set `pairs` times, each time to a new object made by `op` (`]` lists, `}`
    /// dicts, `)` empty tuples): every value but the last is unreachable once replaced, yet a
    /// VM that never frees holds them all (and turboio keeps every pair).
    pub fn made_and_dropped(op: u8, pairs: usize) -> Vec<u8> {
        let mut p = Pickle::new();
        p.op(b"}");
        let mut body = Vec::with_capacity(pairs * 4 + 16);
        for i in 0..pairs {
            if i == 0 {
                body.extend_from_slice(b"X\x01\x00\x00\x00kq\x01");
            } else {
                body.extend_from_slice(b"h\x01");
            }
            body.extend_from_slice(&[op, b's']);
        }
        p.op(&body);
        with_pickle(&p.stop(), &[])
    }

    /// A list of `n` empty tuples appended in batches of 1000 (`APPENDS`): torch's pickler writes
    /// a shared object this way; each costs a list slot and nothing more.
    pub fn empty_tuples(n: usize) -> Vec<u8> {
        let mut p = Pickle::new();
        p.op(b"]");
        let mut left = n;
        while left > 0 {
            let k = left.min(1000);
            p.op(b"(").op(&vec![b')'; k]).op(b"e");
            left -= k;
        }
        with_pickle(&p.stop(), &[])
    }
}
