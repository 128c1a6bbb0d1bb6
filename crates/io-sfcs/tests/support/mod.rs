//! The fake libcloudfs (crates/io-sfcs/fake-cloudfs), built on demand, and test clusters on it.
//!
//! `cargo test` does not build cdylib crates that nothing links, so the first test that needs
//! the fake runs `$CARGO build -p turboio-fake-cloudfs` into the same target directory and
//! profile as the running test binary, once per process, and loads
//! `<target>/<profile>/libturboio_fake_cloudfs.so` through the backend's real loading code.
//! Faults are chosen by `FAKE_CFS_FAULTS`; tests that inject them re-run themselves in a child
//! process with that variable set ([`in_child`]), so no test changes its own environment.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use turboio_io_sfcs::{SfcsStorage, Vars};

/// The fake library, built once.
pub fn fake_lib() -> PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let exe = std::env::current_exe().expect("current_exe");
        // <target>/<profile>/deps/<test binary>
        let profile_dir = exe.parent().and_then(Path::parent).expect("the test binary is in <target>/<profile>/deps");
        let target_dir = profile_dir.parent().expect("target dir");
        let profile = profile_dir.file_name().and_then(|n| n.to_str()).unwrap_or("debug");
        // The workspace root: the first ancestor of this package with the lock file.
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        let root = here.ancestors().find(|d| d.join("Cargo.lock").exists()).unwrap_or(here);
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(root)
            .args(["build", "--quiet", "-p", "turboio-fake-cloudfs"])
            .env("CARGO_TARGET_DIR", target_dir);
        if profile != "debug" {
            cmd.args(["--profile", if profile == "release" { "release" } else { profile }]);
        }
        let status = cmd.status().expect("run cargo build -p turboio-fake-cloudfs");
        assert!(status.success(), "building the fake libcloudfs failed: {status}");
        let lib = profile_dir.join("libturboio_fake_cloudfs.so");
        assert!(lib.exists(), "{} was not built", lib.display());
        lib
    })
    .clone()
}

/// Variables of a test cluster: static credentials, the fake library, nothing read from the
/// machine (no policy file, no credential files, no datapipe socket).
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub vars: HashMap<String, String>,
}

impl Cluster {
    /// A cluster whose SFCS root is the local `/` (SFCS path = local path), so tests can look
    /// at what the backend left behind with `std::fs`.
    pub fn new() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let mut vars = HashMap::new();
        for (k, v) in [
            ("SFCS_FSNAME", "fs-test"),
            ("SFCS_REGION", "cn-test"),
            ("SFCS_UFS_PATH", "file:///"),
            ("SFCS_NS_ID", "ns-1"),
            ("SFCS_NETWORK_SEGMENT", "10.0.0.0/8"),
            ("SFCS_MULTI_NIC_WHITELIST", "eth0"),
            ("SFCS_AUTHENTICATION_SERVICE_NAME", "auth-svc"),
            ("SFCS_ACCESS_KEY", "AKTEST"),
            ("SFCS_SECRET_KEY", "SK-very-secret-value"),
            ("SFCS_NAMENODE_ENDPOINT_ADDRESS", "10.1.2.3"),
        ] {
            vars.insert(k.to_string(), v.to_string());
        }
        vars.insert("LIBCFS_PATH".into(), fake_lib().display().to_string());
        vars.insert("SFCS_METAINFO_PATH".into(), d.join("no-policies.json").display().to_string());
        vars.insert("CREDENTIAL_PATH".into(), d.join("no-credentials").display().to_string());
        vars.insert("DATAPIPE_SOCKET_PATH".into(), d.join("no-datapipe.sock").display().to_string());
        Cluster { dir, vars }
    }

    pub fn set(&mut self, k: &str, v: &str) -> &mut Self {
        self.vars.insert(k.into(), v.into());
        self
    }

    pub fn unset(&mut self, k: &str) -> &mut Self {
        self.vars.remove(k);
        self
    }

    pub fn vars(&self) -> Vars {
        let m = self.vars.clone();
        Arc::new(move |k: &str| m.get(k).cloned().filter(|v| !v.is_empty()))
    }

    pub fn storage(&self) -> SfcsStorage {
        SfcsStorage::with_vars(self.vars())
    }

    /// A scratch directory (a local path that is also its SFCS path).
    pub fn scratch(&self, name: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::create_dir_all(&p).unwrap();
        p
    }
}

/// In the parent: re-runs test `name` in a child process with `FAKE_CFS_FAULTS=faults` (and the
/// extra variables) and returns `false`; the caller returns. In the child: `true`, the caller
/// runs the test body.
pub fn in_child(name: &str, faults: &str, extra: &[(&str, &str)]) -> bool {
    if std::env::var_os("TURBOIO_SFCS_CHILD").is_some() {
        return true;
    }
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env("TURBOIO_SFCS_CHILD", "1")
        .env("FAKE_CFS_FAULTS", faults);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && text.contains("1 passed"),
        "child run of {name} with faults {faults:?} failed:\n{text}"
    );
    false
}

/// Names (not `.`-hidden filtering: everything) in a local directory, sorted.
pub fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}
