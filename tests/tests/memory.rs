//! Memory: a mapped load adds no anonymous memory beyond the header and the tensor index, and a
//! copied load holds the data once (no double buffering). One test in its own binary, so no
//! other test allocates while it measures.

use turboio::{LoadMode, LoadOptions, SaveOptions};
use turboio_tests::disk_dir;

fn status_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[test]
fn loads_hold_the_data_once() {
    let d = disk_dir();
    let path = d.path().join("mem.safetensors");
    let size: u64 = 256 << 20;
    turboio::sample::write_sample(&path, size, 1, &SaveOptions::default()).unwrap();
    let file_len = std::fs::metadata(&path).unwrap().len();
    drop(std::fs::read(&path).unwrap());

    let anon_before = status_kb("RssAnon:");
    let mapped = turboio::load(&path, &LoadOptions { mode: LoadMode::Mapped, ..Default::default() }).unwrap();
    let anon_added = status_kb("RssAnon:").saturating_sub(anon_before);
    assert!(anon_added < 8 << 10, "a mapped load added {anon_added} KiB of anonymous memory");
    assert!(status_kb("RssFile:") * 1024 >= file_len * 9 / 10, "the mapping is populated");
    drop(mapped);

    let rss_before = status_kb("VmRSS:");
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let copied = turboio::load(&path, &LoadOptions { mode: LoadMode::Copied, ..Default::default() }).unwrap();
    let peak_added = (status_kb("VmHWM:").saturating_sub(rss_before)) * 1024;
    assert!(peak_added >= file_len * 9 / 10, "the copy is resident: {peak_added}");
    assert!(
        peak_added <= file_len + (16 << 20),
        "peak {peak_added} bytes for a {file_len}-byte file: double buffering?"
    );
    drop(copied);
}
