// Package kube holds what the harness and the k3s stand-in share: a certificate
// directory (CA, API server serving cert, service-account key pair, admin client
// cert), admin kubeconfigs and the kube-apiserver command line.
package kube

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// Files in a cert dir (all PEM).
const (
	CACert, CAKey           = "ca.crt", "ca.key"
	ServingCert, ServingKey = "apiserver.crt", "apiserver.key"
	SAKey, SAPub            = "sa.key", "sa.pub"
	AdminCert, AdminKey     = "admin.crt", "admin.key"
)

// Issuer is the service-account issuer k3s uses.
const Issuer = "https://kubernetes.default.svc.cluster.local"

func exists(p string) bool { _, err := os.Stat(p); return err == nil }

func writePEM(path, typ string, der []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), mode); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func newKey() (*ecdsa.PrivateKey, []byte, error) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	der, err := x509.MarshalECPrivateKey(k)
	return k, der, err
}

func readKey(path string) (*ecdsa.PrivateKey, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		return nil, fmt.Errorf("%s: no PEM", path)
	}
	return x509.ParseECPrivateKey(blk.Bytes)
}

func readCert(path string) (*x509.Certificate, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		return nil, fmt.Errorf("%s: no PEM", path)
	}
	return x509.ParseCertificate(blk.Bytes)
}

// EnsureCerts creates whatever of the cert dir is missing; existing files are
// kept, so several servers can share one pre-made dir. hosts are IPs or DNS
// names for the serving cert (127.0.0.1 and localhost are always included).
func EnsureCerts(dir string, hosts []string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	p := func(n string) string { return filepath.Join(dir, n) }
	now := time.Now().Add(-time.Hour)
	serial := func() *big.Int { n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62)); return n }
	if !exists(p(CACert)) || !exists(p(CAKey)) {
		k, der, err := newKey()
		if err != nil {
			return err
		}
		tmpl := &x509.Certificate{SerialNumber: serial(), Subject: pkix.Name{CommonName: "regrade-test-ca"},
			NotBefore: now, NotAfter: now.AddDate(10, 0, 0), IsCA: true, BasicConstraintsValid: true,
			KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign}
		cert, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
		if err != nil {
			return err
		}
		if err := writePEM(p(CAKey), "EC PRIVATE KEY", der, 0o600); err != nil {
			return err
		}
		if err := writePEM(p(CACert), "CERTIFICATE", cert, 0o644); err != nil {
			return err
		}
	}
	caKey, err := readKey(p(CAKey))
	if err != nil {
		return err
	}
	ca, err := readCert(p(CACert))
	if err != nil {
		return err
	}
	leaf := func(certF, keyF string, tmpl *x509.Certificate) error {
		if exists(p(certF)) && exists(p(keyF)) {
			return nil
		}
		k, der, err := newKey()
		if err != nil {
			return err
		}
		tmpl.SerialNumber, tmpl.NotBefore, tmpl.NotAfter = serial(), now, now.AddDate(10, 0, 0)
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment
		cert, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
		if err != nil {
			return err
		}
		if err := writePEM(p(keyF), "EC PRIVATE KEY", der, 0o600); err != nil {
			return err
		}
		return writePEM(p(certF), "CERTIFICATE", cert, 0o644)
	}
	srv := &x509.Certificate{Subject: pkix.Name{CommonName: "kube-apiserver"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:    []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("10.43.0.1")}}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			srv.IPAddresses = append(srv.IPAddresses, ip)
		} else if h != "" {
			srv.DNSNames = append(srv.DNSNames, h)
		}
	}
	if err := leaf(ServingCert, ServingKey, srv); err != nil {
		return err
	}
	adm := &x509.Certificate{Subject: pkix.Name{CommonName: "admin", Organization: []string{"system:masters"}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	if err := leaf(AdminCert, AdminKey, adm); err != nil {
		return err
	}
	if !exists(p(SAKey)) || !exists(p(SAPub)) {
		k, der, err := newKey()
		if err != nil {
			return err
		}
		pub, err := x509.MarshalPKIXPublicKey(&k.PublicKey)
		if err != nil {
			return err
		}
		if err := writePEM(p(SAKey), "EC PRIVATE KEY", der, 0o600); err != nil {
			return err
		}
		if err := writePEM(p(SAPub), "PUBLIC KEY", pub, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// WriteAdminKubeconfig writes a kubeconfig for server (https://host:port) that
// authenticates with the admin client cert (group system:masters), by path.
func WriteAdminKubeconfig(out, certDir, server string) error {
	abs, err := filepath.Abs(certDir)
	if err != nil {
		return err
	}
	p := func(n string) string { return filepath.Join(abs, n) }
	s := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: regrade-test
  cluster:
    server: %s
    certificate-authority: %s
users:
- name: admin
  user:
    client-certificate: %s
    client-key: %s
contexts:
- name: admin
  context: {cluster: regrade-test, user: admin}
current-context: admin
`, server, p(CACert), p(AdminCert), p(AdminKey))
	tmp := out + ".tmp"
	if err := os.WriteFile(tmp, []byte(s), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, out)
}

// APIServerArgs is the kube-apiserver command line used by the harness and
// the stand-in: RBAC on, anonymous auth off, default admission plugins plus
// NodeRestriction. No Endpoints are reconciled when advertise is loopback
// (Endpoints validation refuses 127.0.0.0/8).
func APIServerArgs(certDir, etcdURL, bind string, port int, advertise string) []string {
	p := func(n string) string { return filepath.Join(certDir, n) }
	args := []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=" + bind,
		fmt.Sprintf("--secure-port=%d", port),
		"--advertise-address=" + advertise,
		"--tls-cert-file=" + p(ServingCert),
		"--tls-private-key-file=" + p(ServingKey),
		"--client-ca-file=" + p(CACert),
		"--service-account-issuer=" + Issuer,
		"--service-account-key-file=" + p(SAPub),
		"--service-account-signing-key-file=" + p(SAKey),
		"--api-audiences=" + Issuer + ",k3s",
		"--service-cluster-ip-range=10.43.0.0/16",
		"--authorization-mode=Node,RBAC",
		"--anonymous-auth=false",
		"--enable-admission-plugins=NodeRestriction",
		"--allow-privileged=true",
		"--profiling=false",
		"--cert-dir=" + filepath.Join(certDir, "apiserver-generated"),
	}
	if ip := net.ParseIP(advertise); ip == nil || ip.IsLoopback() {
		args = append(args, "--endpoint-reconciler-type=none")
	}
	return args
}
