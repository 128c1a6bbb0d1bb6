//! A performance model of a GPU, for measuring the staged load pipeline on machines without
//! one.
//!
//! [`ModelDevice`] keeps no bytes: it charges time. Its uploads complete per stream in FIFO
//! order over one shared host-to-device link at [`GpuModel::link_bytes_per_s`]; its staging
//! buffers are real host memory, faulted in and locked (`mlock`) as pinned memory is, with the
//! driver's pinning time charged at [`GpuModel::pin_bytes_per_s`] plus a per-call cost; waiting
//! on an upload's event wakes [`GpuModel::event_wake`] after the copy ends. Everything the real
//! pipeline does on the host (planning, the readers' `pread`s into the slots, the pool, the
//! waits) runs unchanged, so a load through this device takes as long as it would on the modelled
//! GPU wherever the host, not the GPU, is the limit, and the link's time shows where it is not.
//!
//! It counts what matters for a load's speed ([`ModelCounters`]): pinned allocations and bytes,
//! events created, synchronisations, the time readers waited on uploads, the time the link was
//! busy. Bytes are not kept, so [`Device::download`] is refused: correctness is the
//! [`OpaqueDevice`](super::OpaqueDevice)'s job.
//!
//! The defaults ([`GpuModel::default`]) are the H200 VMs' measurements (see the GPU runs in
//! docs/src/benchmarks.md): a pinned host-to-device copy of 1.07 GB in 0.019-0.020 s (55 GB/s, 4 streams), and
//! pinning at about 2 GB/s (`cuMemHostRegister` of 1.07 GB in 0.59-0.62 s). The per-call costs
//! are assumptions, not measurements; a GPU run that measures them resets them.

use crate::cpu::Arena;
use crate::{
    check_range, AfterUpload, Allocation, Device, DeviceError, DeviceId, DeviceKey, DeviceKind, PendingTransfer,
    Result, Staging, StagingPool, Transfer,
};
use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The rates and latencies a [`ModelDevice`] charges. See the module docs for where the
/// defaults come from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuModel {
    /// Host-to-device bytes per second, shared by every stream (default 55 GB/s: the H200 VMs'
    /// pinned copy).
    pub link_bytes_per_s: f64,
    /// Bytes per second the driver pins host memory at (default 2 GB/s: the H200 VMs'
    /// `cuMemHostRegister`).
    pub pin_bytes_per_s: f64,
    /// Fixed cost of one pinning call (default 0.2 ms, assumed).
    pub pin_call: Duration,
    /// Fixed cost of one device allocation (default 0.1 ms, assumed).
    pub alloc_call: Duration,
    /// From a copy's end to the waiting thread running again (default 20 µs, assumed: a
    /// blocking-sync event's wake-up).
    pub event_wake: Duration,
    /// Copy streams (default 4, as the CUDA device's `TURBOIO_CUDA_STREAMS`).
    pub streams: usize,
    /// Bytes per second the decryption kernel runs at after a copy (default 400 GB/s, assumed).
    pub kernel_bytes_per_s: f64,
}

impl Default for GpuModel {
    fn default() -> Self {
        GpuModel {
            link_bytes_per_s: 55e9,
            pin_bytes_per_s: 2e9,
            pin_call: Duration::from_micros(200),
            alloc_call: Duration::from_micros(100),
            event_wake: Duration::from_micros(20),
            streams: 4,
            kernel_bytes_per_s: 400e9,
        }
    }
}

impl GpuModel {
    /// The defaults with the settings in `spec` changed: comma-separated `name=value` pairs,
    /// rates in GB/s (`link`, `pin`, `kernel`), times in microseconds (`pin_call`, `alloc_call`,
    /// `wake`), and `streams`. E.g. `link=25,pin=1.5`.
    pub fn parse(spec: &str) -> std::result::Result<GpuModel, String> {
        let mut m = GpuModel::default();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| format!("`{part}`: expected name=value"))?;
            let x: f64 = v
                .trim()
                .parse()
                .ok()
                .filter(|x: &f64| x.is_finite() && *x > 0.0)
                .ok_or_else(|| format!("`{part}`: `{v}` is not a positive number"))?;
            let us = || Duration::from_secs_f64(x / 1e6);
            match k.trim() {
                "link" => m.link_bytes_per_s = x * 1e9,
                "pin" => m.pin_bytes_per_s = x * 1e9,
                "kernel" => m.kernel_bytes_per_s = x * 1e9,
                "pin_call" => m.pin_call = us(),
                "alloc_call" => m.alloc_call = us(),
                "wake" => m.event_wake = us(),
                "streams" => m.streams = (x as usize).clamp(1, 64),
                other => {
                    return Err(format!(
                        "unknown model setting `{other}` (link, pin, kernel, pin_call, alloc_call, wake, streams)"
                    ))
                }
            }
        }
        Ok(m)
    }

    fn link_time(&self, bytes: usize) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.link_bytes_per_s)
    }
}

