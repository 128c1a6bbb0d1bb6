//! The CLI on object-store URLs, against a real S3 server on 127.0.0.1 (moto's, started by the
//! test through the venv's Python): gen, inspect, load --check of files and model prefixes,
//! options from the environment and from --storage-option, errors.

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
    let run = |args: &[&str]| {
        let out = Command::new(bin)
            .args(args)
            .env("AWS_ENDPOINT_URL", fx.server.endpoint())
            .env("AWS_ACCESS_KEY_ID", s3::ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", s3::SECRET_KEY)
            .env("AWS_REGION", "us-east-1")
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, out) = run(&["gen", "s3://cli/s.safetensors", "--size", "2MiB"]);
    assert!(ok, "{out}");
    let (ok, out) = run(&["load", "s3://cli/s.safetensors", "--check"]);
    assert!(ok && out.contains("check: all"), "{out}");
    let (ok, out) = run(&["gen", "s3://cli/model", "--size", "3MiB", "--shards", "3"]);
    assert!(ok, "{out}");
    let (ok, out) = run(&["inspect", "s3://cli/model", "--json"]);
    assert!(ok && out.contains("model.safetensors.index.json"), "{out}");
    let (ok, out) = run(&["load", "s3://cli/model", "--check"]);
    assert!(ok && out.contains("check: all"), "{out}");
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
