//! Helpers shared by the integration tests: building files by hand, naming error variants, and
//! the corpus of hand-made rejected and accepted inputs (used by `rejections.rs` for the exact
//! outcome of each rule and by `reference.rs` to compare with the reference implementation).
#![allow(dead_code)]

use turboio_format::FormatError;

/// Deterministic filler for tensor bytes, so that data slices can be compared meaningfully.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// `N` (little-endian) followed by `rest`, whatever `rest` is.
pub fn raw(n: u64, rest: &[u8]) -> Vec<u8> {
    let mut out = n.to_le_bytes().to_vec();
    out.extend_from_slice(rest);
    out
}

/// A file whose header is exactly `json` (N = its length, no padding) followed by `data_len`
/// bytes of data.
pub fn file(json: impl AsRef<[u8]>, data_len: usize) -> Vec<u8> {
    let json = json.as_ref();
    let mut out = raw(json.len() as u64, json);
    out.extend_from_slice(&pattern(data_len, 7));
    out
}

/// One header entry: `"name":{"dtype":..,"shape":[..],"data_offsets":[b,e]}`.
pub fn entry(name: &str, dtype: &str, shape: &[u64], begin: u64, end: u64) -> String {
    let shape: Vec<String> = shape.iter().map(u64::to_string).collect();
    format!(
        "{}:{{\"dtype\":\"{dtype}\",\"shape\":[{}],\"data_offsets\":[{begin},{end}]}}",
        serde_json::to_string(name).unwrap(),
        shape.join(",")
    )
}

/// `{e1,e2,...}`.
pub fn object(entries: &[String]) -> String {
    format!("{{{}}}", entries.join(","))
}

/// The variant name of one of our errors.
pub fn kind(e: &FormatError) -> &'static str {
    match e {
        FormatError::HeaderTooSmall { .. } => "HeaderTooSmall",
        FormatError::HeaderTooLarge { .. } => "HeaderTooLarge",
        FormatError::InvalidHeaderLength { .. } => "InvalidHeaderLength",
        FormatError::InvalidHeader(_) => "InvalidHeader",
        FormatError::InvalidHeaderDeserialization(_) => "InvalidHeaderDeserialization",
        FormatError::InvalidOffset { .. } => "InvalidOffset",
        FormatError::ValidationOverflow { .. } => "ValidationOverflow",
        FormatError::MisalignedSlice { .. } => "MisalignedSlice",
        FormatError::TensorInvalidInfo { .. } => "TensorInvalidInfo",
        FormatError::MetadataIncompleteBuffer { .. } => "MetadataIncompleteBuffer",
        FormatError::DuplicateTensorName(_) => "DuplicateTensorName",
        FormatError::ReservedName => "ReservedName",
        FormatError::TensorNotFound(_) => "TensorNotFound",
        _ => "unknown variant",
    }
}

/// A hand-made input and the variant it must be rejected with.
pub struct Case {
    /// Short unique label.
    pub label: &'static str,
    /// The whole file.
    pub bytes: Vec<u8>,
    /// Expected variant name (see [`kind`]).
    pub expect: &'static str,
}

const IHD: &str = "InvalidHeaderDeserialization";

fn f32_entry(name: &str, begin: u64, end: u64) -> String {
    entry(name, "F32", &[(end.saturating_sub(begin)) / 4], begin, end)
}

/// A 200-deep nested array, inside an ignored field of an otherwise valid tensor entry.
pub fn deep_nesting(depth: usize) -> String {
    format!(
        "{{\"a\":{{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":{}{}}}}}",
        "[".repeat(depth),
        "]".repeat(depth)
    )
}

/// Eight U8 tensors of 2^61 - 1 bytes each: each one validates, but the data length
/// (8 x (2^61 - 1) = 2^64 - 8) plus `8 + N` overflows 64 bits.
pub fn overflowing_data_len_json() -> String {
    let size: u64 = (1 << 61) - 1;
    let entries: Vec<String> =
        (0..8u64).map(|i| entry(&format!("t{i}"), "U8", &[size], i * size, (i + 1) * size)).collect();
    object(&entries)
}

