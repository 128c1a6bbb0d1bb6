//! turboio's object-storage backend: [`ObjectStorage`] implements the [`Storage`] contract for
//! `s3://` (AWS and every S3-compatible store: MinIO, Ceph, R2, OCI...), `gs://`, `az://` /
//! `abfs://` / `abfss://` and `http://` / `https://` URLs, on Apache Arrow's `object_store` crate.
//! Request signing, credentials chains, retries and HTTP are object_store's (reqwest + rustls
//! with the ring provider); nothing here speaks HTTP by hand.
//!
//! # Reads
//!
//! [`Storage::open`] sends **one** ranged GET for the first [`ObjectOptions::prefix_bytes`]
//! (1 MiB by default): its answer gives the object's size, its ETag (and version, where the
//! store has one) and the bytes a safetensors header (or a `.pt` zip's first records) lives in,
//! so reading the header costs no second request unless the header is longer. An empty object
//! (a range cannot be asked of it) is looked up with a HEAD instead.
//!
//! [`StorageFile::read_ranges`] cuts the requested ranges into parts of
//! [`ObjectOptions::part_size`] and keeps [`ObjectOptions::concurrency`] ranged GETs in flight
//! (a bound shared by every read of one [`ObjectStorage`]: the files of a model load fill
//! together within it). Each GET is a task of the process's Tokio runtime that copies its body
//! straight into its final place (the load's arena, a staging buffer) as it arrives, on the
//! runtime thread that received it, never into a temporary file or a second full-size buffer;
//! the calling thread hands out the parts and runs the per-part hook (decryption, conversion,
//! the node cache's write-through) as each part completes. So a piece of a body costs no
//! wake-up of another thread, however many files load at once: measured against a local S3
//! server on 2 vCPUs, that took a 1.07 GB load from 3.74 s to 3.25 s and its client CPU from
//! 1.94 s to 1.24 s (see the `spawned` module). Parts inside the first GET's bytes are copied
//! from them.
//!
//! **One version per load.** Every GET after the first carries `If-Match: <ETag>` (and the
//! version id where there is one; `If-Unmodified-Since: <Last-Modified>` for an object without
//! an ETag), and every answer's size, ETag, version id and (without an ETag) `Last-Modified`
//! are compared with the first answer's, so a server that ignores the condition cannot slip
//! another version in: an object replaced during a load fails the load with an error naming the
//! URL ("the object changed while it was being read"), never a mix of two versions. An object
//! with none of these validators is read one GET per requested range (never in parallel parts
//! that could come from two versions), its size still checked, and is never kept in the node
//! cache. No GET reads more than it asked for: a body longer than its range (or without end)
//! fails the read.
//!
//! **Failures.** object_store retries throttling (429, 503 SlowDown), other 5xx, timeouts and
//! connection errors with exponential backoff and resumes a body cut short from where it broke
//! (when the response had an ETag); on top of that a part whose body still ends early is
//! fetched again from its first missing byte, up to [`ObjectOptions::part_retries`] times.
//! Permanent failures (no such bucket or key, access denied, bad credentials, a changed object)
//! fail at once. Nothing partial is returned: a failed part fails the whole read.
//!
//! **Bandwidth.** [`ObjectOptions::max_bandwidth`] caps the bytes per second received by all the
//! reads of one [`ObjectStorage`] together (a pacing limiter), for stores shared with training
//! jobs.
//!
//! # Saves
//!
//! [`Storage::write_file`] writes an object small enough for one part with a single PUT and a
//! larger one as a multipart upload: parts of `max(part_size, size / 10 000)` bytes (S3 allows
//! 10 000 parts, each but the last at least 5 MiB) filled from the [`WriteSource`] on the
//! caller's worker threads (so encryption and device downloads run in parallel) and uploaded
//! [`ObjectOptions::concurrency`] at a time. The object appears only when the upload completes;
//! any error aborts the upload (its parts are deleted) and leaves the previous object as it was.
//! A killed process leaves an incomplete upload that is invisible to readers (stores clean those
//! up with a lifecycle rule). `http(s)://` URLs are read-only.
//!
//! # Configuration
//!
//! From the environment, as each cloud's own tools read it (object_store's `from_env`):
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`,
//! `AWS_ENDPOINT_URL` (`AWS_ENDPOINT_URL_S3`), `AWS_ALLOW_HTTP`, ..., the web-identity / ECS / EKS /
//! instance-metadata chain; `GOOGLE_SERVICE_ACCOUNT`, `GOOGLE_APPLICATION_CREDENTIALS`, ...;
//! `AZURE_STORAGE_ACCOUNT_NAME`, `AZURE_STORAGE_ACCOUNT_KEY`, ... Explicit options
//! ([`ObjectOptions::config`]) win over the environment and take object_store's keys
//! (`endpoint`, `region`, `access_key_id`, `secret_access_key`, `session_token`, `allow_http`,
//! `timeout`, ...); an endpoint given as `http://...` allows plain HTTP for it. Secrets (secret
//! keys, session tokens, SAS tokens, query strings and user info of URLs) never appear in errors
//! or `Debug` output: every error names its URL through [`turboio_storage::shown`].
//!
//! A URL with a query string or fragment (a presigned URL, `?versionId=...`) is refused before
//! any request: object_store addresses objects by bucket and key alone, so the query would be
//! dropped and another object loaded. Give credentials through the environment or the options.
//!
//! The request slots ([`ObjectOptions::concurrency`]) and the bandwidth limiter belong to one
//! process: a child forked while the parent's GETs are in flight (a DataLoader worker) gets its
//! own, as it gets its own runtime, never the parent's slots that no thread of its would free.
//!
//! # Tokio
//!
//! object_store is async. One small multi-thread Tokio runtime per process carries the
//! connections; the synchronous calls of this crate block their own thread on it
//! (`Runtime::block_on`), so they must not be called from inside a Tokio runtime. A process
//! forked after the runtime was built (DataLoader workers) gets a fresh runtime and fresh
//! connections.
#![deny(missing_docs)]
#![deny(unsafe_code)]

