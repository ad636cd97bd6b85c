#!/usr/bin/env bash
# TEST CODE: deploy/docker/compose.yaml brought up the way a Docker user does, against
# the rig's real dockerd (rig.sh), with Debian's docker-compose (1.29, profiles
# included) and the images built from deploy/docker/*.Dockerfile with the static
# regrade (rig.sh up). rancher/k3s is replaced by the k3s stand-in (tests/rig): it runs
# a real embedded etcd (its /health on 127.0.0.65:2381) and its agent keeps the Node
# server-1 Ready in a real kube-apiserver with RBAC (the rig's harness), which stands
# for the cluster's API here (the image carries no kube-apiserver of its own: at full
# the stand-in only logs that it cannot start one; at etcd-only its port 6443 answers
# 503 as k3s's does). regrade talks to that API with the least-privilege
# kubeconfig deploy/docker/regrade-kubeconfig.sh writes, by host name (localhost, from
# /etc/hosts: the static build's resolver).
#
# Steps (each prints the k3s and regrade container IDs and the level):
#   1. `up -d` without the profile: k3s alone, at full (no level file).
#   2. `--profile regrade up -d`: regrade runs; k3s untouched.
#   3. fixture pressure: regrade steps k3s to control-plane, then etcd-only (a
#      restart: same container ID, same node password, API disabled); dockerd is
#      restarted on purpose while regrade waits for the Node after that restart, and
#      the restarted regrade finishes the step at etcd-only.
#   4. `up -d` again while stepped down: nothing changes.
#   5. `docker restart k3s`, then a dockerd restart: still etcd-only.
#   6. calm fixture: back up one level at a time (a restart into control-plane, then
#      full without one), same container, same node password.
# Every step is judged done by regrade's level record (no step under way), not by
# the containers' state.
#   7. the static build's host names: a name that is not in /etc/hosts is refused
#      with a message naming it, and nothing changes.
# Run by tests/docker/run.sh (REGRADE_TEST_DOCKER=1, root; under the rig lock when
# other rigs share the machine).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
t0=$SECONDS

if [ "${REGRADE_TEST_DOCKER:-}" != 1 ]; then
  echo "compose.sh: skipped: set REGRADE_TEST_DOCKER=1 (as root) to run the Compose example against a real dockerd"
  exit 0
fi

say() { printf 'compose.sh [%3ds] %s\n' "$((SECONDS - t0))" "$*"; }
fail() {
  say "FAILED: $*"
  diagnostics
  exit 1
}

rig_out="$(bash "$here/rig.sh" up)"
get() { sed -n "s/^$1=//p" <<<"$rig_out"; }
sock="$(get socket)"
export DOCKER_HOST="unix://$sock"
docker=(/usr/bin/docker -H "$DOCKER_HOST")
bin="$("$repo/tests/rig/build.sh" | tail -n 1)"
kubectl=("$bin/kubectl")

