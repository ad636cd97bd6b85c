//! A Node PATCH whose reply is lost (issue 10, scenario 3), against a real
//! kube-apiserver with RBAC: `regrade watch` steps full -> control-plane through a
//! proxy (tests/testsuite/common/lost_reply.rs) that forwards the PATCH setting the Node's marks
//! — so the API server applies it — and drops its reply; then every request times
//! out for a while, as when every endpoint does. regrade cannot know whether the
//! marks were set: the step does not count as done, and the marks must converge on
//! the level regrade holds once the API answers again, with no step of its own.
//!
//! Gated by REGRADE_TEST_KUBE=1. full -> control-plane restarts nothing, so the
//! systemd actuator here needs no systemd (its drop-in and start record are files in
//! a temporary directory).

use crate::common;

use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Api;

const NODE: &str = "server-1";
const LABEL: &str = "regrade.dev/level";
const TAINT: &str = "regrade.dev/stepped-down";

fn marks(n: &Node) -> (Option<String>, bool, bool) {
    let label = n.metadata.labels.as_ref().and_then(|l| l.get(LABEL).cloned());
    let spec = n.spec.clone().unwrap_or_default();
    let tainted = spec.taints.unwrap_or_default().iter().any(|t| t.key == TAINT);
    (label, spec.unschedulable == Some(true), tainted)
}

fn psi(path: &std::path::Path, v: f64) {
    std::fs::write(path, common::psi_text(v)).unwrap();
}

#[test]
fn a_lost_reply_to_the_node_patch_converges() {
    let Some(h) = common::start("a_lost_reply_to_the_node_patch_converges") else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let admin = rt.block_on(h.admin());
    rt.block_on(common::create_server_node(&admin, &common::Kubelet::ready(NODE)));
    let sa = h.unbound_server_credential(NODE);
    let proxy = rt.block_on(common::lost_reply::start(&h.server, &h.dir.join("pki")));

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let kubeconfig = d.join("proxied.kubeconfig");
    std::fs::write(&kubeconfig, std::fs::read_to_string(&sa).unwrap().replace(&h.server, &proxy.url)).unwrap();
    psi(&d.join("psi"), 80.0);
    std::fs::write(d.join("meminfo"), "MemAvailable: 2000000 kB\n").unwrap();
    let conf = d.join("regrade.toml");
    std::fs::write(
        &conf,
        format!(
            "state_file = {:?}\nlevel_record = {:?}\n[pressure]\nthreshold = 40\ncalm_threshold = 10\n\
             mem_available_floor = \"none\"\nsample_period = \"200ms\"\nsustain = \"600ms\"\ncooldown = \"1s\"\n\
             source = {:?}\nmeminfo = {:?}\n[cluster]\nkubeconfig = {kubeconfig:?}\nnode_name = {NODE:?}\n\
             lease_name = \"regrade\"\nlease_duration = \"3s\"\nrequest_timeout = \"2s\"\n\
             endpoints_cache = {:?}\n[systemd]\ndropin = {:?}\nrecord = {:?}\n",
            d.join("state.json"),
            d.join("level.json"),
            d.join("psi"),
            d.join("meminfo"),
            d.join("endpoints"),
            d.join("config.yaml.d/50-regrade.yaml"),
            d.join("started-level"),
        ),
    )
    .unwrap();

    // The next Node PATCH reaches the API server; its reply never comes back, and for
    // 6 s after it nothing answers at all.
    proxy.knobs.lose_next_node_patch(Duration::from_secs(6));
    let log = d.join("watch.log");
    let mut watch = Command::new(env!("CARGO_BIN_EXE_regrade"))
        .args(["--config", conf.to_str().unwrap(), "watch"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let nodes: Api<Node> = Api::all(admin.clone());
    let t0 = Instant::now();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        while proxy.knobs.lost.load(Ordering::SeqCst) == 0 {
            assert!(t0.elapsed() < Duration::from_secs(30), "no Node PATCH went through the proxy");
            std::thread::sleep(Duration::from_millis(50));
        }
        // No more pressure: whatever happens now is regrade converging, not stepping.
        psi(&d.join("psi"), 20.0);
        let t_lost = Instant::now();
        std::thread::sleep(Duration::from_millis(500));
        let n = rt.block_on(nodes.get(NODE)).unwrap();
        assert_eq!(marks(&n), (Some("control-plane".into()), true, true), "the lost PATCH took effect at the API");
        println!("[lost reply] the PATCH marking {NODE} control-plane took effect; its reply was dropped");

        // Converged: the record holds full (the step did not finish), the Node has no
        // marks of regrade's, and it stays so.
        let t = Instant::now();
        loop {
            let n = rt.block_on(nodes.get(NODE)).unwrap();
            let rec: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(d.join("level.json")).unwrap_or_default())
                    .unwrap_or_default();
            if marks(&n) == (None, false, false) && rec["level"] == "full" && rec["step"].is_null() {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "marks not converged: {:?}, record {rec}", marks(&n));
            std::thread::sleep(Duration::from_millis(200));
        }
        println!(
            "[lost reply] marks converged on full {:.1}s after the lost reply ({} requests swallowed meanwhile, {} \
             Node PATCHes in all)",
            t_lost.elapsed().as_secs_f64(),
            proxy.knobs.swallowed.load(Ordering::SeqCst),
            proxy.knobs.node_patches.load(Ordering::SeqCst)
        );
        assert!(proxy.knobs.back(), "converged while the API answered nothing?");
        std::thread::sleep(Duration::from_secs(2));
        assert_eq!(marks(&rt.block_on(nodes.get(NODE)).unwrap()), (None, false, false), "and it stays so");
    }));
    let _ = watch.kill();
    let _ = watch.wait();
    if let Err(p) = result {
        eprintln!("--- watch log ---\n{}", std::fs::read_to_string(&log).unwrap_or_default());
        std::panic::resume_unwind(p);
    }
}
