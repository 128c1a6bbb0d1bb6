//! The datapipe sidecar: HTTP/1.1 over a unix socket, one task per request chosen by the
//! `X-Datapipe-Task-Type` header.

use std::fmt;
use std::os::unix::net::UnixStream;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use turboio_cipher::{b64_decode, CipherError, Iv, Key};

use crate::config::{process_env, var, RetryPolicy, Secret};
use crate::http1::{self, DeadlineStream, HttpError, Response};
use crate::{KeyError, KeySource};

/// veTurboIO's default socket path.
pub const DEFAULT_SOCKET_PATH: &str = "/finetuned-model/datapipe.sock";

/// The header that selects the task.
pub const TASK_HEADER: &str = "X-Datapipe-Task-Type";

/// Datapipe settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatapipeConfig {
    /// The socket (`DATAPIPE_SOCKET_PATH`, default [`DEFAULT_SOCKET_PATH`]).
    pub socket_path: PathBuf,
    /// Sent as `X-Encrypt-Caller-Pod` with `encrypt-key` (`POD_NAME`, default empty).
    pub pod_name: String,
    /// Deadline for one request: connect, send, and the whole response (default 30 s).
    pub timeout: Duration,
    /// Retries of a task on connection errors, timeouts, malformed answers and HTTP 5xx/429
    /// (default 4 retries from 500 ms: at most 0.5 + 1 + 2 + 4 = 7.5 s of waiting).
    /// veTurboIO waits much longer (up to 61 retries 2 s apart) for a sidecar that is still
    /// starting; raise `retries` to match that.
    pub retry: RetryPolicy,
}

impl Default for DatapipeConfig {
    fn default() -> Self {
        DatapipeConfig {
            socket_path: PathBuf::from(DEFAULT_SOCKET_PATH),
            pod_name: String::new(),
            timeout: Duration::from_secs(30),
            retry: RetryPolicy::new(4, Duration::from_millis(500)),
        }
    }
}

impl DatapipeConfig {
    /// Defaults, with `DATAPIPE_SOCKET_PATH` and `POD_NAME` from the process environment.
    pub fn from_env() -> DatapipeConfig {
        DatapipeConfig::from_vars(process_env)
    }

    /// Like [`DatapipeConfig::from_env`], reading variables through `get` (unset and empty
    /// are the same).
    pub fn from_vars<F: Fn(&str) -> Option<String>>(get: F) -> DatapipeConfig {
        let mut c = DatapipeConfig::default();
        if let Some(p) = var(&get, "DATAPIPE_SOCKET_PATH") {
            c.socket_path = PathBuf::from(p);
        }
        if let Some(p) = var(&get, "POD_NAME") {
            c.pod_name = p;
        }
        c
    }
}

/// Temporary KMS credentials from the `kms-sts` task.
#[derive(Clone)]
pub struct StsCredentials {
    /// `Cred.AccessKeyId`.
    pub access_key: String,
    /// `Cred.SecretAccessKey`.
    pub secret_key: Secret,
    /// `Cred.SessionToken` (may be empty).
    pub session_token: Secret,
}

impl fmt::Debug for StsCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StsCredentials")
            .field("access_key", &self.access_key)
            .field("secret_key", &self.secret_key)
            .field("session_token", &self.session_token)
            .finish()
    }
}

/// A client of the datapipe socket.
#[derive(Debug, Clone)]
pub struct DatapipeClient {
    config: DatapipeConfig,
}

impl DatapipeClient {
    /// A client; nothing is contacted until a task is called.
    pub fn new(config: DatapipeConfig) -> DatapipeClient {
        DatapipeClient { config }
    }

    /// The settings.
    pub fn config(&self) -> &DatapipeConfig {
        &self.config
    }

    /// The socket path.
    pub fn socket_path(&self) -> &Path {
        &self.config.socket_path
    }

    /// Whether the socket file exists (veTurboIO uses datapipe only when it does).
    pub fn exists(&self) -> bool {
        self.config.socket_path.exists()
    }

