//! A remote file being loaded and written through to its cache entry at the same time.

use crate::entries::{KeyLock, NodeCache, Slot};
use crate::ranges::Ranges;
use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use turboio_storage::{IoOptions, RangeReader, ReadRequest, Result, StorageFile};

/// The most bytes a fill left incomplete by its load fetches by itself when the file is
/// dropped, to publish the entry anyway (a `.pt` load skips the zip's record headers and
/// directory): at most this, and at most an eighth of the object.
const MAX_GAP_FILL: u64 = 16 << 20;
/// ... in at most this many ranges (fetched together, as one bulk read of the backend).
const MAX_GAPS: usize = 4096;

pub(crate) struct Filling {
    inner: Box<dyn StorageFile>,
    url: String,
    tag: String,
    slot: Slot,
    cache: NodeCache,
    part_path: PathBuf,
    part: File,
    /// The same file opened with `O_DIRECT` (where the file system allows it): aligned chunks
    /// go to the disk from the load's own memory, with no copy into the page cache and no CPU
    /// spent on one; others through `part`.
    direct: Option<File>,
    state: Mutex<State>,
}

/// True if `a` and `b` are the same file (device and inode).
fn same_file(a: &File, b: &File) -> bool {
    use std::os::unix::fs::MetadataExt;
    matches!((a.metadata(), b.metadata()), (Ok(x), Ok(y)) if x.dev() == y.dev() && x.ino() == y.ino())
}

/// `O_DIRECT`'s alignment (offsets, lengths and memory addresses), as the local backend uses.
const DIRECT_ALIGN: usize = 4096;

struct State {
    covered: Ranges,
    /// Published or abandoned: nothing more is written.
    done: bool,
    lock: Option<KeyLock>,
}

impl fmt::Debug for Filling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Filling").field("inner", &self.inner).field("part", &self.part_path).finish_non_exhaustive()
    }
}

