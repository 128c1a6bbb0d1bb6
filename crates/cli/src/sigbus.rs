//! A mapped file truncated in place by another program raises `SIGBUS` when its lost pages are
//! touched (see "Mapped loads and the one hazard" in docs/src/loads.md). The CLI turns that into its
//! usual one-line error and exit status 1 instead of dying by the signal.

use crate::out::Shown;
use nix::sys::signal::{signal, SigHandler, Signal};
use std::ffi::c_int;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::OnceLock;

/// The line written when `SIGBUS` arrives, prepared before any file is mapped.
static MESSAGE: OnceLock<Vec<u8>> = OnceLock::new();

extern "C" fn on_sigbus(_signal: c_int) {
    if let Some(m) = MESSAGE.get() {
        // Async-signal-safe: nix's write is write(2) and nothing else; `m` is an initialized,
        // never-mutated buffer (OnceLock::get is a plain atomic load, no lock or allocation);
        // `stderr().as_fd()` names descriptor 2 without locking or allocating.
        let _ = nix::unistd::write(std::io::stderr().as_fd(), m);
    }
    // SAFETY: _exit(2) is async-signal-safe; the process ends here without running anything else
    // (std::process::exit would run exit handlers, which is not async-signal-safe).
    // libc: nix has no wrapper for _exit(2).
    unsafe { libc::_exit(1) }
}

/// Reports a `SIGBUS` during the load of `file` as "the file changed while it was mapped".
/// Only the first file given is named (the CLI loads one file per run).
pub fn report_for(file: &Path) {
    let line = format!(
        "turboio: error: {}: the file changed while it was mapped (another program truncated or rewrote it in place); \
         load it with --mode copied if it is rewritten in place\n",
        file.shown()
    );
    if MESSAGE.set(line.into_bytes()).is_ok() {
        // SAFETY: installs a handler that only calls async-signal-safe functions (above).
        let _ = unsafe { signal(Signal::SIGBUS, SigHandler::Handler(on_sigbus)) };
    }
}
