//! The read path: one opening GET (size, ETag, the header's bytes), then parallel ranged GETs
//! pinned to that ETag, each body copied into its final place as it arrives.

use crate::{runtime, ObjectStorage};
use bytes::Bytes;
use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreExt};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use turboio_storage::{split_requests, Chunk, IoOptions, RangeReader, ReadRequest, StorageError, StorageFile};

/// An object opened for reading, pinned to the version it had when opened.
#[derive(Clone)]
pub(crate) struct ObjectFile {
    storage: ObjectStorage,
    url: PathBuf,
    store: Arc<dyn ObjectStore>,
    key: ObjectPath,
    pin: Pin,
    /// The object's first bytes, from the opening GET.
    prefix: Bytes,
}

/// What the opening answer said about the object, checked against every later answer: its
/// size always, its ETag and version id where it has them, and its `Last-Modified` where it has
/// no ETag. A server that ignores `If-Match` and answers from another version is caught here,
/// not trusted.
#[derive(Clone, Debug)]
pub(crate) struct Pin {
    size: u64,
    etag: Option<String>,
    version: Option<String>,
    /// Pinned only for an object without an ETag (object_store reports a missing header as the
    /// epoch, which pins nothing).
    modified: Option<DateTime<Utc>>,
}

impl Pin {
    pub(crate) fn new(meta: &ObjectMeta) -> Pin {
        let modified =
            (meta.e_tag.is_none() && meta.last_modified.timestamp_nanos_opt() != Some(0)).then_some(meta.last_modified);
        Pin { size: meta.size, etag: meta.e_tag.clone(), version: meta.version.clone(), modified }
    }

    /// True when something tells this version from another (an ETag, a version id or a
    /// modification time): reads may then be split into parallel parts.
    fn validated(&self) -> bool {
        self.etag.is_some() || self.version.is_some() || self.modified.is_some()
    }

    /// How `meta` (a later answer) differs from the pinned version, if it does.
    fn differs(&self, meta: &ObjectMeta) -> Option<String> {
        if meta.size != self.size {
            return Some(format!("its size went from {} to {} bytes", self.size, meta.size));
        }
        if meta.e_tag != self.etag {
            return Some(format!(
                "its ETag went from {} to {}",
                self.etag.as_deref().unwrap_or("none"),
                meta.e_tag.as_deref().unwrap_or("none")
            ));
        }
        if self.version.is_some() && meta.version != self.version {
            return Some("its version id changed".into());
        }
        match self.modified {
            Some(m) if meta.last_modified != m => {
                Some(format!("its Last-Modified went from {} to {}", m.to_rfc2822(), meta.last_modified.to_rfc2822()))
            }
            _ => None,
        }
    }

    /// The version tag (see [`StorageFile::version`]).
    pub(crate) fn tag(&self) -> Option<String> {
        match (&self.etag, &self.version, self.modified) {
            (None, None, None) => None,
            (None, None, Some(m)) => Some(format!("modified={}", m.timestamp_nanos_opt().unwrap_or(0))),
            (e, v, _) => Some(format!("etag={} version={}", e.as_deref().unwrap_or("-"), v.as_deref().unwrap_or("-"))),
        }
    }
}

impl fmt::Debug for ObjectFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectFile")
            .field("url", &self.storage.redact(&self.url.to_string_lossy()))
            .field("pin", &self.pin)
            .finish_non_exhaustive()
    }
}

/// True for failures worth fetching the rest of a part again for (object_store has already
/// retried the request itself): not a missing object, a refusal, a changed object or a bad
/// request.
fn transient(e: &object_store::Error) -> bool {
    use object_store::Error as E;
    !matches!(
        e,
        E::NotFound { .. }
            | E::Precondition { .. }
            | E::PermissionDenied { .. }
            | E::Unauthenticated { .. }
            | E::NotSupported { .. }
            | E::InvalidPath { .. }
            | E::NotImplemented { .. }
            | E::NotModified { .. }
            | E::AlreadyExists { .. }
    )
}

enum Fetch {
    Done,
    /// The body ended before the range was complete (a cut connection).
    Short,
}

/// What the opening GET gave: the object's metadata and its first bytes, or object_store's
/// error.
type Opening = Result<(ObjectMeta, Bytes), object_store::Error>;

