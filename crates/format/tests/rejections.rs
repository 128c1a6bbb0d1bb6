//! Every rejection rule of the reader (spec §1.4), in the reference order, with the exact
//! `FormatError` variant and what its message names; then the accepted edge cases.

mod common;

use common::{accepted, case, entry, file, kind, object, raw, rejected_cases};
use turboio_format::{read_header_len, Dtype, FormatError, Header, MAX_HEADER_SIZE};

fn parse(bytes: &[u8]) -> Result<Header, FormatError> {
    Header::from_file_bytes(bytes)
}

fn reject(label: &str) -> FormatError {
    match parse(&case(label)) {
        Ok(h) => panic!("{label}: accepted: {h:?}"),
        Err(e) => e,
    }
}

fn ok(label: &str) -> Header {
    parse(&accepted(label)).unwrap_or_else(|e| panic!("{label}: rejected: {e}"))
}

fn assert_ihd(label: &str, needle: &str) {
    let e = reject(label);
    let FormatError::InvalidHeaderDeserialization(inner) = &e else {
        panic!("{label}: expected InvalidHeaderDeserialization, got {e:?}");
    };
    let msg = e.to_string();
    assert!(msg.starts_with("invalid JSON in header: "), "{label}: {msg}");
    assert!(inner.to_string().contains(needle), "{label}: `{inner}` does not mention `{needle}`");
}

// ---- the whole corpus, variant by variant ---------------------------------------------------

#[test]
fn every_rejected_case_has_its_variant() {
    let cases = rejected_cases();
    assert!(cases.len() >= 50, "corpus shrank: {}", cases.len());
    let mut labels: Vec<&str> = cases.iter().map(|c| c.label).collect();
    labels.sort_unstable();
    labels.dedup();
    assert_eq!(labels.len(), cases.len(), "duplicate labels");
    for c in &cases {
        match parse(&c.bytes) {
            Ok(h) => panic!("{}: accepted {h:?}", c.label),
            Err(e) => assert_eq!(kind(&e), c.expect, "{}: {e}", c.label),
        }
    }
}

#[test]
fn every_accepted_case_is_accepted() {
    for (label, bytes) in common::accepted_cases() {
        let h = parse(&bytes).unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(h.file_len(), bytes.len() as u64, "{label}");
    }
}

// ---- 1. buffer < 8 bytes --------------------------------------------------------------------

#[test]
fn rule1_fewer_than_8_bytes_is_header_too_small() {
    for len in 0..8 {
        let bytes = vec![0u8; len];
        match parse(&bytes) {
            Err(FormatError::HeaderTooSmall { len: l }) => assert_eq!(l, len as u64),
            other => panic!("{len} bytes: {other:?}"),
        }
    }
    let e = reject("seven_bytes");
    assert!(e.to_string().contains("7 bytes"), "{e}");
    // 8 bytes with N = 0 get past rule 1 (and fail on the empty JSON).
    assert_eq!(kind(&parse(&[0u8; 8]).unwrap_err()), "InvalidHeaderDeserialization");
}

// ---- 2, 3. N too large ----------------------------------------------------------------------

#[test]
fn rule3_n_over_limit_is_header_too_large() {
    match reject("n_over_max") {
        FormatError::HeaderTooLarge { len } => assert_eq!(len, 100_000_001),
        e => panic!("{e:?}"),
    }
    let e = reject("n_u64_max");
    assert!(matches!(e, FormatError::HeaderTooLarge { len: u64::MAX }), "{e:?}");
    assert!(e.to_string().contains(&u64::MAX.to_string()), "{e}");
    // Checked before anything else: even a buffer with nothing after N.
    assert!(matches!(parse(&raw(u64::MAX, b"")), Err(FormatError::HeaderTooLarge { .. })));
}

