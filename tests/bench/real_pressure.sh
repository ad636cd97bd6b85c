#!/usr/bin/env bash
# Benchmark (not a test, not in tests/run): real memory stall on this host, and what a
# dry-run `regrade watch` on the real /proc/pressure/memory does about it.
#
# A cgroup v1 memory cgroup limited to 200 MiB reads random pages of a 600 MiB file
# through mmap: the page cache it may keep is a third of the file, so most reads wait
# for the disk, and the whole machine's /proc/pressure/memory shows the stall
# (some_avg10 went from 0 to about 20 % in 25 s here) while MemAvailable stays high.
# With the default mem_available_floor that is rightly "neither"; this run sets
# mem_available_floor = "none" so that PSI alone decides, and shows:
#   1. watch asleep on its PSI trigger while the host is calm,
#   2. the trigger firing once the stall starts, and the first sample within a second,
#   3. a dry-run step down after `sustain` of over samples.
#
# It stalls the whole machine's memory: it takes the rig lock, runs at most about
# two minutes, and cleans up its cgroup and file. Root, cgroup v1 memory controller.
#
#   bash tests/bench/real_pressure.sh        (takes /tmp/regrade-rig.lock itself)
set -euo pipefail
cd "$(dirname "$0")/../.."
threshold=${REGRADE_BENCH_THRESHOLD:-10}
sustain=${REGRADE_BENCH_SUSTAIN:-20s}
cg=/sys/fs/cgroup/memory/regrade-bench-$$
[ -d /sys/fs/cgroup/memory ] || { echo "needs the cgroup v1 memory controller at /sys/fs/cgroup/memory"; exit 1; }
[ "$(id -u)" = 0 ] || { echo "needs root (to make a cgroup)"; exit 1; }

exec 9>/tmp/regrade-rig.lock
flock 9

cargo build --release --quiet
bin=target/release/regrade
# On disk, not tmpfs: tmpfs pages are shared memory that the limit could not evict.
work=$(mktemp -d /var/tmp/regrade-bench.XXXXXX)
cleanup() {
  kill $(jobs -p) 2>/dev/null || true
  if [ -d "$cg" ]; then
    while read -r p; do kill -9 "$p" 2>/dev/null || true; done <"$cg/cgroup.procs"
    sleep 0.5
    rmdir "$cg" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

cat >"$work/regrade.toml" <<TOML
state_file = "$work/state.json"
[pressure]
threshold = $threshold
mem_available_floor = "none"
sample_period = "5s"
sustain = "$sustain"
[systemd]
record = "$work/started-level"
dropin = "$work/config.yaml.d/50-regrade.yaml"
TOML

echo "== writing a 600 MiB file, dropping it from the page cache"
dd if=/dev/urandom of="$work/big" bs=1M count=600 status=none
sync
echo 1 >/proc/sys/vm/drop_caches
mkdir "$cg"
echo $((200 << 20)) >"$cg/memory.limit_in_bytes"

echo "== regrade watch --dry-run on /proc/pressure/memory (threshold $threshold, floor none, sustain $sustain)"
env -u NOTIFY_SOCKET -u WATCHDOG_USEC REGRADE_LOG=debug \
  "$bin" --config "$work/regrade.toml" watch --dry-run 2>"$work/watch.log" &
wpid=$!
sleep 8 # calm: the first samples, then asleep on the trigger
grep -q 'mode=trigger\|PSI trigger armed' "$work/watch.log" || { echo "watch did not arm its trigger:"; cat "$work/watch.log"; exit 1; }

echo "== thrashing inside $cg (200 MiB limit) for up to 90 s"
start=$(date +%s.%N)
(
  echo $BASHPID >"$cg/cgroup.procs"
  exec timeout 90 python3 -c '
import mmap, os, random, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
pages = len(m) // 4096
while True:
    m[random.randrange(pages) * 4096]
' "$work/big"
) &
tpid=$!

# Until the dry-run step, or 90 s.
for _ in $(seq 1 180); do
  grep -q 'step done' "$work/watch.log" && break
  kill -0 $tpid 2>/dev/null || break
  sleep 0.5
done
kill $tpid 2>/dev/null || true
sleep 1
kill $wpid; wait $wpid 2>/dev/null || true

# Strips ANSI colour; the fmt layer starts each line with an RFC 3339 time.
sed 's/\x1b\[[0-9;]*m//g' "$work/watch.log" >"$work/plain.log"
echo "== watch's log from the thrash on (samples and decisions):"
awk -v s="$start" '{print}' "$work/plain.log" | grep -E 'trigger|stepping|step done|refused|sample' |
  awk -v start="$start" '
    { cmd = "date -d " $1 " +%s.%N"; cmd | getline t; close(cmd); if (t + 0 >= start - 0.5) printf "%+7.2fs  %s\n", t - start, $0 }' |
  cut -c1-220 | grep -v 'decision=Calm' | head -40
fire=$(grep -m1 'trigger fired' "$work/plain.log" | awk '{print $1}')
[ -n "$fire" ] || { echo "RESULT: the trigger never fired"; exit 1; }
first=$(awk -v f="$fire" '$1 >= f && /sample/ {print $1; exit}' "$work/plain.log")
ft=$(date -d "$fire" +%s.%N); st=$(date -d "$first" +%s.%N)
awk -v s="$start" -v f="$ft" -v x="$st" 'BEGIN {
  printf "RESULT: trigger fired %.2f s into the thrash; first sample %.3f s after the fire\n", f - s, x - f }'
if grep -q 'step done' "$work/plain.log"; then
  d=$(grep -m1 'step done' "$work/plain.log" | awk '{print $1}')
  o=$(grep -m1 'decision=Over' "$work/plain.log" | awk '{print $1}')
  awk -v s="$start" -v d="$(date -d "$d" +%s.%N)" -v o="$(date -d "$o" +%s.%N)" 'BEGIN {
    printf "RESULT: first over sample %.1f s into the thrash; dry-run step down %.1f s into it (%.1f s of over)\n", o - s, d - s, d - o }'
else
  echo "RESULT: no step within the thrash (PSI stayed under threshold $threshold?)"
  exit 1
fi