mod options;
mod read;
mod runtime;
#[allow(unsafe_code)]
mod spawned;
mod write;

pub use options::{ObjectOptions, DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE, DEFAULT_PREFIX_BYTES};

use object_store::path::Path as ObjectPath;
use object_store::ObjectStore;
use options::Limiter;
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use turboio_storage::{IoOptions, Storage, StorageError, StorageFile, WriteSource};

/// The URL schemes this backend serves.
pub const SCHEMES: &[&str] = &["s3://", "gs://", "az://", "abfs://", "abfss://", "http://", "https://"];

/// True for a path this backend serves (`s3://...`, `gs://...`, `az://...`, `abfs[s]://...`,
/// `http[s]://...`).
pub fn is_object_url(path: &Path) -> bool {
    path.to_str().is_some_and(|s| SCHEMES.iter().any(|p| s.starts_with(p)))
}

/// The object-storage backend.
///
/// Cheap to make and to clone: stores (one per bucket or HTTP origin) are built on first use and
/// shared by the clones, as is the bandwidth limiter.
#[derive(Clone)]
pub struct ObjectStorage {
    inner: Arc<Inner>,
}

struct Inner {
    options: ObjectOptions,
    /// This process's request slots and limiter, with the process id they belong to.
    local: Mutex<Option<(u32, Arc<Local>)>>,
    /// Built stores (see [`StoreKey`]).
    stores: Mutex<HashMap<StoreKey, Arc<dyn ObjectStore>>>,
}

/// What one process's reads share: never inherited across `fork`, where the parent's requests
/// in flight would hold slots that no thread of the child ever gives back.
pub(crate) struct Local {
    /// One permit per request in flight, shared by every read of this backend (a model load
    /// fills many files at once; together they keep `concurrency` requests in flight).
    pub(crate) permits: tokio::sync::Semaphore,
    /// The bandwidth cap's pacing.
    pub(crate) limiter: Limiter,
}

