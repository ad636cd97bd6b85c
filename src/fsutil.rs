//! Replacing and removing small files so that a reader (k3s, the entrypoint, `status`,
//! a restarted regrade) sees either the old file or the new one whole, even across a
//! crash or power loss: write a temporary file in the same directory, fsync it,
//! rename it over the target, fsync the directory (the rename itself is only durable
//! once the directory is). And reading a file that may be absent.
//!
//! Every durable write is named by its caller (`level-record`, `dropin`, …): the name
//! is what a test's cut points at (`REGRADE_TEST_KILL_AT=<write>:<moment>`, see
//! [`crate::kill_point`]) and, in a build with the `fsync-faults` feature (tests only),
//! what `REGRADE_TEST_NO_FSYNC` takes an fsync out of, to show a power-cut test
//! catching the loss.
//!
//! A file that means something only while its writer runs (`watch`'s published state,
//! the drain's progress: their readers check that the writer's PID is alive) is
//! replaced the same way but without the fsyncs ([`publish_atomic`]): a power loss ends
//! its writer, so durability buys nothing, and under memory pressure each fsync waits
//! for a disk the thrash keeps busy (0.1-0.3 s each, measured in the incident test).

use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::kill_point::{self, Moment};

/// Makes `path` hold exactly `bytes`, with permission bits `mode` (set explicitly, so
/// the process's umask does not change them), creating its directory if missing.
/// On failure the old file is untouched and no temporary file is left behind.
///
/// The temporary name starts with a dot and ends in `.tmp`, so directory readers that
/// pick files by suffix (k3s reads `config.yaml.d/*.yaml`) never take it, and carries
/// the process id and a counter, so two writers of one path never share it. `write`
/// names the write (see the module documentation).
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32, write: &str) -> io::Result<()> {
    replace(path, bytes, mode, Some(write)).map(drop)
}

/// [`write_atomic`], and the new file, still open: what it wrote, for a writer that
/// wants to tell later whether the file is still the one it wrote (same inode).
pub fn write_atomic_kept(path: &Path, bytes: &[u8], mode: u32, write: &str) -> io::Result<File> {
    replace(path, bytes, mode, Some(write))
}

/// As [`write_atomic`] (readers see the old file or the new one whole) but not durable:
/// for a file that is void once its writer is gone (see the module documentation).
pub fn publish_atomic(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    replace(path, bytes, mode, None).map(drop)
}

