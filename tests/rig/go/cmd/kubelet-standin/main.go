// Command kubelet-standin is TEST CODE: it plays the part kubelets (and, with
// --schedule, the scheduler) play in a pod's life, against a real API server,
// for regrade's drain tests. No containers run anywhere.
//
// What of a kubelet it imitates, for every pod bound to a Node it serves:
//   - A new pod (phase Pending, not being deleted) is reported started: phase
//     Running, conditions Initialized, ContainersReady, Ready and PodScheduled
//     True, each container running and ready, written through the status
//     subresource as a kubelet does. (The API server lets a Pending pod be
//     evicted whatever its PodDisruptionBudget says, so a budget only holds
//     Running pods back.)
//   - A pod being deleted gracefully (deletionTimestamp set) is finished once its
//     grace period has passed (at deletionTimestamp): deleted with grace period 0
//     and its UID as a precondition, as a kubelet does once the containers have
//     stopped. A real kubelet finishes earlier when the containers exit on SIGTERM;
//     this one always takes the whole grace period.
//
// What of a scheduler it imitates (--schedule): a pod without a Node, not being
// deleted, is bound (pods/binding) to the first Node by name that it serves and
// that is Ready, not cordoned (spec.unschedulable), matches the pod's nodeSelector
// and whose NoSchedule and NoExecute taints the pod tolerates. Nothing else
// (no resources, affinity, spreading, preemption).
//
// What of the node lifecycle controller it imitates: the taint
// node.kubernetes.io/not-ready:NoSchedule, which the API server puts on every new
// Node (admission plugin TaintNodesByCondition), is removed from a served Node
// once its Ready condition is True. Nothing else (no NotReady marking, no
// NoExecute taints, no pod deletion for stale heartbeats).
//
// Served Nodes: those named by --nodes (comma-separated), or every Node when
// --nodes is empty. Mirror pods (annotation kubernetes.io/config.mirror) are
// marked Running like any other, and never deleted by it except at the end of a
// graceful deletion, as a kubelet would.
//
// Real processes (--exec-node NODE --exec-cgroup DIR; issue 26's incident
// scenario): for a pod bound to NODE, when it is reported started, the stand-in
// also runs its first container's command (spec.containers[0].command + args) as
// a real process on this host: a shell writes its own PID into DIR/cgroup.procs
// (a memory cgroup, NODE's own memory) and execs the command, so the process and
// all it allocates are charged to that cgroup from its first instruction. No
// image, no namespaces: the command is a host path. The process is the pod's:
//   - a pod being deleted (evicted, or its Deployment scaled down) has its process
//     killed (SIGKILL to its process group) when the deletion starts, then the
//     deletion finishes at the end of the grace period as above;
//   - a process that exits by itself (e.g. the cgroup's OOM killer) is reported
//     as the container's lastState.terminated (exit code, reason "OOMKilled" when
//     the kernel's SIGKILL ended it and the stand-in did not, "Error" otherwise),
//     restartCount one more, and the command run again 5 s later (restartPolicy
//     Always, as a kubelet would, with a fixed back-off).
//
// Pods on other Nodes get no process: they are only reported Running.
//
// Pods placed as a kubelet with the systemd cgroup driver places them
// (--exec-kubepods instead of --exec-cgroup; the VM lane, where the stand-in runs
// inside server1's guest with systemd as PID 1 and cgroup v2): each run of the
// command is a transient scope cri-containerd-<64 hex>.scope (as containerd's runc
// names a container's scope) in the pod's slice
// kubepods-besteffort-pod<UID with _ for ->.slice, so under kubepods.slice and
// kubepods-besteffort.slice (systemd-run --scope --slice; systemd makes the parent
// slices, as the kubelet's cgroup manager does over D-Bus), with oom_score_adj 1000,
// what the kubelet gives a BestEffort pod's containers. Only BestEffort is imitated
// (no requests or limits: no memory.max on the pod's slice, no other QoS class), no
// pause container, no kubepods.slice allocatable limit, no eviction manager.
//
// Scheduling onto Nodes served by another stand-in (--bind-nodes a,b,c: the Nodes
// the scheduler may bind to; default the served ones): the VM lane's stand-in on the
// host schedules for all three Nodes while the one in server1's guest runs server1's
// pods.
//
// Usage: kubelet-standin --kubeconfig FILE [--nodes a,b] [--schedule] [--bind-nodes a,b,c]
//
//	[--exec-node NODE (--exec-cgroup DIR | --exec-kubepods)]
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"os/signal"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listersv1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