/// A built store's key: `(process id, scheme://authority, fingerprint of the environment)`.
type StoreKey = (u32, String, u64);

impl fmt::Debug for ObjectStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectStorage").field("options", &self.inner.options).finish_non_exhaustive()
    }
}

impl Default for ObjectStorage {
    fn default() -> Self {
        ObjectStorage::new(ObjectOptions::default())
    }
}

/// An object located: its store and its key in the store.
pub(crate) struct Located {
    pub store: Arc<dyn ObjectStore>,
    pub key: ObjectPath,
}

impl ObjectStorage {
    /// A backend with these options (credentials and endpoints not given here come from the
    /// environment).
    pub fn new(options: ObjectOptions) -> ObjectStorage {
        ObjectStorage {
            inner: Arc::new(Inner { options, local: Mutex::new(None), stores: Mutex::new(HashMap::new()) }),
        }
    }

    /// This process's request slots and bandwidth limiter: made on first use, and made again in
    /// a child forked from a process that had them (the parent's GETs in flight hold slots the
    /// child would wait for forever).
    pub(crate) fn local(&self) -> Arc<Local> {
        let pid = std::process::id();
        let mut slot = self.inner.local.lock().unwrap_or_else(|p| p.into_inner());
        match slot.as_ref() {
            Some((owner, local)) if *owner == pid => local.clone(),
            _ => {
                if let Some((_, inherited)) = slot.take() {
                    // The parent's: its waiters and holders are threads this process does not have.
                    std::mem::forget(inherited);
                }
                let options = &self.inner.options;
                let local = Arc::new(Local {
                    permits: tokio::sync::Semaphore::new(options.concurrency.max(1)),
                    limiter: Limiter::new(options.max_bandwidth),
                });
                *slot = Some((pid, local.clone()));
                local
            }
        }
    }

    /// The options.
    pub fn options(&self) -> &ObjectOptions {
        &self.inner.options
    }

    /// The store serving `url` and the object's key in it.
    pub(crate) fn locate(&self, url: &Path) -> Result<Located, StorageError> {
        self.locate_any(url, false)
    }

    /// [`locate`](Self::locate), also for a bucket's root when `allow_empty`.
    fn locate_any(&self, url: &Path, allow_empty: bool) -> Result<Located, StorageError> {
        let text = url.to_str().ok_or_else(|| setup(url, "the URL is not valid UTF-8"))?.to_owned();
        let parsed = url::Url::parse(&text).map_err(|e| setup(url, format!("not a valid URL: {e}")))?;
        if parsed.query().is_some() || parsed.fragment().is_some() {
            // object_store addresses an object by bucket and key alone: a query (a presigned
            // URL's signature, `?versionId=`) would be dropped and another object loaded.
            return Err(setup(
                url,
                "the URL has a query string or fragment, which turboio does not send (it would load the object \
                 the path names, not the one the URL names); presigned URLs are not supported: remove the query \
                 and give the credentials through the environment or the storage options",
            ));
        }
        let (scheme, key) = object_store::ObjectStoreScheme::parse(&parsed)
            .map_err(|e| setup(url, format!("not an object-store URL: {}", self.redact(&e.to_string()))))?;
        let key = ObjectPath::parse(key).map_err(|e| setup(url, format!("not a valid object key: {e}")))?;
        if key.as_ref().is_empty() && !allow_empty {
            return Err(setup(url, "the URL names a bucket, not an object"));
        }
        let authority = format!("{}://{}", parsed.scheme(), parsed.authority());
        let cache_key = (std::process::id(), authority.clone(), options::environment_fingerprint());
        let mut stores = self.inner.stores.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(store) = stores.get(&cache_key) {
            return Ok(Located { store: store.clone(), key });
        }
        if stores.keys().any(|k| k.0 != cache_key.0) {
            // Forked: the parent's connections are not ours.
            stores.clear();
        }
        let store = self.inner.options.build(&scheme, &parsed, &authority).map_err(|e| setup(url, self.redact(&e)))?;
        stores.insert(cache_key, store.clone());
        Ok(Located { store, key })
    }

