//! The zip container torch writes (torch >= 1.6): one top-level directory holding `data.pkl`,
//! `byteorder`, `data/<key>` per storage and a few small records, every entry STORED.
//!
//! The `zip` crate parses the central directory and the local headers (it gives each entry's
//! absolute data offset, `ZipFile::data_start`); this module adds what torch's layout promises
//! and a reader that maps or `pread`s storages relies on: every entry stored uncompressed and
//! unencrypted, inside the file, no two entries overlapping, one top-level directory.

use crate::{PtError, ReadAt};
use std::collections::HashMap;
use std::io::{self, Read, Seek, SeekFrom};

/// One record's bytes in the file.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Record {
    /// Absolute offset of the first data byte.
    pub offset: u64,
    /// Bytes of data.
    pub len: u64,
}

/// The records of one archive, by name relative to its top-level directory.
#[derive(Debug)]
pub(crate) struct Archive {
    /// The top-level directory (`archive`, or the file stem torch used).
    pub prefix: String,
    pub records: HashMap<String, Record>,
}

/// Read + Seek over a `ReadAt`, for the zip crate.
struct Cursor<'a, R: ReadAt + ?Sized> {
    src: &'a R,
    pos: u64,
}

impl<R: ReadAt + ?Sized> Read for Cursor<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.src.len().saturating_sub(self.pos);
        let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
        if n == 0 {
            return Ok(0);
        }
        self.src.read_exact_at(self.pos, &mut buf[..n])?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl<R: ReadAt + ?Sized> Seek for Cursor<'_, R> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let target = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.src.len().checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        match target {
            Some(p) => {
                self.pos = p;
                Ok(p)
            }
            None => Err(io::Error::new(io::ErrorKind::InvalidInput, "seek before the start of the file")),
        }
    }
}

/// The magic number the legacy (pre-1.6) format pickles first: 0x1950a86a20f9469cfc6c as LONG1.
const LEGACY_MAGIC: [u8; 12] = [0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];

/// Says whether the file is the legacy format (or the even older tar layout).
fn is_legacy(head: &[u8]) -> bool {
    let pickled = head.len() >= 2 + LEGACY_MAGIC.len() && head[0] == 0x80 && head[2..14] == LEGACY_MAGIC;
    let tar = head.get(257..262) == Some(b"ustar".as_slice());
    pickled || tar
}

fn le16(b: &[u8], at: usize) -> u64 {
    u64::from(u16::from_le_bytes([b[at], b[at + 1]]))
}

