//! Read throughput of the posix backend's paths into fresh huge-page arenas, hot and cold,
//! against `std::fs::read` (hot) and a raw `O_DIRECT` queue-depth-32 read into a reused buffer
//! (cold: the disk's ceiling).
//!
//! ```text
//! cargo run --release -p turboio-io-posix --example readbench -- FILE [--size GIB] [--runs N]
//!     [--hot MODE,..] [--cold MODE,..] [--threads N] [--qd N] [--block KIB] [--settle SECS]
//! ```
//!
//! FILE is created (`--size`, default 4 GiB) if it does not exist. Modes run alternately, run
//! after run, and the median of each is printed with its ratio to the baseline. Cold runs drop
//! the page cache first (`echo 3 > /proc/sys/vm/drop_caches` as root, else `fadvise`). Before each
//! run the bench waits `--settle` seconds (default 3) for freed memory to settle,.
//!
//! Modes: `std` (`std::fs::read`), `threads` (buffered threads), `threads-prefault` (the arena
//! prefaulted on every core first, included in the time), `uring` (io_uring + O_DIRECT),
//! `uring-nc` (the same with a destination not congruent to the file offset: bounce buffers),
//! `uring-popconc` (io_uring + O_DIRECT while another thread prefaults the arena), `threads-direct`
//! (threads + O_DIRECT), `uring-buffered`, `auto` (the default choice), `raw` (raw O_DIRECT,
//! queue depth 32, 1 MiB requests, one reused 32 MiB buffer), `touchN` (only
//! prefaulting a fresh huge-page arena on N threads). A `-4k` suffix on an arena mode uses an
//! arena without huge pages; `-warm` prefaults the arena before the clock starts (the I/O alone).

use io_uring::{opcode, types, IoUring};
use nix::fcntl::OFlag;
use nix::sys::mman::{madvise, MmapAdvise};
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;
use turboio_device::Arena;
use turboio_io_posix::{PosixConfig, PosixStorage, ReadMethod};
use turboio_storage::{DirectIo, IoOptions, ReadRequest, Storage, WriteSource};

struct Args {
    file: PathBuf,
    size: u64,
    runs: usize,
    hot: Vec<String>,
    cold: Vec<String>,
    threads: usize,
    qd: u32,
    block: usize,
    settle: f64,
}

fn parse() -> Args {
    let mut a = Args {
        file: PathBuf::new(),
        size: 4 << 30,
        runs: 3,
        hot: "std,threads,threads-prefault".split(',').map(String::from).collect(),
        cold: "raw,uring,threads-direct,threads,auto".split(',').map(String::from).collect(),
        threads: 0,
        qd: 16,
        block: 1 << 20,
        settle: 3.0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--size" => a.size = val().parse::<u64>().expect("GiB") << 30,
            "--runs" => a.runs = val().parse().expect("runs"),
            "--hot" => a.hot = split(&val()),
            "--cold" => a.cold = split(&val()),
            "--threads" => a.threads = val().parse().expect("threads"),
            "--qd" => a.qd = val().parse().expect("queue depth"),
            "--settle" => a.settle = val().parse().expect("seconds"),
            "--block" => a.block = val().parse::<usize>().expect("KiB") << 10,
            f => a.file = PathBuf::from(f),
        }
    }
    assert!(!a.file.as_os_str().is_empty(), "usage: readbench FILE [options]");
    a
}

fn split(s: &str) -> Vec<String> {
    s.split(',').filter(|m| !m.is_empty()).map(String::from).collect()
}

/// Cheap deterministic bytes.
struct Gen(u64);

impl WriteSource for Gen {
    fn len(&self) -> u64 {
        self.0
    }

