//! The datapipe sidecar: HTTP/1.1 over a unix socket, one task per request chosen by the
//! `X-Datapipe-Task-Type` header, through reqwest's blocking client
//! (`ClientBuilder::unix_socket`).

use std::fmt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderName, HeaderValue};
use serde::Deserialize;
use turboio_cipher::{b64_decode, CipherError, Iv, Key};
use zeroize::Zeroizing;

use crate::config::{process_env, var, RetryPolicy, Secret};
use crate::http::{self, Cancelled, ReadError};
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

/// Temporary KMS credentials from the `kms-sts` task (`Debug` shows the secrets as `<redacted>`).
#[derive(Clone, Debug)]
pub struct StsCredentials {
    /// `Cred.AccessKeyId`.
    pub access_key: String,
    /// `Cred.SecretAccessKey`.
    pub secret_key: Secret,
    /// `Cred.SessionToken` (may be empty).
    pub session_token: Secret,
}

/// Temporary SFCS credentials from the `sfcs-sts` task, with their validity and the name node
/// to use (`Debug` shows the secrets as `<redacted>`).
#[derive(Clone, Debug)]
pub struct SfcsSts {
    /// `Cred.AccessKeyId`.
    pub access_key: String,
    /// `Cred.SecretAccessKey`.
    pub secret_key: Secret,
    /// `Cred.SessionToken`.
    pub session_token: Secret,
    /// `Cred.CurrentTime`: when the datapipe issued them.
    pub current_time: SystemTime,
    /// `Cred.ExpiredTime`: when they stop working.
    pub expired_time: SystemTime,
    /// `SfcsNameNodeAddress`.
    pub namenode_address: String,
}

// Answers, parsed straight into zeroizing types: no secret passes through a `serde_json::Value`.

#[derive(Deserialize)]
struct PingAnswer {
    message: Option<String>,
}

#[derive(Deserialize, Debug)]
struct KeyAnswer {
    #[serde(rename = "Key")]
    key: Secret,
    #[serde(rename = "IV")]
    iv: Secret,
}

#[derive(Deserialize)]
struct KmsStsAnswer {
    #[serde(rename = "Cred")]
    cred: KmsCred,
}

#[derive(Deserialize)]
struct KmsCred {
    #[serde(rename = "AccessKeyId")]
    access_key: String,
    #[serde(rename = "SecretAccessKey")]
    secret_key: Secret,
    #[serde(rename = "SessionToken")]
    session_token: Secret,
}

#[derive(Deserialize)]
struct SfcsStsAnswer {
    #[serde(rename = "Cred")]
    cred: SfcsCred,
    #[serde(rename = "SfcsNameNodeAddress")]
    namenode_address: String,
}

#[derive(Deserialize)]
struct SfcsCred {
    #[serde(rename = "CurrentTime")]
    current_time: String,
    #[serde(rename = "ExpiredTime")]
    expired_time: String,
    #[serde(rename = "AccessKeyId")]
    access_key: String,
    #[serde(rename = "SecretAccessKey")]
    secret_key: Secret,
    #[serde(rename = "SessionToken")]
    session_token: Secret,
}

/// A datapipe answer: status and body (zeroized on drop: it may hold key material).
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) body: Zeroizing<Vec<u8>>,
}

/// Why one exchange failed.
#[derive(Debug)]
pub(crate) enum ExchangeError {
    /// A header value we were asked to send is not valid in HTTP (CR, LF, NUL...).
    BadHeader(&'static str),
    /// The request timed out.
    Timeout,
    /// Connecting, sending or reading failed; worth retrying.
    Transport(String),
    /// The answer is larger than the limit.
    TooLarge,
    /// The caller cancelled.
    Cancelled,
}

impl fmt::Display for ExchangeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExchangeError::BadHeader(name) => {
                write!(f, "header {name} would contain CR, LF, NUL or another invalid byte")
            }
            ExchangeError::Timeout => f.write_str("timed out"),
            ExchangeError::Transport(m) => f.write_str(m),
            ExchangeError::TooLarge => write!(f, "the answer is larger than {} bytes", http::MAX_BODY),
            ExchangeError::Cancelled => f.write_str("cancelled"),
        }
    }
}

/// A client of the datapipe socket.
#[derive(Debug, Clone)]
pub struct DatapipeClient {
    config: DatapipeConfig,
    cancel: Option<Arc<AtomicBool>>,
    http: OnceLock<Result<reqwest::blocking::Client, String>>,
}

impl DatapipeClient {
    /// A client; nothing is contacted until a task is called.
    pub fn new(config: DatapipeConfig) -> DatapipeClient {
        DatapipeClient { config, cancel: None, http: OnceLock::new() }
    }

