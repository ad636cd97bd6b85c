#!/usr/bin/env bash
# TEST RIG: the end-to-end test's network (tests/testsuite/e2e_three_servers.rs). One network
# namespace per server, so each k3s stand-in listens where k3s does (etcd on
# 127.0.0.1:2379 and its own address, /health on 127.0.0.1:2381 only), and a hub
# namespace with a bridge joining them, which the test itself enters to reach the
# servers. Nothing here touches the host's own network namespace.
#
#   netns.sh up      make regrade-e2e-hub and regrade-e2e-s1..3 (removing stale ones)
#   netns.sh down    remove them
#   netns.sh partition N | heal N   drop (or stop dropping) server N's etcd peer
#                    traffic (TCP 2380 both ways), in its own namespace only
#
# Addresses: hub 10.213.7.1/24 on bridge br-e2e; server N 10.213.7.1N/24 on its eth0.
set -euo pipefail
hub=regrade-e2e-hub
net=10.213.7

down() {
  for n in 1 2 3; do ip netns del "regrade-e2e-s$n" 2>/dev/null || true; done
  ip netns del "$hub" 2>/dev/null || true
}

up() {
  down
  ip netns add "$hub"
  ip -n "$hub" link set lo up
  ip -n "$hub" link add br-e2e type bridge
  ip -n "$hub" addr add "$net.1/24" dev br-e2e
  ip -n "$hub" link set br-e2e up
  for n in 1 2 3; do
    local ns="regrade-e2e-s$n"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$hub" link add "veth-s$n" type veth peer name eth0 netns "$ns"
    ip -n "$hub" link set "veth-s$n" master br-e2e up
    ip -n "$ns" addr add "$net.1$n/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
}

rules() { # ACTION N
  local ns="regrade-e2e-s$2"
  for chain in INPUT OUTPUT; do
    for dir in --dport --sport; do
      ip netns exec "$ns" iptables "$1" "$chain" -p tcp "$dir" 2380 -j DROP
    done
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  partition) rules -A "${2:?server number}" ;;
  heal) rules -D "${2:?server number}" ;;
  *) echo "usage: netns.sh up|down|partition N|heal N" >&2; exit 2 ;;
esac