type standin struct {
	cs       kubernetes.Interface
	pods     listersv1.PodLister
	nodes    listersv1.NodeLister
	serve    map[string]bool // empty: every Node
	schedule bool

	mu       sync.Mutex
	inFlight map[types.UID]string // what is being done to a pod, so it is done once
	kick     chan struct{}

	execNode     string
	execCgroup   string
	execKubepods bool
	bindTo       map[string]bool        // empty: the served Nodes
	procs        map[types.UID]*podProc // real processes of pods on execNode
}

// podProc is the real process of one pod's first container.
type podProc struct {
	cmd    *exec.Cmd
	killed bool // by the stand-in (the pod is being deleted)
	gone   bool // the pod is gone or being deleted: never run again
}

func main() {
	kubeconfig := flag.String("kubeconfig", "", "admin kubeconfig")
	nodes := flag.String("nodes", "", "comma-separated Node names to serve (empty: all)")
	schedule := flag.Bool("schedule", false, "also bind unscheduled pods to a served Node")
	execNode := flag.String("exec-node", "", "run the first container's command of pods on this Node as real processes")
	execCgroup := flag.String("exec-cgroup", "", "the memory cgroup directory those processes are placed in")
	execKubepods := flag.Bool("exec-kubepods", false, "place those processes as the kubelet's systemd cgroup driver does (a scope in kubepods-besteffort-pod<uid>.slice)")
	bindNodes := flag.String("bind-nodes", "", "comma-separated Node names the scheduler may bind to (empty: the served ones)")
	flag.Parse()
	log.SetPrefix("kubelet-standin: ")
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		log.Fatalf("%v", err)
	}
	cfg.QPS, cfg.Burst = 200, 400
	cs := kubernetes.NewForConfigOrDie(cfg)
	f := informers.NewSharedInformerFactory(cs, 0)
	s := &standin{
		cs:       cs,
		pods:     f.Core().V1().Pods().Lister(),
		nodes:    f.Core().V1().Nodes().Lister(),
		serve:    map[string]bool{},
		schedule: *schedule,
		inFlight: map[types.UID]string{},
		kick:     make(chan struct{}, 1),

		execNode:     *execNode,
		execCgroup:   *execCgroup,
		execKubepods: *execKubepods,
		bindTo:       map[string]bool{},
		procs:        map[types.UID]*podProc{},
	}
	for _, n := range strings.Split(*nodes, ",") {
		if n = strings.TrimSpace(n); n != "" {
			s.serve[n] = true
		}
	}
	for _, n := range strings.Split(*bindNodes, ",") {
		if n = strings.TrimSpace(n); n != "" {
			s.bindTo[n] = true
		}
	}
	h := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { s.poke() },
		UpdateFunc: func(any, any) { s.poke() },
		DeleteFunc: func(any) { s.poke() },
	}
	f.Core().V1().Pods().Informer().AddEventHandler(h)
	f.Core().V1().Nodes().Informer().AddEventHandler(h)
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	f.Start(ctx.Done())
	f.WaitForCacheSync(ctx.Done())
	log.Printf("serving %v (schedule=%v)", keys(s.serve), s.schedule)
	tick := time.NewTicker(2 * time.Second) // a safety net for a missed event
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			s.killAll()
			os.Exit(0)
		case <-s.kick:
		case <-tick.C:
		}
		s.pass(ctx)
	}
}

func keys(m map[string]bool) []string {
	out := []string{}
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func (s *standin) poke() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// bindable: the scheduler may bind a pod to node.
func (s *standin) bindable(node string) bool {
	if len(s.bindTo) > 0 {
		return s.bindTo[node]
	}
	return s.serves(node)
}

func (s *standin) serves(node string) bool {
	return node != "" && (len(s.serve) == 0 || s.serve[node])
}

// start runs fn for pod once at a time per (pod, what).
func (s *standin) start(p *corev1.Pod, what string, fn func()) {
	s.mu.Lock()
	if s.inFlight[p.UID] == what {
		s.mu.Unlock()
		return
	}
	s.inFlight[p.UID] = what
	s.mu.Unlock()
	go func() {
		fn()
		s.mu.Lock()
		if s.inFlight[p.UID] == what {
			delete(s.inFlight, p.UID)
		}
		s.mu.Unlock()
		s.poke()
	}()
}

func (s *standin) pass(ctx context.Context) {
	if nodes, err := s.nodes.List(labels.Everything()); err == nil {
		for _, n := range nodes {
			if s.serves(n.Name) && ready(n) && hasTaint(n, notReadyTaint) {
				n := n
				s.start(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{UID: n.UID}}, "untaint", func() { s.untaint(ctx, n) })
			}
		}
	}
	pods, err := s.pods.List(labels.Everything())
	if err != nil {
		log.Printf("list pods: %v", err)
		return
	}
	for _, p := range pods {
		p := p
		if p.DeletionTimestamp != nil {
			s.kill(p.UID)
		}
		switch {
		case p.DeletionTimestamp != nil && s.serves(p.Spec.NodeName):
			s.start(p, "finish", func() { s.finish(ctx, p) })
		case p.DeletionTimestamp != nil:
		case p.Spec.NodeName == "" && s.schedule:
			s.start(p, "bind", func() { s.bind(ctx, p) })
		case s.serves(p.Spec.NodeName) && p.Status.Phase == corev1.PodPending:
			s.start(p, "run", func() { s.run(ctx, p) })
		}
	}
}

