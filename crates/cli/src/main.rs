//! The `turboio` command (see the library, `turboio_cli`, which the Python wheel's `turboio`
//! console script runs too).

fn main() -> std::process::ExitCode {
    turboio_cli::main()
}
