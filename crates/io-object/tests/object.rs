//! The object-storage backend against a real S3 server on 127.0.0.1 (moto's, started by the
//! test through the venv's Python): the storage conformance suite, and the faults a remote
//! store has (throttling, 5xx, bodies cut short, an object replaced during a read, wrong
//! credentials, missing buckets and keys, a server that stops).

#[path = "../../../tests/src/python.rs"]
mod python;
#[path = "../../../tests/src/s3.rs"]
#[allow(dead_code)]
mod s3;

use s3::{S3Server, SECRET_KEY};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use turboio_io_object::{ObjectOptions, ObjectStorage};
use turboio_storage::conformance::{self, pattern, Capabilities};
use turboio_storage::{BytesSource, IoOptions, ReadRequest, Storage, StorageError, WriteSource};

fn server() -> Option<S3Server> {
    Some(S3Server::start(&python::python()?))
}

fn storage(s: &S3Server, extra: &[(&str, &str)]) -> ObjectStorage {
    let mut pairs = s.options();
    pairs.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    ObjectStorage::new(ObjectOptions::from_pairs(pairs).unwrap())
}

fn read_all(st: &dyn Storage, url: &Path, opts: &IoOptions<'_>) -> Result<Vec<u8>, StorageError> {
    let f = st.open(url)?;
    let mut buf = vec![0u8; f.len() as usize];
    f.read_ranges(vec![ReadRequest { offset: 0, dst: &mut buf }], opts)?;
    Ok(buf)
}

fn url(s: &str) -> PathBuf {
    PathBuf::from(s)
}

#[test]
fn conformance_against_a_real_s3_server() {
    let Some(s) = server() else { return };
    s.create_bucket("conformance");
    // Small parts and a small first GET, so that multipart uploads, parts served from the first
    // GET's bytes and parts fetched in parallel all happen at the suite's sizes.
    let st = storage(&s, &[("part_size", "5MiB"), ("prefix_bytes", "4096"), ("concurrency", "4")]);
    let caps = Capabilities { local_dir: false, directories: false, lists: true };
    for threads in [1, 3] {
        let dir = url(&format!("s3://conformance/t{threads}"));
        conformance::run_all(&st, &dir, caps, &IoOptions { threads, ..Default::default() });
    }
}

#[test]
fn transient_faults_are_retried_and_the_bytes_are_right() {
    let Some(s) = server() else { return };
    s.create_bucket("faults");
    let st = storage(&s, &[("part_size", "5MiB"), ("prefix_bytes", "4096"), ("concurrency", "4")]);
    let data = pattern((23 << 20) + 11, 3);
    let obj = url("s3://faults/model.safetensors");
    st.write_file(&obj, &BytesSource(&data), &IoOptions::default()).unwrap();
    for faults in [r#"{"slowdown_every": 2}"#, r#"{"error_every": 3}"#, r#"{"truncate_every": 2}"#] {
        s.faults(faults);
        let progress = AtomicU64::new(0);
        let back = read_all(&st, &obj, &IoOptions { threads: 2, progress: Some(&progress), ..Default::default() })
            .unwrap_or_else(|e| panic!("{faults}: {e}"));
        assert!(back == data, "{faults}: bytes differ");
        assert_eq!(progress.load(Ordering::Relaxed), data.len() as u64, "{faults}: progress");
        assert!(s.stat("gets") > 5, "{faults}: the reads went to the server: {}", s.stats());
    }
    s.faults("{}");
}

#[test]
fn the_header_costs_one_request_and_reads_are_pinned_to_the_opened_version() {
    let Some(s) = server() else { return };
    s.create_bucket("pinned");
    let st = storage(&s, &[("part_size", "5MiB")]);
    let obj = url("s3://pinned/a.bin");
    let first = pattern(12 << 20, 1);
    st.write_file(&obj, &BytesSource(&first), &IoOptions::default()).unwrap();
    s.faults("{}");
    let f = st.open(&obj).unwrap();
    assert_eq!(f.len(), first.len() as u64);
    // The opening GET brought the first MiB: reading inside it sends nothing.
    let mut head = vec![0u8; 100_000];
    f.read_exact_at(8, &mut head).unwrap();
    assert_eq!(head[..], first[8..100_008]);
    assert_eq!(s.stat("gets"), 1, "{}", s.stats());
    // Replaced while open: the next read fails, naming the URL, instead of mixing versions.
    st.write_file(&obj, &BytesSource(&pattern(12 << 20, 2)), &IoOptions::default()).unwrap();
    let mut buf = vec![0u8; 6 << 20];
    let err = f.read_ranges(vec![ReadRequest { offset: 5 << 20, dst: &mut buf }], &IoOptions::default()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("s3://pinned/a.bin") && msg.contains("changed while it was being read"), "{msg}");
    // Opened again, the new version reads whole.
    assert!(read_all(&st, &obj, &IoOptions::default()).unwrap() == pattern(12 << 20, 2));
}

