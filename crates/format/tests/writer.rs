//! The writer rules of spec §1.5: order, compact JSON, `__metadata__`, escaping, padding, and the
//! writer's errors.

mod common;

use common::pattern;
use std::collections::BTreeMap;
use turboio_format::{plan, serialize, Dtype, FormatError, Header, TensorSpec, MAX_HEADER_SIZE};

fn meta(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// The JSON text of a written header, padding included, and N.
fn header_text(bytes: &[u8]) -> (u64, &str) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    (n, std::str::from_utf8(&bytes[8..8 + n as usize]).unwrap())
}

fn write(specs: &[(&str, Dtype, Vec<usize>)], m: Option<&BTreeMap<String, String>>) -> Vec<u8> {
    let specs: Vec<TensorSpec<'_>> = specs.iter().map(|(n, d, s)| TensorSpec::new(n, *d, s).unwrap()).collect();
    let data: Vec<Vec<u8>> = specs.iter().enumerate().map(|(i, s)| pattern(s.data_len, i as u8)).collect();
    let pairs: Vec<(TensorSpec<'_>, &[u8])> = specs.iter().zip(&data).map(|(s, d)| (*s, d.as_slice())).collect();
    serialize(&pairs, m).unwrap()
}

#[test]
fn empty_input_is_an_empty_object_padded_to_8() {
    let bytes = serialize(&[], None).unwrap();
    let mut expect = vec![8, 0, 0, 0, 0, 0, 0, 0, b'{', b'}'];
    expect.extend_from_slice(&[b' '; 6]);
    assert_eq!(bytes, expect);
    assert!(Header::from_file_bytes(&bytes).unwrap().is_empty());
}

#[test]
fn empty_input_with_framework_metadata_has_n_40() {
    let m = meta(&[("framework", "pt")]);
    let bytes = serialize(&[], Some(&m)).unwrap();
    let (n, text) = header_text(&bytes);
    assert_eq!(n, 40);
    assert_eq!(text, "{\"__metadata__\":{\"framework\":\"pt\"}}     ");
    assert_eq!(bytes.len(), 48);
}

#[test]
fn compact_json_with_fields_in_order() {
    let bytes = write(&[("w", Dtype::F32, vec![1, 2, 3])], None);
    let (n, text) = header_text(&bytes);
    let json = "{\"w\":{\"dtype\":\"F32\",\"shape\":[1,2,3],\"data_offsets\":[0,24]}}";
    assert_eq!(text.trim_end_matches(' '), json);
    assert_eq!(n as usize, json.len().next_multiple_of(8));
    // Scalars have an empty shape list; zero-sized tensors [b, b].
    let bytes = write(&[("s", Dtype::F64, vec![]), ("z", Dtype::F64, vec![0, 5])], None);
    let (_, text) = header_text(&bytes);
    assert_eq!(
        text.trim_end_matches(' '),
        "{\"s\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[0,8]},\"z\":{\"dtype\":\"F64\",\"shape\":[0,5],\"data_offsets\":[8,8]}}"
    );
}

#[test]
fn order_is_descending_dtype_then_name() {
    // Every dtype twice, names chosen so that name order and dtype order disagree.
    let mut specs = Vec::new();
    for (i, d) in Dtype::ALL.iter().enumerate() {
        let shape = match d {
            Dtype::F4 => vec![2],
            Dtype::F6_E2M3 | Dtype::F6_E3M2 => vec![4],
            _ => vec![3],
        };
        specs.push((format!("{:02}b", 21 - i), *d, shape.clone()));
        specs.push((format!("{:02}a", 21 - i), *d, shape));
    }
    let borrowed: Vec<(&str, Dtype, Vec<usize>)> = specs.iter().map(|(n, d, s)| (n.as_str(), *d, s.clone())).collect();
    let bytes = write(&borrowed, None);
    let h = Header::from_file_bytes(&bytes).unwrap();
    let got: Vec<(Dtype, &str)> = h.tensors().iter().map(|t| (t.dtype, t.name.as_str())).collect();
    let mut expect: Vec<(Dtype, &str)> = specs.iter().map(|(n, d, _)| (*d, n.as_str())).collect();
    expect.sort_by(|l, r| r.0.cmp(&l.0).then(l.1.cmp(r.1)));
    assert_eq!(got, expect);
    assert_eq!(got[0], (Dtype::U64, "00a"));
    assert_eq!(got[1], (Dtype::U64, "00b"));
    assert_eq!(got.last().unwrap(), &(Dtype::BOOL, "21b"));
    // The header text lists them in the same order.
    let (_, text) = header_text(&bytes);
    let mut last = 0;
    for (_, name) in &got {
        let pos = text.find(&format!("\"{name}\":")).unwrap();
        assert!(pos > last || last == 0, "{name} out of order");
        last = pos;
    }
    // And each tensor's file offset is a multiple of its element size.
    for t in h.tensors() {
        if let Some(size) = t.dtype.byte_size() {
            assert_eq!((h.data_start() + t.data_offsets.0 as u64) % size as u64, 0, "{}", t.name);
        }
    }
}

#[test]
fn layout_entries_follow_the_written_order_and_index_the_input() {
    let shapes = [vec![2usize], vec![3], vec![1]];
    let specs = [
        TensorSpec::new("b", Dtype::U8, &shapes[0]).unwrap(),
        TensorSpec::new("a", Dtype::F64, &shapes[1]).unwrap(),
        TensorSpec::new("c", Dtype::F64, &shapes[2]).unwrap(),
    ];
    let layout = plan(&specs, None).unwrap();
    let got: Vec<(usize, &str, (usize, usize))> =
        layout.entries.iter().map(|e| (e.input_index, e.info.name.as_str(), e.info.data_offsets)).collect();
    assert_eq!(got, [(1, "a", (0, 24)), (2, "c", (24, 32)), (0, "b", (32, 34))]);
    assert_eq!(layout.data_len, 34);
    assert_eq!(layout.file_len(), layout.header.len() as u64 + 34);
    assert_eq!(layout.file_offset(&layout.entries[2]), layout.header.len() as u64 + 32);
    // The header of the plan is the prefix of the serialized file, and the data follows in
    // layout order.
    let data = [vec![1u8, 2], pattern(24, 3), pattern(8, 4)];
    let pairs: Vec<(TensorSpec<'_>, &[u8])> = specs.iter().zip(&data).map(|(s, d)| (*s, d.as_slice())).collect();
    let bytes = serialize(&pairs, None).unwrap();
    assert_eq!(&bytes[..layout.header.len()], layout.header.as_slice());
    let body = &bytes[layout.header.len()..];
    assert_eq!(&body[..24], data[1].as_slice());
    assert_eq!(&body[24..32], data[2].as_slice());
    assert_eq!(&body[32..], data[0].as_slice());
}

#[test]
fn metadata_comes_first_even_when_empty_and_keys_are_sorted() {
    let empty = BTreeMap::new();
    let bytes = write(&[("w", Dtype::U8, vec![1])], Some(&empty));
    let (_, text) = header_text(&bytes);
    assert!(text.starts_with("{\"__metadata__\":{},\"w\":{"), "{text}");
    assert_eq!(Header::from_file_bytes(&bytes).unwrap().metadata(), Some(&empty));

    let m = meta(&[("zeta", "1"), ("alpha", "2"), ("mid", "3")]);
    let bytes = write(&[("w", Dtype::U8, vec![1])], Some(&m));
    let (_, text) = header_text(&bytes);
    assert!(text.starts_with("{\"__metadata__\":{\"alpha\":\"2\",\"mid\":\"3\",\"zeta\":\"1\"},\"w\":{"), "{text}");
    assert_eq!(Header::from_file_bytes(&bytes).unwrap().metadata(), Some(&m));

    // None: no `__metadata__` at all.
    let bytes = write(&[("w", Dtype::U8, vec![1])], None);
    assert!(!header_text(&bytes).1.contains("__metadata__"));
}

#[test]
fn escaping_is_serde_json_s() {
    let name = "q\"b\\s\n\t\u{1}\u{1f}é/模\u{7f}";
    let bytes = write(&[(name, Dtype::U8, vec![1])], Some(&meta(&[("k/\"", "v\\\r")])));
    let (_, text) = header_text(&bytes);
    assert!(text.contains(r#""q\"b\\s\n\t\u0001\u001fé/模"#), "{text}");
    // DEL (0x7f) is not a JSON control character: written raw.
    assert!(text.contains("模\u{7f}\":{"), "{text}");
    assert!(text.contains(r#"{"__metadata__":{"k/\"":"v\\\r"}"#), "{text}");
    // `/` is never escaped.
    assert!(!text.contains("\\/"));
    // Non-ASCII is raw UTF-8, not \u escapes.
    assert!(!text.contains("\\u00e9"));
    let h = Header::from_file_bytes(&bytes).unwrap();
    assert_eq!(h.tensors()[0].name, name);
    assert_eq!(h.metadata().unwrap()["k/\""], "v\\\r");
}

/// Metadata `{"k": "x" * len}` alone: raw JSON length is 23 + len.
fn metadata_only(len: usize) -> Vec<u8> {
    serialize(&[], Some(&meta(&[("k", &"x".repeat(len))]))).unwrap()
}

#[test]
fn padding_is_spaces_up_to_a_multiple_of_8() {
    let raw_len = |len: usize| "{\"__metadata__\":{\"k\":\"\"}}".len() + len;
    // raw 56 -> N 56, no padding.
    let len = 56 - raw_len(0);
    let bytes = metadata_only(len);
    let (n, text) = header_text(&bytes);
    assert_eq!((n, text.len()), (56, 56));
    assert!(text.ends_with("\"}}"));
    // raw 57 -> N 64, 7 spaces.
    let bytes = metadata_only(len + 1);
    let (n, text) = header_text(&bytes);
    assert_eq!(n, 64);
    assert!(text.ends_with("\"}}       "), "{text:?}");
    // Every raw length from 49 to 64.
    for extra in 0..16 {
        let raw = raw_len(len - 7 + extra);
        let bytes = metadata_only(len - 7 + extra);
        let (n, text) = header_text(&bytes);
        assert_eq!(n as usize, raw.next_multiple_of(8), "raw {raw}");
        assert!(text[raw..].bytes().all(|b| b == b' '));
        assert_eq!(bytes.len(), 8 + n as usize);
    }
}

#[test]
fn duplicate_names_are_an_error_not_a_panic() {
    let shape = [1usize];
    let a = TensorSpec::new("a", Dtype::U8, &shape).unwrap();
    let b = TensorSpec::new("b", Dtype::F32, &shape).unwrap();
    let a_f32 = TensorSpec::new("a", Dtype::F32, &shape).unwrap();
    match plan(&[a, b, a_f32], None) {
        Err(FormatError::DuplicateTensorName(n)) => assert_eq!(n, "a"),
        other => panic!("{other:?}"),
    }
    let e = serialize(&[(a, &[1u8][..]), (a, &[2u8][..])], None).unwrap_err();
    assert!(matches!(&e, FormatError::DuplicateTensorName(n) if n == "a"), "{e:?}");
    assert!(e.to_string().contains("`a`"));
}

#[test]
fn metadata_is_a_reserved_name() {
    let shape = [1usize];
    let t = TensorSpec::new("__metadata__", Dtype::U8, &shape).unwrap();
    assert!(matches!(plan(&[t], None), Err(FormatError::ReservedName)));
    // Only the exact name.
    let t = TensorSpec::new("__metadata__.x", Dtype::U8, &shape).unwrap();
    assert!(plan(&[t], None).is_ok());
}

#[test]
fn data_length_mismatch_is_tensor_invalid_info() {
    let shape = [2usize];
    let t = TensorSpec::new("w", Dtype::F32, &shape).unwrap();
    assert_eq!(t.data_len, 8);
    match serialize(&[(t, &[0u8; 7][..])], None) {
        Err(FormatError::TensorInvalidInfo { name, expected, actual, .. }) => {
            assert_eq!((name.as_str(), expected, actual), ("w", 8, 7))
        }
        other => panic!("{other:?}"),
    }
    // A spec whose data_len disagrees with its dtype and shape.
    let bad = TensorSpec { data_len: 12, ..t };
    match plan(&[bad], None) {
        Err(FormatError::TensorInvalidInfo { name, expected, actual, .. }) => {
            assert_eq!((name.as_str(), expected, actual), ("w", 8, 12))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn odd_f4_is_misaligned() {
    let shape = [3usize];
    match TensorSpec::new("f", Dtype::F4, &shape) {
        Err(FormatError::MisalignedSlice { name, dtype, shape }) => {
            assert_eq!((name.as_str(), dtype, shape), ("f", Dtype::F4, vec![3]));
        }
        other => panic!("{other:?}"),
    }
    let spec = TensorSpec { name: "f", dtype: Dtype::F4, shape: &shape, data_len: 2 };
    assert!(matches!(plan(&[spec], None), Err(FormatError::MisalignedSlice { .. })));
    assert!(matches!(serialize(&[(spec, &[0u8; 2][..])], None), Err(FormatError::MisalignedSlice { .. })));
    let even = [4usize];
    assert_eq!(TensorSpec::new("f", Dtype::F4, &even).unwrap().data_len, 2);
}

#[test]
fn header_over_100_mb_is_too_large() {
    // The reference's test: a 100_000_000-char metadata value. (A header of exactly
    // 100_000_000 bytes is read back in rejections.rs; writing one here too would double the
    // cost of this test, which is the slowest of the crate in debug builds.)
    let overhead = "{\"__metadata__\":{\"k\":\"\"}}".len();
    let m = meta(&[("k", &"x".repeat(100_000_000))]);
    match serialize(&[], Some(&m)) {
        Err(FormatError::HeaderTooLarge { len }) => {
            assert_eq!(len as usize, (100_000_000 + overhead).next_multiple_of(8));
            assert!(len as usize > MAX_HEADER_SIZE);
        }
        other => panic!("{:?}", other.map(|b| b.len())),
    }
}

#[test]
fn plan_rejects_a_layout_whose_file_length_overflows() {
    let shape = [(1usize << 61) - 1];
    let names: Vec<String> = (0..8).map(|i| format!("t{i}")).collect();
    let specs: Vec<TensorSpec<'_>> = names.iter().map(|n| TensorSpec::new(n, Dtype::U8, &shape).unwrap()).collect();
    // Seven fit (with the header) in 64 bits.
    let layout = plan(&specs[..7], None).unwrap();
    assert_eq!(layout.data_len, 7 * ((1u64 << 61) - 1));
    assert!(layout.file_len() > layout.data_len);
    // Eight do not.
    assert!(matches!(
        plan(&specs, None),
        Err(FormatError::ValidationOverflow { name, .. }) if name == "t7"
    ));
    // Offsets that overflow usize while being summed.
    let huge = TensorSpec { name: "h", dtype: Dtype::U8, shape: &shape, data_len: usize::MAX };
    let other = TensorSpec { name: "i", ..huge };
    assert!(matches!(
        plan(&[huge, other], None),
        Err(FormatError::ValidationOverflow { name, .. }) if name == "i"
    ));
}

#[test]
fn written_files_read_back() {
    let m = meta(&[("format", "pt")]);
    let bytes = write(
        &[
            ("layer.0.weight", Dtype::BF16, vec![4, 3]),
            ("layer.0.bias", Dtype::F32, vec![4]),
            ("mask", Dtype::BOOL, vec![2, 2]),
            ("q", Dtype::F4, vec![6]),
            ("empty", Dtype::I64, vec![0]),
        ],
        Some(&m),
    );
    let h = Header::from_file_bytes(&bytes).unwrap();
    assert_eq!(h.len(), 5);
    assert_eq!(h.metadata(), Some(&m));
    assert_eq!(h.get("layer.0.weight").unwrap().len(), 24);
    assert_eq!(h.get("q").unwrap().len(), 3);
    assert_eq!(h.file_len(), bytes.len() as u64);
    assert_eq!(h.header_len() % 8, 0);
}

#[test]
fn a_selected_header_keeps_the_picked_tensors_at_their_new_places() {
    let specs = [
        TensorSpec { name: "a", dtype: Dtype::F32, shape: &[4], data_len: 16 },
        TensorSpec { name: "b", dtype: Dtype::F16, shape: &[2, 2], data_len: 8 },
        TensorSpec { name: "c", dtype: Dtype::U8, shape: &[3], data_len: 3 },
    ];
    let meta = BTreeMap::from([("tied".to_owned(), "c".to_owned())]);
    let layout = plan(&specs, Some(&meta)).unwrap();
    let h = Header::parse(&layout.header, layout.file_len()).unwrap();
    let (b, c) = (h.position("b").unwrap(), h.position("c").unwrap());
    let s = h.select(&[(c, (0, 3)), (b, (8, 16))], 16).unwrap();
    assert_eq!(s.len(), 2);
    assert!(s.get("a").is_none());
    assert_eq!(s.get("c").unwrap().data_offsets, (0, 3));
    assert_eq!(s.get("b").unwrap().data_offsets, (8, 16));
    assert_eq!(s.get("b").unwrap().shape, vec![2, 2]);
    assert_eq!(s.tensors()[0].name, "c", "in offset order");
    assert_eq!(s.aliases(), vec![("tied", "c")]);
    assert_eq!(s.data_len(), 16);
    // A length that changes, a place past the end, a position out of range, a name twice.
    assert!(h.select(&[(b, (0, 9))], 16).is_none());
    assert!(h.select(&[(b, (10, 18))], 16).is_none());
    assert!(h.select(&[(7, (0, 1))], 16).is_none());
    assert!(h.select(&[(b, (0, 8)), (b, (8, 16))], 16).is_none());
}
