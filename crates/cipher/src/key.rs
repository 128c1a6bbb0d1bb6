//! Key material, IVs and modes.

use std::fmt;
use std::str::FromStr;

use base64::Engine as _;
use zeroize::{Zeroize, ZeroizeOnDrop, Zeroizing};

use crate::CipherError;

/// Standard base64 with padding, accepting non-zero trailing bits as Python's `b64decode` does.
const B64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::general_purpose::PAD.with_decode_allow_trailing_bits(true),
);

/// Encodes bytes as standard base64 with padding (Python's `base64.b64encode`).
pub fn b64_encode(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

/// Decodes standard base64 with padding (Python's `base64.b64decode(s, validate=True)`).
///
/// The error names `what` and the problem, never the text: it may be a key.
/// The decoded bytes are returned in a [`Zeroizing`] buffer.
pub fn b64_decode(text: &str, what: &'static str) -> Result<Zeroizing<Vec<u8>>, CipherError> {
    let mut out = Zeroizing::new(Vec::with_capacity(text.len() / 4 * 3 + 3));
    match B64.decode_vec(text.as_bytes(), &mut out) {
        Ok(()) => Ok(out),
        Err(e) => Err(CipherError::InvalidBase64 { what, reason: describe_b64_error(&e) }),
    }
}

/// A description of a base64 error that names positions but never the offending byte
/// (the input may be key material).
fn describe_b64_error(e: &base64::DecodeError) -> String {
    match e {
        base64::DecodeError::InvalidByte(at, _) => {
            format!("character at offset {at} is not in the base64 alphabet")
        }
        base64::DecodeError::InvalidLength(len) => {
            format!("length {len} is not a valid base64 length")
        }
        base64::DecodeError::InvalidLastSymbol { offset, .. } => {
            format!("invalid last symbol at offset {offset}")
        }
        base64::DecodeError::InvalidPadding => "incorrect padding".to_string(),
    }
}

/// The AES-CTR variant: AES-128 or AES-256, both with a 128-bit big-endian counter.
///
/// The names are veTurboIO's `CipherMode` values, as stored in the encrypted-file header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// AES-128-CTR, 16-byte key (`"CTR-128"`). What veTurboIO writes.
    Ctr128,
    /// AES-256-CTR, 32-byte key (`"CTR-256"`).
    Ctr256,
}

