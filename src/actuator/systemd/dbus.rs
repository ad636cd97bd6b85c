//! systemd's D-Bus API (org.freedesktop.systemd1) on the system bus: restart a unit
//! and watch its ActiveState and InvocationID. The bus address comes from
//! `DBUS_SYSTEM_BUS_ADDRESS` when set (tests reach a container's bus this way).
//!
//! Every call is bounded: zbus sets no timeout of its own, and PID 1 or the bus broker
//! stalling is likely under the very memory pressure regrade reacts to. A call that
//! fails transiently (no reply in time, the broker busy, systemd re-executing) is
//! tried again a few times within the same bound before the caller sees an error, so
//! a hiccup of the bus does not undo a restart that went well.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;
use zbus::{Connection, OwnedObjectPath, OwnedVariant};

const SYSTEMD: &str = "org.freedesktop.systemd1";
const MANAGER_PATH: &str = "/org/freedesktop/systemd1";
const MANAGER: &str = "org.freedesktop.systemd1.Manager";
const UNIT: &str = "org.freedesktop.systemd1.Unit";
const PROPERTIES: &str = "org.freedesktop.DBus.Properties";
const SERVICE: &str = "org.freedesktop.systemd1.Service";

/// What a unit is doing now, read fresh (never from a property cache).
#[derive(Debug, Clone, PartialEq)]
pub struct UnitState {
    pub active: String,
    pub sub: String,
    /// systemd's id of the current run of the unit: a new one means a new start.
    pub invocation: Vec<u8>,
}

impl UnitState {
    /// The unit is down, for good or waiting for `Restart=` to try again: the start
    /// it was asked for failed.
    pub fn start_failed(&self) -> bool {
        matches!(self.active.as_str(), "failed" | "inactive") || self.sub == "auto-restart"
    }
}

impl std::fmt::Display for UnitState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ActiveState={} SubState={}", self.active, self.sub)
    }
}

/// A service's static protections as systemd has them (`MemoryLow=`, `MemoryMin=`:
/// bytes, 0 unset; `OOMScoreAdjust=`), its main process and its cgroup.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitProtection {
    pub memory_low: u64,
    pub memory_min: u64,
    pub oom_score_adjust: i32,
    pub main_pid: u32,
    /// The cgroup's path below the cgroup root, e.g. `/system.slice/k3s.service`.
    pub control_group: String,
}

/// The longest RestartUnit's reply is waited for (less where `systemd.call_timeout` is
/// less): the restart's request must reach systemd before the Lease's safe bound
/// (`actuator::restart`), so its own bound is short enough to fit the safe window of
/// a short Lease too; a reply later than that is judged a lost one, by what follows.
pub const RESTART_REPLY_TIMEOUT: Duration = Duration::from_secs(2);

/// How long RestartUnit's reply is waited for with `call_timeout` configured.
pub fn restart_timeout(call_timeout: Duration) -> Duration {
    call_timeout.min(RESTART_REPLY_TIMEOUT)
}

/// How many times a call that failed transiently is made in all.
const ATTEMPTS: u32 = 3;

/// Whether a failed call may succeed when made again: no answer in time, the broker
/// or systemd busy or restarting. A definite answer (no such unit, access denied, a
/// bad argument) is not tried again.
pub fn is_transient(e: &zbus::Error) -> bool {
    match e {
        zbus::Error::InputOutput(_) => true,
        zbus::Error::MethodError(name, _, _) => matches!(
            name.as_str(),
            "org.freedesktop.DBus.Error.NoReply"
                | "org.freedesktop.DBus.Error.Timeout"
                | "org.freedesktop.DBus.Error.TimedOut"
                | "org.freedesktop.DBus.Error.ServiceUnknown"
                | "org.freedesktop.DBus.Error.NameHasNoOwner"
                | "org.freedesktop.DBus.Error.Disconnected"
                | "org.freedesktop.DBus.Error.LimitsExceeded"
        ),
        _ => false,
    }
}

pub struct Systemd {
    conn: Connection,
    unit: String,
    timeout: Duration,
}

impl Systemd {
    /// Connects to the system bus within `timeout`, which bounds every call made on
    /// it too. The connection is made as zbus makes it by default and bounded from
    /// outside: with zbus's own method timeout set on the builder, connecting from
    /// inside a k3s server's unit never completed in the end-to-end test.
    pub async fn connect(unit: &str, timeout: Duration) -> anyhow::Result<Systemd> {
        const WHAT: &str =
            "connecting to the system bus (DBUS_SYSTEM_BUS_ADDRESS, else /run/dbus/system_bus_socket) to reach systemd";
        let conn = tokio::time::timeout(timeout, Connection::system())
            .await
            .map_err(|_| {
                anyhow::anyhow!("{WHAT}: the bus did not answer within {}", crate::units::format_duration(timeout))
            })?
            .context(WHAT)?;
        Ok(Systemd { conn, unit: unit.to_string(), timeout })
    }

