//! Integration tests: the KMS client against a signature-checking mock KMS, the datapipe client
//! against a mock sidecar on a real unix socket, and the whole key-source chain.
//!
//! No test touches the process environment: resolvers are built with `from_vars` and setters.

mod support;

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use support::*;
use turboio_cipher::{CipherHeader, Iv, Mode};
use turboio_kms::{
    DatapipeClient, DatapipeConfig, KeyError, KeyResolver, KeySource, KmsClient, KmsConfig, RetryPolicy, Secret,
};

const AK: &str = "AKLTtestaccesskey";
const SK: &str = "SK-very-secret-0123456789";
const STS_AK: &str = "AKSTStemporary";
const STS_SK: &str = "STS-secret-key-abcdef";
const STS_TOKEN: &str = "STS-session-token-XYZ987";
const RAW_KEY: &[u8; 16] = b"abcdefgh12345678";
const RAW_IV: &[u8; 16] = b"1234567887654321";

fn fast() -> RetryPolicy {
    RetryPolicy::new(0, Duration::from_millis(1))
}

fn kms_config(kms: &MockKms, sk: &str) -> KmsConfig {
    KmsConfig {
        endpoint: Some(kms.endpoint()),
        access_key: Some(AK.into()),
        secret_key: Some(Secret::new(sk)),
        keyring_name: Some(KEYRING.into()),
        key_name: Some(KEY_NAME.into()),
        connect_timeout: Duration::from_secs(5),
        timeout: Duration::from_secs(10),
        retry: fast(),
        ..KmsConfig::default()
    }
}

fn mock_kms() -> MockKms {
    let kms = MockKms::start();
    kms.add_credentials(AK, SK, None);
    kms.add_credentials(STS_AK, STS_SK, Some(STS_TOKEN));
    kms
}

fn dp_config(path: &Path) -> DatapipeConfig {
    DatapipeConfig {
        socket_path: path.to_path_buf(),
        pod_name: "trainer-pod-7".into(),
        timeout: Duration::from_secs(10),
        retry: fast(),
    }
}

/// A resolver with nothing configured but what the test sets.
fn resolver(kms: Option<&MockKms>, socket: &Path) -> KeyResolver {
    let r = KeyResolver::from_vars(|_| None).with_datapipe_config(dp_config(socket));
    match kms {
        Some(k) => r.with_kms_config(kms_config(k, SK)),
        None => r,
    }
}

fn header(blob: String) -> CipherHeader {
    CipherHeader { mode: Mode::Ctr128, iv: Iv(*RAW_IV), meta_data_key: blob, file_timestamp: 1_700_000_000 }
}

// ---------------------------------------------------------------------------------------------
// KMS client

#[test]
fn kms_encrypt_decrypt_round_trip_with_signed_requests() {
    let kms = mock_kms();
    let client = KmsClient::new(kms_config(&kms, SK)).unwrap();
    let blob = client.encrypt(b"hello data key").unwrap();
    assert_eq!(blob, mock_blob(b"hello data key"));
    assert_eq!(&client.decrypt(&blob).unwrap()[..], b"hello data key");

    let reqs = kms.requests();
    assert_eq!(reqs.len(), 2);
    let enc = &reqs[0];
    assert_eq!(enc.method, "POST");
    assert_eq!(enc.target, format!("/?Action=Encrypt&KeyName={KEY_NAME}&KeyringName={KEYRING}&Version=2021-02-18"));
    assert_eq!(String::from_utf8_lossy(&enc.body), format!("{{\"Plaintext\": \"{}\"}}", b64(b"hello data key")));
    for name in ["x-date", "authorization", "x-content-sha256", "content-type", "host"] {
        assert!(enc.header(name).is_some(), "missing {name}");
    }
    assert_eq!(enc.header("content-type"), Some("application/json"));
    assert_eq!(enc.header("host"), Some(kms.addr.to_string().as_str()));
    assert!(enc.header("x-security-token").is_none());
    assert!(enc.header("authorization").unwrap().starts_with(&format!("HMAC-SHA256 Credential={AK}/")));
    let dec = &reqs[1];
    assert!(dec.target.starts_with("/?Action=Decrypt&"));
    assert_eq!(String::from_utf8_lossy(&dec.body), format!("{{\"CiphertextBlob\": \"{blob}\"}}"));
}

#[test]
fn kms_data_key_wrapping_is_base64_of_the_key() {
    let kms = mock_kms();
    let client = KmsClient::new(kms_config(&kms, SK)).unwrap();
    let key = turboio_cipher::Key::new(RAW_KEY).unwrap();
    let blob = client.encrypt_data_key(&key).unwrap();
    // What veTurboIO stores: the KMS ciphertext of base64(key).
    assert_eq!(blob, header_blob(RAW_KEY));
    let back = client.decrypt_data_key(&blob).unwrap();
    assert_eq!(back.expose(), RAW_KEY);
}

#[test]
fn kms_wrong_secret_key_is_rejected_and_not_retried() {
    let kms = mock_kms();
    let mut cfg = kms_config(&kms, "SK-wrong-secret-key-000");
    cfg.retry = RetryPolicy::new(3, Duration::from_millis(1));
    let client = KmsClient::new(cfg).unwrap();
    let err = client.decrypt(&mock_blob(b"x")).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, KeyError::Kms { status: Some(401), action: "Decrypt", .. }), "{err:?}");
    assert!(msg.contains("SignatureDoesNotMatch"), "{msg}");
    assert!(msg.contains("credentials or signature"), "{msg}");
    assert!(msg.contains(&kms.addr.to_string()), "{msg}");
    assert!(!msg.contains("SK-wrong-secret-key-000"), "{msg}");
    assert!(!format!("{err:?}").contains("SK-wrong-secret-key-000"));
    assert_eq!(kms.requests().len(), 1, "4xx must not be retried");
}

