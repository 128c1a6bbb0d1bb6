//! Parses arbitrary bytes as a torch.save checkpoint. Whatever is accepted must be
//! self-consistent: every view inside its storage, every storage inside the file, and every
//! tensor gathers. Seed it with real checkpoints (tests/fixtures/make.py writes some).
//!
//! Inputs starting with `0xF0..=0xF5` are not parsed as they are but build one of the hostile
//! shapes of issue 22 from the bytes that follow (the same builders as the property tests):
//! duplicate entry names, long names over many leaves, stacked end-of-directory records,
//! expanded views, and objects made and dropped by the million. Each must be refused or
//! accepted within the reader's limits. Inputs starting `0xF6` vary one view the way the
//! differential property test does, checked against torch's rules (see `view_rules`).
#![no_main]

#[path = "../../tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;

use common::hostile;
use libfuzzer_sys::fuzz_target;
use turboio_pt::{PtIndex, PtOptions};

/// Reads a little-endian number of `n` bytes (missing bytes are zero).
fn num(data: &[u8], at: usize, n: usize) -> u64 {
    (0..n).map(|i| u64::from(data.get(at + i).copied().unwrap_or(0)) << (8 * i)).sum()
}

fn check(data: &[u8]) {
    let Ok(index) = PtIndex::parse(data, &PtOptions::default()) else {
        return;
    };
    for t in index.tensors() {
        let st = index.storage_of(t);
        assert!(st.offset + st.len <= data.len() as u64);
        let span = index.file_span(t);
        assert!(span.start >= st.offset && span.end <= st.offset + st.len);
        // Expanded views may describe far more than is stored (conversions bound that).
        if t.nbytes() <= 64 << 20 {
            let mut out = vec![0u8; t.nbytes() as usize];
            t.gather(&data[span.start as usize..span.end as usize], &mut out).expect("accepted view gathers");
        }
    }
}

/// Inputs starting `0xF6`: one view varying what torch checks or applies when it rebuilds a
/// tensor (the storage class against the record's size, the location, the metadata argument,
/// the view), checked against torch's rules (the property tests compare with torch itself):
/// accepted only with a record of exactly `numel` elements, a location torch restores, the
/// conjugate bit on complex64 only; and the gathered values are the stored ones with the bits
/// applied.
fn view_rules(data: &[u8]) {
    use common::{one_view, VIEW_CLASSES, VIEW_LOCATIONS, VIEW_METADATA};
    let (class, es) = VIEW_CLASSES[num(data, 1, 1) as usize % VIEW_CLASSES.len()];
    let location = VIEW_LOCATIONS[num(data, 2, 1) as usize % VIEW_LOCATIONS.len()];
    let metadata = VIEW_METADATA[num(data, 3, 1) as usize % VIEW_METADATA.len()];
    let record: Vec<u8> = data.iter().skip(8).take(64).copied().collect();
    let numel = num(data, 4, 1) as i32 % 20;
    let offset = num(data, 5, 1) as i32 % 20;
    let len = num(data, 6, 1) as i32 % 20;
    let file = one_view(class, location, numel, offset, len, metadata, &record);
    let Ok(index) = PtIndex::parse(file.as_slice(), &PtOptions::default()) else { return };
    let t = index.tensor("w").expect("the one tensor");
    assert_eq!(record.len(), numel as usize * es, "accepted only with an exact record size");
    assert!(!["bogus", "cuda:"].contains(&location), "accepted only a location torch restores");
    assert_eq!(t.meta, location == "meta");
    assert!(!t.conj || t.dtype == turboio_pt::Dtype::C64, "the conjugate bit on complex only");
    if !t.meta {
        let span = index.file_span(t);
        let stored = &file[span.start as usize..span.end as usize];
        let mut got = vec![0u8; t.nbytes() as usize];
        t.gather(stored, &mut got).expect("accepted view gathers");
        let mut want = stored.to_vec();
        assert!(turboio_pt::bits::apply(t.dtype, t.conj, t.neg, &mut want));
        assert_eq!(got, want, "the logical values are the stored ones, bits applied");
    }
}

fuzz_target!(|data: &[u8]| {
    let built = match data.first() {
        Some(0xF0) => hostile::duplicate_names(num(data, 1, 1) as u8),
        Some(0xF1) => hostile::long_names(num(data, 1, 3) as usize % 300_000 + 1, num(data, 4, 3) as usize % 300_000),
        Some(0xF2) => hostile::stacked_directory_records(num(data, 1, 2) as usize, num(data, 3, 4) as u32),
        Some(0xF3) => {
            let dims = (num(data, 1, 1) % 5) as usize;
            let shape: Vec<i32> = (0..dims).map(|i| num(data, 2 + 3 * i, 2) as i32).collect();
            let strides: Vec<i32> = (0..dims).map(|i| num(data, 4 + 3 * i, 1) as i32 % 3).collect();
            hostile::expanded_view(&shape, &strides)
        }
        Some(0xF4) => hostile::made_and_dropped(data.get(1).copied().unwrap_or(b']'), num(data, 2, 3) as usize),
        Some(0xF5) => hostile::empty_tuples(num(data, 1, 3) as usize),
        Some(0xF6) => return view_rules(data),
        _ => return check(data),
    };
    if data[0] == 0xF0 || data[0] == 0xF2 {
        assert!(PtIndex::parse(built.as_slice(), &PtOptions::default()).is_err(), "a hostile shape was accepted");
    }
    check(&built);
});
