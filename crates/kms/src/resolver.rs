//! The key-source chain, in veTurboIO's order.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use turboio_cipher::{b64_decode, CipherError, CipherHeader, Iv, Key, Mode};

use crate::config::{process_env, var, Secret};
use crate::datapipe::{DatapipeClient, DatapipeConfig};
use crate::kms::{KmsClient, KmsConfig};
use crate::{Attempt, KeyError, KeySource};

/// A data key, its IV, and where they came from. `Debug` redacts the key.
#[derive(Clone)]
pub struct KeyMaterial {
    /// The AES key (16 or 32 bytes).
    pub key: Key,
    /// The initial counter block.
    pub iv: Iv,
    /// Which source gave them.
    pub source: KeySource,
}

impl fmt::Debug for KeyMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyMaterial")
            .field("key", &format_args!("<redacted {} bits>", self.key.len() * 8))
            .field("iv", &self.iv)
            .field("source", &self.source)
            .finish()
    }
}

/// Finds the key for an encrypted file: header+KMS, then datapipe, then the environment.
///
/// [`KeyResolver::from_env`] snapshots the environment (KMS settings, datapipe socket and pod
/// name, `VETURBOIO_KEY` / `VETURBOIO_IV`) once; the `with_*` setters replace parts of it.
/// Each call contacts the sources afresh (credentials from `kms-sts` are temporary).
#[derive(Clone)]
pub struct KeyResolver {
    kms: KmsConfig,
    datapipe: DatapipeConfig,
    env_key: Option<Secret>,
    env_iv: Option<String>,
    cancel: Option<Arc<AtomicBool>>,
}

impl fmt::Debug for KeyResolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyResolver")
            .field("kms", &self.kms)
            .field("datapipe", &self.datapipe)
            .field("env_key", &self.env_key.as_ref().map(|_| "<redacted>"))
            .field("env_iv", &self.env_iv)
            .finish()
    }
}

impl KeyResolver {
    /// Everything from the process environment.
    pub fn from_env() -> KeyResolver {
        KeyResolver::from_vars(process_env)
    }

    /// Like [`KeyResolver::from_env`], reading variables through `get` (unset and empty are
    /// the same). Tests use this instead of mutating the process environment.
    pub fn from_vars<F: Fn(&str) -> Option<String>>(get: F) -> KeyResolver {
        KeyResolver {
            kms: KmsConfig::from_vars(&get),
            datapipe: DatapipeConfig::from_vars(&get),
            env_key: var(&get, "VETURBOIO_KEY").map(Secret::new),
            env_iv: var(&get, "VETURBOIO_IV"),
            cancel: None,
        }
    }

    /// Every look-up gives up with [`KeyError::Cancelled`] once `cancel` is set: the flag is
    /// checked between sources and attempts, waits between retries wake up, and a request in
    /// flight is abandoned (Ctrl-C in Python returns at once even when the datapipe or KMS
    /// never answers).
    pub fn with_cancel(mut self, cancel: Arc<AtomicBool>) -> KeyResolver {
        self.cancel = Some(cancel);
        self
    }

    /// Replaces the KMS settings.
    pub fn with_kms_config(mut self, config: KmsConfig) -> KeyResolver {
        self.kms = config;
        self
    }

    /// Replaces the datapipe settings.
    pub fn with_datapipe_config(mut self, config: DatapipeConfig) -> KeyResolver {
        self.datapipe = config;
        self
    }

    /// Replaces the datapipe socket path only.
    pub fn with_socket_path(mut self, path: impl Into<PathBuf>) -> KeyResolver {
        self.datapipe.socket_path = path.into();
        self
    }

    /// Replaces the environment source's values (base64 text, as in `VETURBOIO_KEY` and
    /// `VETURBOIO_IV`; `None` = not set).
    pub fn with_env_key_iv(mut self, key_b64: Option<&str>, iv_b64: Option<&str>) -> KeyResolver {
        self.env_key = key_b64.map(Secret::new);
        self.env_iv = iv_b64.map(str::to_string);
        self
    }

    /// The KMS settings.
    pub fn kms_config(&self) -> &KmsConfig {
        &self.kms
    }

    /// The datapipe settings.
    pub fn datapipe_config(&self) -> &DatapipeConfig {
        &self.datapipe
    }

