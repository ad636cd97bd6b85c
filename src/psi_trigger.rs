//! PSI triggers: the kernel wakes `watch` when memory starts to stall, so a calm host
//! costs no polling at all.
//!
//! A trigger is armed by writing `some <stall µs> <window µs>` (or `full ...`) to an
//! open pressure file (`/proc/pressure/memory`, or a cgroup v2 `memory.pressure`);
//! `poll()` on that file then reports `POLLPRI` once stall time within a window reaches
//! the stall given, at most once per window (Linux's `Documentation/accounting/psi.rst`).
//!
//! Why a trigger at `threshold` cannot miss a step down: every PSI average (avg10,
//! avg60, avg300) is an exponentially weighted mean of the stall share of successive
//! 2-second periods. A mean that starts below `threshold` can only reach it if some
//! period's share reaches it, and such a period is a 2-second window whose stall time
//! is at least `threshold` percent of 2 s, which is exactly what the trigger waits for.
//! It fires on the first such period, usually well before the average gets there.
//!
//! The window is 2 s because the kernel lets a process without CAP_SYS_RESOURCE arm
//! only windows that are whole multiples of 2 s (regrade's unit keeps only
//! CAP_IPC_LOCK), and 2 s is also the period the averages are computed on.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::decide::{Reading, Settings, State};
use crate::level::Level;
use crate::sample::{Metric, Pacing};

/// The trigger's window: the shortest one the kernel allows without CAP_SYS_RESOURCE.
pub const WINDOW: Duration = Duration::from_secs(2);

/// Which line of the pressure file the trigger watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Line {
    Some,
    Full,
}

impl Line {
    pub fn as_str(self) -> &'static str {
        match self {
            Line::Some => "some",
            Line::Full => "full",
        }
    }
}

/// What to arm: stall time within a window on one line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spec {
    pub line: Line,
    pub stall: Duration,
    pub window: Duration,
}

impl Spec {
    /// The trigger for `metric` at `threshold` percent: `threshold` percent of the
    /// window as stall time, on the metric's line. The kernel refuses a stall of zero
    /// or one longer than the window, so 0 % becomes 1 µs and the result is capped at
    /// the window.
    pub fn for_threshold(metric: Metric, threshold: f64) -> Spec {
        let line = match metric {
            Metric::SomeAvg10 | Metric::SomeAvg60 | Metric::SomeAvg300 => Line::Some,
            Metric::FullAvg10 | Metric::FullAvg60 | Metric::FullAvg300 => Line::Full,
        };
        let window_us = WINDOW.as_micros() as u64;
        let stall_us = (threshold.clamp(0.0, 100.0) / 100.0 * window_us as f64).round() as u64;
        Spec { line, stall: Duration::from_micros(stall_us.clamp(1, window_us)), window: WINDOW }
    }

    /// The bytes to write, NUL included: the kernel overwrites the last byte written
    /// with a NUL, so without one it would cut the window's last digit.
    pub fn text(&self) -> Vec<u8> {
        let mut s =
            format!("{} {} {}", self.line.as_str(), self.stall.as_micros(), self.window.as_micros()).into_bytes();
        s.push(0);
        s
    }
}

impl std::fmt::Display for Spec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {}", self.line.as_str(), self.stall.as_micros(), self.window.as_micros())
    }
}

/// Why a trigger could not be armed. `watch` says so once and polls instead.
#[derive(Debug)]
pub enum CannotArm {
    /// No such file.
    Missing {
        path: PathBuf,
    },
    /// The file is not the kernel's (a test's fixture, a copy): nothing can fire.
    NotKernelFile {
        path: PathBuf,
        fs_magic: i64,
    },
    /// The kernel has PSI files but no triggers (before Linux 5.2).
    OldKernel {
        path: PathBuf,
        release: String,
        cause: io::Error,
    },
    /// Opening for writing or writing the trigger was not allowed.
    NoPermission {
        path: PathBuf,
        release: String,
        cause: io::Error,
    },
    /// The kernel refused the trigger itself.
    Refused {
        path: PathBuf,
        spec: Spec,
        cause: io::Error,
    },
    Io {
        path: PathBuf,
        cause: io::Error,
    },
}

impl std::fmt::Display for CannotArm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CannotArm::Missing { path } => write!(f, "{} does not exist", path.display()),
            CannotArm::NotKernelFile { path, fs_magic } => write!(
                f,
                "{} is not a kernel pressure file (filesystem type {fs_magic:#x}, a fixture?): triggers need \
                 /proc/pressure/memory or a cgroup v2 memory.pressure",
                path.display()
            ),
            CannotArm::OldKernel { path, release, cause } => {
                write!(f, "{}: {cause}: Linux {release} has no PSI triggers (they came in 5.2)", path.display())
            }
            CannotArm::NoPermission { path, release, cause } => {
                write!(f, "{}: {cause}", path.display())?;
                if kernel_before(release, (6, 5)) {
                    write!(f, ": before Linux 6.5 (this is {release}) arming a trigger needs CAP_SYS_RESOURCE")
                } else {
                    f.write_str(": the file must be writable by regrade to arm a trigger")
                }
            }
            CannotArm::Refused { path, spec, cause } => {
                write!(f, "{}: the kernel refused the trigger \"{spec}\": {cause}", path.display())
            }
            CannotArm::Io { path, cause } => write!(f, "{}: {cause}", path.display()),
        }
    }
}

