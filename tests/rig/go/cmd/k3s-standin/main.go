// Command k3s-standin is TEST CODE: a stand-in for a k3s *server* process, for
// regrade's tests on machines where k3s itself cannot be had. Read against k3s's own
// sources (pkg/etcd, pkg/cli/server, pkg/cluster/bootstrap.go, pkg/agent,
// pkg/configfilearg); each point says whether it is imitated.
//
// Imitated:
//   - Config: reads CONFIG_DIR/config.yaml, then CONFIG_DIR/config.yaml.d/*.yaml in
//     alphabetical order (also when config.yaml is absent). Each file is a YAML map
//     of flag name -> value (bool, string, number or list). A later file's value
//     replaces an earlier one; a key written "name+" appends to a list. The merged
//     values become --flags placed before the command-line flags, so the command
//     line wins. Keys the stand-in does not know are ignored with a warning and
//     listed in the report ("unknown_config_keys").
//   - etcd: always runs an embedded etcd member (go.etcd.io/etcd/server/v3/embed),
//     data in DATA_DIR/server/db/etcd, so a restart keeps the member ID.
//   - etcd's client port: TLS with client-certificate auth on https://127.0.0.1:2379
//     and https://NODE_IP:2379 (the node IP's advertised); peer port TLS with
//     client-cert auth on https://NODE_IP:2380. Certificates under
//     DATA_DIR/server/tls/etcd/ with k3s's names (server-ca, server-client, client,
//     peer-ca, peer-server-client .crt/.key); see etcdtls.go.
//   - Member names "<node>-<8 hex>", chosen once and kept in DATA_DIR/server/db/etcd/name.
//   - /health (and /readyz, /livez, /metrics) without TLS on 127.0.0.1:2381 only,
//     like k3s's etcd metrics listener.
//   - Start: a member initialised before is first reconciled through a temporary
//     etcd on a copy of its data dir (127.0.0.1:2399, force-new-cluster), as k3s's
//     bootstrap reconcile does on a server without a join URL (the first, cluster-init
//     server) or whose join URL does not answer /v1-k3s/server-bootstrap within 15 s
//     (pkg/cluster/bootstrap.go); a server whose join URL answers skips it in k3s,
//     here never (NOT imitated: the stand-in serves no /v1-k3s; its start costs what
//     the first server's costs). etcd as k3s configures it (etcd.go, asK3sRunsIt):
//     heartbeat 500 ms, election 5 s, the initial corruption check (the whole db read
//     and hashed before serving), and no defragment of its own at start since
//     k3s#14099: etcd's bootstrap defragment, only when it frees 100 MB or more.
//     Until 2026-12 the stand-in defragmented at every start and ran etcd's default
//     100 ms / 1 s raft timing: both made its starts and its elections under a
//     thrash costlier than k3s's.
//   - API server: unless disable-apiserver, supervises a kube-apiserver binary
//     against the local etcd (TLS, etcd's client cert) on BIND:6443. With
//     disable-apiserver, port 6443 still answers (TLS), every request with HTTP 503
//     and body "apiserver disabled". Not k3s: the test knob standin-no-apiserver
//     does the same at every level, for rigs whose API server is the harness's.
//   - sd_notify READY=1 as pkg/cli/server sends it: once its own API server is ready
//     (unless disabled) and its own etcd is ready. At etcd-only that is etcd alone,
//     as k3s >= 1.22 does: no other server's API is waited for.
//   - Without its own API server, exit 1 when no API server (the kubeconfig's or a
//     "server" URL) has answered for 15 minutes (apiserver-wait-timeout; shorter
//     in tests), as an etcd-only k3s was seen to do; systemd restarts it.
//   - Agent: unless disable-agent, and given a kubeconfig, keeps a Node (labels
//     node-role.kubernetes.io/etcd=true always; control-plane=true and
//     master=true set only while the API server is enabled, as k3s's
//     setNodeLabelsAndAnnotations does; never removed; annotations
//     etcd.k3s.cattle.io/node-name and node-address), its Lease in kube-node-lease
//     renewed every 10 s from the start, its Ready condition with
//     lastHeartbeatTime — first Ready=False (KubeletNotReady, as a restarted
//     kubelet reports before its runtime check), Ready=True from
//     kubelet-ready-delay (5 s) on — and the Secret kube-system/<node>.node-password.k3s.
//     Real k3s after a restart: its embedded kubelet posts Ready=False
//     (KubeletNotReady, "container runtime network not ready ... cni plugin not
//     initialized") until containerd's CRI answers and flannel has written its CNI
//     config, which needs the agent connected to an API server (through the
//     client-side load balancer; at etcd-only, another server's): typically 10-30 s
//     on a small host, longer under memory pressure. The delay here is fixed and
//     short; the not-ready knob below holds it for as long as a test needs.
//   - OOM score (kubelet-oom-score-adj, off unless set; the VM lane sets -999): k3s's
//     embedded kubelet sets oom_score_adj -999 on the k3s process once it runs, which
//     needs an API server; here once the agent has registered its Node, on the
//     stand-in and its kube-apiserver.
//   - kubelet-arg (the stand-in runs no kubelet): the kubelet's arguments as k3s's
//     agent builds them, in the report's "kubelet": k3s's defaults (none here) with
//     each kubelet-arg in order (pkg/util/args.go GetArgs: `key=value` adds a value,
//     `key+=` appends, `key-=` prepends; a key given again adds another argument,
//     all of a key's kept in order), then parsed as the kubelet parses its command
//     line: the last value of a flag wins, except the map flags (system-reserved,
//     kube-reserved, eviction-hard, eviction-soft, eviction-minimum-reclaim), whose
//     values merge key by key with the later one winning (component-base's
//     MapStringString).
//   - EtcdIsVoter: the etcd leader writes it on every etcd Node every 15 s when it
//     changes (or is 5 min old): True MemberNotLearner, False MemberIsLearner or
//     NotAMember, as k3s's member controller does.
//
// NOT imitated: no kubelet, containerd, flannel, kube-proxy, controller-manager,
// scheduler or addons (disable-controller-manager and disable-scheduler are only
// recorded); no join tokens or bootstrap data (the etcd CAs are seeded into each
// data dir by the test instead, missing ones generated); no joining through member
// add as a learner and no learner promotion: cluster membership is static (below);
// no client-side load balancer (the agent fails over between the kubeconfig's server
// and the "server" URLs); no hiding of its arguments, no k3s.yaml; no etcd
// snapshots. The node-password Secret holds sha256 of a random password kept in
// DATA_DIR/agent/node-password, not k3s's hash format. Node authorization is
// whatever the kubeconfig has (tests pass an admin kubeconfig).
//
// Cluster mode (design of this stand-in, not k3s's): give each member
//
//	node-name, node-ip (its own address, in a network namespace of its own)
//	etcd-initial-cluster: "a-1a2b3c4d=https://10.0.0.1:2380,b-...=https://10.0.0.2:2380,..."
//
// The entry "<node-name>-<8 hex>" there becomes this member's name (k3s picks the
// hex at random; a static cluster must know every name in advance). Peer URL
// https://NODE_IP:2380 unless etcd-peer-url says otherwise. Single-member mode (the
// default) is initial cluster NAME=PEER_URL with a random name.
// Sharing one network namespace (the systemd tests): etcd-client-url and
// etcd-health-addr move the client port and /health to the node IP.
//
// Test knobs: health-delay (/health answers 503 until that long after start);
// temp-etcd-addr (the temporary etcd's address, 127.0.0.1 as in k3s by default);
// kubelet-ready-delay; apiserver-wait-timeout;
// file CONFIG_DIR/standin-fail-next-start: deleted, then exit 1 at once;
// file CONFIG_DIR/standin-never-healthy: /health answers 503 while it exists;
// file CONFIG_DIR/standin-not-ready: the agent posts Ready=False while it exists (a
// kubelet whose runtime or network is not up), its node Lease still renewed;
// file CONFIG_DIR/standin-kill-etcd: the etcd member stops (ports closed) while the
// agent keeps the Node Ready and its Lease fresh, until the next start without it.
//
// Usage: k3s-standin [server] [--flag=value ...]; run with -h for the flags.
// The effective flags are written as JSON to --report-file and logged.
package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.etcd.io/etcd/server/v3/etcdserver/api/etcdhttp"
	coordv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"

	"regrade.test/rig/internal/kube"
)

