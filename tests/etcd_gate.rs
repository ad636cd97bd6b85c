//! The etcd gate against a real three-member etcd (tests/rig's etcd binary) serving its
//! client port over TLS with client-certificate auth, as k3s runs it; certificates made
//! with openssl. Members on 127.0.0.31–34 (client :2379, peer :2380), names
//! `server<N>-<8 hex>` as k3s names them. Faults, in order, each with the member it must
//! name: a member SIGKILLed; started again (the after-restart check); a learner added
//! (not started, then started); a voter removed (two voters left).
//!
//! Gated by REGRADE_TEST_ETCD=1. Run alone: `REGRADE_TEST_ETCD=1 flock /tmp/regrade-rig.lock
//! cargo test --test etcd_gate -- --nocapture`.

use std::io::Write as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use regrade::etcd::client::{Endpoint, EtcdClient};
use regrade::etcd::gate::{EtcdGate, GateError};
use regrade::etcd::judge::{EtcdRefusal, Reason, View};
use regrade::etcd::EtcdConfig;

const GATE: &str = "REGRADE_TEST_ETCD";

fn ip(n: usize) -> String {
    format!("127.0.0.3{n}")
}

fn client_url(n: usize) -> String {
    format!("https://{}:2379", ip(n))
}

fn peer_url(n: usize) -> String {
    format!("http://{}:2380", ip(n))
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").args(args).current_dir(dir).output().expect("openssl");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA and a leaf signed by it (`name.crt`, `name.key`), P-256 as k3s makes them.
fn ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
        ],
    );
}

fn leaf(dir: &Path, ca: &str, name: &str, san: &str, usage: &str) {
    std::fs::write(dir.join(format!("{name}.ext")), format!("subjectAltName={san}\nextendedKeyUsage={usage}\n"))
        .unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
        ],
    );
}

/// The etcd members this test started; killed when it ends or panics.
struct Cluster {
    etcd: PathBuf,
    dir: PathBuf,
    names: Vec<String>,
    procs: Vec<Option<Child>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in self.procs.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Cluster {
    fn name(&self, n: usize) -> &str {
        &self.names[n - 1]
    }

    /// Starts member `n` (1-based) with `initial` as its initial cluster.
    fn start(&mut self, n: usize, initial: &str, state: &str) {
        let d = &self.dir;
        let log = std::fs::File::create(d.join(format!("etcd{n}.log"))).unwrap();
        let c = Command::new(&self.etcd)
            .args(["--name", self.name(n), "--data-dir", d.join(format!("data{n}")).to_str().unwrap()])
            .args(["--listen-client-urls", &client_url(n), "--advertise-client-urls", &client_url(n)])
            .args(["--listen-peer-urls", &peer_url(n), "--initial-advertise-peer-urls", &peer_url(n)])
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

    fn kill(&mut self, n: usize) {
        let mut c = self.procs[n - 1].take().expect("running");
        c.kill().unwrap(); // SIGKILL
        c.wait().unwrap();
    }

    fn initial(&self, members: &[usize]) -> String {
        members.iter().map(|&n| format!("{}={}", self.name(n), peer_url(n))).collect::<Vec<_>>().join(",")
    }
}

fn config(dir: &Path, n: usize, client: &str) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![client_url(n)],
        ca_file: dir.join("server-ca.crt"),
        cert_file: dir.join(format!("{client}.crt")),
        key_file: dir.join(format!("{client}.key")),
        ..EtcdConfig::default()
    }
}