impl std::error::Error for CannotArm {}

/// procfs and cgroup2 carry pressure files that take triggers.
const PROC_SUPER_MAGIC: i64 = 0x9fa0;
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// An armed trigger. Dropping it closes the file, which disarms it.
#[derive(Debug)]
pub struct Trigger {
    file: File,
    path: PathBuf,
    spec: Spec,
}

impl Trigger {
    /// Opens `path` for reading and writing, non-blocking (the kernel requires both for
    /// a trigger that `poll()` and epoll can watch), and writes `spec`.
    pub fn arm(path: &Path, spec: Spec) -> Result<Trigger, CannotArm> {
        let release = kernel_release();
        let magic = fs_magic(path).map_err(|cause| match cause.kind() {
            io::ErrorKind::NotFound => CannotArm::Missing { path: path.to_path_buf() },
            _ => CannotArm::Io { path: path.to_path_buf(), cause },
        })?;
        if magic != PROC_SUPER_MAGIC && magic != CGROUP2_SUPER_MAGIC {
            return Err(CannotArm::NotKernelFile { path: path.to_path_buf(), fs_magic: magic });
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(|cause| classify(path, &release, spec, cause))?;
        // One write: the kernel takes the trigger from a single buffer, whole or not at all.
        let text = spec.text();
        match file.write(&text) {
            Ok(n) if n == text.len() => Ok(Trigger { file, path: path.to_path_buf(), spec }),
            Ok(n) => Err(CannotArm::Io {
                path: path.to_path_buf(),
                cause: io::Error::other(format!("the kernel took {n} of the trigger's {} bytes", text.len())),
            }),
            Err(cause) => Err(classify(path, &release, spec, cause)),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn spec(&self) -> Spec {
        self.spec
    }

    /// The armed descriptor, for [`Pacer`]; closing it disarms the trigger.
    pub fn into_fd(self) -> std::os::fd::OwnedFd {
        self.file.into()
    }

    /// Blocks until the trigger fires (true) or `timeout` passes (false). `watch`
    /// waits through epoll instead (see [`Trigger::as_fd`]); this is for tools and tests.
    pub fn wait(&self, timeout: Duration) -> io::Result<bool> {
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        let mut pfd = libc::pollfd { fd: self.file.as_raw_fd(), events: libc::POLLPRI, revents: 0 };
        loop {
            // SAFETY: one valid pollfd, for the length given.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            return check_revents(pfd.revents, &self.path).map(|_| n > 0 && pfd.revents & libc::POLLPRI != 0);
        }
    }
}

/// `POLLERR` means the trigger is gone (its cgroup was removed): polling must take over.
pub fn check_revents(revents: libc::c_short, path: &Path) -> io::Result<()> {
    if revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
        return Err(io::Error::other(format!(
            "{}: the trigger reported an error (its cgroup removed?)",
            path.display()
        )));
    }
    Ok(())
}

impl AsFd for Trigger {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl AsRawFd for Trigger {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }
}

/// Why [`Pacer::next`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// A sample is due.
    Sample(Cause),
    /// Only the watchdog needs its ping (asleep on the trigger under systemd).
    Watchdog,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// Polling: `sample_period` passed.
    Period,
    /// The trigger fired: memory stalled for `threshold` of a window.
    Fired,
    /// Asleep on the trigger for [`SAFETY_TIMEOUT`]: one sample to check on the files
    /// and the level, in case the kernel never says anything.
    SafetyTimeout,
    /// The trigger's file reported an error or hung up (its cgroup removed): the
    /// trigger is dropped, and `watch` polls until it can be armed again.
    TriggerLost,
}

/// How often a lost trigger is armed again while `watch` polls.
pub const REARM_EVERY: Duration = Duration::from_secs(60);

/// How long `watch` sleeps on a trigger at most. Long, as a quiet trigger is the
/// normal case; it bounds how late a hand step at `full` is noticed.
pub const SAFETY_TIMEOUT: Duration = Duration::from_secs(300);

/// After a fire, how long samples must stay calm before `watch` sleeps on the trigger
/// again: the averages lag the stall (avg10's time constant is 10 s), so a calm sample
/// just after a fire says little. A fresh trigger also fires once or twice in its
/// first seconds with no stall to speak of (seen on 6.18: the kernel's window starts
/// from stale totals), which this keeps to a few samples.
pub const HOLD_AFTER_FIRE: Duration = Duration::from_secs(10);

/// Chooses how `watch` waits: every `sample_period`, or on the trigger.
///
/// Nothing is lost by sleeping: an average below `threshold` at the last calm sample
/// can only reach it after a 2-second period at or above it, which fires the trigger
/// (see the module's header). The trigger stays armed all the time, so one that fires
/// while `watch` polls is still pending when it goes back to the trigger, and costs one
/// extra sample at most.
///
/// Asleep on the trigger, the only clock is a timerfd set to the next ping or the
/// safety timeout, and no Tokio timer is left registered: Tokio's hierarchical timer
/// wheel wakes the thread at each coarser slot boundary on the way to a far deadline
/// (three wake-ups for a 5 s sleep, more for 5 minutes), a timerfd wakes it once.
/// Polling keeps Tokio's interval, as before (and tests with paused time drive it).
pub struct Pacer {
    period: Duration,
    /// `None` asleep on the trigger: a dropped interval leaves nothing in the wheel.
    ticks: Option<tokio::time::Interval>,
    trigger: Option<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>,
    timer: Option<tokio::io::unix::AsyncFd<TimerFd>>,
    watchdog: Option<Pings>,
    mode: Pacing,
    /// After a fire, how long samples must stay calm before sleeping again: the
    /// averages lag the stall, so a calm sample just after a fire says little.
    hold: Duration,
    last_fire: Option<tokio::time::Instant>,
    safety: Duration,
    /// Arms the trigger again after it was lost (see [`Pacer::rearming`]).
    rearm: Option<Box<dyn FnMut() -> Option<std::os::fd::OwnedFd> + Send>>,
    rearm_every: Duration,
    /// When the next try is due, while the trigger is lost.
    rearm_at: Option<tokio::time::Instant>,
    /// The last sample was calm at the top, past the hold after a fire: where `watch`
    /// sleeps on the trigger, if it has one (see [`Pacer::resting`]).
    resting: bool,
}

/// The trigger waits for POLLPRI; POLLERR and POLLHUP (which epoll always reports)
/// say it is gone. Tokio keeps a hang-up set once seen, so an unchecked one would
/// look like a fire at every wait.
const TRIGGER_INTEREST: tokio::io::Interest = tokio::io::Interest::PRIORITY.add(tokio::io::Interest::ERROR);

fn register<F: AsRawFd>(fd: F, interest: tokio::io::Interest) -> io::Result<tokio::io::unix::AsyncFd<F>> {
    // SAFETY: the Pacer owns the descriptor for as long as the registration
    // lives; nothing closes or replaces it meanwhile.
    unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, interest) }.map_err(io::Error::from)
}

