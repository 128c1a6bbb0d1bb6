//! The GPU AES-CTR kernel's source, compiled for the host with the system C++ compiler and
//! compared byte for byte with `turboio-cipher` (random AES-128/256 keys, IVs whose low 64 bits
//! overflow, odd stream positions, odd lengths, unaligned buffers, several grid sizes).
//!
//! Needs a C++ compiler (`$CXX`, else `g++`): without one the test prints that it was skipped,
//! unless `TURBOIO_REQUIRE_CXX=1`, which makes a missing compiler a failure (CI sets it).

use std::sync::OnceLock;
use turboio_cipher::{CtrCipher, Iv, Key};
use turboio_device::aes_kernel::{iv_halves, RoundKeys, SOURCE};

type Launch = unsafe extern "C" fn(*mut u8, u64, *const u32, u32, u64, u64, u64, u32);

mod host_cxx;

/// Builds the host library once per test binary; `None` when no compiler is available.
fn host_kernel() -> Option<&'static (libloading::Library, Launch)> {
    static LIB: OnceLock<Option<(libloading::Library, Launch)>> = OnceLock::new();
    LIB.get_or_init(|| {
        let lib = host_cxx::build("aes_ctr.cu", SOURCE, "harness.cpp", "TURBOIO_AES_CU")?;
        // SAFETY: the symbol is `turboio_host_launch` of harness.cpp, whose C signature is `Launch`.
        let f: Launch = unsafe { *lib.get::<Launch>(b"turboio_host_launch\0").expect("symbol") };
        Some((lib, f))
    })
    .as_ref()
}

/// xorshift64*: deterministic test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Runs the host-compiled kernel on `data` (whose first byte is keystream byte `pos`).
fn kernel(launch: Launch, key: &[u8], iv: &[u8; 16], pos: u64, data: &mut [u8], grid: u32) {
    let rk = RoundKeys::expand(key).unwrap();
    let (hi, lo) = iv_halves(iv);
    // SAFETY: data is a valid, exclusive buffer of data.len() bytes; the round keys hold
    // 4 * (rounds + 1) words; the kernel touches nothing else.
    unsafe { launch(data.as_mut_ptr(), data.len() as u64, rk.words().as_ptr(), rk.rounds(), hi, lo, pos, grid) };
}

fn reference(key: &[u8], iv: &[u8; 16], pos: u64, data: &mut [u8]) {
    CtrCipher::new(&Key::new(key).unwrap(), &Iv(*iv)).apply_at(pos, data);
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

#[test]
fn kernel_matches_published_vectors() {
    let Some(&(_, launch)) = host_kernel() else { return };
    // veTurboIO's test key and IV (spec/veturboio.md §2.4, computed with Python cryptography).
    let key = b"abcdefgh12345678";
    let iv: [u8; 16] = *b"1234567887654321";
    let mut ks = vec![0u8; 64];
    kernel(launch, key, &iv, 0, &mut ks, 3);
    assert_eq!(
        ks,
        hex("2fe4fb3e78c72433551b7a69522a4d8e93114ff735af07fcd70e74aeaa86671bff99a7a2365c5d4b973b645e5e759bf1eacb21b0b9f23830049c283e5617d5d3")
    );
    let mut at = vec![0u8; 7];
    kernel(launch, key, &iv, 4093, &mut at, 1);
    assert_eq!(at, hex("ff94310ae2880d"));
    // The counter wraps through all 128 bits: IV = ff..ff, block 1 is AES_K(0).
    let mut wrap = vec![0u8; 16];
    kernel(launch, key, &[0xff; 16], 16, &mut wrap, 1);
    assert_eq!(wrap, hex("2e8c749efed4583c3931d9766e43984e"));
    let mut k256 = vec![0u8; 32];
    kernel(launch, b"abcdefgh12345678abcdefgh12345678", &iv, 0, &mut k256, 2);
    assert_eq!(k256, hex("70878b1bb3f32d621046d2e00b2620da78bfe0d994801ae71844d37330ee9ff7"));
    // FIPS-197 C.1 / C.3 through CTR at counter 0: the keystream's first block is AES_K(IV).
    let mut c1 = vec![0u8; 16];
    kernel(launch, &hex("000102030405060708090a0b0c0d0e0f"), &hex16("00112233445566778899aabbccddeeff"), 0, &mut c1, 1);
    assert_eq!(c1, hex("69c4e0d86a7b0430d8cdb78070b4c55a"));
    let mut c3 = vec![0u8; 16];
    let k = hex("000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f");
    kernel(launch, &k, &hex16("00112233445566778899aabbccddeeff"), 0, &mut c3, 1);
    assert_eq!(c3, hex("8ea2b7ca516745bfeafc49904b496089"));
}

fn hex16(s: &str) -> [u8; 16] {
    hex(s).try_into().unwrap()
}

#[test]
fn kernel_matches_turboio_cipher_on_random_inputs() {
    let Some(&(_, launch)) = host_kernel() else { return };
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for case in 0..400 {
        let key = rng.bytes(if case % 2 == 0 { 16 } else { 32 });
        let mut iv: [u8; 16] = rng.bytes(16).try_into().unwrap();
        if case % 5 == 0 {
            // Low 64 bits about to overflow into the high half.
            iv[8..].copy_from_slice(&(u64::MAX - rng.below(40)).to_be_bytes());
        }
        if case % 17 == 0 {
            iv = [0xff; 16];
        }
        let pos = match case % 4 {
            0 => rng.below(64),
            1 => rng.below(1 << 40),
            2 => u64::MAX - rng.below(1 << 12),
            _ => rng.next(),
        };
        let len = match case % 3 {
            0 => rng.below(48) as usize,
            1 => rng.below(5000) as usize,
            _ => 16 * rng.below(300) as usize,
        };
        // Unaligned starts exercise the byte path; aligned ones the word path.
        let misalign = rng.below(4) as usize;
        let mut buf = rng.bytes(len + misalign);
        let original = buf.clone();
        let grid = [1u32, 2, 3, 7, 64][case % 5];
        let data = &mut buf[misalign..];
        let mut expect = data.to_vec();
        reference(&key, &iv, pos, &mut expect);
        kernel(launch, &key, &iv, pos, data, grid);
        assert!(
            data == &expect[..],
            "case {case}: key {} bytes, pos {pos}, len {len}, misalign {misalign}, grid {grid}",
            key.len()
        );
        assert_eq!(&buf[..misalign], &original[..misalign], "case {case}: bytes before the buffer untouched");
    }
}

#[test]
fn chunks_decrypt_independently_at_any_offset() {
    let Some(&(_, launch)) = host_kernel() else { return };
    let mut rng = Rng(42);
    let key = rng.bytes(32);
    let iv: [u8; 16] = rng.bytes(16).try_into().unwrap();
    let plain = rng.bytes(100_003);
    let mut cipher = plain.clone();
    reference(&key, &iv, 262_144, &mut cipher);
    // Decrypt in uneven chunks, as the staged loader uploads them.
    let mut at = 0;
    let mut out = cipher.clone();
    for step in [1usize, 15, 16, 17, 4095, 4096, 33_333] {
        let end = (at + step).min(out.len());
        kernel(launch, &key, &iv, 262_144 + at as u64, &mut out[at..end], 5);
        at = end;
    }
    kernel(launch, &key, &iv, 262_144 + at as u64, &mut out[at..], 9);
    assert!(out == plain);
}
