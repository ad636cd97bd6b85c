#!/usr/bin/env bash
# The Docker rig for regrade's Docker actuator tests (tests/docker_actuator.rs).
#
#   rig.sh up REGRADE_BIN   install docker.io, start our own dockerd if it is not
#                           running, build the k3s test image and import it; prints
#                           `socket=...` and `image=...` lines on stdout
#   rig.sh restart-dockerd  stop and start that dockerd (containers with a restart
#                           policy come back through their entrypoint)
#   rig.sh down             stop that dockerd (state stays cached)
#
# The dockerd is this rig's own: --bridge=none (no private-range network is made),
# --iptables=false, and its own data-root, exec-root, pidfile and socket under
# ${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}/docker, so it collides with no
# other engine. Containers use --network host with loopback addresses only.
#
# The image (docker import of a directory, no registry): the static k3s stand-in as
# /bin/k3s (built by tests/rig/build.sh), the regrade binary as /bin/regrade with the
# shared libraries `ldd` names (it links glibc dynamically and the musl target cannot
# be installed offline; copying four libraries is smaller and faster than a
# debootstrap rootfs), and busybox-static as /bin/cat, since the actuator reads the
# started-level record with `cat` through the Engine API (as rancher/k3s has cat).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}"
state="$cache/docker"
sock="$state/docker.sock"
pidfile="$state/dockerd.pid"
log="$state/dockerd.log"
image="regrade-test/k3s:latest"
docker=(/usr/bin/docker -H "unix://$sock")

say() { echo "rig.sh: $*" >&2; }

install_packages() {
  local missing=() p
  for p in docker.io busybox-static; do
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

start_dockerd() {
  if running && "${docker[@]}" version >/dev/null 2>&1; then
    return
  fi
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
  local regrade_bin="$1" bin rootfs lib
  bin="$("$repo/tests/rig/build.sh" | tail -n 1)"
  [ -x "$bin/k3s-standin" ] || { say "no k3s-standin in $bin"; exit 1; }
  rootfs="$state/rootfs"
  rm -rf "$rootfs"
  mkdir -p "$rootfs"/{bin,etc/regrade,etc/rancher/k3s,var/lib/rancher/k3s,run,tmp,proc,sys,dev}
  cp "$bin/k3s-standin" "$rootfs/bin/k3s"
  cp "$regrade_bin" "$rootfs/bin/regrade"
  cp /bin/busybox "$rootfs/bin/busybox"
  ln -s busybox "$rootfs/bin/cat"
  # The dynamic loader and the libraries the regrade binary links.
  for lib in $(ldd "$regrade_bin" | grep -o '/[^ ]*'); do
    mkdir -p "$rootfs$(dirname "$lib")"
    cp -L "$lib" "$rootfs$lib"
  done
  "${docker[@]}" rmi -f "$image" >/dev/null 2>&1 || true
  tar -C "$rootfs" -c . | "${docker[@]}" import \
    --change 'ENTRYPOINT ["/bin/regrade", "entrypoint", "--"]' \
    --change 'CMD ["k3s", "server"]' - "$image" >/dev/null
  say "imported $image"
}

case "${1:-}" in
  up)
    [ -n "${2:-}" ] || { say "usage: rig.sh up REGRADE_BIN"; exit 2; }
    install_packages
    start_dockerd
    build_image "$2"
    echo "socket=$sock"
    echo "image=$image"
    ;;
  restart-dockerd)
    stop_dockerd
    start_dockerd
    ;;
  down)
    stop_dockerd
    ;;
  *)
    say "usage: rig.sh up REGRADE_BIN | restart-dockerd | down"
    exit 2
    ;;
esac
