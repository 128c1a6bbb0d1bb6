//! The cipher layer of loads and saves (feature `cipher`): keys, the decrypting layer of an
//! open file, the encrypting write source. The public face is [`crate::crypt`].
//!
//! Loads detect the layout (the 256 KiB `Byte3ncryptM0del` header, or none), get the key from
//! [`Keys`], and decrypt each chunk on the reader thread right after it is read. Saves encrypt
//! each chunk as the writers produce it, so no second full-size buffer exists. Encrypted files
//! are always copied (a mapping would expose ciphertext).

use crate::{Error, Result};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use turboio_cipher::{CipherHeader, CtrCipher, HEADER_SIZE, MAGIC};
use turboio_format::{read_header_len, FormatError, Header, N_LEN};
use turboio_storage::{StorageFile, WriteSource};

pub use turboio_cipher::{Iv, Key};
pub use turboio_kms::KeyResolver;

/// Where the keys of encrypted files come from.
#[derive(Clone)]
pub enum Keys {
    /// veTurboIO's chain: a cipher header's KMS-wrapped key, then the datapipe socket, then
    /// `VETURBOIO_KEY` / `VETURBOIO_IV` (see `turboio_kms`).
    Chain(Arc<KeyResolver>),
    /// A key and IV given directly.
    Fixed {
        /// 16 bytes (AES-128) or 32 (AES-256).
        key: Key,
        /// The initial counter block.
        iv: Iv,
    },
}

impl fmt::Debug for Keys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Keys::Chain(_) => f.write_str("Keys::Chain"),
            Keys::Fixed { key, .. } => write!(f, "Keys::Fixed({key:?})"),
        }
    }
}

impl Keys {
    /// veTurboIO's chain, configured from the environment.
    pub fn from_env() -> Keys {
        Keys::Chain(Arc::new(KeyResolver::from_env()))
    }

    /// Only `VETURBOIO_KEY` and `VETURBOIO_IV` (standard base64), no KMS or datapipe.
    pub fn env_only() -> std::result::Result<Keys, String> {
        let get = |name: &str| std::env::var(name).map_err(|_| format!("{name} is not set"));
        let key = Key::from_base64(&get("VETURBOIO_KEY")?).map_err(|e| format!("VETURBOIO_KEY: {e}"))?;
        let iv = Iv::from_base64(&get("VETURBOIO_IV")?).map_err(|e| format!("VETURBOIO_IV: {e}"))?;
        Ok(Keys::Fixed { key, iv })
    }
}

/// Encryption of a load or a save.
#[derive(Clone, Debug)]
pub struct Encryption {
    /// Where the key comes from.
    pub keys: Keys,
    /// Saves only: write veTurboIO's 256 KiB header (a fresh random key, wrapped by KMS
    /// Encrypt, is stored in it). Loads detect the header by themselves.
    pub header: bool,
    /// Loads only: before any byte is returned, check that the key decrypts the file to a
    /// safetensors or torch file (a wrong key gives random bytes). `true` normally; `false` for
    /// files of other content whose reader checks what it decrypted itself (DCP's metadata
    /// pickle and data files, in `turboio.dcp`).
    pub check_content: bool,
}

impl Encryption {
    /// Decryption or encryption with `keys`, without a header on save, checking content on load.
    pub fn new(keys: Keys) -> Self {
        Encryption { keys, header: false, check_content: true }
    }
}

/// The decrypting layer of an open file.
pub(crate) struct Crypt {
    /// Bytes of cipher header before the ciphertext.
    pub offset: u64,
    pub cipher: CtrCipher,
    /// The key and IV themselves, for devices that decrypt in their own memory (zeroized on
    /// drop by `Key`).
    pub key: Key,
    pub iv: Iv,
    /// Where the key came from, for messages.
    pub source: String,
}

impl fmt::Debug for Crypt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Crypt").field("offset", &self.offset).field("source", &self.source).finish_non_exhaustive()
    }
}

fn key_error(path: &Path, message: impl fmt::Display) -> Error {
    let message = message.to_string();
    // The key chain names the file in its own message ("no key for PATH: ..."); the error
    // names it once, in front.
    let named = format!("no key for {}: ", turboio_storage::shown(&key_path(path)));
    let message = match message.strip_prefix(&named) {
        Some(rest) => format!("no key found: {rest}"),
        None => message,
    };
    Error::Key { path: path.to_owned(), message }
}

/// The resolver, giving up once `cancel` is set.
fn cancellable(r: &Arc<KeyResolver>, cancel: Option<&Arc<AtomicBool>>) -> Arc<KeyResolver> {
    match cancel {
        Some(c) => Arc::new((**r).clone().with_cancel(c.clone())),
        None => r.clone(),
    }
}

fn key_lookup_error(path: &Path, e: turboio_kms::KeyError) -> Error {
    match e {
        turboio_kms::KeyError::Cancelled => Error::Cancelled { path: path.to_owned() },
        e => key_error(path, e),
    }
}

