#!/usr/bin/env bash
# Runs the Docker tests against a real dockerd and stops that dockerd after:
#   - the static regrade build, with `file` and `ldd` of it (static.sh);
#   - the Docker actuator tests (tests/testsuite/docker_actuator.rs) and the feature
#     check (tests/testsuite/docker_build.rs);
#   (tests/run runs the kill-point matrix against the Docker actuator beforehand:
#   kill-points.sh here);
#   - the Compose example brought up end to end with docker-compose (compose.sh).
#   REGRADE_TEST_DOCKER=1 tests/docker/run.sh    (as root)
# Extra arguments go to the test binary in place of its two modules' filters (e.g. a
# test's name: docker_actuator::NAME). The test binary built with `docker` is
# kill-points.sh's, in the cache's target directory: built once for both, and
# target/debug/regrade stays the default build the other tests run.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/../.."
trap 'bash "$here/rig.sh" down' EXIT
t0=$SECONDS
REGRADE_STATIC_BIN="$(bash "$here/static.sh" | tail -n 1)"
export REGRADE_STATIC_BIN
echo "run.sh: static build and checks took $((SECONDS - t0)) s" >&2
# The tests start the rig themselves (rig.sh up, once per process).
filters=(docker_actuator:: docker_build::)
[ $# = 0 ] || filters=("$@")
REGRADE_TEST_DOCKER="${REGRADE_TEST_DOCKER:-1}" \
  CARGO_TARGET_DIR="${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}/target-docker" \
  cargo test --locked --no-fail-fast --features docker \
  --test testsuite -- --test-threads=1 "${filters[@]}"
REGRADE_TEST_DOCKER="${REGRADE_TEST_DOCKER:-1}" bash "$here/compose.sh"
echo "run.sh: the Docker tests took $((SECONDS - t0)) s" >&2
