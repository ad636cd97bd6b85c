//! A hand step `full → control-plane → full` end to end through the step runner, with
//! every call regrade makes going through this server's own credential as `regrade
//! credential` mints it (a token of regrade/rbac-1 bound to its Node), under the shipped
//! deploy/rbac.yaml and deploy/admission-policy.yaml; and a call outside them failing
//! with a named error.
//! Gated by REGRADE_TEST_KUBE=1.

use crate::common;

use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::{Event, Node};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::ListParams;
use kube::Api;
use regrade::actuator::NodeReadiness;
use regrade::cluster::{events, Cluster, StepEvent};
use regrade::decide::{Direction, Step};
use regrade::level::Level;
use regrade::levels::LevelsConfig;
use regrade::step::{self, Outcome};
use regrade::testing::FakeActuator;
use regrade::units::HumanDuration;
use serde_json::json;

use common::{block_on, Kubelet};

#[test]
fn every_call_works_with_the_shipped_rbac_and_a_hand_step_round_trips() {
    let Some(h) = common::start("every_call_works_with_the_shipped_rbac_and_a_hand_step_round_trips") else { return };
    block_on(async {
        let admin = h.admin().await;
        for n in ["rbac-1", "rbac-2", "rbac-3"] {
            common::create_server_node(&admin, &Kubelet::ready(n)).await;
        }
        let sa = h.server_credential("rbac-1").await;
        let slice: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": "kubernetes"},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.255.255.1"]}],
            "ports": [{"name": "https", "port": 6443}],
        }))
        .unwrap();
        Api::<EndpointSlice>::namespaced(admin.clone(), "default").create(&Default::default(), &slice).await.unwrap();

        let mut cfg = h.config(&sa, "rbac-1", "regrade");
        cfg.cluster.lease_duration = HumanDuration(Duration::from_secs(3));
        let c = common::kube_cluster(&cfg).unwrap();
        let levels = LevelsConfig::default();
        // Stands in for k3s (which cannot be had here): `control-plane` needs no
        // restart, so applying it only takes time — longer than the Lease, so it must
        // be renewed.
        let mut k3s = FakeActuator::at(Level::Full).taking(Duration::from_millis(4000));

        // status' preflight, then the step down and back up: Lease create/get/update
        // (renewed during the 4 s apply), peer gate, Node patch, Events.
        let down = Step { direction: Direction::Down, from: Level::Full, to: Level::ControlPlane };
        let up = Step { direction: Direction::Up, from: Level::ControlPlane, to: Level::Full };
        c.preflight(&down).await.unwrap();
        // The level record in memory only (it is not what this test is about).
        let keeper = regrade::level_keeper::Keeper::new(
            None,
            regrade::level_record::LevelRecord::at(Level::Full, Default::default()),
            Default::default(),
        );
        for s in [&down, &up] {
            // The etcd gate is not what this test is about (tests/testsuite/etcd_gate.rs, e2e).
            match step::run(
                s,
                &mut k3s,
                &c,
                &regrade::etcd::NoRestartGate,
                &levels,
                &keeper,
                &regrade::own_time::StepClock::start(),
            )
            .await
            {
                Outcome::Done => {}
                other => panic!("{s:?}: {other:?}"),
            }
            let node = Api::<Node>::all(admin.clone()).get("rbac-1").await.unwrap();
            let label = node.metadata.labels.unwrap_or_default().get("regrade.dev/level").cloned();
            assert_eq!(label.as_deref(), (s.to != Level::Full).then_some("control-plane"));
        }
        // Discovery read the EndpointSlice with the shipped Role.
        let cache = std::fs::read_to_string(&cfg.cluster.endpoints_cache).unwrap();
        assert_eq!(cache, "https://10.255.255.1:6443\n");

        // The readiness wait reads the Node and its node Lease.
        let since = SystemTime::now() - Duration::from_secs(30);
        c.wait_ready_since(since, Duration::from_secs(5)).await.unwrap();

        // A refusal, recorded as an Event (asserted directly: `record` only logs).
        common::set_node_lease(&admin, "rbac-2", Timestamp::now() - SignedDuration::from_secs(90)).await;
        let r = c.acquire(&down).await.unwrap_err();
        events::record(&c.endpoints, "rbac-1", &StepEvent::Refused(&down, &r)).await.unwrap();

        let lp = ListParams::default().fields("involvedObject.name=rbac-1");
        let evs = Api::<Event>::namespaced(admin.clone(), "default").list(&lp).await.unwrap().items;
        let reasons: Vec<_> = evs.iter().map(|e| e.reason.clone().unwrap_or_default()).collect();
        // The step down drains (list pods, nothing to evict here) before it is done.
        assert_eq!(reasons, ["RegradeDrained", "RegradeStepDown", "RegradeStepUp", "RegradeRefused"]);
        for e in &evs {
            assert_eq!(e.source.as_ref().unwrap().component.as_deref(), Some("regrade"));
            assert_eq!(e.involved_object.kind.as_deref(), Some("Node"));
        }
        println!("events: {:?}", evs.iter().map(|e| e.message.clone().unwrap_or_default()).collect::<Vec<_>>());

        // Outside the RBAC: a Lease of another name. The error names verb and resource.
        let mut other = h.config(&sa, "rbac-1", "not-regrade");
        other.cluster.lease_duration = HumanDuration(Duration::from_secs(3));
        let r = common::kube_cluster(&other).unwrap().acquire(&down).await.unwrap_err();
        assert_eq!(r.kind, "api-error", "{r}");
        assert!(r.message.contains("get leases kube-system/not-regrade") && r.message.contains("403"), "{r}");
        assert!(r.message.contains("cannot get resource \"leases\""), "{r}");
        println!("without permission: {r}");
    });
}
