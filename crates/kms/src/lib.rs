//! Key sources for encrypted checkpoints: Volcano Engine KMS, the datapipe unix socket, and
//! the environment, tried in veTurboIO's order.
//!
//! The cipher itself and the file formats live in `turboio-cipher`; this crate only finds the
//! [`Key`](turboio_cipher::Key) and [`Iv`](turboio_cipher::Iv) for a file. The entry point is
//! [`KeyResolver`]:
//!
//! ```no_run
//! # fn main() -> Result<(), turboio_kms::KeyError> {
//! use std::path::Path;
//! let resolver = turboio_kms::KeyResolver::from_env();
//! // A headerless encrypted file: datapipe, then VETURBOIO_KEY / VETURBOIO_IV.
//! let km = resolver.key_for_read(Path::new("/models/m.safetensors"), None)?;
//! println!("key from {}", km.source);
//! # Ok(()) }
//! ```
//!
//! # Sources, in order
//!
//! When **reading** ([`KeyResolver::key_for_read`]):
//!
//! 1. **Header + KMS**, only for files with veTurboIO's 256 KiB header: KMS `Decrypt` of the
//!    header's `meta_data_key` gives the base64 text of the data key, which is decoded once
//!    more (veTurboIO wraps `base64(key)`, not the key); the IV is the header's. The KMS
//!    client is built like veTurboIO's `fetch_kms_client`: settings from `VETURBOIO_KMS_*`;
//!    if the datapipe socket exists and answers `ping`, requests are proxied through it and
//!    its `kms-sts` credentials replace the environment's (if `kms-sts` fails the environment
//!    credentials are kept, and the proxy too).
//! 2. **Datapipe** (`encrypt-key`): key and IV for the file's absolute path.
//! 3. **Environment**: `VETURBOIO_KEY` (16 or 32 bytes) and `VETURBOIO_IV` (16 bytes), strict
//!    standard base64.
//!
//! If a header file's KMS step fails, the key and IV come from 2 or 3 (the caller still skips
//! the header), exactly as veTurboIO does. When every source fails the error,
//! [`KeyError::NoKey`], lists each source tried and why, in order, e.g. `no key for
//! /m.safetensors: header+KMS: KMS Decrypt at https://open.volcengineapi.com failed: HTTP 403:
//! AccessDenied: ... ; datapipe: datapipe socket /finetuned-model/datapipe.sock does not
//! exist; environment: VETURBOIO_KEY is not set`. veTurboIO raises a bare `fail to get cipher
//! info in all cases` there.
//!
//! When **writing** a headerless file ([`KeyResolver::key_for_write`]): datapipe, then
//! environment. For a header file ([`KeyResolver::new_header_key`]): a fresh random 16-byte
//! key and IV (`CTR-128`, as veTurboIO writers), KMS `Encrypt(base64(key))`, and the
//! [`CipherHeader`](turboio_cipher::CipherHeader) to write.
//!
//! # Environment variables
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `VETURBOIO_KMS_HOST` | `open.volcengineapi.com` | OpenAPI host; requests go to `https://{host}/` |
//! | `VETURBOIO_KMS_REGION` | `cn-beijing` | region in the signature scope |
//! | `VETURBOIO_KMS_ACCESS_KEY`, `VETURBOIO_KMS_SECRET_KEY` | — | credentials (required for KMS unless datapipe `kms-sts` gives them) |
//! | `VETURBOIO_KMS_SESSION_TOKEN` | — | STS token, sent as `X-Security-Token` |
//! | `VETURBOIO_KMS_KEYRING_NAME`, `VETURBOIO_KMS_KEY_NAME` | — | the KMS key (required for KMS) |
//! | `VETURBOIO_KMS_ENDPOINT` | — | **turboio extension**: a full `http(s)://host[:port]` replacing `https://{host}/` (local gateways, tests) |
//! | `VETURBOIO_KMS_ALLOW_HTTP` | `0` | **turboio extension**: `1` allows a plain `http://` endpoint on a host other than the loopback (refused otherwise: signed requests and data keys would travel unencrypted) |
//! | `DATAPIPE_SOCKET_PATH` | `/finetuned-model/datapipe.sock` | the datapipe socket |
//! | `POD_NAME` | empty | sent as `X-Encrypt-Caller-Pod` |
//! | `VETURBOIO_KEY`, `VETURBOIO_IV` | — | the environment source |
//!
//! Unset and empty mean the same. [`KeyResolver::from_env`] reads them once; tests and
//! embedders use [`KeyResolver::from_vars`] and the `with_*` setters instead.
//!
//! # KMS requests and signing
//!
//! `POST https://{host}/?Action={Decrypt|Encrypt}&KeyName=..&KeyringName=..&Version=2021-02-18`
//! (query sorted and not URL-encoded, keyring and key names restricted to URL-unreserved
//! characters so that this is safe), body `{"CiphertextBlob": "<blob>"}` or
//! `{"Plaintext": "<base64>"}` with Python `json.dumps` spacing, headers `X-Date`,
//! `Authorization`, `X-Content-Sha256`, `Content-Type: application/json` and, with a session
//! token, `X-Security-Token`. The signature is Volcano Engine's `HMAC-SHA256` as veTurboIO
//! computes it (see [`sign`]): a canonical request over the method, `/`, the query, the signed
//! headers `content-type;host;x-content-sha256;x-date` and the body hash; a string to sign
//! over `X-Date`, the scope `{date}/{region}/kms/request` and the canonical request's hash;
//! a key derived from the raw secret through date, region, service and `"request"`. veTurboIO
//! also sends a constant, unsigned `X-Amz-Date: 20180614T114308Z`; turboio does not.
//!
//! Through the datapipe proxy the same signed request goes as plain HTTP over the socket
//! (`POST /?{query}`, `Host: localhost`, `X-Datapipe-Task-Type: top`); the signature still
//! covers the KMS host, which the sidecar forwards to.
//!
//! HTTPS uses reqwest (blocking) over rustls with the **ring** provider and the platform
//! certificate verifier; no OpenSSL, no cmake. reqwest's default provider, aws-lc-rs, also
//! builds here without cmake, but a clean debug build of reqwest took about twice as long with
//! it (58–131 s against 28–63 s for ring, in alternating runs on the shared 2-core build
//! machine), for no benefit at a few KMS calls per checkpoint. The ring provider is passed to
//! reqwest in a preconfigured rustls `ClientConfig`, so no process-wide default provider is
//! installed.
//!
//! # Timeouts and retries
//!
//! | | default | retried on | not retried |
//! |---|---|---|---|
//! | KMS ([`KmsConfig`]) | connect 5 s, whole request 30 s; 4 retries, backoff 200 ms doubling (≤ 3 s of waiting) | connection errors, timeouts, HTTP 5xx and 429 | other 4xx (bad credentials, signature, blob) |
//! | datapipe ([`DatapipeConfig`]) | 30 s per request (one deadline over connect, send and the whole response); 4 retries, backoff 500 ms doubling (≤ 7.5 s) | connection errors, timeouts, malformed answers, HTTP 5xx and 429 | other 4xx; a missing socket file (datapipe is simply not there) |
//!
//! veTurboIO retries datapipe up to 61 times 2 s apart (about 2 minutes) to wait for a
//! sidecar that is still starting, and KMS 4 times 0.5 s apart; raise
//! [`RetryPolicy::retries`] to get the former. One resolution pings the datapipe at most once,
//! so a dead sidecar costs its retry budget once.
//!
//! # Security
//!
//! - Key bytes, secret access keys and session tokens never appear in an error, a `Debug`
//!   output or a log (this crate does not log): [`Key`](turboio_cipher::Key),
//!   [`KeyMaterial`], [`Secret`], [`KmsConfig`], [`StsCredentials`] and [`KeyResolver`] redact
//!   them, error bodies quoted from a peer are scrubbed of the request's secrets, and answers
//!   that carry key material (KMS `Decrypt`, datapipe `encrypt-key`) are never quoted.
//! - Buffers that hold key material in this crate (decoded keys, response bodies, the encrypt
//!   request body, signing keys) are zeroized on drop; copies inside reqwest, hyper and
//!   serde_json are not.
//! - Answers that carry secrets (KMS `Result.Plaintext`, datapipe `Key`/`IV`, STS secret keys
//!   and tokens) are parsed straight into zeroizing strings by typed serde structs, never into a
//!   `serde_json::Value`; bodies are read into one buffer sized up front from `Content-Length`
//!   (grown, when there is none, by copying into a fresh buffer, so no unwiped allocation is
//!   freed); the KMS `Encrypt` body (the base64 key) is built once in a buffer of its exact size
//!   and handed to reqwest without a copy (`Bytes::from_owner`), zeroized when reqwest drops
//!   it. What remains outside our reach: hyper's own write and read buffers, and serde_json's
//!   scratch buffer for strings with escapes (base64 has none).
//! - Header values are checked (CR/LF/NUL are refused before anything is sent); responses
//!   are size-capped (4 MiB) and parsed without panics.
//!
//! # One HTTP client, cancellable
//!
//! Every request, to KMS over HTTPS and to the datapipe over its unix socket (`ping`,
//! `encrypt-key`, `kms-sts`, `sfcs-sts`, the `top` proxy), goes through reqwest's blocking
//! client (`ClientBuilder::unix_socket` for the socket). With a cancel flag
//! ([`KeyResolver::with_cancel`], [`DatapipeClient::with_cancel`], [`KmsClient::with_cancel`])
//! the flag is checked before every attempt, backoff waits wake within 20 ms of it being set,
//! and a request in flight runs on a helper thread that the caller stops waiting for (it ends
//! by itself within its timeout, owning everything it touches), so a cancelled look-up returns
//! at once even against a socket that never answers.
//! - `#![forbid(unsafe_code)]`.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod config;
mod datapipe;
mod error;
mod http;
mod kms;
mod resolver;
pub mod sign;

pub use config::{RetryPolicy, Secret};
pub use datapipe::{DatapipeClient, DatapipeConfig, SfcsSts, StsCredentials, DEFAULT_SOCKET_PATH};
pub use error::{Attempt, KeyError, KeySource};
pub use kms::{KmsClient, KmsConfig, API_VERSION, DEFAULT_HOST, DEFAULT_REGION, SERVICE};
pub use resolver::{KeyMaterial, KeyResolver};
pub use zeroize::Zeroizing;