/// What a [`ModelDevice`] counted (all since it was made; subtract two with
/// [`since`](Self::since) for one load's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelCounters {
    /// Device allocations.
    pub allocations: u64,
    /// Uploads (staged copies).
    pub uploads: u64,
    /// Bytes uploaded.
    pub uploaded_bytes: u64,
    /// Pinned staging buffers allocated (a pool's reuse allocates none).
    pub pinned_allocations: u64,
    /// Bytes of pinned staging buffers allocated.
    pub pinned_bytes: u64,
    /// Time spent pinning (charged and real).
    pub pin_time: Duration,
    /// Events created (reused ones are not counted again).
    pub events_created: u64,
    /// Device-wide synchronisations.
    pub synchronizations: u64,
    /// Waits on an upload's event.
    pub upload_waits: u64,
    /// Time threads spent blocked in those waits (readers waiting for a slot to come back).
    pub upload_wait_time: Duration,
    /// Time the modelled link was busy copying.
    pub link_busy: Duration,
}

impl ModelCounters {
    /// What was counted between `before` and `self`.
    pub fn since(&self, before: &ModelCounters) -> ModelCounters {
        ModelCounters {
            allocations: self.allocations - before.allocations,
            uploads: self.uploads - before.uploads,
            uploaded_bytes: self.uploaded_bytes - before.uploaded_bytes,
            pinned_allocations: self.pinned_allocations - before.pinned_allocations,
            pinned_bytes: self.pinned_bytes - before.pinned_bytes,
            pin_time: self.pin_time.saturating_sub(before.pin_time),
            events_created: self.events_created - before.events_created,
            synchronizations: self.synchronizations - before.synchronizations,
            upload_waits: self.upload_waits - before.upload_waits,
            upload_wait_time: self.upload_wait_time.saturating_sub(before.upload_wait_time),
            link_busy: self.link_busy.saturating_sub(before.link_busy),
        }
    }
}

#[derive(Default)]
struct Atomics {
    allocations: AtomicU64,
    uploads: AtomicU64,
    uploaded_bytes: AtomicU64,
    pinned_allocations: AtomicU64,
    pinned_bytes: AtomicU64,
    pin_ns: AtomicU64,
    events_created: AtomicU64,
    synchronizations: AtomicU64,
    upload_waits: AtomicU64,
    upload_wait_ns: AtomicU64,
    link_busy_ns: AtomicU64,
}

/// Takes `d` of the calling thread, as a driver call does: a sleep for most of it (the kernel
/// wakes a sleeper up to ~60 µs late) and the rest spun, so that short charges are not
/// inflated.
fn charge(d: Duration) {
    let end = Instant::now() + d;
    if d > Duration::from_micros(200) {
        std::thread::sleep(d - Duration::from_micros(100));
    }
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// When the link and each stream are free again.
struct Link {
    free_at: Instant,
    streams: Vec<Instant>,
    next: usize,
}

struct Inner {
    id: DeviceId,
    model: GpuModel,
    counters: Atomics,
    link: Mutex<Link>,
    /// Events not in use (the CUDA device records them again).
    free_events: AtomicUsize,
    allocated: AtomicU64,
    next_address: AtomicU64,
}

impl Inner {
    fn sleep_until(&self, t: Instant) {
        let now = Instant::now();
        if t > now {
            std::thread::sleep(t - now + self.model.event_wake);
        }
    }
}

/// The modelled GPU. See the module docs.
pub struct ModelDevice {
    inner: Arc<Inner>,
    pool: StagingPool,
    decrypts: bool,
    capacity: Option<u64>,
}

impl fmt::Debug for ModelDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelDevice").field("id", &self.inner.id).field("model", &self.inner.model).finish()
    }
}

impl ModelDevice {
    /// A modelled GPU with ordinal `ordinal`, charging `model`'s rates, with a staging pool of
    /// its own.
    pub fn new(ordinal: u32, model: GpuModel) -> Self {
        let now = Instant::now();
        ModelDevice {
            inner: Arc::new(Inner {
                id: DeviceId { kind: DeviceKind::Test, ordinal },
                counters: Atomics::default(),
                link: Mutex::new(Link { free_at: now, streams: vec![now; model.streams.max(1)], next: 0 }),
                model,
                free_events: AtomicUsize::new(0),
                allocated: AtomicU64::new(0),
                next_address: AtomicU64::new(1 << 40),
            }),
            pool: StagingPool::default(),
            decrypts: false,
            capacity: None,
        }
    }

