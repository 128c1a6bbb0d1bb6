//! Loads and saves to device memory the CPU cannot address, end to end on the opaque test
//! device, with every ability the CUDA device has switched on and off: pooled staging buffers,
//! decryption after upload (no AES on the CPU), copies straight from the page-cache mapping,
//! a GPUDirect-Storage-like backend and its refusals, 16-byte placement, saves from device
//! memory. Each fallback must leave a line in the report and identical bytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use turboio::crypt::{Encryption, Iv, Key, Keys};
use turboio::device::testing::OpaqueDevice;
use turboio::device::{Allocation, Device, DeviceId, NpuDevice, StagingPool};
use turboio::storage::{
    DeviceReadRequest, DeviceWriteRequest, IoOptions, RangeReader, ReadRequest, Storage, StorageError, StorageFile,
    WriteSource,
};
use turboio::{DeviceTensor, Dtype, Held, LoadMode, LoadOptions, LoadedFile, SaveOptions, SaveTensor};
use turboio_tests::{bytes, disk_dir};

/// What the orchestrator counts as hot (half the file cached).
const HOT: f64 = 0.5;

fn sample(dir: &Path, size: u64) -> PathBuf {
    let path = dir.join("sample.safetensors");
    turboio::sample::write_sample(&path, size, 5, &SaveOptions::default()).unwrap();
    path
}

fn assert_matches(loaded: &LoadedFile, plain_file: &Path, label: &str) {
    let plain = std::fs::read(plain_file).unwrap();
    let start = loaded.header().data_start() as usize;
    assert!(loaded.len() > 5, "{label}: a real sample");
    for t in loaded.tensors() {
        let (b, e) = t.info().data_offsets;
        assert!(
            loaded.to_host(t.name()).unwrap() == plain[start + b..start + e],
            "{label}: tensor {} differs",
            t.name()
        );
    }
}

fn dev_opts(dev: &Arc<OpaqueDevice>) -> LoadOptions {
    LoadOptions {
        device: Some(dev.clone() as Arc<dyn Device>),
        staging_chunk: 1 << 20,
        threads: 2,
        ..Default::default()
    }
}

