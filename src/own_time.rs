//! regrade's own share of a step: of the time from the decision to a moment of the
//! step, how much regrade spent itself (running, waiting for a CPU, waiting for the
//! disk) rather than waiting for an answer from the API, etcd or systemd. Under
//! memory pressure the two differ by seconds, and only the first is regrade's to cut.
//!
//! Read from the kernel, per process: CPU time and major faults from `getrusage`
//! (every thread, exited ones too); the time each thread waited for a CPU
//! (`/proc/self/task/*/schedstat`) and for block I/O — page-ins, fsync — (field 42 of
//! `/proc/self/task/*/stat`). The kernel counts those two only with delay accounting on
//! (`kernel.task_delayacct = 1`, or `delayacct` on its command line); without it they
//! are left out, and the progress lines say so. A thread that exits between two
//! readings takes its waits with it (tokio's blocking threads live 10 s idle, longer
//! than a step's file work lasts before its next progress line).
//! Sleeping on a socket or a timer is waiting for someone else, and is not counted.

use std::time::{Duration, Instant};

/// Where the kernel says whether it counts delays.
const DELAYACCT: &str = "/proc/sys/kernel/task_delayacct";

/// The process's counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnTime {
    pub cpu: Duration,
    pub major_faults: u64,
    /// `None` when the kernel does not count delays.
    pub waits: Option<Waits>,
}

/// Time this process's threads waited, runnable, for a CPU, and blocked on block I/O.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Waits {
    pub for_cpu: Duration,
    pub for_disk: Duration,
}

impl OwnTime {
    /// The counters now.
    pub fn now() -> OwnTime {
        let (cpu, major_faults) = rusage();
        let counted = std::fs::read_to_string(DELAYACCT).is_ok_and(|s| s.trim() == "1");
        OwnTime { cpu, major_faults, waits: counted.then(thread_waits) }
    }

    /// What was spent from `earlier` to `self` (waits only if counted at both).
    pub fn since(&self, earlier: &OwnTime) -> OwnTime {
        let waits = match (self.waits, earlier.waits) {
            (Some(a), Some(b)) => Some(Waits {
                for_cpu: a.for_cpu.saturating_sub(b.for_cpu),
                for_disk: a.for_disk.saturating_sub(b.for_disk),
            }),
            _ => None,
        };
        OwnTime {
            cpu: self.cpu.saturating_sub(earlier.cpu),
            major_faults: self.major_faults.saturating_sub(earlier.major_faults),
            waits,
        }
    }

    /// Everything counted: CPU plus the waits when the kernel counts them.
    pub fn total(&self) -> Duration {
        self.cpu + self.waits.map_or(Duration::ZERO, |w| w.for_cpu + w.for_disk)
    }
}

/// When a step began (its decision) and regrade's counters then.
#[derive(Clone, Copy, Debug)]
pub struct StepClock {
    started: Instant,
    at_start: OwnTime,
}

impl StepClock {
    pub fn start() -> StepClock {
        StepClock { started: Instant::now(), at_start: OwnTime::now() }
    }

    /// A progress line of the step: the wall time since the decision (`after_ms`) and
    /// regrade's own share of it (`own_ms`, then its parts).
    pub fn progress(&self, what: &str) {
        let after_ms = self.started.elapsed().as_millis() as u64;
        let own = OwnTime::now().since(&self.at_start);
        let (own_ms, cpu_ms) = (own.total().as_millis() as u64, own.cpu.as_millis() as u64);
        match own.waits {
            Some(w) => tracing::info!(
                after_ms,
                own_ms,
                own_cpu_ms = cpu_ms,
                own_cpu_wait_ms = w.for_cpu.as_millis() as u64,
                own_disk_wait_ms = w.for_disk.as_millis() as u64,
                own_major_faults = own.major_faults,
                "{what}"
            ),
            None => tracing::info!(
                after_ms,
                own_ms,
                own_cpu_ms = cpu_ms,
                own_major_faults = own.major_faults,
                own_waits = "not counted (kernel.task_delayacct = 0)",
                "{what}"
            ),
        }
    }
}

