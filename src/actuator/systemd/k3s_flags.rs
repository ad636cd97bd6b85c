//! The systemd actuator's view of k3s's effective configuration ([`crate::k3s_config`],
//! the levels against it in [`crate::k3s_config::levels`]): k3s's configuration with
//! regrade's drop-in read as it is or as it would be at a level, for `record-start`, and
//! whether each level's flags would be in force once regrade's drop-in holds them
//! (`check-config`, `watch`'s start, and before every restart of a step). A level
//! another file or the unit's command line overrides is an error naming the file and
//! the key: a step into it would change nothing while regrade recorded it.

use std::path::{Path, PathBuf};

use crate::k3s_config::levels::overridden;
use crate::k3s_config::{self, Distribution, Effective, Invocation, Overlay};
use crate::level::Level;
use crate::levels::LevelsConfig;

use super::dropin;

/// k3s, with its default config file beside regrade's drop-in directory
/// (`systemd.dropin` in `/etc/rancher/k3s/config.yaml.d` stands for
/// `/etc/rancher/k3s/config.yaml`), so a test's or a site's other root is read the same.
pub fn distribution(dropin: &Path) -> Distribution {
    let beside = dropin.parent().and_then(|d| d.to_str()?.strip_suffix(".d").map(PathBuf::from));
    match beside {
        Some(config) => Distribution::k3s().with_default_config(config),
        None => Distribution::k3s(),
    }
}

/// k3s's effective configuration for the unit's `inv`, with regrade's drop-in read as
/// if it held `level`'s flags (`None`: as it is on disk).
pub fn effective(
    dropin_path: &Path,
    levels: &LevelsConfig,
    inv: &Invocation,
    level: Option<Level>,
) -> anyhow::Result<Effective> {
    let text = level.map(|l| dropin::render(levels, l));
    let overlay = text.as_ref().map(|t| Overlay { path: dropin_path, content: t.as_deref() });
    k3s_config::read(&distribution(dropin_path), inv, overlay)
}

/// Each level as k3s would run it with regrade's drop-in written for it: an error
/// naming every level whose flags another file or the command line overrides, with
/// the file and the key, or that k3s would not read regrade's drop-in for.
pub fn check_levels(dropin_path: &Path, levels: &LevelsConfig, inv: &Invocation) -> anyhow::Result<()> {
    let mut problems = Vec::new();
    for level in Level::ALL {
        let eff = effective(dropin_path, levels, inv, Some(level))?;
        let wrong = overridden(levels, level, &eff, Some(dropin_path));
        if wrong.is_empty() {
            continue;
        }
        if !levels.k3s_flags(level).is_empty() && !eff.reads(dropin_path) {
            problems.push(format!(
                "level {level}: k3s reads {} and {}.d, not regrade's drop-in {} (systemd.dropin)",
                eff.config_file.display(),
                eff.config_file.display(),
                dropin_path.display()
            ));
            continue;
        }
        let words: Vec<String> = wrong.iter().map(|o| o.to_string()).collect();
        problems.push(format!("level {level}: {}", words.join("; ")));
    }
    if !problems.is_empty() {
        anyhow::bail!("k3s would not run at every level regrade steps to: {}", problems.join(". "));
    }
    Ok(())
}

