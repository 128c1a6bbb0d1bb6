//! Element type conversion between the floating dtypes, bit-identical to torch's CPU `.to()`.
//!
//! [`cast`] converts little-endian element bytes from one dtype to another. It is pure (no I/O, no
//! allocation) and works on any element-aligned sub-slice, so a reader can convert each chunk on
//! the thread that read (or decrypted) it.
//!
//! # What torch does, and so what this does
//!
//! The rules were measured on torch 2.15 (CPU) and are checked bit for bit by the tests
//! (`tests/cast_torch.rs`: every bit pattern of every 8- and 16-bit source, random and special
//! 32- and 64-bit values).
//!
//! - **Finite values and infinities** round to nearest, ties to even. Widening is exact.
//! - **Double rounding from F64.** torch converts `float64` to `float16`, `bfloat16` and the
//!   float8 types through `float32`, so a value just above a tie of the target can round twice.
//!   This module does the same: `F64 -> F32 -> target`.
//! - **Overflow.** F16, BF16 and F8_E5M2 overflow to infinity. F8_E4M3 (`float8_e4m3fn`, which
//!   has no infinity) *saturates*: every finite value above 448 in magnitude, and ±infinity,
//!   become ±448 (torch's `.to()` does this; the c10 scalar conversion would give NaN instead).
//! - **NaN.** The bits of a NaN depend on the pair, because torch's CPU kernels take different
//!   paths: F32 and F64 -> BF16 give `0xFFFF` (the vectorised kernel), other sources give BF16
//!   `0x7FC0`; BF16 -> F32 keeps the bits; the IEEE hardware
//!   conversions (F32 <-> F64, F32 -> F16, to F64) keep the sign and the top of the payload and set
//!   the quiet bit; F8_E4M3's NaN widens to `0x7FF00000` (F32) with its sign; any NaN becomes
//!   the signed `0x7F` in either float8 type. The private `nan_bits` is that table.
//! - **Two places torch disagrees with itself**, on NaN bits only: F16 -> F32 keeps the payload
//!   in the vectorised kernel but gives `0x7FFFFFFF` in the scalar tail (the last `len % 8`
//!   elements of a tensor), and F64 -> BF16 gives `0xFFFF` in bulk but `0x7FC0` in the tail.
//!   Bits here cannot depend on where a chunk ends, so this module always does what the bulk
//!   kernel does; both results are NaN either way.
//!
//! Only the six floating dtypes torch converts on the CPU are supported: F64, F32, F16, BF16,
//! F8_E4M3 and F8_E5M2. Any dtype may be "cast" to itself (a copy); everything else (integers,
//! BOOL, C64, the fnuz and sub-byte floats, E8M0) is refused by [`can_cast`] and [`cast`], so a
//! caller converting a whole checkpoint passes non-floating tensors through untouched
//! (see [`castable`]).
//!
//! Written by hand rather than with the `half` crate: `half` has no float8 types and its BF16 NaN
//! rule differs from torch's, and the remaining conversions are a few lines of integer code.

use crate::Dtype;

/// Why a [`cast`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CastError {
    /// The pair is not a conversion torch does between floating dtypes (see [`can_cast`]).
    #[error("cannot convert {from} to {to}: only F64, F32, F16, BF16, F8_E4M3 and F8_E5M2 convert, and float8 only from and to those")]
    Unsupported {
        /// Source dtype.
        from: Dtype,
        /// Target dtype.
        to: Dtype,
    },
    /// The source is not a whole number of elements.
    #[error("source of {len} bytes is not a whole number of {dtype} elements ({size} bytes each)")]
    Misaligned {
        /// Source length in bytes.
        len: usize,
        /// Source dtype.
        dtype: Dtype,
        /// Bytes per source element.
        size: usize,
    },
    /// The destination does not have room for exactly the converted elements.
    #[error("destination has {got} bytes, converting {elements} elements to {to} needs {expected}")]
    DestinationLength {
        /// Elements converted.
        elements: usize,
        /// Target dtype.
        to: Dtype,
        /// Bytes needed.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
}

/// Whether `dtype` is one of the floating dtypes [`cast`] converts (F64, F32, F16, BF16, F8_E4M3,
/// F8_E5M2). A reader converting a checkpoint converts these and passes the others through.
pub const fn castable(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F64 | Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F8_E4M3 | Dtype::F8_E5M2)
}