work="$(mktemp -d /tmp/regrade-compose.XXXXXX)"
harness_pid=""
etcd_pids=()
cleanup() {
  # Every step, whatever failed: a `wait` on a killed process is non-zero.
  set +e
  for p in "${etcd_pids[@]}"; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null; done
  (cd "$work" && docker-compose -p k3s -f compose.yaml -f compose.test.yaml --profile regrade down -v -t 5) >/dev/null 2>&1 || true
  [ -n "$harness_pid" ] && kill "$harness_pid" 2>/dev/null && wait "$harness_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

diagnostics() {
  say "--- docker ps -a"
  "${docker[@]}" ps -a || true
  for c in k3s regrade; do
    say "--- last lines of $c's log"
    "${docker[@]}" logs --tail 40 "$c" 2>&1 || true
  done
}

# --- The images: what they are built from and that they hold no C library.
k3s_image="$(get k3s_image)"
regrade_image="$(get regrade_image)"
for img in "$k3s_image" "$regrade_image"; do
  c="$("${docker[@]}" create "$img" /bin/regrade --version)"
  files="$("${docker[@]}" export "$c" | tar -t)"
  "${docker[@]}" rm "$c" >/dev/null
  say "image $img ($("${docker[@]}" image inspect -f '{{.Id}}' "$img" | cut -c8-19)): $(grep -v '/$' <<<"$files" | grep -v -E '^(\./)?(proc|sys|dev|etc/(hosts|hostname|resolv\.conf|mtab))' | tr '\n' ' ')"
  if grep -E '(^|/)(libc[.-][^/]*\.so|ld-linux[^/]*\.so|ld-musl[^/]*|libc\.musl[^/]*)' <<<"$files"; then
    fail "$img has a C library"
  fi
done
say "neither image has a C library"
say "static regrade in the k3s image: $("${docker[@]}" run --rm --entrypoint /bin/regrade "$k3s_image" --version)"

# --- The cluster's API: a real kube-apiserver with RBAC.
# It picks free ports, which another process can take first: up to three tries.
for try in 1 2 3; do
  "$bin/harness" run --bin-dir "$bin" >"$work/harness.out" 2>"$work/harness.err" &
  harness_pid=$!
  for _ in $(seq 1 240); do
    grep -q '^LOG=' "$work/harness.out" 2>/dev/null && break 2
    kill -0 "$harness_pid" 2>/dev/null || break
    sleep 0.5
  done
  wait "$harness_pid" 2>/dev/null || true
  harness_pid=""
  say "the kube harness exited (try $try): $(tail -n 1 "$work/harness.err")"
done
[ -n "$harness_pid" ] || fail "the kube harness did not start"
admin="$(head -n 1 "$work/harness.out")"

# --- The etcd the gate asks: three members on the host (127.0.0.51-53, client :2379,
# peer :2380) with TLS and client-certificate auth, as k3s runs etcd. The stand-in's
# own etcd is one member, and a gate that judged it would rightly refuse every
# restart of a lone voter (etcd-too-few-voters); this test is about the Docker path,
# and the gate's judgement of the member k3s restarts is tested in tests/testsuite/etcd_gate.rs
# and the three-server e2e test. regrade reads the certificates mounted at
# /etc/regrade/etcd (compose.test.yaml).
etcd_dir="$work/etcd"
mkdir -p "$etcd_dir"
ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
(
  cd "$etcd_dir"
  openssl req -x509 "${ec[@]}" -keyout server-ca.key -out server-ca.crt -days 2 -subj /CN=server-ca 2>/dev/null
  leaf() { # NAME SAN USAGE
    printf 'subjectAltName=%s\nextendedKeyUsage=%s\n' "$2" "$3" >"$1.ext"
    openssl req "${ec[@]}" -keyout "$1.key" -out "$1.csr" -subj "/CN=$1" 2>/dev/null
    openssl x509 -req -in "$1.csr" -CA server-ca.crt -CAkey server-ca.key -CAcreateserial -out "$1.crt" -days 2 \
      -extfile "$1.ext" 2>/dev/null
  }
  for n in 1 2 3; do leaf "server$n" "IP:127.0.0.5$n" serverAuth,clientAuth; done
  leaf client DNS:etcd-client clientAuth
)
initial="server-1-0c0e7c01=http://127.0.0.51:2380,server-2-0c0e7c02=http://127.0.0.52:2380,server-3-0c0e7c03=http://127.0.0.53:2380"
for n in 1 2 3; do
  "$bin/etcd" --name "server-$n-0c0e7c0$n" --data-dir "$etcd_dir/data$n" \
    --listen-client-urls "https://127.0.0.5$n:2379" --advertise-client-urls "https://127.0.0.5$n:2379" \
    --listen-peer-urls "http://127.0.0.5$n:2380" --initial-advertise-peer-urls "http://127.0.0.5$n:2380" \
    --initial-cluster "$initial" --initial-cluster-state new --initial-cluster-token compose \
    --client-cert-auth --trusted-ca-file "$etcd_dir/server-ca.crt" \
    --cert-file "$etcd_dir/server$n.crt" --key-file "$etcd_dir/server$n.key" \
    --log-level warn >"$etcd_dir/etcd$n.log" 2>&1 &
  etcd_pids+=($!)
done
etcd_ok() {
  curl -sf --cacert "$etcd_dir/server-ca.crt" --cert "$etcd_dir/client.crt" --key "$etcd_dir/client.key" \
    https://127.0.0.51:2379/health | grep -q '"health":"true"'
}
server="$(sed -n 's/^SERVER=//p' "$work/harness.out")"
port="${server##*:}"
kc() { "${kubectl[@]}" --kubeconfig "$admin" "$@"; }
say "kube-apiserver at $server"

# --- The Compose project directory: the repo's compose.yaml as it is, plus the test's
# own settings (the stand-in's k3s config, regrade's settings and fixture pressure).
cp "$repo/deploy/docker/compose.yaml" "$work/"
mkdir -p "$work/k3s" "$work/fixture"
echo "regrade-test-token" >"$work/k3s/token"
# The stand-in's agent registers server-1 in the harness (an admin kubeconfig, as the
# stand-in's tests use; regrade's own is the least-privilege one below).
kc config view --raw --minify --flatten >"$work/k3s/agent.kubeconfig"
cat >"$work/k3s/config.yaml" <<EOF
# TEST CODE: read by the k3s stand-in as k3s reads /etc/rancher/k3s/config.yaml.
node-ip: 127.0.0.65
etcd-health-addr: 127.0.0.65:2381
# The stand-in's own knobs (not k3s's): every port on the test's own address, as k3s
# would listen in a network of its own (k3s also listens on 127.0.0.1:2379 and starts
# its temporary etcd there); the host's network is shared with the suite's other rigs.
etcd-client-url: https://127.0.0.65:2379
temp-etcd-addr: 127.0.0.65
kubeconfig: /etc/rancher/k3s/agent.kubeconfig
node-lease-interval: 2s
node-status-interval: 2s
EOF
cat >"$work/regrade.toml" <<'EOF'
# TEST CODE: deploy/docker/regrade.toml with fixture pressure and short times.
step_up = "automatic"

[pressure]
metric = "some_avg10"
threshold = 40
calm_threshold = 10
sample_period = "1s"
sustain = "2s"
cooldown = "3s"
source = "/var/lib/regrade-fixture/pressure"
meminfo = "/var/lib/regrade-fixture/meminfo"

[cluster]
kubeconfig = "/etc/regrade/kubeconfig"
node_name = "server-1"
lease_duration = "10s"
request_timeout = "3s"

[docker]
container = "k3s"
stop_timeout = "10s"
etcd_health_url = "http://127.0.0.65:2381/health"
health_timeout = "90s"

[etcd]
endpoints = ["https://127.0.0.51:2379"]
ca_file = "/etc/regrade/etcd/server-ca.crt"
cert_file = "/etc/regrade/etcd/client.crt"
key_file = "/etc/regrade/etcd/client.key"
EOF
cat >"$work/compose.test.yaml" <<EOF
# TEST CODE: what the test adds to compose.yaml: the rig's dockerd socket in place of
# /var/run/docker.sock, and the fixture pressure files; k3s not privileged (the
# stand-in needs no capabilities, and this test machine's sandbox refuses a privileged
# container's full set: "unable to apply caps").
services:
  k3s:
    privileged: false
  regrade:
    volumes:
      - $sock:/var/run/docker.sock
      - ./fixture:/var/lib/regrade-fixture:ro
      - ./etcd:/etc/regrade/etcd:ro
EOF
# "over" needs both: pressure at or above the threshold and MemAvailable under the
# floor (512 MiB by default); "calm" needs both the other way (docs/behaviour.md).
# Written in place, never renamed over: regrade opens the pressure file once and
# re-reads that open file (as it does /proc/pressure/memory), so a new inode would go
# unseen.
pressure() { # SOME_AVG10 MEMAVAILABLE_KB
  printf 'MemTotal:       16000000 kB\nMemAvailable:   %8d kB\n' "$2" >"$work/fixture/meminfo"
  printf 'some avg10=%s avg60=%s avg300=0.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=1\n' "$1" "$1" \
    >"$work/fixture/pressure"
}
pressure 0.00 8000000

# regrade's kubeconfig: the ServiceAccount token deploy/rbac.yaml binds, written by the
# documented script. The server by name: the static regrade resolves localhost from
# the /etc/hosts Docker gives a host-network container (the harness's certificate
# names localhost).
KUBECTL="${kubectl[*]} --kubeconfig $admin" SERVER="https://localhost:$port" DURATION=1h \
  sh "$repo/deploy/docker/regrade-kubeconfig.sh" "$work/regrade.kubeconfig"
rk() { "${kubectl[@]}" --kubeconfig "$work/regrade.kubeconfig" "$@"; }
[ "$(rk auth can-i patch nodes)" = yes ] || fail "regrade's kubeconfig cannot patch nodes"
if rk auth can-i list secrets -A >/dev/null 2>&1 || rk auth can-i create pods >/dev/null 2>&1; then
  fail "regrade's kubeconfig has rights beyond deploy/rbac.yaml"
fi
say "regrade's kubeconfig: $(rk auth whoami -o 'jsonpath={.status.userInfo.username}' 2>/dev/null || echo ServiceAccount) — can patch nodes, cannot list secrets or create pods"

compose() { (cd "$work" && docker-compose -p k3s -f compose.yaml -f compose.test.yaml "$@"); }
# What an earlier, interrupted run may have left (same project name, same volumes).
compose --profile regrade down -v -t 1 >/dev/null 2>&1 || true

id_of() { "${docker[@]}" inspect -f '{{.Id}}' "$1" 2>/dev/null | cut -c1-12 || true; }
started_at() { "${docker[@]}" inspect -f '{{.State.StartedAt}}' "$1"; }
in_k3s() { "${docker[@]}" exec k3s cat "$1" 2>/dev/null || true; }
started_level() { in_k3s /run/regrade/started-level | tr -d '\n'; }
level_file() { in_k3s /var/lib/rancher/k3s/regrade-level | tr -d '\n'; }
api_disabled() { in_k3s /run/k3s-standin/flags.json | grep -q '"disable-apiserver": true' && echo yes || echo no; }
node_password() { in_k3s /var/lib/rancher/k3s/agent/node-password; }
show() { # STEP
  say "$1: k3s=$(id_of k3s) regrade=$(id_of regrade) started-level=$(started_level) level-file=$(level_file) apiserver-disabled=$(api_disabled) k3s-started=$(started_at k3s 2>/dev/null || echo -)"
}
wait_for() { # SECONDS WHAT CMD...
  local n="$1" what="$2"
  shift 2
  for _ in $(seq 1 "$((n * 2))"); do
    "$@" && return 0
    sleep 0.5
  done
  fail "no $what within $n s"
}
level_is() { [ "$(started_level)" = "$1" ] && [ "$(level_file)" = "${2:-$1}" ]; }
node_ready() {
  kc get node server-1 -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -qx True
}
healthy() { curl -sf http://127.0.0.65:2381/health >/dev/null; }
logs_of() { "${docker[@]}" logs "$1" 2>&1; }
running() { [ "$("${docker[@]}" inspect -f '{{.State.Running}}' "$1" 2>/dev/null)" = true ]; }
both_running() { running k3s && running regrade; }
# regrade's level record, on its state volume (the image has no shell to read it by).
record() { cat "$("${docker[@]}" volume inspect -f '{{.Mountpoint}}' k3s_regrade-state)/level.json" 2>/dev/null; }
record_brief() { record | tr -d ' \n' | grep -oE '"level":"[a-z-]+"|"phase":"[a-z-]+"' | tr '\n' ' '; }
# Settled: regrade's level record at LEVEL with no step under way.
settled() {
  local r
  r="$(record)" || return 1
  grep -q "\"level\": \"$1\"" <<<"$r" && ! grep -q '"step"' <<<"$r"
}
# Settled at LEVEL, or already in the next step from it.
at_or_past() { settled "$1" || record | grep -q "\"from\": \"$1\""; }
# What regrade decided at its last start about its level record and the world.
last_decision() { logs_of regrade | grep 'the level record and the world' | tail -n 1 | sed 's/.*decision=//'; }
# In the step to LEVEL, k3s restarted, etcd healthy, the Node awaited.
waiting_for_node() {
  record | grep -q '"phase": "restarting"' &&
    logs_of regrade | grep 'etcd is healthy after the restart' | grep -q "level=$1"
}

wait_for 30 "the gate's three-member etcd" etcd_ok
say "the gate's etcd: three members on 127.0.0.51-53"

# 1. k3s alone.
compose up -d
wait_for 60 "etcd health from k3s" healthy
wait_for 60 "Ready Node server-1" node_ready
[ -z "$(id_of regrade)" ] || fail "regrade runs without its profile"
[ "$(started_level)" = full ] || fail "k3s did not start at full"
[ "$(api_disabled)" = no ] || fail "k3s started with its API server disabled"
k3s_id="$(id_of k3s)"
password="$(node_password)"
[ -n "$password" ] || fail "no node password"
show "1. up -d (no profile)"

# 2. regrade next to it.
before="$(started_at k3s)"
compose --profile regrade up -d
wait_for 30 "running regrade container" sh -c "[ \"\$(${docker[*]} inspect -f '{{.State.Running}}' regrade 2>/dev/null)\" = true ]"
[ "$(id_of k3s)" = "$k3s_id" ] && [ "$(started_at k3s)" = "$before" ] || fail "bringing up regrade touched k3s"
regrade_id="$(id_of regrade)"
sleep 3
[ "$(started_level)" = full ] || fail "regrade stepped k3s without pressure"
show "2. --profile regrade up -d"

# 3. Pressure: one level at a time, down to etcd-only. Each step is judged done by
# regrade's own level record (no step under way, at the level), never by the
# container's state: after a restart regrade still waits for etcd and a Ready Node.
# The step to etcd-only is disrupted on purpose while regrade waits for the Node: the
# stand-in's agent is held Ready=False (its not-ready knob) until dockerd has been
# restarted, which restarts both containers; the restarted regrade must finish the
# step at etcd-only (the record's phase says k3s was restarted for it).
touch "$work/k3s/standin-not-ready"
pressure 80.00 200000
say "fixture pressure: some avg10=80, MemAvailable 195 MiB; the Node is held Ready=False"
wait_for 60 "regrade settled at control-plane" at_or_past control-plane
[ "$(started_at k3s)" = "$before" ] || fail "the step to control-plane restarted k3s"
show "3a. stepped to control-plane (no restart)"
wait_for 120 "regrade waiting for the Node after restarting k3s into etcd-only" waiting_for_node etcd-only
say "3b. regrade is in the step to etcd-only, waiting for the Node: $(record_brief); $(logs_of regrade | grep -c 'restarting the k3s container') restart(s) asked"
restarts_before="$(logs_of regrade | grep -c 'restarting the k3s container')"
bash "$here/rig.sh" restart-dockerd
say "3c. dockerd restarted in the middle of the step"
wait_for 90 "both containers running after the dockerd restart" both_running
rm -f "$work/k3s/standin-not-ready"
wait_for 120 "regrade settled at etcd-only after the dockerd restart" settled etcd-only
level_is etcd-only || fail "the record says etcd-only, but k3s started at $(started_level) with level file $(level_file)"
decision="$(last_decision)"
say "3d. the restarted regrade decided: $decision"
grep -q 'finish the step control-plane -> etcd-only interrupted at restarting' <<<"$decision" ||
  fail "the restarted regrade did not finish the interrupted step: $decision"
[ "$(logs_of regrade | grep -c 'restarting the k3s container')" = "$restarts_before" ] ||
  fail "the resumed step restarted k3s again (the dockerd restart had restarted it with etcd-only's flags)"
show "3e. the interrupted step finished at etcd-only"
[ "$(id_of k3s)" = "$k3s_id" ] || fail "k3s was recreated: $(id_of k3s), was $k3s_id"
[ "$(started_at k3s)" != "$before" ] || fail "k3s was not restarted for etcd-only"
[ "$(node_password)" = "$password" ] || fail "the node password changed"
[ "$(api_disabled)" = yes ] || fail "k3s at etcd-only runs its API server"
node_ready || fail "regrade finished the step without a Ready Node"
say "Node server-1: Ready=True, regrade.dev/level=$(kc get node server-1 -o 'jsonpath={.metadata.labels.regrade\.dev/level}')"
regrade_id="$(id_of regrade)"

# 4. Compose again while stepped down: nothing changes (a window of 2 s in which
# nothing may happen: there is no event to wait for).
stepped="$(started_at k3s)"
compose --profile regrade up -d
sleep 2
[ "$(id_of k3s)" = "$k3s_id" ] && [ "$(started_at k3s)" = "$stepped" ] || fail "up -d recreated or restarted k3s"
[ "$(id_of regrade)" = "$regrade_id" ] || fail "up -d recreated regrade"
level_is etcd-only || fail "up -d changed the level"
[ "$(api_disabled)" = yes ] || fail "after up -d k3s runs its API server"
show "4. up -d again while at etcd-only"

# 5. docker restart, then a dockerd restart, with regrade at rest: the level holds.
"${docker[@]}" restart k3s >/dev/null
wait_for 60 "etcd health after docker restart" healthy
wait_for 30 "the started-level record after docker restart" level_is etcd-only
[ "$(api_disabled)" = yes ] || fail "docker restart lost the level"
[ "$(id_of k3s)" = "$k3s_id" ] || fail "docker restart changed the container"
show "5a. docker restart k3s"
starts="$(logs_of regrade | grep -c 'the level record and the world')"
bash "$here/rig.sh" restart-dockerd
wait_for 90 "both containers running after the dockerd restart" both_running
wait_for 60 "regrade's start-up decision after the dockerd restart" \
  sh -c "[ \"\$(${docker[*]} logs regrade 2>&1 | grep -c 'the level record and the world')\" -gt $starts ]"
wait_for 60 "regrade settled at etcd-only" settled etcd-only
wait_for 60 "etcd health after the dockerd restart" healthy
level_is etcd-only || fail "the dockerd restart lost the level"
[ "$(api_disabled)" = yes ] || fail "after the dockerd restart k3s runs its API server"
[ "$(id_of k3s)" = "$k3s_id" ] && [ "$(id_of regrade)" = "$regrade_id" ] || fail "the dockerd restart changed a container"
show "5b. dockerd restarted; regrade decided: $(last_decision)"

# 6. Calm: back up, one level at a time: etcd-only -> control-plane (a restart into
# full's flags), then control-plane -> full (no restart), in that order.
pressure 0.00 8000000
say "fixture pressure: some avg10=0, MemAvailable 7812 MiB"
ups_before="$(logs_of regrade | grep -cE 'stepping level=[a-z-]+ to=[a-z-]+')"
wait_for 180 "regrade settled at full" settled full
level_is control-plane full || fail "at full, but k3s started at $(started_level) with level file $(level_file)"
ups="$(logs_of regrade | grep -oE 'stepping level=[a-z-]+ to=[a-z-]+' | tail -n +"$((ups_before + 1))" | tr '\n' ';')"
[ "$ups" = "stepping level=etcd-only to=control-plane;stepping level=control-plane to=full;" ] ||
  fail "not one level at a time on the way up: $ups"
show "6. stepped up to control-plane (restarted), then to full (no restart)"
# The natural wait after a restart, read from regrade's log: the restart asked, etcd
# healthy, the Node Ready on a fresh heartbeat.
logs_of regrade | grep -E 'restarting the k3s container|etcd is healthy after the restart|the Node is Ready on a heartbeat' |
  tail -n 3 | sed 's/^/    regrade: /'
node_ready || fail "at full without a Ready Node"
[ "$(id_of k3s)" = "$k3s_id" ] || fail "k3s was recreated on the way up"
[ "$(node_password)" = "$password" ] || fail "the node password changed on the way up"
[ "$(api_disabled)" = no ] || fail "k3s at full runs without its API server"
label="$(kc get node server-1 -o 'jsonpath={.metadata.labels.regrade\.dev/level}')"
[ -z "$label" ] || fail "the Node still carries regrade.dev/level=$label at full"
say "6. Node server-1: Ready=True, no regrade.dev/level label"
logs_of regrade | grep -E 'step (started|done)|stepped' | tail -n 8 | sed 's/^/    regrade: /' || true

# 7. A static build looks host names up in /etc/hosts and DNS only: a name it cannot
# resolve is refused, naming it. No network (nothing leaves), the real Docker socket.
sed "s#server: .*#server: https://k3s-api.invalid:6443#" "$work/regrade.kubeconfig" >"$work/bad.kubeconfig"
before="$(started_at k3s)"
set +e
out="$("${docker[@]}" run --rm --network none -v "$sock:/var/run/docker.sock" \
  -v "$work/regrade.toml:/etc/regrade/regrade.toml:ro" -v "$work/bad.kubeconfig:/etc/regrade/kubeconfig:ro" \
  "$regrade_image" step down 2>&1)"
rc=$?
set -e
say "7. regrade step down with server https://k3s-api.invalid:6443 (exit $rc): $(tail -n 2 <<<"$out")"
[ "$rc" != 0 ] || fail "a step with an unresolvable API server succeeded"
grep -q 'k3s-api.invalid' <<<"$out" && grep -q 'statically linked' <<<"$out" || fail "the refusal does not say why the name did not resolve"
level_is control-plane full && [ "$(started_at k3s)" = "$before" ] || fail "the refused step changed k3s"
show "7. refused, unchanged"

say "PASSED in $((SECONDS - t0)) s"
