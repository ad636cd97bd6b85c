//! Reading memory pressure: the PSI file and the memory available — MemAvailable, or a
//! memory cgroup's own figure with `pressure.memory_cgroup` (docs/behaviour.md,
//! "Pressure") — and `[pressure]`, the section that configures it and the core.
//!
//! Every file stays open for the life of the sampler and is re-read with `pread` into
//! fixed buffers, so a sample opens nothing and allocates nothing: on a host that is
//! thrashing, the watcher must not need memory to notice it. Only a read that fails
//! (a cgroup removed and made again, as systemd does on a unit's restart) opens the
//! file again, once, by its path.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::bail;
use serde::{de, Deserialize, Deserializer, Serialize};

use crate::sample::{Metric, Psi, Sample};
use crate::units::{format_duration, ByteSize, HumanDuration};

/// `mem_available_floor`: a size, or `"none"` to decide on PSI alone (TOML has no null).
fn floor_de<'de, D: Deserializer<'de>>(d: D) -> Result<Option<ByteSize>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Floor {
        None(NoneWord),
        Size(ByteSize),
    }
    #[derive(Deserialize)]
    enum NoneWord {
        #[serde(rename = "none")]
        None,
    }
    // Untagged enums hide the inner error, so say what is accepted.
    match Floor::deserialize(d).map_err(|_| {
        de::Error::custom("expected a size such as \"512MiB\" or a number of bytes (0 or more), or \"none\"")
    })? {
        Floor::None(_) => Ok(None),
        Floor::Size(b) => Ok(Some(b)),
    }
}

fn floor_ser<S: serde::Serializer>(v: &Option<ByteSize>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(b) => s.serialize_u64(b.0),
        None => s.serialize_str("none"),
    }
}

/// `[pressure]`: its keys are a contract (README, "Configuration").
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PressureConfig {
    pub metric: Metric,
    /// Percent (0–100) of the chosen PSI average at or above which a sample may be "over".
    pub threshold: f64,
    /// Percent below which a sample may be "calm"; defaults to `threshold`.
    pub calm_threshold: Option<f64>,
    /// "Over" also needs MemAvailable below this, "calm" at or above it. `"none"`:
    /// PSI alone decides.
    #[serde(deserialize_with = "floor_de", serialize_with = "floor_ser")]
    pub mem_available_floor: Option<ByteSize>,
    pub sample_period: HumanDuration,
    pub sustain: HumanDuration,
    pub cooldown: HumanDuration,
    /// The PSI file, `/proc/pressure/memory` format.
    pub source: PathBuf,
    /// The meminfo file, `/proc/meminfo` format.
    pub meminfo: PathBuf,
    /// A memory cgroup (v1 or v2) whose own available memory (limit − usage +
    /// inactive file pages) is used instead of MemAvailable; on v2 its
    /// `memory.pressure` is also the PSI source unless `source` names another file.
    pub memory_cgroup: Option<PathBuf>,
}

impl Default for PressureConfig {
    fn default() -> Self {
        PressureConfig {
            metric: Metric::SomeAvg10,
            threshold: 40.0,
            calm_threshold: None,
            mem_available_floor: Some(ByteSize(512 << 20)),
            sample_period: HumanDuration(Duration::from_secs(5)),
            sustain: HumanDuration(Duration::from_secs(60)),
            cooldown: HumanDuration(Duration::from_secs(300)),
            source: PathBuf::from(PROC_PSI),
            meminfo: PathBuf::from("/proc/meminfo"),
            memory_cgroup: None,
        }
    }
}

/// The default of `pressure.source`.
pub const PROC_PSI: &str = "/proc/pressure/memory";

impl PressureConfig {
    /// The lines deciding reads: the `full` line only for a `full_*` metric,
    /// MemAvailable only with a floor.
    pub fn needs(&self) -> Needs {
        let full_line = matches!(self.metric, Metric::FullAvg10 | Metric::FullAvg60 | Metric::FullAvg300);
        Needs { full_line, mem_available: self.mem_available_floor.is_some() }
    }

    /// The calm threshold in force: `calm_threshold`, or `threshold` when unset.
    pub fn calm_threshold(&self) -> f64 {
        self.calm_threshold.unwrap_or(self.threshold)
    }

    /// With `memory_cgroup` on cgroup v2 (the directory has a `memory.pressure`) and
    /// `source` left at `/proc/pressure/memory`, the PSI source becomes that cgroup's
    /// `memory.pressure`: stalls of the cgroup's tasks, which is what its limit causes.
    /// Called once, when the configuration is read.
    pub fn resolve_psi_source(&mut self) {
        if let Some(cg) = &self.memory_cgroup {
            let cg_psi = cg.join("memory.pressure");
            if self.source == Path::new(PROC_PSI) && cg_psi.is_file() {
                self.source = cg_psi;
            }
        }
    }

    /// Rejects values no server could run with, naming the key as `pressure.key`.
    pub fn validate(&self) -> anyhow::Result<()> {
        if let Some(cg) = &self.memory_cgroup {
            if !cg.is_absolute() {
                bail!("pressure.memory_cgroup = {:?} must be an absolute path (a cgroup directory)", cg.display());
            }
        }
        check_percent("pressure.threshold", self.threshold)?;
        if let Some(c) = self.calm_threshold {
            check_percent("pressure.calm_threshold", c)?;
            if c > self.threshold {
                bail!(
                    "pressure.calm_threshold = {c} is above pressure.threshold = {}: a sample could be over and calm at once",
                    self.threshold
                );
            }
        }
        if self.sample_period.0.is_zero() {
            bail!("pressure.sample_period must be more than 0");
        }
        if self.sustain.0 < self.sample_period.0 {
            bail!(
                "pressure.sustain = {} is shorter than pressure.sample_period = {}: a streak could never be observed",
                format_duration(self.sustain.0),
                format_duration(self.sample_period.0)
            );
        }
        Ok(())
    }
}

fn check_percent(key: &str, v: f64) -> anyhow::Result<()> {
    if !(0.0..=100.0).contains(&v) || v.is_nan() {
        bail!("{key} = {v} is out of range: PSI is a percentage from 0 to 100");
    }
    Ok(())
}