/// [`check_levels`] for the unit as systemd starts it (its command line and
/// environment, within `systemd.call_timeout`); without systemd, the files alone.
pub async fn check_levels_of_unit(sd: &super::SystemdConfig, levels: &LevelsConfig) -> anyhow::Result<()> {
    let asked = async { super::dbus::Systemd::connect(&sd.unit, sd.call_timeout.0).await?.invocation().await };
    let inv = asked.await.unwrap_or_else(|e| {
        tracing::debug!(error = %format!("{e:#}"), "could not ask systemd how it starts k3s; reading the files alone");
        Invocation::default()
    });
    check_levels(&sd.dropin, levels, &inv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k3s_config::levels::started_level;
    use std::fs;

    struct Host {
        dir: tempfile::TempDir,
    }

    impl Host {
        fn new() -> Host {
            let h = Host { dir: tempfile::tempdir().unwrap() };
            fs::create_dir(h.dir.path().join("config.yaml.d")).unwrap();
            h
        }
        fn dropin(&self) -> PathBuf {
            self.dir.path().join("config.yaml.d/50-regrade.yaml")
        }
        fn put(&self, name: &str, text: &str) -> PathBuf {
            let p = self.dir.path().join(name);
            fs::write(&p, text).unwrap();
            p
        }
    }

    fn argv(args: &[&str]) -> Invocation {
        Invocation { argv: Some(args.iter().map(|s| s.to_string()).collect()), env: Vec::new() }
    }

    #[test]
    fn a_later_file_that_overrides_a_level_is_named_with_its_key() {
        let h = Host::new();
        let levels = LevelsConfig::default();
        check_levels(&h.dropin(), &levels, &argv(&["k3s", "server"])).unwrap();
        let site = h.put("config.yaml.d/90-site.yaml", "disable-apiserver: false\n");
        let e = format!("{:#}", check_levels(&h.dropin(), &levels, &argv(&["k3s", "server"])).unwrap_err());
        assert!(e.contains("level etcd-only") && e.contains(site.to_str().unwrap()), "{e}");
        assert!(e.contains("disable-apiserver = \"false\""), "{e}");
        assert!(!e.contains("level full") && !e.contains("control-plane"), "only etcd-only is overridden: {e}");
        // An earlier file is replaced by regrade's drop-in: no override.
        fs::remove_file(&site).unwrap();
        h.put("config.yaml.d/10-site.yaml", "disable-apiserver: false\n");
        check_levels(&h.dropin(), &levels, &argv(&["k3s", "server"])).unwrap();
    }

    #[test]
    fn the_command_line_overrides_every_file_and_is_named() {
        let h = Host::new();
        let levels = LevelsConfig::default();
        let inv = argv(&["/usr/local/bin/k3s", "server", "--disable-scheduler=false"]);
        let e = format!("{:#}", check_levels(&h.dropin(), &levels, &inv).unwrap_err());
        assert!(e.contains("k3s's command line sets disable-scheduler"), "{e}");
        // At full the command line's `--disable-apiserver` (a boolean without a value)
        // keeps the API server off: full is overridden.
        let inv = argv(&["k3s", "server", "--disable-apiserver"]);
        let e = format!("{:#}", check_levels(&h.dropin(), &levels, &inv).unwrap_err());
        assert!(e.contains("level full") && e.contains("disable-apiserver"), "{e}");
    }

    #[test]
    fn a_config_file_elsewhere_does_not_read_regrades_drop_in() {
        let h = Host::new();
        let other = h.put("other.yaml", "node-name: a\n");
        let inv = argv(&["k3s", "server", "--config", other.to_str().unwrap()]);
        let e = format!("{:#}", check_levels(&h.dropin(), &LevelsConfig::default(), &inv).unwrap_err());
        assert!(e.contains("not regrade's drop-in") && e.contains("other.yaml"), "{e}");
    }

    #[test]
    fn k3s_starts_at_the_level_its_flags_say() {
        let h = Host::new();
        let levels = LevelsConfig::default();
        let started = |claimed| {
            let eff = effective(&h.dropin(), &levels, &Invocation::default(), None).unwrap();
            started_level(&levels, &eff, Some(&h.dropin()), claimed)
        };
        assert_eq!(started(None), (Level::Full, vec![]));
        assert_eq!(started(Some(Level::ControlPlane)), (Level::ControlPlane, vec![]), "same flags: the claim holds");
        // The operator's own config.yaml sets etcd-only's flags, no drop-in: etcd-only.
        h.put("config.yaml", "disable-apiserver: true\ndisable-controller-manager: true\ndisable-scheduler: yes\n");
        assert_eq!(started(None), (Level::EtcdOnly, vec![]));
        fs::remove_file(h.dir.path().join("config.yaml")).unwrap();
        // regrade's drop-in at etcd-only, a later file turning the API server back on:
        // no level holds; the nearest, with the override named.
        fs::write(h.dropin(), dropin::render(&levels, Level::EtcdOnly).unwrap()).unwrap();
        h.put("config.yaml.d/90-site.yaml", "disable-apiserver: false\n");
        let (level, wrong) = started(Some(Level::EtcdOnly));
        assert_eq!(level, Level::EtcdOnly);
        assert_eq!(wrong.len(), 1, "{wrong:?}");
        assert!(wrong[0].to_string().contains("90-site.yaml sets disable-apiserver"), "{}", wrong[0]);
    }

    #[test]
    fn a_levels_list_flag_adds_to_the_operators_and_keeps_their_reservation() {
        let h = Host::new();
        let levels = crate::config::Config::parse("[levels.control-plane.k3s]\nkubelet-arg = [\"max-pods=10\"]\n")
            .unwrap()
            .levels;
        h.put("config.yaml", "kubelet-arg: [system-reserved=memory=2Gi]\n");
        h.put("config.yaml.d/40-regrade-reserved.yaml", "kubelet-arg+: [system-reserved=memory=3Gi]\n");
        let eff = effective(&h.dropin(), &levels, &argv(&["k3s", "server"]), Some(Level::ControlPlane)).unwrap();
        let values: Vec<&str> = eff.all("kubelet-arg").map(|a| a.value.as_str()).collect();
        assert_eq!(values, ["system-reserved=memory=2Gi", "system-reserved=memory=3Gi", "max-pods=10"]);
        let reserved = crate::k3s_config::kubelet::map_flag(&eff, "system-reserved");
        assert_eq!(reserved.entries["memory"].value, "3Gi", "the level's drop-in lowers nothing");
        check_levels(&h.dropin(), &levels, &argv(&["k3s", "server"])).unwrap();
    }

    #[test]
    fn a_list_flag_shadowed_by_a_later_plain_key_is_named() {
        let h = Host::new();
        let levels = crate::config::Config::parse(
            "[levels.etcd-only.k3s]\ndisable-apiserver = true\nkubelet-arg = [\"max-pods=10\"]\n",
        )
        .unwrap()
        .levels;
        h.put("config.yaml.d/90-site.yaml", "kubelet-arg: [eviction-hard=memory.available<5%]\n");
        let e = format!("{:#}", check_levels(&h.dropin(), &levels, &Invocation::default()).unwrap_err());
        assert!(e.contains("90-site.yaml sets kubelet-arg") && e.contains("kubelet-arg+"), "{e}");
    }
}
