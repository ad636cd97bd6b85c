//! The Node's marks (docs/behaviour.md, "Levels" and "Coordination") and the readiness wait after a restart.
//!
//! Below `full` the Node carries the level label, is cordoned and has regrade's taint;
//! an annotation records which of cordon and taint regrade set, so `full` undoes only
//! that (an operator's own cordon survives). `spec.taints` has no merge key, so the
//! taint list is edited on the Node just read and written back with its
//! `resourceVersion`: a 409 means someone else wrote, and the edit is redone on a fresh
//! read. Only our keys are in the patch: other labels, annotations (the
//! `etcd.k3s.cattle.io/*` ones above all) and taints are never written.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::{json, Value};

use super::endpoints::Endpoints;
use super::peers::NODE_LEASE_NAMESPACE;
use crate::level::Level;
use crate::levels::LevelsConfig;

pub struct NodeMarks<'a> {
    pub node_name: &'a str,
    pub level_label: &'a str,
    pub taint_key: &'a str,
    /// The annotation recording what regrade set: `cordon`, `taint`, comma-separated.
    pub set_annotation: &'a str,
}

/// How long 409s are retried before marking fails: other writers (the kubelet, the
/// node controller, an operator) finish their edits well within it.
const CONFLICT_PATIENCE: Duration = Duration::from_secs(30);

