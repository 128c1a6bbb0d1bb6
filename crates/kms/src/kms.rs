//! The Volcano Engine KMS client: signed `Decrypt` / `Encrypt` over HTTPS (reqwest + rustls
//! with the ring provider), or over the datapipe socket acting as a proxy.

use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use serde::Deserialize;

use reqwest::header::{HeaderName, HeaderValue};
use reqwest::Url;
use serde_json::Value;
use turboio_cipher::{b64_decode, b64_encode, Key};
use zeroize::Zeroizing;

use crate::config::{process_env, py_json_str, scrub, var, RetryPolicy, Secret};
use crate::datapipe::{DatapipeClient, ExchangeError, TASK_HEADER};
use crate::http::{self, Cancelled, ReadError, MAX_BODY};
use crate::sign::{self, SignRequest, XDate};
use crate::{KeyError, KeySource};

/// veTurboIO's default OpenAPI host.
pub const DEFAULT_HOST: &str = "open.volcengineapi.com";
/// veTurboIO's default region.
pub const DEFAULT_REGION: &str = "cn-beijing";
/// The OpenAPI service name.
pub const SERVICE: &str = "kms";
/// The KMS API version.
pub const API_VERSION: &str = "2021-02-18";

/// KMS settings.
///
/// [`KmsConfig::from_env`] reads veTurboIO's variables (`VETURBOIO_KMS_HOST`, `_REGION`,
/// `_ACCESS_KEY`, `_SECRET_KEY`, `_SESSION_TOKEN`, `_KEYRING_NAME`, `_KEY_NAME`) plus the
/// turboio extension `VETURBOIO_KMS_ENDPOINT`. `Debug` redacts the secret key and token.
#[derive(Clone)]
pub struct KmsConfig {
    /// OpenAPI host (`VETURBOIO_KMS_HOST`, default [`DEFAULT_HOST`]); requests go to
    /// `https://{host}/`.
    pub host: String,
    /// Region (`VETURBOIO_KMS_REGION`, default [`DEFAULT_REGION`]).
    pub region: String,
    /// A full endpoint URL that replaces `https://{host}/`, e.g. `http://127.0.0.1:8080` for a
    /// local mock or an internal gateway (`VETURBOIO_KMS_ENDPOINT`; a turboio extension that
    /// veTurboIO does not have). Its host (and port, if not the scheme's default) is what gets
    /// signed.
    pub endpoint: Option<String>,
    /// Allow a plain `http://` endpoint on a host other than the loopback (`127.0.0.0/8`,
    /// `::1`, `localhost`): the signed requests and the data keys in the answers would cross the
    /// network unencrypted (`VETURBOIO_KMS_ALLOW_HTTP=1`, a turboio extension; default false).
    pub allow_http: bool,
    /// Access key id (`VETURBOIO_KMS_ACCESS_KEY`).
    pub access_key: Option<String>,
    /// Secret access key (`VETURBOIO_KMS_SECRET_KEY`).
    pub secret_key: Option<Secret>,
    /// STS session token (`VETURBOIO_KMS_SESSION_TOKEN`), sent as `X-Security-Token`.
    pub session_token: Option<Secret>,
    /// Keyring (`VETURBOIO_KMS_KEYRING_NAME`).
    pub keyring_name: Option<String>,
    /// Key (`VETURBOIO_KMS_KEY_NAME`).
    pub key_name: Option<String>,
    /// TCP (and TLS) connect timeout (default 5 s).
    pub connect_timeout: Duration,
    /// Timeout of one whole request, response body included (default 30 s).
    pub timeout: Duration,
    /// Retries on connection errors, timeouts and HTTP 5xx/429; never on other 4xx
    /// (default 4 retries from 200 ms: at most 0.2 + 0.4 + 0.8 + 1.6 = 3 s of waiting).
    pub retry: RetryPolicy,
}

