//! The Docker actuator (docs/behaviour.md, "Actuators"; cargo feature `docker`): k3s server runs as a
//! Docker container whose entrypoint is `regrade entrypoint -- k3s server ARGS...`
//! (see [`super::entrypoint`]).
//!
//! - The level is a file on the k3s data volume (`docker.level_file`, one line: the
//!   level's name), written atomically. The entrypoint reads it at every start of the
//!   container, so a level survives `docker restart`, a dockerd restart, a reboot.
//! - When the flags of the running level and of the new one differ
//!   ([`LevelsConfig::needs_restart`]), the container is restarted through the Docker
//!   Engine API (`POST /containers/{id}/restart?t=...`): a restart, never a recreate, so
//!   the container keeps its node password and its own configuration, and a later
//!   Compose or Ansible run does not undo a level. Then etcd's health and, where the
//!   level runs the agent, a Node Ready on a heartbeat newer than the container's new
//!   start; on failure the previous level file is put back, the container restarted
//!   again, and the error says what happened.
//! - What k3s runs with is the level the entrypoint recorded on the container's tmpfs
//!   at its start (`docker.started_level_file`), read with `cat` through the Engine's
//!   exec API: `GET /containers/{id}/archive` does not see a tmpfs mount. A running
//!   container without a record (its k3s started before regrade was set up) runs at
//!   `full`.
//!
//! Why plain HTTP over the engine's socket and not the bollard crate: the actuator
//! needs four calls (inspect, restart, exec create/start/inspect) and reads five
//! fields; hyper is already in the build through kube, so this is ~150 lines and no
//! new dependency, where bollard would add its generated API models and their
//! dependencies to a daemon that should stay small.

mod engine;
mod http;

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use self::engine::{Container, Engine};
use super::entrypoint::{self, parse_level, read_level_file};
use super::etcd_health::HealthUrl;
use super::restart::{self, Purpose};
use super::{Actuator, NodeReadiness};
use crate::fsutil;
use crate::kill_point;
use crate::level::Level;
use crate::levels::LevelsConfig;
use crate::units::{format_duration, HumanDuration};

/// `[docker]`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DockerConfig {
    /// The Docker Engine's API socket. Access to it is root on the host.
    pub socket: PathBuf,
    /// The k3s server container (name or ID).
    pub container: String,
    /// The level file as regrade sees it: on the k3s data volume, the same file the
    /// k3s container's entrypoint reads (`REGRADE_LEVEL_FILE` there).
    pub level_file: PathBuf,
    /// The started-level record inside the k3s container, on its tmpfs
    /// (`REGRADE_STARTED_LEVEL_FILE` there).
    pub started_level_file: PathBuf,
    /// How long a restart lets k3s stop before the engine kills it (`t=` of the
    /// restart call; whole seconds).
    pub stop_timeout: HumanDuration,
    /// etcd's health endpoint, which k3s serves without TLS (with host networking, on
    /// the host's loopback).
    pub etcd_health_url: String,
    /// How long a restart may take to become healthy (and Ready) before it is undone.
    pub health_timeout: HumanDuration,
}

impl Default for DockerConfig {
    fn default() -> Self {
        DockerConfig {
            socket: PathBuf::from("/var/run/docker.sock"),
            container: "k3s".into(),
            level_file: PathBuf::from(entrypoint::DEFAULT_LEVEL_FILE),
            started_level_file: PathBuf::from(entrypoint::DEFAULT_STARTED_LEVEL_FILE),
            stop_timeout: HumanDuration(Duration::from_secs(30)),
            etcd_health_url: "http://127.0.0.1:2381/health".into(),
            health_timeout: HumanDuration(Duration::from_secs(300)),
        }
    }
}

impl DockerConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        let name_ok = |c: char| c.is_ascii_alphanumeric() || "_.-".contains(c);
        if self.container.is_empty() || !self.container.chars().all(name_ok) {
            bail!("docker.container = {:?} is not a container name or ID", self.container);
        }
        if !self.socket.is_absolute() {
            bail!("docker.socket = {:?} must be an absolute path", self.socket);
        }
        if !self.level_file.is_absolute() || self.level_file.file_name().is_none() {
            bail!("docker.level_file = {:?} must be an absolute path to a file", self.level_file);
        }
        if !self.started_level_file.is_absolute() || self.started_level_file.to_str().is_none() {
            bail!("docker.started_level_file = {:?} must be an absolute path", self.started_level_file);
        }
        HealthUrl::parse("docker.etcd_health_url", &self.etcd_health_url)?;
        if self.health_timeout.0.is_zero() {
            bail!("docker.health_timeout must be more than 0");
        }
        Ok(())
    }
}

