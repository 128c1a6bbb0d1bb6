//! Parses arbitrary bytes as a whole safetensors file. Whatever is accepted must be
//! self-consistent, and writing its tensors and metadata back must give a file that parses to
//! the same specs.
#![no_main]

use libfuzzer_sys::fuzz_target;
use turboio_format::{plan, Header, TensorSpec};

fuzz_target!(|data: &[u8]| {
    let Ok(header) = Header::parse(data, data.len() as u64) else {
        return;
    };
    assert_eq!(header.file_len(), data.len() as u64);

    // Re-serialize the header alone (`plan` needs no tensor bytes) and parse it back.
    let specs: Vec<TensorSpec<'_>> = header
        .tensors()
        .iter()
        .map(|t| TensorSpec::new(&t.name, t.dtype, &t.shape).expect("accepted tensor"))
        .collect();
    let layout = match plan(&specs, header.metadata()) {
        Ok(layout) => layout,
        // Only possible rewrite failure: escaping grew the header past the 100 MB limit.
        Err(turboio_format::FormatError::HeaderTooLarge { .. }) => return,
        Err(e) => panic!("accepted header cannot be rewritten: {e}"),
    };
    let again = Header::parse(&layout.header, layout.file_len()).expect("rewritten header");
    assert_eq!(again.metadata(), header.metadata());
    assert_eq!(again.data_len(), header.data_len());
    let key = |h: &Header| {
        let mut v: Vec<_> = h
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.len()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(key(&again), key(&header));
});
