//! Volcano Engine OpenAPI request signing ("HMAC-SHA256"), exactly as veTurboIO does it.
//!
//! Pure functions, no I/O. The algorithm (veTurboIO `KmsService.sigv4`, Volcano Engine docs
//! 6766/127937):
//!
//! 1. `X-Date` = the UTC time as `YYYYMMDDTHHMMSSZ`; the date stamp is its first 8 characters.
//! 2. `payload_hash` = hex SHA-256 of the exact body bytes sent.
//! 3. Canonical headers: `content-type:application/json\nhost:{host}\nx-content-sha256:{hash}\n`
//!    `x-date:{X-Date}\n`; signed headers `content-type;host;x-content-sha256;x-date`.
//! 4. Canonical request: `{METHOD}\n/\n{query}\n{canonical headers}\n{signed headers}\n{hash}`,
//!    where the query is the parameters sorted by name and joined as `k=v&k=v` **without URL
//!    encoding** (veTurboIO's quirk; the values it sends never need encoding).
//! 5. Scope `{date}/{region}/{service}/request`; string to sign
//!    `HMAC-SHA256\n{X-Date}\n{scope}\n{hex sha256(canonical request)}`.
//! 6. Signing key: `kDate = HMAC(secret key as raw UTF-8, date)`, `kRegion = HMAC(kDate,
//!    region)`, `kService = HMAC(kRegion, service)`, `kSigning = HMAC(kService, "request")`.
//! 7. `Authorization: HMAC-SHA256 Credential={AK}/{scope}, SignedHeaders={signed headers},
//!    Signature={hex HMAC(kSigning, string to sign)}`.
//!
//! `X-Security-Token` (an STS session token) is sent but not signed, as veTurboIO does.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

/// The algorithm name in the string to sign and the `Authorization` header.
pub const ALGORITHM: &str = "HMAC-SHA256";

/// The headers covered by the signature, in canonical order.
pub const SIGNED_HEADERS: &str = "content-type;host;x-content-sha256;x-date";

/// The `Content-Type` every signed request carries (and signs).
pub const CONTENT_TYPE: &str = "application/json";

/// A request timestamp, as `X-Date` spells it: `YYYYMMDDTHHMMSSZ` (UTC).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XDate(String);

impl XDate {
    /// The current time.
    pub fn now() -> XDate {
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        XDate::from_unix_seconds(secs)
    }

    /// The timestamp for `secs` seconds after 1970-01-01T00:00:00Z.
    pub fn from_unix_seconds(secs: u64) -> XDate {
        let days = secs / 86_400;
        let rem = secs % 86_400;
        let (y, m, d) = civil_from_days(days);
        XDate(format!("{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60))
    }

    /// Parses `YYYYMMDDTHHMMSSZ` (digits in the right places, `T` and `Z`); `None` otherwise.
    pub fn parse(text: &str) -> Option<XDate> {
        let b = text.as_bytes();
        let ok = b.len() == 16
            && b[8] == b'T'
            && b[15] == b'Z'
            && b[..8].iter().all(u8::is_ascii_digit)
            && b[9..15].iter().all(u8::is_ascii_digit);
        ok.then(|| XDate(text.to_string()))
    }

    /// The full `X-Date` text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The `YYYYMMDD` date stamp used in the scope and the key derivation.
    pub fn date_stamp(&self) -> &str {
        &self.0[..8]
    }
}

impl fmt::Display for XDate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    // Shift the epoch to 0000-03-01 so leap days fall at the end of a 400-year era.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097; // day of era, [0, 146096]
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of year from March 1, [0, 365]
    let mp = (5 * doy + 2) / 153; // month from March, [0, 11]
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

/// Everything that goes into one signature.
#[derive(Clone, Copy)]
pub struct SignRequest<'a> {
    /// HTTP method, upper case (`POST`).
    pub method: &'a str,
    /// The `Host` header value the server will see (`open.volcengineapi.com`, or
    /// `127.0.0.1:8080` with a non-default port).
    pub host: &'a str,
    /// Query parameters in any order; they are sorted by name (then value) and joined
    /// unencoded.
    pub query: &'a [(&'a str, &'a str)],
    /// The exact body bytes that will be sent.
    pub body: &'a [u8],
    /// The request time.
    pub date: &'a XDate,
    /// Region, e.g. `cn-beijing`.
    pub region: &'a str,
    /// Service, e.g. `kms`.
    pub service: &'a str,
    /// Access key id.
    pub access_key: &'a str,
    /// Secret access key (raw, no prefix).
    pub secret_key: &'a str,
}

impl fmt::Debug for SignRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SignRequest")
            .field("method", &self.method)
            .field("host", &self.host)
            .field("query", &self.query)
            .field("body_len", &self.body.len())
            .field("date", &self.date)
            .field("region", &self.region)
            .field("service", &self.service)
            .field("access_key", &self.access_key)
            .field("secret_key", &"<redacted>")
            .finish()
    }
}

