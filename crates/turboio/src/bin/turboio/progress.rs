//! Progress bars on stderr, shown only when stderr is a terminal.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// A bar fed by a byte counter the library updates.
pub struct Bar {
    counter: Option<Arc<AtomicU64>>,
    done: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Bar {
    /// Starts a bar for `total` bytes (a no-op when stderr is not a terminal).
    pub fn start(total: u64, message: &str) -> Bar {
        let done = Arc::new(AtomicBool::new(false));
        if !std::io::stderr().is_terminal() {
            return Bar { counter: None, done, thread: None };
        }
        let counter = Arc::new(AtomicU64::new(0));
        let (c, d, message) = (counter.clone(), done.clone(), message.to_owned());
        let thread = std::thread::spawn(move || {
            // Only draw for operations that last: a quick load shows no bar at all.
            let mut bar: Option<ProgressBar> = None;
            let mut waited = 0;
            while !d.load(Ordering::Relaxed) {
                std::thread::park_timeout(Duration::from_millis(50));
                waited += 50;
                if waited < 300 || d.load(Ordering::Relaxed) {
                    continue;
                }
                let b = bar.get_or_insert_with(|| {
                    let b = ProgressBar::new(total);
                    b.set_style(
                        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}")
                            .unwrap_or_else(|_| ProgressStyle::default_bar())
                            .progress_chars("=> "),
                    );
                    b.set_message(message.clone());
                    b
                });
                b.set_position(c.load(Ordering::Relaxed));
            }
            if let Some(b) = bar {
                b.finish_and_clear();
            }
        });
        Bar { counter: Some(counter), done, thread: Some(thread) }
    }

    /// The counter to hand to the library.
    pub fn counter(&self) -> Option<Arc<AtomicU64>> {
        self.counter.clone()
    }

    /// Removes the bar.
    pub fn finish(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.stop();
    }
}
