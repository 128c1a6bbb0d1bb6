//! Devices for tests: one whose memory the CPU cannot address (the proof that the [`Device`]
//! contract is not CPU-shaped), and a performance model of a GPU ([`ModelDevice`]) that measures
//! the staged pipeline on machines without one.
//!
//! [`OpaqueDevice`] keeps each allocation in memory owned by a copy-engine thread. An
//! allocation's [`host`](Allocation::host) is `None`, so loads must stage through host buffers;
//! [`upload`](Device::upload) queues the copy and returns at once, like a CUDA stream, and the
//! copy completes later on the engine thread. Tests read results back with
//! [`download`](Device::download). Counters record what crossed the boundary, and a byte budget
//! makes copies fail on demand to test error paths.
//!
//! Optional abilities mirror the CUDA device's, each switched on by a builder so tests can run a
//! load with and without it:
//!
//! - [`with_decryption`](OpaqueDevice::with_decryption): decrypts after upload. The engine
//!   thread XORs the AES-CTR keystream (`turboio-cipher`, standing in for the GPU kernel) into
//!   the uploaded bytes, so an encrypted load must hand it ciphertext: if the CPU had decrypted
//!   too, the result would be garbage.
//! - [`with_host_uploads`](OpaqueDevice::with_host_uploads): copies straight from host memory
//!   (the registered page-cache mapping of the CUDA device).
//! - [`with_staging_pool`](OpaqueDevice::with_staging_pool): staging buffers come from a pool.
//! - [`with_key_failure`](OpaqueDevice::with_key_failure): [`prepare_key`](Device::prepare_key)
//!   fails, as the CUDA device's does without NVRTC.
//! - [`with_cast_failure`](OpaqueDevice::with_cast_failure): [`cast`](Device::cast) fails, as
//!   the CUDA device's does without NVRTC.

mod model;

pub use model::{GpuModel, ModelAllocation, ModelCounters, ModelDevice};

use crate::cpu::Arena;
use crate::{
    check_range, AfterUpload, Allocation, CastJob, Device, DeviceError, DeviceId, DeviceKey, DeviceKind,
    PendingTransfer, Result, Staging, StagingPool, Transfer,
};
use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use turboio_cipher::{CtrCipher, Iv, Key};

type Memory = Arc<Mutex<HashMap<u64, Vec<u8>>>>;

/// A key on the test device; the cipher (and its key schedule, zeroized by `aes`) is dropped
/// with the last job that uses it.
struct KeyInner {
    cipher: CtrCipher,
    live: Arc<AtomicUsize>,
}

impl Drop for KeyInner {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A key prepared on the [`OpaqueDevice`].
pub struct OpaqueKey {
    device: DeviceId,
    inner: Arc<KeyInner>,
}

impl fmt::Debug for OpaqueKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpaqueKey").field("device", &self.device).finish_non_exhaustive()
    }
}

impl DeviceKey for OpaqueKey {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

enum Job {
    Copy {
        handle: u64,
        offset: usize,
        src: Staging,
        len: usize,
        keystream: Option<(Arc<KeyInner>, u64)>,
        done: mpsc::Sender<Result<Staging>>,
    },
    Fence(mpsc::Sender<()>),
}

#[derive(Default)]
struct Counters {
    uploads: AtomicUsize,
    uploaded_bytes: AtomicU64,
    decrypted_bytes: AtomicU64,
    host_uploaded_bytes: AtomicU64,
    cast_elements: AtomicU64,
    live_keys: Arc<AtomicUsize>,
    keys_prepared: AtomicUsize,
}

/// The test device. See the module docs.
pub struct OpaqueDevice {
    ordinal: u32,
    memory: Memory,
    next_handle: AtomicU64,
    engine: Mutex<mpsc::Sender<Job>>,
    counters: Arc<Counters>,
    fail_after: Arc<AtomicU64>,
    decrypts: bool,
    host_uploads: bool,
    /// Whether automatic loads should take the host-upload path (see
    /// [`Device::prefers_host_uploads`]).
    prefers_host_uploads: bool,
    key_failure: Option<String>,
    cast_failure: Option<String>,
    pool: Option<StagingPool>,
    host_upload_refused: AtomicBool,
    /// Why [`Device::uploads_from_page_cache`] says no, when it does (as CUDA's does).
    page_cache_refusal: Option<String>,
    /// Bytes of memory the device has (`None`: unlimited, and [`Device::free_memory`] says
    /// nothing).
    capacity: Option<u64>,
}

impl fmt::Debug for OpaqueDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpaqueDevice").field("ordinal", &self.ordinal).finish_non_exhaustive()
    }
}

