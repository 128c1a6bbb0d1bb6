//! The node cache against a versioned backend of local files: the conformance suite through the
//! cache (cold and warm), bytes fetched once, partial reads, replaced objects, eviction, many
//! readers at once, a full disk, and fetchers killed with SIGKILL at random points.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use turboio_cache::testing::Versioned;
use turboio_cache::{CacheStorage, NodeCache};
use turboio_storage::conformance::{self, pattern, Capabilities};
use turboio_storage::{BytesSource, IoOptions, ReadRequest, Storage, StorageFile};

fn setup(pause: Option<Duration>) -> (tempfile::TempDir, Arc<Versioned>, CacheStorage) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("store")).unwrap();
    let inner = Arc::new(Versioned::with_pause(pause));
    let cache = CacheStorage::new(inner.clone(), NodeCache::new(dir.path().join("cache")));
    (dir, inner, cache)
}

fn read_all(s: &dyn Storage, path: &Path) -> (Vec<u8>, bool) {
    let f = s.open(path).unwrap();
    let mut buf = vec![0u8; f.len() as usize];
    f.read_ranges(vec![ReadRequest { offset: 0, dst: &mut buf }], &IoOptions { threads: 3, ..Default::default() })
        .unwrap();
    (buf, f.local_file().is_some())
}

#[test]
fn conformance_through_the_cache() {
    let (dir, _inner, cache) = setup(None);
    let store = dir.path().join("store");
    for threads in [1, 3] {
        let opts = IoOptions { threads, ..Default::default() };
        let run = store.join(format!("threads-{threads}"));
        std::fs::create_dir(&run).unwrap();
        conformance::run_all(&cache, &run, Capabilities::default(), &opts);
    }
    // The suite reads its files back (filling entries) and rewrites some (new versions).
    assert!(!cache.cache().entries().unwrap().is_empty(), "the suite's reads filled entries");
}