/// How often a waited-for container is looked at again.
const POLL: Duration = Duration::from_millis(250);

pub struct DockerActuator {
    cfg: DockerConfig,
    levels: LevelsConfig,
    engine: Engine,
    health: HealthUrl,
}

impl DockerActuator {
    pub fn new(cfg: &DockerConfig, levels: &LevelsConfig) -> anyhow::Result<DockerActuator> {
        let health = HealthUrl::parse("docker.etcd_health_url", &cfg.etcd_health_url)?;
        Ok(DockerActuator { engine: Engine::new(&cfg.socket), cfg: cfg.clone(), levels: levels.clone(), health })
    }

    async fn running_container(&self) -> anyhow::Result<Container> {
        let c = self.engine.inspect(&self.cfg.container).await?;
        if !c.running {
            bail!(
                "container {} is {}, not running: the level k3s runs at cannot be read",
                self.cfg.container,
                c.status
            );
        }
        Ok(c)
    }

    /// The level the entrypoint recorded when the container's k3s started.
    async fn started_level(&self, c: &Container) -> anyhow::Result<Level> {
        let record = self.cfg.started_level_file.to_str().context("docker.started_level_file is not UTF-8")?;
        let out = self.engine.exec(&c.id, &["cat", record]).await?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        match out.exit_code {
            0 => parse_level(&out.stdout)
                .with_context(|| format!("started-level record {record} in container {}", self.cfg.container)),
            _ if stderr.contains("No such file") => Ok(Level::Full),
            code => bail!(
                "reading the started-level record {record} in container {} with `cat` exited {code}: {}",
                self.cfg.container,
                stderr.trim()
            ),
        }
    }

    /// The level the level file names (no file, or one the entrypoint cannot read:
    /// `full`, which is what the entrypoint would start).
    fn file_level(&self) -> Level {
        read_level_file(&self.cfg.level_file).ok().flatten().unwrap_or(Level::Full)
    }

    /// Of the levels whose flags k3s runs with (those of `started`), the one nearest to
    /// what the level file says: a level reached without a restart (`control-plane`
    /// from `full`) is the file's, while a file whose flags k3s does not run with (a
    /// restart that never happened) does not count.
    fn level_from(&self, started: Level, file: Level) -> Level {
        let pos = |l: Level| l.index_in(&Level::ALL).unwrap_or(0);
        Level::ALL
            .into_iter()
            .filter(|l| !self.levels.needs_restart(started, *l))
            .min_by_key(|l| (pos(*l).abs_diff(pos(file)), pos(*l).abs_diff(pos(started))))
            .unwrap_or(started)
    }

