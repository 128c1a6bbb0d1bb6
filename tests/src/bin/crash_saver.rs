//! The writer of the crash tests (`tests/tests/crash.rs`): saves version `V` of the test model
//! to `PATH` with small chunks, printing `fill OFFSET` on stdout as each chunk is produced (so
//! the harness can kill it at a chosen point of the save) and `saved V` when done.
//!
//! Two versions in three are saved with block reuse (into the previous version's blocks).
//! With `TURBOIO_CRASH_AT=link` or `rename` it kills itself (`SIGKILL`) right after that step
//! of the writer (the old file given its second name; the new file renamed in, the old one not
//! yet deleted): the points no timing can hit reliably.
//!
//! Usage: `crash_saver PATH VERSION`

use std::io::Write;
use std::sync::Arc;
use turboio::{SaveOptions, TensorData};
use turboio_io_posix::{Faults, PosixConfig, PosixStorage, Step};
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
    let crash = match std::env::var("TURBOIO_CRASH_AT").as_deref() {
        Ok("link") => Some(Step::Link),
        Ok("rename") => Some(Step::Rename),
        _ => None,
    };
    let storage =
        PosixStorage::with_config(PosixConfig { faults: Faults { crash, ..Default::default() }, ..Default::default() });
    // Two saves in three write into the previous version's blocks where nobody holds it (the
    // readers of the test often do): kills then land in the middle of an in-place write.
    let opts = SaveOptions {
        chunk_size: CHUNK,
        threads: 2,
        storage: Some(Arc::new(storage)),
        reuse_blocks: version % 3 != 0,
        ..Default::default()
    };
    match turboio::save_with(path, &specs, None, &Announcing(data.clone()), &opts) {
        Ok(()) => {
            // The replaced file is deleted in the background: gone before this process is.
            turboio::wait_for_saves();
            println!("saved {version}")
        }
        Err(e) if crash.is_some() && e.to_string().contains("simulated crash") => {
            // SAFETY: kill(2) on this process: it ends here, as a killed writer would.
            unsafe { libc::kill(std::process::id() as libc::pid_t, libc::SIGKILL) };
        }
        Err(e) => {
            eprintln!("crash_saver: {e}");
            std::process::exit(1);
        }
    }
}