#[test]
fn an_object_is_fetched_once_then_read_locally() {
    let (dir, inner, cache) = setup(None);
    let path = dir.path().join("store/model.safetensors");
    let data = pattern(5 << 20, 7);
    std::fs::write(&path, &data).unwrap();

    let (got, local) = read_all(&cache, &path);
    assert_eq!(got, data);
    assert!(!local, "the first load reads the store");
    assert_eq!(inner.read.load(Ordering::Relaxed), data.len() as u64, "each byte fetched once");
    let entries = cache.cache().entries().unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].url, path.to_str().unwrap());
    assert_eq!(entries[0].len, data.len() as u64);
    assert_eq!(std::fs::read(&entries[0].path).unwrap(), data);

    for _ in 0..3 {
        let (got, local) = read_all(&cache, &path);
        assert_eq!(got, data);
        assert!(local, "later loads are local files (mappable)");
    }
    assert_eq!(inner.read.load(Ordering::Relaxed), data.len() as u64, "hits read nothing from the store");
    let f = cache.open(&path).unwrap();
    assert_eq!(f.path(), path, "a hit is named by its URL");
    assert!(f.version().is_some());
    // Nothing but the entry, its description and its lock.
    let mut names: Vec<String> = std::fs::read_dir(dir.path().join("cache"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let key = &entries[0].key;
    let seen: Vec<&String> = names.iter().filter(|n| n.starts_with("U-") && n.ends_with(".seen")).collect();
    assert_eq!(seen.len(), 1, "one record of the version seen last: {names:?}");
    let seen = seen[0].clone();
    names.retain(|n| *n != seen);
    assert_eq!(names, vec![format!("{key}.data"), format!("{key}.json"), format!("{key}.lock")]);
}

fn read_file(f: &dyn StorageFile) -> Vec<u8> {
    let mut buf = vec![0u8; f.len() as usize];
    f.read_ranges(vec![ReadRequest { offset: 0, dst: &mut buf }], &IoOptions { threads: 2, ..Default::default() })
        .unwrap();
    buf
}

#[test]
fn an_unconfirmed_open_reads_the_entry_while_the_store_is_asked() {
    let (dir, inner, cache) = setup(None);
    let path = dir.path().join("store/m.bin");
    let first = pattern(3 << 20, 1);
    inner.write_file(&path, &BytesSource(&first), &IoOptions::default()).unwrap();
    assert_eq!(read_all(&cache, &path), (first.clone(), false));
    let heads = inner.heads.load(Ordering::Relaxed);

    // The store's answer held back: the open and the whole read go on without it (the entry,
    // a local file), and `confirm` gives the answer once it comes.
    inner.hold_heads(true);
    let f = cache.open_unconfirmed(&path, None).unwrap();
    assert!(f.local_file().is_some(), "the entry itself, mappable");
    assert_eq!(read_file(f.as_ref()), first);
    assert_eq!(inner.heads.load(Ordering::Relaxed), heads, "read before the store answered");
    inner.hold_heads(false);
    f.confirm().unwrap();
    f.confirm().unwrap();
    assert_eq!(inner.heads.load(Ordering::Relaxed), heads + 1, "one HEAD");

    // Replaced: the old copy is handed out, and `confirm` refuses it naming the URL; the next
    // open reads the new version.
    let second = pattern(3 << 20, 2);
    inner.write_file(&path, &BytesSource(&second), &IoOptions::default()).unwrap();
    let f = cache.open_unconfirmed(&path, None).unwrap();
    assert_eq!(read_file(f.as_ref()), first);
    let err = f.confirm().unwrap_err();
    assert!(err.is_changed(), "{err}");
    assert!(err.to_string().contains(path.to_str().unwrap()), "{err}");
    assert!(f.confirm().unwrap_err().is_changed(), "asked again: the same answer");
    drop(f);
    let f = cache.open_unconfirmed(&path, None).unwrap();
    assert!(f.local_file().is_none(), "a miss: fetched from the store");
    assert_eq!(read_file(f.as_ref()), second);
    f.confirm().unwrap();
    drop(f);
    let f = cache.open_unconfirmed(&path, None).unwrap();
    assert!(f.local_file().is_some(), "the new version's entry");
    assert_eq!(read_file(f.as_ref()), second);
    f.confirm().unwrap();

    // Gone from the store: `confirm` gives the store's answer, as an open would have.
    std::fs::remove_file(&path).unwrap();
    let f = cache.open_unconfirmed(&path, None).unwrap();
    assert!(f.confirm().unwrap_err().is_not_found());
    assert!(cache.open(&path).unwrap_err().is_not_found(), "a confirmed open asks first");
}

#[test]
fn a_replaced_object_is_a_miss_and_a_changed_length_too() {
    let (dir, inner, cache) = setup(None);
    let path = dir.path().join("store/m.bin");
    let first = pattern(3 << 20, 1);
    inner.write_file(&path, &BytesSource(&first), &IoOptions::default()).unwrap();
    assert_eq!(read_all(&cache, &path).0, first);
    let second = pattern(3 << 20, 2);
    inner.write_file(&path, &BytesSource(&second), &IoOptions::default()).unwrap();
    let (got, local) = read_all(&cache, &path);
    assert_eq!(got, second, "the new version, never the cached old one");
    assert!(!local);
    assert_eq!(read_all(&cache, &path), (second.clone(), true));
    let third = pattern(1000, 3);
    inner.write_file(&path, &BytesSource(&third), &IoOptions::default()).unwrap();
    assert_eq!(read_all(&cache, &path).0, third);
    // Each new version's entry replaced the older ones when it was published.
    let entries = cache.cache().entries().unwrap();
    assert_eq!(entries.len(), 1, "only the current version is kept: {entries:?}");
    assert_eq!(entries[0].len, third.len() as u64);
}

#[test]
fn a_save_or_a_removal_through_the_cache_is_seen_by_the_next_load() {
    let (dir, inner, _) = setup(None);
    let node = NodeCache::new(dir.path().join("cache")).with_revalidate_after(Some(Duration::from_secs(3600)));
    let cache = CacheStorage::new(inner.clone(), node);
    let path = dir.path().join("store/m.bin");
    let first = pattern(2 << 20, 1);
    inner.write_file(&path, &BytesSource(&first), &IoOptions::default()).unwrap();
    assert_eq!(read_all(&cache, &path), (first.clone(), false));
    assert_eq!(read_all(&cache, &path), (first.clone(), true), "trusted within the interval");
    // Saved through the cache: the saver loads what it saved, not the version it trusted.
    let second = pattern(2 << 20, 2);
    cache.write_file(&path, &BytesSource(&second), &IoOptions::default()).unwrap();
    assert_eq!(read_all(&cache, &path).0, second, "the save is seen at once");
    // Removed through the cache: gone, whatever the record said.
    cache.remove_file(&path).unwrap();
    assert!(cache.open(&path).is_err(), "a removed object does not load from the cache");
}

#[test]
fn within_the_revalidation_interval_a_hit_asks_the_store_nothing() {
    let (dir, inner, _) = setup(None);
    let node = NodeCache::new(dir.path().join("cache")).with_revalidate_after(Some(Duration::from_secs(3600)));
    let cache = CacheStorage::new(inner.clone(), node.clone());
    let path = dir.path().join("store/m.bin");
    let first = pattern(3 << 20, 1);
    inner.write_file(&path, &BytesSource(&first), &IoOptions::default()).unwrap();
    assert_eq!(read_all(&cache, &path), (first.clone(), false));
    assert_eq!(inner.heads.load(Ordering::Relaxed), 1);
    for _ in 0..3 {
        assert_eq!(read_all(&cache, &path), (first.clone(), true));
    }
    assert_eq!(inner.heads.load(Ordering::Relaxed), 1, "hits within the interval ask nothing");
    // Replaced within the interval: the cached version is still served (what the interval
    // trades), and the new one once the interval is over.
    let second = pattern(3 << 20, 2);
    inner.write_file(&path, &BytesSource(&second), &IoOptions::default()).unwrap();
    assert_eq!(read_all(&cache, &path), (first.clone(), true));
    let seen: Vec<PathBuf> = std::fs::read_dir(dir.path().join("cache"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "seen"))
        .collect();
    assert_eq!(seen.len(), 1, "one record per URL: {seen:?}");
    let past = std::time::SystemTime::now() - Duration::from_secs(7200);
    std::fs::File::options().write(true).open(&seen[0]).unwrap().set_modified(past).unwrap();
    assert_eq!(read_all(&cache, &path), (second.clone(), false), "revalidated: the new version");
    assert_eq!(inner.heads.load(Ordering::Relaxed), 2);
    assert_eq!(read_all(&cache, &path), (second.clone(), true));
    assert_eq!(inner.heads.load(Ordering::Relaxed), 2);
    // An evicted entry is a miss whatever the record says (the store is asked again), and
    // prune drops records of entries that are gone.
    node.prune(0).unwrap();
    assert_eq!(read_all(&cache, &path), (second.clone(), false));
    assert_eq!(inner.heads.load(Ordering::Relaxed), 3);
    node.prune(0).unwrap();
    let left = std::fs::read_dir(dir.path().join("cache"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "seen"))
        .count();
    assert_eq!(left, 0, "records of evicted entries pruned");
    // Without an interval every open asks.
    let asking = CacheStorage::new(inner.clone(), NodeCache::new(dir.path().join("cache")));
    read_all(&asking, &path);
    read_all(&asking, &path);
    assert_eq!(inner.heads.load(Ordering::Relaxed), 5);
}

#[test]
fn partial_reads_publish_nothing_unless_little_is_missing() {
    let (dir, inner, cache) = setup(None);
    let path = dir.path().join("store/big.bin");
    let data = pattern(4 << 20, 5);
    std::fs::write(&path, &data).unwrap();
    {
        let f = cache.open(&path).unwrap();
        let mut head = vec![0u8; 1 << 20];
        f.read_exact_at(0, &mut head).unwrap();
        assert_eq!(head, data[..1 << 20]);
    }
    assert!(cache.cache().entries().unwrap().is_empty(), "three quarters missing: no entry");
    assert_eq!(inner.read.load(Ordering::Relaxed), 1 << 20, "nothing fetched beyond the load's reads");
    // A read of all but a few small gaps (a .pt load skipping zip records): the gaps are
    // fetched when the file is closed and the entry is published.
    {
        let f = cache.open(&path).unwrap();
        let mut a = vec![0u8; 1_000_000];
        let mut b = vec![0u8; (4 << 20) - 1_000_100];
        f.read_ranges(
            vec![ReadRequest { offset: 0, dst: &mut a }, ReadRequest { offset: 1_000_050, dst: &mut b }],
            &IoOptions::default(),
        )
        .unwrap();
    }
    let entries = cache.cache().entries().unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(std::fs::read(&entries[0].path).unwrap(), data);
}

#[test]
fn hooks_see_the_bytes_and_the_entry_keeps_them_raw() {
    let (dir, _inner, cache) = setup(None);
    let path = dir.path().join("store/enc.bin");
    let data = pattern(2 << 20, 9);
    std::fs::write(&path, &data).unwrap();
    let f = cache.open(&path).unwrap();
    let mut buf = vec![0u8; data.len()];
    // A hook that changes the bytes in place (as decryption does).
    let hook = |_: u64, b: &mut [u8]| {
        b.iter_mut().for_each(|x| *x ^= 0xFF);
        Ok(())
    };
    f.read_ranges(
        vec![ReadRequest { offset: 0, dst: &mut buf }],
        &IoOptions { hook: Some(&hook), ..Default::default() },
    )
    .unwrap();
    assert!(buf.iter().zip(&data).all(|(a, b)| *a == !*b));
    drop(f);
    let e = &cache.cache().entries().unwrap()[0];
    assert_eq!(std::fs::read(&e.path).unwrap(), data, "the entry holds the store's bytes");
}

#[test]
fn the_size_limit_evicts_the_least_recently_used() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("store")).unwrap();
    let inner = Arc::new(Versioned::default());
    let cache =
        CacheStorage::new(inner.clone(), NodeCache::new(dir.path().join("cache")).with_max_bytes(Some(7 << 20)));
    let paths: Vec<PathBuf> = (0..3).map(|i| dir.path().join(format!("store/{i}.bin"))).collect();
    for (i, p) in paths.iter().enumerate() {
        std::fs::write(p, pattern(3 << 20, i as u64)).unwrap();
    }
    read_all(&cache, &paths[0]);
    read_all(&cache, &paths[1]);
    // Use 0 again: 1 is now the least recently used.
    std::thread::sleep(Duration::from_millis(20)); // distinct modification times
    assert!(read_all(&cache, &paths[0]).1);
    read_all(&cache, &paths[2]);
    let urls: Vec<String> = cache.cache().entries().unwrap().into_iter().map(|e| e.url).collect();
    assert_eq!(urls, vec![paths[2].to_str().unwrap().to_owned(), paths[0].to_str().unwrap().to_owned()]);
    // An object above the limit is loaded, not cached.
    let huge = dir.path().join("store/huge.bin");
    std::fs::write(&huge, pattern(8 << 20, 4)).unwrap();
    assert_eq!(read_all(&cache, &huge), (pattern(8 << 20, 4), false));
    assert_eq!(cache.cache().entries().unwrap().len(), 2);
    // prune to a byte count, then to nothing.
    let r = cache.cache().prune(3 << 20).unwrap();
    assert_eq!((r.removed, r.freed), (1, 3 << 20));
    let r = cache.cache().prune(0).unwrap();
    assert_eq!(r.removed, 1);
    assert!(cache.cache().entries().unwrap().is_empty());
}

