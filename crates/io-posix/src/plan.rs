//! Cutting reads into chunks and chunks into the I/Os that fill them (pure arithmetic, no I/O).
//!
//! `O_DIRECT` wants the file offset, the length and the buffer address of every read aligned to
//! the file system's logical block size. We use [`ALIGN`] (4096), a multiple of every common
//! logical block size. A chunk becomes a list of [`Piece`]s:
//!
//! - when its destination address and file offset are congruent modulo [`ALIGN`], the aligned
//!   middle is read straight into the destination ([`Piece::Direct`]) and the unaligned head and
//!   tail (less than one block each) go through a small bounce buffer ([`Piece::Bounce`]);
//! - otherwise the whole chunk goes through bounce buffers, `block` bytes at a time.
//!
//! A bounce piece reads whole aligned blocks, so near the end of the file it may ask for bytes
//! past EOF; the kernel then returns a short read, which is fine as long as it covers the bytes
//! the chunk needs. A direct piece never extends past the chunk, so it never reads past EOF
//! and never writes beyond the destination.

use turboio_storage::{Chunk, ReadRequest};

/// Alignment of `O_DIRECT` offsets, lengths and buffer addresses.
pub(crate) const ALIGN: u64 = 4096;

/// Rounds down to a multiple of [`ALIGN`].
pub(crate) fn align_down(x: u64) -> u64 {
    x & !(ALIGN - 1)
}

/// Rounds up to a multiple of [`ALIGN`] (inputs are file offsets, far below `u64::MAX`).
pub(crate) fn align_up(x: u64) -> u64 {
    align_down(x.saturating_add(ALIGN - 1))
}

/// Rounds a byte count to a usable multiple of [`ALIGN`] between `ALIGN` and `max`.
pub(crate) fn aligned_size(x: usize, max: usize) -> usize {
    let a = ALIGN as usize;
    x.clamp(a, max.max(a)).next_multiple_of(a)
}

/// One read that fills part of a chunk. Offsets in the chunk are `dst_off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece {
    /// Read `len` bytes at file `offset` straight into the chunk at `dst_off`.
    Direct {
        /// File offset.
        offset: u64,
        /// Where in the chunk.
        dst_off: usize,
        /// Bytes.
        len: usize,
    },
    /// Read `len` bytes at the aligned file `offset` into a bounce buffer, then copy
    /// `copy_len` bytes starting `skip` bytes into it to the chunk at `dst_off`.
    Bounce {
        /// Aligned file offset.
        offset: u64,
        /// Aligned length (at most the bounce buffer).
        len: usize,
        /// Bytes of the bounce buffer before the wanted ones.
        skip: usize,
        /// Where in the chunk.
        dst_off: usize,
        /// Bytes wanted.
        copy_len: usize,
    },
}

impl Piece {
    /// The part of the chunk this piece fills: `(dst_off, len, file_offset)`.
    pub(crate) fn target(&self) -> (usize, usize, u64) {
        match *self {
            Piece::Direct { offset, dst_off, len } => (dst_off, len, offset),
            Piece::Bounce { offset, skip, dst_off, copy_len, .. } => (dst_off, copy_len, offset + skip as u64),
        }
    }
}

/// Pieces of a buffered read: `block`-sized reads straight into the destination, any alignment.
pub(crate) fn plan_buffered(offset: u64, len: usize, block: usize) -> Vec<Piece> {
    let block = block.max(1);
    (0..len)
        .step_by(block)
        .map(|dst_off| Piece::Direct { offset: offset + dst_off as u64, dst_off, len: block.min(len - dst_off) })
        .collect()
}

/// Pieces of an `O_DIRECT` read of `len` bytes at file `offset` into memory at `dst_addr`.
/// `block` must be a multiple of [`ALIGN`].
pub(crate) fn plan_direct(offset: u64, dst_addr: usize, len: usize, block: usize) -> Vec<Piece> {
    debug_assert!(block >= ALIGN as usize && block.is_multiple_of(ALIGN as usize));
    let mut out = Vec::new();
    if len == 0 {
        return out;
    }
    let end = offset + len as u64;
    let congruent = dst_addr as u64 % ALIGN == offset % ALIGN;
    let mid_start = align_up(offset);
    let mid_end = align_down(end);
    if congruent && mid_start < mid_end {
        if offset < mid_start {
            out.push(Piece::Bounce {
                offset: align_down(offset),
                len: ALIGN as usize,
                skip: (offset - align_down(offset)) as usize,
                dst_off: 0,
                copy_len: (mid_start - offset) as usize,
            });
        }
        let mut s = mid_start;
        while s < mid_end {
            let n = (block as u64).min(mid_end - s);
            out.push(Piece::Direct { offset: s, dst_off: (s - offset) as usize, len: n as usize });
            s += n;
        }
        if mid_end < end {
            out.push(Piece::Bounce {
                offset: mid_end,
                len: ALIGN as usize,
                skip: 0,
                dst_off: (mid_end - offset) as usize,
                copy_len: (end - mid_end) as usize,
            });
        }
    } else {
        // Everything through bounce buffers, whole aligned blocks at a time.
        let stop = align_up(end);
        let mut s = align_down(offset);
        while s < stop {
            let n = (block as u64).min(stop - s);
            let from = s.max(offset);
            let to = (s + n).min(end);
            out.push(Piece::Bounce {
                offset: s,
                len: n as usize,
                skip: (from - s) as usize,
                dst_off: (from - offset) as usize,
                copy_len: (to - from) as usize,
            });
            s += n;
        }
    }
    out
}

