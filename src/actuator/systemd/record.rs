//! The record of the level k3s was started at (or, after a step that needed no
//! restart, runs at now), under `/run` so a reboot forgets it while the drop-in stays.

use std::path::Path;

use anyhow::Context;

use crate::fsutil;
use crate::level::Level;

/// The recorded level; `None` when there is no record (k3s not started through the
/// hook since boot).
pub fn read(path: &Path) -> anyhow::Result<Option<Level>> {
    let text =
        fsutil::read_string_if_exists(path).with_context(|| format!("reading the level record {}", path.display()))?;
    text.map(|s| s.trim().parse().map_err(|e| anyhow::anyhow!("the level record {}: {e}", path.display()))).transpose()
}

/// Replaces the record whole (see [`crate::fsutil`]), creating its directory. World
/// readable: `regrade status` run by an operator reads it.
pub fn write(path: &Path, level: Level) -> anyhow::Result<()> {
    fsutil::write_atomic(path, format!("{level}\n").as_bytes(), 0o644, "start-record")
        .with_context(|| format!("writing the level record {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn round_trips_and_names_the_file_when_garbled() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("regrade/started-level");
        assert_eq!(read(&p).unwrap(), None);
        write(&p, Level::EtcdOnly).unwrap();
        assert_eq!(read(&p).unwrap(), Some(Level::EtcdOnly));
        fs::write(&p, "half").unwrap();
        let e = format!("{:#}", read(&p).unwrap_err());
        assert!(e.contains("started-level") && e.contains("half"), "{e}");
    }
}
