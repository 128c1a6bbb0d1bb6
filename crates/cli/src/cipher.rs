//! `--cipher`, `--key-env`, `--cipher-header` and the `encrypt` / `decrypt` commands.

use crate::out::{outln, Shown};
use std::path::Path;
use turboio::crypt::{Encryption, Keys};

/// Key options of the commands that read encrypted checkpoints (`load`, `inspect`, `decrypt`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ReadCipherArgs {
    /// The file is encrypted (AES-CTR, veTurboIO's formats).
    ///
    /// The file is encrypted with AES-CTR, veTurboIO's formats (detected: with or without the
    /// 256 KiB cipher header). Keys come from veTurboIO's chain: a cipher header's KMS-wrapped
    /// key (VETURBOIO_KMS_*), the datapipe socket (DATAPIPE_SOCKET_PATH), then VETURBOIO_KEY /
    /// VETURBOIO_IV.
    #[arg(long)]
    pub cipher: bool,
    /// Like --cipher, with the key and IV taken only from VETURBOIO_KEY / VETURBOIO_IV (base64).
    #[arg(long)]
    pub key_env: bool,
}

impl ReadCipherArgs {
    /// The decryption asked for, if any.
    pub fn encryption(&self) -> Result<Option<Encryption>, String> {
        CipherArgs { cipher: self.cipher, key_env: self.key_env, cipher_header: false }.encryption()
    }
}

/// Key options of the commands that write encrypted checkpoints (`gen`, `encrypt`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CipherArgs {
    /// Encrypt what is written: AES-CTR, veTurboIO's format.
    ///
    /// The key and IV come from veTurboIO's chain (the datapipe socket DATAPIPE_SOCKET_PATH,
    /// then VETURBOIO_KEY / VETURBOIO_IV); with --cipher-header, a fresh key is made and stored
    /// in the file's header, wrapped by KMS. Read it back with the same key options.
    #[arg(long)]
    pub cipher: bool,
    /// Like --cipher, with the key and IV taken only from VETURBOIO_KEY / VETURBOIO_IV (base64).
    #[arg(long)]
    pub key_env: bool,
    /// Write veTurboIO's 256 KiB cipher header, holding a fresh key wrapped by KMS Encrypt
    /// (needs VETURBOIO_KMS_*); implies --cipher.
    #[arg(long)]
    pub cipher_header: bool,
}

impl CipherArgs {
    /// The encryption asked for, if any.
    pub fn encryption(&self) -> Result<Option<Encryption>, String> {
        if !(self.cipher || self.key_env || self.cipher_header) {
            return Ok(None);
        }
        let keys = if self.key_env { Keys::env_only()? } else { Keys::from_env() };
        Ok(Some(Encryption { keys, header: self.cipher_header, check_content: true }))
    }
}

/// `turboio encrypt IN OUT`: any file (safetensors or .pt) to veTurboIO's encrypted format.
pub fn encrypt(input: &Path, output: &Path, args: &CipherArgs) -> Result<(), Box<dyn std::error::Error>> {
    let mut args = args.clone();
    args.cipher = true;
    let enc = args.encryption()?.ok_or("no encryption")?;
    turboio::crypt::encrypt_file(input, output, &enc, &turboio::SaveOptions::default())?;
    outln!(
        "encrypted {} -> {}{}",
        input.shown(),
        output.shown(),
        if enc.header { " (with cipher header)" } else { "" }
    );
    Ok(())
}

/// `turboio decrypt IN OUT`: back to the plain file (the header layout is detected).
pub fn decrypt(input: &Path, output: &Path, args: &ReadCipherArgs) -> Result<(), Box<dyn std::error::Error>> {
    let enc = ReadCipherArgs { cipher: true, ..args.clone() }.encryption()?.ok_or("no encryption")?;
    turboio::crypt::decrypt_file(input, output, &enc, &turboio::SaveOptions::default())?;
    outln!("decrypted {} -> {}", input.shown(), output.shown());
    Ok(())
}
