//! The switch-time hold: a short pause on steps, asked for from outside the daemon.
//!
//! Turning regrade off on NixOS runs a check before any unit stops: it refuses the
//! switch while the server is below `full`. Between that check and regrade.service
//! stopping, the running `watch` could still start a step down, and since it finishes a
//! step before it honours SIGTERM, the server would be left below `full` with regrade
//! off. So the check first writes a hold file, `switch-hold` beside the state file, and
//! only then reads the level and the step in progress ("stepping") from the state file;
//! `watch` first publishes the step it is about to start ("stepping") and only then
//! reads the hold, starting no step while one is active. Whichever of the two comes
//! second sees the other. The hold ends on its own: the file
//! holds the Unix time it ends, and a hold further ahead than [`MAX_HOLD`] is not one
//! the check wrote (it never asks for more) and is ignored, so a stray file can never
//! stop regrade for good.
//!
//! The file: the end time in whole Unix seconds as the first word of the first line
//! that is not empty or a `#` comment; anything after it is for people reading it.
//!
//! ```text
//! 1764570000
//! # regrade: steps held by the switch-time check (switch of /nix/store/…) until this Unix time
//! ```

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The file's name, in the state file's directory (`/run/regrade/switch-hold` by default).
pub const FILE_NAME: &str = "switch-hold";

/// The longest hold honoured: the NixOS module's `switchHoldSeconds` allows at most this.
pub const MAX_HOLD: Duration = Duration::from_secs(900);

/// What a hold file says at a given moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hold {
    /// No file, or a hold that has ended: steps may start.
    None,
    /// Steps are held until `until` (Unix seconds), `left` from now.
    Active { until: u64, left: Duration },
    /// A file that is not a hold (garbage, or an end beyond [`MAX_HOLD`]): steps may
    /// start; the reason is for a warning.
    Ignored(String),
}

impl Hold {
    pub fn is_active(&self) -> bool {
        matches!(self, Hold::Active { .. })
    }
}

/// Where the hold for a given state file lives.
pub fn path_for(state_file: &Path) -> PathBuf {
    state_file.with_file_name(FILE_NAME)
}

/// What `contents`, a hold file's text, says at `now`. Never fails: whatever is not a
/// well-formed hold within [`MAX_HOLD`] of `now` holds nothing.
pub fn parse(contents: &str, now: SystemTime) -> Hold {
    let Some(word) = contents
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .and_then(|l| l.split_whitespace().next())
    else {
        return Hold::Ignored("the hold file says no end time".into());
    };
    let Ok(until) = word.parse::<u64>() else {
        return Hold::Ignored(format!("the hold file's end time {word:?} is not a whole number of Unix seconds"));
    };
    // A clock before 1970 is a broken clock; treat it as the epoch, which ends any hold.
    let now_secs = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let end = Duration::from_secs(until);
    if end <= now_secs {
        return Hold::None;
    }
    let left = end - now_secs;
    if left > MAX_HOLD {
        return Hold::Ignored(format!(
            "the hold file's end time {until} is {}s ahead, more than the longest hold ({}s): not written by the switch-time check",
            left.as_secs(),
            MAX_HOLD.as_secs()
        ));
    }
    Hold::Active { until, left }
}