// finish deletes p for good once its grace period has passed.
func (s *standin) finish(ctx context.Context, p *corev1.Pod) {
	if d := time.Until(p.DeletionTimestamp.Time); d > 0 {
		select {
		case <-ctx.Done():
			return
		case <-time.After(d):
		}
	}
	zero := int64(0)
	err := s.cs.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{
		GracePeriodSeconds: &zero, Preconditions: &metav1.Preconditions{UID: &p.UID}})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		log.Printf("finish %s/%s: %v", p.Namespace, p.Name, err)
		return
	}
	log.Printf("finished deleting %s/%s on %s", p.Namespace, p.Name, p.Spec.NodeName)
}

// run reports p's containers started and ready.
func (s *standin) run(ctx context.Context, p *corev1.Pod) {
	now := metav1.Now()
	q := p.DeepCopy()
	q.Status.Phase = corev1.PodRunning
	q.Status.StartTime = &now
	q.Status.Conditions = nil
	for _, t := range []corev1.PodConditionType{corev1.PodInitialized, corev1.ContainersReady, corev1.PodReady, corev1.PodScheduled} {
		q.Status.Conditions = append(q.Status.Conditions, corev1.PodCondition{Type: t, Status: corev1.ConditionTrue, LastTransitionTime: now})
	}
	q.Status.ContainerStatuses = nil
	for _, c := range p.Spec.Containers {
		q.Status.ContainerStatuses = append(q.Status.ContainerStatuses, corev1.ContainerStatus{
			Name: c.Name, Image: c.Image, ImageID: "standin://" + c.Image, Ready: true, Started: ptr(true),
			ContainerID: "standin://" + string(p.UID) + "/" + c.Name,
			State:       corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}},
		})
	}
	_, err := s.cs.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, q, metav1.UpdateOptions{})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		log.Printf("run %s/%s: %v", p.Namespace, p.Name, err)
		return
	}
	if err == nil && s.execNode != "" && p.Spec.NodeName == s.execNode && len(p.Spec.Containers) > 0 {
		s.spawn(ctx, p)
	}
}

// spawn starts p's process in the exec cgroup, and watches it until it ends.
func (s *standin) spawn(ctx context.Context, p *corev1.Pod) {
	c := p.Spec.Containers[0]
	argv := append(append([]string{}, c.Command...), c.Args...)
	if len(argv) == 0 {
		log.Printf("exec %s/%s: no command", p.Namespace, p.Name)
		return
	}
	s.mu.Lock()
	if pp := s.procs[p.UID]; pp != nil && (pp.gone || pp.cmd.ProcessState == nil) {
		s.mu.Unlock()
		return // running, or the pod is going
	}
	sh := append([]string{"-c", `echo $$ > "$0/cgroup.procs" && exec "$@"`, s.execCgroup}, argv...)
	if s.execKubepods {
		slice := "kubepods-besteffort-pod" + strings.ReplaceAll(string(p.UID), "-", "_") + ".slice"
		id := make([]byte, 32)
		_, _ = rand.Read(id)
		scope := "cri-containerd-" + hex.EncodeToString(id) + ".scope"
		// systemd-run --scope registers this very process as the scope and execs the
		// command: the PID (and process group) stay the stand-in's child.
		run := `echo 1000 > /proc/self/oom_score_adj && s=$0 u=$1 && shift && exec systemd-run --quiet --scope --collect --slice="$s" --unit="$u" -- "$@"`
		sh = append([]string{"-c", run, slice, scope}, argv...)
	}
	cmd := exec.Command("/bin/sh", sh...)
	// Its own process group (killed whole); killed too if the stand-in dies.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		s.mu.Unlock()
		log.Printf("exec %s/%s: %v", p.Namespace, p.Name, err)
		return
	}
	pp := &podProc{cmd: cmd}
	s.procs[p.UID] = pp
	s.mu.Unlock()
	where := s.execCgroup
	if s.execKubepods {
		where = sh[2] + "/" + sh[3]
	}
	log.Printf("started process %d for %s/%s on %s in %s: %v", cmd.Process.Pid, p.Namespace, p.Name, p.Spec.NodeName, where, argv)
	go func() {
		werr := cmd.Wait()
		s.mu.Lock()
		killed, gone := pp.killed, pp.gone
		s.mu.Unlock()
		st := cmd.ProcessState
		code, reason := int32(st.ExitCode()), "Error"
		if ws, ok := st.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			code = 128 + int32(ws.Signal())
			if ws.Signal() == syscall.SIGKILL && !killed {
				reason = "OOMKilled"
			}
		}
		log.Printf("process %d of %s/%s ended (%v; killed by the stand-in: %v): %s", cmd.Process.Pid, p.Namespace, p.Name, werr, killed, reason)
		if gone {
			return
		}
		s.terminated(ctx, p, code, reason)
		select {
		case <-ctx.Done():
			return
		case <-time.After(5 * time.Second):
		}
		s.mu.Lock()
		again := !pp.gone
		s.mu.Unlock()
		if again {
			s.spawn(ctx, p)
		}
	}()
}

