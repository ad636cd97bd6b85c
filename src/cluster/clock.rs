//! Wall-clock time as the cluster code sees it, and this server's clock against the
//! API server's.
//!
//! Nothing that decides who may step trusts the local wall clock alone: the step
//! Lease's expiry is judged by this process's own observation on its monotonic clock
//! (see `lease`), peers' heartbeats against the API server's clock (its `Date`
//! header, read once per gate check), and a local clock further off the API server's
//! than `cluster.max_clock_skew` refuses the step outright.
//!
//! In test builds (feature `testing`), `set_test_offset` shifts the calling thread's
//! wall clock: a test-only seam, so a test can run with a skewed clock without
//! changing the machine's, beside other tests in the same process. Release builds
//! have no seam.

use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};

#[cfg(feature = "testing")]
thread_local! {
    static TEST_OFFSET: std::cell::Cell<i64> = const { std::cell::Cell::new(0) };
}

/// Test builds only: this thread's wall clock shifted by `secs` (whole seconds, may be
/// negative) from now on; 0 puts it back. A thread's own, so tests running beside it
/// in the same process keep the true clock (the cluster code runs on the thread that
/// drives its future: a current-thread runtime's).
#[cfg(feature = "testing")]
pub fn set_test_offset(secs: i64) {
    TEST_OFFSET.with(|o| o.set(secs));
}

/// Read at every use (the cluster code reads the time a few times per step, never
/// per sample), so one test can run with several offsets in turn.
fn offset() -> SignedDuration {
    #[cfg(feature = "testing")]
    let secs = TEST_OFFSET.with(std::cell::Cell::get);
    #[cfg(not(feature = "testing"))]
    let secs = 0;
    SignedDuration::from_secs(secs)
}

/// This process's wall-clock time (shifted by the test seam, if set).
pub fn wall_now() -> Timestamp {
    Timestamp::now().checked_add(offset()).unwrap_or_else(|_| Timestamp::now())
}

/// How far the API server's clock is ahead of ours (negative: behind).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Skew(pub SignedDuration);

impl Skew {
    /// From the API server's `Date` header (RFC 9110's IMF-fixdate, whole seconds)
    /// and our clock when the answer came. `None` when the header is not a date.
    pub fn from_date_header(date: &str, ours: Timestamp) -> Option<Skew> {
        let theirs = k8s_openapi::jiff::fmt::rfc2822::parse(date).ok()?.timestamp();
        Some(Skew(theirs.duration_since(ours)))
    }

    /// The API server's time now, by our clock corrected for the skew.
    pub fn server_now(&self) -> Timestamp {
        let ours = wall_now();
        ours.checked_add(self.0).unwrap_or(ours)
    }

    /// How far off, either way. The header has whole seconds: up to 1 s of it is
    /// rounding, not skew.
    pub fn magnitude(&self) -> Duration {
        Duration::try_from(self.0.abs()).unwrap_or(Duration::MAX).saturating_sub(Duration::from_secs(1))
    }
}

impl std::fmt::Display for Skew {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.0.as_secs();
        if s >= 0 {
            write!(f, "this server's clock is {s}s behind the API server's")
        } else {
            write!(f, "this server's clock is {}s ahead of the API server's", -s)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skew_from_the_date_header_either_way() {
        let ours: Timestamp = "2026-12-01T08:00:00Z".parse().unwrap();
        let behind = Skew::from_date_header("Tue, 01 Dec 2026 08:02:00 GMT", ours).unwrap();
        assert_eq!(behind.0.as_secs(), 120);
        assert!(behind.to_string().contains("120s behind"), "{behind}");
        assert_eq!(behind.magnitude(), Duration::from_secs(119));
        let ahead = Skew::from_date_header("Tue, 01 Dec 2026 07:58:00 GMT", ours).unwrap();
        assert_eq!(ahead.0.as_secs(), -120);
        assert!(ahead.to_string().contains("120s ahead"), "{ahead}");
        assert_eq!(Skew::from_date_header("Tue, 01 Dec 2026 08:00:00 GMT", ours).unwrap().magnitude(), Duration::ZERO);
        assert!(Skew::from_date_header("yesterday", ours).is_none());
    }
}
