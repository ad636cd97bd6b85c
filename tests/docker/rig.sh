#!/usr/bin/env bash
# The Docker rig for regrade's Docker tests (tests/testsuite/docker_actuator.rs, compose.sh).
#
#   rig.sh up               install docker.io and docker-compose, start our own dockerd
#                           if it is not running, build the static regrade
#                           (static.sh, unless REGRADE_STATIC_BIN names it) and the
#                           images; prints `socket=...`,
#                           `image=...`, `k3s_image=...`, `regrade_image=...` on stdout
#   rig.sh restart-dockerd  stop and start that dockerd (containers with a restart
#                           policy come back through their entrypoint)
#   rig.sh down             stop that dockerd (state stays cached)
#
# The dockerd is this rig's own: --bridge=none (no private-range network is made),
# --iptables=false, and its own data-root, exec-root, pidfile and socket under
# ${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}/docker, so it collides with no
# other engine. Containers use --network host with loopback addresses only.
#
# The images are the ones deploy/docker/README.md documents, built by `docker build`
# from deploy/docker/k3s.Dockerfile and deploy/docker/regrade.Dockerfile with the
# static regrade (no registry is reachable, so nothing is pulled):
#   - k3s.Dockerfile's base, rancher/k3s, is replaced (build arg K3S_IMAGE) by
#     regrade-test/k3s-base: `docker import` of a directory holding the static k3s
#     stand-in as /bin/k3s (tests/rig/build.sh) and busybox-static as /bin/cat (the
#     actuator reads the started-level record with `cat`, as rancher/k3s has cat),
#     with rancher/k3s's ENTRYPOINT ["/bin/k3s"]. Neither it nor the result has a C
#     library.
#   - regrade.Dockerfile is FROM scratch: nothing to replace.
# The k3s image is tagged regrade-test/k3s:latest (the actuator tests) and
# local/k3s-regrade:v1.33.5-k3s1, the regrade image local/regrade:docker: the names
# deploy/docker/compose.yaml uses.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}"
state="$cache/docker"
sock="$state/docker.sock"
pidfile="$state/dockerd.pid"
log="$state/dockerd.log"
image="regrade-test/k3s:latest"
base_image="regrade-test/k3s-base:latest"
k3s_image="local/k3s-regrade:v1.33.5-k3s1"
regrade_image="local/regrade:docker"
docker=(/usr/bin/docker -H "unix://$sock")

say() { echo "rig.sh: $*" >&2; }

install_packages() {
  local missing=() p
  for p in docker.io docker-compose busybox-static file; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return
  say "installing ${missing[*]}"
  # Another apt run on the machine holds the lock for a while: wait for it.
  local apt=(apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends)
  DEBIAN_FRONTEND=noninteractive "${apt[@]}" "${missing[@]}" >&2 ||
    { apt-get -o DPkg::Lock::Timeout=600 update >&2 && DEBIAN_FRONTEND=noninteractive "${apt[@]}" "${missing[@]}" >&2; }
}

