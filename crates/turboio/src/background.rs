//! Saves in the background, for training loops: [`save_async`] copies the tensors into host
//! buffers kept for reuse (a snapshot: the caller may modify or free its tensors as soon as it
//! returns) and writes the file on a thread of its own, through the same atomic writer as
//! [`save`](crate::save).
//!
//! The snapshot is one memory copy, spread over the cores, into an arena from a pool: after
//! the first checkpoint the arena is already faulted in, so the caller is blocked for about
//! the time of a `memcpy` of the checkpoint (tens of GB/s), while the write runs at the disk's
//! speed behind it. The default pool holds at most two snapshots (a
//! [bounded](turboio_device::ArenaPool::bounded) pool): one can be taken while the previous
//! checkpoint is still being written, and a third background save blocks its caller until the
//! oldest pending save finishes. Saves queued faster than the disk writes them therefore hold
//! at most two checkpoints' worth of host memory, not one per save.
//!
//! Saves of one target file land in the order they were asked for: a later save of the same
//! file (however it is spelled: symbolic links and `..` resolved) waits, in its own background
//! thread, for the earlier one to finish, so the file on disk always ends up as the last save
//! asked for.

use crate::save::{save_with, SaveTensor, TensorData};
use crate::{Error, Result, SaveOptions};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use turboio_device::{Allocation, ArenaPool, PooledArena};
use turboio_format::{plan, TensorSpec};

/// Bytes per piece of the snapshot copy handed to a thread.
const COPY_PIECE: usize = 16 << 20;

/// Snapshots held at once by the default pool (in use by pending saves, or kept for reuse).
pub const DEFAULT_SNAPSHOTS: usize = 2;

/// The pool snapshots come from when [`SaveOptions::snapshots`] is `None`: bounded to
/// [`DEFAULT_SNAPSHOTS`] (a save that finds them all in use waits for one to come back).
///
/// Its arenas use 4 KiB pages unless `TURBOIO_HUGE_PAGES=1` asks for huge pages: a snapshot's
/// first touch of a new arena is on its caller's time, and transparent huge pages made it 2.5-5
/// times slower there (the kernel compacts memory to find 2 MiB pages). Measured on the 2-vCPU
/// VM, a 1 GiB `save_file(..., blocking=False)` in a new process blocked 1.07-2.23 s with huge
/// pages against 0.33-0.42 s for a bare two-thread `memcpy` into fresh memory in the same runs
/// (the floor of any snapshot), and without them about the floor (0.42-0.48 s against
/// 0.38-0.45 s; in a later set 1.25-1.67 s against 1.9-2.1 s: this VM's fresh memory costs
/// swing that much); a synchronous save took 0.55-0.74 s (issue 48, item 18).
pub fn default_snapshot_pool() -> &'static ArenaPool {
    static POOL: OnceLock<ArenaPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let huge = std::env::var("TURBOIO_HUGE_PAGES").is_ok_and(|v| matches!(v.as_str(), "1" | "on" | "true" | "yes"));
        ArenaPool::bounded_with_huge_pages(DEFAULT_SNAPSHOTS, huge)
    })
}

#[derive(Debug)]
struct Shared {
    path: PathBuf,
    total: u64,
    written: Arc<AtomicU64>,
    result: Mutex<Option<std::result::Result<(), Arc<Error>>>>,
    finished: Condvar,
}