#[test]
fn kms_session_token_is_sent() {
    let kms = mock_kms();
    let cfg = KmsConfig {
        access_key: Some(STS_AK.into()),
        secret_key: Some(Secret::new(STS_SK)),
        session_token: Some(Secret::new(STS_TOKEN)),
        ..kms_config(&kms, SK)
    };
    let client = KmsClient::new(cfg.clone()).unwrap();
    client.encrypt(b"k").unwrap();
    assert_eq!(kms.requests()[0].header("x-security-token"), Some(STS_TOKEN));

    // Without the token the mock refuses, and the error does not leak the secret.
    let client = KmsClient::new(KmsConfig { session_token: None, ..cfg }).unwrap();
    let err = client.encrypt(b"k").unwrap_err().to_string();
    assert!(err.contains("InvalidSecurityToken"), "{err}");
    assert!(!err.contains(STS_SK), "{err}");
}

#[test]
fn kms_retries_5xx_and_429_then_succeeds() {
    let kms = mock_kms();
    kms.force(&[500, 429, 503]);
    let mut cfg = kms_config(&kms, SK);
    cfg.retry = RetryPolicy::new(3, Duration::from_millis(1));
    let client = KmsClient::new(cfg).unwrap();
    assert_eq!(client.encrypt(b"k").unwrap(), mock_blob(b"k"));
    assert_eq!(kms.requests().len(), 4);
}

#[test]
fn kms_gives_up_after_bounded_retries() {
    let kms = mock_kms();
    kms.force(&[500, 500, 500, 500]);
    let mut cfg = kms_config(&kms, SK);
    cfg.retry = RetryPolicy::new(2, Duration::from_millis(1));
    let client = KmsClient::new(cfg).unwrap();
    let err = client.encrypt(b"k").unwrap_err();
    assert!(matches!(err, KeyError::Kms { status: Some(500), .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("HTTP 500") && msg.contains("after 3 attempts"), "{msg}");
    assert_eq!(kms.requests().len(), 3);
}

#[test]
fn kms_4xx_is_not_retried() {
    for code in [400u16, 403, 404] {
        let kms = mock_kms();
        kms.force(&[code]);
        let mut cfg = kms_config(&kms, SK);
        cfg.retry = RetryPolicy::new(5, Duration::from_millis(1));
        let err = KmsClient::new(cfg).unwrap().encrypt(b"k").unwrap_err();
        assert!(err.to_string().contains(&format!("HTTP {code}")), "{err}");
        assert_eq!(kms.requests().len(), 1, "HTTP {code} retried");
    }
}

#[test]
fn kms_unknown_key_name_is_a_clear_error() {
    let kms = mock_kms();
    let cfg = KmsConfig { key_name: Some("other_key".into()), ..kms_config(&kms, SK) };
    let err = KmsClient::new(cfg).unwrap().decrypt(&mock_blob(b"x")).unwrap_err();
    assert!(err.to_string().contains("HTTP 404: KeyNotFound"), "{err}");
}

#[test]
fn kms_answer_without_result_is_an_error() {
    let kms = mock_kms();
    kms.set_omit_result(true);
    let client = KmsClient::new(kms_config(&kms, SK)).unwrap();
    let err = client.decrypt(&mock_blob(b"x")).unwrap_err().to_string();
    assert!(err.contains("no Result.Plaintext"), "{err}");
    let err = client.encrypt(b"x").unwrap_err().to_string();
    assert!(err.contains("no Result.CiphertextBlob"), "{err}");
}

#[test]
fn kms_timeout_names_the_host() {
    // Connections complete in the kernel backlog, but nobody ever answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let cfg = KmsConfig {
        endpoint: Some(format!("http://{addr}")),
        timeout: Duration::from_millis(300),
        ..kms_config(&mock_kms(), SK)
    };
    let err = KmsClient::new(cfg).unwrap().decrypt("YQ==").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("timed out"), "{msg}");
    assert!(msg.contains(&addr.to_string()), "{msg}");
    drop(silent);
}

#[test]
fn kms_connection_refused_is_retried_and_names_the_host() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let cfg = KmsConfig {
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        retry: RetryPolicy::new(1, Duration::from_millis(1)),
        ..kms_config(&mock_kms(), SK)
    };
    let err = KmsClient::new(cfg).unwrap().decrypt("YQ==").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&format!("cannot connect to 127.0.0.1:{port}")), "{msg}");
    assert!(msg.contains("after 2 attempts"), "{msg}");
}

#[test]
fn kms_https_uses_tls() {
    // A plain-HTTP server behind an https:// endpoint: the TLS handshake (rustls, ring
    // provider) must fail cleanly, naming the host, rather than panic or fall back to HTTP.
    let server = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        if let Ok((mut c, _)) = server.accept() {
            use std::io::Write;
            let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}");
        }
    });
    let cfg = KmsConfig { endpoint: Some(format!("https://{addr}")), ..kms_config(&mock_kms(), SK) };
    let err = KmsClient::new(cfg).unwrap().decrypt("YQ==").unwrap_err();
    t.join().unwrap();
    assert!(matches!(err, KeyError::Kms { status: None, .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&format!("https://{addr}")), "{msg}");
    assert!(msg.contains(&addr.to_string()), "{msg}");
}

