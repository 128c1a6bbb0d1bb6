//! Whole-file and streaming helpers.

use std::io::{Read, Write};

use turboio_cipher::{
    decrypt_file_bytes, encrypt_file_bytes, CipherError, CipherHeader, CtrCipher, DecryptingReader, EncryptingWriter,
    Iv, Key, Layout, Mode, HEADER_SIZE,
};

use crate::reference::{bytes, xor_at, KEY128};

fn setup() -> (CtrCipher, CipherHeader) {
    let iv = Iv(*b"1234567887654321");
    let c = CtrCipher::new(&Key::new(KEY128).unwrap(), &iv);
    let h = CipherHeader { mode: Mode::Ctr128, iv, meta_data_key: "blob".into(), file_timestamp: 1 };
    (c, h)
}

#[test]
fn headerless_file() {
    let (c, _) = setup();
    let plain = bytes(1, 3 << 20);
    let enc = encrypt_file_bytes(&plain, &c, None).unwrap();
    assert_eq!(enc, xor_at(KEY128, c.iv().0, 0, &plain));
    assert_eq!(decrypt_file_bytes(&enc, &c, Layout::Headerless).unwrap(), plain);
}

#[test]
fn file_with_header() {
    let (c, h) = setup();
    let plain = bytes(2, 100_003);
    let enc = encrypt_file_bytes(&plain, &c, Some(&h)).unwrap();
    assert_eq!(enc.len() as u64, HEADER_SIZE + plain.len() as u64);
    assert_eq!(enc[..HEADER_SIZE as usize], h.to_bytes().unwrap());
    // The data after the header starts at keystream position 0.
    assert_eq!(enc[HEADER_SIZE as usize..], xor_at(KEY128, c.iv().0, 0, &plain));
    assert_eq!(CipherHeader::parse(&enc, enc.len() as u64).unwrap(), Some(h));
    assert_eq!(decrypt_file_bytes(&enc, &c, Layout::WithHeader).unwrap(), plain);
    let e = decrypt_file_bytes(&enc[..1000], &c, Layout::WithHeader).unwrap_err();
    assert!(matches!(e, CipherError::Truncated { len: 1000, need: HEADER_SIZE }));
    // An empty plain file is just the header.
    assert_eq!(encrypt_file_bytes(b"", &c, Some(&setup().1)).unwrap().len() as u64, HEADER_SIZE);
}

#[test]
fn header_must_match_the_cipher() {
    let (c, mut h) = setup();
    h.iv = Iv([9; 16]);
    let e = encrypt_file_bytes(b"x", &c, Some(&h)).unwrap_err().to_string();
    assert!(e.contains("iv"), "{e}");
    let (c, mut h) = setup();
    h.mode = Mode::Ctr256;
    let e = encrypt_file_bytes(b"x", &c, Some(&h)).unwrap_err().to_string();
    assert!(e.contains("mode"), "{e}");
}

#[test]
fn streaming_writer_and_reader() {
    let (c, h) = setup();
    let plain = bytes(3, (2 << 20) + 77);
    let mut file = h.to_bytes().unwrap();
    let mut w = EncryptingWriter::new(&mut file, c.clone(), 0);
    // Odd-sized writes.
    for part in plain.chunks(33_333) {
        w.write_all(part).unwrap();
    }
    w.flush().unwrap();
    assert_eq!(w.position(), plain.len() as u64);
    drop(w);
    assert_eq!(file, encrypt_file_bytes(&plain, &c, Some(&h)).unwrap());

    let mut r = DecryptingReader::new(&file[HEADER_SIZE as usize..], c.clone(), 0);
    let mut back = Vec::new();
    let mut small = [0u8; 4097];
    loop {
        let n = r.read(&mut small).unwrap();
        if n == 0 {
            break;
        }
        back.extend_from_slice(&small[..n]);
    }
    assert_eq!(r.position(), plain.len() as u64);
    assert_eq!(back, plain);
}
