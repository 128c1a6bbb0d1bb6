//! The dtype conversion kernel that converts loads in device memory.
//!
//! [`SOURCE`] is one CUDA C++ file (`src/cuda/cast.cu`), compiled by the CUDA device with NVRTC
//! at run time and, by the test suite, as plain C++ for the host (with the shim of the AES
//! kernel's tests), where it is compared bit for bit with [`turboio_format::cast()`] on every 8-
//! and 16-bit pattern of every pair and on random wider ones: the conversion a GPU does is the
//! one the CPU does, which is torch's `.to()`.
//!
//! The kernel's contract: `turboio_cast(src, dst, n, from, to)` converts `n` elements of dtype
//! code `from` at `src` into dtype code `to` at `dst` ([`code`]); `from == to` copies. Any
//! alignment and any launch shape work (byte loads, grid-stride loop).

use turboio_format::Dtype;

/// The kernel source (CUDA C++; also valid C++ with the host shim of the tests).
pub const SOURCE: &str = include_str!("cuda/cast.cu");

/// The kernel's entry point (`extern "C"`).
pub const KERNEL_NAME: &str = "turboio_cast";

/// The kernel's code for a dtype: 0 F64, 1 F32, 2 F16, 3 BF16, 4 F8_E4M3, 5 F8_E5M2, and 6
/// for `U8` (plain bytes, for copies). `None` for the others.
pub fn code(dtype: Dtype) -> Option<u32> {
    Some(match dtype {
        Dtype::F64 => 0,
        Dtype::F32 => 1,
        Dtype::F16 => 2,
        Dtype::BF16 => 3,
        Dtype::F8_E4M3 => 4,
        Dtype::F8_E5M2 => 5,
        Dtype::U8 => 6,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_cover_the_convertible_dtypes_and_bytes() {
        for d in [Dtype::F64, Dtype::F32, Dtype::F16, Dtype::BF16, Dtype::F8_E4M3, Dtype::F8_E5M2] {
            assert!(turboio_format::castable(d) && code(d).is_some(), "{d}");
        }
        assert_eq!(code(Dtype::U8), Some(6));
        assert_eq!(code(Dtype::I64), None);
        assert!(SOURCE.contains(KERNEL_NAME));
    }
}