/// Whether [`cast`] converts `from` to `to`: any pair of [`castable`] dtypes, or any dtype to
/// itself (a copy).
pub const fn can_cast(from: Dtype, to: Dtype) -> bool {
    (castable(from) && castable(to)) || from as u8 == to as u8
}

/// Bytes per element of `to` for `n` bytes of `from`, i.e. the destination length [`cast`] wants.
/// `None` when the pair is not supported or `n` is not a whole number of `from` elements.
pub fn cast_len(n: usize, from: Dtype, to: Dtype) -> Option<usize> {
    if !can_cast(from, to) {
        return None;
    }
    if from == to {
        return Some(n);
    }
    let (fs, ts) = (from.byte_size()?, to.byte_size()?);
    if !n.is_multiple_of(fs) {
        return None;
    }
    (n / fs).checked_mul(ts)
}

/// Converts the little-endian elements in `src` from `from` to `to`, writing `dst`.
///
/// `src` must hold a whole number of elements and `dst` exactly as many elements of `to`. The
/// result equals torch's CPU `tensor.to(to)` bit for bit, NaN payloads included (see the module
/// docs). `from == to` copies.
pub fn cast(src: &[u8], from: Dtype, to: Dtype, dst: &mut [u8]) -> Result<(), CastError> {
    if !can_cast(from, to) {
        return Err(CastError::Unsupported { from, to });
    }
    if from == to {
        if dst.len() != src.len() {
            let elements = match from.byte_size() {
                Some(s) => src.len() / s,
                None => src.len(),
            };
            return Err(CastError::DestinationLength { elements, to, expected: src.len(), got: dst.len() });
        }
        dst.copy_from_slice(src);
        return Ok(());
    }
    // Both castable, so both have a byte size.
    let (fs, ts) = (from.byte_size().unwrap_or(1), to.byte_size().unwrap_or(1));
    if !src.len().is_multiple_of(fs) {
        return Err(CastError::Misaligned { len: src.len(), dtype: from, size: fs });
    }
    let elements = src.len() / fs;
    let expected = elements.checked_mul(ts);
    if expected != Some(dst.len()) {
        return Err(CastError::DestinationLength {
            elements,
            to,
            expected: expected.unwrap_or(usize::MAX),
            got: dst.len(),
        });
    }
    dispatch(src, from, to, dst);
    Ok(())
}

/// One floating format: how its bits are read, classified and produced.
trait Float {
    const DTYPE: Dtype;
    const SIZE: usize;
    fn load(b: &[u8]) -> u64;
    fn store(v: u64, b: &mut [u8]);
    fn is_nan(bits: u64) -> bool;
    /// The exact value of non-NaN `bits`.
    fn decode(bits: u64) -> f64;
    /// The bits of `v` (not NaN) rounded to nearest even, through F32 for the narrow formats.
    fn encode(v: f64) -> u64;
    /// `decode` for the formats whose every value is an F32 (all but F64): the fast path.
    fn decode32(bits: u64) -> f32 {
        Self::decode(bits) as f32
    }
    /// `encode` of an F32 value (not NaN).
    fn encode32(x: f32) -> u64 {
        Self::encode(f64::from(x))
    }
}

struct F64;
struct F32;
struct F16;
struct Bf16;
struct E4m3;
struct E5m2;

impl Float for F64 {
    const DTYPE: Dtype = Dtype::F64;
    const SIZE: usize = 8;
    fn load(b: &[u8]) -> u64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        u64::from_le_bytes(a)
    }
    fn store(v: u64, b: &mut [u8]) {
        b.copy_from_slice(&v.to_le_bytes());
    }
    fn is_nan(bits: u64) -> bool {
        bits & 0x7FFF_FFFF_FFFF_FFFF > 0x7FF0_0000_0000_0000
    }
    fn decode(bits: u64) -> f64 {
        f64::from_bits(bits)
    }
    fn encode(v: f64) -> u64 {
        v.to_bits()
    }
}

