//! The 22 element types of the safetensors format.

use serde::Deserialize;
use std::fmt;
use std::str::FromStr;

/// An element type, spelled in headers exactly as the variant name (case-sensitive).
///
/// The declaration order is the reference implementation's "increasing alignment" order; the
/// writer sorts tensors by descending `Dtype` and then by name, so bigger elements come first and
/// every tensor ends up aligned to its element size in the file.
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
pub enum Dtype {
    /// Boolean, one byte per element.
    BOOL,
    /// MXFP4 (E2M1), 4 bits per element, two elements per byte.
    F4,
    /// MXFP6 (E2M3), 6 bits per element.
    F6_E2M3,
    /// MXFP6 (E3M2), 6 bits per element.
    F6_E3M2,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// 8-bit float, 5 exponent and 2 mantissa bits.
    F8_E5M2,
    /// 8-bit float, 4 exponent and 3 mantissa bits (torch `float8_e4m3fn`).
    F8_E4M3,
    /// 8-bit exponent-only scale (torch `float8_e8m0fnu`).
    F8_E8M0,
    /// 8-bit float E4M3, "fnuz" variant (AMD).
    F8_E4M3FNUZ,
    /// 8-bit float E5M2, "fnuz" variant (AMD).
    F8_E5M2FNUZ,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// IEEE single precision.
    F32,
    /// Complex of two `f32`.
    C64,
    /// IEEE double precision.
    F64,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
}

impl Dtype {
    /// Every dtype, in declaration order.
    pub const ALL: [Dtype; 22] = [
        Dtype::BOOL,
        Dtype::F4,
        Dtype::F6_E2M3,
        Dtype::F6_E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8_E5M2,
        Dtype::F8_E4M3,
        Dtype::F8_E8M0,
        Dtype::F8_E4M3FNUZ,
        Dtype::F8_E5M2FNUZ,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// Bits per element.
    pub const fn bits(self) -> usize {
        match self {
            Dtype::F4 => 4,
            Dtype::F6_E2M3 | Dtype::F6_E3M2 => 6,
            Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8_E5M2
            | Dtype::F8_E4M3
            | Dtype::F8_E8M0
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }

    /// Bytes per element, or `None` for the sub-byte types (F4, F6_*).
    pub const fn byte_size(self) -> Option<usize> {
        let bits = self.bits();
        if bits.is_multiple_of(8) {
            Some(bits / 8)
        } else {
            None
        }
    }

    /// The header spelling, e.g. `"BF16"`.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6_E2M3 => "F6_E2M3",
            Dtype::F6_E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E8M0 => "F8_E8M0",
            Dtype::F8_E4M3FNUZ => "F8_E4M3FNUZ",
            Dtype::F8_E5M2FNUZ => "F8_E5M2FNUZ",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The error of [`Dtype::from_str`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype `{0}` (expected one of BOOL, F4, F6_E2M3, F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64)")]
pub struct UnknownDtype(pub String);

impl FromStr for Dtype {
    type Err = UnknownDtype;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Dtype::ALL.into_iter().find(|d| d.name() == s).ok_or_else(|| UnknownDtype(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_case_sensitive() {
        for d in Dtype::ALL {
            assert_eq!(d.name().parse::<Dtype>().unwrap(), d);
            let json: Dtype = serde_json::from_str(&format!("\"{}\"", d.name())).unwrap();
            assert_eq!(json, d);
        }
        assert!("f32".parse::<Dtype>().is_err());
        assert!(serde_json::from_str::<Dtype>("\"f32\"").is_err());
    }

    #[test]
    fn declaration_order_matches_all() {
        let mut sorted = Dtype::ALL;
        sorted.sort();
        assert_eq!(sorted, Dtype::ALL);
    }

    #[test]
    fn bit_sizes() {
        let expect = [8, 4, 6, 6, 8, 8, 8, 8, 8, 8, 8, 16, 16, 16, 16, 32, 32, 32, 64, 64, 64, 64];
        for (d, bits) in Dtype::ALL.into_iter().zip(expect) {
            assert_eq!(d.bits(), bits, "{d}");
        }
        assert_eq!(Dtype::F4.byte_size(), None);
        assert_eq!(Dtype::BF16.byte_size(), Some(2));
    }
}
