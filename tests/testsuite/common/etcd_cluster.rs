//! A real etcd cluster on loopback (tests/rig's etcd binary), serving its client port
//! over TLS with client-certificate auth as k3s runs it; certificates made with
//! openssl, P-256 as k3s makes them; members named `server<N>-<8 hex>` as k3s names
//! them. Member `n` (1-based) listens on `<prefix><n>`: client :2379, peer :2380.
//! Every member is killed when the cluster is dropped.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use std::time::{Duration, Instant};

use regrade::etcd::gate::EtcdGate;
use regrade::etcd::judge::View;
use regrade::etcd::EtcdConfig;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").args(args).current_dir(dir).output().expect("openssl");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

const P256: [&str; 4] = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];

/// A CA (`name.crt`, `name.key`) in `dir`.
pub fn ca(dir: &Path, name: &str) {
    let (key, crt, subj) = (format!("{name}.key"), format!("{name}.crt"), format!("/CN={name}"));
    let mut args = vec!["req", "-x509"];
    args.extend(P256);
    args.extend(["-nodes", "-keyout", &key, "-out", &crt, "-days", "2", "-subj", &subj]);
    openssl(dir, &args);
}

/// A leaf signed by `ca` (`name.crt`, `name.key`) with subjectAltName `san` and
/// extendedKeyUsage `usage`.
pub fn leaf(dir: &Path, ca: &str, name: &str, san: &str, usage: &str) {
    let ext = format!("{name}.ext");
    std::fs::write(dir.join(&ext), format!("subjectAltName={san}\nextendedKeyUsage={usage}\n")).unwrap();
    let (key, csr, crt, subj) =
        (format!("{name}.key"), format!("{name}.csr"), format!("{name}.crt"), format!("/CN={name}"));
    let mut args = vec!["req"];
    args.extend(P256);
    args.extend(["-nodes", "-keyout", &key, "-out", &csr, "-subj", &subj]);
    openssl(dir, &args);
    let (ca_crt, ca_key) = (format!("{ca}.crt"), format!("{ca}.key"));
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_crt,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
}

