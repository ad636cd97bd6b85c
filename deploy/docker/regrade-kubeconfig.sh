#!/bin/sh
# Writes regrade's least-privilege kubeconfig for the Compose setup: applies
# ../rbac.yaml (ServiceAccount kube-system/regrade and exactly the rights regrade
# uses), asks the API server for a token for that ServiceAccount and writes a
# kubeconfig with it, the cluster's CA and API server URL, readable only by its owner.
#
#   ./regrade-kubeconfig.sh [OUT]        default OUT: ./regrade.kubeconfig
#
#   KUBECTL    how to run kubectl with admin rights; default: k3s's own kubectl in the
#              running k3s container, with its admin k3s.yaml
#              (`docker exec -i k3s kubectl`)
#   SERVER     the API server URL written to OUT; default: the one KUBECTL's kubeconfig
#              names (k3s.yaml: https://127.0.0.1:6443, which both containers reach on
#              the host's network)
#   DURATION   the token's lifetime (default 8760h: a year). The token is bound to the
#              ServiceAccount: run this again before it expires, then
#              `docker restart regrade` (regrade reads the kubeconfig at its first API
#              call after a start).
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-./regrade.kubeconfig}"
kubectl="${KUBECTL:-docker exec -i k3s kubectl}"
duration="${DURATION:-8760h}"

# shellcheck disable=SC2086 # KUBECTL is a command line
kc() { $kubectl "$@"; }

kc apply -f - <"$here/../rbac.yaml" >&2
server="${SERVER:-$(kc config view --raw --minify --flatten -o 'jsonpath={.clusters[0].cluster.server}')}"
ca="$(kc config view --raw --minify --flatten -o 'jsonpath={.clusters[0].cluster.certificate-authority-data}')"
[ -n "$server" ] && [ -n "$ca" ] || { echo "regrade-kubeconfig.sh: no server URL or CA data in kubectl's kubeconfig" >&2; exit 1; }
token="$(kc -n kube-system create token regrade --duration="$duration")"

umask 077
tmp="$out.tmp.$$"
cat >"$tmp" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters:
  - name: k3s
    cluster:
      server: $server
      certificate-authority-data: $ca
users:
  - name: regrade
    user:
      token: $token
contexts:
  - name: regrade
    context: {cluster: k3s, user: regrade}
current-context: regrade
KUBECONFIG
mv -f "$tmp" "$out"
echo "regrade-kubeconfig.sh: wrote $out (ServiceAccount kube-system/regrade, $server, token for $duration)" >&2
