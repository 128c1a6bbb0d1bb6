//! Zero-copy loads: private writable file mappings populated from the page cache.

use super::advise_parallel;
use crate::sys::{touch_pages, RawMap};
use crate::{Allocation, DeviceError, DeviceId, Result};
use nix::errno::Errno;
use nix::sys::mman::MmapAdvise;
use std::any::Any;
use std::fs::File;

/// Bytes per `MADV_WILLNEED` call over a range: the kernel reads at most
/// `max(read_ahead_kb, max_sectors_kb)` per call (`force_page_cache_ra`), commonly 128 KiB to a
/// few MiB, so longer ranges are asked for a piece at a time.
const WILL_NEED_STEP: usize = 512 << 10;

/// A file mapped privately (`MAP_PRIVATE`, readable and writable).
///
/// Reading a page shares it with the page cache; writing one gives this mapping its own copy
/// (copy-on-write), so the file on disk never changes. See the crate docs for the one hazard (a
/// file truncated in place while mapped).
#[derive(Debug)]
pub struct FileMapping {
    map: RawMap,
}

impl FileMapping {
    /// Maps the first `len` bytes of `file` (`len` > 0). Nothing is read yet.
    pub fn new(file: &File, len: usize) -> Result<FileMapping> {
        let map = RawMap::file_private(file, len).map_err(|source| DeviceError::Map { op: "mmap", source })?;
        Ok(FileMapping { map })
    }

    /// Maps every page now with `MADV_POPULATE_READ`, split over `threads` threads. For a file
    /// in the page cache this only fills page tables (no copy); pages not cached are read from
    /// disk. Kernels older than 5.14 lack the call; every page is then touched instead.
    ///
    /// Fails (instead of raising `SIGBUS` later) if the file has shrunk under the mapping.
    pub fn populate(&self, threads: usize) -> Result<()> {
        self.populate_with(threads, false)
    }

    /// Like [`populate`](Self::populate), for a file that is mostly not in the page cache:
    /// first asks the kernel to read the whole range ahead (`MADV_WILLNEED`, which queues the
    /// reads of every missing page at once, a deep queue for the disk), then maps every page.
    /// Pages another process is already reading are waited for, not read again, so several
    /// processes populating the same file read it from the disk about once.
    ///
    /// Populating faults one page at a time and leaves read-ahead to the fault path, which
    /// keeps only a few small reads in flight; measured here (2 GiB, cold, 2 threads), asking
    /// for the whole range first was 1.5-3x faster.
    pub fn populate_cold(&self, threads: usize) -> Result<()> {
        self.populate_with(threads, true)
    }

    /// [`populate`](Self::populate) (or, with `cold`, [`populate_cold`](Self::populate_cold))
    /// of some byte ranges `(offset, len)` of the mapping only: a load of a few of a file's
    /// tensors reads their pages and nothing else. The ranges are cut into pieces that
    /// `threads` threads take in turn; a cold populate asks for every range first.
    pub fn populate_ranges(&self, ranges: &[(usize, usize)], threads: usize, cold: bool) -> Result<()> {
        const PIECE: usize = 8 << 20;
        let len = self.map.len();
        let pieces: Vec<(usize, usize)> = ranges
            .iter()
            .map(|&(at, n)| (at.min(len), at.saturating_add(n).min(len)))
            .flat_map(|(start, end)| (start..end).step_by(PIECE).map(move |at| (at, PIECE.min(end - at))))
            .collect();
        // Cold: no read-around on the faults (the kernel would read its whole read-ahead window,
        // often MiBs, around each range); every range is asked for first instead. Otherwise the
        // faults keep their read-around: "hot" is decided for the whole file, and ranges of a
        // half-cached file may not be (a model streamed in groups of tensors: each group after
        // the first finds the file half cached but its own pages not), where faults without
        // read-around would read one page each (measured: 3-4x slower). Advisory, as the rest.
        if cold {
            let _ = self.map.advise(0, len, MmapAdvise::MADV_RANDOM);
            self.will_need_ranges(ranges);
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        let map = &self.map;
        let work = || -> std::io::Result<()> {
            while let Some(&(at, n)) = pieces.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                match map.advise(at, n, MmapAdvise::MADV_POPULATE_READ) {
                    Ok(()) if !cold => {}
                    // Kernels before 5.14 (and cold pieces, see populate_and_touch): read a
                    // byte of every page.
                    Ok(()) => touch_pages(&map.as_slice()[at..at + n]),
                    Err(e) if e.raw_os_error() == Some(Errno::EINVAL as i32) => {
                        touch_pages(&map.as_slice()[at..at + n])
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        };
        let parts = threads.clamp(1, pieces.len().max(1));
        let result = std::thread::scope(|s| {
            let handles: Vec<_> = (1..parts).map(|_| s.spawn(work)).collect();
            let first = work();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(std::io::Error::other("populate thread panicked"))))
                .fold(first, |acc, r| acc.and(r))
        });
        result.map_err(|source| DeviceError::Map { op: "madvise(MADV_POPULATE_READ)", source })
    }

    /// Asks the kernel to read the whole file into the page cache, without waiting for it
    /// (`MADV_WILLNEED`; advisory: a kernel that ignores it only loses the speed-up).
    pub fn will_need(&self) {
        let _ = self.map.advise(0, self.map.len(), MmapAdvise::MADV_WILLNEED);
    }

    /// [`will_need`](Self::will_need) of some byte ranges `(offset, len)` only, asked for in
    /// steps of `WILL_NEED_STEP` (512 KiB): the kernel reads at most its read-ahead window (or the
    /// device's largest request) per call and silently drops the rest of a longer range.
    pub fn will_need_ranges(&self, ranges: &[(usize, usize)]) {
        for &(at, n) in ranges {
            let end = at.saturating_add(n).min(self.map.len());
            for step in (at..end).step_by(WILL_NEED_STEP) {
                // Advisory: a kernel that ignores it only loses the speed-up.
                let _ = self.map.advise(step, WILL_NEED_STEP.min(end - step), MmapAdvise::MADV_WILLNEED);
            }
        }
    }

    fn populate_with(&self, threads: usize, read_ahead: bool) -> Result<()> {
        if read_ahead {
            // Advisory: a kernel or file system that ignores it only loses the speed-up.
            let _ = self.map.advise(0, self.map.len(), MmapAdvise::MADV_WILLNEED);
            return self.populate_and_touch(threads);
        }
        match advise_parallel(&self.map, MmapAdvise::MADV_POPULATE_READ, threads) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(Errno::EINVAL as i32) => {
                touch_pages(self.map.as_slice());
                Ok(())
            }
            Err(source) => Err(DeviceError::Map { op: "madvise(MADV_POPULATE_READ)", source }),
        }
    }

