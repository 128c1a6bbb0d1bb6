//! turboio-cipher's tests: one binary, one module per area.

mod files;
mod header;
mod key;
mod python;
mod random_access;
mod reference;
mod vectors;
