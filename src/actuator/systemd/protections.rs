//! Which static protections of k3s are in place on this host, for `regrade status`
//! (packaging/systemd/k3s.service.d/40-regrade-protect.conf, the NixOS module's
//! `services.regrade.protect`): k3s.service's `MemoryLow=`/`MemoryMin=` and its
//! slice's (cgroup v2 only), its `OOMScoreAdjust=` and the k3s process's
//! `oom_score_adj` now, and the kubelet's `system-reserved` memory as k3s will pass it
//! (its configuration read as k3s reads it, [`crate::k3s_config`]): in force, shadowed
//! by a later file, or lowering a larger reservation made before it.
//!
//! With the pods capped on cgroup v2 it also says whether regrade reads the server's
//! PSI rather than the host's.
//!
//! [`survey`] reads systemd over D-Bus (one bounded call) and a few files;
//! [`judge`] turns what was read into plain words, and is table-tested.

use std::path::{Path, PathBuf};

use crate::k3s_config::kubelet::{self, MapEntry, Replaced};
use crate::k3s_config::Effective;

use serde::Serialize;

use super::dbus::{Systemd, UnitProtection};
use super::SystemdConfig;

/// What was read on this host.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Facts {
    /// The unified hierarchy with the memory controller (`/sys/fs/cgroup/cgroup.controllers`).
    pub cgroup_v2_memory: bool,
    /// k3s.service as systemd has it, or why it could not be read.
    pub unit: Option<Result<UnitProtection, String>>,
    /// The unit's slice's `memory.low` and `memory.min` (v2), in bytes; `None` unread.
    pub slice_low: Option<u64>,
    pub slice_min: Option<u64>,
    /// The slice's name (`system.slice`).
    pub slice: String,
    /// The k3s main process's `oom_score_adj` now.
    pub main_oom_score_adj: Option<i32>,
    /// The kubelet's `system-reserved` memory as k3s will pass it, or why k3s's
    /// configuration could not be read; `None`: not read.
    pub reserved: Option<Result<ReservedMemory, String>>,
    /// The PSI file regrade reads (`pressure.source`, resolved).
    pub psi_source: PathBuf,
}

/// The kubelet's `system-reserved` memory as k3s's configuration gives it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ReservedMemory {
    /// What the kubelet reserves, and the file (or command line) it comes from.
    pub in_force: Option<MapEntry>,
    /// Reservations a later file's plain `kubelet-arg:` dropped: the value, its file,
    /// and the file that dropped it.
    pub shadowed: Vec<(String, PathBuf, PathBuf)>,
    /// Reservations a later `system-reserved` memory replaced (the kubelet keeps the last).
    pub replaced: Vec<Replaced>,
}

impl ReservedMemory {
    pub fn of(eff: &Effective) -> ReservedMemory {
        let flag = kubelet::map_flag(eff, "system-reserved");
        let shadowed = eff
            .shadowed
            .iter()
            .filter(|s| s.key == "kubelet-arg")
            .filter_map(|s| {
                let pairs = kubelet::pairs_of(&s.value, "system-reserved")?;
                let memory = pairs.into_iter().rev().find(|(k, _)| k == "memory")?.1;
                Some((memory, s.was_in.clone(), s.by.clone()))
            })
            .collect();
        ReservedMemory {
            in_force: flag.entries.get("memory").cloned(),
            shadowed,
            replaced: flag.replaced.into_iter().filter(|r| r.key == "memory").collect(),
        }
    }
}

/// One protection, as `status` says it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    pub protection: &'static str,
    /// `in place`, `missing`, `shadowed` (set, but a later file drops it), `lowered` (in
    /// force, but smaller than one it replaced), `not on this host` (cgroup v1) or `unknown`.
    pub state: &'static str,
    /// What is in force, or what is missing and what to do about it.
    pub words: String,
    /// The value in force (or set and shadowed), as its source writes it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// Where that value comes from: a file, k3s's command line, the unit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The file that drops it, for a shadowed setting.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadowed_by: Option<String>,
}

