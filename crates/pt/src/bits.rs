//! The conjugate and negative bits torch records in a tensor's metadata (`x.conj()` of a
//! complex tensor and `x._neg_view()` save the stored values with a bit that says how to read
//! them): turning stored bytes into the logical values torch returns.

use turboio_format::Dtype;

/// Whether turboio computes the negation of `dtype`'s values: every signed and unsigned integer
/// (wrapping, as torch's `neg`), the floats with a sign bit, and complex64. Not booleans (torch
/// cannot negate them either), not `float8_e8m0fnu` (it has no sign bit), not the packed
/// sub-byte types.
pub fn negatable(dtype: Dtype) -> bool {
    use Dtype::*;
    matches!(dtype, I8 | I16 | I32 | I64 | U8 | U16 | U32 | U64 | F16 | BF16 | F32 | F64 | F8_E4M3 | F8_E5M2)
        || matches!(dtype, C64 | F8_E4M3FNUZ | F8_E5M2FNUZ)
}

/// Rewrites `bytes` (whole little-endian elements of `dtype`) from stored to logical values:
/// conjugated (the imaginary parts negated) and/or negated. `false` if `dtype` cannot take the
/// bits asked for (the parser refuses such files before anything is read).
pub fn apply(dtype: Dtype, conj: bool, neg: bool, bytes: &mut [u8]) -> bool {
    if !conj && !neg {
        return true;
    }
    if conj && dtype != Dtype::C64 {
        return false;
    }
    if neg && !negatable(dtype) {
        return false;
    }
    let Some(size) = dtype.byte_size() else { return false };
    for e in bytes.chunks_exact_mut(size) {
        match dtype {
            Dtype::C64 => {
                // (re, im) f32 pairs: conj flips im's sign, neg flips both; conj + neg flips re.
                if neg {
                    e[3] ^= 0x80;
                }
                if neg != conj {
                    e[7] ^= 0x80;
                }
            }
            Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64 | Dtype::F8_E4M3 | Dtype::F8_E5M2 => {
                e[size - 1] ^= 0x80;
            }
            // The fnuz formats have no negative zero: 0x80 is their NaN, and -0 is 0.
            Dtype::F8_E4M3FNUZ | Dtype::F8_E5M2FNUZ => {
                if e[0] != 0 && e[0] != 0x80 {
                    e[0] ^= 0x80;
                }
            }
            _ => {
                // Integers: two's complement negation, wrapping (torch's `neg` on uint8 too).
                let mut carry = true;
                for b in e.iter_mut() {
                    let (v, c) = (!*b).overflowing_add(u8::from(carry));
                    *b = v;
                    carry = c;
                }
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logical_values() {
        let mut f = [1.5f32.to_le_bytes(), (-2.0f32).to_le_bytes()].concat();
        assert!(apply(Dtype::F32, false, true, &mut f));
        assert_eq!(f, [(-1.5f32).to_le_bytes(), 2.0f32.to_le_bytes()].concat());
        let mut c = [1.0f32.to_le_bytes(), 2.0f32.to_le_bytes()].concat();
        assert!(apply(Dtype::C64, true, false, &mut c));
        assert_eq!(c, [1.0f32.to_le_bytes(), (-2.0f32).to_le_bytes()].concat());
        let mut c = [1.0f32.to_le_bytes(), 2.0f32.to_le_bytes()].concat();
        assert!(apply(Dtype::C64, true, true, &mut c), "-(conj(1+2i)) = -1+2i");
        assert_eq!(c, [(-1.0f32).to_le_bytes(), 2.0f32.to_le_bytes()].concat());
        let mut i = [5i64.to_le_bytes(), i64::MIN.to_le_bytes(), 0i64.to_le_bytes()].concat();
        assert!(apply(Dtype::I64, false, true, &mut i));
        assert_eq!(i, [(-5i64).to_le_bytes(), i64::MIN.to_le_bytes(), 0i64.to_le_bytes()].concat());
        let mut u = [1u8, 0, 255];
        assert!(apply(Dtype::U8, false, true, &mut u));
        assert_eq!(u, [255, 0, 1]);
        let mut z = [0x00u8, 0x80, 0x01];
        assert!(apply(Dtype::F8_E4M3FNUZ, false, true, &mut z));
        assert_eq!(z, [0x00, 0x80, 0x81]);
        assert!(!apply(Dtype::BOOL, false, true, &mut [1]));
        assert!(!apply(Dtype::F32, true, false, &mut [0; 4]));
        assert!(!negatable(Dtype::F8_E8M0));
    }
}