#[test]
fn kms_through_the_datapipe_proxy() {
    let kms = mock_kms();
    let dp = MockDatapipe::start();
    dp.set_kms(&kms);
    let client =
        KmsClient::new(kms_config(&kms, SK)).unwrap().with_datapipe_proxy(DatapipeClient::new(dp_config(&dp.path)));
    let blob = client.encrypt(b"via proxy").unwrap();
    assert_eq!(&client.decrypt(&blob).unwrap()[..], b"via proxy");
    let reqs = dp.requests();
    assert_eq!(dp.tasks(), ["top", "top"]);
    assert_eq!(reqs[0].method, "POST");
    assert!(reqs[0].target.starts_with("/?Action=Encrypt&KeyName="));
    assert_eq!(reqs[0].header("host"), Some("localhost"));
    assert!(reqs[0].header("authorization").is_some());
    // The KMS saw the signed request (the proxy set the KMS's Host).
    assert_eq!(kms.requests().len(), 2);
}

// ---------------------------------------------------------------------------------------------
// Datapipe client

#[test]
fn datapipe_tasks_and_headers() {
    let dp = MockDatapipe::start();
    dp.set_key_iv(RAW_KEY, RAW_IV);
    dp.set_sts(STS_AK, STS_SK, STS_TOKEN);
    let client = DatapipeClient::new(dp_config(&dp.path));
    assert!(client.exists());
    client.ping().unwrap();
    let (key, iv) = client.encrypt_key(Path::new("/models/./x/../m.safetensors")).unwrap();
    assert_eq!(key.expose(), RAW_KEY);
    assert_eq!(iv, Iv(*RAW_IV));
    let sts = client.kms_sts().unwrap();
    assert_eq!(sts.access_key, STS_AK);
    assert_eq!(sts.secret_key.expose(), STS_SK);
    assert_eq!(sts.session_token.expose(), STS_TOKEN);
    assert!(!format!("{sts:?}").contains(STS_SK));

    let reqs = dp.requests();
    assert_eq!(dp.tasks(), ["ping", "encrypt-key", "kms-sts"]);
    for r in &reqs {
        assert_eq!(r.method, "GET");
        assert_eq!(r.target, "/");
        assert_eq!(r.header("host"), Some("localhost"));
    }
    assert_eq!(reqs[1].header("x-tos-path"), Some("/models/m.safetensors"));
    assert_eq!(reqs[1].header("x-encrypt-caller-pod"), Some("trainer-pod-7"));
    assert!(reqs[0].header("x-tos-path").is_none());

    // A relative path is sent absolute.
    client.encrypt_key(Path::new("rel/m.safetensors")).unwrap();
    let sent = dp.requests()[3].header("x-tos-path").unwrap().to_string();
    assert!(sent.starts_with('/') && sent.ends_with("/rel/m.safetensors"), "{sent}");
}

#[test]
fn datapipe_chunked_answers() {
    let dp = MockDatapipe::start();
    dp.set_key_iv(RAW_KEY, RAW_IV);
    dp.set_sts(STS_AK, STS_SK, STS_TOKEN);
    dp.set_chunked(true);
    let client = DatapipeClient::new(dp_config(&dp.path));
    client.ping().unwrap();
    assert_eq!(client.encrypt_key(Path::new("/m")).unwrap().0.expose(), RAW_KEY);
    assert_eq!(client.kms_sts().unwrap().access_key, STS_AK);
}

#[test]
fn datapipe_retries_5xx_but_not_4xx() {
    let dp = MockDatapipe::start();
    dp.set_key_iv(RAW_KEY, RAW_IV);
    dp.force("encrypt-key", &[500, 503]);
    let mut cfg = dp_config(&dp.path);
    cfg.retry = RetryPolicy::new(2, Duration::from_millis(1));
    let client = DatapipeClient::new(cfg.clone());
    client.encrypt_key(Path::new("/m")).unwrap();
    assert_eq!(dp.tasks(), ["encrypt-key"; 3]);

    let dp = MockDatapipe::start();
    dp.force("encrypt-key", &[403]);
    cfg.socket_path = dp.path.clone();
    let err = DatapipeClient::new(cfg.clone()).encrypt_key(Path::new("/m")).unwrap_err();
    assert!(matches!(err, KeyError::Datapipe { status: Some(403), task: "encrypt-key", .. }), "{err:?}");
    assert_eq!(dp.tasks().len(), 1);

    let dp = MockDatapipe::start();
    dp.force("ping", &[500, 500, 500]);
    cfg.socket_path = dp.path.clone();
    let err = DatapipeClient::new(cfg).ping().unwrap_err().to_string();
    assert!(err.contains("HTTP 500") && err.contains("after 3 attempts"), "{err}");
    assert!(err.contains(&dp.path.display().to_string()), "{err}");
}

#[test]
fn datapipe_bad_answers() {
    let dp = MockDatapipe::start();
    dp.set_pong("ping?");
    let client = DatapipeClient::new(dp_config(&dp.path));
    let err = client.ping().unwrap_err().to_string();
    assert!(err.contains("pong"), "{err}");

    // No encrypt-key configured: the mock answers 404 with a message.
    let err = client.encrypt_key(Path::new("/m")).unwrap_err().to_string();
    assert!(err.contains("HTTP 404") && err.contains("no key for this model"), "{err}");

    // Bad base64 and wrong lengths are reported without the value.
    dp.set_key_iv_b64("not*base64", &b64(RAW_IV));
    let err = client.encrypt_key(Path::new("/m")).unwrap_err();
    assert!(matches!(err, KeyError::InvalidKeyMaterial { from: KeySource::Datapipe, .. }), "{err:?}");
    dp.set_key_iv(b"short", RAW_IV);
    let err = client.encrypt_key(Path::new("/m")).unwrap_err().to_string();
    assert!(err.contains("5 bytes"), "{err}");
    dp.set_key_iv(RAW_KEY, b"short iv");
    let err = client.encrypt_key(Path::new("/m")).unwrap_err().to_string();
    assert!(err.contains("8 bytes"), "{err}");
    assert!(!err.contains(&b64(RAW_KEY)), "{err}");
}

