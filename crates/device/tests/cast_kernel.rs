//! The GPU dtype conversion kernel's source, compiled for the host with the system C++ compiler
//! and compared bit for bit with `turboio_format::cast` (itself checked against torch): every
//! 8- and 16-bit pattern of every source, random and special 32- and 64-bit patterns, for every
//! pair of the six floating dtypes, with several grid sizes and unaligned buffers.
//!
//! Needs a C++ compiler (`$CXX`, else `g++`): without one the test prints that it was skipped,
//! unless `TURBOIO_REQUIRE_CXX=1`, which makes a missing compiler a failure (CI sets it).

use turboio_device::cast_kernel::{code, SOURCE};
use turboio_format::Dtype;

type Launch = unsafe extern "C" fn(*const u8, *mut u8, u64, u32, u32, u32);

mod host_cxx;

fn host_kernel() -> Option<(libloading::Library, Launch)> {
    let lib = host_cxx::build("cast.cu", SOURCE, "cast_harness.cpp", "TURBOIO_CAST_CU")?;
    // SAFETY: the symbol is `turboio_host_cast` of cast_harness.cpp, whose C signature is `Launch`.
    let f: Launch = unsafe { *lib.get::<Launch>(b"turboio_host_cast\0").expect("symbol") };
    Some((lib, f))
}

const FLOATS: [Dtype; 6] = [Dtype::F64, Dtype::F32, Dtype::F16, Dtype::BF16, Dtype::F8_E4M3, Dtype::F8_E5M2];

/// Source elements: every pattern for 1- and 2-byte dtypes, random and special ones for wider.
fn patterns(d: Dtype) -> Vec<u8> {
    let size = d.byte_size().unwrap();
    if size <= 2 {
        return (0..1u32 << (8 * size)).flat_map(|v| v.to_le_bytes()[..size].to_vec()).collect();
    }
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut out = Vec::new();
    let specials: [u64; 12] = if size == 4 {
        [
            0,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0001,
            0x0000_0001,
            0x3380_0000,
            0x477F_F000,
            0x3F80_8000,
            0x3F81_8000,
            0x43E0_0000,
            0x47FF_E000,
        ]
    } else {
        [
            0,
            1 << 63,
            0x7FF0 << 48,
            0xFFF0 << 48,
            0x7FF8_0000_0000_0001,
            1,
            0x3FF0_0000_1000_0000,
            0x3FF0_1000_0000_0000,
            0x40EF_FE00_0000_0000,
            0x47EF_FFFF_E000_0000,
            0x36A0_0000_0000_0000,
            0x3FF0_0000_0800_0001,
        ]
    };
    for v in specials {
        out.extend_from_slice(&v.to_le_bytes()[..size]);
    }
    for _ in 0..50_000 {
        let v = next();
        // Half random bits, half values near 1 with random low bits (ties and roundings).
        let v = if v & 1 == 0 {
            v
        } else if size == 4 {
            0x3F80_0000 | (v >> 41)
        } else {
            0x3FF0_0000_0000_0000 | (v >> 12)
        };
        out.extend_from_slice(&v.to_le_bytes()[..size]);
    }
    out
}

#[test]
fn the_kernel_converts_bit_for_bit_as_the_host_does() {
    let Some((_lib, launch)) = host_kernel() else { return };
    for from in FLOATS {
        let src = patterns(from);
        let n = src.len() / from.byte_size().unwrap();
        for to in FLOATS {
            let mut want = vec![0u8; n * to.byte_size().unwrap()];
            turboio_format::cast(&src, from, to, &mut want).unwrap();
            for grid in [1u32, 7] {
                // One byte in: unaligned source and destination.
                let mut s = vec![0u8; src.len() + 1];
                s[1..].copy_from_slice(&src);
                let mut got = vec![0xAAu8; want.len() + 1];
                // SAFETY: s[1..] holds n elements of `from`, got[1..] room for n of `to`; the
                // kernel touches nothing else.
                unsafe {
                    launch(
                        s[1..].as_ptr(),
                        got[1..].as_mut_ptr(),
                        n as u64,
                        code(from).unwrap(),
                        code(to).unwrap(),
                        grid,
                    )
                };
                if got[1..] != want[..] {
                    let ts = to.byte_size().unwrap();
                    let i = (0..n).find(|&i| got[1 + i * ts..1 + (i + 1) * ts] != want[i * ts..(i + 1) * ts]).unwrap();
                    let fs = from.byte_size().unwrap();
                    panic!(
                        "{from} -> {to} (grid {grid}): element {i} ({:02x?}) gave {:02x?}, the host gives {:02x?}",
                        &src[i * fs..(i + 1) * fs],
                        &got[1 + i * ts..1 + (i + 1) * ts],
                        &want[i * ts..(i + 1) * ts]
                    );
                }
                assert_eq!(got[0], 0xAA, "nothing written before dst");
            }
        }
    }
    // Bytes (code 6) copy.
    let src: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    let mut got = vec![0u8; 1000];
    // SAFETY: both buffers hold 1000 bytes.
    unsafe { launch(src.as_ptr(), got.as_mut_ptr(), 1000, 6, 6, 3) };
    assert_eq!(got, src);
}