fn fixed(key_len: usize) -> Encryption {
    let key: Vec<u8> = (0..key_len as u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
    Encryption::new(Keys::Fixed {
        key: Key::new(&key).unwrap(),
        iv: Iv([0xff, 0xfe, 1, 2, 3, 4, 5, 6, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xf0]),
    })
}

#[test]
fn pooled_staging_buffers_are_reused_across_loads() {
    let d = disk_dir();
    let path = sample(d.path(), 12 << 20);
    let pool = StagingPool::new(8);
    let dev = Arc::new(OpaqueDevice::new(0).with_staging_pool(pool.clone()));
    let opts = LoadOptions { mode: LoadMode::Copied, ..dev_opts(&dev) };
    let first = turboio::load(&path, &opts).unwrap();
    assert_matches(&first, &path, "first");
    let allocated = pool.allocations();
    assert!(allocated >= 2, "two buffers per reader");
    assert_eq!(pool.free_buffers(), allocated, "every buffer came back");
    drop(first);
    let second = turboio::load(&path, &opts).unwrap();
    assert_matches(&second, &path, "second");
    assert_eq!(pool.allocations(), allocated, "the second load allocated no staging buffer");
    assert!(pool.reuses() >= allocated);
}

#[test]
fn encrypted_loads_decrypt_on_the_device_not_the_cpu() {
    let d = disk_dir();
    let plain = sample(d.path(), 6 << 20);
    for key_len in [16, 32] {
        let enc = fixed(key_len);
        let encrypted = d.path().join(format!("enc{key_len}.safetensors"));
        turboio::crypt::encrypt_file(&plain, &encrypted, &enc, &SaveOptions::default()).unwrap();
        for chunk in [4096 * 3 + 1, 1 << 20] {
            let dev = Arc::new(OpaqueDevice::new(0).with_decryption());
            let opts = LoadOptions { encryption: Some(enc.clone()), staging_chunk: chunk, ..dev_opts(&dev) };
            let loaded = turboio::load(&encrypted, &opts).unwrap();
            let label = format!("AES-{} chunk {chunk}", key_len * 8);
            // The device XORed every staged byte; had the CPU decrypted too, the bytes would be
            // garbage again.
            assert_eq!(dev.decrypted_bytes(), loaded.report().bytes, "{label}");
            assert!(loaded.report().fallbacks.is_empty(), "{label}: {:?}", loaded.report().fallbacks);
            assert_matches(&loaded, &plain, &label);
            assert_eq!(dev.live_keys(), 0, "{label}: the key left the device with the load");
        }
    }
}

#[test]
fn header_files_decrypt_on_the_device_at_the_right_stream_position() {
    let d = disk_dir();
    let plain = sample(d.path(), 4 << 20);
    let enc = fixed(16);
    let Keys::Fixed { key, iv } = &enc.keys else { unreachable!() };
    // veTurboIO's header layout: 256 KiB of header, then the whole plain file encrypted from
    // keystream position 0.
    let header = turboio_cipher::CipherHeader {
        mode: turboio_cipher::Mode::Ctr128,
        iv: *iv,
        meta_data_key: "opaque".into(),
        file_timestamp: 0,
    };
    let mut body = std::fs::read(&plain).unwrap();
    turboio_cipher::CtrCipher::new(key, iv).apply_at(0, &mut body);
    let mut file = header.to_bytes().unwrap();
    file.extend_from_slice(&body);
    let encrypted = d.path().join("header.safetensors");
    std::fs::write(&encrypted, file).unwrap();
    let dev = Arc::new(OpaqueDevice::new(0).with_decryption());
    let loaded = turboio::load(&encrypted, &LoadOptions { encryption: Some(enc), ..dev_opts(&dev) }).unwrap();
    assert!(dev.decrypted_bytes() > 0);
    assert_matches(&loaded, &plain, "header file");
}

#[test]
fn without_device_decryption_the_readers_decrypt_and_say_why() {
    let d = disk_dir();
    let plain = sample(d.path(), 4 << 20);
    let enc = fixed(32);
    let encrypted = d.path().join("enc.safetensors");
    turboio::crypt::encrypt_file(&plain, &encrypted, &enc, &SaveOptions::default()).unwrap();
    // A device that cannot decrypt at all: no fallback line, the CPU decrypts as always.
    let dev = Arc::new(OpaqueDevice::new(0));
    let loaded = turboio::load(&encrypted, &LoadOptions { encryption: Some(enc.clone()), ..dev_opts(&dev) }).unwrap();
    assert!(loaded.report().fallbacks.is_empty());
    assert_matches(&loaded, &plain, "CPU decryption");
    // A device that should but cannot (the CUDA device without NVRTC): one line says so.
    let dev = Arc::new(OpaqueDevice::new(0).with_key_failure("NVRTC (libnvrtc.so.13 or .12) was not found"));
    let loaded = turboio::load(&encrypted, &LoadOptions { encryption: Some(enc), ..dev_opts(&dev) }).unwrap();
    assert_eq!(dev.decrypted_bytes(), 0);
    let fb = &loaded.report().fallbacks;
    assert_eq!(fb.len(), 1, "{fb:?}");
    assert!(fb[0].starts_with("decrypting on the CPU") && fb[0].contains("NVRTC"), "{fb:?}");
    assert_matches(&loaded, &plain, "CPU decryption after a key failure");
}

/// An 8 MiB sample just read, so in the page cache; `None` (the test skipped, and said) where
/// the page cache did not keep at least half of it.
fn hot_sample(dir: &Path) -> Option<PathBuf> {
    let path = sample(dir, 8 << 20);
    drop(std::fs::read(&path).unwrap());
    let cached = turboio::posix::PosixStorage::new().open_posix(&path).unwrap().cached_fraction().unwrap();
    if cached < HOT {
        eprintln!("skipped: the page cache kept only {cached:.2} of a file just read");
        return None;
    }
    Some(path)
}

#[test]
fn hot_files_go_straight_from_the_page_cache_mapping() {
    let d = disk_dir();
    let Some(path) = hot_sample(d.path()) else { return };
    let dev = Arc::new(OpaqueDevice::new(0).with_host_uploads());
    let hot = turboio::load(&path, &dev_opts(&dev)).unwrap();
    assert_eq!(hot.report().held, Held::Staged);
    assert_eq!(hot.report().read.method, "mmap, DMA from the page cache");
    assert_eq!(dev.host_uploaded_bytes(), hot.report().bytes);
    assert_eq!(dev.uploads(), 0, "no staging");
    assert_matches(&hot, &path, "from the mapping");
    // Copied mode stages instead.
    let copied = turboio::load(&path, &LoadOptions { mode: LoadMode::Copied, ..dev_opts(&dev) }).unwrap();
    assert_ne!(copied.report().read.method, "mmap, DMA from the page cache");
    assert!(dev.uploads() > 0);
    // A refused registration stages, with one line saying why.
    dev.refuse_host_uploads();
    let refused = turboio::load(&path, &dev_opts(&dev)).unwrap();
    let fb = &refused.report().fallbacks;
    assert!(fb.len() == 1 && fb[0].contains("refused"), "{fb:?}");
    assert_matches(&refused, &path, "refused mapping");
    // A device without the ability, asked for mapped: staged, and said.
    let plain_dev = Arc::new(OpaqueDevice::new(0));
    let forced = turboio::load(&path, &LoadOptions { mode: LoadMode::Mapped, ..dev_opts(&plain_dev) }).unwrap();
    assert!(forced.report().fallbacks.iter().any(|f| f.contains("not mapped")), "{:?}", forced.report().fallbacks);
    assert_matches(&forced, &path, "mapped on a device without host uploads");
    // Lazy loads are a CPU thing.
    let err = turboio::load(&path, &LoadOptions { mode: LoadMode::Lazy, ..dev_opts(&plain_dev) }).unwrap_err();
    assert!(err.to_string().contains("lazy"), "{err}");
}

/// A device where registering host memory costs more than staging (CUDA): automatic loads of a
/// hot file stage, with no fallback line; asked for mapped, it maps, unless the device refuses
/// the page cache's pages.
#[test]
fn a_device_that_prefers_staging_maps_hot_files_only_when_asked() {
    let d = disk_dir();
    let Some(path) = hot_sample(d.path()) else { return };
    let dev = Arc::new(OpaqueDevice::new(0).with_host_uploads_on_request());
    assert!(dev.uploads_from_host() && !dev.prefers_host_uploads());
    let auto = turboio::load(&path, &dev_opts(&dev)).unwrap();
    assert_ne!(auto.report().read.method, "mmap, DMA from the page cache");
    assert!(auto.report().fallbacks.is_empty(), "{:?}", auto.report().fallbacks);
    assert_eq!(dev.host_uploaded_bytes(), 0);
    assert!(dev.uploads() > 0, "staged");
    assert_matches(&auto, &path, "staged hot file");
    let mapped = turboio::load(&path, &LoadOptions { mode: LoadMode::Mapped, ..dev_opts(&dev) }).unwrap();
    assert_eq!(mapped.report().read.method, "mmap, DMA from the page cache");
    assert_eq!(dev.host_uploaded_bytes(), mapped.report().bytes);
    assert_matches(&mapped, &path, "mapped on request");
    // A device that uploads host memory but refuses the page cache's pages (CUDA by default):
    // asked for mapped, it stages, and the report says why.
    let dev = Arc::new(OpaqueDevice::new(0).with_page_cache_refused("page-cache DMA is off (test)"));
    let refused = turboio::load(&path, &LoadOptions { mode: LoadMode::Mapped, ..dev_opts(&dev) }).unwrap();
    assert_ne!(refused.report().read.method, "mmap, DMA from the page cache");
    assert_eq!(refused.report().fallbacks, ["not mapped: page-cache DMA is off (test)"]);
    assert_eq!(dev.host_uploaded_bytes(), 0);
    assert!(dev.uploads() > 0, "staged");
    assert_matches(&refused, &path, "page cache refused");
}

#[test]
fn the_data_section_is_16_byte_aligned_in_device_memory() {
    let d = disk_dir();
    let mut starts = std::collections::HashSet::new();
    for pad in 0..6 {
        let path = d.path().join(format!("a{pad}.safetensors"));
        let data = bytes(4096 * 3 + 40, pad);
        let mut meta = BTreeMap::new();
        meta.insert("pad".to_owned(), "x".repeat(pad as usize * 3));
        let t = [
            SaveTensor { name: "a", dtype: Dtype::F32, shape: &[3], data: &data[..12] },
            SaveTensor { name: "b", dtype: Dtype::U8, shape: &[4096 * 3 + 28], data: &data[12..] },
        ];
        turboio::save(&path, &t, Some(&meta), &SaveOptions::default()).unwrap();
        let dev = Arc::new(OpaqueDevice::new(0));
        let loaded = turboio::load(&path, &dev_opts(&dev)).unwrap();
        starts.insert(loaded.header().data_start() % 16);
        assert_eq!((loaded.memory().address() as usize + loaded.data_base()) % 16, 0, "pad {pad}");
        assert_eq!(loaded.to_host("b").unwrap(), &data[12..]);
        assert_eq!(loaded.to_host("a").unwrap(), &data[..12]);
    }
    assert_eq!(starts.len(), 2, "headers ending at 0 and 8 mod 16 were both tried");
}

#[test]
fn npu_and_missing_devices_are_clear_errors() {
    let d = disk_dir();
    let path = sample(d.path(), 1 << 20);
    let npu: Arc<dyn Device> = Arc::new(NpuDevice::new(0));
    let err = turboio::load(&path, &LoadOptions { device: Some(npu), ..Default::default() }).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("sample.safetensors") && msg.contains("npu:0") && msg.contains("not supported in this build"),
        "{msg}"
    );
    let err = turboio::device::open_device(DeviceId::parse("npu:0").unwrap()).unwrap_err().to_string();
    assert!(err.contains("CANN"), "{err}");
    // CUDA is compiled in here; without a GPU, opening it names what is missing.
    if std::env::var("TURBOIO_TEST_CUDA").as_deref() != Ok("1") {
        let err = turboio::device::open_device(DeviceId::parse("cuda:0").unwrap()).unwrap_err().to_string();
        assert!(err.contains("cuda:0") && (err.contains("libcuda") || err.contains("no CUDA device")), "{err}");
    }
    assert!(DeviceId::parse("tpu:0").is_err());
    assert_eq!(DeviceId::parse("cuda").unwrap().to_string(), "cuda:0");
    assert_eq!(DeviceId::parse(" cuda:3 ").unwrap().ordinal, 3);
}

