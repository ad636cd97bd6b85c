//! The local etcd member's columns of a trace, after the pressure columns:
//! `record --etcd-member` writes them from what [`crate::etcd::member::look`] sees at its
//! metrics listener (`etcd.metrics_url`), and `simulate` reads them by name for the plot.
//! The replay gives the core each row's look (or the last one, while it is fresh), as
//! `watch` gives it its last look: with `etcd.distress_overrides_floor`, a member in
//! distress makes PSI over the threshold over whatever the floor says. `record` looks
//! every row, each request within 45 % of the interval, where `watch` looks every
//! `etcd.metrics_interval` within `etcd.request_timeout`: a trace recorded at 1 s sees
//! a slow member as "not healthy" sooner than `watch` would.

use std::io::Write;
use std::time::Duration;

use anyhow::bail;

use crate::actuator::etcd_health::HealthUrl;
use crate::etcd::member::{look, MemberView, Scrape};
use crate::etcd::EtcdConfig;

/// In the order `record` writes them. The p99s are over the interval since the last
/// row the member answered (from the histograms' bucket deltas); the counters are as
/// the member reported them (since it started).
pub const MEMBER_COLUMNS: [&str; 6] = [
    "etcd_healthy",
    "etcd_wal_fsync_p99_ms",
    "etcd_backend_commit_p99_ms",
    "etcd_heartbeat_send_failures",
    "etcd_slow_applies",
    "etcd_leader_changes",
];

/// One row's member cells; `None` is an empty cell.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MemberCells {
    /// `/health` said true (1) or false or did not answer in time (0); empty: nothing
    /// answered at all (connection refused: the member is not running).
    pub healthy: Option<bool>,
    /// Empty: no fsync (commit) in the interval, no row before, or no `/metrics`.
    pub wal_fsync_p99_ms: Option<f64>,
    pub backend_commit_p99_ms: Option<f64>,
    /// Empty: no `/metrics`.
    pub heartbeat_send_failures: Option<u64>,
    pub slow_applies: Option<u64>,
    pub leader_changes: Option<u64>,
}

impl MemberCells {
    /// What one look saw; `scrape` is its `/metrics`, if it answered.
    pub fn from_look(view: &MemberView, scrape: Option<&Scrape>) -> MemberCells {
        let ms = |s: Option<f64>| s.map(|s| s * 1000.0);
        MemberCells {
            healthy: view.healthy,
            wal_fsync_p99_ms: ms(view.wal_fsync_p99),
            backend_commit_p99_ms: ms(view.backend_commit_p99),
            heartbeat_send_failures: scrape.map(|s| s.heartbeat_failures),
            slow_applies: scrape.map(|s| s.slow_applies),
            leader_changes: scrape.map(|s| s.leader_changes),
        }
    }

    /// Whether the row had a look that answered anything (all empty: no look, or
    /// nothing listening).
    pub fn looked(&self) -> bool {
        *self != MemberCells::default()
    }

    /// The core's view of this look.
    pub fn signals(&self) -> crate::decide::MemberSignals {
        let ms = |v: Option<f64>| v.map(|ms| Duration::from_secs_f64(ms / 1000.0));
        crate::decide::MemberSignals {
            healthy: self.healthy,
            wal_fsync_p99: ms(self.wal_fsync_p99_ms),
            backend_commit_p99: ms(self.backend_commit_p99_ms),
        }
    }

    /// The cells, each after a comma, in [`MEMBER_COLUMNS`]' order.
    pub fn write(&self, out: &mut impl Write) -> std::io::Result<()> {
        let healthy = self.healthy.map(|h| if h { "1" } else { "0" }).unwrap_or("");
        write!(out, ",{healthy}")?;
        for p in [self.wal_fsync_p99_ms, self.backend_commit_p99_ms] {
            match p {
                Some(ms) => write!(out, ",{ms:.3}")?,
                None => write!(out, ",")?,
            }
        }
        for c in [self.heartbeat_send_failures, self.slow_applies, self.leader_changes] {
            match c {
                Some(n) => write!(out, ",{n}")?,
                None => write!(out, ",")?,
            }
        }
        Ok(())
    }
}

/// Where a trace's header put the member columns (any of them, in any order).
#[derive(Clone, Copy, Debug)]
pub struct MemberColumns([Option<usize>; 6]);

impl MemberColumns {
    /// `None` when the header names none of them.
    pub fn find(names: &[&str]) -> Option<MemberColumns> {
        let at = MEMBER_COLUMNS.map(|c| names.iter().position(|n| *n == c));
        at.iter().any(Option::is_some).then_some(MemberColumns(at))
    }

    /// One row's cells; a cell that is neither empty nor a value of its column is an
    /// error naming the line and the column.
    pub fn read(&self, cells: &[&str], lineno: usize) -> anyhow::Result<MemberCells> {
        let cell = |i: usize| self.0[i].map(|c| cells[c]).filter(|v| !v.is_empty());
        let bad = |i: usize, v: &str, what: &str| -> anyhow::Error {
            anyhow::anyhow!("line {lineno}: {}: {v:?} is not {what}", MEMBER_COLUMNS[i])
        };
        let healthy = match cell(0) {
            None => None,
            Some("1") => Some(true),
            Some("0") => Some(false),
            Some(v) => return Err(bad(0, v, "1 (healthy), 0 (not) or empty (no answer)")),
        };
        let ms = |i: usize| -> anyhow::Result<Option<f64>> {
            let Some(v) = cell(i) else { return Ok(None) };
            match v.parse::<f64>() {
                Ok(ms) if ms.is_finite() && ms >= 0.0 => Ok(Some(ms)),
                _ => Err(bad(i, v, "milliseconds (0 or more) or empty")),
            }
        };
        let count = |i: usize| -> anyhow::Result<Option<u64>> {
            cell(i).map(|v| v.parse::<u64>().map_err(|_| bad(i, v, "a count (0, 1, 2 ...) or empty"))).transpose()
        };
        Ok(MemberCells {
            healthy,
            wal_fsync_p99_ms: ms(1)?,
            backend_commit_p99_ms: ms(2)?,
            heartbeat_send_failures: count(3)?,
            slow_applies: count(4)?,
            leader_changes: count(5)?,
        })
    }
}

