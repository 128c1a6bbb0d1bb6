//! Saves: one PUT for an object that fits in one part, else a multipart upload whose parts are
//! filled in parallel and uploaded several at a time; the object appears only on completion,
//! and any failure aborts the upload.

use crate::{runtime, ObjectStorage};
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use object_store::{MultipartUpload, ObjectStoreExt, PutPayload};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use turboio_storage::{IoOptions, StorageError, WriteSource};

/// S3's (and moto's, and s3s's) largest part count.
const MAX_PARTS: u64 = 10_000;
/// S3's smallest part but the last.
const MIN_PART: u64 = 5 << 20;

/// The part size for an object of `size` bytes: the configured size, grown so that the parts
/// fit in [`MAX_PARTS`], in whole MiB.
pub(crate) fn part_size(configured: usize, size: u64) -> u64 {
    let need = size.div_ceil(MAX_PARTS).max(MIN_PART).max(configured as u64);
    need.div_ceil(1 << 20) * (1 << 20)
}

fn source_error(path: &Path, message: String) -> StorageError {
    StorageError::Source { path: path.to_owned(), message }
}

/// Fills a fresh buffer with `len` bytes of `source` at `offset`.
fn fill(path: &Path, source: &dyn WriteSource, offset: u64, len: usize) -> Result<Vec<u8>, StorageError> {
    let mut buf = Vec::new();
    buf.try_reserve_exact(len).map_err(|_| source_error(path, format!("cannot allocate a {len}-byte part")))?;
    buf.resize(len, 0);
    source.fill(offset, &mut buf).map_err(|m| source_error(path, m))?;
    Ok(buf)
}

