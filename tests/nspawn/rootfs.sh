#!/usr/bin/env bash
# Builds (once) the Debian rootfs the systemd tests boot with systemd-nspawn, in a cache
# outside the repo. Installs its own host packages. Idempotent: a finished rootfs is
# marked by a stamp file and reused; a half-built one is thrown away and rebuilt.
# Last stdout line: the rootfs directory. Progress goes to stderr.
#   REGRADE_TEST_CACHE  cache root (default $HOME/.cache/regrade-tests)
set -euo pipefail

cache="${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}"
suite=bookworm
packages=systemd,systemd-sysv,dbus
# The key changes when the package list or suite does, so an old rootfs is not reused.
key="$(echo "$suite $packages v1" | sha256sum | cut -c1-12)"
root="$cache/nspawn-rootfs-$suite-$key"

log() { echo "rootfs.sh: $*" >&2; }

need_pkgs=()
command -v debootstrap >/dev/null || need_pkgs+=(debootstrap)
command -v systemd-nspawn >/dev/null || need_pkgs+=(systemd-container)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  log "installing ${need_pkgs[*]}"
  apt-get install -y "${need_pkgs[@]}" >&2 || { apt-get update >&2; apt-get install -y "${need_pkgs[@]}" >&2; }
fi

mkdir -p "$cache"
exec 9>"$cache/.nspawn-rootfs.lock"
flock 9

if [ ! -e "$root/.regrade-rootfs-done" ]; then
  rm -rf "$root" "$root.tmp"
  log "debootstrap $suite into $root (about a minute) ..."
  t0=$SECONDS
  debootstrap --variant=minbase --include="$packages" "$suite" "$root.tmp" http://deb.debian.org/debian >&2
  # A machine-id makes the journal and D-Bus happy on every boot of a copy.
  systemd-machine-id-setup --root="$root.tmp" >&2
  # Nothing in the container needs a console login or the network managed.
  rm -f "$root.tmp/etc/systemd/system/getty.target.wants/"* 2>/dev/null || true
  touch "$root.tmp/.regrade-rootfs-done"
  mv "$root.tmp" "$root"
  log "rootfs built in $((SECONDS - t0))s"
fi
echo "$root"
