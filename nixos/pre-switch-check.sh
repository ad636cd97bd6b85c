# regrade's switch-time check, for a configuration that has regrade turned OFF: refuse
# the switch while this server is below `full`, since nothing would step it back up.
#
# nixos/module.nix puts this text into `system.preSwitchChecks` after these assignments:
#   regrade_dropin regrade_record regrade_state  the paths the running regrade uses
#   regrade_level_record                         its level record (kept across reboots)
#   regrade_hold regrade_hold_seconds            the hold it leaves (see below)
#   regrade_bin                                  coreutils' bin directory
# NixOS runs every check inside one writeShellApplication script (errexit, nounset,
# pipefail) as `if ! ( <check> ) >&2; then …; exit 1; fi`, with $1 = the new system and
# $2 = the action (switch, boot, test, dry-activate, check; older switch-to-configuration
# passes $1 only). Inside that `if`, errexit is off: every failure is handled here by hand,
# and every variable is set before use (nounset is on).
#
# The race it closes: the check runs before any unit stops, and the running `regrade
# watch` finishes a step before it honours SIGTERM. So the check FIRST leaves a hold
# (`regrade_hold`: the Unix time it ends, one line), and only THEN looks at the level;
# the watch, for its part, first publishes the step it is about to take ("stepping" in
# its state file) and only then looks for a hold. Whichever comes second sees the other:
# the watch refuses the step, or the check refuses the switch. The hold ends on its own
# after `regrade_hold_seconds`, so a switch that fails later holds nothing for long.
# switch-to-configuration-ng also exports the action as NIXOS_ACTION (older ones pass no $2).
regrade_action="${2-${NIXOS_ACTION-switch}}"
regrade_now="$("$regrade_bin/date" +%s)" || regrade_now=""

regrade_held=""
case "$regrade_action" in
  dry-activate | check) ;; # nothing will be stopped: no hold
  *)
    # No directory: no regrade ever ran with these paths, so none is running to hold.
    if [ -n "$regrade_now" ] && [ -d "$("$regrade_bin/dirname" -- "$regrade_hold")" ]; then
      regrade_until=$((regrade_now + regrade_hold_seconds))
      if printf '%s\n# regrade: steps held by the switch-time check (%s of %s) until this Unix time\n' \
        "$regrade_until" "$regrade_action" "${1-?}" >"$regrade_hold.tmp" &&
        "$regrade_bin/mv" -f -- "$regrade_hold.tmp" "$regrade_hold"; then
        regrade_held=yes
      else
        echo "regrade: could not write the hold $regrade_hold; refusing the switch, since the running regrade could start a step before it stops." >&2
        exit 1
      fi
    fi
    ;;
esac

regrade_below=""
if [ -e "$regrade_dropin" ]; then
  regrade_below="regrade's k3s drop-in $regrade_dropin is in place, so k3s runs (or will start) below full"
fi
if [ -r "$regrade_record" ]; then
  regrade_level=""
  read -r regrade_level <"$regrade_record" || true
  if [ -n "$regrade_level" ] && [ "$regrade_level" != full ]; then
    regrade_below="k3s was started at level '$regrade_level' ($regrade_record)"
  fi
fi
# The level record is on disk: after a reboot at control-plane it alone still knows
# (the drop-in is for etcd-only only, the start record and the state are under /run).
if [ -r "$regrade_level_record" ]; then
  regrade_json="$(<"$regrade_level_record")" || regrade_json=""
  if [[ $regrade_json =~ \"level\"[[:space:]]*:[[:space:]]*\"(control-plane|etcd-only)\" ]]; then
    regrade_below="regrade's level record ($regrade_level_record) holds this server at '${BASH_REMATCH[1]}'"
  fi
  if [[ $regrade_json =~ \"step\"[[:space:]]*:[[:space:]]*\{ ]]; then
    regrade_below="a step is under way by regrade's level record ($regrade_level_record)"
  fi
fi
# control-plane restarts nothing, so only the daemon's own state tells it.
if [ -r "$regrade_state" ]; then
  regrade_json="$(<"$regrade_state")" || regrade_json=""
  if [[ $regrade_json =~ \"level\"[[:space:]]*:[[:space:]]*\"(control-plane|etcd-only)\" ]]; then
    regrade_below="regrade's state ($regrade_state) says level '${BASH_REMATCH[1]}'"
  fi
  if [[ $regrade_json =~ \"stepping\"[[:space:]]*:[[:space:]]*\"([a-z-]+)\" ]]; then
    regrade_below="regrade is stepping to '${BASH_REMATCH[1]}' right now ($regrade_state)"
  fi
fi

if [ -n "$regrade_below" ]; then
  if [ "$regrade_action" = dry-activate ]; then
    echo "regrade: a switch to this configuration would be refused: $regrade_below." >&2
    exit 0
  fi
  # The switch stops here and regrade keeps running: it must be free to step up.
  if [ -n "$regrade_held" ]; then
    "$regrade_bin/rm" -f -- "$regrade_hold"
  fi
  echo "regrade: refusing to turn regrade off on this server while it is below full: $regrade_below." >&2
  echo "Nothing would step it back up. First step it up by hand with the regrade still running:" >&2
  echo "  regrade step to full    (then 'regrade status' must say: level full)" >&2
  echo "and switch again." >&2
  exit 1
fi
if [ -n "$regrade_held" ]; then
  echo "regrade: at full; regrade starts no step for ${regrade_hold_seconds}s (hold $regrade_hold) while the switch stops it." >&2
fi
exit 0
