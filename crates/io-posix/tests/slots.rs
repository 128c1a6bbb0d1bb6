//! Reads into a caller's slots through the kept io_uring: the slots are registered as fixed
//! buffers once and the registration is reused while they are the same memory (the arenas'
//! serials), so a steady-state load registers nothing, also when loads alternate between two
//! sets of slots; new memory, or a release, registers again; the bytes are right every time.
//!
//! One test in this binary: the registration count is process-wide.

use std::path::PathBuf;
use turboio_device::Arena;
use turboio_io_posix::{release_registered_slots, slot_registrations, PosixStorage};
use turboio_storage::conformance::pattern;
use turboio_storage::{DirectIo, IoOptions, SlotFeed, SlotMemory, SlotRead, StorageError, StorageFile};

/// Slots in page-aligned arenas (as the device pools make them); reads `spans` in order and
/// keeps a copy of each as it is filled.
struct ArenaFeed<'a> {
    arenas: &'a mut [Arena],
    memory: Vec<SlotMemory>,
    spans: Vec<(u64, usize)>,
    next: usize,
    free: Vec<usize>,
    out: Vec<Vec<u8>>,
}

impl<'a> ArenaFeed<'a> {
    fn new(arenas: &'a mut [Arena], spans: Vec<(u64, usize)>) -> Self {
        let memory = arenas
            .iter_mut()
            .map(|a| {
                let serial = Some(a.serial());
                let s = a.as_mut_slice();
                SlotMemory { ptr: s.as_mut_ptr(), len: s.len(), serial }
            })
            .collect();
        let n = arenas.len();
        let out = vec![Vec::new(); spans.len()];
        ArenaFeed { arenas, memory, spans, next: 0, free: (0..n).collect(), out }
    }
}

// SAFETY: the arenas are borrowed for the feed's life and never resized; a slot is handed out
// only from `free`, read here only in `filled`, and free again after.
unsafe impl SlotFeed for ArenaFeed<'_> {
    fn slots(&self) -> usize {
        self.memory.len()
    }

    fn slot_memory(&self, slot: usize) -> SlotMemory {
        self.memory[slot]
    }

    fn slot_mut(&mut self, slot: usize) -> &mut [u8] {
        self.arenas[slot].as_mut_slice()
    }

    fn next(&mut self, wait: bool) -> Result<SlotRead, StorageError> {
        let Some(&(offset, len)) = self.spans.get(self.next) else { return Ok(SlotRead::End) };
        let Some(slot) = self.free.pop() else {
            assert!(!wait, "asked to wait with every slot's read in flight");
            return Ok(SlotRead::Later);
        };
        self.next += 1;
        Ok(SlotRead::Read { slot, offset, len })
    }

    fn filled(&mut self, slot: usize, offset: u64, len: usize) -> Result<(), StorageError> {
        let i = self.spans.iter().position(|&s| s == (offset, len)).expect("a span that was asked for");
        self.out[i] = self.arenas[slot].as_slice()[..len].to_vec();
        self.free.push(slot);
        Ok(())
    }
}

#[test]
fn slots_are_registered_once_and_read_right_every_time() {
    let dir = tempfile::Builder::new()
        .prefix("io-posix-slots-")
        .tempdir_in(PathBuf::from(env!("CARGO_TARGET_TMPDIR")))
        .unwrap();
    let path = dir.path().join("file.bin");
    let len = (9 << 20) + 123;
    let data = pattern(len, 7);
    std::fs::write(&path, &data).unwrap();
    let st = PosixStorage::new();
    let f = st.open_posix(&path).unwrap();
    let opts = IoOptions { direct: DirectIo::On, ..Default::default() };
    if !f.reads_into_slots(&opts) {
        // No io_uring or no O_DIRECT here: the default, one slot at a time, is the conformance
        // suite's to check.
        eprintln!("skipped: this machine reads slots one at a time");
        return;
    }
    let slot = 2 << 20;
    // Aligned chunks, an unaligned head and a tail that ends at the end of the file.
    let spans: Vec<(u64, usize)> =
        vec![(0, slot), (2 << 20, slot), (4 << 20, slot), (6 << 20, slot), (8 << 20, len - (8 << 20)), (4095, 9000)];
    let read = |arenas: &mut [Arena]| -> (usize, &'static str) {
        let before = slot_registrations();
        let mut feed = ArenaFeed::new(arenas, spans.clone());
        let info = f.read_into_slots(&mut feed, &opts).unwrap();
        for (i, &(off, n)) in spans.iter().enumerate() {
            assert!(feed.out[i] == data[off as usize..off as usize + n], "span {off}+{n} differs ({})", info.method);
        }
        assert!(info.direct, "O_DIRECT: {info:?}");
        (slot_registrations() - before, info.method)
    };
    let mut arenas: Vec<Arena> = (0..3).map(|_| Arena::new(slot, false).unwrap()).collect();
    let (first, method) = read(&mut arenas);
    if method != "io_uring, registered buffers" {
        // The kernel refused to register (RLIMIT_MEMLOCK without CAP_IPC_LOCK): plain reads.
        assert_eq!((first, method), (0, "io_uring"));
        eprintln!("registration refused here; the reads were checked without it");
        return;
    }
    assert_eq!(first, 1, "the first read registers its slots");
    assert_eq!(read(&mut arenas), (0, method), "the same slots again: nothing registered");
    // Two of the same slots, in another order: still covered.
    arenas.swap(0, 2);
    assert_eq!(read(&mut arenas[..2]), (0, method), "a subset in another order: nothing registered");
    // New memory (a fresh arena at, possibly, a freed one's address) registers again.
    arenas[1] = Arena::new(slot, false).unwrap();
    assert_eq!(read(&mut arenas), (1, method), "a new slot: registered again");
    // Another set of slots alongside (another GPU's pool): each set is registered once, then
    // loads that alternate between them register nothing.
    let mut other: Vec<Arena> = (0..3).map(|_| Arena::new(slot, false).unwrap()).collect();
    assert_eq!(read(&mut other), (1, method), "a second set of slots: registered on a ring of its own");
    assert_eq!(read(&mut arenas), (0, method), "the first set's ring was kept");
    assert_eq!(read(&mut other), (0, method), "and the second's");
    release_registered_slots();
    assert_eq!(read(&mut arenas), (1, method), "after a release: registered again");
}
