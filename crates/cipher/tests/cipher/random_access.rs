//! apply_at at any position equals the matching slice of a straight pass from 0, checked
//! against the independent block-by-block reference.

use turboio_cipher::{CtrCipher, Iv, Key};

use crate::reference::{bytes, keystream, xor_at, IV, KEY128, KEY256};

fn ciphers() -> Vec<(&'static [u8], [u8; 16], CtrCipher)> {
    let mut v = Vec::new();
    for key in [&KEY128[..], &KEY256[..]] {
        for iv in [IV, [0xff; 16], [0; 16], {
            let mut i = [0xffu8; 16];
            i[0] = 0x12;
            i
        }] {
            v.push((key, iv, CtrCipher::new(&Key::new(key).unwrap(), &Iv(iv))));
        }
    }
    v
}

#[test]
fn straight_pass_equals_reference() {
    for (key, iv, c) in ciphers() {
        let data = bytes(1, 10_000);
        let mut buf = data.clone();
        c.apply_at(0, &mut buf);
        assert_eq!(buf, xor_at(key, iv, 0, &data));
    }
}

#[test]
fn every_small_position_and_length() {
    let (key, iv, c) = ciphers().swap_remove(0);
    let whole = keystream(key, iv, 0, 400);
    for pos in 0..80usize {
        for len in 0..70usize {
            let mut buf = vec![0u8; len];
            c.apply_at(pos as u64, &mut buf);
            assert_eq!(buf, whole[pos..pos + len], "pos {pos} len {len}");
        }
    }
}

#[test]
fn many_positions_and_lengths() {
    let positions: &[u64] = &[
        0,
        1,
        7,
        15,
        16,
        17,
        4093,
        65_535,
        262_143,
        262_144,
        (8 << 20) + 3,
        (1 << 32) - 5,
        (1 << 40) + 9,
        (1 << 60) + 1,
        u64::MAX / 16 * 16 - 16,
        u64::MAX - 1000,
        u64::MAX - 15,
        u64::MAX - 1,
        u64::MAX,
    ];
    let lengths = [0usize, 1, 2, 15, 16, 17, 31, 33, 127, 129, 1000, 4097, 70_001];
    for (key, iv, c) in ciphers() {
        for (i, &pos) in positions.iter().enumerate() {
            for (j, &len) in lengths.iter().enumerate() {
                let data = bytes((i * 100 + j) as u64, len);
                let mut buf = data.clone();
                c.apply_at(pos, &mut buf);
                // Past 2^64 the keystream goes on: the reference uses 128-bit positions.
                assert_eq!(
                    buf,
                    xor_at(key, iv, u128::from(pos), &data),
                    "key {} bits, iv {iv:02x?}, pos {pos}, len {len}",
                    key.len() * 8
                );
            }
        }
    }
}

#[test]
fn chunked_equals_whole_for_odd_chunk_sizes() {
    let (_, _, c) = ciphers().swap_remove(1);
    let data = bytes(7, 300_000);
    let mut whole = data.clone();
    c.apply_at(0, &mut whole);
    for chunk in [1usize, 3, 13, 16, 17, 1000, 4099, 65_537] {
        let mut buf = data.clone();
        let mut pos = 0;
        for part in buf.chunks_mut(chunk) {
            c.apply_at(pos as u64, part);
            pos += part.len();
        }
        assert!(buf == whole, "chunk size {chunk}");
    }
}

#[test]
fn applying_twice_is_identity() {
    for (_, _, c) in ciphers() {
        for pos in [0u64, 5, 4093, u64::MAX - 7] {
            let data = bytes(pos, 5000);
            let mut buf = data.clone();
            c.apply_at(pos, &mut buf);
            assert_ne!(buf, data);
            c.apply_at(pos, &mut buf);
            assert_eq!(buf, data);
        }
    }
}

#[test]
fn parallel_equals_serial() {
    // Parts are at least 256 KiB, so these lengths make 2-4 parts. (Sizes are kept small:
    // tests run unoptimized AES at a few MB/s.)
    for (_, _, c) in ciphers().into_iter().step_by(5) {
        for (pos, len) in
            [(0u64, 600_000usize), (3, (1 << 20) + 5), (1_000_001, 800_017), (7, 100), (u64::MAX - 300_000, 700_000)]
        {
            let data = bytes(pos ^ len as u64, len);
            let mut serial = data.clone();
            c.apply_at(pos, &mut serial);
            for threads in [0, 2, 3, 64] {
                let mut par = data.clone();
                c.apply_at_parallel(pos, &mut par, threads);
                assert!(par == serial, "pos {pos} len {len} threads {threads}");
            }
        }
    }
}

#[test]
fn cipher_is_send_sync_and_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<CtrCipher>();
    let (_, _, c) = ciphers().swap_remove(0);
    let data = bytes(3, 1 << 16);
    let mut want = data.clone();
    c.apply_at(100, &mut want);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let mut buf = data.clone();
                c.apply_at(100, &mut buf);
                assert!(buf == want);
            });
        }
    });
}
