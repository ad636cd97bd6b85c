//! Reading memory pressure: the PSI file and MemAvailable (docs/behaviour.md,
//! "Pressure"), and `[pressure]`, the section that configures it and the core.
//!
//! Both files stay open for the life of the sampler and are re-read with `pread` into
//! fixed buffers, so a sample opens nothing and allocates nothing: on a host that is
//! thrashing, the watcher must not need memory to notice it.

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
            source: PathBuf::from("/proc/pressure/memory"),
            meminfo: PathBuf::from("/proc/meminfo"),
        }
    }
}

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

    /// Rejects values no server could run with, naming the key as `pressure.key`.
    pub fn validate(&self) -> anyhow::Result<()> {
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
}

impl std::fmt::Display for SampleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
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
pub trait ReadAt {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
}

impl ReadAt for File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        FileExt::read_at(self, buf, offset)
    }
}

/// The PSI line is about 60 bytes, two lines 120: 256 is ample.
const PSI_BUF: usize = 256;
/// MemAvailable is the third line of /proc/meminfo, but fixture files and other
/// kernels may order differently; the whole file is about 1.5 KiB.
const MEMINFO_BUF: usize = 8192;

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

pub struct Sampler<R: ReadAt = File> {
    needs: Needs,
    psi_path: PathBuf,
    meminfo_path: PathBuf,
    psi: R,
    meminfo: R,
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

    /// Reads both files once. Allocates nothing on success.
    pub fn sample(&mut self) -> Result<Sample, SampleError> {
        let n = read_whole(&self.psi, &mut self.psi_buf).map_err(|cause| {
            if is_unsupported(&cause) {
                SampleError::PsiUnavailable { path: self.psi_path.clone(), cause }
            } else {
                SampleError::Io { path: self.psi_path.clone(), cause }
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
    for line in text.split(|&b| b == b'\n') {
        let Some(rest) = line.strip_prefix(b"MemAvailable:") else { continue };
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
