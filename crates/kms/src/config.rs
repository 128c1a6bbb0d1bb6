//! Small shared pieces: secrets that never print, retry policies, environment look-ups.

use std::fmt;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use crate::http::Cancelled;

use zeroize::Zeroizing;

/// A secret string (secret access key, session token, base64 key): zeroized on drop, and its
/// `Debug` prints `<redacted>`. There is no `Display`; [`Secret::expose`] is the one way in.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(Zeroizing<String>);

impl Secret {
    /// Wraps a secret.
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(Zeroizing::new(value.into()))
    }

    /// The secret text. Never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// True for the empty string.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Secret {
        Secret::new(s)
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Secret {
        Secret::new(s)
    }
}

impl<'de> serde::Deserialize<'de> for Secret {
    /// Straight from the JSON text into the zeroizing string (one allocation of exactly the
    /// value's size; never through a `serde_json::Value`).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Secret, D::Error> {
        String::deserialize(d).map(Secret::new)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Bounded retries with exponential backoff: after failure `n` (0-based) the next attempt
/// waits `min(base_delay * 2^n, max_delay)`. `retries` counts the attempts after the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts after the first one (0 = try once).
    pub retries: u32,
    /// Wait before the first retry; doubles each time.
    pub base_delay: Duration,
    /// Upper bound on any single wait.
    pub max_delay: Duration,
}

impl RetryPolicy {
    /// `retries` retries starting at `base_delay`, capped at 30 s per wait.
    pub const fn new(retries: u32, base_delay: Duration) -> RetryPolicy {
        RetryPolicy { retries, base_delay, max_delay: Duration::from_secs(30) }
    }

    /// Try once, never retry.
    pub const fn none() -> RetryPolicy {
        RetryPolicy::new(0, Duration::ZERO)
    }

    /// Total attempts: `retries + 1`.
    pub fn attempts(&self) -> u32 {
        self.retries.saturating_add(1)
    }

    /// The wait after failure number `n` (0-based).
    pub fn delay(&self, n: u32) -> Duration {
        let factor = 1u32.checked_shl(n.min(31)).unwrap_or(u32::MAX);
        self.base_delay.checked_mul(factor).unwrap_or(self.max_delay).min(self.max_delay)
    }

    /// Waits before attempt `attempt` (1-based retries; nothing before attempt 0), waking up
    /// early when `cancel` is set. Fails once it is set.
    pub(crate) fn wait_before(&self, attempt: u32, cancel: Option<&AtomicBool>) -> Result<(), Cancelled> {
        if crate::http::is_cancelled(cancel) {
            return Err(Cancelled);
        }
        if attempt > 0 {
            let d = self.delay(attempt - 1);
            if !d.is_zero() {
                crate::http::sleep(d, cancel)?;
            }
        }
        Ok(())
    }
}

/// A variable's value, with unset and empty both meaning `None`.
pub(crate) fn var<F: Fn(&str) -> Option<String>>(get: &F, name: &str) -> Option<String> {
    get(name).filter(|v| !v.is_empty())
}

/// The process environment as a look-up function.
pub(crate) fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Replaces every occurrence of each non-empty secret in `text` with `<redacted>`, and
/// control characters with spaces (for quoting a peer's error body in a message).
pub(crate) fn scrub(text: &str, secrets: &[&str]) -> String {
    let mut out: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    for s in secrets {
        if s.len() >= 4 && out.contains(s) {
            out = out.replace(s, "<redacted>");
        }
    }
    out
}

pub(crate) use turboio_cipher::py_json_string as py_json_str;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let p = RetryPolicy { retries: 40, base_delay: Duration::from_millis(200), max_delay: Duration::from_secs(5) };
        assert_eq!(p.delay(0), Duration::from_millis(200));
        assert_eq!(p.delay(1), Duration::from_millis(400));
        assert_eq!(p.delay(3), Duration::from_millis(1600));
        assert_eq!(p.delay(5), Duration::from_secs(5));
        assert_eq!(p.delay(39), Duration::from_secs(5));
        assert_eq!(p.attempts(), 41);
        assert_eq!(RetryPolicy::none().attempts(), 1);
        assert_eq!(RetryPolicy::none().delay(3), Duration::ZERO);
    }

    #[test]
    fn python_json_strings() {
        assert_eq!(py_json_str("Y2lw+/=="), "\"Y2lw+/==\"");
        assert_eq!(py_json_str("a\"b\\c\n\u{1}"), "\"a\\\"b\\\\c\\n\\u0001\"");
        assert_eq!(py_json_str("é😀\u{7f}"), "\"\\u00e9\\ud83d\\ude00\\u007f\"");
    }

    #[test]
    fn secrets_do_not_print() {
        let s = Secret::new("very-secret-value");
        assert_eq!(format!("{s:?}"), "<redacted>");
        assert_eq!(scrub("echo very-secret-value\n!", &["very-secret-value", ""]), "echo <redacted> !");
    }
}
