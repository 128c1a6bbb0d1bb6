//! A fake `libcloudfs.so` for turboio's SFCS tests: the 19 functions turboio-io-sfcs calls,
//! with cfs.h's signatures, backed by a local directory, so that the backend is tested through
//! its real dynamic loading and FFI code.
//!
//! # Behaviour
//!
//! - `cfsBuilderConnect` reads the XML file named by `LIBCLOUDFS_CONF` (as libcloudfs does) and
//!   fails unless it exists and names a local root in `cfs.filesystem.ufs-path` as
//!   `file:///some/dir`. SFCS path `/a/b` is `<root>/a/b`; `..` is refused.
//! - Errors set `errno` and the text `cfsGetLastError()` returns (per thread).
//! - `cfsGetDefaultBlockSize` is `FAKE_CFS_BLOCK_SIZE` (default 1 MiB).
//!
//! # Fault injection (`FAKE_CFS_FAULTS`, read at each connect, comma-separated)
//!
//! | fault | effect |
//! |---|---|
//! | `short_reads` | every `cfsRead` returns at most 1000 bytes |
//! | `eintr_reads` | every other `cfsRead` fails with `EINTR` first |
//! | `eio_read=N` | the N-th `cfsRead` of the connection fails with `EIO` |
//! | `extra_size=N` | `cfsGetPathInfo` reports files N bytes longer than they are |
//! | `fail_write=N` | the N-th `cfsWrite` of the connection fails with `ENOSPC` |
//! | `fail_concat` / `fail_rename` / `fail_mkdir` / `fail_connect` | those calls fail with `EIO` |
//! | `slow_read_ms=N` | every `cfsRead` sleeps N ms first |
//!
//! # Call record (`FAKE_CFS_LOG`)
//!
//! When set, one line per call is appended to that file: `<function> <thread id> <details>`.
#![allow(clippy::missing_safety_doc)]

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::mode_t;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

static LOG_LOCK: Mutex<()> = Mutex::new(());

fn log(call: &str, details: &str) {
    let Ok(path) = std::env::var("FAKE_CFS_LOG") else { return };
    let _g = LOG_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    if let Ok(mut f) = OpenOptions::new().create(true).append(true).open(path) {
        let _ = writeln!(f, "{call} {:?} {details}", std::thread::current().id());
    }
}

fn fail(errno: Errno, message: String) {
    fail_raw(errno as c_int, message)
}

/// Sets this thread's `errno` (any value, also one nix has no name for) and error text.
fn fail_raw(errno: c_int, message: String) {
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(message.replace('\0', " ")).unwrap_or_default());
    Errno::set_raw(errno);
}

fn fail_io(e: &std::io::Error, what: &str) {
    fail_raw(e.raw_os_error().unwrap_or(Errno::EIO as c_int), format!("fake cfs: {what}: {e}"));
}

#[derive(Default, Debug)]
struct Faults {
    short_reads: bool,
    eintr_reads: bool,
    eio_read: Option<u64>,
    extra_size: u64,
    fail_write: Option<u64>,
    fail_concat: bool,
    fail_rename: bool,
    fail_mkdir: bool,
    fail_connect: bool,
    slow_read_ms: u64,
}

impl Faults {
    fn from_env() -> Faults {
        let mut f = Faults::default();
        let spec = std::env::var("FAKE_CFS_FAULTS").unwrap_or_default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item.split_once('=').unwrap_or((item, ""));
            let n = v.parse::<u64>().ok();
            match k {
                "short_reads" => f.short_reads = true,
                "eintr_reads" => f.eintr_reads = true,
                "eio_read" => f.eio_read = n,
                "extra_size" => f.extra_size = n.unwrap_or(0),
                "fail_write" => f.fail_write = n,
                "fail_concat" => f.fail_concat = true,
                "fail_rename" => f.fail_rename = true,
                "fail_mkdir" => f.fail_mkdir = true,
                "fail_connect" => f.fail_connect = true,
                "slow_read_ms" => f.slow_read_ms = n.unwrap_or(0),
                _ => {}
            }
        }
        f
    }
}