    fn fill(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
        for (i, c) in dst.chunks_mut(8).enumerate() {
            let x = (offset / 8 + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
        }
        Ok(())
    }
}

fn drop_caches(path: &Path) {
    nix::unistd::sync();
    if std::fs::write("/proc/sys/vm/drop_caches", "3").is_err() {
        let f = PosixStorage::new().open_posix(path).expect("open");
        f.evict_cache().expect("fadvise");
    }
}

/// Brings the file into the page cache (a no-op when it is there), through a small buffer so as
/// not to churn memory between runs.
fn warm(path: &Path) {
    use std::io::Read;
    let mut f = std::fs::File::open(path).expect("open");
    let mut buf = vec![0u8; 8 << 20];
    while f.read(&mut buf).expect("read") > 0 {}
}

/// Reads the whole file with `O_DIRECT` at queue depth 32, 1 MiB requests, into one reused
/// 32 MiB buffer.
fn raw_direct(path: &Path, len: u64) {
    const QD: usize = 32;
    const BLOCK: usize = 1 << 20;
    let f = OpenOptions::new().read(true).custom_flags(OFlag::O_DIRECT.bits()).open(path).expect("open O_DIRECT");
    let mut buf = Arena::new(QD * BLOCK, true).expect("buffer");
    buf.prefault(1);
    let base = buf.as_mut_slice().as_mut_ptr();
    let mut ring = IoUring::new(QD as u32).expect("ring");
    let mut next = 0u64;
    let mut in_flight = 0usize;
    let push = |ring: &mut IoUring, slot: usize, off: u64| {
        let n = (len - off).min(BLOCK as u64) as u32;
        // SAFETY: slot `slot` of the buffer is used by this request alone until it completes,
        // and the buffer outlives the loop below, which waits for every request.
        let e = opcode::Read::new(types::Fd(f.as_raw_fd()), unsafe { base.add(slot * BLOCK) }, n)
            .offset(off)
            .build()
            .user_data(slot as u64);
        // SAFETY: as above.
        unsafe { ring.submission().push(&e).expect("sq") };
    };
    for slot in 0..QD {
        if next >= len {
            break;
        }
        push(&mut ring, slot, next);
        next += BLOCK as u64;
        in_flight += 1;
    }
    while in_flight > 0 {
        ring.submit_and_wait(1).expect("wait");
        let done: Vec<(u64, i32)> = ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (slot, res) in done {
            assert!(res > 0, "read failed: {res}");
            in_flight -= 1;
            if next < len {
                push(&mut ring, slot as usize, next);
                next += BLOCK as u64;
                in_flight += 1;
            }
        }
    }
}

fn run_mode(mode: &str, args: &Args, len: u64) -> f64 {
    let path = &args.file;
    let cfg = |method| PosixConfig { method, queue_depth: args.qd, block_size: args.block, ..PosixConfig::default() };
    let huge = !mode.contains("-4k");
    let untimed_prefault = mode.contains("-warm");
    let read_into = |cfg: PosixConfig, direct: DirectIo, prefault: bool, shift: usize| -> f64 {
        let mut arena = Arena::new(len as usize + 4096, huge).expect("arena");
        if untimed_prefault {
            arena.prefault(turboio_storage::default_threads());
        }
        let t = Instant::now();
        if prefault {
            arena.prefault(turboio_storage::default_threads());
        }
        let f = PosixStorage::with_config(cfg).open_posix(path).expect("open");
        let dst = &mut arena.as_mut_slice()[shift..shift + len as usize];
        let r = f
            .read_ranges_report(
                vec![ReadRequest { offset: 0, dst }],
                &IoOptions { threads: args.threads, direct, ..Default::default() },
            )
            .expect("read");
        let secs = t.elapsed().as_secs_f64();
        eprintln!("    {mode}: {r:?}");
        std::hint::black_box(arena.as_slice()[len as usize / 2]);
        secs
    };
    match mode.replace("-4k", "").replace("-warm", "").as_str() {
        "std" => {
            let t = Instant::now();
            let v = std::fs::read(path).expect("read");
            let s = t.elapsed().as_secs_f64();
            std::hint::black_box(v[v.len() / 2]);
            s
        }
        m if m.starts_with("touch") => {
            // Only the first touch of a fresh arena: the floor under every copy into one.
            let t = Instant::now();
            let arena = Arena::new(len as usize, huge).expect("arena");
            arena.prefault(m["touch".len()..].parse().expect("touchN"));
            t.elapsed().as_secs_f64()
        }
        "raw" => {
            let t = Instant::now();
            raw_direct(path, len);
            t.elapsed().as_secs_f64()
        }
        "threads" => read_into(cfg(ReadMethod::Threads), DirectIo::Off, false, 0),
        "threads-prefault" => read_into(cfg(ReadMethod::Threads), DirectIo::Off, true, 0),
        "uring-buffered" => read_into(cfg(ReadMethod::IoUring), DirectIo::Off, false, 0),
        "uring" => read_into(cfg(ReadMethod::IoUring), DirectIo::On, false, 0),
        "uring-nc" => read_into(cfg(ReadMethod::IoUring), DirectIo::On, false, 1),
        "threads-direct" => read_into(cfg(ReadMethod::Threads), DirectIo::On, false, 0),
        "auto" => read_into(cfg(ReadMethod::Auto), DirectIo::Auto, false, 0),
        "uring-popconc" => {
            let t = Instant::now();
            let mut arena = Arena::new(len as usize, huge).expect("arena");
            let (addr, cap) = (arena.addr(), arena.capacity());
            let f = PosixStorage::with_config(cfg(ReadMethod::IoUring)).open_posix(path).expect("open");
            std::thread::scope(|s| {
                s.spawn(move || {
                    let addr = std::ptr::NonNull::new(addr as *mut std::ffi::c_void).expect("arena address");
                    // SAFETY: populating only faults in missing pages of our own mapping; it
                    // never changes the contents of a page that is already there.
                    let _ = unsafe { madvise(addr, cap, MmapAdvise::MADV_POPULATE_WRITE) };
                });
                f.read_ranges_report(
                    vec![ReadRequest { offset: 0, dst: arena.as_mut_slice() }],
                    &IoOptions { threads: args.threads, direct: DirectIo::On, ..Default::default() },
                )
                .expect("read");
            });
            t.elapsed().as_secs_f64()
        }
        m => panic!("unknown mode {m}"),
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args = parse();
    if !args.file.exists() {
        if let Some(dir) = args.file.parent() {
            std::fs::create_dir_all(dir).expect("mkdir");
        }
        eprintln!("creating {} ({} bytes)", args.file.display(), args.size);
        PosixStorage::new().write_file(&args.file, &Gen(args.size), &IoOptions::default()).expect("write");
    }
    let len = std::fs::metadata(&args.file).expect("stat").len();
    for state in ["hot", "cold"] {
        if state == "hot" {
            warm(&args.file);
        } else {
            drop_caches(&args.file);
        }
        let f = PosixStorage::new().open_posix(&args.file).expect("open");
        let mut best = f64::MAX;
        let mut frac = None;
        for _ in 0..20 {
            let t = Instant::now();
            frac = turboio_storage::StorageFile::cached_fraction(&f);
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("cached_fraction ({state}): {frac:?} in {:.0} us (best of 20)", best * 1e6);
    }
    let gb = len as f64 / 1e9;
    for (label, modes, cold) in [("hot", &args.hot, false), ("cold", &args.cold, true)] {
        if modes.is_empty() {
            continue;
        }
        println!("{label}: {} runs, {:.2} GB", args.runs, gb);
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
        for run in 0..args.runs {
            // Shuffle the order run by run: what ran before (memory it freed, pages it cached)
            // changes the next run, so no mode may always follow the same one.
            let mut order: Vec<usize> = (0..modes.len()).collect();
            let mut x = (run as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            for k in (1..order.len()).rev() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                order.swap(k, (x % (k as u64 + 1)) as usize);
            }
            for i in order {
                let m = &modes[i];
                if cold {
                    drop_caches(&args.file);
                } else {
                    warm(&args.file);
                }
                // Let the previous run's freed memory settle (on a VM with free page reporting
                // it goes back to the host after about 2 s), so every mode starts alike.
                std::thread::sleep(std::time::Duration::from_secs_f64(args.settle));
                let s = run_mode(m, &args, len);
                eprintln!("  run {run} {m}: {:.2} GB/s", gb / s);
                times[i].push(s);
            }
        }
        let base = median(&mut times[0].clone());
        for (m, t) in modes.iter().zip(times.iter_mut()) {
            let med = median(t);
            let all: Vec<String> = t.iter().map(|s| format!("{:.2}", gb / s)).collect();
            println!(
                "  {m:>16}: median {:.2} GB/s ({:.2}x {}) runs [{}]",
                gb / med,
                base / med,
                modes[0],
                all.join(" ")
            );
        }
    }
}
