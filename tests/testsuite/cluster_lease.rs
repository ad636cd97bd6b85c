//! The step Lease against a real kube-apiserver (docs/behaviour.md, "Coordination"):
//! contention, a held Lease refusing, takeover after expiry, release by a non-holder,
//! renewal through a long step. Gated by REGRADE_TEST_KUBE=1.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use regrade::cluster::lease::holder_of;
use regrade::cluster::KubeCluster;
use regrade::units::HumanDuration;

use common::block_on;

fn cluster(h: &common::Harness, node: &str, lease: &str, secs: u64) -> KubeCluster {
    let mut cfg = h.config(&h.admin_kubeconfig, node, lease);
    cfg.cluster.lease_duration = HumanDuration(Duration::from_secs(secs));
    common::kube_cluster(&cfg).unwrap()
}

async fn get_lease(h: &common::Harness, name: &str) -> Lease {
    Api::<Lease>::namespaced(h.admin().await, "kube-system").get(name).await.unwrap()
}

#[test]
fn contenders_never_hold_the_lease_at_once() {
    let Some(h) = common::start("contenders_never_hold_the_lease_at_once") else { return };
    const CONTENDERS: usize = 3;
    const ROUNDS: usize = 200;
    let intervals: Arc<Mutex<Vec<(Instant, Instant, usize)>>> = Arc::default();
    let refusals = Arc::new(Mutex::new(0usize));
    std::thread::scope(|s| {
        for who in 0..CONTENDERS {
            let (h, intervals, refusals) = (&h, intervals.clone(), refusals.clone());
            s.spawn(move || {
                block_on(async {
                    let c = cluster(h, &format!("contender-{who}"), "contention", 30);
                    for _ in 0..ROUNDS {
                        loop {
                            match c.lease.acquire(&c.endpoints).await {
                                Ok(()) => break,
                                Err(r) => {
                                    assert_eq!(r.kind, "lease-held", "{r}");
                                    *refusals.lock().unwrap() += 1;
                                    tokio::time::sleep(Duration::from_millis(2)).await;
                                }
                            }
                        }
                        // Hold it long enough that a second holder would be caught.
                        let start = Instant::now();
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        let end = Instant::now();
                        intervals.lock().unwrap().push((start, end, who));
                        c.lease.release(&c.endpoints).await;
                    }
                })
            });
        }
    });
    let mut iv = intervals.lock().unwrap().clone();
    assert_eq!(iv.len(), CONTENDERS * ROUNDS);
    iv.sort();
    for w in iv.windows(2) {
        assert!(w[1].0 >= w[0].1, "contender {} held the Lease while contender {} did", w[1].2, w[0].2);
    }
    let refused = *refusals.lock().unwrap();
    let transitions = block_on(get_lease(&h, "contention")).spec.unwrap().lease_transitions.unwrap();
    println!(
        "contention: {CONTENDERS} contenders x {ROUNDS} rounds, no overlap; {refused} refusals, leaseTransitions {transitions}"
    );
    assert!(refused > 0, "the contenders never met: the test proved nothing");
}

