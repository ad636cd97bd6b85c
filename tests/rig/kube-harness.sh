#!/usr/bin/env bash
# Runs etcd + kube-apiserver on free 127.0.0.1 ports (see go/cmd/harness).
# First stdout line: the admin kubeconfig path. Runs until SIGTERM/SIGINT.
# Builds the binaries first if needed (build output goes to stderr).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$("$here/build.sh" | tail -n1)"
exec "$bin/harness" run --bin-dir "$bin" "$@"