    /// `text` with every configured secret and every URL query string removed.
    pub(crate) fn redact(&self, text: &str) -> String {
        self.inner.options.redact(text)
    }

    /// The storage error for an object_store failure of `op` on `url`.
    pub(crate) fn error(&self, url: &Path, op: &'static str, e: object_store::Error) -> StorageError {
        use object_store::Error as E;
        let text = e.to_string();
        if let Some(message) = no_credentials(url, &text) {
            return StorageError::Io {
                path: url.to_owned(),
                op,
                source: std::io::Error::new(std::io::ErrorKind::PermissionDenied, message),
            };
        }
        match e {
            E::NotFound { .. } => StorageError::NotFound { path: url.to_owned() },
            E::PermissionDenied { .. } | E::Unauthenticated { .. } => {
                let detail = one_line(&self.redact(&text));
                StorageError::Io {
                    path: url.to_owned(),
                    op,
                    source: std::io::Error::new(
                        std::io::ErrorKind::PermissionDenied,
                        format!("access denied (check the credentials and the bucket's policy): {detail}"),
                    ),
                }
            }
            E::Precondition { .. } => read::changed(url, "its ETag no longer matches the one the load started with"),
            other => StorageError::Io {
                path: url.to_owned(),
                op,
                source: std::io::Error::other(one_line(&self.redact(&other.to_string()))),
            },
        }
    }

    /// The objects directly under the "directory" `dir` (the key prefix `dir/`), as URLs, sorted.
    pub fn list(&self, dir: &Path) -> Result<Vec<PathBuf>, StorageError> {
        let base = dir.to_str().ok_or_else(|| setup(dir, "the URL is not valid UTF-8"))?.trim_end_matches('/');
        let located = self.locate_any(Path::new(base), true)?;
        let parent = (!located.key.as_ref().is_empty()).then(|| located.key.clone());
        let store = located.store.clone();
        let listed = runtime::block_on(async move { store.list_with_delimiter(parent.as_ref()).await })
            .map_err(|e| StorageError::io(dir, "LIST", e))?
            .map_err(|e| self.error(dir, "LIST", e))?;
        let mut out: Vec<PathBuf> = listed
            .objects
            .into_iter()
            .filter_map(|m| m.location.filename().map(|n| PathBuf::from(format!("{base}/{n}"))))
            .collect();
        out.sort();
        Ok(out)
    }

    /// Deletes the object at `url` (a missing object is not an error).
    pub fn delete(&self, url: &Path) -> Result<(), StorageError> {
        use object_store::ObjectStoreExt;
        let located = self.locate(url)?;
        let (store, key) = (located.store, located.key);
        match runtime::block_on(async move { store.delete(&key).await })
            .map_err(|e| StorageError::io(url, "DELETE", e))?
        {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error(url, "DELETE", e)),
        }
    }

    /// The object's length and version tag (its ETag and version id, as
    /// [`StorageFile::version`] gives them for an open object) from a HEAD request.
    pub fn head(&self, url: &Path) -> Result<Option<turboio_storage::Version>, StorageError> {
        use object_store::ObjectStoreExt;
        let located = self.locate(url)?;
        let (store, key) = (located.store, located.key);
        let meta = runtime::block_on(async move { store.head(&key).await })
            .map_err(|e| StorageError::io(url, "HEAD", e))?
            .map_err(|e| self.error(url, "HEAD", e))?;
        Ok(read::Pin::new(&meta).tag().map(|tag| turboio_storage::Version { len: meta.size, tag }))
    }

    /// The process-wide backend for URLs met without explicit options (configured from the
    /// environment at each use).
    pub fn global() -> ObjectStorage {
        static GLOBAL: std::sync::OnceLock<ObjectStorage> = std::sync::OnceLock::new();
        GLOBAL.get_or_init(|| ObjectStorage::new(ObjectOptions::from_env_options())).clone()
    }
}