#[test]
fn datapipe_missing_socket_and_timeout() {
    let (_d, missing) = missing_socket();
    let err = DatapipeClient::new(dp_config(&missing)).ping().unwrap_err();
    assert!(matches!(&err, KeyError::DatapipeMissing(p) if *p == missing), "{err:?}");
    assert_eq!(err.to_string(), format!("datapipe socket {} does not exist", missing.display()));

    let silent = silent_socket();
    let mut cfg = dp_config(&silent.path);
    cfg.timeout = Duration::from_millis(200);
    let err = DatapipeClient::new(cfg).ping().unwrap_err().to_string();
    assert!(err.contains("timed out"), "{err}");
    assert!(err.contains(&silent.path.display().to_string()), "{err}");
}

#[test]
fn datapipe_rejects_header_injection() {
    let dp = MockDatapipe::start();
    dp.set_key_iv(RAW_KEY, RAW_IV);
    let client = DatapipeClient::new(dp_config(&dp.path));
    let err = client.encrypt_key(Path::new("/m\r\nX-Evil: 1")).unwrap_err().to_string();
    assert!(err.contains("X-TOS-Path"), "{err}");
    assert!(dp.requests().is_empty());
}

// ---------------------------------------------------------------------------------------------
// The chain

#[test]
fn header_kms_with_environment_credentials() {
    let kms = mock_kms();
    let (_d, missing) = missing_socket();
    let r = resolver(Some(&kms), &missing);
    let km = r.key_for_read(Path::new("/m.safetensors"), Some(&header(header_blob(RAW_KEY)))).unwrap();
    assert_eq!(km.source, KeySource::HeaderKms);
    assert_eq!(km.key.expose(), RAW_KEY);
    assert_eq!(km.iv, Iv(*RAW_IV));
    let req = &kms.requests()[0];
    assert!(req.header("authorization").unwrap().contains(AK));
}

#[test]
fn header_kms_with_datapipe_sts_credentials_and_proxy() {
    let kms = mock_kms();
    let dp = MockDatapipe::start();
    dp.set_kms(&kms);
    dp.set_sts(STS_AK, STS_SK, STS_TOKEN);
    // The configured (environment) credentials are wrong; kms-sts replaces them.
    let r = resolver(None, &dp.path).with_kms_config(KmsConfig {
        access_key: Some("AKenvironment".into()),
        ..kms_config(&kms, "wrong-env-secret")
    });
    let km = r.key_for_read(Path::new("/m.safetensors"), Some(&header(header_blob(RAW_KEY)))).unwrap();
    assert_eq!(km.source, KeySource::HeaderKms);
    assert_eq!(km.key.expose(), RAW_KEY);
    assert_eq!(dp.tasks(), ["ping", "kms-sts", "top"]);
    let seen = &kms.requests()[0];
    assert_eq!(seen.header("x-security-token"), Some(STS_TOKEN));
    assert!(seen.header("authorization").unwrap().contains(STS_AK));
}

#[test]
fn header_kms_keeps_environment_credentials_when_sts_fails() {
    let kms = mock_kms();
    let dp = MockDatapipe::start();
    dp.set_kms(&kms);
    // No kms-sts configured: the mock answers 404; env credentials, but still via the proxy.
    let r = resolver(Some(&kms), &dp.path);
    let km = r.key_for_read(Path::new("/m"), Some(&header(header_blob(RAW_KEY)))).unwrap();
    assert_eq!(km.source, KeySource::HeaderKms);
    assert_eq!(dp.tasks(), ["ping", "kms-sts", "top"]);
    assert!(kms.requests()[0].header("authorization").unwrap().contains(AK));
}

#[test]
fn kms_failure_falls_back_to_datapipe() {
    let kms = mock_kms();
    let dp = MockDatapipe::start();
    dp.set_kms(&kms);
    dp.set_key_iv(b"datapipe-key-16b", b"datapipe-iv-16bb");
    let r = resolver(Some(&kms), &dp.path);
    let km = r.key_for_read(Path::new("/m"), Some(&header("bm90IGEgYmxvYg==".into()))).unwrap();
    assert_eq!(km.source, KeySource::Datapipe);
    assert_eq!(km.key.expose(), b"datapipe-key-16b");
    assert_eq!(km.iv, Iv(*b"datapipe-iv-16bb"));
    // One ping serves both the KMS proxy check and the datapipe source.
    assert_eq!(dp.tasks(), ["ping", "kms-sts", "top", "encrypt-key"]);
}

#[test]
fn kms_failure_and_no_datapipe_falls_back_to_env() {
    let kms = mock_kms();
    let (_d, missing) = missing_socket();
    let r = resolver(None, &missing)
        .with_kms_config(kms_config(&kms, "wrong-secret-key-here"))
        .with_env_key_iv(Some(&b64(RAW_KEY)), Some(&b64(RAW_IV)));
    let km = r.key_for_read(Path::new("/m"), Some(&header(header_blob(RAW_KEY)))).unwrap();
    assert_eq!(km.source, KeySource::Env);
    assert_eq!(km.key.expose(), RAW_KEY);
    assert_eq!(km.iv, Iv(*RAW_IV));
}