    /// Every task of this client gives up with [`KeyError::Cancelled`] once `cancel` is set:
    /// waits between retries wake up and a request in flight is abandoned.
    pub fn with_cancel(mut self, cancel: Arc<AtomicBool>) -> DatapipeClient {
        self.cancel = Some(cancel);
        self
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
        let resp = self.task("ping", &[], self.cancel.as_deref())?;
        let a: PingAnswer = self.parse("ping", &resp)?;
        match a.message.as_deref() {
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
        let resp = self.task(
            "encrypt-key",
            &[("X-Encrypt-Caller-Pod", &self.config.pod_name), ("X-TOS-Path", tos_path)],
            self.cancel.as_deref(),
        )?;
        let a: KeyAnswer = self.parse("encrypt-key", &resp)?;
        let invalid =
            |e: CipherError| KeyError::InvalidKeyMaterial { from: KeySource::Datapipe, detail: e.to_string() };
        let key = Key::new(&b64_decode(a.key.expose(), "datapipe's Key").map_err(invalid)?).map_err(invalid)?;
        let iv = Iv::new(&b64_decode(a.iv.expose(), "datapipe's IV").map_err(invalid)?).map_err(invalid)?;
        Ok((key, iv))
    }

    /// `kms-sts`: temporary KMS credentials.
    pub fn kms_sts(&self) -> Result<StsCredentials, KeyError> {
        let resp = self.task("kms-sts", &[], self.cancel.as_deref())?;
        let a: KmsStsAnswer = self.parse("kms-sts", &resp)?;
        Ok(StsCredentials {
            access_key: a.cred.access_key,
            secret_key: a.cred.secret_key,
            session_token: a.cred.session_token,
        })
    }

    /// `sfcs-sts`: temporary SFCS credentials, their validity (`CurrentTime`, `ExpiredTime`,
    /// ISO 8601 / RFC 3339 with or without an offset; without one, UTC) and the name node.
    pub fn sfcs_sts(&self) -> Result<SfcsSts, KeyError> {
        self.sfcs_sts_cancellable(None)
    }

    /// [`DatapipeClient::sfcs_sts`], also giving up once `cancel` (or the client's own flag)
    /// is set.
    pub fn sfcs_sts_cancellable(&self, cancel: Option<&AtomicBool>) -> Result<SfcsSts, KeyError> {
        let cancel = cancel.or(self.cancel.as_deref());
        let resp = self.task("sfcs-sts", &[], cancel)?;
        let a: SfcsStsAnswer = self.parse("sfcs-sts", &resp)?;
        let time = |name: &str, text: &str| {
            parse_time(text).ok_or_else(|| {
                self.err(
                    "sfcs-sts",
                    Some(200),
                    format!("Cred.{name} {:?} is not an ISO 8601 time", http::truncate(text, 40)),
                )
            })
        };
        Ok(SfcsSts {
            current_time: time("CurrentTime", &a.cred.current_time)?,
            expired_time: time("ExpiredTime", &a.cred.expired_time)?,
            access_key: a.cred.access_key,
            secret_key: a.cred.secret_key,
            session_token: a.cred.session_token,
            namenode_address: a.namenode_address,
        })
    }

    fn http(&self) -> Result<&reqwest::blocking::Client, String> {
        self.http
            .get_or_init(|| http::unix_client(&self.config.socket_path, self.config.timeout))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// One exchange over the socket, no retries: used by the KMS client for `top`, which has
    /// its own retry policy and timeout. `body` is handed to the client without a copy and
    /// zeroized when the client is done with it.
    pub(crate) fn exchange(
        &self,
        method: reqwest::Method,
        target: &str,
        headers: &[(&'static str, &str)],
        body: Option<bytes::Bytes>,
        timeout: Duration,
        cancel: Option<&AtomicBool>,
    ) -> Result<Answer, ExchangeError> {
        let client = self.http().map_err(ExchangeError::Transport)?.clone();
        let mut req = client.request(method, format!("http://localhost{target}")).timeout(timeout);
        for (name, value) in headers {
            let mut v = HeaderValue::from_str(value).map_err(|_| ExchangeError::BadHeader(name))?;
            if name.eq_ignore_ascii_case("X-Security-Token") || name.eq_ignore_ascii_case("Authorization") {
                v.set_sensitive(true);
            }
            let n = HeaderName::from_bytes(name.as_bytes()).map_err(|_| ExchangeError::BadHeader(name))?;
            req = req.header(n, v);
        }
        if let Some(b) = body {
            req = req.body(b);
        }
        let req = req
            .build()
            .map_err(|e| ExchangeError::Transport(format!("cannot build the request{}", http::error_chain(&e))))?;
        let run = move || -> Result<Answer, ExchangeError> {
            let resp = client.execute(req).map_err(|e| {
                if e.is_timeout() {
                    ExchangeError::Timeout
                } else {
                    ExchangeError::Transport(format!("request failed{}", http::error_chain(&e)))
                }
            })?;
            let status = resp.status().as_u16();
            let body = http::read_body(resp).map_err(|e| match e {
                ReadError::TooLarge => ExchangeError::TooLarge,
                ReadError::Io(e) if http::is_timeout_io(&e) => ExchangeError::Timeout,
                ReadError::Io(e) => ExchangeError::Transport(format!("reading the answer failed: {e}")),
            })?;
            Ok(Answer { status, body })
        };
        match http::cancellable(cancel, run, |e| {
            Err(ExchangeError::Transport(format!("no thread for the request: {e}")))
        }) {
            Ok(r) => r,
            Err(Cancelled) => Err(ExchangeError::Cancelled),
        }
    }

    /// A GET task with retries; returns the 200 answer.
    fn task(
        &self,
        task: &'static str,
        extra: &[(&'static str, &str)],
        cancel: Option<&AtomicBool>,
    ) -> Result<Answer, KeyError> {
        if !self.exists() {
            return Err(KeyError::DatapipeMissing(self.config.socket_path.clone()));
        }
        let mut headers: Vec<(&'static str, &str)> = vec![(TASK_HEADER, task)];
        headers.extend_from_slice(extra);
        let policy = self.config.retry;
        let mut last = None;
        for attempt in 0..policy.attempts() {
            policy.wait_before(attempt, cancel).map_err(|Cancelled| KeyError::Cancelled)?;
            match self.exchange(reqwest::Method::GET, "/", &headers, None, self.config.timeout, cancel) {
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
                Err(ExchangeError::Cancelled) => return Err(KeyError::Cancelled),
                Err(e @ (ExchangeError::BadHeader(_) | ExchangeError::TooLarge)) => {
                    return Err(self.err(task, None, e.to_string()))
                }
                Err(ExchangeError::Timeout) => {
                    last = Some(self.err(task, None, format!("timed out after {:?}", self.config.timeout)))
                }
                Err(e) => last = Some(self.err(task, None, e.to_string())),
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

    /// Parses an answer into `T` (whose secret fields are zeroizing). The body may hold key
    /// material: it is never quoted.
    fn parse<T: for<'de> Deserialize<'de>>(&self, task: &'static str, resp: &Answer) -> Result<T, KeyError> {
        serde_json::from_slice(&resp.body)
            .map_err(|e| self.err(task, Some(resp.status), http::describe_json_error(&e, resp.body.len())))
    }

    fn err(&self, task: &'static str, status: Option<u16>, detail: impl Into<String>) -> KeyError {
        KeyError::Datapipe { socket: self.config.socket_path.clone(), task, status, detail: detail.into() }
    }
}

/// An ISO 8601 / RFC 3339 time (`2024-01-02T03:04:05Z`, `...+08:00`, fractions allowed, a
/// space instead of `T` too); without an offset, UTC.
pub(crate) fn parse_time(text: &str) -> Option<SystemTime> {
    use time::format_description::well_known::{Iso8601, Rfc3339};
    let t = text.trim();
    let t = if t.len() > 10 && t.as_bytes()[10] == b' ' { format!("{}T{}", &t[..10], &t[11..]) } else { t.to_string() };
    let parsed = time::OffsetDateTime::parse(&t, &Rfc3339)
        .or_else(|_| time::OffsetDateTime::parse(&t, &Iso8601::DEFAULT))
        .or_else(|_| time::PrimitiveDateTime::parse(&t, &Iso8601::DEFAULT).map(|p| p.assume_utc()))
        .ok()?;
    Some(SystemTime::from(parsed))
}

/// `: <first 200 characters of an error body>`, or nothing for an empty body.
pub(crate) fn body_excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text = crate::config::scrub(text.trim(), &[]);
    if text.is_empty() {
        String::new()
    } else {
        format!(": {}", http::truncate(&text, 200))
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

    #[test]
    fn iso_times() {
        let utc = |s: &str| parse_time(s).unwrap().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs();
        assert_eq!(utc("2024-01-01T00:00:00Z"), 1_704_067_200);
        assert_eq!(utc("2024-01-01T08:00:00+08:00"), 1_704_067_200);
        assert_eq!(utc("2024-01-01 00:00:00"), 1_704_067_200);
        assert_eq!(utc("2024-01-01T00:00:00.250Z"), 1_704_067_200);
        assert!(parse_time("yesterday").is_none());
    }

    #[test]
    fn secrets_parse_without_values_in_errors() {
        let e = serde_json::from_slice::<KeyAnswer>(br#"{"Key": 12345678, "IV": "x"}"#).unwrap_err();
        let d = http::describe_json_error(&e, 10);
        assert!(!d.contains("12345678"), "{d}");
        let e = serde_json::from_slice::<KeyAnswer>(br#"{"IV": "x"}"#).unwrap_err();
        assert_eq!(http::describe_json_error(&e, 10), "the answer has no field `Key`");
    }
}
