//! The raw C interface of libcloudfs: the types of `cfs.h` and a table of the functions turboio
//! calls, resolved by name from a library opened at run time. Nothing here checks anything;
//! [`super::result`] does.
//!
//! Only the symbols below are looked up (the fake library in `fake-cloudfs` exports exactly
//! these). `cfsFreeBuilder` is deliberately absent: `cfsBuilderConnect` frees the builder
//! whether or not it connects (cfs.h), so turboio never frees it itself.

use nix::sys::stat::mode_t;
use std::ffi::{c_char, c_int, c_void};
use std::path::Path;

/// `tOffset`.
pub type TOffset = i64;

/// `struct cfsBuilder` (opaque).
#[repr(C)]
pub struct CfsBuilder {
    _private: [u8; 0],
}

/// `cfsFS`: a connection (opaque pointer).
pub type CfsFs = *mut c_void;
/// `cfsFile`: an open file (opaque pointer).
pub type CfsFile = *mut c_void;

/// `tCfsObjectKind`: `'F'` (file) or `'D'` (directory).
pub const KIND_DIRECTORY: c_int = b'D' as c_int;

/// `cfsFileInfo` (cfs.h), x86-64 / aarch64 LP64 layout.
#[repr(C)]
#[derive(Debug)]
pub struct CfsFileInfo {
    /// `tCfsObjectKind mKind`.
    pub kind: c_int,
    /// `char *mName`.
    pub name: *mut c_char,
    /// `tTime mLastMod`.
    pub last_mod: i64,
    /// `tOffset mSize`.
    pub size: TOffset,
    /// `short mReplication`.
    pub replication: i16,
    /// `tOffset mBlockSize`.
    pub block_size: TOffset,
    /// `char *mOwner`.
    pub owner: *mut c_char,
    /// `char *mGroup`.
    pub group: *mut c_char,
    /// `short mPermissions`.
    pub permissions: i16,
    /// `tTime mLastAccess`.
    pub last_access: i64,
    /// `cfsEncryptionFileInfo *mCfsEncryptionFileInfo`.
    pub encryption: *mut c_void,
    /// `cfsBlockLocation *mBlocks`.
    pub blocks: *mut c_void,
    /// `int mNumOfBlocks`.
    pub num_blocks: c_int,
    /// `tCfsObjectAccStatus mAccStatus`.
    pub acc_status: c_int,
}

// The layout gcc gives cfs.h's struct on LP64 targets.
const _: () = assert!(std::mem::size_of::<CfsFileInfo>() == 104);
const _: () = assert!(std::mem::offset_of!(CfsFileInfo, size) == 24);
const _: () = assert!(std::mem::offset_of!(CfsFileInfo, block_size) == 40);
const _: () = assert!(std::mem::offset_of!(CfsFileInfo, acc_status) == 100);

/// The functions turboio calls, with cfs.h's signatures.
pub struct Api {
    pub new_builder: unsafe extern "C" fn() -> *mut CfsBuilder,
    pub builder_set_name_node: unsafe extern "C" fn(*mut CfsBuilder, *const c_char),
    pub builder_set_user_name: unsafe extern "C" fn(*mut CfsBuilder, *const c_char),
    pub builder_connect: unsafe extern "C" fn(*mut CfsBuilder, *const c_char) -> CfsFs,
    pub disconnect: unsafe extern "C" fn(CfsFs) -> c_int,
    pub get_last_error: unsafe extern "C" fn() -> *const c_char,
    pub get_path_info: unsafe extern "C" fn(CfsFs, *const c_char) -> *mut CfsFileInfo,
    pub free_file_info: unsafe extern "C" fn(*mut CfsFileInfo, c_int),
    pub open_file: unsafe extern "C" fn(CfsFs, *const c_char, c_int, c_int, i16, TOffset) -> CfsFile,
    pub open_file_acc: unsafe extern "C" fn(CfsFs, *const c_char, c_int, mode_t, c_int, c_int) -> CfsFile,
    pub close_file: unsafe extern "C" fn(CfsFs, CfsFile) -> c_int,
    pub seek: unsafe extern "C" fn(CfsFs, CfsFile, TOffset) -> c_int,
    pub read: unsafe extern "C" fn(CfsFs, CfsFile, *mut c_void, u64) -> i64,
    pub write: unsafe extern "C" fn(CfsFs, CfsFile, *const c_void, u64) -> i64,
    pub delete: unsafe extern "C" fn(CfsFs, *const c_char, c_int) -> c_int,
    pub create_directory: unsafe extern "C" fn(CfsFs, *const c_char) -> c_int,
    pub concat: unsafe extern "C" fn(CfsFs, *const c_char, *mut *const c_char, c_int) -> c_int,
    pub rename2: unsafe extern "C" fn(CfsFs, *const c_char, *const c_char) -> c_int,
    pub get_default_block_size: unsafe extern "C" fn(CfsFs) -> TOffset,
    // Declared last so that it is dropped after the function pointers above stop being used
    // (they point into it).
    _lib: libloading::Library,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api").finish_non_exhaustive()
    }
}