#[test]
fn header_mode_must_fit_the_key() {
    let kms = mock_kms();
    let (_d, missing) = missing_socket();
    let r = resolver(Some(&kms), &missing);
    let mut h = header(header_blob(RAW_KEY));
    h.mode = Mode::Ctr256;
    let err = r.key_for_read(Path::new("/m"), Some(&h)).unwrap_err().to_string();
    assert!(err.contains("header+KMS: unusable key material"), "{err}");
    assert!(err.contains("CTR-256"), "{err}");
}

#[test]
fn headerless_read_and_write_use_datapipe_then_env() {
    let dp = MockDatapipe::start();
    dp.set_key_iv(RAW_KEY, RAW_IV);
    let r = resolver(None, &dp.path).with_env_key_iv(Some(&b64(&[7u8; 32])), Some(&b64(&[8u8; 16])));
    let km = r.key_for_read(Path::new("/m"), None).unwrap();
    assert_eq!(km.source, KeySource::Datapipe);
    let km = r.key_for_write(Path::new("/m")).unwrap();
    assert_eq!(km.source, KeySource::Datapipe);
    assert_eq!(dp.tasks(), ["ping", "encrypt-key", "ping", "encrypt-key"]);

    // No datapipe: the environment (a 32-byte key is AES-256).
    let (_d, missing) = missing_socket();
    let r = r.with_socket_path(&missing);
    for km in [r.key_for_read(Path::new("/m"), None).unwrap(), r.key_for_write(Path::new("/m")).unwrap()] {
        assert_eq!(km.source, KeySource::Env);
        assert_eq!(km.key.expose(), &[7u8; 32]);
        assert_eq!(km.key.mode(), Mode::Ctr256);
        assert_eq!(km.iv, Iv([8u8; 16]));
    }
}

#[test]
fn datapipe_ping_failure_falls_back_to_env() {
    let dp = MockDatapipe::start();
    dp.set_pong("nope");
    dp.set_key_iv(b"datapipe-key-16b", RAW_IV);
    let r = resolver(None, &dp.path).with_env_key_iv(Some(&b64(RAW_KEY)), Some(&b64(RAW_IV)));
    let km = r.key_for_read(Path::new("/m"), None).unwrap();
    assert_eq!(km.source, KeySource::Env);
    assert_eq!(dp.tasks(), ["ping"]);
}

#[test]
fn environment_source_validation() {
    let (_d, missing) = missing_socket();
    let key = b64(RAW_KEY);
    let iv = b64(RAW_IV);
    let cases: Vec<(Option<String>, Option<String>, &str)> = vec![
        (None, Some(iv.clone()), "environment: VETURBOIO_KEY is not set"),
        (Some(key.clone()), None, "environment: VETURBOIO_IV is not set"),
        (Some(String::new()), Some(iv.clone()), "environment: VETURBOIO_KEY is not set"),
        (
            Some("YWJj ZGVmZ2gxMjM0NTY3OA==".into()),
            Some(iv.clone()),
            "environment: VETURBOIO_KEY is invalid: not standard base64",
        ),
        (
            Some(format!("{key}\n")),
            Some(iv.clone()),
            "environment: VETURBOIO_KEY is invalid: not standard base64",
        ),
        (
            Some("YWJjZGVmZ2gxMjM0NTY3OA".into()),
            Some(iv.clone()),
            "environment: VETURBOIO_KEY is invalid: not standard base64",
        ),
        (
            Some("YWJjZGVmZ2gxMjM0NTY3OA-=".into()),
            Some(iv.clone()),
            "environment: VETURBOIO_KEY is invalid: not standard base64",
        ),
        (
            Some(b64(&[1u8; 24])),
            Some(iv.clone()),
            "environment: VETURBOIO_KEY is invalid: decodes to 24 bytes; a key must be 16 (AES-128) or 32 (AES-256) bytes",
        ),
        (
            Some(key.clone()),
            Some(b64(&[1u8; 12])),
            "environment: VETURBOIO_IV is invalid: decodes to 12 bytes; the IV must be 16 bytes",
        ),
        (
            Some(key.clone()),
            Some("MTIzNDU2Nzg4NzY1NDMyMQ=".into()),
            "environment: VETURBOIO_IV is invalid: not standard base64",
        ),
    ];
    for (k, i, want) in cases {
        let r = resolver(None, &missing).with_env_key_iv(k.as_deref(), i.as_deref());
        let err = r.key_for_read(Path::new("/m"), None).unwrap_err().to_string();
        assert!(err.contains(want), "{k:?}/{i:?}: {err}");
        assert!(!err.contains(&key), "{err}");
    }
    // The veTurboIO test vectors are accepted.
    let r =
        resolver(None, &missing).with_env_key_iv(Some("YWJjZGVmZ2gxMjM0NTY3OA=="), Some("MTIzNDU2Nzg4NzY1NDMyMQ=="));
    let km = r.key_for_read(Path::new("/m"), None).unwrap();
    assert_eq!(km.key.expose(), b"abcdefgh12345678");
    assert_eq!(km.iv, Iv(*b"1234567887654321"));
}

