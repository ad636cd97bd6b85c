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
// Usage: kubelet-standin --kubeconfig FILE [--nodes a,b] [--schedule]
package main

import (
	"context"
	"flag"
	"log"
	"os"
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
}

func main() {
	kubeconfig := flag.String("kubeconfig", "", "admin kubeconfig")
	nodes := flag.String("nodes", "", "comma-separated Node names to serve (empty: all)")
	schedule := flag.Bool("schedule", false, "also bind unscheduled pods to a served Node")
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
	}
	for _, n := range strings.Split(*nodes, ",") {
		if n = strings.TrimSpace(n); n != "" {
			s.serve[n] = true
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
		if !s.serves(n.Name) || !fits(p, n) {
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
