//! Reads into a caller's slots ([`StorageFile::read_into_slots`](turboio_storage::StorageFile::read_into_slots)):
//! `O_DIRECT` through an io_uring kept for the process, with the slots registered as its fixed
//! buffers.
//!
//! A staged GPU load reads a cold file into pinned slots and starts each slot's device copy the
//! moment its read completes. Each reader's thread keeps a read in flight for every free slot of
//! its own (the disk sees a deep queue of large reads; the kernel splits each and queues its
//! parts at once) and sleeps in the kernel between completions. Registering the slots
//! (`IORING_REGISTER_BUFFERS`) spares the kernel pinning and unpinning every page of every read
//! (the `O_DIRECT` ceiling of `bench --gpu-model` spends 0.01 s of CPU per GB with it, 0.06-0.09
//! without); registering is itself costly (256 MiB of slots: 6-10 ms to register, 3-4 ms to
//! unregister on the 2-vCPU VM), so rings and their registrations are kept between calls and
//! reused while the caller's slots are the same memory, which [`SlotMemory::serial`] says: a
//! steady-state load registers nothing.
//!
//! Up to [`MAX_KEPT`] idle rings are kept, each registered for one set of slots (a staged load
//! has a ring per reader, and a process loading into several GPUs one pool of slots per GPU).
//! The kernel holds the registered pages until a registration is replaced or dropped, even once
//! the caller has freed them; [`release_registered_slots`] drops them all (a caller that frees
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

/// Idle rings kept, each with its registration (one per set of slots in use: a staged load has
/// a ring per reader, each with its own slots, and a process loading into several GPUs a pool
/// per GPU; 16 readers for each of 4 GPUs).
const MAX_KEPT: usize = 64;

/// The idle rings, oldest first; a call takes the one registered for its slots (or makes one)
/// and gives it back.
static KEPT: Mutex<Vec<Lease>> = Mutex::new(Vec::new());
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
    let kept = std::mem::take(&mut *KEPT.lock().unwrap_or_else(|p| p.into_inner()));
    drop(kept);
}

/// A ring with room for `depth` requests, with `slots` registered where every one of them has a
/// serial: a kept ring of this process, deep enough, whose registration covers the same memory
/// if there is one; else a new ring (or, with [`MAX_KEPT`] kept, the oldest, registered anew).
pub(crate) fn take(depth: u32, slots: &[SlotMemory]) -> io::Result<Lease> {
    let pid = std::process::id();
    let want = wanted(slots);
    let picked = {
        let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
        // Rings inherited through fork are the parent's: never used here.
        kept.retain(|l| l.pid == pid);
        let fits = |l: &Lease| l.ring.depth() >= depth as usize;
        let covering = want.as_ref().and_then(|w| kept.iter().position(|l| fits(l) && covers(l, w).is_some()));
        match covering {
            Some(i) => Some(kept.remove(i)),
            None if kept.len() >= MAX_KEPT => kept.iter().position(fits).map(|i| kept.remove(i)),
            None => None,
        }
    };
    let mut lease = match picked {
        Some(l) => l,
        None => Lease { ring: Ring::new(depth)?, registered: Vec::new(), index: Vec::new(), pid },
    };
    lease.index = register(&mut lease, slots, want);
    Ok(lease)
}

/// Gives the ring back for the next call.
pub(crate) fn give_back(lease: Lease) {
    if lease.ring.in_flight() == 0 {
        let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
        kept.push(lease);
        if kept.len() > MAX_KEPT {
            kept.remove(0);
        }
    }
}

/// The slots as they would be registered; `None` when one has no serial (never registered).
fn wanted(slots: &[SlotMemory]) -> Option<Vec<Registered>> {
    slots.iter().map(|s| s.serial.map(|serial| Registered { serial, addr: s.ptr as usize, len: s.len })).collect()
}

/// Each wanted slot's index in the lease's registration, if it covers them all.
fn covers(lease: &Lease, want: &[Registered]) -> Option<Vec<Option<u16>>> {
    want.iter()
        .map(|w| lease.registered.iter().position(|r| r == w).and_then(|i| u16::try_from(i).ok()).map(Some))
        .collect()
}

/// Each slot's registered index, registering the slots when the lease's registration does not
/// already cover them; all `None` when they cannot be (a slot without a serial, too many, the
/// kernel refuses).
fn register(lease: &mut Lease, slots: &[SlotMemory], want: Option<Vec<Registered>>) -> Vec<Option<u16>> {
    let none = vec![None; slots.len()];
    let Some(want) = want else { return none };
    if want.is_empty() || want.len() > MAX_REGISTERED {
        return none;
    }
    if let Some(index) = covers(lease, &want) {
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
