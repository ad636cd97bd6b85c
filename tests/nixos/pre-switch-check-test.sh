#!/usr/bin/env bash
# pre-switch-check-test.sh: runs regrade's switch-time check (nixos/pre-switch-check.sh,
# as nixos/module.nix renders it into system.preSwitchChecks) the way NixOS runs it, for
# every action of switch-to-configuration, at each level, against real files:
#   - inside the script NixOS builds with writeShellApplication (errexit, nounset,
#     pipefail; shellcheck at build time, so shellcheck runs here too), in each of the
#     wrapper forms nixpkgs' nixos/modules/system/activation/pre-switch-check.nix has had:
#       nixos-25.11  `if ! ( check ) >&2; then echo "Pre-switch check … failed"; exit 1; fi`
#       newer        `set +e; ( set -e; check ) >&2; _rc=$?; set -e; if [ "$_rc" -ne 0 ] …`
#       older        `( check ); if [[ $? != 0 ]] …` (writeShellScript: no errexit)
#   - with $1 = the new toplevel and $2 = the action; and with $1 only (the
#     switch-to-configuration-ng that passes no action, exporting NIXOS_ACTION).
# Needs only bash and coreutils (no Nix): CI runs it whether or not nixpkgs' lib is at hand.
# `render_check` is also used by eval-module.sh to show the module renders the same text.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

# The text nixos/module.nix gives system.preSwitchChecks.regrade-not-below-full.
render_check() { # DROPIN RECORD STATE LEVEL_RECORD HOLD SECONDS COREUTILS_BIN
  printf 'regrade_dropin=%s\nregrade_record=%s\nregrade_state=%s\nregrade_level_record=%s\nregrade_hold=%s\nregrade_hold_seconds=%s\nregrade_bin=%s\n' "$@"
  cat "$repo/nixos/pre-switch-check.sh"
}

# The pre-switch-checks script NixOS builds around one check named NAME.
wrap() { # FORM NAME TEXTFILE
  local form="$1" name="$2" text
  text="$(cat "$3")"
  case "$form" in
    nixos-25.11)
      printf '#!%s\nset -o errexit\nset -o nounset\nset -o pipefail\n\n' "$BASH"
      printf '# pre-switch check %s\nif ! (\n  %s\n) >&2 ; then\n  echo "Pre-switch check '"'"'%s'"'"' failed" >&2\n  exit 1\nfi\n' "$name" "$text" "$name"
      ;;
    newer)
      printf '#!%s\nset -o errexit\nset -o nounset\nset -o pipefail\n\n' "$BASH"
      printf '# pre-switch check %s\nset +e\n(\n  set -e\n  %s\n) >&2\n_rc=$?\nset -e\nif [ "$_rc" -ne 0 ]; then\n  echo "Pre-switch check '"'"'%s'"'"' failed" >&2\n  exit 1\nfi\n' "$name" "$text" "$name"
      ;;
    older)
      printf '#!%s\n' "$BASH"
      printf '# pre-switch check %s\n(\n  %s\n)\nif [[ $? != 0 ]]; then\n  echo "Pre-switch check '"'"'%s'"'"' failed"\n  exit 1\nfi\n' "$name" "$text" "$name"
      ;;
  esac
}

if [ "${1:-}" = --render ]; then
  shift
  render_check "$@"
  exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fails=0
passes=0
ok() { echo "ok   $*"; passes=$((passes + 1)); }
bad() { echo "FAIL $*"; fails=$((fails + 1)); }

k3s="$tmp/etc/rancher/k3s"
run="$tmp/run/regrade"
dropin="$k3s/config.yaml.d/50-regrade.yaml"
record="$run/started-level"
state="$run/state.json"
lib="$tmp/var/lib/regrade"
level_record="$lib/level.json"
hold="$run/switch-hold"
secs=300
coreutils="$(dirname "$(command -v date)")"
render_check "$dropin" "$record" "$state" "$level_record" "$hold" "$secs" "$coreutils" >"$tmp/check.txt"

for form in nixos-25.11 newer older; do
  wrap "$form" regrade-not-below-full "$tmp/check.txt" >"$tmp/pre-switch-checks.$form"
  chmod +x "$tmp/pre-switch-checks.$form"
done
# writeShellApplication's checkPhase: a warning fails the system's build.
if command -v shellcheck >/dev/null; then
  if shellcheck "$tmp/pre-switch-checks.nixos-25.11" >"$tmp/shellcheck.out" 2>&1; then
    ok "shellcheck: the pre-switch-checks script (nixos-25.11 form) is clean, as writeShellApplication requires"
  else
    bad "shellcheck on the pre-switch-checks script:"; cat "$tmp/shellcheck.out"
  fi
else
  bad "shellcheck missing (apt-get install -y shellcheck): writeShellApplication would run it"
fi

# The levels, as the running regrade leaves its files.
# The level record as src/level_record.rs writes it (pretty JSON).
level_json() { # LEVEL [STEP]
  local step=""
  [ -z "${2:-}" ] || step=$',\n  "step": {\n    "from": "full",\n    "to": "'"$2"$'",\n    "phase": "marking",\n    "started": 1796000000\n  }'
  printf '{\n  "version": 1,\n  "level": "%s"%s,\n  "keys": {\n    "cluster.level_label": "regrade.dev/level"\n  },\n  "updated": 1796000000\n}\n' "$1" "$step" >"$level_record"
}

