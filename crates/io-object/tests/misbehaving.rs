//! Object stores that misbehave, each a small HTTP server on 127.0.0.1 started by the test
//! (`tests/src/hostile_http.rs`) in front of the real backend: endless bodies, wrong
//! `Content-Range`, `If-Match` ignored, no ETag, a version switch mid-load, 5xx storms, reset
//! connections, a redirect to another host, URLs with secrets, a fork while GETs are in
//! flight. Each ends in a correct load or a clear error naming the URL (redacted), within a
//! deadline: never a hang, an abort or a mix of two versions (issue 48, items 1-5).

#[path = "../../../tests/src/hostile_http.rs"]
#[allow(dead_code)]
mod hostile_http;

use hostile_http::{Answer, Body, HostileServer, Object, Request};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;
use turboio_io_object::{ObjectOptions, ObjectStorage};
use turboio_storage::conformance::pattern;
use turboio_storage::{IoOptions, ReadRequest, Storage, StorageError};

/// Far above what any case needs (a few retries with backoff), far below a hang.
const DEADLINE: Duration = Duration::from_secs(90);

/// 3 parts of 5 MiB after a 4 KiB first GET.
const SIZE: usize = (12 << 20) + 11;

const MONDAY: &str = "Mon, 23 Nov 2026 10:00:00 GMT";
const TUESDAY: &str = "Tue, 24 Nov 2026 10:00:00 GMT";

fn storage(extra: &[(&str, &str)]) -> ObjectStorage {
    let mut pairs =
        vec![("prefix_bytes", "4096"), ("part_size", "5MiB"), ("max_retries", "2"), ("retry_timeout", "10")];
    pairs.extend_from_slice(extra);
    ObjectStorage::new(ObjectOptions::from_pairs(pairs).unwrap())
}

/// Opens `url` and reads all of it, on another thread, failing the test if that takes longer
/// than [`DEADLINE`].
fn read_all(st: &ObjectStorage, url: &str) -> Result<Vec<u8>, StorageError> {
    let (st, url) = (st.clone(), url.to_owned());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = (|| {
            let f = st.open(Path::new(&url))?;
            let mut buf = vec![0u8; f.len() as usize];
            f.read_ranges(
                vec![ReadRequest { offset: 0, dst: &mut buf }],
                &IoOptions { threads: 2, ..Default::default() },
            )?;
            Ok(buf)
        })();
        let _ = tx.send(r);
    });
    rx.recv_timeout(DEADLINE).expect("the read hung")
}

/// An error that names the URL (as shown: no query, no user info) and says `what`.
fn assert_error(r: Result<Vec<u8>, StorageError>, url: &str, what: &str) -> String {
    let e = r.err().unwrap_or_else(|| panic!("{url}: loaded, but should have failed with {what:?}")).to_string();
    assert!(e.contains(url), "the error names the URL {url}: {e}");
    assert!(e.contains(what), "the error says {what:?}: {e}");
    e
}

fn gets(s: &HostileServer) -> Vec<Request> {
    s.requests().into_iter().filter(|r| r.method == "GET").collect()
}

