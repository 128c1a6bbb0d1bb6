//! The checks every storage backend's tests run.
//!
//! Call [`run_all`] from a backend's test with a scratch directory the backend can write to
//! and the [`Capabilities`] it has; or call the checks one by one. Each check panics with a
//! message naming the backend and what differed, like any test assertion.
//!
//! Files are created through the backend's own [`Storage::write_file`] so that the suite works
//! for backends whose files live somewhere `std::fs` cannot reach.

use crate::{BytesSource, IoOptions, ReadRequest, SlotFeed, SlotMemory, SlotRead, Storage, StorageError, WriteSource};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// What a backend can do, so the suite checks only what applies.
#[derive(Debug, Clone, Copy)]
pub struct Capabilities {
    /// The scratch directory is a local directory that `std::fs` can list (to check that no
    /// temporary file is left behind after a failed write).
    pub local_dir: bool,
    /// Directories exist: writing into a missing one fails with "not found". Object stores
    /// have key prefixes instead, which need no creating.
    pub directories: bool,
    /// [`Storage::list`] and [`Storage::remove_file`] are implemented.
    pub lists: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities { local_dir: true, directories: true, lists: true }
    }
}

/// Deterministic test bytes: byte `i` of a pattern seeded with `seed`.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Runs every check under `dir` with the given I/O options.
pub fn run_all(storage: &dyn Storage, dir: &Path, caps: Capabilities, opts: &IoOptions<'_>) {
    round_trip(storage, dir, opts);
    odd_offsets(storage, dir, opts);
    empty_and_tiny_files(storage, dir, opts);
    short_file(storage, dir, opts);
    missing_file(storage, dir);
    concurrent_readers(storage, dir, opts);
    hook_sees_every_byte(storage, dir, opts);
    slot_reads(storage, dir, opts);
    overwrite_replaces(storage, dir, opts);
    failed_write_keeps_old_file(storage, dir, caps, opts);
    if caps.lists {
        list_and_remove(storage, dir, caps, opts);
    }
}

fn write(storage: &dyn Storage, path: &Path, data: &[u8], opts: &IoOptions<'_>) {
    storage
        .write_file(path, &BytesSource(data), opts)
        .unwrap_or_else(|e| panic!("{}: write_file({}) failed: {e}", storage.name(), path.display()));
}

fn read_all(storage: &dyn Storage, path: &Path, opts: &IoOptions<'_>) -> Vec<u8> {
    let f = storage.open(path).unwrap_or_else(|e| panic!("{}: open({}) failed: {e}", storage.name(), path.display()));
    let mut buf = vec![0u8; f.len() as usize];
    f.read_ranges(vec![ReadRequest { offset: 0, dst: &mut buf }], opts)
        .unwrap_or_else(|e| panic!("{}: read_ranges of {} failed: {e}", storage.name(), path.display()));
    buf
}

fn scratch(dir: &Path, name: &str) -> PathBuf {
    dir.join(name)
}

/// A multi-chunk file written and read back whole is identical, and its length is right.
pub fn round_trip(storage: &dyn Storage, dir: &Path, opts: &IoOptions<'_>) {
    for (i, len) in [1usize, 4095, 4096, 4097, (3 << 20) + 17, 9 << 20].into_iter().enumerate() {
        let path = scratch(dir, &format!("round_trip_{i}.bin"));
        let data = pattern(len, i as u64 + 1);
        write(storage, &path, &data, opts);
        let f = storage.open(&path).unwrap();
        assert_eq!(f.len(), len as u64, "{}: length of {}", storage.name(), path.display());
        let back = read_all(storage, &path, opts);
        assert!(back == data, "{}: {len}-byte round trip differs", storage.name());
    }
}