/// Why a sample could not be taken.
#[derive(Debug)]
pub enum SampleError {
    /// The kernel has no PSI: the file is missing or reads fail with EOPNOTSUPP. Fatal
    /// for `watch` and `status` (docs/behaviour.md, "Pressure").
    PsiUnavailable {
        path: PathBuf,
        cause: io::Error,
    },
    Io {
        path: PathBuf,
        cause: io::Error,
    },
    Malformed {
        path: PathBuf,
        what: &'static str,
    },
    /// The file lacks a line the configuration needs and this kernel does not write
    /// (no `full` line for a `full_*` metric, no MemAvailable with a floor set): no
    /// sample can ever succeed, so this is fatal rather than a warning per sample.
    Lacking {
        path: PathBuf,
        what: &'static str,
        key: &'static str,
    },
    /// A file of `pressure.memory_cgroup` is missing, unreadable or does not parse.
    /// When the sampler is opened this is fatal (it is returned by the constructor);
    /// in a later sample it is not (the cgroup may be between a removal and its
    /// making again), and the next sample opens the file again.
    Cgroup {
        path: PathBuf,
        what: &'static str,
        cause: Option<io::Error>,
    },
}

impl std::fmt::Display for SampleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // A cgroup's memory.pressure (pressure.source on system.slice, say) is missing
            // for another reason than the kernel's: the host's cgroups are v1.
            SampleError::PsiUnavailable { path, cause }
                if path.starts_with("/sys/fs/cgroup") && cause.kind() == io::ErrorKind::NotFound =>
            {
                write!(
                    f,
                    "memory pressure (PSI) is unavailable: pressure.source = {}: {cause}. A cgroup has a \
                     memory.pressure only on cgroup v2 (unified hierarchy); on cgroup v1 set pressure.source = \"{}\"",
                    path.display(),
                    PROC_PSI
                )
            }
            SampleError::PsiUnavailable { path, cause } => write!(
                f,
                "memory pressure (PSI) is unavailable: {}: {cause}. regrade needs a kernel built with \
                 CONFIG_PSI=y and not booted with psi=0",
                path.display()
            ),
            SampleError::Io { path, cause } => write!(f, "reading {}: {cause}", path.display()),
            SampleError::Malformed { path, what } => write!(f, "{}: {what}", path.display()),
            SampleError::Lacking { path, what, key } => {
                write!(f, "{}: {what}, which {key} needs; change {key} or use a kernel that writes it", path.display())
            }
            SampleError::Cgroup { path, what, cause } => {
                write!(f, "pressure.memory_cgroup: {}: {what}", path.display())?;
                match cause {
                    Some(c) => write!(f, ": {c}"),
                    None => Ok(()),
                }
            }
        }
    }
}

impl std::error::Error for SampleError {}

impl SampleError {
    pub fn is_fatal(&self) -> bool {
        matches!(self, SampleError::PsiUnavailable { .. } | SampleError::Lacking { .. })
    }
}

/// Something to `pread` from: a `File`, or a test's injected reader.
pub trait ReadAt: Sized {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;

    /// Opens `path` again after a read failed. Only a `File` can.
    fn reopen(_path: &Path) -> io::Result<Self> {
        Err(io::ErrorKind::Unsupported.into())
    }
}

impl ReadAt for File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        FileExt::read_at(self, buf, offset)
    }

    fn reopen(path: &Path) -> io::Result<Self> {
        File::open(path)
    }
}

/// The PSI line is about 60 bytes, two lines 120: 256 is ample.
const PSI_BUF: usize = 256;
/// MemAvailable is the third line of /proc/meminfo, but fixture files and other
/// kernels may order differently; the whole file is about 1.5 KiB. The same buffer
/// holds a cgroup's `memory.stat` (v1 about 1 KiB, v2 about 1.5 KiB on Linux 6.1).
const MEMINFO_BUF: usize = 8192;
/// `memory.limit_in_bytes`, `memory.max` and the usage files: one number or `max`.
const NUMBER_BUF: usize = 32;

/// Which lines a sample needs: only these must be in the files.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Needs {
    /// The metric is a `full_*` average (older kernels write no `full` line for memory).
    pub full_line: bool,
    /// A MemAvailable floor is set.
    pub mem_available: bool,
}

impl Needs {
    /// Everything: the strictest reading (`record`, which writes all columns).
    pub const ALL: Needs = Needs { full_line: true, mem_available: true };
}

/// MemAvailable when the file has none and nothing needs it: the same "plenty"
/// `simulate` uses for a trace without the column.
pub const MEM_AVAILABLE_UNKNOWN: u64 = u64::MAX;

/// Which cgroup interface `pressure.memory_cgroup` is, and so which files it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

impl CgroupVersion {
    /// The limit, the usage, and the `memory.stat` key of the inactive file pages.
    fn files(self) -> (&'static str, &'static str, &'static str) {
        match self {
            // `total_`: the cgroup and its descendants, as the usage counts them.
            CgroupVersion::V1 => ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
            // v2's memory.stat is hierarchical already.
            CgroupVersion::V2 => ("memory.max", "memory.current", "inactive_file"),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        }
    }
}

/// The open files of `pressure.memory_cgroup`.
///
/// Available = limit − (usage − inactive file pages): the limit less the cgroup's
/// working set, which is the figure the kubelet evicts by (its `memory.available`
/// for a cgroup) and `docker stats` shows. Active file pages are **not** counted as
/// available: under a limit, a thrashing workload's own file pages (its binary, an
/// mmap'ed file) are the active ones, refaulted as fast as they are reclaimed, so
/// counting them would keep the figure high exactly while the cgroup thrashes. The
/// kernel's MemAvailable counts part of them; here the figure errs low, towards
/// stepping down. A limit above MemTotal (v1's "unlimited", v2's `max`) is MemTotal,
/// read from `pressure.meminfo` when the sampler is opened.
struct Cgroup<R> {
    version: CgroupVersion,
    dir: PathBuf,
    /// The cgroup's own files, then each ancestor's up to the hierarchy's root: a
    /// limit set on a parent (a slice's `MemoryMax=`) bounds the cgroup as much as its
    /// own does, so the figure is the least of theirs.
    path: Vec<CgroupFiles<R>>,
    mem_total: u64,
    num_buf: [u8; NUMBER_BUF],
}

/// One cgroup's limit, usage and `memory.stat`, open.
struct CgroupFiles<R> {
    dir: PathBuf,
    limit: R,
    usage: R,
    stat: R,
}