/// Cuts requests into chunks of about `chunk` bytes whose inner boundaries fall on aligned file
/// offsets, so that neighbouring chunks never read the same block twice. Empty requests vanish.
pub(crate) fn split_aligned(requests: Vec<ReadRequest<'_>>, chunk: usize) -> Vec<Chunk<'_>> {
    let chunk = aligned_size(chunk, usize::MAX / 2) as u64;
    let mut out = Vec::new();
    for r in requests {
        let mut offset = r.offset;
        let mut rest = r.dst;
        while !rest.is_empty() {
            let cut = align_down(offset) + chunk;
            let n = usize::try_from(cut - offset).unwrap_or(usize::MAX).min(rest.len());
            let (head, tail) = rest.split_at_mut(n);
            out.push(Chunk { offset, dst: head });
            offset += n as u64;
            rest = tail;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks the invariants of a plan: every destination byte exactly once, direct pieces and
    /// bounce reads aligned, nothing outside the chunk.
    fn check(offset: u64, addr: usize, len: usize, block: usize) {
        let pieces = plan_direct(offset, addr, len, block);
        let mut covered = vec![0u8; len];
        for p in &pieces {
            let (dst_off, n, file_off) = p.target();
            assert_eq!(file_off, offset + dst_off as u64, "{p:?}");
            assert!(dst_off + n <= len, "{p:?} outside the chunk");
            for c in &mut covered[dst_off..dst_off + n] {
                *c += 1;
            }
            match *p {
                Piece::Direct { offset: o, dst_off, len: n } => {
                    assert_eq!(o % ALIGN, 0);
                    assert_eq!(n as u64 % ALIGN, 0);
                    assert!(n <= block);
                    assert_eq!((addr + dst_off) as u64 % ALIGN, 0);
                }
                Piece::Bounce { offset: o, len: n, skip, copy_len, .. } => {
                    assert_eq!(o % ALIGN, 0);
                    assert_eq!(n as u64 % ALIGN, 0);
                    assert!(n <= block);
                    assert!(skip + copy_len <= n);
                    assert!(copy_len > 0);
                }
            }
        }
        assert!(covered.iter().all(|&c| c == 1), "offset {offset} addr {addr} len {len}: {pieces:?}");
    }

    #[test]
    fn plans_cover_every_byte_once_and_align() {
        let block = 3 * ALIGN as usize;
        for offset in [0u64, 1, 100, 4095, 4096, 4097, 8191, 12288 + 7] {
            for addr_mod in [0usize, 1, 100, 4095] {
                for len in [1usize, 2, 4095, 4096, 4097, 8192, 9000, 20000, 3 * 4096 + 1] {
                    check(offset, 1 << 20 | addr_mod, len, block);
                    // The congruent case.
                    check(offset, (1 << 20) + (offset % ALIGN) as usize, len, block);
                }
            }
        }
    }

    #[test]
    fn congruent_chunk_reads_the_middle_directly() {
        let p = plan_direct(100, 100, 3 * 4096, 1 << 20);
        assert_eq!(
            p,
            vec![
                Piece::Bounce { offset: 0, len: 4096, skip: 100, dst_off: 0, copy_len: 3996 },
                Piece::Direct { offset: 4096, dst_off: 3996, len: 8192 },
                Piece::Bounce { offset: 12288, len: 4096, skip: 0, dst_off: 12188, copy_len: 100 },
            ]
        );
        // Aligned on both ends: one direct read.
        assert_eq!(plan_direct(8192, 4096, 4096, 1 << 20), vec![Piece::Direct { offset: 8192, dst_off: 0, len: 4096 }]);
    }

    #[test]
    fn buffered_plan_splits_by_block() {
        assert_eq!(
            plan_buffered(5, 10, 4),
            vec![
                Piece::Direct { offset: 5, dst_off: 0, len: 4 },
                Piece::Direct { offset: 9, dst_off: 4, len: 4 },
                Piece::Direct { offset: 13, dst_off: 8, len: 2 },
            ]
        );
    }

    #[test]
    fn aligned_split_cuts_on_block_boundaries() {
        let mut a = vec![0u8; 20000];
        let mut empty: Vec<u8> = Vec::new();
        let reqs = vec![ReadRequest { offset: 100, dst: &mut a }, ReadRequest { offset: 3, dst: &mut empty }];
        let chunks = split_aligned(reqs, 8192);
        let spans: Vec<(u64, usize)> = chunks.iter().map(|c| (c.offset, c.dst.len())).collect();
        assert_eq!(spans, vec![(100, 8092), (8192, 8192), (16384, 3716)]);
    }
}
