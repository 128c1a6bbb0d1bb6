//! Interop with an independent implementation: Python `cryptography`'s AES-CTR (OpenSSL).
//!
//! Runs when `TURBOIO_PYTHON` names a Python that has `cryptography`; otherwise prints that it
//! was skipped (and fails if `TURBOIO_REQUIRE_PYTHON` is set).

use std::io::Write;
use std::process::{Command, Stdio};

use turboio_cipher::{CtrCipher, Iv, Key};

use crate::reference::{bytes, hex, unhex};

/// Reads lines `key_hex iv_hex pos data_hex`, prints the ciphertext hex of each: the counter
/// block IV + pos // 16 (mod 2^128), with pos % 16 leading keystream bytes discarded.
const SCRIPT: &str = r#"
import sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
for line in sys.stdin:
    key, iv, pos, data = line.split()
    key, data, pos = bytes.fromhex(key), bytes.fromhex(data), int(pos)
    counter = ((int(iv, 16) + pos // 16) % (1 << 128)).to_bytes(16, "big")
    enc = Cipher(algorithms.AES(key), modes.CTR(counter)).encryptor()
    skip = pos % 16
    out = enc.update(bytes(skip) + data) + enc.finalize()
    print(out[skip:].hex())
"#;

#[test]
fn matches_python_cryptography() {
    let Some(python) = std::env::var_os("TURBOIO_PYTHON") else {
        assert!(
            std::env::var_os("TURBOIO_REQUIRE_PYTHON").is_none(),
            "TURBOIO_REQUIRE_PYTHON is set but TURBOIO_PYTHON is not"
        );
        println!("skipped: set TURBOIO_PYTHON to a Python with the `cryptography` package");
        return;
    };
    let keys: [&[u8]; 3] = [b"abcdefgh12345678", b"abcdefgh12345678abcdefgh12345678", &bytes(99, 16)];
    let ivs = [*b"1234567887654321", [0xff; 16], {
        let mut iv = [0u8; 16];
        iv[8..].fill(0xff);
        iv[15] = 0xf0;
        iv
    }];
    let positions = [0u64, 1, 15, 16, 17, 4093, 262_144, 8_388_611, (1 << 33) + 5, u64::MAX - 40];
    let mut cases = Vec::new();
    let mut input = String::new();
    for (k, key) in keys.iter().enumerate() {
        for (i, iv) in ivs.iter().enumerate() {
            for (p, &pos) in positions.iter().enumerate() {
                let len = [1usize, 31, 100, 1000, 4099][(k + i + p) % 5];
                let data = bytes((k * 1000 + i * 100 + p) as u64, len);
                input.push_str(&format!("{} {} {pos} {}\n", hex(key), hex(iv), hex(&data)));
                cases.push((*key, *iv, pos, data));
            }
        }
    }
    let mut child = Command::new(&python)
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run TURBOIO_PYTHON={python:?}: {e}"));
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(
        out.status.success(),
        "{python:?} failed (is `cryptography` installed?): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = std::str::from_utf8(&out.stdout).unwrap().lines().collect();
    assert_eq!(lines.len(), cases.len());
    for ((key, iv, pos, data), line) in cases.iter().zip(lines) {
        let c = CtrCipher::new(&Key::new(key).unwrap(), &Iv(*iv));
        let mut ours = data.clone();
        c.apply_at(*pos, &mut ours);
        assert_eq!(ours, unhex(line), "key {} bits, iv {iv:02x?}, pos {pos}, len {}", key.len() * 8, data.len());
        // Parallel too.
        let mut par = data.clone();
        c.apply_at_parallel(*pos, &mut par, 2);
        assert_eq!(par, ours);
    }
    println!("checked {} cases against Python cryptography", cases.len());
}
