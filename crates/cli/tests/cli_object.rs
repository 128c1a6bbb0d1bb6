//! The CLI on object-store URLs, against a real S3 server on 127.0.0.1 (moto's, started by the
//! test through the venv's Python): gen, inspect, load --check of files and model prefixes,
//! options from the environment and from --storage-option, errors.

#[path = "../../../tests/src/hostile_http.rs"]
#[allow(dead_code)]
mod hostile_http;
#[path = "../../../tests/src/python.rs"]
mod python;
#[path = "../../../tests/src/s3.rs"]
#[allow(dead_code)]
mod s3;

use std::process::Command;

struct Fixture {
    server: s3::S3Server,
}

fn fixture(bucket: &str, _extra: &[(&str, &str)]) -> Option<Fixture> {
    let server = s3::S3Server::start(&python::python()?);
    server.create_bucket(bucket);
    Some(Fixture { server })
}

#[test]
fn the_cli_loads_inspects_and_writes_urls() {
    let Some(fx) = fixture("cli", &[]) else { return };
    let bin = env!("CARGO_BIN_EXE_turboio");
    let command = |args: &[&str]| {
        let mut c = Command::new(bin);
        c.args(args)
            .env("AWS_ENDPOINT_URL", fx.server.endpoint())
            .env("AWS_ACCESS_KEY_ID", s3::ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", s3::SECRET_KEY)
            .env("AWS_REGION", "us-east-1");
        c
    };
    let result = |c: &mut Command| {
        let out = c.output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let run = |args: &[&str]| result(&mut command(args));
    let (ok, out) = run(&["gen", "s3://cli/s.safetensors", "--size", "2MiB"]);
    assert!(ok, "{out}");
    let (ok, out) = run(&["load", "s3://cli/s.safetensors", "--check"]);
    assert!(ok && out.contains("a plain read of the"), "{out}");
    // A plain-HTTP endpoint with static keys needs no root certificates: a machine (or a slim
    // container) without any loads from it ("builder error" before they were left out).
    let no_certificates = &mut command(&["load", "s3://cli/s.safetensors", "--check"]);
    let (ok, out) =
        result(no_certificates.env("SSL_CERT_FILE", "/nonexistent/ca.pem").env("SSL_CERT_DIR", "/nonexistent"));
    assert!(ok && out.contains("a plain read of the"), "{out}");
    let (ok, out) = run(&["gen", "s3://cli/model", "--size", "3MiB", "--shards", "3"]);
    assert!(ok, "{out}");
    let (ok, out) = run(&["inspect", "s3://cli/model", "--json"]);
    assert!(ok && out.contains("model.safetensors.index.json"), "{out}");
    let (ok, out) = run(&["load", "s3://cli/model", "--check"]);
    assert!(ok && out.contains("a plain read of the"), "{out}");
    // Explicit options instead of the environment; a bad one is refused before anything runs.
    let opt = format!("endpoint={}", fx.server.endpoint());
    let out = Command::new(bin)
        .args(["inspect", "s3://cli/s.safetensors", "--storage-option", &opt, "--storage-option", "region=us-east-1"])
        .args(["--storage-option", &format!("access_key_id={}", s3::ACCESS_KEY)])
        .args(["--storage-option", &format!("secret_access_key={}", s3::SECRET_KEY)])
        .env_remove("AWS_ENDPOINT_URL")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (ok, out) = run(&["load", "s3://cli/s.safetensors", "--storage-option", "concurrency=0"]);
    assert!(!ok && out.contains("concurrency") && out.contains("at least 1"), "{out}");
    // Errors name the URL and never the secret.
    let (ok, out) = run(&["load", "s3://cli/missing.safetensors"]);
    assert!(!ok && out.contains("s3://cli/missing.safetensors") && !out.contains(s3::SECRET_KEY), "{out}");
}

/// Runs the binary with a deadline (a hang fails the test instead of stalling it).
fn bounded(args: &[&str]) -> (bool, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_turboio"))
        .args(args)
        .env_remove("TURBOIO_CACHE_DIR")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("turboio {args:?} hung");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
}

#[test]
fn hostile_servers_and_secret_urls_get_clear_errors_from_the_cli() {
    use hostile_http::{Answer, Body, HostileServer};
    // Issue 48, item 1: a first answer with a sane Content-Range and a body without end made
    // `inspect` collect it until the allocation failed (an abort).
    let endless = HostileServer::start(|_| Answer::Respond {
        status: 206,
        headers: vec![("Content-Range".into(), "bytes 0-1048575/2097152".into())],
        body: Body::Endless,
    });
    let url = endless.url("model.safetensors");
    let (ok, out) = bounded(&["inspect", &url]);
    assert!(!ok && out.contains(&url) && out.contains("more than the 1048576 bytes"), "{out}");
    assert!(!out.contains("memory allocation") && !out.contains("panicked"), "{out}");
    // Item 3: a query is refused before any request (it was taken for a model prefix and
    // listed, with retries); item 4: its secrets are not shown.
    let quiet = HostileServer::start(|_| Answer::status(404));
    let signed = quiet.url("model.safetensors?X-Amz-Signature=sekrit&X-Amz-Security-Token=tokentoken");
    for command in ["inspect", "load"] {
        let (ok, out) = bounded(&[command, &signed]);
        assert!(
            !ok && out.contains("query string") && out.contains(&quiet.url("model.safetensors?<redacted>")),
            "{out}"
        );
        assert!(!out.contains("sekrit") && !out.contains("tokentoken"), "{out}");
    }
    assert!(quiet.requests().is_empty(), "{:?}", quiet.requests());
    // Issue 49, item 8: no credentials anywhere. The chain's last resort, the instance-metadata
    // service, is pointed at a closed port here (this machine reaches nothing beyond loopback,
    // and a test must never ask the cloud's); its failure was all the error said.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let out = Command::new(env!("CARGO_BIN_EXE_turboio"))
        .args(["inspect", "s3://bucket/model.safetensors", "--storage-option", "max_retries=0"])
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env_remove("AWS_SESSION_TOKEN")
        .env_remove("AWS_PROFILE")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{closed}"))
        .env("AWS_METADATA_ENDPOINT", format!("http://127.0.0.1:{closed}"))
        .env_remove("TURBOIO_CACHE_DIR")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("s3://bucket/model.safetensors") && err.contains("no credentials found"), "{err}");
    assert!(err.contains("AWS_ACCESS_KEY_ID") && err.trim_end().lines().count() == 1, "one line: {err}");
    let with_user = format!("http://bob:pa55word@127.0.0.1:{}/missing.safetensors", quiet.port());
    let (ok, out) = bounded(&["load", &with_user]);
    assert!(!ok && !out.contains("pa55word") && out.contains("missing.safetensors"), "{out}");
}

/// Issue 49, item 7: a remote load's bar showed a total of 0 B, was full from the first frame
/// and printed rates like 555 GiB/s, in MiB where the command's lines say MB. Drawn only on a
/// terminal: the binary runs under `script`, which gives it one.
#[test]
fn a_remote_loads_progress_bar_has_its_total_and_the_commands_units() {
    use hostile_http::{Answer, Body, HostileServer, Object};
    if std::process::Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: no `script` (util-linux) to run the binary on a terminal");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("bar.safetensors");
    let o =
        Command::new(env!("CARGO_BIN_EXE_turboio")).args(["gen", file.to_str().unwrap(), "--size", "20MiB"]).output();
    assert!(o.unwrap().status.success());
    let data: &'static [u8] = Vec::leak(std::fs::read(&file).unwrap());
    // Every part after the first GET waits 0.4 s: the load lasts long enough to draw.
    let s = HostileServer::start(move |r| match (Object { data, etag: Some("v1"), last_modified: None }).answer(r) {
        Answer::Respond { status: 206, headers, body: Body::Bytes(b) } if r.range().is_some_and(|x| x.start > 0) => {
            Answer::Respond { status: 206, headers, body: Body::Stall(std::time::Duration::from_millis(400), b) }
        }
        other => other,
    });
    let cmd = format!("{} load {}", env!("CARGO_BIN_EXE_turboio"), s.url("bar.safetensors"));
    let out =
        Command::new("script").args(["-qfec", &cmd, "/dev/null"]).env_remove("TURBOIO_CACHE_DIR").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "\n");
    assert!(out.status.success(), "{text}");
    let frames: Vec<&str> = text.lines().filter(|l| l.contains("loading ") && l.contains('[')).collect();
    assert!(!frames.is_empty(), "no bar drawn: {text}");
    let total = std::fs::metadata(&file).unwrap().len() as f64 / 1e6;
    for f in &frames {
        assert!(f.contains(&format!("/{total:.2} MB")), "every frame has the total ({total:.2} MB): {f}");
        assert!(!f.contains("iB") && !f.contains("GB/s"), "decimal units, a sane rate: {f}");
    }
    assert!(!frames[0].contains("[=============================="), "not full from the first frame: {}", frames[0]);
}