/// A storage standing in for GDS on the test device: DMA "from the file" into the test device's
/// memory, or a refusal, and a say in whether the file looks cold.
#[derive(Debug)]
struct FakeGds {
    dev: Arc<OpaqueDevice>,
    refuse: Option<&'static str>,
    cold: bool,
    reads: Arc<AtomicUsize>,
    writes: Arc<AtomicUsize>,
}

#[derive(Debug)]
struct FakeFile {
    inner: turboio::posix::PosixFile,
    gds: Arc<FakeGdsShared>,
}

#[derive(Debug)]
struct FakeGdsShared {
    dev: Arc<OpaqueDevice>,
    refuse: Option<&'static str>,
    cold: bool,
    reads: Arc<AtomicUsize>,
}

impl StorageFile for FakeFile {
    fn path(&self) -> &Path {
        self.inner.path()
    }
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn reader(&self) -> Result<Box<dyn RangeReader + '_>, StorageError> {
        self.inner.reader()
    }
    fn read_ranges(&self, requests: Vec<ReadRequest<'_>>, opts: &IoOptions<'_>) -> Result<(), StorageError> {
        self.inner.read_ranges(requests, opts)
    }
    fn reads_to_device(&self, kind: &str) -> bool {
        kind == "test"
    }
    fn read_to_device(&self, requests: &[DeviceReadRequest], _opts: &IoOptions<'_>) -> Result<(), StorageError> {
        if let Some(why) = self.gds.refuse {
            return Err(StorageError::Unsupported {
                backend: "fake-gds",
                what: format!("GPUDirect Storage is not available: {why}"),
            });
        }
        for r in requests {
            let mut buf = vec![0u8; r.len as usize];
            self.inner.read_exact_at(r.offset, &mut buf)?;
            // SAFETY: the orchestrator hands us a live allocation of this device (address and
            // offset inside it), which the test device range-checks.
            let view = unsafe { self.gds.dev.borrow(r.dst.base + r.dst.offset, buf.len()) }.unwrap();
            self.gds.dev.write(view.as_ref(), 0, &buf).unwrap();
        }
        self.gds.reads.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn local_file(&self) -> Option<&std::fs::File> {
        self.inner.local_file()
    }
    fn cached_fraction(&self) -> Option<f64> {
        if self.gds.cold {
            Some(0.0)
        } else {
            self.inner.cached_fraction()
        }
    }
}