/// Returns the new file, open (it is `path` once renamed). `durable`: the write's name,
/// for a durable write; `None` for a published one.
fn replace(path: &Path, bytes: &[u8], mode: u32, durable: Option<&str>) -> io::Result<File> {
    let dir = parent(path);
    fs::create_dir_all(dir)?;
    let (tmp, mut f) = create_temp(dir, path)?;
    // Held until this process closes the file or dies: how another writer of the same
    // path tells a live temporary from a dead one (see remove_stale_temporaries).
    lock(&f, libc::LOCK_EX)?;
    let written = (|| {
        f.set_permissions(Permissions::from_mode(mode))?;
        f.write_all(bytes)?;
        if let Some(write) = durable {
            kill_point::in_write(write, Moment::BeforeFsync);
            if !fsync_faulted(write, false) {
                f.sync_all()?;
                count_sync();
            }
            kill_point::in_write(write, Moment::BeforeRename);
        }
        fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    if let Some(write) = durable {
        kill_point::in_write(write, Moment::BeforeDirFsync);
        sync_dir(dir, write)?;
    }
    remove_stale_temporaries(dir, path);
    Ok(f)
}

/// How old an unlocked temporary must be before it is taken for a dead writer's: a
/// writer locks its temporary right after creating it, and this leaves that moment
/// (and any clock step) far behind.
const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// Removes the temporaries of `path` that a writer left when it died mid-write (a
/// crash, a power cut): those whose lock no process holds (the kernel lets go of it
/// when the writer dies) and that are over a minute old, or that were written before
/// this boot. Best effort: nothing reads them, they only take room. A live writer's
/// temporary (another process writing the same path now) is left alone.
///
/// Not by `/proc/<pid>` (issue 55): under `ProtectProc=invisible` regrade.service does
/// not see other processes, so a live `regrade record-start` or hand step looked dead.
fn remove_stale_temporaries(dir: &Path, path: &Path) {
    let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else { return };
    let Ok(entries) = fs::read_dir(dir) else { return };
    let prefix = format!(".{name}.");
    // Read only when a temporary of another process is found (most writes find none).
    let mut booted = None;
    for e in entries.flatten() {
        let file = e.file_name();
        let Some(pid) = file.to_str().and_then(|f| temporary_writer(f, &prefix)) else { continue };
        if pid == std::process::id() {
            continue;
        }
        let mut before_boot = || {
            let mtime = e.metadata().and_then(|m| m.modified()).ok();
            matches!((mtime, *booted.get_or_insert_with(boot_time)), (Some(m), Some(b)) if m < b)
        };
        let old = || {
            let age = e.metadata().and_then(|m| m.modified()).ok().and_then(|m| m.elapsed().ok());
            age.is_some_and(|a| a >= STALE_AFTER)
        };
        let unlocked = File::open(e.path()).is_ok_and(|f| lock(&f, libc::LOCK_EX | libc::LOCK_NB).is_ok());
        if unlocked && (old() || before_boot()) {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// `flock(2)` on `f`.
fn lock(f: &File, how: libc::c_int) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor this File owns; no memory is passed.
    match unsafe { libc::flock(f.as_raw_fd(), how) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// The writer's PID of a temporary named as [`create_temp`] names them
/// (`<prefix><pid>-<n>.tmp`).
fn temporary_writer(file: &str, prefix: &str) -> Option<u32> {
    let (pid, n) = file.strip_prefix(prefix)?.strip_suffix(".tmp")?.split_once('-')?;
    n.parse::<u64>().ok()?;
    pid.parse().ok()
}

/// When this boot began (`btime` of /proc/stat).
fn boot_time() -> Option<std::time::SystemTime> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let secs: u64 = stat.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse().ok()?;
    Some(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
}

/// Removes `path` durably (the directory is fsynced after). A missing file is not an
/// error: the outcome, no file, is the one asked for. `write` names it as for
/// [`write_atomic`] (its one cut: removed, the directory not yet fsynced).
pub fn remove_durable(path: &Path, write: &str) -> io::Result<()> {
    match fs::remove_file(path) {
        Ok(()) => {
            kill_point::in_write(write, Moment::BeforeDirFsync);
            sync_dir(parent(path), write)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// The file's bytes, or `None` when there is no file. Every other error is an error:
/// an unreadable file is not an absent one.
pub fn read_if_exists(path: &Path) -> io::Result<Option<Vec<u8>>> {
    absent_is_none(fs::read(path))
}

/// [`read_if_exists`] for a text file.
pub fn read_string_if_exists(path: &Path) -> io::Result<Option<String>> {
    absent_is_none(fs::read_to_string(path))
}

fn absent_is_none<T>(r: io::Result<T>) -> io::Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn parent(path: &Path) -> &Path {
    path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

fn sync_dir(dir: &Path, write: &str) -> io::Result<()> {
    if fsync_faulted(write, true) {
        return Ok(());
    }
    File::open(dir)?.sync_all()?;
    count_sync();
    Ok(())
}

/// The `fsync-faults` build's mutation (tests only): whether `REGRADE_TEST_NO_FSYNC`
/// takes this fsync out (the file's, or with `dir` its directory's). Always false in
/// every other build.
fn fsync_faulted(write: &str, dir: bool) -> bool {
    #[cfg(feature = "fsync-faults")]
    {
        let asked = std::env::var(kill_point::NO_FSYNC_ENV).ok();
        if kill_point::fsync_skipped(asked.as_deref(), write, dir) {
            let what = if dir { "its directory's fsync" } else { "its fsync" };
            tracing::warn!(write, "{}: {write} without {what} (fsync-faults build)", kill_point::NO_FSYNC_ENV);
            return true;
        }
    }
    let _ = (write, dir);
    false
}

#[cfg(test)]
thread_local! {
    /// The fsyncs this thread made: what tells a durable replacement from a published one.
    static SYNCS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

fn count_sync() {
    #[cfg(test)]
    SYNCS.with(|n| n.set(n.get() + 1));
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A new file beside `path` that no one else has open: `O_EXCL` on a name unique to
/// this process and call; a leftover of a crashed writer with the same pid is skipped.
fn create_temp(dir: &Path, path: &Path) -> io::Result<(PathBuf, File)> {
    let name = path.file_name().ok_or_else(|| io::Error::other(format!("{} names no file", path.display())))?;
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{}.{}-{n}.tmp", name.to_string_lossy(), std::process::id()));
        match OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<_> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        v.sort();
        v
    }

    #[test]
    fn replaces_whole_with_the_mode_asked_for_whatever_the_umask() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/dir/file.yaml");
        write_atomic(&p, b"one\n", 0o644, "t").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"one\n");
        assert_eq!(fs::metadata(&p).unwrap().permissions().mode() & 0o7777, 0o644);
        write_atomic(&p, b"two\n", 0o600, "t").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two\n");
        assert_eq!(fs::metadata(&p).unwrap().permissions().mode() & 0o7777, 0o600);
        assert_eq!(names(p.parent().unwrap()), ["file.yaml"], "no temporary file is left behind");
    }

    #[test]
    fn published_files_replace_whole_without_the_fsyncs_of_durable_ones() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("run/state.json");
        let syncs = || SYNCS.with(|n| n.get());
        let before = syncs();
        write_atomic(&p, b"durable\n", 0o644, "t").unwrap();
        assert_eq!(syncs() - before, 2, "the file and its directory");
        let before = syncs();
        publish_atomic(&p, b"published\n", 0o640).unwrap();
        assert_eq!(syncs() - before, 0, "a published file is not fsynced");
        assert_eq!(fs::read(&p).unwrap(), b"published\n");
        assert_eq!(fs::metadata(&p).unwrap().permissions().mode() & 0o7777, 0o640);
        assert_eq!(names(p.parent().unwrap()), ["state.json"], "no temporary file is left behind");
    }

    #[cfg(feature = "fsync-faults")]
    #[test]
    fn the_fsync_faults_build_takes_out_only_the_fsync_named() {
        // Names no other test writes, so the variable touches no other test.
        std::env::set_var(kill_point::NO_FSYNC_ENV, "mutated-file, mutated-dir:dir");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let syncs = || SYNCS.with(|n| n.get());
        for (write, expected) in [("mutated-file", 1), ("mutated-dir", 1), ("mutated-file@tag", 1), ("other", 2)] {
            let before = syncs();
            write_atomic(&p, write.as_bytes(), 0o644, write).unwrap();
            assert_eq!(syncs() - before, expected, "{write}");
            assert_eq!(fs::read(&p).unwrap(), write.as_bytes(), "still replaced whole");
        }
    }

    #[test]
    fn a_leftover_temporary_file_is_neither_reused_nor_clobbered() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        // Crashed writers' temporary files on every name the next calls could pick
        // (other tests running meanwhile take far fewer than 200 of them).
        let base = COUNTER.load(Ordering::Relaxed);
        let stale: Vec<_> =
            (base..base + 200).map(|n| dir.path().join(format!(".f.{}-{n}.tmp", std::process::id()))).collect();
        for s in &stale {
            fs::write(s, b"stale").unwrap();
        }
        for _ in 0..3 {
            write_atomic(&p, b"new", 0o644, "t").unwrap();
        }
        assert_eq!(fs::read(&p).unwrap(), b"new");
        assert!(stale.iter().all(|s| fs::read(s).unwrap() == b"stale"));
    }

    #[test]
    fn a_dead_writers_temporaries_are_removed_by_the_next_write() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let dead = dir.path().join(".f.4294967294-7.tmp");
        let just_made = dir.path().join(".f.4294967294-8.tmp");
        let before_boot = dir.path().join(".f.1-4.tmp");
        let other = dir.path().join(".g.4294967294-7.tmp");
        for s in [&dead, &just_made, &before_boot, &other] {
            fs::write(s, b"stale").unwrap();
        }
        let ago = |secs| std::time::SystemTime::now() - std::time::Duration::from_secs(secs);
        File::options().write(true).open(&dead).unwrap().set_modified(ago(120)).unwrap();
        File::options().write(true).open(&other).unwrap().set_modified(ago(120)).unwrap();
        File::options().write(true).open(&before_boot).unwrap().set_modified(std::time::UNIX_EPOCH).unwrap();
        write_atomic(&p, b"new", 0o644, "t").unwrap();
        assert!(!dead.exists(), "a dead writer's temporary stays");
        assert!(!before_boot.exists(), "a temporary from before this boot stays");
        assert!(just_made.exists(), "a temporary made a moment ago (its writer about to lock it) went");
        assert!(other.exists(), "another file's temporary went");
        assert_eq!(temporary_writer(".f.12-0.tmp", ".f."), Some(12));
        assert_eq!(temporary_writer(".f.x-0.tmp", ".f."), None);
        assert_eq!(temporary_writer(".f.12.tmp", ".f."), None);
    }

    /// Issue 55's suspicion: under `ProtectProc=invisible` regrade.service sees no
    /// other process in /proc, so a live writer (`regrade record-start`, a hand step)
    /// looked dead and its temporary was removed under it. Now a temporary is judged
    /// by its lock, which its writer holds whether or not its PID can be seen: here
    /// one whose PID exists nowhere, old, and locked, is left alone.
    #[test]
    fn a_live_writers_temporary_stays_though_its_pid_cannot_be_seen() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let live = dir.path().join(".f.4294967294-9.tmp");
        fs::write(&live, b"half").unwrap();
        let writer = File::options().write(true).open(&live).unwrap();
        writer.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(600)).unwrap();
        lock(&writer, libc::LOCK_EX).unwrap();
        write_atomic(&p, b"new", 0o644, "t").unwrap();
        assert!(live.exists(), "a live writer's temporary was removed");
        drop(writer);
        write_atomic(&p, b"newer", 0o644, "t").unwrap();
        assert!(!live.exists(), "its writer gone (the lock with it), it stays");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        write_atomic(&p, b"old", 0o644, "t").unwrap();
        // A directory where the file should go: the rename fails.
        let d = dir.path().join("d");
        fs::create_dir_all(d.join("x")).unwrap();
        assert!(write_atomic(&d, b"new", 0o644, "t").is_err());
        assert_eq!(fs::read(&p).unwrap(), b"old");
        assert_eq!(names(dir.path()), ["d", "f"]);
    }

    #[test]
    fn absent_is_none_but_unreadable_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        assert_eq!(read_if_exists(&p).unwrap(), None);
        assert_eq!(read_string_if_exists(&p).unwrap(), None);
        write_atomic(&p, b"x", 0o644, "t").unwrap();
        assert_eq!(read_if_exists(&p).unwrap().as_deref(), Some(&b"x"[..]));
        assert_eq!(read_string_if_exists(&p).unwrap().as_deref(), Some("x"));
        assert!(read_if_exists(dir.path()).is_err(), "a directory is not an absent file");
    }

    #[test]
    fn remove_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        write_atomic(&p, b"x", 0o644, "t").unwrap();
        remove_durable(&p, "t").unwrap();
        assert!(!p.exists());
        remove_durable(&p, "t").unwrap();
        assert!(remove_durable(dir.path(), "t").is_err(), "a directory is not removed as a file");
    }
}
