//! A reader of the crash tests (`tests/tests/crash.rs`): loads `PATH` again and again (mapped
//! or copied) until its stdin is closed, checking that every load is one complete version of
//! the test model. Prints `ok LOADS MIN_VERSION MAX_VERSION` and exits 0, or prints what was
//! wrong and exits 1. A torn mapping would kill it with SIGBUS, which the harness sees.
//!
//! Usage: `crash_checker PATH mapped|copied`

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use turboio::{LoadMode, LoadOptions};
use turboio_tests::crash::check_model;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).cloned().unwrap_or_default();
    let mode = match args.get(2).map(String::as_str) {
        Some("mapped") => LoadMode::Mapped,
        Some("copied") => LoadMode::Copied,
        _ => {
            eprintln!("usage: crash_checker PATH mapped|copied");
            std::process::exit(2);
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        s.store(true, Ordering::Relaxed);
    });
    let (mut loads, mut lo, mut hi) = (0u64, u64::MAX, 0u64);
    while !stop.load(Ordering::Relaxed) || loads == 0 {
        let loaded = match turboio::load(&path, &LoadOptions { mode, threads: 1, ..Default::default() }) {
            Ok(l) => l,
            Err(e) => {
                println!("load {loads} failed: {e}");
                std::process::exit(1);
            }
        };
        match check_model(&loaded) {
            Ok(v) => {
                lo = lo.min(v);
                hi = hi.max(v);
            }
            Err(e) => {
                println!("load {loads}: {e}");
                std::process::exit(1);
            }
        }
        loads += 1;
    }
    println!("ok {loads} {lo} {hi}");
}
