//! The SFCS backend over the fake libcloudfs: the storage conformance suite, every injected
//! fault, the configuration and its XML, and the datapipe STS refresh.

mod support;

use support::*;
use turboio_storage::conformance::{self, Capabilities};
use turboio_storage::IoOptions;

#[test]
fn conformance_suite_over_the_fake_library() {
    let c = Cluster::new();
    let s = c.storage();
    for threads in [4, 1] {
        let dir = c.scratch(&format!("conformance-{threads}"));
        let opts = IoOptions { threads, ..Default::default() };
        conformance::run_all(&s, &dir, Capabilities { local_dir: true, directories: true, lists: false }, &opts);
    }
}

use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicBool, Ordering};
use turboio_storage::conformance::pattern;
use turboio_storage::{BytesSource, ReadRequest, Storage, StorageError};

fn read_whole(s: &turboio_io_sfcs::SfcsStorage, path: &Path, opts: &IoOptions<'_>) -> Result<Vec<u8>, StorageError> {
    let f = s.open_sfcs(path, None)?;
    let mut buf = vec![0u8; turboio_storage::StorageFile::len(&f) as usize];
    turboio_storage::StorageFile::read_ranges(&f, vec![ReadRequest { offset: 0, dst: &mut buf }], opts)?;
    Ok(buf)
}

/// The call record's path: chosen by the parent, inherited by the child.
fn log_path(what: &str) -> PathBuf {
    match std::env::var_os("FAKE_CFS_LOG") {
        Some(p) => PathBuf::from(p),
        None => std::env::temp_dir().join(format!("fake-cfs-log-{what}-{}", std::process::id())),
    }
}

fn sfcs(p: &Path) -> PathBuf {
    PathBuf::from(format!("sfcs:/{}", p.display()))
}

use std::path::{Path, PathBuf};

#[test]
fn sfcs_urls_and_plain_paths_name_the_same_file() {
    let c = Cluster::new();
    let s = c.storage();
    let dir = c.scratch("urls");
    let data = pattern(3 << 20, 3);
    s.write_file(&sfcs(&dir.join("m.bin")), &BytesSource(&data), &IoOptions::default()).unwrap();
    assert_eq!(std::fs::read(dir.join("m.bin")).unwrap(), data, "sfcs://{{dir}}/m.bin is {{dir}}/m.bin on the fake");
    assert_eq!(read_whole(&s, &dir.join("m.bin"), &IoOptions::default()).unwrap(), data);
    let f = s.open_sfcs(&sfcs(&dir.join("m.bin")), None).unwrap();
    assert_eq!(turboio_storage::StorageFile::path(&f), sfcs(&dir.join("m.bin")), "errors name the user's path");
    assert_eq!(f.sfcs_path(), dir.join("m.bin").to_str().unwrap());
    let err = s.open_sfcs(Path::new("sfcs://"), None).unwrap_err();
    assert!(matches!(err, StorageError::Setup { .. }), "{err:?}");
    let err = s.open_sfcs(Path::new("relative/x"), None).unwrap_err();
    assert!(err.to_string().contains("not an SFCS path"), "{err}");
    let err = s.open_sfcs(&dir.join("../x"), None).unwrap_err();
    assert!(err.to_string().contains(".."), "{err}");
}