impl<R: ReadAt> Cgroup<R> {
    /// The cgroup's available memory, in bytes: the least of its own and every limited
    /// ancestor's. Allocates only on failure.
    fn available(&mut self, stat_buf: &mut [u8]) -> Result<u64, SampleError> {
        let (version, mem_total) = (self.version, self.mem_total);
        let mut least = u64::MAX;
        for (i, files) in self.path.iter_mut().enumerate() {
            // An unlimited ancestor bounds nothing of its own (the host's memory bounds
            // the cgroup itself already).
            if let Some(a) = files.available(version, mem_total, i > 0, &mut self.num_buf, stat_buf)? {
                least = least.min(a);
            }
        }
        Ok(least)
    }
}

impl<R: ReadAt> CgroupFiles<R> {
    fn open(dir: &Path, version: CgroupVersion) -> Result<CgroupFiles<File>, SampleError> {
        let (limit_name, usage_name, _) = version.files();
        let open = |name: &str| {
            File::open(dir.join(name)).map_err(|c| SampleError::Cgroup {
                path: dir.join(name),
                what: "cannot be opened",
                cause: Some(c),
            })
        };
        Ok(CgroupFiles {
            dir: dir.to_path_buf(),
            limit: open(limit_name)?,
            usage: open(usage_name)?,
            stat: open("memory.stat")?,
        })
    }

    /// limit − (usage − inactive file pages); `None` for an unlimited cgroup when
    /// `skip_unlimited` (an ancestor).
    fn available(
        &mut self,
        version: CgroupVersion,
        mem_total: u64,
        skip_unlimited: bool,
        num_buf: &mut [u8; NUMBER_BUF],
        stat_buf: &mut [u8],
    ) -> Result<Option<u64>, SampleError> {
        let (limit_name, usage_name, inactive_key) = version.files();
        let limit = match read_number(&mut self.limit, &self.dir, limit_name, num_buf)? {
            Number::Value(v) if v < mem_total => v,
            _ if skip_unlimited => return Ok(None),
            _ => mem_total,
        };
        let usage = match read_number(&mut self.usage, &self.dir, usage_name, num_buf)? {
            Number::Value(v) => v,
            Number::Max => return Err(self.malformed(usage_name, "\"max\" where a usage in bytes was expected")),
        };
        let n = read_reopening(&mut self.stat, &self.dir, "memory.stat", stat_buf).map_err(|cause| {
            SampleError::Cgroup { path: self.dir.join("memory.stat"), what: "reading", cause: Some(cause) }
        })?;
        let inactive = match parse_stat(&stat_buf[..n], inactive_key.as_bytes()) {
            Ok(v) => v,
            Err(StatError::Missing) => {
                let what = match version {
                    CgroupVersion::V1 => "no total_inactive_file line",
                    CgroupVersion::V2 => "no inactive_file line",
                };
                return Err(self.malformed("memory.stat", what));
            }
            Err(StatError::NotANumber) => {
                return Err(self.malformed("memory.stat", "an inactive_file that is not a whole number"))
            }
        };
        Ok(Some(limit.saturating_sub(usage.saturating_sub(inactive))))
    }

    fn malformed(&self, name: &str, what: &'static str) -> SampleError {
        SampleError::Cgroup { path: self.dir.join(name), what, cause: None }
    }
}

enum Number {
    Max,
    Value(u64),
}

/// Reads a file holding one number (or `max`).
fn read_number<R: ReadAt>(
    r: &mut R,
    dir: &Path,
    name: &str,
    buf: &mut [u8; NUMBER_BUF],
) -> Result<Number, SampleError> {
    let n = read_reopening(r, dir, name, buf).map_err(|cause| SampleError::Cgroup {
        path: dir.join(name),
        what: "reading",
        cause: Some(cause),
    })?;
    parse_number(&buf[..n]).ok_or_else(|| SampleError::Cgroup {
        path: dir.join(name),
        what: "not a whole number of bytes (nor \"max\")",
        cause: None,
    })
}

/// Reads `r` whole; after a failed read, opens `dir/name` again once and retries (a
/// cgroup's files stop reading, ENODEV, once it is removed, and a new one may stand
/// at the same path). Allocates only on that failure.
fn read_reopening<R: ReadAt>(r: &mut R, dir: &Path, name: &str, buf: &mut [u8]) -> io::Result<usize> {
    match read_whole(r, buf) {
        Err(e) if !is_unsupported(&e) => match R::reopen(&dir.join(name)) {
            Ok(fresh) => {
                *r = fresh;
                read_whole(r, buf)
            }
            Err(_) => Err(e),
        },
        other => other,
    }
}

/// One number with an optional newline, or `max` (cgroup v2's "no limit").
fn parse_number(text: &[u8]) -> Option<Number> {
    let text = text.strip_suffix(b"\n").unwrap_or(text);
    if text == b"max" {
        return Some(Number::Max);
    }
    parse_whole(text).map(Number::Value)
}

