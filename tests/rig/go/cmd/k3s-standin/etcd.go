package main

// The stand-in's etcd, as k3s runs its embedded etcd (pkg/etcd, pkg/cluster/bootstrap.go):
// member name, TLS on both ports, k3s's raft timing and start-time checks, the
// start-time temporary etcd, and the leader's EtcdIsVoter conditions.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	iofs "io/fs"
	"log"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"go.etcd.io/etcd/pkg/v3/featuregate"
	"go.etcd.io/etcd/server/v3/embed"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// memberName is k3s's: "<node>-<8 hex>", chosen once and kept in DATA_DIR/server/db/etcd/name.
// A static initial cluster (this stand-in's cluster mode, see the header) must name
// every member in advance, so an entry "<node>-<8 hex>=..." there is taken as ours.
func memberName(dbDir, node, initialCluster string) (string, error) {
	nameFile := filepath.Join(dbDir, "name")
	if b, err := os.ReadFile(nameFile); err == nil && len(strings.TrimSpace(string(b))) > 0 {
		return strings.TrimSpace(string(b)), nil
	}
	name := ""
	for _, e := range strings.Split(initialCluster, ",") {
		n, _, _ := strings.Cut(strings.TrimSpace(e), "=")
		if suffix, ok := strings.CutPrefix(n, node+"-"); ok && len(suffix) == 8 && isHex(suffix) {
			name = n
		}
	}
	if name == "" {
		b := make([]byte, 4)
		rand.Read(b)
		name = node + "-" + hex.EncodeToString(b)
	}
	if err := os.MkdirAll(dbDir, 0o700); err != nil {
		return "", err
	}
	return name, os.WriteFile(nameFile, []byte(name), 0o600)
}

func isHex(s string) bool {
	_, err := hex.DecodeString(s)
	return err == nil
}

// nodeOfMember is how k3s maps a member back to its Node: the name without "-<8 hex>".
func nodeOfMember(name string) string {
	if i := strings.LastIndex(name, "-"); i > 0 && len(name)-i-1 == 8 && isHex(name[i+1:]) {
		return name[:i]
	}
	return name
}

func urls(list string) ([]url.URL, error) {
	var out []url.URL
	for _, s := range strings.Split(list, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		u, err := url.Parse(s)
		if err != nil {
			return nil, fmt.Errorf("%q: %v", s, err)
		}
		out = append(out, *u)
	}
	return out, nil
}

// copyDir copies a data dir (files and dirs only: etcd's data dir has nothing else).
func copyDir(src, dst string) error {
	return filepath.WalkDir(src, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		t := filepath.Join(dst, rel)
		if d.IsDir() {
			return os.MkdirAll(t, 0o700)
		}
		in, err := os.Open(p)
		if err != nil {
			return err
		}
		defer in.Close()
		out, err := os.OpenFile(t, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
		if err != nil {
			return err
		}
		if _, err := io.Copy(out, in); err != nil {
			out.Close()
			return err
		}
		return out.Close()
	})
}

// reconcileWithTemporaryEtcd does what k3s does at the start of a server whose etcd
// was initialised before (pkg/cluster/bootstrap.go reconcile, pkg/etcd's temporary
// etcd): copy the data dir, start a single-member etcd on the copy
// (force-new-cluster, 127.0.0.1:2399/2400), read the bootstrap data from it, stop it,
// remove the copy. The cost (a copy of the whole db and an etcd start) is the point.
func reconcileWithTemporaryEtcd(dbDir, name string) {
	if !fileExists(filepath.Join(dbDir, "member", "wal")) {
		return
	}
	t0 := time.Now()
	tmp := dbDir + "-tmp"
	os.RemoveAll(tmp)
	defer os.RemoveAll(tmp)
	if err := copyDir(dbDir, tmp); err != nil {
		log.Fatalf("k3s-standin: temporary etcd: copying %s: %v", dbDir, err)
	}
	cfg := embed.NewConfig()
	cfg.Name, cfg.Dir, cfg.ForceNewCluster = name, tmp, true
	cu, _ := url.Parse("http://" + *tempEtcdAddr + ":2399")
	pu, _ := url.Parse("http://" + *tempEtcdAddr + ":2400")
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*cu}, []url.URL{*cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*pu}, []url.URL{*pu}
	cfg.InitialCluster = name + "=" + pu.String()
	cfg.LogLevel = "error"
	asK3sRunsIt(cfg)
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("k3s-standin: temporary etcd: %v", err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		log.Fatalf("k3s-standin: temporary etcd not ready within 60s")
	}
	// k3s reads its bootstrap keys here; the stand-in reads the db's size.
	size := e.Server.Backend().Size()
	e.Close()
	log.Printf("k3s-standin: reconciled with a temporary etcd on "+*tempEtcdAddr+":2399 (db %d bytes) in %v", size, time.Since(t0).Round(time.Millisecond))
}