impl Shared {
    fn wait(&self) -> std::result::Result<(), Arc<Error>> {
        let mut r = self.result.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = r.as_ref() {
                return r.clone();
            }
            r = self.finished.wait(r).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn finish(&self, result: Result<()>) {
        *self.result.lock().unwrap_or_else(|p| p.into_inner()) = Some(result.map_err(Arc::new));
        self.finished.notify_all();
    }
}

/// A save running in the background ([`save_async`]). Dropping the handle does not stop the
/// save; [`wait_for_saves`] waits for every save of the process.
#[derive(Debug, Clone)]
pub struct SaveHandle {
    shared: Arc<Shared>,
}

impl SaveHandle {
    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// True once the save has finished, successfully or not.
    pub fn done(&self) -> bool {
        self.shared.result.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// Waits for the save to finish; its error, if it failed (the previous file is then
    /// intact). Can be called any number of times.
    pub fn wait(&self) -> std::result::Result<(), Arc<Error>> {
        self.shared.wait()
    }

    /// Bytes written so far, and the file's size.
    pub fn progress(&self) -> (u64, u64) {
        (self.shared.written.load(Ordering::Relaxed), self.shared.total)
    }
}

/// The file a save of `path` writes, as the key that orders saves of one file: symbolic links
/// and `..` resolved (the file itself when it exists, else its directory, plus the name), so
/// `a.safetensors`, `sub/../a.safetensors` and a link to it are one file. Paths with a scheme
/// (`s3://...`) and paths that cannot be resolved are keyed as given (made absolute).
fn ordering_key(path: &Path) -> PathBuf {
    if path.to_str().is_some_and(|p| p.contains("://")) {
        return path.to_owned();
    }
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
    if let Ok(real) = std::fs::canonicalize(&absolute) {
        return real;
    }
    match (absolute.parent(), absolute.file_name()) {
        (Some(dir), Some(name)) => std::fs::canonicalize(dir).map(|d| d.join(name)).unwrap_or(absolute),
        _ => absolute,
    }
}

/// Saves pending or running, by the file they write (see [`ordering_key`]).
fn pending() -> &'static Mutex<HashMap<PathBuf, Arc<Shared>>> {
    static PENDING: OnceLock<Mutex<HashMap<PathBuf, Arc<Shared>>>> = OnceLock::new();
    PENDING.get_or_init(Default::default)
}

/// Waits for every background save of this process to finish (e.g. before exiting: a save
/// cut short by the process ending leaves the previous file, not the new one), and for the
/// deletion of the files saves replaced (done after each save returns, off its path; see
/// `turboio_io_posix::wait_for_deletions`).
pub fn wait_for_saves() {
    wait_for_pending_saves();
    #[cfg(feature = "posix")]
    turboio_io_posix::wait_for_deletions();
}

fn wait_for_pending_saves() {
    loop {
        let next = pending().lock().unwrap_or_else(|p| p.into_inner()).values().next().cloned();
        match next {
            Some(s) => {
                let _ = s.wait();
                // The writer removes itself once finished; make sure the loop moves on.
                let mut map = pending().lock().unwrap_or_else(|p| p.into_inner());
                map.retain(|_, v| !Arc::ptr_eq(v, &s));
            }
            None => return,
        }
    }
}

/// The snapshot: every tensor's bytes, one after the other, in one pooled arena.
struct Snapshot {
    arena: PooledArena,
    /// `(start, len)` of each tensor in the arena, in the order given.
    spans: Vec<(usize, usize)>,
}

impl TensorData for Snapshot {
    fn fill(&self, index: usize, offset: usize, dst: &mut [u8]) -> std::result::Result<(), String> {
        let &(start, len) = self.spans.get(index).ok_or_else(|| format!("no tensor #{index}"))?;
        let bytes = self.arena.host().ok_or("snapshot is not in host memory")?;
        let src = offset
            .checked_add(dst.len())
            .filter(|&end| end <= len)
            .and_then(|end| bytes.get(start + offset..start + end))
            .ok_or_else(|| format!("tensor #{index}: bytes {offset}+{} are outside its {len}", dst.len()))?;
        dst.copy_from_slice(src);
        Ok(())
    }
}

/// Copies `tensors` into one arena from `pool`, in parallel.
fn snapshot(
    path: &Path,
    tensors: &[SaveTensor<'_>],
    pool: &ArenaPool,
    threads: usize,
    budget: Option<u64>,
) -> Result<Snapshot> {
    let mut spans = Vec::with_capacity(tensors.len());
    let mut total = 0usize;
    for t in tensors {
        spans.push((total, t.data.len()));
        total += t.data.len();
    }
    let mut arena = pool.take_within(total, budget).map_err(|e| Error::device(path, e))?;
    {
        let mut dst: &mut [u8] = arena.arena_mut().as_mut_slice();
        let mut pieces: Vec<(&[u8], &mut [u8])> = Vec::new();
        for t in tensors {
            let (mine, rest) = std::mem::take(&mut dst).split_at_mut(t.data.len());
            dst = rest;
            for (s, d) in t.data.chunks(COPY_PIECE).zip(mine.chunks_mut(COPY_PIECE)) {
                pieces.push((s, d));
            }
        }
        let workers = turboio_storage::threads_or_default(threads);
        let queue = Mutex::new(pieces.into_iter());
        turboio_storage::run_workers(vec![(); workers.max(1)], |(), _| -> std::result::Result<(), ()> {
            loop {
                let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                let Some((s, d)) = next else { return Ok(()) };
                d.copy_from_slice(s);
            }
        })
        .ok();
    }
    Ok(Snapshot { arena, spans })
}

/// Saves tensors atomically in the background, like [`save`](crate::save): the tensors are
/// copied before this returns (the caller may then change or drop them), and the file is
/// written by a thread of its own. Errors in the tensors or metadata are returned right away;
/// errors of the write come from [`SaveHandle::wait`], and leave the previous file intact.
///
/// The copy goes into an arena of [`SaveOptions::snapshots`] (the default pool holds at most
/// [`DEFAULT_SNAPSHOTS`]): when a bounded pool has all its arenas in pending saves, this call
/// waits for the oldest to finish before copying, so memory stays bounded however fast saves
/// are asked for. [`SaveOptions::max_host_memory`] bounds the snapshots' bytes the same way,
/// and a snapshot that cannot fit (over the budget, or over the host memory available) is
/// refused before anything is copied.
///
/// A save of a file that has a save pending waits for it before writing, so saves of one file
/// land in the order they were asked for.
pub fn save_async(
    path: impl AsRef<Path>,
    tensors: &[SaveTensor<'_>],
    metadata: Option<&BTreeMap<String, String>>,
    opts: &SaveOptions,
) -> Result<SaveHandle> {
    let path = path.as_ref().to_owned();
    let specs: Vec<TensorSpec<'_>> = tensors
        .iter()
        .map(|t| TensorSpec { name: t.name, dtype: t.dtype, shape: t.shape, data_len: t.data.len() })
        .collect();
    // Validate now, in the caller: the background thread should fail only on I/O.
    let layout = plan(&specs, metadata).map_err(|e| Error::format(&path, e))?;
    let pool = opts.snapshots.clone().unwrap_or_else(|| default_snapshot_pool().clone());
    let bytes: usize = tensors.iter().map(|t| t.data.len()).sum();
    crate::memory::check_snapshot(&path, bytes as u64, opts.max_host_memory, pool.can_reuse(bytes))?;
    let snap = snapshot(&path, tensors, &pool, opts.threads, opts.max_host_memory)?;

    let owned: Vec<(String, turboio_format::Dtype, Vec<usize>, usize)> =
        tensors.iter().map(|t| (t.name.to_owned(), t.dtype, t.shape.to_vec(), t.data.len())).collect();
    let metadata = metadata.cloned();
    let written = opts.progress.clone().unwrap_or_default();
    let shared = Arc::new(Shared {
        path: path.clone(),
        total: layout.file_len(),
        written: written.clone(),
        result: Mutex::new(None),
        finished: Condvar::new(),
    });
    let key = ordering_key(&path);
    let previous = pending().lock().unwrap_or_else(|p| p.into_inner()).insert(key.clone(), shared.clone());
    let opts = SaveOptions { progress: Some(written), ..opts.clone() };
    let me = shared.clone();
    let spawned = std::thread::Builder::new().name("turboio-save".into()).spawn(move || {
        if let Some(prev) = previous {
            let _ = prev.wait();
        }
        let specs: Vec<TensorSpec<'_>> = owned
            .iter()
            .map(|(name, dtype, shape, len)| TensorSpec { name, dtype: *dtype, shape, data_len: *len })
            .collect();
        let result = save_with(&me.path, &specs, metadata.as_ref(), &snap, &opts);
        drop(snap);
        me.finish(result);
        let mut map = pending().lock().unwrap_or_else(|p| p.into_inner());
        if map.get(&key).is_some_and(|v| Arc::ptr_eq(v, &me)) {
            map.remove(&key);
        }
    });
    if let Err(e) = spawned {
        let message = format!("cannot start a save thread: {e}");
        shared.finish(Err(Error::Unsupported { path: path.clone(), message: message.clone() }));
        let mut map = pending().lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, v| !Arc::ptr_eq(v, &shared));
        return Err(Error::Unsupported { path, message });
    }
    Ok(SaveHandle { shared })
}

#[cfg(all(test, feature = "posix"))]
mod bound_tests {
    use super::*;
    use crate::Dtype;
    use std::sync::Arc;
    use turboio_storage::{IoOptions, Storage, StorageError, StorageFile, WriteSource};

    /// Local files whose writes wait until the gate opens, noting the snapshots in use then.
    #[derive(Debug)]
    struct Gated {
        open: Mutex<bool>,
        opened: Condvar,
        pool: ArenaPool,
        in_use_seen: Mutex<Vec<usize>>,
    }

    impl Storage for Gated {
        fn name(&self) -> &'static str {
            "gated"
        }
        fn open(&self, path: &Path) -> std::result::Result<Box<dyn StorageFile>, StorageError> {
            turboio_io_posix::PosixStorage::new().open(path)
        }
        fn write_file(
            &self,
            path: &Path,
            source: &dyn WriteSource,
            opts: &IoOptions<'_>,
        ) -> std::result::Result<(), StorageError> {
            self.in_use_seen.lock().unwrap().push(self.pool.in_use());
            let mut open = self.open.lock().unwrap();
            while !*open {
                open = self.opened.wait(open).unwrap();
            }
            drop(open);
            turboio_io_posix::PosixStorage::new().write_file(path, source, opts)
        }
    }

    impl Gated {
        /// Writes wait until [`release`](Self::release); `pool`'s arenas in use are noted at
        /// each write.
        fn closed(pool: &ArenaPool) -> Arc<Gated> {
            Arc::new(Gated {
                open: Mutex::new(false),
                opened: Condvar::new(),
                pool: pool.clone(),
                in_use_seen: Mutex::new(Vec::new()),
            })
        }

        fn release(&self) {
            *self.open.lock().unwrap() = true;
            self.opened.notify_all();
        }
    }

    #[test]
    fn saves_queued_faster_than_written_hold_at_most_the_pools_snapshots() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("a.safetensors");
        let pool = ArenaPool::bounded(2);
        let gate = Gated::closed(&pool);
        let opts = SaveOptions { snapshots: Some(pool.clone()), storage: Some(gate.clone()), ..Default::default() };
        let save = |path: &Path, fill: u8, opts: &SaveOptions| {
            let data = vec![fill; 1 << 20];
            let t = [SaveTensor { name: "w", dtype: Dtype::U8, shape: &[1 << 20], data: &data }];
            save_async(path, &t, None, opts).unwrap()
        };
        // Two saves hold the two snapshots while their writes wait at the gate.
        let first = save(&path, 1, &opts);
        let second = save(&path, 2, &opts);
        assert_eq!(pool.in_use(), 2);
        // A third waits in the caller for one of them to come back.
        let third = {
            let (path, opts) = (path.clone(), opts.clone());
            std::thread::spawn(move || save(&path, 3, &opts))
        };
        while pool.waiting() == 0 && !third.is_finished() {
            std::thread::yield_now();
        }
        assert_eq!(pool.waiting(), 1, "the third save waits for a snapshot instead of taking a third");
        gate.release();
        let third = third.join().unwrap();
        for h in [first, second, third] {
            h.wait().unwrap();
        }
        assert!(gate.in_use_seen.lock().unwrap().iter().all(|&n| n <= 2), "{:?}", gate.in_use_seen);
        let back = crate::load(&path, &crate::LoadOptions::default()).unwrap();
        assert!(back.tensor("w").unwrap().bytes().unwrap().iter().all(|&b| b == 3), "the last save lands");
        assert_eq!(pool.in_use(), 0);
    }