#[test]
fn without_the_library_every_operation_names_libcfs_path() {
    let mut c = Cluster::new();
    c.set("LIBCFS_PATH", "/nonexistent/libcloudfs.so");
    let s = c.storage();
    let err = s.open_sfcs(Path::new("sfcs://m.safetensors"), None).unwrap_err();
    assert!(matches!(err, StorageError::Setup { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.starts_with("sfcs://m.safetensors: "), "{msg}");
    assert!(msg.contains("LIBCFS_PATH=/nonexistent/libcloudfs.so"), "{msg}");
    let err = s.write_file(Path::new("sfcs://m.bin"), &BytesSource(b"x"), &IoOptions::default()).unwrap_err();
    assert!(err.to_string().contains("LIBCFS_PATH=/nonexistent/libcloudfs.so"), "{err}");
    // The default path is veTurboIO's.
    c.unset("LIBCFS_PATH");
    assert_eq!(c.storage().library_path(), Path::new("/usr/lib/libcloudfs.so"));
}

#[test]
fn each_missing_setting_gives_veturboios_error() {
    for (var, expected) in [
        ("SFCS_NETWORK_SEGMENT", "NetworkError: Network setting is not valid"),
        ("SFCS_MULTI_NIC_WHITELIST", "NetworkError: Network setting is not valid"),
        ("SFCS_FSNAME", "RuntimeError: fsname is required"),
        ("SFCS_REGION", "RuntimeError: region is required"),
        ("SFCS_UFS_PATH", "RuntimeError: ufs_path is required"),
        ("SFCS_NS_ID", "RuntimeError: ns_id is required"),
        ("SFCS_AUTHENTICATION_SERVICE_NAME", "RuntimeError: authentication_service_name is required"),
    ] {
        let mut c = Cluster::new();
        c.unset(var);
        let err = c.storage().open_sfcs(Path::new("sfcs://data/m.bin"), None).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(expected), "without {var}: {msg}");
        assert!(msg.starts_with("sfcs://data/m.bin: "), "{msg}");
    }
    // Without a complete static key pair veTurboIO turns to the datapipe: with none there, the
    // error names its socket.
    let mut c = Cluster::new();
    c.unset("SFCS_SECRET_KEY");
    let msg = c.storage().open_sfcs(Path::new("sfcs://data/m.bin"), None).unwrap_err().to_string();
    assert!(msg.contains("no-datapipe.sock") && msg.contains("does not exist"), "{msg}");
    // Credential files count as static credentials; the name node is then required.
    let mut c = Cluster::new();
    let cred = c.dir.path().join("cred");
    std::fs::create_dir_all(&cred).unwrap();
    std::fs::write(cred.join("MLP_ACCESS_KEY"), "AKFILE\n").unwrap();
    std::fs::write(cred.join("MLP_SECRET_KEY"), "SKFILE\n").unwrap();
    c.set("CREDENTIAL_PATH", cred.to_str().unwrap()).unset("SFCS_SECRET_KEY").unset("SFCS_NAMENODE_ENDPOINT_ADDRESS");
    let msg = c.storage().open_sfcs(Path::new("sfcs://data/m.bin"), None).unwrap_err().to_string();
    assert!(msg.contains("CredentialError: Credential is not valid"), "{msg}");
    c.set("SFCS_SECRET_KEY", "SK2");
    let msg = c.storage().open_sfcs(Path::new("sfcs://data/m.bin"), None).unwrap_err().to_string();
    assert!(msg.contains("NetworkError: name node endpoint should be set setting is not valid"), "{msg}");
    // A policy file that exists but is not valid is an error naming it.
    let mut c = Cluster::new();
    let bad = c.dir.path().join("bad.json");
    std::fs::write(&bad, "{\"cache_policies\": {\"/x\": {\"bogus\": 1}}}").unwrap();
    c.set("SFCS_METAINFO_PATH", bad.to_str().unwrap());
    let msg = c.storage().open_sfcs(Path::new("sfcs://data/m.bin"), None).unwrap_err().to_string();
    assert!(msg.contains("bad.json") && msg.contains("bogus"), "{msg}");
}

/// The XML veTurboIO writes for the cluster's settings, by hand from its property list.
fn expected_xml(root: &str) -> String {
    let props = [
        ("cfs.filesystem.fs-mode", "ACC"),
        ("cfs.filesystem.resolve.addr.by.dns", "false"),
        ("cfs.metrics.emitters", "metric_server;local_prometheus"),
        ("cfs.client.metadata-cache.enable", "false"),
        ("rpc.client.channel.pool.size", "32"),
        ("dfs.default.replica", "2"),
        ("cfs.client.multi-nic.enabled", "true"),
        ("fs.datanode.router.ignore-main-nic", "true"),
        ("cfs.datanode.router.shuffle", "true"),
        ("dfs.default.uri", "cfs://fs-test.sfcs-cn-test.ivolces.com"),
        ("dfs.authentication.service.name", "auth-svc"),
        ("cfs.filesystem.ns-id", "ns-1"),
        ("cfs.filesystem.ufs-path", root),
        ("cfs.metrics.server.host", "metricserver-cn-test.cfs.ivolces.com"),
        ("cfs.client.multi-nic.whitelist", "eth0"),
        ("cfs.client.network.segment", "10.0.0.0/8"),
        ("dfs.client.log.severity", "INFO"),
        ("cfs.filesystem.task-id", "sfcs"),
        ("cfs.filesystem.sync-interval", "-1"),
        ("cfs.access.key", "AKTEST"),
        ("cfs.secret.key", "SK-very-secret-value"),
        ("cfs.namenode.endpoint.address.fs-test", "10.1.2.3"),
    ];
    let mut x = String::from(
        "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n\t<?xml-stylesheet type=\"text/xsl\" href=\"configuration.xsl\"?>\n\t<configuration>\n",
    );
    for (k, v) in props {
        x.push_str(&format!("\t\t<property>\n\t\t\t<name>{k}</name>\n\t\t\t<value>{v}</value>\n\t\t</property>\n"));
    }
    x.push_str("\t</configuration>\n");
    x
}

#[test]
fn xml_matches_veturboio_and_is_private() {
    let c = Cluster::new();
    let s = c.storage();
    let dir = c.scratch("xml");
    std::fs::write(dir.join("m.bin"), b"hello").unwrap();
    let f = s.open_sfcs(&sfcs(&dir.join("m.bin")), None).unwrap();
    let xml_path = f.config_file().to_path_buf();
    assert_eq!(std::fs::read_to_string(&xml_path).unwrap(), expected_xml("file:///"));
    assert_eq!(std::fs::metadata(&xml_path).unwrap().permissions().mode() & 0o777, 0o600);
    let conf_dir = xml_path.parent().unwrap();
    assert_eq!(std::fs::metadata(conf_dir).unwrap().permissions().mode() & 0o777, 0o700);
    let cwd = std::env::current_dir().unwrap();
    assert!(!conf_dir.starts_with(&cwd), "{} is under the working directory", conf_dir.display());
    // veTurboIO's file name for the group (`tmp`, the first component), after a unique prefix.
    assert!(xml_path.file_name().unwrap().to_str().unwrap().ends_with("-tmp.xml"), "{}", xml_path.display());
    assert_eq!(f.group(), "tmp");
    drop(f);
    assert!(!xml_path.exists(), "the XML (with credentials) is deleted with its last user");
}

#[test]
fn cache_policies_map_paths_and_pick_the_group() {
    let mut c = Cluster::new();
    let root = c.scratch("cache-root");
    std::fs::create_dir_all(root.join("sft_demo/ckpt")).unwrap();
    std::fs::write(root.join("sft_demo/ckpt/x.bin"), b"mapped").unwrap();
    let policies = c.dir.path().join("policies.json");
    std::fs::write(
        &policies,
        format!(
            r#"{{"cache_policies": {{"/sfcs/required": {{"mount_path": "/sfcs/required", "cache_prefix": "/sft_demo",
                "authentication_service_name": "auth-svc", "enable_dns": "false", "sfcs_fs_name": "fs-test",
                "region": "cn-test", "ufs_path": "file://{}", "ns_id": "ns-1", "name_node_endpoint": "ignored"}}}}}}"#,
            root.display()
        ),
    )
    .unwrap();
    c.set("SFCS_METAINFO_PATH", policies.to_str().unwrap())
        .unset("SFCS_UFS_PATH")
        .set("MLP_RDMA_NETWORK_SEGMENT", "192.168.0.0/16")
        .set("MLP_RDMA_NIC_NAMES", "eth9")
        .unset("SFCS_NETWORK_SEGMENT")
        .unset("SFCS_MULTI_NIC_WHITELIST");
    let s = c.storage();
    let f = s.open_sfcs(Path::new("sfcs://sfcs/required/ckpt/x.bin"), None).unwrap();
    assert_eq!(f.group(), "/sfcs/required");
    assert_eq!(f.sfcs_path(), "/sft_demo/ckpt/x.bin");
    let mut buf = [0u8; 6];
    turboio_storage::StorageFile::read_exact_at(&f, 0, &mut buf).unwrap();
    assert_eq!(&buf, b"mapped");
    let xml = std::fs::read_to_string(f.config_file()).unwrap();
    assert!(xml.ends_with("sfcs#required.xml") || f.config_file().to_str().unwrap().ends_with("sfcs#required.xml"));
    assert!(xml.contains("<name>cfs.client.network.segment</name>\n\t\t\t<value>192.168.0.0/16</value>"), "{xml}");
    assert!(xml.contains("<name>cfs.client.multi-nic.whitelist</name>\n\t\t\t<value>eth9</value>"), "{xml}");
}

