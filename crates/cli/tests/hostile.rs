//! Crafted hostile inputs through the real binary, each in a child process with a deadline:
//! every one is refused (or read) in time linear in its size and with bounded memory, never a
//! crash, an abort or minutes of work. The shapes are the ones an outside review found (issue
//! 22): duplicate zip names, long names over many leaves, stacked end-of-directory records,
//! objects made and dropped by the million, expanded views in a conversion, and a safetensors
//! header of many tensors. The deadline is generous for a debug build on a busy 2-core CI
//! machine; before the fixes these took minutes, or gigabytes, or killed the process.

mod common;

#[path = "../../pt/tests/common/mod.rs"]
#[allow(unused_imports)]
mod pt_files;

use common::scratch;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::WaitStatus;
use nix::unistd::Pid;
use pt_files::hostile;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Far above what any of these needs here (well under 10 s each in a debug build), far below
/// the minutes the quadratic cases took.
const DEADLINE: Duration = Duration::from_secs(60);

/// What a bounded run of the binary did.
struct Run {
    /// Exit code; `None` if a signal ended it (the watchdog's, or an abort).
    code: Option<i32>,
    stderr: String,
    /// Peak resident memory of the child.
    peak_rss: u64,
    elapsed: Duration,
}

/// Runs `turboio ARGS` and waits for it with `wait4` (for its peak RSS); a watchdog thread
/// kills it at the deadline.
fn run(args: &[&str]) -> Run {
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_turboio"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run turboio");
    let pid = Pid::from_raw(child.id() as i32);
    let mut err_pipe = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut err_pipe, &mut s).ok();
        s
    });
    let (done, finished) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if finished.recv_timeout(DEADLINE).is_err() {
            // Our own child, which has not been reaped yet (the main thread reaps it only after
            // this thread is told, or after this kill).
            let _ = kill(pid, Signal::SIGKILL);
        }
    });
    // The child's own peak RSS needs wait4, which nix does not wrap: waitpid gives no rusage,
    // and getrusage(RUSAGE_CHILDREN) is the largest of every child this test process has
    // reaped, so one run could not be told from another.
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid value for wait4 to overwrite.
    // libc: the rusage wait4 fills (nix has no wrapper for wait4(2), above).
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child; `status` and `usage` are valid for writes.
    // libc: nix has no wrapper for wait4(2) (above).
    let r = unsafe { libc::wait4(pid.as_raw(), &mut status, 0, &mut usage) };
    assert_eq!(r, pid.as_raw(), "wait4: {}", std::io::Error::last_os_error());
    let elapsed = start.elapsed();
    let _ = done.send(());
    watchdog.join().unwrap();
    // The child is reaped: std must not wait for it again (it would find nothing).
    std::mem::forget(child);
    let code = match WaitStatus::from_raw(pid, status) {
        Ok(WaitStatus::Exited(_, code)) => Some(code),
        _ => None,
    };
    Run { code, stderr: reader.join().unwrap(), peak_rss: usage.ru_maxrss as u64 * 1024, elapsed }
}

/// Runs, and checks: a clean exit with `code` within the deadline, stderr naming the file and
/// containing `words`, peak memory under `max_rss`.
fn expect(args: &[&str], code: i32, file: &Path, words: &[&str], max_rss: u64) {
    let r = run(args);
    let what = format!("turboio {}", args.join(" "));
    assert_eq!(
        r.code,
        Some(code),
        "{what}: ended by a signal or with the wrong code after {:?} (deadline {DEADLINE:?}): {}",
        r.elapsed,
        r.stderr
    );
    if code != 0 {
        let name = file.file_name().unwrap().to_str().unwrap();
        assert!(r.stderr.contains(name), "{what}: the error names the file: {}", r.stderr);
    }
    for w in words {
        assert!(r.stderr.contains(w), "{what}: expected `{w}` in: {}", r.stderr);
    }
    assert!(r.peak_rss < max_rss, "{what}: peak RSS {} MiB (bound {} MiB)", r.peak_rss >> 20, max_rss >> 20);
    eprintln!("{what}: {:?}, peak {} MiB", r.elapsed, r.peak_rss >> 20);
}

