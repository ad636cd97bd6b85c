//! Logs go to the journal, with structured fields, when systemd says stderr is the
//! journal (`JOURNAL_STREAM`), and to stderr otherwise. `REGRADE_LOG` sets the level
//! (error, warn, info, debug, trace; default info).

use std::os::unix::fs::MetadataExt;

use tracing::level_filters::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

pub fn init() {
    let level =
        std::env::var("REGRADE_LOG").ok().and_then(|s| s.parse::<LevelFilter>().ok()).unwrap_or(LevelFilter::INFO);
    if stderr_is_journal() {
        if let Ok(journald) = tracing_journald::layer() {
            let _ = tracing_subscriber::registry().with(journald.with_filter(level)).try_init();
            return;
        }
    }
    // Colour only on a terminal: piped or captured logs stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_target(false).with_ansi(ansi);
    let _ = tracing_subscriber::registry().with(fmt.with_filter(level)).try_init();
}

/// `JOURNAL_STREAM` is `<device>:<inode>` of the journal's stream; it names stderr
/// only if stderr's own device and inode match (a child may inherit the variable).
fn stderr_is_journal() -> bool {
    let Ok(js) = std::env::var("JOURNAL_STREAM") else { return false };
    let Some((dev, ino)) = js.split_once(':') else { return false };
    // /proc/self/fd/2 resolves to stderr itself, socket or not.
    let Ok(meta) = std::fs::metadata("/proc/self/fd/2") else { return false };
    dev.parse::<u64>().ok() == Some(meta.dev()) && ino.parse::<u64>().ok() == Some(meta.ino())
}
