//! What the VM lane's tests share (tests/testsuite/vm_incident.rs, tests/testsuite/vm_power_cuts.rs): the
//! one-guest-at-a-time lock and the sweep of what a killed run left, the rigs and the
//! image, the lane's network (tests/vm/net.sh), server1's seed, and server2 and
//! server3 as systemd-nspawn containers in the lane's namespaces. Included by each
//! with `#[path]`.

#![allow(dead_code)] // each test uses its own part

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::guest;
use crate::common::nspawn::Container;
use crate::common::three_servers::{addr, container_env, enter_netns, repo, run, seed_k3s};
use crate::incident::shared::member_ids;

/// The hub namespace: the bridge and server1's tap are there, and so is the thread
/// that boots qemu.
pub const HUB: &str = "regrade-vm-hub";

/// `/tmp/regrade-vm.lock`, held: one guest at a time on this machine. Taking it sweeps
/// what a killed run left (qemu's cgroups, the peers' containers, temporary trees).
pub struct Lock(File);

/// Fails at once, before the rigs and the image are built, when qemu is not installed.
pub fn take_lock() -> Lock {
    for tool in ["qemu-system-x86_64", "qemu-img"] {
        let on_path =
            std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()));
        assert!(
            on_path,
            "{tool} is not installed: the VM lane needs Debian's qemu-system-x86 and qemu-utils \
             (tests/run installs them, without their recommends)"
        );
    }
    let lock =
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open("/tmp/regrade-vm.lock").unwrap();
    // SAFETY: flock on a file this test opened.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    // What a killed run left (the lock is ours: no other run is under way).
    guest::sweep();
    for n in [2, 3] {
        let _ = Command::new(repo("tests/nspawn/container.sh")).args(["down", &format!("vm-server{n}")]).output();
    }
    for e in std::fs::read_dir("/var/tmp").unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("regrade-vm.") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    Lock(lock)
}

/// The lane's network; removed when dropped (after the containers and the guest).
pub struct Network;

impl Network {
    pub fn up() -> Network {
        let st = Command::new(repo("tests/vm/net.sh")).arg("up").status().unwrap();
        assert!(st.success(), "tests/vm/net.sh up");
        Network
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        let _ = Command::new(repo("tests/vm/net.sh")).arg("down").status();
    }
}

/// Runs `f` on a thread inside the network namespace `ns`.
pub fn in_ns<T: Send + 'static>(ns: String, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        enter_netns(&ns);
        f()
    })
    .join()
    .unwrap()
}

/// server2 or server3: a container in its namespace `regrade-vm-s<n>`.
pub struct Peer {
    pub n: usize,
    pub c: Container,
}

impl Peer {
    pub fn etcd_metric(&self, series: &'static str) -> Option<f64> {
        let text = in_ns(format!("regrade-vm-s{}", self.n), || {
            crate::common::nspawn::http_get("http://127.0.0.1:2381/metrics")
        })?;
        let line = text.lines().find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))?;
        line[series.len()..].trim().parse().ok()
    }

    pub fn server1_member(&self) -> Option<u64> {
        member_ids(Path::new(self.c.var("ROOT")), self.n)
            .into_iter()
            .find(|(n, _)| n.starts_with("server1-"))
            .map(|(_, id)| id)
    }
}

/// server2 and server3, booted at once in the lane's namespaces (an etcd of three
/// reaches quorum once server1's member is up too).
pub fn peers_up(tmp: &Path, certs: &Path, names: &[String], bin: &Path) -> Vec<Peer> {
    let specs: Vec<(String, Vec<(&str, String)>)> = [2, 3]
        .iter()
        .map(|&n| {
            let (etc, root) = seed_k3s(tmp, certs, names, n);
            let mut env = container_env(n, &etc, &root, bin);
            for (k, v) in &mut env {
                if *k == "REGRADE_NSPAWN_NETNS" {
                    *v = format!("regrade-vm-s{n}");
                }
            }
            (format!("vm-server{n}"), env)
        })
        .collect();
    let specs: Vec<(&str, Vec<(&str, String)>)> = specs.iter().map(|(n, e)| (n.as_str(), e.clone())).collect();
    Container::up_many(&specs).into_iter().zip([2, 3]).map(|(c, n)| Peer { n, c }).collect()
}

/// The run's seed for server1 (tests/vm/guest/seed.sh copies `root` over / at the
/// first boot of this run's disk): its address, the binaries, k3s's configuration (the
/// e2e's, with the node's name and address, as a k3s user writes them in
/// config.yaml), the kubelet stand-in's kubeconfig (server2's API), and regrade's
/// configuration `regrade_toml` (`@API_SERVERS@` replaced) with `more` files
/// (path under /, contents).
pub fn server1_seed(
    tmp: &Path,
    certs: &Path,
    names: &[String],
    bin: &Path,
    regrade_bin: &Path,
    regrade_toml: &str,
    more: &[(String, String)],
) -> PathBuf {
    let (etc, root) = seed_k3s(tmp, certs, names, 1);
    let seed = tmp.join("vm-seed");
    std::fs::create_dir_all(seed.join("bin")).unwrap();
    std::fs::write(seed.join("net.env"), format!("HOST=server1\nADDR={}\n", addr(1))).unwrap();
    std::fs::copy(regrade_bin, seed.join("bin/regrade")).unwrap();
    for b in ["k3s-standin", "kube-apiserver", "kubelet-standin"] {
        std::fs::copy(bin.join(b), seed.join("bin").join(b)).unwrap();
    }
    let r = seed.join("root");
    run(Path::new("cp"), &["-a", &format!("{}/.", root.display()), r.to_str().unwrap()]);
    let k3s_etc = r.join("etc/rancher/k3s");
    std::fs::create_dir_all(&k3s_etc).unwrap();
    run(Path::new("cp"), &["-a", &format!("{}/.", etc.display()), k3s_etc.to_str().unwrap()]);
    let mut cfg = std::fs::read_to_string(k3s_etc.join("config.yaml")).unwrap();
    cfg += &format!("node-name: server1\nnode-ip: {}\n", addr(1));
    std::fs::write(k3s_etc.join("config.yaml"), cfg).unwrap();
    let admin = std::fs::read_to_string(certs.join("admin.kubeconfig")).unwrap();
    std::fs::write(
        k3s_etc.join("kubelet.kubeconfig"),
        admin.replace(&certs.display().to_string(), "/etc/rancher/k3s/tls"),
    )
    .unwrap();
    let etc_regrade = r.join("etc/regrade");
    std::fs::create_dir_all(&etc_regrade).unwrap();
    let toml = regrade_toml.replace("@API_SERVERS@", &crate::common::three_servers::api_servers_toml(1));
    std::fs::write(etc_regrade.join("regrade.toml"), toml).unwrap();
    for (path, text) in more {
        let p = r.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    seed
}

/// Waits until the three servers' Nodes are Ready, through `c`; panics after 300 s.
pub async fn nodes_ready(c: &kube::Client) {
    for n in ["server1", "server2", "server3"] {
        let ok = crate::incident::shared::wait_until(std::time::Duration::from_secs(300), async || {
            (crate::incident::shared::node_state(c, n).await.is_some_and(|(ready, _)| ready)).then_some(())
        })
        .await;
        assert!(ok.is_some(), "Node {n} not Ready within 300 s");
    }
}