#[test]
fn permanent_failures_are_clear_and_keep_secrets() {
    let Some(s) = server() else { return };
    s.create_bucket("perm");
    let st = storage(&s, &[]);
    st.write_file(&url("s3://perm/x.bin"), &BytesSource(b"hello"), &IoOptions::default()).unwrap();
    // A missing key, a missing bucket.
    for missing in ["s3://perm/nope.safetensors", "s3://no-such-bucket-here/x.bin"] {
        let err = st.open(&url(missing)).unwrap_err();
        assert!(err.is_not_found() && err.to_string().contains(missing), "{err}");
    }
    // Wrong credentials: refused at once, with the URL and no secret.
    s.faults(r#"{"require_key": "AKIASOMEONEELSE"}"#);
    let err = st.open(&url("s3://perm/x.bin")).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("s3://perm/x.bin") && msg.contains("access denied"), "{msg}");
    // One line: the server's XML error folded to its code and message (issue 49, item 8).
    assert!(!msg.contains('\n') && !msg.contains("<Error>"), "{msg}");
    assert!(!msg.contains(SECRET_KEY) && !format!("{err:?}").contains(SECRET_KEY), "{msg}");
    assert!(s.stat("requests") <= 2, "a refusal is not retried: {}", s.stats());
    assert!(!format!("{st:?}").contains(SECRET_KEY));
    s.faults("{}");
    // Saving to a missing bucket fails and names it.
    let err = st.write_file(&url("s3://no-such-bucket-here/y.bin"), &BytesSource(b"x"), &IoOptions::default());
    assert!(err.unwrap_err().to_string().contains("s3://no-such-bucket-here/y.bin"));
    // http(s):// is read-only.
    let err = st.write_file(&url("http://127.0.0.1:1/x.bin"), &BytesSource(b"x"), &IoOptions::default()).unwrap_err();
    assert!(matches!(err, StorageError::Unsupported { .. }) && err.to_string().contains("read-only"), "{err}");
    // A URL that names a bucket only, and unknown options.
    assert!(st.open(&url("s3://perm")).unwrap_err().to_string().contains("names a bucket"));
    let e = ObjectOptions::from_pairs([("concurrency", "x")]).unwrap_err();
    assert!(e.contains("concurrency"), "{e}");
    let bad = ObjectStorage::new(ObjectOptions::from_pairs([("no_such_option", "1")]).unwrap());
    let err = bad.open(&url("s3://perm/x.bin")).unwrap_err().to_string();
    assert!(err.contains("no_such_option") && err.contains("s3://perm/x.bin"), "{err}");
}