impl Storage for FakeGds {
    fn name(&self) -> &'static str {
        "fake-gds"
    }
    fn open(&self, path: &Path) -> Result<Box<dyn StorageFile>, StorageError> {
        let gds = Arc::new(FakeGdsShared {
            dev: self.dev.clone(),
            refuse: self.refuse,
            cold: self.cold,
            reads: self.reads.clone(),
        });
        Ok(Box::new(FakeFile { inner: turboio::posix::PosixStorage::new().open_posix(path)?, gds }))
    }
    fn write_file(&self, path: &Path, source: &dyn WriteSource, opts: &IoOptions<'_>) -> Result<(), StorageError> {
        turboio::posix::PosixStorage::new().write_file(path, source, opts)
    }
    fn writes_from_device(&self, kind: &str) -> bool {
        kind == "test"
    }
    fn write_file_from_device(
        &self,
        path: &Path,
        source: &dyn WriteSource,
        device: &[DeviceWriteRequest],
        opts: &IoOptions<'_>,
    ) -> Result<(), StorageError> {
        if let Some(why) = self.refuse {
            return Err(StorageError::Unsupported {
                backend: "fake-gds",
                what: format!("GPUDirect Storage is not available: {why}"),
            });
        }
        // Device ranges come from device memory, the rest from the source.
        let mut file = vec![0u8; source.len() as usize];
        let mut covered = vec![false; file.len()];
        for r in device {
            // SAFETY: addresses of live test-device allocations, range-checked by the device.
            let view = unsafe { self.dev.borrow(r.src.base + r.src.offset, r.len as usize) }.unwrap();
            let range = r.offset as usize..(r.offset + r.len) as usize;
            self.dev.download(view.as_ref(), 0, &mut file[range.clone()]).unwrap();
            covered[range].iter_mut().for_each(|c| *c = true);
        }
        for i in 0..file.len() {
            if !covered[i] {
                source
                    .fill(i as u64, &mut file[i..i + 1])
                    .map_err(|m| StorageError::Source { path: path.into(), message: m })?;
            }
        }
        self.writes.fetch_add(1, Ordering::SeqCst);
        turboio::posix::PosixStorage::new().write_file(path, &turboio::storage::BytesSource(&file), opts)
    }
}

