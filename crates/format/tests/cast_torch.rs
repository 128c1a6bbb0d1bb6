//! `cast` against torch's CPU `.to()`, bit for bit: every bit pattern of the 8- and 16-bit
//! formats, and random and special 32- and 64-bit values (NaN payloads, infinities, zeros,
//! subnormals, exact ties and their neighbours, the largest finite values and just above).
//!
//! Needs `TURBOIO_PYTHON` (a Python with torch and numpy; `cargo xtask test` sets it up).

use std::path::Path;
use std::process::Command;
use turboio_format::{cast, Dtype};

const FLOATS: [Dtype; 6] = [Dtype::F64, Dtype::F32, Dtype::F16, Dtype::BF16, Dtype::F8_E4M3, Dtype::F8_E5M2];

#[path = "../../../tests/src/python.rs"]
mod python;
use python::python;

fn element(bytes: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a[..bytes.len()].copy_from_slice(bytes);
    u64::from_le_bytes(a)
}

fn check_pair(dir: &Path, from: Dtype, to: Dtype) -> Result<usize, String> {
    let src = std::fs::read(dir.join(format!("{from}.in"))).unwrap();
    let want = std::fs::read(dir.join(format!("{from}-{to}.out"))).unwrap();
    let (fs, ts) = (from.byte_size().unwrap(), to.byte_size().unwrap());
    let mut got = vec![0u8; want.len()];
    cast(&src, from, to, &mut got).unwrap();
    let mut bad = Vec::new();
    for (i, (g, w)) in got.chunks(ts).zip(want.chunks(ts)).enumerate() {
        if g != w {
            bad.push(format!(
                "  element {i}: {:#0w1$x} -> ours {:#0w2$x}, torch {:#0w2$x}",
                element(&src[i * fs..(i + 1) * fs]),
                element(g),
                element(w),
                w1 = 2 + 2 * fs,
                w2 = 2 + 2 * ts
            ));
        }
    }
    if !bad.is_empty() {
        return Err(format!(
            "{from} -> {to}: {} of {} differ, e.g.\n{}",
            bad.len(),
            got.len() / ts,
            bad[..bad.len().min(12)].join("\n")
        ));
    }
    // Converting in odd-sized chunks gives the same bytes.
    let mut chunked = vec![0u8; want.len()];
    let per = 1237;
    for (s, d) in src.chunks(per * fs).zip(chunked.chunks_mut(per * ts)) {
        cast(s, from, to, d).unwrap();
    }
    assert!(chunked == got, "{from} -> {to}: chunked conversion differs");
    Ok(got.len() / ts)
}

#[test]
fn every_float_pair_matches_torch_bit_for_bit() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/cast_torch.py");
    let out = Command::new(&py).arg(&script).arg(dir.path()).output().expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "cast_torch.py failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    // torch disagrees with itself only where the module docs say so.
    for line in stdout.lines().filter(|l| l.starts_with("inconsistent")) {
        assert!(
            line.contains("F16->F32") || line.contains("F64->BF16"),
            "torch's kernels disagree somewhere new: {line}"
        );
    }
    let mut total = 0;
    let mut failures = Vec::new();
    for from in FLOATS {
        for to in FLOATS {
            if from != to {
                match check_pair(dir.path(), from, to) {
                    Ok(n) => total += n,
                    Err(e) => failures.push(e),
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    eprintln!("{total} conversions identical to torch");
}
