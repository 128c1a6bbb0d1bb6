//! PyTorch `.pt` / `.bin` checkpoints (`torch.save`, torch >= 1.6) read without executing the
//! pickle: an index of storages (with their absolute byte offsets in the file) and tensor views,
//! so a loader can map or read tensors exactly as it reads safetensors. No I/O of its own.
//!
//! ```no_run
//! use turboio_pt::{PtIndex, PtOptions};
//! let bytes: Vec<u8> = std::fs::read("pytorch_model.bin")?;
//! let index = PtIndex::parse(&bytes, &PtOptions::default())?; // or any ReadAt
//! for t in index.tensors() {
//!     let storage = index.storage_of(t);
//!     let span = index.file_span(t); // the bytes the view touches, absolute in the file
//!     let src = &bytes[span.start as usize..span.end as usize];
//!     let mut out = vec![0u8; t.nbytes() as usize];
//!     t.gather(src, &mut out)?; // contiguous row-major bytes, any strides
//!     println!("{} {} {:?} in storage {}", t.name, t.dtype, t.shape, storage.key);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # The format
//!
//! `torch.save` writes a zip archive with one top-level directory (`archive/`, or a name derived
//! from the file) holding `data.pkl` (the pickled object: a state dict, nested dicts, ...),
//! `byteorder` (`little` or `big`; absent in old files: little), one `data/<key>` record per
//! storage, and `.format_version`, `.storage_alignment`, `version`, `.data/serialization_id`.
//! Every record is STORED (uncompressed) and starts on a 64-byte boundary. In the pickle, each
//! tensor is a call `torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride,
//! requires_grad, backward_hooks[, metadata])` (`_rebuild_tensor_v3(..., dtype)` for the dtypes
//! without a typed storage class: unsigned, float8...), optionally wrapped in
//! `_rebuild_parameter` or `torch._tensor._rebuild_from_type_v2`, and each storage a persistent
//! id `('storage', storage_type, key, location, numel)`.
//!
//! # Design
//!
//! - **Random access through [`ReadAt`].** The parser reads the zip directory, the local
//!   headers and the small records through a callback, so the caller chooses plain `pread`s, a
//!   mapping, or a decrypting reader. Tensor data is never read here.
//! - **The zip container by the `zip` crate** (stored entries only; its `data_start` gives each
//!   record's absolute offset), plus the checks a mapping reader relies on: every record stored,
//!   unencrypted, inside the file, no two entries overlapping, one top-level directory.
//! - **An allow-listed pickle VM written here** (`pickle.rs`), because no crate fits:
//!   `serde-pickle` cannot do persistent ids and maps unknown globals to `None`; `pytorch-reader`
//!   (burn) does not expose storage offsets; candle's is inside candle. The VM builds only
//!   dicts, OrderedDicts, lists, tuples, scalars, strings, storages and tensors; any other global,
//!   any call that is not one of torch's rebuild functions, any BUILD of a non-dict, and every
//!   opcode containers do not need are errors naming the opcode (and its byte position) or the
//!   global (`module.name`). Nothing is ever executed. Size, depth, memo, stack and item counts
//!   are capped ([`Limits`]).
//! - **Names.** Nested dicts, lists and tuples flatten to dotted names (`model.layer.0.weight`,
//!   `optimizer.state.0.exp_avg`), as veTurboIO's converter does, or [`PtOptions::top_level_key`]
//!   picks one entry (`"model"`, `"state_dict"`) and names relative to it. Non-tensor leaves
//!   (ints, floats, strings, None...) are skipped and listed in [`PtIndex::skipped`].
//! - **Views, not copies.** Each tensor is a view (storage index, offset, shape, strides) of a
//!   storage; tied weights and views share one storage index and so the same bytes. Every view
//!   is checked against its storage at parse time; [`PtTensor::gather`] makes the row-major bytes
//!   of a strided view.
//! - **Dtypes.** Every dtype torch saves that safetensors has maps to [`turboio_format::Dtype`]
//!   (including BF16, the float8 types, U16/U32/U64, BOOL and C64); the others (complex128,
//!   complex32, quantized, bits, float4) are an "unsupported dtype" error naming the tensor.
//! - **Byte order.** Big-endian files (`byteorder` = `big`) are refused unless
//!   [`PtOptions::allow_big_endian`] is set; then [`to_little_endian`] swaps a tensor's bytes.
//!   Swapping is the caller's job because it cannot be done on a shared mapping.
//! - **The legacy format** (pre-1.6: a bare pickle stream with torch's magic number, or the older
//!   tar) is a clear error saying how to re-save the file. So is a TorchScript archive.
//! - `#![forbid(unsafe_code)]`; checked arithmetic and `get` on everything read from the file;
//!   property tests with random mutations and a fuzz target (`fuzz/`) check it never panics.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod archive;
pub mod bits;
mod error;
mod index;
mod pickle;

pub use error::PtError;
pub use index::{ByteOrder, Limits, PtIndex, PtOptions, PtStorage, PtTensor, Skipped};
pub use turboio_format::Dtype;

/// Random-access reads of a file's bytes: what the parser needs from the caller.
pub trait ReadAt {
    /// Fills `dst` with the bytes at `offset`; an error if they are not all there.
    fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> std::io::Result<()>;
    /// The file's length in bytes.
    fn len(&self) -> u64;
    /// Whether the file is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl ReadAt for [u8] {
    fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> std::io::Result<()> {
        let src = usize::try_from(offset)
            .ok()
            .and_then(|o| Some(o..o.checked_add(dst.len())?))
            .and_then(|r| self.get(r))
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "read past the end of the file"))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn len(&self) -> u64 {
        <[u8]>::len(self) as u64
    }
}

impl ReadAt for Vec<u8> {
    fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> std::io::Result<()> {
        self.as_slice().read_exact_at(offset, dst)
    }

    fn len(&self) -> u64 {
        self.as_slice().len() as u64
    }
}

/// Converts the elements of a big-endian file's tensor (or storage) bytes to little-endian in
/// place: each element's bytes are reversed (each half separately for C64). A no-op for 1-byte
/// dtypes. `bytes` must be a whole number of elements.
pub fn to_little_endian(dtype: Dtype, bytes: &mut [u8]) -> Result<(), PtError> {
    let size = match dtype {
        Dtype::C64 => 4, // two f32
        d => d.byte_size().unwrap_or(1),
    };
    if !bytes.len().is_multiple_of(size) {
        return Err(PtError::ByteSwap { len: bytes.len(), dtype });
    }
    if size > 1 {
        bytes.chunks_exact_mut(size).for_each(<[u8]>::reverse);
    }
    Ok(())
}
