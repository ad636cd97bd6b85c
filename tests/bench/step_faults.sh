#!/usr/bin/env bash
# Benchmark: does a step run from locked memory? regrade's major page faults during a
# step after the page cache was dropped, with its binary locked whole at start (now)
# and locked only on fault (before, REGRADE_TEST_TEXT_ON_FAULT=1), and what that costs.
#
# For each of the two, a `regrade watch --dry-run` on fixture pressure files:
#   1. starts calm and samples (every 200 ms, polling: a fixture has no trigger);
#   2. prints `Locked:` and `Rss:` of its binary's r-xp mapping (/proc/PID/smaps),
#      VmRSS and VmLck (/proc/PID/status);
#   3. drops the page cache (echo 3 > /proc/sys/vm/drop_caches), so any page of a file
#      it touches from now on that is not locked is read from disk: a major fault;
#   4. is made "over", steps down (the log's "would apply level"), is made calm,
#      steps up; majflt (field 12 of /proc/PID/stat) is read before and after each.
#
# A stand-in, said plainly: the dry-run step applies no level, so it runs the core,
# the step's sequencing and the dry-run actuator, not the D-Bus client, the etcd gate
# or a rollback. What it shows is the mechanism: with every page of the binary locked,
# no code path in it can fault, whichever it is; what remains are pages of the shared
# libraries (locked on fault) that a step would touch for the first time.
#
# Root (drop_caches; mlockall beyond RLIMIT_MEMLOCK). About 20 s.
#
#   bash tests/bench/step_faults.sh
#   REGRADE_BIN=path/to/regrade bash tests/bench/step_faults.sh
#   REGRADE_BENCH_STRICT=1 ...     exit 1 unless <= 10 major faults per step when locked
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "step_faults: needs root (drop_caches)" >&2; exit 1; }
bin=${REGRADE_BIN:-}
if [ -z "$bin" ]; then
  cargo build --release --quiet
  bin=target/release/regrade
fi
bin=$(readlink -f "$bin")

work=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT
calm='some avg10=0.00 avg60=0.00 avg300=0.00 total=0
full avg10=0.00 avg60=0.00 avg300=0.00 total=0'
over='some avg10=90.00 avg60=90.00 avg300=90.00 total=9
full avg10=50.00 avg60=50.00 avg300=50.00 total=9'
cat >"$work/regrade.toml" <<TOML
state_file = "$work/state.json"
level_record = "$work/level.json"
[pressure]
source = "$work/psi"
meminfo = "$work/meminfo"
mem_available_floor = "none"
sample_period = "200ms"
sustain = "400ms"
cooldown = "400ms"
[systemd]
record = "$work/started-level"
dropin = "$work/config.yaml.d/50-regrade.yaml"
TOML
printf 'MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n' >"$work/meminfo"
# The second stand-in: a real `watch` (systemd actuator, KubeCluster, the etcd gate)
# whose API server is a closed loopback port, so the step is refused at its preflight.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$work/kubeconfig" <<YAML
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:$port", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: not-a-token}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
YAML
{ cat "$work/regrade.toml"; printf '[cluster]\nkubeconfig = "%s"\nnode_name = "bench-1"\n' "$work/kubeconfig"; } \
  >"$work/regrade-act.toml"

majflt() { sed 's/.*) //' "/proc/$1/stat" | awk '{print $10}'; } # field 12 of the whole line
status_kb() { awk -v k="$2:" '$1==k {print $2}' "/proc/$1/status"; }
# "Locked Rss" of the binary's r-xp mapping, in kB.
text_kb() {
  awk -v exe="$bin" '
    /^[0-9a-f]+-[0-9a-f]+ / { inside = ($2 == "r-xp" && $6 == exe) }
    inside && $1 == "Rss:" { rss = $2 }
    inside && $1 == "Locked:" { lck = $2 }
    END { print lck + 0, rss + 0 }' "/proc/$1/smaps"
}
# Waits until the log has <n> lines matching <pattern> (the watch's own events), 30 s at most.
wait_log() {
  local i
  for i in $(seq 300); do
    [ "$(grep -c -- "$1" "$work/log" || true)" -ge "$2" ] && return 0
    kill -0 "$pid" 2>/dev/null || { echo "step_faults: watch died:"; cat "$work/log"; exit 1; }
    sleep 0.1
  done
  echo "step_faults: no \"$1\" in the log:"; cat "$work/log"; exit 1
}

run() { # <label> <env: 1 = on fault only> <mode: dry-run | act>
  printf '%s\n' "$calm" >"$work/psi"
  rm -f "$work/level.json" "$work/state.json"
  local cfg=regrade.toml args=(watch --dry-run) done_down="would apply level" n_up=2
  if [ "$3" = act ]; then cfg=regrade-act.toml args=(watch) done_down="step refused" n_up=0; fi
  env -u NOTIFY_SOCKET -u WATCHDOG_USEC REGRADE_TEST_TEXT_ON_FAULT="$2" RUST_LOG=info \
    "$bin" --config "$work/$cfg" "${args[@]}" >"$work/log" 2>&1 &
  pid=$!
  wait_log "regrade watch starting" 1
  # A few calm samples past start-up.
  local t0; t0=$(date +%s%N)
  while [ $(( ($(date +%s%N) - t0) / 1000000 )) -lt 1000 ]; do sleep 0.1; done
  read -r lck rss < <(text_kb "$pid")
  local vmrss vmlck; vmrss=$(status_kb "$pid" VmRSS); vmlck=$(status_kb "$pid" VmLck)
  sync; echo 3 >/proc/sys/vm/drop_caches
  local f0 f1 f2; f0=$(majflt "$pid")
  printf '%s\n' "$over" >"$work/psi"
  wait_log "$done_down" 1
  f1=$(majflt "$pid")
  f2=$f1
  if [ "$n_up" -gt 0 ]; then
    printf '%s\n' "$calm" >"$work/psi"
    wait_log "$done_down" "$n_up"
    f2=$(majflt "$pid")
  fi
  read -r lck2 rss2 < <(text_kb "$pid")
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
  printf '%-34s %9s %9s %9s %9s %10s %8s\n' "$1" "$lck" "$rss" "$vmrss" "$vmlck" "$((f1 - f0))" "$((f2 - f1))"
  echo "$((f1 - f0)) $((f2 - f1))" >"$work/faults-$2-$3"
}

size=$(stat -c %s "$bin")
echo "binary $bin, $((size / 1024)) kB; r-xp Locked/Rss and VmRSS/VmLck in kB after start; majflt per step after drop_caches"
printf '%-34s %9s %9s %9s %9s %10s %8s\n' "" "Locked" "Rss" "VmRSS" "VmLck" "majflt down" "up"
run "dry-run step, on fault (before)" 1 dry-run
run "dry-run step, whole binary (now)" 0 dry-run
run "refused step, on fault (before)" 1 act
run "refused step, whole binary (now)" 0 act
echo "(refused step: a real watch whose API server is a closed port; the step goes as far as its preflight; no step up)"
ok=1
for f in "$work"/faults-0-*; do
  read -r down up <"$f"
  [ "$down" -le 10 ] && [ "$up" -le 10 ] || ok=0
done
if [ "$ok" = 1 ]; then
  echo "target: <= 10 major faults per step, both stand-ins, binary locked whole: met"
else
  echo "target: <= 10 major faults per step, both stand-ins, binary locked whole: MISSED"
  [ "${REGRADE_BENCH_STRICT:-0}" = 1 ] && exit 1
fi