#[test]
fn an_endless_body_fails_the_read_with_bounded_memory() {
    // A server answering every GET with 206, this Content-Range and a body without end.
    let endless = |range: String, body: fn() -> Body| {
        HostileServer::start(move |_| Answer::Respond {
            status: 206,
            headers: vec![("Content-Range".into(), range.clone())],
            body: body(),
        })
    };
    // The first GET: a sane Content-Range, then a body without end.
    let s = endless(format!("bytes 0-4095/{SIZE}"), || Body::Endless);
    let url = s.url("endless.safetensors");
    assert_error(read_all(&storage(&[]), &url), &url, "more than the 4096 bytes");

    // The same with the default 1 MiB first GET and a claimed 2 MiB object (the review's case).
    let s = endless("bytes 0-1048575/2097152".into(), || Body::Endless);
    let url = s.url("endless.safetensors");
    assert_error(read_all(&ObjectStorage::default(), &url), &url, "more than the 1048576 bytes");

    // Chunked without end: no length at all.
    let s = endless("bytes 0-1048575/2097152".into(), || Body::EndlessChunked);
    let url = s.url("chunked.safetensors");
    assert_error(read_all(&ObjectStorage::default(), &url), &url, "Content-Length");

    // Later GETs: an honest first answer, then endless parts.
    let data = pattern(SIZE, 1);
    let s = HostileServer::start(move |r| match r.index {
        0 => Object { data: &data, etag: Some("v1"), last_modified: None }.answer(r),
        _ => {
            let range = r.range().unwrap();
            Answer::Respond {
                status: 206,
                headers: vec![
                    ("ETag".into(), "\"v1\"".into()),
                    ("Content-Range".into(), format!("bytes {}-{}/{SIZE}", range.start, range.end - 1)),
                ],
                body: Body::Endless,
            }
        }
    });
    let url = s.url("endless-parts.safetensors");
    assert_error(read_all(&storage(&[]), &url), &url, "more than the");
}

#[test]
fn a_wrong_content_range_is_refused() {
    let data = pattern(SIZE, 2);
    // The first answer starts elsewhere than asked.
    let d = data.clone();
    let s = HostileServer::start(move |r| {
        let Some(mut range) = r.range() else { return Answer::status(405) };
        range.start += 100;
        Answer::Respond {
            status: 206,
            headers: vec![("Content-Range".into(), format!("bytes {}-{}/{SIZE}", range.start, range.end - 1))],
            body: Body::Bytes(d[range.start as usize..range.end as usize].to_vec()),
        }
    });
    let url = s.url("shifted.safetensors");
    assert_error(read_all(&storage(&[]), &url), &url, "Requested 0..4096, got 100..4096");
    // A later part answered with another range.
    let s = HostileServer::start(move |r| match r.range() {
        Some(range) if range.start > 0 => {
            let (a, b) = (range.start - 1, range.end - 1);
            Answer::Respond {
                status: 206,
                headers: vec![
                    ("ETag".into(), "\"v1\"".into()),
                    ("Content-Range".into(), format!("bytes {a}-{}/{SIZE}", b - 1)),
                ],
                body: Body::Bytes(data[a as usize..b as usize].to_vec()),
            }
        }
        _ => Object { data: &data, etag: Some("v1"), last_modified: None }.answer(r),
    });
    let url = s.url("shifted-parts.safetensors");
    let e = assert_error(read_all(&storage(&[]), &url), &url, "Requested ");
    assert!(e.contains(", got "), "{e}");
}

/// A server that switches from `old` to `new` after the first request, ignoring every
/// condition the client sends.
fn switching(old: Object<'static>, new: Object<'static>) -> HostileServer {
    HostileServer::start(move |r| if r.index == 0 { old.answer(r) } else { new.answer(r) })
}

fn leak(v: Vec<u8>) -> &'static [u8] {
    Vec::leak(v)
}