fn parse_whole(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    let mut v: u64 = 0;
    for &b in digits {
        if !b.is_ascii_digit() {
            return None;
        }
        v = v.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    Some(v)
}

#[derive(Debug, PartialEq)]
enum StatError {
    Missing,
    NotANumber,
}

/// The value of `key` in a `memory.stat` (`key value` lines).
fn parse_stat(text: &[u8], key: &[u8]) -> Result<u64, StatError> {
    for line in text.split(|&b| b == b'\n') {
        let Some(rest) = line.strip_prefix(key) else { continue };
        let Some(value) = rest.strip_prefix(b" ") else { continue };
        return parse_whole(value).ok_or(StatError::NotANumber);
    }
    Err(StatError::Missing)
}

pub struct Sampler<R: ReadAt = File> {
    needs: Needs,
    psi_path: PathBuf,
    meminfo_path: PathBuf,
    psi: R,
    meminfo: R,
    /// `pressure.memory_cgroup`: read instead of MemAvailable.
    cgroup: Option<Cgroup<R>>,
    psi_buf: [u8; PSI_BUF],
    meminfo_buf: Box<[u8; MEMINFO_BUF]>,
}

impl Sampler<File> {
    /// Opens both files. A missing PSI file is [`SampleError::PsiUnavailable`].
    pub fn open(psi: &Path, meminfo: &Path) -> Result<Self, SampleError> {
        let psi_file = File::open(psi).map_err(|cause| {
            if cause.kind() == io::ErrorKind::NotFound || is_unsupported(&cause) {
                SampleError::PsiUnavailable { path: psi.to_path_buf(), cause }
            } else {
                SampleError::Io { path: psi.to_path_buf(), cause }
            }
        })?;
        let meminfo_file =
            File::open(meminfo).map_err(|cause| SampleError::Io { path: meminfo.to_path_buf(), cause })?;
        Ok(Sampler::with_readers(psi, meminfo, psi_file, meminfo_file))
    }

    /// Opens what `[pressure]` names: the PSI file (`source`, which on cgroup v2 is
    /// already the cgroup's `memory.pressure`, see
    /// [`PressureConfig::resolve_psi_source`]), and `meminfo` or `memory_cgroup`.
    /// Requires the lines the configuration needs ([`PressureConfig::needs`]).
    pub fn for_config(p: &PressureConfig) -> Result<Self, SampleError> {
        let s = Sampler::open(&p.source, &p.meminfo)?.needing(p.needs());
        match &p.memory_cgroup {
            Some(cg) => s.with_cgroup(cg),
            None => Ok(s),
        }
    }

    /// Reads available memory from the memory cgroup `dir` (v1 or v2, told apart by
    /// its files) instead of MemAvailable. Each file is opened and read once here, so
    /// a wrong path or an unreadable file is an error now, naming
    /// `pressure.memory_cgroup` and the file.
    pub fn with_cgroup(mut self, dir: &Path) -> Result<Self, SampleError> {
        let err = |name: &str, what: &'static str, cause: Option<io::Error>| SampleError::Cgroup {
            path: dir.join(name),
            what,
            cause,
        };
        let version = if dir.join("memory.limit_in_bytes").exists() {
            CgroupVersion::V1
        } else if dir.join("memory.max").exists() {
            CgroupVersion::V2
        } else if dir.join("memory.current").exists() {
            return Err(err(
                "memory.max",
                "missing: the root of a cgroup v2 hierarchy has no limit; leave pressure.memory_cgroup unset to read \
                 MemAvailable",
                None,
            ));
        } else {
            return Err(err(
                "memory.limit_in_bytes",
                "missing, and so is memory.max: not a memory cgroup (v1 needs the memory controller mounted, v2 \
                 needs \"memory\" in the parent's cgroup.subtree_control)",
                None,
            ));
        };
        // The cgroup, then its ancestors while they are memory cgroups of the same
        // hierarchy (v2's root has no memory.max; v1's root is unlimited and skipped).
        let (limit_name, _, _) = version.files();
        let mut path = vec![CgroupFiles::<File>::open(dir, version)?];
        let mut up = dir.parent();
        while let Some(d) = up.filter(|d| d.join(limit_name).exists()) {
            path.push(CgroupFiles::<File>::open(d, version)?);
            up = d.parent();
        }
        let n = read_whole(&self.meminfo, &mut self.meminfo_buf[..])
            .map_err(|cause| SampleError::Io { path: self.meminfo_path.clone(), cause })?;
        let mem_total = parse_meminfo_kb(&self.meminfo_buf[..n], b"MemTotal:").map_err(|_| SampleError::Malformed {
            path: self.meminfo_path.clone(),
            what: "no MemTotal line in kB, which pressure.memory_cgroup needs to bound an unlimited cgroup",
        })?;
        let mut cg = Cgroup { version, dir: dir.to_path_buf(), path, mem_total, num_buf: [0; NUMBER_BUF] };
        cg.available(&mut self.meminfo_buf[..])?;
        self.cgroup = Some(cg);
        Ok(self)
    }
}

fn is_unsupported(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EOPNOTSUPP) || e.kind() == io::ErrorKind::Unsupported
}

impl<R: ReadAt> Sampler<R> {
    pub fn with_readers(psi_path: &Path, meminfo_path: &Path, psi: R, meminfo: R) -> Self {
        Sampler {
            needs: Needs::ALL,
            psi_path: psi_path.to_path_buf(),
            meminfo_path: meminfo_path.to_path_buf(),
            psi,
            meminfo,
            cgroup: None,
            psi_buf: [0; PSI_BUF],
            meminfo_buf: Box::new([0; MEMINFO_BUF]),
        }
    }

    /// Requires only the lines `needs` names; the others may be missing.
    pub fn needing(mut self, needs: Needs) -> Self {
        self.needs = needs;
        self
    }

    pub fn psi_path(&self) -> &Path {
        &self.psi_path
    }

    /// The cgroup read instead of MemAvailable, and its version.
    pub fn cgroup(&self) -> Option<(&Path, CgroupVersion)> {
        self.cgroup.as_ref().map(|c| (c.dir.as_path(), c.version))
    }

    /// In words, where the available memory comes from (`status`, `watch` at start).
    pub fn memory_source(&self) -> String {
        match &self.cgroup {
            None => format!("MemAvailable of {}", self.meminfo_path.display()),
            Some(c) => {
                let (limit, usage, inactive) = c.version.files();
                format!(
                    "memory cgroup {} {}: {limit} - {usage} + {inactive} of memory.stat (limit at most MemTotal, {} \
                     MiB), and the least of that and the same of each limited ancestor ({} read)",
                    c.version.as_str(),
                    c.dir.display(),
                    c.mem_total >> 20,
                    c.path.len() - 1
                )
            }
        }
    }

    /// Reads the files once. Allocates nothing on success.
    pub fn sample(&mut self) -> Result<Sample, SampleError> {
        let n = read_whole(&self.psi, &mut self.psi_buf).or_else(|cause| {
            if is_unsupported(&cause) {
                return Err(SampleError::PsiUnavailable { path: self.psi_path.clone(), cause });
            }
            // A cgroup's memory.pressure after the cgroup was made again.
            match R::reopen(&self.psi_path) {
                Ok(fresh) => {
                    self.psi = fresh;
                    read_whole(&self.psi, &mut self.psi_buf)
                        .map_err(|cause| SampleError::Io { path: self.psi_path.clone(), cause })
                }
                Err(_) => Err(SampleError::Io { path: self.psi_path.clone(), cause }),
            }
        })?;
        let psi = match parse_psi_lines(&self.psi_buf[..n]) {
            Ok((psi, true)) => psi,
            Ok((psi, false)) if !self.needs.full_line => psi,
            Ok(_) => {
                let path = self.psi_path.clone();
                return Err(SampleError::Lacking { path, what: "no \"full\" line", key: "pressure.metric" });
            }
            Err(what) => return Err(SampleError::Malformed { path: self.psi_path.clone(), what }),
        };
        if let Some(cg) = &mut self.cgroup {
            let mem_available = cg.available(&mut self.meminfo_buf[..])?;
            return Ok(Sample { psi, mem_available });
        }
        let n = read_whole(&self.meminfo, &mut self.meminfo_buf[..])
            .map_err(|cause| SampleError::Io { path: self.meminfo_path.clone(), cause })?;
        let mem_available = match parse_mem_available(&self.meminfo_buf[..n]) {
            Ok(m) => m,
            Err(NO_MEM_AVAILABLE) if !self.needs.mem_available => MEM_AVAILABLE_UNKNOWN,
            Err(NO_MEM_AVAILABLE) => {
                let (path, what) = (self.meminfo_path.clone(), NO_MEM_AVAILABLE);
                return Err(SampleError::Lacking { path, what, key: "pressure.mem_available_floor" });
            }
            Err(what) => return Err(SampleError::Malformed { path: self.meminfo_path.clone(), what }),
        };
        Ok(Sample { psi, mem_available })
    }
}