impl Filling {
    /// Starts filling `slot` from `inner` (whose lock the caller holds).
    pub(crate) fn start(
        inner: Box<dyn StorageFile>,
        url: String,
        tag: String,
        slot: Slot,
        cache: NodeCache,
        mut lock: KeyLock,
    ) -> std::result::Result<Filling, (Box<dyn StorageFile>, std::io::Error)> {
        let (part_path, part) = match slot.start_part(&mut lock) {
            Ok(made) => made,
            Err(e) => return Err((inner, e)),
        };
        crate::filling_here(&slot.key, true);
        // The part file has the object's length from the start (a sparse file): the chunks,
        // which arrive in any order, are then writes inside the file, which ext4 runs without
        // the serialised size updates of writes past its end.
        let _ = part.set_len(inner.len());
        use std::os::unix::fs::OpenOptionsExt;
        let direct = File::options()
            .write(true)
            .custom_flags((nix::fcntl::OFlag::O_DIRECT | nix::fcntl::OFlag::O_NOFOLLOW).bits())
            .open(&part_path)
            .ok()
            .filter(|d| same_file(d, &part));
        let f = Filling {
            inner,
            url,
            tag,
            slot,
            cache,
            part_path,
            part,
            direct,
            state: Mutex::new(State { covered: Ranges::default(), done: false, lock: Some(lock) }),
        };
        if f.inner.is_empty() {
            f.publish();
        }
        Ok(f)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes bytes just read into the entry; the last missing ones publish it. A failure
    /// (a full disk) abandons the entry, never the load.
    fn record(&self, offset: u64, bytes: &[u8]) {
        if bytes.is_empty() || self.state().done {
            return;
        }
        let aligned = |n: usize| n.is_multiple_of(DIRECT_ALIGN);
        let written = match &self.direct {
            Some(d) if aligned(offset as usize) && aligned(bytes.len()) && aligned(bytes.as_ptr() as usize) => {
                d.write_all_at(bytes, offset)
            }
            _ => self.part.write_all_at(bytes, offset).inspect(|()| {
                crate::sys::start_writeback(&self.part, offset, bytes.len() as u64);
            }),
        };
        if let Err(e) = written {
            crate::warn(&self.cache, &format!("writing {}: {e}", self.part_path.display()));
            self.abandon();
            return;
        }
        let complete = {
            let mut st = self.state();
            if st.done {
                return;
            }
            st.covered.insert(offset, offset + bytes.len() as u64);
            st.covered.covered() >= self.inner.len()
        };
        if complete {
            self.publish();
        }
    }

    /// Makes the entry durable and visible: data synced, description written, the part renamed
    /// to the entry's name, the directory synced; then the key's lock is released.
    fn publish(&self) {
        let mut st = self.state();
        if st.done {
            return;
        }
        st.done = true;
        let result = publish_part(&self.slot, &self.part, &self.part_path, &self.url, &self.tag, self.inner.len());
        if let Err(e) = &result {
            crate::warn(&self.cache, &format!("publishing {}: {e}", self.slot.data().display()));
            let _ = std::fs::remove_file(&self.part_path);
        }
        st.lock.take();
        crate::filling_here(&self.slot.key, false);
        drop(st);
        if result.is_ok() {
            self.cache.drop_superseded(&self.url, &self.slot.key);
            self.cache.enforce_limit(&self.slot.key);
        }
    }

    fn abandon(&self) {
        let mut st = self.state();
        if st.done {
            return;
        }
        st.done = true;
        let _ = std::fs::remove_file(&self.part_path);
        st.lock.take();
        crate::filling_here(&self.slot.key, false);
    }
}

/// Makes a complete part file an entry: data synced, description written, renamed to the
/// entry's name, the directory synced.
pub(crate) fn publish_part(
    slot: &Slot,
    part: &File,
    part_path: &Path,
    url: &str,
    tag: &str,
    len: u64,
) -> std::io::Result<()> {
    part.sync_data()?;
    // A shared cache records the bytes' hash, which every first use there checks.
    let sha256 = if slot.shared { Some(crate::entries::sha256_of(part)?) } else { None };
    slot.write_meta(url, tag, len, sha256)?;
    std::fs::rename(part_path, slot.data())?;
    File::open(&slot.dir)?.sync_all()
}

impl Drop for Filling {
    fn drop(&mut self) {
        let gaps = {
            let st = self.state();
            if st.done {
                return;
            }
            st.covered.gaps(self.inner.len())
        };
        let missing: u64 = gaps.iter().map(|(s, e)| e - s).sum();
        if missing <= MAX_GAP_FILL.min(self.inner.len() / 8) && gaps.len() <= MAX_GAPS {
            // One bulk read (the backend keeps its requests in flight); each range lands in the
            // entry through `record`, the last one publishes it.
            let mut bufs: Vec<Vec<u8>> = gaps.iter().map(|(s, e)| vec![0u8; (e - s) as usize]).collect();
            let requests =
                gaps.iter().zip(bufs.iter_mut()).map(|(&(s, _), b)| ReadRequest { offset: s, dst: b }).collect();
            let hook = |offset: u64, bytes: &mut [u8]| {
                self.record(offset, bytes);
                Ok(())
            };
            let _ = self.inner.read_ranges(requests, &IoOptions { hook: Some(&hook), ..Default::default() });
        }
        self.abandon();
    }
}

/// Chunks a load has received and not yet written to the entry, at most (each up to a part,
/// 8 MiB by default): beyond it the threads running the hook wait for the writer.
const WRITE_BEHIND: usize = 16;

/// A chunk received into the caller's memory, to be written to the entry.
struct Received {
    offset: u64,
    ptr: *const u8,
    len: usize,
}

// SAFETY: `Received` is a borrowed view of a chunk of the caller's destination, sent to the
// writer thread of `read_writing_behind`; the memory stays valid and unchanged until that
// thread has been joined (see there), so reading it from another thread is sound.
#[allow(unsafe_code)] // the write-behind's hand-over of a borrowed chunk, no FFI
unsafe impl Send for Received {}

impl Filling {
    /// A bulk read whose chunks are written to the entry by a thread of its own while the
    /// load goes on, instead of on the thread that runs the hook: that thread hands out the
    /// backend's next requests (or, for a backend that reads on the caller's threads, drives
    /// several at once), and a write (milliseconds for a part) would hold them back. Only for
    /// reads without a caller's hook (nothing modifies a chunk after the backend has filled
    /// it); the writer is joined before this returns.
    fn read_writing_behind(
        &self,
        requests: Vec<ReadRequest<'_>>,
        opts: &IoOptions<'_>,
    ) -> Result<turboio_storage::ReadInfo> {
        std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<Received>(WRITE_BEHIND);
            let writer = s.spawn(move || {
                for r in rx {
                    // SAFETY: `r` points at a chunk of a destination of `requests`, which the
                    // caller lends for the whole of this call: this thread is joined before
                    // the call returns, and the backend writes a chunk's bytes only before it
                    // runs the hook on them (the `IoOptions::hook` contract), so they are valid
                    // and no longer written while this reads them.
                    #[allow(unsafe_code)] // as above
                    let bytes = unsafe { std::slice::from_raw_parts(r.ptr, r.len) };
                    self.record(r.offset, bytes);
                }
            });
            let hook = |offset: u64, bytes: &mut [u8]| {
                let chunk = Received { offset, ptr: bytes.as_ptr(), len: bytes.len() };
                if tx.send(chunk).is_err() {
                    // The writer is gone (only if it panicked): written here.
                    self.record(offset, bytes);
                }
                Ok(())
            };
            let result = self.inner.read_ranges_reported(requests, &IoOptions { hook: Some(&hook), ..*opts });
            drop(tx);
            if writer.join().is_err() {
                self.abandon();
            }
            result
        })
    }
}

