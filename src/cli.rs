//! The command line.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

pub use crate::hand::StepTarget;
use crate::level::Level;

#[derive(Parser, Debug)]
#[command(
    name = "regrade",
    version,
    about = "Steps a k3s server down under memory pressure without losing its etcd vote, one server at a time",
    long_about = "regrade runs on every k3s server. It watches memory pressure (PSI) and MemAvailable; \
under sustained pressure it steps its server down one level at a time \
(full -> control-plane -> etcd-only), keeping the server's etcd member and vote, and steps it \
back up once memory has been calm. Only one server in the cluster is stepped down at a time \
(a Kubernetes Lease plus a check that every other etcd voter is Ready).\n\n\
Levels: full (k3s as configured); control-plane (cordoned, tainted, labelled, not restarted); \
etcd-only (k3s restarted without API server, controller manager and scheduler)."
)]
pub struct Cli {
    /// The configuration file (TOML). When the default path is absent, built-in defaults apply.
    #[arg(long, short = 'c', global = true, env = "REGRADE_CONFIG", default_value = crate::config::DEFAULT_PATH)]
    pub config: PathBuf,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the daemon: sample pressure every sample_period and step when the rules say so.
    Watch {
        /// Decide and log what would be done, touching neither k3s nor the cluster.
        #[arg(long)]
        dry_run: bool,
    },
    /// Show the level, pressure, MemAvailable, streaks, last step, and when the next step
    /// could happen and what would refuse it.
    Status {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Step this server by hand. Takes the same Lease and peer check as an automatic step
    /// and never reads pressure.
    Step {
        #[command(subcommand)]
        target: StepTarget,
    },
    /// Replay a pressure trace (CSV) through the decision core and print one JSON object
    /// per step. Every step succeeds in simulation. With --plot, also draw the trace, the
    /// thresholds and the steps as one self-contained SVG.
    Simulate {
        /// The CSV trace: header row with t,some_avg10,some_avg60,some_avg300,full_avg10,
        /// full_avg60,full_avg300,mem_available_kb (any order); t in seconds. The etcd
        /// member's columns `record --etcd-member` writes may follow: the core takes the
        /// member's distress from them as watch does (etcd.distress_overrides_floor),
        /// and --plot draws them.
        trace: PathBuf,
        /// The level the simulated server starts at.
        #[arg(long, default_value = "full")]
        level: Level,
        /// Also write an SVG (1200x800, no scripts, fonts or links) of the trace: the
        /// metric with threshold and calm_threshold, MemAvailable with its floor, each
        /// sample's reading, the streaks, sustain and cooldown, and the level with each
        /// step (the steps printed). With the etcd member's columns, also (1200x1000) a
        /// panel of the member: when it was unhealthy or did not answer, its p99 WAL
        /// fsync and backend commit against etcd.wal_fsync_p99_limit and
        /// etcd.backend_commit_p99_limit, and its heartbeat send failures, slow applies
        /// and leader changes. Needs two rows or more and a mem_available_kb column; a
        /// trace of more than 4000 rows is downsampled for drawing only.
        #[arg(long, value_name = "FILE.svg")]
        plot: Option<PathBuf>,
    },
    /// Sample the live pressure files and print the CSV `simulate` replays, one row per
    /// sample_period, until interrupted (or --count rows).
    Record {
        /// Stop after this many rows.
        #[arg(long)]
        count: Option<u64>,
        /// Time between rows (default: pressure.sample_period), e.g. "1s".
        #[arg(long)]
        interval: Option<String>,
        /// Also look at the local etcd member's metrics listener (etcd.metrics_url,
        /// /health and /metrics) for every row and add its columns after the others:
        /// etcd_healthy (1/0), etcd_wal_fsync_p99_ms and etcd_backend_commit_p99_ms
        /// (p99 since the last row it answered), etcd_heartbeat_send_failures,
        /// etcd_slow_applies, etcd_leader_changes (the member's counters). Off unless
        /// asked: without it the CSV keeps its eight columns wherever it runs, whatever
        /// answers at etcd.metrics_url. Each look is bounded by
        /// etcd.request_timeout and never delays the next row; a member that does not
        /// answer leaves empty cells and one warning on stderr.
        #[arg(long)]
        etcd_member: bool,
    },
    /// Check the configuration file and print the settings in force; then check that
    /// k3s would run each level's flags, its configuration read as k3s reads it (config
    /// file, config.yaml.d, the unit's command line): a file or flag that overrides a
    /// level is an error naming it and the key.
    CheckConfig,
    /// Say what regrade's credential (cluster.kubeconfig) may and may not do, as the API
    /// server answers: who it is, each right regrade needs and rights it never needs
    /// (SelfSubjectAccessReview), and, for this server's own credential, dry-run requests
    /// the admission policy must refuse (another Node, another taint or label, another
    /// Lease). Exits 1 unless the credential is least privilege; an admin kubeconfig is
    /// named OVER-PRIVILEGED.
    CheckAccess,
    /// Mint or renew this server's own credential: a token of the ServiceAccount
    /// regrade/<Node>, bound to the Node (Kubernetes >= 1.31; unbound before), written
    /// beside cluster.kubeconfig as <kubeconfig>.token, and the kubeconfig naming it. A
    /// token is kept while the API server accepts it (asked with a SelfSubjectReview)
    /// until less than half of its lifetime and one credential.renew_period are left; a
    /// running `watch` uses a new one at its next request. The API servers are those
    /// `watch` uses (cluster.api_servers, else the endpoints cache). Run it from a timer
    /// every credential.renew_period, as the NixOS module does.
    Credential {
        /// Credentials that may read Nodes and make ServiceAccounts and their tokens
        /// (namespace regrade); with rights to get validatingadmissionpolicies and their
        /// bindings it also says whether the admission policy is in force.
        #[arg(long, value_name = "FILE", default_value = "/etc/rancher/k3s/k3s.yaml")]
        admin_kubeconfig: PathBuf,
        /// How long a new token is valid (at least 10m, and at least four
        /// credential.renew_period). Default: credential.lifetime (24h).
        #[arg(long)]
        lifetime: Option<String>,
        /// Mint a new token even if the one at hand is not due.
        #[arg(long)]
        force: bool,
    },
    /// The ExecStartPre hook of k3s.service: record the level k3s is being started at
    /// (read from regrade's k3s config drop-in) under /run. Never fails k3s's start.
    RecordStart,
    /// The k3s container's entrypoint (Docker): read the level file, record the started
    /// level on tmpfs, and exec k3s with the level's flags added.
    /// Usage: regrade entrypoint -- k3s server ARGS...
    Entrypoint {
        /// The k3s command line to exec.
        #[arg(last = true, required = true)]
        command: Vec<std::ffi::OsString>,
    },
}