impl Float for F32 {
    const DTYPE: Dtype = Dtype::F32;
    const SIZE: usize = 4;
    fn load(b: &[u8]) -> u64 {
        let mut a = [0u8; 4];
        a.copy_from_slice(b);
        u32::from_le_bytes(a).into()
    }
    fn store(v: u64, b: &mut [u8]) {
        b.copy_from_slice(&(v as u32).to_le_bytes());
    }
    fn is_nan(bits: u64) -> bool {
        bits & 0x7FFF_FFFF > 0x7F80_0000
    }
    fn decode(bits: u64) -> f64 {
        f64::from(f32::from_bits(bits as u32))
    }
    fn encode(v: f64) -> u64 {
        // `as` rounds to nearest even (the value is not NaN, so the bits are deterministic).
        (v as f32).to_bits().into()
    }
    fn decode32(bits: u64) -> f32 {
        f32::from_bits(bits as u32)
    }
    fn encode32(x: f32) -> u64 {
        x.to_bits().into()
    }
}

/// Parameters of a narrow format: exponent and mantissa bits, and whether it saturates (E4M3FN:
/// no infinity, the all-ones pattern is NaN, finite overflow clamps to the largest value).
struct Narrow {
    exp: u32,
    man: u32,
    saturate: bool,
}

impl Narrow {
    const fn bias(&self) -> i32 {
        (1 << (self.exp - 1)) - 1
    }

    const fn sign_bit(&self) -> u32 {
        1 << (self.exp + self.man)
    }

    /// The all-ones-exponent pattern: infinity for the IEEE-like formats.
    const fn inf(&self) -> u32 {
        ((1 << self.exp) - 1) << self.man
    }

    /// The largest finite magnitude's bits.
    const fn max_finite(&self) -> u32 {
        if self.saturate {
            self.inf() | ((1 << self.man) - 2)
        } else {
            self.inf() - 1
        }
    }

    /// Exact value of non-NaN bits.
    fn decode(&self, bits: u32) -> f64 {
        let neg = bits & self.sign_bit() != 0;
        let e = (bits >> self.man) & ((1 << self.exp) - 1);
        let m = bits & ((1 << self.man) - 1);
        let mag = if !self.saturate && e == (1 << self.exp) - 1 {
            f64::INFINITY
        } else if e == 0 {
            f64::from(m) * pow2(1 - self.bias() - self.man as i32)
        } else {
            f64::from((1 << self.man) | m) * pow2(e as i32 - self.bias() - self.man as i32)
        };
        if neg {
            -mag
        } else {
            mag
        }
    }

    /// `x` (not NaN) rounded to nearest even.
    fn encode(&self, x: f32) -> u32 {
        let bits = x.to_bits();
        let sign = if bits >> 31 != 0 { self.sign_bit() } else { 0 };
        let abs = bits & 0x7FFF_FFFF;
        if abs >= 0x7F80_0000 {
            return sign | if self.saturate { self.max_finite() } else { self.inf() };
        }
        if abs == 0 {
            return sign;
        }
        // abs = sig * 2^exp exactly.
        let (sig, exp) = if abs >> 23 == 0 {
            (u64::from(abs), -149i32)
        } else {
            (u64::from(abs & 0x7F_FFFF) | 1 << 23, (abs >> 23) as i32 - 150)
        };
        let top = 63 - sig.leading_zeros() as i32;
        let emin = 1 - self.bias();
        let te = (top + exp).max(emin);
        // Bits of `sig` below the target's last mantissa bit at exponent `te`; always >= 0 here
        // because every narrow format has fewer mantissa bits than F32.
        let shift = (te - self.man as i32 - exp) as u32;
        let n = if shift == 0 {
            sig
        } else if shift >= 40 {
            0 // sig < 2^24 is below half of the quantum
        } else {
            let q = sig >> shift;
            let rem = sig & ((1 << shift) - 1);
            let half = 1 << (shift - 1);
            if rem > half || (rem == half && q & 1 == 1) {
                q + 1
            } else {
                q
            }
        };
        // (te + bias - 1) << man + n: a carry out of the mantissa bumps the exponent by itself,
        // and subnormals (te = emin, n < 2^man) get a zero exponent.
        let enc = (((te + self.bias() - 1) as u64) << self.man) + n;
        let enc = if enc > u64::from(self.max_finite()) {
            if self.saturate {
                self.max_finite()
            } else {
                self.inf()
            }
        } else {
            enc as u32
        };
        sign | enc
    }
}