    /// The key for reading `path`.
    ///
    /// With a `header`: KMS `Decrypt` of `header.meta_data_key` (see
    /// [`KeyResolver::kms_client`] for where credentials and transport come from), with the
    /// header's IV; the key's length must fit the header's mode. If that fails: datapipe
    /// `encrypt-key`, then the environment, each giving key *and* IV (the caller still skips
    /// the 256 KiB header, as veTurboIO does). Without a header: datapipe, then environment.
    /// When nothing works, [`KeyError::NoKey`] lists every source tried and why it failed.
    pub fn key_for_read(&self, path: &Path, header: Option<&CipherHeader>) -> Result<KeyMaterial, KeyError> {
        let mut session = Session::new(self);
        let mut attempts = Vec::new();
        if let Some(h) = header {
            match self.header_kms(&mut session, h) {
                Ok(m) => return Ok(m),
                Err(KeyError::Cancelled) => return Err(KeyError::Cancelled),
                Err(error) => attempts.push(Attempt { source: KeySource::HeaderKms, error }),
            }
        }
        self.headerless(&mut session, path, attempts)
    }

    /// The key for writing a headerless encrypted file: datapipe `encrypt-key`, then the
    /// environment.
    pub fn key_for_write(&self, path: &Path) -> Result<KeyMaterial, KeyError> {
        let mut session = Session::new(self);
        self.headerless(&mut session, path, Vec::new())
    }

    /// A new data key for writing a header file, as veTurboIO writers do: a random 16-byte key
    /// and IV (`CTR-128`), the key wrapped by KMS `Encrypt(base64(key))`, and the header to
    /// write (`file_timestamp` = now, Unix seconds).
    pub fn new_header_key(&self) -> Result<(KeyMaterial, CipherHeader), KeyError> {
        let mut session = Session::new(self);
        let client = self.kms_client_in(&mut session)?;
        let random = |e: CipherError| KeyError::Random(e.to_string());
        let key = Key::try_random(Mode::Ctr128).map_err(random)?;
        let iv = Iv::try_random().map_err(random)?;
        let meta_data_key = client.encrypt_data_key(&key)?;
        let file_timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        let header = CipherHeader { mode: Mode::Ctr128, iv, meta_data_key, file_timestamp };
        Ok((KeyMaterial { key, iv, source: KeySource::HeaderKms }, header))
    }

    /// The KMS client veTurboIO's `fetch_kms_client` would build: the configured (environment)
    /// settings; if the datapipe socket exists and answers `ping`, requests go through it
    /// (task `top`) and its `kms-sts` credentials replace the configured ones (if `kms-sts`
    /// fails, the configured credentials are kept and the proxy stays, as in veTurboIO).
    pub fn kms_client(&self) -> Result<KmsClient, KeyError> {
        self.kms_client_in(&mut Session::new(self))
    }

    fn kms_client_in(&self, session: &mut Session) -> Result<KmsClient, KeyError> {
        let mut config = self.kms.clone();
        let mut proxy = None;
        let mut note = "credentials from VETURBOIO_KMS_*".to_string();
        if session.dp.exists() {
            match session.ping() {
                Ok(()) => {
                    proxy = Some(session.dp.clone());
                    match session.dp.kms_sts() {
                        Ok(c) => {
                            config.access_key = Some(c.access_key);
                            config.secret_key = Some(c.secret_key);
                            config.session_token = Some(c.session_token);
                            note = "credentials from datapipe kms-sts".into();
                        }
                        Err(e) => {
                            note = format!("{e}; credentials from VETURBOIO_KMS_*");
                        }
                    }
                }
                Err(e) => note = format!("{e}; KMS called directly"),
            }
        }
        let client = KmsClient::new(config).map_err(|e| match e {
            KeyError::KmsConfig(m) => KeyError::KmsConfig(format!("{m} [{note}]")),
            other => other,
        })?;
        let mut client = client.with_note(note);
        if let Some(c) = &self.cancel {
            client = client.with_cancel(c.clone());
        }
        Ok(match proxy {
            Some(p) => client.with_datapipe_proxy(p),
            None => client,
        })
    }

