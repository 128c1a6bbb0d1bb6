//! AES-CTR with random access, and veTurboIO's encrypted-file formats. No I/O.
//!
//! # The cipher
//!
//! AES-128 or AES-256 (picked by the key's length: 16 or 32 bytes) in counter mode with a
//! **128-bit big-endian counter** that starts at the 16-byte IV. Keystream byte `p` is
//!
//! ```text
//! AES_K(IV + floor(p / 16))[p mod 16]
//! ```
//!
//! where `IV + n` adds `n` to the IV read as one big-endian 128-bit integer, the carry running
//! through all 16 bytes and wrapping mod 2^128 (an IV of `ff`x16 is followed by `00`x16).
//! This is OpenSSL's `EVP_aes_*_ctr`, Python `cryptography`'s `modes.CTR`, and what veTurboIO's
//! CPU and GPU paths compute. Encrypting and decrypting are the same XOR.
//!
//! **Random access.** [`CtrCipher::apply_at`] XORs the keystream from any byte position: it
//! sets the counter to `IV + pos / 16`, discards `pos % 16` bytes of the first block, and goes
//! on from there. So a loader decrypts each chunk right after reading it, on the thread that
//! read it and while the bytes are still in cache, with chunks of any size at any offset;
//! [`CtrCipher::apply_at_parallel`] splits one large buffer over threads at 16-byte keystream
//! boundaries. A [`CtrCipher`] is immutable, `Send + Sync`, and cheap to share.
//!
//! ```
//! use turboio_cipher::{CtrCipher, Iv, Key};
//!
//! let key = Key::new(b"abcdefgh12345678")?; // 16 bytes: AES-128
//! let cipher = CtrCipher::new(&key, &Iv(*b"1234567887654321"));
//! let mut file = b"Hello veTurboIO!Hello veTurboIO!".to_vec();
//! cipher.apply_at(0, &mut file); // encrypt the whole stream
//! // Decrypt bytes 5..21 alone, as a reader thread would its chunk:
//! let mut chunk = file[5..21].to_vec();
//! cipher.apply_at(5, &mut chunk);
//! assert_eq!(&chunk, b" veTurboIO!Hello");
//! # Ok::<(), turboio_cipher::CipherError>(())
//! ```
//!
//! # The two file layouts
//!
//! Keystream position = file offset - [`Layout::header_size`]:
//!
//! ```text
//! Layout::Headerless   offset 0: ciphertext of the whole plain file (safetensors or .pt),
//!                      file byte p at keystream position p. No marker: the reader must be told.
//!
//! Layout::WithHeader   offset 0:      16 bytes MAGIC  b"Byte3ncryptM0del"
//!                      offset 16:     UTF-8 JSON, Python json.dumps style, in this key order:
//!                                     {"mode": "CTR-128", "iv": "<base64 of the 16-byte IV>",
//!                                      "meta_data_key": "<KMS CiphertextBlob>", "file_timestamp": 1700000000}
//!                      then:          0x00 up to offset 262144 (HEADER_SIZE, 256 KiB)
//!                      offset 262144: ciphertext of the whole plain file,
//!                                     file byte p at keystream position p - 262144
//! ```
//!
//! A file is a header file iff it is at least [`HEADER_SIZE`] bytes long and starts with
//! [`MAGIC`] ([`CipherHeader::parse`] returns `Some`); the JSON runs to the first NUL. The
//! data key is not in the header in the clear: `meta_data_key` is KMS-encrypted and decrypted
//! by the `kms` crate. [`CipherHeader::to_bytes`] writes exactly veTurboIO's bytes.
//! [`encrypt_file_bytes`] / [`decrypt_file_bytes`] do whole files in memory;
//! [`EncryptingWriter`] / [`DecryptingReader`] stream.
//!
//! # Why this AES implementation
//!
//! Pure Rust, from RustCrypto: `aes` 0.8.4 + `ctr` 0.9.2. The `aes` crate detects AES-NI at
//! run time (`cpufeatures`) and falls back to a constant-time bitsliced software AES on CPUs
//! without it; no `unsafe` here, no C library to find. It was measured against the other
//! pure-Rust RustCrypto options on the build machine (2 vCPU AMD EPYC with AES-NI, VAES and
//! AVX-512) with `examples/ctrbench.rs` (256 MiB buffer, medians of alternated runs):
//!
//! | GB/s, 256 MiB, median of 3 runs' medians | AES-128 1 thread | AES-128 2 threads | AES-256 1 thread | AES-256 2 threads |
//! |---|---|---|---|---|
//! | **aes 0.8.4 + ctr 0.9.2** (this crate, `apply_at_parallel`) | **5.66** | **8.26** | **3.97** | **4.89** |
//! | the same, loader pattern: `apply_at` on 8 MiB + 1 chunks at odd positions | 5.50 | 8.08 | 4.23 | 4.23 |
//! | aes 0.9.4 + ctr 0.10.1 | 3.59 | 6.08 | 3.75 | 3.13 |
//! | hand-rolled counter loop over aes 0.8.4 `encrypt_blocks` | 2.92 | 5.07 | | |
//! | hand-rolled counter loop over aes 0.9.4 `encrypt_blocks` | 2.27 | 3.91 | | |
//!
//! The machine was shared and noisy while this ran (single runs swing 2x, and the second core
//! was often busy, so 2 threads gained little); compare within a row only. Run by run, in the
//! same alternated run, 0.8.4 + 0.9.2 beat 0.9.4 + 0.10.1 by 1.3-1.8x with AES-128 and
//! 1.0-1.7x with AES-256, and was never slower. The chunked loader pattern costs nothing
//! measurable over one big call: per call, `apply_at` copies the key schedule (under 1 KiB)
//! and seeks, without allocating.
//!
//! `aes` 0.9 has VAES backends (selected at run time from 0.9.3 on), yet through `ctr` 0.10 it
//! is the slower of the two on this CPU, as the machine notes (`shared/MACHINE.md`) also
//! found; it also needs Rust 1.89 (the workspace's floor is 1.85). Hand-rolling the counter
//! loop over `encrypt_blocks` lost to `ctr`, which generates and XORs the keystream inside the
//! AES-NI backend, eight blocks at a time.
//! Rerun with `cargo run --release -p turboio-cipher --features bench-compare --example
//! ctrbench` when a new version lands.
//!
//! # Key hygiene
//!
//! - [`Key`] overwrites its bytes with zeros when dropped ([`zeroize::ZeroizeOnDrop`]), and the
//!   expanded key schedules inside [`CtrCipher`] (and the per-call stack copies) are zeroized
//!   on drop by the `aes` crate's `zeroize` feature.
//! - `Debug` of [`Key`] prints `Key(<redacted>, 128 bits)`; `Debug` of [`CtrCipher`] shows the
//!   mode and the IV (which is not secret: the header stores it in plain) but not the key.
//!   Neither has `Display`.
//! - No [`CipherError`] message contains key bytes, and base64 errors name the position of a
//!   bad character, never the character (the text may be a key).
//! - [`Key::expose`] is the only way to read the bytes back, for handing the key to KMS.
//!
//! `#![forbid(unsafe_code)]`.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod aes_ctr;
mod error;
mod file;
mod header;
mod key;

pub use aes_ctr::CtrCipher;
pub use error::CipherError;
pub use file::{crypt_in_place, decrypt_file_bytes, encrypt_file_bytes, DecryptingReader, EncryptingWriter};
pub use header::{CipherHeader, Layout, HEADER_SIZE, MAGIC};

/// A string as Python's `json.dumps` writes it (default `ensure_ascii=True`): quotes, `"` and `\`
/// escaped, `\n \r \t \b \f` by name, everything outside printable ASCII as `\uXXXX`
/// (UTF-16 surrogate pairs above U+FFFF). veTurboIO's headers and KMS bodies are written this
/// way, and signatures cover the exact bytes.
pub fn py_json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    header::push_py_json_str(&mut out, text);
    out
}
pub use key::{b64_decode, b64_encode, Iv, Key, Mode};
pub use zeroize;