#[test]
fn an_object_too_large_for_the_disk_evicts_nothing() {
    let (dir, _inner, cache) = setup(None);
    let paths: Vec<PathBuf> = (0..2).map(|i| dir.path().join(format!("store/{i}.bin"))).collect();
    for (i, p) in paths.iter().enumerate() {
        std::fs::write(p, pattern(1 << 20, i as u64)).unwrap();
        read_all(&cache, p);
    }
    assert_eq!(cache.cache().entries().unwrap().len(), 2);
    // A (sparse) object larger than the whole file system: evicting every entry cannot make room.
    let st = nix::sys::statvfs::statvfs(dir.path()).unwrap();
    let disk = st.blocks().saturating_mul(st.fragment_size());
    let huge = dir.path().join("store/huge.bin");
    std::fs::File::create(&huge).unwrap().set_len(disk.saturating_mul(2).max(1 << 40)).unwrap();
    let f = cache.open(&huge).unwrap();
    assert!(f.local_file().is_none(), "read from the store, not cached");
    assert_eq!(cache.cache().entries().unwrap().len(), 2, "the cache kept its entries");
}

/// `readers` threads load one object of `len` bytes at once through a cache in front of a
/// store whose chunk reads pause `pause`; returns the bytes the store served.
fn concurrent_loads(pause: Option<Duration>, len: usize, readers: usize) -> (u64, u64) {
    let (dir, inner, cache) = setup(pause);
    let path = dir.path().join("store/shared.bin");
    let data = pattern(len, 3);
    std::fs::write(&path, &data).unwrap();
    let cache = Arc::new(cache);
    std::thread::scope(|s| {
        for _ in 0..readers {
            s.spawn(|| assert_eq!(read_all(cache.as_ref(), &path).0, data));
        }
    });
    (inner.read.load(Ordering::Relaxed), data.len() as u64)
}

