//! The crate's one error type.

/// Why a `.pt` file was refused, or a view could not be gathered.
///
/// Messages name what is wrong (the opcode and its byte position, the global `module.name`, the
/// tensor, the limit) but not the file: the caller knows its name and prefixes it, as the
/// safetensors path does with `turboio_format::FormatError`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PtError {
    /// Reading the source failed.
    #[error("read error: {0}")]
    Io(#[from] std::io::Error),
    /// A pre-1.6 `torch.save` file (a bare pickle stream, or the older tar layout).
    #[error(
        "legacy (pre-1.6) torch format; re-save it with torch>=1.6: \
         torch.save(torch.load(f, weights_only=True), f2)"
    )]
    Legacy,
    /// A TorchScript archive (`torch.jit.save`), not a `torch.save` checkpoint.
    #[error(
        "a TorchScript archive (torch.jit.save: it has {0}), not a torch.save checkpoint; \
         save the state dict instead: torch.save(torch.jit.load(f).state_dict(), f2)"
    )]
    TorchScript(String),
    /// Not a zip archive at all.
    #[error("not a torch.save checkpoint (a zip archive with data.pkl): {0}")]
    NotZip(String),
    /// A zip archive, but not laid out the way torch writes one (or damaged).
    #[error("invalid torch checkpoint archive: {0}")]
    Archive(String),
    /// The `byteorder` record says `big` and `PtOptions::allow_big_endian` is off.
    #[error(
        "big-endian checkpoint (its byteorder record says \"big\"): not read by default; \
         re-save it on a little-endian machine, or set PtOptions::allow_big_endian and byte-swap \
         each tensor with turboio_pt::to_little_endian"
    )]
    BigEndian,
    /// The pickle asks for something the allow-list does not have: an opcode, a global, a call,
    /// a BUILD. Nothing was executed.
    #[error("pickle byte {pos}: {what} is not allowed (only what torch.save writes for tensors and containers is; nothing was executed)")]
    Forbidden {
        /// Byte position of the opcode in `data.pkl`.
        pos: u64,
        /// What was asked for, e.g. `global posix.system` or `opcode INST (0x69)`.
        what: String,
    },
    /// The pickle is malformed (truncated, wrong operand types, stack underflow...).
    #[error("pickle byte {pos}: {msg}")]
    Pickle {
        /// Byte position of the opcode in `data.pkl`.
        pos: u64,
        /// What is wrong.
        msg: String,
    },
    /// A size or depth limit of `PtOptions::limits` was exceeded.
    #[error("{what} exceeds the limit of {limit} (PtOptions::limits.{field})")]
    Limit {
        /// What grew too large.
        what: String,
        /// The limit in force.
        limit: u64,
        /// The `Limits` field that sets it.
        field: &'static str,
    },
    /// A tensor cannot be described: unsupported dtype, missing or short storage, bad view.
    #[error("tensor `{name}`: {msg}")]
    Tensor {
        /// The tensor's dotted name.
        name: String,
        /// What is wrong.
        msg: String,
    },
    /// `PtOptions::top_level_key` names a key the checkpoint does not have.
    #[error("top-level key `{key}` not found; the checkpoint has {found}")]
    TopLevelKey {
        /// The key asked for.
        key: String,
        /// What the top level has instead.
        found: String,
    },
    /// `to_little_endian` was given a partial element.
    #[error("byte swap: {len} bytes are not a whole number of {dtype} elements")]
    ByteSwap {
        /// Bytes given.
        len: usize,
        /// Their dtype.
        dtype: turboio_format::Dtype,
    },
    /// `PtTensor::gather` was given buffers of the wrong size.
    #[error("gather of `{name}`: {msg}")]
    Gather {
        /// The tensor's name.
        name: String,
        /// What is wrong.
        msg: String,
    },
}