/// Reads the hold at `path`. A missing file is no hold; a file that cannot be read is
/// ignored with the error as the reason (a hold must never stop regrade by accident).
pub fn read(path: &Path, now: SystemTime) -> Hold {
    match std::fs::read_to_string(path) {
        Ok(text) => parse(&text, now),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Hold::None,
        Err(e) => Hold::Ignored(format!("could not read the hold file {}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    const NOW: u64 = 1_764_570_000;

    #[test]
    fn the_checks_own_file_holds_until_its_end() {
        let text = format!(
            "{}\n# regrade: steps held by the switch-time check (switch of /nix/store/x) until this Unix time\n",
            NOW + 300
        );
        assert_eq!(parse(&text, at(NOW)), Hold::Active { until: NOW + 300, left: Duration::from_secs(300) });
        assert_eq!(parse(&text, at(NOW + 299)), Hold::Active { until: NOW + 300, left: Duration::from_secs(1) });
        assert!(parse(&text, at(NOW + 299)).is_active());
    }

    #[test]
    fn a_hold_ends_on_its_own() {
        let text = format!("{}\n", NOW + 300);
        assert_eq!(parse(&text, at(NOW + 300)), Hold::None);
        assert_eq!(parse(&text, at(NOW + 100_000)), Hold::None);
        // Sub-second: the end is whole seconds, now need not be.
        let just_before = at(NOW + 299) + Duration::from_millis(999);
        assert_eq!(parse(&text, just_before), Hold::Active { until: NOW + 300, left: Duration::from_millis(1) });
    }

    #[test]
    fn comments_blank_lines_and_spaces_around_the_end_are_fine() {
        let text = format!("# written by hand\n\n   {}   trailing words\n", NOW + 60);
        assert_eq!(parse(&text, at(NOW)), Hold::Active { until: NOW + 60, left: Duration::from_secs(60) });
        assert!(parse(&format!("{}", NOW + 60), at(NOW)).is_active(), "no newline at the end");
        assert!(parse(&format!("{}\r\n", NOW + 60), at(NOW)).is_active(), "CRLF");
    }

    #[test]
    fn garbage_holds_nothing() {
        for text in [
            "",
            "\n\n",
            "# only a comment\n",
            "soon\n",
            "-5\n",
            "12.5\n",
            "0x10\n",
            "99999999999999999999999\n",
            "\u{0}\u{1}",
        ] {
            let h = parse(text, at(NOW));
            assert!(matches!(h, Hold::Ignored(_)), "{text:?} gave {h:?}");
            assert!(!h.is_active());
        }
    }

    #[test]
    fn a_hold_beyond_the_longest_is_ignored_not_honoured() {
        let at_bound = format!("{}\n", NOW + MAX_HOLD.as_secs());
        assert!(parse(&at_bound, at(NOW)).is_active(), "exactly the longest hold is honoured");
        let beyond = format!("{}\n", NOW + MAX_HOLD.as_secs() + 1);
        match parse(&beyond, at(NOW)) {
            Hold::Ignored(why) => assert!(why.contains("more than the longest hold (900s)"), "{why}"),
            other => panic!("a hold 901s ahead gave {other:?}"),
        }
        assert!(!parse(&format!("{}\n", u64::MAX), at(NOW)).is_active());
    }

    #[test]
    fn a_clock_before_1970_ends_every_hold_it_can() {
        let before_epoch = UNIX_EPOCH - Duration::from_secs(10);
        // From the epoch, a hold near now is far beyond the bound: ignored, not honoured.
        assert!(!parse(&format!("{NOW}\n"), before_epoch).is_active());
        assert!(parse("600\n", before_epoch).is_active());
    }

    #[test]
    fn reading_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state.json");
        let path = path_for(&state);
        assert_eq!(path, dir.path().join("switch-hold"));
        assert_eq!(read(&path, at(NOW)), Hold::None, "no file, no hold");
        std::fs::write(&path, format!("{}\n", NOW + 30)).unwrap();
        assert!(read(&path, at(NOW)).is_active());
        // A directory where the file should be cannot be read: ignored, with why.
        let dir_path = dir.path().join("sub");
        std::fs::create_dir(&dir_path).unwrap();
        match read(&dir_path, at(NOW)) {
            Hold::Ignored(why) => assert!(why.contains("could not read the hold file"), "{why}"),
            other => panic!("a directory gave {other:?}"),
        }
    }

    #[test]
    fn the_default_path_is_the_modules() {
        assert_eq!(path_for(Path::new("/run/regrade/state.json")), PathBuf::from("/run/regrade/switch-hold"));
    }
}
