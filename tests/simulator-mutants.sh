#!/usr/bin/env bash
# The simulator's mutation check: puts each fault a review found back into the code,
# one at a time, runs the simulator over SEEDS seeds (default 4000, the CI budget) and
# prints the first failing seed and the invariant it broke. Every fault must be found.
# Faults 1-6 are issue 23's; 7-10 issue 38's; 11 issue 55's. Since issue 55 every restart
# goes through src/actuator/restart.rs, so faults 5, 8 and 9 are put back there: the
# shape each fault had, on the one path every restart now takes. Edits src/ in place and restores it with
# git after each run, so it refuses to start with uncommitted changes under src/.
#
#   bash tests/simulator-mutants.sh            all eleven (up to 5 min a fault on 2 cores)
#   ONLY="7 9" SEEDS=3000 bash tests/simulator-mutants.sh
#   bash tests/simulator-mutants.sh --check    only that every mutation still applies to
#                                              the code (no build; CI runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
check=false
[ "${1:-}" = --check ] && check=true
seeds=${SEEDS:-4000}
missed=0
if $check; then
  # A scratch copy of src/, fresh for each fault: a mutation whose text is gone from
  # the code stops the check, naming the file and the text.
  scratch=$(mktemp -d /tmp/regrade-mutants.XXXXXX)
  trap 'rm -rf "$scratch"' EXIT
  fresh() { rm -rf "$scratch/src"; cp -r src "$scratch/src"; }
  fresh
  SRC="$scratch/src"
else
  if [ -n "$(git status --porcelain src/)" ]; then
    echo "simulator-mutants: src/ has uncommitted changes; commit or stash them first" >&2
    exit 1
  fi
  trap 'git checkout -q src/' EXIT
  SRC=src
fi
run() {
  local name=$1
  if $check; then
    echo "$name: applies"
    fresh
    return
  fi
  local t0=$(date +%s)
  out=$(REGRADE_SIM_SEEDS=$seeds RUST_BACKTRACE=0 cargo test -q --test testsuite simulator:: 2>&1 || true)
  first=$(echo "$out" | grep -oE "seed [0-9]+ \([0-9] servers\): .*VIOLATION [a-zA-Z ]+" | head -1 || true)
  [ -n "$first" ] || missed=$((missed + 1))
  echo "$name: ${first:-NOT FOUND in $seeds seeds} ($(( $(date +%s) - t0 )) s)"
  git checkout -q src/
}
mut() { python3 -c "
import sys; p,a,b=sys.argv[1:4]; s=open(p).read(); assert a in s, ('the mutation no longer applies', p, a); s=s.replace(a,b,1); open(p,'w').write(s)" "$SRC/${1#src/}" "$2" "$3"; }
# follow_hand_steps as it was before issue 23: a settled record adopted from memory,
# none decided again (faults 3 and 6 lived beside it).
old_follow_hand_steps() {
  mut src/watch/mod.rs "        if self.keeper.moved_on_disk() {
            self.decide_again();
        }
    }" "        let Some(r) = self.keeper.on_disk() else { return };
        if r.step.is_none() && r.level != self.keeper.level() && !matches!(self.pending, Pending::Resume(_)) {
            self.ticker.state.step_ran(self.origin.elapsed(), r.level);
            self.keeper.adopt(r);
            self.ticker.mark_dirty();
        }
    }"
}
only=" ${ONLY:-1 2 3 4 5 6 7 8 9 10 11} "
if [[ $only == *" 1 "* ]]; then
mut src/step.rs "        restart_allowed(self.cluster, self.gate).await" "        Ok(())"
run "1 the gate not asked at the moment of restart"; fi
if [[ $only == *" 2 "* ]]; then
mut src/level_record.rs "            s.phase = s.phase.max(phase);" "            s.phase = phase;"
run "2 the record's phase rewinds"; fi
if [[ $only == *" 3 "* ]]; then
mut src/watch/mod.rs "        if self.keeper.moved_on_disk() {
            self.decide_again();
        }
        let notifier" "        if !matches!(self.pending, Pending::Resume(_)) && self.keeper.moved_on_disk() {
            self.decide_again();
        }
        let notifier"
