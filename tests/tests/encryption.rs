//! Encrypted checkpoints through the whole pipeline: both of veTurboIO's layouts, every load
//! path, keys from a fixed key and from the KMS chain (against the mock KMS of turboio-kms's
//! tests, which verifies every request's signature), wrong keys, and tools.

#[path = "../../crates/kms/tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;
use support::MockKms;
use turboio::crypt::{Encryption, Iv, Key, KeyResolver, Keys};
use turboio::device::testing::OpaqueDevice;
use turboio::device::Device;
use turboio::{CachePolicy, Error, Held, LoadMode, LoadOptions, SaveOptions};
use turboio_cipher::{CipherHeader, HEADER_SIZE, MAGIC};
use turboio_kms::{KmsConfig, RetryPolicy, Secret};
use turboio_tests::disk_dir;

fn fixed() -> Keys {
    Keys::Fixed { key: Key::new(b"abcdefgh12345678").unwrap(), iv: Iv(*b"1234567887654321") }
}

fn kms_resolver(kms: &MockKms) -> KeyResolver {
    let config = KmsConfig {
        endpoint: Some(kms.endpoint()),
        access_key: Some("AKTEST".into()),
        secret_key: Some(Secret::new("SKTEST".to_string())),
        keyring_name: Some(support::KEYRING.into()),
        key_name: Some(support::KEY_NAME.into()),
        retry: RetryPolicy { retries: 0, base_delay: Duration::ZERO, max_delay: Duration::ZERO },
        ..KmsConfig::default()
    };
    let dir = std::env::temp_dir().join("turboio-no-datapipe");
    KeyResolver::from_vars(|_| None).with_kms_config(config).with_socket_path(dir.join("missing.sock"))
}

fn plain_and_encrypted(dir: &std::path::Path, enc: &Encryption) -> (std::path::PathBuf, std::path::PathBuf) {
    let plain = dir.join("plain.safetensors");
    let encrypted = dir.join("enc.safetensors");
    turboio::sample::write_sample(&plain, 6 << 20, 9, &SaveOptions::default()).unwrap();
    let opts = SaveOptions { encryption: Some(enc.clone()), ..Default::default() };
    turboio::sample::write_sample(&encrypted, 6 << 20, 9, &opts).unwrap();
    (plain, encrypted)
}

fn assert_same_tensors(a: &turboio::LoadedFile, b: &turboio::LoadedFile) {
    assert_eq!(a.len(), b.len());
    for t in a.tensors() {
        assert_eq!(a.to_host(t.name()).unwrap(), b.to_host(t.name()).unwrap(), "{}", t.name());
    }
    assert_eq!(a.metadata(), b.metadata());
}

#[test]
fn headerless_files_on_every_path() {
    let d = disk_dir();
    let enc = Encryption::new(fixed());
    let (plain, encrypted) = plain_and_encrypted(d.path(), &enc);
    assert_eq!(std::fs::metadata(&plain).unwrap().len(), std::fs::metadata(&encrypted).unwrap().len());
    assert_ne!(std::fs::read(&plain).unwrap()[..64], std::fs::read(&encrypted).unwrap()[..64]);
    let reference = turboio::load(&plain, &LoadOptions::default()).unwrap();
    let dev: Arc<dyn Device> = Arc::new(OpaqueDevice::new(0));
    for (label, opts) in [
        ("auto", LoadOptions::default()),
        (
            "copied direct",
            LoadOptions { mode: LoadMode::Copied, cache: CachePolicy::Bypass, threads: 2, ..Default::default() },
        ),
        (
            "copied buffered",
            LoadOptions { mode: LoadMode::Copied, cache: CachePolicy::Keep, threads: 3, ..Default::default() },
        ),
        (
            "staged odd chunks",
            LoadOptions { device: Some(dev.clone()), staging_chunk: 4096 * 3 + 1, ..Default::default() },
        ),
    ] {
        let opts = LoadOptions { encryption: Some(enc.clone()), ..opts };
        let loaded = turboio::load(&encrypted, &opts).unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_ne!(loaded.report().held, Held::Mapped, "{label}: encrypted files are never mapped");
        assert_same_tensors(&reference, &loaded);
    }
    let err = turboio::load(
        &encrypted,
        &LoadOptions { encryption: Some(enc.clone()), mode: LoadMode::Mapped, ..Default::default() },
    )
    .unwrap_err();
    assert!(err.to_string().contains("cannot be mapped"), "{err}");
    // Without the key the file is not a safetensors file at all.
    assert!(turboio::load(&encrypted, &LoadOptions::default()).is_err());
}