/// `record`'s looks at the member: a runtime of its own on `record`'s thread, and the
/// scrape before (for the interval's deltas).
pub struct Looker {
    runtime: tokio::runtime::Runtime,
    url: HealthUrl,
    request_timeout: Duration,
    earlier: Option<Scrape>,
    warned: bool,
}

/// A look given less than this per request is not made: it could only say "no answer".
const LEAST_PER_REQUEST: Duration = Duration::from_millis(20);

impl Looker {
    pub fn new(etcd: &EtcdConfig) -> anyhow::Result<Looker> {
        let Some(url) = etcd.metrics_url() else {
            bail!("--etcd-member: etcd.metrics_url is empty, so there is no member to look at");
        };
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        Ok(Looker { runtime, url: url?, request_timeout: etcd.request_timeout.0, earlier: None, warned: false })
    }

    /// One look, done within `budget` (the time left until the next row is due): each of
    /// its two requests gets `etcd.request_timeout` or 45 % of the budget, whichever is
    /// shorter. A member that does not answer leaves empty cells and is named on stderr
    /// once.
    pub fn look(&mut self, budget: Duration) -> MemberCells {
        // Both requests and what is around them fit in the budget.
        let each = self.request_timeout.min(budget * 9 / 20);
        if each < LEAST_PER_REQUEST {
            return MemberCells::default();
        }
        let (view, scrape) = self.runtime.block_on(look(&self.url, each, self.earlier.as_ref()));
        let cells = MemberCells::from_look(&view, scrape.as_ref());
        if scrape.is_some() {
            self.earlier = scrape;
        }
        let trouble = match (&view.healthy, &view.metrics_error) {
            (None, _) => Some(view.health.as_str()),
            (_, Some(e)) => Some(e.as_str()),
            _ => None,
        };
        if let (Some(why), false) = (trouble, self.warned) {
            self.warned = true;
            tracing::warn!(
                url = %self.url,
                "the etcd member does not answer ({why}): its columns stay empty while it does not (said once)"
            );
        }
        cells
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(header: &str, row: &str) -> anyhow::Result<Option<MemberCells>> {
        let names: Vec<&str> = header.split(',').collect();
        let cells: Vec<&str> = row.split(',').collect();
        MemberColumns::find(&names).map(|c| c.read(&cells, 7)).transpose()
    }

    #[test]
    fn the_columns_are_read_by_name_and_empty_cells_are_unknown() {
        let all = MEMBER_COLUMNS.join(",");
        let got = read(&all, "1,2.5,0.125,3,0,12").unwrap().unwrap();
        assert_eq!(
            got,
            MemberCells {
                healthy: Some(true),
                wal_fsync_p99_ms: Some(2.5),
                backend_commit_p99_ms: Some(0.125),
                heartbeat_send_failures: Some(3),
                slow_applies: Some(0),
                leader_changes: Some(12),
            }
        );
        assert_eq!(read(&all, ",,,,,").unwrap().unwrap(), MemberCells::default());
        assert_eq!(read(&all, "0,,,,,").unwrap().unwrap().healthy, Some(false));
        // Any order, any subset; a header without them has none.
        let got = read("etcd_leader_changes,t,etcd_healthy", "4,9,0").unwrap().unwrap();
        assert_eq!((got.healthy, got.leader_changes, got.slow_applies), (Some(false), Some(4), None));
        assert!(read("t,some_avg10", "0,1").unwrap().is_none());
    }

    #[test]
    fn a_bad_cell_names_the_line_and_the_column() {
        let all = MEMBER_COLUMNS.join(",");
        for (row, column) in [
            ("yes,,,,,", "etcd_healthy"),
            ("2,,,,,", "etcd_healthy"),
            (",x,,,,", "etcd_wal_fsync_p99_ms"),
            (",,-1,,,", "etcd_backend_commit_p99_ms"),
            (",,inf,,,", "etcd_backend_commit_p99_ms"),
            (",,,1.5,,", "etcd_heartbeat_send_failures"),
            (",,,,-2,", "etcd_slow_applies"),
            (",,,,,z", "etcd_leader_changes"),
        ] {
            let e = format!("{:#}", read(&all, row).unwrap_err());
            assert!(e.starts_with(&format!("line 7: {column}: ")), "{row:?}: {e}");
        }
    }

    #[test]
    fn cells_are_written_as_they_are_read_back() {
        let c = MemberCells {
            healthy: Some(false),
            wal_fsync_p99_ms: Some(7.96),
            backend_commit_p99_ms: None,
            heartbeat_send_failures: Some(2),
            slow_applies: None,
            leader_changes: Some(0),
        };
        let mut out = vec![];
        c.write(&mut out).unwrap();
        let row = String::from_utf8(out).unwrap();
        assert_eq!(row, ",0,7.960,,2,,0");
        assert_eq!(read(&MEMBER_COLUMNS.join(","), &row[1..]).unwrap().unwrap(), c);
        let mut out = vec![];
        MemberCells::default().write(&mut out).unwrap();
        assert_eq!(out, b",,,,,,");
    }
}