old_follow_hand_steps
run "3 a stale pending resume"; fi
if [[ $only == *" 4 "* ]]; then
mut src/watch/mod.rs "                Ok(Ok(_lock)) if self.keeper.moved_on_disk() => {" "                Ok(Ok(_lock)) if self.keeper.moved_on_disk() && self.keeper.on_disk().is_some_and(|r| r.step.is_none()) => {"
mut src/watch/mod.rs "        if self.keeper.moved_on_disk() {
            self.decide_again();
        }
    }" "        if self.keeper.moved_on_disk() && self.keeper.on_disk().is_some_and(|r| r.step.is_none()) {
            self.decide_again();
        }
    }"
mut src/step.rs "        apply(step, &mut *actuator, Tracked { cluster, keeper, clock: p.clock, gate: etcd }, levels, mode).await?;" "        let nogate = crate::etcd::NoRestartGate;
        let gate: &dyn RestartGate = if me.is_some() { etcd } else { &nogate };
        apply(step, &mut *actuator, Tracked { cluster, keeper, clock: p.clock, gate }, levels, mode).await?;"
run "4 a killed hand step ignored, its next step ungated"; fi
if [[ $only == *" 5 "* ]]; then
mut src/step.rs "    if phase == Phase::Applied {" "    if phase == Phase::Applied && false {"
mut src/step.rs "            let tracked = Tracked { cluster, keeper, clock, gate: etcd };" "            let tracked = Tracked { cluster, keeper, clock, gate: &crate::etcd::NoRestartGate };"
run "5 a deadline at applied restarts again, ungated"; fi
if [[ $only == *" 6 "* ]]; then
mut src/watch/mod.rs "        if self.keeper.moved_on_disk() {
            self.decide_again();
        }
        let notifier" "        if self.pending != Pending::Marks && self.keeper.moved_on_disk() {
            self.decide_again();
        }
        let notifier"
old_follow_hand_steps
run "6 pending marks from a stale level"; fi
if [[ $only == *" 7 "* ]]; then
# The gate asks only the local member: with it down, nothing can be asked.
mut src/etcd/gate.rs "        if !local_answered {" "        if false {"
run "7 the gate answerable only through the local member"; fi
if [[ $only == *" 8 "* ]]; then
mut src/actuator/restart.rs "    if let Err(no) = readiness.may_restart().await {" "    if let Err(no) = if purpose == Purpose::Back { Ok(()) } else { readiness.may_restart().await } {"
run "8 the undoing of a failed restart ungated"; fi
if [[ $only == *" 9 "* ]]; then
# The Lease looked at nowhere for a restart back: neither around the gate nor as the
# request's bound.
mut src/actuator/restart.rs "    let Some(bound) = readiness.restart_bound() else { return Ok(()) };" "    let Some(bound) = readiness.restart_bound().filter(|_| request.purpose == Purpose::Forward) else { return Ok(()) };"
mut src/step.rs "    lease_sure()?;
    if let Err(refusal)" "    if let Err(refusal)"
mut src/step.rs "        anyhow::bail!(\"the etcd gate refused the restart at the moment of it: {}\", refusal.message);
    }
    lease_sure()" "        anyhow::bail!(\"the etcd gate refused the restart at the moment of it: {}\", refusal.message);
    }
    let _ = lease_sure;
    Ok(())"
run "9 the rollback's restart past the Lease's safe bound"; fi
if [[ $only == *" 11 "* ]]; then
# Issue 55's shape: the look taken once, then I/O of unbounded length (the durable
# write) before the act, and no bound after it.
mut src/actuator/restart.rs "    if let Err(no) = readiness.may_restart().await {
        return Err(pending(no.context(format!(\"restarting {}: not allowed now\", request.what))));
    }
    within_bound(readiness, &request, wrote).map_err(|e| pending(e.into()))?;" ""
mut src/actuator/restart.rs "    within_bound(readiness, &request, false).map_err(|e| pending(e.into()))?;" ""
mut src/actuator/restart.rs "    // Not even the request fits before the bound: nothing is written." "    if let Err(no) = readiness.may_restart().await {
        return Err(pending(no.context(format!(\"restarting {}: not allowed now\", request.what))));
    }"
run "11 the look before the write, no bound after it (issue 55)"; fi
if [[ $only == *" 10 "* ]]; then
mut src/pressure.rs "        let mut up = dir.parent();" "        let mut up: Option<&Path> = None;"
run "10 a limit on an ancestor cgroup ignored"; fi
$check || [ "$missed" = 0 ] || { echo "simulator-mutants: $missed fault(s) not found" >&2; exit 1; }