fn fake(dev: &Arc<OpaqueDevice>, refuse: Option<&'static str>, cold: bool) -> FakeGds {
    FakeGds { dev: dev.clone(), refuse, cold, reads: Arc::default(), writes: Arc::default() }
}

#[test]
fn device_reads_from_storage_for_cold_files_and_fall_back_with_a_reason() {
    let d = disk_dir();
    let path = sample(d.path(), 6 << 20);
    let dev = Arc::new(OpaqueDevice::new(0).with_decryption());
    let gds = fake(&dev, None, true);
    let reads = gds.reads.clone();
    let opts = LoadOptions { storage: Some(Arc::new(gds)), ..dev_opts(&dev) };
    let loaded = turboio::load(&path, &opts).unwrap();
    assert_eq!(loaded.report().read.method, "gds");
    assert_eq!(reads.load(Ordering::SeqCst), 1);
    assert_eq!(dev.uploads(), 0, "nothing staged");
    assert_matches(&loaded, &path, "gds");

    // Encrypted: ciphertext by GDS, then decrypted in device memory.
    let enc = fixed(16);
    let encrypted = d.path().join("enc.safetensors");
    turboio::crypt::encrypt_file(&path, &encrypted, &enc, &SaveOptions::default()).unwrap();
    let loaded = turboio::load(&encrypted, &LoadOptions { encryption: Some(enc.clone()), ..opts.clone() }).unwrap();
    assert_eq!(loaded.report().read.method, "gds");
    assert_eq!(dev.decrypted_bytes(), loaded.report().bytes);
    assert_matches(&loaded, &path, "gds encrypted");
    // Encrypted, and the device cannot decrypt: staged, CPU decryption, with the reason.
    let plain_dev = Arc::new(OpaqueDevice::new(0));
    let o = LoadOptions {
        storage: Some(Arc::new(fake(&plain_dev, None, true))),
        encryption: Some(enc),
        ..dev_opts(&plain_dev)
    };
    let loaded = turboio::load(&encrypted, &o).unwrap();
    assert_ne!(loaded.report().read.method, "gds");
    assert!(loaded.report().fallbacks.iter().any(|f| f.contains("cannot decrypt")), "{:?}", loaded.report().fallbacks);
    assert_matches(&loaded, &path, "gds refused for encryption");

    // Refused (no nvidia-fs, no GPU...): staged, one line.
    let o =
        LoadOptions { storage: Some(Arc::new(fake(&dev, Some("nvidia-fs is not loaded"), true))), ..dev_opts(&dev) };
    let loaded = turboio::load(&path, &o).unwrap();
    assert_ne!(loaded.report().read.method, "gds");
    assert_eq!(
        loaded.report().fallbacks,
        vec!["GPUDirect Storage is not available: nvidia-fs is not loaded".to_owned()]
    );
    assert_matches(&loaded, &path, "gds refused");

    // Hot files are staged from the page cache rather than DMA'd from the disk (when the device
    // cannot copy from the mapping).
    drop(std::fs::read(&path).unwrap());
    let o = LoadOptions { storage: Some(Arc::new(fake(&plain_dev, None, false))), ..dev_opts(&plain_dev) };
    let loaded = turboio::load(&path, &o).unwrap();
    if loaded.report().cached_fraction.is_some_and(|f| f >= HOT) {
        assert_ne!(loaded.report().read.method, "gds");
        assert!(loaded.report().fallbacks.iter().any(|f| f.contains("page cache")), "{:?}", loaded.report().fallbacks);
    }
    // ... unless copied mode says to read them anyway.
    let loaded = turboio::load(&path, &LoadOptions { mode: LoadMode::Copied, ..o }).unwrap();
    assert_eq!(loaded.report().read.method, "gds");
}

