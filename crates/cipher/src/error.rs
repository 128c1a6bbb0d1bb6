//! The crate's one error type.

use crate::Mode;

/// Everything that can go wrong in this crate.
///
/// No message ever contains key bytes: key errors report only lengths and modes.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum CipherError {
    /// A key that is neither 16 (AES-128) nor 32 (AES-256) bytes long.
    #[error("invalid AES key length: {len} bytes (expected 16 for AES-128 or 32 for AES-256)")]
    InvalidKeyLength {
        /// The length that was given.
        len: usize,
    },
    /// An IV that is not 16 bytes long.
    #[error("invalid AES-CTR IV length: {len} bytes (expected 16)")]
    InvalidIvLength {
        /// The length that was given.
        len: usize,
    },
    /// A mode string other than `CTR-128` / `CTR-256`.
    #[error("unknown cipher mode {0:?} (expected \"CTR-128\" or \"CTR-256\")")]
    UnknownMode(String),
    /// A key whose length does not match the mode it is used with.
    #[error("key/mode mismatch: a {key_bits}-bit key cannot be used with mode {}", mode.as_str())]
    KeyModeMismatch {
        /// The key's length in bits.
        key_bits: usize,
        /// The mode that was asked for.
        mode: Mode,
    },
    /// Base64 text that does not decode (the text itself is not repeated: it may be a key).
    #[error("invalid base64 in {what}: {reason}")]
    InvalidBase64 {
        /// What was being decoded (e.g. "the header's iv").
        what: &'static str,
        /// Why it did not decode.
        reason: String,
    },
    /// A file that starts with the encrypted-file magic but whose header is malformed.
    #[error("invalid encrypted-file header: {0}")]
    InvalidHeader(String),
    /// A header whose JSON does not fit in the 256 KiB header block.
    #[error(
        "encrypted-file header too large: {json_len} bytes of JSON do not fit in the \
         {} byte header (at most {} after the 16-byte magic, with room for a NUL terminator)",
        crate::HEADER_SIZE,
        crate::HEADER_SIZE - 17
    )]
    HeaderTooLarge {
        /// Bytes of JSON the header would need.
        json_len: usize,
    },
    /// A header that names a different IV or mode than the cipher used to encrypt.
    #[error("header does not match the cipher: {0}")]
    HeaderMismatch(&'static str),
    /// Input shorter than its layout requires (e.g. a header file shorter than its header).
    #[error("truncated input: {len} bytes, but the layout needs at least {need}")]
    Truncated {
        /// Bytes given.
        len: u64,
        /// Bytes needed.
        need: u64,
    },
    /// The operating system's random number generator failed.
    #[error("OS random number generator failed: {0}")]
    Random(String),
}