#[test]
fn the_node_cache_serves_later_loads_and_concurrent_processes_fetch_once() {
    let Some(fx) = fixture("cached", &[]) else { return };
    let bin = env!("CARGO_BIN_EXE_turboio");
    let dir = tempfile::tempdir().unwrap();
    let command = |args: &[&str]| {
        let mut c = Command::new(bin);
        c.args(args)
            .env("AWS_ENDPOINT_URL", fx.server.endpoint())
            .env("AWS_ACCESS_KEY_ID", s3::ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", s3::SECRET_KEY)
            .env("AWS_REGION", "us-east-1")
            .env_remove("TURBOIO_CACHE_DIR");
        c
    };
    let run = |args: &[&str]| {
        let out = command(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let size: u64 = 64 << 20;
    // The cache keeps 5% of its file system free and stores nothing that would eat into it (a
    // fetch then only loads): on a nearly full disk there is nothing to test.
    if let Ok(fs) = nix::sys::statvfs::statvfs(dir.path()) {
        let unit = fs.fragment_size();
        let (total, free) = (fs.blocks() * unit, fs.blocks_available() * unit);
        if free < total / 20 + 4 * size {
            eprintln!(
                "skipped: {} has {free} bytes free, under the cache's 5% reserve plus the object",
                dir.path().display()
            );
            return;
        }
    }
    let (ok, out) = run(&["gen", "s3://cached/m.safetensors", "--size", "64MiB"]);
    assert!(ok, "{out}");
    let cache = dir.path().join("cache");
    let cache_arg = cache.to_str().unwrap();

    // Cold: fetched once (plus the opening GETs of the header), published, listed.
    fx.server.faults("{}");
    let (ok, out) = run(&["--cache-dir", cache_arg, "load", "s3://cached/m.safetensors", "--check"]);
    assert!(ok && out.contains("a plain read of the"), "{out}");
    assert!(out.contains("node cache: miss, written through"), "a miss is reported: {out}");
    let cold = fx.server.stat("get_bytes");
    assert!(cold >= size && cold <= size + (3 << 20), "cold load fetched {cold} bytes");
    let (ok, out) = run(&["--cache-dir", cache_arg, "cache", "ls"]);
    assert!(ok && out.contains("s3://cached/m.safetensors") && out.contains("1 entry,"), "{out}");
    // Sizes as everywhere else, under a header (issue 49, item 12).
    assert!(
        out.contains("SIZE") && out.contains("LAST USED") && out.contains(" MB") && out.contains(" s ago"),
        "{out}"
    );

    // Warm, from the environment this time: no byte from the server (one HEAD per open).
    fx.server.faults("{}");
    let out =
        command(&["load", "s3://cached/m.safetensors", "--check"]).env("TURBOIO_CACHE_DIR", &cache).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("a plain read of the"), "{text}");
    assert!(text.contains("node cache: hit"), "a hit is reported (issue 49, item 12): {text}");
    assert_eq!(fx.server.stat("get_bytes"), 0, "a warm load reads the local entry");

    // Trusting the version seen for an hour: after one load that asks, none asks anything.
    let trusted =
        ["--cache-dir", cache_arg, "--cache-revalidate", "1h", "load", "s3://cached/m.safetensors", "--check"];
    let (ok, out) = run(&trusted);
    assert!(ok && out.contains("a plain read of the"), "{out}");
    fx.server.faults("{}");
    let (ok, out) = run(&trusted);
    assert!(ok && out.contains("a plain read of the"), "{out}");
    assert_eq!(fx.server.stat("requests"), 0, "no request to the store within the interval");
    let (ok, out) = run(&["--cache-revalidate", "soon", "load", "s3://cached/m.safetensors"]);
    assert!(!ok && out.contains("soon") && out.contains("not an interval"), "{out}");

    // A new object version is a miss.
    let size: u64 = 48 << 20;
    let (ok, out) = run(&["gen", "s3://cached/m.safetensors", "--size", "48MiB"]);
    assert!(ok, "{out}");
    fx.server.faults("{}");
    let (ok, out) = run(&["--cache-dir", cache_arg, "load", "s3://cached/m.safetensors", "--check"]);
    assert!(ok && out.contains("a plain read of the"), "{out}");
    assert!(fx.server.stat("get_bytes") >= size);
    // The replaced version's entry went when the new one was published (issue 49, item 12).
    let (ok, out) = run(&["--cache-dir", cache_arg, "cache", "du"]);
    assert!(ok && out.contains("1 entry,") && out.contains(" MB in"), "{out}");

    // Four processes on a cold cache: the object is served about once (each process that takes
    // the fetch for a moment, to look at the header, costs one opening GET of 1 MiB more).
    let size: u64 = 96 << 20;
    let (ok, out) = run(&["gen", "s3://cached/big.safetensors", "--size", "96MiB"]);
    assert!(ok, "{out}");
    let cold_dir = dir.path().join("cold");
    fx.server.faults("{}");
    let children: Vec<_> = (0..4)
        .map(|_| {
            command(&["--cache-dir", cold_dir.to_str().unwrap(), "load", "s3://cached/big.safetensors", "--check"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in children {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("a plain read of the"), "{text}");
    }
    let served = fx.server.stat("get_bytes");
    assert!(served as f64 <= 1.1 * size as f64, "four processes made the server send {served} bytes for {size}");

    // prune: down to one entry, then all; a missing directory is an error only without one.
    let (ok, out) = run(&["--cache-dir", cache_arg, "cache", "prune", "--max-size", "50MiB"]);
    assert!(ok && out.contains("removed 0 entries"), "{out}");
    let (ok, out) = run(&["--cache-dir", cache_arg, "cache", "prune"]);
    assert!(ok && out.contains("removed 1 entry (") && out.contains(" MB)"), "{out}");
    // Nothing left behind: no lock file, no record.
    let left: Vec<_> = std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "{left:?}");
    let (ok, out) = run(&["cache", "ls"]);
    assert!(!ok && out.contains("--cache-dir"), "{out}");
    let (ok, out) = run(&["--cache-dir", cache_arg, "--cache-max-size", "lots", "cache", "ls"]);
    assert!(!ok && out.contains("lots"), "{out}");

    // A model under a prefix, warm (its index and shards read from the cache while the server
    // is asked), then saved again as a smaller model: the warm load notices and loads the new one.
    let megabytes = |out: &str| -> f64 {
        let before = out.split(" MB in ").next().unwrap_or_default();
        before.rsplit(' ').next().unwrap_or_default().parse().unwrap_or_else(|_| panic!("no size in {out}"))
    };
    let (ok, out) = run(&["gen", "s3://cached/model", "--shards", "3", "--size", "6MiB"]);
    assert!(ok, "{out}");
    for _ in 0..2 {
        let (ok, out) = run(&["--cache-dir", cache_arg, "load", "s3://cached/model", "--check"]);
        assert!(ok && out.contains("a plain read of the") && megabytes(&out) > 6.0, "{out}");
    }
    fx.server.faults("{}");
    let (ok, out) = run(&["--cache-dir", cache_arg, "load", "s3://cached/model", "--check"]);
    assert!(ok && megabytes(&out) > 6.0, "{out}");
    assert_eq!(fx.server.stat("get_bytes"), 0, "a warm model load reads the local entries");
    // One shard's entry goes (as an eviction would take it): the stale index then names a shard
    // that is neither cached nor in the store any more, and the load must still end with the
    // new model, not that shard's "no such file".
    let (ok, listing) = run(&["--cache-dir", cache_arg, "cache", "ls", "--json"]);
    assert!(ok, "{listing}");
    let entry = listing.split('}').find(|e| e.contains("model-00002-of-00003")).expect("the second shard's entry");
    let data = entry.split("\"path\": \"").nth(1).and_then(|p| p.split('"').next()).expect("its path");
    std::fs::remove_file(data).unwrap();
    let (ok, out) = run(&["gen", "s3://cached/model", "--shards", "2", "--size", "4MiB"]);
    assert!(ok, "{out}");
    let (ok, out) = run(&["--cache-dir", cache_arg, "load", "s3://cached/model", "--check"]);
    assert!(ok && out.contains("a plain read of the") && megabytes(&out) < 5.0, "{out}");
}
