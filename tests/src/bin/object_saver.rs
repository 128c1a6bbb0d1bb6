//! Saves a file to object storage and never finishes on its own: after half of the bytes have
//! been handed to the upload it prints `HALF` and stops producing more, so that a test can kill
//! it in the middle of a multipart upload. Usage: `object_saver ENDPOINT URL BYTES`.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use turboio::object::{ObjectOptions, ObjectStorage};
use turboio::storage::{IoOptions, Storage, WriteSource};

struct Stalling {
    len: u64,
    said: AtomicBool,
}

impl WriteSource for Stalling {
    fn len(&self) -> u64 {
        self.len
    }

    fn fill(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
        if offset >= self.len / 2 {
            if !self.said.swap(true, Ordering::SeqCst) {
                println!("HALF");
                let _ = std::io::stdout().flush();
            }
            // Parked until killed: the upload is in flight with half its parts sent.
            loop {
                std::thread::park();
            }
        }
        dst.fill((offset % 251) as u8);
        Ok(())
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, endpoint, url, bytes] = &args[..] else {
        eprintln!("usage: object_saver ENDPOINT URL BYTES");
        std::process::exit(2);
    };
    let options = ObjectOptions::from_pairs([
        ("endpoint", endpoint.as_str()),
        ("region", "us-east-1"),
        ("access_key_id", turboio_tests::s3::ACCESS_KEY),
        ("secret_access_key", turboio_tests::s3::SECRET_KEY),
        ("part_size", "5MiB"),
        ("concurrency", "2"),
    ])
    .expect("options");
    let storage = ObjectStorage::new(options);
    let source = Stalling { len: bytes.parse().expect("BYTES"), said: AtomicBool::new(false) };
    let r = storage.write_file(Path::new(url), &source, &IoOptions { threads: 2, ..Default::default() });
    eprintln!("object_saver: the save returned: {r:?}");
    std::process::exit(1);
}