#[test]
fn held_refuses_expired_is_taken_over_and_renewal_keeps_it() {
    let Some(h) = common::start("held_refuses_expired_is_taken_over_and_renewal_keeps_it") else { return };
    block_on(async {
        let a = cluster(&h, "server-a", "basic", 3);
        let b = cluster(&h, "server-b", "basic", 3);
        a.lease.acquire(&a.endpoints).await.unwrap();
        let first = get_lease(&h, "basic").await;
        assert!(holder_of(&first).starts_with("server-a/"));

        // A held Lease refuses, naming the holder.
        let r = b.lease.acquire(&b.endpoints).await.unwrap_err();
        assert_eq!(r.kind, "lease-held");
        assert!(r.message.contains("held by server-a/"), "{r}");
        assert_eq!(r.subject, holder_of(&first), "the holder identifies the reason");

        // Release by a non-holder changes nothing.
        b.lease.release(&b.endpoints).await;
        let after = get_lease(&h, "basic").await;
        assert_eq!(after.metadata.resource_version, first.metadata.resource_version);

        // A step longer than the lease duration keeps the Lease by renewing it.
        let step = async {
            for _ in 0..8 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let r = b.lease.acquire(&b.endpoints).await.unwrap_err();
                assert_eq!(r.kind, "lease-held", "{r}");
            }
        };
        tokio::select! {
            lost = a.lease.hold(&a.endpoints) => panic!("lost the Lease while renewing: {lost:#}"),
            _ = step => {}
        }
        let renewed = get_lease(&h, "basic").await;
        assert!(holder_of(&renewed).starts_with("server-a/"));
        assert!(renewed.spec.as_ref().unwrap().renew_time > first.spec.as_ref().unwrap().renew_time);
        // The renewal changed the message (its renew time), not the reason.
        let again = b.lease.acquire(&b.endpoints).await.unwrap_err();
        assert_ne!(again.message, r.message);
        assert!(again.same_reason(&r), "{again:?} vs {r:?}");

        // a stops renewing (it died): b takes over once the Lease expired, not before.
        let stopped = Instant::now();
        loop {
            match b.lease.acquire(&b.endpoints).await {
                Ok(()) => break,
                Err(r) => assert_eq!(r.kind, "lease-held", "{r}"),
            }
            assert!(stopped.elapsed() < Duration::from_secs(30), "never taken over");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let waited = stopped.elapsed();
        assert!(waited >= Duration::from_secs(3), "taken over after {waited:?}, before the 3s lease expired");
        let taken = get_lease(&h, "basic").await;
        assert!(holder_of(&taken).starts_with("server-b/"));
        let t = |l: &Lease| l.spec.as_ref().unwrap().lease_transitions.unwrap();
        assert_eq!(t(&taken), t(&first) + 1);

        // a, renewing again, finds it lost: surely ours no longer, with no bound at
        // all (it was `now - safe_for`, which within that long of the machine's boot
        // is no instant, and was read as "no bound"; issue 55).
        let lost = a.lease.hold(&a.endpoints).await;
        assert!(format!("{lost:#}").contains("lost Lease"), "{lost:#}");
        assert_eq!(a.lease.safe_until(), None, "a lost Lease has no safe bound");

        // a's release now is a no-op: b holds it.
        a.lease.release(&a.endpoints).await;
        assert_eq!(get_lease(&h, "basic").await.metadata.resource_version, taken.metadata.resource_version);
        // b's release frees it.
        b.lease.release(&b.endpoints).await;
        assert_eq!(holder_of(&get_lease(&h, "basic").await), "");
        println!("takeover after {waited:?} without renewal (duration 3s + margin)");
    });
}

