//! Man pages and shell completions, generated from the clap definitions in src/cli.rs
//! at build time (so they always match the binary), into `$OUT_DIR/gen`, and also into
//! `$REGRADE_GEN_DIR` when that is set (what an install step or a package copies from):
//!
//!   man/regrade.1, man/regrade-watch.1, … (one page per subcommand)
//!   completions/regrade.bash, completions/_regrade (zsh), completions/regrade.fish

use std::path::{Path, PathBuf};

use clap::CommandFactory;

// src/cli.rs refers to these; the build script compiles them itself. The path is
// repeated from src/config.rs; tests/testsuite/man_completions.rs checks the page names the same.
#[path = "src/level.rs"]
#[allow(dead_code)]
mod level;
mod config {
    pub const DEFAULT_PATH: &str = "/etc/regrade/regrade.toml";
}
/// A copy of `hand::StepTarget` (src/hand.rs runs steps, which a build script cannot
/// compile); tests/testsuite/man_completions.rs checks every subcommand and option of the real
/// command line is in the pages.
mod hand {
    use crate::level::Level;

    #[derive(clap::Subcommand, Debug, Clone, Copy)]
    pub enum StepTarget {
        /// One level down.
        Down,
        /// One level up.
        Up,
        /// To LEVEL, one level at a time.
        To { level: Level },
    }
}
#[path = "src/cli.rs"]
#[allow(dead_code)]
mod cli;

fn main() -> std::io::Result<()> {
    for f in ["src/cli.rs", "src/level.rs"] {
        println!("cargo:rerun-if-changed={f}");
    }
    println!("cargo:rerun-if-env-changed=REGRADE_GEN_DIR");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("gen");
    generate(&out)?;
    if let Some(dir) = std::env::var_os("REGRADE_GEN_DIR") {
        generate(Path::new(&dir))?;
    }
    Ok(())
}

fn generate(dir: &Path) -> std::io::Result<()> {
    let (man, completions) = (dir.join("man"), dir.join("completions"));
    std::fs::create_dir_all(&man)?;
    std::fs::create_dir_all(&completions)?;
    let mut cmd = cli::Cli::command();
    cmd.build();
    man_pages(&cmd, "regrade", &man)?;
    for shell in [clap_complete::Shell::Bash, clap_complete::Shell::Zsh, clap_complete::Shell::Fish] {
        clap_complete::generate_to(shell, &mut cmd.clone(), "regrade", &completions)?;
    }
    Ok(())
}

/// One page for the command and one for each subcommand (`regrade-step.1`, …), named
/// as `man regrade-watch` finds them.
fn man_pages(cmd: &clap::Command, name: &str, dir: &Path) -> std::io::Result<()> {
    // Command::name wants a 'static str; a build script can leak a few.
    let cmd = cmd.clone().name(&*Box::leak(name.to_string().into_boxed_str())).version(env!("CARGO_PKG_VERSION"));
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd.clone()).render(&mut page)?;
    std::fs::write(dir.join(format!("{name}.1")), page)?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set() && s.get_name() != "help") {
        man_pages(sub, &format!("{name}-{}", sub.get_name()), dir)?;
    }
    Ok(())
}
