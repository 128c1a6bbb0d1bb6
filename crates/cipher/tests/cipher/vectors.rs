//! The test vectors of the spec (../shared/spec/veturboio.md §2.4), computed independently with
//! Python `cryptography`.

use turboio_cipher::{CtrCipher, Iv, Key};

use crate::reference::{hex, unhex, IV, KEY128, KEY256};

fn cipher(key: &[u8], iv: [u8; 16]) -> CtrCipher {
    CtrCipher::new(&Key::new(key).unwrap(), &Iv(iv))
}

fn keystream(c: &CtrCipher, pos: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    c.apply_at(pos, &mut buf);
    buf
}

#[test]
fn keystream_first_64_bytes() {
    let want = "2fe4fb3e78c72433551b7a69522a4d8e 93114ff735af07fcd70e74aeaa86671b \
                ff99a7a2365c5d4b973b645e5e759bf1 eacb21b0b9f23830049c283e5617d5d3";
    assert_eq!(hex(&keystream(&cipher(KEY128, IV), 0, 64)), hex(&unhex(want)));
}

#[test]
fn encrypt_hello_twice() {
    let mut buf = b"Hello veTurboIO!Hello veTurboIO!".to_vec();
    cipher(KEY128, IV).apply_at(0, &mut buf);
    assert_eq!(hex(&buf), "6781975217e75256016e080b3d6302afdb74239b5a8f7199837b06ccc5cf283a");
}

#[test]
fn keystream_bytes_4093_to_4099() {
    let c = cipher(KEY128, IV);
    assert_eq!(hex(&keystream(&c, 4093, 7)), "ff94310ae2880d");
    // The same bytes read out of a longer pass from 0.
    assert_eq!(hex(&keystream(&c, 0, 4100)[4093..4100]), "ff94310ae2880d");
}

#[test]
fn counter_wraps_through_all_16_bytes() {
    // IV ff..ff: block 1 uses counter 00..00.
    let c = cipher(KEY128, [0xff; 16]);
    assert_eq!(hex(&keystream(&c, 16, 16)), "2e8c749efed4583c3931d9766e43984e");
    let zero = cipher(KEY128, [0; 16]);
    assert_eq!(keystream(&c, 16, 16), keystream(&zero, 0, 16));
}

#[test]
fn carry_crosses_the_low_64_bits() {
    // IV 00..00 ff..ff (low half all ones): block 1 is 00..01 00..00, not a 64-bit wrap.
    let mut iv = [0u8; 16];
    iv[8..].fill(0xff);
    let c = cipher(KEY128, iv);
    let mut next = [0u8; 16];
    next[7] = 1;
    assert_eq!(keystream(&c, 16, 16), keystream(&cipher(KEY128, next), 0, 16));
}

#[test]
fn aes256_first_32_bytes() {
    assert_eq!(
        hex(&keystream(&cipher(KEY256, IV), 0, 32)),
        "70878b1bb3f32d621046d2e00b2620da78bfe0d994801ae71844d37330ee9ff7"
    );
}
