#!/usr/bin/env bash
# TEST RIG: boots a Debian container with a real systemd and D-Bus for regrade's
# systemd tests, or stops and removes one.
#
#   container.sh up NAME     boot; print KEY=VALUE lines (below) on stdout
#   container.sh down NAME   stop (poweroff, then SIGKILL of our nspawn), remove its files
#   container.sh reboot NAME stop it as down does but keep its files, give it a new empty
#                            RUN (as a real boot does), boot the same root again; prints as up
#
# Network, one of two:
# - by default the container shares the host's network namespace (no
#   --private-network) and its k3s stand-in listens on a loopback address of its own,
#   ${REGRADE_NSPAWN_ADDR:-127.0.0.61} (etcd /health on ADDR:2381, client 2379, peer
#   2380; API on ADDR:${REGRADE_NSPAWN_API_PORT:-16443}), so a test on the host reaches
#   etcd's health URL directly and talks to nothing but loopback;
# - with REGRADE_NSPAWN_NETNS=NAME it runs in the network namespace /run/netns/NAME
#   (made by the test, ADDR on one of its interfaces) and the stand-in listens where
#   k3s does: etcd on https://127.0.0.1:2379 and https://ADDR:2379, peers on ADDR:2380,
#   /health on 127.0.0.1:2381 only (HEALTH_URL is then inside that namespace).
#
# Shared with the host (bind mounts), so host-side tests see what the container sees:
#   ETC  -> /etc/rancher/k3s     (config.yaml, config.yaml.d/ with regrade's drop-in,
#                                 the stand-in's knob files)
#   RUN  -> /run/regrade         (record-start's record; a tmpfs, as /run is on a real
#                                 host: regrade's files there cost no disk I/O)
# The container's system bus: DBUS_SYSTEM_BUS_ADDRESS=$BUS.
#
# Inputs (env): REGRADE_BIN (the regrade binary to install; required for up),
# REGRADE_STANDIN_BIN_DIR (k3s-standin and kube-apiserver; default: tests/rig/build.sh),
# REGRADE_NSPAWN_MEMORY_CGROUP and REGRADE_NSPAWN_CAPABILITY (see boot),
# REGRADE_NSPAWN_HEALTH_DELAY (default 3s), REGRADE_NSPAWN_NODE_NAME (the stand-in's
# node and etcd member name; default regrade-test), REGRADE_TEST_CACHE.
# Seeds, copied in before boot so k3s and regrade find them at their first start (the
# end-to-end test's cluster membership, certificates, regrade.toml, enabled units):
# REGRADE_NSPAWN_SEED_ETC (a dir copied into ETC), REGRADE_NSPAWN_SEED_ROOT (a dir
# copied over the container's root).
# Output of up: PID NSPAWN_PID DIR ROOT ETC RUN BUS HEALTH_URL ADDR [NETNS]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}"
cmd="${1:?usage: container.sh up|down NAME}"
name="${2:?usage: container.sh up|down NAME}"
case "$name" in *[!a-zA-Z0-9-]*) echo "container.sh: bad name $name" >&2; exit 2 ;; esac
dir="$cache/nspawn-run/$name"
addr="${REGRADE_NSPAWN_ADDR:-127.0.0.61}"
api_port="${REGRADE_NSPAWN_API_PORT:-16443}"
node_name="${REGRADE_NSPAWN_NODE_NAME:-regrade-test}"

log() { echo "container.sh[$name]: $*" >&2; }

pid1_of() { # the container's PID 1: the child of our nspawn process
  local np="$1"
  pgrep -P "$np" 2>/dev/null | head -n1
}