pub(crate) fn write_file(
    storage: &ObjectStorage,
    path: &Path,
    source: &dyn WriteSource,
    opts: &IoOptions<'_>,
) -> Result<(), StorageError> {
    if path.to_str().is_some_and(|u| u.starts_with("http://") || u.starts_with("https://")) {
        return Err(StorageError::Unsupported {
            backend: "object",
            what: format!(
                "saving to {}: http(s):// URLs are read-only (save to s3://, gs:// or az://)",
                storage.redact(&path.to_string_lossy())
            ),
        });
    }
    let located = storage.locate(path)?;
    let (store, key) = (located.store, located.key);
    let size = source.len();
    let part = part_size(storage.options().part_size, size);
    let io = |e: std::io::Error| StorageError::io(path, "PUT", e);
    if size <= part {
        opts.check_cancel()?;
        let len = usize::try_from(size).map_err(|_| source_error(path, "too large".into()))?;
        let body = fill(path, source, 0, len)?;
        opts.check_cancel()?;
        runtime::block_on(async { store.put(&key, PutPayload::from(body)).await })
            .map_err(io)?
            .map_err(|e| storage.error(path, "PUT", e))?;
        opts.add_progress(size);
        return Ok(());
    }

    let upload: Box<dyn MultipartUpload> = runtime::block_on(async { store.put_multipart(&key).await })
        .map_err(io)?
        .map_err(|e| storage.error(path, "CreateMultipartUpload", e))?;
    // Aborted when dropped unless completed: on an error, and on a panic unwinding through here
    // (the parts uploaded so far are deleted; the previous object was never touched).
    let upload = Mutex::new(AbortOnDrop(Some(upload)));
    let parts = size.div_ceil(part);
    let next = AtomicUsize::new(0);
    // Parts are numbered in the order `put_part` is called: each is submitted in its turn.
    let turn = (Mutex::new(0u64), Condvar::new());
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<StorageError>> = Mutex::new(None);
    let concurrency = storage.options().concurrency.max(1);
    let threads = opts.worker_count(size, part as usize).min(concurrency).max(1);
    let per_thread = concurrency.div_ceil(threads);

    let fail = |e: StorageError| {
        failed.store(true, Ordering::Relaxed);
        let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() || matches!(*slot, Some(StorageError::Cancelled)) {
            *slot = Some(e);
        }
        drop(slot);
        let _guard = turn.0.lock().unwrap_or_else(|p| p.into_inner());
        turn.1.notify_all();
    };
    let work = || -> Result<(), StorageError> {
        let mut inflight = FuturesUnordered::new();
        let run = async {
            loop {
                while inflight.len() >= per_thread {
                    if let Some(done) = inflight.next().await {
                        let n: u64 = done?;
                        opts.add_progress(n);
                    }
                }
                if failed.load(Ordering::Relaxed) {
                    return Err(StorageError::Cancelled);
                }
                opts.check_cancel()?;
                let i = next.fetch_add(1, Ordering::Relaxed) as u64;
                if i >= parts {
                    break;
                }
                let offset = i * part;
                let len = (size - offset).min(part) as usize;
                let body = fill(path, source, offset, len)?;
                // Wait for this part's turn, then submit it.
                let mut current = turn.0.lock().unwrap_or_else(|p| p.into_inner());
                while *current != i {
                    if failed.load(Ordering::Relaxed) {
                        return Err(StorageError::Cancelled);
                    }
                    current = turn.1.wait(current).unwrap_or_else(|p| p.into_inner());
                }
                let fut = upload.lock().unwrap_or_else(|p| p.into_inner()).part(PutPayload::from(body))?;
                *current += 1;
                turn.1.notify_all();
                drop(current);
                inflight.push(async move {
                    fut.await.map(|()| len as u64).map_err(|e| storage.error(path, "UploadPart", e))
                });
            }
            while let Some(done) = inflight.next().await {
                opts.add_progress(done?);
            }
            Ok(())
        };
        runtime::block_on(run).map_err(io)?
    };
    // A worker that panics (the source's code) stops the others as a failure would (they may
    // be waiting for its part's turn); the panic goes on once every worker has stopped, and the
    // upload is aborted as it unwinds.
    let panicked = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&work)) {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => {
                        fail(e);
                        None
                    }
                    Err(p) => {
                        fail(StorageError::Cancelled);
                        Some(p)
                    }
                })
            })
            .collect();
        let mut panicked = None;
        for h in handles {
            match h.join() {
                Ok(p) => panicked = panicked.or(p),
                Err(p) => panicked = panicked.or(Some(p)),
            }
        }
        panicked
    });
    let mut upload = upload.into_inner().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = panicked {
        drop(upload);
        std::panic::resume_unwind(p);
    }
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    let mut parts = upload.0.take().ok_or_else(|| source_error(path, "internal: the upload went away".into()))?;
    let completed = runtime::block_on(async { parts.complete().await }).map_err(io)?;
    if let Err(e) = completed {
        let _ = runtime::block_on(async { parts.abort().await });
        return Err(storage.error(path, "CompleteMultipartUpload", e));
    }
    Ok(())
}

/// A multipart upload that is aborted when dropped before it was taken out to complete.
struct AbortOnDrop(Option<Box<dyn MultipartUpload>>);

impl AbortOnDrop {
    fn part(&mut self, body: PutPayload) -> Result<object_store::UploadPart, StorageError> {
        match &mut self.0 {
            Some(u) => Ok(u.put_part(body)),
            None => Err(StorageError::Cancelled),
        }
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(mut upload) = self.0.take() {
            // Best effort: a store that cannot be reached now expires the parts itself.
            let _ = runtime::block_on(async { upload.abort().await });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_fit_the_part_limit() {
        assert_eq!(part_size(8 << 20, 1 << 30), 8 << 20);
        assert_eq!(part_size(1, 1 << 20), 5 << 20);
        let big = 200u64 << 30;
        let p = part_size(8 << 20, big);
        assert!(big.div_ceil(p) <= MAX_PARTS && p.is_multiple_of(1 << 20), "{p}");
    }
}
