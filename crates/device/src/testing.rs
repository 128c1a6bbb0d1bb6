//! A device whose memory the CPU cannot address: the proof that the [`Device`] contract is not
//! CPU-shaped.
//!
//! [`OpaqueDevice`] keeps each allocation in memory owned by a copy-engine thread. An
//! allocation's [`host`](Allocation::host) is `None`, so loads must stage through host buffers;
//! [`upload`](Device::upload) queues the copy and returns at once, like a CUDA stream, and the
//! copy completes later on the engine thread. Tests read results back with
//! [`download`](Device::download). Counters record what crossed the boundary, and a byte budget
//! makes copies fail on demand to test error paths.

use crate::cpu::Arena;
use crate::{
    check_range, Allocation, Device, DeviceError, DeviceId, DeviceKind, PendingTransfer, Result, Staging, Transfer,
};
use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

type Memory = Arc<Mutex<HashMap<u64, Vec<u8>>>>;

enum Job {
    Copy { handle: u64, offset: usize, src: Staging, len: usize, done: mpsc::Sender<Result<Staging>> },
    Fence(mpsc::Sender<()>),
}

/// The test device. See the module docs.
pub struct OpaqueDevice {
    ordinal: u32,
    memory: Memory,
    next_handle: AtomicU64,
    engine: Mutex<mpsc::Sender<Job>>,
    uploads: Arc<AtomicUsize>,
    uploaded_bytes: Arc<AtomicU64>,
    fail_after: Arc<AtomicU64>,
}

impl fmt::Debug for OpaqueDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpaqueDevice").field("ordinal", &self.ordinal).finish_non_exhaustive()
    }
}

impl OpaqueDevice {
    /// A test device with ordinal `ordinal`.
    pub fn new(ordinal: u32) -> Self {
        let memory: Memory = Arc::default();
        let (tx, rx) = mpsc::channel::<Job>();
        let uploads = Arc::new(AtomicUsize::new(0));
        let uploaded_bytes = Arc::new(AtomicU64::new(0));
        let fail_after = Arc::new(AtomicU64::new(u64::MAX));
        {
            let memory = memory.clone();
            let uploads = uploads.clone();
            let uploaded_bytes = uploaded_bytes.clone();
            let fail_after = fail_after.clone();
            let id = DeviceId { kind: DeviceKind::Test, ordinal };
            std::thread::spawn(move || {
                for job in rx {
                    match job {
                        Job::Copy { handle, offset, src, len, done } => {
                            let result = (|| {
                                let before = uploaded_bytes.fetch_add(len as u64, Ordering::SeqCst);
                                if before + len as u64 > fail_after.load(Ordering::SeqCst) {
                                    return Err(DeviceError::Driver {
                                        device: id,
                                        message: "injected copy failure".into(),
                                    });
                                }
                                let mut mem = memory.lock().unwrap_or_else(|p| p.into_inner());
                                let buf = mem.get_mut(&handle).ok_or(DeviceError::Driver {
                                    device: id,
                                    message: "allocation freed during a copy".into(),
                                })?;
                                check_range(id, buf.len(), offset, len)?;
                                let bytes = src.as_slice().get(..len).ok_or(DeviceError::OutOfBounds {
                                    device: id,
                                    offset: 0,
                                    len,
                                    alloc_len: src.as_slice().len(),
                                })?;
                                buf[offset..offset + len].copy_from_slice(bytes);
                                uploads.fetch_add(1, Ordering::SeqCst);
                                Ok(())
                            })();
                            let _ = done.send(result.map(|()| src));
                        }
                        Job::Fence(done) => {
                            let _ = done.send(());
                        }
                    }
                }
            });
        }
        OpaqueDevice {
            ordinal,
            memory,
            next_handle: AtomicU64::new(1),
            engine: Mutex::new(tx),
            uploads,
            uploaded_bytes,
            fail_after,
        }
    }

    /// Copies completed so far.
    pub fn uploads(&self) -> usize {
        self.uploads.load(Ordering::SeqCst)
    }

    /// Bytes handed to uploads so far (including failed ones).
    pub fn uploaded_bytes(&self) -> u64 {
        self.uploaded_bytes.load(Ordering::SeqCst)
    }

    /// Makes every copy fail once more than `bytes` bytes have been uploaded in total.
    pub fn fail_after_bytes(&self, bytes: u64) {
        self.fail_after.store(bytes, Ordering::SeqCst);
    }

    /// Allocations alive now.
    pub fn live_allocations(&self) -> usize {
        self.memory.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    fn send(&self, job: Job) -> Result<()> {
        self.engine
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job)
            .map_err(|_| DeviceError::Driver { device: self.id(), message: "copy engine stopped".into() })
    }
}

/// An allocation on the [`OpaqueDevice`]; its bytes are not addressable.
pub struct OpaqueAllocation {
    device: DeviceId,
    handle: u64,
    len: usize,
    memory: Memory,
}