#[test]
fn from_vars_reads_every_variable() {
    let kms = mock_kms();
    let dp = MockDatapipe::start();
    dp.set_kms(&kms);
    let vars: HashMap<&str, String> = HashMap::from([
        ("VETURBOIO_KMS_ENDPOINT", kms.endpoint()),
        ("VETURBOIO_KMS_REGION", REGION.to_string()),
        ("VETURBOIO_KMS_ACCESS_KEY", AK.to_string()),
        ("VETURBOIO_KMS_SECRET_KEY", SK.to_string()),
        ("VETURBOIO_KMS_KEYRING_NAME", KEYRING.to_string()),
        ("VETURBOIO_KMS_KEY_NAME", KEY_NAME.to_string()),
        ("DATAPIPE_SOCKET_PATH", dp.path.display().to_string()),
        ("POD_NAME", "pod-from-env".to_string()),
        ("VETURBOIO_KEY", b64(RAW_KEY)),
        ("VETURBOIO_IV", b64(RAW_IV)),
    ]);
    let r = KeyResolver::from_vars(|k| vars.get(k).cloned());
    assert_eq!(r.datapipe_config().socket_path, dp.path);
    assert_eq!(r.datapipe_config().pod_name, "pod-from-env");
    let mut kc = r.kms_config().clone();
    kc.retry = fast();
    let r = r.with_kms_config(kc);
    // Header + KMS through the proxy with environment credentials.
    let km = r.key_for_read(Path::new("/m"), Some(&header(header_blob(RAW_KEY)))).unwrap();
    assert_eq!(km.source, KeySource::HeaderKms);
    // Headerless: datapipe has no key (404), so the environment.
    let km = r.key_for_read(Path::new("/m"), None).unwrap();
    assert_eq!(km.source, KeySource::Env);
    let enc = dp.requests().into_iter().find(|q| q.header("x-datapipe-task-type") == Some("encrypt-key")).unwrap();
    assert_eq!(enc.header("x-encrypt-caller-pod"), Some("pod-from-env"));
    let dbg = format!("{r:?}");
    assert!(!dbg.contains(SK) && !dbg.contains(&b64(RAW_KEY)), "{dbg}");
}

#[test]
fn all_sources_failing_lists_each_in_order() {
    let kms = mock_kms();
    let (_d, missing) = missing_socket();
    let r = resolver(None, &missing).with_kms_config(kms_config(&kms, "definitely-wrong-secret"));
    let err = r.key_for_read(Path::new("/m.safetensors"), Some(&header(header_blob(RAW_KEY)))).unwrap_err();
    let KeyError::NoKey { path, attempts } = &err else { panic!("{err:?}") };
    assert_eq!(path, &PathBuf::from("/m.safetensors"));
    let sources: Vec<_> = attempts.iter().map(|a| a.source).collect();
    assert_eq!(sources, [KeySource::HeaderKms, KeySource::Datapipe, KeySource::Env]);
    let msg = err.to_string();
    let want_prefix = format!(
        "no key for /m.safetensors: header+KMS: KMS Decrypt at {} failed: HTTP 401: SignatureDoesNotMatch",
        kms.endpoint()
    );
    assert!(msg.starts_with(&want_prefix), "{msg}");
    let want_tail = format!(
        "; datapipe: datapipe socket {} does not exist; environment: VETURBOIO_KEY is not set",
        missing.display()
    );
    assert!(msg.ends_with(&want_tail), "{msg}");
    assert!(msg.contains("[credentials from VETURBOIO_KMS_*]"), "{msg}");

    // Without any KMS settings the first step says what is missing.
    let r = resolver(None, &missing);
    let msg = r.key_for_read(Path::new("/m"), Some(&header(header_blob(RAW_KEY)))).unwrap_err().to_string();
    assert!(
        msg.starts_with("no key for /m: header+KMS: KMS is not configured: VETURBOIO_KMS_ACCESS_KEY is not set"),
        "{msg}"
    );

    // Headerless: two sources.
    let msg = r.key_for_write(Path::new("/w")).unwrap_err().to_string();
    assert_eq!(
        msg,
        format!(
            "no key for /w: datapipe: datapipe socket {} does not exist; environment: VETURBOIO_KEY is not set",
            missing.display()
        )
    );
}

#[test]
fn new_header_key_round_trip() {
    let kms = mock_kms();
    let (_d, missing) = missing_socket();
    let r = resolver(Some(&kms), &missing);
    let (km, h) = r.new_header_key().unwrap();
    assert_eq!(km.source, KeySource::HeaderKms);
    assert_eq!(km.key.len(), 16);
    assert_eq!(h.mode, Mode::Ctr128);
    assert_eq!(h.iv, km.iv);
    assert!(h.file_timestamp > 1_700_000_000);
    // The header serialises and parses back (the cipher crate's format).
    let bytes = h.to_bytes().unwrap();
    let parsed = CipherHeader::parse(&bytes, bytes.len() as u64).unwrap().unwrap();
    assert_eq!(parsed, h);
    // Reading with that header gets the same key and IV back through KMS Decrypt.
    let back = r.key_for_read(Path::new("/m"), Some(&parsed)).unwrap();
    assert_eq!(back.source, KeySource::HeaderKms);
    assert_eq!(back.key.expose(), km.key.expose());
    assert_eq!(back.iv, km.iv);
    // Two calls give different keys.
    let (km2, h2) = r.new_header_key().unwrap();
    assert_ne!(km2.key.expose(), km.key.expose());
    assert_ne!(h2.meta_data_key, h.meta_data_key);
}

#[test]
fn new_header_key_through_datapipe() {
    let kms = mock_kms();
    let dp = MockDatapipe::start();
    dp.set_kms(&kms);
    dp.set_sts(STS_AK, STS_SK, STS_TOKEN);
    let r = resolver(None, &dp.path).with_kms_config(KmsConfig {
        access_key: None,
        secret_key: None,
        ..kms_config(&kms, SK)
    });
    let (km, h) = r.new_header_key().unwrap();
    let back = r.key_for_read(Path::new("/m"), Some(&h)).unwrap();
    assert_eq!(back.key.expose(), km.key.expose());
    assert_eq!(dp.tasks(), ["ping", "kms-sts", "top", "ping", "kms-sts", "top"]);
}

