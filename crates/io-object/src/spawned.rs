//! A read's ranged GETs as tasks of the process's Tokio runtime, each copying its body into
//! place on the runtime thread that received it; the calling thread only hands out parts and
//! runs the per-chunk hooks.
//!
//! Why not `block_on` on the caller's threads (what the crate did first): there, every piece
//! of every body is received by a runtime thread and copied by a caller thread, so each piece
//! costs a cross-thread wake-up, and a model load filling several files at once had one such
//! thread per file. Measured with `turboio load` on the 2-vCPU VM against s3s-fs on the same
//! machine (1.07 GB, 16 GETs of 8 MiB in flight, 5 alternating runs, mean wall time and client
//! CPU): a file with two calling threads 3.74 s / 1.94 s, with one 3.20 s / 1.47 s, as tasks
//! 3.25 s / 1.24 s; a 10-shard model (ten calling threads) 3.88 s / 1.96 s, as tasks 3.41 s /
//! 1.31 s. Where the client shares the cores (with the server here; with a training job or the
//! GPU driver elsewhere) the wake-ups are what it costs; as tasks, a whole part costs one
//! wake-up of the caller however many files load at once.
//!
//! The tasks write into the caller's memory, which `tokio::spawn` cannot borrow (it wants
//! `'static` futures): each task gets the address and length of its part, and the caller does
//! not return before every task it spawned has reported back (a guard reports even when a
//! task is dropped unfinished: a runtime shutting down, a panic). That is the one `unsafe`
//! here; no maintained crate offers scoped Tokio tasks safely without the same blocking wait
//! (async-scoped's non-blocking `scope` is itself `unsafe` to call).

use crate::read::ObjectFile;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;
use turboio_storage::{Chunk, IoOptions, StorageError, StorageFile};

/// A part's destination, sent to its task.
struct Dst {
    addr: usize,
    len: usize,
}

/// Reports a task's end to the caller when dropped: after a normal end with its result, when
/// dropped unfinished (a panic in the HTTP client, the runtime shutting down) with an error
/// naming the object.
struct Report {
    tx: mpsc::Sender<(usize, Result<(), StorageError>)>,
    index: usize,
    file: Arc<ObjectFile>,
    result: Option<Result<(), StorageError>>,
}

impl Drop for Report {
    fn drop(&mut self) {
        let r = self.result.take().unwrap_or_else(|| {
            Err(StorageError::Io {
                path: self.file.path().to_owned(),
                op: "GET",
                source: std::io::Error::other(
                    "a part's request ended unfinished (the HTTP client panicked, or its runtime shut down)",
                ),
            })
        });
        // The caller waits for this message; it is gone only if the caller is gone, which it
        // cannot be while a task of its is running.
        let _ = self.tx.send((self.index, r));
    }
}

/// Waits for the tasks still running when dropped (an error, a panic in a hook): none of
/// them may outlive the memory it writes into. They stop at once (`stop` ends their GETs).
struct Running<'a> {
    rx: &'a mpsc::Receiver<(usize, Result<(), StorageError>)>,
    count: usize,
    stop: &'a tokio::sync::watch::Sender<bool>,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if self.count > 0 {
            let _ = self.stop.send(true);
        }
        while self.count > 0 && self.rx.recv().is_ok() {
            self.count -= 1;
        }
    }
}

/// Fetches every chunk of `parts` (none inside the opening GET's bytes) with at most
/// `concurrency` GETs in flight, running `opts.hook` and counting progress for each on the
/// calling thread. Returns once every spawned task has ended; the first error wins (and stops
/// the others at once), a cancellation only if nothing else failed.
pub(crate) fn fetch_all(
    file: &ObjectFile,
    rt: &tokio::runtime::Runtime,
    mut parts: Vec<Chunk<'_>>,
    opts: &IoOptions<'_>,
    concurrency: usize,
) -> Result<(), StorageError> {
    let file = Arc::new(file.clone());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let (tx, rx) = mpsc::channel();
    let spawn = |index: usize, chunk: &mut Chunk<'_>| {
        let dst = Dst { addr: chunk.dst.as_mut_ptr() as usize, len: chunk.dst.len() };
        let (offset, mut stopped) = (chunk.offset, stopped.clone());
        let mut report = Report { tx: tx.clone(), index, file: file.clone(), result: None };
        rt.spawn(async move {
            // SAFETY: `dst` is the memory of `parts[index].dst`, a `&mut [u8]` of the caller's
            // that outlives this task: `fetch_all` neither returns (`Running` waits, on every
            // path out, unwinding included) nor touches that chunk before it has received this
            // task's report, which `report` sends only when it is dropped, after `bytes`
            // (declared later, and moved into `fetch`, which ends first) is gone. The chunks
            // are disjoint slices: no two tasks write the same bytes.
            let bytes = unsafe { std::slice::from_raw_parts_mut(dst.addr as *mut u8, dst.len) };
            let result = {
                // The GET ends at once when the read stops (an error elsewhere, a cancellation),
                // even while it waits for an answer.
                let fetch = std::pin::pin!(report.file.fetch(offset, bytes));
                let halted = std::pin::pin!(stopped.wait_for(|s| *s));
                match futures_util::future::select(fetch, halted).await {
                    futures_util::future::Either::Left((r, _)) => r,
                    futures_util::future::Either::Right(_) => Err(StorageError::Cancelled),
                }
            };
            report.result = Some(result);
            drop(report);
        });
    };
    let mut running = Running { rx: &rx, count: 0, stop: &stop };
    let mut next = 0usize;
    let mut failure: Option<StorageError> = None;
    let concurrency = concurrency.max(1);
    while next < parts.len() && running.count < concurrency {
        spawn(next, &mut parts[next]);
        next += 1;
        running.count += 1;
    }
    let fail = |e: StorageError, failure: &mut Option<StorageError>| {
        let _ = stop.send(true);
        if failure.as_ref().is_none_or(|f| matches!(f, StorageError::Cancelled)) {
            *failure = Some(e);
        }
    };
    while running.count > 0 {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok((index, result)) => {
                running.count -= 1;
                match result {
                    Ok(()) if failure.is_none() => {
                        let c = &mut parts[index];
                        let hooked = match opts.hook {
                            Some(hook) => hook(c.offset, c.dst),
                            None => Ok(()),
                        }
                        .and_then(|()| opts.check_cancel());
                        match hooked {
                            Ok(()) => {
                                opts.add_progress(c.dst.len() as u64);
                                if next < parts.len() {
                                    spawn(next, &mut parts[next]);
                                    next += 1;
                                    running.count += 1;
                                }
                            }
                            Err(e) => fail(e, &mut failure),
                        }
                    }
                    Ok(()) => {}
                    Err(e) => fail(e, &mut failure),
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Err(e) = opts.check_cancel() {
                    fail(e, &mut failure);
                }
            }
            // Unreachable: `tx` is held here.
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    drop(running);
    match failure {
        Some(e) => Err(e),
        None => opts.check_cancel(),
    }
}
