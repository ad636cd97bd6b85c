#!/bin/sh
# TEST CODE (tests/vm/guest/vm-seed.service): copies this run's seed over the root on
# its first boot, sets the host name and the address, and says so on the console.
set -eu
if [ ! -e /var/lib/regrade-vm/seeded ]; then
  cp -a /seed/root/. /
  mkdir -p /var/lib/regrade-vm
  touch /var/lib/regrade-vm/seeded
  sync
fi
. /seed/net.env
hostname "$HOST"
ip link set lo up
ip addr replace "$ADDR/24" dev eth0
ip link set eth0 up
echo "regrade-vm: seeded $HOST $ADDR" > /dev/ttyS0
