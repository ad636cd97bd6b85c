//! The shipped packaging/systemd/regrade.service inside the test container's real
//! systemd: `systemd-analyze security` scores it (printed for CI's log), and the same
//! sandbox, with a probe as its command, still reaches what regrade needs.
//! Gated by REGRADE_TEST_SYSTEMD=1 (root).

use crate::common;

use common::nspawn::{enabled, Container};

/// The most exposure the unit may have: systemd-analyze's "OK" band.
const TARGET: f64 = 2.5;

#[test]
fn the_shipped_unit_is_hardened_and_still_reaches_what_regrade_needs() {
    if !enabled("the_shipped_unit_is_hardened_and_still_reaches_what_regrade_needs") {
        return;
    }
    let c = Container::up("regrade-unit");
    c.wait_healthy(std::time::Duration::from_secs(90));

    let report = c.exec(&["systemd-analyze", "security", "--no-pager", "regrade.service"]);
    let overall = report.lines().find(|l| l.contains("Overall exposure level")).expect("an overall score");
    println!("{}", report.lines().filter(|l| l.contains('✗')).collect::<Vec<_>>().join("\n"));
    println!("systemd-analyze security regrade.service: {}", overall.trim());
    let score: f64 = overall.split(':').nth(1).and_then(|s| s.split_whitespace().next()).unwrap().parse().unwrap();
    assert!(score <= TARGET, "exposure {score} is above {TARGET}");

    // A step may outlast systemd's default stop timeout; regrade finishes it first.
    assert_eq!(c.exec(&["systemctl", "show", "-P", "TimeoutStopUSec", "regrade.service"]).trim(), "30min");
    // Ahead of a thrashing host's workloads for a CPU.
    assert_eq!(c.exec(&["systemctl", "show", "-P", "Nice", "regrade.service"]).trim(), "-10");
    // ... and for the disk.
    assert_eq!(c.exec(&["systemctl", "show", "-P", "IOSchedulingClass", "regrade.service"]).trim(), "1");

    // The same sandbox with a probe instead of `regrade watch`: /proc/pressure,
    // /proc/meminfo, writing in the drop-in directory and the default
    // cluster.endpoints_cache (/var/lib/regrade), systemd on the system bus,
    // and the network (etcd's health endpoint of this container's k3s).
    let addr = c.var("ADDR");
    let probe = format!(
        "set -e; read -r line < /proc/pressure/memory; echo \"psi: $line\"; grep MemAvailable /proc/meminfo; \
         echo probe > /etc/rancher/k3s/config.yaml.d/.probe; rm /etc/rancher/k3s/config.yaml.d/.probe; \
         echo probe > /var/lib/regrade/api-endpoints; rm /var/lib/regrade/api-endpoints; \
         busctl --system call org.freedesktop.systemd1 /org/freedesktop/systemd1 \
         org.freedesktop.systemd1.Manager GetUnit s k3s.service; \
         exec 3<>/dev/tcp/{addr}/2381; printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3; grep -q '\"health\":\"true\"' <&3; \
         echo probe-ok"
    );
    let dir = std::path::Path::new(c.var("ROOT")).join("etc/systemd/system/regrade.service.d");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("probe.conf"),
        format!("[Service]\nType=oneshot\nWatchdogSec=0\nExecStart=\nExecStart=/bin/bash -c {}\n", shell_quote(&probe)),
    )
    .unwrap();
    c.exec(&["systemctl", "daemon-reload"]);
    let started = std::process::Command::new("nsenter")
        .args(["-t", c.var("PID"), "-a", "systemctl", "start", "regrade.service"])
        .status()
        .unwrap();
    let log = c.exec(&["journalctl", "-u", "regrade.service", "-o", "cat", "--no-pager"]);
    println!("{log}");
    assert!(started.success() && log.contains("probe-ok"), "the sandboxed probe failed:\n{log}");
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}
