//! Whole-file and streaming helpers for the two layouts.

use std::io::{self, Read, Write};

use crate::{CipherError, CipherHeader, CtrCipher, Layout};

/// Threads for whole-buffer helpers: one per core.
fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// An error unless `header` names `cipher`'s IV and mode.
fn check_header(cipher: &CtrCipher, header: &CipherHeader) -> Result<(), CipherError> {
    if header.iv != *cipher.iv() {
        return Err(CipherError::HeaderMismatch("the header's iv differs from the cipher's IV"));
    }
    if header.mode != cipher.mode() {
        return Err(CipherError::HeaderMismatch("the header's mode differs from the cipher's key length"));
    }
    Ok(())
}

/// Encrypts a whole plain file (safetensors or `.pt`) in memory.
///
/// With `header: None` the result is [`Layout::Headerless`]: the ciphertext of `plain`, byte
/// for byte. With a header it is [`Layout::WithHeader`]: `header.to_bytes()` followed by the
/// ciphertext; the header's IV and mode must be the cipher's. Uses every core.
pub fn encrypt_file_bytes(
    plain: &[u8],
    cipher: &CtrCipher,
    header: Option<&CipherHeader>,
) -> Result<Vec<u8>, CipherError> {
    let mut out = match header {
        Some(h) => {
            check_header(cipher, h)?;
            let mut out = h.to_bytes()?;
            out.reserve_exact(plain.len());
            out
        }
        None => Vec::with_capacity(plain.len()),
    };
    let start = out.len();
    out.extend_from_slice(plain);
    cipher.apply_at_parallel(0, &mut out[start..], default_threads());
    Ok(out)
}

/// Decrypts a whole encrypted file in memory: skips `layout`'s header (a
/// [`Layout::WithHeader`] file shorter than [`HEADER_SIZE`](crate::HEADER_SIZE) is an error) and decrypts the rest
/// from keystream position 0. Uses every core.
pub fn decrypt_file_bytes(file: &[u8], cipher: &CtrCipher, layout: Layout) -> Result<Vec<u8>, CipherError> {
    let skip = layout.header_size();
    if (file.len() as u64) < skip {
        return Err(CipherError::Truncated { len: file.len() as u64, need: skip });
    }
    let mut out = file[skip as usize..].to_vec();
    cipher.apply_at_parallel(0, &mut out, default_threads());
    Ok(out)
}

/// Encrypts in place: `buf` holds the bytes at keystream positions `pos ..`. The same as
/// [`CtrCipher::apply_at_parallel`] with one thread per core.
pub fn crypt_in_place(cipher: &CtrCipher, pos: u64, buf: &mut [u8]) {
    cipher.apply_at_parallel(pos, buf, default_threads());
}

/// `pos + n`, or an error past 2^64 (continuing would need positions a `u64` cannot name).
fn position_after(pos: u64, n: usize) -> io::Result<u64> {
    pos.checked_add(n as u64).ok_or_else(|| io::Error::other("keystream position past 2^64 bytes"))
}

/// Bytes of plaintext [`EncryptingWriter`] encrypts per inner `write`.
const WRITER_CHUNK: usize = 1 << 20;

/// A [`Write`] adapter that encrypts everything written through it.
///
/// It does not write a header: write [`CipherHeader::to_bytes`] to the inner writer first for
/// a [`Layout::WithHeader`] file. Bytes are encrypted at keystream positions from `start_pos`
/// (0 for a new file) in a 1 MiB scratch buffer allocated once, so a save streams in bounded
/// memory.
pub struct EncryptingWriter<W: Write> {
    inner: W,
    cipher: CtrCipher,
    pos: u64,
    scratch: Vec<u8>,
}

impl<W: Write> EncryptingWriter<W> {
    /// Encrypts bytes written from keystream position `start_pos` on into `inner`.
    pub fn new(inner: W, cipher: CtrCipher, start_pos: u64) -> Self {
        EncryptingWriter { inner, cipher, pos: start_pos, scratch: Vec::new() }
    }

    /// The keystream position of the next byte written.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// The inner writer (after a [`flush`](Write::flush) if buffered).
    pub fn into_inner(self) -> W {
        self.inner
    }
}

impl<W: Write> Write for EncryptingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(WRITER_CHUNK);
        let end = position_after(self.pos, n)?;
        if self.scratch.len() < n {
            self.scratch.resize(n.clamp(64 * 1024, WRITER_CHUNK), 0);
        }
        let chunk = &mut self.scratch[..n];
        chunk.copy_from_slice(&buf[..n]);
        self.cipher.apply_at(self.pos, chunk);
        // write_all: a short inner write would leave encrypted bytes we could not un-count.
        self.inner.write_all(chunk)?;
        self.pos = end;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<W: Write> std::fmt::Debug for EncryptingWriter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncryptingWriter").field("cipher", &self.cipher).field("pos", &self.pos).finish_non_exhaustive()
    }
}

/// A [`Read`] adapter that decrypts everything read through it, in place in the caller's
/// buffer (no copy, no allocation).
///
/// Positions count from `start_pos`: for a [`Layout::WithHeader`] file, skip the
/// [`HEADER_SIZE`](crate::HEADER_SIZE) header bytes of the inner reader first and start at 0.
pub struct DecryptingReader<R: Read> {
    inner: R,
    cipher: CtrCipher,
    pos: u64,
}

impl<R: Read> DecryptingReader<R> {
    /// Decrypts bytes read from `inner`, the first one at keystream position `start_pos`.
    pub fn new(inner: R, cipher: CtrCipher, start_pos: u64) -> Self {
        DecryptingReader { inner, cipher, pos: start_pos }
    }

    /// The keystream position of the next byte read.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// The inner reader.
    pub fn into_inner(self) -> R {
        self.inner
    }
}

impl<R: Read> Read for DecryptingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let end = position_after(self.pos, n)?;
        self.cipher.apply_at(self.pos, &mut buf[..n]);
        self.pos = end;
        Ok(n)
    }
}

impl<R: Read> std::fmt::Debug for DecryptingReader<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecryptingReader").field("cipher", &self.cipher).field("pos", &self.pos).finish_non_exhaustive()
    }
}