#[test]
fn a_wrong_key_is_a_clear_error_not_garbage() {
    let d = disk_dir();
    let (_, encrypted) = plain_and_encrypted(d.path(), &Encryption::new(fixed()));
    for wrong in [
        Keys::Fixed { key: Key::new(b"abcdefgh12345679").unwrap(), iv: Iv(*b"1234567887654321") },
        Keys::Fixed { key: Key::new(b"abcdefgh12345678").unwrap(), iv: Iv(*b"1234567887654322") },
        Keys::Fixed { key: Key::new(&[7u8; 32]).unwrap(), iv: Iv([0; 16]) },
    ] {
        let err =
            turboio::load(&encrypted, &LoadOptions { encryption: Some(Encryption::new(wrong)), ..Default::default() })
                .unwrap_err();
        assert!(matches!(err, Error::Decrypted { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("enc.safetensors") && msg.contains("wrong key"), "{msg}");
    }
}

#[test]
fn header_files_with_keys_from_kms() {
    let kms = MockKms::start();
    kms.add_credentials("AKTEST", "SKTEST", None);
    let d = disk_dir();
    let enc = Encryption { keys: Keys::Chain(Arc::new(kms_resolver(&kms))), header: true, check_content: true };
    let (plain, encrypted) = plain_and_encrypted(d.path(), &enc);
    let bytes = std::fs::read(&encrypted).unwrap();
    assert_eq!(bytes.len() as u64, std::fs::metadata(&plain).unwrap().len() + HEADER_SIZE);
    assert_eq!(&bytes[..16], MAGIC);
    let header = CipherHeader::parse(&bytes[..HEADER_SIZE as usize], bytes.len() as u64).unwrap().unwrap();
    assert_eq!(header.mode.as_str(), "CTR-128");
    assert!(kms.requests().iter().any(|r| r.query_param("Action") == Some("Encrypt")));
    let opts = LoadOptions { encryption: Some(enc.clone()), ..Default::default() };
    let loaded = turboio::load(&encrypted, &opts).unwrap();
    assert!(kms.requests().iter().any(|r| r.query_param("Action") == Some("Decrypt")));
    assert_same_tensors(&turboio::load(&plain, &LoadOptions::default()).unwrap(), &loaded);
    // decrypt_file gives back exactly the plain file.
    let out = d.path().join("decrypted.safetensors");
    turboio::crypt::decrypt_file(&encrypted, &out, &enc, &SaveOptions::default()).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&plain).unwrap());
    // A KMS that does not know our credentials leaves no key: the error lists every source.
    let kms2 = MockKms::start();
    let enc2 = Encryption { keys: Keys::Chain(Arc::new(kms_resolver(&kms2))), header: false, check_content: true };
    let err = turboio::load(&encrypted, &LoadOptions { encryption: Some(enc2), ..Default::default() }).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Key { .. }), "{err:?}");
    assert!(msg.contains("header+KMS") && msg.contains("datapipe") && msg.contains("environment"), "{msg}");
}

#[test]
fn encrypt_and_decrypt_files_of_any_kind() {
    let d = disk_dir();
    let enc = Encryption::new(fixed());
    let src = d.path().join("model.pt");
    // What torch.save writes: a zip archive (local header first, end record last).
    let mut data = b"PK\x03\x04".to_vec();
    data.extend((0..3_000_001u32).map(|i| (i * 7 % 251) as u8));
    data.extend_from_slice(b"PK\x05\x06");
    data.extend_from_slice(&[0u8; 18]);
    std::fs::write(&src, &data).unwrap();
    let e = d.path().join("model.pt.enc");
    turboio::crypt::encrypt_file(&src, &e, &enc, &SaveOptions::default()).unwrap();
    let opts = LoadOptions { encryption: Some(enc.clone()), ..Default::default() };
    assert_eq!(turboio::read_all(&e, &opts).unwrap(), data);
    assert_eq!(turboio::read_prefix(&e, 10, &opts).unwrap(), (data[..10].to_vec(), data.len() as u64));
    let back = d.path().join("back.pt");
    turboio::crypt::decrypt_file(&e, &back, &enc, &SaveOptions::default()).unwrap();
    assert_eq!(std::fs::read(&back).unwrap(), data);
    let err = turboio::crypt::encrypt_file(
        &src,
        &e,
        &Encryption { keys: fixed(), header: true, check_content: true },
        &SaveOptions::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("needs the KMS"), "{err}");

    // Bytes that are neither safetensors nor a torch file are refused once decrypted, as a
    // wrong key's output is: nothing is read, returned or written.
    let junk = d.path().join("junk.bin");
    std::fs::write(&junk, &data[4..]).unwrap();
    let junk_enc = d.path().join("junk.enc");
    turboio::crypt::encrypt_file(&junk, &junk_enc, &enc, &SaveOptions::default()).unwrap();
    let err = turboio::read_all(&junk_enc, &opts).unwrap_err();
    assert!(matches!(err, Error::Decrypted { .. }), "{err:?}");
    let out = d.path().join("junk.out");
    assert!(turboio::crypt::decrypt_file(&junk_enc, &out, &enc, &SaveOptions::default()).is_err());
    assert!(!out.exists());
}