/// What the copy-engine thread works on.
struct Engine {
    memory: Memory,
    counters: Arc<Counters>,
    fail_after: Arc<AtomicU64>,
    id: DeviceId,
}

impl Engine {
    fn copy(
        &self,
        handle: u64,
        offset: usize,
        src: &Staging,
        len: usize,
        keystream: Option<(Arc<KeyInner>, u64)>,
    ) -> Result<()> {
        let id = self.id;
        let before = self.counters.uploaded_bytes.fetch_add(len as u64, Ordering::SeqCst);
        if before + len as u64 > self.fail_after.load(Ordering::SeqCst) {
            return Err(DeviceError::Driver { device: id, message: "injected copy failure".into() });
        }
        let mut mem = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        let buf = mem
            .get_mut(&handle)
            .ok_or(DeviceError::Driver { device: id, message: "allocation freed during a copy".into() })?;
        check_range(id, buf.len(), offset, len)?;
        let bytes = crate::staged_bytes(id, src.as_ref(), len)?;
        let dst = &mut buf[offset..offset + len];
        dst.copy_from_slice(bytes);
        if let Some((key, pos)) = keystream {
            key.cipher.apply_at(pos, dst);
            self.counters.decrypted_bytes.fetch_add(len as u64, Ordering::SeqCst);
        }
        self.counters.uploads.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl OpaqueDevice {
    /// A test device with ordinal `ordinal` and none of the optional abilities.
    pub fn new(ordinal: u32) -> Self {
        let memory: Memory = Arc::default();
        let (tx, rx) = mpsc::channel::<Job>();
        let counters = Arc::new(Counters::default());
        let fail_after = Arc::new(AtomicU64::new(u64::MAX));
        {
            let engine = Engine {
                memory: memory.clone(),
                counters: counters.clone(),
                fail_after: fail_after.clone(),
                id: DeviceId { kind: DeviceKind::Test, ordinal },
            };
            std::thread::spawn(move || {
                for job in rx {
                    match job {
                        Job::Copy { handle, offset, src, len, keystream, done } => {
                            let r = engine.copy(handle, offset, &src, len, keystream);
                            let _ = done.send(r.map(|()| src));
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
            counters,
            fail_after,
            decrypts: false,
            host_uploads: false,
            prefers_host_uploads: true,
            key_failure: None,
            cast_failure: None,
            pool: None,
            host_upload_refused: AtomicBool::new(false),
            page_cache_refusal: None,
            capacity: None,
        }
    }

    /// A device with `bytes` of memory: [`Device::free_memory`] says what is left, and an
    /// allocation past it fails as a full device's does.
    pub fn with_capacity(mut self, bytes: u64) -> Self {
        self.capacity = Some(bytes);
        self
    }

    /// Bytes of device memory allocated and not freed.
    pub fn allocated_bytes(&self) -> u64 {
        self.memory.lock().unwrap_or_else(|p| p.into_inner()).values().map(|v| v.len() as u64).sum()
    }

    /// Decrypts after upload (see the module docs).
    pub fn with_decryption(mut self) -> Self {
        self.decrypts = true;
        self
    }

    /// Copies straight from host memory ([`Device::upload_from_host`]).
    pub fn with_host_uploads(mut self) -> Self {
        self.host_uploads = true;
        self
    }

    /// Copies straight from host memory, but, like CUDA, only when a load asks for it: automatic
    /// loads of hot files stage ([`Device::prefers_host_uploads`] is false).
    pub fn with_host_uploads_on_request(mut self) -> Self {
        self.host_uploads = true;
        self.prefers_host_uploads = false;
        self
    }

    /// Copies straight from host memory, but refuses mappings of cached files with `why`, as
    /// CUDA does by default ([`Device::uploads_from_page_cache`]).
    pub fn with_page_cache_refused(mut self, why: &str) -> Self {
        self.host_uploads = true;
        self.page_cache_refusal = Some(why.to_owned());
        self
    }

    /// Staging buffers come from (and return to) `pool`.
    pub fn with_staging_pool(mut self, pool: StagingPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// Claims to decrypt after upload but fails [`Device::prepare_key`] with `message`.
    pub fn with_key_failure(mut self, message: &str) -> Self {
        self.decrypts = true;
        self.key_failure = Some(message.to_owned());
        self
    }

    /// Claims to convert dtypes but fails [`Device::cast`] with `message`.
    pub fn with_cast_failure(mut self, message: &str) -> Self {
        self.cast_failure = Some(message.to_owned());
        self
    }

    /// Makes the next [`Device::upload_from_host`] calls fail as a refused registration does.
    pub fn refuse_host_uploads(&self) {
        self.host_upload_refused.store(true, Ordering::SeqCst);
    }

    /// Copies completed so far.
    pub fn uploads(&self) -> usize {
        self.counters.uploads.load(Ordering::SeqCst)
    }

    /// Bytes handed to uploads so far (including failed ones).
    pub fn uploaded_bytes(&self) -> u64 {
        self.counters.uploaded_bytes.load(Ordering::SeqCst)
    }

    /// Bytes decrypted in device memory so far.
    pub fn decrypted_bytes(&self) -> u64 {
        self.counters.decrypted_bytes.load(Ordering::SeqCst)
    }

    /// Elements converted (or copied) in device memory by [`Device::cast`] so far.
    pub fn cast_elements(&self) -> u64 {
        self.counters.cast_elements.load(Ordering::SeqCst)
    }

    /// Bytes copied straight from host memory so far.
    pub fn host_uploaded_bytes(&self) -> u64 {
        self.counters.host_uploaded_bytes.load(Ordering::SeqCst)
    }

    /// Keys prepared so far ([`Device::prepare_key`]: one per load that decrypts here).
    pub fn keys_prepared(&self) -> usize {
        self.counters.keys_prepared.load(Ordering::SeqCst)
    }

    /// Keys alive on the device now.
    pub fn live_keys(&self) -> usize {
        self.counters.live_keys.load(Ordering::SeqCst)
    }

    /// Makes every copy fail once more than `bytes` bytes have been uploaded in total.
    pub fn fail_after_bytes(&self, bytes: u64) {
        self.fail_after.store(bytes, Ordering::SeqCst);
    }

    /// Allocations alive now.
    pub fn live_allocations(&self) -> usize {
        self.memory.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Writes `bytes` into an allocation at `offset` (test setup, e.g. tensors to save).
    pub fn write(&self, dst: &dyn Allocation, offset: usize, bytes: &[u8]) -> Result<()> {
        self.synchronize()?;
        let dst = self.own(dst)?;
        check_range(self.id(), dst.len, offset, bytes.len())?;
        let mut mem = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        let buf = mem
            .get_mut(&dst.handle)
            .ok_or(DeviceError::Driver { device: self.id(), message: "allocation freed".into() })?;
        buf[dst.base + offset..dst.base + offset + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn send(&self, job: Job) -> Result<()> {
        self.engine
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job)
            .map_err(|_| DeviceError::Driver { device: self.id(), message: "copy engine stopped".into() })
    }

    fn own<'a>(&self, a: &'a dyn Allocation) -> Result<&'a OpaqueAllocation> {
        a.as_any()
            .downcast_ref::<OpaqueAllocation>()
            .filter(|o| o.device == self.id())
            .ok_or(DeviceError::ForeignAllocation { device: self.id(), other: a.device() })
    }

    fn own_key<'a>(&self, k: &'a dyn DeviceKey) -> Result<&'a OpaqueKey> {
        k.as_any()
            .downcast_ref::<OpaqueKey>()
            .filter(|o| o.device == self.id())
            .ok_or(DeviceError::Driver { device: self.id(), message: "a key prepared by another device".into() })
    }
}

/// An allocation on the [`OpaqueDevice`] (or a borrowed view of one); its bytes are not
/// addressable.
pub struct OpaqueAllocation {
    device: DeviceId,
    handle: u64,
    /// Start within the handle's memory (non-zero for borrowed views).
    base: usize,
    len: usize,
    owned: bool,
    memory: Memory,
}

impl fmt::Debug for OpaqueAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpaqueAllocation")
            .field("handle", &self.handle)
            .field("base", &self.base)
            .field("len", &self.len)
            .field("owned", &self.owned)
            .finish()
    }
}

impl Drop for OpaqueAllocation {
    fn drop(&mut self) {
        if self.owned {
            self.memory.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.handle);
        }
    }
}

impl Allocation for OpaqueAllocation {
    fn len(&self) -> usize {
        self.len
    }

    fn device(&self) -> DeviceId {
        self.device
    }

    /// `handle << 32 | offset`: distinct per allocation, and what [`Device::borrow`] takes.
    fn address(&self) -> u64 {
        (self.handle << 32) + self.base as u64
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

impl Device for OpaqueDevice {
    fn id(&self) -> DeviceId {
        DeviceId { kind: DeviceKind::Test, ordinal: self.ordinal }
    }

    fn free_memory(&self) -> Option<u64> {
        self.capacity.map(|c| c.saturating_sub(self.allocated_bytes()))
    }

    fn alloc(&self, len: usize) -> Result<Box<dyn Allocation>> {
        if self.free_memory().is_some_and(|free| len as u64 > free) {
            return Err(DeviceError::OutOfMemory {
                device: self.id(),
                len,
                source: std::io::Error::other("the test device's capacity is used up"),
            });
        }
        let handle = self.next_handle.fetch_add(1, Ordering::SeqCst);
        self.memory.lock().unwrap_or_else(|p| p.into_inner()).insert(handle, vec![0xEE; len]);
        Ok(Box::new(OpaqueAllocation {
            device: self.id(),
            handle,
            base: 0,
            len,
            owned: true,
            memory: self.memory.clone(),
        }))
    }

    fn alloc_staging(&self, len: usize) -> Result<Staging> {
        let new = |len: usize| -> Result<Staging> { Ok(Box::new(Arena::new(len, false)?)) };
        match &self.pool {
            Some(pool) => Ok(Box::new(pool.take(len, new)?)),
            None => new(len),
        }
    }

    fn upload(&self, src: Staging, len: usize, dst: &dyn Allocation, dst_offset: usize) -> Result<Transfer> {
        self.upload_with(src, len, dst, dst_offset, AfterUpload::Nothing)
    }

    fn upload_with(
        &self,
        src: Staging,
        len: usize,
        dst: &dyn Allocation,
        dst_offset: usize,
        after: AfterUpload<'_>,
    ) -> Result<Transfer> {
        let dst = self.own(dst)?;
        check_range(self.id(), dst.len, dst_offset, len)?;
        let keystream = match after {
            AfterUpload::Nothing => None,
            AfterUpload::Keystream { key, pos } => Some((self.own_key(key)?.inner.clone(), pos)),
        };
        let (tx, rx) = mpsc::channel();
        self.send(Job::Copy { handle: dst.handle, offset: dst.base + dst_offset, src, len, keystream, done: tx })?;
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
        let at = src.base + src_offset;
        dst.copy_from_slice(&buf[at..at + dst.len()]);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        self.send(Job::Fence(tx))?;
        rx.recv().map_err(|_| DeviceError::Driver { device: self.id(), message: "copy engine stopped".into() })
    }

    fn decrypts_after_upload(&self) -> bool {
        self.decrypts
    }

    fn casts(&self) -> bool {
        true
    }

    /// Converts with `turboio_format::cast` on the device's own memory (standing in for the
    /// GPU kernel, which the host-compiled kernel tests compare with that same function).
    fn cast(&self, src: &dyn Allocation, dst: &dyn Allocation, jobs: &[CastJob]) -> Result<()> {
        if let Some(message) = &self.cast_failure {
            return Err(DeviceError::Driver { device: self.id(), message: message.clone() });
        }
        self.synchronize()?;
        let (s, d) = (self.own(src)?, self.own(dst)?);
        let mut mem = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        let freed = || DeviceError::Driver { device: self.id(), message: "allocation freed".into() };
        for j in jobs {
            check_range(self.id(), s.len, j.src_offset, j.src_len())?;
            check_range(self.id(), d.len, j.dst_offset, j.dst_len())?;
            let at = s.base + j.src_offset;
            let input = mem.get(&s.handle).ok_or_else(freed)?[at..at + j.src_len()].to_vec();
            let out = mem.get_mut(&d.handle).ok_or_else(freed)?;
            let at = d.base + j.dst_offset;
            turboio_format::cast(&input, j.from, j.to, &mut out[at..at + j.dst_len()])
                .map_err(|e| DeviceError::Driver { device: self.id(), message: e.to_string() })?;
            self.counters.cast_elements.fetch_add(j.elements as u64, Ordering::SeqCst);
        }
        Ok(())
    }

    fn prepare_key(&self, key: &[u8], iv: &[u8; 16]) -> Result<Box<dyn DeviceKey>> {
        if !self.decrypts {
            return Err(DeviceError::Unsupported { device: self.id(), what: "decrypting in device memory".into() });
        }
        if let Some(m) = &self.key_failure {
            return Err(DeviceError::Unavailable { device: self.id().to_string(), reason: m.clone() });
        }
        let key = Key::new(key).map_err(|e| DeviceError::Driver { device: self.id(), message: e.to_string() })?;
        self.counters.live_keys.fetch_add(1, Ordering::SeqCst);
        self.counters.keys_prepared.fetch_add(1, Ordering::SeqCst);
        let inner =
            Arc::new(KeyInner { cipher: CtrCipher::new(&key, &Iv(*iv)), live: self.counters.live_keys.clone() });
        Ok(Box::new(OpaqueKey { device: self.id(), inner }))
    }

    fn apply_keystream(
        &self,
        key: &dyn DeviceKey,
        dst: &dyn Allocation,
        offset: usize,
        len: usize,
        pos: u64,
    ) -> Result<()> {
        let key = self.own_key(key)?;
        self.synchronize()?;
        let dst = self.own(dst)?;
        check_range(self.id(), dst.len, offset, len)?;
        let mut mem = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        let buf = mem
            .get_mut(&dst.handle)
            .ok_or(DeviceError::Driver { device: self.id(), message: "allocation freed".into() })?;
        key.inner.cipher.apply_at(pos, &mut buf[dst.base + offset..dst.base + offset + len]);
        self.counters.decrypted_bytes.fetch_add(len as u64, Ordering::SeqCst);
        Ok(())
    }

    fn uploads_from_host(&self) -> bool {
        self.host_uploads
    }

    fn prefers_host_uploads(&self) -> bool {
        self.host_uploads && self.prefers_host_uploads
    }

    fn uploads_from_page_cache(&self) -> std::result::Result<(), String> {
        match &self.page_cache_refusal {
            Some(why) => Err(why.clone()),
            None if self.host_uploads => Ok(()),
            None => Err(format!("{} cannot copy straight from the page cache", self.id())),
        }
    }

    fn upload_from_host(&self, src: &[u8], dst: &dyn Allocation, dst_offset: usize) -> Result<()> {
        if !self.host_uploads || self.host_upload_refused.load(Ordering::SeqCst) {
            return Err(DeviceError::Unsupported {
                device: self.id(),
                what: "registering host memory for DMA was refused (test)".into(),
            });
        }
        self.synchronize()?;
        let dst = self.own(dst)?;
        check_range(self.id(), dst.len, dst_offset, src.len())?;
        let mut mem = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        let buf = mem
            .get_mut(&dst.handle)
            .ok_or(DeviceError::Driver { device: self.id(), message: "allocation freed".into() })?;
        buf[dst.base + dst_offset..dst.base + dst_offset + src.len()].copy_from_slice(src);
        self.counters.host_uploaded_bytes.fetch_add(src.len() as u64, Ordering::SeqCst);
        Ok(())
    }

    unsafe fn borrow(&self, address: u64, len: usize) -> Result<Box<dyn Allocation>> {
        let handle = address >> 32;
        let base = (address & 0xffff_ffff) as usize;
        let mem = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        let buf = mem.get(&handle).ok_or(DeviceError::Driver {
            device: self.id(),
            message: format!("no allocation at address {address:#x}"),
        })?;
        check_range(self.id(), buf.len(), base, len)?;
        Ok(Box::new(OpaqueAllocation {
            device: self.id(),
            handle,
            base,
            len,
            owned: false,
            memory: self.memory.clone(),
        }))
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

    #[test]
    fn decrypts_after_upload_like_the_cipher() {
        let plain = dev_bytes(1000);
        let key = [7u8; 32];
        let iv = [0xfe; 16];
        let cipher = CtrCipher::new(&Key::new(&key).unwrap(), &Iv(iv));
        let mut enc = plain.clone();
        cipher.apply_at(5000, &mut enc);

        let plain_dev = OpaqueDevice::new(0);
        assert!(!plain_dev.decrypts_after_upload());
        assert!(plain_dev.prepare_key(&key, &iv).is_err());

        let dev = OpaqueDevice::new(0).with_decryption();
        let a = dev.alloc(1000).unwrap();
        let k = dev.prepare_key(&key, &iv).unwrap();
        assert_eq!(dev.live_keys(), 1);
        assert!(!format!("{k:?}").contains("7, 7"), "no key material in Debug");
        // Two uneven chunks, each decrypted at its own stream position.
        for (off, len) in [(0usize, 333usize), (333, 667)] {
            let mut s = dev.alloc_staging(len).unwrap();
            s.as_mut_slice()[..len].copy_from_slice(&enc[off..off + len]);
            let after = AfterUpload::Keystream { key: k.as_ref(), pos: 5000 + off as u64 };
            dev.upload_with(s, len, a.as_ref(), off, after).unwrap().wait().unwrap();
        }
        let mut back = vec![0u8; 1000];
        dev.download(a.as_ref(), 0, &mut back).unwrap();
        assert!(back == plain);
        assert_eq!(dev.decrypted_bytes(), 1000);
        // In place, for bytes that arrived another way.
        dev.apply_keystream(k.as_ref(), a.as_ref(), 10, 20, 5010).unwrap();
        dev.download(a.as_ref(), 0, &mut back).unwrap();
        assert!(back[10..30] == enc[10..30]);
        drop(k);
        assert_eq!(dev.live_keys(), 0, "keys are dropped with their handle");
        let failing = OpaqueDevice::new(0).with_key_failure("no NVRTC");
        assert!(failing.decrypts_after_upload());
        assert!(failing.prepare_key(&key, &iv).unwrap_err().to_string().contains("no NVRTC"));
    }

    #[test]
    fn host_uploads_borrows_and_pooled_staging() {
        let pool = StagingPool::new(4);
        let dev = OpaqueDevice::new(1).with_host_uploads().with_staging_pool(pool.clone());
        let a = dev.alloc(64).unwrap();
        dev.upload_from_host(b"hello", a.as_ref(), 7).unwrap();
        assert_eq!(dev.host_uploaded_bytes(), 5);
        // SAFETY: the address and range come from a live allocation of this device.
        let view = unsafe { dev.borrow(a.address() + 7, 5) }.unwrap();
        let mut back = [0u8; 5];
        dev.download(view.as_ref(), 0, &mut back).unwrap();
        assert_eq!(&back, b"hello");
        drop(view);
        assert_eq!(dev.live_allocations(), 1, "dropping a borrowed view frees nothing");
        // SAFETY: as above; the range is checked and refused.
        assert!(unsafe { dev.borrow(a.address() + 60, 5) }.is_err());
        dev.refuse_host_uploads();
        assert!(dev.upload_from_host(b"x", a.as_ref(), 0).is_err());
        let s = dev.alloc_staging(100).unwrap();
        drop(s);
        let s = dev.alloc_staging(50).unwrap();
        drop(s);
        assert_eq!((pool.allocations(), pool.reuses()), (1, 1));
        assert!(!OpaqueDevice::new(0).uploads_from_host());
    }

    fn dev_bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }
}
