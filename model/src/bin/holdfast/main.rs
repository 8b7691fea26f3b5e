//! `holdfast`: serve a seeded request stream under every graph mode and check that graphs change
//! speed, not results (`simulate`); or show what a configuration would capture (`plan`).
//!
//! Exit codes: 0 success, 1 a runtime failure or tokens that differ between modes, 2 a bad option
//! or configuration (clap's usage errors are 2 as well).

use std::process::ExitCode;

use clap::Parser;

mod args;
mod error;
mod plan;
mod simulate;
mod table;
mod workload;

use args::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Simulate(a) => simulate::run(a),
        Command::Plan(a) => plan::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
    }
}