    /// The restart request as [`restart::send`] sends it: the Engine's restart of the
    /// container, whose request reaches the engine within its socket's connect.
    fn request<'a>(&self, purpose: Purpose, level: Level, write: restart::Write<'a>) -> restart::Request<'a> {
        restart::Request {
            purpose,
            what: format!("container {} into level {level}", self.cfg.container),
            timeout: engine::RESTART_CONNECT_TIMEOUT,
            write: Some(write),
        }
    }

    /// After the engine got the restart (its `answer`): the container started again
    /// (a start newer than `before`'s), then serving at `expected`.
    async fn follow(
        &self,
        answer: anyhow::Result<()>,
        before: &Container,
        expected: Level,
        readiness: &dyn NodeReadiness,
    ) -> anyhow::Result<()> {
        let name = &self.cfg.container;
        let deadline = Instant::now() + self.cfg.health_timeout.0;
        answer?;
        kill_point::reached("after-restart-request");
        let after = self.engine.inspect(name).await?;
        if after.started_at <= before.started_at {
            bail!("container {name} was not restarted: it still runs the start of {:?}", before.started_at);
        }
        kill_point::reached("health-wait");
        self.serving(expected, after.started_at, deadline, readiness).await
    }

    async fn serving(
        &self,
        expected: Level,
        since: SystemTime,
        deadline: Instant,
        readiness: &dyn NodeReadiness,
    ) -> anyhow::Result<()> {
        let name = &self.cfg.container;
        let budget = format!("docker.health_timeout = {}", format_duration(self.cfg.health_timeout.0));
        self.health.wait(deadline, &budget).await.with_context(|| format!("after restarting container {name}"))?;
        let started = self.started_level(&self.running_container().await?).await?;
        if self.levels.needs_restart(started, expected) {
            bail!(
                "container {name} started k3s with the flags of {started}, not those of {expected}: is its \
                 entrypoint `regrade entrypoint`, reading the level file {} (REGRADE_LEVEL_FILE)?",
                self.cfg.level_file.display()
            );
        }
        tracing::info!(container = %name, level = %expected, url = %self.health, "etcd is healthy after the restart");
        if self.levels.runs_agent(expected) {
            let left = deadline.saturating_duration_since(Instant::now());
            readiness
                .wait_ready_since(since, left)
                .await
                .with_context(|| format!("waiting for the Node to be Ready after restarting container {name}"))?;
            tracing::info!(container = %name, level = %expected, "the Node is Ready on a heartbeat newer than the restart");
        }
        Ok(())
    }

    /// Writes `level`'s level file and restarts the container into it, recording each
    /// phase first; on failure puts `previous` back and restarts into `from`'s flags.
    async fn write_and_restart(
        &self,
        from: Level,
        level: Level,
        previous: Option<Vec<u8>>,
        readiness: &dyn NodeReadiness,
    ) -> anyhow::Result<()> {
        let name = &self.cfg.container;
        let unchanged = || format!("stepping k3s from {from} to {level}: nothing was changed");
        // Read before the restart is allowed: what takes long comes before the look.
        let before = self.engine.inspect(name).await.with_context(unchanged)?;
        tracing::info!(container = %name, level = %level, "restarting the k3s container");
        let (path, written) = (&self.cfg.level_file, std::cell::Cell::new(false));
        let write = restart::write(|| {
            // A failed write leaves the old file whole: nothing to undo.
            write_level_file(path, format!("{level}\n").as_bytes())?;
            written.set(true);
            Ok(())
        });
        let asked = self.engine.restart(&before.id, self.cfg.stop_timeout.0);
        let answer = match restart::send(readiness, self.request(Purpose::Forward, level, write), asked).await {
            Ok(answer) => answer,
            // Not restarted (not allowed, not sent before the Lease's bound, or the
            // engine not reached): the level file goes back.
            Err(e) if !written.get() => return Err(e.context(unchanged())),
            Err(e) => {
                let back = self.put_back(&previous).map_or_else(
                    |p| format!("putting the previous level file back failed too ({p:#})"),
                    |()| "the previous level file was put back".to_string(),
                );
                return Err(e.context(format!("stepping k3s from {from} to {level}: k3s was not restarted; {back}")));
            }
        };
        let failure = match self.follow(answer, &before, level, readiness).await {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        let failed = anyhow::anyhow!("restarting container {name} into level {level} failed: {failure:#}");
        self.undo(from, level, &previous, failed, readiness).await
    }

    /// The restart into `to` failed: puts the previous level file back and restarts the
    /// container into it, if a restart is allowed now; the error says what was done.
    async fn undo(
        &self,
        from: Level,
        to: Level,
        previous: &Option<Vec<u8>>,
        failure: anyhow::Error,
        readiness: &dyn NodeReadiness,
    ) -> anyhow::Result<()> {
        let name = &self.cfg.container;
        tracing::error!(container = %name, error = %format!("{failure:#}"), from = %from, to = %to, "putting the previous level back");
        let failed = format!("stepping container {name} from {from} to {to} failed: {failure:#}");
        let restored =
            self.restore(previous, readiness).await.map_err(|e| super::undo_pending(readiness, e, &failed, from))?;
        bail!("{failed}; {restored}")
    }

    /// The level file as it was before a step (`previous`; `None`: there was none).
    fn put_back(&self, previous: &Option<Vec<u8>>) -> anyhow::Result<()> {
        let path = &self.cfg.level_file;
        match previous {
            Some(bytes) => write_level_file(path, bytes),
            None => fsutil::remove_durable(path, "level-file")
                .with_context(|| format!("removing level file {}", path.display())),
        }
    }

    /// Puts the previous level file back and restarts the container into it
    /// ([`restart::send`], [`Purpose::Back`]); says what it did. `Err`: nothing was
    /// restarted (the container not read, the restart not allowed or not sent, the
    /// file not written, the engine not reached).
    async fn restore(&self, previous: &Option<Vec<u8>>, readiness: &dyn NodeReadiness) -> anyhow::Result<String> {
        let (path, name) = (&self.cfg.level_file, &self.cfg.container);
        let back = previous.as_deref().and_then(|b| parse_level(b).ok()).unwrap_or(Level::Full);
        let before = self.engine.inspect(name).await.context("reading the container to restart it back")?;
        let write = restart::write(|| self.put_back(previous));
        let asked = self.engine.restart(&before.id, self.cfg.stop_timeout.0);
        let answer = restart::send(readiness, self.request(Purpose::Back, back, write), asked).await?;
        let path = path.display();
        Ok(match self.follow(answer, &before, back, readiness).await {
            Ok(()) => format!(
                "restored the previous level {back} (level file {path}) and restarted container {name}: k3s serves \
                 at {back} again"
            ),
            Err(e) => format!(
                "restored the previous level {back} (level file {path}) and restarted container {name}, but that \
                 failed too: {e:#}"
            ),
        })
    }

    /// The container, once it runs: after a dockerd restart (or the restart policy's
    /// back-off) it may be starting still.
    async fn running_by(&self, deadline: Instant) -> anyhow::Result<Container> {
        loop {
            match self.running_container().await {
                Ok(c) => return Ok(c),
                Err(e) if Instant::now() >= deadline => {
                    return Err(e.context(format!(
                        "within docker.health_timeout = {}",
                        format_duration(self.cfg.health_timeout.0)
                    )))
                }
                Err(_) => tokio::time::sleep(POLL).await,
            }
        }
    }
}

