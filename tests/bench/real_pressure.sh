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
# Calm: the first samples, a fresh trigger's one or two early fires and their 10 s of
# sampling, then asleep on the trigger.
sleep 25
tail -n1 "$work/watch.log" | grep -q 'pacing=trigger' || { echo "watch is not asleep on its trigger:"; cat "$work/watch.log"; exit 1; }

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

# The fmt layer starts each line with an RFC 3339 time; times below are from the thrash's start.
python3 - "$work/watch.log" "$start" <<'PY'
import datetime, re, sys
start = float(sys.argv[2])
rows = []
for line in open(sys.argv[1]):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line).rstrip()
    try:
        t = datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()
    except (ValueError, IndexError):
        continue
    rows.append((t - start, line))
print("== watch's log from 2 s before the thrash (samples, fires, decisions):")
for dt, line in rows:
    if dt >= -2:
        print("%+7.2fs  %s" % (dt, line.split(None, 1)[1][:200]))
fire = next((dt for dt, l in rows if dt >= 0 and "trigger fired" in l), None)
if fire is None:
    print("RESULT: the trigger never fired"); sys.exit(1)
first = next((dt for dt, l in rows if dt >= fire and " sample " in l + " "), None)
over = next((dt for dt, l in rows if dt >= 0 and "decision=over" in l.lower()), None)
done = next((dt for dt, l in rows if dt >= 0 and "step done" in l), None)
print("RESULT: trigger fired %.2f s into the thrash; first sample %.3f s after the fire" % (fire, first - fire))
if done is None:
    print("RESULT: no step within the thrash (PSI under the threshold?)"); sys.exit(1)
print("RESULT: first over sample %.1f s into the thrash; dry-run step down at %.1f s (%.1f s of over)" % (over, done, done - over))
PY
