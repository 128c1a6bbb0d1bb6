//! Progress bars on stderr, shown only when stderr is a terminal.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
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

/// Whether bars are drawn (standard error is a terminal).
pub fn shown() -> bool {
    std::io::stderr().is_terminal()
}

impl Bar {
    /// Starts a bar for `total` bytes, or (`total` 0: not known) a counter of bytes and rate
    /// without a total; a no-op when stderr is not a terminal. Sizes and rates in the units of
    /// the command's own lines (kB, MB, GB), never a bar full before the bytes are in.
    pub fn start(total: u64, message: &str) -> Bar {
        let done = Arc::new(AtomicBool::new(false));
        if !shown() {
            return Bar { counter: None, done, thread: None };
        }
        let counter = Arc::new(AtomicU64::new(0));
        let (c, d, message) = (counter.clone(), done.clone(), message.to_owned());
        let thread = std::thread::spawn(move || {
            // Made at once but drawn only for operations that last (a quick load shows no bar):
            // its rate is then measured over the whole operation, not over the first frame.
            let bar = if total > 0 {
                ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden())
            } else {
                ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden())
            };
            let template = if total > 0 {
                "{msg} [{bar:30}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec}"
            } else {
                "{msg} {spinner} {decimal_bytes} {decimal_bytes_per_sec}"
            };
            bar.set_style(
                ProgressStyle::with_template(template)
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            bar.set_message(message);
            let mut waited = 0;
            while !d.load(Ordering::Relaxed) {
                std::thread::park_timeout(Duration::from_millis(50));
                waited += 50;
                bar.set_position(c.load(Ordering::Relaxed));
                if waited == 300 && !d.load(Ordering::Relaxed) {
                    bar.set_draw_target(ProgressDrawTarget::stderr());
                }
            }
            bar.finish_and_clear();
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
