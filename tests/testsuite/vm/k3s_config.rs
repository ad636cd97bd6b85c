//! k3s's configuration as regrade reads it, on the VM lane's guest (issue 58): beside
//! the reservation packaging/ ships in config.yaml.d, a site drop-in read after it
//! that writes `kubelet-arg:` without `+` (the shipped reservation shadowed), then an
//! operator's 2 GiB in a file read before it (lowered by the shipped 768 MiB: the
//! kubelet keeps the last value) and moved after it as `kubelet-arg+` (in force).
//! `regrade status` must say each, naming the files; the k3s stand-in's report (the
//! kubelet's flags as k3s's agent builds them from every kubelet-arg,
//! /run/k3s-standin/flags.json) must agree at k3s's next start.
//!
//! Run by vm_power_cuts before its cells (the guest, its cluster and regrade.service
//! are up there already): the operator's 2 GiB stays through the cells, whose steps
//! restart k3s with regrade's own drop-in, and [`after_steps`] reads it back then: a
//! level's drop-in does not lower it.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

use super::guest::Guest;

const DIR: &str = "/etc/rancher/k3s/config.yaml.d";
/// packaging/k3s/40-regrade-reserved.yaml, installed as its header says.
const SHIPPED: &str = "40-regrade-reserved.yaml";
/// A site's drop-in, read after the shipped one.
const SITE: &str = "90-site.yaml";
/// An operator's file read before the shipped one.
const EARLY: &str = "10-operator.yaml";
const REPORT: &str = "/run/k3s-standin/flags.json";
const LONG: Duration = Duration::from_secs(120);
const OPERATORS: &str = "memory=2Gi";

/// The kubelet's flags in the stand-in's report: name, value as the kubelet ends with it.
type Kubelet = BTreeMap<String, String>;

/// The three cases, in order, each checked in `regrade status`; the first also in the
/// stand-in's report after a restart of k3s (the last one's is read after the cells by
/// [`after_steps`]); what was seen, a line each.
pub fn before_steps(g: &Guest) -> Result<Vec<String>, String> {
    let mut said = Vec::new();
    let shipped = std::fs::read_to_string(crate::common::three_servers::repo("packaging/k3s/40-regrade-reserved.yaml"))
        .map_err(|e| format!("packaging/k3s/40-regrade-reserved.yaml: {e}"))?;
    put(g, SHIPPED, &shipped)?;

    // A site file without `+`: every earlier kubelet-arg is dropped, the reservation too.
    put(g, SITE, "kubelet-arg:\n  - \"max-pods=110\"\n")?;
    let line = reserved_line(g)?;
    expect(&line, &["SHADOWED", SITE, SHIPPED], "a site drop-in's kubelet-arg without `+`")?;
    said.push(format!("shadowed: {line}"));
    let kubelet = restart_k3s(g)?;
    if kubelet.contains_key("system-reserved") || kubelet.get("max-pods").map(String::as_str) != Some("110") {
        return Err(format!("the stand-in's kubelet flags with the site file: {kubelet:?}, not max-pods=110 alone"));
    }
    said.push(format!("  the stand-in's kubelet after k3s's restart: {kubelet:?}"));

    // The operator's 2 GiB read before the shipped file: the kubelet keeps 768Mi.
    remove(g, SITE);
    put(g, EARLY, &format!("kubelet-arg+:\n  - \"system-reserved={OPERATORS}\"\n"))?;
    let line = reserved_line(g)?;
    expect(
        &line,
        &["LOWERED", EARLY, SHIPPED, OPERATORS, "memory=768Mi"],
        "an operator's 2 GiB before the shipped file",
    )?;
    said.push(format!("lowered: {line}"));

    // Moved after it, as `kubelet-arg+`: in force, and what the kubelet gets.
    remove(g, EARLY);
    put(g, SITE, &format!("kubelet-arg+:\n  - \"system-reserved={OPERATORS}\"\n"))?;
    let line = reserved_line(g)?;
    expect(&line, &["reserved memory: in place", OPERATORS, SITE], "the operator's 2 GiB after the shipped file")?;
    said.push(format!("in force: {line}"));
    // What the kubelet gets from it: read after the cells, whose steps restart k3s
    // (with regrade's drop-in at etcd-only), by [`after_steps`].
    Ok(said)
}

/// After the cells (k3s restarted by regrade's steps, with its level drop-in): the
/// operator's 2 GiB is still what the kubelet gets, and what status says.
pub fn after_steps(g: &Guest) -> Result<String, String> {
    let (_, kubelet) = report(g)?;
    expect_kubelet(&kubelet)?;
    let line = reserved_line(g)?;
    expect(&line, &["reserved memory: in place", OPERATORS, SITE], "after regrade's steps")?;
    let dropins = g.sh(&format!("ls {DIR}"), LONG);
    Ok(format!(
        "after the steps ({}): {line}; the stand-in's kubelet {kubelet:?}",
        dropins.split_whitespace().collect::<Vec<_>>().join(" ")
    ))
}

fn put(g: &Guest, name: &str, text: &str) -> Result<(), String> {
    let e = g.exec_input(&format!("cat > {DIR}/{name}"), Some(text.as_bytes()), LONG)?;
    if e.code != 0 {
        return Err(format!("writing {DIR}/{name}: exit {}: {}", e.code, e.err));
    }
    Ok(())
}

fn remove(g: &Guest, name: &str) {
    g.sh(&format!("rm -f {DIR}/{name}"), LONG);
}

/// `regrade status`'s reserved-memory line.
fn reserved_line(g: &Guest) -> Result<String, String> {
    let e = g.exec_input("regrade status 2>&1", None, LONG)?;
    e.out
        .lines()
        .find(|l| l.contains("reserved memory:"))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .ok_or_else(|| format!("`regrade status` (exit {}) says nothing of reserved memory:\n{}", e.code, e.out))
}

fn expect(line: &str, words: &[&str], case: &str) -> Result<(), String> {
    match words.iter().find(|w| !line.contains(**w)) {
        Some(w) => Err(format!("{case}: `regrade status` does not say {w:?}: {line}")),
        None => Ok(()),
    }
}

fn expect_kubelet(kubelet: &Kubelet) -> Result<(), String> {
    match kubelet.get("system-reserved") {
        Some(v) if v == OPERATORS => Ok(()),
        other => Err(format!("the stand-in's kubelet gets system-reserved {other:?}, not {OPERATORS}: {kubelet:?}")),
    }
}

/// The stand-in's report: its PID and the kubelet's flags.
fn report(g: &Guest) -> Result<(i64, Kubelet), String> {
    let text = g.sh(&format!("cat {REPORT}"), LONG);
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{REPORT}: {e}: {text}"))?;
    let pid = v["pid"].as_i64().ok_or_else(|| format!("{REPORT}: no pid"))?;
    let kubelet = v["kubelet"]
        .as_object()
        .ok_or_else(|| format!("{REPORT}: no kubelet flags (an older stand-in?)"))?
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
        .collect();
    Ok((pid, kubelet))
}

/// Restarts k3s.service (Type=notify: back once the new process says READY, its
/// report written before that) and returns the new process's kubelet flags.
fn restart_k3s(g: &Guest) -> Result<Kubelet, String> {
    let (before, _) = report(g)?;
    g.sh("systemctl restart k3s.service", Duration::from_secs(300));
    let (pid, kubelet) = report(g)?;
    if pid == before {
        return Err(format!("k3s restarted, but {REPORT} is still its old process's ({pid})"));
    }
    Ok(kubelet)
}
