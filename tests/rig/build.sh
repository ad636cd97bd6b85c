#!/usr/bin/env bash
# Builds the Go test components for regrade's tests into a cache outside the repo:
#   kube-apiserver (k8s.io/kubernetes/cmd/kube-apiserver), kube-controller-manager,
#   kubectl, etcd, k3s-standin, kubelet-standin, harness
# all static (CGO_ENABLED=0). Skips what is already built. GOCACHE and GOMODCACHE
# live under the same cache so CI reruns are fast.
# Last stdout line: the bin dir. Progress goes to stderr.
#   REGRADE_TEST_CACHE  cache root (default $HOME/.cache/regrade-tests)
#   GO                  go binary (default: go on PATH, else /usr/local/go/bin/go)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mod="$here/go"
cache="${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}"
GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
[ -x "$GO" ] || { echo "build.sh: no go toolchain (set GO=...)" >&2; exit 1; }

export GOCACHE="$cache/gocache" GOMODCACHE="$cache/gomod" CGO_ENABLED=0 GOFLAGS=-mod=readonly
export GOTOOLCHAIN=local

k8s_ver="$(awk '$1=="k8s.io/kubernetes"{print $2; exit}' "$mod/go.mod")"
etcd_ver="$(awk '$1=="go.etcd.io/etcd/server/v3"{print $2; exit}' "$mod/go.mod")"
key="$( { "$GO" env GOVERSION; cat "$mod/go.mod" "$mod/go.sum"; } | sha256sum | cut -c1-12)"
bin="$cache/bin-k8s-$k8s_ver-etcd-$etcd_ver-$key"
mkdir -p "$bin"
# One build at a time per cache (tests may start several harnesses at once).
exec 9>"$cache/.build.lock"
flock 9

log() { echo "build.sh: $*" >&2; }
gobuild() { # OUT PKG [extra args]
  local out="$1" pkg="$2"; shift 2
  local t0=$SECONDS
  log "building $(basename "$out") from $pkg ..."
  (cd "$mod" && "$GO" build -trimpath -o "$out.tmp" "$@" "$pkg")
  mv -f "$out.tmp" "$out"
  log "built $(basename "$out") in $((SECONDS - t0))s"
}

minor="${k8s_ver#v1.}"; minor="${minor%%.*}"
vpkg=k8s.io/component-base/version
kver="-X $vpkg.gitVersion=$k8s_ver -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=$minor -X $vpkg.gitTreeState=clean -X $vpkg.buildDate=1970-01-01T00:00:00Z"

[ -x "$bin/kube-apiserver" ] || gobuild "$bin/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver -ldflags "-s -w $kver"
[ -x "$bin/kube-controller-manager" ] || gobuild "$bin/kube-controller-manager" k8s.io/kubernetes/cmd/kube-controller-manager -ldflags "-s -w $kver"
[ -x "$bin/kubectl" ]        || gobuild "$bin/kubectl" k8s.io/kubernetes/cmd/kubectl -ldflags "-s -w $kver"
[ -x "$bin/etcd" ]           || gobuild "$bin/etcd" ./cmd/etcd -ldflags "-s -w"

# The stand-ins and harness are this repo's code: rebuild when their source changes.
for cmd in k3s-standin kubelet-standin harness; do
  [ -d "$mod/cmd/$cmd" ] || continue
  src="$(cat "$mod/cmd/$cmd"/*.go "$mod"/internal/*/*.go | sha256sum | cut -c1-16)"
  if [ ! -x "$bin/$cmd" ] || [ "$(cat "$bin/.$cmd.src" 2>/dev/null)" != "$src" ]; then
    gobuild "$bin/$cmd" "./cmd/$cmd" -ldflags "-s -w"
    echo "$src" > "$bin/.$cmd.src"
  fi
done

echo "$bin"