/// A sampling interval whose first tick is one period from now (or now).
fn interval_from(start: tokio::time::Instant, period: Duration) -> tokio::time::Interval {
    let mut i = tokio::time::interval_at(start, period);
    i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    i
}

impl Pacer {
    /// `watchdog`: the ping period when systemd wants pings. Needs a Tokio runtime.
    /// `trigger`: an armed [`Trigger`]'s descriptor ([`Trigger::into_fd`]).
    pub fn new(
        period: Duration,
        hold: Duration,
        trigger: Option<std::os::fd::OwnedFd>,
        watchdog: Option<Duration>,
    ) -> io::Result<Self> {
        Self::with_safety(period, hold, SAFETY_TIMEOUT, trigger, watchdog)
    }

    /// [`Pacer::new`] with another safety timeout (tests).
    pub fn with_safety(
        period: Duration,
        hold: Duration,
        safety: Duration,
        trigger: Option<std::os::fd::OwnedFd>,
        watchdog: Option<Duration>,
    ) -> io::Result<Self> {
        let (trigger, timer) = match trigger {
            Some(t) => {
                (Some(register(t, TRIGGER_INTEREST)?), Some(register(TimerFd::new()?, tokio::io::Interest::READABLE)?))
            }
            None => (None, None),
        };
        let watchdog = watchdog.map(|p| {
            // A ping period past the safety timeout (WatchdogSec over twice it) would
            // stretch the sleep past it, and /healthz's allowance with it.
            let p = p.min(safety);
            let per_safety = (safety.as_millis() / p.as_millis().max(1)).max(1) as u32;
            Pings { period: p, pings: 0, per_safety }
        });
        Ok(Pacer {
            period,
            ticks: Some(interval_from(tokio::time::Instant::now(), period)),
            trigger,
            timer,
            watchdog,
            mode: Pacing::Polling,
            hold,
            safety,
            last_fire: None,
            rearm: None,
            rearm_every: REARM_EVERY,
            rearm_at: None,
            resting: false,
        })
    }

    /// After a lost trigger, `arm` is called every `every` while polling until it
    /// gives a descriptor, which becomes the trigger.
    pub fn rearming(
        mut self,
        every: Duration,
        arm: impl FnMut() -> Option<std::os::fd::OwnedFd> + Send + 'static,
    ) -> Self {
        self.rearm = Some(Box::new(arm));
        self.rearm_every = every;
        self
    }

    /// Arms the trigger again when it is lost and a try is due.
    fn try_rearm(&mut self, now: tokio::time::Instant) {
        if self.trigger.is_some() || self.timer.is_none() || self.rearm_at.is_none_or(|t| now < t) {
            return;
        }
        let Some(arm) = &mut self.rearm else { return };
        match arm().map(|fd| register(fd, TRIGGER_INTEREST)) {
            Some(Ok(t)) => {
                tracing::info!("the PSI trigger is armed again");
                self.trigger = Some(t);
                self.rearm_at = None;
            }
            Some(Err(e)) => {
                tracing::debug!(error = %e, "could not watch the re-armed PSI trigger");
                self.rearm_at = Some(now + self.rearm_every);
            }
            None => self.rearm_at = Some(now + self.rearm_every),
        }
    }

    pub fn mode(&self) -> Pacing {
        self.mode
    }

    pub fn has_trigger(&self) -> bool {
        self.trigger.is_some()
    }

