//! Standard output for every command: a reader that goes away early (`turboio inspect F | head`)
//! ends the command quietly instead of panicking in `println!`.

use std::fmt;
use std::io::{ErrorKind, Write};

/// Standard output was closed by its reader; the command stops and exits with status 141, as
/// a Unix tool killed by `SIGPIPE` does, without a message.
#[derive(Debug)]
pub struct Closed;

impl fmt::Display for Closed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("standard output was closed")
    }
}

impl std::error::Error for Closed {}

/// The exit status of a command whose output was closed (128 + SIGPIPE).
pub const CLOSED_STATUS: u8 = 141;

/// Writes one line to standard output.
pub fn line(args: fmt::Arguments<'_>) -> Result<(), Box<dyn std::error::Error>> {
    let mut out = std::io::stdout().lock();
    match out.write_fmt(args).and_then(|()| out.write_all(b"\n")) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Err(Box::new(Closed)),
        Err(e) => Err(format!("cannot write to standard output: {e}").into()),
    }
}

/// `println!` for the CLI's commands: returns from the enclosing function with [`Closed`] when
/// standard output is closed (or with an error when it fails otherwise).
macro_rules! outln {
    () => {
        $crate::out::line(format_args!(""))?
    };
    ($($arg:tt)*) => {
        $crate::out::line(format_args!($($arg)*))?
    };
}
pub(crate) use outln;

/// Paths and URLs as the command prints them: a URL without user info or query string (see
/// [`turboio::storage::shown`]), a local path as `Path::display` shows it.
pub trait Shown {
    /// See the trait.
    fn shown(&self) -> turboio::storage::Shown<'_>;
}

impl Shown for std::path::Path {
    fn shown(&self) -> turboio::storage::Shown<'_> {
        turboio::storage::shown(self)
    }
}
