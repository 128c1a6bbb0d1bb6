//! Reads into a caller's slots ([`StorageFile::read_into_slots`](turboio_storage::StorageFile::read_into_slots)):
//! `O_DIRECT` through one io_uring, kept for the process, with the slots registered as its
//! fixed buffers.
//!
//! A staged GPU load reads a cold file into a few dozen pinned slots and starts each slot's
//! device copy the moment its read completes. One thread keeps every free slot's read in
//! flight (the disk sees a deep queue of large reads; the kernel splits each and queues its
//! parts at once) and sleeps in the kernel between completions. Registering the slots
//! (`IORING_REGISTER_BUFFERS`) spares the kernel pinning and unpinning every page of every read;
//! registering is itself costly (256 MiB of slots: 6-10 ms to register, 3-4 ms to unregister on
//! the 2-vCPU VM), so the ring and its registration are kept between calls and reused while the
//! caller's slots are the same memory, which [`SlotMemory::serial`] says: a steady-state load
//! registers nothing.
//!
//! The kernel holds the registered pages until the registration is replaced or dropped, even
//! once the caller has freed them; [`release_registered_slots`] drops it (a caller that frees
//! its slots to give the memory back calls it too).

use crate::uring::Ring;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use turboio_storage::SlotMemory;

/// Most slots registered (the kernel allows 16,384 buffers; a load uses a few dozen).
const MAX_REGISTERED: usize = 1024;

/// A memory slot as registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Registered {
    serial: u64,
    addr: usize,
    len: usize,
}

/// The ring kept between calls, with what is registered in it.
pub(crate) struct Lease {
    pub(crate) ring: Ring,
    registered: Vec<Registered>,
    /// Per slot of the call, its registered index.
    pub(crate) index: Vec<Option<u16>>,
    pid: u32,
}

/// The idle ring; a call takes it and gives it back (two calls at once: the second makes a
/// ring of its own, and the one given back last is kept).
static KEPT: Mutex<Option<Lease>> = Mutex::new(None);
/// Registrations made in this process (each pins the slots' pages once).
static REGISTRATIONS: AtomicUsize = AtomicUsize::new(0);
/// The kernel refused to register buffers here (`RLIMIT_MEMLOCK`, an old kernel): reads go
/// without, and registering is not tried again.
static REFUSED: AtomicBool = AtomicBool::new(false);

/// Registrations of slots made by this process so far: one per new set of slot memory, none
/// for a call whose slots were registered before.
pub fn slot_registrations() -> usize {
    REGISTRATIONS.load(Ordering::Relaxed)
}

/// Drops the kept ring and its registration, unpinning every slot page the kernel holds for
/// it. The next slot read registers its slots again.
pub fn release_registered_slots() {
    let kept = KEPT.lock().unwrap_or_else(|p| p.into_inner()).take();
    drop(kept);
}

/// A ring with room for `depth` requests, with `slots` registered where every one of them has a
/// serial: the kept ring when it is deep enough and of this process, its registration reused
/// when it covers the same memory.
pub(crate) fn take(depth: u32, slots: &[SlotMemory]) -> io::Result<Lease> {
    let pid = std::process::id();
    let kept = KEPT.lock().unwrap_or_else(|p| p.into_inner()).take();
    let mut lease = match kept {
        Some(l) if l.pid == pid && l.ring.depth() >= depth as usize => l,
        // Inherited through fork (the ring is the parent's) or too shallow: a new one.
        _ => Lease { ring: Ring::new(depth)?, registered: Vec::new(), index: Vec::new(), pid },
    };
    lease.index = register(&mut lease, slots);
    Ok(lease)
}

/// Gives the ring back for the next call.
pub(crate) fn give_back(lease: Lease) {
    if lease.ring.in_flight() == 0 {
        *KEPT.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease);
    }
}

/// Each slot's registered index, registering the slots when the lease's registration does not
/// already cover them; all `None` when they cannot be (a slot without a serial, too many, the
/// kernel refuses).
fn register(lease: &mut Lease, slots: &[SlotMemory]) -> Vec<Option<u16>> {
    let none = vec![None; slots.len()];
    let Some(want) = slots
        .iter()
        .map(|s| s.serial.map(|serial| Registered { serial, addr: s.ptr as usize, len: s.len }))
        .collect::<Option<Vec<Registered>>>()
    else {
        return none;
    };
    if want.is_empty() || want.len() > MAX_REGISTERED {
        return none;
    }
    let found: Option<Vec<Option<u16>>> = want
        .iter()
        .map(|w| lease.registered.iter().position(|r| r == w).and_then(|i| u16::try_from(i).ok()).map(Some))
        .collect();
    if let Some(index) = found {
        return index;
    }
    if REFUSED.load(Ordering::Relaxed) {
        return none;
    }
    let bufs: Vec<(*mut u8, usize)> = slots.iter().map(|s| (s.ptr, s.len)).collect();
    // SAFETY: the slots are the caller's memory, mapped for their lengths for the whole call
    // (the `SlotFeed` contract). The registration may outlive them; it is used again only for
    // memory with the same serial, which names this memory alone (freed memory never gets it
    // back), so no read ever lands in pages that are no longer the slot's.
    match unsafe { lease.ring.register_buffers(&bufs) } {
        Ok(()) => {
            REGISTRATIONS.fetch_add(1, Ordering::Relaxed);
            lease.registered = want;
            (0..slots.len()).map(|i| u16::try_from(i).ok()).collect()
        }
        Err(_) => {
            REFUSED.store(true, Ordering::Relaxed);
            lease.ring.unregister_buffers();
            lease.registered.clear();
            none
        }
    }
}
