// Command harness runs a throwaway Kubernetes control plane for regrade's
// tests, and mints credentials for it. TEST CODE.
//
//	harness run [--bin-dir DIR] [--dir DIR]
//	    Starts etcd and kube-apiserver (binaries from --bin-dir, default: this
//	    executable's dir) on free 127.0.0.1 ports (a start that loses a port to
//	    another process before binding it starts again on new ones, up to 5
//	    times; HARNESS_TAKE_A_PORT=1 takes etcd's first one, to check that),
//	    with generated certs, a service-account key,
//	    --authorization-mode=Node,RBAC, --anonymous-auth=false.
//	    Prints the admin kubeconfig path (client cert in group system:masters)
//	    as its FIRST stdout line once /readyz answers 200, then KEY=VALUE lines
//	    (SERVER, CA, CERT, KEY, DIR, ETCD). Stays in the foreground until
//	    SIGTERM/SIGINT (or until etcd/apiserver dies, exit 1), then stops both
//	    and removes its temp dir (unless --dir was given).
//	    --controller-manager also runs kube-controller-manager (controllers
//	    disruption and replicaset: PodDisruptionBudget status, ReplicaSet pods)
//	    and --kubelet runs kubelet-standin (pods on any Node run and finish their
//	    graceful deletions; unscheduled pods are bound to a fitting Node), both
//	    with the admin kubeconfig, once /readyz answers; either dying stops all.
//	    --apiserver-arg ARG (repeatable) adds ARG to kube-apiserver's command line, e.g.
//	    --runtime-config=... to serve a cluster without ValidatingAdmissionPolicy.
//	harness certs DIR [--host H]... [--server URL]
//	    Creates what is missing of a cert dir (ca, apiserver serving cert for
//	    127.0.0.1/localhost plus each --host, sa key pair, admin client cert) and,
//	    with --server, DIR/admin.kubeconfig. Used to share certs between stand-ins.
//	harness mint-sa ADMIN_KUBECONFIG NAMESPACE SA OUT [--duration 1h]
//	    Creates the namespace and ServiceAccount if missing, gets a token with
//	    the TokenRequest API and writes a kubeconfig using it to OUT.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"regrade.test/rig/internal/kube"
)

func die(f string, a ...any) { fmt.Fprintf(os.Stderr, "harness: "+f+"\n", a...); os.Exit(1) }

func main() {
	if len(os.Args) < 2 {
		die("usage: harness run|certs|mint-sa ...")
	}
	switch os.Args[1] {
	case "run":
		run(os.Args[2:])
	case "certs":
		certs(os.Args[2:])
	case "mint-sa":
		mintSA(os.Args[2:])
	default:
		die("unknown subcommand %q", os.Args[1])
	}
}

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(v string) error { *l = append(*l, v); return nil }

func certs(args []string) {
	fs := flag.NewFlagSet("certs", flag.ExitOnError)
	var hosts list
	fs.Var(&hosts, "host", "extra IP/DNS name for the serving cert (repeatable)")
	server := fs.String("server", "", "write DIR/admin.kubeconfig for this server URL")
	if len(args) < 1 {
		die("usage: harness certs DIR [--host H]... [--server URL]")
	}
	dir := args[0]
	fs.Parse(args[1:])
	if err := kube.EnsureCerts(dir, hosts); err != nil {
		die("%v", err)
	}
	if *server != "" {
		if err := kube.WriteAdminKubeconfig(filepath.Join(dir, "admin.kubeconfig"), dir, *server); err != nil {
			die("%v", err)
		}
	}
}