    /// One method call to systemd, each attempt bounded by the timeout, transient
    /// failures tried again (see [`is_transient`]).
    async fn call<B, R>(&self, path: &str, interface: &str, method: &str, body: &B) -> zbus::Result<R>
    where
        B: serde::Serialize + zbus::DynamicType,
        R: for<'d> zbus::wire::DynamicDeserialize<'d>,
    {
        let mut attempt = 1;
        loop {
            let once = async {
                let reply = self.conn.call_method(Some(SYSTEMD), path, Some(interface), method, body).await?;
                reply.body().deserialize()
            };
            let result = match tokio::time::timeout(self.timeout, once).await {
                Ok(r) => r,
                Err(_) => Err(zbus::Error::InputOutput(std::sync::Arc::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("systemd did not answer {method} within {}", crate::units::format_duration(self.timeout)),
                )))),
            };
            match result {
                Err(e) if attempt < ATTEMPTS && is_transient(&e) => {
                    tracing::warn!(method, attempt, error = %e, "a call to systemd failed transiently; trying again");
                    tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await;
                    attempt += 1;
                }
                r => return r,
            }
        }
    }

    async fn manager_call<B, R>(&self, method: &str, body: &B) -> zbus::Result<R>
    where
        B: serde::Serialize + zbus::DynamicType,
        R: for<'d> zbus::wire::DynamicDeserialize<'d>,
    {
        self.call(MANAGER_PATH, MANAGER, method, body).await
    }

    /// One property, read fresh with org.freedesktop.DBus.Properties.Get.
    async fn property<T>(&self, path: &OwnedObjectPath, interface: &str, name: &str) -> anyhow::Result<T>
    where
        T: TryFrom<OwnedVariant>,
        T::Error: Into<zbus::Error>,
    {
        let value: OwnedVariant = self
            .call(path.as_str(), PROPERTIES, "Get", &(interface, name))
            .await
            .with_context(|| format!("reading {}'s {name}", self.unit))?;
        T::try_from(value).map_err(|e| anyhow::anyhow!("{}'s {name}: {}", self.unit, e.into()))
    }

    /// The unit's object path. `LoadUnit` rather than `GetUnit`: it answers for a unit
    /// that is not loaded yet too.
    async fn unit_path(&self) -> anyhow::Result<OwnedObjectPath> {
        self.manager_call("LoadUnit", &(self.unit.as_str(),))
            .await
            .with_context(|| format!("systemd LoadUnit({})", self.unit))
    }

    /// ActiveState, SubState and InvocationID from one `Properties.GetAll`: systemd
    /// answers it from one moment of its state, where three `Get`s could straddle the
    /// stop→start gap of a restart job and mix them (inactive with the new run's
    /// InvocationID, which reads as a start that failed).
    pub async fn state(&self) -> anyhow::Result<UnitState> {
        let path = self.unit_path().await?;
        let mut all: HashMap<String, OwnedVariant> = self
            .call(path.as_str(), PROPERTIES, "GetAll", &(UNIT,))
            .await
            .with_context(|| format!("reading {}'s properties", self.unit))?;
        Ok(UnitState {
            active: self.take(&mut all, "ActiveState")?,
            sub: self.take(&mut all, "SubState")?,
            invocation: self.take(&mut all, "InvocationID")?,
        })
    }

    fn take<T>(&self, all: &mut HashMap<String, OwnedVariant>, name: &str) -> anyhow::Result<T>
    where
        T: TryFrom<OwnedVariant>,
        T::Error: Into<zbus::Error>,
    {
        let value = all.remove(name).with_context(|| format!("{}'s properties lack {name}", self.unit))?;
        T::try_from(value).map_err(|e| anyhow::anyhow!("{}'s {name}: {}", self.unit, e.into()))
    }

    /// The service's memory protection, OOM score and main process, from one
    /// `Properties.GetAll` (`regrade status`, "protections").
    pub async fn protection(&self) -> anyhow::Result<UnitProtection> {
        let path = self.unit_path().await?;
        let mut all: HashMap<String, OwnedVariant> = self
            .call(path.as_str(), PROPERTIES, "GetAll", &(SERVICE,))
            .await
            .with_context(|| format!("reading {}'s properties", self.unit))?;
        Ok(UnitProtection {
            memory_low: self.take(&mut all, "MemoryLow")?,
            memory_min: self.take(&mut all, "MemoryMin")?,
            oom_score_adjust: self.take(&mut all, "OOMScoreAdjust")?,
            main_pid: self.take(&mut all, "MainPID")?,
            control_group: self.take(&mut all, "ControlGroup")?,
        })
    }

    /// The command lines of the unit's `ExecStart=` (argv of each), to see which flags
    /// k3s gets on its command line.
    pub async fn exec_start(&self) -> anyhow::Result<Vec<Vec<String>>> {
        type ExecCommand = (String, Vec<String>, bool, u64, u64, u64, u64, u32, i32, i32);
        let path = self.unit_path().await?;
        let commands: Vec<ExecCommand> = self.property(&path, "org.freedesktop.systemd1.Service", "ExecStart").await?;
        Ok(commands.into_iter().map(|c| c.1).collect())
    }

    /// How the unit starts k3s, for reading k3s's configuration as k3s will: the first
    /// `ExecStart=` command line, `Environment=`, and the `EnvironmentFile=`s' variables
    /// (a missing `-`-prefixed file has none). A unit with no ExecStart (not loaded)
    /// gives no command line.
    pub async fn invocation(&self) -> anyhow::Result<crate::k3s_config::Invocation> {
        let argv = self.exec_start().await?.into_iter().next();
        let path = self.unit_path().await?;
        // EnvironmentFile= overrides Environment= (systemd.exec(5)); the last one counts.
        let vars: Vec<String> = self.property(&path, SERVICE, "Environment").await?;
        let mut env: Vec<(String, String)> =
            vars.iter().filter_map(|v| v.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let files: Vec<(String, bool)> = self.property(&path, SERVICE, "EnvironmentFiles").await?;
        for (file, optional) in files {
            match std::fs::read_to_string(&file) {
                Ok(text) => env.extend(crate::k3s_config::environment_file(&text)),
                Err(e) if optional && e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e).with_context(|| format!("reading {}'s EnvironmentFile {file}", self.unit)),
            }
        }
        Ok(crate::k3s_config::Invocation { argv, env })
    }

    /// The service's `Result` (e.g. "exit-code"), for an error message.
    pub async fn result(&self) -> String {
        let read = async {
            let path = self.unit_path().await?;
            self.property::<String>(&path, "org.freedesktop.systemd1.Service", "Result").await
        };
        read.await.unwrap_or_else(|e| format!("unknown ({e:#})"))
    }

    /// Queues a restart and returns at once: the job is not waited on (k3s without
    /// its API server may signal READY before the Node is Ready, and k3s units may have
    /// `TimeoutStartSec=0`). A lost reply is not an error: the request may have reached
    /// systemd, so the caller judges by what it then observes (a new InvocationID or
    /// none within its deadline) rather than asking twice and restarting k3s twice.
    pub async fn restart(&self) -> anyhow::Result<()> {
        let body = &(self.unit.as_str(), "replace");
        let once = self.conn.call_method(Some(SYSTEMD), MANAGER_PATH, Some(MANAGER), "RestartUnit", body);
        match tokio::time::timeout(restart_timeout(self.timeout), once).await {
            Ok(Ok(_job)) => Ok(()),
            Ok(Err(e)) if !is_lost_reply(&e) => {
                Err(e).with_context(|| format!("systemd RestartUnit({}, replace)", self.unit))
            }
            Ok(Err(e)) => {
                tracing::warn!(unit = %self.unit, error = %e, "RestartUnit's reply was lost; judging by what follows");
                Ok(())
            }
            Err(_) => {
                tracing::warn!(unit = %self.unit, "RestartUnit got no reply in time; judging by what follows");
                Ok(())
            }
        }
    }
}