    /// `ping`: succeeds when the answer is `{"message": "pong"}`.
    pub fn ping(&self) -> Result<(), KeyError> {
        let resp = self.task("ping", &[])?;
        let json = self.json("ping", &resp)?;
        match json.get("message").and_then(Value::as_str) {
            Some("pong") => Ok(()),
            _ => Err(self.err("ping", Some(200), "the answer is not {\"message\": \"pong\"}")),
        }
    }

    /// `encrypt-key`: the data key and IV for the model file `path` (sent as the absolute,
    /// lexically normalised `X-TOS-Path`, like Python's `os.path.abspath`).
    pub fn encrypt_key(&self, path: &Path) -> Result<(Key, Iv), KeyError> {
        let tos_path = abspath(path);
        let tos_path = tos_path.to_str().ok_or_else(|| {
            self.err("encrypt-key", None, "the model path is not UTF-8 and cannot be sent as X-TOS-Path")
        })?;
        let resp =
            self.task("encrypt-key", &[("X-Encrypt-Caller-Pod", &self.config.pod_name), ("X-TOS-Path", tos_path)])?;
        let json = self.json("encrypt-key", &resp)?;
        let field = |name: &str| {
            json.get(name)
                .and_then(Value::as_str)
                .ok_or_else(|| self.err("encrypt-key", Some(200), format!("the answer has no string \"{name}\"")))
        };
        let key_b64 = field("Key")?;
        let iv_b64 = field("IV")?;
        let invalid =
            |e: CipherError| KeyError::InvalidKeyMaterial { from: KeySource::Datapipe, detail: e.to_string() };
        let key = Key::new(&b64_decode(key_b64, "datapipe's Key").map_err(invalid)?).map_err(invalid)?;
        let iv = Iv::new(&b64_decode(iv_b64, "datapipe's IV").map_err(invalid)?).map_err(invalid)?;
        Ok((key, iv))
    }

    /// `kms-sts`: temporary KMS credentials.
    pub fn kms_sts(&self) -> Result<StsCredentials, KeyError> {
        let resp = self.task("kms-sts", &[])?;
        let json = self.json("kms-sts", &resp)?;
        let field = |name: &str| {
            json.get("Cred")
                .and_then(|c| c.get(name))
                .and_then(Value::as_str)
                .ok_or_else(|| self.err("kms-sts", Some(200), format!("the answer has no string \"Cred.{name}\"")))
        };
        Ok(StsCredentials {
            access_key: field("AccessKeyId")?.to_string(),
            secret_key: Secret::new(field("SecretAccessKey")?),
            session_token: Secret::new(field("SessionToken")?),
        })
    }