#[test]
fn new_header_key_without_kms_is_an_error() {
    let (_d, missing) = missing_socket();
    let err = resolver(None, &missing).new_header_key().unwrap_err().to_string();
    assert!(err.contains("VETURBOIO_KMS_ACCESS_KEY is not set"), "{err}");
}

#[test]
fn secrets_never_appear_in_errors_or_debug() {
    let kms = mock_kms();
    let env_key = b64(b"ENVKEY-16-bytes!");
    let secrets = [SK, STS_SK, STS_TOKEN, "wrong-secret-value-1", env_key.as_str()];
    let key_hex: String = RAW_KEY.iter().map(|b| format!("{b:02x}")).collect();
    let check = |what: &str, text: &str| {
        for s in secrets {
            assert!(!text.contains(s), "{what} leaks {s:?}: {text}");
        }
        assert!(!text.contains(&b64(RAW_KEY)), "{what} leaks the key: {text}");
        assert!(!text.contains(&key_hex), "{what} leaks the key: {text}");
        assert!(!text.contains("abcdefgh12345678"), "{what} leaks the key: {text}");
    };

    // Failing KMS (wrong secret, with a token), datapipe answers with garbage, env key too short.
    let dp = MockDatapipe::start();
    dp.set_kms(&kms);
    dp.set_key_iv_b64("%%%", "%%%");
    let r = resolver(None, &dp.path)
        .with_kms_config(KmsConfig {
            session_token: Some(Secret::new(STS_TOKEN)),
            ..kms_config(&kms, "wrong-secret-value-1")
        })
        .with_env_key_iv(Some(&env_key[..8]), Some(&b64(RAW_IV)));
    let err = r.key_for_read(Path::new("/m"), Some(&header(header_blob(RAW_KEY)))).unwrap_err();
    check("error", &err.to_string());
    check("error debug", &format!("{err:?}"));
    check("resolver debug", &format!("{r:?}"));
    check("config debug", &format!("{:?}", r.kms_config()));
    check("client debug", &format!("{:?}", r.kms_client().unwrap()));

    // Successful material prints redacted.
    let dp2 = MockDatapipe::start();
    dp2.set_key_iv(RAW_KEY, RAW_IV);
    dp2.set_sts(STS_AK, STS_SK, STS_TOKEN);
    let r2 = resolver(Some(&kms), &dp2.path);
    let km = r2.key_for_read(Path::new("/m"), None).unwrap();
    check("key material debug", &format!("{km:?}"));
    let sts = DatapipeClient::new(dp_config(&dp2.path)).kms_sts().unwrap();
    check("sts debug", &format!("{sts:?}"));

    // An Encrypt error body that echoes the request does not leak the plaintext.
    let echo = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = echo.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut c, _) = echo.accept().unwrap();
        let req = read_request(&mut c).unwrap();
        let body = String::from_utf8_lossy(&req.body).to_string();
        write_response(&mut c, 400, &format!("bad request: {body} token={STS_TOKEN}"), false);
    });
    let client = KmsClient::new(KmsConfig {
        endpoint: Some(format!("http://{addr}")),
        session_token: Some(Secret::new(STS_TOKEN)),
        ..kms_config(&kms, SK)
    })
    .unwrap();
    let key = turboio_cipher::Key::new(RAW_KEY).unwrap();
    let err = client.encrypt_data_key(&key).unwrap_err().to_string();
    server.join().unwrap();
    assert!(err.contains("HTTP 400: bad request"), "{err}");
    check("echoed error", &err);
    assert!(!err.contains(&b64(b64(RAW_KEY).as_bytes())), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Cancellation and the HTTP client

#[test]
fn a_cancelled_lookup_returns_at_once_against_a_datapipe_that_never_answers() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let silent = silent_socket();
    let mut cfg = dp_config(&silent.path);
    // veTurboIO-like patience: without the cancel this would wait minutes.
    cfg.timeout = Duration::from_secs(60);
    cfg.retry = RetryPolicy::new(60, Duration::from_secs(2));
    let cancel = Arc::new(AtomicBool::new(false));
    let r = KeyResolver::from_vars(|_| None).with_datapipe_config(cfg).with_cancel(cancel.clone());
    let worker = std::thread::spawn(move || r.key_for_read(Path::new("/m.safetensors"), None));
    let _held = silent.accept_one();
    let start = std::time::Instant::now();
    cancel.store(true, Ordering::Relaxed);
    let result = worker.join().unwrap();
    let took = start.elapsed();
    assert!(matches!(result, Err(KeyError::Cancelled)), "{result:?}");
    assert!(took < Duration::from_secs(1), "cancelling took {took:?}");

    // The backoff wait between attempts wakes up too.
    let dp = MockDatapipe::start();
    dp.force("ping", &[500; 10]);
    let mut cfg = dp_config(&dp.path);
    cfg.retry = RetryPolicy::new(5, Duration::from_secs(30));
    let cancel = Arc::new(AtomicBool::new(false));
    let client = DatapipeClient::new(cfg).with_cancel(cancel.clone());
    let worker = std::thread::spawn(move || client.ping());
    while dp.requests().is_empty() {
        std::thread::yield_now();
    }
    let start = std::time::Instant::now();
    cancel.store(true, Ordering::Relaxed);
    assert!(matches!(worker.join().unwrap(), Err(KeyError::Cancelled)));
    assert!(start.elapsed() < Duration::from_secs(1));
    assert_eq!(dp.requests().len(), 1, "no attempt after the cancel");
}