/// `gs://` and `az://` URLs go to object_store's GCS and Azure clients, configured from their own
/// keys (no emulator of either can be installed here, so this stops at the first request): each
/// refuses another store's key, naming it, and a request to an address where nothing listens
/// fails with the URL and without the credentials.
#[test]
fn gcs_and_azure_urls_use_their_own_clients_and_fail_with_the_url() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let endpoint = format!("http://127.0.0.1:{closed}");
    // base64 of "fake-secret-key-for-turboio-tests": Azure's keys are base64.
    let secret = "ZmFrZS1zZWNyZXQta2V5LWZvci10dXJib2lvLXRlc3Rz";
    let gcs_key = format!(
        r#"{{"private_key": "{secret}", "private_key_id": "k1", "client_email": "t@example.com", "gcs_base_url": "{endpoint}", "disable_oauth": true}}"#
    );
    let quick = [("max_retries", "0"), ("part_retries", "0"), ("retry_timeout", "1"), ("allow_http", "true")];
    let cases = [
        ("gs://bucket/dir/m.safetensors", vec![("service_account_key", gcs_key.as_str())], "aws_region", "GCS"),
        (
            "az://container/dir/m.safetensors",
            vec![("account_name", "turboio"), ("access_key", secret), ("endpoint", endpoint.as_str())],
            "google_service_account",
            "Azure",
        ),
    ];
    for (u, keys, foreign, store) in cases {
        let st = ObjectStorage::new(ObjectOptions::from_pairs(keys.iter().chain(quick.iter()).copied()).unwrap());
        let err = st.open(&url(u)).unwrap_err();
        let (msg, dbg) = (err.to_string(), format!("{err:?}"));
        // The client's request went out (the opening GET, to the configured endpoint) and was
        // refused.
        assert!(msg.contains(u) && msg.contains(&format!("GET {endpoint}/")) && !err.is_not_found(), "{u}: {msg}");
        assert!(!msg.contains(secret) && !dbg.contains(secret) && !format!("{st:?}").contains(secret), "{u}: {msg}");
        let wrong = ObjectOptions::from_pairs(keys.iter().chain([(foreign, "x")].iter()).copied()).unwrap();
        let msg = ObjectStorage::new(wrong).open(&url(u)).unwrap_err().to_string();
        assert!(msg.contains(foreign) && msg.contains(&format!("for {store}")) && msg.contains(u), "{u}: {msg}");
    }
}

#[test]
fn a_server_that_stops_fails_the_read_with_the_url() {
    let Some(mut s) = server() else { return };
    s.create_bucket("stops");
    let st = storage(&s, &[("part_size", "5MiB"), ("part_retries", "1"), ("retry_timeout", "1"), ("max_retries", "1")]);
    let data = pattern(16 << 20, 9);
    let obj = url("s3://stops/m.bin");
    st.write_file(&obj, &BytesSource(&data), &IoOptions::default()).unwrap();
    let f = st.open(&obj).unwrap();
    s.stop();
    let mut buf = vec![0u8; data.len()];
    let err = f.read_ranges(vec![ReadRequest { offset: 0, dst: &mut buf }], &IoOptions::default()).unwrap_err();
    assert!(err.to_string().contains("s3://stops/m.bin"), "{err}");
}

struct Failing(u64);

impl WriteSource for Failing {
    fn len(&self) -> u64 {
        self.0
    }

    fn fill(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
        if offset + dst.len() as u64 > self.0 / 2 {
            return Err("the tensor source failed on purpose".into());
        }
        dst.fill(7);
        Ok(())
    }
}

#[test]
fn a_failed_multipart_save_aborts_its_upload_and_keeps_the_old_object() {
    let Some(s) = server() else { return };
    s.create_bucket("saves");
    let st = storage(&s, &[("part_size", "5MiB"), ("concurrency", "3")]);
    let obj = url("s3://saves/ckpt.safetensors");
    let old = pattern(7 << 20, 4);
    st.write_file(&obj, &BytesSource(&old), &IoOptions::default()).unwrap();
    let err = st.write_file(&obj, &Failing(40 << 20), &IoOptions { threads: 2, ..Default::default() }).unwrap_err();
    assert!(err.to_string().contains("failed on purpose"), "{err}");
    assert!(read_all(&st, &obj, &IoOptions::default()).unwrap() == old, "the old object is intact");
    let (status, body) = s.request("GET", "/saves?uploads", b"");
    let listing = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "{listing}");
    assert!(!listing.contains("<UploadId>"), "the multipart upload was aborted: {listing}");
    // A cancelled save likewise.
    let cancel = std::sync::atomic::AtomicBool::new(true);
    let err = st
        .write_file(
            &obj,
            &BytesSource(&pattern(20 << 20, 5)),
            &IoOptions { cancel: Some(&cancel), ..Default::default() },
        )
        .unwrap_err();
    assert!(matches!(err, StorageError::Cancelled), "{err:?}");
    assert!(read_all(&st, &obj, &IoOptions::default()).unwrap() == old);
}

/// A source whose code panics past half of the object.
struct Panicking(u64);

impl WriteSource for Panicking {
    fn len(&self) -> u64 {
        self.0
    }