#[test]
fn one_connection_and_one_cfs_file_per_reader_thread() {
    let log = log_path("threads");
    if !in_child("one_connection_and_one_cfs_file_per_reader_thread", "", &[("FAKE_CFS_LOG", log.to_str().unwrap())]) {
        let _ = std::fs::remove_file(&log);
        return;
    }
    let c = Cluster::new();
    let s = c.storage();
    let dir = c.scratch("threads");
    let data = pattern(6 << 20, 9);
    std::fs::write(dir.join("m.bin"), &data).unwrap();
    let _ = std::fs::remove_file(&log);
    let opts = IoOptions { threads: 4, chunk_size: 1 << 20, ..Default::default() };
    assert_eq!(read_whole(&s, &dir.join("m.bin"), &opts).unwrap(), data);
    let text = std::fs::read_to_string(&log).unwrap();
    let lines = |call: &str| text.lines().filter(|l| l.starts_with(&format!("{call} "))).collect::<Vec<_>>();
    assert_eq!(lines("cfsBuilderConnect").len(), 1, "{text}");
    let thread_of = |l: &&str| l.split(' ').nth(1).unwrap().to_string();
    let opens: Vec<String> = lines("cfsOpenFile").iter().map(thread_of).collect();
    let mut readers: Vec<String> = lines("cfsRead").iter().map(thread_of).collect();
    readers.sort();
    readers.dedup();
    let mut distinct = opens.clone();
    distinct.sort();
    distinct.dedup();
    // Workers that found no chunk left never open a file; each one that reads opens exactly one.
    assert_eq!(opens.len(), distinct.len(), "one cfsFile per reader thread: {text}");
    assert_eq!(distinct, readers, "{text}");
    assert!((1..=4).contains(&opens.len()), "{text}");
    assert_eq!(lines("cfsCloseFile").len(), opens.len(), "{text}");
    assert_eq!(lines("cfsDisconnect").len(), 1, "{text}");
}

