//! The commands about regrade's own credential (docs/behaviour.md, "Least privilege"):
//! `regrade credential` mints or renews it, `regrade check-access` says what it may and
//! may not do. The API work is in `cluster::credential` and `cluster::boundary`.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::cluster::credential::{self, Minted};
use crate::cluster::KubeCluster;
use crate::config::Config;
use crate::runtime::runtime;

/// `regrade credential`: keeps this server's token, or mints a new one, and says which.
pub fn mint(cfg: &Config, admin_kubeconfig: PathBuf, lifetime: Option<&str>, force: bool) -> anyhow::Result<ExitCode> {
    let lifetime = lifetime
        .map(|l| crate::units::parse_duration(l).map_err(|e| anyhow::anyhow!("--lifetime {l:?}: {e}")))
        .transpose()?;
    let settings = cfg.cluster.mint_settings(&cfg.credential, admin_kubeconfig, lifetime, force)?;
    let now = crate::statefile::unix(std::time::SystemTime::now()) as i64;
    let minted = runtime()?.block_on(credential::ensure(&settings, now))?;
    let token = credential::token_path(&settings.kubeconfig);
    let at = |t: i64| k8s_openapi::jiff::Timestamp::from_second(t).map_or(t.to_string(), |t| t.to_string());
    match minted {
        Minted::Kept { claims, renew_at, unasked } => {
            println!(
                "regrade credential: kept {} ({}, expires {}, renewed from {})",
                token.display(),
                claims.subject,
                at(claims.expires_at),
                at(renew_at)
            );
            if let Some(why) = unasked {
                eprintln!("regrade credential: could not ask whether the API server still accepts it: {why}");
            }
        }
        Minted::Renewed { claims, why, unbound, policy } => {
            let bound = claims.node.as_deref().map_or("bound to no Node".to_string(), |n| format!("bound to Node {n}"));
            println!(
                "regrade credential: wrote {} ({}, {bound}, expires {}) because {why}; {} names it",
                token.display(),
                claims.subject,
                at(claims.expires_at),
                settings.kubeconfig.display()
            );
            if let Some(why) = unbound {
                eprintln!(
                    "regrade credential: {why}: the token is good until it expires; the admission policy reads the \
                     Node from the ServiceAccount's name"
                );
            }
            if let Some(refusal) = policy.refusal() {
                eprintln!("regrade credential: {refusal}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `regrade check-access`: prints what the credential may and may not do; fails unless
/// it is least privilege.
pub fn check(cfg: &Config) -> anyhow::Result<ExitCode> {
    let kubeconfig = cfg.cluster.kubeconfig.clone().unwrap_or_else(|| crate::cluster::DEFAULT_KUBECONFIG.into());
    let c = KubeCluster::new(&cfg.cluster, &cfg.levels)?;
    let boundary = runtime()?.block_on(c.boundary())?;
    println!("credential: {}", kubeconfig.display());
    let token = credential::token_path(&kubeconfig);
    if let Ok(Some(t)) = crate::fsutil::read_string_if_exists(&token) {
        if let Ok(claims) = credential::TokenClaims::parse(&t) {
            let at = k8s_openapi::jiff::Timestamp::from_second(claims.expires_at).map(|t| t.to_string());
            println!("token: {} (expires {})", token.display(), at.unwrap_or_default());
        }
    }
    print!("{boundary}");
    Ok(if boundary.is_least_privilege() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