    fn fill(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
        if offset + dst.len() as u64 > self.0 / 2 {
            panic!("the tensor source panicked on purpose");
        }
        dst.fill(7);
        Ok(())
    }
}

#[test]
fn a_multipart_save_whose_source_panics_aborts_its_upload_and_ends() {
    let Some(s) = server() else { return };
    s.create_bucket("panics");
    let st = storage(&s, &[("part_size", "5MiB"), ("concurrency", "3")]);
    let obj = url("s3://panics/ckpt.safetensors");
    let old = pattern(7 << 20, 6);
    st.write_file(&obj, &BytesSource(&old), &IoOptions::default()).unwrap();
    // Three workers: the others wait for the panicking one's part, and must stop too.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        st.write_file(&obj, &Panicking(40 << 20), &IoOptions { threads: 3, ..Default::default() })
    }));
    let panic = r.expect_err("the source's panic goes on to the caller");
    assert_eq!(panic.downcast_ref::<&str>().copied(), Some("the tensor source panicked on purpose"));
    assert!(read_all(&st, &obj, &IoOptions::default()).unwrap() == old, "the old object is intact");
    let (status, body) = s.request("GET", "/panics?uploads", b"");
    let listing = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "{listing}");
    assert!(!listing.contains("<UploadId>"), "the multipart upload was aborted: {listing}");
}

/// The GETs run as tasks on the backend's runtime, writing into the caller's memory: every way
/// a read can stop early (a hook's error, a cancellation, a hook that panics) must end it with
/// the right answer, stop sending requests, and leave no task behind (the backend reads
/// correctly afterwards).
#[test]
fn a_read_stopped_by_its_hook_or_a_cancellation_ends_cleanly() {
    let Some(s) = server() else { return };
    s.create_bucket("stops");
    let st = storage(&s, &[("part_size", "5MiB"), ("prefix_bytes", "4096"), ("concurrency", "2")]);
    let data = pattern(60 << 20, 7);
    let obj = url("s3://stops/a.bin");
    st.write_file(&obj, &BytesSource(&data), &IoOptions::default()).unwrap();
    let parts = (data.len() as u64).div_ceil(5 << 20);
    s.faults("{}");
    let gets = || s.stat("gets");

    // A hook's error is the read's answer (not the cancellations it causes), and the parts not
    // yet asked for are never asked for.
    let before = gets();
    let hooked = std::sync::atomic::AtomicUsize::new(0);
    let hook = |off: u64, _: &mut [u8]| {
        hooked.fetch_add(1, Ordering::Relaxed);
        Err(StorageError::Io {
            path: "hook".into(),
            op: "decrypt",
            source: std::io::Error::other(format!("bad part at {off}")),
        })
    };
    let err = read_all(&st, &obj, &IoOptions { hook: Some(&hook), ..Default::default() }).unwrap_err();
    assert!(err.to_string().contains("bad part at"), "{err}");
    assert_eq!(hooked.load(Ordering::Relaxed), 1, "the hook ran after the first error");
    assert!(gets() - before < parts, "{} GETs for a read that failed on its first part", gets() - before);

    // A cancellation (here asked from the progress of the first part) ends the read with
    // `Cancelled`.
    let before = gets();
    let cancel = AtomicBool::new(false);
    let hook = |_: u64, _: &mut [u8]| {
        cancel.store(true, Ordering::Relaxed);
        Ok(())
    };
    let err =
        read_all(&st, &obj, &IoOptions { hook: Some(&hook), cancel: Some(&cancel), ..Default::default() }).unwrap_err();
    assert!(matches!(err, StorageError::Cancelled), "{err}");
    assert!(gets() - before < parts, "{} GETs for a read cancelled on its first part", gets() - before);

    // A hook that panics: the panic reaches the caller once the tasks in flight have stopped.
    let hook = |_: u64, _: &mut [u8]| -> Result<(), StorageError> { panic!("a hook that panics") };
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        read_all(&st, &obj, &IoOptions { hook: Some(&hook), ..Default::default() })
    }));
    assert!(panicked.is_err());

    // Nothing of those reads is left running: the next read is whole and right.
    assert!(read_all(&st, &obj, &IoOptions::default()).unwrap() == data);
}