pub struct EtcdCluster {
    etcd: PathBuf,
    pub dir: PathBuf,
    prefix: &'static str,
    names: Vec<String>,
    procs: Vec<Option<Child>>,
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for c in self.procs.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl EtcdCluster {
    /// Certificates for `members` members in `dir` (`server-ca`, `server<n>` serving
    /// and client, `client` for regrade), none started yet.
    pub fn new(bin_dir: &Path, dir: &Path, prefix: &'static str, members: usize) -> EtcdCluster {
        ca(dir, "server-ca");
        for n in 1..=members {
            let san = format!("IP:{prefix}{n},IP:127.0.0.1,DNS:localhost");
            leaf(dir, "server-ca", &format!("server{n}"), &san, "serverAuth,clientAuth");
        }
        leaf(dir, "server-ca", "client", "DNS:etcd-client", "clientAuth");
        // k3s names members <node>-<8 hex>, random at first start.
        let names = (1..=members)
            .map(|n| {
                let hex = std::process::id().wrapping_mul(2654435761).rotate_left(n as u32 * 8);
                format!("server{n}-{hex:08x}")
            })
            .collect();
        EtcdCluster {
            etcd: bin_dir.join("etcd"),
            dir: dir.to_path_buf(),
            prefix,
            names,
            procs: (0..members).map(|_| None).collect(),
        }
    }

    /// Starts members `1..=n` as a new cluster.
    pub fn start_new(&mut self, n: usize) -> String {
        let members: Vec<usize> = (1..=n).collect();
        let initial = self.initial(&members);
        for m in members {
            self.start(m, &initial, "new");
        }
        initial
    }

    pub fn ip(&self, n: usize) -> String {
        format!("{}{n}", self.prefix)
    }

    pub fn client_url(&self, n: usize) -> String {
        format!("https://{}:2379", self.ip(n))
    }

    /// Member `n`'s metrics listener (`/metrics`), as `etcd.metrics_url` names it.
    pub fn metrics_url(&self, n: usize) -> String {
        format!("http://{}:2381/metrics", self.ip(n))
    }

    pub fn peer_url(&self, n: usize) -> String {
        format!("http://{}:2380", self.ip(n))
    }

    pub fn name(&self, n: usize) -> &str {
        &self.names[n - 1]
    }

    /// Starts member `n` with `initial` as its initial cluster.
    pub fn start(&mut self, n: usize, initial: &str, state: &str) {
        let d = &self.dir;
        let log = std::fs::File::create(d.join(format!("etcd{n}.log"))).unwrap();
        let (client, peer) = (self.client_url(n), self.peer_url(n));
        let c = Command::new(&self.etcd)
            .args(["--name", self.name(n), "--data-dir", d.join(format!("data{n}")).to_str().unwrap()])
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            // k3s serves /metrics and /health without TLS on its own listener.
            .args(["--listen-metrics-urls", &format!("http://{}:2381", self.ip(n))])
            .args(["--initial-cluster", initial, "--initial-cluster-state", state, "--initial-cluster-token", "gate"])
            .args(["--client-cert-auth", "--trusted-ca-file", d.join("server-ca.crt").to_str().unwrap()])
            .args(["--cert-file", d.join(format!("server{n}.crt")).to_str().unwrap()])
            .args(["--key-file", d.join(format!("server{n}.key")).to_str().unwrap()])
            .args(["--log-level", "warn", "--heartbeat-interval", "100", "--election-timeout", "1000"])
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("starting etcd");
        self.procs[n - 1] = Some(c);
    }

    /// SIGKILLs member `n`.
    pub fn kill(&mut self, n: usize) {
        let mut c = self.procs[n - 1].take().expect("running");
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// Stops (SIGSTOP) or continues (SIGCONT) member `n`: a member that hangs.
    pub fn signal(&self, n: usize, sig: libc::c_int) {
        let pid = self.procs[n - 1].as_ref().expect("running").id();
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, sig) }, 0);
    }

    /// `--initial-cluster` for `members`.
    pub fn initial(&self, members: &[usize]) -> String {
        members.iter().map(|&n| format!("{}={}", self.name(n), self.peer_url(n))).collect::<Vec<_>>().join(",")
    }

    /// regrade's `[etcd]` as member `n`'s server sees it, with `client`'s certificate.
    pub fn config(&self, n: usize, client: &str) -> EtcdConfig {
        EtcdConfig {
            endpoints: vec![self.client_url(n)],
            ca_file: self.dir.join("server-ca.crt"),
            cert_file: self.dir.join(format!("{client}.crt")),
            key_file: self.dir.join(format!("{client}.key")),
            members_cache: self.dir.join(format!("etcd-members-{n}.json")),
            ..EtcdConfig::default()
        }
    }

    /// The same as a `[etcd]` TOML section.
    pub fn config_toml(&self, n: usize) -> String {
        let c = self.config(n, "client");
        format!(
            "[etcd]\nendpoints = [{:?}]\nca_file = {:?}\ncert_file = {:?}\nkey_file = {:?}\nmembers_cache = {:?}\n",
            c.endpoints[0], c.ca_file, c.cert_file, c.key_file, c.members_cache
        )
    }
}

/// Looks until every member listed answers its status and sees a leader.
pub async fn settled(gate: &EtcdGate, want: usize, within: Duration) -> View {
    let t0 = Instant::now();
    loop {
        if let Ok(v) = gate.look().await.map(|l| l.view) {
            let ok = v.statuses.iter().filter(|(_, s)| s.as_ref().is_ok_and(|s| s.leader != 0)).count();
            if v.list.members.len() == want && ok == want {
                return v;
            }
        }
        assert!(t0.elapsed() < within, "etcd did not settle with {want} healthy members within {within:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
