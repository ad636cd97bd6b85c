#!/usr/bin/env bash
# eval-module.sh [NIXPKGS_LIB_CHECKOUT] [REGRADE_BINARY]
# Evaluates nixos/module.nix against the real nixpkgs `lib` (a checkout of
# nix-community/nixpkgs.lib, or of nixpkgs itself: the directory holding lib/), with stub
# NixOS options (tests/nixos/eval-module.nix), and checks:
#   - an enabled server: no assertion fails; the settings, units, manifests it makes;
#   - a disabled server: k3s.service's definition is identical (no k3s restart), and the
#     pre-switch check refuses while below full, in bash, against real files;
#   - each misconfiguration fails exactly its assertion (messages printed);
#   - with REGRADE_BINARY, the generated settings pass `regrade check-config`.
# Without a lib checkout (argument or $NIXPKGS_LIB) it skips with a notice: nixpkgs
# cannot be downloaded on the project's machines, and the lib is never committed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
libdir="${1:-${NIXPKGS_LIB:-}}"
regrade="${2:-}"
if [ -z "$libdir" ] || [ ! -f "$libdir/lib/default.nix" ]; then
  echo "SKIP eval-module: no nixpkgs lib checkout given (argument or NIXPKGS_LIB=DIR with DIR/lib/default.nix)"
  exit 0
fi
command -v nix-instantiate >/dev/null || { echo "eval-module: nix-instantiate missing (apt-get install -y nix-bin)" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
out="$tmp/eval.json"
nix-instantiate --eval --strict --json "$here/eval-module.nix" \
  --arg lib "import $libdir/lib" --argstr tmp "$tmp/k3s" >"$out"

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
check(en["failingAssertions"] == [], "enabled server: no assertion fails")
check(dis["failingAssertions"] == [], "disabled server: no assertion fails")
check(d["k3sUnitUnchangedWhenDisabled"], "k3s.service is defined identically with regrade on and off")
pre = en["units"]["k3s"]["serviceConfig"]["ExecStartPre"]
check(len(pre) == 1 and pre[0].startswith("-/nix/store/"), "k3s ExecStartPre is one '-'-prefixed hook: %s" % pre)
svc = en["units"]["regrade"]["serviceConfig"]
check(svc["Type"] == "notify" and svc["Restart"] == "always" and "WatchdogSec" in svc, "regrade.service: Type=notify, Restart=always, WatchdogSec")
check("ProcSubset" not in svc, "regrade.service: no ProcSubset (it would hide /proc/pressure)")
check(svc["ReadWritePaths"] == [tmp + "/k3s/config.yaml.d", tmp + "/k3s"], "regrade.service writes only the drop-in dir and the record dir: %s" % svc["ReadWritePaths"])
check(svc.get("StateDirectory") == "regrade", "regrade.service has StateDirectory=regrade (cluster.endpoints_cache): %s" % svc.get("StateDirectory"))
check(svc.get("TimeoutStopSec") == "30min", "regrade.service: TimeoutStopSec=30min, a step finishes before SIGTERM is honoured")
check("k3s.service" in en["units"]["regrade"]["after"] and "k3s.service" in en["units"]["regrade"]["wants"], "regrade.service is after and wants k3s.service")
check(set(en["manifests"]) == {"regrade-rbac", "regrade-token"}, "manifests: deploy/rbac.yaml and the token Secret")
check(en["settings"]["cluster"]["kubeconfig"] == "/var/lib/regrade/kubeconfig", "daemon uses the minted least-privilege kubeconfig")
check("regrade-credentials" in en["units"], "regrade-credentials.service mints it")
check(d["adminKubeconfig"] == {"kubeconfig": "/etc/rancher/k3s/k3s.yaml", "credentialsUnit": False}, "kubeconfig option: admin credentials, no minting unit")
check(dis["preSwitchChecks"] and not en["preSwitchChecks"], "pre-switch check only in a configuration with regrade off")
check(not dis["etc"] and "regrade" not in dis["units"], "regrade off: no config file, no regrade.service")

want = {
    "k3sOff": "services.k3s.enable",
    "agent": "role is \"agent\"",
    "noOtherServers": "apiServers is empty",
    "configPathInStore": "is in the Nix store",
    "configPathLiteral": "is a Nix path",
    "dropinElsewhere": "is not in",
    "dropinNotYaml": "must end in .yaml",
}
for case, needle in want.items():
    msgs = d["misconfigured"][case]
    check(len(msgs) == 1 and needle in msgs[0], "assertion %s fails alone" % case)
    for m in msgs:
        print("       message: " + m)

vm = d["vm"]
check(vm["server1"]["failingAssertions"] == [], "VM test server1 (three-servers.nix with vm-settings.toml): no assertion fails")
check(vm["server1"]["settings"]["cluster"]["api_servers"] == ["https://192.168.1.2:6443", "https://192.168.1.3:6443"], "VM test server1 reaches the two others")
check(vm["server2K3s"] == {"clusterInit": False, "serverAddr": "https://192.168.1.1:6443"}, "VM test server2 joins server1")
check(vm["specialisationOff"] == {"regradeUnit": False, "preSwitchCheck": True, "k3sUnchanged": True}, "VM test's no-regrade specialisation: no regrade.service, the check, k3s.service unchanged")

open(tmp + "/precheck.sh", "w").write(dis["preSwitchChecks"]["regrade-not-below-full"])
open(tmp + "/credentials.sh", "w").write(en["credentialsScript"])

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
open(tmp + "/result", "w").write("fail" if fail else "ok")
PY

bash -n "$tmp/credentials.sh"
grep -q '^apiVersion: v1$' "$tmp/credentials.sh" && grep -q '^EOF$' "$tmp/credentials.sh"
echo "ok   regrade-credentials script: bash -n clean, kubeconfig heredoc unindented"

# The pre-switch check, run as switch-to-configuration runs it: in a subshell, with the
# new system's path and the action as arguments.
precheck() {
  local action="$1"
  (bash -c "set -e; ( $(cat "$tmp/precheck.sh") )" precheck /nix/store/new-system "$action") 2>"$tmp/precheck.err"
}
mkdir -p "$tmp/k3s/config.yaml.d"
expect() {
  local want="$1" what="$2" action="$3"
  if precheck "$action"; then got=pass; else got=refuse; fi
  if [ "$got" = "$want" ]; then echo "ok   pre-switch check ($action): $what -> $got"; else echo "FAIL pre-switch check ($action): $what -> $got, wanted $want"; echo fail >"$tmp/result"; fi
}
expect pass "no record, no drop-in" switch
echo full >"$tmp/k3s/started-level"
expect pass "record says full" switch
echo etcd-only >"$tmp/k3s/started-level"
expect refuse "record says etcd-only" switch
sed 's/^/       /' "$tmp/precheck.err"
expect refuse "record says etcd-only" boot
expect pass "record says etcd-only" dry-activate
echo full >"$tmp/k3s/started-level"
echo '{"pid":1,"level":"full","dry_run":false}' >"$tmp/k3s/state.json"
expect pass "record and daemon state say full" switch
echo '{"pid":1,"level":"control-plane","dry_run":false}' >"$tmp/k3s/state.json"
expect refuse "daemon state says control-plane (no restart, record says full)" switch
sed 's/^/       /' "$tmp/precheck.err"
echo '{"pid":1,"level":"full","dry_run":false}' >"$tmp/k3s/state.json"
echo 'disable-apiserver: true' >"$tmp/k3s/config.yaml.d/50-regrade.yaml"
expect refuse "drop-in in place" test

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