// listFlag is a repeatable flag; values may also be comma-separated. The first
// Set after reset() (i.e. on the command line) replaces the config files' list.
type listFlag struct {
	vals  []string
	fresh bool
}

func (l *listFlag) String() string { return strings.Join(l.vals, ",") }
func (l *listFlag) Set(v string) error {
	if l.fresh {
		l.vals, l.fresh = nil, false
	}
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			l.vals = append(l.vals, s)
		}
	}
	return nil
}

var (
	fs            = flag.NewFlagSet("k3s-standin", flag.ExitOnError)
	configDir     = fs.String("config-dir", envOr("K3S_STANDIN_CONFIG_DIR", "/etc/rancher/k3s"), "dir with config.yaml and config.yaml.d/ (command line or env only)")
	reportFile    = fs.String("report-file", "/run/k3s-standin/flags.json", "where the effective flags are written as JSON")
	dataDir       = fs.String("data-dir", "/var/lib/rancher/k3s", "k3s data dir; etcd data in DATA_DIR/server/db/etcd")
	nodeName      = fs.String("node-name", envOr("K3S_NODE_NAME", hostname()), "node and etcd member name")
	nodeIP        = fs.String("node-ip", "127.0.0.1", "this server's address")
	etcdClientURL = fs.String("etcd-client-url", "", "etcd client URLs to listen on, comma-separated; the first is advertised (default https://127.0.0.1:2379,https://NODE_IP:2379, advertising the node IP's)")
	etcdPeerURL   = fs.String("etcd-peer-url", "", "etcd peer URL (default https://NODE_IP:2380)")
	etcdCluster   = fs.String("etcd-initial-cluster", "", "etcd initial cluster, name=peerURL,... (default: this member only)")
	etcdState     = fs.String("etcd-initial-cluster-state", "new", "new or existing")
	healthAddr    = fs.String("etcd-health-addr", "127.0.0.1:2381", "where /health is served (plain http)")
	tempEtcdAddr  = fs.String("temp-etcd-addr", "127.0.0.1", "test knob: where the start's temporary etcd listens (k3s: 127.0.0.1), so stand-ins sharing the host's network can start at once")
	healthDelay   = fs.Duration("health-delay", 0, "test knob: /health answers 503 until this long after start")
	failFile      = fs.String("fail-next-start-file", "", "test knob file (default CONFIG_DIR/standin-fail-next-start)")
	neverFile     = fs.String("never-healthy-file", "", "test knob file (default CONFIG_DIR/standin-never-healthy)")
	notReadyFile  = fs.String("not-ready-file", "", "test knob file (default CONFIG_DIR/standin-not-ready)")
	killEtcdFile  = fs.String("kill-etcd-file", "", "test knob file (default CONFIG_DIR/standin-kill-etcd)")
	disableAPI    = fs.Bool("disable-apiserver", false, "do not run kube-apiserver; port answers 503")
	noAPIServer   = fs.Bool("standin-no-apiserver", false, "test knob: run no kube-apiserver at any level (another serves the API, the kubeconfig's), as disable-apiserver does, without setting regrade's level key")
	disableAgent  = fs.Bool("disable-agent", false, "do not keep the Node, its Lease and node-password Secret")
	_             = fs.Bool("disable-controller-manager", false, "recorded only")
	_             = fs.Bool("disable-scheduler", false, "recorded only")
	_             = fs.Bool("cluster-init", false, "recorded only")
	_             = fs.String("token", "", "recorded only")
	_             = fs.String("token-file", "", "recorded only")
	bindAddr      = fs.String("bind-address", "", "API listen address (default NODE_IP)")
	advertiseAddr = fs.String("advertise-address", "", "API advertise address (default NODE_IP)")
	apiPort       = fs.Int("https-listen-port", 6443, "API port")
	certDir       = fs.String("cert-dir", "", "API certs (see internal/kube; missing files are generated; default DATA_DIR/server/tls)")
	apiserverBin  = fs.String("kube-apiserver-bin", "", "kube-apiserver binary (default: next to this executable)")
	kubeconfig    = fs.String("kubeconfig", "", "kubeconfig for the agent (no kubeconfig: no agent)")
	leaseEvery    = fs.Duration("node-lease-interval", 10*time.Second, "node Lease renew interval")
	readyDelay    = fs.Duration("kubelet-ready-delay", 5*time.Second, "after a start, the Node is Ready=False this long (a kubelet's runtime check)")
	apiWait       = fs.Duration("apiserver-wait-timeout", 15*time.Minute, "without its own API server, exit 1 when no API server answered for this long")
	statusEvery   = fs.Duration("node-status-interval", time.Minute, "Node Ready heartbeat interval")
	kubeletOOMAdj = fs.Int("kubelet-oom-score-adj", 0, "once the agent has registered its Node, set this oom_score_adj on this process and its kube-apiserver (real k3s: -999, which its embedded kubelet sets on the k3s process; 0: leave it)")
	servers       = &listFlag{}
	_             = fs.String("write-kubeconfig-mode", "", "recorded only")
)