/// `struct cfsBuilder`.
pub struct Builder {
    name_node: Option<String>,
    user: Option<String>,
}

/// `cfsFS`.
pub struct Fs {
    root: PathBuf,
    faults: Faults,
    reads: AtomicU64,
    writes: AtomicU64,
}

/// `cfsFile`.
pub struct FakeFile {
    file: File,
    path: String,
    pos: u64,
    eintr_next: bool,
}

/// `cfsFileInfo`, cfs.h's layout.
#[repr(C)]
pub struct FileInfo {
    kind: c_int,
    name: *mut c_char,
    last_mod: i64,
    size: i64,
    replication: i16,
    block_size: i64,
    owner: *mut c_char,
    group: *mut c_char,
    permissions: i16,
    last_access: i64,
    encryption: *mut c_void,
    blocks: *mut c_void,
    num_blocks: c_int,
    acc_status: c_int,
}

const _: () = assert!(std::mem::size_of::<FileInfo>() == 104);

unsafe fn cstr<'a>(p: *const c_char) -> Option<&'a str> {
    if p.is_null() {
        None
    } else {
        CStr::from_ptr(p).to_str().ok()
    }
}

impl Fs {
    fn local(&self, path: *const c_char) -> Option<(String, PathBuf)> {
        // SAFETY: callers pass NUL-terminated strings (cfs.h).
        let Some(p) = (unsafe { cstr(path) }) else {
            fail(Errno::EINVAL, "fake cfs: path is NULL or not UTF-8".into());
            return None;
        };
        let rel = Path::new(p);
        if rel.components().any(|c| matches!(c, Component::ParentDir)) {
            fail(Errno::EINVAL, format!("fake cfs: {p}: `..` is not allowed"));
            return None;
        }
        Some((p.to_string(), self.root.join(p.trim_start_matches('/'))))
    }
}

