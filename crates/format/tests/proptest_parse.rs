//! Property tests: the parser never panics (arbitrary bytes, mutated valid files, structured JSON
//! with huge numbers) and whatever it accepts is consistent; `serialize` then parse round-trips.

mod common;

use common::{pattern, strategies};
use proptest::prelude::*;
use std::collections::BTreeMap;
use turboio_format::{plan, read_header_len, serialize, Dtype, FormatError, Header, TensorSpec, MAX_HEADER_SIZE};

/// What must hold of any header the parser accepts for a file of `file_len` bytes.
fn check_accepted(h: &Header, file_len: u64) -> Result<(), TestCaseError> {
    prop_assert_eq!(h.file_len(), file_len);
    prop_assert!(h.header_len() <= MAX_HEADER_SIZE as u64);
    prop_assert_eq!(h.data_start(), 8 + h.header_len());
    let mut end = 0usize;
    for (i, t) in h.tensors().iter().enumerate() {
        prop_assert_eq!(t.data_offsets.0, end, "tensor {} not contiguous", i);
        prop_assert!(t.data_offsets.1 >= t.data_offsets.0);
        end = t.data_offsets.1;
        // Recompute the size with checked arithmetic.
        let bits =
            t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).and_then(|n| n.checked_mul(t.dtype.bits()));
        prop_assert_eq!(bits.map(|b| b / 8), Some(t.len()));
        prop_assert_eq!(bits.unwrap() % 8, 0);
        prop_assert_eq!(h.position(&t.name), Some(i));
    }
    prop_assert_eq!(end as u64, h.data_len());
    Ok(())
}

/// Parses a whole buffer both ways (whole file, and header prefix + length) and checks they
/// agree and that an accepted header is consistent.
fn parse_all_ways(bytes: &[u8]) -> Result<Option<Header>, TestCaseError> {
    let whole = Header::from_file_bytes(bytes);
    let len = bytes.len() as u64;
    match read_header_len(bytes, len) {
        Ok(n) => {
            let prefix = &bytes[..8 + n as usize];
            let from_prefix = Header::parse(prefix, len);
            match (&whole, &from_prefix) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(a), Err(b)) => prop_assert_eq!(a.to_string(), b.to_string()),
                _ => prop_assert!(false, "whole {:?} vs prefix {:?}", whole, from_prefix),
            }
        }
        Err(e) => {
            let w = whole.as_ref().unwrap_err();
            prop_assert_eq!(e.to_string(), w.to_string());
        }
    }
    match whole {
        Ok(h) => {
            check_accepted(&h, len)?;
            Ok(Some(h))
        }
        Err(e) => {
            // Every error renders.
            prop_assert!(!e.to_string().is_empty());
            Ok(None)
        }
    }
}

/// A valid file written by us, to mutate.
fn valid_file() -> impl Strategy<Value = Vec<u8>> {
    (strategies::tensor_set(5), strategies::metadata(2)).prop_map(|(tensors, meta)| {
        let specs: Vec<TensorSpec<'_>> = tensors.iter().map(|(n, d, s)| TensorSpec::new(n, *d, s).unwrap()).collect();
        let data: Vec<Vec<u8>> = specs.iter().map(|s| pattern(s.data_len, 1)).collect();
        let pairs: Vec<(TensorSpec<'_>, &[u8])> = specs.iter().zip(&data).map(|(s, d)| (*s, d.as_slice())).collect();
        serialize(&pairs, meta.as_ref()).unwrap()
    })
}

#[derive(Debug, Clone)]
enum Edit {
    Set(prop::sample::Index, u8),
    Insert(prop::sample::Index, u8),
    Delete(prop::sample::Index),
    Truncate(prop::sample::Index),
    /// Overwrite one of the 8 length bytes.
    Length(u8, u8),
}

fn edit() -> impl Strategy<Value = Edit> {
    let byte = prop_oneof![any::<u8>(), prop::sample::select(b"\"{}[],:0123456789 -.eE\\".to_vec()),];
    prop_oneof![
        4 => (any::<prop::sample::Index>(), byte.clone()).prop_map(|(i, b)| Edit::Set(i, b)),
        2 => (any::<prop::sample::Index>(), byte).prop_map(|(i, b)| Edit::Insert(i, b)),
        2 => any::<prop::sample::Index>().prop_map(Edit::Delete),
        1 => any::<prop::sample::Index>().prop_map(Edit::Truncate),
        1 => (0u8..8, any::<u8>()).prop_map(|(i, b)| Edit::Length(i, b)),
    ]
}

fn apply(mut bytes: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let len = bytes.len();
        match e {
            Edit::Set(i, b) if len > 0 => bytes[i.index(len)] = *b,
            Edit::Insert(i, b) => bytes.insert(i.index(len + 1), *b),
            Edit::Delete(i) if len > 0 => {
                bytes.remove(i.index(len));
            }
            Edit::Truncate(i) => bytes.truncate(i.index(len + 1)),
            Edit::Length(i, b) if (*i as usize) < len => bytes[*i as usize] = *b,
            _ => {}
        }
    }
    bytes
}