stop() {
  [ -d "$dir" ] || return 0
  local np=""
  [ -f "$dir/nspawn.pid" ] && np="$(cat "$dir/nspawn.pid")"
  if [ -n "$np" ] && kill -0 "$np" 2>/dev/null; then
    local p1; p1="$(pid1_of "$np" || true)"
    # SIGRTMIN+4 asks systemd (as PID 1) to power off.
    [ -n "$p1" ] && kill -s RTMIN+4 "$p1" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$np" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$np" 2>/dev/null; then
      log "nspawn $np did not stop within 30s; killing it"
      kill -9 "$np" 2>/dev/null || true
      for _ in $(seq 1 20); do kill -0 "$np" 2>/dev/null || break; sleep 0.5; done
    fi
  fi
}

# RUN is a tmpfs mounted on the host, so the host-side tests see it too.
mount_run() {
  mkdir -p "$dir/run-regrade"
  mount -t tmpfs -o mode=0755,size=16m "regrade-run-$name" "$dir/run-regrade"
}

umount_run() {
  while mountpoint -q "$dir/run-regrade" 2>/dev/null; do umount -l "$dir/run-regrade"; done
}

down() {
  stop
  # Only once nspawn is gone: its bind mounts lived in its own mount namespace.
  umount_run
  rm -rf "$dir"
}

up() {
  : "${REGRADE_BIN:?REGRADE_BIN must name the regrade binary to install}"
  down
  local root bin
  root="$("$here/rootfs.sh" | tail -n1)"
  bin="${REGRADE_STANDIN_BIN_DIR:-$("$repo/tests/rig/build.sh" | tail -n1)}"
  [ -x "$bin/k3s-standin" ] || { log "no k3s-standin in $bin"; exit 1; }
  mkdir -p "$dir/etc-k3s/config.yaml.d"
  mount_run
  cp -a "$root" "$dir/root"
  local sys="$dir/root/etc/systemd/system"
  local netflags="--etcd-health-addr=$addr:2381 --etcd-client-url=https://$addr:2379" netns=()
  if [ -n "${REGRADE_NSPAWN_NETNS:-}" ]; then
    [ -e "/run/netns/$REGRADE_NSPAWN_NETNS" ] || { log "no network namespace $REGRADE_NSPAWN_NETNS"; exit 1; }
    netflags="" netns=("--network-namespace-path=/run/netns/$REGRADE_NSPAWN_NETNS")
  fi
  sed -e "s/@ADDR@/$addr/g" -e "s/@APIPORT@/$api_port/g" -e "s/@NODENAME@/$node_name/g" -e "s|@NETFLAGS@|$netflags|g" \
      -e "s/@DELAY@/${REGRADE_NSPAWN_HEALTH_DELAY:-3s}/g" "$here/k3s.service" > "$sys/k3s.service"
  mkdir -p "$sys/k3s.service.d" "$sys/multi-user.target.wants"
  cp "$repo/packaging/systemd/k3s.service.d/regrade.conf" "$sys/k3s.service.d/"
  ln -sf ../k3s.service "$sys/multi-user.target.wants/k3s.service"
  # The shipped regrade unit, installed but not enabled: systemd-analyze security reads it.
  cp "$repo/packaging/systemd/regrade.service" "$sys/regrade.service"
  mkdir -p "$dir/root/etc/rancher/k3s" "$dir/root/run/regrade"
  [ -z "${REGRADE_NSPAWN_SEED_ETC:-}" ] || cp -a "$REGRADE_NSPAWN_SEED_ETC/." "$dir/etc-k3s/"
  [ -z "${REGRADE_NSPAWN_SEED_ROOT:-}" ] || cp -a "$REGRADE_NSPAWN_SEED_ROOT/." "$dir/root/"
  echo "$bin" > "$dir/standin-bin"
  log "booting (rootfs $root, stand-in $bin, address $addr)"
  boot
}

reboot() {
  : "${REGRADE_BIN:?REGRADE_BIN must name the regrade binary to install}"
  [ -f "$dir/standin-bin" ] || { log "no container $name to reboot"; exit 1; }
  stop
  umount_run
  mount_run
  bin="$(cat "$dir/standin-bin")"
  local netns=()
  [ -z "${REGRADE_NSPAWN_NETNS:-}" ] || netns=("--network-namespace-path=/run/netns/$REGRADE_NSPAWN_NETNS")
  log "rebooting (same root, /run/regrade emptied)"
  boot
}