func init() {
	fs.Var(servers, "server", "other servers' API URLs (agent failover and READY check)")
	for _, n := range []string{"node-label", "node-taint", "tls-san", "disable", "etcd-arg", "kube-apiserver-arg", "kubelet-arg"} {
		fs.Var(&listFlag{}, n, "recorded only")
	}
}

func envOr(k, d string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return d
}

func hostname() string { h, _ := os.Hostname(); return h }

func must(err error, what string) {
	if err != nil {
		log.Fatalf("k3s-standin: %s: %v", what, err)
	}
}

// loadConfig merges the config files the way k3s does and returns them as args.
func loadConfig(dir string) (files []string, merged map[string][]string, unknown []string, args []string) {
	merged = map[string][]string{}
	if _, err := os.Stat(filepath.Join(dir, "config.yaml")); err == nil {
		files = append(files, filepath.Join(dir, "config.yaml"))
	}
	dropins, _ := filepath.Glob(filepath.Join(dir, "config.yaml.d", "*.yaml"))
	sort.Strings(dropins)
	files = append(files, dropins...)
	var order []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		must(err, "read config")
		m := map[string]any{}
		must(yaml.Unmarshal(b, &m), "parse "+f)
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			appendTo := strings.HasSuffix(k, "+")
			name := strings.TrimPrefix(strings.TrimSuffix(k, "+"), "--")
			var vals []string
			switch v := m[k].(type) {
			case []any:
				for _, e := range v {
					vals = append(vals, scalar(e))
				}
			default:
				vals = []string{scalar(v)}
			}
			if _, seen := merged[name]; !seen {
				order = append(order, name)
			}
			if appendTo {
				merged[name] = append(merged[name], vals...)
			} else {
				merged[name] = vals
			}
		}
	}
	for _, name := range order {
		if fs.Lookup(name) == nil || name == "config-dir" {
			unknown = append(unknown, name)
			continue
		}
		for _, v := range merged[name] {
			args = append(args, "--"+name+"="+v)
		}
	}
	return
}

