//! systemd's D-Bus API (org.freedesktop.systemd1) on the system bus: restart a unit
//! and watch its ActiveState and InvocationID. The bus address comes from
//! `DBUS_SYSTEM_BUS_ADDRESS` when set (tests reach a container's bus this way).

use std::collections::HashMap;

use anyhow::Context;
use zbus::{Connection, OwnedObjectPath, OwnedVariant};

const SYSTEMD: &str = "org.freedesktop.systemd1";
const MANAGER_PATH: &str = "/org/freedesktop/systemd1";
const MANAGER: &str = "org.freedesktop.systemd1.Manager";
const UNIT: &str = "org.freedesktop.systemd1.Unit";

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

pub struct Systemd {
    conn: Connection,
    unit: String,
}

impl Systemd {
    pub async fn connect(unit: &str) -> anyhow::Result<Systemd> {
        let conn = Connection::system().await.context(
            "connecting to the system bus (DBUS_SYSTEM_BUS_ADDRESS, else /run/dbus/system_bus_socket) to reach systemd",
        )?;
        Ok(Systemd { conn, unit: unit.to_string() })
    }

    async fn manager_call<B, R>(&self, method: &str, body: &B) -> zbus::Result<R>
    where
        B: serde::Serialize + zbus::DynamicType,
        R: for<'d> zbus::wire::DynamicDeserialize<'d>,
    {
        let reply = self.conn.call_method(Some(SYSTEMD), MANAGER_PATH, Some(MANAGER), method, body).await?;
        reply.body().deserialize()
    }

    /// One property, read fresh with org.freedesktop.DBus.Properties.Get.
    async fn property<T>(&self, path: &OwnedObjectPath, interface: &str, name: &str) -> anyhow::Result<T>
    where
        T: TryFrom<OwnedVariant>,
        T::Error: Into<zbus::Error>,
    {
        let reply = self
            .conn
            .call_method(
                Some(SYSTEMD),
                path.as_str(),
                Some("org.freedesktop.DBus.Properties"),
                "Get",
                &(interface, name),
            )
            .await
            .with_context(|| format!("reading {}'s {name}", self.unit))?;
        let value: OwnedVariant = reply.body().deserialize()?;
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
        let reply = self
            .conn
            .call_method(Some(SYSTEMD), path.as_str(), Some("org.freedesktop.DBus.Properties"), "GetAll", &(UNIT,))
            .await
            .with_context(|| format!("reading {}'s properties", self.unit))?;
        let mut all: HashMap<String, OwnedVariant> =
            reply.body().deserialize().with_context(|| format!("reading {}'s properties", self.unit))?;
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

    /// The service's `Result` (e.g. "exit-code"), for an error message.
    pub async fn result(&self) -> String {
        let read = async {
            let path = self.unit_path().await?;
            self.property::<String>(&path, "org.freedesktop.systemd1.Service", "Result").await
        };
        read.await.unwrap_or_else(|e| format!("unknown ({e:#})"))
    }

    /// Queues a restart and returns at once: the job is not waited on (k3s without
    /// its API server signals READY only once another server's API answers, and
    /// k3s units may have `TimeoutStartSec=0`).
    pub async fn restart(&self) -> anyhow::Result<()> {
        let _job: OwnedObjectPath = self
            .manager_call("RestartUnit", &(self.unit.as_str(), "replace"))
            .await
            .with_context(|| format!("systemd RestartUnit({}, replace)", self.unit))?;
        Ok(())
    }
}