/// `LIBCLOUDFS_CONF` is set once per process, to one path that never changes (a link pointed
/// at each connecting group's XML): changing the environment while other threads may read it
/// is undefined behaviour. Before, it was set to each group's XML at every connect.
/// A new directory whose first path component (the group the fake SDK's configuration is keyed
/// by) differs from `dir`'s: the project's directory, `/var/tmp` or `/dev/shm`, whichever is
/// writable and in another group (a checkout under `/tmp` shares the scratch directories' `tmp`).
fn other_group(dir: &Path) -> tempfile::TempDir {
    let first = |p: &Path| p.components().nth(1).map(|c| c.as_os_str().to_owned());
    let candidates = [Path::new(env!("CARGO_MANIFEST_DIR")), Path::new("/var/tmp"), Path::new("/dev/shm")];
    candidates
        .iter()
        .filter(|c| first(c) != first(dir))
        .find_map(|c| tempfile::tempdir_in(c).ok())
        .unwrap_or_else(|| panic!("no writable directory outside {}'s group to test with", dir.display()))
}

#[test]
fn the_environment_is_set_once_and_each_connect_reads_its_groups_xml() {
    let log = log_path("env");
    let name = "the_environment_is_set_once_and_each_connect_reads_its_groups_xml";
    if !in_child(name, "", &[("FAKE_CFS_LOG", log.to_str().unwrap())]) {
        let _ = std::fs::remove_file(&log);
        return;
    }
    let c = Cluster::new();
    let s = c.storage();
    // Two groups (the first path component): the cluster's directory, and one whose first
    // component differs from it wherever the checkout and the scratch directories live.
    let a = c.scratch("env");
    let b_root = other_group(&a);
    let groups = [(a.join("m.bin"), pattern(5000, 1)), (b_root.path().join("m.bin"), pattern(7000, 2))];
    let _ = std::fs::remove_file(&log);
    let mut seen = Vec::new();
    let mut files = Vec::new();
    for (path, data) in &groups {
        std::fs::write(path, data).unwrap();
        let f = s.open_sfcs(&sfcs(path), None).unwrap();
        seen.push((std::env::var_os("LIBCLOUDFS_CONF").unwrap(), f.config_file().to_path_buf()));
        assert_eq!(read_whole(&s, path, &IoOptions::default()).unwrap(), *data);
        files.push(f);
    }
    let stable = turboio_io_sfcs::conf_path();
    assert_ne!(seen[0].1, seen[1].1, "two groups, two XML files");
    for (env, _) in &seen {
        assert_eq!(Path::new(env), stable, "the variable names the one stable path");
    }
    // What libcloudfs opened at each connect: the stable path, pointing at that group's XML.
    let text = std::fs::read_to_string(&log).unwrap();
    let confs: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("cfsBuilderConnect "))
        .map(|l| l.split(" conf=").nth(1).unwrap().split(' ').next().unwrap())
        .collect();
    assert!(confs.len() >= 2 && confs.iter().all(|c| Path::new(c) == stable), "{text}");
    assert_eq!(std::fs::read_link(&stable).unwrap(), seen[1].1, "the link points at the last connecting group's XML");
    drop(files);
}