/// Ranges at odd offsets and of odd lengths, many per call, in any order, read the right bytes.
pub fn odd_offsets(storage: &dyn Storage, dir: &Path, opts: &IoOptions<'_>) {
    let len = (5 << 20) + 333;
    let path = scratch(dir, "odd_offsets.bin");
    let data = pattern(len, 42);
    write(storage, &path, &data, opts);
    let f = storage.open(&path).unwrap();
    let spans: [(usize, usize); 9] = [
        (0, 1),
        (1, 7),
        (4095, 2),
        (4097, 4096 * 3 + 5),
        (12345, 1 << 20),
        (len - 1, 1),
        (len - 4099, 4099),
        ((2 << 20) - 3, (2 << 20) + 9),
        (777, 0),
    ];
    let mut bufs: Vec<Vec<u8>> = spans.iter().map(|&(_, n)| vec![0xAA; n]).collect();
    let reqs = spans
        .iter()
        .zip(bufs.iter_mut())
        .rev()
        .map(|(&(off, _), b)| ReadRequest { offset: off as u64, dst: b })
        .collect();
    f.read_ranges(reqs, opts).unwrap_or_else(|e| panic!("{}: odd-offset read_ranges failed: {e}", storage.name()));
    for (&(off, n), b) in spans.iter().zip(&bufs) {
        assert!(b[..] == data[off..off + n], "{}: range {off}+{n} differs", storage.name());
    }
    // Single reads through a reader and through the convenience method.
    let mut small = [0u8; 13];
    f.reader().unwrap().read_exact_at(4093, &mut small).unwrap();
    assert_eq!(small[..], data[4093..4106]);
    f.read_exact_at(len as u64 - 13, &mut small).unwrap();
    assert_eq!(small[..], data[len - 13..]);
}

/// Empty files open with length 0 and a zero-length read succeeds; tiny files read whole.
pub fn empty_and_tiny_files(storage: &dyn Storage, dir: &Path, opts: &IoOptions<'_>) {
    let path = scratch(dir, "empty.bin");
    write(storage, &path, &[], opts);
    let f = storage.open(&path).unwrap();
    assert_eq!(f.len(), 0);
    assert!(f.is_empty());
    f.read_ranges(vec![], opts).unwrap();
    f.read_ranges(vec![ReadRequest { offset: 0, dst: &mut [] }], opts).unwrap();
    let path = scratch(dir, "tiny.bin");
    write(storage, &path, b"abc", opts);
    assert_eq!(read_all(storage, &path, opts), b"abc");
}

/// Reading past the end is [`StorageError::ShortFile`], naming the file; never zeros or a hang.
pub fn short_file(storage: &dyn Storage, dir: &Path, opts: &IoOptions<'_>) {
    let path = scratch(dir, "short.bin");
    let data = pattern(10_000, 7);
    write(storage, &path, &data, opts);
    let f = storage.open(&path).unwrap();
    for (off, n) in [(9_990u64, 11usize), (10_000, 1), (20_000, 5), (0, 10_001), (4096, 1 << 20)] {
        let mut buf = vec![0u8; n];
        let err = f
            .read_ranges(vec![ReadRequest { offset: off, dst: &mut buf }], opts)
            .expect_err("reading past the end must fail");
        assert!(
            matches!(err, StorageError::ShortFile { .. }),
            "{}: reading {off}+{n} of a 10000-byte file gave {err:?}, not ShortFile",
            storage.name()
        );
        assert!(err.to_string().contains("short.bin"), "message names the file: {err}");
        let err = f.read_exact_at(off, &mut buf).expect_err("past the end");
        assert!(matches!(err, StorageError::ShortFile { .. }), "{err:?}");
    }
}

/// A missing file is [`StorageError::NotFound`], naming the path.
pub fn missing_file(storage: &dyn Storage, dir: &Path) {
    let path = scratch(dir, "does-not-exist.bin");
    let err = storage.open(&path).expect_err("opening a missing file must fail");
    assert!(err.is_not_found(), "{}: missing file gave {err:?}", storage.name());
    assert!(err.to_string().contains("does-not-exist.bin"), "{err}");
    let path = scratch(dir, "no-such-dir/x.bin");
    let err = storage.open(&path).expect_err("missing directory");
    assert!(err.is_not_found(), "{err:?}");
}

