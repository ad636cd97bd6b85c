#!/bin/sh
# Writes this server's own least-privilege kubeconfig for the Compose setup: applies
# ../rbac.yaml (exactly the rights regrade uses, for the ServiceAccounts of the namespace
# regrade) and ../admission-policy.yaml (each server's credential may change only its own
# Node, and on it only regrade's marks; skipped with a warning where the cluster serves no
# ValidatingAdmissionPolicy), makes the ServiceAccount regrade/NODE, asks the API server
# for a token of it bound to the Node NODE, and writes a kubeconfig with it, the
# cluster's CA and API server URL, readable only by its owner.
#
#   ./regrade-kubeconfig.sh [OUT]        default OUT: ./regrade.kubeconfig
#
#   KUBECTL    how to run kubectl with admin rights; default: k3s's own kubectl in the
#              running k3s container, with its admin k3s.yaml
#              (`docker exec -i k3s kubectl`)
#   SERVER     the API server URL written to OUT; default: the one KUBECTL's kubeconfig
#              names (k3s.yaml: https://127.0.0.1:6443, which both containers reach on
#              the host's network)
#   NODE       the Node regrade steps (cluster.node_name; default server-1, as in
#              compose.yaml). Once it is registered, the token is bound to it.
#   DURATION   the token's lifetime (default 8760h: a year). Run this again before it
#              expires, then `docker restart regrade` (regrade reads the kubeconfig at
#              its first API call after a start). Where a k3s host runs regrade outside a
#              container, `regrade credential` does this from a timer instead.
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-./regrade.kubeconfig}"
kubectl="${KUBECTL:-docker exec -i k3s kubectl}"
duration="${DURATION:-8760h}"
node="${NODE:-server-1}"

# shellcheck disable=SC2086 # KUBECTL is a command line
kc() { $kubectl "$@"; }

kc apply -f - <"$here/../rbac.yaml" >&2
if ! kc apply -f - <"$here/../admission-policy.yaml" >&2; then
  echo "regrade-kubeconfig.sh: the admission policy was not installed (a cluster before Kubernetes 1.30 serves no ValidatingAdmissionPolicy): regrade's credential is bounded by its RBAC alone" >&2
fi
server="${SERVER:-$(kc config view --raw --minify --flatten -o 'jsonpath={.clusters[0].cluster.server}')}"
ca="$(kc config view --raw --minify --flatten -o 'jsonpath={.clusters[0].cluster.certificate-authority-data}')"
[ -n "$server" ] && [ -n "$ca" ] || { echo "regrade-kubeconfig.sh: no server URL or CA data in kubectl's kubeconfig" >&2; exit 1; }
kc -n regrade get serviceaccount "$node" >/dev/null 2>&1 || kc -n regrade create serviceaccount "$node" >&2
if uid="$(kc get node "$node" -o 'jsonpath={.metadata.uid}' 2>/dev/null)" && [ -n "$uid" ]; then
  bound="bound to Node $node"
  token="$(kc -n regrade create token "$node" --duration="$duration" \
    --bound-object-kind Node --bound-object-name "$node" --bound-object-uid "$uid")"
else
  # Before k3s's first start: the admission policy still reads the Node from the
  # ServiceAccount's name; run this again once the Node is there to bind the token too.
  bound="bound to no Node: Node $node is not registered yet"
  token="$(kc -n regrade create token "$node" --duration="$duration")"
fi

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
  - name: regrade/$node
    user:
      token: $token
contexts:
  - name: regrade
    context: {cluster: k3s, user: regrade/$node}
current-context: regrade
KUBECONFIG
mv -f "$tmp" "$out"
echo "regrade-kubeconfig.sh: wrote $out (ServiceAccount regrade/$node, $bound, $server, token for $duration)" >&2
