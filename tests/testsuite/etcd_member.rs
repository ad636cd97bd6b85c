//! regrade's look at its own etcd member (`etcd::member`) against a real three-member
//! etcd (tests/rig's etcd) serving its metrics listener without TLS, as k3s does: every
//! series regrade reads is there by the name it reads; a healthy member is healthy with
//! its WAL fsync and backend commit p99 over the interval of ten writes; a
//! SIGSTOPped member (hung) is not healthy within `etcd.request_timeout`, and the look
//! ends by then; a SIGKILLed one (nothing listening) is not known. `watch`'s look task
//! publishes each change for `status` (`etcd-member.json`).
//!
//! Gated by REGRADE_TEST_ETCD=1. Members on 127.0.0.81–83 (no other test uses them).

use std::path::Path;
use std::time::{Duration, Instant};

use regrade::actuator::etcd_health::HealthUrl;
use regrade::etcd::client::{Endpoint, EtcdClient};
use regrade::etcd::member::{self, MemberView};

use crate::common;

use common::etcd_cluster::{settled, EtcdCluster};

/// Waits until the look task's file says what `want` accepts.
async fn published(state_file: &Path, want: impl Fn(&MemberView) -> bool, within: Duration) -> MemberView {
    let t0 = Instant::now();
    loop {
        if let Some(v) = member::read_live(state_file).filter(&want) {
            return v;
        }
        assert!(
            t0.elapsed() < within,
            "etcd-member.json never said what was wanted: {:?}",
            member::read_live(state_file)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn the_local_members_distress_is_seen_from_its_metrics_listener() {
    if !common::gate_open(
        "REGRADE_TEST_ETCD",
        "the_local_members_distress_is_seen_from_its_metrics_listener",
        "tests/rig's etcd",
    ) {
        return;
    }
    let bin = common::built("tests/rig/build.sh");
    let tmp = tempfile::tempdir().unwrap();
    let mut cl = EtcdCluster::new(&bin, tmp.path(), "127.0.0.8", 3);
    cl.start_new(3);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let t0 = Instant::now();
    let at = |what: &str| println!("[{:>5.1}s] {what}", t0.elapsed().as_secs_f64());
    rt.block_on(async {
        let gate = regrade::etcd::gate::EtcdGate::new(&cl.config(1, "client")).unwrap();
        settled(&gate, 3, Duration::from_secs(30)).await;
        at("three members up");
        let url = HealthUrl::parse("etcd.metrics_url", &cl.metrics_url(1)).unwrap();
        let (_, text) = url.fetch("/metrics", 16 << 20).await.unwrap();
        let text = String::from_utf8(text).unwrap();
        for series in member::SERIES {
            assert!(text.lines().any(|l| l.starts_with(series)), "etcd no longer serves {series}");
        }
        let timeout = Duration::from_secs(1);
        let (v, first) = member::look(&url, timeout, None).await;
        assert_eq!((v.healthy, v.has_leader), (Some(true), Some(true)), "{v:?}");

        // Ten writes through member 1: its own fsyncs and commits in the interval.
        let client = EtcdClient::new(&cl.config(1, "client")).unwrap();
        let ep = Endpoint::parse(&cl.client_url(1)).unwrap();
        for _ in 0..10 {
            // key "k", value "v", base64 as the JSON gateway takes them: each put a revision.
            client.call(&ep, "/v3/kv/put", r#"{"key":"aw==","value":"dg=="}"#).await.unwrap();
        }
        let (v, _) = member::look(&url, timeout, first.as_ref()).await;
        let (wal, commit) = (v.wal_fsync_p99.expect("fsyncs in the interval"), v.backend_commit_p99.expect("commits"));
        at(&format!("after 10 writes: {}", v.summary()));
        assert!(wal > 0.0 && wal < 1.0 && commit > 0.0 && commit < 1.0, "{v:?}");

        // watch's look task, publishing for status.
        let state_file = tmp.path().join("state.json");
        let task = tokio::spawn(member::run(url.clone(), Duration::from_secs(1), timeout, Some(state_file.clone())));
        published(&state_file, |v| v.healthy == Some(true), Duration::from_secs(10)).await;
        at("watch's look task published it healthy");

        // Hung: not healthy within the timeout, and the look ends by then.
        cl.signal(1, libc::SIGSTOP);
        let t0 = Instant::now();
        let (v, _) = member::look(&url, timeout, None).await;
        let took = t0.elapsed();
        assert_eq!(v.healthy, Some(false), "{v:?}");
        assert!(took < timeout * 2 + Duration::from_millis(500), "two requests, each bounded: {took:?}");
        let seen = published(&state_file, |v| v.healthy == Some(false), Duration::from_secs(10)).await;
        assert!(seen.health.contains("etcd.request_timeout"), "{seen:?}");
        at("SIGSTOPped: not healthy within the timeout, published");
        cl.signal(1, libc::SIGCONT);
        published(&state_file, |v| v.healthy == Some(true), Duration::from_secs(10)).await;
        at("SIGCONT: healthy again, published");

        // Dead: nothing listens, so not known (a restart's own wait sees it come back).
        cl.kill(1);
        let (v, scrape) = member::look(&url, timeout, None).await;
        assert!(v.healthy.is_none() && scrape.is_none() && v.metrics_error.is_some(), "{v:?}");
        task.abort();
        at("SIGKILLed: not known");
    });
}