/// Looks until every member listed answers its status and sees a leader.
async fn settled(gate: &EtcdGate, want: usize, within: Duration) -> View {
    let t0 = Instant::now();
    loop {
        if let Ok(v) = gate.look().await {
            let ok = v.statuses.iter().filter(|(_, s)| s.as_ref().is_ok_and(|s| s.leader != 0)).count();
            if v.list.members.len() == want && ok == want {
                return v;
            }
        }
        assert!(t0.elapsed() < within, "etcd did not settle with {want} healthy members within {within:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

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

fn refused(r: Result<View, GateError>) -> EtcdRefusal {
    match r {
        Err(GateError::Refused(r)) => r,
        Err(GateError::Unavailable(e)) => panic!("etcd could not be asked: {e:#}"),
        Ok(v) => panic!("not refused: {:?}", v.members(1000)),
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
    if std::env::var(GATE).as_deref() != Ok("1") {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED etcd_gate_against_a_real_tls_cluster: set {GATE}=1 (tests/rig's etcd)"
        );
        return;
    }
    let rig = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/rig/build.sh");
    let build = Command::new(rig).stderr(Stdio::inherit()).output().unwrap();
    assert!(build.status.success(), "tests/rig/build.sh failed");
    let bin = PathBuf::from(String::from_utf8(build.stdout).unwrap().lines().last().unwrap().trim());

    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    ca(d, "server-ca");
    for n in 1..=4 {
        leaf(
            d,
            "server-ca",
            &format!("server{n}"),
            &format!("IP:{},IP:127.0.0.1,DNS:localhost", ip(n)),
            "serverAuth,clientAuth",
        );
    }
    leaf(d, "server-ca", "client", "DNS:etcd-client", "clientAuth");
    ca(d, "rogue-ca");
    leaf(d, "rogue-ca", "rogue", "DNS:rogue", "clientAuth");
    // k3s names members <node>-<8 hex>, random at first start.
    let hex: Vec<String> =
        (0..4).map(|i| format!("{:08x}", std::process::id().wrapping_mul(2654435761).rotate_left(i * 8))).collect();
    let names = (1..=4).map(|n| format!("server{n}-{}", hex[n - 1])).collect();
    let mut cl = Cluster { etcd: bin.join("etcd"), dir: d.to_path_buf(), names, procs: vec![None, None, None, None] };
    let three = cl.initial(&[1, 2, 3]);
    for n in 1..=3 {
        cl.start(n, &three, "new");
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let t = Instant::now();
        let gate1 = EtcdGate::new(&config(d, 1, "client")).unwrap();
        let v = settled(&gate1, 3, Duration::from_secs(30)).await;
        println!(
            "[{:>5.1}s] three members up, each answering over TLS with client-cert auth",
            t.elapsed().as_secs_f64()
        );

        // Healthy: the gate lets this member go, and names every member right.
        let v1 = gate1.check().await.unwrap();
        let me1 = v1.self_id();
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
        assert_eq!(v1.list.members.iter().find(|m| m.id == me1).unwrap().name, cl.name(1));

        // Client-certificate auth is on: a client with another CA's certificate gets nothing.
        let rogue = EtcdClient::new(&config(d, 1, "rogue")).unwrap();
        let e = rogue.member_list(&Endpoint::parse(&client_url(1)).unwrap()).await.unwrap_err();
        println!("[{:>5.1}s] a certificate from another CA is refused: {e:#}", t.elapsed().as_secs_f64());
        let mut missing = config(d, 1, "client");
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
        let gate3 = EtcdGate::new(&config(d, 3, "client")).unwrap();
        let me3 = v1.list.members.iter().find(|m| m.name == cl.name(3)).unwrap().id;
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

        // Fault 2: a learner added (as k3s adds a joining server), not started yet.
        let ep1 = Endpoint::parse(&client_url(1)).unwrap();
        let admin = EtcdClient::new(&config(d, 1, "client")).unwrap();
        let add = format!(r#"{{"peerURLs":["{}"],"isLearner":true}}"#, peer_url(4));
        let added = reconfigure(&admin, &ep1, "/v3/cluster/member/add", &add).await;
        let added: serde_json::Value = serde_json::from_slice(&added).unwrap();
        let id4 = added["member"]["ID"].as_str().unwrap().to_string();
        let r = refused(gate1.check().await);
        assert!(matches!(named(&r).2, Reason::NotStarted), "{r}");
        println!("[{:>5.1}s] a learner added, not started: refused: {r}", t.elapsed().as_secs_f64());
        // ... started: still a learner, refused naming it.
        let four = format!("{},{}={}", three, cl.name(4), peer_url(4));
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
