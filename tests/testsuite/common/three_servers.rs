//! The three-server rig shared by tests/testsuite/e2e_three_servers.rs and
//! tests/testsuite/incident_real_pressure.rs: server `n` (1..=3) at 10.213.7.1`n` in the network
//! namespace `regrade-e2e-s<n>` (tests/e2e/netns.sh), running the k3s stand-in with
//! tests/e2e/k3s-config.yaml. Each test adds its own regrade configuration to the seeds.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

use super::nspawn::Container;

pub fn repo(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(p)
}

pub fn addr(n: usize) -> String {
    format!("10.213.7.1{n}")
}

/// The network namespace server `n` runs in (tests/e2e/netns.sh).
pub fn netns(n: usize) -> String {
    format!("regrade-e2e-s{n}")
}

pub fn api_url(n: usize) -> String {
    format!("https://{}:6443", addr(n))
}

/// The two servers other than `n`.
pub fn others(n: usize) -> Vec<usize> {
    (1..=3).filter(|&m| m != n).collect()
}

/// The other servers' API URLs as a TOML array's items, for `@API_SERVERS@`.
pub fn api_servers_toml(n: usize) -> String {
    others(n).iter().map(|&m| format!("{:?}", api_url(m))).collect::<Vec<_>>().join(", ")
}

pub fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// Moves the calling thread (and the threads and processes it starts from now on) into
/// the network namespace `name`.
pub fn enter_netns(name: &str) {
    let f = std::fs::File::open(format!("/run/netns/{name}")).unwrap_or_else(|e| panic!("netns {name}: {e}"));
    // SAFETY: setns on a namespace file this test made; affects only this thread.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {name}: {}", std::io::Error::last_os_error());
}

/// Runs `f` on a thread inside server `n`'s network namespace (its 127.0.0.1).
pub fn in_netns<T: Send + 'static>(n: usize, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        enter_netns(&netns(n));
        f()
    })
    .join()
    .unwrap()
}

pub fn run(cmd: &Path, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{}: {e}", cmd.display()));
    assert!(out.status.success(), "{} {args:?}: {}", cmd.display(), String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The rig's network namespaces; removed when the test ends (after the containers).
pub struct Network;

impl Drop for Network {
    fn drop(&mut self) {
        let _ = Command::new(repo("tests/e2e/netns.sh")).arg("down").status();
    }
}

/// A field of a journal entry in JSON (`journalctl -o json`): regrade's own (`F_` +
/// name, tracing-journald's prefix) or journald's.
pub fn field<'a>(v: &'a Value, name: &str) -> &'a str {
    v[format!("F_{name}")].as_str().or_else(|| v[name].as_str()).unwrap_or("?")
}

/// The seeds of server `n`'s k3s: its config (ETC, with the API certificates from
/// `certs`) and etcd's CAs under its root (ROOT). Returns (ETC, ROOT).
pub fn seed_k3s(tmp: &Path, certs: &Path, names: &[String], n: usize) -> (PathBuf, PathBuf) {
    let etc = tmp.join(format!("seed{n}/etc"));
    let root = tmp.join(format!("seed{n}/root"));
    std::fs::create_dir_all(etc.join("tls")).unwrap();
    for e in std::fs::read_dir(certs).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "admin.kubeconfig" {
            std::fs::copy(e.path(), etc.join("tls").join(e.file_name())).unwrap();
        }
    }
    let servers: String = others(n).iter().map(|&m| format!("  - {}\n", api_url(m))).collect();
    let k3s = std::fs::read_to_string(repo("tests/e2e/k3s-config.yaml")).unwrap();
    let cluster: Vec<String> = (1..=3).map(|m| format!("{}=https://{}:2380", names[m - 1], addr(m))).collect();
    let k3s =
        k3s.replace("@N@", &n.to_string()).replace("@SERVERS@\n", &servers).replace("@CLUSTER@", &cluster.join(","));
    std::fs::write(etc.join("config.yaml"), k3s).unwrap();
    // etcd's CAs, shared (k3s hands them to a joining server in its bootstrap data); each
    // stand-in makes its own serving, peer and client certificates from them.
    let etcd_tls = root.join("var/lib/rancher/k3s/server/tls/etcd");
    std::fs::create_dir_all(&etcd_tls).unwrap();
    for f in ["server-ca.crt", "server-ca.key", "peer-ca.crt", "peer-ca.key"] {
        std::fs::copy(tmp.join("etcd-ca").join(f), etcd_tls.join(f)).unwrap();
    }
    (etc, root)
}

