#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 15) and prints its executions;
# `--build` only builds them (tests/run builds and runs them in one background job beside the rig tests).
# Needs `cargo +nightly` and cargo-fuzz. The build lives outside the clone
# (${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}/fuzz-target) so CI reruns are quick.
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-15}
cache="${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}"
target_dir="$cache/fuzz-target"
mkdir -p "$target_dir"
# cargo-fuzz cannot pass --locked: check the lock file first, so a dependency added to
# the main crate without updating fuzz/Cargo.lock fails here instead of changing the clone.
cargo metadata --locked --format-version 1 >/dev/null ||
  { echo "fuzz: fuzz/Cargo.lock is out of date: run 'cargo update --workspace' in fuzz/ and commit it" >&2; exit 1; }
mapfile -t targets < <(cargo +nightly fuzz list)
cargo +nightly fuzz build --target-dir "$target_dir" >&2
[ "$secs" = --build ] && exit 0
for t in "${targets[@]}"; do
  log=$(mktemp)
  # Each target starts from an empty corpus in a temp dir: nothing is left in the clone.
  corpus=$(mktemp -d)
  if ! cargo +nightly fuzz run --target-dir "$target_dir" "$t" "$corpus" -- -max_total_time="$secs" -print_final_stats=1 >"$log" 2>&1; then
    tail -40 "$log"
    echo "fuzz: target $t FAILED" >&2
    exit 1
  fi
  execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' || true)
  [ -n "$execs" ] || execs=$(grep -oE '#[0-9]+' "$log" | tail -1 | tr -d '#')
  printf 'fuzz: %-20s %8s executions in %ss\n' "$t" "$execs" "$secs"
  rm -rf "$log" "$corpus"
done