#[test]
fn the_real_gds_backend_falls_back_on_the_test_device_and_without_a_gpu() {
    let d = disk_dir();
    let path = sample(d.path(), 4 << 20);
    let dev = Arc::new(OpaqueDevice::new(0));
    let gds: Arc<dyn Storage> = Arc::new(turboio::gds::GdsStorage::new());
    // The test device is not CUDA memory: GDS is simply not offered.
    let loaded = turboio::load(&path, &LoadOptions { storage: Some(gds), ..dev_opts(&dev) }).unwrap();
    assert!(loaded.report().fallbacks.is_empty(), "{:?}", loaded.report().fallbacks);
    assert_matches(&loaded, &path, "GdsStorage on the test device");
    assert_eq!(turboio::gds::driver_open_calls(), 0);
}

/// `(name, dtype, shape, offset in the allocation, bytes)`.
type Spec = (String, Dtype, Vec<usize>, usize, usize);

fn device_tensors(dev: &OpaqueDevice, data: &[u8]) -> (Box<dyn Allocation>, Vec<Spec>) {
    let mem = dev.alloc(data.len() + 64).unwrap();
    dev.write(mem.as_ref(), 64, data).unwrap();
    let specs = vec![
        ("w".to_owned(), Dtype::BF16, vec![100, 33], 64usize, 6600usize),
        ("b".to_owned(), Dtype::F32, vec![7], 64 + 6600, 28),
        ("empty".to_owned(), Dtype::I64, vec![0, 3], 64, 0),
        ("big".to_owned(), Dtype::U8, vec![data.len() - 6628], 64 + 6628, data.len() - 6628),
    ];
    (mem, specs)
}