// asK3sRunsIt sets what k3s sets on its embedded etcd, the temporary one too
// (pkg/etcd's cluster() and StartEmbeddedTemporary): heartbeat 500 ms and election
// timeout 5 s (etcd's own defaults are 100 ms and 1 s: a member under a thrash would
// lose its leader and call elections far sooner than k3s's does); the initial
// corruption check, which hashes the whole db before serving (a start reads it all);
// and, since k3s#14099 (2026), no defragment of its own at start: etcd's bootstrap
// defragment, run only when it would free at least 100 MB.
func asK3sRunsIt(cfg *embed.Config) {
	cfg.TickMs, cfg.ElectionMs = 500, 5000
	cfg.SnapshotCount = 10000
	cfg.BootstrapDefragThresholdMegabytes = 100
	gate, ok := cfg.ServerFeatureGate.(featuregate.MutableFeatureGate)
	if !ok {
		log.Fatalf("k3s-standin: etcd's feature gate cannot be set")
	}
	if err := gate.Set("InitialCorruptCheck=true"); err != nil {
		log.Fatalf("k3s-standin: InitialCorruptCheck: %v", err)
	}
}

// clientListenURLs: k3s listens on https://127.0.0.1:2379 and https://NODE_IP:2379
// and advertises the node IP's.
func defaultClientURLs(nodeIP string) (listen, advertise string) {
	node := "https://" + net.JoinHostPort(nodeIP, "2379")
	if ip := net.ParseIP(nodeIP); ip != nil && ip.IsLoopback() && nodeIP == "127.0.0.1" {
		return node, node
	}
	return "https://127.0.0.1:2379," + node, node
}

// ---- EtcdIsVoter: written by the etcd leader for every member's Node ----

const etcdVoterCondition corev1.NodeConditionType = "EtcdIsVoter"

// voterEvery is k3s's manageTickerTime; voterHeartbeat its heartbeatInterval (the
// condition is rewritten when it changes or when its heartbeat is that old).
const (
	voterEvery     = 15 * time.Second
	voterHeartbeat = 5 * time.Minute
)

// writeVoterConditions runs on every server; only the etcd leader writes.
func (a *agent) writeVoterConditions(e *embed.Etcd) {
	if e.Server.Leader() != e.Server.MemberID() {
		return
	}
	members := map[string]bool{} // node -> voter
	for _, m := range e.Server.Cluster().Members() {
		if m.Name != "" {
			members[nodeOfMember(m.Name)] = !m.IsLearner
		}
	}
	err := a.do(func(cs *kubernetes.Clientset) error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		nodes, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: "node-role.kubernetes.io/etcd=true"})
		if err != nil {
			return err
		}
		for i := range nodes.Items {
			n := &nodes.Items[i]
			voter, member := members[n.Name]
			want := corev1.NodeCondition{Type: etcdVoterCondition, Status: corev1.ConditionTrue, Reason: "MemberNotLearner",
				Message: "Node is a voting member of the etcd cluster"}
			switch {
			case !member:
				want.Status, want.Reason, want.Message = corev1.ConditionFalse, "NotAMember", "Node is not a member of the etcd cluster"
			case !voter:
				want.Status, want.Reason, want.Message = corev1.ConditionFalse, "MemberIsLearner", "Node has not been promoted from learner to voting member"
			}
			now := metav1.Now()
			idx := -1
			for j, c := range n.Status.Conditions {
				if c.Type == etcdVoterCondition {
					idx = j
				}
			}
			if idx >= 0 {
				c := n.Status.Conditions[idx]
				if c.Status == want.Status && c.Reason == want.Reason && time.Since(c.LastHeartbeatTime.Time) < voterHeartbeat {
					continue
				}
				want.LastTransitionTime = c.LastTransitionTime
				if c.Status != want.Status {
					want.LastTransitionTime = now
				}
				want.LastHeartbeatTime = now
				n.Status.Conditions[idx] = want
			} else {
				want.LastHeartbeatTime, want.LastTransitionTime = now, now
				n.Status.Conditions = append(n.Status.Conditions, want)
			}
			if _, err := cs.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
				return err
			}
			log.Printf("k3s-standin: etcd leader: Node %s EtcdIsVoter=%s (%s)", n.Name, want.Status, want.Reason)
		}
		return nil
	})
	if err != nil {
		log.Printf("k3s-standin: etcd leader: EtcdIsVoter: %v", err)
	}
}
