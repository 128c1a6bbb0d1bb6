//! Options: what turboio itself tunes (concurrency, part size, bandwidth, retries) and what is
//! handed to object_store's builders (endpoints, credentials, client settings), with secrets
//! kept out of every message.

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::http::HttpBuilder;
use object_store::{BackoffConfig, ClientConfigKey, ObjectStore, ObjectStoreScheme, RetryConfig};
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Ranged GETs (or part uploads) in flight at once, by default (and across all reads of one
/// backend). `cargo xtask bench --object` on loopback against s3s-fs: 16 and 32 in flight gave
/// the same throughput (the server's limit), with and without 20 ms per request; stores further
/// away or faster than one local process may reward more (set `concurrency`).
pub const DEFAULT_CONCURRENCY: usize = 16;
/// Bytes per ranged GET and per uploaded part, by default (S3's multipart minimum is 5 MiB;
/// object_store's whole-request timeout of 30 s leaves a part of this size > 0.3 MB/s).
pub const DEFAULT_PART_SIZE: usize = 8 << 20;
/// Bytes asked for by the first GET of a load (the header, in one request, for almost every
/// safetensors file: a 5,000-tensor header is about 600 KB).
pub const DEFAULT_PREFIX_BYTES: usize = 1 << 20;

/// Options of an [`ObjectStorage`](crate::ObjectStorage).
#[derive(Clone)]
pub struct ObjectOptions {
    /// object_store configuration keys and values (`endpoint`, `region`, `access_key_id`,
    /// `secret_access_key`, `session_token`, `allow_http`, `timeout`, `virtual_hosted_style_request`,
    /// ...; the builder of the URL's scheme must know each key). They win over the environment.
    pub config: Vec<(String, String)>,
    /// Requests in flight at once for one bulk read or write.
    pub concurrency: usize,
    /// Bytes per ranged GET and per uploaded part.
    pub part_size: usize,
    /// Bytes the opening GET asks for.
    pub prefix_bytes: usize,
    /// Bytes per second received by all reads of this backend together; `None`: no cap.
    pub max_bandwidth: Option<u64>,
    /// Times a part whose body ends early is fetched again (from its first missing byte), on
    /// top of object_store's own request retries.
    pub part_retries: u32,
    /// object_store's request retries (throttling, 5xx, timeouts, connection errors).
    pub max_retries: usize,
    /// object_store's limit on the time spent retrying one request.
    pub retry_timeout: Duration,
}

impl Default for ObjectOptions {
    fn default() -> Self {
        ObjectOptions {
            config: Vec::new(),
            concurrency: DEFAULT_CONCURRENCY,
            part_size: DEFAULT_PART_SIZE,
            prefix_bytes: DEFAULT_PREFIX_BYTES,
            max_bandwidth: None,
            part_retries: 3,
            max_retries: 6,
            retry_timeout: Duration::from_secs(60),
        }
    }
}

/// object_store's key (and its S3 spelling) for leaving out the system's root certificates.
const NO_SYSTEM_CERTIFICATES: [&str; 2] = ["disable_system_certificates", "aws_disable_system_certificates"];

/// turboio's own option keys (the rest go to object_store).
const OWN_KEYS: &[&str] =
    &["concurrency", "part_size", "prefix_bytes", "max_bandwidth", "part_retries", "max_retries", "retry_timeout"];

impl ObjectOptions {
    /// Options from `key = value` pairs: turboio's keys (`concurrency`, `part_size`,
    /// `prefix_bytes`, `max_bandwidth` in bytes per second, `part_retries`, `max_retries`,
    /// `retry_timeout` in seconds; sizes take `8MiB`-style suffixes) are parsed here, every
    /// other key is kept for object_store's builder. A bad value is an error naming the key.
    pub fn from_pairs<K: AsRef<str>, V: AsRef<str>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Result<ObjectOptions, String> {
        let mut o = ObjectOptions::default();
        for (k, v) in pairs {
            o.set(k.as_ref(), v.as_ref())?;
        }
        Ok(o)
    }

    /// Sets one option (see [`from_pairs`](Self::from_pairs)).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let key = key.trim().to_ascii_lowercase();
        let bad = |what: &str| format!("storage option {key}: {what}, not {value:?}");
        let positive = |v: u64| if v == 0 { Err(bad("must be at least 1")) } else { Ok(v) };
        match key.as_str() {
            "concurrency" => {
                self.concurrency = positive(value.parse().map_err(|_| bad("must be a whole number"))?)? as usize
            }
            "part_size" => {
                let v = positive(parse_size(value).map_err(|e| bad(&e))?)?;
                if v < 5 << 20 {
                    return Err(bad("must be at least 5 MiB (S3's smallest multipart part)"));
                }
                self.part_size = usize::try_from(v).map_err(|_| bad("is too large"))?;
            }
            "prefix_bytes" => {
                self.prefix_bytes =
                    usize::try_from(positive(parse_size(value).map_err(|e| bad(&e))?)?).map_err(|_| bad("too large"))?
            }
            "max_bandwidth" => {
                self.max_bandwidth = match value.trim() {
                    "" | "0" | "none" | "unlimited" => None,
                    v => Some(positive(parse_size(v).map_err(|e| bad(&e))?)?),
                }
            }
            "part_retries" => self.part_retries = value.parse().map_err(|_| bad("must be a whole number"))?,
            "max_retries" => self.max_retries = value.parse().map_err(|_| bad("must be a whole number"))?,
            "retry_timeout" => {
                let secs: f64 = value.trim_end_matches('s').parse().map_err(|_| bad("must be seconds"))?;
                if !(secs.is_finite() && secs >= 0.0) {
                    return Err(bad("must be seconds"));
                }
                self.retry_timeout = Duration::from_secs_f64(secs);
            }
            _ => {
                self.config.retain(|(k, _)| *k != key);
                self.config.push((key, value.to_owned()));
            }
        }
        Ok(())
    }

    /// The defaults, with `TURBOIO_OBJECT_CONCURRENCY`, `TURBOIO_OBJECT_PART_SIZE` and
    /// `TURBOIO_OBJECT_MAX_BANDWIDTH` applied (bad values are ignored with the defaults kept;
    /// explicit options report them).
    pub fn from_env_options() -> ObjectOptions {
        let mut o = ObjectOptions::default();
        for (var, key) in [
            ("TURBOIO_OBJECT_CONCURRENCY", "concurrency"),
            ("TURBOIO_OBJECT_PART_SIZE", "part_size"),
            ("TURBOIO_OBJECT_MAX_BANDWIDTH", "max_bandwidth"),
        ] {
            if let Ok(v) = std::env::var(var) {
                let _ = o.set(key, &v);
            }
        }
        o
    }

    fn retry(&self) -> RetryConfig {
        RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_secs(4),
                base: 2.0,
            },
            max_retries: self.max_retries,
            retry_timeout: self.retry_timeout,
        }
    }

    fn value(&self, keys: &[&str]) -> Option<String> {
        self.config.iter().rev().find(|(k, _)| keys.contains(&k.as_str())).map(|(_, v)| v.clone())
    }

    /// Builds the store for `url` (whose scheme `scheme` is), reading the environment first.
    pub(crate) fn build(
        &self,
        scheme: &ObjectStoreScheme,
        url: &url::Url,
        authority: &str,
    ) -> Result<Arc<dyn ObjectStore>, String> {
        crate::runtime::install_crypto_provider();
        let unknown = |store: &str, k: &str| {
            format!(
                "unknown storage option {k:?} for {store} (turboio's own: {}; the rest are object_store's \
                 configuration keys for {store})",
                OWN_KEYS.join(", ")
            )
        };
        let store: Arc<dyn ObjectStore> = match scheme {
            ObjectStoreScheme::AmazonS3 => {
                let mut b = AmazonS3Builder::from_env().with_url(url.as_str()).with_retry(self.retry());
                for (k, v) in &self.config {
                    let key: AmazonS3ConfigKey = k.parse().map_err(|_| unknown("S3", k))?;
                    b = b.with_config(key, v);
                }
                let endpoint = self
                    .value(&["endpoint", "endpoint_url", "aws_endpoint", "aws_endpoint_url", "aws_endpoint_url_s3"])
                    .or_else(|| std::env::var("AWS_ENDPOINT_URL_S3").ok())
                    .or_else(|| std::env::var("AWS_ENDPOINT_URL").ok())
                    .or_else(|| std::env::var("AWS_ENDPOINT").ok());
                let plain = endpoint.is_some_and(|e| e.starts_with("http://"));
                if plain && self.value(&["allow_http"]).is_none() {
                    b = b.with_config(AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp), "true");
                }
                // Every request of a plain-HTTP endpoint with static credentials goes to that
                // endpoint without TLS, so the system's root certificates (about 150 files, 10 ms
                // of a new process's first request here) are not loaded. Other credentials may
                // be fetched over HTTPS (STS), so they keep them.
                let static_keys = self.value(&["access_key_id", "aws_access_key_id"]).is_some()
                    || std::env::var_os("AWS_ACCESS_KEY_ID").is_some();
                if plain && static_keys && self.value(&NO_SYSTEM_CERTIFICATES).is_none() {
                    b = b.with_config(AmazonS3ConfigKey::Client(ClientConfigKey::NoSystemCertificates), "true");
                }
                Arc::new(b.build().map_err(|e| e.to_string())?)
            }
            ObjectStoreScheme::GoogleCloudStorage => {
                let mut b = GoogleCloudStorageBuilder::from_env().with_url(url.as_str()).with_retry(self.retry());
                for (k, v) in &self.config {
                    let key: GoogleConfigKey = k.parse().map_err(|_| unknown("GCS", k))?;
                    b = b.with_config(key, v);
                }
                Arc::new(b.build().map_err(|e| e.to_string())?)
            }
            ObjectStoreScheme::MicrosoftAzure => {
                let mut b = MicrosoftAzureBuilder::from_env().with_url(url.as_str()).with_retry(self.retry());
                for (k, v) in &self.config {
                    let key: AzureConfigKey = k.parse().map_err(|_| unknown("Azure", k))?;
                    b = b.with_config(key, v);
                }
                Arc::new(b.build().map_err(|e| e.to_string())?)
            }
            ObjectStoreScheme::Http => {
                let mut b = HttpBuilder::new().with_url(authority).with_retry(self.retry());
                if url.scheme() == "http" {
                    // One plain-HTTP server: no TLS, so no root certificates to load (see S3).
                    b = b.with_config(ClientConfigKey::AllowHttp, "true");
                    b = b.with_config(ClientConfigKey::NoSystemCertificates, "true");
                }
                for (k, v) in &self.config {
                    let key: ClientConfigKey = k.parse().map_err(|_| unknown("HTTP", k))?;
                    b = b.with_config(key, v);
                }
                Arc::new(b.build().map_err(|e| e.to_string())?)
            }
            other => return Err(format!("{other:?} URLs are not served by turboio's object-storage backend")),
        };
        Ok(store)
    }

    /// Every secret this configuration knows of: option values whose key names a secret, and
    /// the environment's.
    fn secrets(&self) -> Vec<String> {
        let mut out: Vec<String> =
            self.config.iter().filter(|(k, _)| is_secret_key(k)).map(|(_, v)| v.clone()).collect();
        out.extend(
            std::env::vars()
                .filter(|(k, _)| {
                    (k.starts_with("AWS_") || k.starts_with("GOOGLE_") || k.starts_with("AZURE_"))
                        && is_secret_key(&k.to_ascii_lowercase())
                })
                .map(|(_, v)| v),
        );
        out.retain(|s| s.len() >= 4);
        out.sort_by_key(|s| std::cmp::Reverse(s.len()));
        out
    }

    /// `text` without any secret value and without the query string of any URL in it
    /// (pre-signed URLs and SAS tokens carry credentials there).
    pub(crate) fn redact(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for s in self.secrets() {
            out = out.replace(&s, "***");
        }
        redact_queries(&out)
    }
}

