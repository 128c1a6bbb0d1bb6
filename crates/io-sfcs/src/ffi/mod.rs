//! libcloudfs, in three layers: [`sys`] (the C types and the function table resolved at run
//! time), [`result`] (every call checked, failures captured with `cfsGetLastError()`), [`safe`]
//! (RAII handles). All `unsafe` code of the crate is in this module.

pub mod result;
pub mod safe;
pub mod sys;

pub use result::CfsError;
pub use safe::{Fs, Library};

/// The effective user id.
pub fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}
