//! The systemd actuator against a stalled system bus: a private `dbus-daemon` (the
//! real broker, Debian's) on which a peer owns `org.freedesktop.systemd1` and never
//! answers — what PID 1 looks like when it is stuck under memory pressure — and then
//! a bus socket that takes the connection and never answers the handshake (a stuck
//! broker). Each step must end by its bounds with nothing changed, not hang.
//! Gated by REGRADE_TEST_SYSTEMD=1 (needs dbus-daemon; no root).

use crate::common;

use std::time::{Duration, Instant};

use common::private_bus::{private_bus, silent_systemd};

use regrade::actuator::systemd::SystemdActuator;
use regrade::actuator::{Actuator, NodeReadiness};
use regrade::level::Level;

struct NeverReady;

#[async_trait::async_trait(?Send)]
impl NodeReadiness for NeverReady {
    async fn wait_ready_since(&self, _: std::time::SystemTime, _: Duration) -> anyhow::Result<()> {
        anyhow::bail!("not reached in this test")
    }
}

#[test]
fn a_step_against_a_stalled_bus_ends_in_bounded_time_with_nothing_changed() {
    if std::env::var("REGRADE_TEST_SYSTEMD").as_deref() != Ok("1") {
        eprintln!("skipped: set REGRADE_TEST_SYSTEMD=1");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (_bus, address) = private_bus(dir.path());
    silent_systemd(&address);
    // The process's system bus is this test's while it runs (tests share the process).
    let _bus = common::nspawn::system_bus();
    std::env::set_var("DBUS_SYSTEM_BUS_ADDRESS", &address);

    let dropin = dir.path().join("config.yaml.d/50-regrade.yaml");
    let record = dir.path().join("started-level");
    std::fs::write(&record, "full").unwrap();
    let cfg = regrade::config::Config::parse(&format!(
        "[systemd]\ndropin = {dropin:?}\nrecord = {record:?}\netcd_health_url = \"http://127.0.0.1:9/health\"\n\
         call_timeout = \"1s\"\nhealth_timeout = \"30s\"\n"
    ))
    .unwrap();
    let mut a = SystemdActuator::new(&cfg.systemd, &cfg.levels).unwrap();

    let t0 = Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let result = rt.block_on(a.apply_level(Level::EtcdOnly, &NeverReady));
    let took = t0.elapsed();
    eprintln!("stalled bus: the step ended after {took:?}: {result:?}");

    let e = format!("{:#}", result.expect_err("a step against a silent systemd must fail"));
    assert!(e.contains("nothing was changed"), "{e}");
    assert!(e.contains("did not answer") || e.contains("timed out") || e.contains("TimedOut"), "{e}");
    // Three attempts of 1 s each plus backoff: far below the 30 s health timeout,
    // and nowhere near "forever".
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(!dropin.exists(), "the etcd-only drop-in was not written");
    assert_eq!(std::fs::read_to_string(&record).unwrap(), "full");

    // A stuck broker: the socket takes the connection and never says a word.
    let stuck = dir.path().join("stuck-bus");
    let listener = std::os::unix::net::UnixListener::bind(&stuck).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in listener.incoming() {
            held.push(s);
        }
    });
    std::env::set_var("DBUS_SYSTEM_BUS_ADDRESS", format!("unix:path={}", stuck.display()));
    let mut a = SystemdActuator::new(&cfg.systemd, &cfg.levels).unwrap();
    let t0 = Instant::now();
    let result = rt.block_on(a.apply_level(Level::EtcdOnly, &NeverReady));
    let took = t0.elapsed();
    eprintln!("stuck broker: the step ended after {took:?}: {result:?}");
    let e = format!("{:#}", result.expect_err("a step against a stuck broker must fail"));
    assert!(e.contains("system bus") && e.contains("did not answer within 1s"), "{e}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(!dropin.exists(), "the etcd-only drop-in was not written");
    assert_eq!(std::fs::read_to_string(&record).unwrap(), "full");
}
