//! `alejandra --check` for files named on the command line, built from the `alejandra`
//! library on crates.io (its command-line crate is not published there).
//! `--write` formats the files in place instead, for a developer fixing what the check found.

use std::process::ExitCode;

use alejandra::format::{in_fs, Status};

fn main() -> ExitCode {
    let mut write = false;
    let mut files = Vec::new();
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--write" => write = true,
            _ => files.push(arg),
        }
    }
    if files.is_empty() {
        eprintln!("usage: alejandra-check [--write] FILE.nix...");
        return ExitCode::from(2);
    }
    let mut bad = 0;
    for file in files {
        match in_fs(file.clone(), write) {
            Status::Changed(false) => {}
            Status::Changed(true) if write => println!("formatted {file}"),
            Status::Changed(true) => {
                println!("{file}: not formatted as alejandra 3.1.0 would (fix: alejandra-check --write {file})");
                bad += 1;
            }
            Status::Error(e) => {
                println!("{file}: alejandra cannot parse it: {e}");
                bad += 1;
            }
        }
    }
    if bad > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
