//! Benchmark: API requests made by an idle `regrade watch` while memory is calm.
//! Target: zero — a calm server must not load the API at all.
//!
//! Runs the real `regrade watch` (real cluster client, real API server from the rig)
//! with calm fixture pressure for 720 samples — an hour at the default 5 s
//! sample_period — at a 50 ms period, with its kubeconfig pointing at a counting TCP proxy
//! in front of the API server. TLS runs end to end through the proxy, so it counts
//! connections and bytes: zero of both is zero requests. A positive control sends one
//! `status`-style preflight through the same proxy to show it counts.
//!
//! REGRADE_TEST_KUBE=1 cargo test --test testsuite bench_idle_api:: -- --nocapture

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use regrade::cluster::Cluster;
use regrade::decide::{Direction, Step};
use regrade::level::Level;
use tokio::net::{TcpListener, TcpStream};

const SAMPLES: u32 = 720;
const PERIOD_MS: u64 = 50;

#[derive(Default)]
struct Counts {
    connections: AtomicUsize,
    bytes: AtomicUsize,
}

/// A loopback proxy to `to` that counts connections and bytes both ways.
async fn counting_proxy(to: String) -> (u16, Arc<Counts>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let counts = Arc::new(Counts::default());
    let c = counts.clone();
    tokio::spawn(async move {
        loop {
            let (mut a, _) = listener.accept().await.unwrap();
            c.connections.fetch_add(1, Ordering::SeqCst);
            let (to, c) = (to.clone(), c.clone());
            tokio::spawn(async move {
                if let Ok(mut b) = TcpStream::connect(to).await {
                    if let Ok((up, down)) = tokio::io::copy_bidirectional(&mut a, &mut b).await {
                        c.bytes.fetch_add((up + down) as usize, Ordering::SeqCst);
                    }
                }
            });
        }
    });
    (port, counts)
}

#[test]
fn idle_watch_makes_no_api_requests() {
    let Some(h) = common::start("idle_watch_makes_no_api_requests") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let admin = h.admin().await;
        common::create_server_node(&admin, &common::Kubelet::ready("idle-1")).await;
        let (port, counts) = counting_proxy(h.server.trim_start_matches("https://").to_string()).await;
        let proxied = format!("https://127.0.0.1:{port}");
        let kubeconfig = tmp.path().join("proxied.kubeconfig");
        let text = std::fs::read_to_string(&h.admin_kubeconfig).unwrap().replace(&h.server, &proxied);
        std::fs::write(&kubeconfig, text).unwrap();

        // Calm: no PSI, plenty of memory.
        let psi = tmp.path().join("psi");
        let meminfo = tmp.path().join("meminfo");
        std::fs::write(
            &psi,
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        )
        .unwrap();
        std::fs::write(
            &meminfo,
            "MemTotal:       16000000 kB\nMemFree:         8000000 kB\nMemAvailable:   12000000 kB\n",
        )
        .unwrap();
        let config = tmp.path().join("regrade.toml");
        std::fs::write(
            &config,
            format!(
                r#"
state_file = "{state}"
level_record = "{level_record}"
[pressure]
sample_period = "{PERIOD_MS}ms"
sustain = "1s"
cooldown = "1s"
source = "{psi}"
meminfo = "{meminfo}"
[cluster]
kubeconfig = "{kc}"
node_name = "idle-1"
endpoints_cache = "{cache}"
[systemd]
record = "{record}"
"#,
                state = tmp.path().join("state.json").display(),
                psi = psi.display(),
                meminfo = meminfo.display(),
                kc = kubeconfig.display(),
                cache = tmp.path().join("endpoints").display(),
                record = tmp.path().join("started-level").display(),
                level_record = tmp.path().join("level.json").display(),
            ),
        )
        .unwrap();

        let mut watch = Command::new(env!("CARGO_BIN_EXE_regrade"))
            .args(["--config", config.to_str().unwrap(), "watch"])
            .env("REGRADE_LOG", "debug")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Count the samples the watch logs; stop it after SAMPLES of them.
        let stderr = watch.stderr.take().unwrap();
        let seen = Arc::new(AtomicUsize::new(0));
        let reader = {
            let seen = seen.clone();
            std::thread::spawn(move || {
                let mut log = String::new();
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if line.contains("DEBUG") && line.contains(" sample ") && line.contains("decision") {
                        seen.fetch_add(1, Ordering::SeqCst);
                    }
                    log += &line;
                    log.push('\n');
                }
                log
            })
        };
        // Start-up may read the Node once (its level label after a reboot,
        // docs/behaviour.md "Coordination");
        // what counts is what a calm watch does afterwards, sample after sample.
        let t0 = Instant::now();
        while seen.load(Ordering::SeqCst) < 1 {
            assert!(watch.try_wait().unwrap().is_none(), "regrade watch exited early");
            assert!(t0.elapsed() < Duration::from_secs(60), "no sample within 60 s");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The proxy counts a forwarded chunk after writing it on: on a loaded machine
        // the count of start-up's last reply can land after the first sample's log
        // line. Take the start-up figures once they have been still for 300 ms (six
        // samples at 50 ms): whatever moves after that is the calm watch's.
        let snapshot = || (counts.connections.load(Ordering::SeqCst), counts.bytes.load(Ordering::SeqCst));
        let (mut start_conns, mut start_bytes) = snapshot();
        let mut still_since = Instant::now();
        while still_since.elapsed() < Duration::from_millis(300) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let now = snapshot();
            if now != (start_conns, start_bytes) {
                (start_conns, start_bytes) = now;
                still_since = Instant::now();
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "start-up traffic never ended");
        }
        while seen.load(Ordering::SeqCst) < SAMPLES as usize {
            assert!(watch.try_wait().unwrap().is_none(), "regrade watch exited early");
            assert!(
                t0.elapsed() < Duration::from_secs(300),
                "too slow: {} samples in 300s",
                seen.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let ran = t0.elapsed();
        // SAFETY: signals our own child.
        unsafe { libc::kill(watch.id() as i32, libc::SIGTERM) };
        let status = watch.wait().unwrap();
        let log = reader.join().unwrap();
        assert!(status.success(), "regrade watch failed: {log}");
        let samples = seen.load(Ordering::SeqCst);
        let (conns, bytes) = (
            counts.connections.load(Ordering::SeqCst) - start_conns,
            counts.bytes.load(Ordering::SeqCst) - start_bytes,
        );

        // Positive control: one preflight through the same proxy is seen.
        let mut cfg = h.config(&kubeconfig, "idle-1", "idle");
        cfg.cluster.endpoints_cache = tmp.path().join("endpoints-control");
        let c = common::kube_cluster(&cfg).unwrap();
        c.preflight(&Step { direction: Direction::Down, from: Level::Full, to: Level::ControlPlane }).await.unwrap();
        let control = counts.connections.load(Ordering::SeqCst) - start_conns - conns;

        // 720 samples are one hour at the default 5 s sample_period.
        let per_hour = conns as f64 * 720.0 / samples as f64;
        println!(
            "idle watch, calm: {samples} samples in {:.1}s (720 = 1 h at the default sample_period 5s); \
             API connections {conns}, bytes {bytes}; API requests per hour while calm: {per_hour:.0} \
             (start-up: {start_conns} connection(s), {start_bytes} bytes; control: one preflight opened \
             {control} connection(s))",
            ran.as_secs_f64()
        );
        assert!(control >= 1, "the proxy saw the control preflight: it counts");
        assert_eq!((conns, bytes), (0, 0), "an idle watch talked to the API:\n{log}");
    });
}