/// Every libcloudfs symbol turboio looks up (the fake library exports exactly these).
pub const SYMBOLS: [&str; 19] = [
    "cfsNewBuilder",
    "cfsBuilderSetNameNode",
    "cfsBuilderSetUserName",
    "cfsBuilderConnect",
    "cfsDisconnect",
    "cfsGetLastError",
    "cfsGetPathInfo",
    "cfsFreeFileInfo",
    "cfsOpenFile",
    "cfsOpenFileAcc",
    "cfsCloseFile",
    "cfsSeek",
    "cfsRead",
    "cfsWrite",
    "cfsDelete",
    "cfsCreateDirectory",
    "cfsConcat",
    "cfsRename2",
    "cfsGetDefaultBlockSize",
];

impl Api {
    /// Opens the library at `path` and resolves every symbol of [`SYMBOLS`].
    pub fn load(path: &Path) -> Result<Api, String> {
        // libc: nix has no dlopen, and libloading exports no RTLD_NODELETE.
        use libc::RTLD_NODELETE;
        use libloading::os::unix::{RTLD_LOCAL, RTLD_NOW};
        // SAFETY: opening a shared library runs its initialisers. The library is the vendor's
        // libcloudfs (or the test fake) that the user pointed LIBCFS_PATH at; running its
        // initialisers is what using it means. RTLD_NODELETE: it is never unmapped, even
        // after the last handle is closed, because it may have registered thread-local
        // destructors (C++ and Rust libraries do) that run when threads exit later.
        let lib = unsafe { libloading::os::unix::Library::open(Some(path), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE) }
            .map(libloading::Library::from)
            .map_err(|e| e.to_string())?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the symbol's type is its cfs.h prototype (above); the pointer is
                // copied out and used only while `_lib`, stored in the same `Api`, keeps the
                // library mapped.
                let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("symbol {} is missing: {e}", $name))?;
                *s
            }};
        }
        Ok(Api {
            new_builder: sym!("cfsNewBuilder"),
            builder_set_name_node: sym!("cfsBuilderSetNameNode"),
            builder_set_user_name: sym!("cfsBuilderSetUserName"),
            builder_connect: sym!("cfsBuilderConnect"),
            disconnect: sym!("cfsDisconnect"),
            get_last_error: sym!("cfsGetLastError"),
            get_path_info: sym!("cfsGetPathInfo"),
            free_file_info: sym!("cfsFreeFileInfo"),
            open_file: sym!("cfsOpenFile"),
            open_file_acc: sym!("cfsOpenFileAcc"),
            close_file: sym!("cfsCloseFile"),
            seek: sym!("cfsSeek"),
            read: sym!("cfsRead"),
            write: sym!("cfsWrite"),
            delete: sym!("cfsDelete"),
            create_directory: sym!("cfsCreateDirectory"),
            concat: sym!("cfsConcat"),
            rename2: sym!("cfsRename2"),
            get_default_block_size: sym!("cfsGetDefaultBlockSize"),
            _lib: lib,
        })
    }
}
