//! Where `watch` starts from: the actuator's level (what k3s runs) against the level
//! the Node is labelled with. A pure function returning a named decision; the caller
//! reads the label and logs the decision.
//!
//! After a reboot at `control-plane` nothing on disk says so (the level has the flags
//! of `full` and the start record lives in /run): only the Node's label does. A label
//! naming a lower level with the same k3s flags is adopted; any other mismatch is
//! corrected to the actuator's level, which is what k3s runs.

use crate::level::Level;
use crate::levels::LevelsConfig;

/// What the Node's level label said at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeLabel {
    /// The label's level; `None`: no label, i.e. `full`.
    Read(Option<Level>),
    /// The Node could not be read (API unreachable): nothing to compare with.
    Unreadable,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartDecision {
    /// The label and k3s agree (or the label could not be read): start from k3s's level.
    Actuator,
    /// The Node is labelled with a lower level k3s runs as (same flags): carry on from
    /// it.
    AdoptLabel(Level),
    /// The label cannot be true: start from k3s's level and put the Node's marks right.
    CorrectNode { label: Level },
}

impl StartDecision {
    /// The level the core starts at.
    pub fn level(self, actual: Level) -> Level {
        match self {
            StartDecision::AdoptLabel(l) => l,
            StartDecision::Actuator | StartDecision::CorrectNode { .. } => actual,
        }
    }

    /// Whether the Node's marks must be put right on the next samples.
    pub fn marks_pending(self) -> bool {
        matches!(self, StartDecision::CorrectNode { .. })
    }
}

/// The start-up label policy: `actual` is the actuator's level.
pub fn decide_start(label: NodeLabel, actual: Level, levels: &LevelsConfig) -> StartDecision {
    let NodeLabel::Read(label) = label else { return StartDecision::Actuator };
    let labelled = label.unwrap_or(Level::Full);
    if labelled == actual {
        StartDecision::Actuator
    } else if labelled < actual && !levels.needs_restart(labelled, actual) {
        StartDecision::AdoptLabel(labelled)
    } else {
        StartDecision::CorrectNode { label: labelled }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(label: anyhow::Result<Option<Level>>, actual: Level) -> (Level, bool) {
        let label = match label {
            Ok(l) => NodeLabel::Read(l),
            Err(_) => NodeLabel::Unreadable,
        };
        let d = decide_start(label, actual, &LevelsConfig::default());
        (d.level(actual), d.marks_pending())
    }

    #[test]
    fn after_a_reboot_at_control_plane_the_nodes_label_is_adopted() {
        // The record says full (a reboot forgot it), the Node says control-plane.
        assert_eq!(start(Ok(Some(Level::ControlPlane)), Level::Full), (Level::ControlPlane, false));
        // Agreement, or an unreachable API: the actuator's level, nothing to correct.
        assert_eq!(start(Ok(None), Level::Full), (Level::Full, false));
        assert_eq!(start(Ok(Some(Level::EtcdOnly)), Level::EtcdOnly), (Level::EtcdOnly, false));
        assert_eq!(start(Err(anyhow::anyhow!("503")), Level::Full), (Level::Full, false));
    }

    #[test]
    fn a_label_that_cannot_be_true_is_corrected() {
        // etcd-only needs other flags than k3s runs with at full: the label is stale.
        assert_eq!(start(Ok(Some(Level::EtcdOnly)), Level::Full), (Level::Full, true));
        // k3s runs at control-plane (on record) but the label was removed by hand.
        assert_eq!(start(Ok(None), Level::ControlPlane), (Level::ControlPlane, true));
        assert_eq!(start(Ok(Some(Level::ControlPlane)), Level::EtcdOnly), (Level::EtcdOnly, true));
    }

    #[test]
    fn the_decision_is_named() {
        let levels = LevelsConfig::default();
        assert_eq!(
            decide_start(NodeLabel::Read(Some(Level::ControlPlane)), Level::Full, &levels),
            StartDecision::AdoptLabel(Level::ControlPlane)
        );
        assert_eq!(
            decide_start(NodeLabel::Read(None), Level::ControlPlane, &levels),
            StartDecision::CorrectNode { label: Level::Full }
        );
        assert_eq!(decide_start(NodeLabel::Unreadable, Level::EtcdOnly, &levels), StartDecision::Actuator);
    }
}