    fn header_kms(&self, session: &mut Session, header: &CipherHeader) -> Result<KeyMaterial, KeyError> {
        let client = self.kms_client_in(session)?;
        let key = client.decrypt_data_key(&header.meta_data_key)?;
        key.check_mode(header.mode)
            .map_err(|e| KeyError::InvalidKeyMaterial { from: KeySource::HeaderKms, detail: e.to_string() })?;
        Ok(KeyMaterial { key, iv: header.iv, source: KeySource::HeaderKms })
    }

    fn headerless(
        &self,
        session: &mut Session,
        path: &Path,
        mut attempts: Vec<Attempt>,
    ) -> Result<KeyMaterial, KeyError> {
        match session.datapipe_key(path) {
            Ok((key, iv)) => return Ok(KeyMaterial { key, iv, source: KeySource::Datapipe }),
            Err(KeyError::Cancelled) => return Err(KeyError::Cancelled),
            Err(error) => attempts.push(Attempt { source: KeySource::Datapipe, error }),
        }
        match self.env_key_iv() {
            Ok((key, iv)) => return Ok(KeyMaterial { key, iv, source: KeySource::Env }),
            Err(error) => attempts.push(Attempt { source: KeySource::Env, error }),
        }
        Err(KeyError::NoKey { path: path.to_path_buf(), attempts })
    }

    /// The environment source: `VETURBOIO_KEY` (16 or 32 bytes) and `VETURBOIO_IV` (16
    /// bytes), both strict standard base64 (no whitespace, correct padding).
    fn env_key_iv(&self) -> Result<(Key, Iv), KeyError> {
        const KEY: &str = "VETURBOIO_KEY";
        const IV: &str = "VETURBOIO_IV";
        let key_b64 = self.env_key.as_ref().filter(|k| !k.is_empty()).ok_or(KeyError::EnvNotSet { var: KEY })?;
        let iv_b64 = self.env_iv.as_deref().filter(|k| !k.is_empty()).ok_or(KeyError::EnvNotSet { var: IV })?;
        let invalid = |var: &'static str| {
            move |e: CipherError| KeyError::EnvInvalid {
                var,
                detail: match e {
                    CipherError::InvalidBase64 { reason, .. } => {
                        format!("not standard base64 ({reason})")
                    }
                    other => other.to_string(),
                },
            }
        };
        let raw_key = b64_decode(key_b64.expose(), KEY).map_err(invalid(KEY))?;
        let key = Key::new(&raw_key).map_err(|_| KeyError::EnvInvalid {
            var: KEY,
            detail: format!("decodes to {} bytes; a key must be 16 (AES-128) or 32 (AES-256) bytes", raw_key.len()),
        })?;
        let raw_iv = b64_decode(iv_b64, IV).map_err(invalid(IV))?;
        let iv = Iv::new(&raw_iv).map_err(|_| KeyError::EnvInvalid {
            var: IV,
            detail: format!("decodes to {} bytes; the IV must be 16 bytes", raw_iv.len()),
        })?;
        Ok((key, iv))
    }
}

/// State shared by the steps of one resolution, so the datapipe is pinged at most once (a
/// dead sidecar costs its retry budget once, not once per source).
struct Session {
    dp: DatapipeClient,
    ping: Option<Result<(), KeyError>>,
}

impl Session {
    fn new(resolver: &KeyResolver) -> Session {
        let mut dp = DatapipeClient::new(resolver.datapipe.clone());
        if let Some(c) = &resolver.cancel {
            dp = dp.with_cancel(c.clone());
        }
        Session { dp, ping: None }
    }

    fn ping(&mut self) -> Result<(), KeyError> {
        if self.ping.is_none() {
            self.ping = Some(self.dp.ping());
        }
        self.ping.clone().unwrap_or(Ok(()))
    }

    /// veTurboIO's `DataPipeClient().get_data_key_iv(path)`: the socket must exist and
    /// answer `ping`, then `encrypt-key`.
    fn datapipe_key(&mut self, path: &Path) -> Result<(Key, Iv), KeyError> {
        if !self.dp.exists() {
            return Err(KeyError::DatapipeMissing(self.dp.socket_path().to_path_buf()));
        }
        self.ping()?;
        self.dp.encrypt_key(path)
    }
}
