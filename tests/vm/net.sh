#!/usr/bin/env bash
# TEST RIG: the VM lane's network (tests/testsuite/vm_incident.rs). As tests/e2e/netns.sh, with
# names of its own so the lane can run beside the e2e test: a hub namespace with the
# bridge br-vm (10.213.7.1/24) that the test enters, server2 and server3 in namespaces
# of their own on veths (10.213.7.12, .13), and the tap tap-vm1 on the bridge for
# server1's qemu guest (10.213.7.11 set inside the guest). Nothing here touches the
# host's own network namespace, and qemu runs with -nodefaults (no user-mode NIC).
#
#   net.sh up      make regrade-vm-hub, regrade-vm-s2, regrade-vm-s3 and the tap (removing stale ones)
#   net.sh down    remove them
set -euo pipefail
hub=regrade-vm-hub
net=10.213.7

down() {
  for n in 2 3; do ip netns del "regrade-vm-s$n" 2>/dev/null || true; done
  ip netns del "$hub" 2>/dev/null || true
}

up() {
  down
  ip netns add "$hub"
  ip -n "$hub" link set lo up
  ip -n "$hub" link add br-vm type bridge
  ip -n "$hub" addr add "$net.1/24" dev br-vm
  ip -n "$hub" link set br-vm up
  ip -n "$hub" tuntap add dev tap-vm1 mode tap
  ip -n "$hub" link set tap-vm1 master br-vm up
  for n in 2 3; do
    local ns="regrade-vm-s$n"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$hub" link add "veth-s$n" type veth peer name eth0 netns "$ns"
    ip -n "$hub" link set "veth-s$n" master br-vm up
    ip -n "$ns" addr add "$net.1$n/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: net.sh up|down" >&2; exit 2 ;;
esac