/// A call whose request may have been carried out although no answer came.
fn is_lost_reply(e: &zbus::Error) -> bool {
    match e {
        zbus::Error::InputOutput(_) => true,
        zbus::Error::MethodError(name, _, _) => {
            matches!(name.as_str(), "org.freedesktop.DBus.Error.NoReply" | "org.freedesktop.DBus.Error.Timeout")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn method_error(name: &str) -> zbus::Error {
        zbus::Error::MethodError(
            zbus::names::OwnedErrorName::try_from(name).unwrap(),
            None,
            zbus::message::Message::method_call("/", "x").build(&()).unwrap(),
        )
    }

    #[test]
    fn transient_errors_are_tried_again_and_definite_answers_are_not() {
        let io = zbus::Error::InputOutput(std::sync::Arc::new(std::io::Error::from(std::io::ErrorKind::TimedOut)));
        assert!(is_transient(&io));
        assert!(is_transient(&method_error("org.freedesktop.DBus.Error.NoReply")));
        assert!(is_transient(&method_error("org.freedesktop.DBus.Error.ServiceUnknown")));
        assert!(!is_transient(&method_error("org.freedesktop.systemd1.NoSuchUnit")));
        assert!(!is_transient(&method_error("org.freedesktop.DBus.Error.AccessDenied")));
        assert!(is_lost_reply(&io));
        assert!(!is_lost_reply(&method_error("org.freedesktop.DBus.Error.ServiceUnknown")));
    }
}
