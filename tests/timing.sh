# shellcheck shell=bash
# The timing table printed at the end of .ci/run and tests/run (issue 56): each
# section's wall time and CPU time, each background part (started with timing_bg) in a
# row of its own, and the run's total. Sourced by both scripts.
#
# CPU is user+sys of the processes a part started and waited for (/proc/PID/stat's
# utime, stime, cutime and cstime): what the suite burned, whatever else the machine
# ran. Not counted: what dockerd runs (a daemon started with setsid, it is nobody's
# waited-for child here). Beside the total: the host's busy CPU over the run (/proc/stat:
# every process, the suite's and anyone else's), so a slow afternoon (host busy well
# above the suite's CPU, or the suite's CPU up for the same work) can be told from a
# slow suite.
#
# The first script of a run to source it (.ci/run, or tests/run on its own) owns the
# table and prints it when it exits, however it exits; a script it runs adds its rows
# to the same file (REGRADE_TIMING_FILE). A section that fails is marked so.

timing_tck=$(getconf CLK_TCK)

# Now, in centiseconds.
timing_now() {
  local t=${EPOCHREALTIME/[.,]/}
  echo $((10#$t / 10000))
}

# PID's reaped children's CPU in centiseconds; with a second argument, its own too
# (then: what its parent gains when it reaps PID).
timing_cpu() {
  local s f t
  read -r s <"/proc/$1/stat"
  read -ra f <<<"${s##*) }" # f[0] is field 3 (state)
  t=$((f[13] + f[14]))
  [ -z "${2:-}" ] || t=$((t + f[11] + f[12]))
  echo $((t * 100 / timing_tck))
}

# The host's busy and total CPU ticks so far, all cores (/proc/stat's first line).
timing_host() {
  local _cpu u n s i w q sq st
  read -r _cpu u n s i w q sq st _ </proc/stat
  echo "$((u + n + s + q + sq + st)) $((u + n + s + i + w + q + sq + st))"
}

# The host's busy CPU so far, in centiseconds (every process: a row's "host" column is
# what the whole machine burned while that part ran, beside it or not).
timing_host_cs() {
  local busy _
  read -r busy _ < <(timing_host)
  echo $((busy * 100 / timing_tck))
}

timing_label=""
timing_counted=" "

# The CPU of background parts that ended since the last call, into timing_bg_cpu:
# bash reaps a background job when it ends, and its CPU then lands in this shell's
# cutime, in whatever section is running; it belongs to the part's own row.
timing_bg_ended() {
  local kind key cpu
  timing_bg_cpu=0
  while IFS='|' read -r kind key _ _ cpu _; do
    if [ "$kind" != bg ] || [[ $timing_counted == *" $key "* ]]; then continue; fi
    timing_counted+="$key "
    timing_bg_cpu=$((timing_bg_cpu + cpu))
  done <"$REGRADE_TIMING_FILE"
}

# Ends the current section (STATUS: why it ended, if not well).
timing_section_end() {
  [ -n "$timing_label" ] || return 0
  timing_bg_ended
  printf 'fg|%s|%s|%s|%s|%s\n' "$timing_label" $(($(timing_now) - timing_s0)) \
    $(($(timing_cpu $$) - timing_c0 - timing_bg_cpu)) "${1:-}" $(($(timing_host_cs) - timing_h0)) >>"$REGRADE_TIMING_FILE"
  timing_label=""
}

# Ends the current section and starts one called LABEL.
timing_section() {
  timing_section_end
  timing_bg_ended # ended before this section: not its CPU
  timing_label=$1
  timing_s0=$(timing_now)
  timing_c0=$(timing_cpu $$)
  timing_h0=$(timing_host_cs)
}

# KEY LABEL CMD...: runs CMD and records its wall and CPU in a row of its own; called
# in the background (`timing_bg ... &`), so its subshell's CPU is the part's.
timing_bg() {
  local key=$1 label=$2 me=$BASHPID t0 h0 rc=0 # BASHPID: this background subshell
  shift 2
  printf 'bgstart|%s|%s\n' "$key" "$label" >>"$REGRADE_TIMING_FILE"
  t0=$(timing_now)
  h0=$(timing_host_cs)
  "$@" || rc=$?
  printf 'bg|%s|%s|%s|%s|%s|%s\n' "$key" "$label" $(($(timing_now) - t0)) "$(timing_cpu "$me" own)" "$rc" \
    $(($(timing_host_cs) - h0)) >>"$REGRADE_TIMING_FILE"
  return "$rc"
}

timing_table() {
  local now host0 tot0 host tot
  now=$(timing_now)
  read -r host0 tot0 <<<"$timing_host0"
  read -r host tot < <(timing_host)
  printf '\n=== timings (m:ss.s; cpu: user+sys of what each part ran and waited for; host: the whole machine busy meanwhile)\n'
  awk -F'|' -v wall=$((now - timing_t0)) -v cpu=$(($(timing_cpu $$ own) - timing_c00)) \
    -v host=$(((host - host0) * 100 / timing_tck)) -v avail=$(((tot - tot0) * 100 / timing_tck)) '
    function ms(cs) { s = int(cs / 10 + 0.5) / 10; return sprintf("%d:%04.1f", int(s / 60), s - 60 * int(s / 60)) }
    function row(what, w, c, h, note) { printf "%-70.70s %7s %7s %7s  %s\n", what, w, c, h, note }
    BEGIN { row("part", "wall", "cpu", "host", "") }
    $1 == "fg" { row($2, ms($3), ms($4), ms($6), $5 == "" ? "" : "FAILED (exit " $5 ")") }
    $1 == "bgstart" { order[++n] = $2; label[$2] = $3 }
    $1 == "bg" { done[$2] = 1; w[$2] = $4; c[$2] = $5; rc[$2] = $6; h[$2] = $7 }
    END {
      for (i = 1; i <= n; i++) {
        k = order[i]
        if (k in done) row("[beside] " label[k], ms(w[k]), ms(c[k]), ms(h[k]), rc[k] == 0 ? "" : "FAILED (exit " rc[k] ")")
        else row("[beside] " label[k], "-", "-", "-", "did not finish")
      }
      row("total", ms(wall), ms(cpu), ms(host), sprintf("CPU/wall %.2f; host: the machine busy (every process) %s of %s CPU time",
        wall ? cpu / wall : 0, ms(host), ms(avail)))
    }' "$REGRADE_TIMING_FILE"
}

timing_exit() {
  local rc=$?
  timing_section_end "$([ "$rc" = 0 ] || echo "$rc")"
  if [ "$timing_owner" = 1 ]; then
    timing_table
    rm -f "$REGRADE_TIMING_FILE"
  fi
  return "$rc"
}

if [ -z "${REGRADE_TIMING_FILE:-}" ]; then
  REGRADE_TIMING_FILE=$(mktemp /tmp/regrade-timing.XXXXXX)
  export REGRADE_TIMING_FILE
  timing_owner=1
  timing_t0=$(timing_now)
  timing_c00=$(timing_cpu $$ own)
  timing_host0=$(timing_host)
else
  timing_owner=0
fi
trap timing_exit EXIT
