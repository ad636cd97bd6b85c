#!/usr/bin/env bash
# Runs the Docker actuator tests against a real dockerd and stops that dockerd after.
#   REGRADE_TEST_DOCKER=1 tests/docker/run.sh    (as root)
# Extra arguments go to the test binary (e.g. a test name).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/../.."
trap 'bash "$here/rig.sh" down' EXIT
# The tests start the rig themselves (rig.sh up, once per process).
REGRADE_TEST_DOCKER="${REGRADE_TEST_DOCKER:-1}" cargo test --locked --no-fail-fast --features docker \
  --test docker_actuator --test docker_build -- --test-threads=1 "$@"