impl Finding {
    fn at(mut self, value: impl ToString, source: impl ToString) -> Finding {
        self.value = Some(value.to_string());
        self.source = Some(source.to_string());
        self
    }
}

const IN_PLACE: &str = "in place";
const MISSING: &str = "missing";
const NOT_HERE: &str = "not on this host";
const UNKNOWN: &str = "unknown";
const SHADOWED: &str = "shadowed";
const LOWERED: &str = "lowered";

/// The PSI of k3s and the system, not the pods', on cgroup v2 (systemd puts k3s.service
/// in system.slice, the kubelet the pods in kubepods.slice beside it).
pub const SERVER_PSI: &str = "/sys/fs/cgroup/system.slice/memory.pressure";

const FIX_UNIT: &str = "install packaging/systemd/k3s.service.d/40-regrade-protect.conf \
     (NixOS: services.regrade.protect), then systemctl daemon-reload";

fn mib(b: u64) -> String {
    format!("{} MiB", b >> 20)
}

/// The findings, one per protection, in plain words an operator can act on.
pub fn judge(f: &Facts, unit_name: &str) -> Vec<Finding> {
    let found = |protection, state, words: String| Finding {
        protection,
        state,
        words,
        value: None,
        source: None,
        shadowed_by: None,
    };
    let unit = match &f.unit {
        Some(Ok(u)) => Ok(u),
        Some(Err(e)) => Err(format!("could not ask systemd about {unit_name}: {e}")),
        None => Err("not asked".to_string()),
    };
    let mut out = Vec::new();
    out.push(match (f.cgroup_v2_memory, &unit) {
        (false, _) => found(
            "memory protection",
            NOT_HERE,
            "this host's memory controller is cgroup v1, where MemoryLow=/MemoryMin= do nothing: \
             k3s's pages are reclaimed as readily as the pods'; kubelet system-reserved memory is the lever here"
                .into(),
        ),
        (true, Err(e)) => found("memory protection", UNKNOWN, e.clone()),
        (true, Ok(u)) if u.memory_low.max(u.memory_min) == 0 => found(
            "memory protection",
            MISSING,
            format!(
                "{unit_name} has no MemoryLow= or MemoryMin=: under pressure the kernel reclaims k3s's and \
                 etcd's pages as readily as the pods'; {FIX_UNIT}"
            ),
        )
        .at(mib(0), unit_name),
        (true, Ok(u)) => {
            let p = u.memory_low.max(u.memory_min);
            let slice = f.slice_low.unwrap_or(0).max(f.slice_min.unwrap_or(0));
            if f.slice_low.is_some() && slice < p {
                found(
                    "memory protection",
                    MISSING,
                    format!(
                        "{unit_name} has MemoryLow/MemoryMin {} but {} only {}: cgroup v2 protects a cgroup only \
                         within its parent's protection; install packaging/systemd/system.slice.d/40-regrade-protect.conf \
                         (NixOS: services.regrade.protect.memoryLow)",
                        mib(p),
                        f.slice,
                        mib(slice)
                    ),
                )
                .at(mib(slice), &f.slice)
            } else {
                found("memory protection", IN_PLACE, format!("{unit_name} {} protected, {} {}", mib(p), f.slice, mib(slice)))
                    .at(mib(p), unit_name)
            }
        }
    });
    match unit {
        Err(e) => out.push(found("OOM score", UNKNOWN, e)),
        Ok(u) if u.oom_score_adjust < 0 => out.push(
            found(
                "OOM score",
                IN_PLACE,
                format!("{unit_name} starts at OOMScoreAdjust={}, also during a restart", u.oom_score_adjust),
            )
            .at(u.oom_score_adjust, unit_name),
        ),
        Ok(u) => out.push(
            found(
                "OOM score",
                MISSING,
                format!(
                    "{unit_name} starts at OOMScoreAdjust={}: until its kubelet sets -999, k3s (etcd with it) is the \
                     OOM killer's likely pick, during every restart; {FIX_UNIT}",
                    u.oom_score_adjust
                ),
            )
            .at(u.oom_score_adjust, unit_name),
        ),
    }
    if let (Some(adj), Some(Ok(u))) = (f.main_oom_score_adj, &f.unit) {
        let state = if adj < 0 { IN_PLACE } else { MISSING };
        out.push(
            found("k3s process", state, format!("PID {} at oom_score_adj {adj} now", u.main_pid))
                .at(adj, format!("/proc/{}/oom_score_adj", u.main_pid)),
        );
    }
    let reserved = match &f.reserved {
        None => found("reserved memory", UNKNOWN, "k3s's configuration was not read".into()),
        Some(Err(e)) => found("reserved memory", UNKNOWN, format!("could not read k3s's configuration: {e}")),
        Some(Ok(r)) => reserved_memory(r, found("reserved memory", MISSING, String::new())),
    };
    let capped = matches!(reserved.state, IN_PLACE | LOWERED);
    out.push(reserved);
    // With the pods capped, the host-wide PSI counts their own thrash inside the cap,
    // which no step of this server relieves (docs/incident-vm.md, the reserved runs).
    if f.cgroup_v2_memory && capped {
        out.push(if f.psi_source == Path::new(crate::pressure::PROC_PSI) {
            found(
                "server's pressure",
                MISSING,
                format!(
                    "regrade reads PSI host-wide ({}), where the pods' thrash inside their reserved cap counts as \
                     this server's and steps it for nothing; set pressure.source = \"{SERVER_PSI}\" (NixOS: the \
                     default while protect.systemReservedMemory is set)",
                    f.psi_source.display()
                ),
            )
        } else {
            found("server's pressure", IN_PLACE, format!("regrade reads PSI from {}", f.psi_source.display()))
                .at(f.psi_source.display(), "pressure.source")
        });
    }
    out
}

