#!/usr/bin/env bash
# mint-sa-kubeconfig.sh ADMIN_KUBECONFIG NAMESPACE SA OUT [--duration 1h]
# Creates NAMESPACE and ServiceAccount SA if missing, requests a token for it
# (TokenRequest API) and writes a kubeconfig using that token to OUT.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$("$here/build.sh" | tail -n1)"
exec "$bin/harness" mint-sa "$@"
