//! The GDS backend without a GPU (what CI can check) and with the real libcufile.
//!
//! - Ordinary reads and writes pass the storage conformance suite (they go to the posix backend).
//! - Device reads and writes refuse cleanly, quickly, and without ever calling
//!   `cuFileDriverOpen` (which can hang without a GPU); saves leave the old file intact.
//! - With `TURBOIO_CUFILE_LIB` (CI: the venv's `nvidia/cu13/lib/libcufile.so.0`), the real
//!   library loads, reports its version and exports every symbol we use; the struct layouts,
//!   constants and function signatures are checked against its `cufile.h` with a C compiler.
//!   Without it those tests print that they were skipped.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use turboio_io_gds::{sys, GdsConfig, GdsMode, GdsStorage};
use turboio_storage::conformance::{self, Capabilities};
use turboio_storage::{
    BytesSource, DeviceDst, DeviceReadRequest, DeviceWriteRequest, IoOptions, Storage, StorageError,
};

fn scratch() -> tempfile::TempDir {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-scratch");
    std::fs::create_dir_all(&base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}

fn gpu_present() -> bool {
    std::env::var("TURBOIO_TEST_CUDA").as_deref() == Ok("1")
}

fn cuda(offset: u64) -> DeviceDst {
    DeviceDst { kind: "cuda", ordinal: 0, base: 0x7f00_0000_0000, offset }
}

#[test]
fn ordinary_io_passes_the_conformance_suite() {
    let dir = scratch();
    for mode in [GdsMode::Auto, GdsMode::On] {
        let st = GdsStorage::with_config(GdsConfig { mode, ..Default::default() });
        let sub = dir.path().join(format!("{mode:?}"));
        std::fs::create_dir_all(&sub).unwrap();
        conformance::run_all(&st, &sub, Capabilities::default(), &IoOptions { threads: 2, ..Default::default() });
    }
}

#[test]
fn without_a_gpu_device_io_refuses_cleanly_and_never_opens_the_driver() {
    if gpu_present() {
        eprintln!("skipped: this test is for machines without a GPU");
        return;
    }
    let dir = scratch();
    let path = dir.path().join("f.bin");
    let data = conformance::pattern(3 << 20, 9);
    std::fs::write(&path, &data).unwrap();
    let st = GdsStorage::new();
    let f = st.open(&path).unwrap();
    assert!(f.reads_to_device("cuda") && !f.reads_to_device("npu"));
    let started = Instant::now();
    let req = [DeviceReadRequest { offset: 4096, len: 1 << 20, dst: cuda(0) }];
    let err = f.read_to_device(&req, &IoOptions::default()).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(20), "refusing must not hang");
    assert!(matches!(err, StorageError::Unsupported { backend: "gds", .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("GPUDirect Storage is not available"), "{msg}");
    assert!(msg.contains("libcuda") || msg.contains("no CUDA device"), "names what is missing: {msg}");
    assert_eq!(turboio_io_gds::driver_open_calls(), 0, "cuFileDriverOpen is never reached without a GPU");
    // Other kinds and bad ranges are refused before anything else.
    let npu = [DeviceReadRequest { offset: 0, len: 1, dst: DeviceDst { kind: "npu", ..cuda(0) } }];
    assert!(f.read_to_device(&npu, &IoOptions::default()).unwrap_err().to_string().contains("CUDA memory"));
    let past = [DeviceReadRequest { offset: (3 << 20) - 10, len: 11, dst: cuda(0) }];
    assert!(matches!(f.read_to_device(&past, &IoOptions::default()), Err(StorageError::ShortFile { .. })));
    assert!(f.read_to_device(&[], &IoOptions::default()).is_ok());
    // Ordinary reads still work on the same file.
    let mut back = vec![0u8; 1000];
    f.read_exact_at(777, &mut back).unwrap();
    assert_eq!(back, data[777..1777]);

    // A save from device memory refuses too, leaving the old file and no temporary behind.
    assert!(st.writes_from_device("cuda"));
    let target = dir.path().join("out.bin");
    std::fs::write(&target, b"old").unwrap();
    let src = BytesSource(&data);
    let dev = [DeviceWriteRequest { offset: 8192, len: 1 << 20, src: cuda(0) }];
    let err = st.write_file_from_device(&target, &src, &dev, &IoOptions::default()).unwrap_err();
    assert!(matches!(err, StorageError::Unsupported { .. }), "{err:?}");
    assert_eq!(std::fs::read(&target).unwrap(), b"old");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 2, "no temporary file left: {left:?}");
    assert_eq!(turboio_io_gds::driver_open_calls(), 0);
    let probe = st.probe(0).unwrap_err();
    assert!(probe.contains("cuda:0"), "{probe}");
}

/// Saves from device memory go through the one atomic writer's protocol: a symbolic link at
/// the target is followed (not replaced), the replaced file's mode is kept, and temporaries of
/// dead writers are cleaned by the same rule. Device ranges holding no whole aligned block need
/// no driver, so this runs without a GPU (it failed before: the GDS path had a writer of its
/// own, asked for the driver first, and replaced links).
#[test]
fn device_saves_use_the_one_atomic_writer() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch();
    let blob = dir.path().join("blob.bin");
    std::fs::write(&blob, b"old").unwrap();
    std::fs::set_permissions(&blob, std::fs::Permissions::from_mode(0o640)).unwrap();
    let link = dir.path().join("model.bin");
    std::os::unix::fs::symlink("blob.bin", &link).unwrap();
    // A killed writer's temporary of this host (a pid that is gone).
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let stale = dir.path().join(format!(".blob.bin.turboio-tmp.{dead}.{}.{:016x}", turboio_io_posix::owner_tag(), 1));
    std::fs::write(&stale, b"partial").unwrap();
    let data = conformance::pattern(10_000, 3);
    // Two device ranges, neither with a whole 4 KiB block inside: written from the source.
    let dev = [
        DeviceWriteRequest { offset: 100, len: 3000, src: cuda(0) },
        DeviceWriteRequest { offset: 5000, len: 4000, src: cuda(100) },
    ];
    GdsStorage::new().write_file_from_device(&link, &BytesSource(&data), &dev, &IoOptions::default()).unwrap();
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link stays a link");
    assert_eq!(std::fs::read(&blob).unwrap(), data, "the file it points to is replaced");
    assert_eq!(std::fs::metadata(&blob).unwrap().permissions().mode() & 0o7777, 0o640);
    assert!(!stale.exists(), "abandoned temporaries are removed by the same rule");
    // The replaced file's second name is unlinked after the save returns.
    turboio_io_posix::wait_for_deletions();
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 2, "{left:?}");
    assert_eq!(turboio_io_gds::driver_open_calls(), 0);
}

