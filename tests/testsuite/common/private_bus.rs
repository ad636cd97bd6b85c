//! A private D-Bus for the systemd actuator's stall tests: the real broker
//! (Debian's `dbus-daemon`) on a socket of the test's own, and peers that own
//! `org.freedesktop.systemd1` on it as a stalled PID 1 would: one that never
//! answers, and one that answers until it is asked to restart the unit and then
//! never again (a restart job that wedges systemd). Needs dbus-daemon; no root.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct Bus(Child);

impl Drop for Bus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a private bus listening at `dir/bus`; its address.
pub fn private_bus(dir: &Path) -> (Bus, String) {
    let socket = dir.join("bus");
    let conf = dir.join("bus.conf");
    std::fs::write(
        &conf,
        format!(
            r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>custom</type>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
"#,
            socket.display()
        ),
    )
    .unwrap();
    let child = Command::new("dbus-daemon")
        .arg(format!("--config-file={}", conf.display()))
        .args(["--nofork", "--nopidfile"])
        .stdout(Stdio::null())
        .spawn()
        .expect("dbus-daemon (Debian package dbus) must be installed");
    let bus = Bus(child);
    let t0 = Instant::now();
    while !socket.exists() {
        assert!(t0.elapsed() < Duration::from_secs(10), "dbus-daemon did not listen at {}", socket.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    (bus, format!("unix:path={}", socket.display()))
}

/// A peer that owns org.freedesktop.systemd1 and then never reads its socket: its
/// connection's tasks live on a runtime nobody drives any more, so every call to
/// "systemd" waits for an answer that never comes.
pub fn silent_systemd(address: &str) {
    let (tx, rx) = std::sync::mpsc::channel();
    let address = address.to_string();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let conn = rt.block_on(async {
            zbus::connection::Builder::address(address.as_str()).name("org.freedesktop.systemd1").build().await.unwrap()
        });
        tx.send(()).unwrap();
        let _keep = (rt, conn);
        loop {
            std::thread::park();
        }
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("the silent peer took the name");
}

/// A peer that owns org.freedesktop.systemd1 and answers as systemd does for one
/// running unit (LoadUnit, Properties.GetAll; no ExecStart to read) until it gets
/// RestartUnit: that call and every one after it are never answered. Counts the
/// RestartUnit calls it got.
pub fn stalling_systemd(address: &str) -> Arc<AtomicUsize> {
    let restarts = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = std::sync::mpsc::channel();
    let (address, counted) = (address.to_string(), restarts.clone());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let conn = zbus::connection::Builder::address(address.as_str())
                .name("org.freedesktop.systemd1")
                .build()
                .await
                .unwrap();
            tx.send(()).unwrap();
            let mut calls = zbus::MessageStream::from(&conn);
            while let Some(Ok(msg)) = futures_util::StreamExt::next(&mut calls).await {
                let h = msg.header();
                if h.message_type() != zbus::message::Type::MethodCall {
                    continue;
                }
                let member = h.member().map(|m| m.to_string()).unwrap_or_default();
                if member == "RestartUnit" {
                    counted.fetch_add(1, Ordering::SeqCst);
                }
                if counted.load(Ordering::SeqCst) > 0 {
                    continue; // wedged: no answer, ever
                }
                let _ = match member.as_str() {
                    "LoadUnit" => {
                        let path = zbus::ObjectPath::try_from("/org/freedesktop/systemd1/unit/k3s_2eservice");
                        conn.reply(&h, &path.unwrap()).await
                    }
                    "GetAll" => {
                        let mut all = std::collections::HashMap::<&str, zbus::Variant>::new();
                        all.insert("ActiveState", "active".into());
                        all.insert("SubState", "running".into());
                        all.insert("InvocationID", zbus::Variant::from(vec![1u8; 16]));
                        conn.reply(&h, &all).await
                    }
                    _ => conn.reply_error(&h, "org.freedesktop.DBus.Error.UnknownProperty", &"not here").await,
                };
            }
        });
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("the stalling peer took the name");
    restarts
}