#[test]
fn many_readers_at_once_fetch_the_object_once() {
    let (read, len) = concurrent_loads(None, 16 << 20, 4);
    assert_eq!(read, len, "four readers, one fetch");
}

/// Issue 48, item 8: waiters judged the fetch's progress by its part file, which moves only
/// when a whole chunk is in, and gave up after STALL: on a slow store every waiter fetched the
/// object again. The fetch now shows a heartbeat while it reads.
#[test]
fn waiters_wait_for_a_slow_fetch_that_is_alive() {
    // Each 1 MiB chunk takes longer than the waiters' patience to arrive.
    let (read, len) = concurrent_loads(Some(turboio_cache::STALL + Duration::from_millis(1500)), 2 << 20, 3);
    assert_eq!(read, len, "three readers of a slow store, one fetch");
}

#[test]
fn an_unwritable_cache_never_fails_a_load() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("store")).unwrap();
    let blocker = dir.path().join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let cache = CacheStorage::new(Arc::new(Versioned::default()), NodeCache::new(blocker.join("cache")));
    let path = dir.path().join("store/m.bin");
    let data = pattern(1 << 20, 1);
    std::fs::write(&path, &data).unwrap();
    assert_eq!(read_all(&cache, &path), (data, false));
    assert!(cache.open(&dir.path().join("store/missing.bin")).unwrap_err().is_not_found());
}