#[test]
fn saves_from_device_memory_are_byte_identical_and_fall_back() {
    let d = disk_dir();
    let data = bytes(6628 + (3 << 20) + 5, 77);
    let mut meta = BTreeMap::new();
    meta.insert("format".to_owned(), "pt".to_owned());
    // The reference: the same tensors saved from host memory.
    let reference = d.path().join("host.safetensors");
    let big_shape = [data.len() - 6628];
    let host: Vec<SaveTensor<'_>> = vec![
        SaveTensor { name: "w", dtype: Dtype::BF16, shape: &[100, 33], data: &data[..6600] },
        SaveTensor { name: "b", dtype: Dtype::F32, shape: &[7], data: &data[6600..6628] },
        SaveTensor { name: "empty", dtype: Dtype::I64, shape: &[0, 3], data: &[] },
        SaveTensor { name: "big", dtype: Dtype::U8, shape: &big_shape, data: &data[6628..] },
    ];
    turboio::save(&reference, &host, Some(&meta), &SaveOptions::default()).unwrap();
    let expect = std::fs::read(&reference).unwrap();

    let dev = Arc::new(OpaqueDevice::new(0));
    let (mem, specs) = device_tensors(&dev, &data);
    // SAFETY: ranges of the live allocation `mem`, unchanged during the saves.
    let views: Vec<Box<dyn Allocation>> =
        specs.iter().map(|s| unsafe { dev.borrow(mem.address() + s.3 as u64, s.4) }.unwrap()).collect();
    let tensors: Vec<DeviceTensor<'_>> = specs
        .iter()
        .zip(&views)
        .map(|(s, v)| DeviceTensor { name: &s.0, dtype: s.1, shape: &s.2, memory: v.as_ref() })
        .collect();

    // Default storage: staged through host memory, chunk by chunk.
    let out = d.path().join("staged.safetensors");
    let r = turboio::save_from_device(&out, dev.as_ref(), &tensors, Some(&meta), &SaveOptions::default()).unwrap();
    assert_eq!((r.method, r.fallback.as_deref()), ("staged", None));
    assert!(std::fs::read(&out).unwrap() == expect);

    // A storage that writes from device memory.
    let gds = fake(&dev, None, false);
    let writes = gds.writes.clone();
    let out = d.path().join("gds.safetensors");
    let opts = SaveOptions { storage: Some(Arc::new(gds)), ..Default::default() };
    let r = turboio::save_from_device(&out, dev.as_ref(), &tensors, Some(&meta), &opts).unwrap();
    assert_eq!(r.method, "gds");
    assert_eq!(writes.load(Ordering::SeqCst), 1);
    assert!(std::fs::read(&out).unwrap() == expect);

    // Refused: staged, with the reason.
    let out = d.path().join("refused.safetensors");
    let opts = SaveOptions { storage: Some(Arc::new(fake(&dev, Some("no GPU"), false))), ..Default::default() };
    let r = turboio::save_from_device(&out, dev.as_ref(), &tensors, Some(&meta), &opts).unwrap();
    assert_eq!(r.method, "staged");
    assert!(r.fallback.unwrap().contains("no GPU"));
    assert!(std::fs::read(&out).unwrap() == expect);

    // Encrypted saves encrypt on the way out (never straight from device memory), and load back.
    let enc = fixed(16);
    let out = d.path().join("enc.safetensors");
    let opts = SaveOptions {
        storage: Some(Arc::new(fake(&dev, None, false))),
        encryption: Some(enc.clone()),
        ..Default::default()
    };
    let r = turboio::save_from_device(&out, dev.as_ref(), &tensors, Some(&meta), &opts).unwrap();
    assert_eq!(r.method, "staged");
    let back = turboio::load(&out, &LoadOptions { encryption: Some(enc), ..Default::default() }).unwrap();
    assert_eq!(back.to_host("big").unwrap(), &data[6628..]);

    // A tensor whose memory is too short is refused before anything is written.
    let short = DeviceTensor { name: "w", dtype: Dtype::F32, shape: &[1 << 20], memory: views[0].as_ref() };
    let out = d.path().join("bad.safetensors");
    assert!(turboio::save_from_device(&out, dev.as_ref(), &[short], None, &SaveOptions::default()).is_err());
    assert!(!out.exists());
}