fn le32(b: &[u8], at: usize) -> u64 {
    u64::from(u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]))
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// What torch's writer guarantees about the central directory, checked from the file's own
/// bytes before the `zip` crate sees it (hand-written because the crate cannot say either):
///
/// - the end-of-central-directory record is the file's last 22 bytes (torch writes no
///   comment). The crate would otherwise search backwards for one and, when a directory does
///   not parse, retry from every earlier candidate: quadratic in the file's size.
/// - no two entries have the same name. The crate keeps entries by name, so a later entry
///   would silently replace an earlier one (torch and zip scanners use the first): a file could
///   look harmless to them and load other weights here.
///
/// The work is linear in the directory's size, which is bounded by the file's.
fn check_directory<R: ReadAt + ?Sized>(src: &R, file_len: u64) -> Result<(), PtError> {
    let bad = |why: String| PtError::Archive(why);
    if file_len < 22 {
        return Err(PtError::NotZip(format!("only {file_len} bytes: no end-of-central-directory record")));
    }
    let mut eocd = [0u8; 22];
    src.read_exact_at(file_len - 22, &mut eocd)?;
    if eocd[..4] != *b"PK\x05\x06" || le16(&eocd, 20) != 0 {
        return Err(bad(
            "the end-of-central-directory record is not the last 22 bytes of the file (torch writes it last, \
             without a comment): bytes were added after it, or it is not torch's zip"
                .into(),
        ));
    }
    let (mut entries, mut cd_size, mut cd_offset) = (le16(&eocd, 10), le32(&eocd, 12), le32(&eocd, 16));
    if entries == 0xFFFF || cd_size == 0xFFFF_FFFF || cd_offset == 0xFFFF_FFFF {
        // Zip64: the locator right before the record points at the zip64 record.
        let mut loc = [0u8; 20];
        if file_len < 42 {
            return Err(bad("a zip64 directory without its locator".into()));
        }
        src.read_exact_at(file_len - 42, &mut loc)?;
        if loc[..4] != *b"PK\x06\x07" {
            return Err(bad("a zip64 directory without its locator".into()));
        }
        let at = le64(&loc, 8);
        let mut z = [0u8; 56];
        if at.checked_add(56).is_none_or(|end| end > file_len - 42) {
            return Err(bad(format!("the zip64 end-of-central-directory record (offset {at}) is outside the file")));
        }
        src.read_exact_at(at, &mut z)?;
        if z[..4] != *b"PK\x06\x06" {
            return Err(bad(format!("no zip64 end-of-central-directory record at offset {at}")));
        }
        (entries, cd_size, cd_offset) = (le64(&z, 32), le64(&z, 40), le64(&z, 48));
    }
    let end = cd_offset.checked_add(cd_size).filter(|&e| e <= file_len - 22);
    let (Some(_), Ok(size)) = (end, usize::try_from(cd_size)) else {
        return Err(bad(format!(
            "the central directory ({cd_size} bytes at offset {cd_offset}) is outside the {file_len}-byte file"
        )));
    };
    let mut cd = Vec::new();
    cd.try_reserve_exact(size).map_err(|_| bad(format!("cannot allocate a {size}-byte central directory")))?;
    cd.resize(size, 0);
    src.read_exact_at(cd_offset, &mut cd)?;
    let mut names: std::collections::HashSet<&[u8]> = std::collections::HashSet::new();
    let mut at = 0usize;
    for i in 0..entries {
        if cd.len().saturating_sub(at) < 46 || cd[at..at + 4] != *b"PK\x01\x02" {
            return Err(bad(format!("central directory entry {i} of {entries} is missing or malformed")));
        }
        let (name_len, extra, comment) =
            (le16(&cd, at + 28) as usize, le16(&cd, at + 30) as usize, le16(&cd, at + 32) as usize);
        let name_end = at + 46 + name_len;
        let next = name_end + extra + comment;
        if next > cd.len() {
            return Err(bad(format!("central directory entry {i} runs past the directory")));
        }
        let name = &cd[at + 46..name_end];
        if !names.insert(name) {
            return Err(bad(format!(
                "two entries are named `{}`: torch and zip tools read the first, a map of names the last, so the \
                 file is refused",
                String::from_utf8_lossy(name)
            )));
        }
        at = next;
    }
    Ok(())
}

