//! Save throughput of the posix backend: buffered against `O_DIRECT` writes, by thread count.
//!
//! ```text
//! cargo run --release -p turboio-io-posix --example writebench -- FILE [--size GIB] [--runs N]
//!     [--modes buffered:1,buffered:2,direct:1,direct:2] [--chunk MIB]
//! ```
//!
//! Each run writes FILE atomically (with fsync) from a reused in-memory source and deletes it
//! (kept with `WRITEBENCH_KEEP=1`). A mode is `KIND:THREADS[:CHUNK_MIB]`; the modes alternate
//! within each run. `--chunk` sets the chunk of modes that do not give one (default: the
//! writer's).

use std::path::PathBuf;
use std::time::Instant;
use turboio_io_posix::{PosixConfig, PosixStorage};
use turboio_storage::{BytesSource, IoOptions, Storage};

fn main() {
    let mut file = PathBuf::new();
    let mut size: usize = 2 << 30;
    let mut runs = 3;
    let mut wanted = "buffered:1,buffered:2,direct:1,direct:2".to_string();
    let mut chunk = 0usize;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--size" => size = it.next().and_then(|v| v.parse::<usize>().ok()).expect("GiB") << 30,
            "--modes" => wanted = it.next().expect("modes"),
            "--runs" => runs = it.next().and_then(|v| v.parse().ok()).expect("runs"),
            "--chunk" => chunk = it.next().and_then(|v| v.parse::<usize>().ok()).expect("MiB") << 20,
            f => file = PathBuf::from(f),
        }
    }
    assert!(!file.as_os_str().is_empty(), "usage: writebench FILE");
    let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
    let gb = size as f64 / 1e9;
    // MODE:THREADS[:CHUNK_MIB]
    let modes: Vec<(String, bool, usize, usize)> = wanted
        .split(',')
        .map(|m| {
            let mut parts = m.split(':');
            let kind = parts.next().expect("MODE");
            let t: usize = parts.next().expect("MODE:THREADS").parse().expect("threads");
            let c = parts.next().map_or(chunk, |c| c.parse::<usize>().expect("chunk MiB") << 20);
            (m.to_string(), kind == "direct", t, c)
        })
        .collect();
    let mut times = vec![Vec::new(); modes.len()];
    for run in 0..runs {
        for (i, (name, direct, threads, chunk)) in modes.iter().enumerate() {
            let st = PosixStorage::with_config(PosixConfig { direct_writes: *direct, ..PosixConfig::default() });
            let t = Instant::now();
            st.write_file(
                &file,
                &BytesSource(&data),
                &IoOptions { threads: *threads, chunk_size: *chunk, ..Default::default() },
            )
            .expect("write");
            let s = t.elapsed().as_secs_f64();
            eprintln!("  run {run} {name}: {:.2} GB/s", gb / s);
            times[i].push(s);
            if std::env::var_os("WRITEBENCH_KEEP").is_none() {
                std::fs::remove_file(&file).expect("remove");
            }
        }
    }
    for ((name, ..), t) in modes.iter().zip(times.iter_mut()) {
        t.sort_by(f64::total_cmp);
        println!("{name:>12}: median {:.2} GB/s", gb / t[t.len() / 2]);
    }
}
