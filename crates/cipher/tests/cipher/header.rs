//! The 256 KiB header: exact bytes, round trip, recognition and rejection.

use turboio_cipher::{CipherError, CipherHeader, Iv, Layout, Mode, HEADER_SIZE, MAGIC};

fn sample() -> CipherHeader {
    CipherHeader {
        mode: Mode::Ctr128,
        iv: Iv(*b"1234567887654321"),
        meta_data_key: "bl2htKYLQ2+CjyyJ84Q3twAA9ZpCbFxwznRb0NkR9zGGRp1RK5Mb9u8NNOiahY+0yVrxNw3IVQ9Wgn6PDscw77Cb3eImjVn14hNBJRlwtSyQ7tRZLOsZBEHv5cWwDQ==".to_string(),
        file_timestamp: 1_700_000_000,
    }
}

/// magic + `json` + NUL padding to HEADER_SIZE.
fn block(json: &[u8]) -> Vec<u8> {
    let mut b = Vec::from(&MAGIC[..]);
    b.extend_from_slice(json);
    b.resize(HEADER_SIZE as usize, 0);
    b
}

#[test]
fn exact_bytes_of_a_known_header() {
    let h = sample();
    let bytes = h.to_bytes().unwrap();
    // What Python's json.dumps writes, by hand.
    let json = "{\"mode\": \"CTR-128\", \"iv\": \"MTIzNDU2Nzg4NzY1NDMyMQ==\", \"meta_data_key\": \
                \"bl2htKYLQ2+CjyyJ84Q3twAA9ZpCbFxwznRb0NkR9zGGRp1RK5Mb9u8NNOiahY+0yVrxNw3IVQ9Wgn6PDscw77Cb3eImjVn14hNBJRlwtSyQ7tRZLOsZBEHv5cWwDQ==\", \
                \"file_timestamp\": 1700000000}";
    assert_eq!(bytes.len() as u64, HEADER_SIZE);
    assert_eq!(&bytes[..16], b"Byte3ncryptM0del");
    assert_eq!(
        &bytes[..16],
        &[0x42, 0x79, 0x74, 0x65, 0x33, 0x6e, 0x63, 0x72, 0x79, 0x70, 0x74, 0x4d, 0x30, 0x64, 0x65, 0x6c]
    );
    assert_eq!(std::str::from_utf8(&bytes[16..16 + json.len()]).unwrap(), json);
    assert!(bytes[16 + json.len()..].iter().all(|&b| b == 0));
    assert_eq!(bytes, block(json.as_bytes()));
    assert_eq!(h.to_json(), json);
}

#[test]
fn json_escapes_like_python() {
    let mut h = sample();
    h.mode = Mode::Ctr256;
    h.file_timestamp = -5;
    h.meta_data_key = "a\"b\\c\n\t\u{1}\u{7f}é€😀/".to_string();
    // json.dumps({"mode": "CTR-256", ...}) with ensure_ascii=True.
    assert_eq!(
        h.to_json(),
        "{\"mode\": \"CTR-256\", \"iv\": \"MTIzNDU2Nzg4NzY1NDMyMQ==\", \"meta_data_key\": \
         \"a\\\"b\\\\c\\n\\t\\u0001\\u007f\\u00e9\\u20ac\\ud83d\\ude00/\", \"file_timestamp\": -5}"
    );
    let back = CipherHeader::parse(&h.to_bytes().unwrap(), HEADER_SIZE).unwrap().unwrap();
    assert_eq!(back, h);
}

#[test]
fn round_trip() {
    for (mode, ts) in [(Mode::Ctr128, 0i64), (Mode::Ctr256, i64::MAX), (Mode::Ctr128, i64::MIN)] {
        let h = CipherHeader { mode, iv: Iv::random(), meta_data_key: String::new(), file_timestamp: ts };
        let bytes = h.to_bytes().unwrap();
        assert_eq!(CipherHeader::parse(&bytes, HEADER_SIZE).unwrap(), Some(h.clone()));
        // Longer file, and only a prefix of the header passed (up to its NUL).
        assert_eq!(CipherHeader::parse(&bytes, 1 << 40).unwrap(), Some(h.clone()));
        let nul = 16 + h.to_json().len();
        assert_eq!(CipherHeader::parse(&bytes[..nul + 1], 1 << 20).unwrap(), Some(h.clone()));
        // Extra bytes after the header are ignored.
        let mut more = bytes.clone();
        more.extend_from_slice(b"ciphertext");
        assert_eq!(CipherHeader::parse(&more, more.len() as u64).unwrap(), Some(h));
    }
}

#[test]
fn not_a_header_file() {
    let good = sample().to_bytes().unwrap();
    // No magic: plain safetensors, headerless ciphertext, anything.
    let mut other = good.clone();
    other[0] ^= 1;
    assert_eq!(CipherHeader::parse(&other, HEADER_SIZE).unwrap(), None);
    assert_eq!(CipherHeader::parse(b"", 0).unwrap(), None);
    assert_eq!(CipherHeader::parse(&MAGIC[..15], HEADER_SIZE).unwrap(), None);
    assert_eq!(CipherHeader::parse(&[0u8; 300_000], 300_000).unwrap(), None);
    // Shorter than the header: never a header file, even with the magic and valid JSON.
    assert_eq!(CipherHeader::parse(&good, HEADER_SIZE - 1).unwrap(), None);
    assert_eq!(CipherHeader::parse(&good[..1000], 1000).unwrap(), None);
}