pub(crate) fn open<R: ReadAt + ?Sized>(src: &R) -> Result<Archive, PtError> {
    let file_len = src.len();
    let mut head = vec![0u8; usize::try_from(file_len.min(512)).unwrap_or(512)];
    src.read_exact_at(0, &mut head)?;
    if is_legacy(&head) {
        return Err(PtError::Legacy);
    }
    if !head.starts_with(b"PK\x03\x04") {
        let what = if head.first() == Some(&0x80) {
            "a bare pickle stream (a pickle file, not torch.save's zip)".to_owned()
        } else if file_len < 4 {
            format!("only {file_len} bytes")
        } else {
            "it does not start with a zip local file header".to_owned()
        };
        return Err(PtError::NotZip(what));
    }
    check_directory(src, file_len)?;
    let mut zip = zip::ZipArchive::new(Cursor { src, pos: 0 }).map_err(|e| PtError::NotZip(e.to_string()))?;

    struct Entry {
        name: String,
        header_start: u64,
        data_start: u64,
        len: u64,
    }
    let mut entries = Vec::with_capacity(zip.len());
    for i in 0..zip.len() {
        let f = zip.by_index_raw(i).map_err(|e| PtError::Archive(format!("entry {i}: {e}")))?;
        let name = String::from_utf8_lossy(f.name_raw()).into_owned();
        if f.encrypted() {
            return Err(PtError::Archive(format!("entry `{name}` is encrypted")));
        }
        if f.compression() != zip::CompressionMethod::Stored {
            return Err(PtError::Archive(format!(
                "entry `{name}` is compressed ({}); torch writes every record stored",
                f.compression()
            )));
        }
        if f.compressed_size() != f.size() {
            return Err(PtError::Archive(format!(
                "entry `{name}` is stored but its sizes differ ({} compressed, {} uncompressed)",
                f.compressed_size(),
                f.size()
            )));
        }
        let (data_start, len) = (f.data_start(), f.size());
        match data_start.checked_add(len) {
            Some(end) if end <= file_len => {}
            _ => {
                return Err(PtError::Archive(format!(
                    "entry `{name}` ({len} bytes at offset {data_start}) extends past the end of the file ({file_len} bytes)"
                )))
            }
        }
        entries.push(Entry { name, header_start: f.header_start(), data_start, len });
    }

    // No two entries (local header + data) may overlap: a storage read must never see another
    // record's bytes.
    let mut spans: Vec<(u64, u64, usize)> =
        entries.iter().enumerate().map(|(i, e)| (e.header_start, e.data_start + e.len, i)).collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(PtError::Archive(format!(
                "entries `{}` and `{}` overlap (bytes {}..{} and {}..{})",
                entries[w[0].2].name, entries[w[1].2].name, w[0].0, w[0].1, w[1].0, w[1].1
            )));
        }
    }

    // One top-level directory holding data.pkl.
    let Some(pkl) = entries.iter().find(|e| e.name == "data.pkl" || e.name.ends_with("/data.pkl")) else {
        if let Some(e) = entries.iter().find(|e| e.name.ends_with("constants.pkl") || e.name.contains("/code/")) {
            return Err(PtError::TorchScript(format!("`{}`", e.name)));
        }
        return Err(PtError::Archive("no data.pkl record".into()));
    };
    let prefix = match pkl.name.strip_suffix("data.pkl") {
        Some(p) => p.to_owned(), // "" or "dir/"
        None => String::new(),
    };
    if prefix.matches('/').count() > 1 {
        return Err(PtError::Archive(format!("data.pkl is nested too deep (`{}`)", pkl.name)));
    }
    let mut records = HashMap::with_capacity(entries.len());
    for e in &entries {
        let Some(rel) = e.name.strip_prefix(prefix.as_str()) else {
            return Err(PtError::Archive(format!(
                "entry `{}` is outside the archive's top-level directory `{}`",
                e.name,
                prefix.trim_end_matches('/')
            )));
        };
        if records.insert(rel.to_owned(), Record { offset: e.data_start, len: e.len }).is_some() {
            return Err(PtError::Archive(format!("entry `{}` appears twice", e.name)));
        }
    }
    if records.contains_key("constants.pkl") {
        return Err(PtError::TorchScript(format!("`{prefix}constants.pkl`")));
    }
    Ok(Archive { prefix: prefix.trim_end_matches('/').to_owned(), records })
}

impl Archive {
    /// Reads a whole record, at most `max` bytes (else `None`).
    pub(crate) fn read<R: ReadAt + ?Sized>(
        &self,
        src: &R,
        name: &str,
        max: u64,
        field: &'static str,
    ) -> Result<Option<Vec<u8>>, PtError> {
        let Some(r) = self.records.get(name) else { return Ok(None) };
        if r.len > max {
            return Err(PtError::Limit { what: format!("record `{name}` of {} bytes", r.len), limit: max, field });
        }
        let mut buf = vec![0u8; usize::try_from(r.len).map_err(|_| PtError::Archive(format!("`{name}` too large")))?];
        src.read_exact_at(r.offset, &mut buf)?;
        Ok(Some(buf))
    }
}
