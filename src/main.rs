//! The `regrade` binary: parses the command line and hands over to the library.

use std::process::ExitCode;

use clap::Parser;

use regrade::cli::{Cli, Command};
use regrade::config::{Config, IfMissing};
use regrade::{access, hand, logging, simulate, status, watch};

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            // Not eprintln!: a terminal gone (SIGHUP) must not turn the error into a panic.
            let _ = std::io::Write::write_fmt(&mut std::io::stderr(), format_args!("regrade: {e:#}\n"));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let if_missing = IfMissing::for_path(&cli.config);
    if let Command::Entrypoint { command } = &cli.command {
        // k3s must start even when regrade's configuration is broken: the entrypoint
        // reads only its [levels], leniently.
        return regrade::actuator::entrypoint::run(Config::load_levels(&cli.config, if_missing), command);
    }
    if let Command::RecordStart = &cli.command {
        // The hook must record something even when regrade's configuration is broken:
        // a stale record would misreport the level k3s runs at.
        let cfg = Config::load_for_hook(&cli.config, if_missing, |w| eprintln!("regrade record-start: {w}"));
        return regrade::actuator::systemd::record_start(&cfg.systemd, &cfg.levels, &cfg.level_record);
    }
    let cfg = Config::load(&cli.config, if_missing)?;
    match cli.command {
        Command::CheckConfig => {
            print!("{}", toml::to_string_pretty(&cfg)?);
            for w in cfg.cluster.warnings() {
                eprintln!("regrade: warning: {w}");
            }
            // Each level as k3s would run it: a level another file overrides is an error.
            regrade::runtime::runtime()?.block_on(regrade::backend::check_levels(&cfg))?;
            eprintln!("regrade: {} is valid", cli.config.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::CheckAccess => access::check(&cfg),
        Command::Credential { admin_kubeconfig, lifetime, force } => {
            access::mint(&cfg, admin_kubeconfig, lifetime.as_deref(), force)
        }
        Command::Simulate { trace, level, plot } => simulate::run(&cfg, &trace, level, plot.as_deref()),
        Command::Record { count, interval, etcd_member } => {
            simulate::record(&cfg, count, interval.as_deref(), etcd_member)
        }
        Command::Status { json } => status::run(&cfg, json),
        Command::Watch { dry_run } => {
            let rt = regrade::runtime::runtime()?;
            if !dry_run {
                // A level whose flags k3s would not run with is refused before the first
                // sample, never found out as a step that changed nothing.
                rt.block_on(regrade::backend::check_levels(&cfg))?;
            }
            rt.block_on(regrade::backend::note_reserved_memory(&cfg));
            drop(rt);
            watch::run(&cfg, if dry_run { watch::Mode::DryRun } else { watch::Mode::Act })
        }
        Command::Step { target } => hand::step_by_hand(&cfg, target),
        Command::RecordStart | Command::Entrypoint { .. } => unreachable!("handled before the configuration is loaded"),
    }
}
