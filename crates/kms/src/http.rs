//! The one HTTP client of the crate: reqwest's blocking client, over TCP/TLS for KMS and over
//! the datapipe's unix socket (`ClientBuilder::unix_socket`) for the sidecar's tasks. This
//! module adds what both need: a size cap on answers read into one pre-sized zeroizing buffer,
//! and requests that give up as soon as the caller's cancel flag is set.

use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use zeroize::Zeroizing;

/// Largest body accepted: KMS and datapipe answers are a few hundred bytes.
pub(crate) const MAX_BODY: usize = 4 * 1024 * 1024;

/// How often a waiting caller looks at its cancel flag.
pub(crate) const CANCEL_POLL: Duration = Duration::from_millis(20);

/// The cancel flag was set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cancelled;

/// True once `cancel` is set.
pub(crate) fn is_cancelled(cancel: Option<&AtomicBool>) -> bool {
    cancel.is_some_and(|c| c.load(Ordering::Relaxed))
}

/// Sleeps for `d`, waking within [`CANCEL_POLL`] of `cancel` being set.
pub(crate) fn sleep(d: Duration, cancel: Option<&AtomicBool>) -> Result<(), Cancelled> {
    let Some(flag) = cancel else {
        std::thread::sleep(d);
        return Ok(());
    };
    let end = std::time::Instant::now() + d;
    loop {
        if flag.load(Ordering::Relaxed) {
            return Err(Cancelled);
        }
        let left = end.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        std::thread::sleep(left.min(CANCEL_POLL));
    }
}

/// Runs `work` (one HTTP exchange) so that the caller can stop waiting for it: without a
/// flag, inline; with one, on a helper thread while the caller polls the flag. A cancelled
/// exchange is abandoned to finish on its own (bounded by its timeout); it owns everything it
/// uses, and what it returns is dropped there (answers are zeroizing buffers).
pub(crate) fn cancellable<T: Send + 'static>(
    cancel: Option<&AtomicBool>,
    work: impl FnOnce() -> T + Send + 'static,
    no_thread: impl FnOnce(std::io::Error) -> T,
) -> Result<T, Cancelled> {
    let Some(flag) = cancel else { return Ok(work()) };
    if flag.load(Ordering::Relaxed) {
        return Err(Cancelled);
    }
    let (tx, rx) = mpsc::sync_channel(1);
    let job = move || {
        let _ = tx.send(work());
    };
    if let Err(e) = std::thread::Builder::new().name("turboio-kms-http".into()).spawn(job) {
        return Ok(no_thread(e));
    }
    loop {
        match rx.recv_timeout(CANCEL_POLL) {
            Ok(v) => return Ok(v),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if flag.load(Ordering::Relaxed) {
                    return Err(Cancelled);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(Cancelled),
        }
    }
}

/// A reqwest blocking client whose every connection is the unix socket `path` (requests name
/// `http://localhost/...`, so `Host: localhost`, as veTurboIO's requests adapter sends).
pub(crate) fn unix_client(path: &Path, timeout: Duration) -> Result<reqwest::blocking::Client, String> {
    // The sidecar speaks plain HTTP; reqwest still wants a TLS configuration (no process-wide
    // provider is installed): ring, trusting nothing.
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup failed: {e}"))?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    reqwest::blocking::Client::builder()
        .tls_backend_preconfigured(tls)
        .unix_socket(path)
        .timeout(timeout)
        .pool_max_idle_per_host(0)
        .user_agent(concat!("turboio-kms/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("cannot create the HTTP client{}", error_chain(&e)))
}

/// Why an answer could not be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// Larger than [`MAX_BODY`].
    TooLarge,
    /// The transport failed or timed out while reading.
    Io(std::io::Error),
}

/// Reads an answer's body into one zeroizing buffer sized up front from `Content-Length`
/// (grown, when there is none, by copying into a fresh buffer so that no unwiped allocation is
/// ever freed), at most [`MAX_BODY`] bytes.
pub(crate) fn read_body(mut resp: reqwest::blocking::Response) -> Result<Zeroizing<Vec<u8>>, ReadError> {
    let declared = resp.content_length();
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(ReadError::TooLarge);
    }
    let mut cap = declared.map_or(16 * 1024, |n| n as usize + 1).clamp(1, MAX_BODY + 1);
    let mut body = Zeroizing::new(vec![0u8; cap]);
    let mut len = 0usize;
    loop {
        if len == cap {
            if cap > MAX_BODY {
                return Err(ReadError::TooLarge);
            }
            cap = (cap * 2).min(MAX_BODY + 1);
            let mut bigger = Zeroizing::new(vec![0u8; cap]);
            bigger[..len].copy_from_slice(&body[..len]);
            body = bigger;
        }
        match resp.read(&mut body[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    if len > MAX_BODY {
        return Err(ReadError::TooLarge);
    }
    // Shrinking in place keeps the allocation: nothing is freed unwiped.
    body.truncate(len);
    Ok(body)
}

/// True when a reading error is a timeout.
pub(crate) fn is_timeout_io(e: &std::io::Error) -> bool {
    e.get_ref().and_then(|i| i.downcast_ref::<reqwest::Error>()).is_some_and(reqwest::Error::is_timeout)
        || e.kind() == std::io::ErrorKind::TimedOut
}

/// `: cause: cause...` of an error's sources (reqwest's own text names the URL; callers name
/// the host or socket themselves).
pub(crate) fn error_chain(e: &reqwest::Error) -> String {
    let mut out = String::new();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

/// At most `max` characters of `s`, for messages.
pub(crate) fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// A JSON answer's serde error, safe to quote: "missing field" names a field; other errors
/// may quote a value (a secret, for some answers) and are described by category only.
pub(crate) fn describe_json_error(e: &serde_json::Error, len: usize) -> String {
    let text = e.to_string();
    if text.starts_with("missing field") {
        let field = text.split(" at line").next().unwrap_or(&text);
        format!("the answer has no {}", field.trim_start_matches("missing "))
    } else {
        let what = match e.classify() {
            serde_json::error::Category::Io => "I/O error",
            serde_json::error::Category::Syntax => "not JSON",
            serde_json::error::Category::Data => "a field of the wrong type",
            serde_json::error::Category::Eof => "cut short",
        };
        format!("the answer is {what} ({len} bytes)")
    }
}
