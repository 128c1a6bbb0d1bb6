//! One Tokio runtime per process for object_store's connections, and the synchronous bridge.

use std::future::Future;
use std::sync::{Arc, Mutex};

/// Worker threads of the runtime: they run the connections (TLS, HTTP framing); the bytes are
/// copied into their destination by the calling threads.
fn worker_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8)
}

/// The runtime of this process (a child forked after the parent built one gets its own: the
/// parent's threads do not exist in it).
pub(crate) fn runtime() -> std::io::Result<Arc<tokio::runtime::Runtime>> {
    static RUNTIME: Mutex<Option<(u32, Arc<tokio::runtime::Runtime>)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut slot = RUNTIME.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((owner, rt)) = slot.as_ref() {
        if *owner == pid {
            return Ok(rt.clone());
        }
        // The parent's runtime: its threads are gone here, and dropping it would wait for them.
        if let Some((_, old)) = slot.take() {
            std::mem::forget(old);
        }
    }
    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(worker_threads())
            .thread_name("turboio-object")
            .enable_all()
            .build()?,
    );
    *slot = Some((pid, rt.clone()));
    Ok(rt)
}

/// Runs `fut` to completion on the calling thread, its I/O driven by this process's runtime.
/// Called from inside another Tokio runtime (where `block_on` is not allowed), it runs on a
/// short-lived thread of its own instead. Fails only if the runtime cannot be built (no
/// threads or file descriptors left).
pub(crate) fn block_on<F>(fut: F) -> std::io::Result<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime()?;
    if tokio::runtime::Handle::try_current().is_ok() {
        return Ok(std::thread::scope(|s| {
            s.spawn(|| rt.block_on(fut)).join().unwrap_or_else(|p| std::panic::resume_unwind(p))
        }));
    }
    Ok(rt.block_on(fut))
}

/// Installs rustls' ring provider as the process default (reqwest is built without one), once.
pub(crate) fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // An error means another part of the process installed one first: that one serves.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
