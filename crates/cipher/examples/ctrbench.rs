//! AES-CTR throughput on this machine: `turboio-cipher` against the other pure-Rust RustCrypto
//! options.
//!
//! ```sh
//! cargo run --release -p turboio-cipher --example ctrbench                            # ours only
//! cargo run --release -p turboio-cipher --features bench-compare --example ctrbench   # all
//! #   options: --mib N (buffer, default 256)  --runs R (default 5)  --threads 1,2
//! ```
//!
//! Every candidate XORs the keystream into the same warm buffer, AES-128 and AES-256, with 1 and
//! 2 threads; the candidates take turns run by run (the order rotates), and the table gives the
//! median, min and max GB/s of each. The loader's pattern (8 MiB chunks at odd keystream
//! positions, one `apply_at` call each, chunks dealt to the threads in turn) is a row of its own.
//! Before timing, every candidate's output is checked against ours.

use std::time::Instant;

use turboio_cipher::{CtrCipher, Iv, Key};

type Run = Box<dyn Fn(&mut [u8], usize)>;

#[cfg(feature = "bench-compare")]
/// Splits `buf` (stream positions from 0) into `threads` parts at 16-byte boundaries and runs
/// `f(pos, part)` on each part in its own thread.
fn split<F: Fn(u64, &mut [u8]) + Sync>(buf: &mut [u8], threads: usize, f: F) {
    if threads <= 1 {
        f(0, buf);
        return;
    }
    let per = buf.len().div_ceil(16).div_ceil(threads) * 16;
    std::thread::scope(|s| {
        for (i, part) in buf.chunks_mut(per).enumerate() {
            let f = &f;
            s.spawn(move || f((i * per) as u64, part));
        }
    });
}

fn candidates(key: &Key, iv: &Iv) -> Vec<(&'static str, Run)> {
    let ours = CtrCipher::new(key, iv);
    let chunked = ours.clone();
    #[allow(unused_mut)]
    let mut v: Vec<(&'static str, Run)> = vec![
        (
            "turboio-cipher apply_at_parallel (aes 0.8.4 + ctr 0.9.2)",
            Box::new(move |buf, t| ours.apply_at_parallel(0, buf, t)),
        ),
        (
            "turboio-cipher apply_at, 8 MiB+1 chunks at odd positions",
            Box::new(move |buf, t| {
                const CHUNK: usize = (8 << 20) + 1;
                let (lead, rest) = buf.split_at_mut(7);
                chunked.apply_at(0, lead);
                let chunks: Vec<&mut [u8]> = rest.chunks_mut(CHUNK).collect();
                let mut per_thread: Vec<Vec<(u64, &mut [u8])>> = (0..t).map(|_| Vec::new()).collect();
                for (i, c) in chunks.into_iter().enumerate() {
                    per_thread[i % t].push((7 + (i * CHUNK) as u64, c));
                }
                std::thread::scope(|s| {
                    for list in per_thread {
                        let c = &chunked;
                        s.spawn(move || {
                            for (pos, chunk) in list {
                                c.apply_at(pos, chunk);
                            }
                        });
                    }
                });
            }),
        ),
    ];
    #[cfg(feature = "bench-compare")]
    compare::add(&mut v, key, iv);
    v
}

#[cfg(feature = "bench-compare")]
mod compare {
    //! The other options. The hand-rolled loops fill a stack array of counter blocks, encrypt
    //! them with `encrypt_blocks` (which uses the crate's widest parallel backend), and XOR.

    use super::{split, Run};
    use turboio_cipher::{Iv, Key};

    const BATCH: usize = 64;