#[test]
fn rule3_n_exactly_at_limit_is_allowed_then_fails_on_length() {
    assert_eq!(MAX_HEADER_SIZE, 100_000_000);
    match reject("n_exactly_max_short_buffer") {
        FormatError::InvalidHeaderLength { header_len, available } => {
            assert_eq!(header_len, 100_000_000);
            assert_eq!(available, 2);
        }
        e => panic!("{e:?}"),
    }
    // The header-only entry point: N = 100_000_000 with a file that claims to be long enough
    // passes the length checks.
    let first = 100_000_000u64.to_le_bytes();
    assert_eq!(read_header_len(&first, 100_000_008).unwrap(), 100_000_000);
    assert!(matches!(read_header_len(&first, 100_000_007), Err(FormatError::InvalidHeaderLength { .. })));
}

#[test]
fn rule3_a_header_of_exactly_100_mb_is_accepted() {
    let prefix = b"{\"__metadata__\":{\"k\":\"";
    let suffix = b"\"}}";
    let mut json = Vec::with_capacity(MAX_HEADER_SIZE);
    json.extend_from_slice(prefix);
    json.resize(MAX_HEADER_SIZE - suffix.len(), b'x');
    json.extend_from_slice(suffix);
    let bytes = file(&json, 0);
    drop(json);
    let h = parse(&bytes).unwrap();
    assert_eq!(h.header_len(), MAX_HEADER_SIZE as u64);
    assert_eq!(h.metadata().unwrap()["k"].len(), MAX_HEADER_SIZE - 25);
}

// ---- 4. 8 + N past the end ------------------------------------------------------------------