func freePort() int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		die("free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func run(args []string) {
	self, _ := os.Executable()
	fs := flag.NewFlagSet("run", flag.ExitOnError)
	binDir := fs.String("bin-dir", filepath.Dir(self), "dir with etcd and kube-apiserver")
	keep := fs.String("dir", "", "work dir to use and keep (default: a temp dir, removed at exit)")
	withKCM := fs.Bool("controller-manager", false, "also run kube-controller-manager (disruption, replicaset)")
	withKubelet := fs.Bool("kubelet", false, "also run kubelet-standin --schedule for every Node")
	var apiArgs list
	fs.Var(&apiArgs, "apiserver-arg", "extra kube-apiserver argument (repeatable)")
	fs.Parse(args)
	dir := *keep
	if dir == "" {
		d, err := os.MkdirTemp("", "regrade-kube-")
		if err != nil {
			die("%v", err)
		}
		dir = d
		defer os.RemoveAll(dir)
	}
	os.MkdirAll(dir, 0o700)
	certDir := filepath.Join(dir, "pki")
	if err := kube.EnsureCerts(certDir, nil); err != nil {
		die("certs: %v", err)
	}
	logf, err := os.Create(filepath.Join(dir, "harness.log"))
	if err != nil {
		die("%v", err)
	}
	start := func(name string, a ...string) *exec.Cmd {
		c := exec.Command(filepath.Join(*binDir, name), a...)
		c.Stdout, c.Stderr = logf, logf
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := c.Start(); err != nil {
			die("start %s: %v", name, err)
		}
		return c
	}
	var procs []*exec.Cmd
	stop := func() {
		// Clients first: the API server's shutdown waits for their watches.
		for _, c := range procs {
			c.Process.Signal(syscall.SIGTERM)
			done := make(chan struct{})
			go func() { c.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				c.Process.Kill()
				<-done
			}
		}
	}
	cleanup := func() {
		if *keep == "" {
			os.RemoveAll(dir)
		}
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	cert, err := tls.LoadX509KeyPair(filepath.Join(certDir, kube.AdminCert), filepath.Join(certDir, kube.AdminKey))
	if err != nil {
		die("%v", err)
	}
	pool := x509.NewCertPool()
	caPEM, _ := os.ReadFile(filepath.Join(certDir, kube.CACert))
	pool.AppendCertsFromPEM(caPEM)
	hc := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}}}}

	// A free port is free only until someone binds it: tests run harnesses side by
	// side, and any outgoing connection may take an ephemeral port. A start that
	// lost one of its ports before binding it starts again on new ones.
	var etcdURL, server string
	kc := filepath.Join(dir, "admin.kubeconfig")
	var died chan string
	for try := 1; ; try++ {
		cport, pport, mport, aport := freePort(), freePort(), freePort(), freePort()
		etcdURL = fmt.Sprintf("http://127.0.0.1:%d", cport)
		peerURL := fmt.Sprintf("http://127.0.0.1:%d", pport)
		server = fmt.Sprintf("https://127.0.0.1:%d", aport)
		if err := kube.WriteAdminKubeconfig(kc, certDir, server); err != nil {
			die("%v", err)
		}
		logStart, _ := logf.Seek(0, io.SeekEnd)
		if try == 1 && os.Getenv("HARNESS_TAKE_A_PORT") != "" {
			// The rig's own check of the retry: another process has the client port.
			if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", cport)); err == nil {
				defer l.Close()
			}
		}
		etcd := start("etcd", "--name=harness", "--data-dir="+filepath.Join(dir, "etcd"),
			"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
			"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
			"--initial-cluster=harness="+peerURL, "--initial-cluster-state=new",
			fmt.Sprintf("--listen-metrics-urls=http://127.0.0.1:%d", mport), "--log-level=warn",
			// The API server's store, not an etcd under test: without fsync its writes
			// do not wait for a disk that the suite's builds keep busy (a Lease renewal
			// that took over 2 s stopped a step in a CI run).
			"--unsafe-no-fsync")
		api := start("kube-apiserver", append(kube.APIServerArgs(certDir, etcdURL, "127.0.0.1", aport, "127.0.0.1"), apiArgs...)...)
		procs = []*exec.Cmd{api, etcd}
		died = make(chan string, 4)
		go func() { etcd.Wait(); died <- "etcd" }()
		go func() { api.Wait(); died <- "kube-apiserver" }()
		if ready(hc, server, died, sigs, stop, cleanup) {
			break
		}
		stop() // the one still running
		b, _ := os.ReadFile(logf.Name())
		thisTry := string(b[min(int(logStart), len(b)):])
		if try < 5 && strings.Contains(thisTry, "address already in use") {
			fmt.Fprintf(os.Stderr, "harness: a port was taken before etcd or kube-apiserver bound it; starting again on new ports (try %d of 5)\n", try+1)
			os.RemoveAll(filepath.Join(dir, "etcd"))
			continue
		}
		cleanup()
		die("etcd or kube-apiserver exited before ready; log:\n%s", tail(thisTry, 4000))
	}
	// After /readyz: neither has anything to do before the API answers.
	if *withKCM {
		kcm := start("kube-controller-manager", "--kubeconfig="+kc, "--leader-elect=false",
			"--controllers=disruption,replicaset", "--bind-address=127.0.0.1", "--secure-port=0", "-v=1")
		procs = append([]*exec.Cmd{kcm}, procs...)
		go func() { kcm.Wait(); died <- "kube-controller-manager" }()
	}
	if *withKubelet {
		kl := start("kubelet-standin", "--kubeconfig="+kc, "--schedule")
		procs = append([]*exec.Cmd{kl}, procs...)
		go func() { kl.Wait(); died <- "kubelet-standin" }()
	}
	fmt.Println(kc)
	fmt.Printf("SERVER=%s\nCA=%s\nCERT=%s\nKEY=%s\nDIR=%s\nETCD=%s\nLOG=%s\n", server,
		filepath.Join(certDir, kube.CACert), filepath.Join(certDir, kube.AdminCert),
		filepath.Join(certDir, kube.AdminKey), dir, etcdURL, logf.Name())
	os.Stdout.Sync()
	select {
	case <-sigs:
		stop()
	case n := <-died:
		fmt.Fprintf(os.Stderr, "harness: %s died; stopping\n", n)
		stop()
		cleanup()
		os.Exit(1)
	}
}