fn pow2(k: i32) -> f64 {
    // Exact for the exponents the narrow formats need (-133..=15).
    f64::from_bits(((k + 1023) as u64) << 52)
}

const F16_FMT: Narrow = Narrow { exp: 5, man: 10, saturate: false };
/// BF16 encodes with a shorter bit trick; the tests check it against the generic encoder.
#[cfg(test)]
const BF16_FMT: Narrow = Narrow { exp: 8, man: 7, saturate: false };
const E4M3_FMT: Narrow = Narrow { exp: 4, man: 3, saturate: true };
const E5M2_FMT: Narrow = Narrow { exp: 5, man: 2, saturate: false };

impl Float for F16 {
    const DTYPE: Dtype = Dtype::F16;
    const SIZE: usize = 2;
    fn load(b: &[u8]) -> u64 {
        u16::from_le_bytes([b[0], b[1]]).into()
    }
    fn store(v: u64, b: &mut [u8]) {
        b.copy_from_slice(&(v as u16).to_le_bytes());
    }
    fn is_nan(bits: u64) -> bool {
        bits & 0x7FFF > 0x7C00
    }
    fn decode(bits: u64) -> f64 {
        f64::from(Self::decode32(bits))
    }
    fn encode(v: f64) -> u64 {
        Self::encode32(v as f32)
    }
    fn decode32(bits: u64) -> f32 {
        let h = bits as u32;
        let sign = (h & 0x8000) << 16;
        let e = (h >> 10) & 0x1F;
        let m = h & 0x3FF;
        if e == 0 {
            // Zero or subnormal: m * 2^-24, exact in F32.
            let mag = m as f32 * f32::from_bits(0x3380_0000);
            f32::from_bits(mag.to_bits() | sign)
        } else if e == 0x1F {
            f32::from_bits(sign | 0x7F80_0000 | (m << 13)) // infinity (NaN is handled by nan_bits)
        } else {
            f32::from_bits(sign | ((e + 112) << 23) | (m << 13))
        }
    }
    fn encode32(x: f32) -> u64 {
        let bits = x.to_bits();
        let abs = bits & 0x7FFF_FFFF;
        let sign = (bits >> 16) & 0x8000;
        if (0x3880_0000..0x4780_0000).contains(&abs) {
            // F16 normal range before rounding: rebias the exponent and round the 13 dropped bits
            // to nearest even; a carry rolls into the exponent, up to infinity (0x7C00).
            let v = abs - 0x3800_0000;
            let r = v + 0x0FFF + ((v >> 13) & 1);
            return (sign | (r >> 13)).into();
        }
        F16_FMT.encode(x).into() // subnormals, zero, overflow, infinity
    }
}

impl Float for Bf16 {
    const DTYPE: Dtype = Dtype::BF16;
    const SIZE: usize = 2;
    fn load(b: &[u8]) -> u64 {
        u16::from_le_bytes([b[0], b[1]]).into()
    }
    fn store(v: u64, b: &mut [u8]) {
        b.copy_from_slice(&(v as u16).to_le_bytes());
    }
    fn is_nan(bits: u64) -> bool {
        bits & 0x7FFF > 0x7F80
    }
    fn decode(bits: u64) -> f64 {
        f64::from(Self::decode32(bits))
    }
    fn encode(v: f64) -> u64 {
        Self::encode32(v as f32)
    }
    fn decode32(bits: u64) -> f32 {
        f32::from_bits((bits as u32) << 16)
    }
    fn encode32(x: f32) -> u64 {
        // F32 -> BF16 round to nearest even on the bits: add 0x7FFF plus the lowest kept bit.
        // Correct for every non-NaN input, subnormals and overflow to infinity included.
        let x = x.to_bits();
        (x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16).into()
    }
}

macro_rules! narrow8 {
    ($t:ident, $dt:expr, $fmt:ident) => {
        impl Float for $t {
            const DTYPE: Dtype = $dt;
            const SIZE: usize = 1;
            fn load(b: &[u8]) -> u64 {
                b[0].into()
            }
            fn store(v: u64, b: &mut [u8]) {
                b[0] = v as u8;
            }
            fn is_nan(bits: u64) -> bool {
                if $fmt.saturate {
                    bits & 0x7F == 0x7F
                } else {
                    bits & 0x7F > u64::from($fmt.inf())
                }
            }
            fn decode(bits: u64) -> f64 {
                $fmt.decode(bits as u32)
            }
            fn encode(v: f64) -> u64 {
                $fmt.encode(v as f32).into()
            }
            fn encode32(x: f32) -> u64 {
                $fmt.encode(x).into()
            }
        }
    };
}
narrow8!(E4m3, Dtype::F8_E4M3, E4M3_FMT);
narrow8!(E5m2, Dtype::F8_E5M2, E5M2_FMT);