/// `pread`s from offset 0 until the buffer is full or the file ends. A file larger than
/// the buffer is read as far as it fits: the parsers only need its start.
///
/// A read that returns less than asked for is taken as the end: a regular file reads
/// short only there, and the kernel produces `/proc/meminfo` and a PSI file whole in
/// one read. Not asking again saves a syscall per file per sample (callgrind and
/// strace of a sample: two `pread`s per file before, the second returning 0).
fn read_whole<R: ReadAt>(r: &R, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        let asked = buf.len() - n;
        match r.read_at(&mut buf[n..], n as u64) {
            Ok(0) => break,
            Ok(k) if k < asked => return Ok(n + k),
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Parses `/proc/pressure/memory`:
/// ```text
/// some avg10=0.00 avg60=0.00 avg300=0.00 total=0
/// full avg10=0.00 avg60=0.00 avg300=0.00 total=0
/// ```
///
/// Both lines are required here; [`parse_psi_lines`] says whether `full` was there.
pub fn parse_psi(text: &[u8]) -> Result<Psi, &'static str> {
    match parse_psi_lines(text)? {
        (psi, true) => Ok(psi),
        (_, false) => Err("no \"full\" line"),
    }
}

/// Parses the PSI file, tolerant where kernels differ: fields other than the three
/// averages (`total=`, or any a newer kernel adds) are skipped, and the `full` line may
/// be missing (older kernels have none for memory) — the bool says whether it was
/// there. Strict where it matters: each line present needs all three averages, each a
/// number in 0..=100, and the `some` line must be there.
pub fn parse_psi_lines(text: &[u8]) -> Result<(Psi, bool), &'static str> {
    let mut psi = Psi::default();
    let (mut seen_some, mut seen_full) = (false, false);
    for line in text.split(|&b| b == b'\n') {
        let mut fields = line.split(|&b| b == b' ').filter(|f| !f.is_empty());
        let (target, seen) = match fields.next() {
            Some(b"some") => (&mut psi.some, &mut seen_some),
            Some(b"full") => (&mut psi.full, &mut seen_full),
            Some(_) => return Err("unexpected line (expected \"some ...\" and \"full ...\")"),
            None => continue,
        };
        let mut got = [false; 3];
        for field in fields {
            let Some(eq) = field.iter().position(|&b| b == b'=') else {
                return Err("a field without '='");
            };
            let (key, value) = (&field[..eq], &field[eq + 1..]);
            let slot = match key {
                b"avg10" => 0,
                b"avg60" => 1,
                b"avg300" => 2,
                _ => continue,
            };
            let v = parse_decimal(value).ok_or("an average that is not a number")?;
            if !(0.0..=100.0).contains(&v) {
                return Err("an average outside 0..100");
            }
            target[slot] = v;
            got[slot] = true;
        }
        if got != [true; 3] {
            return Err("a line without all of avg10, avg60 and avg300");
        }
        *seen = true;
    }
    if !seen_some {
        return Err("no \"some\" line");
    }
    Ok((psi, seen_full))
}

/// Parses a non-negative decimal like `12.34` without allocating.
fn parse_decimal(s: &[u8]) -> Option<f64> {
    if s.is_empty() {
        return None;
    }
    let mut int: u64 = 0;
    let mut frac: u64 = 0;
    let mut frac_div: u64 = 1;
    let mut in_frac = false;
    for &b in s {
        match b {
            b'0'..=b'9' => {
                let d = u64::from(b - b'0');
                if in_frac {
                    if frac_div < 1_000_000_000 {
                        frac = frac * 10 + d;
                        frac_div *= 10;
                    }
                } else {
                    int = int.checked_mul(10)?.checked_add(d)?;
                }
            }
            b'.' if !in_frac => in_frac = true,
            _ => return None,
        }
    }
    if in_frac && frac_div == 1 {
        return None;
    }
    Some(int as f64 + frac as f64 / frac_div as f64)
}

/// Finds `MemAvailable:   123456 kB` and returns bytes.
pub fn parse_mem_available(text: &[u8]) -> Result<u64, &'static str> {
    parse_meminfo_kb(text, b"MemAvailable:")
}

/// Finds the line starting with `key` (`MemAvailable:`, `MemTotal:`) and returns bytes.
fn parse_meminfo_kb(text: &[u8], key: &[u8]) -> Result<u64, &'static str> {
    for line in text.split(|&b| b == b'\n') {
        let Some(rest) = line.strip_prefix(key) else { continue };
        let mut fields = rest.split(|&b| b == b' ' || b == b'\t').filter(|f| !f.is_empty());
        let num = fields.next().ok_or("MemAvailable has no value")?;
        let mut kb: u64 = 0;
        for &b in num {
            if !b.is_ascii_digit() {
                return Err("MemAvailable is not a whole number");
            }
            kb = kb
                .checked_mul(10)
                .and_then(|k| k.checked_add(u64::from(b - b'0')))
                .ok_or("MemAvailable is too large")?;
        }
        return match fields.next() {
            Some(b"kB") => kb.checked_mul(1024).ok_or("MemAvailable is too large"),
            _ => Err("MemAvailable is not in kB"),
        };
    }
    Err(NO_MEM_AVAILABLE)
}