#[test]
fn a_cancelled_open_stops_waiting() {
    let (dir, _inner, cache) = setup(None);
    let path = dir.path().join("store/m.bin");
    std::fs::write(&path, pattern(2 << 20, 1)).unwrap();
    let cache = Arc::new(cache);
    // This thread holds the fetch (opened, nothing read yet); another thread waits for it.
    let held = cache.open(&path).unwrap();
    let cancel = Arc::new(AtomicBool::new(true));
    let c2 = cache.clone();
    let p2 = path.clone();
    let cancel2 = cancel.clone();
    let err =
        std::thread::spawn(move || c2.open_cancellable(&p2, Some(&cancel2)).map(|_| ())).join().unwrap().unwrap_err();
    assert!(matches!(err, turboio_storage::StorageError::Cancelled), "{err:?}");
    // The same thread opening it again does not wait on itself.
    assert_eq!(cache.open(&path).unwrap().len(), 2 << 20);
    drop(held);
}

const CHILD_ENV: &str = "TURBOIO_CACHE_TEST_CHILD";

/// Run by `killed_fetches_leave_complete_entries_or_none` in a child process: fills the cache
/// slowly until killed.
#[test]
#[ignore = "the child of killed_fetches_leave_complete_entries_or_none"]
fn child_fill() {
    let Some(args) = std::env::var_os(CHILD_ENV) else { return };
    let args = PathBuf::from(args);
    let (store, cache_dir) = (args.join("store/m.bin"), args.join("cache"));
    let inner = Arc::new(Versioned::with_pause(Some(Duration::from_millis(1))));
    let cache = CacheStorage::new(inner, NodeCache::new(cache_dir));
    let f = cache.open(&store).unwrap();
    let mut buf = vec![0u8; f.len() as usize];
    println!("started");
    f.read_ranges(
        vec![ReadRequest { offset: 0, dst: &mut buf }],
        &IoOptions { threads: 2, chunk_size: 64 << 10, ..Default::default() },
    )
    .unwrap();
}