/// True for configuration keys whose values are secrets.
fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    (key.contains("secret") || key.contains("token") || key.contains("password") || key.contains("sas"))
        || (key.contains("key") && !key.contains("key_id") && !key.contains("key_file") && !key.ends_with("_path"))
}

/// Every URL in `text` as [`turboio_storage::shown`] shows it: without user info
/// (`user:password@`) and without its query string (presigned URLs and SAS tokens carry
/// credentials there). object_store's own messages quote the URLs they requested.
fn redact_queries(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, word) in text.split(' ').enumerate() {
        if i > 0 {
            out.push(' ');
        }
        match word.find("://") {
            Some(at) => {
                let start =
                    word[..at].rfind(|c: char| !(c.is_ascii_alphanumeric() || "+-.".contains(c))).map_or(0, |p| p + 1);
                out.push_str(&word[..start]);
                out.push_str(&turboio_storage::shown(std::path::Path::new(&word[start..])).to_string());
            }
            None => out.push_str(word),
        }
    }
    out
}

impl fmt::Debug for ObjectOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let config: Vec<(String, String)> = self
            .config
            .iter()
            .map(|(k, v)| (k.clone(), if is_secret_key(k) { "***".to_owned() } else { redact_queries(v) }))
            .collect();
        f.debug_struct("ObjectOptions")
            .field("config", &config)
            .field("concurrency", &self.concurrency)
            .field("part_size", &self.part_size)
            .field("prefix_bytes", &self.prefix_bytes)
            .field("max_bandwidth", &self.max_bandwidth)
            .field("part_retries", &self.part_retries)
            .field("max_retries", &self.max_retries)
            .field("retry_timeout", &self.retry_timeout)
            .finish()
    }
}

