//! A k3s server run as a Docker container on the Docker rig's real dockerd
//! (tests/docker/rig.sh), for the level-record tests of a `docker` build: the k3s
//! stand-in behind regrade's entrypoint, as deploy/docker/compose.yaml runs it
//! (`--restart unless-stopped`, a tmpfs /run for the started-level record, the data
//! volume holding the level file), with host networking on a loopback address of its
//! own and its agent keeping the Node Ready against the tests' API server.
//!
//! It offers what [`super::level_rig`] asks of the systemd rig's nspawn container:
//! the regrade configuration that drives it, the level its file names, the level k3s
//! was started at, etcd's health — and a dockerd restart, which restarts it through
//! its restart policy.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const DOCKER: &str = "/usr/bin/docker";

pub struct DockerK3s {
    pub socket: PathBuf,
    pub name: String,
    pub ip: String,
    /// The data volume (`/var/lib/rancher/k3s`); the level file is in it.
    data: PathBuf,
    /// regrade's level record (on the host: regrade runs there).
    level_record: PathBuf,
}

fn rig_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/docker/rig.sh")
}

impl DockerK3s {
    /// Brings the rig's dockerd up (`rig.sh up`) and starts the container `name` with
    /// `etc` as its /etc/rancher/k3s, node `node`, on loopback address `ip`; waits
    /// for etcd's health.
    pub fn up(name: &str, node: &str, ip: &str, etc: &Path, dir: &Path) -> DockerK3s {
        let out = Command::new("bash").arg(rig_script()).arg("up").output().unwrap();
        assert!(out.status.success(), "rig.sh up failed:\n{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        let get = |k: &str| {
            text.lines().find_map(|l| l.strip_prefix(&format!("{k}="))).unwrap_or_else(|| panic!("no {k}= in {text}"))
        };
        let data = dir.join("k3s-data");
        std::fs::create_dir_all(&data).unwrap();
        let k = DockerK3s {
            socket: get("socket").into(),
            name: name.to_string(),
            ip: ip.to_string(),
            data,
            level_record: dir.join("level.json"),
        };
        let _ = k.docker_output(&["rm", "-f", name]);
        let (data_mount, etc_mount) =
            (format!("{}:/var/lib/rancher/k3s", k.data.display()), format!("{}:/etc/rancher/k3s", etc.display()));
        // Every port on its own address (the temporary etcd of a start too), so this
        // rig runs beside the systemd rig's, which shares the host's network.
        let temp_etcd_arg = format!("--temp-etcd-addr={ip}");
        let (node_arg, ip_arg, health_arg, bind_arg, client_arg) = (
            format!("--node-name={node}"),
            format!("--node-ip={ip}"),
            format!("--etcd-health-addr={ip}:2381"),
            format!("--bind-address={ip}"),
            format!("--etcd-client-url=https://{ip}:2379"),
        );
        k.docker(&[
            "run",
            "-d",
            "--name",
            name,
            "--network",
            "host",
            "--tmpfs",
            "/run",
            "--restart",
            "unless-stopped",
            "-v",
            &data_mount,
            "-v",
            &etc_mount,
            "--entrypoint",
            "/bin/regrade",
            get("image"),
            "entrypoint",
            "--",
            "k3s",
            "server",
            &node_arg,
            &ip_arg,
            &health_arg,
            &bind_arg,
            &client_arg,
            &temp_etcd_arg,
        ]);
        k.wait_healthy(Duration::from_secs(90));
        k
    }

    fn docker_output(&self, args: &[&str]) -> std::process::Output {
        Command::new(DOCKER).arg("-H").arg(format!("unix://{}", self.socket.display())).args(args).output().unwrap()
    }

    pub fn docker(&self, args: &[&str]) -> String {
        let out = self.docker_output(args);
        assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    pub fn level_file(&self) -> PathBuf {
        self.data.join("regrade-level")
    }

    pub fn level_record(&self) -> PathBuf {
        self.level_record.clone()
    }

    /// regrade's `[docker]` section for this container, and `extra` after it.
    pub fn config_text(&self, health_timeout: &str, extra: &str) -> String {
        format!(
            "[docker]\nsocket = {:?}\ncontainer = {:?}\nlevel_file = {:?}\nstop_timeout = \"5s\"\n\
             etcd_health_url = \"http://{}:2381/health\"\nhealth_timeout = {health_timeout:?}\n{extra}",
            self.socket,
            self.name,
            self.level_file(),
            self.ip
        )
    }

    /// The level the level file names (none: full).
    pub fn file_level(&self) -> String {
        std::fs::read_to_string(self.level_file()).map_or("full".into(), |t| t.trim().to_string())
    }

    /// The level the entrypoint recorded at the container's start; "" when it is not
    /// running (or has no record yet).
    pub fn record_text(&self) -> String {
        let out = self.docker_output(&["exec", &self.name, "cat", "/run/regrade/started-level"]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    pub fn healthy(&self) -> bool {
        super::nspawn::health_ok(&format!("http://{}:2381/health", self.ip))
    }

    pub fn wait_healthy(&self, within: Duration) {
        let t0 = Instant::now();
        while !self.healthy() || self.record_text().is_empty() {
            assert!(t0.elapsed() < within, "{} not healthy on {}:2381 within {within:?}", self.name, self.ip);
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Stops and starts the rig's dockerd: the container comes back through its
    /// restart policy (not waited for here).
    pub fn restart_dockerd(&self) {
        let out = Command::new("bash").arg(rig_script()).arg("restart-dockerd").output().unwrap();
        assert!(out.status.success(), "rig.sh restart-dockerd: {}", String::from_utf8_lossy(&out.stderr));
    }
}

impl Drop for DockerK3s {
    fn drop(&mut self) {
        let _ = self.docker_output(&["rm", "-f", &self.name]);
    }
}