func scalar(v any) string {
	switch x := v.(type) {
	case nil:
		return ""
	case string:
		return x
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64)
	default:
		return fmt.Sprint(x)
	}
}

func main() {
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	started := time.Now()
	cli := os.Args[1:]
	if len(cli) > 0 && cli[0] == "server" {
		cli = cli[1:]
	}
	// config-dir must be known before the files are read.
	for i, a := range cli {
		if v, ok := strings.CutPrefix(strings.TrimLeft(a, "-"), "config-dir="); ok && strings.HasPrefix(a, "-") {
			*configDir = v
		} else if (a == "--config-dir" || a == "-config-dir") && i+1 < len(cli) {
			*configDir = cli[i+1]
		}
	}
	files, merged, unknown, cfgArgs := loadConfig(*configDir)
	for _, k := range unknown {
		log.Printf("k3s-standin: warning: ignoring unknown config key %q", k)
	}
	must(fs.Parse(cfgArgs), "config files")
	fs.VisitAll(func(f *flag.Flag) {
		if l, ok := f.Value.(*listFlag); ok {
			l.fresh = true
		}
	})
	must(fs.Parse(cli), "command line")
	if fs.NArg() > 0 {
		log.Fatalf("k3s-standin: unexpected arguments %q", fs.Args())
	}
	def := func(p *string, v string) {
		if *p == "" {
			*p = v
		}
	}
	def(failFile, filepath.Join(*configDir, "standin-fail-next-start"))
	def(neverFile, filepath.Join(*configDir, "standin-never-healthy"))
	def(notReadyFile, filepath.Join(*configDir, "standin-not-ready"))
	def(killEtcdFile, filepath.Join(*configDir, "standin-kill-etcd"))
	listenClient, advertiseClient := defaultClientURLs(*nodeIP)
	if *etcdClientURL != "" {
		listenClient, advertiseClient, _ = strings.Cut(*etcdClientURL+",", ",")
		listenClient, advertiseClient = *etcdClientURL, listenClient
	}
	def(etcdPeerURL, "https://"+net.JoinHostPort(*nodeIP, "2380"))
	dbDir := filepath.Join(*dataDir, "server", "db", "etcd")
	name, err := memberName(dbDir, *nodeName, *etcdCluster)
	must(err, "etcd member name")
	def(etcdCluster, name+"="+*etcdPeerURL)
	etcdTLS := filepath.Join(*dataDir, "server", "tls", "etcd")
	def(bindAddr, *nodeIP)
	def(advertiseAddr, *nodeIP)
	def(certDir, filepath.Join(*dataDir, "server", "tls"))
	if self, err := os.Executable(); err == nil {
		def(apiserverBin, filepath.Join(filepath.Dir(self), "kube-apiserver"))
	}

	if _, err := os.Stat(*failFile); err == nil {
		os.Remove(*failFile)
		log.Printf("k3s-standin: %s existed: removed it, failing this start", *failFile)
		os.Exit(1)
	}
	writeReport(started, files, merged, unknown, append(cfgArgs, cli...))

	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()

	// etcd, as k3s runs it: TLS with client-cert auth on both ports, certificates
	// under server/tls/etcd/, after the temporary-etcd reconcile of a known member.
	must(ensureEtcdCerts(etcdTLS, []string{*nodeIP, *nodeName}), "etcd certs")
	reconcileWithTemporaryEtcd(dbDir, name)
	cfg := embed.NewConfig()
	cfg.Name, cfg.Dir = name, dbDir
	lcu, err := urls(listenClient)
	must(err, "etcd-client-url")
	acu, err := urls(advertiseClient)
	must(err, "etcd-client-url")
	pu, err := url.Parse(*etcdPeerURL)
	must(err, "etcd-peer-url")
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = lcu, acu
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*pu}, []url.URL{*pu}
	cfg.InitialCluster, cfg.ClusterState, cfg.InitialClusterToken = *etcdCluster, *etcdState, "k3s-standin"
	tlsFile := func(f string) string { return filepath.Join(etcdTLS, f) }
	cfg.ClientTLSInfo.CertFile, cfg.ClientTLSInfo.KeyFile = tlsFile(etcdServing), tlsFile(etcdServingKey)
	cfg.ClientTLSInfo.TrustedCAFile, cfg.ClientTLSInfo.ClientCertAuth = tlsFile(etcdServerCA), true
	cfg.PeerTLSInfo.CertFile, cfg.PeerTLSInfo.KeyFile = tlsFile(etcdPeer), tlsFile(etcdPeerKey)
	cfg.PeerTLSInfo.TrustedCAFile, cfg.PeerTLSInfo.ClientCertAuth = tlsFile(etcdPeerCA), true
	cfg.LogLevel = "warn"
	asK3sRunsIt(cfg)
	must(os.MkdirAll(cfg.Dir, 0o700), "data dir")
	e, err := embed.StartEtcd(cfg)
	must(err, "start etcd")
	defer e.Close()
	log.Printf("k3s-standin: etcd member %s starting (data %s, client %s, peer %s)", cfg.Name, cfg.Dir, listenClient, pu)

	// /health, gated by the test knobs.
	mux := http.NewServeMux()
	etcdhttp.HandleMetrics(mux)
	etcdhttp.HandleHealth(e.GetLogger(), mux, e.Server)
	gate := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reason := ""
		if time.Since(started) < *healthDelay {
			reason = "k3s-standin health-delay"
		} else if _, err := os.Stat(*neverFile); err == nil {
			reason = "k3s-standin never-healthy knob"
		}
		if reason != "" && r.URL.Path != "/metrics" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintf(w, `{"health":"false","reason":%q}`, reason)
			return
		}
		mux.ServeHTTP(w, r)
	})
	hl, err := net.Listen("tcp", *healthAddr)
	must(err, "listen "+*healthAddr)
	go http.Serve(hl, gate)

	etcdReady := make(chan struct{})
	go func() {
		select {
		case <-e.Server.ReadyNotify():
			log.Printf("k3s-standin: etcd member %s ready (id %x)", cfg.Name, uint64(e.Server.MemberID()))
			close(etcdReady)
		case <-ctx.Done():
		}
	}()

	// API server, or the 503 stand-in for it.
	apiHost := *bindAddr
	if ip := net.ParseIP(apiHost); ip != nil && ip.IsUnspecified() {
		apiHost = *nodeIP
	}
	localAPI := "https://" + net.JoinHostPort(apiHost, strconv.Itoa(*apiPort))
	must(kube.EnsureCerts(*certDir, []string{*nodeIP, apiHost, *advertiseAddr}), "certs")
	must(kube.WriteAdminKubeconfig(filepath.Join(*certDir, "admin.kubeconfig"), *certDir, localAPI), "admin kubeconfig")
	apiDone := make(chan struct{})
	if withoutAPIServer() {
		close(apiDone)
		go serveDisabled(net.JoinHostPort(*bindAddr, strconv.Itoa(*apiPort)))
	} else {
		go func() {
			defer close(apiDone)
			select {
			case <-etcdReady:
			case <-ctx.Done():
				return
			}
			// Through the first client URL (127.0.0.1 by default), with etcd's client cert.
			args := kube.APIServerArgs(*certDir, lcu[0].String(), *bindAddr, *apiPort, *advertiseAddr)
			args = append(args, "--etcd-cafile="+tlsFile(etcdServerCA), "--etcd-certfile="+tlsFile(etcdClient), "--etcd-keyfile="+tlsFile(etcdClientKey))
			superviseAPIServer(ctx, args)
		}()
	}

	if !*disableAgent && *kubeconfig != "" {
		go runAgent(ctx, !withoutAPIServer(), e, name)
	} else {
		log.Printf("k3s-standin: agent not running (disable-agent=%v, kubeconfig=%q)", *disableAgent, *kubeconfig)
	}

	go notifyWhenReady(ctx, localAPI)
	if withoutAPIServer() {
		go exitWithoutAPIServer(ctx)
	}

	// Test knob: the etcd member dies (its ports close) while the rest of the server,
	// the agent with its node Lease and Ready heartbeats included, keeps running.
	var etcdKilled atomic.Bool
	go func() {
		for ctx.Err() == nil {
			if _, err := os.Stat(*killEtcdFile); err == nil {
				log.Printf("k3s-standin: %s exists: stopping the etcd member, keeping the rest running", *killEtcdFile)
				etcdKilled.Store(true)
				e.Close()
				return
			}
			time.Sleep(500 * time.Millisecond)
		}
	}()
	for done := false; !done; {
		select {
		case <-ctx.Done():
			log.Printf("k3s-standin: stopping")
			done = true
		case err := <-e.Err():
			if !etcdKilled.Load() {
				log.Fatalf("k3s-standin: etcd: %v", err)
			}
			log.Printf("k3s-standin: etcd member stopped by the kill-etcd knob (%v)", err)
			<-ctx.Done()
			done = true
		}
	}
	sdNotify("STOPPING=1")
	cancel()
	<-apiDone
}