boot() {
  # netns: the caller's (up or reboot) local, which bash's dynamic scope shows here.
  # With REGRADE_NSPAWN_MEMORY_CGROUP=DIR (a cgroup v1 memory cgroup the caller made)
  # the container runs inside DIR (nspawn --keep-unit stays in its caller's cgroups),
  # which is bound read-only at /run/regrade-memcg for pressure.memory_cgroup.
  # REGRADE_NSPAWN_CAPABILITY=CAP_X[,...] adds capabilities to the container's bounding
  # set (nspawn leaves out CAP_IPC_LOCK, which the packaged regrade.service keeps).
  local memcg=()
  [ -z "${REGRADE_NSPAWN_MEMORY_CGROUP:-}" ] || memcg=("--bind-ro=$REGRADE_NSPAWN_MEMORY_CGROUP:/run/regrade-memcg")
  [ -z "${REGRADE_NSPAWN_CAPABILITY:-}" ] || memcg+=("--capability=$REGRADE_NSPAWN_CAPABILITY")
  (
  [ -z "${REGRADE_NSPAWN_MEMORY_CGROUP:-}" ] || echo "$BASHPID" > "$REGRADE_NSPAWN_MEMORY_CGROUP/cgroup.procs"
  exec setsid systemd-nspawn --keep-unit --register=no -b -q --console=passive "${netns[@]}" "${memcg[@]}" \
    -D "$dir/root" -M "$name" \
    --bind="$dir/etc-k3s:/etc/rancher/k3s" --bind="$dir/run-regrade:/run/regrade" \
    --bind-ro="$REGRADE_BIN:/usr/local/bin/regrade" \
    --bind-ro="$bin/k3s-standin:/usr/local/bin/k3s-standin" \
    --bind-ro="$bin/kube-apiserver:/usr/local/bin/kube-apiserver" \
    </dev/null >"$dir/console.log" 2>&1
  ) &
  local np=$!
  echo "$np" > "$dir/nspawn.pid"
  local p1="" bus=""
  for _ in $(seq 1 120); do
    kill -0 "$np" 2>/dev/null || { log "nspawn exited:"; cat "$dir/console.log" >&2; exit 1; }
    p1="$(pid1_of "$np" || true)"
    if [ -n "$p1" ] && [ -S "/proc/$p1/root/run/dbus/system_bus_socket" ]; then
      bus="unix:path=/proc/$p1/root/run/dbus/system_bus_socket"
      # Booted far enough when systemd answers on the bus and k3s.service has a job or runs.
      if state="$(nsenter -t "$p1" -a systemctl is-system-running 2>/dev/null)"; then :; fi
      case "${state:-}" in running|degraded) break ;; esac
    fi
    sleep 0.5
  done
  [ -n "$bus" ] || { log "no system bus after 60s"; cat "$dir/console.log" >&2; exit 1; }
  echo "PID=$p1"
  echo "NSPAWN_PID=$np"
  echo "DIR=$dir"
  echo "ROOT=$dir/root"
  echo "ETC=$dir/etc-k3s"
  echo "RUN=$dir/run-regrade"
  echo "BUS=$bus"
  echo "ADDR=$addr"
  if [ -n "${REGRADE_NSPAWN_NETNS:-}" ]; then
    echo "NETNS=$REGRADE_NSPAWN_NETNS"
    echo "HEALTH_URL=http://127.0.0.1:2381/health"
  else
    echo "HEALTH_URL=http://$addr:2381/health"
  fi
}

case "$cmd" in
  up) up ;;
  down) down ;;
  reboot) reboot ;;
  *) echo "usage: container.sh up|down|reboot NAME" >&2; exit 2 ;;
esac
