#!/usr/bin/env bash
# Benchmark (not a test): the metrics listener under load (issue 25). On loopback,
# `regrade watch --dry-run` with `[metrics] listen` set, polling every second on
# fixture files (a PSI reading between the calm and the over threshold, so watch
# samples every sample_period instead of sleeping on a PSI trigger). First a calm
# phase (a scrape of /metrics a second, a /healthz probe every 100 ms), then the load:
# 1,000 connections that open and send nothing and 200 that send a request head a
# byte a second (each reopened a second after the server closes it), beside the same
# scraper and probes (run from a process of their own, apart from the load's). Prints /healthz latency (max, p99; each probe within 100 ms?),
# scrapes complete (ok/total), whether watch's samples stayed on time (timed by the
# STATUS= datagram it sends at each sample to NOTIFY_SOCKET, bound here), and VmRSS
# under load against the calm phase (target within 1 MiB). Nothing fails on the
# figures (a noisy 2-core machine must not flake CI).
#
#   bash tests/bench/metrics_load.sh [LOAD_SECONDS]   (default 45, after 12 s calm)
#   REGRADE_BIN=path/to/regrade ...                   (another build; default: release)
#   REGRADE_BENCH_IDLE=1000 REGRADE_BENCH_SLOW=200    (the load)
set -euo pipefail
cd "$(dirname "$0")/../.."
load=${1:-45}
calm=${REGRADE_BENCH_CALM:-12}
bin=${REGRADE_BIN:-}
if [ -z "$bin" ]; then
  cargo build --release --quiet
  bin=target/release/regrade
fi
# 1,200 client sockets in one process, beside the shell's own.
ulimit -n 8192

work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
printf 'some avg10=20.00 avg60=20.00 avg300=20.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n' >"$work/psi"
printf 'MemTotal:        8000000 kB\nMemFree:         4000000 kB\nMemAvailable:    6000000 kB\n' >"$work/meminfo"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$work/regrade.toml" <<TOML
state_file = "$work/state.json"
[pressure]
source = "$work/psi"
meminfo = "$work/meminfo"
threshold = 40.0
calm_threshold = 10.0
sample_period = "1s"
[systemd]
record = "$work/started-level"
dropin = "$work/config.yaml.d/50-regrade.yaml"
[metrics]
listen = "127.0.0.1:$port"
TOML
"$bin" --config "$work/regrade.toml" check-config >/dev/null

env -u WATCHDOG_USEC -u WATCHDOG_PID NOTIFY_SOCKET="$work/notify" \
  "$bin" --config "$work/regrade.toml" watch --dry-run 2>"$work/regrade.log" &
rpid=$!
python3 tests/bench/metrics_load.py "$port" "$work/notify" "$rpid" "$calm" "$load" 1 ||
  { echo "metrics_load: the load script failed; watch's log:" >&2; cat "$work/regrade.log" >&2; exit 1; }
kill -0 $rpid 2>/dev/null || { echo "metrics_load: watch died:" >&2; cat "$work/regrade.log" >&2; exit 1; }
# A listener stuck in a loop would also keep watch from its SIGTERM: that fails the run.
kill $rpid
for _ in $(seq 100); do kill -0 $rpid 2>/dev/null || break; sleep 0.1; done
if kill -0 $rpid 2>/dev/null; then
  echo "metrics_load: watch did not stop within 10 s of SIGTERM" >&2
  kill -9 $rpid
  exit 1
fi
wait $rpid 2>/dev/null || true
