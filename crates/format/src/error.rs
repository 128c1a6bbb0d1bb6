//! The typed error of the format crate.

use crate::Dtype;

/// Why a safetensors header was rejected, or could not be written.
///
/// The variants and the conditions that raise them are those of the reference implementation
/// (`SafeTensorError` in huggingface/safetensors), so a file is accepted or rejected for the same
/// reason there and here. The messages add what the reference leaves out: the tensor's name, the
/// numbers that disagree. The crate does no I/O and so never knows the file's path; callers
/// prefix it (the orchestrator does).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// Fewer than 8 bytes: there is no header length.
    #[error("header too small: the file has {len} bytes, fewer than the 8-byte header length")]
    HeaderTooSmall {
        /// Bytes available.
        len: u64,
    },
    /// The header length is larger than [`MAX_HEADER_SIZE`](crate::MAX_HEADER_SIZE).
    #[error("header too large: the header length field says {len} bytes, more than the limit of 100000000")]
    HeaderTooLarge {
        /// The length the file claims (or the padded length being written).
        len: u64,
    },
    /// `8 + N` runs past the end of the file.
    #[error("invalid header length: the header claims {header_len} bytes but the file has only {available} bytes after the 8-byte length")]
    InvalidHeaderLength {
        /// N, as read from the first 8 bytes.
        header_len: u64,
        /// Bytes present after the length field.
        available: u64,
    },
    /// The header bytes are not UTF-8.
    #[error("invalid UTF-8 in header: {0}")]
    InvalidHeader(#[source] std::str::Utf8Error),
    /// The header is not JSON of the expected shape (also: unknown dtype, missing field, bad shape entry,
    /// duplicate `__metadata__`, non-string metadata value).
    #[error("invalid JSON in header: {0}")]
    InvalidHeaderDeserialization(#[source] serde_json::Error),
    /// A tensor's offsets leave a hole, overlap the previous tensor, do not start at 0, or end before they begin.
    #[error("invalid offset for tensor `{name}`: data_offsets [{begin}, {end}] but the previous tensor ends at {expected_begin} (tensors must be contiguous from 0, without holes or overlaps)")]
    InvalidOffset {
        /// The offending tensor.
        name: String,
        /// Its BEGIN.
        begin: usize,
        /// Its END.
        end: usize,
        /// Where it should begin.
        expected_begin: usize,
    },
    /// product(shape) or its size in bits overflows.
    #[error("overflow computing the size of tensor `{name}` from shape {shape:?} and dtype {dtype}")]
    ValidationOverflow {
        /// The offending tensor.
        name: String,
        /// Its dtype.
        dtype: Dtype,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A sub-byte dtype whose element count does not fill whole bytes.
    #[error("tensor `{name}` of dtype {dtype} and shape {shape:?} does not end on a byte boundary")]
    MisalignedSlice {
        /// The offending tensor.
        name: String,
        /// Its dtype.
        dtype: Dtype,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// `END - BEGIN` differs from product(shape) x bits / 8.
    #[error("invalid shape, data type, or offset for tensor `{name}`: dtype {dtype} and shape {shape:?} need {expected} bytes but data_offsets give {actual}")]
    TensorInvalidInfo {
        /// The offending tensor.
        name: String,
        /// Its dtype.
        dtype: Dtype,
        /// Its shape.
        shape: Vec<usize>,
        /// Bytes the dtype and shape need.
        expected: usize,
        /// Bytes the offsets (or the data given to the writer) hold.
        actual: usize,
    },
    /// `8 + N + data length` differs from the file length: trailing bytes, or a truncated file.
    #[error("incomplete metadata, file not fully covered: the header describes {expected} bytes ({header_end} of header and {data_len} of tensor data) but the file has {actual}")]
    MetadataIncompleteBuffer {
        /// 8 + N + last END (saturated at `u64::MAX` if the sum overflows).
        expected: u64,
        /// 8 + N.
        header_end: u64,
        /// last END.
        data_len: u64,
        /// The file's length.
        actual: u64,
    },
    /// The writer was given the same name twice (the reference implementation panics here).
    #[error("tensor name `{0}` given twice")]
    DuplicateTensorName(String),
    /// The writer was given a tensor named `__metadata__`, which the format reserves.
    #[error("`__metadata__` is reserved for the metadata map and cannot name a tensor")]
    ReservedName,
    /// No tensor of that name in the header.
    #[error("tensor `{0}` not found")]
    TensorNotFound(String),
}