    #[test]
    fn a_host_memory_budget_bounds_the_snapshots_and_refuses_one_too_big() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("b.safetensors");
        let pool = ArenaPool::bounded(4);
        let gate = Gated::closed(&pool);
        let unit = 2 << 20; // 2 MiB: arenas may be rounded up to huge pages
        let opts = SaveOptions {
            snapshots: Some(pool.clone()),
            storage: Some(gate.clone()),
            max_host_memory: Some(3 * unit as u64),
            ..Default::default()
        };
        let data = vec![7u8; 4 * unit];
        // Over the budget alone: refused before anything is copied; the old file stays.
        let t = [SaveTensor { name: "w", dtype: Dtype::U8, shape: &[4 * unit], data: &data }];
        let e = save_async(&path, &t, None, &opts).unwrap_err();
        assert!(matches!(e, Error::WontFit { .. }), "{e}");
        let e = e.to_string();
        assert!(e.contains("b.safetensors") && e.contains("max_host_memory is 6MiB"), "{e}");
        assert_eq!((pool.in_use(), pool.free_arenas()), (0, 0), "nothing taken");
        assert!(!path.exists());
        // Two snapshots of 2 x 2 MiB do not fit in 3 x 2 MiB together: the second save waits
        // for the first write, although the pool would allow four arenas.
        let t = [SaveTensor { name: "w", dtype: Dtype::U8, shape: &[2 * unit], data: &data[..2 * unit] }];
        let first = save_async(&path, &t, None, &opts).unwrap();
        let second = {
            let (path, opts, data) = (path.clone(), opts.clone(), data.clone());
            std::thread::spawn(move || {
                let t = [SaveTensor { name: "w", dtype: Dtype::U8, shape: &[2 * unit], data: &data[..2 * unit] }];
                save_async(&path, &t, None, &opts).unwrap()
            })
        };
        while pool.waiting() == 0 && !second.is_finished() {
            std::thread::yield_now();
        }
        assert_eq!((pool.waiting(), pool.in_use()), (1, 1), "the second waits for room in the budget");
        gate.release();
        let second = second.join().unwrap();
        first.wait().unwrap();
        second.wait().unwrap();
        assert!(gate.in_use_seen.lock().unwrap().iter().all(|&n| n <= 1), "{:?}", gate.in_use_seen);
        assert_eq!(pool.in_use_bytes(), 0);
    }

    #[test]
    fn the_default_pool_is_bounded() {
        assert_eq!(default_snapshot_pool().limit(), Some(DEFAULT_SNAPSHOTS));
    }
}

#[cfg(test)]
mod ordering_tests {
    use super::ordering_key;

    #[test]
    fn spellings_of_one_file_are_one_key() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        let a = d.path().join("a.safetensors");
        // Before the file exists (its directory resolved), and after.
        assert_eq!(ordering_key(&a), ordering_key(&d.path().join("sub/../a.safetensors")));
        std::fs::write(&a, b"x").unwrap();
        std::os::unix::fs::symlink(&a, d.path().join("link")).unwrap();
        assert_eq!(ordering_key(&a), ordering_key(&d.path().join("sub/../a.safetensors")));
        assert_eq!(ordering_key(&a), ordering_key(&d.path().join("link")));
        assert_ne!(ordering_key(&a), ordering_key(&d.path().join("b.safetensors")));
        let url = std::path::Path::new("s3://b/k.safetensors");
        assert_eq!(ordering_key(url), url);
    }
}
