//! Save throughput of the posix backend: buffered against `O_DIRECT` writes, by thread count.
//!
//! ```text
//! cargo run --release -p turboio-io-posix --example writebench -- FILE [--size GIB] [--runs N]
//!     [--modes buffered:1,buffered:2,direct:1,direct:2]
//! ```
//!
//! Each run writes FILE atomically (with fsync) from a reused in-memory source and deletes it.

use std::path::PathBuf;
use std::time::Instant;
use turboio_io_posix::{PosixConfig, PosixStorage};
use turboio_storage::{BytesSource, IoOptions, Storage};

fn main() {
    let mut file = PathBuf::new();
    let mut size: usize = 2 << 30;
    let mut runs = 3;
    let mut wanted = "buffered:1,buffered:2,direct:1,direct:2".to_string();
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--size" => size = it.next().and_then(|v| v.parse::<usize>().ok()).expect("GiB") << 30,
            "--modes" => wanted = it.next().expect("modes"),
            "--runs" => runs = it.next().and_then(|v| v.parse().ok()).expect("runs"),
            f => file = PathBuf::from(f),
        }
    }
    assert!(!file.as_os_str().is_empty(), "usage: writebench FILE");
    let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
    let gb = size as f64 / 1e9;
    let modes: Vec<(String, bool, usize)> = wanted
        .split(',')
        .map(|m| {
            let (kind, t) = m.split_once(':').expect("MODE:THREADS");
            let t: usize = t.parse().expect("threads");
            (m.to_string(), kind == "direct", t)
        })
        .collect();
    let mut times = vec![Vec::new(); modes.len()];
    for run in 0..runs {
        for (i, (name, direct, threads)) in modes.iter().enumerate() {
            let st = PosixStorage::with_config(PosixConfig { direct_writes: *direct, ..PosixConfig::default() });
            let t = Instant::now();
            st.write_file(&file, &BytesSource(&data), &IoOptions { threads: *threads, ..Default::default() })
                .expect("write");
            let s = t.elapsed().as_secs_f64();
            eprintln!("  run {run} {name}: {:.2} GB/s", gb / s);
            times[i].push(s);
            std::fs::remove_file(&file).expect("remove");
        }
    }
    for ((name, _, _), t) in modes.iter().zip(times.iter_mut()) {
        t.sort_by(f64::total_cmp);
        println!("{name:>12}: median {:.2} GB/s", gb / t[t.len() / 2]);
    }
}
