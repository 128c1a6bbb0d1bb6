//! AES-CTR with a 128-bit big-endian counter and random access.

use std::fmt;

use aes::cipher::{
    typenum::U16, BlockCipher, BlockEncrypt, BlockSizeUser, InnerIvInit, KeyInit, StreamCipher,
    StreamCipherCoreWrapper, StreamCipherSeek,
};

use crate::{Iv, Key, Mode};

/// Below this many bytes per thread, [`CtrCipher::apply_at_parallel`] does not start a thread:
/// spawning one costs about as much as encrypting this much.
const MIN_BYTES_PER_THREAD: usize = 256 * 1024;

// Inline rather than boxed: no pointer chase, and the per-call copy (under 1 KiB) is nothing
// next to a chunk.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
enum Schedule {
    Aes128(aes::Aes128Enc),
    Aes256(aes::Aes256Enc),
}

/// AES-CTR (128-bit big-endian counter starting at the IV) with random access.
///
/// Keystream byte `p` is `AES_K(IV + floor(p / 16))[p mod 16]`, where `IV + n` adds `n` to the
/// IV read as one 128-bit big-endian integer (the carry runs through all 16 bytes, wrapping mod
/// 2^128). This is OpenSSL's `EVP_aes_*_ctr` and veTurboIO's `CtrEncrypter`/`CtrDecrypter`.
/// Encryption and decryption are the same operation: XOR with the keystream.
///
/// The cipher holds only the expanded encryption key schedule (zeroized on drop by the `aes`
/// crate's `zeroize` feature) and the IV; it is immutable, so one value can be shared by every
/// reader thread (`Send + Sync`) and each [`apply_at`](CtrCipher::apply_at) call is
/// independent. `Debug` shows the mode and IV, never the key.
#[derive(Clone)]
pub struct CtrCipher {
    schedule: Schedule,
    iv: Iv,
}

impl CtrCipher {
    /// A cipher for `key` (16 bytes: AES-128, 32 bytes: AES-256) and `iv`.
    pub fn new(key: &Key, iv: &Iv) -> CtrCipher {
        let schedule = match key.mode() {
            Mode::Ctr128 => Schedule::Aes128(aes::Aes128Enc::new_from_slice(key.expose()).expect("Key has 16 bytes")),
            Mode::Ctr256 => Schedule::Aes256(aes::Aes256Enc::new_from_slice(key.expose()).expect("Key has 32 bytes")),
        };
        CtrCipher { schedule, iv: *iv }
    }

    /// [`Mode::Ctr128`] or [`Mode::Ctr256`], from the key's length.
    pub fn mode(&self) -> Mode {
        match self.schedule {
            Schedule::Aes128(_) => Mode::Ctr128,
            Schedule::Aes256(_) => Mode::Ctr256,
        }
    }

    /// The initial counter block.
    pub fn iv(&self) -> &Iv {
        &self.iv
    }

    /// XORs the keystream starting at byte position `pos` into `buf` (encrypts or decrypts
    /// `buf` as the bytes at positions `pos .. pos + buf.len()` of the stream).
    ///
    /// `pos` need not be a multiple of 16: the first block's leading `pos % 16` keystream bytes
    /// are discarded. Positions past 2^64 (a `pos` near `u64::MAX` with a long `buf`) continue
    /// the same keystream. No heap allocation; the key schedule is copied onto the stack.
    pub fn apply_at(&self, pos: u64, buf: &mut [u8]) {
        self.apply_wide(u128::from(pos), buf);
    }

    /// Like [`apply_at`](CtrCipher::apply_at), splitting `buf` over up to `threads` threads
    /// (the calling thread works too). Parts start at 16-byte keystream boundaries and are at
    /// least 256 KiB, so small buffers stay on the calling thread. If a thread cannot be
    /// started, the others (and the calling thread) do its share. The result equals
    /// `apply_at`'s.
    pub fn apply_at_parallel(&self, pos: u64, buf: &mut [u8], threads: usize) {
        let parts = threads.min(buf.len() / MIN_BYTES_PER_THREAD).max(1);
        if parts == 1 {
            self.apply_at(pos, buf);
            return;
        }
        // Offset `o` of buf is a keystream block boundary when (pos + o) % 16 == 0.
        let head = ((16 - pos % 16) % 16) as usize;
        let per = ((buf.len() - head) / 16).div_ceil(parts) * 16;
        let mut work = Vec::with_capacity(parts + 1);
        let (first, mut rest) = buf.split_at_mut(head + per);
        work.push((u128::from(pos), first));
        let mut at = u128::from(pos) + (head + per) as u128;
        while !rest.is_empty() {
            let len = per.min(rest.len());
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(len);
            work.push((at, part));
            at += len as u128;
            rest = tail;
        }
        let queue = std::sync::Mutex::new(work.into_iter());
        let drain = || loop {
            let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
            match next {
                Some((at, part)) => self.apply_wide(at, part),
                None => break,
            }
        };
        std::thread::scope(|scope| {
            for _ in 1..parts {
                // A thread that cannot start leaves its share to the others.
                let _ = std::thread::Builder::new().name("turboio-ctr".into()).spawn_scoped(scope, drain);
            }
            drain();
        });
    }

    /// `apply_at` with a 128-bit position (parts of a buffer that runs past 2^64).
    fn apply_wide(&self, pos: u128, buf: &mut [u8]) {
        if buf.is_empty() {
            return;
        }
        match &self.schedule {
            Schedule::Aes128(c) => apply::<aes::Aes128Enc>(c, &self.iv, pos, buf),
            Schedule::Aes256(c) => apply::<aes::Aes256Enc>(c, &self.iv, pos, buf),
        }
    }
}

/// The core: a `ctr` 0.9 stream over a stack copy of the key schedule, seeked to `pos`.
fn apply<C>(schedule: &C, iv: &Iv, pos: u128, buf: &mut [u8])
where
    C: BlockCipher + BlockEncrypt + BlockSizeUser<BlockSize = U16> + Clone,
{
    let core = ctr::CtrCore::<C, ctr::flavors::Ctr128BE>::inner_iv_init(schedule.clone(), (&iv.0).into());
    let mut stream = StreamCipherCoreWrapper::from_core(core);
    // Neither call can panic: positions here are below 2^65, so the block index is below 2^61,
    // and the 128-bit counter has 2^128 blocks of room.
    stream.seek(pos);
    stream.apply_keystream(buf);
}

impl fmt::Debug for CtrCipher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CtrCipher")
            .field("mode", &self.mode())
            .field("key", &format_args!("<redacted>"))
            .field("iv", &self.iv)
            .finish()
    }
}
