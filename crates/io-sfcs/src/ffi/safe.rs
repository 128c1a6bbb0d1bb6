//! RAII handles over libcloudfs: a loaded library, a connection (`cfsFS`, disconnected on
//! drop) and an open file (`cfsFile`, closed on drop). Every method returns a `Result`.

use super::result::{check, CfsError};
use super::sys::{self, Api, CfsFile, CfsFs};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

/// The name node veTurboIO connects to: "take everything from the XML configuration".
const NAME_NODE: &CStr = c"default";
/// The user name veTurboIO connects as.
const USER_NAME: &CStr = c"demo-user";

/// libcloudfs, opened and resolved.
#[derive(Debug, Clone)]
pub struct Library {
    api: Arc<Api>,
}

impl Library {
    /// Opens the library at `path`.
    pub fn open(path: &Path) -> Result<Library, String> {
        Ok(Library { api: Arc::new(Api::load(path)?) })
    }

    /// Connects with the configuration named by `LIBCLOUDFS_CONF` (which the caller has set).
    pub fn connect(&self) -> Result<Fs, CfsError> {
        let api = &*self.api;
        // SAFETY: cfsNewBuilder takes nothing and returns a builder or NULL.
        let bld = check(api, "cfsNewBuilder", unsafe { (api.new_builder)() }, |b| !b.is_null())?;
        // SAFETY: `bld` is the live builder just made; the strings are 'static C strings (cfs.h:
        // the user name is shallow-copied, so it must outlive the builder: it does).
        // cfsBuilderConnect frees the builder, connected or not (cfs.h), so it is not used
        // (or freed) after this block.
        let raw = unsafe {
            (api.builder_set_name_node)(bld, NAME_NODE.as_ptr());
            (api.builder_set_user_name)(bld, USER_NAME.as_ptr());
            (api.builder_connect)(bld, std::ptr::null())
        };
        let raw = NonNull::new(raw).ok_or_else(|| CfsError::last(api, "cfsBuilderConnect"))?;
        Ok(Fs { api: self.api.clone(), raw })
    }
}

/// Facts about a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathInfo {
    /// A directory.
    pub is_dir: bool,
    /// Its size in bytes.
    pub size: u64,
}

/// A connection to one file system (`cfsFS`).
#[derive(Debug)]
pub struct Fs {
    api: Arc<Api>,
    raw: NonNull<c_void>,
}

// SAFETY: a cfsFS is shared by many threads at once, each with its own cfsFile (that is how
// veTurboIO's parallel reads and writes use it: sfcs.cpp read_multi_files / write_file_from_tensors);
// the handle itself is an opaque pointer that we only pass back to the library.
unsafe impl Send for Fs {}
// SAFETY: as above; no method of `Fs` mutates Rust-side state.
unsafe impl Sync for Fs {}

impl Fs {
    fn raw(&self) -> CfsFs {
        self.raw.as_ptr()
    }

    /// `cfsGetPathInfo`.
    pub fn path_info(&self, path: &CStr) -> Result<PathInfo, CfsError> {
        let api = &*self.api;
        // SAFETY: a live connection and a NUL-terminated path that outlives the call.
        let info = unsafe { (api.get_path_info)(self.raw(), path.as_ptr()) };
        let info = NonNull::new(info).ok_or_else(|| CfsError::last(api, "cfsGetPathInfo"))?;
        // SAFETY: a non-NULL result points to one cfsFileInfo owned by the library until
        // cfsFreeFileInfo, which is called right after the two fields are copied.
        let out = unsafe {
            let i = info.as_ref();
            let out = PathInfo { is_dir: i.kind == sys::KIND_DIRECTORY, size: u64::try_from(i.size).unwrap_or(0) };
            (api.free_file_info)(info.as_ptr(), 1);
            out
        };
        Ok(out)
    }

