//! A server whose clock is off, against a real kube-apiserver. The fault: this
//! test's wall clock shifted (`cluster::clock::set_test_offset`, the test-only seam:
//! this thread's clock, so the tests beside it keep theirs), the API server's and the
//! other "servers'" clocks true.
//! Gated by REGRADE_TEST_KUBE=1.

use crate::common;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use regrade::cluster::Cluster;
use regrade::decide::{Direction, Step};
use regrade::level::Level;

use common::{block_on, Kubelet};

const DOWN: Step = Step { direction: Direction::Down, from: Level::Full, to: Level::ControlPlane };

fn offset(secs: i64) {
    // The cluster calls below run on this thread (`block_on`: a current-thread runtime).
    regrade::cluster::clock::set_test_offset(secs);
}

#[test]
fn a_skewed_clock_neither_takes_a_live_lease_nor_judges_a_stale_peer_fresh() {
    let Some(h) = common::start("a_skewed_clock_neither_takes_a_live_lease_nor_judges_a_stale_peer_fresh") else {
        return;
    };
    block_on(async {
        let admin = h.admin().await;
        for n in ["skew-1", "skew-2", "skew-3"] {
            common::create_server_node(&admin, &Kubelet::ready(n)).await;
        }
        // A bound wide enough that the checks below reach the Lease and the peers.
        let cfg = |bound_secs: u64| {
            let mut c = h.config(&h.admin_kubeconfig, "skew-1", "skew");
            c.cluster.max_clock_skew = regrade::units::HumanDuration(std::time::Duration::from_secs(bound_secs));
            c
        };
        let wide = 600;

        // Another server holds the step Lease and is alive: renewed just now by the
        // true clock, for 60 s.
        let now = Timestamp::now();
        let live = Lease {
            metadata: ObjectMeta {
                name: Some("skew".into()),
                namespace: Some("kube-system".into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some("skew-2/4242".into()),
                lease_duration_seconds: Some(60),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                ..Default::default()
            }),
        };
        Api::<Lease>::namespaced(admin.clone(), "kube-system").create(&Default::default(), &live).await.unwrap();

        // 1. Clock 2 minutes ahead: renewTime + 60 s + margin is in "our" past, yet
        //    the Lease is live. It is judged by observation only: held.
        offset(120);
        let c = common::kube_cluster(&cfg(wide)).unwrap();
        let r = c.acquire(&DOWN).await.expect_err("a live Lease must not be taken");
        assert_eq!(r.kind, "lease-held", "{r}");
        assert!(r.message.contains("skew-2/4242"), "{r}");
        let held = Api::<Lease>::namespaced(admin.clone(), "kube-system").get("skew").await.unwrap();
        assert_eq!(held.spec.unwrap().holder_identity.as_deref(), Some("skew-2/4242"), "the Lease stayed the holder's");
        Api::<Lease>::namespaced(admin.clone(), "kube-system").delete("skew", &Default::default()).await.unwrap();

        // 2. Clock 2 minutes behind, a peer's node Lease 60 s stale by the true clock
        //    (timeout 40 s). By "our" clock it was renewed in the future; against the
        //    API server's clock it is stale: refused, naming the peer.
        offset(-120);
        common::set_node_lease(&admin, "skew-2", Timestamp::now() - SignedDuration::from_secs(60)).await;
        let c = common::kube_cluster(&cfg(wide)).unwrap();
        let r = c.acquire(&DOWN).await.expect_err("a stale peer must not be judged fresh");
        assert_eq!(r.kind, "peer-not-ready", "{r}");
        assert!(r.message.contains("skew-2"), "{r}");
        common::renew_node_lease(&admin, "skew-2").await;
        c.acquire(&DOWN).await.expect("fresh peers, live API: the step may go, whatever our clock says");
        c.release().await;

        // 3. Beyond the bound (default 30 s): refused outright, saying by how much.
        offset(120);
        let c = common::kube_cluster(&cfg(30)).unwrap();
        let r = c.preflight(&DOWN).await.expect_err("a clock 2 minutes off must refuse");
        assert_eq!(r.kind, "clock-skew", "{r}");
        assert!(r.message.contains("ahead") && r.message.contains("max_clock_skew"), "{r}");
        offset(-120);
        let r = c.acquire(&DOWN).await.expect_err("a clock 2 minutes off must refuse");
        assert_eq!(r.kind, "clock-skew", "{r}");
        assert!(r.message.contains("behind"), "{r}");
        offset(0);
        c.acquire(&DOWN).await.expect("a true clock steps");
        c.release().await;
        println!("clock skew: +120 s held, -120 s stale peer refused, beyond the bound refused: as expected");
    });
}
