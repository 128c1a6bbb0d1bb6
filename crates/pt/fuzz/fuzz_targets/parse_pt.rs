//! Parses arbitrary bytes as a torch.save checkpoint. Whatever is accepted must be
//! self-consistent: every view inside its storage, every storage inside the file, and every
//! tensor gathers. Seed it with real checkpoints (tests/fixtures/make.py writes some).
#![no_main]

use libfuzzer_sys::fuzz_target;
use turboio_pt::{PtIndex, PtOptions};

fuzz_target!(|data: &[u8]| {
    let Ok(index) = PtIndex::parse(data, &PtOptions::default()) else {
        return;
    };
    for t in index.tensors() {
        let st = index.storage_of(t);
        assert!(st.offset + st.len <= data.len() as u64);
        let span = index.file_span(t);
        assert!(span.start >= st.offset && span.end <= st.offset + st.len);
        let mut out = vec![0u8; t.nbytes() as usize];
        t.gather(&data[span.start as usize..span.end as usize], &mut out).expect("accepted view gathers");
    }
});