// ready waits for /readyz with the admin cert: true once it answers 200, false if
// etcd or kube-apiserver exited first. A signal meanwhile stops both and exits.
func ready(hc *http.Client, server string, died <-chan string, sigs <-chan os.Signal, stop func(), cleanup func()) bool {
	deadline := time.Now().Add(3 * time.Minute)
	for {
		resp, err := hc.Get(server + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return true
			}
		}
		select {
		case <-died:
			return false
		case <-sigs:
			stop()
			cleanup()
			os.Exit(0)
		case <-time.After(300 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			stop()
			cleanup()
			die("kube-apiserver not ready after 3m")
		}
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func mintSA(args []string) {
	fs := flag.NewFlagSet("mint-sa", flag.ExitOnError)
	dur := fs.Duration("duration", time.Hour, "token lifetime (min 10m)")
	if len(args) < 4 {
		die("usage: harness mint-sa ADMIN_KUBECONFIG NAMESPACE SA OUT [--duration 1h]")
	}
	admin, ns, sa, out := args[0], args[1], args[2], args[3]
	fs.Parse(args[4:])
	raw, err := clientcmd.LoadFromFile(admin)
	if err != nil {
		die("%v", err)
	}
	cfg, err := clientcmd.NewDefaultClientConfig(*raw, nil).ClientConfig()
	if err != nil {
		die("%v", err)
	}
	cs := kubernetes.NewForConfigOrDie(cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err = cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		die("namespace: %v", err)
	}
	_, err = cs.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		die("serviceaccount: %v", err)
	}
	secs := int64(dur.Seconds())
	tr, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa,
		&authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: &secs}}, metav1.CreateOptions{})
	if err != nil {
		die("token request: %v", err)
	}
	ctxName := raw.CurrentContext
	cl := raw.Clusters[raw.Contexts[ctxName].Cluster]
	user := ns + ":" + sa
	outCfg := clientcmdapi.Config{
		Clusters:       map[string]*clientcmdapi.Cluster{"regrade-test": cl},
		AuthInfos:      map[string]*clientcmdapi.AuthInfo{user: {Token: tr.Status.Token}},
		Contexts:       map[string]*clientcmdapi.Context{user: {Cluster: "regrade-test", AuthInfo: user, Namespace: ns}},
		CurrentContext: user,
	}
	if err := clientcmd.WriteToFile(outCfg, out); err != nil {
		die("%v", err)
	}
}
