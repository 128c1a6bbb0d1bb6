//! The AES-CTR kernel that decrypts loads in device memory, and the host half it needs.
//!
//! [`SOURCE`] is one CUDA C++ file (`src/cuda/aes_ctr.cu`) that the CUDA device compiles with
//! NVRTC at run time and that the test suite also compiles as plain C++ for the host (with a small
//! shim for the CUDA qualifiers), so the kernel's arithmetic is checked against `turboio-cipher`
//! on machines without a GPU. The key schedule is expanded here, on the host ([`RoundKeys`]),
//! and copied to device memory for the duration of a load; both copies are zeroed afterwards.
//!
//! The kernel's contract: `turboio_aes_ctr_xor(data, len, round_keys, rounds, iv_hi, iv_lo, pos)`
//! XORs keystream bytes `pos .. pos + len` into `data[0 .. len]`, where keystream byte `p` is
//! `AES_K(IV + p / 16)[p % 16]` with a 128-bit big-endian counter (`iv_hi` and `iv_lo` are the
//! IV's two big-endian halves). Any launch shape works (grid-stride loop).

use std::fmt;

/// The kernel source (CUDA C++; also valid C++ with the host shim of the tests).
pub const SOURCE: &str = include_str!("cuda/aes_ctr.cu");

/// The kernel's entry point (`extern "C"`).
pub const KERNEL_NAME: &str = "turboio_aes_ctr_xor";

/// The AES S-box (FIPS-197 figure 7).
const SBOX: [u8; 256] = [
    0x63, 0x7c, 0x77, 0x7b, 0xf2, 0x6b, 0x6f, 0xc5, 0x30, 0x01, 0x67, 0x2b, 0xfe, 0xd7, 0xab, 0x76, 0xca, 0x82, 0xc9,
    0x7d, 0xfa, 0x59, 0x47, 0xf0, 0xad, 0xd4, 0xa2, 0xaf, 0x9c, 0xa4, 0x72, 0xc0, 0xb7, 0xfd, 0x93, 0x26, 0x36, 0x3f,
    0xf7, 0xcc, 0x34, 0xa5, 0xe5, 0xf1, 0x71, 0xd8, 0x31, 0x15, 0x04, 0xc7, 0x23, 0xc3, 0x18, 0x96, 0x05, 0x9a, 0x07,
    0x12, 0x80, 0xe2, 0xeb, 0x27, 0xb2, 0x75, 0x09, 0x83, 0x2c, 0x1a, 0x1b, 0x6e, 0x5a, 0xa0, 0x52, 0x3b, 0xd6, 0xb3,
    0x29, 0xe3, 0x2f, 0x84, 0x53, 0xd1, 0x00, 0xed, 0x20, 0xfc, 0xb1, 0x5b, 0x6a, 0xcb, 0xbe, 0x39, 0x4a, 0x4c, 0x58,
    0xcf, 0xd0, 0xef, 0xaa, 0xfb, 0x43, 0x4d, 0x33, 0x85, 0x45, 0xf9, 0x02, 0x7f, 0x50, 0x3c, 0x9f, 0xa8, 0x51, 0xa3,
    0x40, 0x8f, 0x92, 0x9d, 0x38, 0xf5, 0xbc, 0xb6, 0xda, 0x21, 0x10, 0xff, 0xf3, 0xd2, 0xcd, 0x0c, 0x13, 0xec, 0x5f,
    0x97, 0x44, 0x17, 0xc4, 0xa7, 0x7e, 0x3d, 0x64, 0x5d, 0x19, 0x73, 0x60, 0x81, 0x4f, 0xdc, 0x22, 0x2a, 0x90, 0x88,
    0x46, 0xee, 0xb8, 0x14, 0xde, 0x5e, 0x0b, 0xdb, 0xe0, 0x32, 0x3a, 0x0a, 0x49, 0x06, 0x24, 0x5c, 0xc2, 0xd3, 0xac,
    0x62, 0x91, 0x95, 0xe4, 0x79, 0xe7, 0xc8, 0x37, 0x6d, 0x8d, 0xd5, 0x4e, 0xa9, 0x6c, 0x56, 0xf4, 0xea, 0x65, 0x7a,
    0xae, 0x08, 0xba, 0x78, 0x25, 0x2e, 0x1c, 0xa6, 0xb4, 0xc6, 0xe8, 0xdd, 0x74, 0x1f, 0x4b, 0xbd, 0x8b, 0x8a, 0x70,
    0x3e, 0xb5, 0x66, 0x48, 0x03, 0xf6, 0x0e, 0x61, 0x35, 0x57, 0xb9, 0x86, 0xc1, 0x1d, 0x9e, 0xe1, 0xf8, 0x98, 0x11,
    0x69, 0xd9, 0x8e, 0x94, 0x9b, 0x1e, 0x87, 0xe9, 0xce, 0x55, 0x28, 0xdf, 0x8c, 0xa1, 0x89, 0x0d, 0xbf, 0xe6, 0x42,
    0x68, 0x41, 0x99, 0x2d, 0x0f, 0xb0, 0x54, 0xbb, 0x16,
];

