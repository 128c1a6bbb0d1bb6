//! veTurboIO's 256 KiB encrypted-file header, and the two on-disk layouts.

use serde_json::Value;

use crate::{CipherError, Iv, Mode};

/// Size of the header block of a "with header" file; the ciphertext starts here.
pub const HEADER_SIZE: u64 = 262_144;

/// The 16 bytes a "with header" file starts with.
pub const MAGIC: &[u8; 16] = b"Byte3ncryptM0del";

/// The two on-disk layouts of an encrypted file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// The whole file is ciphertext; file byte `p` uses keystream position `p`. Nothing marks
    /// such a file: the reader has to be told.
    Headerless,
    /// A [`CipherHeader`] block of [`HEADER_SIZE`] bytes, then the ciphertext; file byte `p`
    /// uses keystream position `p - HEADER_SIZE`.
    WithHeader,
}

impl Layout {
    /// Bytes before the ciphertext: 0 or [`HEADER_SIZE`]. Keystream position = file offset
    /// minus this.
    pub fn header_size(self) -> u64 {
        match self {
            Layout::Headerless => 0,
            Layout::WithHeader => HEADER_SIZE,
        }
    }
}

/// veTurboIO's 256 KiB header: [`MAGIC`], UTF-8 JSON, then zeros up to [`HEADER_SIZE`].
///
/// `meta_data_key` is the KMS `CiphertextBlob` of the base64 data key (opaque here: the `kms`
/// crate decrypts it). `iv` is the plain IV. `file_timestamp` is informational and never read
/// back by veTurboIO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CipherHeader {
    /// The AES-CTR variant (veTurboIO always writes `CTR-128`).
    pub mode: Mode,
    /// The initial counter block.
    pub iv: Iv,
    /// The KMS-encrypted data key, as the KMS returned it.
    pub meta_data_key: String,
    /// Seconds since the epoch when the file was written (veTurboIO's is shifted by the local
    /// UTC offset; nobody reads it).
    pub file_timestamp: i64,
}

impl CipherHeader {
    /// Recognises and parses a header.
    ///
    /// `first` is the start of the file (up to [`HEADER_SIZE`] bytes of it; more are ignored)
    /// and `file_len` the file's length. Returns `Ok(None)` when the file is not a header file:
    /// it is shorter than [`HEADER_SIZE`] or does not start with [`MAGIC`] (veTurboIO's rule).
    /// Returns an error for a file with the magic whose header is malformed: the JSON (from
    /// offset 16 to the first NUL) must be an object with `"mode"` `"CTR-128"` or `"CTR-256"`,
    /// `"iv"` the standard base64 of 16 bytes, `"meta_data_key"` a string and, if present,
    /// `"file_timestamp"` an integer (0 when absent). Other keys are ignored. If `first` is
    /// shorter than the header and holds no NUL after the magic, the header cannot be read
    /// from it, which is an error too.
    pub fn parse(first: &[u8], file_len: u64) -> Result<Option<CipherHeader>, CipherError> {
        if file_len < HEADER_SIZE || !first.starts_with(MAGIC) {
            return Ok(None);
        }
        let block = &first[..first.len().min(HEADER_SIZE as usize)];
        let body = &block[MAGIC.len()..];
        let json = match body.iter().position(|&b| b == 0) {
            Some(end) => &body[..end],
            None if block.len() as u64 == HEADER_SIZE => {
                return Err(bad("the JSON is not NUL-terminated within the 256 KiB header"))
            }
            None => return Err(CipherError::Truncated { len: first.len() as u64, need: HEADER_SIZE }),
        };
        let text = std::str::from_utf8(json)
            .map_err(|e| bad(format!("the JSON is not valid UTF-8 (at byte {} after the magic)", e.valid_up_to())))?;
        let value: Value = serde_json::from_str(text).map_err(|e| bad(format!("the JSON does not parse: {e}")))?;
        let Value::Object(map) = value else {
            return Err(bad(format!("the JSON is {}, not an object", kind_of(&value))));
        };
        let field = |name: &'static str| -> Result<&str, CipherError> {
            match map.get(name) {
                Some(Value::String(s)) => Ok(s),
                Some(other) => Err(bad(format!("\"{name}\" is {}, not a string", kind_of(other)))),
                None => Err(bad(format!("\"{name}\" is missing"))),
            }
        };
        let mode: Mode = field("mode")?.parse().map_err(|e| bad(format!("\"mode\": {e}")))?;
        let iv_text = field("iv")?;
        let iv = crate::key::b64_decode(iv_text, "the header's \"iv\"").map_err(|e| bad(e.to_string()))?;
        let iv = Iv::new(&iv).map_err(|_| bad(format!("\"iv\" decodes to {} bytes, expected 16", iv.len())))?;
        let meta_data_key = field("meta_data_key")?.to_string();
        let file_timestamp = match map.get("file_timestamp") {
            None => 0,
            Some(v) => {
                v.as_i64().ok_or_else(|| bad(format!("\"file_timestamp\" is {}, not a 64-bit integer", kind_of(v))))?
            }
        };
        Ok(Some(CipherHeader { mode, iv, meta_data_key, file_timestamp }))
    }

    /// The header block: exactly [`HEADER_SIZE`] bytes, byte-identical to veTurboIO's
    /// `to_header_bytes()`.
    ///
    /// [`MAGIC`], then the JSON as Python's `json.dumps` writes it by default (separators
    /// `", "` and `": "`, keys in the order `mode`, `iv`, `meta_data_key`, `file_timestamp`,
    /// non-ASCII escaped as `\uXXXX`), then zeros. An error if the JSON does not fit with at
    /// least one NUL after it (the reader needs one).
    pub fn to_bytes(&self) -> Result<Vec<u8>, CipherError> {
        let json = self.to_json();
        if MAGIC.len() + json.len() >= HEADER_SIZE as usize {
            return Err(CipherError::HeaderTooLarge { json_len: json.len() });
        }
        let mut out = vec![0u8; HEADER_SIZE as usize];
        out[..MAGIC.len()].copy_from_slice(MAGIC);
        out[MAGIC.len()..MAGIC.len() + json.len()].copy_from_slice(json.as_bytes());
        Ok(out)
    }

    /// The JSON text alone, as [`to_bytes`](CipherHeader::to_bytes) writes it.
    pub fn to_json(&self) -> String {
        let mut s = String::with_capacity(96 + self.meta_data_key.len());
        s.push_str("{\"mode\": ");
        push_py_json_str(&mut s, self.mode.as_str());
        s.push_str(", \"iv\": ");
        push_py_json_str(&mut s, &self.iv.to_base64());
        s.push_str(", \"meta_data_key\": ");
        push_py_json_str(&mut s, &self.meta_data_key);
        s.push_str(", \"file_timestamp\": ");
        s.push_str(&self.file_timestamp.to_string());
        s.push('}');
        s
    }
}

fn bad(msg: impl Into<String>) -> CipherError {
    CipherError::InvalidHeader(msg.into())
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Appends `text` as a JSON string the way Python's `json.dumps` (with its default
/// `ensure_ascii=True`) does: `"` and `\` escaped, `\n \r \t \b \f` by name, every other
/// character outside `' '..='~'` as `\u00XX` (lowercase hex; UTF-16 surrogate pairs above
/// U+FFFF).
pub(crate) fn push_py_json_str(out: &mut String, text: &str) {
    use std::fmt::Write as _;
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
        }
    }
    out.push('"');
}
