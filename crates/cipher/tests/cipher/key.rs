//! Keys, IVs and modes: lengths, redaction, zeroize.

use turboio_cipher::zeroize::ZeroizeOnDrop;
use turboio_cipher::{CipherError, CtrCipher, Iv, Key, Mode};

use crate::reference::{hex, KEY128, KEY256};

#[test]
fn key_lengths() {
    for len in [0usize, 1, 15, 17, 24, 31, 33, 64] {
        let err = Key::new(&vec![7u8; len]).unwrap_err();
        assert!(matches!(err, CipherError::InvalidKeyLength { len: l } if l == len));
        let msg = err.to_string();
        assert!(msg.contains(&format!("{len} bytes")), "{msg}");
        assert!(msg.contains("16") && msg.contains("32"), "{msg}");
    }
    let k = Key::new(KEY128).unwrap();
    assert_eq!((k.len(), k.mode(), k.expose()), (16, Mode::Ctr128, &KEY128[..]));
    let k = Key::new(KEY256).unwrap();
    assert_eq!((k.len(), k.mode(), k.expose()), (32, Mode::Ctr256, &KEY256[..]));
    assert!(k.check_mode(Mode::Ctr256).is_ok());
    let e = k.check_mode(Mode::Ctr128).unwrap_err().to_string();
    assert!(e.contains("256-bit key") && e.contains("CTR-128"), "{e}");
}

#[test]
fn iv_length() {
    assert_eq!(Iv::new(&[1u8; 16]).unwrap(), Iv([1; 16]));
    for len in [0usize, 15, 17, 32] {
        let e = Iv::new(&vec![0u8; len]).unwrap_err();
        assert!(matches!(e, CipherError::InvalidIvLength { len: l } if l == len));
    }
}

#[test]
fn modes_parse_and_print() {
    assert_eq!("CTR-128".parse::<Mode>().unwrap(), Mode::Ctr128);
    assert_eq!("CTR-256".parse::<Mode>().unwrap(), Mode::Ctr256);
    assert_eq!(Mode::Ctr128.as_str(), "CTR-128");
    assert_eq!(Mode::Ctr256.to_string(), "CTR-256");
    for bad in ["ctr-128", "CTR-192", "", "CTR_128", "CBC-128"] {
        let e = bad.parse::<Mode>().unwrap_err().to_string();
        assert!(e.contains("unknown cipher mode") && e.contains(&format!("{bad:?}")), "{e}");
    }
}

/// Every way the key's bytes could be spelled in formatted output.
fn spellings(key: &[u8]) -> Vec<String> {
    vec![
        hex(key),
        format!("{key:?}"),
        format!("{key:x?}"),
        String::from_utf8_lossy(key).into_owned(),
        turboio_cipher::b64_encode(key),
        key[..4].iter().map(|b| b.to_string()).collect::<Vec<_>>().join(", "),
    ]
}

#[test]
fn debug_never_shows_the_key() {
    for bytes in [&KEY128[..], &KEY256[..]] {
        let key = Key::new(bytes).unwrap();
        let c = CtrCipher::new(&key, &Iv(*b"1234567887654321"));
        let outputs = [format!("{key:?}"), format!("{key:#?}"), format!("{c:?}"), format!("{c:#?}")];
        assert_eq!(outputs[0], format!("Key(<redacted>, {} bits)", bytes.len() * 8));
        assert!(outputs[2].contains("<redacted>"), "{}", outputs[2]);
        for out in &outputs {
            for s in spellings(bytes) {
                assert!(!out.contains(&s), "{out:?} contains {s:?}");
            }
        }
        // The IV is not secret and may show.
        assert!(outputs[2].contains("iv"));
    }
}

#[test]
fn key_hygiene_traits() {
    fn zeroized_on_drop<T: ZeroizeOnDrop>() {}
    zeroized_on_drop::<Key>();
    // The expanded key schedules the cipher holds are zeroized by the aes crate too.
    zeroized_on_drop::<aes::Aes128Enc>();
    zeroized_on_drop::<aes::Aes256Enc>();
    fn clone_send_sync<T: Clone + Send + Sync>() {}
    clone_send_sync::<Key>();
}

#[test]
fn random_keys_and_ivs() {
    let a = Key::random(Mode::Ctr128);
    let b = Key::random(Mode::Ctr128);
    assert_eq!(a.len(), 16);
    assert_ne!(a.expose(), b.expose());
    assert_eq!(Key::random(Mode::Ctr256).len(), 32);
    assert_eq!(Key::try_random(Mode::Ctr256).unwrap().mode(), Mode::Ctr256);
    assert_ne!(Iv::random(), Iv::random());
}

#[test]
fn base64_round_trips_and_errors_do_not_echo() {
    let key = Key::from_base64("YWJjZGVmZ2gxMjM0NTY3OA==").unwrap();
    assert_eq!(key.expose(), KEY128);
    assert_eq!(&*key.to_base64(), "YWJjZGVmZ2gxMjM0NTY3OA==");
    let iv = Iv::from_base64("MTIzNDU2Nzg4NzY1NDMyMQ==").unwrap();
    assert_eq!(&iv.0, b"1234567887654321");
    assert_eq!(iv.to_base64(), "MTIzNDU2Nzg4NzY1NDMyMQ==");
    // A bad character: the error names the offset, not the text.
    let e = Key::from_base64("YWJjZGVmZ2gxMjM0NTY3O*==").unwrap_err().to_string();
    assert!(e.contains("offset 21") && !e.contains("YWJj") && !e.contains('*'), "{e}");
    let e = Key::from_base64("YWJjZGVm").unwrap_err().to_string();
    assert!(e.contains("6 bytes"), "{e}");
    assert!(Iv::from_base64("YWJjZGVm").is_err());
    assert!(Key::from_base64("YWJjZGVmZ2gxMjM0NTY3OA").is_err(), "missing padding");
}