#[test]
fn a_version_switch_mid_load_is_caught_whatever_the_server_ignores() {
    let (a, b) = (leak(pattern(SIZE, 3)), leak(pattern(SIZE, 4)));
    let st = storage(&[]);
    // ETags, If-Match ignored.
    let s = switching(
        Object { data: a, etag: Some("a"), last_modified: None },
        Object { data: b, etag: Some("b"), last_modified: None },
    );
    let url = s.url("m.safetensors");
    assert_error(read_all(&st, &url), &url, "changed while it was being read (its ETag went from \"a\" to \"b\")");
    assert!(gets(&s)[1..].iter().all(|r| r.header("if-match") == Some("\"a\"")), "later GETs carry If-Match");
    // Same ETag, another size.
    let s = switching(
        Object { data: a, etag: Some("a"), last_modified: None },
        Object { data: &b[..SIZE - 1], etag: Some("a"), last_modified: None },
    );
    let url = s.url("m.safetensors");
    assert_error(read_all(&st, &url), &url, &format!("its size went from {SIZE} to {} bytes", SIZE - 1));
    // No ETag: Last-Modified is pinned (and sent as If-Unmodified-Since).
    let s = switching(
        Object { data: a, etag: None, last_modified: Some(MONDAY) },
        Object { data: b, etag: None, last_modified: Some(TUESDAY) },
    );
    let url = s.url("m.safetensors");
    assert_error(read_all(&st, &url), &url, "its Last-Modified went from");
    assert!(gets(&s)[1..].iter().all(|r| r.header("if-unmodified-since") == Some(MONDAY)), "{:?}", gets(&s));
    // An ETag appearing where there was none is another version too.
    let s = switching(
        Object { data: a, etag: None, last_modified: Some(MONDAY) },
        Object { data: b, etag: Some("b"), last_modified: Some(MONDAY) },
    );
    let url = s.url("m.safetensors");
    assert_error(read_all(&st, &url), &url, "its ETag went from none to \"b\"");
    // Neither validator: the size still counts.
    let s = switching(
        Object { data: a, etag: None, last_modified: None },
        Object { data: &b[..SIZE - 7], etag: None, last_modified: None },
    );
    let url = s.url("m.safetensors");
    assert_error(read_all(&st, &url), &url, "its size went from");
}

#[test]
fn an_object_without_validators_loads_in_one_get_per_range() {
    let data = leak(pattern(SIZE, 5));
    let s = HostileServer::start(move |r| Object { data, etag: None, last_modified: None }.answer(r));
    let back = read_all(&storage(&[]), &s.url("plain.safetensors")).unwrap();
    assert!(back == data, "bytes differ");
    // The first GET, then the rest in one GET (with a validator it would be 3 parts).
    assert_eq!(gets(&s).len(), 2, "{:?}", gets(&s));
    let s = HostileServer::start(move |r| Object { data, etag: Some("e"), last_modified: None }.answer(r));
    assert!(read_all(&storage(&[]), &s.url("plain.safetensors")).unwrap() == data);
    assert_eq!(gets(&s).len(), 4, "{:?}", gets(&s));
}

#[test]
fn storms_and_resets_are_retried_or_fail_clearly() {
    let data = leak(pattern(SIZE, 6));
    let obj = move |r: &Request| Object { data, etag: Some("v"), last_modified: Some(MONDAY) }.answer(r);
    // Every third request a 503, every fifth a reset: retried, the bytes right.
    let s = HostileServer::start(move |r| match r.index {
        i if i % 3 == 1 => Answer::status(503),
        i if i % 5 == 2 => Answer::Reset,
        _ => obj(r),
    });
    assert!(read_all(&storage(&[]), &s.url("flaky.safetensors")).unwrap() == data, "bytes differ");
    assert!(s.requests().len() > 4);
    // Nothing but 500s: a clear error after the configured retries.
    let s = HostileServer::start(|_| Answer::status(500));
    let url = s.url("storm.safetensors");
    assert_error(read_all(&storage(&[]), &url), &url, "500");
    // The GET and the HEAD that tells an empty object from a failure, each tried 1 + 2 times.
    assert!(s.requests().len() <= 6, "max_retries 2: {} requests", s.requests().len());
    // Every connection reset after the first answer.
    let s = HostileServer::start(move |r| if r.index == 0 { obj(r) } else { Answer::Reset });
    let url = s.url("reset.safetensors");
    assert_error(read_all(&storage(&[]), &url), &url, "GET failed");
}

#[test]
fn a_redirect_to_another_host_loads_the_same_bytes_or_fails_clearly() {
    let data = leak(pattern(SIZE, 7));
    let target = HostileServer::start(move |r| Object { data, etag: Some("v"), last_modified: None }.answer(r));
    let to = target.url("elsewhere.safetensors");
    let s = HostileServer::start(move |_| Answer::Respond {
        status: 302,
        headers: vec![("Location".into(), to.clone())],
        body: Body::Bytes(vec![]),
    });
    let url = s.url("moved.safetensors");
    match read_all(&storage(&[]), &url) {
        Ok(back) => assert!(back == data, "a followed redirect gave other bytes"),
        Err(e) => assert!(e.to_string().contains(&url), "{e}"),
    }
}