    /// Calm at the top at the last sample, and no fire within the hold: what `watch`
    /// sleeps on the trigger for, with or without one. Not resting (pressure, a
    /// level below the top, a fire just now, nothing sampled yet) is when `watch`
    /// looks at the etcd member and the host's units (`watch::looks`).
    pub fn resting(&self) -> bool {
        self.resting
    }

    /// After each sample: `calm_at_top` says the core is calm at the top level with no
    /// streak that could lead to a step. Returns the new mode when it changes.
    pub fn after_sample(&mut self, calm_at_top: bool) -> Option<Pacing> {
        let now = tokio::time::Instant::now();
        self.try_rearm(now);
        let held = self.last_fire.is_none_or(|f| now.duration_since(f) >= self.hold);
        self.resting = calm_at_top && held;
        let want = if self.resting && self.trigger.is_some() { Pacing::Trigger } else { Pacing::Polling };
        if want == self.mode {
            return None;
        }
        self.set_mode(want, now);
        Some(want)
    }

    fn set_mode(&mut self, mode: Pacing, now: tokio::time::Instant) {
        self.ticks = match mode {
            // The next sample one period after this one, as when polling all along.
            Pacing::Polling => Some(interval_from(now + self.period, self.period)),
            Pacing::Trigger => None,
        };
        if let Some(w) = &mut self.watchdog {
            // Polling pinged at every sample: the next ping is due a period from now.
            w.pings = 0;
        }
        self.mode = mode;
    }

    /// Waits for the next sample (or, asleep on the trigger under systemd, the next ping).
    pub async fn next(&mut self) -> Wake {
        let (Pacing::Trigger, Some(trigger), Some(timer)) = (self.mode, &self.trigger, &self.timer) else {
            let ticks = self.ticks.get_or_insert_with(|| interval_from(tokio::time::Instant::now(), self.period));
            ticks.tick().await;
            return Wake::Sample(Cause::Period);
        };
        let due = self.watchdog.as_ref().map_or(self.safety, |w| w.period);
        if let Err(e) = timer.get_ref().set(due) {
            tracing::warn!(error = %e, "could not set the safety timer; sampling every period from now on");
            self.trigger = None;
            self.set_mode(Pacing::Polling, tokio::time::Instant::now());
            return Wake::Sample(Cause::SafetyTimeout);
        }
        let fired = async {
            let mut guard = trigger.ready(TRIGGER_INTEREST).await?;
            let ready = guard.ready();
            guard.clear_ready();
            if ready.is_error() {
                return Err(io::Error::other("the trigger's file reported an error (POLLERR: its cgroup removed?)"));
            }
            if ready.is_read_closed() {
                return Err(io::Error::other("the trigger's file hung up (POLLHUP)"));
            }
            Ok(())
        };
        let timed_out = async {
            loop {
                let Ok(mut guard) = timer.readable().await else { return };
                match guard.try_io(|t| t.get_ref().read()) {
                    Ok(_) => return,
                    Err(_would_block) => continue,
                }
            }
        };
        let woke = tokio::select! {
            biased;
            r = fired => Some(r),
            _ = timed_out => None,
        };
        match woke {
            None => {
                let Some(w) = &mut self.watchdog else { return Wake::Sample(Cause::SafetyTimeout) };
                w.pings += 1;
                // The safety sample rides on a ping, so it costs no wake-up of its own.
                if w.pings < w.per_safety {
                    return Wake::Watchdog;
                }
                w.pings = 0;
                Wake::Sample(Cause::SafetyTimeout)
            }
            Some(Err(e)) => {
                // Said once: re-arming is retried quietly until it works.
                tracing::warn!(error = %e, "the PSI trigger is gone; sampling every period until it can be armed again");
                self.trigger = None;
                let now = tokio::time::Instant::now();
                self.rearm_at = Some(now + self.rearm_every);
                self.set_mode(Pacing::Polling, now);
                Wake::Sample(Cause::TriggerLost)
            }
            Some(Ok(())) => {
                let now = tokio::time::Instant::now();
                self.last_fire = Some(now);
                self.set_mode(Pacing::Polling, now);
                Wake::Sample(Cause::Fired)
            }
        }
    }
}

/// The watchdog's pings while asleep on the trigger.
struct Pings {
    period: Duration,
    /// Pings since the last sample, and how many make the safety timeout.
    pings: u32,
    per_safety: u32,
}

/// A one-shot CLOCK_MONOTONIC timerfd.
struct TimerFd(std::os::fd::OwnedFd);

