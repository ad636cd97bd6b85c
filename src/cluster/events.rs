//! Kubernetes Events on the Node (docs/behaviour.md, "Coordination"): one per step and per new refusal reason,
//! so `kubectl describe node` shows what regrade did and why it did not.

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::Api;

use super::endpoints::Endpoints;
use super::StepEvent;
use crate::decide::{Direction, Step};

/// Node Events live where the kubelet puts its own.
pub const NAMESPACE: &str = "default";
pub const COMPONENT: &str = "regrade";

/// An Event's `type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

/// An Event's `reason`: what `kubectl get events --field-selector reason=...` finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventReason {
    StepDown,
    StepUp,
    StepFailed,
    Refused,
    Drained,
    DrainIncomplete,
}

impl EventReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EventReason::StepDown => "RegradeStepDown",
            EventReason::StepUp => "RegradeStepUp",
            EventReason::StepFailed => "RegradeStepFailed",
            EventReason::Refused => "RegradeRefused",
            EventReason::Drained => "RegradeDrained",
            EventReason::DrainIncomplete => "RegradeDrainIncomplete",
        }
    }
}

/// `(type, reason, message)` of the Event for `e`.
pub fn describe(e: &StepEvent<'_>) -> (EventType, EventReason, String) {
    let done = |s: &Step| match s.direction {
        Direction::Down => EventReason::StepDown,
        Direction::Up => EventReason::StepUp,
    };
    match e {
        StepEvent::Done(s) => {
            (EventType::Normal, done(s), format!("{} from {} to {}", s.direction.action(), s.from, s.to))
        }
        StepEvent::Failed(s, why) => (
            EventType::Warning,
            EventReason::StepFailed,
            format!("{} from {} to {} failed: {why}", s.direction.action(), s.from, s.to),
        ),
        StepEvent::Refused(s, r) => (
            EventType::Warning,
            EventReason::Refused,
            format!("{} from {} to {} refused: {}", s.direction.action(), s.from, s.to, r),
        ),
        StepEvent::Drained(report) if report.incomplete() => {
            (EventType::Warning, EventReason::DrainIncomplete, report.to_string())
        }
        StepEvent::Drained(report) => (EventType::Normal, EventReason::Drained, report.to_string()),
    }
}

pub async fn record(eps: &Endpoints, node: &str, e: &StepEvent<'_>) -> anyhow::Result<()> {
    let (type_, reason, message) = describe(e);
    post(eps, node, type_.as_str(), reason.as_str(), message).await
}

/// Records an Event of `type_` and `reason` on Node `node`.
pub async fn post(eps: &Endpoints, node: &str, type_: &str, reason: &str, message: String) -> anyhow::Result<()> {
    let now = Timestamp::now();
    let stamp = Time(Timestamp::from_second(now.as_second())?);
    let event = Event {
        metadata: ObjectMeta {
            name: Some(format!("{node}.{:x}", now.as_nanosecond())),
            namespace: Some(NAMESPACE.into()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.into()),
            // As the kubelet does, so `kubectl describe node` finds the Event.
            uid: Some(node.into()),
            ..Default::default()
        },
        type_: Some(type_.into()),
        reason: Some(reason.into()),
        message: Some(message),
        source: Some(EventSource { component: Some(COMPONENT.into()), host: Some(node.into()) }),
        reporting_component: Some(COMPONENT.into()),
        reporting_instance: Some(node.into()),
        first_timestamp: Some(stamp.clone()),
        last_timestamp: Some(stamp),
        count: Some(1),
        ..Default::default()
    };
    let event = &event;
    eps.call(format!("create events -n {NAMESPACE}"), |c| async move {
        Api::<Event>::namespaced(c, NAMESPACE).create(&PostParams::default(), event).await
    })
    .await?;
    Ok(())
}