/// The bits torch's CPU `.to()` produces for the NaN `bits` of `from` converted to `to`
/// (measured on torch 2.15; see the module docs).
fn nan_bits(from: Dtype, to: Dtype, bits: u64) -> u64 {
    use Dtype::*;
    let neg = match from {
        F64 => bits >> 63 != 0,
        F32 => bits >> 31 != 0,
        F16 | BF16 => bits >> 15 != 0,
        _ => bits >> 7 != 0,
    };
    match to {
        F64 => {
            let s = if neg { 1 << 63 } else { 0 };
            let payload = match from {
                F32 => (bits & 0x7F_FFFF) << 29,
                F16 => (bits & 0x3FF) << 42,
                BF16 => (bits & 0x7F) << 45,
                F8_E4M3 => 0x7 << 49,
                F8_E5M2 => ((bits << 8) & 0x3FF) << 42,
                _ => 0,
            };
            s | 0x7FF8_0000_0000_0000 | payload
        }
        F32 => {
            let s = if neg { 1 << 31 } else { 0 };
            match from {
                F64 => s | 0x7FC0_0000 | ((bits & 0xF_FFFF_FFFF_FFFF) >> 29),
                F16 => s | 0x7FC0_0000 | ((bits & 0x3FF) << 13),
                BF16 => bits << 16,
                F8_E4M3 => s | 0x7FF0_0000,
                _ => s | 0x7FC0_0000 | (((bits << 8) & 0x3FF) << 13),
            }
        }
        F16 => {
            let s = if neg { 0x8000 } else { 0 };
            let payload = match from {
                F64 => (bits & 0xF_FFFF_FFFF_FFFF) >> 42,
                F32 => (bits & 0x7F_FFFF) >> 13,
                BF16 => (bits & 0x7F) << 3,
                F8_E4M3 => 0x380,
                _ => (bits << 8) & 0x3FF,
            };
            s | 0x7E00 | payload
        }
        BF16 => {
            if matches!(from, F32 | F64) {
                0xFFFF
            } else {
                0x7FC0
            }
        }
        _ => {
            if neg {
                0xFF
            } else {
                0x7F
            }
        }
    }
}

fn convert<S: Float, D: Float>(src: &[u8], dst: &mut [u8]) {
    for (s, d) in src.chunks_exact(S::SIZE).zip(dst.chunks_exact_mut(D::SIZE)) {
        let bits = S::load(s);
        let out = if S::is_nan(bits) {
            nan_bits(S::DTYPE, D::DTYPE, bits)
        } else if S::SIZE <= 4 && D::SIZE <= 4 {
            D::encode32(S::decode32(bits)) // every value of S is an F32: skip F64
        } else {
            D::encode(S::decode(bits))
        };
        D::store(out, d);
    }
}

