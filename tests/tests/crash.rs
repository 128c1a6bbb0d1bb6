//! Saves survive being killed: a real saving process (`crash_saver`) is killed with SIGKILL at
//! many points of its save, chosen by its own progress (the N-th chunk it produced) and by
//! time, while four reader processes (`crash_checker`, two mapped, two copied) keep loading the
//! target. Every load must be one complete version (the old or the new one: never torn, never
//! a SIGBUS), and the next successful save must leave nothing but the target behind
//! (temporary files of killed writers, and second names of replaced files whose deletion a
//! kill prevented, are removed by it). Every tenth saver kills itself right after the old file
//! got its second name, and every tenth right after the rename, before the old file is deleted.
//! Two saves in three write into the previous version's blocks where nobody holds it.
//!
//! `TURBOIO_CRASH_KILLS` sets the number of kills (default 200).

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use turboio::{LoadOptions, SaveOptions};
use turboio_tests::crash::{check_model, model_specs, ModelData};
use turboio_tests::{disk_dir, Rng};

fn saver(path: &Path, version: u64) -> Child {
    // Every tenth save dies right after the old file got its second name, every tenth right
    // after the rename (before the old file is deleted).
    let at = match version % 10 {
        3 => "link",
        7 => "rename",
        _ => "",
    };
    Command::new(env!("CARGO_BIN_EXE_crash_saver"))
        .arg(path)
        .arg(version.to_string())
        .env("TURBOIO_CRASH_AT", at)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start crash_saver")
}

fn checker(path: &Path, mode: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_crash_checker"))
        .arg(path)
        .arg(mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start crash_checker")
}

#[test]
fn killed_saves_never_tear_the_file() {
    let kills: u64 = std::env::var("TURBOIO_CRASH_KILLS").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let dir = disk_dir();
    let path = dir.path().join("model.safetensors");
    let v0 = ModelData::new(0);
    turboio::save_with(&path, &model_specs(&v0), None, &v0, &SaveOptions::default()).unwrap();

    let mut checkers: Vec<Child> = ["mapped", "copied", "mapped", "copied"].iter().map(|m| checker(&path, m)).collect();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut complete, mut killed_mid_save) = (0u64, 0u64);
    let mut last_saved = 0u64;
    let started = Instant::now();
    for i in 1..=kills {
        let mut child = saver(&path, i);
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let self_killed = matches!(i % 10, 3 | 7);
        if self_killed {
            // It kills itself at its step; nothing to do but wait.
        } else if i % 2 == 0 {
            // By progress: after the k-th chunk was produced (a file has about 16).
            let k = 1 + rng.below(18);
            let mut seen = 0;
            for line in lines.by_ref() {
                let line = line.unwrap();
                if line.starts_with("fill") {
                    seen += 1;
                    if seen >= k {
                        break;
                    }
                }
            }
        } else {
            // By time: somewhere in the first ~20 ms after the save started producing bytes
            // (a save of this model takes a few to tens of ms).
            let _ = lines.next();
            std::thread::sleep(Duration::from_micros(rng.below(20_000)));
        }
        if !self_killed {
            let _ = child.kill();
        }
        let status = child.wait().unwrap();
        let saved = lines.map_while(Result::ok).any(|l| l == format!("saved {i}"));
        if status.signal() == Some(libc::SIGKILL) && !saved {
            killed_mid_save += 1;
        } else {
            complete += 1;
        }
        if self_killed {
            assert_eq!(status.signal(), Some(libc::SIGKILL), "save {i} was to die at its step");
            let second_names = std::fs::read_dir(dir.path())
                .unwrap()
                .filter(|e| {
                    let n = e.as_ref().unwrap().file_name().to_string_lossy().into_owned();
                    n.contains(".turboio-old.") || n.ends_with(".turboio-spare")
                })
                .count();
            assert!(second_names > 0, "kill {i}: the old file's second name is left for the next save");
            let loaded = turboio::load(&path, &LoadOptions::default()).unwrap();
            let want = if i % 10 == 3 { last_saved } else { i };
            assert_eq!(
                check_model(&loaded).unwrap(),
                want,
                "kill {i} after {}",
                if i % 10 == 3 { "the link" } else { "the rename" }
            );
        }
        // Between saves the file is one complete version: the last one saved or this one.
        let loaded = turboio::load(&path, &LoadOptions::default()).unwrap();
        let v = check_model(&loaded).unwrap_or_else(|e| panic!("after kill {i}: {e}"));
        assert!(v == last_saved || v == i, "after kill {i}: version {v}, last complete save {last_saved}");
        last_saved = v;
    }
    // Readers stop when their stdin closes; each must have loaded and found no torn file.
    let mut loads = 0u64;
    for mut c in checkers.drain(..) {
        drop(c.stdin.take());
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "a reader failed ({:?}, signal {:?}): {text} {}",
            out.status,
            out.status.signal(),
            String::from_utf8_lossy(&out.stderr)
        );
        loads += text.split_whitespace().nth(1).and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
    }
    eprintln!(
        "{kills} kills ({killed_mid_save} mid-save, {complete} after the save completed) in {:.1} s; readers loaded {loads} times",
        started.elapsed().as_secs_f64()
    );
    assert!(killed_mid_save >= kills / 2, "most kills must land mid-save to test anything: {killed_mid_save}/{kills}");

    // The next save that completes removes every temporary file killed writers left (a save
    // without block reuse, which also frees the kept spare).
    let last_version = (kills + 1).next_multiple_of(3);
    let mut last = saver(&path, last_version);
    assert!(last.wait().unwrap().success());
    let names: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, vec!["model.safetensors"]);
    let loaded = turboio::load(&path, &LoadOptions::default()).unwrap();
    assert_eq!(check_model(&loaded).unwrap(), last_version);
}