impl fmt::Debug for OpaqueAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpaqueAllocation").field("handle", &self.handle).field("len", &self.len).finish()
    }
}

impl Drop for OpaqueAllocation {
    fn drop(&mut self) {
        self.memory.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.handle);
    }
}

impl Allocation for OpaqueAllocation {
    fn len(&self) -> usize {
        self.len
    }

    fn device(&self) -> DeviceId {
        self.device
    }

    fn host(&self) -> Option<&[u8]> {
        None
    }

    fn host_mut(&mut self) -> Option<&mut [u8]> {
        None
    }

    fn address(&self) -> u64 {
        self.handle << 32
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct Pending(mpsc::Receiver<Result<Staging>>, DeviceId);

impl PendingTransfer for Pending {
    fn wait(self: Box<Self>) -> Result<Staging> {
        self.0
            .recv()
            .unwrap_or_else(|_| Err(DeviceError::Driver { device: self.1, message: "copy engine stopped".into() }))
    }
}

impl OpaqueDevice {
    fn own<'a>(&self, a: &'a dyn Allocation) -> Result<&'a OpaqueAllocation> {
        a.as_any()
            .downcast_ref::<OpaqueAllocation>()
            .filter(|o| o.device == self.id())
            .ok_or(DeviceError::ForeignAllocation { device: self.id(), other: a.device() })
    }
}

impl Device for OpaqueDevice {
    fn id(&self) -> DeviceId {
        DeviceId { kind: DeviceKind::Test, ordinal: self.ordinal }
    }

    fn alloc(&self, len: usize) -> Result<Box<dyn Allocation>> {
        let handle = self.next_handle.fetch_add(1, Ordering::SeqCst);
        self.memory.lock().unwrap_or_else(|p| p.into_inner()).insert(handle, vec![0xEE; len]);
        Ok(Box::new(OpaqueAllocation { device: self.id(), handle, len, memory: self.memory.clone() }))
    }

    fn alloc_staging(&self, len: usize) -> Result<Staging> {
        Ok(Box::new(Arena::new(len, false)?))
    }

    fn upload(&self, src: Staging, len: usize, dst: &dyn Allocation, dst_offset: usize) -> Result<Transfer> {
        let dst = self.own(dst)?;
        check_range(self.id(), dst.len, dst_offset, len)?;
        let (tx, rx) = mpsc::channel();
        self.send(Job::Copy { handle: dst.handle, offset: dst_offset, src, len, done: tx })?;
        Ok(Transfer::Pending(Box::new(Pending(rx, self.id()))))
    }

    fn download(&self, src: &dyn Allocation, src_offset: usize, dst: &mut [u8]) -> Result<()> {
        self.synchronize()?;
        let src = self.own(src)?;
        check_range(self.id(), src.len, src_offset, dst.len())?;
        let mem = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        let buf = mem
            .get(&src.handle)
            .ok_or(DeviceError::Driver { device: self.id(), message: "allocation freed".into() })?;
        dst.copy_from_slice(&buf[src_offset..src_offset + dst.len()]);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        self.send(Job::Fence(tx))?;
        rx.recv().map_err(|_| DeviceError::Driver { device: self.id(), message: "copy engine stopped".into() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_reachable_only_through_copies() {
        let dev = OpaqueDevice::new(3);
        let mut a = dev.alloc(100).unwrap();
        assert!(a.host().is_none() && a.host_mut().is_none());
        let mut s = dev.alloc_staging(10).unwrap();
        s.as_mut_slice().copy_from_slice(b"0123456789");
        let s = dev.upload(s, 10, a.as_ref(), 90).unwrap().wait().unwrap();
        assert_eq!(s.as_slice(), b"0123456789");
        let mut back = [0u8; 12];
        dev.download(a.as_ref(), 88, &mut back).unwrap();
        assert_eq!(&back, b"\xEE\xEE0123456789");
        assert!(dev.upload(s, 10, a.as_ref(), 91).is_err(), "out of bounds");
        assert_eq!(dev.live_allocations(), 1);
        drop(a);
        assert_eq!(dev.live_allocations(), 0);
        let cpu = crate::CpuDevice::new().alloc(10).unwrap();
        let s = dev.alloc_staging(10).unwrap();
        assert!(matches!(dev.upload(s, 10, cpu.as_ref(), 0), Err(DeviceError::ForeignAllocation { .. })));
    }

    #[test]
    fn injected_failures_surface_on_wait() {
        let dev = OpaqueDevice::new(0);
        let a = dev.alloc(64).unwrap();
        dev.fail_after_bytes(40);
        let s = dev.alloc_staging(32).unwrap();
        let s = dev.upload(s, 32, a.as_ref(), 0).unwrap().wait().unwrap();
        let err = dev.upload(s, 32, a.as_ref(), 32).unwrap().wait().unwrap_err();
        assert!(err.to_string().contains("injected"), "{err}");
    }
}