#[test]
fn rule4_header_past_end_is_invalid_header_length() {
    let e = reject("n_past_end");
    match &e {
        FormatError::InvalidHeaderLength { header_len, available } => assert_eq!((*header_len, *available), (20, 8)),
        _ => panic!("{e:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("20") && msg.contains('8'), "{msg}");
    assert!(matches!(reject("n_one_past_end"), FormatError::InvalidHeaderLength { header_len: 3, available: 2 }));
    // Exactly fitting is fine.
    assert!(parse(&raw(2, b"{}")).is_ok());
}

// ---- 5. UTF-8 -------------------------------------------------------------------------------

#[test]
fn rule5_invalid_utf8_is_invalid_header() {
    for label in ["invalid_utf8", "truncated_utf8"] {
        let e = reject(label);
        assert!(matches!(e, FormatError::InvalidHeader(_)), "{label}: {e:?}");
        assert!(e.to_string().starts_with("invalid UTF-8 in header"), "{e}");
        assert!(std::error::Error::source(&e).is_some());
    }
}

#[test]
fn rule5_utf8_is_checked_before_json() {
    // Invalid UTF-8 inside otherwise broken JSON: the UTF-8 rule wins.
    let e = parse(&file(b"{\xff", 0)).unwrap_err();
    assert!(matches!(e, FormatError::InvalidHeader(_)), "{e:?}");
}

// ---- 6. JSON --------------------------------------------------------------------------------

#[test]
fn rule6_bad_json() {
    assert_ihd("bad_json", "EOF");
}

#[test]
fn rule6_trailing_characters() {
    assert_ihd("trailing_chars", "trailing characters");
}

#[test]
fn rule6_trailing_nul_padding() {
    assert_ihd("trailing_nul", "trailing characters");
}

#[test]
fn rule6_bom() {
    assert_ihd("bom", "expected value");
}

#[test]
fn rule6_n_zero() {
    assert_ihd("n_zero", "EOF");
}

#[test]
fn rule6_not_an_object() {
    assert_ihd("array", "expected");
    assert_ihd("null", "expected");
    assert_ihd("number", "expected");
}

#[test]
fn rule6_tensor_value_not_an_object() {
    assert_ihd("tensor_not_object", "");
    assert_ihd("tensor_array_wrong_order", "");
    assert_ihd("tensor_array_too_short", "");
}

#[test]
fn a_tensor_entry_may_be_an_array_of_the_three_fields() {
    // serde's derived visitor accepts `[dtype, shape, data_offsets]` for the struct, in the
    // reference as here.
    let h = ok("tensor_as_array");
    let a = h.get("a").unwrap();
    assert_eq!((a.dtype, a.shape.clone(), a.data_offsets), (Dtype::F32, vec![1], (0, 4)));
}

#[test]
fn rule6_unknown_dtype() {
    assert_ihd("unknown_dtype", "unknown variant `F128`");
    let e = reject("unknown_dtype").to_string();
    // The message lists the accepted names.
    for d in Dtype::ALL {
        assert!(e.contains(d.name()), "{e} lacks {d}");
    }
}

#[test]
fn rule6_lowercase_dtype() {
    assert_ihd("lowercase_dtype", "unknown variant `f32`");
}

#[test]
fn rule6_missing_fields() {
    assert_ihd("missing_dtype", "missing field `dtype`");
    assert_ihd("missing_shape", "missing field `shape`");
    assert_ihd("missing_data_offsets", "missing field `data_offsets`");
}

#[test]
fn rule6_data_offsets_arity() {
    assert_ihd("data_offsets_arity_1", "");
    assert_ihd("data_offsets_arity_3", "");
    assert_ihd("data_offsets_above_u64", "");
}

#[test]
fn rule6_bad_shape_entries() {
    for label in ["shape_negative", "shape_float", "shape_exponent", "shape_string"] {
        assert_ihd(label, "");
    }
}

#[test]
fn rule6_duplicate_metadata() {
    assert_ihd("duplicate_metadata", "duplicate field `__metadata__`");
}

#[test]
fn rule6_metadata_values_must_be_strings() {
    assert_ihd("metadata_number_value", "");
    assert_ihd("metadata_nested_object", "");
    assert_ihd("metadata_string", "");
}

#[test]
fn rule6_comments_and_trailing_commas() {
    assert_ihd("json_line_comment", "trailing characters");
    assert_ihd("json_block_comment", "");
    assert_ihd("trailing_comma", "trailing comma");
}

#[test]
fn rule6_recursion_limit_applies_inside_ignored_fields() {
    assert_ihd("deep_nesting_200", "recursion limit exceeded");
    assert!(ok("deep_nesting_100").get("a").is_some());
}

#[test]
fn rule6_json_is_checked_before_offsets() {
    // A hole *and* an unknown dtype: the JSON rule (step 6) wins over the offset rule (7).
    let json = object(&[entry("a", "F32", &[1], 4, 8), entry("b", "X", &[1], 8, 12)]);
    assert!(matches!(parse(&file(json, 12)), Err(FormatError::InvalidHeaderDeserialization(_))));
}

// ---- 7a. offsets ----------------------------------------------------------------------------

fn assert_offset(label: &str, name: &str, begin: usize, end: usize, expected_begin: usize) {
    let e = reject(label);
    match &e {
        FormatError::InvalidOffset { name: n, begin: b, end: en, expected_begin: x } => {
            assert_eq!((n.as_str(), *b, *en, *x), (name, begin, end, expected_begin), "{label}");
        }
        _ => panic!("{label}: {e:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains(&format!("`{name}`")), "{msg}");
    assert!(msg.contains(&format!("[{begin}, {end}]")), "{msg}");
}

#[test]
fn rule7a_hole() {
    assert_offset("hole", "b", 20, 36, 16);
}

#[test]
fn rule7a_overlap() {
    assert_offset("overlap", "b", 8, 24, 16);
}

#[test]
fn rule7a_not_starting_at_zero() {
    assert_offset("not_starting_at_zero", "a", 4, 20, 0);
}

#[test]
fn rule7a_end_before_begin() {
    assert_offset("end_before_begin", "b", 16, 8, 16);
}

#[test]
fn rule7a_duplicate_key_keeps_last_which_leaves_a_hole() {
    assert_offset("duplicate_key_last_wins_leaves_hole", "a", 4, 8, 0);
}

#[test]
fn rule7a_ties_are_broken_by_name() {
    // Two tensors with the same offsets: the reference reports whichever comes first in hash
    // order; we sort ties by name, so the second name is always the offending one.
    let json = object(&[entry("y", "F32", &[1], 0, 4), entry("x", "F32", &[1], 0, 4)]);
    for _ in 0..5 {
        match parse(&file(&json, 4)) {
            Err(FormatError::InvalidOffset { name, .. }) => assert_eq!(name, "y"),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn rule7a_offsets_are_checked_before_sizes_of_later_tensors() {
    // `a` has a bad size, `b` a hole; sorted by offset `a` comes first, so its size error wins.
    let json = object(&[entry("a", "F32", &[2], 0, 4), entry("b", "F32", &[1], 8, 12)]);
    assert_eq!(kind(&parse(&file(&json, 12)).unwrap_err()), "TensorInvalidInfo");
    // And reversed: a hole in the first tensor wins over a bad size in the second.
    let json = object(&[entry("a", "F32", &[1], 4, 8), entry("b", "F32", &[5], 8, 12)]);
    assert_eq!(kind(&parse(&file(&json, 12)).unwrap_err()), "InvalidOffset");
}

// ---- 7b, 7c. overflow -----------------------------------------------------------------------

#[test]
fn rule7b_shape_product_overflow() {
    let e = reject("shape_product_overflow");
    match &e {
        FormatError::ValidationOverflow { name, dtype, shape } => {
            assert_eq!(name, "a");
            assert_eq!(*dtype, Dtype::U8);
            assert_eq!(shape, &[1usize << 32, 1 << 32]);
        }
        _ => panic!("{e:?}"),
    }
    assert!(e.to_string().contains("`a`"), "{e}");
    assert!(e.to_string().contains("4294967296"), "{e}");
}

#[test]
fn rule7c_bits_overflow() {
    let e = reject("bits_overflow");
    match &e {
        FormatError::ValidationOverflow { name, shape, .. } => {
            assert_eq!(name, "a");
            assert_eq!(shape, &[usize::MAX]);
        }
        _ => panic!("{e:?}"),
    }
    // The largest U8 count whose bit count fits is fine as far as overflow goes (the offsets
    // then disagree with the data, which is the next rule).
    let max = (usize::MAX / 8) as u64;
    let json = object(&[entry("a", "U8", &[max], 0, max)]);
    assert_eq!(kind(&parse(&file(&json, 0)).unwrap_err()), "MetadataIncompleteBuffer");
    let json = object(&[entry("a", "U8", &[max + 1], 0, max + 1)]);
    assert_eq!(kind(&parse(&file(&json, 0)).unwrap_err()), "ValidationOverflow");
}

#[test]
fn rule7_zero_dimension_does_not_hide_overflow_order() {
    // A zero *after* the overflowing product still overflows (checked_mul left to right), as in
    // the reference; a zero *before* it makes the product 0.
    let json = object(&[entry("a", "U8", &[1 << 32, 1 << 32, 0], 0, 0)]);
    assert_eq!(kind(&parse(&file(&json, 0)).unwrap_err()), "ValidationOverflow");
    let json = object(&[entry("a", "U8", &[0, 1 << 32, 1 << 32], 0, 0)]);
    assert!(parse(&file(&json, 0)).is_ok());
}

// ---- 7d. sub-byte ---------------------------------------------------------------------------

#[test]
fn rule7d_misaligned_sub_byte() {
    for (label, dtype, shape) in [("f4_odd_count", Dtype::F4, vec![3usize]), ("f6_e3m2_two", Dtype::F6_E3M2, vec![2])] {
        let e = reject(label);
        match &e {
            FormatError::MisalignedSlice { name, dtype: d, shape: s } => {
                assert_eq!((name.as_str(), *d, s), ("a", dtype, &shape), "{label}");
            }
            _ => panic!("{label}: {e:?}"),
        }
        assert!(e.to_string().contains(dtype.name()), "{e}");
    }
}

#[test]
fn rule7d_sub_byte_counts_that_fill_bytes_are_accepted() {
    let h = ok("f4_four");
    assert_eq!(h.get("a").unwrap().len(), 2);
    let h = ok("f6_e2m3_four");
    assert_eq!(h.get("a").unwrap().len(), 3);
    assert_eq!(ok("f4_two_by_three").get("a").unwrap().len(), 3);
    assert_eq!(ok("f6_e3m2_eight").get("a").unwrap().len(), 6);
}

// ---- 7e. size -------------------------------------------------------------------------------

#[test]
fn rule7e_size_mismatch_is_tensor_invalid_info() {
    let e = reject("size_mismatch");
    match &e {
        FormatError::TensorInvalidInfo { name, dtype, shape, expected, actual } => {
            assert_eq!(name, "a");
            assert_eq!(*dtype, Dtype::F32);
            assert_eq!(shape, &[4]);
            assert_eq!((*expected, *actual), (16, 12));
        }
        _ => panic!("{e:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("`a`") && msg.contains("16") && msg.contains("12"), "{msg}");
}

// ---- 8. coverage ----------------------------------------------------------------------------

#[test]
fn rule8_trailing_bytes_and_truncated_data() {
    for (label, actual) in [("trailing_bytes", 1), ("truncated_data", -1i64)] {
        let bytes = case(label);
        let e = parse(&bytes).unwrap_err();
        match &e {
            FormatError::MetadataIncompleteBuffer { expected, header_end, data_len, actual: a } => {
                assert_eq!(*data_len, 32, "{label}");
                assert_eq!(*expected, header_end + 32, "{label}");
                assert_eq!(*a as i64, *expected as i64 + actual, "{label}");
                assert_eq!(*a, bytes.len() as u64);
            }
            _ => panic!("{label}: {e:?}"),
        }
        assert!(e.to_string().contains(&bytes.len().to_string()), "{e}");
    }
    assert!(matches!(reject("no_tensor_but_data"), FormatError::MetadataIncompleteBuffer { data_len: 0, .. }));
}

#[test]
fn rule8_data_length_overflowing_u64_is_incomplete_buffer_not_a_panic() {
    // Each tensor validates alone; 8 + N + data length does not fit in 64 bits.
    let bytes = file(common::overflowing_data_len_json(), 0);
    match parse(&bytes) {
        Err(FormatError::MetadataIncompleteBuffer { data_len, actual, .. }) => {
            assert_eq!(data_len, u64::MAX - 7);
            assert_eq!(actual, bytes.len() as u64);
        }
        other => panic!("{other:?}"),
    }
}

// ---- the header-only entry points agree with the whole-file one -----------------------------

#[test]
fn parse_reads_nothing_past_the_header() {
    let bytes = accepted("unaligned_offsets");
    let whole = parse(&bytes).unwrap();
    let n = read_header_len(&bytes, bytes.len() as u64).unwrap();
    assert_eq!(n, whole.header_len());
    let prefix = &bytes[..8 + n as usize];
    assert_eq!(Header::parse(prefix, bytes.len() as u64).unwrap(), whole);
    assert_eq!(Header::parse_json(&prefix[8..], bytes.len() as u64).unwrap(), whole);
    // The same prefix with a wrong file length fails coverage, both ways.
    for len in [bytes.len() as u64 - 1, bytes.len() as u64 + 1] {
        assert_eq!(kind(&Header::parse(prefix, len).unwrap_err()), "MetadataIncompleteBuffer");
    }
    // A prefix shorter than 8 + N is an error, not a panic.
    assert_eq!(
        kind(&Header::parse(&prefix[..prefix.len() - 1], bytes.len() as u64).unwrap_err()),
        "InvalidHeaderLength"
    );
    assert_eq!(kind(&Header::parse(&prefix[..5], bytes.len() as u64).unwrap_err()), "HeaderTooSmall");
}

// ---- accepted edge cases --------------------------------------------------------------------

#[test]
fn accepts_leading_and_trailing_whitespace() {
    for label in ["leading_whitespace", "trailing_whitespace", "inner_whitespace"] {
        let h = ok(label);
        let a = h.get("a").unwrap();
        assert_eq!((a.dtype, a.shape.as_slice(), a.data_offsets), (Dtype::F32, &[1usize][..], (0, 4)));
    }
}

#[test]
fn duplicate_tensor_keys_keep_the_last() {
    let h = ok("duplicate_key_identical");
    assert_eq!(h.len(), 1);
    let h = ok("duplicate_key_last_wins");
    assert_eq!(h.len(), 1);
    let a = h.get("a").unwrap();
    assert_eq!((a.dtype, a.shape.clone()), (Dtype::U8, vec![4]));
}

#[test]
fn unknown_fields_are_ignored() {
    let h = ok("unknown_extra_field");
    assert_eq!(h.get("a").unwrap().data_offsets, (0, 4));
    assert_eq!(h.len(), 1);
}

#[test]
fn metadata_null_empty_and_position() {
    let h = ok("metadata_null");
    assert_eq!(h.metadata(), None);
    assert_eq!(h.len(), 1);
    let h = ok("metadata_empty");
    assert!(h.metadata().unwrap().is_empty());
    assert!(h.is_empty());
    let h = ok("metadata_last");
    assert_eq!(h.metadata().unwrap()["format"], "pt");
    assert_eq!(ok("metadata_duplicate_key_last_wins").metadata().unwrap()["k"], "2");
    let h = ok("escaped_metadata_key");
    assert_eq!(h.metadata().unwrap()["k"], "v");
    assert!(h.is_empty());
    assert_ihd("duplicate_metadata_escaped", "duplicate field `__metadata__`");
    // Absent.
    assert_eq!(ok("empty_object").metadata(), None);
}

#[test]
fn names_empty_unicode_and_escaped() {
    assert_eq!(ok("empty_name").get("").unwrap().data_offsets, (0, 4));
    let h = ok("unicode_names");
    assert_eq!(h.sorted_names(), vec!["é", "模型.权重", "🦀"]);
    let h = ok("escaped_names");
    assert_eq!(h.get("é\n\"q\\").unwrap().data_offsets, (0, 1));
    assert_eq!(h.get("🦀").unwrap().data_offsets, (1, 2));
}

#[test]
fn zero_sized_tensors_before_data_and_scalars() {
    let h = ok("zero_sized_before_data");
    let order: Vec<&str> = h.tensors().iter().map(|t| t.name.as_str()).collect();
    // Ties at [0, 0] in name order, then the data tensor.
    assert_eq!(order, ["y", "z", "a"]);
    assert!(h.get("y").unwrap().is_empty());
    assert_eq!(h.get("y").unwrap().num_elements(), 0);
    assert_eq!(h.data_len(), 4);
    let h = ok("only_zero_sized");
    assert_eq!((h.len(), h.data_len()), (2, 0));
    let h = ok("scalar");
    let s = h.get("s").unwrap();
    assert!(s.shape.is_empty());
    assert_eq!((s.num_elements(), s.len()), (1, 8));
}

#[test]
fn unaligned_offsets_are_accepted() {
    let h = ok("unaligned_offsets");
    assert_eq!(h.get("f").unwrap().data_offsets, (1, 5));
    assert_eq!(h.get("d").unwrap().data_offsets, (5, 13));
    assert_eq!(h.data_len(), 13);
}

#[test]
fn header_order_is_irrelevant_tensors_come_in_offset_order() {
    let h = ok("header_order_irrelevant");
    let order: Vec<&str> = h.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(order, ["first", "second"]);
    assert_eq!(h.position("second"), Some(1));
    assert!(matches!(h.tensor("third"), Err(FormatError::TensorNotFound(n)) if n == "third"));
}