const MIB: u64 = 1 << 20;

#[test]
fn hostile_pt_files_are_refused_in_linear_time_and_bounded_memory() {
    let d = scratch();
    let write = |name: &str, bytes: &[u8]| {
        let p = d.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let s = |p: &Path| p.to_str().unwrap().to_owned();

    // Two entries named `archive/data/0`: torch reads the first, the zip crate kept the last.
    let dup = write("dup.pt", &hostile::duplicate_names(0xff));
    expect(&["load", &s(&dup)], 1, &dup, &["two entries are named `archive/data/0`"], 256 * MIB);
    expect(&["inspect", &s(&dup)], 1, &dup, &["two entries are named"], 256 * MIB);

    // {'A' * 10**6: [None] * 10**6}: about 2 MB; naming every leaf would build a terabyte.
    let long = write("long.pt", &hostile::long_names(1_000_000, 1_000_000));
    assert!(std::fs::metadata(&long).unwrap().len() < 3 << 20);
    expect(&["inspect", &s(&long)], 1, &long, &["max_name_bytes"], 512 * MIB);

    // 60,000 stacked end-of-directory records (1.3 MB): a quadratic search took minutes.
    let stacked = write("stacked.pt", &hostile::stacked_directory_records(60_000, 0));
    expect(&["load", &s(&stacked)], 1, &stacked, &["central directory"], 256 * MIB);

    // 8 million empty tuples in a list (8 MB) read as an empty checkpoint in little memory (the
    // tuple is made once; one object each took 1.4 GB for 16 million before); one dict key set
    // 10 million times to a new list (50 MB) is refused by a limit, never grows past it.
    let tuples = write("tuples.pt", &hostile::empty_tuples(8 << 20));
    expect(&["inspect", &s(&tuples)], 0, &tuples, &[], 384 * MIB);
    let lists = write("lists.pt", &hostile::made_and_dropped(b']', 10_000_000));
    let r = run(&["inspect", &s(&lists)]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("lists.pt") && r.stderr.contains("max_"), "{}", r.stderr);
    assert!(r.peak_rss < 1024 * MIB, "peak {} MiB", r.peak_rss >> 20);

    // A 600-byte view of one float expanded to 2^29 elements: the conversion refuses it before
    // allocating 2 GiB, and leaves no output or temporary.
    let bomb = write("bomb.pt", &hostile::expanded_view(&[1 << 29], &[0]));
    let out = d.path().join("bomb.safetensors");
    expect(&["convert", &s(&bomb), &s(&out)], 1, &bomb, &["expanded view"], 256 * MIB);
    let left: Vec<_> = std::fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(!out.exists() && !left.iter().any(|n| n.to_string_lossy().contains("turboio-tmp")), "{left:?}");
}

#[test]
fn a_safetensors_header_of_many_tensors_reads_in_linear_time() {
    // 200,000 one-byte tensors (a 9 MB header) in reverse name order: parsed, validated
    // (sorted, checked for overlaps and gaps) and loaded within the deadline; the same header
    // with one overlap is refused naming the tensors.
    let d = scratch();
    let n = 200_000usize;
    let header = |overlap: bool| {
        let mut h = String::from("{");
        for i in (0..n).rev() {
            let start = if overlap && i == n - 1 { i - 1 } else { i };
            h.push_str(&format!(
                "\"t{i:06}\":{{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[{start},{}]}},",
                start + 1
            ));
        }
        h.pop();
        h.push('}');
        while h.len() % 8 != 0 {
            h.push(' ');
        }
        let mut f = (h.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(h.as_bytes());
        f.extend((0..n).map(|i| i as u8));
        f
    };
    let good = d.path().join("many.safetensors");
    std::fs::write(&good, header(false)).unwrap();
    let g = good.to_str().unwrap();
    expect(&["inspect", g], 0, &good, &[], 512 * MIB);
    expect(&["load", g, "--check"], 0, &good, &[], 1024 * MIB);
    let bad = d.path().join("overlap.safetensors");
    std::fs::write(&bad, header(true)).unwrap();
    let r = run(&["load", bad.to_str().unwrap()]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("overlap.safetensors"), "{}", r.stderr);
}
