use crate::DeviceId;

/// The error of device operations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The device could not provide the memory.
    #[error("{device}: cannot allocate {len} bytes: {source}")]
    OutOfMemory {
        /// Device.
        device: DeviceId,
        /// Bytes asked for.
        len: usize,
        /// The OS or driver error.
        #[source]
        source: std::io::Error,
    },
    /// A copy outside an allocation.
    #[error("{device}: range {offset}+{len} is outside an allocation of {alloc_len} bytes")]
    OutOfBounds {
        /// Device.
        device: DeviceId,
        /// Start.
        offset: usize,
        /// Length.
        len: usize,
        /// Allocation size.
        alloc_len: usize,
    },
    /// An allocation from another device was passed in.
    #[error("{device}: the allocation belongs to {other}")]
    ForeignAllocation {
        /// This device.
        device: DeviceId,
        /// The allocation's device.
        other: DeviceId,
    },
    /// The device (or its driver library) is not available on this machine.
    #[error("{device} is not available: {reason}")]
    Unavailable {
        /// Device.
        device: String,
        /// Why.
        reason: String,
    },
    /// Mapping or populating a file failed.
    #[error("mapping failed: {op}: {source}")]
    Map {
        /// The call that failed.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A driver call failed.
    #[error("{device}: {message}")]
    Driver {
        /// Device.
        device: DeviceId,
        /// What failed.
        message: String,
    },
    /// The device cannot do this (an optional capability it lacks).
    #[error("{device}: not supported: {what}")]
    Unsupported {
        /// Device.
        device: DeviceId,
        /// What was asked.
        what: String,
    },
    /// The device's support was left out of this build.
    #[error("{device}: support for this device is not compiled in (enable the `{feature}` feature of turboio)")]
    NotCompiledIn {
        /// The device asked for.
        device: String,
        /// The Cargo feature that enables it.
        feature: &'static str,
    },
}