/// The headers a signed request must carry (besides `Host`, which comes from the URL).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedHeaders {
    /// `X-Date`.
    pub x_date: String,
    /// `X-Content-Sha256`: hex SHA-256 of the body.
    pub x_content_sha256: String,
    /// `Content-Type` (always `application/json`).
    pub content_type: &'static str,
    /// `Authorization`.
    pub authorization: String,
    /// The hex signature alone (also inside `authorization`).
    pub signature: String,
}

impl SignedHeaders {
    /// The headers as (name, value) pairs, in the order veTurboIO sends them.
    pub fn to_vec(&self) -> Vec<(&'static str, String)> {
        vec![
            ("X-Date", self.x_date.clone()),
            ("Authorization", self.authorization.clone()),
            ("X-Content-Sha256", self.x_content_sha256.clone()),
            ("Content-Type", self.content_type.to_string()),
        ]
    }
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    s
}

/// Hex SHA-256.
pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

fn hmac_sha256(key: &[u8], data: &[u8]) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC-SHA256 accepts keys of any length");
    mac.update(data);
    mac.finalize().into_bytes().into()
}

/// The query string as veTurboIO builds it: sorted by name (then value), `k=v` joined with
/// `&`, nothing encoded. The same text goes into the URL and the canonical request.
pub fn canonical_query(query: &[(&str, &str)]) -> String {
    let mut q: Vec<_> = query.to_vec();
    q.sort();
    q.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&")
}

/// The canonical request text (step 4).
pub fn canonical_request(req: &SignRequest<'_>) -> String {
    let payload_hash = sha256_hex(req.body);
    format!(
        "{method}\n/\n{query}\ncontent-type:{CONTENT_TYPE}\nhost:{host}\nx-content-sha256:{payload_hash}\nx-date:{date}\n\n{SIGNED_HEADERS}\n{payload_hash}",
        method = req.method,
        query = canonical_query(req.query),
        host = req.host,
        date = req.date.as_str(),
    )
}

/// The credential scope `{date}/{region}/{service}/request`.
pub fn credential_scope(date: &XDate, region: &str, service: &str) -> String {
    format!("{}/{region}/{service}/request", date.date_stamp())
}

/// The string to sign (step 5).
pub fn string_to_sign(req: &SignRequest<'_>) -> String {
    format!(
        "{ALGORITHM}\n{}\n{}\n{}",
        req.date.as_str(),
        credential_scope(req.date, req.region, req.service),
        sha256_hex(canonical_request(req).as_bytes())
    )
}

/// The derived signing key (step 6). Secret: it signs any request of that day, region and
/// service; it is zeroized when dropped.
pub fn signing_key(secret_key: &str, date: &XDate, region: &str, service: &str) -> Zeroizing<[u8; 32]> {
    let k_date = Zeroizing::new(hmac_sha256(secret_key.as_bytes(), date.date_stamp().as_bytes()));
    let k_region = Zeroizing::new(hmac_sha256(&*k_date, region.as_bytes()));
    let k_service = Zeroizing::new(hmac_sha256(&*k_region, service.as_bytes()));
    Zeroizing::new(hmac_sha256(&*k_service, b"request"))
}