func writeReport(started time.Time, files []string, merged map[string][]string, unknown, args []string) {
	flags := map[string]any{}
	fs.VisitAll(func(f *flag.Flag) {
		switch v := f.Value.(type) {
		case *listFlag:
			flags[f.Name] = append([]string{}, v.vals...)
		default:
			if g, ok := f.Value.(flag.Getter); ok {
				if b, ok := g.Get().(bool); ok {
					flags[f.Name] = b
					return
				}
			}
			flags[f.Name] = f.Value.String()
		}
	})
	rep := map[string]any{"pid": os.Getpid(), "started": started.Format(time.RFC3339Nano), "argv": os.Args,
		"config_dir": *configDir, "config_files": files, "config": merged, "unknown_config_keys": unknown,
		"effective_args": args, "flags": flags, "kubelet": kubeletFlags(flags["kubelet-arg"].([]string))}
	b, _ := json.MarshalIndent(rep, "", "  ")
	must(os.MkdirAll(filepath.Dir(*reportFile), 0o755), "report dir")
	tmp := *reportFile + ".tmp"
	must(os.WriteFile(tmp, append(b, '\n'), 0o644), "write report")
	must(os.Rename(tmp, *reportFile), "write report")
	one, _ := json.Marshal(rep)
	log.Printf("k3s-standin: effective flags: %s", one)
}