#[test]
fn short_reads_and_eintr_are_retried() {
    if !in_child("short_reads_and_eintr_are_retried", "short_reads,eintr_reads", &[]) {
        return;
    }
    let c = Cluster::new();
    let s = c.storage();
    let dir = c.scratch("short");
    let data = pattern((1 << 20) + 777, 4);
    std::fs::write(dir.join("m.bin"), &data).unwrap();
    let opts = IoOptions { threads: 3, chunk_size: 300_000, ..Default::default() };
    assert_eq!(read_whole(&s, &dir.join("m.bin"), &opts).unwrap(), data);
}

#[test]
fn an_io_error_on_a_read_names_the_path_and_the_library_error() {
    if !in_child("an_io_error_on_a_read_names_the_path_and_the_library_error", "eio_read=3", &[]) {
        return;
    }
    let c = Cluster::new();
    let s = c.storage();
    let dir = c.scratch("eio");
    std::fs::write(dir.join("m.bin"), pattern(4 << 20, 1)).unwrap();
    let err =
        read_whole(&s, &sfcs(&dir.join("m.bin")), &IoOptions { threads: 2, chunk_size: 1 << 20, ..Default::default() })
            .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, StorageError::Io { op: "read", .. }), "{err:?}");
    assert!(msg.starts_with(&format!("sfcs:/{}", dir.join("m.bin").display())), "{msg}");
    assert!(msg.contains("cfsRead: fake cfs: injected I/O error on read #3"), "cfsGetLastError() text: {msg}");
}

#[test]
fn end_of_file_before_the_expected_length_is_a_short_file() {
    if !in_child("end_of_file_before_the_expected_length_is_a_short_file", "extra_size=100", &[]) {
        return;
    }
    let c = Cluster::new();
    let s = c.storage();
    let dir = c.scratch("eof");
    std::fs::write(dir.join("m.bin"), pattern(10_000, 1)).unwrap();
    let err = read_whole(&s, &dir.join("m.bin"), &IoOptions::default()).unwrap_err();
    assert!(matches!(err, StorageError::ShortFile { file_len: 10_000, end: 10_100, .. }), "{err:?}");
    assert!(err.to_string().contains("m.bin"), "{err}");
}

/// A failing save: the error, then the old file intact and nothing left in the directory.
fn failing_save(faults_note: &str, expected: &str) {
    let c = Cluster::new();
    let s = c.storage();
    let dir = c.scratch("save");
    let old = pattern(1000, 1);
    std::fs::write(dir.join("m.bin"), &old).unwrap();
    let before = listing(&dir);
    for len in [100usize, 5 << 20] {
        let new = pattern(len, 2);
        let err = s
            .write_file(&sfcs(&dir.join("m.bin")), &BytesSource(&new), &IoOptions { threads: 4, ..Default::default() })
            .expect_err(faults_note);
        let msg = err.to_string();
        assert!(msg.contains(expected), "{faults_note}, {len} bytes: {msg}");
        assert!(msg.contains("m.bin"), "{msg}");
        assert_eq!(std::fs::read(dir.join("m.bin")).unwrap(), old, "{faults_note}: the old file changed");
        assert_eq!(listing(&dir), before, "{faults_note}: something was left behind");
    }
}

#[test]
fn a_failing_concat_keeps_the_old_file() {
    if in_child("a_failing_concat_keeps_the_old_file", "fail_concat", &[]) {
        // 100 bytes are one stream (no concat): that save succeeds, so only the big one fails.
        let c = Cluster::new();
        let s = c.storage();
        let dir = c.scratch("concat");
        let old = pattern(1000, 1);
        std::fs::write(dir.join("m.bin"), &old).unwrap();
        let before = listing(&dir);
        let err = s
            .write_file(
                &dir.join("m.bin"),
                &BytesSource(&pattern(5 << 20, 2)),
                &IoOptions { threads: 4, ..Default::default() },
            )
            .unwrap_err();
        assert!(err.to_string().contains("cfsConcat: fake cfs: injected concat failure"), "{err}");
        assert_eq!(std::fs::read(dir.join("m.bin")).unwrap(), old);
        assert_eq!(listing(&dir), before);
    }
}

