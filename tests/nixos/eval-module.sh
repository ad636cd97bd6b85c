#!/usr/bin/env bash
# eval-module.sh [NIXPKGS_LIB_CHECKOUT] [REGRADE_BINARY]
# Evaluates nixos/module.nix against the real nixpkgs `lib` (a checkout of
# nix-community/nixpkgs.lib, or of nixpkgs itself: the directory holding lib/), with stub
# NixOS options that follow nixpkgs' declarations (tests/nixos/eval-module.nix), and checks:
#   - an enabled server: no assertion fails; the settings, units, manifests it makes;
#   - a disabled server: k3s.service's definition is identical (no k3s restart), and its
#     pre-switch check is exactly what tests/nixos/pre-switch-check-test.sh runs;
#   - the README's example cluster (nixos/README-section.md) evaluates, with no warning;
#   - issue 15's items: the flake's module imported twice, a server without etcd, k3s's
#     nodeName, disableAgent, the firewall, a .yml drop-in;
#   - issue 42: the credential unit and its timer, the admission policy only with k3s >= 1.30;
#     the typed etcd, drain and metrics options; level_record, state_file and
#     systemd.record away from their defaults (sandbox, tmpfiles, switch-time check);
#   - each misconfiguration fails exactly its assertion (messages printed);
#   - with REGRADE_BINARY, the generated settings pass `regrade check-config`.
# nixpkgs cannot be downloaded on the project's machines, and its lib is never committed:
# without a lib checkout (argument or $NIXPKGS_LIB) every scenario is evaluated with
# tests/nixos/minilib.nix, a small implementation of the module system written for this.
# With one, both are run and must give the same JSON, so the stand-in is checked too.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
libdir="${1:-${NIXPKGS_LIB:-}}"
regrade="${2:-}"
if [ -n "$libdir" ] && [ ! -f "$libdir/lib/default.nix" ]; then
  echo "eval-module: $libdir has no lib/default.nix (a nixpkgs or nixpkgs.lib checkout)" >&2
  exit 1
