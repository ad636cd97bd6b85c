//! The process around the loop: the async runtime every command that talks to the
//! cluster or k3s runs on, and locking the daemon's memory.

/// One thread is plenty: one sample at a time, one step at a time.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

/// Locks the daemon's memory so a thrashing host cannot page it out. `MCL_ONFAULT`
/// locks pages as they are touched, so code never run (most of the binary) costs nothing.
fn lock_memory() {
    let flags = libc::MCL_CURRENT | libc::MCL_FUTURE | libc::MCL_ONFAULT;
    // SAFETY: mlockall takes flags only and changes no Rust-visible state.
    if unsafe { libc::mlockall(flags) } != 0 {
        let e = std::io::Error::last_os_error();
        tracing::warn!(error = %e, "could not lock memory (mlockall); going on unlocked (needs CAP_IPC_LOCK)");
    }
}

/// Reading the arguments and the configuration runs code (clap, toml, serde, the
/// checks) that `watch` never runs again, and pages locked on fault stay resident
/// for good. So `watch` calls this once, right after: unlock, drop the mapped pages
/// of every file's code (`r-xp` only: never anything writable, nor read-only data,
/// which may hold relocations), and lock on fault.
///
/// Then the whole of regrade's own binary (its code, read-only data and data) is
/// locked at once, read from the file now: a step runs code nothing ran before it
/// (D-Bus to systemd, the etcd gate's client, a rollback), and on a thrashing host
/// each page of it would be a major fault, read from disk when the host can least
/// afford it. That costs the binary's size in VmRSS (tests/bench/step_faults.sh
/// prints both). Shared libraries stay locked on fault only: what of them the step
/// runs is mostly what start-up ran already (the bench counts what is left).
/// `REGRADE_TEST_TEXT_ON_FAULT=1` leaves the binary locked on fault too, as before,
/// for that benchmark's comparison.
pub fn shed_start_up_code() {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return };
    let exe = std::fs::read_link("/proc/self/exe").ok();
    // SAFETY: munlockall takes no arguments and changes no Rust-visible state.
    unsafe { libc::munlockall() };
    let mut own = Vec::new();
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else { continue };
        // offset, device and inode hold no '/': the path (which may hold spaces) is
        // the rest of the line from its first '/'. Not [vdso], not anonymous.
        let Some(path) = line.find('/').map(|i| &line[i..]) else { continue };
        let Some((start, end)) = range.split_once('-') else { continue };
        let (Ok(start), Ok(end)) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16)) else {
            continue;
        };
        if exe.as_deref().is_some_and(|e| e.as_os_str() == path) {
            own.push((start, end));
        }
        if perms != "r-xp" {
            continue;
        }
        // SAFETY: a private, read-only, executable file mapping: dropping its pages
        // only makes the next access read them from the file again, unchanged.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
    }
    lock_memory();
    if std::env::var_os("REGRADE_TEST_TEXT_ON_FAULT").is_some_and(|v| v == "1") {
        return;
    }
    let mut failed = None;
    for (start, end) in own {
        // SAFETY: mlock faults in and pins pages of a mapping of this process; it
        // changes no contents (a private writable mapping is copied on write, as a
        // write would).
        if unsafe { libc::mlock(start as *const libc::c_void, end - start) } != 0 {
            failed = Some(std::io::Error::last_os_error());
        }
    }
    if let Some(e) = failed {
        tracing::warn!(error = %e, "could not lock regrade's own binary (mlock); its code is locked as it runs");
    }
}