    pub fn add(v: &mut Vec<(&'static str, Run)>, key: &Key, iv: &Iv) {
        let iv = iv.0;
        let k = key.expose().to_vec();
        if k.len() == 16 {
            use aes09::cipher::KeyInit;
            let k09 = k.clone();
            v.push((
                "aes 0.9.4 + ctr 0.10.1",
                Box::new(move |buf, t| {
                    split(buf, t, |pos, part| {
                        use ctr010::cipher::{KeyIvInit, StreamCipher, StreamCipherSeek};
                        let mut c = ctr010::Ctr128BE::<aes09::Aes128>::new_from_slices(&k09, &iv).unwrap();
                        c.seek(pos);
                        c.apply_keystream(part);
                    })
                }),
            ));
            let a08 = {
                use aes::cipher::KeyInit;
                aes::Aes128Enc::new_from_slice(&k).unwrap()
            };
            v.push((
                "own counter loop + aes 0.8.4 encrypt_blocks",
                Box::new(move |buf, t| split(buf, t, |pos, part| own08(&a08, &iv, pos, part))),
            ));
            let a09 = aes09::Aes128Enc::new_from_slice(&k).unwrap();
            v.push((
                "own counter loop + aes 0.9.4 encrypt_blocks",
                Box::new(move |buf, t| split(buf, t, |pos, part| own09(&a09, &iv, pos, part))),
            ));
        } else {
            let k09 = k.clone();
            v.push((
                "aes 0.9.4 + ctr 0.10.1",
                Box::new(move |buf, t| {
                    split(buf, t, |pos, part| {
                        use ctr010::cipher::{KeyIvInit, StreamCipher, StreamCipherSeek};
                        let mut c = ctr010::Ctr128BE::<aes09::Aes256>::new_from_slices(&k09, &iv).unwrap();
                        c.seek(pos);
                        c.apply_keystream(part);
                    })
                }),
            ));
        }
    }

    /// `pos` is a multiple of 16 here (`split` cuts at block boundaries).
    fn own08(c: &aes::Aes128Enc, iv: &[u8; 16], pos: u64, buf: &mut [u8]) {
        use aes::cipher::BlockEncrypt;
        let mut ctr = u128::from_be_bytes(*iv).wrapping_add(u128::from(pos / 16));
        let mut ks = [aes::Block::default(); BATCH];
        for chunk in buf.chunks_mut(BATCH * 16) {
            let nb = chunk.len().div_ceil(16);
            for k in &mut ks[..nb] {
                *k = ctr.to_be_bytes().into();
                ctr = ctr.wrapping_add(1);
            }
            c.encrypt_blocks(&mut ks[..nb]);
            for (d, k) in chunk.chunks_mut(16).zip(&ks) {
                for (a, b) in d.iter_mut().zip(k.iter()) {
                    *a ^= *b;
                }
            }
        }
    }

    fn own09(c: &aes09::Aes128Enc, iv: &[u8; 16], pos: u64, buf: &mut [u8]) {
        use aes09::cipher::BlockCipherEncrypt;
        let mut ctr = u128::from_be_bytes(*iv).wrapping_add(u128::from(pos / 16));
        let mut ks = [aes09::Block::default(); BATCH];
        for chunk in buf.chunks_mut(BATCH * 16) {
            let nb = chunk.len().div_ceil(16);
            for k in &mut ks[..nb] {
                *k = ctr.to_be_bytes().into();
                ctr = ctr.wrapping_add(1);
            }
            c.encrypt_blocks(&mut ks[..nb]);
            for (d, k) in chunk.chunks_mut(16).zip(&ks) {
                for (a, b) in d.iter_mut().zip(k.iter()) {
                    *a ^= *b;
                }
            }
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() {
    let mut mib = 256usize;
    let mut runs = 5usize;
    let mut thread_counts = vec![1usize, 2];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let val = args.next().unwrap_or_default();
        match a.as_str() {
            "--mib" => mib = val.parse().expect("--mib N"),
            "--runs" => runs = val.parse().expect("--runs R"),
            "--threads" => thread_counts = val.split(',').map(|s| s.parse().expect("--threads 1,2")).collect(),
            other => panic!("unknown argument {other}"),
        }
    }
    let iv = Iv(*b"1234567887654321");
    let mut buf: Vec<u8> = (0..mib << 20).map(|i| (i * 31 % 251) as u8).collect();
    println!(
        "buffer {mib} MiB, {runs} runs per row (alternated), {} cores; GB/s = 1e9 bytes/s",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!();
    println!("| candidate | key | threads | median GB/s | min | max |");
    println!("|---|---|---|---|---|---|");
    for key in [Key::new(b"abcdefgh12345678").unwrap(), Key::new(b"abcdefgh12345678abcdefgh12345678").unwrap()] {
        let cands = candidates(&key, &iv);
        // Correctness first: every candidate equals ours on a 1 MiB + 5 prefix.
        let mut want = buf[..(1 << 20) + 5].to_vec();
        cands[0].1(&mut want, 1);
        for (name, run) in &cands {
            for t in [1, 2] {
                let mut got = buf[..(1 << 20) + 5].to_vec();
                run(&mut got, t);
                assert!(got == want, "{name} with {t} threads differs from turboio-cipher");
            }
        }
        for &t in &thread_counts {
            let mut times: Vec<Vec<f64>> = vec![Vec::new(); cands.len()];
            for r in 0..runs {
                for i in 0..cands.len() {
                    let c = (i + r) % cands.len();
                    let start = Instant::now();
                    cands[c].1(&mut buf, t);
                    times[c].push(buf.len() as f64 / start.elapsed().as_secs_f64() / 1e9);
                }
            }
            for ((name, _), mut gbs) in cands.iter().zip(times) {
                let min = gbs.iter().copied().fold(f64::INFINITY, f64::min);
                let max = gbs.iter().copied().fold(0.0, f64::max);
                println!("| {name} | AES-{} | {t} | {:.2} | {min:.2} | {max:.2} |", key.len() * 8, median(&mut gbs));
            }
        }
    }
}
