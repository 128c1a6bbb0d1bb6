//! The NPU stub: answers every call with a clear error naming what an NPU build would need.

use crate::{Allocation, Device, DeviceError, DeviceId, DeviceKind, Result, Staging, Transfer};

/// An Ascend NPU, not supported by this build: every call fails with
/// [`DeviceError::Unsupported`] saying so and what would be needed (the CANN runtime and an
/// `npu` device implementation). veTurboIO returns CPU tensors for `npu:N`; turboio refuses
/// instead of silently loading somewhere else.
#[derive(Debug, Clone, Copy)]
pub struct NpuDevice {
    ordinal: u32,
}

impl NpuDevice {
    /// The stub for `npu:ordinal`.
    pub fn new(ordinal: u32) -> Self {
        NpuDevice { ordinal }
    }

    /// The error every call returns.
    pub fn error(&self) -> DeviceError {
        DeviceError::Unsupported {
            device: self.id(),
            what: "Ascend NPUs are not supported in this build of turboio: loading to an NPU needs an `npu` \
                   device implementation over the CANN runtime (libascendcl.so, as torch_npu uses). Load to \
                   \"cpu\" and move the tensors with torch_npu instead"
                .into(),
        }
    }
}

impl Device for NpuDevice {
    fn id(&self) -> DeviceId {
        DeviceId { kind: DeviceKind::Npu, ordinal: self.ordinal }
    }

    fn alloc(&self, _len: usize) -> Result<Box<dyn Allocation>> {
        Err(self.error())
    }

    fn alloc_staging(&self, _len: usize) -> Result<Staging> {
        Err(self.error())
    }

    fn upload(&self, _src: Staging, _len: usize, _dst: &dyn Allocation, _dst_offset: usize) -> Result<Transfer> {
        Err(self.error())
    }

    fn download(&self, _src: &dyn Allocation, _src_offset: usize, _dst: &mut [u8]) -> Result<()> {
        Err(self.error())
    }

    fn synchronize(&self) -> Result<()> {
        Err(self.error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_call_says_not_supported() {
        let npu = NpuDevice::new(0);
        let msg = npu.alloc(1).unwrap_err().to_string();
        assert!(msg.contains("npu:0") && msg.contains("not supported in this build") && msg.contains("CANN"), "{msg}");
        assert!(npu.alloc_staging(1).is_err());
        assert!(npu.synchronize().is_err());
        let cpu = crate::CpuDevice::new().alloc(4).unwrap();
        assert!(npu.download(cpu.as_ref(), 0, &mut [0u8; 4]).is_err());
        assert!(!npu.decrypts_after_upload() && !npu.uploads_from_host());
        let err = crate::open_device(DeviceId::parse("npu:1").unwrap()).unwrap_err().to_string();
        assert!(err.contains("npu:1") && err.contains("not supported"), "{err}");
    }
}
