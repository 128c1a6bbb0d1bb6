//! Parses arbitrary bytes as a torch.save checkpoint. Whatever is accepted must be
//! self-consistent: every view inside its storage, every storage inside the file, and every
//! tensor gathers. Seed it with real checkpoints (tests/fixtures/make.py writes some).
//!
//! Inputs starting with `0xF0..=0xF4` are not parsed as they are but build one of the hostile
//! shapes of issue 22 from the bytes that follow (the same builders as the property tests):
//! duplicate entry names, long names over many leaves, stacked end-of-directory records,
//! expanded views, and objects made and dropped by the million. Each must be refused or
//! accepted within the reader's limits.
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
        _ => return check(data),
    };
    if data[0] == 0xF0 || data[0] == 0xF2 {
        assert!(PtIndex::parse(built.as_slice(), &PtOptions::default()).is_err(), "a hostile shape was accepted");
    }
    check(&built);
});