/// The library named by `TURBOIO_CUFILE_LIB`, or `None` (skipped).
fn cufile_lib() -> Option<PathBuf> {
    match std::env::var_os("TURBOIO_CUFILE_LIB") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            eprintln!("skipped: TURBOIO_CUFILE_LIB is not set (the real libcufile.so.0 was not loaded)");
            None
        }
    }
}

#[test]
fn the_real_library_loads_with_every_symbol_and_a_version() {
    let Some(path) = cufile_lib() else { return };
    let api = sys::Api::load(&path).unwrap_or_else(|e| panic!("{e}"));
    let v = turboio_io_gds::result::version(&api).unwrap();
    assert!((1000..3000).contains(&v), "cuFileGetVersion gave {v}");
    eprintln!("{}: cuFile version {}.{}", path.display(), v / 1000, v % 1000 / 10);
    assert!(api.has_set_parameter_bool(), "cuFile >= 1.14 has cuFileSetParameterBool");
    // SAFETY: loading the library for a symbol lookup; no function is called.
    let lib = unsafe { libloading::Library::new(&path) }.unwrap();
    for name in sys::REQUIRED_SYMBOLS {
        // SAFETY: only the address is looked up.
        let s = unsafe { lib.get::<*const ()>(format!("{name}\0").as_bytes()) };
        assert!(s.is_ok(), "{name} missing from {}", path.display());
    }
    // The search finds it too (as the Python package sets it up), and says where from.
    let (v2, origin) = turboio_io_gds::library_version().unwrap();
    assert_eq!(v2, v);
    assert!(!origin.is_empty());
    assert_eq!(turboio_io_gds::driver_open_calls(), 0);
}