/// The message for a request that failed because the credential chain found nothing: with no
/// keys in the environment or the options, object_store asks the cloud's instance-metadata
/// service last (`PUT http://169.254.169.254/latest/api/token`), and its failure is all the
/// error said. `None` for any other failure.
fn no_credentials(url: &Path, text: &str) -> Option<String> {
    let imds =
        text.contains("/latest/api/token") || text.contains("169.254.169.254") || text.contains("/latest/meta-data");
    if !imds {
        return None;
    }
    let scheme = url.to_str().and_then(|u| u.split_once("://")).map_or("", |(s, _)| s);
    Some(match scheme {
        "s3" => "no credentials found: none in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, \
                 AWS_PROFILE, AWS_WEB_IDENTITY_TOKEN_FILE) and no instance-metadata service answered; set them, or \
                 pass the storage options access_key_id= and secret_access_key= (skip_signature=true for a public \
                 bucket)"
            .to_owned(),
        _ => "no credentials found: none in the environment or the storage options, and no instance-metadata \
              service answered; set the store's credentials (see the object-storage docs)"
            .to_owned(),
    })
}

/// A server's error on one line: an S3-style XML body as `Code: Message`, anything else with
/// its line breaks folded.
pub(crate) fn one_line(text: &str) -> String {
    let tag = |name: &str| {
        let open = format!("<{name}>");
        let start = text.find(&open)? + open.len();
        let end = text[start..].find(&format!("</{name}>"))? + start;
        Some(text[start..end].trim().to_owned())
    };
    if let Some(code) = tag("Code") {
        let head = text.find('<').map_or(text, |i| &text[..i]).trim_end().trim_end_matches(':');
        let head: String = head.split_whitespace().collect::<Vec<_>>().join(" ");
        return match tag("Message") {
            Some(msg) => format!("{head}: {code}: {msg}"),
            None => format!("{head}: {code}"),
        };
    }
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

pub(crate) fn setup(path: &Path, message: impl Into<String>) -> StorageError {
    StorageError::Setup { path: path.to_owned(), message: message.into() }
}

impl Storage for ObjectStorage {
    fn name(&self) -> &'static str {
        "object"
    }

    fn open(&self, path: &Path) -> Result<Box<dyn StorageFile>, StorageError> {
        Ok(Box::new(read::ObjectFile::open(self, path)?))
    }

    fn write_file(&self, path: &Path, source: &dyn WriteSource, opts: &IoOptions<'_>) -> Result<(), StorageError> {
        write::write_file(self, path, source, opts)
    }

    fn list(&self, dir: &Path) -> Result<Vec<PathBuf>, StorageError> {
        ObjectStorage::list(self, dir)
    }

    fn remove_file(&self, path: &Path) -> Result<(), StorageError> {
        self.delete(path)
    }

    fn current_version(&self, path: &Path) -> Result<Option<turboio_storage::Version>, StorageError> {
        self.head(path)
    }
}

#[cfg(test)]
mod message_tests {
    use super::{no_credentials, one_line};
    use std::path::Path;

    #[test]
    fn server_xml_folds_to_one_line_and_missing_credentials_say_what_to_set() {
        let xml = "Client error with status 403 Forbidden: <?xml version=\"1.0\"?>\n<Error>\n  <Code>SignatureDoesNotMatch</Code>\n  <Message>The request signature we calculated does not match</Message>\n</Error>";
        assert_eq!(
            one_line(xml),
            "Client error with status 403 Forbidden: SignatureDoesNotMatch: The request signature we calculated does not match"
        );
        assert_eq!(one_line("a\n  b\tc"), "a b c");
        let m = no_credentials(
            Path::new("s3://b/k"),
            "Generic S3 error: Error performing PUT http://169.254.169.254/latest/api/token in 1ms - HTTP error",
        )
        .unwrap();
        assert!(m.contains("AWS_ACCESS_KEY_ID") && m.contains("access_key_id=") && !m.contains('\n'), "{m}");
        assert!(no_credentials(Path::new("s3://b/k"), "Generic S3 error: connection refused").is_none());
    }
}
