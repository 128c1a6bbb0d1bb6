//! Reading a header: the reference rules, in the reference order.

use crate::{Dtype, FormatError, MAX_HEADER_SIZE, N_LEN};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};

/// One tensor as the header describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name (any UTF-8 string, possibly empty).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape; `[]` is a scalar (one element), a 0 anywhere means no elements.
    pub shape: Vec<usize>,
    /// `[BEGIN, END)` relative to the start of the data section.
    pub data_offsets: (usize, usize),
}

impl TensorInfo {
    /// Bytes of data.
    pub fn len(&self) -> usize {
        self.data_offsets.1 - self.data_offsets.0
    }

    /// True if the tensor has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of elements (product of the shape; 1 for a scalar).
    pub fn num_elements(&self) -> usize {
        // Validated at parse time not to overflow.
        self.shape.iter().product()
    }
}

/// The deserialization target, shaped exactly as the reference's `HashMetadata` so that serde
/// accepts and rejects the same documents (flattened tensor map: duplicate names keep the last
/// one; a duplicate `__metadata__` is an error; unknown fields in a tensor entry are ignored).
#[derive(Deserialize)]
struct RawHeader {
    #[serde(rename = "__metadata__")]
    metadata: Option<HashMap<String, String>>,
    #[serde(flatten)]
    tensors: HashMap<String, RawTensor>,
}

/// The same document read without `flatten`: serde's flattening buffers every entry into an
/// intermediate tree first, which made a header of 5,000 tensors take milliseconds. This reads
/// the map directly. It accepts exactly what [`RawHeader`] accepts (the first `__metadata__`,
/// a second one an error; the last of duplicate tensor names; unknown tensor fields ignored);
/// on any error the header is read again as a [`RawHeader`], so errors keep the reference's
/// wording.
struct FastHeader {
    metadata: Option<HashMap<String, String>>,
    tensors: HashMap<String, RawTensor>,
}

impl<'de> Deserialize<'de> for FastHeader {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = FastHeader;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a safetensors header")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<FastHeader, A::Error> {
                let mut metadata = None;
                let mut seen_metadata = false;
                let mut tensors = HashMap::with_capacity(map.size_hint().unwrap_or(0));
                while let Some(key) = map.next_key::<String>()? {
                    if key == "__metadata__" {
                        if seen_metadata {
                            return Err(serde::de::Error::duplicate_field("__metadata__"));
                        }
                        seen_metadata = true;
                        metadata = map.next_value::<Option<HashMap<String, String>>>()?;
                    } else {
                        let FastTensor(t) = map.next_value()?;
                        tensors.insert(key, t);
                    }
                }
                Ok(FastHeader { metadata, tensors })
            }
        }
        d.deserialize_map(Visit)
    }
}

/// A tensor entry of [`FastHeader`]: exactly `dtype`, `shape` and `data_offsets`, each once.
/// Anything else (an unknown field, whose value the reference buffers and so limits in depth)
/// is an error here, which sends the header to the [`RawHeader`] path.
struct FastTensor(RawTensor);

impl<'de> Deserialize<'de> for FastTensor {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = FastTensor;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a tensor entry")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<FastTensor, A::Error> {
                use serde::de::Error;
                let (mut dtype, mut shape, mut offsets) = (None, None, None);
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    match &*key {
                        "dtype" if dtype.is_none() => dtype = Some(map.next_value::<Dtype>()?),
                        "shape" if shape.is_none() => shape = Some(map.next_value::<Vec<usize>>()?),
                        "data_offsets" if offsets.is_none() => offsets = Some(map.next_value::<(usize, usize)>()?),
                        _ => return Err(A::Error::custom("not a plain tensor entry")),
                    }
                }
                match (dtype, shape, offsets) {
                    (Some(dtype), Some(shape), Some(data_offsets)) => {
                        Ok(FastTensor(RawTensor { dtype, shape, data_offsets }))
                    }
                    _ => Err(A::Error::custom("a field is missing")),
                }
            }
        }
        d.deserialize_map(Visit)
    }
}

#[derive(Deserialize)]
struct RawTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// A parsed and validated safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    header_len: u64,
    metadata: Option<BTreeMap<String, String>>,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    data_len: u64,
}

