#!/usr/bin/env bash
# TEST RIG: builds (once) server1's disk image for the VM lane (tests/testsuite/vm_incident.rs)
# from the cached nspawn rootfs (tests/nspawn/rootfs.sh), in a cache outside the repo.
#
# The image is a Debian 12 install as a small k3s server would have it: Debian's
# kernel (linux-image-amd64, with an initrd of just the modules a qemu guest needs),
# udev, kmod, iproute2, procps, python3 (the workload and the sampler), earlyoom and
# systemd-oomd (installed, not running: their arms start them), qemu-guest-agent (the
# test's command channel); the stand-ins' units (tests/vm/guest), and regrade's units
# installed from packaging/systemd as a user installs them (every k3s.service and
# system.slice drop-in there too). Binaries and this run's configuration are not in
# it: they come on a second disk, the seed (tests/testsuite/vm_incident.rs), linked from
# /usr/local/bin. A 600 MiB file of random bytes, the workload's data, is.
#
# Keyed by its inputs (the rootfs, the package list, every file copied in, this
# script): a changed input builds a new image. Last stdout line: the image directory
# (disk.img, raw ext4; vmlinuz; initrd.img). Progress goes to stderr.
#   REGRADE_TEST_CACHE  cache root (default $HOME/.cache/regrade-tests)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}"
packages="udev kmod iproute2 procps python3 earlyoom systemd-oomd qemu-guest-agent linux-image-amd64"
data_mib=600
disk_mib=4096

log() { echo "image.sh: $*" >&2; }

command -v mkfs.ext4 >/dev/null || { log "needs mkfs.ext4 (e2fsprogs)"; exit 1; }
rootfs="$("$repo/tests/nspawn/rootfs.sh" | tail -n1)"
inputs=(
  "$here/image.sh" "$here"/guest/* "$repo/packaging/systemd/regrade.service"
  "$repo/packaging/systemd/k3s.service.d/"*.conf "$repo/packaging/systemd/system.slice.d/"*.conf
  "$repo/tests/incident/hog.py"
)
key="$( { echo "$rootfs $packages $data_mib $disk_mib v1"; cat "${inputs[@]}"; } | sha256sum | cut -c1-12)"
out="$cache/vm-image-$key"

mkdir -p "$cache"
exec 9>"$cache/.vm-image.lock"
flock 9
if [ -e "$out/.done" ]; then echo "$out"; exit 0; fi

t0=$SECONDS
rm -rf "$out" "$out.tmp"
mkdir -p "$out.tmp"
tree="$out.tmp/tree"
log "copying the rootfs $rootfs"
cp -a "$rootfs" "$tree"
# No service may start inside the build container.
printf '#!/bin/sh\nexit 101\n' > "$tree/usr/sbin/policy-rc.d"
chmod +x "$tree/usr/sbin/policy-rc.d"
log "installing $packages (a few minutes the first time)"
in_tree() { systemd-nspawn -q --register=no --keep-unit -M regrade-vm-image -D "$tree" -E DEBIAN_FRONTEND=noninteractive "$@" </dev/null >&2; }
in_tree apt-get update -qq
in_tree apt-get install -y -qq --no-install-recommends $packages
# A small initrd: only what a q35 guest with virtio disks needs to mount its root.
printf 'MODULES=list\nCOMPRESS=gzip\n' > "$tree/etc/initramfs-tools/conf.d/regrade-vm.conf"
printf '%s\n' virtio_pci virtio_blk virtio_net virtio_console ext4 > "$tree/etc/initramfs-tools/modules"
in_tree update-initramfs -u -k all
in_tree apt-get clean
rm -f "$tree/usr/sbin/policy-rc.d"
kver="$(ls "$tree/lib/modules" | head -n1)"
cp "$tree/boot/vmlinuz-$kver" "$out.tmp/vmlinuz"
cp "$tree/boot/initrd.img-$kver" "$out.tmp/initrd.img"

log "installing the lane's units and regrade's packaged units"
lib="$tree/usr/local/lib/regrade-vm"
sys="$tree/etc/systemd/system"
mkdir -p "$lib" "$tree/seed" "$tree/etc/rancher/k3s/config.yaml.d" "$tree/etc/regrade" "$sys/k3s.service.d" \
  "$sys/kubepods.slice.d" "$sys/multi-user.target.wants"
cp "$here/guest/seed.sh" "$here/guest/sampler.py" "$repo/tests/incident/hog.py" "$lib/"
cp "$here/guest/fstab" "$tree/etc/fstab"
for u in k3s.service kubelet-standin.service vm-seed.service vm-sampler.service vm-ready.service; do
  cp "$here/guest/$u" "$sys/$u"
  ln -sf "../$u" "$sys/multi-user.target.wants/$u"
done
# regrade as packaging/systemd/README.md installs it (started by the test in its arm).
cp "$repo/packaging/systemd/regrade.service" "$sys/regrade.service"
# Every k3s.service drop-in packaging/ ships (regrade's, and the protections for k3s),
# and system.slice's (cgroup v2 honours k3s.service's MemoryLow only within its
# parent's).
mkdir -p "$sys/system.slice.d"
cp "$repo/packaging/systemd/k3s.service.d/"*.conf "$sys/k3s.service.d/"
cp "$repo/packaging/systemd/system.slice.d/"*.conf "$sys/system.slice.d/"
cp "$here/guest/kubepods-oomd.conf" "$sys/kubepods.slice.d/50-oomd.conf"
for b in regrade k3s-standin kube-apiserver kubelet-standin; do ln -sf "/seed/bin/$b" "$tree/usr/local/bin/$b"; done
ln -sf k3s-standin "$tree/usr/local/bin/k3s"
# earlyoom and systemd-oomd run only in their arms; the console carries the test's
# lines, not a login prompt.
rm -f "$sys/multi-user.target.wants/earlyoom.service" "$sys/multi-user.target.wants/systemd-oomd.service" \
  "$sys/dbus-org.freedesktop.oom1.service" "$sys/sockets.target.wants/systemd-oomd.socket"
ln -sf /dev/null "$sys/serial-getty@ttyS0.service"
ln -sf /dev/null "$sys/getty@tty1.service"
echo server1 > "$tree/etc/hostname"
mkdir -p "$tree/var/lib/regrade-vm"
log "writing the workload's data ($data_mib MiB of random bytes)"
dd if=/dev/urandom of="$tree/var/lib/regrade-vm/data" bs=1M count="$data_mib" status=none

log "making the ext4 image ($disk_mib MiB, sparse)"
truncate -s "${disk_mib}M" "$out.tmp/disk.img"
mkfs.ext4 -q -L regrade-vm -d "$tree" "$out.tmp/disk.img"
rm -rf "$tree"
touch "$out.tmp/.done"
mv "$out.tmp" "$out"
# Images built from older inputs are not used again.
for old in "$cache"/vm-image-*; do [ "$old" = "$out" ] || rm -rf "$old"; done
log "image built in $((SECONDS - t0))s: $out"
echo "$out"
