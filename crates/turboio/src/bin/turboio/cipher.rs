//! `--cipher`, `--key-env`, `--cipher-header` and the `encrypt` / `decrypt` commands.

use std::path::Path;
use turboio::crypt::{Encryption, Keys};

/// Encryption options shared by the commands that read or write checkpoints.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CipherArgs {
    /// The file is (or is to be) encrypted with AES-CTR, veTurboIO's formats. Keys come from
    /// veTurboIO's chain: a cipher header's KMS-wrapped key (VETURBOIO_KMS_*), the datapipe
    /// socket (DATAPIPE_SOCKET_PATH), then VETURBOIO_KEY / VETURBOIO_IV.
    #[arg(long)]
    pub cipher: bool,
    /// Like --cipher, with the key and IV taken only from VETURBOIO_KEY / VETURBOIO_IV (base64).
    #[arg(long)]
    pub key_env: bool,
    /// When writing: add veTurboIO's 256 KiB header holding a fresh key wrapped by KMS Encrypt
    /// (needs VETURBOIO_KMS_*). Reads detect the header by themselves.
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
        Ok(Some(Encryption { keys, header: self.cipher_header }))
    }
}

/// `turboio encrypt IN OUT`: any file (safetensors or .pt) to veTurboIO's encrypted format.
pub fn encrypt(input: &Path, output: &Path, args: &CipherArgs) -> Result<(), Box<dyn std::error::Error>> {
    let enc = CipherArgs { cipher: true, ..args.clone() }.encryption()?.ok_or("no encryption")?;
    turboio::crypt::encrypt_file(input, output, &enc, &turboio::SaveOptions::default())?;
    println!(
        "encrypted {} -> {}{}",
        input.display(),
        output.display(),
        if enc.header { " (with cipher header)" } else { "" }
    );
    Ok(())
}

/// `turboio decrypt IN OUT`: back to the plain file (the header layout is detected).
pub fn decrypt(input: &Path, output: &Path, args: &CipherArgs) -> Result<(), Box<dyn std::error::Error>> {
    let enc = CipherArgs { cipher: true, cipher_header: false, ..args.clone() }.encryption()?.ok_or("no encryption")?;
    turboio::crypt::decrypt_file(input, output, &enc, &turboio::SaveOptions::default())?;
    println!("decrypted {} -> {}", input.display(), output.display());
    Ok(())
}
