//! Whose memory it is: the children of a cgroup v2 slice (`system.slice` by default:
//! k3s, regrade and every other host service beside them), each one's
//! `memory.current`, `memory.pressure` and `memory.events`, and which of them grows.
//! So `status`, the metrics and the journal can say "leaky-backup.service: 1.35 GiB,
//! growing 16.0 MiB/s" where PSI says only that memory stalls.
//!
//! Read off the per-sample path, only when asked: by `watch`'s looking task while it
//! is pressed (`watch::looks`), by a scrape, by `status`. A reading lists the slice's
//! directory and reads three small files per child: a few hundred µs for tens of
//! units, kernel memory only (cgroupfs), nothing that waits on the disk.
//!
//! What grows is judged against the reading before (its age is the window): a unit
//! grows at `GROWING_RATE` or more, by `GROWING_AT_LEAST` or more. Only a growing unit
//! is named as growing; the largest is named as the largest, whatever it is (k3s,
//! most often), never as the one growing unless it does.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

/// A unit grows when its `memory.current` rose at least this fast over the window ...
pub const GROWING_RATE: f64 = (1 << 20) as f64;
/// ... and by at least this much (a page-cache flutter over a 1 s window is not growth).
pub const GROWING_AT_LEAST: u64 = 4 << 20;

/// `[census]`
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CensusConfig {
    /// The cgroup v2 slice whose children are read. Empty: none read.
    pub slice: PathBuf,
}

impl Default for CensusConfig {
    fn default() -> Self {
        CensusConfig { slice: PathBuf::from("/sys/fs/cgroup/system.slice") }
    }
}

impl CensusConfig {
    /// `None`: not read.
    pub fn slice(&self) -> Option<&Path> {
        (!self.slice.as_os_str().is_empty()).then_some(self.slice.as_path())
    }
}

/// One child of the slice.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UnitMemory {
    /// Its directory's name: the unit (`k3s.service`), scope or slice.
    pub unit: String,
    /// `memory.current`, bytes.
    pub current: u64,
    /// Bytes a second over the window; `None`: not known (new, or no reading before).
    pub growth: Option<f64>,
    /// Bytes it grew over the window (0 when it shrank); `None`: not known.
    pub grew: Option<u64>,
    /// `memory.pressure`: its own tasks' stall, `some` and `full` avg10, percent.
    pub some_avg10: Option<f64>,
    pub full_avg10: Option<f64>,
    /// `memory.events` (since the cgroup was made): reclaim over `memory.high`, hits
    /// of `memory.max`, OOMs, OOM kills.
    pub high: u64,
    pub max: u64,
    pub oom: u64,
    pub oom_kill: u64,
}

impl UnitMemory {
    pub fn is_growing(&self) -> bool {
        self.growth.is_some_and(|g| g >= GROWING_RATE) && self.grew.is_some_and(|b| b >= GROWING_AT_LEAST)
    }
}

/// One reading of the slice: its children, largest first.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Census {
    pub slice: String,
    /// Unix seconds of the reading.
    pub at: f64,
    /// Seconds since the reading growth is judged against; `None`: none before.
    pub window: Option<f64>,
    pub units: Vec<UnitMemory>,
    /// The process that read it (the published file is void once it is gone).
    #[serde(default)]
    pub pid: u32,
}