/// The reserved-memory finding (`blank` filled in): in force (or lowering a larger
/// reservation it replaced), shadowed by a later file's plain `kubelet-arg:`, or missing.
fn reserved_memory(r: &ReservedMemory, blank: Finding) -> Finding {
    let bytes = |q: &str| kubelet::quantity_bytes(q).unwrap_or(0);
    match (&r.in_force, r.shadowed.first()) {
        (Some(m), _) => {
            // Larger than what the kubelet ends with: lowered (a larger one after it is not).
            let lowered = r.replaced.iter().find(|x| bytes(&x.value) > bytes(&m.value));
            let (state, words) = match lowered {
                Some(x) => (
                    LOWERED,
                    format!(
                        "the kubelet reserves memory={} from {}, which replaces the larger memory={} of {} (the \
                         kubelet keeps the last value of a key): remove the smaller one, or make it at least as large; \
                         packaging/k3s/40-regrade-reserved.yaml is not for a host that reserves memory already",
                        m.value, m.from, x.value, x.from
                    ),
                ),
                None => (IN_PLACE, format!("the kubelet reserves memory={} for the system, from {}", m.value, m.from)),
            };
            Finding { state, words, ..blank }.at(&m.value, &m.from)
        }
        (None, Some((value, was_in, by))) => Finding {
            state: SHADOWED,
            words: format!(
                "system-reserved memory={value} in {} is not passed to the kubelet: {}, read after it, sets \
                 kubelet-arg without `+`, which replaces every earlier kubelet-arg; write `kubelet-arg+:` there \
                 (or name the reservation in it too). The pods may take all of RAM",
                was_in.display(),
                by.display()
            ),
            shadowed_by: Some(by.display().to_string()),
            ..blank
        }
        .at(value, was_in.display()),
        (None, None) => Finding {
            words: "no system-reserved memory for the kubelet: the pods may take all of RAM; install \
                    packaging/k3s/40-regrade-reserved.yaml into k3s's config.yaml.d (NixOS: \
                    services.regrade.protect.systemReservedMemory); k3s reads it at its next start"
                .into(),
            ..blank
        },
    }
}