/// Finds the layout and the key of an encrypted file (the key look-up stops once `cancel` is
/// set; the first bytes are read with `O_DIRECT` when `bypass`, so that a load bypassing the
/// page cache leaves it as it was).
pub(crate) fn for_read(
    file: &dyn StorageFile,
    enc: &Encryption,
    cancel: Option<&Arc<AtomicBool>>,
    bypass: bool,
) -> Result<Crypt> {
    let path = file.path();
    let len = file.len();
    let mut first = vec![0u8; len.min(HEADER_SIZE) as usize];
    let direct = if bypass { turboio_storage::DirectIo::On } else { turboio_storage::DirectIo::Off };
    let io = turboio_storage::IoOptions { threads: 1, direct, ..Default::default() };
    file.read_ranges(vec![turboio_storage::ReadRequest { offset: 0, dst: &mut first }], &io)
        .map_err(|e| Error::storage(path, e))?;
    let header = CipherHeader::parse(&first, len).map_err(|e| key_error(path, format!("bad cipher header: {e}")))?;
    let offset = if header.is_some() { HEADER_SIZE } else { 0 };
    let (key, iv, source) = match &enc.keys {
        Keys::Fixed { key, iv } => {
            (key.clone(), *iv, "the key and IV given (VETURBOIO_KEY / VETURBOIO_IV with --key-env)".to_string())
        }
        Keys::Chain(resolver) => {
            let r = cancellable(resolver, cancel);
            let m = r.key_for_read(&key_path(path), header.as_ref()).map_err(|e| key_lookup_error(path, e))?;
            let source = format!("the key came from {}", m.source.label());
            (m.key.clone(), m.iv, source)
        }
    };
    let crypt = Crypt { offset, cipher: CtrCipher::new(&key, &iv), key, iv, source };
    if enc.check_content {
        check_plaintext(file, &crypt, &io)?;
    }
    Ok(crypt)
}

/// What a decrypted file turned out to be.
enum Plain {
    Safetensors,
    Torch,
}

/// Legacy `torch.save` files (not zip) start with a pickle of this magic number
/// (`PROTO 2, LONG1 10 bytes`).
const TORCH_LEGACY_MAGIC: &[u8] = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19";

/// Reads `len` plain bytes at plain offset `pos` through the decrypting layer (with the
/// caller's I/O options: `O_DIRECT` when the load bypasses the page cache).
fn read_plain(
    file: &dyn StorageFile,
    crypt: &Crypt,
    pos: u64,
    len: usize,
    io: &turboio_storage::IoOptions<'_>,
) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let request = turboio_storage::ReadRequest { offset: crypt.offset + pos, dst: &mut buf };
    file.read_ranges(vec![request], io).map_err(|e| Error::storage(file.path(), e))?;
    crypt.cipher.apply_at(pos, &mut buf);
    Ok(buf)
}

/// Checks that the key decrypts the file to something valid before any byte of it is written
/// or returned: a safetensors header that parses, or a file `torch.load` opens (a zip archive
/// with its end record, or a legacy torch pickle). A wrong key gives random bytes, which fail
/// this (a safetensors length and `{`, or a 4-byte zip signature plus an end record, or a
/// 14-byte magic number, by chance: far below one in a billion).
fn check_plaintext(file: &dyn StorageFile, crypt: &Crypt, io: &turboio_storage::IoOptions<'_>) -> Result<Plain> {
    let path = file.path();
    let len = file.len().saturating_sub(crypt.offset);
    let first = read_plain(file, crypt, 0, len.min(4096) as usize, io)?;
    let safetensors = match read_header_len(&first, len) {
        Ok(n) => {
            let header = if first.len() as u64 >= N_LEN as u64 + n {
                first.clone()
            } else {
                read_plain(file, crypt, 0, N_LEN + n as usize, io)?
            };
            Header::parse(&header, len).map(|_| ())
        }
        Err(e) => Err(e),
    };
    let source = match safetensors {
        Ok(()) => return Ok(Plain::Safetensors),
        Err(e) => e,
    };
    if first.starts_with(TORCH_LEGACY_MAGIC) {
        return Ok(Plain::Torch);
    }
    if first.starts_with(b"PK\x03\x04") {
        // A zip archive opens from its end-of-central-directory record, within the last
        // 64 KiB + 22 bytes.
        let tail_len = len.min(65_536 + 22);
        let tail = read_plain(file, crypt, len - tail_len, tail_len as usize, io)?;
        if tail.windows(4).any(|w| w == b"PK\x05\x06") {
            return Ok(Plain::Torch);
        }
    }
    Err(Error::Decrypted { path: path.to_owned(), source, key_source: crypt.source.clone() })
}