/// Several threads reading the same open file at once each get their own bytes.
pub fn concurrent_readers(storage: &dyn Storage, dir: &Path, opts: &IoOptions<'_>) {
    let len = 3 << 20;
    let path = scratch(dir, "concurrent.bin");
    let data = pattern(len, 99);
    write(storage, &path, &data, opts);
    let f = storage.open(&path).unwrap();
    std::thread::scope(|s| {
        for t in 0..4usize {
            let f = &f;
            let data = &data;
            s.spawn(move || {
                let mut reader = f.reader().unwrap();
                for k in 0..50usize {
                    let off = (t * 7919 + k * 104_729) % (len - 70_000);
                    let n = 1 + (k * 977) % 65_536;
                    let mut buf = vec![0u8; n];
                    reader.read_exact_at(off as u64, &mut buf).unwrap();
                    assert!(buf[..] == data[off..off + n], "thread {t} read {off}+{n} wrong");
                }
                let mut whole = vec![0u8; len];
                f.read_ranges(vec![ReadRequest { offset: 0, dst: &mut whole }], opts).unwrap();
                assert!(whole == *data, "thread {t}: whole-file read differs");
            });
        }
    });
}

/// The per-chunk hook runs on every byte exactly once, with the right offsets, and what it
/// does to the bytes is what the caller sees.
pub fn hook_sees_every_byte(storage: &dyn Storage, dir: &Path, opts: &IoOptions<'_>) {
    let len = (4 << 20) + 4097;
    let path = scratch(dir, "hook.bin");
    let data = pattern(len, 5);
    write(storage, &path, &data, opts);
    let f = storage.open(&path).unwrap();
    let seen = AtomicU64::new(0);
    let hook = |off: u64, buf: &mut [u8]| {
        seen.fetch_add(buf.len() as u64, Ordering::Relaxed);
        for (i, b) in buf.iter_mut().enumerate() {
            *b ^= ((off + i as u64) % 253) as u8;
        }
        Ok(())
    };
    let hooked = IoOptions { hook: Some(&hook), ..*opts };
    let mut a = vec![0u8; 1 << 20];
    let mut b = vec![0u8; len - (1 << 20) - 3];
    f.read_ranges(vec![ReadRequest { offset: 3, dst: &mut b }, ReadRequest { offset: 1, dst: &mut a }], &hooked)
        .unwrap();
    assert_eq!(seen.load(Ordering::Relaxed), (a.len() + b.len()) as u64);
    for (i, x) in a.iter().enumerate() {
        let off = 1 + i;
        assert_eq!(*x, data[off] ^ ((off % 253) as u8), "hooked byte {off}");
    }
    for (i, x) in b.iter().enumerate() {
        let off = 3 + i;
        assert_eq!(*x, data[off] ^ ((off % 253) as u8), "hooked byte {off}");
    }
}

/// Writing over an existing file replaces it completely, also with a shorter one.
pub fn overwrite_replaces(storage: &dyn Storage, dir: &Path, opts: &IoOptions<'_>) {
    let path = scratch(dir, "overwrite.bin");
    write(storage, &path, &pattern(3 << 20, 1), opts);
    let second = pattern(1000, 2);
    write(storage, &path, &second, opts);
    assert_eq!(read_all(storage, &path, opts), second);
}

struct FailingSource {
    len: u64,
    fail_at: u64,
}

impl WriteSource for FailingSource {
    fn len(&self) -> u64 {
        self.len
    }

    fn fill(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
        if offset + dst.len() as u64 > self.fail_at {
            return Err(format!("tensor bytes are short at offset {}", self.fail_at));
        }
        dst.fill(0x5A);
        Ok(())
    }
}