proptest! {
    #![proptest_config(common::proptest_config(256))]

    /// (a) Arbitrary bytes.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..128)) {
        parse_all_ways(&bytes)?;
    }

    /// (a) Arbitrary bytes behind a length field that fits them, or nearly.
    #[test]
    fn arbitrary_header_bytes_never_panic(
        json in prop::collection::vec(any::<u8>(), 0..96),
        slack in -2i64..3,
        data in 0usize..4,
    ) {
        let n = (json.len() as i64 + slack).max(0) as u64;
        let mut bytes = n.to_le_bytes().to_vec();
        bytes.extend_from_slice(&json);
        bytes.extend(std::iter::repeat_n(b'x', data));
        parse_all_ways(&bytes)?;
    }

    /// (a) Arbitrary JSON-ish text: random tokens.
    #[test]
    fn json_token_soup_never_panics(
        tokens in prop::collection::vec(prop::sample::select(vec![
            "{", "}", "[", "]", ",", ":", "\"a\"", "\"dtype\"", "\"shape\"", "\"data_offsets\"",
            "\"__metadata__\"", "\"F32\"", "\"F4\"", "0", "4", "-1", "1.5", "null", "true", " ",
            "18446744073709551615", "18446744073709551616",
        ]), 0..40),
        data in 0usize..8,
    ) {
        let json: String = tokens.concat();
        parse_all_ways(&common::file(json, data))?;
    }

    /// (b) A valid file with random byte edits, insertions, deletions and truncations.
    #[test]
    fn mutated_valid_files_never_panic(
        base in valid_file(),
        edits in prop::collection::vec(edit(), 1..5),
    ) {
        prop_assert!(Header::from_file_bytes(&base).is_ok());
        parse_all_ways(&apply(base, &edits))?;
    }

    /// (c) Structurally valid JSON with random dtypes, shapes and offsets, including numbers
    /// near `usize::MAX`.
    #[test]
    fn structured_headers_never_panic(bytes in strategies::structured()) {
        parse_all_ways(&bytes)?;
    }

    /// (c) The header alone, with any claimed file length (including near `u64::MAX`).
    #[test]
    fn any_file_length_never_panics(
        bytes in strategies::structured(),
        file_len in prop_oneof![any::<u64>(), (u64::MAX - 64)..=u64::MAX, 0u64..256],
    ) {
        if let Ok(n) = read_header_len(&bytes, bytes.len() as u64) {
            let prefix = &bytes[..8 + n as usize];
            match Header::parse(prefix, file_len) {
                Ok(h) => prop_assert_eq!(h.file_len(), file_len),
                Err(FormatError::MetadataIncompleteBuffer { actual, .. }) => {
                    prop_assert_eq!(actual, file_len)
                }
                Err(_) => {}
            }
        }
    }

    /// `plan` never panics on any specs, however inconsistent.
    #[test]
    fn plan_never_panics(
        specs in prop::collection::vec(
            (
                prop::sample::select(vec!["a", "b", "c", "__metadata__"]),
                prop::sample::select(Dtype::ALL.to_vec()),
                prop::collection::vec(strategies::dim(), 0..3),
                prop_oneof![0usize..64, Just(usize::MAX), Just(usize::MAX / 2), Just((1usize << 61) - 1)],
            ),
            0..6,
        ),
    ) {
        let shapes: Vec<Vec<usize>> = specs.iter().map(|s| s.2.iter().map(|&d| d as usize).collect()).collect();
        let specs: Vec<TensorSpec<'_>> = specs
            .iter()
            .zip(&shapes)
            .map(|((name, dtype, _, data_len), shape)| TensorSpec {
                name,
                dtype: *dtype,
                shape,
                data_len: *data_len,
            })
            .collect();
        if let Ok(layout) = plan(&specs, None) {
            prop_assert_eq!(layout.header.len() % 8, 0);
            prop_assert!(layout.file_len() >= layout.data_len);
            let h = Header::parse(&layout.header, layout.file_len()).unwrap();
            prop_assert_eq!(h.len(), specs.len());
        }
    }
}