#[test]
fn a_cancelled_kms_call_returns_at_once() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    // A TCP listener that accepts and never answers.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut cfg = KmsConfig {
        endpoint: Some(format!("http://{addr}")),
        access_key: Some(AK.into()),
        secret_key: Some(Secret::new(SK)),
        keyring_name: Some(KEYRING.into()),
        key_name: Some(KEY_NAME.into()),
        ..KmsConfig::default()
    };
    cfg.timeout = Duration::from_secs(60);
    let cancel = Arc::new(AtomicBool::new(false));
    let client = KmsClient::new(cfg).unwrap().with_cancel(cancel.clone());
    let worker = std::thread::spawn(move || client.decrypt("Y2lwaGVydGV4dA=="));
    let _held = listener.accept().unwrap();
    let start = std::time::Instant::now();
    cancel.store(true, Ordering::Relaxed);
    assert!(matches!(worker.join().unwrap(), Err(KeyError::Cancelled)));
    assert!(start.elapsed() < Duration::from_secs(1));
}

/// A unix socket that answers every connection with the same raw bytes, then closes it.
fn raw_socket(answer: &'static [u8]) -> (tempfile::TempDir, PathBuf) {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raw.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            // Read the request head, then answer.
            let mut seen = Vec::new();
            let mut byte = [0u8; 1];
            while !seen.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                seen.push(byte[0]);
            }
            let _ = conn.write_all(answer);
        }
    });
    (dir, path)
}

#[test]
fn datapipe_http_framing_through_reqwest() {
    // (The hand-written HTTP/1.1 client's cases, now through reqwest over the unix socket.)
    let pong = |raw: &'static [u8]| {
        let (_d, path) = raw_socket(raw);
        DatapipeClient::new(dp_config(&path)).ping()
    };
    pong(b"HTTP/1.1 200 OK\r\nContent-Length: 19\r\n\r\n{\"message\": \"pong\"}").unwrap();
    pong(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\n{\"me\r\na\r\nssage\": \"p\r\n5\r\nong\"}\r\n0\r\nX-Trailer: t\r\n\r\n")
        .unwrap();
    pong(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{\"message\": \"pong\"}").unwrap();
    pong(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 19\r\n\r\n{\"message\": \"pong\"}").unwrap();
    for raw in [
        &b""[..],
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n",
        b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy",
    ] {
        let err = pong(raw).unwrap_err();
        assert!(matches!(err, KeyError::Datapipe { task: "ping", .. }), "{err:?} for {raw:?}");
    }
    let err = pong(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n").unwrap_err().to_string();
    assert!(err.contains("larger than"), "{err}");
}

#[test]
fn secrets_deserialize_straight_into_zeroizing_strings() {
    // Answers are parsed by typed structs whose secret fields are `Secret`s (zeroized on drop),
    // never through a serde_json::Value.
    let s: Secret = serde_json::from_str("\"sk-0123456789\"").unwrap();
    assert_eq!(s.expose(), "sk-0123456789");
    assert_eq!(format!("{s:?}"), "<redacted>");
    // A secret of the wrong type is an error that does not quote it.
    let dp = MockDatapipe::start();
    dp.set_key_iv_b64("x", "y");
    let client = DatapipeClient::new(dp_config(&dp.path));
    let err = client.encrypt_key(Path::new("/m")).unwrap_err();
    assert!(matches!(err, KeyError::InvalidKeyMaterial { .. }), "{err:?}");
}

#[test]
fn sfcs_sts_answers() {
    use std::time::UNIX_EPOCH;
    let dp = MockDatapipe::start();
    dp.set_sfcs_sts(r#"{"Cred": {"CurrentTime": "2024-01-01T08:00:00+08:00", "ExpiredTime": "2024-01-01T01:00:00Z", "AccessKeyId": "AKSFCS", "SecretAccessKey": "sfcs-secret", "SessionToken": "sfcs-token"}, "SfcsNameNodeAddress": "10.9.8.7"}"#);
    let client = DatapipeClient::new(dp_config(&dp.path));
    let sts = client.sfcs_sts().unwrap();
    assert_eq!(sts.access_key, "AKSFCS");
    assert_eq!(sts.secret_key.expose(), "sfcs-secret");
    assert_eq!(sts.session_token.expose(), "sfcs-token");
    assert_eq!(sts.namenode_address, "10.9.8.7");
    assert_eq!(sts.current_time.duration_since(UNIX_EPOCH).unwrap().as_secs(), 1_704_067_200);
    assert_eq!(sts.expired_time.duration_since(UNIX_EPOCH).unwrap().as_secs(), 1_704_070_800);
    assert!(!format!("{sts:?}").contains("sfcs-secret"));
    dp.set_sfcs_sts(r#"{"Cred": {"CurrentTime": "now", "ExpiredTime": "later", "AccessKeyId": "A", "SecretAccessKey": "s", "SessionToken": "t"}, "SfcsNameNodeAddress": "x"}"#);
    let err = client.sfcs_sts().unwrap_err().to_string();
    assert!(err.contains("CurrentTime") && err.contains("ISO 8601"), "{err}");
    dp.set_sfcs_sts(r#"{"Cred": {"AccessKeyId": "A"}}"#);
    let err = client.sfcs_sts().unwrap_err().to_string();
    assert!(err.contains("no field"), "{err}");
}