impl ObjectFile {
    pub(crate) fn open(storage: &ObjectStorage, url: &Path) -> Result<ObjectFile, StorageError> {
        let located = storage.locate(url)?;
        let (store, key) = (located.store, located.key);
        let want = storage.options().prefix_bytes.max(1) as u64;
        let get = GetOptions { range: Some(GetRange::Bounded(0..want)), ..Default::default() };
        let (s, k) = (store.clone(), key.clone());
        let first: Opening = runtime::block_on(async move {
            let r = match s.get_opts(&k, get).await {
                Ok(r) => r,
                Err(e) => return Ok(Err(e)),
            };
            let (meta, range) = (r.meta.clone(), r.range.clone());
            if range.start != 0 || range.end > want || range.end > meta.size {
                return Err(format!(
                    "the server answered bytes {}..{} of a {}-byte object for a request of bytes 0..{want}",
                    range.start, range.end, meta.size
                ));
            }
            // Never more than was asked for, whatever the server sends (a body without end
            // would otherwise be collected until memory runs out).
            let limit = range.end as usize;
            let mut bytes = Vec::with_capacity(limit);
            let mut body = r.into_stream();
            while let Some(piece) = body.next().await {
                let piece = match piece {
                    Ok(p) => p,
                    Err(e) => return Ok(Err(e)),
                };
                if piece.len() > limit - bytes.len() {
                    return Err(format!("the server sent more than the {limit} bytes its answer announced"));
                }
                bytes.extend_from_slice(&piece);
            }
            if bytes.len() != limit {
                return Err(format!("the body ended after {} of the {limit} bytes announced", bytes.len()));
            }
            Ok(Ok((meta, Bytes::from(bytes))))
        })
        .map_err(|e| StorageError::io(url, "GET", e))?
        .map_err(|message| StorageError::Io {
            path: url.to_owned(),
            op: "GET",
            source: std::io::Error::other(message),
        })?;
        let (pin, prefix) = match first {
            Ok((meta, bytes)) => (Pin::new(&meta), bytes),
            Err(e) if transient(&e) => {
                // An empty object has no byte 0 to ask for: look it up instead.
                let (s, k) = (store.clone(), key.clone());
                match runtime::block_on(async move { s.head(&k).await })
                    .map_err(|e| StorageError::io(url, "HEAD", e))?
                {
                    Ok(meta) if meta.size == 0 => (Pin::new(&meta), Bytes::new()),
                    // Not empty, or no answer to a HEAD either: the GET's failure is the one to tell.
                    _ => return Err(storage.error(url, "GET", e)),
                }
            }
            Err(e) => return Err(storage.error(url, "GET", e)),
        };
        Ok(ObjectFile { storage: storage.clone(), url: url.to_owned(), store, key, pin, prefix })
    }

    fn check_range(&self, offset: u64, len: usize) -> Result<(), StorageError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.pin.size => Ok(()),
            end => Err(StorageError::ShortFile {
                path: self.url.clone(),
                offset,
                end: end.unwrap_or(u64::MAX),
                file_len: self.pin.size,
            }),
        }
    }

    /// `dst` from the opening GET's bytes, when they hold it.
    fn copy_from_prefix(&self, offset: u64, dst: &mut [u8]) -> bool {
        let Ok(start) = usize::try_from(offset) else { return false };
        match start.checked_add(dst.len()).and_then(|end| self.prefix.get(start..end)) {
            Some(src) => {
                dst.copy_from_slice(src);
                true
            }
            None => false,
        }
    }

    /// One ranged GET of `offset..offset + dst.len()` pinned to the opened version, its body
    /// copied into `dst[*filled..]` as it arrives.
    async fn get_into(
        &self,
        offset: u64,
        dst: &mut [u8],
        filled: &mut usize,
    ) -> Result<Result<Fetch, object_store::Error>, StorageError> {
        let start = offset + *filled as u64;
        let end = offset + dst.len() as u64;
        let get = GetOptions {
            range: Some(GetRange::Bounded(start..end)),
            if_match: self.pin.etag.clone(),
            if_unmodified_since: self.pin.modified,
            version: self.pin.version.clone(),
            ..Default::default()
        };
        // Held until the body is in: the backend's requests in flight stay within `concurrency`.
        let local = self.storage.local();
        let _permit = local.permits.acquire().await.map_err(|_| StorageError::Cancelled)?;
        let result = match self.store.get_opts(&self.key, get).await {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        if let Some(what) = self.pin.differs(&result.meta) {
            // The server ignored the condition (or the object has no validator to send).
            return Err(changed(&self.url, &what));
        }
        if result.range != (start..end) {
            return Err(self.protocol(format!(
                "asked for bytes {start}..{end}, the server answered bytes {}..{}",
                result.range.start, result.range.end
            )));
        }
        let mut body = result.into_stream();
        while let Some(piece) = body.next().await {
            let piece = match piece {
                Ok(p) => p,
                Err(e) => return Ok(Err(e)),
            };
            let room = &mut dst[*filled..];
            if piece.len() > room.len() {
                return Err(self.protocol(format!("the server sent more than the {} bytes asked for", end - start)));
            }
            if let Some(wait) = local.limiter.reserve(piece.len()) {
                tokio::time::sleep(wait).await;
            }
            room[..piece.len()].copy_from_slice(&piece);
            *filled += piece.len();
        }
        Ok(Ok(if *filled == dst.len() { Fetch::Done } else { Fetch::Short }))
    }

    fn protocol(&self, message: String) -> StorageError {
        StorageError::Io { path: self.url.clone(), op: "GET", source: std::io::Error::other(message) }
    }

    /// Fills `dst` with the bytes at `offset`, fetching again what a cut body left out. To stop
    /// it, drop it (a read's tasks race it against their stop signal).
    pub(crate) async fn fetch(&self, offset: u64, dst: &mut [u8]) -> Result<(), StorageError> {
        let mut filled = 0usize;
        let mut attempt = 0u32;
        loop {
            let why = match self.get_into(offset, dst, &mut filled).await? {
                Ok(Fetch::Done) => return Ok(()),
                Ok(Fetch::Short) => format!("the body ended after {filled} of {} bytes", dst.len()),
                Err(e) if transient(&e) => crate::one_line(&self.storage.redact(&e.to_string())),
                Err(e) => return Err(self.storage.error(&self.url, "GET", e)),
            };
            if attempt >= self.storage.options().part_retries {
                return Err(self.protocol(format!(
                    "bytes {offset}..{} could not be read after {} attempts: {why}",
                    offset + dst.len() as u64,
                    attempt + 1
                )));
            }
            attempt += 1;
            tokio::time::sleep(Duration::from_millis(100 << attempt.min(6))).await;
        }
    }
}