impl TimerFd {
    fn new() -> io::Result<TimerFd> {
        // SAFETY: plain syscall; the descriptor returned is owned below.
        let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        Ok(TimerFd(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }))
    }

    /// Expires once, `after` from now (also clearing an expiry not yet read).
    fn set(&self, after: Duration) -> io::Result<()> {
        let after = after.max(Duration::from_nanos(1)); // zero would disarm it
        let spec = libc::itimerspec {
            it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
            it_value: libc::timespec { tv_sec: after.as_secs() as libc::time_t, tv_nsec: after.subsec_nanos() as _ },
        };
        // SAFETY: a valid itimerspec; the old value is not wanted.
        if unsafe { libc::timerfd_settime(self.0.as_raw_fd(), 0, &spec, std::ptr::null_mut()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Reads the expiry count; `WouldBlock` when it has not expired.
    fn read(&self) -> io::Result<u64> {
        let mut n = [0u8; 8];
        // SAFETY: reads at most 8 bytes into an 8-byte buffer.
        let r = unsafe { libc::read(self.0.as_raw_fd(), n.as_mut_ptr().cast(), 8) };
        if r != 8 {
            return Err(io::Error::last_os_error());
        }
        Ok(u64::from_ne_bytes(n))
    }
}

impl AsRawFd for TimerFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

/// Arms the trigger `watch` sleeps on, for `metric` at `threshold` on `source`, and
/// says so in the journal, once: armed, or why not (then `watch` polls). Returns the
/// descriptor for [`Pacer`] and the words `status` shows.
pub fn arm_for_watch(source: &Path, metric: Metric, threshold: f64) -> (Option<std::os::fd::OwnedFd>, String) {
    let spec = Spec::for_threshold(metric, threshold);
    match Trigger::arm(source, spec) {
        Ok(t) => {
            tracing::info!(trigger = %spec, path = %source.display(), "PSI trigger armed: calm at the top level, watch sleeps until memory stalls");
            (Some(t.into_fd()), format!("\"{spec}\" on {}", source.display()))
        }
        Err(e) => {
            tracing::warn!(reason = %e, "cannot arm a PSI trigger; sampling every sample_period instead");
            (None, format!("none: {e}"))
        }
    }
}

/// Whether the core may sleep on the trigger: at the top level, the last sample calm,
/// and no streak under way that could lead to a step. Only a step down can happen
/// there, and only after a sample at `threshold`, which the trigger announces.
pub fn calm_at_top(state: &State, reading: Option<Reading>, settings: &Settings, levels: &[Level]) -> bool {
    levels.first() == Some(&state.level)
        && reading == Some(Reading::Calm)
        && state.over_since.is_none()
        && state.next_step_at(settings, levels).is_none()
}

/// Names the reason an open or write failed, by errno and kernel version.
fn classify(path: &Path, release: &str, spec: Spec, cause: io::Error) -> CannotArm {
    let path = path.to_path_buf();
    let release = release.to_string();
    match cause.raw_os_error() {
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => CannotArm::NoPermission { path, release, cause },
        // A PSI file without triggers is read-only to the kernel: EIO or EINVAL on write.
        Some(libc::EINVAL | libc::EIO | libc::EBADF | libc::EOPNOTSUPP) if kernel_before(&release, (5, 2)) => {
            CannotArm::OldKernel { path, release, cause }
        }
        Some(libc::EINVAL | libc::EOPNOTSUPP | libc::EBUSY) => CannotArm::Refused { path, spec, cause },
        _ => CannotArm::Io { path, cause },
    }
}

fn fs_magic(path: &Path) -> io::Result<i64> {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: statfs fills the struct it is given; the path is a valid C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between libcs
    Ok(st.f_type as i64)
}

/// The running kernel's release, as `uname -r` prints it.
pub fn kernel_release() -> String {
    // SAFETY: uname fills the struct it is given.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut u) } != 0 {
        return String::from("unknown");
    }
    // SAFETY: uname NUL-terminates each field.
    unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }.to_string_lossy().into_owned()
}