/// Reads the header length N from the first bytes of a file of `file_len` bytes.
///
/// Applies steps 1 to 4 of the reference validation: fewer than 8 bytes, N above
/// [`MAX_HEADER_SIZE`], and `8 + N` past the end of the file are rejected. `first` must hold at
/// least the first 8 bytes when the file has them.
pub fn read_header_len(first: &[u8], file_len: u64) -> Result<u64, FormatError> {
    let Some(len_bytes) = first.get(..N_LEN) else {
        return Err(FormatError::HeaderTooSmall { len: file_len.min(first.len() as u64) });
    };
    if file_len < N_LEN as u64 {
        return Err(FormatError::HeaderTooSmall { len: file_len });
    }
    let mut le = [0u8; 8];
    le.copy_from_slice(len_bytes);
    let n = u64::from_le_bytes(le);
    if usize::try_from(n).is_err() || n > MAX_HEADER_SIZE as u64 {
        return Err(FormatError::HeaderTooLarge { len: n });
    }
    let available = file_len - N_LEN as u64;
    if n > available {
        return Err(FormatError::InvalidHeaderLength { header_len: n, available });
    }
    Ok(n)
}

impl Header {
    /// Parses and validates a header from the start of a file.
    ///
    /// `prefix` holds at least the first `8 + N` bytes of the file (more is fine and is not
    /// read); `file_len` is the whole file's length, used only for the final coverage check.
    /// Nothing past `8 + N` is looked at, so a loader validates a multi-GB file by reading a few
    /// kilobytes.
    pub fn parse(prefix: &[u8], file_len: u64) -> Result<Header, FormatError> {
        let n = read_header_len(prefix, file_len)?;
        let end = N_LEN + n as usize;
        let Some(json) = prefix.get(N_LEN..end) else {
            return Err(FormatError::InvalidHeaderLength {
                header_len: n,
                available: prefix.len().saturating_sub(N_LEN) as u64,
            });
        };
        Self::parse_json(json, file_len)
    }

    /// Parses a complete in-memory file (header and data).
    pub fn from_file_bytes(file: &[u8]) -> Result<Header, FormatError> {
        Self::parse(file, file.len() as u64)
    }

    /// Steps 5 to 8 of the reference validation: the `N` header bytes (after the 8-byte length) of a file of `file_len` bytes.
    pub fn parse_json(json: &[u8], file_len: u64) -> Result<Header, FormatError> {
        let text = std::str::from_utf8(json).map_err(FormatError::InvalidHeader)?;
        let raw = match serde_json::from_str::<FastHeader>(text) {
            Ok(f) => RawHeader { metadata: f.metadata, tensors: f.tensors },
            Err(_) => serde_json::from_str::<RawHeader>(text).map_err(FormatError::InvalidHeaderDeserialization)?,
        };
        let mut tensors: Vec<TensorInfo> = raw
            .tensors
            .into_iter()
            .map(|(name, t)| TensorInfo { name, dtype: t.dtype, shape: t.shape, data_offsets: t.data_offsets })
            .collect();
        // The reference sorts by (BEGIN, END) only, leaving ties in hash order; the name breaks
        // ties here so that the same file always gives the same error.
        tensors.sort_by(|a, b| a.data_offsets.cmp(&b.data_offsets).then_with(|| a.name.cmp(&b.name)));
        let data_len = validate(&tensors)?;
        let header_end = N_LEN as u64 + json.len() as u64;
        // The data length alone can be close to 2^64 (eight tensors of 2^61 - 1 bytes each
        // validate), so the sum is checked; a sum that overflows cannot be the file's length.
        let expected = header_end.checked_add(data_len as u64);
        if expected != Some(file_len) {
            return Err(FormatError::MetadataIncompleteBuffer {
                expected: expected.unwrap_or(u64::MAX),
                header_end,
                data_len: data_len as u64,
                actual: file_len,
            });
        }
        let index = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(Header {
            header_len: json.len() as u64,
            metadata: raw.metadata.map(|m| m.into_iter().collect()),
            tensors,
            index,
            data_len: data_len as u64,
        })
    }

    /// N: the JSON header's length in bytes, padding included.
    pub fn header_len(&self) -> u64 {
        self.header_len
    }

    /// Offset of the data section in the file: `8 + N`.
    pub fn data_start(&self) -> u64 {
        N_LEN as u64 + self.header_len
    }