/// The hint for a safetensors file read without a key whose header does not parse: whether it
/// looks encrypted (veTurboIO's cipher header, or a length that decrypts to a plausible header
/// with `VETURBOIO_KEY` / `VETURBOIO_IV`), and how to pass a key.
pub(crate) fn unkeyed_error(file: &dyn StorageFile, source: FormatError) -> Error {
    let path = file.path().to_owned();
    let mut prefix = vec![0u8; file.len().min(4096) as usize];
    if file.read_exact_at(0, &mut prefix).is_err() {
        return Error::format(&path, source);
    }
    let prefix = &prefix[..];
    let how = "pass --cipher or --key-env (Python: use_cipher=True) with a key from KMS, the datapipe or \
               VETURBOIO_KEY / VETURBOIO_IV";
    if prefix.starts_with(MAGIC) {
        let hint = format!("it starts with veTurboIO's cipher header: the file is encrypted; {how}");
        return Error::Format { path, source, hint: Some(hint.into()) };
    }
    let at_length = matches!(
        source,
        FormatError::HeaderTooLarge { .. }
            | FormatError::InvalidHeaderLength { .. }
            | FormatError::InvalidHeader(_)
            | FormatError::InvalidHeaderDeserialization(_)
    );
    if !at_length || looks_like_safetensors(prefix, file.len()) {
        return Error::format(&path, source);
    }
    let decrypts = Keys::env_only().ok().is_some_and(|keys| match keys {
        Keys::Fixed { key, iv } => {
            let mut p = prefix.to_vec();
            CtrCipher::new(&key, &iv).apply_at(0, &mut p);
            looks_like_safetensors(&p, file.len())
        }
        Keys::Chain(_) => false,
    });
    let hint = if decrypts {
        format!("it decrypts to a safetensors header with VETURBOIO_KEY / VETURBOIO_IV: the file is encrypted; {how}")
    } else {
        format!("if the file is encrypted (veTurboIO's AES-CTR formats), {how}")
    };
    Error::Format { path, source, hint: Some(hint.into()) }
}

/// A plausible safetensors start: a header length that fits the file, then `{` after optional
/// whitespace.
pub fn looks_like_safetensors(prefix: &[u8], file_len: u64) -> bool {
    let Ok(n) = read_header_len(prefix, file_len) else { return false };
    let json = prefix.get(N_LEN..).unwrap_or(&[]);
    json.iter().take(n as usize).find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

/// Gets the key of a file about to be written, and the plain prefix (the cipher header) to
/// write before the ciphertext.
pub(crate) fn for_write(
    path: &Path,
    enc: &Encryption,
    cancel: Option<&Arc<AtomicBool>>,
) -> Result<(CtrCipher, Vec<u8>)> {
    match (&enc.keys, enc.header) {
        (Keys::Fixed { key, iv }, false) => Ok((CtrCipher::new(key, iv), Vec::new())),
        (Keys::Fixed { .. }, true) => Err(key_error(
            path,
            "a cipher header stores a KMS-wrapped key: it needs the KMS key chain, not a fixed key",
        )),
        (Keys::Chain(r), false) => {
            let m = cancellable(r, cancel).key_for_write(&key_path(path)).map_err(|e| key_lookup_error(path, e))?;
            Ok((CtrCipher::new(&m.key, &m.iv), Vec::new()))
        }
        (Keys::Chain(r), true) => {
            let (m, header) = cancellable(r, cancel).new_header_key().map_err(|e| key_lookup_error(path, e))?;
            let bytes = header.to_bytes().map_err(|e| key_error(path, e))?;
            Ok((CtrCipher::new(&m.key, &m.iv), bytes))
        }
    }
}

/// The bytes of an encrypted file: the plain prefix, then `inner` encrypted chunk by chunk.
pub(crate) struct EncryptingSource<'a> {
    pub prefix: Vec<u8>,
    pub inner: &'a dyn WriteSource,
    pub cipher: CtrCipher,
}

impl WriteSource for EncryptingSource<'_> {
    fn len(&self) -> u64 {
        self.prefix.len() as u64 + self.inner.len()
    }

    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), String> {
        let p = self.prefix.len() as u64;
        let mut out = dst;
        let mut pos = offset;
        if pos < p {
            let n = ((p - pos) as usize).min(out.len());
            out[..n].copy_from_slice(&self.prefix[pos as usize..pos as usize + n]);
            out = &mut out[n..];
            pos += n as u64;
        }
        if !out.is_empty() {
            self.inner.fill(pos - p, out)?;
            self.cipher.apply_at(pos - p, out);
        }
        Ok(())
    }
}

/// The path key sources see for `path`: the path on its file system (`sfcs://a/b` is `/a/b`,
/// as veTurboIO sends it in `X-TOS-Path`).
pub(crate) fn key_path(path: &Path) -> PathBuf {
    match path.to_str().and_then(|s| s.strip_prefix("sfcs:/")) {
        Some(rest) if rest.len() > 1 => PathBuf::from(format!("/{}", rest.trim_start_matches('/'))),
        _ => path.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_paths_are_the_path_on_the_file_system() {
        assert_eq!(key_path(Path::new("sfcs://a/b.safetensors")), PathBuf::from("/a/b.safetensors"));
        assert_eq!(key_path(Path::new("/local/x")), PathBuf::from("/local/x"));
    }
}
