//! Encrypted checkpoints (feature `cipher`): veTurboIO's AES-CTR files, in the load and save
//! paths.
//!
//! Loads detect the layout (the 256 KiB `Byte3ncryptM0del` header, or none), get the key from
//! [`Keys`], and decrypt each chunk on the reader thread right after it is read. Saves encrypt
//! each chunk as the writers produce it, so no second full-size buffer exists. Encrypted files
//! are always copied (a mapping would expose ciphertext). [`encrypt_file`] and
//! [`decrypt_file`] convert whole files.

use crate::backend::Opened;
use crate::encryption::for_read;
use crate::options::SaveOptions;
use crate::save::write_source;
use crate::Result;
use std::path::Path;
use turboio_storage::WriteSource;

pub use crate::encryption::{looks_like_safetensors, Encryption, Iv, Key, KeyResolver, Keys};

/// The bytes of an open file (plain or decrypted), as a write source.
struct OpenedSource<'a>(&'a Opened);

impl WriteSource for OpenedSource<'_> {
    fn len(&self) -> u64 {
        self.0.len()
    }

    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), String> {
        self.0.read_exact_at(offset, dst).map_err(|e| e.to_string())
    }
}

/// Encrypts any file (a safetensors file, a torch pickle) into `output`, atomically: chunk by
/// chunk as the writers go, never holding the whole file.
pub fn encrypt_file(input: &Path, output: &Path, enc: &Encryption, opts: &SaveOptions) -> Result<()> {
    let plain = Opened::open(opts.storage.as_ref(), input, opts.cancel.as_deref(), false)?;
    let opts = SaveOptions { encryption: Some(enc.clone()), ..opts.clone() };
    write_source(output, &OpenedSource(&plain), &opts)
}

/// Decrypts a file written in either of veTurboIO's layouts into `output`, atomically.
pub fn decrypt_file(input: &Path, output: &Path, enc: &Encryption, opts: &SaveOptions) -> Result<()> {
    let mut opened = Opened::open(opts.storage.as_ref(), input, opts.cancel.as_deref(), false)?;
    opened.crypt = Some(for_read(opened.raw(), enc, opts.cancel.as_ref(), false)?);
    let opts = SaveOptions { encryption: None, ..opts.clone() };
    write_source(output, &OpenedSource(&opened), &opts)
}