    /// One exchange over the socket, no retries: used by the KMS client for `top`, which has
    /// its own retry policy and timeout.
    pub(crate) fn exchange(
        &self,
        method: &str,
        target: &str,
        headers: &[(&'static str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> Result<Response, HttpError> {
        let stream = UnixStream::connect(&self.config.socket_path)?;
        let mut stream = DeadlineStream::new(stream, timeout);
        let mut all: Vec<(&'static str, &str)> = vec![
            ("Host", "localhost"),
            ("User-Agent", concat!("turboio-kms/", env!("CARGO_PKG_VERSION"))),
            ("Accept", "*/*"),
            ("Connection", "close"),
        ];
        all.extend_from_slice(headers);
        http1::write_request(&mut stream, method, target, &all, body)?;
        http1::read_response(stream, method)
    }

    /// A GET task with retries; returns the 200 response.
    fn task(&self, task: &'static str, extra: &[(&'static str, &str)]) -> Result<Response, KeyError> {
        if !self.exists() {
            return Err(KeyError::DatapipeMissing(self.config.socket_path.clone()));
        }
        let mut headers: Vec<(&'static str, &str)> = vec![(TASK_HEADER, task)];
        headers.extend_from_slice(extra);
        let policy = self.config.retry;
        let mut last = None;
        for attempt in 0..policy.attempts() {
            policy.wait_before(attempt);
            match self.exchange("GET", "/", &headers, b"", self.config.timeout) {
                Ok(resp) if resp.status == 200 => return Ok(resp),
                Ok(resp) => {
                    let err =
                        self.err(task, Some(resp.status), format!("HTTP {}{}", resp.status, body_excerpt(&resp.body)));
                    if resp.status >= 500 || resp.status == 429 {
                        last = Some(err);
                    } else {
                        return Err(err);
                    }
                }
                Err(e) if e.is_transient() => {
                    let what = if e.is_timeout() {
                        format!("timed out after {:?}", self.config.timeout)
                    } else {
                        e.to_string()
                    };
                    last = Some(self.err(task, None, what));
                }
                Err(e) => return Err(self.err(task, None, e.to_string())),
            }
        }
        let mut err = last.unwrap_or_else(|| self.err(task, None, "no attempt was made"));
        if let KeyError::Datapipe { detail, .. } = &mut err {
            if policy.attempts() > 1 {
                detail.push_str(&format!(" (after {} attempts)", policy.attempts()));
            }
        }
        Err(err)
    }

    fn json(&self, task: &'static str, resp: &Response) -> Result<Value, KeyError> {
        // The body may hold key material: never quote it.
        serde_json::from_slice(&resp.body).map_err(|e| {
            self.err(
                task,
                Some(resp.status),
                format!("the answer is not JSON ({} bytes; {})", resp.body.len(), e.classify_name()),
            )
        })
    }

    fn err(&self, task: &'static str, status: Option<u16>, detail: impl Into<String>) -> KeyError {
        KeyError::Datapipe { socket: self.config.socket_path.clone(), task, status, detail: detail.into() }
    }
}

/// `: <first 200 characters of an error body>`, or nothing for an empty body.
pub(crate) fn body_excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text = crate::config::scrub(text.trim(), &[]);
    if text.is_empty() {
        String::new()
    } else {
        format!(": {}", http1::truncate(&text, 200))
    }
}

trait ClassifyName {
    fn classify_name(&self) -> &'static str;
}

impl ClassifyName for serde_json::Error {
    fn classify_name(&self) -> &'static str {
        match self.classify() {
            serde_json::error::Category::Io => "I/O error",
            serde_json::error::Category::Syntax => "syntax error",
            serde_json::error::Category::Data => "unexpected data",
            serde_json::error::Category::Eof => "unexpected end",
        }
    }
}

/// Python's `os.path.abspath`: join with the current directory when relative, then remove
/// `.` and resolve `..` lexically (symbolic links are not followed).
pub(crate) fn abspath(path: &Path) -> PathBuf {
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().map(|d| d.join(path)).unwrap_or_else(|_| path.to_path_buf())
    };
    let mut out = PathBuf::new();
    for c in joined.components() {
        match c {
            Component::Prefix(_) | Component::RootDir => out.push(c.as_os_str()),
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(s) => out.push(s),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abspath_is_lexical() {
        assert_eq!(abspath(Path::new("/a/./b/../c")), PathBuf::from("/a/c"));
        assert_eq!(abspath(Path::new("/../x")), PathBuf::from("/x"));
        assert_eq!(abspath(Path::new("/m.safetensors")), PathBuf::from("/m.safetensors"));
        let rel = abspath(Path::new("m.safetensors"));
        assert!(rel.is_absolute());
        assert!(rel.ends_with("m.safetensors"));
    }

    #[test]
    fn config_from_vars() {
        let c = DatapipeConfig::from_vars(|k| match k {
            "DATAPIPE_SOCKET_PATH" => Some("/tmp/dp.sock".into()),
            "POD_NAME" => Some("pod-1".into()),
            _ => None,
        });
        assert_eq!(c.socket_path, PathBuf::from("/tmp/dp.sock"));
        assert_eq!(c.pod_name, "pod-1");
        let d = DatapipeConfig::from_vars(|_| Some(String::new()));
        assert_eq!(d, DatapipeConfig::default());
    }

    #[test]
    fn sts_debug_is_redacted() {
        let c = StsCredentials {
            access_key: "AKSTS".into(),
            secret_key: Secret::new("sts-secret-key"),
            session_token: Secret::new("sts-session-token"),
        };
        let d = format!("{c:?}");
        assert!(d.contains("AKSTS"));
        assert!(!d.contains("sts-secret-key") && !d.contains("sts-session-token"), "{d}");
    }
}
