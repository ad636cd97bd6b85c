//! The man pages and shell completions build.rs generates from the clap definitions:
//! present, naming every subcommand and option the binary has, and well-formed for
//! the tools that read them (groff for man, bash for its completion script).

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::CommandFactory;
use regrade::cli::Cli;

fn gen() -> PathBuf {
    PathBuf::from(env!("OUT_DIR")).join("gen")
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn a_man_page_for_the_command_and_each_subcommand() {
    let mut cli = Cli::command();
    cli.build();
    let main = read(&gen().join("man/regrade.1"));
    assert!(main.contains(&format!(".TH regrade 1  \"regrade {}\"", env!("CARGO_PKG_VERSION"))), "{main}");
    // build.rs repeats the default config path; it must be the binary's.
    assert!(main.contains(&regrade::config::DEFAULT_PATH.replace('-', "\\-")), "{main}");
    let mut pages = 0;
    let mut walk = vec![(cli.clone(), "regrade".to_string())];
    while let Some((cmd, name)) = walk.pop() {
        let page = read(&gen().join(format!("man/{name}.1")));
        pages += 1;
        for arg in cmd.get_arguments().filter_map(|a| a.get_long()) {
            assert!(page.contains(&format!("\\-\\-{}", arg.replace('-', "\\-"))), "{name}.1 lacks --{arg}");
        }
        for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
            assert!(page.contains(&sub.get_name().replace('-', "\\-")), "{name}.1 lacks {}", sub.get_name());
            walk.push((sub.clone(), format!("{name}-{}", sub.get_name())));
        }
    }
    assert!(pages >= 11, "{pages} pages");
    let watch = read(&gen().join("man/regrade-watch.1"));
    assert!(watch.contains("\\fB\\-\\-dry\\-run\\fR"), "{watch}");
}

#[test]
fn groff_reads_every_page_without_a_warning() {
    if Command::new("groff").arg("--version").output().is_err() {
        eprintln!("skipped: no groff");
        return;
    }
    // All warnings but "break" (a line that cannot be adjusted: the CSV header is one long word).
    for e in std::fs::read_dir(gen().join("man")).unwrap() {
        let p = e.unwrap().path();
        let out = Command::new("groff").args(["-man", "-Tutf8", "-ww", "-Wbreak", "-z"]).arg(&p).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && err.trim().is_empty(), "{}: {err}", p.display());
    }
}

#[test]
fn completions_for_bash_zsh_and_fish() {
    let bash = gen().join("completions/regrade.bash");
    let zsh = read(&gen().join("completions/_regrade"));
    let fish = read(&gen().join("completions/regrade.fish"));
    let bash_text = read(&bash);
    for word in ["watch", "status", "check-config", "record-start", "--dry-run", "--json", "--config"] {
        assert!(bash_text.contains(word), "bash completion lacks {word}");
        assert!(zsh.contains(word), "zsh completion lacks {word}");
        assert!(fish.contains(word.trim_start_matches('-')), "fish completion lacks {word}");
    }
    assert!(zsh.starts_with("#compdef regrade"), "{zsh}");
    // bash parses it, and after sourcing it the completion function is registered.
    let out = Command::new("bash").arg("-c").arg(format!("source {:?} && complete -p regrade", bash)).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && said.contains("regrade"), "{said}{}", String::from_utf8_lossy(&out.stderr));
}