#[test]
fn killed_fetches_leave_complete_entries_or_none() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("store")).unwrap();
    let path = dir.path().join("store/m.bin");
    let data = pattern(6 << 20, 21);
    std::fs::write(&path, &data).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let (mut mid_fill, mut killed) = (0, 0);
    for round in 0..24 {
        let mut child = std::process::Command::new(&exe)
            .args(["--exact", "child_fill", "--include-ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        // A random point of the fill (about 50 ms of pauses), or after it.
        std::thread::sleep(Duration::from_micros(seed % 70_000));
        // SIGKILL.
        if child.kill().is_ok() {
            killed += 1;
        }
        let _ = child.wait();
        let cache = NodeCache::new(dir.path().join("cache"));
        let left = cache.entries().unwrap();
        for e in &left {
            assert_eq!(std::fs::read(&e.path).unwrap(), data, "round {round}: a published entry is complete");
        }
        if left.is_empty() {
            mid_fill += 1;
        }
        // The next load is right, whatever was left, and leaves a complete entry.
        let storage = CacheStorage::new(Arc::new(Versioned::default()), cache.clone());
        assert_eq!(read_all(&storage, &path).0, data, "round {round}");
        assert_eq!(cache.entries().unwrap().len(), 1);
        let r = cache.prune(0).unwrap();
        assert_eq!(r.removed, 1);
        assert!(
            std::fs::read_dir(dir.path().join("cache")).unwrap().all(|e| !e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".part")),
            "prune removes dead fetches' parts"
        );
    }
    assert!(killed > 0 && mid_fill > 0, "{killed} kills, {mid_fill} before the entry was published");
}

#[test]
fn inserted_bytes_are_entries_like_fills() {
    let (dir, inner, cache) = setup(None);
    let path = dir.path().join("store/replicated.bin");
    let data = pattern(3 << 20, 8);
    std::fs::write(&path, &data).unwrap();
    let version = inner.current_version(&path).unwrap().unwrap();
    assert!(!cache.insert(&path, &version, &data[1..]), "a length other than the version's");
    assert!(cache.insert(&path, &version, &data));
    assert!(!cache.insert(&path, &version, &data), "the entry exists");
    let (got, local) = read_all(&cache, &path);
    assert!(local && got == data, "a hit");
    assert_eq!(inner.read.load(Ordering::Relaxed), 0, "nothing read from the store");
    let e = &cache.cache().entries().unwrap()[0];
    assert_eq!((e.url.as_str(), e.len), (path.to_str().unwrap(), data.len() as u64));
}