proptest! {
    #![proptest_config(common::proptest_config(256))]

    /// Round trip: what we write reads back to the same specs, laid out as the writer promises.
    #[test]
    fn serialize_then_parse_round_trips(
        tensors in strategies::tensor_set(10),
        metadata in strategies::metadata(4),
    ) {
        let specs: Vec<TensorSpec<'_>> = tensors
            .iter()
            .map(|(n, d, s)| TensorSpec::new(n, *d, s).unwrap())
            .collect();
        let data: Vec<Vec<u8>> = specs
            .iter()
            .enumerate()
            .map(|(i, s)| pattern(s.data_len, i as u8))
            .collect();
        let pairs: Vec<(TensorSpec<'_>, &[u8])> = specs
            .iter()
            .zip(&data)
            .map(|(s, d)| (*s, d.as_slice()))
            .collect();
        let bytes = serialize(&pairs, metadata.as_ref()).unwrap();
        let h = Header::from_file_bytes(&bytes).unwrap();
        check_accepted(&h, bytes.len() as u64)?;

        // The writer's order (descending dtype, then name) is the order of the layout; the
        // parser lists tensors by offset, which is the same order except that zero-sized
        // tensors sharing an offset come by name.
        let layout = plan(&specs, metadata.as_ref()).unwrap();
        let mut expect: Vec<(Dtype, &str, &[usize])> = tensors
            .iter()
            .map(|(n, d, s)| (*d, n.as_str(), s.as_slice()))
            .collect();
        expect.sort_by(|l, r| r.0.cmp(&l.0).then(l.1.cmp(r.1)));
        let written: Vec<(Dtype, &str, &[usize])> = layout
            .entries
            .iter()
            .map(|e| (e.info.dtype, e.info.name.as_str(), e.info.shape.as_slice()))
            .collect();
        prop_assert_eq!(&written, &expect);
        let mut in_file_order = layout.entries.iter().map(|e| e.info.clone()).collect::<Vec<_>>();
        in_file_order.sort_by(|a, b| a.data_offsets.cmp(&b.data_offsets).then(a.name.cmp(&b.name)));
        prop_assert_eq!(in_file_order.as_slice(), h.tensors());
        prop_assert_eq!(h.metadata(), metadata.as_ref());

        // N % 8 == 0 and the padding is fewer than 8 spaces after the closing brace.
        let n = h.header_len() as usize;
        prop_assert_eq!(n % 8, 0);
        let json = &bytes[8..8 + n];
        let text_end = json.iter().rposition(|&b| b == b'}').unwrap() + 1;
        prop_assert!(json[text_end..].iter().all(|&b| b == b' '));
        prop_assert!(n - text_end < 8);
        prop_assert!(serde_json::from_slice::<serde_json::Value>(&json[..text_end]).is_ok());

        // Every tensor is aligned to its element size in the file, and holds its data.
        for t in h.tensors() {
            let at = h.data_start() as usize + t.data_offsets.0;
            if let Some(size) = t.dtype.byte_size() {
                prop_assert_eq!(at % size, 0, "{} at {}", t.name, at);
            }
            let i = tensors.iter().position(|(n, _, _)| *n == t.name).unwrap();
            prop_assert_eq!(&bytes[at..at + t.len()], data[i].as_slice());
        }

        // The plan's header is the file's prefix.
        prop_assert_eq!(&bytes[..layout.header.len()], layout.header.as_slice());
        prop_assert_eq!(layout.file_len(), bytes.len() as u64);
        for e in &layout.entries {
            prop_assert_eq!(e.info.name.as_str(), specs[e.input_index].name);
            prop_assert_eq!(layout.file_offset(e), h.data_start() + e.info.data_offsets.0 as u64);
        }
    }

    /// The metadata map survives any keys and values (escapes, control characters, unicode).
    #[test]
    fn metadata_round_trips(metadata in prop::collection::btree_map("(?s).{0,10}", "(?s).{0,20}", 0..8)) {
        let bytes = serialize(&[], Some(&metadata)).unwrap();
        let h = Header::from_file_bytes(&bytes).unwrap();
        prop_assert_eq!(h.metadata(), Some(&metadata));
        prop_assert!(h.is_empty());
        let empty: BTreeMap<String, String> = BTreeMap::new();
        if metadata == empty {
            prop_assert_eq!(&bytes[8..], b"{\"__metadata__\":{}}     ".as_slice());
        }
    }
}
