//! The crate's one error type.

use std::fmt;
use std::path::PathBuf;

/// Where key material came from (or was looked for).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeySource {
    /// The file's 256 KiB header, its `meta_data_key` decrypted by KMS.
    HeaderKms,
    /// The datapipe unix socket's `encrypt-key` task.
    Datapipe,
    /// `VETURBOIO_KEY` / `VETURBOIO_IV`.
    Env,
}

impl KeySource {
    /// The label used in messages: `header+KMS`, `datapipe`, `environment`.
    pub fn label(self) -> &'static str {
        match self {
            KeySource::HeaderKms => "header+KMS",
            KeySource::Datapipe => "datapipe",
            KeySource::Env => "environment",
        }
    }
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// One source that was tried and why it gave no key.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// The source.
    pub source: KeySource,
    /// Why it failed.
    pub error: KeyError,
}

/// Everything that can go wrong in this crate.
///
/// No message (and no `Debug` output) ever contains key bytes, secret access keys or session
/// tokens: errors name hosts, sockets, variables, HTTP statuses and KMS error codes only.
#[non_exhaustive]
#[derive(Debug, Clone, thiserror::Error)]
pub enum KeyError {
    /// KMS cannot be used: a required setting is missing or invalid.
    #[error("KMS is not configured: {0}")]
    KmsConfig(String),

    /// A KMS call failed: transport, timeout, HTTP status, or an unusable answer.
    #[error("KMS {action} at {endpoint} failed: {detail}")]
    Kms {
        /// `Decrypt` or `Encrypt`.
        action: &'static str,
        /// Where the request went (the URL, or the datapipe proxy and the host it forwards to).
        endpoint: String,
        /// The HTTP status, when one was received.
        status: Option<u16>,
        /// What went wrong.
        detail: String,
    },

    /// The datapipe socket file is not there (so datapipe is not used at all).
    #[error("datapipe socket {} does not exist", .0.display())]
    DatapipeMissing(PathBuf),

    /// A datapipe task failed.
    #[error("datapipe {task} via {}: {detail}", socket.display())]
    Datapipe {
        /// The socket path.
        socket: PathBuf,
        /// The task (`ping`, `encrypt-key`, `kms-sts`, `top`).
        task: &'static str,
        /// The HTTP status, when one was received.
        status: Option<u16>,
        /// What went wrong.
        detail: String,
    },

    /// An environment variable the source needs is not set (or empty).
    #[error("{var} is not set")]
    EnvNotSet {
        /// The variable.
        var: &'static str,
    },

    /// An environment variable holds an unusable value (the value itself is never repeated).
    #[error("{var} is invalid: {detail}")]
    EnvInvalid {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        detail: String,
    },

    /// A source answered, but with key material that cannot be used (bad base64, wrong
    /// length, a key that does not fit the header's mode).
    #[error("unusable key material from {from}: {detail}")]
    InvalidKeyMaterial {
        /// Which source answered.
        from: KeySource,
        /// What is wrong (lengths and modes only).
        detail: String,
    },

    /// Every source was tried and none gave a key; each failure is listed in order.
    #[error("no key for {}: {}", path.display(), Attempts(attempts))]
    NoKey {
        /// The model file the key was for.
        path: PathBuf,
        /// The sources tried, in order, with their failures.
        attempts: Vec<Attempt>,
    },

    /// The caller cancelled (e.g. Ctrl-C in Python) while a key source was being asked.
    #[error("cancelled while looking up the key")]
    Cancelled,

    /// The operating system's random generator failed while making a new data key.
    #[error("cannot generate a data key: {0}")]
    Random(String),
}

struct Attempts<'a>(&'a [Attempt]);

impl fmt::Display for Attempts<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, a) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{}: {}", a.source, a.error)?;
        }
        Ok(())
    }
}