/// Round constants for the key expansion.
const RCON: [u32; 10] = [
    0x0100_0000,
    0x0200_0000,
    0x0400_0000,
    0x0800_0000,
    0x1000_0000,
    0x2000_0000,
    0x4000_0000,
    0x8000_0000,
    0x1b00_0000,
    0x3600_0000,
];

fn sub_word(w: u32) -> u32 {
    let b = w.to_be_bytes().map(|x| SBOX[x as usize]);
    u32::from_be_bytes(b)
}

/// An expanded AES encryption key schedule (44 words for AES-128, 60 for AES-256), as the
/// kernel takes it: big-endian words, round 0 first. Zeroed when dropped; `Debug` shows only
/// the number of rounds.
pub struct RoundKeys {
    words: [u32; 60],
    rounds: u32,
}

impl RoundKeys {
    /// Expands a 16-byte (AES-128) or 32-byte (AES-256) key; `None` for any other length.
    pub fn expand(key: &[u8]) -> Option<RoundKeys> {
        let nk = match key.len() {
            16 => 4,
            32 => 8,
            _ => return None,
        };
        let rounds = nk as u32 + 6;
        let total = 4 * (rounds as usize + 1);
        let mut words = [0u32; 60];
        for (i, chunk) in key.chunks_exact(4).enumerate() {
            words[i] = u32::from_be_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        }
        for i in nk..total {
            let mut t = words[i - 1];
            if i % nk == 0 {
                t = sub_word(t.rotate_left(8)) ^ RCON[i / nk - 1];
            } else if nk > 6 && i % nk == 4 {
                t = sub_word(t);
            }
            words[i] = words[i - nk] ^ t;
        }
        Some(RoundKeys { words, rounds })
    }

    /// The schedule's words (`4 * (rounds + 1)` of them).
    pub fn words(&self) -> &[u32] {
        &self.words[..4 * (self.rounds as usize + 1)]
    }

    /// 10 (AES-128) or 14 (AES-256).
    pub fn rounds(&self) -> u32 {
        self.rounds
    }

    /// The schedule as the bytes of native-endian `u32`s, for a copy to device memory.
    pub fn to_ne_bytes(&self) -> Vec<u8> {
        self.words().iter().flat_map(|w| w.to_ne_bytes()).collect()
    }
}

impl Drop for RoundKeys {
    fn drop(&mut self) {
        for w in self.words.iter_mut() {
            // SAFETY: `w` is a valid, aligned, exclusive reference; a volatile write keeps the
            // compiler from eliding the zeroing of memory that is about to be freed.
            unsafe { std::ptr::write_volatile(w, 0) };
        }
    }
}

impl fmt::Debug for RoundKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RoundKeys").field("rounds", &self.rounds).finish_non_exhaustive()
    }
}

/// The IV as the kernel takes it: its big-endian high and low halves.
pub fn iv_halves(iv: &[u8; 16]) -> (u64, u64) {
    let mut hi = [0u8; 8];
    let mut lo = [0u8; 8];
    hi.copy_from_slice(&iv[..8]);
    lo.copy_from_slice(&iv[8..]);
    (u64::from_be_bytes(hi), u64::from_be_bytes(lo))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn key_expansion_matches_fips_197() {
        // FIPS-197 appendix A.1 (AES-128) and A.3 (AES-256): first and last words.
        let k = RoundKeys::expand(&hex("2b7e151628aed2a6abf7158809cf4f3c")).unwrap();
        assert_eq!(k.rounds(), 10);
        assert_eq!(k.words().len(), 44);
        assert_eq!(k.words()[4], 0xa0fafe17);
        assert_eq!(k.words()[43], 0xb6630ca6);
        let k = RoundKeys::expand(&hex("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4")).unwrap();
        assert_eq!(k.rounds(), 14);
        assert_eq!(k.words().len(), 60);
        assert_eq!(k.words()[8], 0x9ba35411);
        assert_eq!(k.words()[59], 0x706c631e);
        assert!(RoundKeys::expand(&[0u8; 24]).is_none(), "AES-192 is not a veTurboIO mode");
        assert!(!format!("{k:?}").contains("706c"), "Debug shows no key material");
    }

    #[test]
    fn iv_halves_are_big_endian() {
        let iv: [u8; 16] = std::array::from_fn(|i| i as u8);
        assert_eq!(iv_halves(&iv), (0x0001_0203_0405_0607, 0x0809_0a0b_0c0d_0e0f));
    }
}