impl Default for KmsConfig {
    fn default() -> Self {
        KmsConfig {
            host: DEFAULT_HOST.to_string(),
            region: DEFAULT_REGION.to_string(),
            endpoint: None,
            allow_http: false,
            access_key: None,
            secret_key: None,
            session_token: None,
            keyring_name: None,
            key_name: None,
            connect_timeout: Duration::from_secs(5),
            timeout: Duration::from_secs(30),
            retry: RetryPolicy::new(4, Duration::from_millis(200)),
        }
    }
}

impl fmt::Debug for KmsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KmsConfig")
            .field("host", &self.host)
            .field("region", &self.region)
            .field("endpoint", &self.endpoint)
            .field("allow_http", &self.allow_http)
            .field("access_key", &self.access_key)
            .field("secret_key", &self.secret_key)
            .field("session_token", &self.session_token)
            .field("keyring_name", &self.keyring_name)
            .field("key_name", &self.key_name)
            .field("connect_timeout", &self.connect_timeout)
            .field("timeout", &self.timeout)
            .field("retry", &self.retry)
            .finish()
    }
}

impl KmsConfig {
    /// Defaults overridden by the process environment.
    pub fn from_env() -> KmsConfig {
        KmsConfig::from_vars(process_env)
    }

    /// Like [`KmsConfig::from_env`], reading variables through `get` (unset and empty are the
    /// same).
    pub fn from_vars<F: Fn(&str) -> Option<String>>(get: F) -> KmsConfig {
        let d = KmsConfig::default();
        KmsConfig {
            host: var(&get, "VETURBOIO_KMS_HOST").unwrap_or(d.host),
            region: var(&get, "VETURBOIO_KMS_REGION").unwrap_or(d.region),
            endpoint: var(&get, "VETURBOIO_KMS_ENDPOINT"),
            allow_http: var(&get, "VETURBOIO_KMS_ALLOW_HTTP")
                .is_some_and(|v| matches!(v.as_str(), "1" | "true" | "yes")),
            access_key: var(&get, "VETURBOIO_KMS_ACCESS_KEY"),
            secret_key: var(&get, "VETURBOIO_KMS_SECRET_KEY").map(Secret::new),
            session_token: var(&get, "VETURBOIO_KMS_SESSION_TOKEN").map(Secret::new),
            keyring_name: var(&get, "VETURBOIO_KMS_KEYRING_NAME"),
            key_name: var(&get, "VETURBOIO_KMS_KEY_NAME"),
            ..d
        }
    }
}

/// A KMS client for one keyring/key and one set of credentials.
pub struct KmsClient {
    config: KmsConfig,
    access_key: String,
    secret_key: Secret,
    keyring_name: String,
    key_name: String,
    /// `scheme://authority` of the endpoint.
    base_url: String,
    /// The `Host` value that is signed (host, plus `:port` when not the scheme's default).
    sign_host: String,
    proxy: Option<DatapipeClient>,
    note: Option<String>,
    cancel: Option<Arc<AtomicBool>>,
    http: OnceLock<Result<reqwest::blocking::Client, String>>,
}

impl fmt::Debug for KmsClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KmsClient")
            .field("config", &self.config)
            .field("base_url", &self.base_url)
            .field("proxy", &self.proxy.as_ref().map(|p| p.socket_path()))
            .finish_non_exhaustive()
    }
}

/// Names that go into the query unencoded must be URL-unreserved characters (the KMS itself
/// allows `[a-zA-Z0-9-_]`), so the signed and the sent query are the same text.
fn check_name(what: &str, v: &str) -> Result<(), KeyError> {
    if v.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~')) {
        Ok(())
    } else {
        Err(KeyError::KmsConfig(format!("{what} {v:?} may only contain letters, digits, '-', '_', '.' and '~'")))
    }
}

fn required<T: Clone>(v: &Option<T>, var: &str) -> Result<T, KeyError> {
    v.clone().ok_or_else(|| KeyError::KmsConfig(format!("{var} is not set")))
}

