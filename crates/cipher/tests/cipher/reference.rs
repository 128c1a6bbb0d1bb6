//! An independent reference: the AES block function applied to counter blocks one by one,
//! with the counter arithmetic written out here (not `ctr`, not `CtrCipher`).

use aes::cipher::{BlockEncrypt, KeyInit};

/// Keystream bytes `pos .. pos + len` (positions may exceed 2^64).
pub fn keystream(key: &[u8], iv: [u8; 16], pos: u128, len: usize) -> Vec<u8> {
    let aes_block: Box<dyn Fn(&mut aes::Block)> = match key.len() {
        16 => {
            let c = aes::Aes128::new_from_slice(key).unwrap();
            Box::new(move |b| c.encrypt_block(b))
        }
        32 => {
            let c = aes::Aes256::new_from_slice(key).unwrap();
            Box::new(move |b| c.encrypt_block(b))
        }
        n => panic!("bad key length {n}"),
    };
    let encrypt = |block: &mut [u8; 16]| aes_block(aes::Block::from_mut_slice(block));
    let iv = u128::from_be_bytes(iv);
    let mut out = Vec::with_capacity(len);
    let mut p = pos;
    while out.len() < len {
        let mut block = iv.wrapping_add(p / 16).to_be_bytes();
        encrypt(&mut block);
        let from = (p % 16) as usize;
        let take = (16 - from).min(len - out.len());
        out.extend_from_slice(&block[from..from + take]);
        p += take as u128;
    }
    out
}

/// `data` XOR the reference keystream from `pos`.
pub fn xor_at(key: &[u8], iv: [u8; 16], pos: u128, data: &[u8]) -> Vec<u8> {
    keystream(key, iv, pos, data.len()).iter().zip(data).map(|(k, d)| k ^ d).collect()
}

/// Deterministic pseudo-random bytes (splitmix64).
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut s = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

pub const KEY128: &[u8; 16] = b"abcdefgh12345678";
pub const KEY256: &[u8; 32] = b"abcdefgh12345678abcdefgh12345678";
pub const IV: [u8; 16] = *b"1234567887654321";