/// Signs a request: the headers to send with it.
pub fn sign(req: &SignRequest<'_>) -> SignedHeaders {
    let key = signing_key(req.secret_key, req.date, req.region, req.service);
    let signature = hex(&hmac_sha256(&*key, string_to_sign(req).as_bytes()));
    let authorization = format!(
        "{ALGORITHM} Credential={}/{}, SignedHeaders={SIGNED_HEADERS}, Signature={signature}",
        req.access_key,
        credential_scope(req.date, req.region, req.service),
    );
    SignedHeaders {
        x_date: req.date.as_str().to_string(),
        x_content_sha256: sha256_hex(req.body),
        content_type: CONTENT_TYPE,
        authorization,
        signature,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DECRYPT_QUERY: &[(&str, &str)] = &[
        ("Version", "2021-02-18"),
        ("Action", "Decrypt"),
        ("KeyringName", "datapipe_keyring"),
        ("KeyName", "datapipe_key_ml_maas"),
    ];

    fn vector1(date: &XDate) -> SignRequest<'_> {
        SignRequest {
            method: "POST",
            host: "open.volcengineapi.com",
            query: DECRYPT_QUERY,
            body: br#"{"CiphertextBlob": "Y2lwaGVydGV4dA=="}"#,
            date,
            region: "cn-beijing",
            service: "kms",
            access_key: "AKLTexampleAK",
            secret_key: "exampleSecretKey==",
        }
    }

    /// veturboio.md §3.3, computed independently with the reference algorithm.
    #[test]
    fn veturboio_vector() {
        let date = XDate::parse("20240102T030405Z").unwrap();
        let req = vector1(&date);
        assert_eq!(sha256_hex(req.body), "82335a70b046e7489353a32039266d420e2407c71dd84aaf13513aff7e37e5e0");
        assert_eq!(
            canonical_query(req.query),
            "Action=Decrypt&KeyName=datapipe_key_ml_maas&KeyringName=datapipe_keyring&Version=2021-02-18"
        );
        assert_eq!(
            sha256_hex(canonical_request(&req).as_bytes()),
            "08a64a8010b91005925d4a18ab03c02a1e05106d187b5e97c2d535f5d06ede09"
        );
        assert_eq!(
            hex(&*signing_key(req.secret_key, &date, "cn-beijing", "kms")),
            "bc23c8c47394288ca20ed373e5a4b6d04e894d02d1ffa2bd1d4ce05237dc2fc8"
        );
        let h = sign(&req);
        assert_eq!(h.signature, "8ca1b88e7df0c5fe3fc4267c5f1c9b668ec81a2e54fc403ebe06c156043242ec");
        assert_eq!(
            h.authorization,
            "HMAC-SHA256 Credential=AKLTexampleAK/20240102/cn-beijing/kms/request, \
             SignedHeaders=content-type;host;x-content-sha256;x-date, \
             Signature=8ca1b88e7df0c5fe3fc4267c5f1c9b668ec81a2e54fc403ebe06c156043242ec"
        );
        assert_eq!(h.x_date, "20240102T030405Z");
        assert_eq!(h.x_content_sha256, "82335a70b046e7489353a32039266d420e2407c71dd84aaf13513aff7e37e5e0");
        assert_eq!(h.content_type, "application/json");
    }

    /// ecosystem.md §6.2, cross-checked there against a second implementation.
    #[test]
    fn ecosystem_vector() {
        let date = XDate::parse("20240708T073658Z").unwrap();
        let req = SignRequest {
            method: "POST",
            host: "open.volcengineapi.com",
            query: &[("Action", "Decrypt"), ("KeyName", "key1"), ("KeyringName", "ring1"), ("Version", "2021-02-18")],
            body: br#"{"CiphertextBlob": "AAAA"}"#,
            date: &date,
            region: "cn-beijing",
            service: "kms",
            access_key: "AKTESTEXAMPLE",
            secret_key: "SKTESTEXAMPLE",
        };
        assert_eq!(sign(&req).signature, "b4b76b747165e3840a94dce47294fed24e46ab674575385c92105b157d5b6148");
    }

    #[test]
    fn every_input_changes_the_signature() {
        let date = XDate::parse("20240102T030405Z").unwrap();
        let base = vector1(&date);
        let reference = sign(&base).signature;
        let other_date = XDate::parse("20240102T030406Z").unwrap();
        let other_day = XDate::parse("20240103T030405Z").unwrap();
        let query2: &[(&str, &str)] = &[
            ("Version", "2021-02-18"),
            ("Action", "Encrypt"),
            ("KeyringName", "datapipe_keyring"),
            ("KeyName", "datapipe_key_ml_maas"),
        ];
        let variants: Vec<(&str, SignRequest<'_>)> = vec![
            ("method", SignRequest { method: "GET", ..base }),
            ("host", SignRequest { host: "kms.cn-beijing.volcengineapi.com", ..base }),
            ("query", SignRequest { query: query2, ..base }),
            ("body", SignRequest { body: br#"{"CiphertextBlob": "Y2lwaGVydGV4dB=="}"#, ..base }),
            ("time", SignRequest { date: &other_date, ..base }),
            ("day", SignRequest { date: &other_day, ..base }),
            ("region", SignRequest { region: "cn-shanghai", ..base }),
            ("service", SignRequest { service: "kmt", ..base }),
            ("secret key", SignRequest { secret_key: "exampleSecretKey=!", ..base }),
        ];
        for (what, req) in &variants {
            assert_ne!(sign(req).signature, reference, "changing the {what}");
        }
        // The access key is not part of the signature, but it is part of the Authorization.
        let ak = SignRequest { access_key: "AKLTother", ..base };
        assert_eq!(sign(&ak).signature, reference);
        assert_ne!(sign(&ak).authorization, sign(&base).authorization);
        // Query order does not matter: it is sorted.
        let mut reversed: Vec<_> = DECRYPT_QUERY.to_vec();
        reversed.reverse();
        let rev = SignRequest { query: &reversed, ..base };
        assert_eq!(sign(&rev).signature, reference);
    }

    #[test]
    fn x_date_formatting() {
        assert_eq!(XDate::from_unix_seconds(0).as_str(), "19700101T000000Z");
        // 2024-01-02T03:04:05Z
        assert_eq!(XDate::from_unix_seconds(1_704_164_645).as_str(), "20240102T030405Z");
        // Leap day 2024-02-29T23:59:59Z and the following second.
        assert_eq!(XDate::from_unix_seconds(1_709_251_199).as_str(), "20240229T235959Z");
        assert_eq!(XDate::from_unix_seconds(1_709_251_200).as_str(), "20240301T000000Z");
        // 2000-02-29 (a 400-year leap day) and 2100-03-01 (2100 is not a leap year).
        assert_eq!(XDate::from_unix_seconds(951_782_400).as_str(), "20000229T000000Z");
        assert_eq!(XDate::from_unix_seconds(4_107_542_400).as_str(), "21000301T000000Z");
        assert_eq!(XDate::now().as_str().len(), 16);
        assert!(XDate::parse("20240102T030405").is_none());
        assert!(XDate::parse("2024010xT030405Z").is_none());
        assert!(XDate::parse("20240102 030405Z").is_none());
    }

    #[test]
    fn debug_redacts_the_secret() {
        let date = XDate::parse("20240102T030405Z").unwrap();
        let req = vector1(&date);
        let dbg = format!("{req:?}");
        assert!(!dbg.contains("exampleSecretKey"), "{dbg}");
        assert!(dbg.contains("AKLTexampleAK"));
    }
}