    /// Bytes of tensor data (the last END).
    pub fn data_len(&self) -> u64 {
        self.data_len
    }

    /// The file's total length: `8 + N + data length`.
    pub fn file_len(&self) -> u64 {
        self.data_start() + self.data_len
    }

    /// `__metadata__`, if present (`None` when absent or `null`), with keys sorted.
    pub fn metadata(&self) -> Option<&BTreeMap<String, String>> {
        self.metadata.as_ref()
    }

    /// The tensors in file (offset) order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True if the header describes no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// A tensor by name.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Position of a tensor in [`tensors`](Self::tensors).
    pub fn position(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// A tensor by name, or [`FormatError::TensorNotFound`].
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, FormatError> {
        self.get(name).ok_or_else(|| FormatError::TensorNotFound(name.to_owned()))
    }

    /// Tensor names sorted alphabetically.
    pub fn sorted_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        names
    }

    /// A header describing some of this one's tensors at new places: each pick is a position in
    /// [`tensors`](Self::tensors) and the tensor's `[BEGIN, END)` in a data section of
    /// `data_len` bytes (a load of a subset lays out only what it reads). Metadata and the header
    /// length are kept, so aliases whose target is picked still resolve. `None` if a pick is out
    /// of range, changes a tensor's length or ends past `data_len`; the picks need not cover the
    /// data section (that is the point), so this is not a file's header.
    pub fn select(&self, picks: &[(usize, (usize, usize))], data_len: u64) -> Option<Header> {
        let mut tensors = Vec::with_capacity(picks.len());
        for &(i, (begin, end)) in picks {
            let t = self.tensors.get(i)?;
            if end.checked_sub(begin)? != t.len() || end as u64 > data_len {
                return None;
            }
            tensors.push(TensorInfo { data_offsets: (begin, end), ..t.clone() });
        }
        tensors.sort_by(|a, b| a.data_offsets.cmp(&b.data_offsets).then_with(|| a.name.cmp(&b.name)));
        let index: HashMap<String, usize> = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        if index.len() != tensors.len() {
            return None;
        }
        Some(Header { header_len: self.header_len, metadata: self.metadata.clone(), tensors, index, data_len })
    }

    /// Aliases recorded in `__metadata__`, as veTurboIO and `safetensors.torch.save_model` write them:
    /// every metadata entry whose value names a tensor of this file (and whose key does not)
    /// means "the tensor `key` is the same tensor as `value`". Returned sorted by alias.
    pub fn aliases(&self) -> Vec<(&str, &str)> {
        let Some(meta) = &self.metadata else {
            return Vec::new();
        };
        meta.iter()
            .filter(|(k, v)| self.index.contains_key(v.as_str()) && !self.index.contains_key(k.as_str()))
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }
}

/// Size in bytes of `shape` elements of `dtype`, with the reference's overflow and sub-byte checks.
pub(crate) fn tensor_byte_len(name: &str, dtype: Dtype, shape: &[usize]) -> Result<usize, FormatError> {
    let overflow = || FormatError::ValidationOverflow { name: name.to_owned(), dtype, shape: shape.to_vec() };
    let elements = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(overflow)?;
    let bits = elements.checked_mul(dtype.bits()).ok_or_else(overflow)?;
    if bits % 8 != 0 {
        return Err(FormatError::MisalignedSlice { name: name.to_owned(), dtype, shape: shape.to_vec() });
    }
    Ok(bits / 8)
}

/// The reference `Metadata::validate`: tensors sorted by offset must tile `[0, end)` exactly and
/// each must hold exactly its dtype x shape bytes. Returns the data length.
pub(crate) fn validate(tensors: &[TensorInfo]) -> Result<usize, FormatError> {
    let mut start = 0usize;
    for t in tensors {
        let (s, e) = t.data_offsets;
        if s != start || e < s {
            return Err(FormatError::InvalidOffset { name: t.name.clone(), begin: s, end: e, expected_begin: start });
        }
        start = e;
        let expected = tensor_byte_len(&t.name, t.dtype, &t.shape)?;
        if e - s != expected {
            return Err(FormatError::TensorInvalidInfo {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                expected,
                actual: e - s,
            });
        }
    }
    Ok(start)
}
