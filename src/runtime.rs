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
/// which may hold relocations), and lock on fault. What runs from then on (the
/// runtime, the clients, the first look at the Node, the loop) is faulted in and
/// locked as before; the files stay in the page cache.
pub fn shed_start_up_code() {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return };
    // SAFETY: munlockall takes no arguments and changes no Rust-visible state.
    unsafe { libc::munlockall() };
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else { continue };
        // offset, device, inode, then the path: code of a file, not [vdso] or anonymous.
        if perms != "r-xp" || !fields.nth(3).is_some_and(|p| p.starts_with('/')) {
            continue;
        }
        let Some((start, end)) = range.split_once('-') else { continue };
        let (Ok(start), Ok(end)) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16)) else {
            continue;
        };
        // SAFETY: a private, read-only, executable file mapping: dropping its pages
        // only makes the next access read them from the file again, unchanged.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
    }
    lock_memory();
}