#[test]
fn query_strings_are_refused_and_secrets_never_reach_errors() {
    let s = HostileServer::start(|_| Answer::status(404));
    // A presigned URL: refused before any request, its signature nowhere in the message.
    let signed = s.url("m.safetensors?X-Amz-Credential=AKIDSECRET&X-Amz-Signature=deadbeefsig");
    let e = assert_error(read_all(&storage(&[]), &signed), &s.url("m.safetensors?<redacted>"), "query string");
    assert!(!e.contains("AKIDSECRET") && !e.contains("deadbeefsig"), "{e}");
    let versioned = s.url("m.safetensors?versionId=v1");
    assert_error(read_all(&storage(&[]), &versioned), &s.url("m.safetensors?<redacted>"), "query string");
    assert!(s.requests().is_empty(), "no request for a refused URL: {:?}", s.requests());
    // User info: never shown.
    let with_user = format!("http://alice:hunter2@127.0.0.1:{}/missing.safetensors", s.port());
    let e = read_all(&storage(&[]), &with_user).unwrap_err().to_string();
    assert!(!e.contains("hunter2") && !e.contains("alice"), "{e}");
    assert!(e.contains(&format!("http://***@127.0.0.1:{}/missing.safetensors", s.port())), "{e}");
    // Nobody listening: object_store's own message quotes the URL it requested.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let e =
        read_all(&storage(&[("max_retries", "0")]), &format!("http://alice:hunter2@127.0.0.1:{closed}/m.safetensors"))
            .unwrap_err()
            .to_string();
    assert!(!e.contains("hunter2") && !e.contains("alice") && e.contains("m.safetensors"), "{e}");
}

#[test]
fn a_child_forked_while_gets_are_in_flight_reads_on_its_own_slots() {
    // "big" stalls every part for seconds (its GETs hold every request slot); "small" answers
    // at once.
    let big = leak(pattern(SIZE, 8));
    let small = leak(pattern(SIZE, 9));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let counter = in_flight.clone();
    let s = HostileServer::start(move |r| {
        if r.target.contains("big") {
            let o = Object { data: big, etag: Some("b"), last_modified: None }.answer(r);
            match o {
                Answer::Respond { status: 206, headers, body: Body::Bytes(b) } if r.range().unwrap().start > 0 => {
                    counter.fetch_add(1, Ordering::SeqCst);
                    Answer::Respond { status: 206, headers, body: Body::Stall(Duration::from_secs(4), b) }
                }
                other => other,
            }
        } else {
            Object { data: small, etag: Some("s"), last_modified: None }.answer(r)
        }
    });
    let st = storage(&[("concurrency", "2")]);
    let (st2, big_url) = (st.clone(), s.url("big.safetensors"));
    let load = std::thread::spawn(move || read_all(&st2, &big_url));
    while in_flight.load(Ordering::SeqCst) < 2 {
        std::thread::sleep(Duration::from_millis(10));
    }
    // Both slots are held by the parent's GETs now.
    let small_url = s.url("small.safetensors");
    // SAFETY: the child runs only the read below and leaves with `_exit`, never returning into
    // the test harness; the parent only waits for it.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let f = st.open(Path::new(&small_url));
        let ok = f.is_ok_and(|f| {
            let mut buf = vec![0u8; f.len() as usize];
            f.read_ranges(vec![ReadRequest { offset: 0, dst: &mut buf }], &IoOptions::default()).is_ok() && buf == small
        });
        // SAFETY: ends the child at once, without running the parent's destructors or atexit
        // handlers.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let deadline = std::time::Instant::now() + DEADLINE;
    let status = loop {
        let mut status = 0;
        // SAFETY: waits for our own child, WNOHANG.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break status;
        }
        if std::time::Instant::now() > deadline {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the forked child hung on the parent's request slots");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child's read failed: {status}");
    assert!(load.join().unwrap().unwrap() == big, "the parent's load");
}