fi
command -v nix-instantiate >/dev/null || { echo "eval-module: nix-instantiate missing (apt-get install -y nix-bin)" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
out="$tmp/eval.json"
# The README's example, as a user copies it, with the hardware files it names.
mkdir -p "$tmp/example/hardware"
python3 - "$here/../../nixos/README-section.md" "$tmp/example" <<'EXAMPLE'
import re, sys
text = open(sys.argv[1]).read()
block = re.search(r"```nix\n(.*?)```", text, re.S).group(1)
open(sys.argv[2] + "/flake.nix", "w").write(block)
for name in sorted(set(re.findall(r'"(k3s-\d+)"', block))):
    open(sys.argv[2] + "/hardware/%s.nix" % name, "w").write("{}\n")
EXAMPLE
evaluate() { # LIB_EXPRESSION OUT
  nix-instantiate --eval --strict --json "$here/eval-module.nix" \
    --arg lib "$1" --argstr tmp "$tmp/k3s" --argstr example "$tmp/example/flake.nix" >"$2"
}
if [ -n "$libdir" ]; then
  echo "eval-module: nixpkgs lib from $libdir, and tests/nixos/minilib.nix beside it"
  evaluate "import $libdir/lib" "$out"
  evaluate "import $here/minilib.nix" "$tmp/eval-minilib.json"
  if python3 -c 'import json, sys; sys.exit(json.load(open(sys.argv[1])) != json.load(open(sys.argv[2])))' "$out" "$tmp/eval-minilib.json"; then
    echo "ok   tests/nixos/minilib.nix evaluates every scenario to the same JSON as nixpkgs' lib"
  else
    echo "FAIL tests/nixos/minilib.nix and nixpkgs' lib disagree:"
    diff <(python3 -m json.tool --sort-keys "$out") <(python3 -m json.tool --sort-keys "$tmp/eval-minilib.json") | head -40 || true
    echo fail >"$tmp/minilib-result"
  fi
else
  echo "eval-module: no nixpkgs lib checkout (NIXPKGS_LIB); evaluating with tests/nixos/minilib.nix"
  evaluate "import $here/minilib.nix" "$out"
fi
# What the module renders must be what pre-switch-check-test.sh runs.
k="$tmp/k3s"
store="$(nix-instantiate --eval -E builtins.storeDir | tr -d '"')"
bash "$here/pre-switch-check-test.sh" --render "$k/config.yaml.d/50-regrade.yaml" "$k/started-level" "$k/state.json" \
  /var/lib/regrade/level.json "$k/switch-hold" 300 "$store/00000000000000000000000000000000-coreutils/bin" >"$tmp/rendered-check.txt" || true

python3 - "$out" "$tmp" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
tmp = sys.argv[2]
fail = []
def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        fail.append(what)

en, dis = d["enabled"], d["disabled"]
for rule, held in sorted(d["libSemantics"].items()):
    check(held is True, "module system: %s" % rule)
check(en["failingAssertions"] == [], "enabled server: no assertion fails")
check(dis["failingAssertions"] == [], "disabled server: no assertion fails")
check(d["k3sUnitUnchangedWhenDisabled"], "k3s.service is defined identically with regrade on and off")
p = d["protect"]
check(p["enabled"]["memoryLow"] == "512M" and p["enabled"]["sliceMemoryLow"] == "512M" and p["enabled"]["oomScoreAdjust"] == -999 and len(p["enabled"]["reserved"]) == 1,
      f"the static protections are on by default (k3s.service MemoryLow, system.slice MemoryLow, OOMScoreAdjust, the reserved-memory drop-in): {p['enabled']}")
check(p["disabled"] == p["enabled"], "the static protections stay with regrade off (k3s.service unchanged)")
check(p["off"] == {"memoryLow": None, "sliceMemoryLow": None, "oomScoreAdjust": None, "reserved": []}, f"each protection off with null: {p['off']}")
check(p["reservedText"].startswith("L+ ") and "/config.yaml.d/40-regrade-reserved.yaml" in p["reservedText"], f"the reserved-memory drop-in is linked into k3s's config.yaml.d: {p['reservedText']}")
check(p["pressureSource"] == {"reserved": "/sys/fs/cgroup/system.slice/memory.pressure", "unreserved": None, "set": "/proc/pressure/memory"},
      f"pressure.source: system.slice's while the pods are capped, regrade's default (null) without, the operator's when set: {p['pressureSource']}")
check(p["cgroupPsiWritable"][-1] == "-/sys/fs/cgroup/kubepods.slice/memory.pressure" and not any("system.slice" in w for w in p["cgroupPsiWritable"]),
      f"pressure.memory_cgroup read for PSI (no reservation): its memory.pressure writable for the trigger: {p['cgroupPsiWritable']}")
o = d["operatorReserves"]
for case in ["extraFlags", "extraFlagsString", "kubeletConfig"]:
    check(o[case] == {"reserved": [], "warned": True, "source": "/sys/fs/cgroup/system.slice/memory.pressure"},
          f"the host already reserves memory ({case}): regrade's reservation is not installed over it, a warning says so, the server's PSI is read: {o[case]}")
check(len(o["otherKubeletArg"]["reserved"]) == 1 and not o["otherKubeletArg"]["warned"],
      f"another kubelet-arg is no reservation: regrade's is installed: {o['otherKubeletArg']}")
for case, said in d["removedOptions"].items():
    check(said == [True], f"the removed option services.regrade.rbac.{case} fails saying what replaced it: {said}")
pre = en["units"]["k3s"]["serviceConfig"]["ExecStartPre"]
check(len(pre) == 1 and pre[0].startswith("-/nix/store/"), "k3s ExecStartPre is one '-'-prefixed hook: %s" % pre)
svc = en["units"]["regrade"]["serviceConfig"]
check(svc["Type"] == "notify" and svc["Restart"] == "always" and "WatchdogSec" in svc, "regrade.service: Type=notify, Restart=always, WatchdogSec")
check("ProcSubset" not in svc, "regrade.service: no ProcSubset (it would hide /proc/pressure)")
check(svc["ReadWritePaths"] == [tmp + "/k3s/config.yaml.d", tmp + "/k3s", "-/sys/fs/cgroup/system.slice/memory.pressure"],
      "regrade.service writes only the drop-in dir, the record dir and (the PSI trigger) system.slice's memory.pressure: %s" % svc["ReadWritePaths"])
check(svc.get("StateDirectory") == "regrade", "regrade.service has StateDirectory=regrade (cluster.endpoints_cache): %s" % svc.get("StateDirectory"))
check(svc.get("TimeoutStopSec") == "30min", "regrade.service: TimeoutStopSec=30min, a step finishes before SIGTERM is honoured")
check(svc.get("IOSchedulingClass") == "realtime", "regrade.service: IOSchedulingClass=realtime, ahead of the workloads for the disk: %s" % svc.get("IOSchedulingClass"))
check(svc.get("Nice") == -10, "regrade.service: Nice=-10, ahead of the workloads for a CPU: %s" % svc.get("Nice"))
for u in ["regrade", "regrade-credentials"]:
    check("k3s.service" in en["units"][u]["after"] and "k3s.service" not in en["units"][u]["wants"],
          "%s.service orders after k3s.service and never wants it (nothing of regrade's starts k3s): %s" % (u, en["units"][u]["wants"]))
check(set(en["manifests"]) == {"regrade-rbac", "regrade-admission-policy"}, "manifests: deploy/rbac.yaml and deploy/admission-policy.yaml")
check(en["settings"]["cluster"]["kubeconfig"] == "/var/lib/regrade/kubeconfig", "daemon uses the minted least-privilege kubeconfig")
cred = en["units"].get("regrade-credentials", {})
check(cred.get("serviceConfig", {}).get("ExecStart", "").endswith(
          "/bin/regrade --config /etc/regrade/regrade.toml credential --admin-kubeconfig /etc/rancher/k3s/k3s.yaml")
      and "RemainAfterExit" not in cred.get("serviceConfig", {}) and "regrade.service" in cred.get("before", []),
      "regrade-credentials.service mints this server's credential before regrade.service: %s" % cred.get("serviceConfig", {}).get("ExecStart"))
timer = en["credentialsTimer"] or {}
check(timer.get("timerConfig") == {"OnBootSec": "900s", "OnUnitActiveSec": "900s"} and timer.get("wantedBy") == ["timers.target"],
      "regrade-credentials.timer asks every 15 minutes (renewed by half of the 24h lifetime): %s" % timer)
check(en["settings"]["credential"] == {"lifetime": "24h", "renew_period": "900s"},
      "the lifetime and the timer's period are in the settings check-config reads: %s" % en["settings"].get("credential"))
path = en["credentialsPath"] or {}
check(path.get("pathConfig") == {"PathChanged": "/var/lib/regrade/kubeconfig.rejected"} and path.get("wantedBy") == ["paths.target"],
      "regrade-credentials.path starts the credential unit when watch notes a 401: %s" % path)
sl = d["shortLifetime"]
check(sl["failingAssertions"] == [] and sl["timer"] == {"OnBootSec": "150s", "OnUnitActiveSec": "150s"}
      and sl["settings"] == {"lifetime": "10m", "renew_period": "150s"},
      "credential.lifetime = 10m: the timer runs every quarter of it (150s), no gap: %s" % sl)
ap = d["admissionPolicy"]
check(ap["k3s129"]["manifests"] == ["regrade-rbac"] and len(ap["k3s129"]["warnings"]) == 1
      and "serves no ValidatingAdmissionPolicy" in ap["k3s129"]["warnings"][0],
      "k3s 1.29: the admission policy is not installed, and a warning says what that leaves")
print("       warning: " + (ap["k3s129"]["warnings"] or [""])[0])
for v in ["k3s130", "k3s133"]:
    check(ap[v]["manifests"] == ["regrade-admission-policy", "regrade-rbac"] and ap[v]["warnings"] == [],
          "%s: the admission policy is installed beside the RBAC, no warning: %s" % (v, ap[v]))
pe = d["pathsElsewhere"]
check(pe["readWritePaths"] == [tmp + "/k3s/config.yaml.d", "/srv/regrade-run", "/srv/regrade-state", "/srv/regrade", "-/sys/fs/cgroup/system.slice/memory.pressure"]
      and all("d %s 0755 root root -" % p in pe["tmpfiles"] for p in ["/srv/regrade-run", "/srv/regrade-state", "/srv/regrade"]),
      "level_record, state_file, systemd.record elsewhere: regrade.service may write each one's directory, made at boot: %s" % pe["readWritePaths"])
check(all(line in pe["preSwitchCheck"].splitlines() for line in [
          "regrade_record=/srv/regrade-run/started-level", "regrade_state=/srv/regrade-state/state.json",
          "regrade_level_record=/srv/regrade/level.json", "regrade_hold=/srv/regrade-state/switch-hold"]),
      "level_record, state_file, systemd.record elsewhere: the switch-time check reads them there")
check(d["adminKubeconfig"] == {"kubeconfig": "/etc/rancher/k3s/k3s.yaml", "credentialsUnit": False}, "kubeconfig option: admin credentials, no minting unit")
check(dis["preSwitchChecks"] and not en["preSwitchChecks"], "pre-switch check only in a configuration with regrade off")
rendered = open(tmp + "/rendered-check.txt").read()
check(dis["preSwitchChecks"].get("regrade-not-below-full") == rendered,
      "7. the module's pre-switch check is nixos/pre-switch-check.sh after its paths and hold (what pre-switch-check-test.sh runs)")
check(en["warnings"] == [], "enabled server with the k3s ports open: no warning")

# Issue 15, item by item.
check(d["importedTwice"] == {"evaluates": True, "failingAssertions": []},
      "1. nixosModules.default imported twice (profile + host file) evaluates: %s" % d["importedTwice"])
check(d["nodeName"] == {"setting": "k3s-a", "k3sFlag": True, "unset": False},
      "3. services.k3s.nodeName = k3s-a -> cluster.node_name = k3s-a (k3s runs --node-name=k3s-a); unset stays unset: %s" % d["nodeName"])
fwd = d["firewall"]
check(len(fwd["closed"]) == 1 and all(p in fwd["closed"][0] for p in ["6443/tcp", "2379/tcp", "2380/tcp", "10250/tcp", "8472/udp"]),
      "6. firewall on with k3s's ports closed: a warning names each: %s" % fwd["closed"])
check(fwd["open"] == [] and fwd["perInterface"] == [] and fwd["trusted"] == [],
      "6. ports open globally, per interface (a range too), or a trusted interface: no warning")
readme = d["readme"] or {}
check(sorted(readme) == ["k3s-1", "k3s-2", "k3s-3"], "6. the README's example cluster evaluates: %s" % sorted(readme))
for name, node in sorted(readme.items() if isinstance(readme, dict) else []):
    check(isinstance(node, dict) and node["failingAssertions"] == [] and node["warnings"] == []
          and {6443, 2379, 2380, 10250} <= set(node["firewall"]["allowedTCPPorts"]) and 8472 in node["firewall"]["allowedUDPPorts"],
          "6. README example %s: firewall opens k3s's ports (%s/tcp %s/udp), no assertion fails, no warning %s"
          % (name, node["firewall"]["allowedTCPPorts"], node["firewall"]["allowedUDPPorts"], node["failingAssertions"] + node["warnings"])
          if isinstance(node, dict) else (name, "-", "-", node))
check(d["ymlDropin"] == [], "8. a .yml drop-in (config.yaml.d/50-regrade.yml) is accepted: %s" % d["ymlDropin"])
r2 = d["roundTwo"]
check(r2["defaultKeys"] == {"etcd": False, "metrics": False, "drain": False, "firewallPorts": [2379, 2380, 6443, 10250]},
      "round 2: no etcd, metrics or drain key set unless asked, no port opened: %s" % r2["defaultKeys"])
check("etcd" not in en["settings"] and "metrics" not in en["settings"], "round 2: regrade.toml has no [etcd] or [metrics] table unless set")
check(r2["metrics"] == {"listen": "127.0.0.1:9559", "firewall": [2379, 2380, 6443, 9559, 10250], "listen6": "[::1]:9600", "firewall6": [2379, 2380, 6443, 10250]},
      "round 2: metrics.enable -> [metrics] listen = 127.0.0.1:9559, openFirewall opens 9559; ::1 -> [::1]:9600, closed: %s" % r2["metrics"])
tls = "/var/lib/rancher/k3s/server/tls/etcd/"
check(r2["etcd"]["sandbox"] == {"TemporaryFileSystem": ["/var/lib/rancher/k3s:ro"],
                                "BindReadOnlyPaths": ["-" + tls + f for f in ["server-ca.crt", "client.crt", "client.key"]]},
      "round 2: regrade.service sees k3s's etcd client certificates read-only, nothing else of k3s's data dir: %s" % r2["etcd"]["sandbox"])
check(r2["etcd"]["custom"] == {"endpoints": ["https://127.0.0.1:2379"], "key_file": "/etc/regrade/etcd.key"}
      and r2["etcd"]["customSandbox"][2] == "-/etc/regrade/etcd.key",
      "round 2: settings.etcd keys are written as set, and the sandbox follows key_file: %s" % r2["etcd"])
check(r2["etcd"]["dataDir"] == {"ca_file": "/srv/k3s/server/tls/etcd/server-ca.crt", "cert_file": "/srv/k3s/server/tls/etcd/client.crt", "key_file": "/srv/k3s/server/tls/etcd/client.key"}
      and r2["etcd"]["dataDirSandbox"]["TemporaryFileSystem"] == ["/srv/k3s:ro"],
      "round 2: k3sDataDir = /srv/k3s -> the etcd files under it are written and bound: %s" % r2["etcd"]["dataDir"])
check(r2["drain"] == {"drain": True, "drain_timeout": "3m", "on_drain_timeout": "delete"} and r2["badDrainRefused"],
      "round 2: levels.control-plane.{drain, drain_timeout, on_drain_timeout} typed; on_drain_timeout = \"wait\" is a type error")
for way, msgs in sorted(d["etcdWays"].items()):
    check(msgs == [], "2. a server with etcd by %s passes the no-etcd assertion: %s" % (way, msgs))
check(not dis["etc"] and "regrade" not in dis["units"], "regrade off: no config file, no regrade.service")

want = {
    "k3sOff": "services.k3s.enable",
    "agent": "role is \"agent\"",
    "noOtherServers": "apiServers is empty",
    "configPathInStore": "is in the Nix store",
    "configPathLiteral": "is a Nix path",
    "dropinElsewhere": "is not in",
    "dropinNotYaml": "must end in .yaml or .yml",
    "noEtcd": "runs no etcd",
    "disableAgent": "disableAgent = true",
    "credentialGap": "leaves a gap",
}
for case, needle in want.items():
    msgs = d["misconfigured"][case]
    check(isinstance(msgs, list) and len(msgs) == 1 and needle in msgs[0], "assertion %s fails alone" % case)
    for m in msgs if isinstance(msgs, list) else [msgs]:
        print("       message: " + m)

vm = d["vm"]
check(vm["server1"]["failingAssertions"] == [], "VM test server1 (three-servers.nix with vm-settings.toml): no assertion fails")
check(vm["server1"]["settings"]["cluster"]["api_servers"] == ["https://192.168.1.2:6443", "https://192.168.1.3:6443"], "VM test server1 reaches the two others")
check(vm["server2K3s"] == {"clusterInit": False, "serverAddr": "https://192.168.1.1:6443"}, "VM test server2 joins server1")
check(vm["specialisationOff"] == {"regradeUnit": False, "preSwitchCheck": True, "k3sUnchanged": True}, "VM test's no-regrade specialisation: no regrade.service, the check, k3s.service unchanged")


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise ValueError(v)
def toml(d, prefix=""):
    lines, tables = [], []
    for k, v in d.items():
        key = json.dumps(k)
        if isinstance(v, dict):
            tables.append((prefix + key, v))
        else:
            lines.append("%s = %s" % (key, toml_value(v)))
    for name, t in tables:
        lines.append("[%s]" % name)
        lines.append(toml(t, name + "."))
    return "\n".join(lines)
open(tmp + "/generated.toml", "w").write(toml(en["settings"]) + "\n")
open(tmp + "/vm-server1.toml", "w").write(toml(vm["server1"]["settings"]) + "\n")
import os
if os.path.exists(tmp + "/minilib-result"):
    fail.append("minilib")
open(tmp + "/result", "w").write("fail" if fail else "ok")
PY


# The pre-switch check itself runs in tests/nixos/pre-switch-check-test.sh (lint.sh runs
# it, with or without a lib checkout); above, its text was shown to be the module's.

if [ -n "$regrade" ]; then
  for f in generated vm-server1; do
    if "$regrade" --config "$tmp/$f.toml" check-config >"$tmp/check.out" 2>&1; then
      echo "ok   regrade check-config passes the module's settings ($f)"
    else
      echo "FAIL regrade check-config on the module's settings ($f):"; cat "$tmp/$f.toml" "$tmp/check.out"
      echo fail >"$tmp/result"
    fi
  done
fi

if [ "$(cat "$tmp/result")" != ok ]; then
  echo "eval-module: FAILED" >&2
  exit 1
fi
echo "eval-module: all checks passed"