/// Reads what [`judge`] needs: systemd over D-Bus (bounded by `systemd.call_timeout`),
/// the cgroup files, the main process's `oom_score_adj`, k3s's config files.
pub async fn survey(cfg: &SystemdConfig, psi_source: &Path) -> Vec<Finding> {
    let mut f = Facts {
        cgroup_v2_memory: cgroup_v2_memory(Path::new("/sys/fs/cgroup")),
        psi_source: psi_source.to_path_buf(),
        ..Default::default()
    };
    let systemd = Systemd::connect(&cfg.unit, cfg.call_timeout.0).await;
    let unit = match &systemd {
        Ok(s) => s.protection().await,
        Err(e) => Err(anyhow::anyhow!("{e:#}")),
    };
    let unit = unit.map_err(|e| format!("{e:#}"));
    if let Ok(u) = &unit {
        let cgroup = Path::new("/sys/fs/cgroup").join(u.control_group.trim_start_matches('/'));
        if let Some(slice) = cgroup.parent() {
            f.slice = slice.file_name().map_or("its slice".into(), |n| n.to_string_lossy().into_owned());
            if f.cgroup_v2_memory {
                f.slice_low = read_bytes(&slice.join("memory.low"));
                f.slice_min = read_bytes(&slice.join("memory.min"));
            }
        }
        if u.main_pid != 0 {
            f.main_oom_score_adj = std::fs::read_to_string(format!("/proc/{}/oom_score_adj", u.main_pid))
                .ok()
                .and_then(|s| s.trim().parse().ok());
        }
    }
    f.unit = Some(unit);
    f.reserved = Some(read_reserved(cfg, systemd.as_ref().ok()).await);
    judge(&f, &cfg.unit)
}

/// The reserved-memory finding alone (for `watch`'s metrics at its start): its state,
/// and the bytes in force.
pub async fn reserved_memory_now(cfg: &SystemdConfig) -> (&'static str, Option<u64>) {
    let systemd = Systemd::connect(&cfg.unit, cfg.call_timeout.0).await.ok();
    let f = Facts { reserved: Some(read_reserved(cfg, systemd.as_ref()).await), ..Default::default() };
    let found = judge(&f, &cfg.unit).into_iter().find(|x| x.protection == "reserved memory");
    let found = found.expect("judge always says the reserved memory");
    let in_force = matches!(found.state, IN_PLACE | LOWERED);
    let bytes = found.value.filter(|_| in_force).and_then(|v| kubelet::quantity_bytes(&v)).map(|b| b as u64);
    (found.state, bytes)
}

/// The kubelet's reserved memory from k3s's configuration, with the unit's command line
/// and environment from systemd (without it, the files alone).
async fn read_reserved(cfg: &SystemdConfig, systemd: Option<&Systemd>) -> Result<ReservedMemory, String> {
    let inv = match systemd {
        Some(s) => s.invocation().await.unwrap_or_default(),
        None => Default::default(),
    };
    let eff = super::k3s_flags::effective(&cfg.dropin, &Default::default(), &inv, None);
    eff.map(|e| ReservedMemory::of(&e)).map_err(|e| format!("{e:#}"))
}

fn cgroup_v2_memory(root: &Path) -> bool {
    std::fs::read_to_string(root.join("cgroup.controllers")).is_ok_and(|c| c.split_whitespace().any(|w| w == "memory"))
}

