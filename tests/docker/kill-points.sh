#!/usr/bin/env bash
# The kill-point matrix (tests/testsuite/level_kill_points.rs) built with `docker`: regrade
# SIGKILLed, and SIGKILLed then dockerd restarted, at each kill point of both
# directions of a restart, against the Docker rig's real dockerd and a real
# kube-apiserver. tests/run starts it beside the systemd rig's tests, which share no
# address, port or file with it; so it builds in a target directory of its own (a
# `docker` build of regrade there, not over the one target/debug/regrade the systemd
# tests run), under the test cache, which tests/docker/run.sh shares. Its builds run
# niced: beside the tests in front they take only the cores those leave idle; the
# matrix itself runs at normal priority.
#   REGRADE_TEST_KUBE=1 REGRADE_TEST_DOCKER=1 tests/docker/kill-points.sh   (as root)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/../.."
cache="${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}"
REGRADE_STATIC_BIN="${REGRADE_STATIC_BIN:-$(nice -n 10 bash "$here/static.sh" | tail -n 1)}"
export REGRADE_STATIC_BIN CARGO_TARGET_DIR="$cache/target-docker"
nice -n 10 cargo test --locked --features docker --test testsuite --no-run
cargo test --locked --features docker --test testsuite -- level_kill_points:: --nocapture --test-threads=1