set_level() {
  rm -rf "$tmp/etc" "$tmp/run" "$tmp/var"
  mkdir -p "$k3s/config.yaml.d" "$run" "$lib"
  case "$1" in
    never-ran) rm -rf "$run" "$lib" ;;
    full)
      echo full >"$record"
      echo '{"pid":1,"level":"full","dry_run":false}' >"$state"
      level_json full
      ;;
    control-plane) # no restart: the record still says full; only the state tells
      echo full >"$record"
      printf '{\n  "pid": 1,\n  "level": "control-plane",\n  "dry_run": false\n}\n' >"$state"
      level_json control-plane
      ;;
    rebooted-at-control-plane) # /run is gone: only the level record knows
      rm -rf "$run"
      level_json control-plane
      ;;
    killed-mid-step) # SIGKILLed during a step down from full: only the record knows
      rm -rf "$run"
      level_json full control-plane
      ;;
    etcd-only)
      echo etcd-only >"$record"
      echo 'disable-apiserver: true' >"$dropin"
      echo '{"pid":1,"level":"etcd-only","dry_run":false}' >"$state"
      level_json etcd-only
      ;;
    stepping) # the watch published a step it is starting (it looks for a hold next)
      echo full >"$record"
      echo '{"pid":1,"level":"full","stepping":"control-plane","dry_run":false}' >"$state"
      level_json full
      ;;
    drop-in-only) # k3s not restarted yet, but will start below full
      echo full >"$record"
      echo 'disable-apiserver: true' >"$dropin"
      ;;
  esac
}

toplevel=/nix/store/00000000000000000000000000000000-nixos-system-new
# Runs the script as switch-to-configuration does: $1 = the new toplevel, $2 = the action
# (or $1 only, with NIXOS_ACTION set, as switch-to-configuration-ng does).
switch() { # FORM ACTION [noarg]
  local form="$1" action="$2"
  if [ "${3:-}" = noarg ]; then
    NIXOS_ACTION="$action" "$tmp/pre-switch-checks.$form" "$toplevel" >"$tmp/out" 2>&1
  else
    env -u NIXOS_ACTION "$tmp/pre-switch-checks.$form" "$toplevel" "$action" >"$tmp/out" 2>&1
  fi
}

for form in nixos-25.11 newer older; do
  for how in args noarg; do
    for level in never-ran full control-plane rebooted-at-control-plane killed-mid-step etcd-only drop-in-only stepping; do
      for action in switch boot test dry-activate check; do
        set_level "$level"
        what="[$form, \$2=${how/noarg/none (NIXOS_ACTION)}] $action at $level"
        before=$(date +%s)
        if switch "$form" "$action" "$how"; then got=pass; else got=refuse; fi
        case "$level:$action" in
          *:dry-activate | never-ran:* | full:*) want=pass ;;
          *) want=refuse ;;
        esac
        # A hold exactly when the switch goes on to stop units and a regrade may run.
        want_hold=no
        if [ "$want" = pass ] && [ "$level" != never-ran ] && [ "$action" != dry-activate ] && [ "$action" != check ]; then
          want_hold=yes
        fi
        got_hold=no
        [ -e "$hold" ] && got_hold=yes
        detail=""
        if [ "$got" != "$want" ]; then detail="exit: $got, wanted $want; "; fi
        if [ "$got_hold" != "$want_hold" ]; then detail="${detail}hold: $got_hold, wanted $want_hold; "; fi
        if [ "$want_hold" = yes ] && [ "$got_hold" = yes ]; then
          until=$(head -n1 "$hold")
          after=$(date +%s)
          if ! [[ $until =~ ^[0-9]+$ ]] || [ "$until" -lt $((before + secs)) ] || [ "$until" -gt $((after + secs)) ]; then
            detail="${detail}hold says '$until', wanted now+$secs; "
          fi
        fi
        if [ "$want" = refuse ] && ! grep -q "refusing to turn regrade off on this server while it is below full" "$tmp/out"; then
          detail="${detail}no refusal message; "
        fi
        if [ "$want" = refuse ] && ! grep -q "Pre-switch check 'regrade-not-below-full' failed" "$tmp/out"; then
          detail="${detail}the wrapper did not report the check failed; "
        fi
        if [ "$level:$action" != "full:dry-activate" ] && [ "$action" = dry-activate ] && [ "$level" != never-ran ] && [ "$level" != full ] &&
          ! grep -q "would be refused" "$tmp/out"; then
          detail="${detail}dry-activate did not say it would be refused; "
        fi
        if [ -z "$detail" ]; then ok "$what -> $got, hold $got_hold"; else bad "$what: $detail"; sed 's/^/       /' "$tmp/out"; fi
      done
    done
  done
done

# Show the messages once, as an operator sees them.
set_level control-plane
switch nixos-25.11 switch || true
echo "       what 'nixos-rebuild switch' prints at control-plane:"
sed 's/^/         /' "$tmp/out"

# A hold that cannot be written refuses (the running regrade could start a step).
set_level full
mkdir "$hold.tmp"
if switch nixos-25.11 switch; then
  bad "an unwritable hold let the switch go on"
elif grep -q "could not write the hold" "$tmp/out"; then
  ok "an unwritable hold refuses the switch, naming $hold"
else
  bad "an unwritable hold refused without saying why:"; cat "$tmp/out"
fi

echo "pre-switch check: $passes passed, $fails failed"
[ "$fails" -eq 0 ]
