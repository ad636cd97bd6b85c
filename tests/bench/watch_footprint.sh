#!/usr/bin/env bash
# Benchmark (not a test): the resident memory (VmRSS), locked memory (VmLck) and CPU
# per sample of `regrade watch --dry-run` on fixture pressure files, beside earlyoom
# (Debian's) run the same way on the same machine. Prints figures; asserts nothing
# about time, which on a noisy 2-core machine would only flake.
#
# Target (issue 2): VmRSS at most 8 MiB, VmLck above zero when run as root.
# Target (issue 14): with `[metrics] listen` set and scraped once a second, VmRSS
# within 0.5 MiB of the run without it.
#
#   bash tests/bench/watch_footprint.sh [SECONDS]      (default 20)
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-20}
period_ms=100

if ! command -v earlyoom >/dev/null; then
  apt-get install -y earlyoom >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y earlyoom >/dev/null; }
fi
# REGRADE_BIN: measure that binary instead of building this tree's (an older build, to
# compare before and after).
if [ -n "${REGRADE_BIN:-}" ]; then
  bin=$REGRADE_BIN
else
  cargo build --release --quiet
  bin=target/release/regrade
fi

work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
# Calm values: the steady state of a healthy server, the case to keep cheap.
printf 'some avg10=0.50 avg60=0.40 avg300=0.30 total=1000\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=10\n' >"$work/psi"
grep -v MemAvailable /proc/meminfo >"$work/meminfo"; echo "MemAvailable: 8000000 kB" >>"$work/meminfo"
cat >"$work/regrade.toml" <<TOML
state_file = "$work/state.json"
[pressure]
source = "$work/psi"
meminfo = "$work/meminfo"
sample_period = "${period_ms}ms"
sustain = "1s"
[systemd]
record = "$work/started-level"
dropin = "$work/config.yaml.d/50-regrade.yaml"
TOML

# field <pid> <name> from /proc/<pid>/status, in kB
field() { awk -v k="$2:" '$1==k {print $2}' "/proc/$1/status"; }
# CPU time of <pid>'s threads in ns (schedstat: finer than the 10 ms ticks of /proc/<pid>/stat)
cpuns() { cat /proc/"$1"/task/*/schedstat | awk '{s += $1} END {print s}'; }

measure() { # name pid samples-per-second
  local name=$1 pid=$2 rate=$3
  sleep 2 # past start-up
  local t0 c0 t1 c1
  t0=$(date +%s.%N); c0=$(cpuns "$pid")
  sleep "$secs"
  t1=$(date +%s.%N); c1=$(cpuns "$pid")
  awk -v n="$name" -v rss="$(field "$pid" VmRSS)" -v hwm="$(field "$pid" VmHWM)" -v lck="$(field "$pid" VmLck)" \
      -v c0="$c0" -v c1="$c1" -v t0="$t0" -v t1="$t1" -v rate="$rate" 'BEGIN {
    cpu = (c1 - c0) / 1e9; wall = t1 - t0; samples = wall * rate;
    printf "%-22s VmRSS %6.2f MiB  VmHWM %6.2f MiB  VmLck %6.2f MiB  CPU %5.2f%%  CPU/sample %7.1f us (%d samples)\n",
      n, rss/1024, hwm/1024, lck/1024, 100*cpu/wall, 1e6*cpu/samples, samples }'
}

"$bin" --config "$work/regrade.toml" watch --dry-run 2>"$work/regrade.log" &
rpid=$!
measure "regrade watch" $rpid $((1000 / period_ms))
kill $rpid; wait $rpid 2>/dev/null || true

# The same with the metrics listener on a free loopback port, scraped once a second
# (as Prometheus would, faster than its usual 15-60 s) while measuring.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
{ cat "$work/regrade.toml"; printf '[metrics]\nlisten = "127.0.0.1:%s"\n' "$port"; } >"$work/regrade-metrics.toml"
if ! "$bin" --config "$work/regrade-metrics.toml" check-config >/dev/null 2>&1; then
  echo "regrade watch+metrics  skipped: $bin has no [metrics] (a build from before issue 14)"
else
  "$bin" --config "$work/regrade-metrics.toml" watch --dry-run 2>"$work/regrade-metrics.log" &
  mpid=$!
  ( sleep 1; while kill -0 $mpid 2>/dev/null; do curl -sf "http://127.0.0.1:$port/metrics" >/dev/null || true; sleep 1; done ) &
  measure "regrade watch+metrics" $mpid $((1000 / period_ms))
  curl -sf "http://127.0.0.1:$port/metrics" | grep -q '^regrade_level{level="full"} 1$' ||
    { echo "watch_footprint: the metrics listener did not answer" >&2; exit 1; }
  kill $mpid; wait $mpid 2>/dev/null || true
fi

# earlyoom reads the real /proc/meminfo (it has no fixture option) and polls at most
# 10 times a second when memory is plentiful; -m 1 -s 1 keeps it from acting and
# --dryrun from killing. Its per-sample figure assumes that 10/s ceiling.
earlyoom -m 1 -s 1 --dryrun -r 3600 >"$work/earlyoom.log" 2>&1 &
epid=$!
measure "earlyoom (Debian)" $epid 10
kill $epid; wait $epid 2>/dev/null || true

[ "$(id -u)" = 0 ] || echo "note: not root, so regrade could not lock its memory (VmLck 0 expected)"
grep -i "mlockall" "$work/regrade.log" || true
