//! The etcd gate against a real three-member etcd (tests/rig's etcd binary) serving its
//! client port over TLS with client-certificate auth, as k3s runs it; certificates made
//! with openssl. Members on 127.0.0.31–34 (client :2379, peer :2380), names
//! `server<N>-<8 hex>` as k3s names them. Faults, in order, each with the member it must
//! name: a member SIGKILLed; started again (the after-restart check); a learner added
//! (not started, then started); a voter removed (two voters left).
//!
//! Gated by REGRADE_TEST_ETCD=1. Run alone: `REGRADE_TEST_ETCD=1 flock /tmp/regrade-rig.lock
//! cargo test --test testsuite etcd_gate:: -- --nocapture`.

use std::time::{Duration, Instant};

use regrade::etcd::client::{Endpoint, EtcdClient};
use regrade::etcd::gate::{Cleared, EtcdGate, GateError};
use regrade::etcd::judge::{EtcdRefusal, Reason};

use crate::common;

use common::etcd_cluster::{settled, EtcdCluster};

const GATE: &str = "REGRADE_TEST_ETCD";

/// A membership change, retried while etcd says "unhealthy cluster" (it takes changes
/// only once every member has been connected for a few seconds).
async fn reconfigure(c: &EtcdClient, ep: &Endpoint, path: &str, body: &str) -> Vec<u8> {
    let t0 = Instant::now();
    loop {
        match c.call(ep, path, body).await {
            Ok(b) => return b,
            Err(e) => {
                assert!(t0.elapsed() < Duration::from_secs(30), "{path} {body}: {e:#}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

fn refused(r: Result<Cleared, GateError>) -> EtcdRefusal {
    match r {
        Err(GateError::Refused(r)) => r,
        Err(GateError::Unavailable(e)) => panic!("etcd could not be asked: {e:#}"),
        Ok(c) => panic!("not refused: {c:?}"),
    }
}

fn named(r: &EtcdRefusal) -> (&str, &str, &Reason) {
    match r {
        EtcdRefusal::Member { member, reason } => (member.name.as_str(), member.node.as_str(), reason),
        other => panic!("refused without naming a member: {other}"),
    }
}

#[test]
fn etcd_gate_against_a_real_tls_cluster() {
    if !common::gate_open(GATE, "etcd_gate_against_a_real_tls_cluster", "tests/rig's etcd") {
        return;
    }
    let bin = common::built("tests/rig/build.sh");

    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    // Four members' certificates: the fourth joins later as a learner.
    let mut cl = EtcdCluster::new(&bin, d, "127.0.0.3", 4);
    common::etcd_cluster::ca(d, "rogue-ca");
    common::etcd_cluster::leaf(d, "rogue-ca", "rogue", "DNS:rogue", "clientAuth");
    let three = cl.start_new(3);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let t = Instant::now();
        let gate1 = EtcdGate::new(&cl.config(1, "client")).unwrap();
        let v = settled(&gate1, 3, Duration::from_secs(30)).await;
        println!(
            "[{:>5.1}s] three members up, each answering over TLS with client-cert auth",
            t.elapsed().as_secs_f64()
        );

        // Healthy: the gate lets this member go, and names every member right.
        assert_eq!(gate1.check().await.unwrap(), Cleared { me: v.self_id(), this_down: false });
        let me1 = v.self_id();
        let mut listed: Vec<(String, String)> = v
            .members(1000)
            .into_iter()
            .map(|(m, h)| {
                h.unwrap();
                (m.name, m.node)
            })
            .collect();
        listed.sort();
        assert_eq!(listed, (1..=3).map(|n| (cl.name(n).to_string(), format!("server{n}"))).collect::<Vec<_>>());
        assert_eq!(v.list.members.iter().find(|m| m.id == me1).unwrap().name, cl.name(1));

        // Client-certificate auth is on: a client with another CA's certificate gets nothing.
        let rogue = EtcdClient::new(&cl.config(1, "rogue")).unwrap();
        let e = rogue.member_list(&Endpoint::parse(&cl.client_url(1)).unwrap()).await.unwrap_err();
        println!("[{:>5.1}s] a certificate from another CA is refused: {e:#}", t.elapsed().as_secs_f64());
        let mut missing = cl.config(1, "client");
        missing.key_file = d.join("absent.key");
        let e = format!("{:#}", EtcdGate::new(&missing).err().unwrap());
        assert!(e.contains("etcd.key_file") && e.contains("absent.key"), "{e}");

        // Fault 1: member 3 SIGKILLed. Refused, naming it and its Node.
        cl.kill(3);
        let r = refused(gate1.check().await);
        let (name, node, reason) = named(&r);
        assert_eq!((name, node), (cl.name(3), "server3"), "{r}");
        assert!(matches!(reason, Reason::Unreachable(_)), "{r}");
        println!("[{:>5.1}s] member 3 killed: refused: {r}", t.elapsed().as_secs_f64());

        // ... started again: the after-restart check (through its own endpoint) passes
        // once it is back and caught up, and the gate lets member 1 go again.
        cl.start(3, &three, "existing");
        let gate3 = EtcdGate::new(&cl.config(3, "client")).unwrap();
        let me3 = v.list.members.iter().find(|m| m.name == cl.name(3)).unwrap().id;
        let back = gate3.wait_back(me3, tokio::time::Instant::now() + Duration::from_secs(30), "30s").await.unwrap();
        assert_eq!(back.self_id(), me3);
        gate1.check().await.unwrap();
        println!(
            "[{:>5.1}s] member 3 restarted: back and caught up; member 1 may restart again",
            t.elapsed().as_secs_f64()
        );
        // The after-restart check fails while it is down.
        cl.kill(3);
        let e = gate3.wait_back(me3, tokio::time::Instant::now() + Duration::from_secs(2), "2s").await.unwrap_err();
        assert!(format!("{e:#}").contains("not back and caught up within 2s"), "{e:#}");
        cl.start(3, &three, "existing");
        settled(&gate1, 3, Duration::from_secs(30)).await;

        // Was (issue 38, finding 1): the gate asked only the local member, so with this
        // server's own member down (k3s not back after a restart) every restart, the
        // one back included, was refused as etcd-unavailable, for ever. Member 1 (this
        // server's) SIGKILLed: the gate asks the others at the client URLs it kept, and
        // lets the restart through without judging them, since it costs no vote: even
        // while member 3 is down too, and from a gate started afresh (a regrade started
        // again) reading the kept members.
        cl.kill(1);
        assert_eq!(gate1.check().await.unwrap(), Cleared { me: me1, this_down: true });
        let fresh = EtcdGate::new(&cl.config(1, "client")).unwrap();
        assert_eq!(fresh.check().await.unwrap(), Cleared { me: me1, this_down: true });
        let look = fresh.look().await.unwrap();
        assert!(matches!(
            look.view.members(1000).iter().find(|(m, _)| m.id == me1),
            Some((_, Err(Reason::Unreachable(_))))
        ));
        println!(
            "[{:>5.1}s] member 1 (this server's) killed: the restart back is let through",
            t.elapsed().as_secs_f64()
        );
        cl.kill(3);
        assert_eq!(fresh.check().await.unwrap(), Cleared { me: me1, this_down: true });
        // Without the kept members there is nobody to ask: refused, naming the key.
        let mut uncached = cl.config(1, "client");
        uncached.members_cache = d.join("never-written.json");
        match EtcdGate::new(&uncached).unwrap().check().await {
            Err(GateError::Unavailable(e)) => assert!(format!("{e:#}").contains("etcd.members_cache"), "{e:#}"),
            other => panic!("{other:?}"),
        }
        // The wait after a restart asks the others too, and ends once member 1 is back.
        let e = fresh.wait_back(me1, tokio::time::Instant::now() + Duration::from_secs(2), "2s").await.unwrap_err();
        assert!(format!("{e:#}").contains("not back and caught up within 2s"), "{e:#}");
        cl.start(1, &three, "existing");
        cl.start(3, &three, "existing");
        fresh.wait_back(me1, tokio::time::Instant::now() + Duration::from_secs(30), "30s").await.unwrap();
        settled(&gate1, 3, Duration::from_secs(30)).await;
        // A member that hangs (SIGSTOP: its port takes the connection, nothing answers) is
        // not known down: the others are asked and judged, and member 3 down refuses.
        cl.signal(1, libc::SIGSTOP);
        assert_eq!(gate1.check().await.unwrap(), Cleared { me: me1, this_down: false });
        cl.kill(3);
        let r = refused(gate1.check().await);
        assert_eq!(named(&r).0, cl.name(3), "{r}");
        println!("[{:>5.1}s] member 1 hung: the others are judged: refused: {r}", t.elapsed().as_secs_f64());
        cl.signal(1, libc::SIGCONT);
        cl.start(3, &three, "existing");
        settled(&gate1, 3, Duration::from_secs(30)).await;

        // Fault 2: a learner added (as k3s adds a joining server), not started yet.
        let ep1 = Endpoint::parse(&cl.client_url(1)).unwrap();
        let admin = EtcdClient::new(&cl.config(1, "client")).unwrap();
        let add = format!(r#"{{"peerURLs":["{}"],"isLearner":true}}"#, cl.peer_url(4));
        let added = reconfigure(&admin, &ep1, "/v3/cluster/member/add", &add).await;
        let added: serde_json::Value = serde_json::from_slice(&added).unwrap();
        let id4 = added["member"]["ID"].as_str().unwrap().to_string();
        let r = refused(gate1.check().await);
        assert!(matches!(named(&r).2, Reason::NotStarted), "{r}");
        println!("[{:>5.1}s] a learner added, not started: refused: {r}", t.elapsed().as_secs_f64());
        // ... started: still a learner, refused naming it.
        let four = format!("{},{}={}", three, cl.name(4), cl.peer_url(4));
        cl.start(4, &four, "existing");
        let t4 = Instant::now();
        let r = loop {
            let r = refused(gate1.check().await);
            if !matches!(named(&r).2, Reason::NotStarted) {
                break r;
            }
            assert!(t4.elapsed() < Duration::from_secs(30), "the learner never started: {r}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let (name, node, reason) = named(&r);
        assert_eq!((name, node, reason), (cl.name(4), "server4", &Reason::Learner), "{r}");
        println!("[{:>5.1}s] the learner started: refused: {r}", t.elapsed().as_secs_f64());
        reconfigure(&admin, &ep1, "/v3/cluster/member/remove", &format!(r#"{{"ID":"{id4}"}}"#)).await;
        cl.kill(4);
        settled(&gate1, 3, Duration::from_secs(30)).await;
        gate1.check().await.unwrap();

        // Fault 3: member 3 removed: two voters, both healthy. Refused for the count.
        let id3 = me3.to_string();
        reconfigure(&admin, &ep1, "/v3/cluster/member/remove", &format!(r#"{{"ID":"{id3}"}}"#)).await;
        cl.kill(3);
        settled(&gate1, 2, Duration::from_secs(30)).await;
        let r = refused(gate1.check().await);
        let EtcdRefusal::TooFewVoters { voters } = &r else { panic!("{r}") };
        let mut voters = voters.clone();
        voters.sort();
        assert_eq!(voters, [cl.name(1), cl.name(2)]);
        println!("[{:>5.1}s] two voters left: refused: {r}", t.elapsed().as_secs_f64());
    });
}