impl Census {
    /// Reads `slice`'s children at `at`, growth judged against `earlier`. A child
    /// without a readable `memory.current` is left out; a slice with none at all is
    /// an error (not cgroup v2, or no memory controller there).
    pub fn read(slice: &Path, at: SystemTime, earlier: Option<&Census>) -> anyhow::Result<Census> {
        let entries = std::fs::read_dir(slice)
            .map_err(|e| anyhow::anyhow!("census.slice = {:?}: {e} (cgroup v2 only)", slice.display()))?;
        let mut units = Vec::new();
        for e in entries.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let dir = e.path();
            let Some(current) = read_u64(&dir.join("memory.current")) else { continue };
            let mut u =
                UnitMemory { unit: e.file_name().to_string_lossy().into_owned(), current, ..Default::default() };
            if let Ok(text) = std::fs::read_to_string(dir.join("memory.pressure")) {
                (u.some_avg10, u.full_avg10) = avg10s(&text);
            }
            if let Ok(text) = std::fs::read_to_string(dir.join("memory.events")) {
                for line in text.lines() {
                    let mut kv = line.split_whitespace();
                    let (Some(k), Some(v)) = (kv.next(), kv.next().and_then(|v| v.parse().ok())) else { continue };
                    match k {
                        "high" => u.high = v,
                        "max" => u.max = v,
                        "oom" => u.oom = v,
                        "oom_kill" => u.oom_kill = v,
                        _ => {}
                    }
                }
            }
            units.push(u);
        }
        if units.is_empty() {
            anyhow::bail!(
                "census.slice = {:?}: no child with a memory.current (cgroup v2 with the memory controller only)",
                slice.display()
            );
        }
        let mut c = Census {
            slice: slice.display().to_string(),
            at: crate::statefile::unix(at),
            window: None,
            units,
            pid: std::process::id(),
        };
        c.judge(earlier);
        Ok(c)
    }

    /// Growth against `earlier` (a unit in both), and the order: largest first.
    pub fn judge(&mut self, earlier: Option<&Census>) {
        let window = earlier.map(|e| self.at - e.at).filter(|w| *w > 0.0);
        self.window = window;
        for u in &mut self.units {
            let before = earlier.and_then(|e| e.units.iter().find(|b| b.unit == u.unit));
            u.grew = before.map(|b| u.current.saturating_sub(b.current));
            u.growth = window.zip(before).map(|(w, b)| (u.current as f64 - b.current as f64) / w);
        }
        self.units.sort_by(|a, b| b.current.cmp(&a.current).then_with(|| a.unit.cmp(&b.unit)));
    }

    pub fn largest(&self) -> Option<&UnitMemory> {
        self.units.first()
    }

    /// The unit growing fastest, if any grows.
    pub fn growing(&self) -> Option<&UnitMemory> {
        self.units.iter().filter(|u| u.is_growing()).max_by(|a, b| a.growth.partial_cmp(&b.growth).unwrap())
    }

    /// One line: the unit growing (or that none does) and the largest.
    pub fn summary(&self) -> String {
        let slice = Path::new(&self.slice).file_name().map_or(self.slice.clone(), |n| n.to_string_lossy().into());
        let largest = self.largest().map_or(String::new(), |l| format!("largest {}: {}", l.unit, bytes(l.current)));
        match (self.growing(), self.window) {
            (Some(g), _) => {
                let kills = if g.oom_kill > 0 { format!(", {} OOM kills", g.oom_kill) } else { String::new() };
                let rate = g.growth.unwrap_or_default();
                let mut line = format!("{}: {}, growing {}/s{kills}", g.unit, bytes(g.current), bytes(rate as u64));
                if self.largest().is_some_and(|l| l.unit != g.unit) {
                    line += &format!("; {largest}");
                }
                line
            }
            (None, Some(w)) => format!("none in {slice} growing over {w:.0} s; {largest}"),
            (None, None) => format!("{largest} (growth not known yet)"),
        }
    }
}