/// Reads `name`'s value from a Hadoop-style XML file.
fn xml_value(xml: &str, name: &str) -> Option<String> {
    let key = format!("<name>{name}</name>");
    let at = xml.find(&key)? + key.len();
    let rest = &xml[at..];
    let start = rest.find("<value>")? + "<value>".len();
    let end = rest[start..].find("</value>")? + start;
    Some(rest[start..end].replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&amp;", "&"))
}

#[no_mangle]
pub extern "C" fn cfsGetLastError() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

#[no_mangle]
pub extern "C" fn cfsNewBuilder() -> *mut Builder {
    log("cfsNewBuilder", "");
    Box::into_raw(Box::new(Builder { name_node: None, user: None }))
}

#[no_mangle]
pub unsafe extern "C" fn cfsBuilderSetNameNode(bld: *mut Builder, nn: *const c_char) {
    if let Some(b) = bld.as_mut() {
        b.name_node = cstr(nn).map(str::to_string);
    }
}

#[no_mangle]
pub unsafe extern "C" fn cfsBuilderSetUserName(bld: *mut Builder, user: *const c_char) {
    if let Some(b) = bld.as_mut() {
        b.user = cstr(user).map(str::to_string);
    }
}

#[no_mangle]
pub unsafe extern "C" fn cfsBuilderConnect(bld: *mut Builder, _user: *const c_char) -> *mut Fs {
    if bld.is_null() {
        fail(Errno::EINVAL, "fake cfs: NULL builder".into());
        return std::ptr::null_mut();
    }
    // cfs.h: the builder is freed whether or not the connection is made.
    let b = Box::from_raw(bld);
    let conf = std::env::var("LIBCLOUDFS_CONF").unwrap_or_default();
    let xml = match std::fs::read_to_string(&conf) {
        Ok(x) => x,
        Err(e) => {
            fail_io(&e, &format!("LIBCLOUDFS_CONF={conf}"));
            return std::ptr::null_mut();
        }
    };
    let ak = xml_value(&xml, "cfs.access.key").unwrap_or_default();
    let token = xml_value(&xml, "cfs.security.token").unwrap_or_default();
    log("cfsBuilderConnect", &format!("nn={:?} user={:?} conf={conf} ak={ak} token={token}", b.name_node, b.user));
    let faults = Faults::from_env();
    if faults.fail_connect {
        fail(Errno::EIO, "fake cfs: injected connect failure".into());
        return std::ptr::null_mut();
    }
    if b.name_node.as_deref() != Some("default") {
        fail(Errno::EINVAL, "fake cfs: the name node must be \"default\"".into());
        return std::ptr::null_mut();
    }
    let Some(root) =
        xml_value(&xml, "cfs.filesystem.ufs-path").and_then(|u| u.strip_prefix("file://").map(PathBuf::from))
    else {
        fail(Errno::EINVAL, format!("fake cfs: {conf}: cfs.filesystem.ufs-path is not file:///a/local/dir"));
        return std::ptr::null_mut();
    };
    if !root.is_dir() {
        fail(Errno::ENOENT, format!("fake cfs: root {} is not a directory", root.display()));
        return std::ptr::null_mut();
    }
    Box::into_raw(Box::new(Fs { root, faults, reads: AtomicU64::new(0), writes: AtomicU64::new(0) }))
}

#[no_mangle]
pub unsafe extern "C" fn cfsDisconnect(fs: *mut Fs) -> c_int {
    log("cfsDisconnect", "");
    if !fs.is_null() {
        drop(Box::from_raw(fs));
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn cfsGetPathInfo(fs: *mut Fs, path: *const c_char) -> *mut FileInfo {
    let Some(fs) = fs.as_ref() else { return std::ptr::null_mut() };
    let Some((p, local)) = fs.local(path) else { return std::ptr::null_mut() };
    log("cfsGetPathInfo", &p);
    match std::fs::metadata(&local) {
        Ok(m) => {
            let extra = if m.is_file() { fs.faults.extra_size } else { 0 };
            Box::into_raw(Box::new(FileInfo {
                kind: if m.is_dir() { b'D' as c_int } else { b'F' as c_int },
                name: CString::new(p).unwrap_or_default().into_raw(),
                last_mod: 0,
                size: (m.len() + extra) as i64,
                replication: 1,
                block_size: 1 << 20,
                owner: std::ptr::null_mut(),
                group: std::ptr::null_mut(),
                permissions: 0o644,
                last_access: 0,
                encryption: std::ptr::null_mut(),
                blocks: std::ptr::null_mut(),
                num_blocks: 0,
                acc_status: 0,
            }))
        }
        Err(e) => {
            fail_io(&e, &p);
            std::ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cfsFreeFileInfo(info: *mut FileInfo, n: c_int) {
    if info.is_null() || n != 1 {
        return;
    }
    let i = Box::from_raw(info);
    if !i.name.is_null() {
        drop(CString::from_raw(i.name));
    }
}

#[no_mangle]
pub unsafe extern "C" fn cfsOpenFile(
    fs: *mut Fs,
    path: *const c_char,
    flags: c_int,
    _buffer: c_int,
    _replication: i16,
    _block: i64,
) -> *mut FakeFile {
    let Some(fs) = fs.as_ref() else { return std::ptr::null_mut() };
    let Some((p, local)) = fs.local(path) else { return std::ptr::null_mut() };
    log("cfsOpenFile", &format!("{p} flags={flags}"));
    if flags & OFlag::O_ACCMODE.bits() != OFlag::O_RDONLY.bits() {
        fail(Errno::ENOTSUP, "fake cfs: cfsOpenFile is only used to read".into());
        return std::ptr::null_mut();
    }
    if local.is_dir() {
        fail(Errno::EISDIR, format!("fake cfs: {p} is a directory"));
        return std::ptr::null_mut();
    }
    match File::open(&local) {
        Ok(file) => Box::into_raw(Box::new(FakeFile { file, path: p, pos: 0, eintr_next: fs.faults.eintr_reads })),
        Err(e) => {
            fail_io(&e, &p);
            std::ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cfsOpenFileAcc(
    fs: *mut Fs,
    path: *const c_char,
    flags: c_int,
    mode: mode_t,
    create_parent: c_int,
    appendable: c_int,
) -> *mut FakeFile {
    let Some(fs) = fs.as_ref() else { return std::ptr::null_mut() };
    let Some((p, local)) = fs.local(path) else { return std::ptr::null_mut() };
    log("cfsOpenFileAcc", &format!("{p} flags={flags} mode={mode:o} parents={create_parent} appendable={appendable}"));
    if flags & OFlag::O_ACCMODE.bits() != OFlag::O_WRONLY.bits() {
        fail(Errno::ENOTSUP, "fake cfs: cfsOpenFileAcc is only used to write".into());
        return std::ptr::null_mut();
    }
    if create_parent != 0 {
        if let Some(parent) = local.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
    }
    let opened = OpenOptions::new().write(true).create(true).truncate(true).open(&local);
    match opened {
        Ok(file) => Box::into_raw(Box::new(FakeFile { file, path: p, pos: 0, eintr_next: false })),
        Err(e) => {
            fail_io(&e, &p);
            std::ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cfsCloseFile(_fs: *mut Fs, file: *mut FakeFile) -> c_int {
    if file.is_null() {
        fail(Errno::EBADF, "fake cfs: NULL file".into());
        return -1;
    }
    let f = Box::from_raw(file);
    log("cfsCloseFile", &f.path);
    0
}

#[no_mangle]
pub unsafe extern "C" fn cfsSeek(_fs: *mut Fs, file: *mut FakeFile, pos: i64) -> c_int {
    let Some(f) = file.as_mut() else { return -1 };
    let len = f.file.metadata().map(|m| m.len()).unwrap_or(0);
    log("cfsSeek", &format!("{} {pos}", f.path));
    if pos < 0 || pos as u64 > len {
        fail(Errno::EINVAL, format!("fake cfs: {}: seek to {pos} past the end ({len})", f.path));
        return -1;
    }
    f.pos = pos as u64;
    0
}

#[no_mangle]
pub unsafe extern "C" fn cfsRead(fs: *mut Fs, file: *mut FakeFile, buf: *mut c_void, len: u64) -> i64 {
    let (Some(fs), Some(f)) = (fs.as_ref(), file.as_mut()) else { return -1 };
    let n = fs.reads.fetch_add(1, Ordering::Relaxed) + 1;
    log("cfsRead", &format!("{} {} {len}", f.path, f.pos));
    if fs.faults.slow_read_ms > 0 {
        std::thread::sleep(std::time::Duration::from_millis(fs.faults.slow_read_ms));
    }
    if fs.faults.eio_read == Some(n) {
        fail(Errno::EIO, format!("fake cfs: injected I/O error on read #{n} of {}", f.path));
        return -1;
    }
    if f.eintr_next {
        f.eintr_next = false;
        fail(Errno::EINTR, "fake cfs: data temporarily unavailable".into());
        return -1;
    }
    f.eintr_next = fs.faults.eintr_reads;
    let mut want = len as usize;
    if fs.faults.short_reads {
        want = want.min(1000);
    }
    // SAFETY: the caller gives a buffer of `len` writable bytes (cfs.h).
    let dst = std::slice::from_raw_parts_mut(buf.cast::<u8>(), want);
    match f.file.read_at(dst, f.pos) {
        Ok(got) => {
            f.pos += got as u64;
            got as i64
        }
        Err(e) => {
            fail_io(&e, &f.path);
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cfsWrite(fs: *mut Fs, file: *mut FakeFile, buf: *const c_void, len: u64) -> i64 {
    let (Some(fs), Some(f)) = (fs.as_ref(), file.as_mut()) else { return -1 };
    let n = fs.writes.fetch_add(1, Ordering::Relaxed) + 1;
    log("cfsWrite", &format!("{} {} {len}", f.path, f.pos));
    if fs.faults.fail_write == Some(n) {
        fail(Errno::ENOSPC, format!("fake cfs: injected write failure #{n} on {}", f.path));
        return -1;
    }
    // SAFETY: the caller gives `len` readable bytes (cfs.h).
    let src = std::slice::from_raw_parts(buf.cast::<u8>(), len as usize);
    match f.file.write_all_at(src, f.pos) {
        Ok(()) => {
            f.pos += len;
            len as i64
        }
        Err(e) => {
            fail_io(&e, &f.path);
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cfsDelete(fs: *mut Fs, path: *const c_char, recursive: c_int) -> c_int {
    let Some(fs) = fs.as_ref() else { return -1 };
    let Some((p, local)) = fs.local(path) else { return -1 };
    log("cfsDelete", &format!("{p} recursive={recursive}"));
    let r = if local.is_dir() {
        if recursive != 0 {
            std::fs::remove_dir_all(&local)
        } else {
            std::fs::remove_dir(&local)
        }
    } else {
        std::fs::remove_file(&local)
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            fail_io(&e, &p);
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cfsCreateDirectory(fs: *mut Fs, path: *const c_char) -> c_int {
    let Some(fs) = fs.as_ref() else { return -1 };
    let Some((p, local)) = fs.local(path) else { return -1 };
    log("cfsCreateDirectory", &p);
    if fs.faults.fail_mkdir {
        fail(Errno::EIO, format!("fake cfs: injected mkdir failure on {p}"));
        return -1;
    }
    match std::fs::create_dir_all(&local) {
        Ok(()) => 0,
        Err(e) => {
            fail_io(&e, &p);
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cfsConcat(fs: *mut Fs, target: *const c_char, srcs: *const *const c_char, n: c_int) -> c_int {
    let Some(fs) = fs.as_ref() else { return -1 };
    let Some((t, tlocal)) = fs.local(target) else { return -1 };
    let mut sources = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the caller gives `n` valid string pointers (cfs.h).
        let Some(s) = fs.local(*srcs.add(i)) else { return -1 };
        sources.push(s);
    }
    let names: Vec<&str> = sources.iter().map(|(p, _)| p.as_str()).collect();
    log("cfsConcat", &format!("{t} <- {}", names.join(" ")));
    if fs.faults.fail_concat {
        fail(Errno::EIO, format!("fake cfs: injected concat failure on {t}"));
        return -1;
    }
    let r = (|| -> std::io::Result<()> {
        let out = OpenOptions::new().append(true).open(&tlocal)?;
        for (_, s) in &sources {
            let data = std::fs::read(s)?;
            (&out).write_all(&data)?;
        }
        for (_, s) in &sources {
            std::fs::remove_file(s)?;
        }
        Ok(())
    })();
    match r {
        Ok(()) => 0,
        Err(e) => {
            fail_io(&e, &t);
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cfsRename2(fs: *mut Fs, old: *const c_char, new: *const c_char) -> c_int {
    let Some(fs) = fs.as_ref() else { return -1 };
    let Some((o, olocal)) = fs.local(old) else { return -1 };
    let Some((n, nlocal)) = fs.local(new) else { return -1 };
    log("cfsRename2", &format!("{o} -> {n}"));
    if fs.faults.fail_rename {
        fail(Errno::EIO, format!("fake cfs: injected rename failure {o} -> {n}"));
        return -1;
    }
    match std::fs::rename(&olocal, &nlocal) {
        Ok(()) => 0,
        Err(e) => {
            fail_io(&e, &n);
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cfsGetDefaultBlockSize(_fs: *mut Fs) -> i64 {
    std::env::var("FAKE_CFS_BLOCK_SIZE").ok().and_then(|v| v.parse().ok()).unwrap_or(1 << 20)
}