impl NodeMarks<'_> {
    pub async fn get(&self, eps: &Endpoints) -> anyhow::Result<Node> {
        let name = self.node_name;
        Ok(eps.call(format!("get nodes/{name}"), |c| async move { Api::<Node>::all(c).get(name).await }).await?)
    }

    /// Puts the marks for `level` in place (see the module doc), retrying on 409.
    pub async fn apply(&self, eps: &Endpoints, level: Level, levels: &LevelsConfig) -> anyhow::Result<()> {
        let name = self.node_name;
        let started = tokio::time::Instant::now();
        let mut attempt = 0u32;
        loop {
            let node = self.get(eps).await?;
            let Some(patch) = self.patch_for(&node, level, levels) else {
                return Ok(());
            };
            let patch = &patch;
            let r = eps
                .call(format!("patch nodes/{name}"), |c| async move {
                    Api::<Node>::all(c).patch(name, &PatchParams::default(), &Patch::Merge(patch)).await
                })
                .await;
            match r {
                Ok(_) => return Ok(()),
                Err(e) if e.is_conflict() && started.elapsed() < CONFLICT_PATIENCE => {
                    tracing::debug!(node = name, attempt, "Node changed while marking it; redoing the edit");
                    tokio::time::sleep(backoff(attempt)).await;
                    attempt += 1;
                }
                Err(e) if e.is_conflict() => {
                    anyhow::bail!(
                        "{e}: the Node kept changing for {}s while regrade marked it",
                        CONFLICT_PATIENCE.as_secs()
                    )
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The merge patch taking `node` to `level`'s marks, with the `resourceVersion` it
    /// was computed from; `None` when the Node already carries them.
    pub fn patch_for(&self, node: &Node, level: Level, levels: &LevelsConfig) -> Option<Value> {
        let labels = node.metadata.labels.clone().unwrap_or_default();
        let annotations = node.metadata.annotations.clone().unwrap_or_default();
        let spec = node.spec.clone().unwrap_or_default();
        let unschedulable = spec.unschedulable.unwrap_or(false);
        let taints = spec.taints.clone().unwrap_or_default();
        let mut set: BTreeSet<&str> = annotations
            .get(self.set_annotation)
            .map(|s| s.split(',').map(str::trim).filter(|p| !p.is_empty()).collect())
            .unwrap_or_default();

        let (want_label, want_unschedulable, want_taints) = match levels.get(level) {
            None => {
                // `full`: undo exactly what regrade set.
                let uncordon = set.contains("cordon");
                set.clear();
                let others = taints.iter().filter(|t| t.key != self.taint_key).cloned().collect::<Vec<_>>();
                (None, unschedulable && !uncordon, others)
            }
            Some(lc) => {
                if !unschedulable {
                    set.insert("cordon");
                }
                set.insert("taint");
                let effect = lc.taint_effect.as_str();
                let mut out = Vec::with_capacity(taints.len() + 1);
                let mut placed = false;
                for t in &taints {
                    if t.key != self.taint_key {
                        out.push(t.clone());
                    } else if !placed {
                        // Keep ours where it was; refresh it if the effect changed.
                        out.push(self.taint(level, effect, Some(t)));
                        placed = true;
                    }
                }
                if !placed {
                    out.push(self.taint(level, effect, None));
                }
                (Some(level.as_str()), true, out)
            }
        };
        let want_set = (!set.is_empty()).then(|| set.iter().copied().collect::<Vec<_>>().join(","));

        let label_ok = labels.get(self.level_label).map(String::as_str) == want_label;
        let set_ok = annotations.get(self.set_annotation) == want_set.as_ref();
        let taints_ok = taints == want_taints;
        if label_ok && set_ok && taints_ok && unschedulable == want_unschedulable {
            return None;
        }
        let mut spec_patch = json!({});
        if unschedulable != want_unschedulable {
            spec_patch["unschedulable"] = json!(want_unschedulable);
        }
        if !taints_ok {
            spec_patch["taints"] = if want_taints.is_empty() { Value::Null } else { json!(want_taints) };
        }
        Some(json!({
            "metadata": {
                "resourceVersion": node.metadata.resource_version,
                "labels": { self.level_label: want_label },
                "annotations": { self.set_annotation: want_set },
            },
            "spec": spec_patch,
        }))
    }

    fn taint(&self, level: Level, effect: &str, old: Option<&Taint>) -> Taint {
        let keep_time = old.filter(|t| t.effect == effect).and_then(|t| t.time_added.clone());
        Taint {
            key: self.taint_key.to_string(),
            value: Some(level.as_str().to_string()),
            effect: effect.to_string(),
            // The taint manager counts NoExecute tolerations from here.
            time_added: if effect == "NoExecute" { keep_time.or_else(|| Some(Time(now_seconds()))) } else { None },
        }
    }

    /// Waits until the Node is Ready on a heartbeat newer than `since`: its node Lease
    /// renewed, or Ready's `lastHeartbeatTime`, after `since`, with Ready True.
    pub async fn wait_ready_since(&self, eps: &Endpoints, since: SystemTime, timeout: Duration) -> anyhow::Result<()> {
        let since = Timestamp::try_from(since)?;
        let deadline = tokio::time::Instant::now() + timeout;
        let name = self.node_name;
        loop {
            let node = self.get(eps).await;
            let lease = eps
                .call(format!("get leases {NODE_LEASE_NAMESPACE}/{name}"), |c| async move {
                    Api::<Lease>::namespaced(c, NODE_LEASE_NAMESPACE).get_opt(name).await
                })
                .await
                .map_err(anyhow::Error::from);
            let last = match (node, lease) {
                (Ok(node), Ok(lease)) => {
                    let ready = node
                        .status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
                    let renewed = lease.and_then(|l| l.spec).and_then(|s| s.renew_time).map(|t| t.0);
                    let heartbeat = ready.and_then(|c| c.last_heartbeat_time.as_ref()).map(|t| t.0);
                    let fresh = renewed.is_some_and(|t| t > since) || heartbeat.is_some_and(|t| t > since);
                    let is_ready = ready.is_some_and(|c| c.status == "True");
                    if fresh && is_ready {
                        return Ok(());
                    }
                    format!(
                        "Ready={}, node Lease renewed {}, last heartbeat {}",
                        ready.map_or("absent", |c| c.status.as_str()),
                        renewed.map_or("never".into(), |t| t.to_string()),
                        heartbeat.map_or("never".into(), |t| t.to_string()),
                    )
                }
                (Err(e), _) | (_, Err(e)) => format!("{e:#}"),
            };
            if tokio::time::Instant::now() >= deadline {
                anyhow::bail!(
                    "Node {name} was not Ready on a heartbeat newer than the restart at {since} within {}s ({last})",
                    timeout.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_secs(1).min(timeout / 4).max(Duration::from_millis(100))).await;
        }
    }
}

/// 10, 20, 40 … up to 640 ms, plus up to 10 ms of jitter so two retrying writers
/// drift apart.
fn backoff(attempt: u32) -> Duration {
    let jitter = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.subsec_micros() % 10_000);
    Duration::from_millis(10 << attempt.min(6)) + Duration::from_micros(jitter.into())
}

/// `metav1.Time` has whole seconds; write it so, so a re-read compares equal.
fn now_seconds() -> Timestamp {
    Timestamp::from_second(Timestamp::now().as_second()).unwrap_or_else(|_| Timestamp::now())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::levels::TaintEffect;
    use k8s_openapi::api::core::v1::NodeSpec;
    use std::collections::BTreeMap;

    const M: NodeMarks = NodeMarks {
        node_name: "server-1",
        level_label: "regrade.dev/level",
        taint_key: "regrade.dev/stepped-down",
        set_annotation: "regrade.dev/set",
    };

    fn node(unschedulable: bool, taints: Vec<Taint>) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some("server-1".into());
        n.metadata.resource_version = Some("42".into());
        n.metadata.annotations =
            Some(BTreeMap::from([("etcd.k3s.cattle.io/node-name".to_string(), "server-1-abc".to_string())]));
        n.spec = Some(NodeSpec { unschedulable: Some(unschedulable), taints: Some(taints), ..Default::default() });
        n
    }

    /// Applies a merge patch the way the API server does (RFC 7386), for these tests.
    fn merge(target: &mut Value, patch: &Value) {
        match patch {
            Value::Object(p) => {
                if !target.is_object() {
                    *target = json!({});
                }
                for (k, v) in p {
                    if v.is_null() {
                        target.as_object_mut().unwrap().remove(k);
                    } else {
                        merge(target.as_object_mut().unwrap().entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
            _ => *target = patch.clone(),
        }
    }

    fn after(n: &Node, level: Level, levels: &LevelsConfig) -> Node {
        let mut v = serde_json::to_value(n).unwrap();
        if let Some(p) = M.patch_for(n, level, levels) {
            assert_eq!(p["metadata"]["resourceVersion"], "42");
            merge(&mut v, &p);
        }
        serde_json::from_value(v).unwrap()
    }

    fn other_taint() -> Taint {
        Taint { key: "dedicated".into(), value: Some("db".into()), effect: "NoSchedule".into(), time_added: None }
    }

    #[test]
    fn down_and_up_restores_the_node() {
        let levels = LevelsConfig::default();
        let start = node(false, vec![other_taint()]);
        let cp = after(&start, Level::ControlPlane, &levels);
        assert_eq!(cp.metadata.labels.as_ref().unwrap()["regrade.dev/level"], "control-plane");
        assert_eq!(cp.metadata.annotations.as_ref().unwrap()["regrade.dev/set"], "cordon,taint");
        assert_eq!(cp.spec.as_ref().unwrap().unschedulable, Some(true));
        let taints = cp.spec.as_ref().unwrap().taints.clone().unwrap();
        assert_eq!(taints[0], other_taint());
        assert_eq!((taints[1].key.as_str(), taints[1].effect.as_str()), ("regrade.dev/stepped-down", "NoExecute"));
        assert!(taints[1].time_added.is_some());
        let eo = after(&cp, Level::EtcdOnly, &levels);
        assert_eq!(eo.metadata.labels.as_ref().unwrap()["regrade.dev/level"], "etcd-only");
        let back = after(&after(&eo, Level::ControlPlane, &levels), Level::Full, &levels);
        assert_eq!(back.metadata.annotations, start.metadata.annotations);
        assert_eq!(back.metadata.labels.clone().unwrap_or_default().get("regrade.dev/level"), None);
        assert_eq!(back.spec.as_ref().unwrap().unschedulable, Some(false));
        assert_eq!(back.spec.as_ref().unwrap().taints.as_deref(), Some(&[other_taint()][..]));
        assert!(M.patch_for(&back, Level::Full, &levels).is_none(), "full is a fixed point");
    }

    #[test]
    fn an_operators_cordon_survives() {
        let levels = LevelsConfig::default();
        let start = node(true, vec![]);
        let cp = after(&start, Level::ControlPlane, &levels);
        assert_eq!(cp.metadata.annotations.as_ref().unwrap()["regrade.dev/set"], "taint");
        let back = after(&cp, Level::Full, &levels);
        assert_eq!(back.spec.as_ref().unwrap().unschedulable, Some(true));
        assert_eq!(back.spec.as_ref().unwrap().taints, None);
    }

    #[test]
    fn the_effect_follows_the_level() {
        let mut levels = LevelsConfig::default();
        levels.etcd_only.taint_effect = TaintEffect::NoSchedule;
        let cp = after(&node(false, vec![]), Level::ControlPlane, &levels);
        let eo = after(&cp, Level::EtcdOnly, &levels);
        let t = &eo.spec.as_ref().unwrap().taints.as_ref().unwrap()[0];
        assert_eq!((t.effect.as_str(), t.time_added.as_ref()), ("NoSchedule", None));
        assert!(M.patch_for(&eo, Level::EtcdOnly, &levels).is_none(), "a level's marks are a fixed point");
    }
}