/// The error for an object whose answers no longer match the version the read started with.
pub(crate) fn changed(url: &Path, what: &str) -> StorageError {
    StorageError::Io {
        path: url.to_owned(),
        op: "GET",
        source: std::io::Error::other(format!(
            "the object changed while it was being read ({what}); nothing was returned: load it again"
        )),
    }
}

struct Reader<'a>(&'a ObjectFile);

impl RangeReader for Reader<'_> {
    fn read_exact_at(&mut self, offset: u64, dst: &mut [u8]) -> Result<(), StorageError> {
        let f = self.0;
        f.check_range(offset, dst.len())?;
        if dst.is_empty() || f.copy_from_prefix(offset, dst) {
            return Ok(());
        }
        runtime::block_on(f.fetch(offset, dst)).map_err(|e| StorageError::io(&f.url, "GET", e))?
    }
}

impl StorageFile for ObjectFile {
    fn path(&self) -> &Path {
        &self.url
    }

    fn len(&self) -> u64 {
        self.pin.size
    }

    fn reader(&self) -> Result<Box<dyn RangeReader + '_>, StorageError> {
        Ok(Box::new(Reader(self)))
    }

    fn requests_in_flight(&self) -> usize {
        self.storage.options().concurrency.max(1)
    }

    fn version(&self) -> Option<String> {
        self.pin.tag()
    }

    fn read_ranges_reported(
        &self,
        requests: Vec<ReadRequest<'_>>,
        opts: &IoOptions<'_>,
    ) -> Result<turboio_storage::ReadInfo, StorageError> {
        self.read_ranges(requests, opts)?;
        Ok(turboio_storage::ReadInfo { method: "ranged GETs", direct: false, direct_refused: false })
    }

    fn read_ranges(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<(), StorageError> {
        for r in &requests {
            self.check_range(r.offset, r.dst.len())?;
        }
        let options = self.storage.options();
        // Without a validator nothing tells two versions' parts apart: each range is one GET
        // (its answer's size still checked), never parts of several.
        let part = if self.pin.validated() { options.part_size.max(1) } else { usize::MAX };
        let mut remote: Vec<Chunk<'_>> = Vec::new();
        for c in split_requests(requests, part) {
            if c.dst.is_empty() {
                continue;
            }
            if self.copy_from_prefix(c.offset, c.dst) {
                if let Some(hook) = opts.hook {
                    hook(c.offset, c.dst)?;
                }
                opts.add_progress(c.dst.len() as u64);
            } else {
                remote.push(c);
            }
        }
        if remote.is_empty() {
            return Ok(());
        }
        let rt = runtime::runtime().map_err(|e| StorageError::io(&self.url, "GET", e))?;
        crate::spawned::fetch_all(self, &rt, remote, opts, options.concurrency)
    }
}