/// CPU time (user + system) and major faults of the whole process.
fn rusage() -> (Duration, u64) {
    // SAFETY: getrusage fills the struct it is given and touches nothing else.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return (Duration::ZERO, 0);
    }
    let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    (tv(u.ru_utime) + tv(u.ru_stime), u.ru_majflt as u64)
}

/// The waits of every live thread, summed.
fn thread_waits() -> Waits {
    let mut sum = Waits::default();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return sum };
    let ticks = clock_ticks();
    for task in tasks.flatten() {
        let dir = task.path();
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        sum.for_cpu += cpu_wait(&read("schedstat")).unwrap_or_default();
        sum.for_disk += disk_wait(&read("stat"), ticks).unwrap_or_default();
    }
    sum
}

/// `schedstat`: time on a CPU, time runnable waiting for one (ns), timeslices.
fn cpu_wait(schedstat: &str) -> Option<Duration> {
    schedstat.split_whitespace().nth(1)?.parse().ok().map(Duration::from_nanos)
}

/// `stat` field 42, `delayacct_blkio_ticks`, in clock ticks. The name (field 2) may hold
/// spaces and parentheses: fields are counted after its last ')'.
fn disk_wait(stat: &str, ticks_per_s: u64) -> Option<Duration> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let ticks: u64 = after_name.split_whitespace().nth(42 - 3)?.parse().ok()?;
    Some(Duration::from_millis(ticks * 1000 / ticks_per_s.max(1)))
}

fn clock_ticks() -> u64 {
    // SAFETY: sysconf reads a constant.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).max(1) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_for_a_cpu_is_schedstats_second_figure() {
        assert_eq!(cpu_wait("699653 85117 2\n"), Some(Duration::from_nanos(85117)));
        assert_eq!(cpu_wait("699653"), None);
    }

    #[test]
    fn the_disk_wait_is_field_42_counted_after_the_name() {
        // A name with spaces and a ')' of its own; fields 3.. after it, 42 = 7 ticks.
        let mut fields: Vec<String> = (3..=52).map(|i| if i == 42 { "7".into() } else { i.to_string() }).collect();
        fields[0] = "S".into();
        let stat = format!("1234 (tokio ) x) {}", fields.join(" "));
        assert_eq!(disk_wait(&stat, 100), Some(Duration::from_millis(70)));
        assert_eq!(disk_wait("1234 (short) S 1 2", 100), None);
    }

    #[test]
    fn since_subtracts_and_leaves_out_waits_not_counted_at_both_ends() {
        let w = |c, d| Some(Waits { for_cpu: Duration::from_millis(c), for_disk: Duration::from_millis(d) });
        let a = OwnTime { cpu: Duration::from_millis(100), major_faults: 3, waits: w(10, 20) };
        let b = OwnTime { cpu: Duration::from_millis(350), major_faults: 5, waits: w(15, 120) };
        let d = b.since(&a);
        assert_eq!((d.cpu, d.major_faults, d.waits), (Duration::from_millis(250), 2, w(5, 100)));
        assert_eq!(d.total(), Duration::from_millis(355));
        assert_eq!(b.since(&OwnTime { waits: None, ..a }).waits, None);
    }

    /// This thread's CPU time, by the clock the kernel keeps for it.
    fn thread_cpu() -> Duration {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        assert_eq!(unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) }, 0);
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }

    /// The process's own CPU is read from the kernel, user and system time both: 60 ms
    /// of a busy loop and 60 ms of reading /dev/zero (the kernel's time) show. Each
    /// loop runs for 60 ms of this thread's CPU, not of the wall clock: on a loaded
    /// machine 60 ms of wall time may be far less CPU (the test failed so under load).
    #[test]
    fn cpu_spent_shows_in_the_next_reading() {
        let before = OwnTime::now();
        let spin = thread_cpu();
        let mut x = 0u64;
        while thread_cpu() - spin < Duration::from_millis(60) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let mut zero = std::fs::File::open("/dev/zero").unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let spin = thread_cpu();
        while thread_cpu() - spin < Duration::from_millis(60) {
            std::io::Read::read_exact(&mut zero, &mut buf).unwrap();
        }
        let spent = OwnTime::now().since(&before);
        assert!(spent.cpu >= Duration::from_millis(90), "{spent:?}");
        assert!(spent.cpu < Duration::from_secs(5), "{spent:?}");
    }
}