    /// Staging buffers come from (and return to) `pool`.
    pub fn with_staging_pool(mut self, pool: StagingPool) -> Self {
        self.pool = pool;
        self
    }

    /// Decrypts after upload (charged at [`GpuModel::kernel_bytes_per_s`] on the copy's
    /// stream), as the CUDA device does.
    pub fn with_decryption(mut self) -> Self {
        self.decrypts = true;
        self
    }

    /// A device with `bytes` of memory ([`Device::free_memory`] says what is left).
    pub fn with_capacity(mut self, bytes: u64) -> Self {
        self.capacity = Some(bytes);
        self
    }

    /// The rates it charges.
    pub fn model(&self) -> &GpuModel {
        &self.inner.model
    }

    /// Everything counted so far.
    pub fn counters(&self) -> ModelCounters {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::SeqCst);
        ModelCounters {
            allocations: get(&c.allocations),
            uploads: get(&c.uploads),
            uploaded_bytes: get(&c.uploaded_bytes),
            pinned_allocations: get(&c.pinned_allocations),
            pinned_bytes: get(&c.pinned_bytes),
            pin_time: Duration::from_nanos(get(&c.pin_ns)),
            events_created: get(&c.events_created),
            synchronizations: get(&c.synchronizations),
            upload_waits: get(&c.upload_waits),
            upload_wait_time: Duration::from_nanos(get(&c.upload_wait_ns)),
            link_busy: Duration::from_nanos(get(&c.link_busy_ns)),
        }
    }

    fn own<'a>(&self, a: &'a dyn Allocation) -> Result<&'a ModelAllocation> {
        a.as_any()
            .downcast_ref::<ModelAllocation>()
            .filter(|m| m.device == self.inner.id)
            .ok_or(DeviceError::ForeignAllocation { device: self.inner.id, other: a.device() })
    }

    /// A real pinned-like buffer: anonymous memory, locked (faulted in) or at least faulted
    /// in, with the modelled pinning time charged on top of what that took.
    fn pin(inner: &Inner, len: usize) -> Result<Staging> {
        let t0 = Instant::now();
        let arena = Arena::new(len, false)?;
        if arena.lock().is_err() {
            // Without the right to lock (RLIMIT_MEMLOCK), faulted in all the same.
            arena.prefault(1);
        }
        let m = &inner.model;
        let charge = m.pin_call + Duration::from_secs_f64(len as f64 / m.pin_bytes_per_s);
        let spent = t0.elapsed();
        if charge > spent {
            self::charge(charge - spent);
        }
        let c = &inner.counters;
        // An event per slot, made with it (as the CUDA device does): a transfer holds one slot
        // and one event, so uploads never create one.
        c.events_created.fetch_add(1, Ordering::SeqCst);
        inner.free_events.fetch_add(1, Ordering::SeqCst);
        c.pinned_allocations.fetch_add(1, Ordering::SeqCst);
        c.pinned_bytes.fetch_add(len as u64, Ordering::SeqCst);
        c.pin_ns.fetch_add(ns(t0.elapsed()), Ordering::SeqCst);
        Ok(Box::new(arena))
    }

    /// Queues `len` bytes on the next stream (and `kernel_len` bytes of kernel work after
    /// them); returns when they are done.
    fn queue(&self, len: usize, kernel_len: usize) -> Instant {
        let inner = &self.inner;
        let m = &inner.model;
        let copy = m.link_time(len);
        let mut link = inner.link.lock().unwrap_or_else(|p| p.into_inner());
        let s = link.next % link.streams.len();
        link.next += 1;
        let start = Instant::now().max(link.free_at).max(link.streams[s]);
        let copied = start + copy;
        link.free_at = copied;
        let done = copied + Duration::from_secs_f64(kernel_len as f64 / m.kernel_bytes_per_s);
        link.streams[s] = done;
        drop(link);
        let c = &inner.counters;
        c.uploads.fetch_add(1, Ordering::SeqCst);
        c.uploaded_bytes.fetch_add(len as u64, Ordering::SeqCst);
        c.link_busy_ns.fetch_add(ns(copy), Ordering::SeqCst);
        done
    }
}