#[test]
fn a_failing_rename_keeps_the_old_file() {
    if in_child("a_failing_rename_keeps_the_old_file", "fail_rename", &[]) {
        failing_save("fail_rename", "cfsRename2: fake cfs: injected rename failure");
    }
}

#[test]
fn a_failing_write_keeps_the_old_file() {
    if in_child("a_failing_write_keeps_the_old_file", "fail_write=1", &[]) {
        failing_save("fail_write", "cfsWrite: fake cfs: injected write failure");
    }
}

#[test]
fn a_failing_mkdir_keeps_the_old_file() {
    if in_child("a_failing_mkdir_keeps_the_old_file", "fail_mkdir", &[]) {
        failing_save("fail_mkdir", "cfsCreateDirectory: fake cfs: injected mkdir failure");
    }
}

#[test]
fn a_failing_connect_is_a_clear_error() {
    if in_child("a_failing_connect_is_a_clear_error", "fail_connect", &[]) {
        let c = Cluster::new();
        let err = c.storage().open_sfcs(Path::new("sfcs://data/m.bin"), None).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("cannot connect to SFCS: cfsBuilderConnect: fake cfs: injected connect failure"), "{msg}");
    }
}

#[test]
fn saves_use_parts_concat_and_rename_and_clean_up() {
    let log = log_path("save");
    if !in_child("saves_use_parts_concat_and_rename_and_clean_up", "", &[("FAKE_CFS_LOG", log.to_str().unwrap())]) {
        let _ = std::fs::remove_file(&log);
        return;
    }
    let c = Cluster::new();
    let s = c.storage();
    let dir = c.scratch("parts");
    let data = pattern((5 << 20) + 3, 8);
    let _ = std::fs::remove_file(&log);
    s.write_file(&dir.join("m.bin"), &BytesSource(&data), &IoOptions { threads: 3, ..Default::default() }).unwrap();
    assert_eq!(std::fs::read(dir.join("m.bin")).unwrap(), data);
    assert_eq!(listing(&dir), ["m.bin"]);
    let text = std::fs::read_to_string(&log).unwrap();
    let calls: Vec<&str> = text.lines().map(|l| l.split(' ').next().unwrap()).collect();
    let parts = text.lines().filter(|l| l.starts_with("cfsOpenFileAcc ")).count();
    assert_eq!(parts, 3, "one part per worker (2 MiB parts of whole 1 MiB blocks): {text}");
    let pos = |c: &str| calls.iter().position(|x| *x == c).unwrap_or_else(|| panic!("no {c} in {text}"));
    assert!(pos("cfsCreateDirectory") < pos("cfsOpenFileAcc"));
    assert!(pos("cfsConcat") < pos("cfsRename2") && pos("cfsRename2") < pos("cfsDelete"), "{text}");
    assert!(text
        .lines()
        .any(|l| l.starts_with("cfsDelete ") && l.contains(".m.bin.turboio-tmp.") && l.ends_with("recursive=1")));
}

#[test]
fn cancelled_reads_and_saves_stop_and_leave_nothing() {
    let c = Cluster::new();
    let s = c.storage();
    let dir = c.scratch("cancel");
    let data = pattern(4 << 20, 5);
    std::fs::write(dir.join("m.bin"), &data).unwrap();
    let cancel = AtomicBool::new(false);
    // The first chunk that lands cancels the rest.
    let hook = |_: u64, _: &mut [u8]| {
        cancel.store(true, Ordering::Relaxed);
        Ok(())
    };
    let opts =
        IoOptions { threads: 1, chunk_size: 1 << 20, hook: Some(&hook), cancel: Some(&cancel), ..Default::default() };
    let err = read_whole(&s, &dir.join("m.bin"), &opts).unwrap_err();
    assert!(matches!(err, StorageError::Cancelled), "{err:?}");

    struct CancelAfterFirst<'a>(&'a AtomicBool, Vec<u8>);
    impl turboio_storage::WriteSource for CancelAfterFirst<'_> {
        fn len(&self) -> u64 {
            self.1.len() as u64
        }
        fn fill(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
            dst.copy_from_slice(&self.1[offset as usize..offset as usize + dst.len()]);
            self.0.store(true, Ordering::Relaxed);
            Ok(())
        }
    }
    let cancel = AtomicBool::new(false);
    let before = listing(&dir);
    let src = CancelAfterFirst(&cancel, pattern(20 << 20, 6));
    let err = s
        .write_file(&dir.join("m.bin"), &src, &IoOptions { threads: 2, cancel: Some(&cancel), ..Default::default() })
        .unwrap_err();
    assert!(matches!(err, StorageError::Cancelled), "{err:?}");
    assert_eq!(std::fs::read(dir.join("m.bin")).unwrap(), data);
    assert_eq!(listing(&dir), before);
}