#[async_trait(?Send)]
impl Actuator for DockerActuator {
    fn levels(&self) -> &[Level] {
        &Level::ALL
    }

    async fn current_level(&self) -> anyhow::Result<Level> {
        let started = self.started_level(&self.running_container().await?).await?;
        Ok(self.level_from(started, self.file_level()))
    }

    async fn apply_level(&mut self, level: Level, readiness: &dyn NodeReadiness) -> anyhow::Result<()> {
        let path = self.cfg.level_file.clone();
        let started = self.started_level(&self.running_container().await?).await?;
        let from = self.level_from(started, self.file_level());
        let previous =
            fsutil::read_if_exists(&path).with_context(|| format!("reading level file {}", path.display()))?;
        if !self.levels.needs_restart(started, level) {
            write_level_file(&path, format!("{level}\n").as_bytes())?;
            tracing::info!(container = %self.cfg.container, level = %level, "level file written; k3s's flags are unchanged, no restart");
            return Ok(());
        }
        self.write_and_restart(from, level, previous, readiness).await
    }

    async fn observe(&self) -> anyhow::Result<(Option<Level>, Option<Level>)> {
        // A level file regrade did not write (unreadable, no level) names no level.
        let file = match read_level_file(&self.cfg.level_file) {
            Ok(l) => Some(l.unwrap_or(Level::Full)),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "the level file names no level");
                None
            }
        };
        // A container that is not running (dockerd restarting it) started nothing yet.
        let c = self.engine.inspect(&self.cfg.container).await?;
        let started = match c.running {
            true => Some(self.started_level(&c).await?),
            false => None,
        };
        Ok((file, started))
    }

    async fn rewrite(&mut self, level: Level) -> anyhow::Result<()> {
        write_level_file(&self.cfg.level_file, format!("{level}\n").as_bytes())
    }

    /// The container already started with `to`'s flags (its restart was asked for
    /// before the kill, or dockerd restarted it since): wait for it to serve, with a
    /// heartbeat newer than that start. Otherwise the level file for `to` is written
    /// and the container restarted, as a step does. Either way a failure puts `from`'s
    /// level file back and restarts into it.
    async fn resume(&mut self, from: Level, to: Level, readiness: &dyn NodeReadiness) -> anyhow::Result<()> {
        let previous = Some(format!("{from}\n").into_bytes());
        if !self.levels.needs_restart(from, to) {
            return self.rewrite(to).await;
        }
        let deadline = Instant::now() + self.cfg.health_timeout.0;
        // A container that does not run (it never came back at `to`) is a failure of
        // the step like any other: undone, not left with `to`'s file.
        let found = async {
            let c = self.running_by(deadline).await?;
            let started = self.started_level(&c).await?;
            anyhow::Ok((c, started))
        };
        let (c, started) = match found.await {
            Ok(found) => found,
            Err(failure) => return self.undo(from, to, &previous, failure, readiness).await,
        };
        if self.levels.needs_restart(started, to) {
            tracing::info!(from = %from, to = %to, "k3s was not restarted with the level's flags yet: restarting it");
            return self.write_and_restart(from, to, previous, readiness).await;
        }
        tracing::info!(from = %from, to = %to, "k3s runs with the level's flags: waiting for it to serve");
        // k3s runs `to`: the file says so too (a reversed resume may find the new
        // level's file still there).
        if self.levels.needs_restart(self.file_level(), to) {
            self.rewrite(to).await?;
        }
        match self.serving(to, c.started_at, deadline, readiness).await {
            Ok(()) => Ok(()),
            Err(failure) => self.undo(from, to, &previous, failure, readiness).await,
        }
    }

    async fn roll_back(
        &mut self,
        from: Level,
        restarted: bool,
        readiness: &dyn NodeReadiness,
    ) -> anyhow::Result<String> {
        let (file, name) = (&self.cfg.level_file, &self.cfg.container);
        let path = file.display().to_string();
        if !restarted {
            write_level_file(file, format!("{from}\n").as_bytes())?;
            return Ok(format!("set the level file {path} back to {from}; container {name} was not restarted"));
        }
        // By name: no inspect between the look and the request.
        let write = restart::write(|| write_level_file(file, format!("{from}\n").as_bytes()));
        let asked = self.engine.restart(name, self.cfg.stop_timeout.0);
        let answer = restart::send(readiness, self.request(Purpose::Back, from, write), asked).await?;
        answer.with_context(|| format!("set the level file {path} back to {from}, but restarting container {name}"))?;
        Ok(format!("set the level file {path} back to {from} and restarted container {name} into it"))
    }

    async fn disagreement(&self) -> Option<String> {
        let started = self.started_level(&self.running_container().await.ok()?).await.ok()?;
        let file = self.file_level();
        self.levels.needs_restart(started, file).then(|| {
            format!(
                "container {} runs k3s with the flags of {started}, but the level file {} says {file}: \
                 the next restart of the container would change k3s's flags",
                self.cfg.container,
                self.cfg.level_file.display()
            )
        })
    }

    /// A level file whose flags k3s does not run with (regrade died between writing
    /// it and restarting, or someone edited it) is set to the level k3s runs at, so
    /// that a restart by anyone does not change the level behind the core's back. No
    /// restart here: the core steps from the level k3s runs at.
    async fn reconcile(&mut self, _readiness: &dyn NodeReadiness) -> anyhow::Result<()> {
        if self.disagreement().await.is_none() {
            return Ok(());
        }
        let level = self.current_level().await?;
        write_level_file(&self.cfg.level_file, format!("{level}\n").as_bytes())?;
        tracing::info!(level = %level, file = %self.cfg.level_file.display(), "level file set to the level k3s runs at");
        Ok(())
    }
}