/// Every rejected hand-made input, in the order of the rules of spec §1.4.
pub fn rejected_cases() -> Vec<Case> {
    let valid = object(&[f32_entry("a", 0, 16), f32_entry("b", 16, 32)]);
    let cases = vec![
        // 1. fewer than 8 bytes
        ("empty_buffer", Vec::new(), "HeaderTooSmall"),
        ("seven_bytes", vec![2, 0, 0, 0, 0, 0, 0], "HeaderTooSmall"),
        // 3. N over the limit
        ("n_over_max", raw(100_000_001, b"{}"), "HeaderTooLarge"),
        ("n_u64_max", raw(u64::MAX, b"{}"), "HeaderTooLarge"),
        // 4. 8 + N past the end
        ("n_exactly_max_short_buffer", raw(100_000_000, b"{}"), "InvalidHeaderLength"),
        ("n_past_end", raw(20, b"{}      "), "InvalidHeaderLength"),
        ("n_one_past_end", raw(3, b"{}"), "InvalidHeaderLength"),
        // 5. UTF-8
        ("invalid_utf8", file(b"{\"\xff\":1}", 0), "InvalidHeader"),
        ("truncated_utf8", file(b"{\"\xc3\":1}", 0), "InvalidHeader"),
        // 6. JSON shape
        ("bad_json", file("{\"a\":", 0), IHD),
        ("trailing_chars", file("{} x", 0), IHD),
        ("trailing_nul", file(b"{}\0\0", 0), IHD),
        ("bom", file(b"\xEF\xBB\xBF{}", 0), IHD),
        ("n_zero", raw(0, b""), IHD),
        ("array", file("[]", 0), IHD),
        ("null", file("null", 0), IHD),
        ("number", file("1", 0), IHD),
        ("tensor_not_object", file("{\"a\":1}", 0), IHD),
        ("tensor_array_wrong_order", file("{\"a\":[[1],\"F32\",[0,4]]}", 4), IHD),
        ("tensor_array_too_short", file("{\"a\":[\"F32\",[1]]}", 4), IHD),
        ("unknown_dtype", file(object(&[entry("a", "F128", &[1], 0, 16)]), 16), IHD),
        ("lowercase_dtype", file(object(&[entry("a", "f32", &[1], 0, 4)]), 4), IHD),
        ("missing_dtype", file("{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4), IHD),
        ("missing_shape", file("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4), IHD),
        ("missing_data_offsets", file("{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4), IHD),
        ("data_offsets_arity_1", file("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4]}}", 4), IHD),
        ("data_offsets_arity_3", file("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 4), IHD),
        (
            "data_offsets_above_u64",
            file("{\"a\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,18446744073709551616]}}", 0),
            IHD,
        ),
        ("shape_negative", file("{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4), IHD),
        ("shape_float", file("{\"a\":{\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]}}", 4), IHD),
        ("shape_exponent", file("{\"a\":{\"dtype\":\"F32\",\"shape\":[1e0],\"data_offsets\":[0,4]}}", 4), IHD),
        ("shape_string", file("{\"a\":{\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]}}", 4), IHD),
        ("duplicate_metadata", file("{\"__metadata__\":{},\"__metadata__\":{}}", 0), IHD),
        ("metadata_number_value", file("{\"__metadata__\":{\"k\":1}}", 0), IHD),
        ("metadata_nested_object", file("{\"__metadata__\":{\"k\":{\"x\":\"y\"}}}", 0), IHD),
        ("duplicate_metadata_escaped", file("{\"__metadata__\":{},\"\\u005f_metadata__\":{}}", 0), IHD),
        ("metadata_string", file("{\"__metadata__\":\"pt\"}", 0), IHD),
        ("json_line_comment", file("{} // comment", 0), IHD),
        ("json_block_comment", file("{/* c */}", 0), IHD),
        ("trailing_comma", file(format!("{{{},}}", f32_entry("a", 0, 4)), 4), IHD),
        ("deep_nesting_200", file(deep_nesting(200), 1), IHD),
        // 7a. offsets
        ("hole", file(object(&[f32_entry("a", 0, 16), f32_entry("b", 20, 36)]), 36), "InvalidOffset"),
        ("overlap", file(object(&[f32_entry("a", 0, 16), f32_entry("b", 8, 24)]), 24), "InvalidOffset"),
        ("not_starting_at_zero", file(object(&[f32_entry("a", 4, 20)]), 20), "InvalidOffset"),
        (
            "end_before_begin",
            file(object(&[f32_entry("a", 0, 16), entry("b", "F32", &[0], 16, 8)]), 16),
            "InvalidOffset",
        ),
        (
            "duplicate_key_last_wins_leaves_hole",
            file(object(&[f32_entry("a", 0, 4), f32_entry("a", 4, 8)]), 8),
            "InvalidOffset",
        ),
        // 7b, 7c. overflow
        (
            "shape_product_overflow",
            file(object(&[entry("a", "U8", &[1 << 32, 1 << 32], 0, 0)]), 0),
            "ValidationOverflow",
        ),
        ("bits_overflow", file(object(&[entry("a", "U8", &[u64::MAX], 0, 0)]), 0), "ValidationOverflow"),
        // 7d. sub-byte
        ("f4_odd_count", file(object(&[entry("a", "F4", &[3], 0, 2)]), 2), "MisalignedSlice"),
        ("f6_e3m2_two", file(object(&[entry("a", "F6_E3M2", &[2], 0, 2)]), 2), "MisalignedSlice"),
        // 7e. size
        ("size_mismatch", file(object(&[entry("a", "F32", &[4], 0, 12)]), 12), "TensorInvalidInfo"),
        // 8. coverage
        ("trailing_bytes", file(&valid, 33), "MetadataIncompleteBuffer"),
        ("truncated_data", file(&valid, 31), "MetadataIncompleteBuffer"),
        ("no_tensor_but_data", file("{}", 1), "MetadataIncompleteBuffer"),
    ];
    cases.into_iter().map(|(label, bytes, expect)| Case { label, bytes, expect }).collect()
}

/// The bytes of one rejected case, by label.
pub fn case(label: &str) -> Vec<u8> {
    rejected_cases().into_iter().find(|c| c.label == label).unwrap_or_else(|| panic!("no case {label}")).bytes
}

/// Every accepted edge case of spec §1.4.
pub fn accepted_cases() -> Vec<(&'static str, Vec<u8>)> {
    let one = f32_entry("a", 0, 4);
    vec![
        ("empty_object", file("{}", 0)),
        ("leading_whitespace", file(format!(" \t\r\n{{{one}}}"), 4)),
        ("trailing_whitespace", file(format!("{{{one}}} \t\r\n  "), 4)),
        ("inner_whitespace", file(" { \"a\" : { \"dtype\" : \"F32\" , \"shape\" : [ 1 ] , \"data_offsets\" : [ 0 , 4 ] } } ", 4)),
        (
            "duplicate_key_identical",
            file(format!("{{{one},{one}}}"), 4),
        ),
        (
            "duplicate_key_last_wins",
            file(object(&[entry("a", "F32", &[9], 0, 36), entry("a", "U8", &[4], 0, 4)]), 4),
        ),
        (
            "unknown_extra_field",
            file("{\"a\":{\"foo\":1,\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"bar\":{\"x\":[null]}}}", 4),
        ),
        ("metadata_null", file(format!("{{\"__metadata__\":null,{one}}}"), 4)),
        ("metadata_empty", file("{\"__metadata__\":{}}", 0)),
        (
            "metadata_last",
            file(format!("{{{one},\"__metadata__\":{{\"format\":\"pt\"}}}}"), 4),
        ),
        (
            "metadata_duplicate_key_last_wins",
            file("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0),
        ),
        // serde's derived struct visitor also takes a sequence of the fields in order.
        ("tensor_as_array", file("{\"a\":[\"F32\",[1],[0,4]]}", 4)),
        // An escaped spelling of `__metadata__` is still the metadata field.
        (
            "escaped_metadata_key",
            file("{\"\\u005f_metadata__\":{\"k\":\"v\"}}", 0),
        ),
        ("empty_name", file(object(&[f32_entry("", 0, 4)]), 4)),
        (
            "unicode_names",
            file(object(&[f32_entry("é", 0, 4), f32_entry("模型.权重", 4, 8), f32_entry("🦀", 8, 12)]), 12),
        ),
        (
            "escaped_names",
            file("{\"\\u00e9\\n\\\"q\\\\\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},\"\\ud83e\\udd80\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2),
        ),
        (
            "zero_sized_before_data",
            file(object(&[entry("z", "F32", &[0], 0, 0), entry("y", "F64", &[2, 0, 3], 0, 0), f32_entry("a", 0, 4)]), 4),
        ),
        (
            "only_zero_sized",
            file(object(&[entry("z", "F32", &[0], 0, 0), entry("y", "BOOL", &[0], 0, 0)]), 0),
        ),
        ("scalar", file(object(&[entry("s", "F64", &[], 0, 8)]), 8)),
        (
            "unaligned_offsets",
            file(object(&[entry("b", "U8", &[1], 0, 1), entry("f", "F32", &[1], 1, 5), entry("d", "F64", &[1], 5, 13)]), 13),
        ),
        ("f4_four", file(object(&[entry("a", "F4", &[4], 0, 2)]), 2)),
        ("f4_two_by_three", file(object(&[entry("a", "F4", &[2, 3], 0, 3)]), 3)),
        ("f6_e2m3_four", file(object(&[entry("a", "F6_E2M3", &[4], 0, 3)]), 3)),
        ("f6_e3m2_eight", file(object(&[entry("a", "F6_E3M2", &[8], 0, 6)]), 6)),
        (
            "header_order_irrelevant",
            file(object(&[f32_entry("second", 4, 8), f32_entry("first", 0, 4)]), 8),
        ),
        ("deep_nesting_100", file(deep_nesting(100), 1)),
    ]
}

/// The bytes of one accepted case, by label.
pub fn accepted(label: &str) -> Vec<u8> {
    accepted_cases().into_iter().find(|c| c.0 == label).unwrap_or_else(|| panic!("no case {label}")).1
}

// ---- structurally valid JSON headers with random contents (for property tests) -------------

/// One tensor entry of a generated header: a dtype *string* (possibly not a dtype), a shape of
/// arbitrary u64s, and offsets that are either given or computed to follow the previous entry.
#[derive(Debug, Clone)]
pub struct RawEntry {
    /// Name.
    pub name: String,
    /// Dtype spelling.
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// `None`: contiguous after the previous entry with the size the dtype and shape need.
    pub offsets: Option<(u64, u64)>,
}

/// Bits per element of a dtype spelling, if it is one.
pub fn dtype_bits(name: &str) -> Option<u64> {
    name.parse::<turboio_format::Dtype>().ok().map(|d| d.bits() as u64)
}

/// Renders a header for `entries` (in the given order, duplicates kept) and returns the whole
/// file: the data section is the last END plus `data_delta` bytes when that is small, else
/// `data_delta.max(0)` bytes.
pub fn structured_file(entries: &[RawEntry], metadata: Option<&[(String, String)]>, data_delta: i64) -> Vec<u8> {
    let mut parts = Vec::new();
    if let Some(m) = metadata {
        let kv: Vec<String> = m
            .iter()
            .map(|(k, v)| format!("{}:{}", serde_json::to_string(k).unwrap(), serde_json::to_string(v).unwrap()))
            .collect();
        parts.push(format!("\"__metadata__\":{{{}}}", kv.join(",")));
    }
    let mut start = 0u64;
    for e in entries {
        let (b, end) = e.offsets.unwrap_or_else(|| {
            let size = e
                .shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .and_then(|n| n.checked_mul(dtype_bits(&e.dtype).unwrap_or(8)))
                .map(|bits| bits / 8)
                .unwrap_or(0);
            (start, start.saturating_add(size))
        });
        start = end;
        let shape: Vec<String> = e.shape.iter().map(u64::to_string).collect();
        parts.push(format!(
            "{}:{{\"dtype\":{},\"shape\":[{}],\"data_offsets\":[{b},{end}]}}",
            serde_json::to_string(&e.name).unwrap(),
            serde_json::to_string(&e.dtype).unwrap(),
            shape.join(",")
        ));
    }
    let json = format!("{{{}}}", parts.join(","));
    let data = if start <= 1 << 16 { (start as i64 + data_delta).max(0) as usize } else { data_delta.max(0) as usize };
    file(json, data)
}

/// Proptest strategies shared by the property tests.
pub mod strategies {
    use super::RawEntry;
    use proptest::prelude::*;
    use turboio_format::Dtype;

    /// Small dimensions most of the time, and the numbers at which arithmetic overflows.
    pub fn dim() -> impl Strategy<Value = u64> {
        prop_oneof![
            8 => 0u64..6,
            1 => prop::sample::select(vec![
                u64::MAX,
                u64::MAX - 1,
                u64::MAX / 8,
                u64::MAX / 8 + 1,
                (1 << 61) - 1,
                1 << 61,
                1 << 62,
                1 << 63,
                1 << 32,
                (1 << 32) + 1,
            ]),
        ]
    }

    /// An offset: small, or huge.
    pub fn offset() -> impl Strategy<Value = u64> {
        prop_oneof![
            6 => 0u64..64,
            1 => dim(),
        ]
    }

    /// A dtype spelling: almost always a real one.
    pub fn dtype_name() -> impl Strategy<Value = String> {
        prop_oneof![
            20 => prop::sample::select(Dtype::ALL.to_vec()).prop_map(|d| d.name().to_owned()),
            1 => prop::sample::select(vec!["f32", "F128", "", "U4", "F8_E4M3FN", "C128"])
                .prop_map(str::to_owned),
        ]
    }

    /// One entry; names from a small set so that duplicates happen.
    pub fn raw_entry() -> impl Strategy<Value = RawEntry> {
        (
            prop::sample::select(vec!["a", "b", "c", "d", "", "é", "__metadata__x"]),
            dtype_name(),
            prop::collection::vec(dim(), 0..4),
            prop_oneof![
                4 => Just(None),
                1 => (offset(), offset()).prop_map(Some),
            ],
        )
            .prop_map(|(name, dtype, shape, offsets)| RawEntry {
                name: name.to_owned(),
                dtype,
                shape,
                offsets,
            })
    }

    /// A valid tensor to write: unique names are enforced by [`tensor_set`].
    pub fn tensor() -> impl Strategy<Value = (String, Dtype, Vec<usize>)> {
        (
            prop_oneof![
                3 => "[a-z][a-z0-9._]{0,10}",
                1 => "(?s).{0,6}",
            ],
            prop::sample::select(Dtype::ALL.to_vec()),
            prop_oneof![
                1 => Just(vec![]),
                1 => prop::collection::vec(0usize..3, 1..3),
                4 => prop::collection::vec(1usize..6, 1..4),
            ],
        )
            .prop_map(|(name, dtype, mut shape)| {
                // Sub-byte types need a count that fills whole bytes.
                let count: usize = shape.iter().product();
                if !(count * dtype.bits()).is_multiple_of(8) {
                    shape.push(if dtype == Dtype::F4 { 2 } else { 4 });
                }
                (name, dtype, shape)
            })
    }

    /// A set of valid tensors with distinct names (never `__metadata__`).
    pub fn tensor_set(max: usize) -> impl Strategy<Value = Vec<(String, Dtype, Vec<usize>)>> {
        prop::collection::vec(tensor(), 0..max).prop_map(|v| {
            let mut seen = std::collections::BTreeSet::new();
            v.into_iter().filter(|(n, _, _)| n != "__metadata__" && seen.insert(n.clone())).collect()
        })
    }

    /// Metadata with at most `max` entries, keys and values any strings.
    pub fn metadata(max: usize) -> impl Strategy<Value = Option<std::collections::BTreeMap<String, String>>> {
        prop::option::of(prop::collection::btree_map("(?s).{0,8}", "(?s).{0,12}", 0..=max))
    }

    /// A whole generated file: entries in random order, optional metadata, data length delta.
    pub fn structured() -> impl Strategy<Value = Vec<u8>> {
        (
            prop::collection::vec(raw_entry(), 0..6),
            prop::option::of(prop::collection::vec(("[a-c]{0,2}", "\\PC{0,4}"), 0..3)),
            prop_oneof![8 => Just(0i64), 1 => -3i64..4],
        )
            .prop_map(|(entries, meta, delta)| super::structured_file(&entries, meta.as_deref(), delta))
    }
}

/// A proptest configuration running `default_cases` cases, or `PROPTEST_CASES` when set (for a
/// longer run: `PROPTEST_CASES=20000 cargo test -p turboio-format`).
pub fn proptest_config(default_cases: u32) -> proptest::test_runner::Config {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default_cases);
    proptest::test_runner::Config::with_cases(cases)
}