fn err(json: &[u8]) -> String {
    match CipherHeader::parse(&block(json), HEADER_SIZE) {
        Err(e @ CipherError::InvalidHeader(_)) => e.to_string(),
        other => panic!("{:?}: expected InvalidHeader, got {other:?}", String::from_utf8_lossy(json)),
    }
}

#[test]
fn bad_headers_are_errors_naming_the_problem() {
    let iv = "MTIzNDU2Nzg4NzY1NDMyMQ==";
    let cases: Vec<(String, &str)> = vec![
        ("garbage{".into(), "does not parse"),
        ("".into(), "does not parse"),
        ("[1, 2]".into(), "an array, not an object"),
        (format!(r#"{{"iv": "{iv}", "meta_data_key": "k"}}"#), "\"mode\" is missing"),
        (format!(r#"{{"mode": 128, "iv": "{iv}", "meta_data_key": "k"}}"#), "\"mode\" is a number"),
        (format!(r#"{{"mode": "CTR-192", "iv": "{iv}", "meta_data_key": "k"}}"#), "unknown cipher mode \"CTR-192\""),
        (format!(r#"{{"mode": "ctr-128", "iv": "{iv}", "meta_data_key": "k"}}"#), "unknown cipher mode"),
        (r#"{"mode": "CTR-128", "meta_data_key": "k"}"#.into(), "\"iv\" is missing"),
        (
            r#"{"mode": "CTR-128", "iv": "not base64!", "meta_data_key": "k"}"#.into(),
            "invalid base64 in the header's \"iv\"",
        ),
        (
            r#"{"mode": "CTR-128", "iv": "MTIzNDU2Nzg=", "meta_data_key": "k"}"#.into(),
            "\"iv\" decodes to 8 bytes, expected 16",
        ),
        (
            r#"{"mode": "CTR-128", "iv": "MTIzNDU2Nzg4NzY1NDMyMTEyMzQ1Njc4ODc2NTQzMjE=", "meta_data_key": "k"}"#.into(),
            "decodes to 32 bytes",
        ),
        (format!(r#"{{"mode": "CTR-128", "iv": "{iv}"}}"#), "\"meta_data_key\" is missing"),
        (format!(r#"{{"mode": "CTR-128", "iv": "{iv}", "meta_data_key": null}}"#), "\"meta_data_key\" is null"),
        (
            format!(r#"{{"mode": "CTR-128", "iv": "{iv}", "meta_data_key": "k", "file_timestamp": "now"}}"#),
            "\"file_timestamp\" is a string",
        ),
        (
            format!(r#"{{"mode": "CTR-128", "iv": "{iv}", "meta_data_key": "k", "file_timestamp": 1.5}}"#),
            "\"file_timestamp\" is a number, not a 64-bit integer",
        ),
    ];
    for (json, want) in cases {
        let msg = err(json.as_bytes());
        assert!(msg.starts_with("invalid encrypted-file header: "), "{msg}");
        assert!(msg.contains(want), "{json}: {msg:?} does not contain {want:?}");
    }
    assert!(err(b"\xff\xfe{}").contains("not valid UTF-8"));
}

#[test]
fn lenient_where_python_is() {
    // Extra keys, other key order, compact separators, no file_timestamp: all fine.
    let json = br#"{"iv":"MTIzNDU2Nzg4NzY1NDMyMQ==","extra":[1],"meta_data_key":"k","mode":"CTR-256"}"#;
    let h = CipherHeader::parse(&block(json), HEADER_SIZE).unwrap().unwrap();
    assert_eq!(h.mode, Mode::Ctr256);
    assert_eq!(h.meta_data_key, "k");
    assert_eq!(h.file_timestamp, 0);
    // Duplicate keys: the last one wins, as in Python's json.loads.
    let json = br#"{"mode": "CTR-256", "mode": "CTR-128", "iv": "MTIzNDU2Nzg4NzY1NDMyMQ==", "meta_data_key": "k"}"#;
    let h = CipherHeader::parse(&block(json), HEADER_SIZE).unwrap().unwrap();
    assert_eq!(h.mode, Mode::Ctr128);
}

#[test]
fn missing_nul_terminator() {
    let mut full = vec![b' '; HEADER_SIZE as usize];
    full[..16].copy_from_slice(MAGIC);
    let e = CipherHeader::parse(&full, HEADER_SIZE).unwrap_err().to_string();
    assert!(e.contains("not NUL-terminated"), "{e}");
    // Too little of the file given to find the end of the JSON.
    let e = CipherHeader::parse(&full[..1000], HEADER_SIZE).unwrap_err();
    assert!(matches!(e, CipherError::Truncated { len: 1000, need: HEADER_SIZE }), "{e}");
}

#[test]
fn json_too_long() {
    let mut h = sample();
    let fixed = h.to_json().len() - h.meta_data_key.len();
    // Largest that fits: magic + JSON + at least one NUL.
    h.meta_data_key = "k".repeat(HEADER_SIZE as usize - 16 - fixed - 1);
    let bytes = h.to_bytes().unwrap();
    assert_eq!(*bytes.last().unwrap(), 0);
    assert_eq!(CipherHeader::parse(&bytes, HEADER_SIZE).unwrap(), Some(h.clone()));
    h.meta_data_key.push('k');
    let e = h.to_bytes().unwrap_err();
    assert!(matches!(e, CipherError::HeaderTooLarge { json_len } if json_len == HEADER_SIZE as usize - 16), "{e}");
    assert!(e.to_string().contains("too large"), "{e}");
}

#[test]
fn layouts() {
    assert_eq!(Layout::Headerless.header_size(), 0);
    assert_eq!(Layout::WithHeader.header_size(), 262_144);
}