// kubeletMapFlags: the kubelet flags of type MapStringString among those a test reads.
var kubeletMapFlags = map[string]bool{"system-reserved": true, "kube-reserved": true, "eviction-hard": true,
	"eviction-soft": true, "eviction-minimum-reclaim": true}

// kubeletFlags: the kubelet's effective flags from k3s's kubelet-arg values (see the
// header): each flag's value as the kubelet ends with it.
func kubeletFlags(kubeletArgs []string) map[string]string {
	// k3s's GetArgs: a value per occurrence, kept in order per key; `+` appends to and
	// `-` prepends before the key's values so far (no defaults here to keep or drop).
	var order []string
	values := map[string][]string{}
	for _, a := range kubeletArgs {
		key, value, found := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !found {
			value = "true"
		}
		name := strings.TrimRight(key, "+-")
		if _, seen := values[name]; !seen {
			order = append(order, name)
		}
		if strings.HasSuffix(key, "-") {
			values[name] = append([]string{value}, values[name]...)
		} else {
			values[name] = append(values[name], value)
		}
	}
	// The kubelet's flag parsing: last wins, map flags merged key by key.
	out := map[string]string{}
	for _, name := range order {
		if !kubeletMapFlags[name] {
			vs := values[name]
			out[name] = vs[len(vs)-1]
			continue
		}
		var keys []string
		merged := map[string]string{}
		for _, v := range values[name] {
			for _, pair := range strings.Split(v, ",") {
				k, val, _ := strings.Cut(strings.TrimSpace(pair), "=")
				if k == "" {
					continue
				}
				if _, seen := merged[k]; !seen {
					keys = append(keys, k)
				}
				merged[k] = val
			}
		}
		sort.Strings(keys)
		pairs := make([]string, 0, len(keys))
		for _, k := range keys {
			pairs = append(pairs, k+"="+merged[k])
		}
		out[name] = strings.Join(pairs, ",")
	}
	return out
}

func serveDisabled(addr string) {
	cert, err := tls.LoadX509KeyPair(filepath.Join(*certDir, kube.ServingCert), filepath.Join(*certDir, kube.ServingKey))
	must(err, "serving cert")
	l, err := tls.Listen("tcp", addr, &tls.Config{Certificates: []tls.Certificate{cert}})
	must(err, "listen "+addr)
	log.Printf("k3s-standin: apiserver disabled; %s answers 503", addr)
	http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusServiceUnavailable)
		w.Write([]byte("apiserver disabled"))
	}))
}

