//! The `flashrt` command line (every command's flags and help come from `flashrt::cli`).

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = flashrt::cli::Cli::parse();
    flashrt::cli::init_logging();
    match flashrt::cli::dispatch(cli) {
        Ok(code) => code,
        Err(msg) => {
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
    }
}