/// A write whose source fails midway leaves the previous file intact and, where the directory
/// can be listed, no temporary file behind. A write into a missing directory fails cleanly.
pub fn failed_write_keeps_old_file(storage: &dyn Storage, dir: &Path, caps: Capabilities, opts: &IoOptions<'_>) {
    let sub = scratch(dir, "failed_write");
    if caps.local_dir {
        std::fs::create_dir_all(&sub).unwrap();
    }
    let path = sub.join("model.bin");
    let old = pattern(2 << 20, 11);
    write(storage, &path, &old, opts);
    let listing = |d: &Path| -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    let before = if caps.local_dir { listing(&sub) } else { vec![] };
    for fail_at in [0u64, 1 << 20, (6 << 20) - 1] {
        let src = FailingSource { len: 6 << 20, fail_at };
        let err = storage.write_file(&path, &src, opts).expect_err("the source fails");
        assert!(matches!(err, StorageError::Source { .. }), "{}: a failing source gave {err:?}", storage.name());
        assert!(err.to_string().contains("short"), "the source's message is kept: {err}");
        assert_eq!(read_all(storage, &path, opts), old, "{}: old file changed", storage.name());
        if caps.local_dir {
            assert_eq!(listing(&sub), before, "{}: a temporary file was left behind", storage.name());
        }
    }
    if caps.directories {
        let err = storage
            .write_file(&scratch(dir, "missing-dir/x.bin"), &BytesSource(b"abc"), opts)
            .expect_err("the directory does not exist");
        assert!(err.is_not_found(), "{err:?}");
    }
}

/// [`Storage::list`] gives the files directly in a directory (not those of its subdirectories),
/// as full paths, sorted; [`Storage::remove_file`] removes one, and removing a missing file is
/// not an error.
pub fn list_and_remove(storage: &dyn Storage, dir: &Path, caps: Capabilities, opts: &IoOptions<'_>) {
    let sub = scratch(dir, "listing");
    if caps.local_dir {
        std::fs::create_dir_all(sub.join("nested")).unwrap();
    }
    for name in ["b.bin", "a.safetensors", "nested/c.bin"] {
        write(storage, &sub.join(name), name.as_bytes(), opts);
    }
    let listed = storage.list(&sub).unwrap_or_else(|e| panic!("{}: list failed: {e}", storage.name()));
    assert_eq!(listed, vec![sub.join("a.safetensors"), sub.join("b.bin")], "{}: listing", storage.name());
    storage.remove_file(&sub.join("b.bin")).unwrap();
    assert!(storage.open(&sub.join("b.bin")).expect_err("removed").is_not_found());
    storage.remove_file(&sub.join("b.bin")).expect("removing a missing file is not an error");
    assert_eq!(storage.list(&sub).unwrap(), vec![sub.join("a.safetensors")]);
    assert_eq!(read_all(storage, &sub.join("nested/c.bin"), opts), b"nested/c.bin");
}

/// A [`SlotFeed`] for the suite: reads `spans` (offset, length) into `slots` slots, copies each
/// filled slot out to `out` at once (so its slot is free again), and can fail its `fail_at`th
/// `filled`.
struct TestFeed {
    slots: Vec<Vec<u8>>,
    spans: Vec<(u64, usize)>,
    next: usize,
    /// Slots handed out and not filled yet: (slot, span index).
    reading: Vec<(usize, usize)>,
    free: Vec<usize>,
    out: Vec<Option<Vec<u8>>>,
    filled: usize,
    fail_at: Option<usize>,
}

impl TestFeed {
    fn new(slots: usize, slot_len: usize, spans: Vec<(u64, usize)>, fail_at: Option<usize>) -> TestFeed {
        let out = vec![None; spans.len()];
        TestFeed {
            slots: (0..slots).map(|_| vec![0xAA; slot_len]).collect(),
            spans,
            next: 0,
            reading: Vec::new(),
            free: (0..slots).collect(),
            out,
            filled: 0,
            fail_at,
        }
    }
}

// SAFETY: each slot is a `Vec` this feed owns for its whole life and never resizes; a slot is
// handed out only from `free` and is read here only in `filled`, after which it is free again.
#[allow(unsafe_code)]
unsafe impl SlotFeed for TestFeed {
    fn slots(&self) -> usize {
        self.slots.len()
    }