#[test]
fn aligned_chunks_go_to_the_entry_with_o_direct_and_the_rest_buffered() {
    // A load's memory is page-aligned (arenas, staging buffers): parts at aligned offsets are
    // written with O_DIRECT from it, the unaligned tail through the page cache.
    let (dir, _inner, cache) = setup(None);
    let path = dir.path().join("store/aligned.bin");
    let data = pattern((5 << 20) + 1234, 12);
    std::fs::write(&path, &data).unwrap();
    let f = cache.open(&path).unwrap();
    let mut backing = vec![0u8; data.len() + 4096];
    let start = backing.as_ptr().align_offset(4096);
    let buf = &mut backing[start..start + data.len()];
    f.read_ranges(
        vec![ReadRequest { offset: 0, dst: buf }],
        &IoOptions { threads: 2, chunk_size: 1 << 20, ..Default::default() },
    )
    .unwrap();
    assert_eq!(&backing[start..start + data.len()], &data[..]);
    // The chunks are written behind the load by a thread of its own, which the read waits for:
    // the entry is complete and published when the read returns, not when the file is dropped.
    let entries = cache.cache().entries().unwrap();
    assert_eq!(entries.len(), 1, "published by the read itself");
    assert_eq!(std::fs::read(&entries[0].path).unwrap(), data);
    drop(f);
    let e = &cache.cache().entries().unwrap()[0];
    assert_eq!(std::fs::read(&e.path).unwrap(), data);
}

#[test]
fn prune_removes_records_half_written_by_dead_processes() {
    let (dir, inner, cache) = setup(None);
    let path = dir.path().join("store/m.bin");
    inner.write_file(&path, &BytesSource(&pattern(1 << 20, 1)), &IoOptions::default()).unwrap();
    read_all(&cache, &path);
    let cache_dir = dir.path().join("cache");
    // A process that has exited, and this one (alive: its temporary files are being written).
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let me = std::process::id();
    let key = &cache.cache().entries().unwrap()[0].key;
    let names = [
        (format!("U-{}.{dead}-0.tmp", "ab".repeat(32)), false),
        (format!("{key}.{dead}.json.tmp"), false),
        (format!("U-{}.{me}-3.tmp", "cd".repeat(32)), true),
        (format!("{key}.{me}.json.tmp"), true),
    ];
    for (name, _) in &names {
        std::fs::write(cache_dir.join(name), b"{").unwrap();
    }
    cache.cache().prune(u64::MAX).unwrap();
    for (name, kept) in &names {
        assert_eq!(cache_dir.join(name).exists(), *kept, "{name}");
    }
    assert_eq!(cache.cache().entries().unwrap().len(), 1, "the entry stays");
}

/// Issue 48, item 6: a cache directory other users can write is not trusted unless the cache
/// is shared explicitly; the cache makes its directory 0700 and its entries 0600.
#[test]
fn a_directory_other_users_can_write_is_not_used_unless_the_cache_is_shared() {
    use std::os::unix::fs::PermissionsExt;
    let (dir, inner, own) = setup(None);
    let path = dir.path().join("store/m.bin");
    let data = pattern(3 << 20, 11);
    std::fs::write(&path, &data).unwrap();
    // Made by the cache: private.
    assert_eq!(read_all(&own, &path).0, data);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&dir.path().join("cache")), 0o700);
    for e in std::fs::read_dir(dir.path().join("cache")).unwrap() {
        let p = e.unwrap().path();
        assert_eq!(mode(&p), 0o600, "{}", p.display());
    }
    // A world-writable directory: loads go to the store, nothing is written there.
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let private = CacheStorage::new(inner.clone(), NodeCache::new(&open));
    let before = inner.read.load(Ordering::Relaxed);
    for _ in 0..2 {
        let (got, local) = read_all(&private, &path);
        assert!(got == data && !local);
    }
    assert_eq!(inner.read.load(Ordering::Relaxed) - before, 2 * data.len() as u64, "both from the store");
    assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0, "nothing written in a refused directory");
    assert!(NodeCache::new(&open).prune(0).unwrap_err().to_string().contains("writable by other users"));
    // Shared explicitly: used, entries readable by the others.
    let shared = CacheStorage::new(inner.clone(), NodeCache::new(&open).with_shared(true));
    assert_eq!(read_all(&shared, &path).0, data);
    let (got, local) = read_all(&shared, &path);
    assert!(got == data && local, "a shared cache serves its entries");
    let entry = &shared.cache().entries().unwrap()[0];
    assert_eq!(mode(&entry.path), 0o644);
}

