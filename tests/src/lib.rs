//! Shared helpers for the workspace integration tests.

use std::path::Path;
use std::process::Command;

/// A directory on a real disk (not tmpfs) for test files, removed on drop.
pub fn disk_dir() -> tempfile::TempDir {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-scratch");
    std::fs::create_dir_all(&base).expect("create target/test-scratch");
    tempfile::tempdir_in(base).expect("tempdir")
}

/// Deterministic bytes.
pub fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

mod python;
pub use python::python;

pub mod s3;

/// xorshift: test choices (kill points, delays) that vary but are the same on every run.
pub struct Rng(pub u64);

impl Rng {
    /// A number in `0..n` (0 for `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// Bytes from the hex string Python's `bytes.hex()` prints.
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// Runs a Python snippet with arguments; panics with its stderr on failure. Returns stdout.
pub fn run_python(python: &Path, code: &str, args: &[&str]) -> String {
    let out = Command::new(python).arg("-c").arg(code).args(args).output().expect("run python");
    assert!(out.status.success(), "python failed: {}\n{}", String::from_utf8_lossy(&out.stderr), code);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The test model of the crash tests: a few tensors whose bytes are all derived from a version
/// number, so that any reader can tell a complete version from a torn file.
pub mod crash {
    use turboio::{Dtype, LoadedFile, TensorData, TensorSpec};

    /// Bytes per chunk of the crash saver (small, so a save has many points to be killed at).
    pub const CHUNK: usize = 64 << 10;
    const SIZES: [usize; 3] = [8, 700_001, 300_000];

    /// The bytes of version `v`.
    #[derive(Clone, Debug)]
    pub struct ModelData {
        /// One buffer per tensor.
        pub tensors: Vec<Vec<u8>>,
        shapes: Vec<[usize; 1]>,
    }

    impl ModelData {
        /// Version `v`: tensor 0 holds `v` (u64), the others bytes seeded by it.
        pub fn new(v: u64) -> ModelData {
            let tensors =
                vec![v.to_le_bytes().to_vec(), super::bytes(SIZES[1], v * 2 + 1), super::bytes(SIZES[2], v * 2 + 2)];
            ModelData { shapes: tensors.iter().map(|t| [t.len()]).collect(), tensors }
        }
    }

    impl TensorData for ModelData {
        fn fill(&self, index: usize, offset: usize, dst: &mut [u8]) -> Result<(), String> {
            let src = self.tensors.get(index).and_then(|t| t.get(offset..offset + dst.len())).ok_or("out of range")?;
            dst.copy_from_slice(src);
            Ok(())
        }
    }

    /// The specs of a version's tensors.
    pub fn model_specs(d: &ModelData) -> Vec<TensorSpec<'_>> {
        ["version", "a", "b"]
            .iter()
            .zip(&d.shapes)
            .map(|(name, shape)| TensorSpec { name, dtype: Dtype::U8, shape, data_len: shape[0] })
            .collect()
    }

    /// Checks a load is one complete version; returns it.
    pub fn check_model(f: &LoadedFile) -> Result<u64, String> {
        let get = |name: &str| f.to_host(name).map_err(|e| e.to_string());
        let v = u64::from_le_bytes(get("version")?.try_into().map_err(|_| "version tensor is not 8 bytes")?);
        let want = ModelData::new(v);
        for (i, name) in ["a", "b"].iter().enumerate() {
            if get(name)? != want.tensors[i + 1] {
                return Err(format!("torn file: tensor {name} is not version {v}'s"));
            }
        }
        Ok(v)
    }
}

/// The model-directory version of the crash tests (`tests/tests/models.rs`, `model_saver`).
pub mod model_crash {
    use turboio::{Dtype, LoadedModel, SaveTensor};

    /// Tensors of the test model.
    pub const TENSORS: usize = 6;
    /// Bytes per tensor.
    pub const LEN: usize = 48 << 10;

    /// The bytes of tensor `i` in version `v`: `v` in the first 8 bytes, then a pattern of both.
    pub fn tensor_bytes(v: u64, i: usize) -> Vec<u8> {
        let mut b: Vec<u8> = (0..LEN).map(|k| ((v as usize * 31 + i * 7 + k) % 251) as u8).collect();
        b[..8].copy_from_slice(&v.to_le_bytes());
        b
    }

    /// Names of the tensors (the same in every version).
    pub fn names() -> Vec<String> {
        (0..TENSORS).map(|i| format!("layers.{i}.weight")).collect()
    }

    /// The largest shard of version `v`: even versions in 2 shards, odd ones in 3, so that the
    /// sets differ in count as well as content.
    pub fn max_shard(v: u64) -> u64 {
        if v.is_multiple_of(2) {
            (3 * LEN) as u64
        } else {
            (2 * LEN) as u64
        }
    }

    /// Save-ready views of version `v`'s data (held in `data`).
    pub fn views<'a>(names: &'a [String], data: &'a [Vec<u8>]) -> Vec<SaveTensor<'a>> {
        const SHAPE: [usize; 1] = [LEN / 4];
        names.iter().zip(data).map(|(n, d)| SaveTensor { name: n, dtype: Dtype::F32, shape: &SHAPE, data: d }).collect()
    }

    /// Which version a loaded model is, if it is exactly one version: every tensor present,
    /// every byte that version's, and the shard count that version's.
    pub fn check(m: &LoadedModel) -> Result<u64, String> {
        let names = names();
        if m.len() != names.len() {
            return Err(format!("{} tensors, expected {}", m.len(), names.len()));
        }
        let first = m.tensor(&names[0]).and_then(|t| t.bytes()).ok_or("no first tensor")?;
        let v = u64::from_le_bytes(first[..8].try_into().unwrap());
        for (i, n) in names.iter().enumerate() {
            let got = m.tensor(n).and_then(|t| t.bytes()).ok_or_else(|| format!("no tensor {n}"))?;
            if got != tensor_bytes(v, i).as_slice() {
                return Err(format!("tensor {n} is not version {v}'s (a mix of saves)"));
            }
        }
        let want = if v % 2 == 0 { 2 } else { 3 };
        if m.shards().len() != want {
            return Err(format!("version {v} loaded from {} shards, it has {want}", m.shards().len()));
        }
        Ok(v)
    }
}
