// Command etcd is a plain etcd server built from go.etcd.io/etcd/server/v3's
// etcdmain package, for regrade's tests (the machine has no etcd release).
// It takes the normal etcd flags: --name, --data-dir, --listen-client-urls,
// --advertise-client-urls, --listen-peer-urls, --initial-advertise-peer-urls,
// --initial-cluster, --initial-cluster-state, --listen-metrics-urls, ...
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