/// Links planted in a cache directory are never followed: not for the lock file (which a
/// fetch truncates and writes), not for an entry's data (which would be served as the
/// object); and an entry of another user is not served by a private cache.
#[test]
fn links_and_other_users_files_in_the_cache_are_refused() {
    use turboio_storage::Storage as _;
    let (dir, inner, cache) = setup(None);
    let cache_dir = dir.path().join("cache");
    let path = dir.path().join("store/victim-model.bin");
    let data = pattern(2 << 20, 12);
    std::fs::write(&path, &data).unwrap();
    cache.cache().prune(0).unwrap(); // makes the directory
    let version = inner.current_version(&path).unwrap().unwrap();
    let key = NodeCache::key(path.to_str().unwrap(), &version);
    // The lock file: a link to a file of the victim's.
    let victim = dir.path().join("precious.txt");
    std::fs::write(&victim, b"do not truncate me").unwrap();
    std::os::unix::fs::symlink(&victim, cache_dir.join(format!("{key}.lock"))).unwrap();
    assert_eq!(read_all(&cache, &path).0, data);
    assert_eq!(std::fs::read(&victim).unwrap(), b"do not truncate me", "the link was followed");
    std::fs::remove_file(cache_dir.join(format!("{key}.lock"))).unwrap();
    // The data: a link to a file of the right length and other bytes.
    let planted = dir.path().join("planted.bin");
    std::fs::write(&planted, vec![0xeeu8; data.len()]).unwrap();
    let _ = std::fs::remove_file(cache_dir.join(format!("{key}.data")));
    std::os::unix::fs::symlink(&planted, cache_dir.join(format!("{key}.data"))).unwrap();
    for _ in 0..2 {
        assert_eq!(read_all(&cache, &path).0, data, "a linked entry was served");
    }
    // A regular file of another user (only root can make one here).
    if nix::unistd::geteuid().is_root() {
        let data_path = cache_dir.join(format!("{key}.data"));
        let _ = std::fs::remove_file(&data_path);
        std::fs::write(&data_path, vec![0xddu8; data.len()]).unwrap();
        std::os::unix::fs::chown(&data_path, Some(65534), Some(65534)).unwrap();
        let (got, local) = read_all(&cache, &path);
        assert!(got == data && !local, "another user's entry was served");
    }
}

/// A shared cache serves an entry only if its bytes match the hash recorded at publication.
#[test]
fn a_shared_cache_checks_the_recorded_hash() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("store")).unwrap();
    let inner = Arc::new(Versioned::default());
    let cache = CacheStorage::new(inner.clone(), NodeCache::new(dir.path().join("cache")).with_shared(true));
    let path = dir.path().join("store/s.bin");
    let data = pattern(3 << 20, 13);
    std::fs::write(&path, &data).unwrap();
    assert_eq!(read_all(&cache, &path).0, data);
    let entry = cache.cache().entries().unwrap()[0].clone();
    let meta = std::fs::read_to_string(entry.path.with_extension("json")).unwrap();
    assert!(meta.contains("\"sha256\""), "{meta}");
    // A hit: the entry's bytes are checked, and the file is remembered as checked.
    let (got, local) = read_all(&cache, &path);
    assert!(got == data && local);
    // Another user's process replaces the entry (same length; ext4 gives the new file the old
    // one's inode number back at once): it must be checked again, not taken for the checked one.
    let _ = std::fs::remove_file(&entry.path);
    std::fs::write(&entry.path, vec![0x77u8; data.len()]).unwrap();
    let before = inner.read.load(Ordering::Relaxed);
    let (got, local) = read_all(&cache, &path);
    assert!(got == data && !local, "the tampered entry was served");
    assert_eq!(inner.read.load(Ordering::Relaxed) - before, data.len() as u64);
    // Fetched again and published again: served from then on.
    let (got, local) = read_all(&cache, &path);
    assert!(got == data && local);
}
