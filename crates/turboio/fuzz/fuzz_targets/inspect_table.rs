//! `turboio inspect`'s table for any header the parser accepts: it must print every tensor
//! (names of any length and content, any shape) without panicking.
//! Run with `cargo fuzz run inspect_table` from `crates/turboio` (the dictionary of
//! `crates/format/fuzz/parse_header.dict` helps: `-dict=../format/fuzz/parse_header.dict`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;
use turboio::Header;

fuzz_target!(|data: &[u8]| {
    let Ok(header) = Header::parse(data, data.len() as u64) else {
        return;
    };
    let mut lines = 0usize;
    let r: Result<(), ()> = turboio::inspect::table(Path::new("fuzz.safetensors"), &header, &mut |_line| {
        lines += 1;
        Ok(())
    });
    r.unwrap();
    assert!(lines >= 2 + header.len());
});