// superviseAPIServer runs kube-apiserver until ctx ends, restarting it when it exits.
func superviseAPIServer(ctx context.Context, args []string) {
	for {
		c := exec.Command(*apiserverBin, args...)
		c.Stdout, c.Stderr = os.Stdout, os.Stderr
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		log.Printf("k3s-standin: starting %s", *apiserverBin)
		if err := c.Start(); err != nil {
			log.Printf("k3s-standin: kube-apiserver: %v", err)
		} else {
			apiserverPID.Store(int32(c.Process.Pid))
			done := make(chan error, 1)
			go func() { done <- c.Wait() }()
			select {
			case err := <-done:
				log.Printf("k3s-standin: kube-apiserver exited: %v", err)
			case <-ctx.Done():
				c.Process.Signal(syscall.SIGTERM)
				select {
				case <-done:
				case <-time.After(10 * time.Second):
					c.Process.Kill()
					<-done
				}
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(5 * time.Second):
		}
	}
}

// withoutAPIServer: this server runs no kube-apiserver (disable-apiserver, or the test
// knob standin-no-apiserver of a rig whose API server is the harness's).
func withoutAPIServer() bool {
	return *disableAPI || *noAPIServer
}

// notifyWhenReady sends READY=1 as k3s's server command does (pkg/cli/server): once
// its own API server is ready, unless disabled, and its own etcd is ready (here:
// /health answers 200, so the health-delay and never-healthy knobs hold READY back).
// With disable-apiserver that is etcd alone: k3s >= 1.22 waits for no API server
// there, and another server's API being down does not delay it.
func notifyWhenReady(ctx context.Context, localAPI string) {
	var local *http.Client
	if !withoutAPIServer() {
		c, err := rest.HTTPClientFor(&rest.Config{Host: localAPI, TLSClientConfig: rest.TLSClientConfig{
			CAFile:   filepath.Join(*certDir, kube.CACert),
			CertFile: filepath.Join(*certDir, kube.AdminCert), KeyFile: filepath.Join(*certDir, kube.AdminKey)}})
		must(err, "local API client")
		local = c
	}
	plain := &http.Client{}
	apiReady := local == nil
	for {
		if !apiReady && httpStatus(ctx, local, localAPI+"/readyz") == 200 {
			log.Printf("k3s-standin: Kube API server is now running")
			apiReady = true
		}
		if apiReady && httpStatus(ctx, plain, "http://"+*healthAddr+"/health") == 200 {
			log.Printf("k3s-standin: ready (etcd healthy%s)", map[bool]string{true: ", local API server ready", false: "; API server disabled"}[local != nil])
			sdNotify("READY=1\nSTATUS=etcd healthy")
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(500 * time.Millisecond):
		}
	}
}

func httpStatus(ctx context.Context, c *http.Client, u string) int {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", u, nil)
	r, err := c.Do(req)
	if err != nil {
		return 0
	}
	r.Body.Close()
	return r.StatusCode
}

// exitWithoutAPIServer: a server without its own API server that has reached no API
// server (the kubeconfig's or a "server" URL) for apiserver-wait-timeout exits 1, as
// an etcd-only k3s was seen to do every 15 minutes; systemd then restarts it.
func exitWithoutAPIServer(ctx context.Context) {
	var targets []string
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	if *kubeconfig != "" {
		if kc, err := clientcmd.BuildConfigFromFlags("", *kubeconfig); err == nil {
			if c, err := rest.HTTPClientFor(kc); err == nil {
				client = c
			}
			targets = append(targets, kc.Host)
		}
	}
	targets = append(targets, servers.vals...)
	last := time.Now()
	for {
		for _, t := range targets {
			if s := httpStatus(ctx, client, strings.TrimSuffix(t, "/")+"/readyz"); s == 200 || s == 401 || s == 403 {
				last = time.Now()
				break
			}
		}
		if time.Since(last) > *apiWait {
			log.Fatalf("k3s-standin: no API server reachable for %v (%v): exiting", *apiWait, targets)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
	}
}

func sdNotify(msg string) {
	sock := os.Getenv("NOTIFY_SOCKET")
	if sock == "" {
		return
	}
	if strings.HasPrefix(sock, "@") {
		sock = "\x00" + sock[1:]
	}
	c, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		log.Printf("k3s-standin: sd_notify: %v", err)
		return
	}
	defer c.Close()
	c.Write([]byte(msg))
}

// ---- agent ----

type agent struct {
	clients []*kubernetes.Clientset
	hosts   []string
	cur     int
	cp      bool // API server enabled here: set control-plane/master labels
	started time.Time
	member  string // etcd member name, for k3s's etcd.k3s.cattle.io annotations
}

// do runs f against the current API server, failing over to the next on errors
// that are not answers from an API server, and on 503s: a server at etcd-only
// answers its API port with 503 "apiserver disabled" (k3s's agent then goes
// through its load balancer to another server).
func (a *agent) do(f func(cs *kubernetes.Clientset) error) error {
	var err error
	for i := 0; i < len(a.clients); i++ {
		err = f(a.clients[a.cur])
		if err == nil || (apierrors.ReasonForError(err) != metav1.StatusReasonUnknown && !apierrors.IsServiceUnavailable(err)) {
			return err
		}
		a.cur = (a.cur + 1) % len(a.clients)
	}
	return err
}

// apiserverPID is the running kube-apiserver's PID (0: none), for setOOMScoreAdj.
var apiserverPID atomic.Int32

// setOOMScoreAdj imitates what k3s's embedded kubelet does once it runs (which needs
// an API server): it sets oom_score_adj -999 on its own process, and so on everything
// in it (k3s runs etcd and the API server in one process; the stand-in runs the API
// server as a child, which gets the same value). Until then k3s runs at its unit's.
func setOOMScoreAdj(v int) {
	for _, pid := range []int{os.Getpid(), int(apiserverPID.Load())} {
		if pid == 0 {
			continue
		}
		f := fmt.Sprintf("/proc/%d/oom_score_adj", pid)
		if err := os.WriteFile(f, []byte(strconv.Itoa(v)), 0o644); err != nil {
			log.Printf("k3s-standin: agent: %s: %v", f, err)
		}
	}
	log.Printf("k3s-standin: agent: oom_score_adj %d set, as k3s's kubelet does", v)
}

func runAgent(ctx context.Context, controlPlane bool, e *embed.Etcd, member string) {
	base, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	must(err, "kubeconfig")
	a := &agent{cp: controlPlane, started: time.Now(), member: member}
	for _, h := range append([]string{base.Host}, servers.vals...) {
		c := rest.CopyConfig(base)
		c.Host, c.Timeout = h, 5*time.Second
		a.clients = append(a.clients, kubernetes.NewForConfigOrDie(c))
		a.hosts = append(a.hosts, h)
	}
	// Register (retried every second until the API answers), then heartbeat: the node
	// Lease at once and every node-lease-interval; the Node's status first Ready=False
	// (a kubelet's runtime check not done yet), Ready=True from kubelet-ready-delay on,
	// then every node-status-interval. The etcd leader writes EtcdIsVoter every 15 s.
	registered, secretDone, readyPosted := false, false, false
	var lastStatus, lastLease, lastVoter time.Time
	for {
		if !registered {
			registered = a.do(a.register) == nil
			if registered && *kubeletOOMAdj != 0 {
				setOOMScoreAdj(*kubeletOOMAdj)
			}
		}
		if registered {
			if time.Since(lastLease) >= *leaseEvery {
				if err := a.do(a.renewLease); err != nil {
					log.Printf("k3s-standin: agent: node lease: %v", err)
				} else {
					lastLease = time.Now()
				}
			}
			_, notReady := os.Stat(*notReadyFile)
			readyNow := time.Since(a.started) >= *readyDelay && notReady != nil
			if lastStatus.IsZero() || (readyNow && !readyPosted) || time.Since(lastStatus) >= *statusEvery {
				if err := a.do(func(cs *kubernetes.Clientset) error { return a.updateStatus(cs, readyNow) }); err != nil {
					log.Printf("k3s-standin: agent: node status: %v", err)
				} else {
					lastStatus, readyPosted = time.Now(), readyNow
				}
			}
			if !secretDone {
				secretDone = a.do(a.ensurePasswordSecret) == nil
			}
			if time.Since(lastVoter) >= voterEvery {
				a.writeVoterConditions(e)
				lastVoter = time.Now()
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
	}
}

func (a *agent) roleLabels() map[string]string {
	l := map[string]string{"node-role.kubernetes.io/etcd": "true"}
	if a.cp {
		l["node-role.kubernetes.io/control-plane"] = "true"
		l["node-role.kubernetes.io/master"] = "true"
	}
	return l
}

func (a *agent) register(cs *kubernetes.Clientset) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := cs.CoreV1().Nodes().Get(ctx, *nodeName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		n = &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: *nodeName, Labels: a.roleLabels()}}
		for k, v := range map[string]string{"kubernetes.io/hostname": *nodeName, "kubernetes.io/os": "linux", "node.kubernetes.io/instance-type": "k3s"} {
			n.Labels[k] = v
		}
		n, err = cs.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
		if err == nil {
			log.Printf("k3s-standin: agent: registered Node %s via %s", *nodeName, a.hosts[a.cur])
		}
	}
	if err != nil {
		log.Printf("k3s-standin: agent: register: %v", err)
		return err
	}
	missing := map[string]string{}
	for k, v := range a.roleLabels() {
		if n.Labels[k] != v {
			missing[k] = v
		}
	}
	// k3s's etcd metadata controller: which member and address this Node's etcd is.
	ann := map[string]string{}
	for k, v := range map[string]string{"etcd.k3s.cattle.io/node-name": a.member, "etcd.k3s.cattle.io/node-address": *nodeIP} {
		if n.Annotations[k] != v {
			ann[k] = v
		}
	}
	if len(missing) > 0 || len(ann) > 0 {
		p, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": missing, "annotations": ann}})
		if _, err := cs.CoreV1().Nodes().Patch(ctx, *nodeName, types.MergePatchType, p, metav1.PatchOptions{}); err != nil {
			return err
		}
	}
	return nil
}

