//! Splitting bulk reads into chunks and running them on worker threads.

use crate::{IoOptions, ReadRequest, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// A piece of a [`ReadRequest`]: a range of the file and the destination slice for it.
#[derive(Debug)]
pub struct Chunk<'a> {
    /// Absolute offset in the file.
    pub offset: u64,
    /// Destination.
    pub dst: &'a mut [u8],
}

/// Available cores (at least 1).
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A thread count as the options take it: `threads`, or one per core when it is 0.
pub fn threads_or_default(threads: usize) -> usize {
    if threads == 0 {
        default_threads()
    } else {
        threads
    }
}

/// Cuts requests into chunks of at most `chunk` bytes, in request order. Empty requests vanish.
pub fn split_requests(requests: Vec<ReadRequest<'_>>, chunk: usize) -> Vec<Chunk<'_>> {
    let chunk = chunk.max(1);
    let mut out = Vec::new();
    for r in requests {
        let mut offset = r.offset;
        let mut rest = r.dst;
        while !rest.is_empty() {
            let n = rest.len().min(chunk);
            let (head, tail) = rest.split_at_mut(n);
            out.push(Chunk { offset, dst: head });
            offset += n as u64;
            rest = tail;
        }
    }
    out
}

/// Runs `work` on every chunk, spread over `opts.threads` workers, each with its own state
/// from `make_state` (a reader, a ring, a buffer). After each chunk the hook runs and progress
/// is counted; cancellation is checked between chunks. The first error stops all workers and is
/// returned.
pub fn for_each_chunk<'c, S, M, W>(chunks: Vec<Chunk<'c>>, opts: &IoOptions<'_>, make_state: M, work: W) -> Result<()>
where
    M: Fn() -> Result<S> + Sync,
    W: Fn(&mut S, &mut Chunk<'c>) -> Result<()> + Sync,
{
    if chunks.is_empty() {
        return opts.check_cancel();
    }
    let total: usize = chunks.iter().map(|c| c.dst.len()).sum();
    let largest = chunks.iter().map(|c| c.dst.len()).max().unwrap_or(1);
    let workers = opts.worker_count(total as u64, largest).min(chunks.len());
    let queue = Mutex::new(chunks.into_iter());
    run_workers(vec![(); workers], |(), stop| {
        let mut state = make_state()?;
        loop {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            opts.check_cancel()?;
            let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
            let Some(mut chunk) = next else { return Ok(()) };
            work(&mut state, &mut chunk)?;
            opts.chunk_read(chunk.offset, chunk.dst)?;
        }
    })
}

/// Runs `work` once per element of `states`, each on a thread of its own (the calling thread
/// takes the first), and returns the first error. `stop` is set as soon as one worker fails so
/// that the others can return early.
pub fn run_workers<S: Send, E: Send>(
    states: Vec<S>,
    work: impl Fn(S, &AtomicBool) -> Result<(), E> + Sync,
) -> Result<(), E> {
    let stop = AtomicBool::new(false);
    let first_error: Mutex<Option<E>> = Mutex::new(None);
    let run = |state: S| {
        if let Err(e) = work(state, &stop) {
            stop.store(true, Ordering::Relaxed);
            let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(e);
            }
        }
    };
    let mut states = states.into_iter();
    let first = states.next();
    if states.len() == 0 {
        if let Some(s) = first {
            run(s);
        }
    } else {
        std::thread::scope(|scope| {
            for s in states {
                scope.spawn(|| run(s));
            }
            if let Some(s) = first {
                run(s);
            }
        });
    }
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StorageError;

    #[test]
    fn split_covers_every_byte_once() {
        let mut a = vec![0u8; 10];
        let mut b = vec![0u8; 3];
        let mut empty: Vec<u8> = Vec::new();
        let reqs = vec![
            ReadRequest { offset: 100, dst: &mut a },
            ReadRequest { offset: 7, dst: &mut empty },
            ReadRequest { offset: 5, dst: &mut b },
        ];
        let chunks = split_requests(reqs, 4);
        let spans: Vec<(u64, usize)> = chunks.iter().map(|c| (c.offset, c.dst.len())).collect();
        assert_eq!(spans, vec![(100, 4), (104, 4), (108, 2), (5, 3)]);
    }

    #[test]
    fn workers_fill_disjoint_chunks_and_run_the_hook() {
        let mut buf = vec![0u8; 1000];
        let chunks = split_requests(vec![ReadRequest { offset: 0, dst: &mut buf }], 7);
        let hooked = std::sync::atomic::AtomicU64::new(0);
        let hook = |off: u64, d: &mut [u8]| {
            hooked.fetch_add(d.len() as u64, Ordering::Relaxed);
            for (i, b) in d.iter_mut().enumerate() {
                *b = b.wrapping_add(((off + i as u64) % 3) as u8);
            }
            Ok(())
        };
        let opts = IoOptions { threads: 3, hook: Some(&hook), ..Default::default() };
        for_each_chunk(
            chunks,
            &opts,
            || Ok(()),
            |_, c| {
                for (i, b) in c.dst.iter_mut().enumerate() {
                    *b = ((c.offset + i as u64) % 251) as u8;
                }
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(hooked.load(Ordering::Relaxed), 1000);
        for (i, b) in buf.iter().enumerate() {
            assert_eq!(*b, ((i % 251) as u8).wrapping_add((i % 3) as u8), "byte {i}");
        }
    }

    #[test]
    fn first_error_is_returned_and_cancel_stops() {
        let mut buf = vec![0u8; 100];
        let chunks = split_requests(vec![ReadRequest { offset: 0, dst: &mut buf }], 10);
        let opts = IoOptions { threads: 2, ..Default::default() };
        let err = for_each_chunk(
            chunks,
            &opts,
            || Ok(()),
            |_, c| {
                if c.offset == 50 {
                    Err(StorageError::Cancelled)
                } else {
                    Ok(())
                }
            },
        )
        .unwrap_err();
        assert!(matches!(err, StorageError::Cancelled));

        let cancel = AtomicBool::new(true);
        let mut buf = vec![0u8; 100];
        let chunks = split_requests(vec![ReadRequest { offset: 0, dst: &mut buf }], 10);
        let opts = IoOptions { cancel: Some(&cancel), ..Default::default() };
        let ran = std::sync::atomic::AtomicUsize::new(0);
        let err = for_each_chunk(
            chunks,
            &opts,
            || Ok(()),
            |_, _| {
                ran.fetch_add(1, Ordering::Relaxed);
                Ok(())
            },
        )
        .unwrap_err();
        assert!(matches!(err, StorageError::Cancelled));
        assert_eq!(ran.load(Ordering::Relaxed), 0);
    }
}
