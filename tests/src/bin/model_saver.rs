//! The writer of the sharded-save crash test (`tests/tests/models.rs`): saves versions
//! `START, START+1, ...` of the test model into `DIR` with `save_model_dir`, forever, printing
//! `saved V` after each, until it is killed.
//!
//! Usage: `model_saver DIR START`

use std::io::Write;
use turboio::SaveOptions;
use turboio_tests::model_crash::{max_shard, names, tensor_bytes, views, TENSORS};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dir), Some(start)) = (args.get(1), args.get(2).and_then(|v| v.parse::<u64>().ok())) else {
        eprintln!("usage: model_saver DIR START");
        std::process::exit(2);
    };
    let names = names();
    for v in start.. {
        let data: Vec<Vec<u8>> = (0..TENSORS).map(|i| tensor_bytes(v, i)).collect();
        if let Err(e) = turboio::save_model_dir(dir, &views(&names, &data), None, max_shard(v), &SaveOptions::default())
        {
            eprintln!("model_saver: {e}");
            std::process::exit(1);
        }
        let mut out = std::io::stdout().lock();
        if writeln!(out, "saved {v}").and_then(|()| out.flush()).is_err() {
            std::process::exit(0);
        }
    }
}
