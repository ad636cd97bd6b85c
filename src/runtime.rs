//! The process around the loop: the async runtime every command that talks to the
//! cluster or k3s runs on, and locking the daemon's memory.

/// One thread is plenty: one sample at a time, one step at a time.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

/// Locks the daemon's memory so a thrashing host cannot page it out. `MCL_ONFAULT`
/// locks pages as they are touched, so code never run (most of the binary) costs nothing.
pub fn lock_memory() {
    let flags = libc::MCL_CURRENT | libc::MCL_FUTURE | libc::MCL_ONFAULT;
    // SAFETY: mlockall takes flags only and changes no Rust-visible state.
    if unsafe { libc::mlockall(flags) } != 0 {
        let e = std::io::Error::last_os_error();
        tracing::warn!(error = %e, "could not lock memory (mlockall); going on unlocked (needs CAP_IPC_LOCK)");
    }
}