/// A model's shards fill through one pipeline (every shard's chunks in one queue): each tensor
/// lands in its own shard's device memory, plain, encrypted (decrypted on the device), with the
/// page cache bypassed, and for a selection.
#[test]
fn a_models_shards_fill_through_one_pipeline() {
    let d = disk_dir();
    let names: Vec<String> = (0..7).map(|i| format!("layers.{i}.weight")).collect();
    // Sizes that cross chunk boundaries at odd places.
    let data: Vec<Vec<u8>> = (0..7).map(|i| bytes((1 << 20) + 4096 * i + 12 * i, 40 + i as u64)).collect();
    let shapes: Vec<[usize; 1]> = data.iter().map(|b| [b.len()]).collect();
    let views: Vec<SaveTensor<'_>> = names
        .iter()
        .zip(&data)
        .zip(&shapes)
        .map(|((n, b), s)| SaveTensor { name: n, dtype: Dtype::U8, shape: s, data: b })
        .collect();
    let plain = d.path().join("plain");
    let report = turboio::save_model_dir(&plain, &views, None, 2 << 20, &SaveOptions::default()).unwrap();
    assert!(report.shards.len() >= 3, "{report:?}");
    let enc = fixed(16);
    let encrypted = d.path().join("encrypted");
    turboio::save_model_dir(
        &encrypted,
        &views,
        None,
        2 << 20,
        &SaveOptions { encryption: Some(enc.clone()), ..Default::default() },
    )
    .unwrap();
    let cases: Vec<(&str, &Path, Arc<OpaqueDevice>, LoadOptions)> = {
        let dev = |decrypts: bool| {
            Arc::new(if decrypts { OpaqueDevice::new(0).with_decryption() } else { OpaqueDevice::new(0) })
        };
        let (a, b, c, e, eb) = (dev(false), dev(false), dev(false), dev(true), dev(true));
        vec![
            ("plain", &plain, a.clone(), LoadOptions { mode: LoadMode::Copied, ..dev_opts(&a) }),
            (
                "bypass",
                &plain,
                b.clone(),
                LoadOptions { mode: LoadMode::Copied, cache: turboio::CachePolicy::Bypass, ..dev_opts(&b) },
            ),
            (
                "selection",
                &plain,
                c.clone(),
                LoadOptions {
                    mode: LoadMode::Copied,
                    tensors: Some(turboio::Selection::names(["layers.1.weight", "layers.5.weight"])),
                    ..dev_opts(&c)
                },
            ),
            ("encrypted", &encrypted, e.clone(), LoadOptions { encryption: Some(enc.clone()), ..dev_opts(&e) }),
            (
                "encrypted, bypass",
                &encrypted,
                eb.clone(),
                LoadOptions {
                    encryption: Some(enc.clone()),
                    mode: LoadMode::Copied,
                    cache: turboio::CachePolicy::Bypass,
                    ..dev_opts(&eb)
                },
            ),
        ]
    };
    for (label, dir, dev, opts) in cases {
        if label.ends_with("bypass") {
            // Cold, as a bypassing load is meant for (a hot file is read from the page cache).
            for f in std::fs::read_dir(dir).unwrap() {
                let f = turboio::posix::PosixStorage::new().open_posix(&f.unwrap().path()).unwrap();
                f.evict_cache().unwrap();
            }
        }
        let m = turboio::load_model(dir, &opts).unwrap_or_else(|e| panic!("{label}: {e}"));
        let want: Vec<usize> = if label == "selection" { vec![1, 5] } else { (0..7).collect() };
        assert_eq!(m.len(), want.len(), "{label}");
        for &i in &want {
            let t = m.tensor(&names[i]).unwrap_or_else(|| panic!("{label}: no {}", names[i]));
            let shard = m.shards().iter().find(|s| s.tensor(&names[i]).is_some()).unwrap();
            assert!(shard.to_host(t.name()).unwrap() == data[i], "{label}: tensor {} differs", names[i]);
        }
        if label.starts_with("encrypted") {
            assert_eq!(dev.decrypted_bytes(), dev.uploaded_bytes(), "{label}: every byte decrypted on the device");
            assert!(dev.decrypted_bytes() > 0);
        }
        for s in m.shards() {
            assert!(s.report().read.method.starts_with("staged"), "{label}: {}", s.report().read.method);
            if label.ends_with("bypass") && turboio::posix::io_uring_available() {
                // Every shard cold with O_DIRECT (the scratch directory is on the disk): the
                // storage's io_uring reads into the slots.
                assert!(
                    s.report().read.method.contains("as its read completes"),
                    "{label}: {}",
                    s.report().read.method
                );
            }
            assert!(s.report().fallbacks.is_empty(), "{label}: {:?}", s.report().fallbacks);
        }
    }
}