impl Mode {
    /// The header spelling: `"CTR-128"` or `"CTR-256"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Ctr128 => "CTR-128",
            Mode::Ctr256 => "CTR-256",
        }
    }

    /// Key length in bytes: 16 or 32.
    pub fn key_len(self) -> usize {
        match self {
            Mode::Ctr128 => 16,
            Mode::Ctr256 => 32,
        }
    }

    /// The mode a key of `len` bytes selects (veTurboIO's C++ rule), if any.
    pub fn for_key_len(len: usize) -> Result<Mode, CipherError> {
        match len {
            16 => Ok(Mode::Ctr128),
            32 => Ok(Mode::Ctr256),
            len => Err(CipherError::InvalidKeyLength { len }),
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Mode {
    type Err = CipherError;

    /// Exactly `"CTR-128"` or `"CTR-256"` (case-sensitive, as Python's `CipherMode(...)`).
    fn from_str(s: &str) -> Result<Mode, CipherError> {
        match s {
            "CTR-128" => Ok(Mode::Ctr128),
            "CTR-256" => Ok(Mode::Ctr256),
            other => Err(CipherError::UnknownMode(other.to_string())),
        }
    }
}

/// AES key material: 16 bytes (AES-128) or 32 bytes (AES-256).
///
/// The bytes are overwritten with zeros when the key is dropped ([`ZeroizeOnDrop`]), `Debug`
/// prints only `Key(<redacted>, 128 bits)`, there is no `Display`, and no error of this crate
/// contains key bytes. [`Key::expose`] is the one way to read them (to encrypt the key for KMS).
#[derive(Clone)]
pub struct Key {
    bytes: [u8; 32],
    len: u8,
}

impl Key {
    /// A key from its raw bytes; 16 or 32 of them, anything else is an error.
    pub fn new(bytes: &[u8]) -> Result<Key, CipherError> {
        Mode::for_key_len(bytes.len())?;
        let mut key = Key { bytes: [0; 32], len: bytes.len() as u8 };
        key.bytes[..bytes.len()].copy_from_slice(bytes);
        Ok(key)
    }

    /// A key from standard base64 (veTurboIO's `VETURBOIO_KEY`, KMS `Plaintext`). The decoded
    /// bytes are zeroized; errors never repeat the text.
    pub fn from_base64(text: &str) -> Result<Key, CipherError> {
        let raw = b64_decode(text.trim(), "the key")?;
        Key::new(&raw)
    }

    /// A fresh random key for `mode` from the operating system's generator.
    ///
    /// # Panics
    ///
    /// If the OS generator fails (on Linux: only before the entropy pool is initialised at
    /// boot, or under a seccomp filter that forbids `getrandom`). Use [`Key::try_random`] to
    /// get an error instead.
    pub fn random(mode: Mode) -> Key {
        match Key::try_random(mode) {
            Ok(k) => k,
            Err(e) => panic!("{e}"),
        }
    }

    /// Like [`Key::random`], returning an error if the OS generator fails.
    pub fn try_random(mode: Mode) -> Result<Key, CipherError> {
        let mut key = Key { bytes: [0; 32], len: mode.key_len() as u8 };
        getrandom::fill(&mut key.bytes[..mode.key_len()]).map_err(|e| CipherError::Random(e.to_string()))?;
        Ok(key)
    }

    /// Bytes of key: 16 or 32.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// Always false (a key has 16 or 32 bytes); present because `len` is.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// [`Mode::Ctr128`] for 16-byte keys, [`Mode::Ctr256`] for 32-byte keys.
    pub fn mode(&self) -> Mode {
        if self.len() == 16 {
            Mode::Ctr128
        } else {
            Mode::Ctr256
        }
    }

    /// An error unless this key's length fits `mode` (e.g. a header says `CTR-256` but KMS
    /// returned 16 bytes).
    pub fn check_mode(&self, mode: Mode) -> Result<(), CipherError> {
        if self.mode() == mode {
            Ok(())
        } else {
            Err(CipherError::KeyModeMismatch { key_bits: self.len() * 8, mode })
        }
    }

    /// The raw key bytes. Only for handing the key to KMS `Encrypt` (or a test); never log them.
    pub fn expose(&self) -> &[u8] {
        &self.bytes[..self.len()]
    }

    /// The key as standard base64 (what KMS `Encrypt` takes as `Plaintext`), in a buffer that
    /// is zeroized on drop.
    pub fn to_base64(&self) -> Zeroizing<String> {
        let mut s = Zeroizing::new(String::with_capacity(44));
        B64.encode_string(self.expose(), &mut s);
        s
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        self.bytes.zeroize();
    }
}

impl ZeroizeOnDrop for Key {}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key(<redacted>, {} bits)", self.len() * 8)
    }
}

/// The 16-byte initial counter block. Not secret: the header stores it in plain base64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Iv(pub [u8; 16]);

impl Iv {
    /// An IV from exactly 16 bytes.
    pub fn new(bytes: &[u8]) -> Result<Iv, CipherError> {
        match <[u8; 16]>::try_from(bytes) {
            Ok(a) => Ok(Iv(a)),
            Err(_) => Err(CipherError::InvalidIvLength { len: bytes.len() }),
        }
    }

    /// An IV from standard base64 of 16 bytes (`VETURBOIO_IV`, the header's `iv`).
    pub fn from_base64(text: &str) -> Result<Iv, CipherError> {
        Iv::new(&b64_decode(text.trim(), "the IV")?)
    }

    /// The IV as standard base64 (24 characters), as the header stores it.
    pub fn to_base64(&self) -> String {
        b64_encode(&self.0)
    }

    /// A fresh random IV from the operating system's generator.
    ///
    /// # Panics
    ///
    /// If the OS generator fails; see [`Key::random`]. [`Iv::try_random`] returns an error.
    pub fn random() -> Iv {
        match Iv::try_random() {
            Ok(iv) => iv,
            Err(e) => panic!("{e}"),
        }
    }

    /// Like [`Iv::random`], returning an error if the OS generator fails.
    pub fn try_random() -> Result<Iv, CipherError> {
        let mut iv = [0u8; 16];
        getrandom::fill(&mut iv).map_err(|e| CipherError::Random(e.to_string()))?;
        Ok(Iv(iv))
    }
}