/// A size: bytes, or with a `K`/`M`/`G` (powers of 1000) or `KiB`/`MiB`/`GiB` suffix.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| "must be a size such as 8388608, 8MiB or 100MB".to_owned())?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "k" | "kb" => 1000,
        "m" | "mb" => 1000 * 1000,
        "g" | "gb" => 1000 * 1000 * 1000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        _ => return Err("must be a size such as 8388608, 8MiB or 100MB".into()),
    };
    let v = n * mult as f64;
    if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
        return Err("is out of range".into());
    }
    Ok(v as u64)
}

/// A hash of the environment variables the stores are configured from: a store built under
/// other credentials is not reused.
pub(crate) fn environment_fingerprint() -> u64 {
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("AWS_") || k.starts_with("GOOGLE_") || k.starts_with("AZURE_"))
        .collect();
    vars.sort();
    let mut h = DefaultHasher::new();
    vars.hash(&mut h);
    h.finish()
}

/// Paces received bytes to at most `rate` per second (shared by all reads of one backend).
pub(crate) struct Limiter {
    rate: Option<u64>,
    next: Mutex<Option<Instant>>,
}

impl Limiter {
    pub(crate) fn new(rate: Option<u64>) -> Limiter {
        Limiter { rate, next: Mutex::new(None) }
    }