const NO_MEM_AVAILABLE: &str = "no MemAvailable line (kernel older than 3.14?)";

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const PSI: &str = "some avg10=12.50 avg60=3.25 avg300=0.75 total=123456\n\
                       full avg10=1.00 avg60=0.50 avg300=0.00 total=789\n";

    #[test]
    fn parses_all_six_averages() {
        let p = parse_psi(PSI.as_bytes()).unwrap();
        assert_eq!(p.some, [12.5, 3.25, 0.75]);
        assert_eq!(p.full, [1.0, 0.5, 0.0]);
    }

    #[test]
    fn rejects_malformed_psi() {
        for bad in [
            "",
            "some avg10=1.00 avg60=1.00 avg300=1.00 total=1\n",
            "full avg10=1.00 avg60=1.00 avg300=1.00 total=1\n",
            "some avg10=1.00 avg60=1.00 total=1\nfull avg10=1.00 avg60=1.00 avg300=1.00 total=1\n",
            "some avg10=x avg60=1.00 avg300=1.00 total=1\nfull avg10=1.00 avg60=1.00 avg300=1.00 total=1\n",
            "some avg10=1.00 avg60=-1.00 avg300=1.00 total=1\nfull avg10=1.00 avg60=1.00 avg300=1.00 total=1\n",
            "some avg10=101.00 avg60=1 avg300=1.00 total=1\nfull avg10=1.00 avg60=1.00 avg300=1.00 total=1\n",
            "cpu avg10=1.00\n",
            "some avg10=1.00 avg60=1.00 avg300=1.00 total=1 future=x\nfull avg10=1 avg60=1 avg300=1\nsome avg10=x\n",
            "some avg10 avg60=1 avg300=1\n",
            "some avg10=1. avg60=1 avg300=1\nfull avg10=1 avg60=1 avg300=1\n",
        ] {
            assert!(parse_psi(bad.as_bytes()).is_err(), "accepted {bad:?}");
        }
    }

    #[test]
    fn tolerates_extra_fields_and_a_missing_full_line() {
        let extra = "some avg10=1.00 avg60=2.00 avg300=3.00 total=1 stall=9\nfull avg10=4 avg60=5 avg300=6 x=y\n";
        let p = parse_psi(extra.as_bytes()).unwrap();
        assert_eq!((p.some, p.full), ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]));
        let (p, full) = parse_psi_lines(b"some avg10=1.00 avg60=2.00 avg300=3.00 total=1\n").unwrap();
        assert_eq!((p.some, full), ([1.0, 2.0, 3.0], false));
        assert!(parse_psi(b"some avg10=1.00 avg60=2.00 avg300=3.00 total=1\n").is_err());
    }

    #[test]
    fn a_line_the_configuration_needs_and_the_kernel_lacks_is_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let (psi, mem) = (dir.path().join("psi"), dir.path().join("meminfo"));
        std::fs::write(&psi, "some avg10=1.00 avg60=2.00 avg300=3.00 total=1\n").unwrap();
        std::fs::write(&mem, "MemTotal: 100 kB\n").unwrap();
        let relaxed = Needs { full_line: false, mem_available: false };
        let a = Sampler::open(&psi, &mem).unwrap().needing(relaxed).sample().unwrap();
        assert_eq!((a.psi.some[0], a.mem_available), (1.0, MEM_AVAILABLE_UNKNOWN));
        let e = Sampler::open(&psi, &mem).unwrap().needing(Needs { full_line: true, ..relaxed }).sample().unwrap_err();
        assert!(e.is_fatal() && e.to_string().contains("pressure.metric"), "{e}");
        let e =
            Sampler::open(&psi, &mem).unwrap().needing(Needs { mem_available: true, ..relaxed }).sample().unwrap_err();
        assert!(e.is_fatal() && e.to_string().contains("pressure.mem_available_floor"), "{e}");
        // A value that does not parse may be a fixture caught mid-write: not fatal.
        std::fs::write(&psi, "some avg10=x avg60=2.00 avg300=3.00 total=1\n").unwrap();
        let e = Sampler::open(&psi, &mem).unwrap().needing(relaxed).sample().unwrap_err();
        assert!(!e.is_fatal(), "{e}");
    }

    #[test]
    fn decimals() {
        assert_eq!(parse_decimal(b"0.00"), Some(0.0));
        assert_eq!(parse_decimal(b"99.99"), Some(99.99));
        assert_eq!(parse_decimal(b"7"), Some(7.0));
        assert_eq!(parse_decimal(b""), None);
        assert_eq!(parse_decimal(b"1.2.3"), None);
        assert_eq!(parse_decimal(b"+1"), None);
    }

    #[test]
    fn parses_mem_available() {
        let m = "MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:    2048 kB\nBuffers: 1 kB\n";
        assert_eq!(parse_mem_available(m.as_bytes()).unwrap(), 2048 * 1024);
        assert_eq!(parse_mem_available(b"MemAvailable:\t5 kB").unwrap(), 5120);
        for bad in [
            "MemTotal: 1 kB\n",
            "MemAvailable: \n",
            "MemAvailable: 12x kB\n",
            "MemAvailable: 12 MB\n",
            "MemAvailable: 12\n",
            "MemAvailable: 99999999999999999999 kB\n",
        ] {
            assert!(parse_mem_available(bad.as_bytes()).is_err(), "accepted {bad:?}");
        }
    }

    #[test]
    fn samples_fixture_files_and_sees_rewrites() {
        let dir = tempfile::tempdir().unwrap();
        let (psi, mem) = (dir.path().join("psi"), dir.path().join("meminfo"));
        std::fs::write(&psi, PSI).unwrap();
        std::fs::write(&mem, "MemAvailable: 100 kB\n").unwrap();
        let mut s = Sampler::open(&psi, &mem).unwrap();
        let a = s.sample().unwrap();
        assert_eq!(a.metric(Metric::SomeAvg10), 12.5);
        assert_eq!(a.metric(Metric::FullAvg60), 0.5);
        assert_eq!(a.mem_available, 100 * 1024);
        // Rewriting in place (shorter) is seen by the already-open file.
        let mut f = std::fs::File::create(&psi).unwrap();
        f.write_all(
            b"some avg10=1.00 avg60=2.00 avg300=3.00 total=1\nfull avg10=4.00 avg60=5.00 avg300=6.00 total=2\n",
        )
        .unwrap();
        drop(f);
        let b = s.sample().unwrap();
        assert_eq!(b.psi.some, [1.0, 2.0, 3.0]);
        assert_eq!(b.psi.full, [4.0, 5.0, 6.0]);
    }

    #[test]
    fn missing_psi_file_names_the_file_and_the_kernel_option() {
        let dir = tempfile::tempdir().unwrap();
        let mem = dir.path().join("meminfo");
        std::fs::write(&mem, "MemAvailable: 100 kB\n").unwrap();
        let psi = dir.path().join("no-such-psi");
        let e = Sampler::open(&psi, &mem).err().unwrap();
        assert!(e.is_fatal());
        let msg = e.to_string();
        assert!(msg.contains("no-such-psi") && msg.contains("CONFIG_PSI") && msg.contains("psi=0"), "{msg}");
        // A cgroup's file missing is no kernel option: on cgroup v1 there is no such file.
        let cg = Path::new("/sys/fs/cgroup/no-such.slice/memory.pressure");
        let msg = Sampler::open(cg, &mem).err().unwrap().to_string();
        assert!(msg.contains("pressure.source") && msg.contains("cgroup v1") && !msg.contains("CONFIG_PSI"), "{msg}");
    }

    struct Unsupported;
    impl ReadAt for Unsupported {
        fn read_at(&self, _: &mut [u8], _: u64) -> io::Result<usize> {
            Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))
        }
    }

    #[test]
    fn eopnotsupp_is_psi_unavailable() {
        let mut s = Sampler::with_readers(
            Path::new("/proc/pressure/memory"),
            Path::new("/proc/meminfo"),
            Unsupported,
            Unsupported,
        );
        let e = s.sample().unwrap_err();
        assert!(e.is_fatal(), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("/proc/pressure/memory") && msg.contains("CONFIG_PSI") && msg.contains("psi=0"), "{msg}");
    }

    /// A cgroup directory as the kernel writes it, v1 or v2.
    fn cgroup_fixture(v: CgroupVersion, limit: &str, usage: u64, inactive: u64, active: u64) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("psi"), PSI).unwrap();
        std::fs::write(d.join("meminfo"), "MemTotal: 4194304 kB\nMemAvailable: 3000000 kB\n").unwrap();
        let cg = d.join("cg");
        std::fs::create_dir(&cg).unwrap();
        match v {
            CgroupVersion::V1 => {
                std::fs::write(cg.join("memory.limit_in_bytes"), format!("{limit}\n")).unwrap();
                std::fs::write(cg.join("memory.usage_in_bytes"), format!("{usage}\n")).unwrap();
                // The cgroup's own lines first, then the hierarchical totals the usage counts.
                std::fs::write(
                    cg.join("memory.stat"),
                    format!(
                        "cache 1\nrss 2\ninactive_file 7\nactive_file 8\nhierarchical_memory_limit 9\n\
                         total_cache 3\ntotal_rss 4\ntotal_inactive_anon 5\ntotal_active_anon 6\n\
                         total_inactive_file {inactive}\ntotal_active_file {active}\ntotal_unevictable 0\n"
                    ),
                )
                .unwrap();
            }
            CgroupVersion::V2 => {
                std::fs::write(cg.join("memory.max"), format!("{limit}\n")).unwrap();
                std::fs::write(cg.join("memory.current"), format!("{usage}\n")).unwrap();
                std::fs::write(
                    cg.join("memory.stat"),
                    format!(
                        "anon 1\nfile 2\nkernel 3\ninactive_anon 4\nactive_anon 5\ninactive_file {inactive}\n\
                         active_file {active}\nunevictable 0\nworkingset_refault_file 0\n"
                    ),
                )
                .unwrap();
                std::fs::write(
                    cg.join("memory.pressure"),
                    "some avg10=55.00 avg60=1.00 avg300=0.00 total=9\nfull avg10=2.00 avg60=0.00 avg300=0.00 total=1\n",
                )
                .unwrap();
            }
        }
        dir
    }

    fn cgroup_config(dir: &Path) -> PressureConfig {
        let mut c = PressureConfig {
            source: dir.join("psi"),
            meminfo: dir.join("meminfo"),
            memory_cgroup: Some(dir.join("cg")),
            ..PressureConfig::default()
        };
        c.resolve_psi_source();
        c
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_v1_cgroup_is_limit_less_usage_plus_inactive_file_pages() {
        let dir = cgroup_fixture(CgroupVersion::V1, &(512 * MIB).to_string(), 400 * MIB, 50 * MIB, 30 * MIB);
        let cfg = cgroup_config(dir.path());
        // No memory.pressure on v1: the PSI stays the host's.
        assert_eq!(cfg.source, dir.path().join("psi"));
        let mut s = Sampler::for_config(&cfg).unwrap();
        assert_eq!(s.cgroup().unwrap().1, CgroupVersion::V1);
        // 512 - 400 + 50 (total_inactive_file; not total_active_file, not the cgroup's own 7).
        assert_eq!(s.sample().unwrap().mem_available, 162 * MIB);
        // The usage grows: the figure follows on the next sample from the open files.
        std::fs::write(dir.path().join("cg/memory.usage_in_bytes"), format!("{}\n", 500 * MIB)).unwrap();
        assert_eq!(s.sample().unwrap().mem_available, 62 * MIB);
        assert!(s.memory_source().contains("memory.limit_in_bytes - memory.usage_in_bytes + total_inactive_file"));
        // Usage above the limit (charged past it briefly) is 0, not an underflow.
        std::fs::write(dir.path().join("cg/memory.usage_in_bytes"), format!("{}\n", 600 * MIB)).unwrap();
        assert_eq!(s.sample().unwrap().mem_available, 0);
    }

    #[test]
    fn an_unlimited_cgroup_is_bounded_by_mem_total() {
        // v1's "unlimited" (PAGE_COUNTER_MAX pages) and v2's "max".
        for (v, limit) in [(CgroupVersion::V1, "9223372036854771712"), (CgroupVersion::V2, "max")] {
            let dir = cgroup_fixture(v, limit, 1024 * MIB, 100 * MIB, 0);
            let mut s = Sampler::for_config(&cgroup_config(dir.path())).unwrap();
            assert_eq!(s.sample().unwrap().mem_available, (4096 - 1024 + 100) * MIB, "{v:?}");
        }
    }

    /// Was (issue 38, finding 4): only the configured cgroup's own limit was read, so an
    /// unlimited `k3s.service` under a slice limited to 512 MiB, 500 MiB used, read as
    /// 3.5 GiB available while it thrashed at its real limit. Now the least of the
    /// cgroup's and every limited ancestor's figure; an unlimited ancestor is skipped.
    #[test]
    fn a_limit_on_an_ancestor_bounds_the_cgroup() {
        for (v, unlimited) in [(CgroupVersion::V1, "9223372036854771712"), (CgroupVersion::V2, "max")] {
            let dir = cgroup_fixture(v, &(512 * MIB).to_string(), 500 * MIB, 0, 0);
            let parent = dir.path().join("cg");
            let child = parent.join("k3s.service");
            std::fs::create_dir(&child).unwrap();
            for f in ["memory.limit_in_bytes", "memory.max"].iter().filter(|f| parent.join(f).exists()) {
                std::fs::write(child.join(f), format!("{unlimited}\n")).unwrap();
            }
            for f in ["memory.usage_in_bytes", "memory.current", "memory.stat", "memory.pressure"] {
                if parent.join(f).exists() {
                    std::fs::copy(parent.join(f), child.join(f)).unwrap();
                }
            }
            let cfg = PressureConfig { memory_cgroup: Some(child.clone()), ..cgroup_config(dir.path()) };
            let mut s = Sampler::for_config(&cfg).unwrap();
            assert_eq!(s.sample().unwrap().mem_available, 12 * MIB, "{v:?}: the parent's 512 - 500");
            assert!(s.memory_source().contains("(1 read)"), "{}", s.memory_source());
            // The parent's limit lifted (at run time, as `systemctl set-property`): the
            // cgroup's own figure, bounded by MemTotal.
            let limit = if v == CgroupVersion::V1 { "memory.limit_in_bytes" } else { "memory.max" };
            std::fs::write(parent.join(limit), format!("{unlimited}\n")).unwrap();
            assert_eq!(s.sample().unwrap().mem_available, (4096 - 500) * MIB, "{v:?}");
        }
    }

    #[test]
    fn a_v2_cgroup_is_read_with_its_own_pressure_file() {
        let dir = cgroup_fixture(CgroupVersion::V2, &(256 * MIB).to_string(), 200 * MIB, 16 * MIB, 64 * MIB);
        // `source` left at its default: the cgroup's memory.pressure takes its place.
        let mut cfg = PressureConfig { source: PathBuf::from(PROC_PSI), ..cgroup_config(dir.path()) };
        cfg.resolve_psi_source();
        assert_eq!(cfg.source, dir.path().join("cg/memory.pressure"), "the cgroup's PSI is the source");
        let mut s = Sampler::for_config(&cfg).unwrap();
        assert_eq!(s.cgroup().unwrap().1, CgroupVersion::V2);
        let a = s.sample().unwrap();
        assert_eq!((a.mem_available, a.psi.some[0]), (72 * MIB, 55.0));
        // A source named explicitly is kept.
        let mut explicit = cgroup_config(dir.path());
        explicit.source = dir.path().join("psi");
        explicit.resolve_psi_source();
        assert_eq!(explicit.source, dir.path().join("psi"));
    }

    #[test]
    fn a_missing_or_unparsable_cgroup_file_names_the_key_and_the_file() {
        let dir = cgroup_fixture(CgroupVersion::V1, "1000", 10, 0, 0);
        let cg = dir.path().join("cg");
        let cfg = cgroup_config(dir.path());
        let msg = |e: SampleError| e.to_string();
        std::fs::remove_file(cg.join("memory.usage_in_bytes")).unwrap();
        let e = msg(Sampler::for_config(&cfg).err().unwrap());
        assert!(e.contains("pressure.memory_cgroup") && e.contains("memory.usage_in_bytes"), "{e}");
        std::fs::write(cg.join("memory.usage_in_bytes"), "lots\n").unwrap();
        let e = msg(Sampler::for_config(&cfg).err().unwrap());
        assert!(e.contains("pressure.memory_cgroup") && e.contains("memory.usage_in_bytes: not a whole"), "{e}");
        std::fs::write(cg.join("memory.usage_in_bytes"), "10\n").unwrap();
        std::fs::write(cg.join("memory.stat"), "total_cache 1\n").unwrap();
        let e = msg(Sampler::for_config(&cfg).err().unwrap());
        assert!(e.contains("memory.stat: no total_inactive_file line"), "{e}");
        // Not a memory cgroup at all.
        let mut other = cfg.clone();
        other.memory_cgroup = Some(dir.path().to_path_buf());
        let e = msg(Sampler::for_config(&other).err().unwrap());
        assert!(e.contains("pressure.memory_cgroup") && e.contains("not a memory cgroup"), "{e}");
        // The root of a v2 hierarchy: usage but no limit.
        std::fs::write(dir.path().join("memory.current"), "1\n").unwrap();
        let e = msg(Sampler::for_config(&other).err().unwrap());
        assert!(e.contains("memory.max") && e.contains("root"), "{e}");
        // A relative path is refused by the configuration check.
        other.memory_cgroup = Some(PathBuf::from("sys/fs/cgroup/k3s"));
        let e = other.validate().unwrap_err().to_string();
        assert!(e.contains("pressure.memory_cgroup") && e.contains("absolute"), "{e}");
    }

    #[test]
    fn a_cgroup_made_again_is_opened_again() {
        let dir = cgroup_fixture(CgroupVersion::V2, &(100 * MIB).to_string(), 50 * MIB, 0, 0);
        let cg = dir.path().join("cg");
        let mut s = Sampler::for_config(&cgroup_config(dir.path())).unwrap();
        assert_eq!(s.sample().unwrap().mem_available, 50 * MIB);
        // A regular file keeps reading after it is replaced; make the old one fail to
        // read instead, as a removed cgroup's files do (ENODEV): a directory cannot be read.
        let cg_gone = dir.path().join("cg-gone");
        std::fs::rename(&cg, &cg_gone).unwrap();
        std::fs::create_dir(&cg).unwrap();
        for f in ["memory.max", "memory.current", "memory.stat", "memory.pressure"] {
            std::fs::copy(cg_gone.join(f), cg.join(f)).unwrap();
        }
        std::fs::write(cg.join("memory.current"), format!("{}\n", 90 * MIB)).unwrap();
        s.cgroup.as_mut().unwrap().path[0].usage = File::open(dir.path()).unwrap();
        assert_eq!(s.sample().unwrap().mem_available, 10 * MIB, "the usage file was opened again by its path");
    }

    #[test]
    fn reads_the_real_cgroup_when_present() {
        let cg = Path::new("/sys/fs/cgroup/memory");
        if !cg.join("memory.limit_in_bytes").exists() || !Path::new(PROC_PSI).exists() {
            return;
        }
        let cfg = PressureConfig { memory_cgroup: Some(cg.to_path_buf()), ..PressureConfig::default() };
        let a = Sampler::for_config(&cfg).unwrap().sample().unwrap();
        assert!(a.mem_available > 0);
    }

    #[test]
    fn reads_the_real_proc_files_when_present() {
        if !Path::new("/proc/pressure/memory").exists() {
            return;
        }
        let mut s = Sampler::open(Path::new("/proc/pressure/memory"), Path::new("/proc/meminfo")).unwrap();
        let a = s.sample().unwrap();
        assert!(a.mem_available > 0);
    }
}