/// The cufile.h next to the library (`../include/cufile.h`), or `TURBOIO_CUFILE_INCLUDE`.
fn cufile_include(lib: &Path) -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("TURBOIO_CUFILE_INCLUDE") {
        return Some(PathBuf::from(dir));
    }
    let dir = lib.parent()?.parent()?.join("include");
    dir.join("cufile.h").exists().then_some(dir)
}

#[test]
fn layouts_constants_and_signatures_match_the_real_header() {
    let Some(lib) = cufile_lib() else { return };
    let Some(include) = cufile_include(&lib) else {
        eprintln!("skipped: no cufile.h next to {} (set TURBOIO_CUFILE_INCLUDE)", lib.display());
        return;
    };
    let dir = scratch();
    // cufile.h includes cuda.h; the cu12 cuFile wheel ships no cuda.h, so a stub with the two
    // types cufile.h uses is found after the real include directory, only if it lacks one.
    let stub = dir.path().join("stub");
    std::fs::create_dir_all(&stub).unwrap();
    std::fs::write(stub.join("cuda.h"), "typedef int CUresult;\ntypedef struct CUstream_st *CUstream;\n").unwrap();
    let src = dir.path().join("layout.c");
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <stdbool.h>\n#include <sys/types.h>\n#include \"cufile.h\"\n",
    );
    // Signatures: each function's type is compared at compile time with the one sys.rs
    // declares (nothing is linked).
    c.push_str(
        r#"
#define SAME(f, T) _Static_assert(__builtin_types_compatible_p(__typeof__(&f), T), #f " has another signature")
SAME(cuFileGetVersion, CUfileError_t (*)(int *));
SAME(cuFileDriverOpen, CUfileError_t (*)(void));
SAME(cuFileDriverClose_v2, CUfileError_t (*)(void));
SAME(cuFileDriverGetProperties, CUfileError_t (*)(CUfileDrvProps_t *));
SAME(cuFileUseCount, long (*)(void));
SAME(cuFileHandleRegister, CUfileError_t (*)(CUfileHandle_t *, CUfileDescr_t *));
SAME(cuFileHandleDeregister, void (*)(CUfileHandle_t));
SAME(cuFileBufRegister, CUfileError_t (*)(const void *, size_t, int));
SAME(cuFileBufDeregister, CUfileError_t (*)(const void *));
SAME(cuFileRead, ssize_t (*)(CUfileHandle_t, void *, size_t, off_t, off_t));
SAME(cuFileWrite, ssize_t (*)(CUfileHandle_t, const void *, size_t, off_t, off_t));
SAME(cuFileSetParameterBool, CUfileError_t (*)(CUFileBoolConfigParameter_t, bool));
int main(void) {
    printf("CUfileError_t %zu %zu %zu %zu\n", sizeof(CUfileError_t), _Alignof(CUfileError_t), offsetof(CUfileError_t, err), offsetof(CUfileError_t, cu_err));
    printf("CUfileDescr_t %zu %zu %zu %zu\n", sizeof(CUfileDescr_t), offsetof(CUfileDescr_t, type), offsetof(CUfileDescr_t, handle), offsetof(CUfileDescr_t, fs_ops));
    printf("CUfileDrvProps_t %zu %zu %zu %zu %zu %zu\n", sizeof(CUfileDrvProps_t), offsetof(CUfileDrvProps_t, nvfs.max_direct_io_size), offsetof(CUfileDrvProps_t, nvfs.dstatusflags), offsetof(CUfileDrvProps_t, fflags), offsetof(CUfileDrvProps_t, max_device_pinned_mem_size), offsetof(CUfileDrvProps_t, max_batch_io_timeout_msecs));
    printf("consts %d %d %d %d %d %d\n", (int)CU_FILE_HANDLE_TYPE_OPAQUE_FD, (int)CU_FILE_SUCCESS, (int)CU_FILE_CUDA_DRIVER_ERROR, (int)CU_FILE_DRIVER_ALREADY_OPEN, (int)CU_FILE_P2P_SUPPORTED, (int)CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE);
    printf("codes %d %d %d %d %d %d %d\n", (int)CU_FILE_DRIVER_NOT_INITIALIZED, (int)CU_FILE_IO_NOT_SUPPORTED, (int)CU_FILE_INVALID_FILE_OPEN_FLAG, (int)CU_FILE_HANDLE_NOT_REGISTERED, (int)CU_FILE_NVFS_SETUP_ERROR, (int)CU_FILE_IO_DISABLED, (int)CU_FILE_ASYNC_NOT_SUPPORTED);
    return 0;
}
"#,
    );
    std::fs::write(&src, c).unwrap();
    let exe = dir.path().join("layout");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = match Command::new(&cc)
        .args(["-std=gnu11", "-Wall", "-Werror", "-Wno-unused-function"])
        .arg("-I")
        .arg(&include)
        .arg("-idirafter")
        .arg(&stub)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipped: no C compiler ({cc}: {e})");
            return;
        }
    };
    assert!(
        out.status.success(),
        "compiling against {}/cufile.h failed:\n{}",
        include.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    let text = String::from_utf8_lossy(&run.stdout).into_owned();
    let line = |tag: &str| -> Vec<usize> {
        text.lines()
            .find(|l| l.starts_with(tag))
            .unwrap_or_else(|| panic!("no {tag} in {text}"))
            .split_whitespace()
            .skip(1)
            .map(|v| v.parse().unwrap())
            .collect()
    };
    use std::mem::{align_of, offset_of, size_of};
    assert_eq!(
        line("CUfileError_t"),
        [
            size_of::<sys::CUfileError>(),
            align_of::<sys::CUfileError>(),
            offset_of!(sys::CUfileError, err),
            offset_of!(sys::CUfileError, cu_err)
        ]
    );
    assert_eq!(
        line("CUfileDescr_t"),
        [
            size_of::<sys::CUfileDescr>(),
            offset_of!(sys::CUfileDescr, type_),
            offset_of!(sys::CUfileDescr, handle),
            offset_of!(sys::CUfileDescr, fs_ops)
        ]
    );
    assert_eq!(
        line("CUfileDrvProps_t"),
        [
            size_of::<sys::CUfileDrvProps>(),
            offset_of!(sys::CUfileDrvProps, nvfs) + offset_of!(sys::CUfileNvfsProps, max_direct_io_size),
            offset_of!(sys::CUfileDrvProps, nvfs) + offset_of!(sys::CUfileNvfsProps, dstatusflags),
            offset_of!(sys::CUfileDrvProps, fflags),
            offset_of!(sys::CUfileDrvProps, max_device_pinned_mem_size),
            offset_of!(sys::CUfileDrvProps, max_batch_io_timeout_msecs),
        ]
    );
    assert_eq!(
        line("consts"),
        [
            sys::CU_FILE_HANDLE_TYPE_OPAQUE_FD as usize,
            sys::CU_FILE_SUCCESS as usize,
            sys::CU_FILE_CUDA_DRIVER_ERROR as usize,
            sys::CU_FILE_DRIVER_ALREADY_OPEN as usize,
            sys::CU_FILE_P2P_SUPPORTED as usize,
            sys::CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE as usize,
        ]
    );
    let codes = line("codes");
    for (code, name) in codes.iter().zip([
        "DRIVER_NOT_INITIALIZED",
        "IO_NOT_SUPPORTED",
        "INVALID_FILE_OPEN_FLAG",
        "HANDLE_NOT_REGISTERED",
        "NVFS_SETUP_ERROR",
        "IO_DISABLED",
        "ASYNC_NOT_SUPPORTED",
    ]) {
        let ours = sys::error_name(*code as i32).unwrap_or_else(|| panic!("no name for {code}"));
        assert!(ours.contains(name), "{code}: header says {name}, we say {ours}");
    }
}