/// What a three-server run is keyed by, made under `tmp`: etcd's CAs in `tmp/etcd-ca`
/// (shared by the members, as k3s's bootstrap data shares them; `seed_k3s` copies them
/// from there), the API servers' certificates and kubeconfigs in `tmp/certs`
/// (`harness certs`; the admin's points at server2), and this run's etcd member names,
/// k3s-style `server<N>-<8 hex>`.
pub struct Credentials {
    pub etcd_ca: PathBuf,
    pub certs: PathBuf,
    pub names: Vec<String>,
}

pub fn make_credentials(tmp: &Path, harness: &Path) -> Credentials {
    let etcd_ca = tmp.join("etcd-ca");
    std::fs::create_dir_all(&etcd_ca).unwrap();
    for ca in ["server-ca", "peer-ca"] {
        let (key, crt) = (etcd_ca.join(format!("{ca}.key")), etcd_ca.join(format!("{ca}.crt")));
        let ec = ["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2"];
        let subj = format!("/CN=etcd-{ca}");
        let rest = ["-keyout", key.to_str().unwrap(), "-out", crt.to_str().unwrap(), "-subj", &subj];
        run(Path::new("openssl"), &[&ec[..], &rest[..]].concat());
    }
    let certs = tmp.join("certs");
    let (c, h) = (certs.to_str().unwrap(), ["--host", &addr(1), "--host", &addr(2), "--host", &addr(3)]);
    run(harness, &[&["certs", c][..], &h[..], &["--server", &api_url(2)][..]].concat());
    let seed = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64 ^ u64::from(std::process::id());
    let names = (1..=3u64)
        .map(|n| format!("server{n}-{:08x}", (seed.wrapping_mul(0x9e3779b97f4a7c15).rotate_left(n as u32 * 13)) as u32))
        .collect();
    Credentials { etcd_ca, certs, names }
}

/// The environment tests/nspawn/container.sh boots server `n` with: its address and
/// namespace, the API on 6443, its Node name, its seeds (`seed_k3s`) and the rig's
/// binaries.
pub fn container_env(n: usize, etc: &Path, root: &Path, bin: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("REGRADE_NSPAWN_ADDR", addr(n)),
        ("REGRADE_NSPAWN_NETNS", netns(n)),
        ("REGRADE_NSPAWN_API_PORT", "6443".into()),
        ("REGRADE_NSPAWN_NODE_NAME", format!("server{n}")),
        ("REGRADE_NSPAWN_SEED_ETC", etc.display().to_string()),
        ("REGRADE_NSPAWN_SEED_ROOT", root.display().to_string()),
        ("REGRADE_STANDIN_BIN_DIR", bin.display().to_string()),
    ]
}

/// A server's own credential, as the NixOS module has it made: deploy/rbac.yaml and
/// deploy/admission-policy.yaml applied as the admin (what k3s does with the module's
/// manifests; applying again changes nothing), then `regrade credential` run in the
/// server's container, as regrade-credentials.service runs it, with the admin kubeconfig
/// the k3s stand-in writes there (k3s's k3s.yaml): a token of regrade/server<n> bound to
/// its Node, beside /etc/rancher/k3s/regrade.kubeconfig (its regrade.toml's kubeconfig).
/// Returns what it printed.
pub fn mint_credential(bin: &Path, certs: &Path, c: &Container) -> String {
    apply_access(bin, certs);
    c.exec(&["regrade", "credential", "--admin-kubeconfig", "/etc/rancher/k3s/tls/admin.kubeconfig"])
}

/// deploy/rbac.yaml and deploy/admission-policy.yaml applied as the admin (what k3s
/// does with the NixOS module's manifests); applying again changes nothing.
pub fn apply_access(bin: &Path, certs: &Path) {
    let admin = certs.join("admin.kubeconfig");
    for f in ["deploy/rbac.yaml", "deploy/admission-policy.yaml"] {
        run(&bin.join("kubectl"), &["--kubeconfig", admin.to_str().unwrap(), "apply", "-f", repo(f).to_str().unwrap()]);
    }
}