/// Replaces the level file whole (see [`crate::fsutil`]); the entrypoint reads it at
/// every start of the container.
fn write_level_file(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    fsutil::write_atomic(path, bytes, 0o644, "level-file")
        .with_context(|| format!("writing level file {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn actuator(toml: &str) -> DockerActuator {
        let cfg = Config::parse(toml).unwrap();
        DockerActuator::new(&cfg.docker, &cfg.levels).unwrap()
    }

    #[test]
    fn the_level_follows_the_file_where_k3s_runs_its_flags() {
        let a = actuator("");
        // No restart between full and control-plane: the file says which.
        assert_eq!(a.level_from(Level::Full, Level::ControlPlane), Level::ControlPlane);
        assert_eq!(a.level_from(Level::ControlPlane, Level::Full), Level::Full);
        assert_eq!(a.level_from(Level::EtcdOnly, Level::EtcdOnly), Level::EtcdOnly);
        // A file k3s was never restarted into: the nearest level k3s's flags allow.
        assert_eq!(a.level_from(Level::Full, Level::EtcdOnly), Level::ControlPlane);
        assert_eq!(a.level_from(Level::EtcdOnly, Level::ControlPlane), Level::EtcdOnly);
        assert_eq!(a.level_from(Level::EtcdOnly, Level::Full), Level::EtcdOnly);
    }

    #[test]
    fn keys_are_named() {
        let e = |t: &str| format!("{:#}", Config::parse(t).unwrap_err());
        assert!(e("[docker]\ncontainer = \"\"\n").contains("docker.container"));
        assert!(e("[docker]\ncontainer = \"a/b\"\n").contains("docker.container"));
        assert!(e("[docker]\netcd_health_url = \"https://127.0.0.1:2381/health\"\n").contains("docker.etcd_health_url"));
        assert!(e("[docker]\nlevel_file = \"level\"\n").contains("docker.level_file"));
        assert!(e("[docker]\nhealth_timeout = \"0s\"\n").contains("docker.health_timeout"));
        assert!(e("[docker]\ncontainr = \"k3s\"\n").contains("containr"));
        let c = Config::parse("[docker]\ncontainer = \"k3s-server_1\"\nstop_timeout = \"10s\"\n").unwrap();
        assert_eq!(c.docker.stop_timeout.0, Duration::from_secs(10));
    }
}