    /// How long to wait before handing on `n` more bytes.
    pub(crate) fn reserve(&self, n: usize) -> Option<Duration> {
        let rate = self.rate?;
        let now = Instant::now();
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        let start = match *next {
            Some(t) if t > now => t,
            _ => now,
        };
        *next = Some(start + Duration::from_secs_f64(n as f64 / rate as f64));
        (start > now).then(|| start - now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_keys_are_parsed_and_the_rest_kept() {
        let o = ObjectOptions::from_pairs([
            ("concurrency", "32"),
            ("part_size", "16MiB"),
            ("max_bandwidth", "100MB"),
            ("endpoint", "http://127.0.0.1:9000"),
            ("Region", "eu-west-1"),
        ])
        .unwrap();
        assert_eq!(o.concurrency, 32);
        assert_eq!(o.part_size, 16 << 20);
        assert_eq!(o.max_bandwidth, Some(100_000_000));
        assert_eq!(o.value(&["endpoint"]).as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(o.value(&["region"]).as_deref(), Some("eu-west-1"));
        for (k, v, want) in [
            ("concurrency", "0", "at least 1"),
            ("concurrency", "many", "whole number"),
            ("part_size", "1MiB", "at least 5 MiB"),
            ("part_size", "big", "size"),
            ("retry_timeout", "-3", "seconds"),
        ] {
            let e = ObjectOptions::from_pairs([(k, v)]).unwrap_err();
            assert!(e.contains(k) && e.contains(want), "{e}");
        }
    }

    #[test]
    fn secrets_never_reach_debug_or_messages() {
        let o = ObjectOptions::from_pairs([
            ("access_key_id", "AKIAEXAMPLE"),
            ("secret_access_key", "wJalrXUtnFEMI/K7MDENG"),
            ("session_token", "FwoGZXIvYXdzEJr"),
        ])
        .unwrap();
        let dbg = format!("{o:?}");
        assert!(!dbg.contains("wJalrXUtnFEMI") && !dbg.contains("FwoGZXIvYXdzEJr"), "{dbg}");
        assert!(dbg.contains("AKIAEXAMPLE"), "the key id is not a secret: {dbg}");
        let msg = o.redact(
            "GET https://b.s3.amazonaws.com/k?X-Amz-Signature=abc&X-Amz-Credential=x failed with wJalrXUtnFEMI/K7MDENG",
        );
        assert_eq!(msg, "GET https://b.s3.amazonaws.com/k?<redacted> failed with ***");
        let msg = o.redact("Error performing GET http://alice:hunter2@127.0.0.1:9/m (\"http://u:p@h/x?q=1\")");
        assert_eq!(msg, "Error performing GET http://***@127.0.0.1:9/m (\"http://***@h/x?<redacted>");
    }

    #[test]
    fn the_limiter_paces_bytes() {
        let l = Limiter::new(Some(1_000_000));
        assert!(l.reserve(500_000).is_none());
        let w = l.reserve(500_000).unwrap();
        assert!(w > Duration::from_millis(400) && w <= Duration::from_millis(500), "{w:?}");
        assert!(Limiter::new(None).reserve(1 << 30).is_none());
    }
}