/// Bytes as an operator reads them: GiB with two decimals, MiB whole, else KiB.
pub fn bytes(b: u64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    let b = b as f64;
    if b >= 1024.0 * MIB {
        format!("{:.2} GiB", b / (1024.0 * MIB))
    } else if b >= MIB {
        format!("{:.0} MiB", b / MIB)
    } else {
        format!("{:.0} KiB", b / 1024.0)
    }
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `some` and `full` avg10 of a pressure file.
fn avg10s(text: &str) -> (Option<f64>, Option<f64>) {
    let avg10 = |prefix: &str| {
        let line = text.lines().find(|l| l.starts_with(prefix))?;
        line.split_whitespace().find_map(|f| f.strip_prefix("avg10="))?.parse().ok()
    };
    (avg10("some "), avg10("full "))
}

/// Where `watch` publishes its last census for `status`: beside the state file.
pub fn path_for(state_file: &Path) -> PathBuf {
    state_file.with_file_name("units.json")
}

/// The published census, if the `watch` that wrote it still runs.
pub fn read_live(state_file: &Path) -> Option<Census> {
    let c: Census = serde_json::from_slice(&std::fs::read(path_for(state_file)).ok()?).ok()?;
    crate::statefile::alive(c.pid).then_some(c)
}

/// `watch`'s reader: each census judged against the one before, published to the
/// metrics and (unless `state_file` is `None`, a dry run) for `status`; the journal
/// told when the unit growing changes.
pub struct Reader {
    slice: PathBuf,
    state_file: Option<PathBuf>,
    last: Option<Census>,
    /// The unit last said to be growing, so the journal hears each change once.
    said: Option<String>,
    /// Said once that the slice cannot be read; then not tried again.
    failed: bool,
}

impl Reader {
    pub fn new(slice: PathBuf, state_file: Option<PathBuf>) -> Reader {
        Reader { slice, state_file, last: None, said: None, failed: false }
    }

    /// One census, published; the journal is told when the unit growing changes.
    pub fn read_and_publish(&mut self) {
        if self.failed {
            return;
        }
        let c = match Census::read(&self.slice, SystemTime::now(), self.last.as_ref()) {
            Ok(c) => c,
            Err(e) => {
                tracing::info!("not naming whose memory grows: {e:#}");
                self.failed = true;
                return;
            }
        };
        crate::metrics::METRICS.units_read(crate::metrics::UnitsLook {
            largest: c.largest().map(|l| (l.unit.clone(), l.current)),
            growing: c.growing().map(|g| (g.unit.clone(), g.current, g.growth.unwrap_or_default())),
        });
        if let Some(state_file) = &self.state_file {
            let path = path_for(state_file);
            let written = serde_json::to_vec_pretty(&c)
                .map_err(std::io::Error::other)
                .and_then(|j| crate::fsutil::publish_atomic(&path, &j, 0o644));
            if let Err(e) = written {
                tracing::warn!(error = %e, path = %path.display(), "could not publish the units' memory");
            }
        }
        let growing = c.growing().map(|g| g.unit.clone());
        if growing.is_some() && growing != self.said {
            tracing::info!(slice = %c.slice, "whose memory grows: {}", c.summary());
        }
        self.said = growing;
        *LAST.lock().unwrap_or_else(|p| p.into_inner()) = Some((tokio::time::Instant::now(), c.summary()));
        self.last = Some(c);
    }
}

/// The last census's summary and when it was read (tokio's clock), for the journal
/// when a step is decided. Written by [`Reader`] only.
static LAST: std::sync::Mutex<Option<(tokio::time::Instant, String)>> = std::sync::Mutex::new(None);

/// The last census's summary if it is younger than `max_age`.
pub fn recent_summary(max_age: std::time::Duration) -> Option<String> {
    let last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    last.as_ref().filter(|(at, _)| at.elapsed() <= max_age).map(|(_, s)| s.clone())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Duration;

    /// A fake cgroup v2 slice: `units` as (name, memory.current, some avg10, oom_kill).
    pub(crate) fn slice(dir: &Path, units: &[(&str, u64, f64, u64)]) -> PathBuf {
        let slice = dir.join("system.slice");
        for (name, current, some, kills) in units {
            let d = slice.join(name);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("memory.current"), format!("{current}\n")).unwrap();
            std::fs::write(
                d.join("memory.pressure"),
                format!("some avg10={some:.2} avg60=0.00 avg300=0.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"),
            )
            .unwrap();
            std::fs::write(
                d.join("memory.events"),
                format!("low 0\nhigh 3\nmax 0\noom 0\noom_kill {kills}\noom_group_kill 0\n"),
            )
            .unwrap();
        }
        // What cgroupfs has beside the children: files, not directories.
        std::fs::write(slice.join("memory.current"), "1\n").unwrap();
        std::fs::write(slice.join("cgroup.procs"), "").unwrap();
        slice
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_unit_growing_is_named_and_the_largest_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let s = slice(dir.path(), &[("k3s.service", 812 * MIB, 0.0, 0), ("leaky-backup.service", 1222 * MIB, 35.5, 0)]);
        let first = Census::read(&s, t0, None).unwrap();
        assert_eq!(
            first.units.iter().map(|u| u.unit.as_str()).collect::<Vec<_>>(),
            ["leaky-backup.service", "k3s.service"]
        );
        assert_eq!(first.units[0].some_avg10, Some(35.5));
        assert_eq!(first.units[0].high, 3);
        assert!(first.growing().is_none(), "nothing before: growth not known");
        assert!(first.summary().contains("growth not known yet"), "{}", first.summary());
        // 10 s later: the backup 160 MiB more (16 MiB/s), k3s 2 MiB more (noise),
        // regrade new.
        let s = slice(
            dir.path(),
            &[
                ("k3s.service", 814 * MIB, 0.0, 0),
                ("leaky-backup.service", 1382 * MIB, 40.0, 1),
                ("regrade.service", 9 * MIB, 0.0, 0),
            ],
        );
        let later = Census::read(&s, t0 + Duration::from_secs(10), Some(&first)).unwrap();
        let g = later.growing().unwrap();
        assert_eq!((g.unit.as_str(), g.growth), ("leaky-backup.service", Some(16.0 * MIB as f64)));
        assert_eq!(later.summary(), "leaky-backup.service: 1.35 GiB, growing 16 MiB/s, 1 OOM kills");
        assert_eq!(later.units.iter().find(|u| u.unit == "regrade.service").unwrap().growth, None, "new: not known");
    }

    /// k3s the largest and growing a little, nothing else growing: no unit is named as
    /// growing, k3s only as the largest; growing faster than the rate, it is named.
    #[test]
    fn k3s_is_never_named_growing_unless_it_grows() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let before = Census::read(
            &slice(dir.path(), &[("k3s.service", 900 * MIB, 2.0, 0), ("journald.service", 60 * MIB, 0.0, 0)]),
            t0,
            None,
        )
        .unwrap();
        let after = |k3s: u64| {
            let s = slice(dir.path(), &[("k3s.service", k3s, 2.0, 0), ("journald.service", 61 * MIB, 0.0, 0)]);
            Census::read(&s, t0 + Duration::from_secs(10), Some(&before)).unwrap()
        };
        let calm = after(903 * MIB);
        assert!(calm.growing().is_none(), "{calm:?}");
        assert_eq!(calm.summary(), "none in system.slice growing over 10 s; largest k3s.service: 903 MiB");
        let shrinking = after(800 * MIB);
        assert!(shrinking.growing().is_none());
        let growing = after(1000 * MIB);
        assert_eq!(growing.growing().unwrap().unit, "k3s.service");
    }

    #[test]
    fn a_slice_without_memory_files_is_an_error_naming_the_key() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("system.slice/k3s.service")).unwrap();
        let e = format!("{:#}", Census::read(&dir.path().join("system.slice"), SystemTime::now(), None).unwrap_err());
        assert!(e.contains("census.slice") && e.contains("memory.current"), "{e}");
        let e = format!("{:#}", Census::read(&dir.path().join("nope"), SystemTime::now(), None).unwrap_err());
        assert!(e.contains("census.slice") && e.contains("cgroup v2"), "{e}");
    }

    #[test]
    fn sizes_read_as_an_operator_reads_them() {
        assert_eq!(bytes(1_449_551_462), "1.35 GiB");
        assert_eq!(bytes(812 * MIB), "812 MiB");
        assert_eq!(bytes(512 * 1024), "512 KiB");
    }
}