func (a *agent) updateStatus(cs *kubernetes.Clientset, isReady bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := cs.CoreV1().Nodes().Get(ctx, *nodeName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	now := metav1.Now()
	ready := corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
		Message: "k3s-standin is posting ready status", LastHeartbeatTime: now, LastTransitionTime: now}
	if !isReady {
		ready.Status, ready.Reason = corev1.ConditionFalse, "KubeletNotReady"
		ready.Message = "container runtime status check may not have completed yet"
	}
	found := false
	for i, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			if c.Status == ready.Status {
				ready.LastTransitionTime = c.LastTransitionTime
			}
			n.Status.Conditions[i], found = ready, true
		}
	}
	if !found {
		n.Status.Conditions = append(n.Status.Conditions, ready)
	}
	n.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: *nodeIP}, {Type: corev1.NodeHostName, Address: *nodeName}}
	n.Status.NodeInfo.KubeletVersion = "v1.37.2+k3s-standin"
	n.Status.NodeInfo.OperatingSystem, n.Status.NodeInfo.Architecture = "linux", "amd64"
	_, err = cs.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{})
	return err
}

func (a *agent) renewLease(cs *kubernetes.Clientset) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	leases := cs.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	now := metav1.NewMicroTime(time.Now())
	l, err := leases.Get(ctx, *nodeName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		n, err := cs.CoreV1().Nodes().Get(ctx, *nodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		dur := int32(40)
		l = &coordv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: *nodeName, Namespace: corev1.NamespaceNodeLease,
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: n.Name, UID: n.UID}}},
			Spec: coordv1.LeaseSpec{HolderIdentity: nodeName, LeaseDurationSeconds: &dur, RenewTime: &now}}
		_, err = leases.Create(ctx, l, metav1.CreateOptions{})
		return err
	}
	if err != nil {
		return err
	}
	l.Spec.RenewTime, l.Spec.HolderIdentity = &now, nodeName
	_, err = leases.Update(ctx, l, metav1.UpdateOptions{})
	return err
}

func (a *agent) ensurePasswordSecret(cs *kubernetes.Clientset) error {
	pwFile := filepath.Join(*dataDir, "agent", "node-password")
	pw, err := os.ReadFile(pwFile)
	if err != nil {
		b := make([]byte, 16)
		rand.Read(b)
		pw = []byte(hex.EncodeToString(b))
		if err := os.MkdirAll(filepath.Dir(pwFile), 0o700); err != nil {
			return err
		}
		if err := os.WriteFile(pwFile, pw, 0o600); err != nil {
			return err
		}
	}
	sum := sha256.Sum256([]byte(strings.TrimSpace(string(pw))))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: *nodeName + ".node-password.k3s", Namespace: "kube-system"},
		Immutable: new(true), StringData: map[string]string{"hash": hex.EncodeToString(sum[:])}}
	_, err = cs.CoreV1().Secrets("kube-system").Create(ctx, s, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	return err
}