    fn slot_memory(&self, slot: usize) -> SlotMemory {
        // The pointer of a Vec the feed owns and never resizes; nothing here reads through it
        // while the slot is out.
        let v = &self.slots[slot];
        SlotMemory { ptr: v.as_ptr().cast_mut(), len: v.len(), serial: None }
    }

    fn slot_mut(&mut self, slot: usize) -> &mut [u8] {
        self.slots.get_mut(slot).map_or(&mut [], |v| &mut v[..])
    }

    fn next(&mut self, wait: bool) -> crate::Result<SlotRead> {
        let Some(&(offset, len)) = self.spans.get(self.next) else { return Ok(SlotRead::End) };
        let Some(slot) = self.free.pop() else {
            // Slots come back in `filled`, so a feed told to wait would wait forever.
            assert!(!wait, "asked to wait with every slot's read in flight");
            return Ok(SlotRead::Later);
        };
        self.reading.push((slot, self.next));
        self.next += 1;
        Ok(SlotRead::Read { slot, offset, len })
    }

    fn filled(&mut self, slot: usize, offset: u64, len: usize) -> crate::Result<()> {
        let at = self.reading.iter().position(|&(s, _)| s == slot).expect("filled a slot that was not handed out");
        let (_, span) = self.reading.swap_remove(at);
        assert_eq!(self.spans[span], (offset, len), "filled says another read than was asked for");
        self.filled += 1;
        if Some(self.filled) == self.fail_at {
            return Err(StorageError::Unsupported { backend: "feed", what: "the feed failed on purpose".into() });
        }
        self.out[span] = Some(self.slots[slot][..len].to_vec());
        self.free.push(slot);
        Ok(())
    }
}

/// [`StorageFile::read_into_slots`] reads every span a feed asks for into its slots (odd
/// offsets and lengths, more spans than slots), tells the feed once per read, stops at a
/// read past the end with an error, and returns an error the feed gave.
pub fn slot_reads(storage: &dyn Storage, dir: &Path, opts: &IoOptions<'_>) {
    let name = storage.name();
    let len = (6 << 20) + 777;
    let path = scratch(dir, "slot_reads.bin");
    let data = pattern(len, 91);
    write(storage, &path, &data, opts);
    let f = storage.open(&path).unwrap();
    let slot = 1 << 20;
    let mut spans: Vec<(u64, usize)> = (0..6).map(|i| ((i << 20) as u64, slot)).collect();
    spans.extend([(4095u64, 4098usize), (13, slot - 13), ((6 << 20) as u64, 777), (12345, 1)]);
    let mut feed = TestFeed::new(3, slot, spans.clone(), None);
    f.read_into_slots(&mut feed, opts).unwrap_or_else(|e| panic!("{name}: read_into_slots failed: {e}"));
    for (i, &(off, n)) in spans.iter().enumerate() {
        let got = feed.out[i].as_deref().unwrap_or_else(|| panic!("{name}: span {off}+{n} was never filled"));
        assert!(got == &data[off as usize..off as usize + n], "{name}: span {off}+{n} differs");
    }
    assert_eq!(feed.filled, spans.len(), "{name}: one `filled` per read");

    // A read past the end fails the call, naming the file; nothing more is asked for after it.
    let mut feed = TestFeed::new(2, slot, vec![(0, 4096), ((len - 10) as u64, 20), (0, 4096), (0, 4096)], None);
    let e = f.read_into_slots(&mut feed, opts).expect_err("a read past the end");
    assert!(e.to_string().contains("slot_reads.bin"), "{name}: the error names the file: {e}");
    assert!(feed.next <= 3, "{name}: reads were asked for after the failure");

    // The feed's own error ends the call with it: no read is handed to the feed after it.
    let mut feed = TestFeed::new(2, slot, spans, Some(2));
    let e = f.read_into_slots(&mut feed, opts).expect_err("the feed failed");
    assert!(e.to_string().contains("on purpose"), "{name}: the feed's error comes back: {e}");
    assert_eq!(feed.filled, 2, "{name}: the feed was told of reads after its error");
}