    /// The cold populate: `threads` threads each take a contiguous part of the file and, piece
    /// by piece as the read-ahead delivers it, map the piece (`MADV_POPULATE_READ`) and read one
    /// byte of each of its pages.
    ///
    /// Why the read: on virtual machines whose memory the host backs lazily (free page
    /// reporting, ballooning; the machines this project is measured on), the first CPU access
    /// to a page the disk has just filled costs several microseconds (the host maps it into the
    /// guest), whoever makes it. Measured here on a cold 4.3 GB model (9 shards, 2 vCPUs): paid
    /// by the user's first pass over the tensors on one thread, that pass took 3-10 s after a
    /// 2.2-2.8 s load; paid here, on every thread and overlapped with the reads still in
    /// flight, the load took 3.3-3.6 s and that first pass 0.03-0.1 s. On bare metal the read
    /// costs about 0.1 us per page, noise beside a cold read. Hot populates (the file already in
    /// the page cache) do not read.
    fn populate_and_touch(&self, threads: usize) -> Result<()> {
        const PIECE: usize = 8 << 20;
        let len = self.map.len();
        let parts = threads.max(1).min(len.div_ceil(PIECE)).max(1);
        let step = len.div_ceil(parts).next_multiple_of(PIECE);
        let map = &self.map;
        let work = move |start: usize| -> std::io::Result<()> {
            let end = (start + step).min(len);
            let mut at = start;
            while at < end {
                let n = PIECE.min(end - at);
                match map.advise(at, n, MmapAdvise::MADV_POPULATE_READ) {
                    Ok(()) => {}
                    // Kernels before 5.14: the read below faults the pages in.
                    Err(e) if e.raw_os_error() == Some(Errno::EINVAL as i32) => {}
                    Err(e) => return Err(e),
                }
                touch_pages(&map.as_slice()[at..at + n]);
                at += n;
            }
            Ok(())
        };
        let result = std::thread::scope(|s| {
            let handles: Vec<_> = (1..parts).map(|i| s.spawn(move || work(i * step))).collect();
            let first = work(0);
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(std::io::Error::other("populate thread panicked"))))
                .fold(first, |acc, r| acc.and(r))
        });
        result.map_err(|source| DeviceError::Map { op: "madvise(MADV_POPULATE_READ)", source })
    }

    /// Mapped bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Never true: empty files are not mapped.
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.map.as_slice()
    }

    /// The bytes, writable (each page written is copied first).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.map.as_mut_slice()
    }
}

impl Allocation for FileMapping {
    fn len(&self) -> usize {
        self.map.len()
    }

    fn device(&self) -> DeviceId {
        DeviceId::CPU
    }

    fn host(&self) -> Option<&[u8]> {
        Some(self.as_slice())
    }

    fn host_mut(&mut self) -> Option<&mut [u8]> {
        Some(self.as_mut_slice())
    }

    fn address(&self) -> u64 {
        self.map.addr() as u64
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn mapping_is_private_and_copy_on_write() {
        let dir = std::env::temp_dir().join(format!("turboio-map-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        let data: Vec<u8> = (0..(3 << 20) + 5).map(|i| (i % 251) as u8).collect();
        std::fs::File::create(&path).unwrap().write_all(&data).unwrap();
        let file = File::open(&path).unwrap();
        let mut m = FileMapping::new(&file, data.len()).unwrap();
        assert_eq!(m.as_slice().as_ptr() as usize % (2 << 20), 0, "mappings start on a huge-page boundary");
        m.populate(2).unwrap();
        assert!(m.as_slice() == &data[..]);
        m.as_mut_slice()[10] = 99;
        assert_eq!(m.as_slice()[10], 99);
        drop(m);
        assert_eq!(std::fs::read(&path).unwrap(), data, "the file is unchanged");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn populate_fails_cleanly_on_a_truncated_file() {
        let dir = std::env::temp_dir().join(format!("turboio-trunc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        std::fs::write(&path, vec![1u8; 1 << 20]).unwrap();
        let file = File::open(&path).unwrap();
        let m = FileMapping::new(&file, 1 << 20).unwrap();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(4096).unwrap();
        let err = m.populate(1).unwrap_err();
        assert!(err.to_string().contains("MADV_POPULATE_READ"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn empty_file_is_refused() {
        let dir = std::env::temp_dir().join(format!("turboio-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("e.bin");
        std::fs::write(&path, b"").unwrap();
        let file = File::open(&path).unwrap();
        assert!(FileMapping::new(&file, 0).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
