//! Writing a header: byte-identical to the reference writer.

use crate::header::{tensor_byte_len, validate, TensorInfo};
use crate::{Dtype, FormatError, MAX_HEADER_SIZE, N_LEN};
use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;

/// A tensor to be written: what the header needs to know about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorSpec<'a> {
    /// Name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: &'a [usize],
    /// Bytes of data the caller will provide; must equal product(shape) x bits / 8.
    pub data_len: usize,
}

impl<'a> TensorSpec<'a> {
    /// A spec whose `data_len` is computed from the dtype and shape.
    pub fn new(name: &'a str, dtype: Dtype, shape: &'a [usize]) -> Result<Self, FormatError> {
        let data_len = tensor_byte_len(name, dtype, shape)?;
        Ok(TensorSpec { name, dtype, shape, data_len })
    }
}

/// Where everything goes in a file about to be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The first `8 + N` bytes of the file: the length, the JSON and its space padding.
    pub header: Vec<u8>,
    /// The tensors in the order their bytes follow the header, with their offsets in the data
    /// section. `input_index` of each is its position in the caller's slice.
    pub entries: Vec<LayoutEntry>,
    /// Bytes of tensor data.
    pub data_len: u64,
}

/// One tensor of a [`Layout`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutEntry {
    /// Position in the slice given to [`plan`].
    pub input_index: usize,
    /// The tensor as written in the header.
    pub info: TensorInfo,
}

impl Layout {
    /// The file's total length.
    pub fn file_len(&self) -> u64 {
        self.header.len() as u64 + self.data_len
    }

    /// Absolute file offset of an entry's first byte.
    pub fn file_offset(&self, entry: &LayoutEntry) -> u64 {
        self.header.len() as u64 + entry.info.data_offsets.0 as u64
    }
}

/// Plans a file: orders the tensors as the reference writer does (descending dtype, then name),
/// assigns contiguous offsets, validates, and renders the header.
///
/// The output is byte-identical to the reference's `serialize` for the same tensors, except
/// that `__metadata__` keys are written sorted (the reference writes them in hash order, so its
/// own output varies from run to run when there is more than one key), and that no tensor with
/// `Some` empty metadata gives `{"__metadata__":{}}` where the reference writes the invalid
/// `{},"__metadata__":{}}`.
pub fn plan(tensors: &[TensorSpec<'_>], metadata: Option<&BTreeMap<String, String>>) -> Result<Layout, FormatError> {
    let mut seen = HashSet::with_capacity(tensors.len());
    for t in tensors {
        if t.name == "__metadata__" {
            return Err(FormatError::ReservedName);
        }
        if !seen.insert(t.name) {
            return Err(FormatError::DuplicateTensorName(t.name.to_owned()));
        }
    }
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let (l, r) = (&tensors[a], &tensors[b]);
        r.dtype.cmp(&l.dtype).then_with(|| l.name.cmp(r.name))
    });
    let mut offset = 0usize;
    let mut entries = Vec::with_capacity(tensors.len());
    for i in order {
        let t = &tensors[i];
        let end = offset.checked_add(t.data_len).ok_or_else(|| FormatError::ValidationOverflow {
            name: t.name.to_owned(),
            dtype: t.dtype,
            shape: t.shape.to_vec(),
        })?;
        entries.push(LayoutEntry {
            input_index: i,
            info: TensorInfo {
                name: t.name.to_owned(),
                dtype: t.dtype,
                shape: t.shape.to_vec(),
                data_offsets: (offset, end),
            },
        });
        offset = end;
    }
    let infos: Vec<TensorInfo> = entries.iter().map(|e| e.info.clone()).collect();
    let data_len = validate(&infos)?;
    let header = render_header(&infos, metadata)?;
    // The file length must fit in 64 bits, or `Layout::file_len` would overflow: eight
    // specs of 2^61 - 1 bytes each are individually valid but not together with a header.
    if let Some(last) = infos.last() {
        if (header.len() as u64).checked_add(data_len as u64).is_none() {
            return Err(FormatError::ValidationOverflow {
                name: last.name.clone(),
                dtype: last.dtype,
                shape: last.shape.clone(),
            });
        }
    }
    Ok(Layout { header, entries, data_len: data_len as u64 })
}

/// Serializes complete tensors, each with its bytes, into one in-memory file.
pub fn serialize(
    tensors: &[(TensorSpec<'_>, &[u8])],
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<Vec<u8>, FormatError> {
    for (t, d) in tensors {
        if t.data_len != d.len() {
            return Err(FormatError::TensorInvalidInfo {
                name: t.name.to_owned(),
                dtype: t.dtype,
                shape: t.shape.to_vec(),
                expected: t.data_len,
                actual: d.len(),
            });
        }
    }
    let specs: Vec<TensorSpec<'_>> = tensors.iter().map(|(t, _)| *t).collect();
    let layout = plan(&specs, metadata)?;
    let mut out = Vec::with_capacity(layout.file_len() as usize);
    out.extend_from_slice(&layout.header);
    for e in &layout.entries {
        out.extend_from_slice(tensors[e.input_index].1);
    }
    Ok(out)
}

fn json_string(out: &mut String, s: &str) {
    // serde_json's escaping is the reference's; a str never fails to serialize.
    out.push_str(&serde_json::to_string(s).unwrap_or_default());
}

fn render_header(tensors: &[TensorInfo], metadata: Option<&BTreeMap<String, String>>) -> Result<Vec<u8>, FormatError> {
    let mut json = String::with_capacity(64 + tensors.len() * 96);
    json.push('{');
    let mut first = true;
    if let Some(meta) = metadata {
        json.push_str("\"__metadata__\":{");
        for (i, (k, v)) in meta.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            json_string(&mut json, k);
            json.push(':');
            json_string(&mut json, v);
        }
        json.push('}');
        first = false;
    }
    for t in tensors {
        if !first {
            json.push(',');
        }
        first = false;
        json_string(&mut json, &t.name);
        let _ = write!(json, ":{{\"dtype\":\"{}\",\"shape\":[", t.dtype.name());
        for (i, d) in t.shape.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            let _ = write!(json, "{d}");
        }
        let _ = write!(json, "],\"data_offsets\":[{},{}]}}", t.data_offsets.0, t.data_offsets.1);
    }
    json.push('}');
    let padded = json.len().next_multiple_of(8);
    if padded > MAX_HEADER_SIZE {
        return Err(FormatError::HeaderTooLarge { len: padded as u64 });
    }
    let mut header = Vec::with_capacity(N_LEN + padded);
    header.extend_from_slice(&(padded as u64).to_le_bytes());
    header.extend_from_slice(json.as_bytes());
    header.resize(N_LEN + padded, b' ');
    Ok(header)
}