/// The API server made slow for the Lease's writes: a proxy holds each PUT or PATCH
/// of a Lease 20 s before passing it on, longer than the request timeout (3 s) and
/// the lease duration (12 s). Server A steps down (Full to ControlPlane, a fake
/// actuator whose apply takes 10 min) through the proxy; server B, straight to the API
/// server, tries to take the Lease every 250 ms. B must not get it while A's step
/// still runs: A stops its step (rolled back) once no renewal has landed for the lease
/// duration less a quarter, and B takes the Lease only after that.
#[test]
fn a_slow_api_server_never_lets_another_server_take_the_lease_mid_step() {
    use regrade::decide::{Direction, Step};
    use regrade::level::Level;
    use regrade::level_keeper::Keeper;
    use regrade::level_record::{LevelRecord, Phase};
    use regrade::testing::{FakeActuator, Log};

    let Some(h) = common::start("a_slow_api_server_never_lets_another_server_take_the_lease_mid_step") else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let proxy = rt.block_on(common::lost_reply::start(&h.server, &h.dir.join("pki")));
    // The proxy passes a token through, not a client certificate: the ServiceAccount.
    let sa = h.unbound_server_credential("server-a");
    let slow = h.dir.join("slow-lease.kubeconfig");
    std::fs::write(&slow, std::fs::read_to_string(&sa).unwrap().replace(&h.server, &proxy.url)).unwrap();
    rt.block_on(async {
        common::create_server_node(&h.admin().await, &common::Kubelet::ready("server-a")).await;
        let mut cfg = h.config(&slow, "server-a", "regrade");
        cfg.cluster.lease_duration = HumanDuration(Duration::from_secs(12));
        cfg.cluster.request_timeout = HumanDuration(Duration::from_secs(3));
        let a = common::kube_cluster(&cfg).unwrap();
        let b = cluster(&h, "server-b", "regrade", 12);
        // Creating the Lease (a POST) passes at once; every renewal (a PUT) is held.
        proxy.knobs.delay_lease_writes(Duration::from_secs(20));

        let log = Log::default();
        let mut actuator = FakeActuator {
            reports: &[Phase::Writing],
            ..FakeActuator::at(Level::Full).logging_to(&log).taking(Duration::from_secs(600))
        };
        let step = Step { direction: Direction::Down, from: Level::Full, to: Level::ControlPlane };
        let keeper = Keeper::new(None, LevelRecord::at(Level::Full, Default::default()), Default::default());
        let levels = regrade::levels::LevelsConfig::default();
        let t0 = Instant::now();
        let stepping = async {
            let out = regrade::step::run(
                &step,
                &mut actuator,
                &a,
                &regrade::etcd::NoRestartGate,
                &levels,
                &keeper,
                &regrade::own_time::StepClock::start(),
            )
            .await;
            (out, t0.elapsed())
        };
        let contender = async {
            // From the moment server-a holds the Lease.
            let leases = Api::<Lease>::namespaced(h.admin().await, "kube-system");
            while !leases.get_opt("regrade").await.unwrap().is_some_and(|l| holder_of(&l).starts_with("server-a/")) {
                assert!(t0.elapsed() < Duration::from_secs(30), "server-a never took the Lease: {:?}", log.take());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let mut calls = Vec::new();
            let mut stopped = None;
            loop {
                calls.extend(log.take());
                if stopped.is_none() && calls.iter().any(|c| c.starts_with("roll back")) {
                    stopped = Some(t0.elapsed());
                }
                match b.lease.acquire(&b.endpoints).await {
                    Ok(()) => {
                        let taken = t0.elapsed();
                        let Some(stopped) = stopped else {
                            panic!("server-b took the Lease after {taken:?} while server-a's step still ran: {calls:?}")
                        };
                        return (stopped, taken);
                    }
                    Err(r) => assert_eq!(r.kind, "lease-held", "{r}"),
                }
                assert!(t0.elapsed() < Duration::from_secs(120), "server-b never took the Lease: {calls:?}");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        };
        let ((out, ended), (stopped, taken)) = tokio::join!(stepping, contender);
        let regrade::step::Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        let error = format!("{error:#}");
        assert_eq!(*level, Level::Full, "{error}");
        assert!(error.contains("could not renew the Lease") && error.contains("rolled back to full"), "{error}");
        assert_eq!(actuator.level(), Level::Full, "the actuator's level is back");
        assert!(stopped < taken && ended < taken, "stopped {stopped:?}, ended {ended:?}, taken {taken:?}");
        // The lease duration less a quarter after the Lease was taken (9 s), give or
        // take the calls before it; long before the step's own deadline.
        assert!(stopped < Duration::from_secs(15), "stopped only after {stopped:?}");
        let lease = get_lease(&h, "regrade").await;
        assert!(holder_of(&lease).starts_with("server-b/"), "{:?}", lease.spec);
        let delayed = proxy.knobs.delayed_lease_writes.load(std::sync::atomic::Ordering::SeqCst);
        assert!(delayed >= 2, "a failed renewal was not tried again within the lease duration ({delayed} writes)");
        println!(
            "slow Lease writes (20 s each, {delayed} held): server-a stopped its step after {stopped:?} (ended \
             {ended:?}), server-b took the Lease after {taken:?}"
        );
        b.lease.release(&b.endpoints).await;
    });
}