impl KmsClient {
    /// A client. Fails when the access key, secret key, keyring or key name is missing, or the
    /// host / endpoint is not a valid URL authority. Nothing is contacted yet.
    pub fn new(config: KmsConfig) -> Result<KmsClient, KeyError> {
        let access_key = required(&config.access_key, "VETURBOIO_KMS_ACCESS_KEY")?;
        let secret_key = required(&config.secret_key, "VETURBOIO_KMS_SECRET_KEY")?;
        let keyring_name = required(&config.keyring_name, "VETURBOIO_KMS_KEYRING_NAME")?;
        let key_name = required(&config.key_name, "VETURBOIO_KMS_KEY_NAME")?;
        check_name("VETURBOIO_KMS_KEYRING_NAME", &keyring_name)?;
        check_name("VETURBOIO_KMS_KEY_NAME", &key_name)?;
        if config.region.is_empty() || config.region.contains(['/', '\n', '\r']) {
            return Err(KeyError::KmsConfig(format!("VETURBOIO_KMS_REGION {:?} is not a region name", config.region)));
        }
        let (url_text, var_name) = match &config.endpoint {
            Some(e) => (e.clone(), "VETURBOIO_KMS_ENDPOINT"),
            None => (format!("https://{}/", config.host), "VETURBOIO_KMS_HOST"),
        };
        let bad = |why: &str| KeyError::KmsConfig(format!("{var_name} {url_text:?}: {why}"));
        let url = Url::parse(&url_text).map_err(|e| bad(&e.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(bad("the scheme must be http or https"));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(bad("user information is not allowed"));
        }
        if !matches!(url.path(), "" | "/") || url.query().is_some() || url.fragment().is_some() {
            return Err(bad("only scheme://host[:port] is allowed (no path or query)"));
        }
        let host = url.host_str().ok_or_else(|| bad("no host"))?;
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let loopback =
            bare.eq_ignore_ascii_case("localhost") || bare.parse::<std::net::IpAddr>().is_ok_and(|a| a.is_loopback());
        if url.scheme() == "http" && !loopback && !config.allow_http {
            return Err(bad(
                "plain http:// is refused for a host other than the loopback (the signed requests and the data \
                 keys would cross the network unencrypted): use https://, or set VETURBOIO_KMS_ALLOW_HTTP=1",
            ));
        }
        let sign_host = match url.port() {
            Some(p) => format!("{host}:{p}"),
            None => host.to_string(),
        };
        let base_url = format!("{}://{sign_host}", url.scheme());
        Ok(KmsClient {
            config,
            access_key,
            secret_key,
            keyring_name,
            key_name,
            base_url,
            sign_host,
            proxy: None,
            note: None,
            cancel: None,
            http: OnceLock::new(),
        })
    }

    /// Sends every request as plain HTTP over the datapipe socket (task `top`) instead of
    /// HTTPS; the sidecar forwards it to the KMS host, which is still what gets signed.
    pub fn with_datapipe_proxy(mut self, proxy: DatapipeClient) -> KmsClient {
        self.proxy = Some(proxy);
        self
    }

    /// Every call of this client gives up with [`KeyError::Cancelled`] once `cancel` is set:
    /// waits between retries wake up and a request in flight is abandoned.
    pub fn with_cancel(mut self, cancel: Arc<AtomicBool>) -> KmsClient {
        self.cancel = Some(cancel);
        self
    }

    /// A note appended to every error of this client (e.g. where the credentials came from).
    pub fn with_note(mut self, note: impl Into<String>) -> KmsClient {
        self.note = Some(note.into());
        self
    }

    /// The settings.
    pub fn config(&self) -> &KmsConfig {
        &self.config
    }

    /// Where requests go, as error messages name it.
    pub fn endpoint(&self) -> String {
        match &self.proxy {
            Some(p) => format!("datapipe proxy {} -> {}", p.socket_path().display(), self.sign_host),
            None => self.base_url.clone(),
        }
    }

    /// `Decrypt`: the plaintext of a `CiphertextBlob` (base64-decoded `Result.Plaintext`).
    /// Body: `{"CiphertextBlob": "<blob>"}` with Python `json.dumps` spacing.
    pub fn decrypt(&self, ciphertext_blob: &str) -> Result<Zeroizing<Vec<u8>>, KeyError> {
        self.decrypt_inner(ciphertext_blob).map_err(|e| self.noted(e))
    }

    fn decrypt_inner(&self, ciphertext_blob: &str) -> Result<Zeroizing<Vec<u8>>, KeyError> {
        let body = format!("{{\"CiphertextBlob\": {}}}", py_json_str(ciphertext_blob));
        let answer = self.call("Decrypt", Bytes::from(body.into_bytes()), &[])?;
        let a = self.parse("Decrypt", &answer)?;
        let text = a
            .result
            .and_then(|r| r.plaintext)
            .ok_or_else(|| self.err("Decrypt", Some(200), missing("Plaintext", a.meta.as_ref())))?;
        b64_decode(text.expose(), "KMS Result.Plaintext")
            .map_err(|e| KeyError::InvalidKeyMaterial { from: KeySource::HeaderKms, detail: e.to_string() })
    }

    /// `Encrypt`: the `CiphertextBlob` for `plaintext` (sent base64-encoded, as the API wants).
    pub fn encrypt(&self, plaintext: &[u8]) -> Result<String, KeyError> {
        self.encrypt_inner(plaintext).map_err(|e| self.noted(e))
    }

    fn encrypt_inner(&self, plaintext: &[u8]) -> Result<String, KeyError> {
        let b64 = Zeroizing::new(b64_encode(plaintext));
        // `{"Plaintext": "<base64>"}`: the base64 alphabet needs no JSON escaping, so this is
        // Python's json.dumps text. One buffer, sized up front and never grown, handed to the
        // HTTP client without a copy and zeroized when the client drops it.
        const OPEN: &[u8] = b"{\"Plaintext\": \"";
        const CLOSE: &[u8] = b"\"}";
        let mut body = Zeroizing::new(Vec::with_capacity(OPEN.len() + b64.len() + CLOSE.len()));
        body.extend_from_slice(OPEN);
        body.extend_from_slice(b64.as_bytes());
        body.extend_from_slice(CLOSE);
        let answer = self.call("Encrypt", Bytes::from_owner(body), &[&b64])?;
        let a = self.parse("Encrypt", &answer)?;
        a.result
            .and_then(|r| r.ciphertext_blob)
            .ok_or_else(|| self.err("Encrypt", Some(200), missing("CiphertextBlob", a.meta.as_ref())))
    }

    fn parse(&self, action: &'static str, answer: &[u8]) -> Result<KmsAnswer, KeyError> {
        serde_json::from_slice(answer)
            .map_err(|e| self.err(action, Some(200), http::describe_json_error(&e, answer.len())))
    }

    /// veTurboIO's data-key wrapping, reading side: the KMS plaintext is the *base64 text* of
    /// the raw key, so `Decrypt` then base64-decode once more.
    pub fn decrypt_data_key(&self, ciphertext_blob: &str) -> Result<Key, KeyError> {
        let b64 = self.decrypt(ciphertext_blob)?;
        let invalid = |e: turboio_cipher::CipherError| KeyError::InvalidKeyMaterial {
            from: KeySource::HeaderKms,
            detail: e.to_string(),
        };
        let text = std::str::from_utf8(&b64).map_err(|_| KeyError::InvalidKeyMaterial {
            from: KeySource::HeaderKms,
            detail: "the KMS plaintext is not the base64 text of a key".into(),
        })?;
        let raw = b64_decode(text, "the KMS plaintext").map_err(invalid)?;
        Key::new(&raw).map_err(invalid)
    }

    /// veTurboIO's data-key wrapping, writing side: `Encrypt(Plaintext = base64(raw key))`.
    pub fn encrypt_data_key(&self, key: &Key) -> Result<String, KeyError> {
        self.encrypt(key.to_base64().as_bytes())
    }

    fn err(&self, action: &'static str, status: Option<u16>, detail: impl Into<String>) -> KeyError {
        KeyError::Kms { action, endpoint: self.endpoint(), status, detail: detail.into() }
    }

    /// Appends the client's note to a KMS error.
    fn noted(&self, mut e: KeyError) -> KeyError {
        if let (Some(n), KeyError::Kms { detail, .. }) = (&self.note, &mut e) {
            detail.push_str(&format!(" [{n}]"));
        }
        e
    }

    /// One signed call with retries; the parsed JSON of the 200 answer. `sensitive` strings
    /// (and the secret key and token) are scrubbed from any quoted error body.
    fn call(&self, action: &'static str, body: Bytes, sensitive: &[&str]) -> Result<Zeroizing<Vec<u8>>, KeyError> {
        let query_pairs = [
            ("Action", action),
            ("KeyName", self.key_name.as_str()),
            ("KeyringName", self.keyring_name.as_str()),
            ("Version", API_VERSION),
        ];
        let query = sign::canonical_query(&query_pairs);
        let token = self.config.session_token.as_ref().filter(|t| !t.is_empty()).map(Secret::expose);
        let mut secrets: Vec<&str> = sensitive.to_vec();
        secrets.push(self.secret_key.expose());
        secrets.extend(token);

        let policy = self.config.retry;
        let mut last = None;
        for attempt in 0..policy.attempts() {
            policy.wait_before(attempt, self.cancel.as_deref()).map_err(|Cancelled| KeyError::Cancelled)?;
            let date = XDate::now();
            let signed = sign::sign(&SignRequest {
                method: "POST",
                host: &self.sign_host,
                query: &query_pairs,
                body: &body,
                date: &date,
                region: &self.config.region,
                service: SERVICE,
                access_key: &self.access_key,
                secret_key: self.secret_key.expose(),
            });
            let mut headers: Vec<(&'static str, String)> = signed.to_vec();
            if let Some(t) = token {
                headers.push(("X-Security-Token", t.to_string()));
            }
            let outcome = match &self.proxy {
                Some(p) => self.send_proxy(p, &query, &headers, body.clone()),
                None => self.send_https(&query, &headers, body.clone()),
            };
            // Header values may hold the token: zeroize our copies.
            for (_, v) in headers.iter_mut() {
                zeroize::Zeroize::zeroize(v);
            }
            match outcome {
                Ok((200, answer)) => return Ok(answer),
                Ok((status, body)) => {
                    let err = self.err(action, Some(status), describe_status(status, &body, &secrets));
                    if status >= 500 || status == 429 {
                        last = Some(err);
                    } else {
                        return Err(err);
                    }
                }
                Err(Failure::Cancelled) => return Err(KeyError::Cancelled),
                Err(Failure::Transient(d)) => last = Some(self.err(action, None, d)),
                Err(Failure::Permanent(d)) => return Err(self.err(action, None, d)),
            }
        }
        let mut err = last.unwrap_or_else(|| self.err(action, None, "no attempt was made"));
        if let KeyError::Kms { detail, .. } = &mut err {
            if policy.attempts() > 1 {
                detail.push_str(&format!(" (after {} attempts)", policy.attempts()));
            }
        }
        Err(err)
    }

    fn http_client(&self) -> Result<&reqwest::blocking::Client, String> {
        self.http.get_or_init(|| build_http_client(&self.config, &self.sign_host)).as_ref().map_err(Clone::clone)
    }

    fn send_https(
        &self,
        query: &str,
        headers: &[(&'static str, String)],
        body: Bytes,
    ) -> Result<(u16, Zeroizing<Vec<u8>>), Failure> {
        let client = self.http_client().map_err(Failure::Permanent)?.clone();
        let url = format!("{}/?{query}", self.base_url);
        let mut req = client.post(&url).body(body);
        for (name, value) in headers {
            let mut v = HeaderValue::from_str(value)
                .map_err(|_| Failure::Permanent(format!("the {name} header value is not valid in HTTP")))?;
            if *name == "X-Security-Token" || *name == "Authorization" {
                v.set_sensitive(true);
            }
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| Failure::Permanent(format!("{name} is not a valid header name")))?;
            req = req.header(name, v);
        }
        let req = req
            .build()
            .map_err(|e| Failure::Permanent(format!("cannot build the request{}", http::error_chain(&e))))?;
        let host = self.sign_host.clone();
        let timeout = self.config.timeout;
        let run = move || -> Result<(u16, Zeroizing<Vec<u8>>), Failure> {
            let resp = client.execute(req).map_err(|e| {
                let chain = http::error_chain(&e);
                if e.is_timeout() {
                    Failure::Transient(format!("timed out after {timeout:?} waiting for {host}{chain}"))
                } else if e.is_connect() {
                    Failure::Transient(format!("cannot connect to {host}{chain}"))
                } else if e.is_builder() {
                    Failure::Permanent(format!("cannot build the request{chain}"))
                } else {
                    Failure::Transient(format!("request to {host} failed{chain}"))
                }
            })?;
            let status = resp.status().as_u16();
            let out = http::read_body(resp).map_err(|e| match e {
                ReadError::TooLarge => {
                    Failure::Permanent(format!("the answer from {host} is larger than {MAX_BODY} bytes"))
                }
                ReadError::Io(e) if http::is_timeout_io(&e) => {
                    Failure::Transient(format!("timed out after {timeout:?} reading the answer from {host}"))
                }
                ReadError::Io(e) => Failure::Transient(format!("reading the answer from {host} failed: {e}")),
            })?;
            Ok((status, out))
        };
        match http::cancellable(self.cancel.as_deref(), run, |e| Err(Failure::Transient(format!("no thread: {e}")))) {
            Ok(r) => r,
            Err(Cancelled) => Err(Failure::Cancelled),
        }
    }

    fn send_proxy(
        &self,
        proxy: &DatapipeClient,
        query: &str,
        headers: &[(&'static str, String)],
        body: Bytes,
    ) -> Result<(u16, Zeroizing<Vec<u8>>), Failure> {
        if !proxy.exists() {
            return Err(Failure::Permanent(format!(
                "datapipe socket {} does not exist",
                proxy.socket_path().display()
            )));
        }
        let mut all: Vec<(&'static str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        all.push((TASK_HEADER, "top"));
        let target = format!("/?{query}");
        let cancel = self.cancel.as_deref();
        match proxy.exchange(reqwest::Method::POST, &target, &all, Some(body), self.config.timeout, cancel) {
            Ok(a) => Ok((a.status, a.body)),
            Err(ExchangeError::Cancelled) => Err(Failure::Cancelled),
            Err(e @ (ExchangeError::BadHeader(_) | ExchangeError::TooLarge)) => Err(Failure::Permanent(e.to_string())),
            Err(ExchangeError::Timeout) => Err(Failure::Transient(format!(
                "timed out after {:?} waiting for {}",
                self.config.timeout, self.sign_host
            ))),
            Err(e) => Err(Failure::Transient(format!("datapipe socket {}: {e}", proxy.socket_path().display()))),
        }
    }
}

enum Failure {
    Transient(String),
    Permanent(String),
    Cancelled,
}

/// A KMS answer, parsed straight into zeroizing types (`Result.Plaintext` is key material).
#[derive(Deserialize)]
struct KmsAnswer {
    #[serde(rename = "Result")]
    result: Option<KmsResult>,
    #[serde(rename = "ResponseMetadata")]
    meta: Option<Value>,
}

#[derive(Deserialize)]
struct KmsResult {
    #[serde(rename = "Plaintext")]
    plaintext: Option<Secret>,
    #[serde(rename = "CiphertextBlob")]
    ciphertext_blob: Option<String>,
}

fn build_http_client(config: &KmsConfig, host: &str) -> Result<reqwest::blocking::Client, String> {
    use rustls_platform_verifier::BuilderVerifierExt;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup failed: {e}"))?
        .with_platform_verifier()
        .map_err(|e| format!("TLS certificate verifier setup failed: {e}"))?
        .with_no_client_auth();
    let mut b = reqwest::blocking::Client::builder()
        .tls_backend_preconfigured(tls)
        .connect_timeout(config.connect_timeout)
        .timeout(config.timeout)
        .user_agent(concat!("turboio-kms/", env!("CARGO_PKG_VERSION")));
    // A proxy from HTTP(S)_PROXY must not capture requests to this machine (local gateways,
    // test mocks).
    let bare = host.rsplit_once(':').map_or(host, |(h, _)| h);
    if matches!(bare, "localhost" | "127.0.0.1" | "[::1]") || bare.starts_with("127.") {
        b = b.no_proxy();
    }
    b.build().map_err(|e| format!("cannot create the HTTPS client{}", http::error_chain(&e)))
}

/// KMS error `Code: Message` from `ResponseMetadata.Error`, if any.
fn api_error(meta: &Value) -> Option<String> {
    let e = meta.get("Error")?;
    let code = e.get("Code").and_then(Value::as_str).unwrap_or("");
    let msg = e.get("Message").and_then(Value::as_str).unwrap_or("");
    Some(format!("{code}: {msg}"))
}

fn missing(field: &str, meta: Option<&Value>) -> String {
    match meta.and_then(api_error) {
        Some(e) => format!("the answer has no Result.{field} ({})", http::truncate(&e, 200)),
        None => format!("the answer has no Result.{field}"),
    }
}

fn describe_status(status: u16, body: &[u8], secrets: &[&str]) -> String {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let why = match parsed.as_ref().and_then(|j| j.get("ResponseMetadata")).and_then(api_error) {
        Some(e) => format!(": {}", http::truncate(&scrub(&e, secrets), 200)),
        None => {
            let text = String::from_utf8_lossy(body);
            let text = scrub(text.trim(), secrets);
            if text.is_empty() {
                String::new()
            } else {
                format!(": {}", http::truncate(&text, 200))
            }
        }
    };
    let hint = match status {
        401 | 403 => " (the KMS rejected the request's credentials or signature: check the access key, secret key and session token)",
        _ => "",
    };
    format!("HTTP {status}{why}{hint}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> KmsConfig {
        KmsConfig {
            access_key: Some("AK".into()),
            secret_key: Some(Secret::new("SK-secret")),
            keyring_name: Some("ring".into()),
            key_name: Some("key".into()),
            ..KmsConfig::default()
        }
    }

    #[test]
    fn config_from_vars() {
        let c = KmsConfig::from_vars(|k| {
            Some(
                match k {
                    "VETURBOIO_KMS_HOST" => "kms.example",
                    "VETURBOIO_KMS_REGION" => "cn-shanghai",
                    "VETURBOIO_KMS_ACCESS_KEY" => "AKX",
                    "VETURBOIO_KMS_SECRET_KEY" => "SKX-secret",
                    "VETURBOIO_KMS_SESSION_TOKEN" => "TOKX-secret",
                    "VETURBOIO_KMS_KEYRING_NAME" => "r",
                    "VETURBOIO_KMS_KEY_NAME" => "k",
                    _ => "",
                }
                .to_string(),
            )
        });
        assert_eq!(c.host, "kms.example");
        assert_eq!(c.region, "cn-shanghai");
        assert_eq!(c.endpoint, None);
        assert_eq!(c.access_key.as_deref(), Some("AKX"));
        assert_eq!(c.secret_key.as_ref().map(Secret::expose), Some("SKX-secret"));
        let d = format!("{c:?}");
        assert!(!d.contains("SKX-secret") && !d.contains("TOKX-secret"), "{d}");
        let e = KmsConfig::from_vars(|_| None);
        assert_eq!(e.host, DEFAULT_HOST);
        assert_eq!(e.region, DEFAULT_REGION);
        assert_eq!(e.connect_timeout, Duration::from_secs(5));
        assert_eq!(e.timeout, Duration::from_secs(30));
        assert_eq!(e.retry.retries, 4);
        assert_eq!(e.retry.base_delay, Duration::from_millis(200));
    }

    #[test]
    fn missing_settings_are_named() {
        for (clear, var) in [
            (0, "VETURBOIO_KMS_ACCESS_KEY"),
            (1, "VETURBOIO_KMS_SECRET_KEY"),
            (2, "VETURBOIO_KMS_KEYRING_NAME"),
            (3, "VETURBOIO_KMS_KEY_NAME"),
        ] {
            let mut c = cfg();
            match clear {
                0 => c.access_key = None,
                1 => c.secret_key = None,
                2 => c.keyring_name = None,
                _ => c.key_name = None,
            }
            let e = KmsClient::new(c).unwrap_err().to_string();
            assert_eq!(e, format!("KMS is not configured: {var} is not set"));
        }
        let mut c = cfg();
        c.key_name = Some("a&b=c".into());
        assert!(KmsClient::new(c).unwrap_err().to_string().contains("VETURBOIO_KMS_KEY_NAME"));
    }

    #[test]
    fn endpoints_and_signed_host() {
        let k = KmsClient::new(cfg()).unwrap();
        assert_eq!(k.base_url, "https://open.volcengineapi.com");
        assert_eq!(k.sign_host, "open.volcengineapi.com");
        for (ep, base, host) in [
            ("http://127.0.0.1:8080", "http://127.0.0.1:8080", "127.0.0.1:8080"),
            ("http://127.0.0.1:80/", "http://127.0.0.1", "127.0.0.1"),
            ("https://kms.internal:443", "https://kms.internal", "kms.internal"),
            ("https://[::1]:9/", "https://[::1]:9", "[::1]:9"),
        ] {
            let k = KmsClient::new(KmsConfig { endpoint: Some(ep.into()), ..cfg() }).unwrap();
            assert_eq!((k.base_url.as_str(), k.sign_host.as_str()), (base, host), "{ep}");
        }
        for ep in ["ftp://x", "http://x/path", "http://x/?a=b", "http://u:p@x", "not a url", "http://kms.internal:8080"]
        {
            let e = KmsClient::new(KmsConfig { endpoint: Some(ep.into()), ..cfg() }).unwrap_err();
            assert!(e.to_string().contains("VETURBOIO_KMS_ENDPOINT"), "{e}");
        }
        let e = KmsClient::new(KmsConfig { endpoint: Some("http://10.0.0.7".into()), ..cfg() }).unwrap_err();
        assert!(e.to_string().contains("VETURBOIO_KMS_ALLOW_HTTP"), "{e}");
        let opted = KmsConfig { endpoint: Some("http://10.0.0.7".into()), allow_http: true, ..cfg() };
        assert_eq!(KmsClient::new(opted).unwrap().base_url, "http://10.0.0.7");
        for ep in ["http://localhost:8080", "http://127.0.0.2:1", "http://[::1]:9"] {
            KmsClient::new(KmsConfig { endpoint: Some(ep.into()), ..cfg() }).unwrap();
        }
        let from_vars = KmsConfig::from_vars(|k| (k == "VETURBOIO_KMS_ALLOW_HTTP").then(|| "1".to_owned()));
        assert!(from_vars.allow_http && !KmsConfig::from_vars(|_| None).allow_http);
        let e = KmsClient::new(KmsConfig { host: "bad host/x".into(), ..cfg() }).unwrap_err();
        assert!(e.to_string().contains("VETURBOIO_KMS_HOST"), "{e}");
    }

    #[test]
    fn status_descriptions() {
        let body = br#"{"ResponseMetadata":{"Error":{"Code":"SignatureDoesNotMatch","Message":"bad sig"}}}"#;
        assert_eq!(
            describe_status(401, body, &[]),
            "HTTP 401: SignatureDoesNotMatch: bad sig (the KMS rejected the request's credentials or signature: check the access key, secret key and session token)"
        );
        assert_eq!(describe_status(500, b"oops SECRETVALUE\n", &["SECRETVALUE"]), "HTTP 500: oops <redacted>");
        assert_eq!(describe_status(502, b"", &[]), "HTTP 502");
    }
}