fn dispatch(src: &[u8], from: Dtype, to: Dtype, dst: &mut [u8]) {
    macro_rules! to {
        ($s:ty) => {
            match to {
                Dtype::F64 => convert::<$s, F64>(src, dst),
                Dtype::F32 => convert::<$s, F32>(src, dst),
                Dtype::F16 => convert::<$s, F16>(src, dst),
                Dtype::BF16 => convert::<$s, Bf16>(src, dst),
                Dtype::F8_E4M3 => convert::<$s, E4m3>(src, dst),
                Dtype::F8_E5M2 => convert::<$s, E5m2>(src, dst),
                _ => {}
            }
        };
    }
    match from {
        Dtype::F64 => to!(F64),
        Dtype::F32 => to!(F32),
        Dtype::F16 => to!(F16),
        Dtype::BF16 => to!(Bf16),
        Dtype::F8_E4M3 => to!(E4m3),
        Dtype::F8_E5M2 => to!(E5m2),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(bits: u64, from: Dtype, to: Dtype) -> u64 {
        let fs = from.byte_size().unwrap();
        let ts = to.byte_size().unwrap();
        let src = &bits.to_le_bytes()[..fs];
        let mut dst = [0u8; 8];
        cast(src, from, to, &mut dst[..ts]).unwrap();
        u64::from_le_bytes(dst)
    }

    fn f32b(x: f32) -> u64 {
        x.to_bits().into()
    }

    #[test]
    fn f32_to_bf16_rounds_to_nearest_even() {
        use Dtype::{BF16, F32};
        assert_eq!(one(f32b(1.0), F32, BF16), 0x3F80);
        // 1 + 2^-8 is the tie between 1 and 1 + 2^-7: to even (1).
        assert_eq!(one(f32b(1.0 + 1.0 / 256.0), F32, BF16), 0x3F80);
        // 1 + 3 * 2^-8 ties between 1 + 2^-7 (odd) and 1 + 2^-6: to even (up).
        assert_eq!(one(f32b(1.0 + 3.0 / 256.0), F32, BF16), 0x3F82);
        assert_eq!(one(0x3F80_8001, F32, BF16), 0x3F81); // just above the tie
        assert_eq!(one(f32b(f32::MAX), F32, BF16), 0x7F80); // overflows to inf
        assert_eq!(one(0x0000_8000, F32, BF16), 0x0000); // subnormal tie to even (0)
        assert_eq!(one(0x0001_8000, F32, BF16), 0x0002);
        assert_eq!(one(f32b(-0.0), F32, BF16), 0x8000);
        assert_eq!(one(f32b(f32::NEG_INFINITY), F32, BF16), 0xFF80);
        assert_eq!(one(0x7FC0_0000, F32, BF16), 0xFFFF);
    }

    #[test]
    fn bf16_generic_encoder_agrees_with_the_bit_trick() {
        let mut x = 0x1234_5678u32;
        for i in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let v = if i < 65536 { (i << 16) | (x & 0xFFFF) } else { x };
            if f32::from_bits(v).is_nan() {
                continue;
            }
            assert_eq!(
                u64::from(BF16_FMT.encode(f32::from_bits(v))),
                Bf16::encode(f64::from(f32::from_bits(v))),
                "{v:#x}"
            );
        }
    }

    #[test]
    fn f16_fast_paths_agree_with_the_generic_codec() {
        let mut x = 0x2545_F491u32;
        for i in 0..600_000u32 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            // Every exponent with random mantissas, plus the values around each boundary.
            let v = match i % 3 {
                0 => x,
                1 => (x & 0x807F_FFFF) | ((i / 3 % 256) << 23),
                _ => [0x3880_0000u32, 0x477F_E000, 0x477F_F000, 0x4780_0000, 0x3300_0000][(i / 3 % 5) as usize]
                    .wrapping_add(x % 9)
                    .wrapping_sub(4),
            };
            if f32::from_bits(v).is_nan() {
                continue;
            }
            assert_eq!(F16::encode32(f32::from_bits(v)), u64::from(F16_FMT.encode(f32::from_bits(v))), "{v:#x}");
        }
        for h in 0..=0xFFFFu64 {
            if !F16::is_nan(h) {
                assert_eq!(F16::decode32(h).to_bits(), (F16_FMT.decode(h as u32) as f32).to_bits(), "{h:#x}");
            }
        }
    }

    #[test]
    fn f32_to_f16() {
        use Dtype::{F16, F32};
        assert_eq!(one(f32b(65504.0), F32, F16), 0x7BFF);
        assert_eq!(one(f32b(65519.0), F32, F16), 0x7BFF);
        assert_eq!(one(f32b(65520.0), F32, F16), 0x7C00); // tie with 65536 goes to inf
        assert_eq!(one(f32b(5.960_464_5e-8), F32, F16), 0x0001); // smallest subnormal
        assert_eq!(one(f32b(2.980_232_2e-8), F32, F16), 0x0000); // half of it: tie to even 0
        assert_eq!(one(f32b(8.940_697e-8), F32, F16), 0x0002); // 1.5 quanta: tie to even 2
        assert_eq!(one(f32b(6.103_515_6e-5), F32, F16), 0x0400); // min normal
        assert_eq!(one(0xFFC1_2345, F32, F16), 0xFE09);
    }

    #[test]
    fn float8_saturation_and_overflow() {
        use Dtype::{F32, F8_E4M3, F8_E5M2};
        assert_eq!(one(f32b(448.0), F32, F8_E4M3), 0x7E);
        assert_eq!(one(f32b(1e6), F32, F8_E4M3), 0x7E);
        assert_eq!(one(f32b(f32::INFINITY), F32, F8_E4M3), 0x7E);
        assert_eq!(one(f32b(f32::NEG_INFINITY), F32, F8_E4M3), 0xFE);
        assert_eq!(one(f32b(f32::NAN), F32, F8_E4M3), 0x7F);
        assert_eq!(one(f32b(1.0 / 512.0), F32, F8_E4M3), 0x01); // smallest subnormal 2^-9
        assert_eq!(one(f32b(1.0 / 1024.0), F32, F8_E4M3), 0x00); // tie to even 0
        assert_eq!(one(f32b(57344.0), F32, F8_E5M2), 0x7B);
        assert_eq!(one(f32b(61439.0), F32, F8_E5M2), 0x7B);
        assert_eq!(one(f32b(61440.0), F32, F8_E5M2), 0x7C); // tie to even: infinity
        assert_eq!(one(f32b(f32::INFINITY), F32, F8_E5M2), 0x7C);
        assert_eq!(one(0x7F, F8_E4M3, F32), 0x7FF0_0000);
        assert_eq!(one(0x7E, F8_E4M3, F32), f32b(448.0));
        assert_eq!(one(0x7C, F8_E5M2, F32), f32b(f32::INFINITY));
    }

    #[test]
    fn f64_goes_through_f32() {
        use Dtype::{F16, F64};
        // Just above the F16 tie 1 + 2^-11, but F32 rounds it onto the tie first.
        let x = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(one(x.to_bits(), F64, F16), 0x3C00);
        let y = 1.0 + 2f64.powi(-11) + 2f64.powi(-20);
        assert_eq!(one(y.to_bits(), F64, F16), 0x3C01);
    }

    #[test]
    fn widening_is_exact_for_every_16_bit_pattern() {
        for b in 0..=0xFFFFu64 {
            for from in [Dtype::F16, Dtype::BF16] {
                let wide = one(b, from, Dtype::F32);
                let back = one(wide, Dtype::F32, from);
                let is_nan = if from == Dtype::F16 { F16::is_nan(b) } else { Bf16::is_nan(b) };
                if !is_nan {
                    assert_eq!(back, b, "{from} {b:#x}");
                    assert_eq!(one(b, from, Dtype::F64), f64::from(f32::from_bits(wide as u32)).to_bits());
                }
            }
        }
    }

    #[test]
    fn refusals_and_lengths() {
        assert!(!can_cast(Dtype::I32, Dtype::F32));
        assert!(!can_cast(Dtype::F32, Dtype::F8_E4M3FNUZ));
        assert!(can_cast(Dtype::I32, Dtype::I32));
        let mut out = [0u8; 4];
        assert_eq!(
            cast(&[0; 4], Dtype::I32, Dtype::F32, &mut out),
            Err(CastError::Unsupported { from: Dtype::I32, to: Dtype::F32 })
        );
        assert!(matches!(cast(&[0; 3], Dtype::F32, Dtype::BF16, &mut out), Err(CastError::Misaligned { .. })));
        assert!(matches!(cast(&[0; 4], Dtype::F32, Dtype::BF16, &mut out), Err(CastError::DestinationLength { .. })));
        assert_eq!(cast_len(12, Dtype::F32, Dtype::BF16), Some(6));
        assert_eq!(cast_len(13, Dtype::F32, Dtype::BF16), None);
        cast(&[1, 2, 3, 4], Dtype::I32, Dtype::I32, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4]);
        // Chunks give the same bytes as the whole.
        let src: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37)).collect();
        let mut whole = vec![0u8; 32];
        cast(&src, Dtype::F32, Dtype::F16, &mut whole).unwrap();
        let mut parts = vec![0u8; 32];
        for (s, d) in src.chunks(12).zip(parts.chunks_mut(6)) {
            cast(s, Dtype::F32, Dtype::F16, d).unwrap();
        }
        assert_eq!(whole, parts);
    }
}
