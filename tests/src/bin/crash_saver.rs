//! The writer of the crash tests (`tests/tests/crash.rs`): saves version `V` of the test model
//! to `PATH` with small chunks, printing `fill OFFSET` on stdout as each chunk is produced (so
//! the harness can kill it at a chosen point of the save) and `saved V` when done.
//!
//! Usage: `crash_saver PATH VERSION`

use std::io::Write;
use turboio::{SaveOptions, TensorData};
use turboio_tests::crash::{model_specs, ModelData, CHUNK};

struct Announcing(ModelData);

impl TensorData for Announcing {
    fn fill(&self, index: usize, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        let mut out = std::io::stdout().lock();
        writeln!(out, "fill {index} {offset}").and_then(|()| out.flush()).map_err(|e| e.to_string())?;
        self.0.fill(index, offset, dst)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(path), Some(version)) = (args.get(1), args.get(2).and_then(|v| v.parse::<u64>().ok())) else {
        eprintln!("usage: crash_saver PATH VERSION");
        std::process::exit(2);
    };
    let data = ModelData::new(version);
    let specs = model_specs(&data);
    let opts = SaveOptions { chunk_size: CHUNK, threads: 2, ..Default::default() };
    match turboio::save_with(path, &specs, None, &Announcing(data.clone()), &opts) {
        Ok(()) => println!("saved {version}"),
        Err(e) => {
            eprintln!("crash_saver: {e}");
            std::process::exit(1);
        }
    }
}
