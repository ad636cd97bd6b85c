#!/usr/bin/env bash
# Builds the static regrade the Docker images carry (README.md, "Docker": the static
# build) and shows that it is static: `file` and `ldd` of it go to stderr, and the
# script fails unless both say so. Last stdout line: the binary's path.
#
# Its own target dir, under the test cache so CI (a fresh clone each run) rebuilds
# only regrade itself, not every dependency:
#   ${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}/target-static
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cache="${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}"
target="${REGRADE_STATIC_TARGET_DIR:-$cache/target-static}"
triple=x86_64-unknown-linux-gnu
bin="$target/$triple/release/regrade"

say() { echo "static.sh: $*" >&2; }

t0=$SECONDS
(cd "$repo" && RUSTFLAGS='-C target-feature=+crt-static' cargo build --locked --release --features docker \
  --target "$triple" --target-dir "$target" >&2)
say "built $bin in $((SECONDS - t0)) s"

f="$(file -b "$bin")"
l="$(ldd "$bin" 2>&1 || true)"
say "file: $f"
say "ldd:  $l"
case "$f" in *"static-pie linked"* | *"statically linked"*) ;; *) say "file does not call it static"; exit 1 ;; esac
case "$l" in *"statically linked"* | *"not a dynamic executable"*) ;; *) say "ldd lists libraries"; exit 1 ;; esac
# No interpreter (PT_INTERP): nothing to load at exec time.
if readelf -l "$bin" | grep -q 'Requesting program interpreter'; then
  say "it names a program interpreter"
  exit 1
fi
echo "$bin"
