//! The memory plan against a real memory cgroup: a copied load that cannot fit in the cgroup's
//! limit fails before allocating, with the numbers, and the process is not killed; the same
//! load with `--tensors` (a few tensors) or mapped fits. Needs root and a writable memory
//! cgroup (v1 `memory.limit_in_bytes` or v2 `memory.max`); says "skipped" otherwise.

mod common;

use common::{scratch, stderr, stdout, turboio};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A child memory cgroup of this process's with a limit, removed on drop.
struct Cgroup {
    dir: PathBuf,
}

impl Cgroup {
    fn create(limit: u64) -> Result<Cgroup, String> {
        let me = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("/proc/self/cgroup: {e}"))?;
        let v1 = me.lines().find_map(|l| {
            let mut p = l.splitn(3, ':');
            let (_, c, path) = (p.next()?, p.next()?, p.next()?);
            c.split(',').any(|c| c == "memory").then(|| path.to_owned())
        });
        let name = format!("turboio-test-{}", std::process::id());
        let (dir, limit_file) = match v1 {
            Some(path) => (
                Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/')).join(name),
                "memory.limit_in_bytes",
            ),
            None => {
                let path = me.lines().find_map(|l| l.strip_prefix("0::")).ok_or("no cgroup v2 path")?;
                (Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/')).join(name), "memory.max")
            }
        };
        std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let cg = Cgroup { dir };
        std::fs::write(cg.dir.join(limit_file), limit.to_string())
            .map_err(|e| format!("cannot set {limit_file} in {}: {e}", cg.dir.display()))?;
        Ok(cg)
    }

    /// `turboio ARGS` run inside the cgroup.
    fn run(&self, args: &[&str]) -> std::process::Output {
        let procs = self.dir.join("cgroup.procs");
        Command::new("sh")
            .arg("-c")
            .arg(format!("echo $$ > '{}' && exec \"$0\" \"$@\"", procs.display()))
            .arg(env!("CARGO_BIN_EXE_turboio"))
            .args(args)
            .output()
            .expect("run turboio in the cgroup")
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // The children have exited; an empty cgroup can be removed.
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[test]
fn a_load_that_cannot_fit_in_the_cgroup_fails_before_allocating_and_nothing_is_killed() {
    let d = scratch();
    let file = d.path().join("s.safetensors");
    let f = file.to_str().unwrap();
    let o = turboio(&["gen", f, "--size", "192MiB", "--seed", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let cg = match Cgroup::create(96 << 20) {
        Ok(cg) => cg,
        Err(why) => {
            eprintln!("skipped: {why} (needs root and a writable memory cgroup)");
            return;
        }
    };
    let o = cg.run(&["load", f, "--mode", "copied"]);
    assert_eq!(o.status.signal(), None, "killed: {}", stderr(&o));
    assert_eq!(o.status.code(), Some(1), "{}{}", stdout(&o), stderr(&o));
    let err = stderr(&o);
    assert!(err.contains(f) && err.contains("this load needs") && err.contains("of host memory"), "{err}");
    assert!(err.contains("is available") && err.contains("nothing was allocated"), "{err}");
    assert!(err.contains("a mapped load") && err.contains("fewer tensors"), "{err}");
    assert!(err.contains("--mode mapped") && err.contains("--tensors") && !err.contains("tensors="), "{err}");
    // What it says would fit does.
    let o = cg.run(&["load", f, "--mode", "copied", "--tensors", "model.norm.weight"]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("1 tensor selected"), "{}", stdout(&o));
}

#[test]
fn load_tensors_reads_and_checks_only_the_selection() {
    let d = scratch();
    let file = d.path().join("s.safetensors");
    let f = file.to_str().unwrap();
    assert!(turboio(&["gen", f, "--size", "16MiB", "--seed", "5"]).status.success());
    for mode in ["auto", "copied"] {
        let o = turboio(&[
            "load",
            f,
            "--mode",
            mode,
            "--tensors",
            "model.layers.1.*",
            "--tensors",
            "lm_head.weight",
            "--check",
        ]);
        assert!(o.status.success(), "{mode}: {}", stderr(&o));
        let out = stdout(&o);
        assert!(out.contains(" tensors selected, ") && out.contains(" read in "), "{out}");
        assert!(out.contains("a plain read of the") && out.contains("tensors match a plain read"), "{out}");
    }
    // A model's selection reports as a file's does: what it read, of how much, and the rate of
    // what it read (it reported the whole model's bytes and a rate from them; issue 49, item 10).
    let model = d.path().join("model");
    assert!(turboio(&["gen", model.to_str().unwrap(), "--size", "16MiB", "--shards", "4"]).status.success());
    let o = turboio(&["load", model.to_str().unwrap(), "--tensors", "model.layers.1.*"]);
    let out = stdout(&o);
    assert!(o.status.success() && out.contains(" tensors selected from "), "{out}");
    let (read, of) = {
        let tail = out.split(" selected from ").nth(1).unwrap();
        let mut it = tail.split(", ").nth(1).unwrap().split(" of ");
        (it.next().unwrap().to_owned(), it.next().unwrap().split(" read in ").next().unwrap().to_owned())
    };
    assert!(read != of && of.ends_with("MB"), "read {read} of {of}: {out}");
    let o = turboio(&["load", f, "--tensors", "model.layer.1.mlp.up_proj.weight"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("no tensor matches `model.layer.1.mlp.up_proj.weight`"), "{err}");
    assert!(err.contains("closest: `model.layers.1.mlp.up_proj.weight`"), "{err}");
    let o = turboio(&["load", f, "--tensors", "[bad"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("bad tensor pattern `[bad`"), "{}", stderr(&o));
    let o = turboio(&["load", f, "--mode", "copied", "--max-host-memory", "1MiB"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("max_host_memory is 1MiB"), "{}", stderr(&o));
}