// terminated reports the end of p's process as a container restart.
func (s *standin) terminated(ctx context.Context, p *corev1.Pod, code int32, reason string) {
	cur, err := s.cs.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil || cur.UID != p.UID || len(cur.Status.ContainerStatuses) == 0 {
		return
	}
	q := cur.DeepCopy()
	now := metav1.Now()
	cs := &q.Status.ContainerStatuses[0]
	cs.RestartCount++
	cs.LastTerminationState = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
		ExitCode: code, Reason: reason, FinishedAt: now,
		Message: fmt.Sprintf("process ended with code %d", code)}}
	if _, err := s.cs.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, q, metav1.UpdateOptions{}); err != nil {
		log.Printf("terminated %s/%s: %v", p.Namespace, p.Name, err)
	}
}

// kill ends the process of a pod being deleted, once; it is never run again.
func (s *standin) kill(uid types.UID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	pp := s.procs[uid]
	if pp == nil || pp.gone {
		return
	}
	pp.gone = true
	if pp.cmd.ProcessState == nil {
		pp.killed = true
		_ = syscall.Kill(-pp.cmd.Process.Pid, syscall.SIGKILL)
		log.Printf("killed process %d: its pod is being deleted", pp.cmd.Process.Pid)
	}
}

func (s *standin) killAll() {
	s.mu.Lock()
	uids := []types.UID{}
	for uid := range s.procs {
		uids = append(uids, uid)
	}
	s.mu.Unlock()
	for _, uid := range uids {
		s.kill(uid)
	}
}

func ptr[T any](v T) *T { return &v }

// bind places p on the first fitting served Node, if any.
func (s *standin) bind(ctx context.Context, p *corev1.Pod) {
	nodes, err := s.nodes.List(labels.Everything())
	if err != nil {
		return
	}
	sort.Slice(nodes, func(i, j int) bool { return nodes[i].Name < nodes[j].Name })
	for _, n := range nodes {
		if !s.bindable(n.Name) || !fits(p, n) {
			continue
		}
		err := s.cs.CoreV1().Pods(p.Namespace).Bind(ctx, &corev1.Binding{
			ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, UID: p.UID},
			Target:     corev1.ObjectReference{Kind: "Node", Name: n.Name},
		}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			log.Printf("bind %s/%s to %s: %v", p.Namespace, p.Name, n.Name, err)
		}
		return
	}
}

const notReadyTaint = "node.kubernetes.io/not-ready"

func ready(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

func hasTaint(n *corev1.Node, key string) bool {
	for _, t := range n.Spec.Taints {
		if t.Key == key {
			return true
		}
	}
	return false
}

// untaint removes the not-ready taint from a Ready Node (a conflict is retried by
// the next pass).
func (s *standin) untaint(ctx context.Context, n *corev1.Node) {
	m := n.DeepCopy()
	m.Spec.Taints = nil
	for _, t := range n.Spec.Taints {
		if t.Key != notReadyTaint {
			m.Spec.Taints = append(m.Spec.Taints, t)
		}
	}
	if _, err := s.cs.CoreV1().Nodes().Update(ctx, m, metav1.UpdateOptions{}); err != nil && !apierrors.IsConflict(err) {
		log.Printf("untaint %s: %v", n.Name, err)
	}
}

func fits(p *corev1.Pod, n *corev1.Node) bool {
	if n.Spec.Unschedulable || !ready(n) {
		return false
	}
	for k, v := range p.Spec.NodeSelector {
		if n.Labels[k] != v {
			return false
		}
	}
	for _, t := range n.Spec.Taints {
		if t.Effect == corev1.TaintEffectPreferNoSchedule {
			continue
		}
		tolerated := false
		for _, tol := range p.Spec.Tolerations {
			if tol.ToleratesTaint(klog.Background(), &t, false) {
				tolerated = true
				break
			}
		}
		if !tolerated {
			return false
		}
	}
	return true
}
