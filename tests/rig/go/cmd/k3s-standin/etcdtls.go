package main

// etcd's certificates as k3s lays them out under DATA_DIR/server/tls/etcd/:
//   server-ca.crt/.key          CA of the client port's serving and client certs
//   server-client.crt/.key      this member's serving cert on :2379 (also a client cert)
//   client.crt/.key             the client cert the API server (and regrade) use
//   peer-ca.crt/.key            CA of the peer port
//   peer-server-client.crt/.key this member's cert on :2380, both ways
// k3s copies the CAs from the cluster's bootstrap data at join; here a missing CA is
// generated, so several stand-ins share one cluster when the test seeds the same CAs
// into each data dir. Leaves are made per member (kept across restarts).

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

const (
	etcdServerCA, etcdServerCAKey = "server-ca.crt", "server-ca.key"
	etcdServing, etcdServingKey   = "server-client.crt", "server-client.key"
	etcdClient, etcdClientKey     = "client.crt", "client.key"
	etcdPeerCA, etcdPeerCAKey     = "peer-ca.crt", "peer-ca.key"
	etcdPeer, etcdPeerKey         = "peer-server-client.crt", "peer-server-client.key"
)

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

func writePEMFile(path, typ string, der []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), mode); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func pemBlock(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		return nil, fmt.Errorf("%s: no PEM", path)
	}
	return blk.Bytes, nil
}

func serialNo() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	return n
}

// ensureCA makes dir/cert+key unless both exist, and returns them.
func ensureCA(dir, certF, keyF, cn string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	cp, kp := filepath.Join(dir, certF), filepath.Join(dir, keyF)
	if !fileExists(cp) || !fileExists(kp) {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, nil, err
		}
		now := time.Now().Add(-time.Hour)
		tmpl := &x509.Certificate{SerialNumber: serialNo(), Subject: pkix.Name{CommonName: cn},
			NotBefore: now, NotAfter: now.AddDate(10, 0, 0), IsCA: true, BasicConstraintsValid: true,
			KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
		if err != nil {
			return nil, nil, err
		}
		kd, _ := x509.MarshalECPrivateKey(k)
		if err := writePEMFile(kp, "EC PRIVATE KEY", kd, 0o600); err != nil {
			return nil, nil, err
		}
		if err := writePEMFile(cp, "CERTIFICATE", der, 0o644); err != nil {
			return nil, nil, err
		}
	}
	cd, err := pemBlock(cp)
	if err != nil {
		return nil, nil, err
	}
	ca, err := x509.ParseCertificate(cd)
	if err != nil {
		return nil, nil, err
	}
	kd, err := pemBlock(kp)
	if err != nil {
		return nil, nil, err
	}
	// SEC1 ("EC PRIVATE KEY", as written here) or PKCS#8 (as openssl writes a seeded CA).
	if key, err := x509.ParseECPrivateKey(kd); err == nil {
		return ca, key, nil
	}
	k8, err := x509.ParsePKCS8PrivateKey(kd)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %v", kp, err)
	}
	key, ok := k8.(*ecdsa.PrivateKey)
	if !ok {
		return nil, nil, fmt.Errorf("%s: not an ECDSA key", kp)
	}
	return ca, key, nil
}

// ensureLeaf makes dir/cert+key signed by ca unless both exist.
func ensureLeaf(dir, certF, keyF, cn string, hosts []string, usage []x509.ExtKeyUsage, ca *x509.Certificate, caKey *ecdsa.PrivateKey) error {
	cp, kp := filepath.Join(dir, certF), filepath.Join(dir, keyF)
	if fileExists(cp) && fileExists(kp) {
		return nil
	}
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	now := time.Now().Add(-time.Hour)
	tmpl := &x509.Certificate{SerialNumber: serialNo(), Subject: pkix.Name{CommonName: cn},
		NotBefore: now, NotAfter: now.AddDate(10, 0, 0), KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: usage}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else if h != "" {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
	if err != nil {
		return err
	}
	kd, _ := x509.MarshalECPrivateKey(k)
	if err := writePEMFile(kp, "EC PRIVATE KEY", kd, 0o600); err != nil {
		return err
	}
	return writePEMFile(cp, "CERTIFICATE", der, 0o644)
}

// ensureEtcdCerts fills dir (DATA_DIR/server/tls/etcd) with what is missing. hosts go
// on the serving and peer certs, with 127.0.0.1 and localhost as k3s puts them.
func ensureEtcdCerts(dir string, hosts []string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	hosts = append([]string{"127.0.0.1", "localhost", "::1"}, hosts...)
	both := []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
	ca, caKey, err := ensureCA(dir, etcdServerCA, etcdServerCAKey, "etcd-server-ca")
	if err != nil {
		return err
	}
	if err := ensureLeaf(dir, etcdServing, etcdServingKey, "etcd-server", hosts, both, ca, caKey); err != nil {
		return err
	}
	if err := ensureLeaf(dir, etcdClient, etcdClientKey, "etcd-client", nil, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, ca, caKey); err != nil {
		return err
	}
	pca, pcaKey, err := ensureCA(dir, etcdPeerCA, etcdPeerCAKey, "etcd-peer-ca")
	if err != nil {
		return err
	}
	return ensureLeaf(dir, etcdPeer, etcdPeerKey, "etcd-peer", hosts, both, pca, pcaKey)
}