/// Memory of the [`ModelDevice`]: an address range and a length, no bytes.
pub struct ModelAllocation {
    device: DeviceId,
    address: u64,
    len: usize,
    inner: Arc<Inner>,
}

impl fmt::Debug for ModelAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelAllocation").field("address", &self.address).field("len", &self.len).finish()
    }
}

impl Drop for ModelAllocation {
    fn drop(&mut self) {
        self.inner.allocated.fetch_sub(self.len as u64, Ordering::SeqCst);
    }
}

impl Allocation for ModelAllocation {
    fn len(&self) -> usize {
        self.len
    }

    fn device(&self) -> DeviceId {
        self.device
    }

    fn address(&self) -> u64 {
        self.address
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A key "on" the model device (nothing is kept).
#[derive(Debug)]
struct ModelKey;

impl DeviceKey for ModelKey {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct ModelPending {
    done: Instant,
    staging: Option<Staging>,
    inner: Arc<Inner>,
}

impl PendingTransfer for ModelPending {
    fn wait(mut self: Box<Self>) -> Result<Staging> {
        let t0 = Instant::now();
        self.inner.sleep_until(self.done);
        let c = &self.inner.counters;
        c.upload_waits.fetch_add(1, Ordering::SeqCst);
        c.upload_wait_ns.fetch_add(ns(t0.elapsed()), Ordering::SeqCst);
        self.inner.free_events.fetch_add(1, Ordering::SeqCst);
        self.staging
            .take()
            .ok_or(DeviceError::Driver { device: self.inner.id, message: "transfer waited twice".into() })
    }

    fn is_complete(&self) -> bool {
        Instant::now() >= self.done
    }
}

impl Drop for ModelPending {
    fn drop(&mut self) {
        if self.staging.is_some() {
            // Dropped unwaited (an error path): the buffer is not freed under a running copy.
            self.inner.sleep_until(self.done);
            self.inner.free_events.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Device for ModelDevice {
    fn id(&self) -> DeviceId {
        self.inner.id
    }

    fn free_memory(&self) -> Option<u64> {
        self.capacity.map(|c| c.saturating_sub(self.inner.allocated.load(Ordering::SeqCst)))
    }

    fn alloc(&self, len: usize) -> Result<Box<dyn Allocation>> {
        if self.free_memory().is_some_and(|free| len as u64 > free) {
            return Err(DeviceError::OutOfMemory {
                device: self.id(),
                len,
                source: std::io::Error::other("the model device's capacity is used up"),
            });
        }
        charge(self.inner.model.alloc_call);
        self.inner.allocated.fetch_add(len as u64, Ordering::SeqCst);
        self.inner.counters.allocations.fetch_add(1, Ordering::SeqCst);
        let address = self.inner.next_address.fetch_add((len as u64).next_multiple_of(256).max(256), Ordering::SeqCst);
        Ok(Box::new(ModelAllocation { device: self.id(), address, len, inner: self.inner.clone() }))
    }

    fn alloc_staging(&self, len: usize) -> Result<Staging> {
        let inner = &self.inner;
        Ok(Box::new(self.pool.take(len, |len| Self::pin(inner, len))?))
    }

    fn staging_pool(&self) -> Option<&StagingPool> {
        Some(&self.pool)
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
        crate::staged_bytes(self.id(), src.as_ref(), len)?;
        let kernel = match after {
            AfterUpload::Nothing => 0,
            AfterUpload::Keystream { key, .. } => {
                key.as_any().downcast_ref::<ModelKey>().ok_or(DeviceError::Driver {
                    device: self.id(),
                    message: "a key prepared by another device".into(),
                })?;
                len
            }
        };
        // An event for the transfer: a free one again, or a new one.
        let reused =
            self.inner.free_events.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        if !reused {
            self.inner.counters.events_created.fetch_add(1, Ordering::SeqCst);
        }
        let done = self.queue(len, kernel);
        Ok(Transfer::Pending(Box::new(ModelPending { done, staging: Some(src), inner: self.inner.clone() })))
    }

    fn download(&self, _src: &dyn Allocation, _src_offset: usize, _dst: &mut [u8]) -> Result<()> {
        Err(DeviceError::Unsupported {
            device: self.id(),
            what: "reading memory back (the model device keeps no bytes; use the opaque test device)".into(),
        })
    }

    fn synchronize(&self) -> Result<()> {
        let last = {
            let link = self.inner.link.lock().unwrap_or_else(|p| p.into_inner());
            link.streams.iter().copied().max().unwrap_or(link.free_at)
        };
        self.inner.counters.synchronizations.fetch_add(1, Ordering::SeqCst);
        self.inner.sleep_until(last);
        Ok(())
    }

    fn decrypts_after_upload(&self) -> bool {
        self.decrypts
    }

    fn prepare_key(&self, _key: &[u8], _iv: &[u8; 16]) -> Result<Box<dyn DeviceKey>> {
        if !self.decrypts {
            return Err(DeviceError::Unsupported { device: self.id(), what: "decrypting in device memory".into() });
        }
        Ok(Box::new(ModelKey))
    }

    fn apply_keystream(
        &self,
        _key: &dyn DeviceKey,
        dst: &dyn Allocation,
        offset: usize,
        len: usize,
        _pos: u64,
    ) -> Result<()> {
        let dst = self.own(dst)?;
        check_range(self.id(), dst.len, offset, len)?;
        self.synchronize()?;
        charge(Duration::from_secs_f64(len as f64 / self.inner.model.kernel_bytes_per_s));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uploads_take_the_links_time_and_pinning_is_charged_once() {
        // A slow link and slow pinning, so that the charged times dwarf the machine's noise.
        let model = GpuModel::parse("link=0.1,pin=0.5,pin_call=1000").unwrap();
        assert_eq!(model.link_bytes_per_s, 0.1e9);
        let dev = ModelDevice::new(0, model);
        let mem = dev.alloc(4 << 20).unwrap();
        let t0 = Instant::now();
        let buf = dev.alloc_staging(1 << 20).unwrap();
        // 1 MiB at 0.5 GB/s is 2.1 ms, plus the 1 ms call.
        assert!(t0.elapsed() >= Duration::from_micros(3000), "pinning charged: {:?}", t0.elapsed());
        let t1 = Instant::now();
        let t = dev.upload(buf, 1 << 20, mem.as_ref(), 0).unwrap();
        let buf = t.wait().unwrap();
        // 1 MiB at 0.1 GB/s is 10.5 ms.
        assert!(t1.elapsed() >= Duration::from_micros(10_400), "the copy's time: {:?}", t1.elapsed());
        drop(buf);
        // Two more copies queue behind each other on the one link.
        let t2 = Instant::now();
        let a = dev.upload(dev.alloc_staging(1 << 20).unwrap(), 1 << 20, mem.as_ref(), 0).unwrap();
        let b = dev.upload(dev.alloc_staging(1 << 20).unwrap(), 1 << 20, mem.as_ref(), 1 << 20).unwrap();
        drop(b.wait().unwrap());
        assert!(t2.elapsed() >= Duration::from_micros(20_900), "FIFO on a shared link: {:?}", t2.elapsed());
        drop(a.wait().unwrap());
        dev.synchronize().unwrap();
        let c = dev.counters();
        assert_eq!((c.uploads, c.uploaded_bytes), (3, 3 << 20));
        assert_eq!(c.pinned_allocations, 2, "the second buffer of the pair was new, the first was reused");
        assert_eq!(c.pinned_bytes, 2 << 20);
        assert_eq!(c.events_created, 2, "one event per slot, made with it");
        assert_eq!(c.synchronizations, 1);
        assert!(c.link_busy >= Duration::from_micros(31_000));
        assert_eq!(c.upload_waits, 3);
        let before = dev.counters();
        drop(dev.upload(dev.alloc_staging(1 << 20).unwrap(), 1 << 20, mem.as_ref(), 0).unwrap().wait().unwrap());
        let one = dev.counters().since(&before);
        assert_eq!((one.pinned_allocations, one.events_created, one.uploads), (0, 0, 1));
    }

    #[test]
    fn bad_settings_and_reads_back_are_refused() {
        assert!(GpuModel::parse("link=fast").unwrap_err().contains("not a positive number"));
        assert!(GpuModel::parse("warp=9").unwrap_err().contains("unknown model setting"));
        let dev = ModelDevice::new(1, GpuModel::default()).with_capacity(1 << 20);
        assert!(dev.alloc(2 << 20).is_err(), "capacity is enforced");
        let mem = dev.alloc(4096).unwrap();
        assert_eq!(dev.free_memory(), Some((1 << 20) - 4096));
        let mut out = [0u8; 16];
        let e = dev.download(mem.as_ref(), 0, &mut out).unwrap_err().to_string();
        assert!(e.contains("keeps no bytes"), "{e}");
        let buf = dev.alloc_staging(4096).unwrap();
        assert!(dev.upload(buf, 4096, mem.as_ref(), 1).is_err(), "uploads are range-checked");
    }
}
