//! A mapped file truncated in place by another program raises `SIGBUS` when its lost pages are
//! touched (see the README's "Mapped loads and the one hazard"). The CLI turns that into its
//! usual one-line error and exit status 1 instead of dying by the signal.

use std::path::Path;
use std::sync::OnceLock;

/// The line written when `SIGBUS` arrives, prepared before any file is mapped.
static MESSAGE: OnceLock<Vec<u8>> = OnceLock::new();

extern "C" fn on_sigbus(_signal: libc::c_int) {
    if let Some(m) = MESSAGE.get() {
        // SAFETY: write(2) and _exit(2) are async-signal-safe; `m` is an initialized,
        // never-mutated buffer (OnceLock::get is a plain atomic load, no lock or allocation).
        unsafe {
            libc::write(2, m.as_ptr().cast(), m.len());
        }
    }
    // SAFETY: see above; the process ends here without running anything else.
    unsafe { libc::_exit(1) }
}

/// Reports a `SIGBUS` during the load of `file` as "the file changed while it was mapped".
/// Only the first file given is named (the CLI loads one file per run).
pub fn report_for(file: &Path) {
    let line = format!(
        "turboio: error: {}: the file changed while it was mapped (another program truncated or rewrote it in place); \
         load it with --mode copied if it is rewritten in place\n",
        file.display()
    );
    if MESSAGE.set(line.into_bytes()).is_ok() {
        // SAFETY: installs a handler that only calls async-signal-safe functions (above).
        unsafe {
            libc::signal(libc::SIGBUS, on_sigbus as extern "C" fn(libc::c_int) as libc::sighandler_t);
        }
    }
}