/// Whether `release` (e.g. "6.1.0-18-amd64") is older than `major.minor`. An
/// unreadable release counts as not older: then the plain errno is reported.
fn kernel_before(release: &str, (major, minor): (u32, u32)) -> bool {
    let mut parts = release.split(|c: char| !c.is_ascii_digit()).filter(|p| !p.is_empty());
    let (Some(Ok(a)), Some(Ok(b))) = (parts.next().map(str::parse::<u32>), parts.next().map(str::parse::<u32>)) else {
        return false;
    };
    (a, b) < (major, minor)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn the_spec_is_threshold_percent_of_a_two_second_window() {
        let s = Spec::for_threshold(Metric::SomeAvg10, 40.0);
        assert_eq!(s.text(), b"some 800000 2000000\0");
        assert_eq!(Spec::for_threshold(Metric::FullAvg60, 7.5).text(), b"full 150000 2000000\0");
        assert_eq!(Spec::for_threshold(Metric::SomeAvg300, 0.0).stall, Duration::from_micros(1), "never zero");
        assert_eq!(Spec::for_threshold(Metric::SomeAvg10, 100.0).stall, WINDOW, "never past the window");
        assert_eq!(WINDOW.as_micros() % 2_000_000, 0, "unprivileged windows are multiples of 2 s");
    }

    #[test]
    fn a_fixture_file_is_refused_as_not_the_kernels() {
        let dir = tempfile::tempdir().unwrap();
        let psi = dir.path().join("psi");
        std::fs::write(&psi, "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n").unwrap();
        let e = Trigger::arm(&psi, Spec::for_threshold(Metric::SomeAvg10, 40.0)).unwrap_err();
        assert!(matches!(e, CannotArm::NotKernelFile { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains(psi.to_str().unwrap()) && msg.contains("fixture"), "{msg}");
        let text = std::fs::read_to_string(&psi).unwrap();
        assert_eq!(text, "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n", "nothing written to the fixture");

        let gone = dir.path().join("no-such-file");
        let e = Trigger::arm(&gone, Spec::for_threshold(Metric::SomeAvg10, 40.0)).unwrap_err();
        assert!(matches!(e, CannotArm::Missing { .. }) && e.to_string().contains("no-such-file"), "{e}");
    }

    #[test]
    fn a_real_trigger_arms_on_the_systems_pressure_file() {
        let path = Path::new("/proc/pressure/memory");
        if !path.exists() {
            eprintln!("skipped: no {}", path.display());
            return;
        }
        let t = Trigger::arm(path, Spec::for_threshold(Metric::SomeAvg10, 40.0)).expect("arming on this kernel");
        // Calm (or not): the wait returns, and within its timeout.
        let start = std::time::Instant::now();
        let _fired = t.wait(Duration::from_millis(50)).unwrap();
        assert!(start.elapsed() < Duration::from_secs(2));
        // The kernel checks what it is given: a stall longer than the window is refused.
        let bad = Spec { stall: WINDOW * 2, ..t.spec() };
        let e = Trigger::arm(path, bad).unwrap_err();
        assert!(matches!(e, CannotArm::Refused { .. }), "{e:?}");
        assert!(e.to_string().contains("some 4000000 2000000"), "{e}");
        // Both ends of the threshold range are accepted.
        for th in [0.0, 100.0] {
            Trigger::arm(path, Spec::for_threshold(Metric::FullAvg10, th)).unwrap();
        }
    }

    #[test]
    fn reasons_name_the_kernel_and_the_capability() {
        let spec = Spec::for_threshold(Metric::SomeAvg10, 40.0);
        let p = Path::new("/proc/pressure/memory");
        let eperm = || io::Error::from_raw_os_error(libc::EPERM);
        let e = classify(p, "6.1.0-18-amd64", spec, eperm());
        assert!(matches!(e, CannotArm::NoPermission { .. }));
        assert!(e.to_string().contains("CAP_SYS_RESOURCE") && e.to_string().contains("6.1.0"), "{e}");
        let e = classify(p, "6.8.0", spec, eperm());
        assert!(!e.to_string().contains("CAP_SYS_RESOURCE") && e.to_string().contains("writable"), "{e}");
        let e = classify(p, "4.20.17", spec, io::Error::from_raw_os_error(libc::EIO));
        assert!(matches!(e, CannotArm::OldKernel { .. }) && e.to_string().contains("5.2"), "{e}");
        let e = classify(p, "6.8.0", spec, io::Error::from_raw_os_error(libc::EINVAL));
        assert!(matches!(e, CannotArm::Refused { .. }), "{e:?}");
    }

    #[test]
    fn kernel_versions_compare_by_major_and_minor() {
        assert!(kernel_before("5.1.21", (5, 2)));
        assert!(kernel_before("4.19.0-26-amd64", (5, 2)));
        assert!(!kernel_before("5.2.0", (5, 2)));
        assert!(!kernel_before("6.18.44-fc-v1045", (6, 5)));
        assert!(kernel_before("6.4.16", (6, 5)));
        assert!(!kernel_before("garbage", (6, 5)));
        assert!(kernel_before("6.1.0", (6, 5)));
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    /// A real kernel POLLPRI source the test controls: urgent (out-of-band) data on a
    /// loopback TCP connection is reported as POLLPRI, as a fired PSI trigger is.
    /// Returns the end to watch and the end to [`fire`] through.
    pub(crate) fn urgent() -> (std::os::fd::OwnedFd, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tx = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (rx, _) = l.accept().unwrap();
        rx.set_nonblocking(true).unwrap();
        (rx.into(), tx)
    }

    pub(crate) fn fire(tx: &std::net::TcpStream) {
        // SAFETY: one byte from a valid buffer on an open socket.
        let n = unsafe { libc::send(tx.as_raw_fd(), b"!".as_ptr().cast(), 1, libc::MSG_OOB) };
        assert_eq!(n, 1);
    }

    /// Blocks until the kernel reports the [`fire`]d byte on `rx` (a duplicate of the
    /// watched end): then a runtime polling its descriptors sees it, however late
    /// loopback delivered it.
    pub(crate) fn wait_urgent(rx: &std::os::fd::OwnedFd) {
        let mut p = libc::pollfd { fd: rx.as_raw_fd(), events: libc::POLLPRI, revents: 0 };
        // SAFETY: one valid pollfd, for the call's duration.
        let n = unsafe { libc::poll(&mut p, 1, 10_000) };
        assert_eq!(n, 1, "the urgent byte never arrived");
    }

    #[test]
    fn asleep_on_a_real_calm_trigger_only_the_safety_timeout_wakes() {
        let path = Path::new("/proc/pressure/memory");
        if !path.exists() {
            eprintln!("skipped: no {}", path.display());
            return;
        }
        // Stall for all of a 2 s window: rare, but this machine is shared, and other
        // work can stall memory, so a real fire is allowed (the kernel sends at most
        // one per window).
        let t = Trigger::arm(path, Spec::for_threshold(Metric::SomeAvg10, 100.0)).unwrap();
        rt().block_on(async {
            let ms = Duration::from_millis;
            let mut p = Pacer::with_safety(ms(10), ms(0), ms(300), Some(t.into_fd()), None).unwrap();
            assert_eq!(p.next().await, Wake::Sample(Cause::Period), "polling until told calm");
            assert_eq!(p.after_sample(true), Some(Pacing::Trigger));
            let start = std::time::Instant::now();
            let mut wakes = vec![];
            while start.elapsed() < ms(1000) {
                wakes.push(p.next().await);
                p.after_sample(true);
            }
            // Polling at 10 ms would have woken about 100 times; a trigger watched for
            // readability (always true of a /proc file) would have spun.
            let safety = wakes.iter().filter(|w| **w == Wake::Sample(Cause::SafetyTimeout)).count();
            let fired = wakes.iter().filter(|w| **w == Wake::Sample(Cause::Fired)).count();
            assert_eq!(safety + fired, wakes.len(), "{wakes:?}");
            assert!(safety >= 2 && fired <= 1 && wakes.len() <= 5, "{wakes:?}");
        });
    }

    #[test]
    fn a_fire_wakes_at_once_then_samples_every_period_until_calm_for_the_hold() {
        let (u, tx) = urgent();
        rt().block_on(async {
            let ms = Duration::from_millis;
            let mut p = Pacer::with_safety(ms(50), ms(400), Duration::from_secs(60), Some(u), None).unwrap();
            p.next().await;
            p.after_sample(true);
            assert_eq!(p.mode(), Pacing::Trigger);
            let fire_at = std::time::Instant::now() + ms(200);
            // The connection stays open after the fire: a hang-up is a lost trigger.
            let _open = tx.try_clone().unwrap();
            std::thread::spawn(move || {
                std::thread::sleep(ms(200));
                fire(&tx);
            });
            assert_eq!(p.next().await, Wake::Sample(Cause::Fired));
            let woke = std::time::Instant::now();
            assert!(woke >= fire_at && woke < fire_at + ms(100), "woke {:?} after the fire", woke - fire_at);
            assert_eq!(p.mode(), Pacing::Polling);
            // Calm samples right after a fire do not put it back to sleep: the averages lag.
            let mut periods = 0;
            loop {
                assert_eq!(p.next().await, Wake::Sample(Cause::Period));
                periods += 1;
                if p.after_sample(true) == Some(Pacing::Trigger) {
                    break;
                }
            }
            let held = woke.elapsed();
            assert!(held >= ms(400) && held < ms(700), "back to the trigger after {held:?}");
            assert!((7..=10).contains(&periods), "{periods} samples in the hold");
        });
    }

    #[test]
    fn a_fire_while_polling_is_not_lost() {
        let (u, tx) = urgent();
        fire(&tx);
        rt().block_on(async {
            let ms = Duration::from_millis;
            let mut p = Pacer::with_safety(ms(10), ms(0), Duration::from_secs(60), Some(u), None).unwrap();
            for _ in 0..3 {
                assert_eq!(p.next().await, Wake::Sample(Cause::Period), "polling ignores the trigger");
                p.after_sample(false);
            }
            p.after_sample(true);
            let start = std::time::Instant::now();
            assert_eq!(p.next().await, Wake::Sample(Cause::Fired), "the pending fire wakes it at once");
            assert!(start.elapsed() < ms(100));
        });
    }

    #[test]
    fn under_systemd_asleep_on_the_trigger_only_pings_and_samples_on_a_ping() {
        let (u, _tx) = urgent();
        rt().block_on(async {
            let ms = Duration::from_millis;
            // Pings every 100 ms, a safety sample every 400 ms (on the 4th ping).
            let mut p = Pacer::with_safety(ms(10), ms(0), ms(400), Some(u), Some(ms(100))).unwrap();
            p.next().await;
            p.after_sample(true);
            let start = std::time::Instant::now();
            let mut wakes = vec![];
            for _ in 0..8 {
                let w = p.next().await;
                wakes.push((w, start.elapsed()));
                if w != Wake::Watchdog {
                    p.after_sample(true);
                }
            }
            let kinds: Vec<_> = wakes.iter().map(|(w, _)| *w).collect();
            let (ping, safety) = (Wake::Watchdog, Wake::Sample(Cause::SafetyTimeout));
            assert_eq!(kinds, [ping, ping, ping, safety, ping, ping, ping, safety]);
            let last = wakes.last().unwrap().1;
            assert!(last >= ms(800) && last < ms(1000), "{wakes:?}");
        });
    }

    #[test]
    fn without_a_trigger_it_polls_even_when_calm() {
        rt().block_on(async {
            let ms = Duration::from_millis;
            let mut p = Pacer::with_safety(ms(10), ms(0), ms(50), None, None).unwrap();
            for _ in 0..5 {
                assert_eq!(p.next().await, Wake::Sample(Cause::Period));
                assert_eq!(p.after_sample(true), None);
                assert_eq!(p.mode(), Pacing::Polling);
            }
        });
    }

    /// A pipe's read end with its write end closed: the kernel reports POLLHUP on it
    /// for good, as it reports POLLERR on a trigger whose cgroup was removed.
    fn hung_up() -> std::os::fd::OwnedFd {
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills the two descriptors it is given.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) }, 0);
        // SAFETY: fresh descriptors nothing else owns.
        let (r, w): (std::os::fd::OwnedFd, std::os::fd::OwnedFd) =
            unsafe { (std::os::fd::FromRawFd::from_raw_fd(fds[0]), std::os::fd::FromRawFd::from_raw_fd(fds[1])) };
        drop(w);
        r
    }

    /// A pipe's write end with its read end closed: POLLERR for good.
    fn errored() -> std::os::fd::OwnedFd {
        let mut fds = [0; 2];
        // SAFETY: as in `hung_up`.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) }, 0);
        let (r, w): (std::os::fd::OwnedFd, std::os::fd::OwnedFd) =
            unsafe { (std::os::fd::FromRawFd::from_raw_fd(fds[0]), std::os::fd::FromRawFd::from_raw_fd(fds[1])) };
        drop(r);
        w
    }

    /// A trigger that hangs up or errors is dropped at its first wake: `watch` polls
    /// from then on instead of "firing" at once every time it goes back to sleep.
    #[test]
    fn a_trigger_that_hangs_up_or_errors_is_dropped_for_polling() {
        for (what, fd) in [("POLLHUP", hung_up()), ("POLLERR", errored())] {
            rt().block_on(async {
                let ms = Duration::from_millis;
                // A short safety timeout, so a trigger never woken again shows quickly.
                let mut p = Pacer::with_safety(ms(20), ms(0), ms(500), Some(fd), None).unwrap();
                assert_eq!(p.next().await, Wake::Sample(Cause::Period));
                assert_eq!(p.after_sample(true), Some(Pacing::Trigger));
                let mut wakes = vec![];
                for _ in 0..5 {
                    wakes.push(p.next().await);
                    p.after_sample(true);
                }
                let fired = wakes.iter().filter(|w| **w == Wake::Sample(Cause::Fired)).count();
                assert!(fired == 0, "{what}: the broken trigger fired {fired} times: {wakes:?}");
                assert_eq!(wakes[0], Wake::Sample(Cause::TriggerLost), "{what}");
                assert!(!p.has_trigger(), "{what}: still kept");
                assert_eq!(p.mode(), Pacing::Polling, "{what}");
                assert!(wakes[1..].iter().all(|w| *w == Wake::Sample(Cause::Period)), "{what}: {wakes:?}");
            });
        }
    }

    /// A lost trigger is said once, polled past, and armed again when its file can be:
    /// then `watch` sleeps on the new one (which does not fire by itself).
    #[test]
    fn a_lost_trigger_is_said_once_and_armed_again() {
        #[derive(Clone, Default)]
        struct Log(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl io::Write for Log {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let log = Log::default();
        let w = log.clone();
        let sub = tracing_subscriber::fmt().with_writer(move || w.clone()).with_ansi(false).finish();
        let _g = tracing::subscriber::set_default(sub);
        let (u, _tx) = urgent();
        let tries = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let n = tries.clone();
        let mut fresh = Some(u);
        rt().block_on(async {
            let ms = Duration::from_millis;
            // The file cannot be armed at the first try, only at the second.
            let mut p = Pacer::with_safety(ms(10), ms(0), ms(300), Some(hung_up()), None).unwrap().rearming(
                ms(100),
                move || {
                    let k = n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if k == 0 {
                        None
                    } else {
                        fresh.take()
                    }
                },
            );
            p.next().await;
            p.after_sample(true);
            assert_eq!(p.next().await, Wake::Sample(Cause::TriggerLost));
            let lost = std::time::Instant::now();
            let mut polled = 0;
            while p.after_sample(true) != Some(Pacing::Trigger) {
                assert_eq!(p.next().await, Wake::Sample(Cause::Period));
                polled += 1;
                assert!(polled < 100, "never armed again");
            }
            let rearmed = lost.elapsed();
            assert!(p.has_trigger() && rearmed >= ms(200), "armed again after {rearmed:?}");
            assert_eq!(tries.load(std::sync::atomic::Ordering::SeqCst), 2);
            // Asleep on the new trigger: only the safety timeout wakes it.
            let t0 = std::time::Instant::now();
            assert_eq!(p.next().await, Wake::Sample(Cause::SafetyTimeout));
            assert!(t0.elapsed() >= ms(250), "woke after {:?}", t0.elapsed());
        });
        let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.matches("the PSI trigger is gone").count(), 1, "{text}");
        assert!(text.contains("POLLHUP"), "{text}");
        assert_eq!(text.matches("the PSI trigger is armed again").count(), 1, "{text}");
    }

    /// Under a WatchdogSec whose ping period is longer than the safety timeout, the
    /// safety sample still comes within the safety timeout (which /healthz allows).
    #[test]
    fn a_long_watchdog_period_does_not_stretch_the_safety_timeout() {
        let (u, _tx) = urgent();
        rt().block_on(async {
            let ms = Duration::from_millis;
            let mut p = Pacer::with_safety(ms(10), ms(0), ms(200), Some(u), Some(ms(400))).unwrap();
            p.next().await;
            p.after_sample(true);
            let t0 = std::time::Instant::now();
            loop {
                let w = p.next().await;
                if w == Wake::Sample(Cause::SafetyTimeout) {
                    break;
                }
                assert_eq!(w, Wake::Watchdog);
            }
            let took = t0.elapsed();
            assert!(took < ms(300), "the safety sample came after {took:?}, past the 200 ms safety timeout");
        });
    }
}