running() {
  [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

# Set by start_dockerd when it started the engine (rather than finding it running).
started_now=0

start_dockerd() {
  if running && "${docker[@]}" version >/dev/null 2>&1; then
    return
  fi
  started_now=1
  mkdir -p "$state/data" "$state/exec"
  say "starting dockerd on $sock (log $log)"
  # setsid: dockerd outlives this script and is not in the caller's process group.
  setsid /usr/sbin/dockerd --bridge=none --iptables=false --ip-masq=false \
    --data-root="$state/data" --exec-root="$state/exec" --pidfile="$pidfile" \
    --host="unix://$sock" >>"$log" 2>&1 </dev/null &
  for _ in $(seq 1 120); do
    if "${docker[@]}" version >/dev/null 2>&1; then
      return
    fi
    sleep 0.5
  done
  say "dockerd did not answer on $sock within 60 s; last log lines:"
  tail -n 30 "$log" >&2
  exit 1
}

stop_dockerd() {
  running || return 0
  local pid
  pid="$(cat "$pidfile")"
  say "stopping dockerd (pid $pid)"
  kill -TERM "$pid"
  for _ in $(seq 1 120); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.5
  done
  say "dockerd (pid $pid) did not stop within 60 s; killing it"
  kill -KILL "$pid" 2>/dev/null || true
}

build_image() {
  local regrade_bin="$1" bin rootfs ctx
  bin="$("$repo/tests/rig/build.sh" | tail -n 1)"
  [ -x "$bin/k3s-standin" ] || { say "no k3s-standin in $bin"; exit 1; }
  rootfs="$state/rootfs"
  rm -rf "$rootfs"
  mkdir -p "$rootfs"/{bin,etc/rancher/k3s,var/lib/rancher/k3s,run,tmp,proc,sys,dev}
  cp "$bin/k3s-standin" "$rootfs/bin/k3s"
  cp /bin/busybox "$rootfs/bin/busybox"
  ln -s busybox "$rootfs/bin/cat"
  "${docker[@]}" rmi -f "$image" "$k3s_image" "$regrade_image" "$base_image" >/dev/null 2>&1 || true
  tar -C "$rootfs" -c . | "${docker[@]}" import \
    --change 'ENTRYPOINT ["/bin/k3s"]' --change 'CMD ["server"]' - "$base_image" >/dev/null
  # The build context: what the Dockerfiles COPY.
  ctx="$state/context"
  rm -rf "$ctx"
  mkdir -p "$ctx"
  cp "$regrade_bin" "$ctx/regrade"
  cp "$repo/deploy/docker/nsswitch.conf" "$ctx/"
  # The legacy builder: COPY-only Dockerfiles need no network and no BuildKit.
  DOCKER_BUILDKIT=0 "${docker[@]}" build -q --build-arg K3S_IMAGE="$base_image" \
    -f "$repo/deploy/docker/k3s.Dockerfile" -t "$image" -t "$k3s_image" "$ctx" >/dev/null
  DOCKER_BUILDKIT=0 "${docker[@]}" build -q \
    -f "$repo/deploy/docker/regrade.Dockerfile" -t "$regrade_image" "$ctx" >/dev/null
  say "built $image ($k3s_image) and $regrade_image from deploy/docker/*.Dockerfile"
}

case "${1:-}" in
  up)
    install_packages
    start_dockerd
    # A freshly started engine brings back the containers an aborted run left (they
    # have a restart policy) and they would hold their addresses: remove them. An
    # engine found running belongs to a test in progress: leave its containers.
    if [ "$started_now" = 1 ]; then
      left="$("${docker[@]}" ps -aq)"
      if [ -n "$left" ]; then
        say "removing $(wc -w <<<"$left") container(s) an earlier run left"
        # shellcheck disable=SC2086
        "${docker[@]}" rm -f $left >/dev/null
      fi
    fi
    # run.sh builds it first (REGRADE_STATIC_BIN); a cargo started from a test
    # process sees another environment and could rebuild for nothing.
    static_bin="${REGRADE_STATIC_BIN:-}"
    [ -n "$static_bin" ] || static_bin="$(bash "$here/static.sh" | tail -n 1)"
    build_image "$static_bin"
    echo "socket=$sock"
    echo "image=$image"
    echo "k3s_image=$k3s_image"
    echo "regrade_image=$regrade_image"
    ;;
  restart-dockerd)
    stop_dockerd
    start_dockerd
    ;;
  down)
    stop_dockerd
    # dockerd leaves its default network namespace mounted under its exec-root; a
    # mount there would keep the cache from being removed (rm: Device or resource busy).
    umount "$state/exec/netns/default" 2>/dev/null || true
    ;;
  *)
    say "usage: rig.sh up | restart-dockerd | down"
    exit 2
    ;;
esac