/// A cgroup v2 size file: bytes, or `max`.
fn read_bytes(path: &Path) -> Option<u64> {
    let s = std::fs::read_to_string(path).ok()?;
    match s.trim() {
        "max" => Some(u64::MAX),
        n => n.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k3s_config::Source;

    fn unit(low: u64, oom: i32) -> UnitProtection {
        UnitProtection {
            memory_low: low,
            memory_min: 0,
            oom_score_adjust: oom,
            main_pid: 42,
            control_group: "/system.slice/k3s.service".into(),
        }
    }

    fn states(f: &Facts) -> Vec<(&'static str, &'static str)> {
        judge(f, "k3s.service").into_iter().map(|x| (x.protection, x.state)).collect()
    }

    #[test]
    fn each_protection_is_said_in_place_or_missing_with_what_to_do() {
        let all = Facts {
            cgroup_v2_memory: true,
            unit: Some(Ok(unit(512 << 20, -999))),
            slice_low: Some(512 << 20),
            slice_min: Some(0),
            slice: "system.slice".into(),
            main_oom_score_adj: Some(-999),
            reserved: Some(Ok(ReservedMemory {
                in_force: Some(MapEntry {
                    value: "768Mi".into(),
                    from: Source::File("/etc/rancher/k3s/config.yaml.d/40-regrade-reserved.yaml".into()),
                }),
                ..Default::default()
            })),
            psi_source: SERVER_PSI.into(),
        };
        assert_eq!(
            states(&all),
            [
                ("memory protection", IN_PLACE),
                ("OOM score", IN_PLACE),
                ("k3s process", IN_PLACE),
                ("reserved memory", IN_PLACE),
                ("server's pressure", IN_PLACE)
            ]
        );
        // The pods capped, the PSI read host-wide: their thrash would step the server.
        let host_wide = Facts { psi_source: crate::pressure::PROC_PSI.into(), ..all.clone() };
        let w = &judge(&host_wide, "k3s.service")[4];
        assert_eq!(w.state, MISSING);
        assert!(w.words.contains(SERVER_PSI), "{w:?}");
        let none = Facts {
            unit: Some(Ok(unit(0, 0))),
            slice_low: Some(0),
            main_oom_score_adj: Some(0),
            reserved: Some(Ok(ReservedMemory::default())),
            ..all.clone()
        };
        let words = judge(&none, "k3s.service");
        assert!(words.iter().all(|w| w.state == MISSING) && words.len() == 4, "{words:?}");
        assert!(
            words[0].words.contains("40-regrade-protect.conf") && words[1].words.contains("OOMScoreAdjust=0"),
            "{words:?}"
        );
        assert!(words[3].words.contains("40-regrade-reserved.yaml"), "{words:?}");
        // The unit protected, its slice not: the kernel would not honour it.
        let slice_bare = Facts { slice_low: Some(0), ..all.clone() };
        let w = &judge(&slice_bare, "k3s.service")[0];
        assert_eq!(w.state, MISSING);
        assert!(w.words.contains("system.slice only 0 MiB") && w.words.contains("system.slice.d"), "{w:?}");
        // cgroup v1: memory protection does not exist here, and says so.
        let v1 = Facts { cgroup_v2_memory: false, ..host_wide.clone() };
        assert_eq!(states(&v1)[0], ("memory protection", NOT_HERE));
        // cgroup v1 has no PSI per cgroup: host-wide is the only reading, nothing to say.
        assert_eq!(states(&v1).len(), 4);
        // The kubelet has set -999 on the process, the unit has no OOMScoreAdjust: the
        // window of a restart is still open.
        let window = Facts { unit: Some(Ok(unit(512 << 20, 0))), ..all.clone() };
        assert_eq!(states(&window)[1..3], [("OOM score", MISSING), ("k3s process", IN_PLACE)]);
        // systemd not reachable: said, nothing guessed, and what the files say still said.
        let unreachable = Facts { unit: Some(Err("no bus".into())), ..all };
        assert_eq!(
            states(&unreachable),
            [
                ("memory protection", UNKNOWN),
                ("OOM score", UNKNOWN),
                ("reserved memory", IN_PLACE),
                ("server's pressure", IN_PLACE)
            ]
        );
        let v1_unreachable = Facts { cgroup_v2_memory: false, ..unreachable };
        assert_eq!(states(&v1_unreachable)[0], ("memory protection", NOT_HERE));
    }

    #[test]
    fn cgroup_files_are_read_as_the_kernel_writes_them() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("cgroup.controllers"), "cpuset cpu io memory pids\n").unwrap();
        assert!(cgroup_v2_memory(d.path()));
        std::fs::write(d.path().join("cgroup.controllers"), "cpu io\n").unwrap();
        assert!(!cgroup_v2_memory(d.path()) && !cgroup_v2_memory(&d.path().join("absent")));
        std::fs::write(d.path().join("memory.low"), "max\n").unwrap();
        assert_eq!(read_bytes(&d.path().join("memory.low")), Some(u64::MAX));
    }

    /// k3s's configuration read as k3s reads it: the reservation in force with its
    /// value and file, shadowed by a later file's plain `kubelet-arg:` (the review's
    /// proof, issue 58), lowering an operator's larger one, or missing.
    #[test]
    fn the_reservation_is_judged_as_the_kubelet_gets_it() {
        let d = tempfile::tempdir().unwrap();
        let dropins = d.path().join("config.yaml.d");
        std::fs::create_dir(&dropins).unwrap();
        let judged = || {
            let dropin = dropins.join("50-regrade.yaml");
            let eff = super::super::k3s_flags::effective(&dropin, &Default::default(), &Default::default(), None);
            let facts = Facts { reserved: Some(Ok(ReservedMemory::of(&eff.unwrap()))), ..Default::default() };
            judge(&facts, "k3s.service").into_iter().find(|f| f.protection == "reserved memory").unwrap()
        };
        assert_eq!(judged().state, MISSING);
        let ours = dropins.join("40-regrade-reserved.yaml");
        std::fs::write(&ours, "kubelet-arg+:\n  - \"system-reserved=memory=768Mi\"\n").unwrap();
        let f = judged();
        assert_eq!((f.state, f.value.as_deref()), (IN_PLACE, Some("768Mi")), "{f:?}");
        assert_eq!(f.source.as_deref(), Some(ours.to_str().unwrap()));
        let site = dropins.join("90-site.yaml");
        std::fs::write(&site, "kubelet-arg: [max-pods=50]\n").unwrap();
        let f = judged();
        assert_eq!(f.state, SHADOWED, "{f:?}");
        assert_eq!(f.shadowed_by.as_deref(), Some(site.to_str().unwrap()));
        assert!(f.words.contains(site.to_str().unwrap()) && f.words.contains("kubelet-arg+"), "{f:?}");
        std::fs::remove_file(&site).unwrap();
        std::fs::write(d.path().join("config.yaml"), "kubelet-arg: [\"system-reserved=memory=2Gi\"]\n").unwrap();
        let f = judged();
        assert_eq!((f.state, f.value.as_deref()), (LOWERED, Some("768Mi")), "{f:?}");
        assert!(f.words.contains("2Gi") && f.words.contains("config.yaml"), "{f:?}");
        // A larger reservation after a smaller one raises it: in place. And a larger one
        // still after the smaller: in place, at the last one's value.
        std::fs::write(d.path().join("config.yaml"), "kubelet-arg: [\"system-reserved=memory=512Mi\"]\n").unwrap();
        assert_eq!(judged().state, IN_PLACE);
        let late = dropins.join("60-more.yaml");
        std::fs::write(d.path().join("config.yaml"), "kubelet-arg: [\"system-reserved=memory=2Gi\"]\n").unwrap();
        std::fs::write(&late, "kubelet-arg+: [\"system-reserved=memory=3Gi\"]\n").unwrap();
        let f = judged();
        assert_eq!((f.state, f.value.as_deref()), (IN_PLACE, Some("3Gi")), "{f:?}");
        std::fs::remove_file(&late).unwrap();
        // k3s's configuration unreadable: said, not guessed.
        std::fs::write(dropins.join("60-broken.yaml"), "kubelet-arg: [\n").unwrap();
        let f = judged_unreadable(&dropins);
        assert!(f.state == UNKNOWN && f.words.contains("60-broken.yaml"), "{f:?}");
    }

    fn judged_unreadable(dropins: &Path) -> Finding {
        let eff = super::super::k3s_flags::effective(
            &dropins.join("50-regrade.yaml"),
            &Default::default(),
            &Default::default(),
            None,
        );
        let facts = Facts {
            reserved: Some(eff.map(|e| ReservedMemory::of(&e)).map_err(|e| format!("{e:#}"))),
            ..Default::default()
        };
        judge(&facts, "k3s.service").into_iter().find(|f| f.protection == "reserved memory").unwrap()
    }
}