    /// `cfsOpenFile(path, O_RDONLY, 0, 0, 0)`, as veTurboIO reads.
    pub fn open_read(&self, path: &CStr) -> Result<File<'_>, CfsError> {
        let api = &*self.api;
        // SAFETY: a live connection, a NUL-terminated path; zeros mean "configured defaults".
        let f = unsafe { (api.open_file)(self.raw(), path.as_ptr(), OFlag::O_RDONLY.bits(), 0, 0, 0) };
        let raw = NonNull::new(f).ok_or_else(|| CfsError::last(api, "cfsOpenFile"))?;
        Ok(File { fs: self, raw: Some(raw) })
    }

    /// `cfsOpenFileAcc(path, O_WRONLY | O_ASYNC, 0644, no parents, not appendable)`, as
    /// veTurboIO writes: creates or truncates.
    pub fn open_write(&self, path: &CStr) -> Result<File<'_>, CfsError> {
        let api = &*self.api;
        // SAFETY: a live connection and a NUL-terminated path.
        let f = unsafe {
            (api.open_file_acc)(self.raw(), path.as_ptr(), (OFlag::O_WRONLY | OFlag::O_ASYNC).bits(), 0o644, 0, 0)
        };
        let raw = NonNull::new(f).ok_or_else(|| CfsError::last(api, "cfsOpenFileAcc"))?;
        Ok(File { fs: self, raw: Some(raw) })
    }

    /// `cfsDelete(path, recursive)`.
    pub fn delete(&self, path: &CStr, recursive: bool) -> Result<(), CfsError> {
        let api = &*self.api;
        // SAFETY: a live connection and a NUL-terminated path.
        let r = unsafe { (api.delete)(self.raw(), path.as_ptr(), c_int::from(recursive)) };
        check(api, "cfsDelete", r, |&r| r == 0).map(drop)
    }

    /// `cfsCreateDirectory` (with parents).
    pub fn create_directory(&self, path: &CStr) -> Result<(), CfsError> {
        let api = &*self.api;
        // SAFETY: a live connection and a NUL-terminated path.
        let r = unsafe { (api.create_directory)(self.raw(), path.as_ptr()) };
        check(api, "cfsCreateDirectory", r, |&r| r == 0).map(drop)
    }

    /// `cfsConcat(target, sources)`: appends the sources to the target and deletes them.
    pub fn concat(&self, target: &CStr, sources: &[CString]) -> Result<(), CfsError> {
        let api = &*self.api;
        let mut ptrs: Vec<*const c_char> = sources.iter().map(|s| s.as_ptr()).collect();
        let n = c_int::try_from(ptrs.len())
            .map_err(|_| CfsError::ours("cfsConcat", Errno::E2BIG as i32, "too many parts"))?;
        // SAFETY: a live connection; `ptrs` holds `n` pointers to NUL-terminated strings owned
        // by `sources`, all alive for the call (the C signature takes `const char **`).
        let r = unsafe { (api.concat)(self.raw(), target.as_ptr(), ptrs.as_mut_ptr(), n) };
        check(api, "cfsConcat", r, |&r| r == 0).map(drop)
    }

    /// `cfsRename2(old, new)`: replaces `new` if it exists.
    pub fn rename2(&self, old: &CStr, new: &CStr) -> Result<(), CfsError> {
        let api = &*self.api;
        // SAFETY: a live connection and two NUL-terminated paths.
        let r = unsafe { (api.rename2)(self.raw(), old.as_ptr(), new.as_ptr()) };
        check(api, "cfsRename2", r, |&r| r == 0).map(drop)
    }

    /// `cfsGetDefaultBlockSize`, or `None` when the library does not say.
    pub fn default_block_size(&self) -> Option<u64> {
        // SAFETY: a live connection.
        let r = unsafe { (self.api.get_default_block_size)(self.raw()) };
        u64::try_from(r).ok().filter(|&b| b > 0)
    }
}

impl Drop for Fs {
    fn drop(&mut self) {
        // SAFETY: the connection is live and no `File` borrows it any more (they borrow `self`).
        // cfs.h: resources are freed even when it reports an error, which has nobody to go to.
        unsafe {
            (self.api.disconnect)(self.raw());
        }
    }
}

/// An open file (`cfsFile`), used by one thread at a time.
#[derive(Debug)]
pub struct File<'fs> {
    fs: &'fs Fs,
    raw: Option<NonNull<c_void>>,
}

// SAFETY: a cfsFile belongs to one thread at a time (`File` is not `Sync`); moving it to another
// thread between calls is what veTurboIO's per-thread files amount to.
unsafe impl Send for File<'_> {}

impl File<'_> {
    fn raw(&self) -> CfsFile {
        self.raw.map_or(std::ptr::null_mut(), NonNull::as_ptr)
    }

    /// `cfsSeek`.
    pub fn seek(&mut self, offset: u64) -> Result<(), CfsError> {
        let api = &*self.fs.api;
        let off =
            i64::try_from(offset).map_err(|_| CfsError::ours("cfsSeek", Errno::EINVAL as i32, "offset too large"))?;
        // SAFETY: a live connection and a file it opened.
        let r = unsafe { (api.seek)(self.fs.raw(), self.raw(), off) };
        check(api, "cfsSeek", r, |&r| r == 0).map(drop)
    }

    /// One `cfsRead` into `buf`: the bytes read, 0 at the end of the file.
    pub fn read(&mut self, buf: &mut [u8]) -> Result<usize, CfsError> {
        let api = &*self.fs.api;
        // SAFETY: `buf` is valid for `buf.len()` bytes of writes for the whole call and the
        // library writes at most that many.
        let r = unsafe { (api.read)(self.fs.raw(), self.raw(), buf.as_mut_ptr().cast(), buf.len() as u64) };
        let n = check(api, "cfsRead", r, |&r| r >= 0)?;
        usize::try_from(n).ok().filter(|&n| n <= buf.len()).ok_or_else(|| {
            CfsError::ours("cfsRead", Errno::EIO as i32, format!("returned {n} for a {}-byte buffer", buf.len()))
        })
    }

    /// One `cfsWrite` of `buf`: the bytes written.
    pub fn write(&mut self, buf: &[u8]) -> Result<usize, CfsError> {
        let api = &*self.fs.api;
        // SAFETY: `buf` is valid for `buf.len()` bytes of reads for the whole call.
        let r = unsafe { (api.write)(self.fs.raw(), self.raw(), buf.as_ptr().cast(), buf.len() as u64) };
        let n = check(api, "cfsWrite", r, |&r| r >= 0)?;
        usize::try_from(n).ok().filter(|&n| n <= buf.len()).ok_or_else(|| {
            CfsError::ours("cfsWrite", Errno::EIO as i32, format!("returned {n} for a {}-byte buffer", buf.len()))
        })
    }

    /// `cfsCloseFile`, reporting its status (for writes, a failed close is a failed write).
    pub fn close(mut self) -> Result<(), CfsError> {
        let api = &*self.fs.api;
        let raw = self.raw();
        self.raw = None;
        // SAFETY: the file is live and is not used again (`raw` was taken).
        let r = unsafe { (api.close_file)(self.fs.raw(), raw) };
        check(api, "cfsCloseFile", r, |&r| r == 0).map(drop)
    }
}

impl Drop for File<'_> {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            // SAFETY: the file is live and not used again; cfs.h frees it even on error.
            unsafe {
                (self.fs.api.close_file)(self.fs.raw(), raw.as_ptr());
            }
        }
    }
}