struct Reader<'a> {
    inner: Box<dyn RangeReader + 'a>,
    file: &'a Filling,
}

impl RangeReader for Reader<'_> {
    fn read_exact_at(&mut self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.inner.read_exact_at(offset, dst)?;
        self.file.record(offset, dst);
        Ok(())
    }
}

impl StorageFile for Filling {
    fn served_by(&self) -> Option<&'static str> {
        Some("node cache: miss, written through")
    }

    fn path(&self) -> &Path {
        self.inner.path()
    }

    fn len(&self) -> u64 {
        self.inner.len()
    }

    fn reader(&self) -> Result<Box<dyn RangeReader + '_>> {
        Ok(Box::new(Reader { inner: self.inner.reader()?, file: self }))
    }

    fn read_ranges(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<()> {
        self.read_ranges_reported(requests, opts).map(|_| ())
    }

    fn read_ranges_reported(
        &self,
        requests: Vec<ReadRequest<'_>>,
        opts: &IoOptions<'_>,
    ) -> Result<turboio_storage::ReadInfo> {
        let done = self.state().done;
        if done {
            return self.inner.read_ranges_reported(requests, opts);
        }
        // While the load reads, the part file's modification time moves every HEARTBEAT: the
        // processes waiting for this fetch see it alive however slowly whole chunks arrive (a
        // chunk is written only when all of it is in: 8 MiB at 1 MiB/s is 8 s).
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let result = std::thread::scope(|s| {
            let part = &self.part;
            s.spawn(move || {
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(HEARTBEAT) {
                    let _ = part.set_modified(std::time::SystemTime::now());
                }
            });
            let result = self.read_filling(requests, opts);
            drop(stop);
            result
        });
        result
    }

    fn requests_in_flight(&self) -> usize {
        self.inner.requests_in_flight()
    }

    fn version(&self) -> Option<String> {
        Some(self.tag.clone())
    }
}

/// How often a fetch in progress shows it is alive (the waiters' patience is [`crate::STALL`]).
pub(crate) const HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(1);

impl Filling {
    fn read_filling(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<turboio_storage::ReadInfo> {
        let done = self.state().done;
        let info = match opts.hook {
            // The entry is published or abandoned: nothing more goes to it.
            None if done => self.inner.read_ranges_reported(requests, opts)?,
            // Nothing changes the bytes after the backend has read them: they are written
            // behind the load, by a thread of their own.
            None => self.read_writing_behind(requests, opts)?,
            Some(user) => {
                // The raw bytes go to the entry before the caller's hook decrypts or converts
                // them (in place), so on the thread that runs the hook.
                let hook = |offset: u64, bytes: &mut [u8]| {
                    self.record(offset, bytes);
                    user(offset, bytes)
                };
                self.inner.read_ranges_reported(requests, &IoOptions { hook: Some(&hook), ..*opts })?
            }
        };
        let method = match info.method {
            "ranged GETs" => "ranged GETs, written through to the node cache",
            _ => "storage, written through to the node cache",
        };
        Ok(turboio_storage::ReadInfo { method, ..info })
    }
}