#[test]
fn writing_into_a_directory_or_a_missing_one_fails_cleanly() {
    let c = Cluster::new();
    let s = c.storage();
    let dir = c.scratch("dirs");
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let err = s.write_file(&dir.join("sub"), &BytesSource(b"x"), &IoOptions::default()).unwrap_err();
    assert!(err.to_string().contains("sub"), "{err}");
    assert!(dir.join("sub").is_dir());
    let err = s.write_file(&dir.join("missing/x.bin"), &BytesSource(b"x"), &IoOptions::default()).unwrap_err();
    assert!(err.is_not_found(), "{err:?}");
    assert!(!dir.join("missing").exists(), "no parent directory is created");
    let err = s.open_sfcs(&dir.join("sub"), None).unwrap_err();
    assert!(err.to_string().contains("sub"), "{err}");
}

#[test]
fn secrets_never_appear_in_errors_or_debug() {
    let c = Cluster::new();
    let s = c.storage();
    let dir = c.scratch("secrets");
    std::fs::write(dir.join("m.bin"), b"abc").unwrap();
    let f = s.open_sfcs(&dir.join("m.bin"), None).unwrap();
    let mut texts = vec![format!("{s:?}"), format!("{f:?}")];
    let mut short = [0u8; 10];
    texts.push(turboio_storage::StorageFile::read_exact_at(&f, 0, &mut short).unwrap_err().to_string());
    let mut broken = Cluster::new();
    broken.unset("SFCS_REGION");
    texts.push(broken.storage().open_sfcs(&dir.join("m.bin"), None).unwrap_err().to_string());
    let sources = turboio_io_sfcs::Sources::read(c.vars()).unwrap();
    texts.push(format!("{sources:?}"));
    let conf = sources.configuration("tmp");
    texts.push(format!("{conf:?}"));
    texts.push(format!("{:?}", conf.to_properties()));
    for t in texts {
        assert!(!t.contains("SK-very-secret-value"), "{t}");
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ` of a Unix time (the datapipe's ISO 8601).
fn iso(t: std::time::SystemTime) -> String {
    let secs = t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

/// A datapipe that answers `sfcs-sts` with credentials `tok-<n>` (n = 1, 2, ...) valid for
/// `validity` from now, and reports each request (its number and when the previous
/// credentials expire) on a channel.
fn sts_datapipe(
    path: &Path,
    validity: std::time::Duration,
) -> std::sync::mpsc::Receiver<(usize, std::time::SystemTime, std::time::SystemTime)> {
    use std::io::{Read, Write};
    let listener = std::os::unix::net::UnixListener::bind(path).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut n = 0usize;
        let mut expiry = std::time::SystemTime::UNIX_EPOCH;
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut b).unwrap_or(0) == 1 {
                head.push(b[0]);
            }
            let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
            let body = if head.contains("x-datapipe-task-type: sfcs-sts") {
                n += 1;
                let now = std::time::SystemTime::now();
                if tx.send((n, now, expiry)).is_err() {
                    return;
                }
                expiry = now + validity;
                format!(
                    r#"{{"Cred": {{"CurrentTime": "{}", "ExpiredTime": "{}", "AccessKeyId": "AK-STS-{n}", "SecretAccessKey": "sts-secret-{n}", "SessionToken": "tok-{n}"}}, "SfcsNameNodeAddress": "10.0.0.{n}"}}"#,
                    iso(now),
                    iso(expiry)
                )
            } else {
                r#"{"message": "pong"}"#.to_string()
            };
            let _ =
                conn.write_all(format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len()).as_bytes());
        }
    });
    rx
}

#[test]
fn datapipe_sts_credentials_are_refreshed_before_they_expire() {
    let mut c = Cluster::new();
    let sock = c.dir.path().join("datapipe.sock");
    let requests = sts_datapipe(&sock, std::time::Duration::from_secs(2));
    c.set("DATAPIPE_SOCKET_PATH", sock.to_str().unwrap())
        .unset("SFCS_ACCESS_KEY")
        .unset("SFCS_SECRET_KEY")
        .unset("SFCS_NAMENODE_ENDPOINT_ADDRESS");
    let s = c.storage();
    let dir = c.scratch("sts");
    std::fs::write(dir.join("m.bin"), b"sts").unwrap();
    let f = s.open_sfcs(&dir.join("m.bin"), None).unwrap();
    let xml_path = f.config_file().to_path_buf();
    let wait = std::time::Duration::from_secs(20);
    let (n, _, _) = requests.recv_timeout(wait).unwrap();
    assert_eq!(n, 1);
    let xml = std::fs::read_to_string(&xml_path).unwrap();
    for (k, v) in [
        ("cfs.access.key", "AK-STS-1"),
        ("cfs.secret.key", "sts-secret-1"),
        ("cfs.security.token", "tok-1"),
        ("cfs.namenode.endpoint.address.fs-test", "10.0.0.1"),
    ] {
        assert!(xml.contains(&format!("<name>{k}</name>\n\t\t\t<value>{v}</value>")), "{k} in {xml}");
    }
    assert!(xml.ends_with("\t\t<property>\n\t\t\t<name>cfs.namenode.endpoint.address.fs-test</name>\n\t\t\t<value>10.0.0.1</value>\n\t\t</property>\n\t</configuration>\n"), "{xml}");
    // The refresh comes halfway to the expiry, before it.
    let (n, at, expiry) = requests.recv_timeout(wait).unwrap();
    assert_eq!(n, 2);
    assert!(at < expiry, "refreshed at {at:?}, after the expiry {expiry:?}");
    // The third request comes after the second answer has been written out.
    let (n, _, _) = requests.recv_timeout(wait).unwrap();
    assert_eq!(n, 3);
    let xml = std::fs::read_to_string(&xml_path).unwrap();
    assert!(!xml.contains("tok-1") && (xml.contains("tok-2") || xml.contains("tok-3")), "{xml}");
    assert_eq!(std::fs::metadata(&xml_path).unwrap().permissions().mode() & 0o777, 0o600);
    // A new operation connects with the refreshed file; the old connection is not reused.
    let g = s.open_sfcs(&dir.join("m.bin"), None).unwrap();
    assert_eq!(g.config_file(), xml_path, "the group's session is shared while in use");
    // The refresh thread stops with the last user, and the file with the credentials goes.
    drop(f);
    drop(g);
    assert!(!xml_path.exists());
}

#[test]
fn a_cancelled_open_stops_waiting_for_the_datapipe() {
    let mut c = Cluster::new();
    let sock = c.dir.path().join("silent.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    c.set("DATAPIPE_SOCKET_PATH", sock.to_str().unwrap()).unset("SFCS_SECRET_KEY");
    let s = c.storage();
    let cancel = std::sync::Arc::new(AtomicBool::new(false));
    let flag = cancel.clone();
    let worker = std::thread::spawn(move || s.open_sfcs(Path::new("sfcs://data/m.bin"), Some(&flag)).map(drop));
    let _held = listener.accept().unwrap();
    let start = std::time::Instant::now();
    cancel.store(true, Ordering::Relaxed);
    let r = worker.join().unwrap();
    assert!(matches!(r, Err(StorageError::Cancelled)), "{r:?}");
    assert!(start.elapsed() < std::time::Duration::from_secs(1));
}

#[test]
fn the_fake_exports_exactly_the_symbols_the_backend_uses() {
    let lib = fake_lib();
    let Ok(out) = std::process::Command::new("nm").args(["-D", "--defined-only"]).arg(&lib).output() else {
        eprintln!("skipped: nm is not installed");
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let mut exported: Vec<&str> =
        text.lines().filter_map(|l| l.split_whitespace().nth(2)).filter(|s| s.starts_with("cfs")).collect();
    exported.sort();
    let mut used = turboio_io_sfcs::SYMBOLS.to_vec();
    used.sort();
    assert_eq!(exported, used);
}
