#!/usr/bin/env bash
# The alert rules against Debian's promtool: they parse (`check rules`) and their unit
# tests pass (`test rules`, deploy/prometheus/regrade-rules.test.yaml).
#
#   bash tests/prometheus/rules.sh
set -euo pipefail
cd "$(dirname "$0")/../../deploy/prometheus"
command -v promtool >/dev/null || { echo "tests/prometheus/rules.sh: promtool missing (apt-get install prometheus)" >&2; exit 1; }
promtool check rules regrade-rules.yaml
promtool test rules regrade-rules.test.yaml
