//! The safetensors format: parse, validate and serialize the header. No I/O.
//!
//! A safetensors file is `N` (u64, little-endian), then `N` bytes of JSON describing every
//! tensor (`dtype`, `shape`, `data_offsets` relative to the data section) plus an optional
//! `__metadata__` string map, then the tensor bytes.
//!
//! # Design
//!
//! - **Only the header is read to validate a file.** [`Header::parse`] takes the first `8 + N`
//!   bytes and the file's length. Every rule of the reference implementation
//!   (huggingface/safetensors 0.8) is applied in the reference order, so a file is rejected here
//!   exactly when it is rejected there, and for the same reason (the same [`FormatError`]
//!   variant): header length over 100 MB, JSON shape, the 22 dtypes, tensors contiguous from 0
//!   with no hole or overlap, `END - BEGIN = product(shape) x bits / 8` with overflow checks,
//!   sub-byte dtypes ending on a byte, and `8 + N + data length` equal to the file length. The
//!   data itself is never touched, so validating a 100 GB file costs one small read.
//! - **Deterministic writes identical to the reference.** [`plan`] orders tensors by descending
//!   dtype then name, lays them out contiguously, and renders compact JSON padded with spaces to
//!   a multiple of 8; the bytes equal the reference writer's, except that `__metadata__` keys are
//!   sorted (the reference writes them in hash order). The [`Layout`] it returns says where each
//!   tensor's bytes go, so an I/O layer can write tensors in parallel at their offsets.
//! - **No panics on any input.** Parsing uses checked arithmetic and `get`; it is covered by a
//!   property test on random and mutated headers and by a fuzz target (`fuzz/`).
//! - `#![forbid(unsafe_code)]`.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod cast;
mod dtype;
mod error;
mod header;
mod write;

pub use cast::{can_cast, cast, cast_len, castable, CastError};
pub use dtype::{Dtype, UnknownDtype};
pub use error::FormatError;
pub use header::{read_header_len, Header, TensorInfo};
pub use write::{plan, serialize, Layout, LayoutEntry, TensorSpec};

/// The largest header length the format accepts (the reference's `MAX_HEADER_SIZE`).
pub const MAX_HEADER_SIZE: usize = 100_000_000;

/// Bytes of the header length field.
pub const N_LEN: usize = 8;
