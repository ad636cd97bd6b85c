# Three k3s servers with embedded etcd (server1 initialises the cluster, the others join),
# regrade on all three, driven by fixture pressure files. Modelled on nixpkgs'
# nixos/tests/rancher (k3s) multi-node test: 1536 MiB per VM, a locally built pause
# image, the bundled components disabled, flannel on eth1.
# Run: nix build .#checks.x86_64-linux.three-servers -L
{
  self,
  pkgs,
}: let
  inherit (pkgs) lib;
  names = ["server1" "server2" "server3"];
  # The whole run's budget (the driver's default is an hour). Every wait below takes at
  # most what is left of it less a margin, so a slow builder fails at the wait that is
  # slow, with its name, instead of being killed mid-wait.
  globalTimeout = 2700;
  # The settings under test, from the file .ci/run checks with `regrade check-config`.
  vmSettings = builtins.fromTOML (builtins.readFile ../../tests/nixos/vm-settings.toml);
  fixtureDir = dirOf vmSettings.pressure.source;

  tokenFile = pkgs.writeText "k3s-token" "regrade-vm-test-token";
  pauseImage = pkgs.dockerTools.buildImage {
    name = "test.local/pause";
    tag = "local";
    copyToRoot = pkgs.buildEnv {
      name = "regrade-test-pause-env";
      paths = [pkgs.tini pkgs.coreutils];
    };
    config.Entrypoint = ["/bin/tini" "--" "/bin/sleep" "inf"];
  };

  # Calm values, in place from boot so regrade.service finds its files at start.
  calmPsi = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\\n";
  calmMeminfo = "MemTotal: 1572864 kB\\nMemAvailable: 1048576 kB\\n";

  server = name: {
    config,
    nodes,
    ...
  }: {
    imports = [self.nixosModules.default];
    virtualisation.memorySize = 1536;
    virtualisation.diskSize = 4096;
    networking.firewall.enable = false;
    environment.systemPackages = [pkgs.jq pkgs.etcd pkgs.curl];

    services.k3s = {
      enable = true;
      role = "server";
      inherit tokenFile;
      clusterInit = name == "server1";
      serverAddr = lib.optionalString (name != "server1") "https://${nodes.server1.networking.primaryIPAddress}:6443";
      images = [pauseImage];
      extraFlags =
        [
          "--disable coredns"
          "--disable local-storage"
          "--disable metrics-server"
          "--disable servicelb"
          "--disable traefik"
          "--node-ip ${config.networking.primaryIPAddress}"
          "--flannel-iface eth1"
          "--pause-image test.local/pause:local"
          # server3 reserves more system memory than regrade's 768Mi on k3s's command
          # line: the module must install no reservation of its own there (subtest 0).
        ]
        ++ lib.optional (name == "server3") "--kubelet-arg=system-reserved=memory=1Gi";
    };

    services.regrade = {
      enable = true;
      settings = vmSettings;
      apiServers = map (n: "https://${nodes.${n}.networking.primaryIPAddress}:6443") (lib.remove name names);
    };

    systemd.tmpfiles.rules = [
      "d ${fixtureDir} 0755 root root -"
      "f ${vmSettings.pressure.source} 0644 root root - ${calmPsi}"
      "f ${vmSettings.pressure.meminfo} 0644 root root - ${calmMeminfo}"
    ];

    # The "nixos-rebuild switch" of steps 6 and 9: the same system with regrade off.
    system.switch.enable = true;
    specialisation.no-regrade.configuration.services.regrade.enable = lib.mkForce false;
  };
in {
  name = "regrade-three-servers";
  inherit globalTimeout;
  nodes = lib.genAttrs names server;

  testScript = ''
    import json, time

    # The margin leaves the driver time to stop the VMs and report.
    global_timeout = ${toString globalTimeout}
    budget_end = time.monotonic() + global_timeout - 120

    def left(cap):
        rest = int(budget_end - time.monotonic())
        assert rest > 0, f"the test's budget (globalTimeout {global_timeout}s less 120s) is spent"
        return min(cap, rest)

    servers = [server1, server2, server3]
    by_name = {"server1": server1, "server2": server2, "server3": server3}
    etcd_tls = "/var/lib/rancher/k3s/server/tls/etcd"
    etcdctl = (f"etcdctl --endpoints https://127.0.0.1:2379 --cacert {etcd_tls}/server-ca.crt"
               f" --cert {etcd_tls}/client.crt --key {etcd_tls}/client.key")
    psi_file = "${vmSettings.pressure.source}"
    meminfo_file = "${vmSettings.pressure.meminfo}"

    def kubectl(m, args):
        return m.succeed(f"k3s kubectl {args}")

    def pressure(m, psi, available_kb):
        # In place (same inode): regrade keeps both files open and re-reads them.
        m.succeed(f"printf 'some avg10={psi:.2f} avg60={psi:.2f} avg300={psi:.2f} total=0\\n"
                  f"full avg10=0.00 avg60=0.00 avg300=0.00 total=0\\n' > {psi_file}")
        m.succeed(f"printf 'MemTotal: 1572864 kB\\nMemAvailable: {available_kb} kB\\n' > {meminfo_file}")

    def over(m):
        pressure(m, 80, 100 * 1024)

    def calm(m):
        pressure(m, 0, 1024 * 1024)

    def status(m):
        return json.loads(m.succeed("regrade status --json"))

    def wait_level(m, level, timeout=left(900)):
        m.wait_until_succeeds(f"regrade status --json | jq -e '.level == \"{level}\"'", timeout=left(timeout))

    def node_label(via, name):
        return kubectl(via, f"get node {name} -o json | jq -r '.metadata.labels[\"regrade.dev/level\"] // \"\"'").strip()

    def below_full(via):
        nodes = json.loads(kubectl(via, "get nodes -o json"))["items"]
        return {n["metadata"]["name"] for n in nodes if "regrade.dev/level" in n["metadata"].get("labels", {})}

    def member_id(m, name):
        members = json.loads(m.succeed(f"{etcdctl} member list -w json"))["members"]
        ids = [mb["ID"] for mb in members if mb["name"].startswith(name + "-")]
        assert len(ids) == 1, f"etcd members of {name}: {members}"
        return ids[0]

    def k3s_invocation(m):
        return m.succeed("systemctl show -p InvocationID --value k3s.service").strip()

    def switch_no_regrade(m):
        return m.execute("/run/current-system/specialisation/no-regrade/bin/switch-to-configuration test 2>&1")

    start_all()
    for m in servers:
        m.wait_for_unit("k3s.service", timeout=left(900))
    for name in by_name:
        server1.wait_until_succeeds(f"k3s kubectl wait --for=condition=Ready node/{name} --timeout=10s", timeout=left(900))
    for m in servers:
        # A oneshot that its timer starts again: done once its token is written.
        m.wait_until_succeeds("test -s /var/lib/regrade/kubeconfig.token", timeout=left(600))
        m.wait_for_unit("regrade.service", timeout=left(300))
        wait_level(m, "full")
    # The daemon runs with this server's own token (bound to its Node), not k3s's admin
    # credentials, and the admission policy bounds it: check-access exits 0 only then.
    server1.succeed("grep -q tokenFile /var/lib/regrade/kubeconfig && ! grep -q client-key-data /var/lib/regrade/kubeconfig")
    server1.wait_until_succeeds("regrade check-access", timeout=left(120))

    def kubelet_reserved(m):
        # k3s logs the kubelet's arguments as it starts it; the kubelet keeps the last
        # value of a repeated flag.
        line = m.succeed("journalctl -u k3s.service -o cat | grep 'Running kubelet' | tail -n 1")
        values = [a.split("=", 1)[1] for a in line.split() if a.startswith("--system-reserved=")]
        return values[-1] if values else None

    def reserved_finding(m):
        return [p for p in status(m)["protections"] if p["protection"] == "reserved memory"][0]

    with subtest("0. regrade's reservation on server1; server3 reserves more itself, and keeps it"):
        server1.succeed("test -e /etc/rancher/k3s/config.yaml.d/40-regrade-reserved.yaml")
        assert kubelet_reserved(server1) == "memory=768Mi", kubelet_reserved(server1)
        assert reserved_finding(server1)["state"] == "in place", reserved_finding(server1)
        server3.fail("test -e /etc/rancher/k3s/config.yaml.d/40-regrade-reserved.yaml")
        assert kubelet_reserved(server3) == "memory=1Gi", kubelet_reserved(server3)
        found = reserved_finding(server3)
        assert found["state"] == "in place" and found["value"] == "1Gi", found

    with subtest("1. a Lease held by someone else refuses a step; released, the step proceeds"):
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(int(server2.succeed("date +%s"))))
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": "regrade", "namespace": "kube-system"},
                 "spec": {"holderIdentity": "made-up-holder", "leaseDurationSeconds": 3600,
                          "acquireTime": now, "renewTime": now}}
        server2.succeed(f"echo '{json.dumps(lease)}' | k3s kubectl apply -f -")
        over(server1)
        server1.wait_until_succeeds("regrade status --json | jq -e '.refusal.kind == \"lease-held\"'", timeout=left(120))
        assert status(server1)["level"] == "full"
        assert node_label(server2, "server1") == ""
        kubectl(server2, "-n kube-system delete lease regrade")

    with subtest("2. pressure steps server1 to control-plane, then etcd-only; no other server below full"):
        id_before = member_id(server2, "server1")
        secret_before = kubectl(server2, "-n kube-system get secret server1.node-password.k3s -o jsonpath='{.metadata.uid}{.data}'")
        wait_level(server1, "control-plane", timeout=left(300))
        # The next step may already be under way (cooldown 20s): the label is one of the two.
        assert node_label(server2, "server1") in ("control-plane", "etcd-only")
        assert below_full(server2) == {"server1"}, below_full(server2)
        assert json.loads(kubectl(server2, "get node server1 -o json"))["spec"].get("unschedulable") is True
        wait_level(server1, "etcd-only")
        server1.succeed("test -e /etc/rancher/k3s/config.yaml.d/50-regrade.yaml")
        server1.wait_until_succeeds("curl -sf http://127.0.0.1:2381/health", timeout=left(300))
        server2.wait_until_succeeds("k3s kubectl get node server1 -o json | jq -e '.metadata.labels[\"regrade.dev/level\"] == \"etcd-only\"'", timeout=left(300))
        assert below_full(server2) == {"server1"}, below_full(server2)
        for m in (server2, server3):
            assert status(m)["level"] == "full"

    with subtest("3. server1 keeps its etcd member ID, its Node with the label, its node-password Secret"):
        assert member_id(server2, "server1") == id_before
        assert member_id(server1, "server1") == id_before
        assert node_label(server2, "server1") == "etcd-only"
        assert kubectl(server2, "-n kube-system get secret server1.node-password.k3s -o jsonpath='{.metadata.uid}{.data}'") == secret_before

    with subtest("4. with server1 at etcd-only and server3 stopped, the cluster still takes writes"):
        server3.systemctl("stop k3s.service")
        server2.wait_until_succeeds("k3s kubectl create configmap quorum-check --from-literal=at=etcd-only", timeout=left(300))
        server2.succeed("k3s kubectl get configmap quorum-check")

        with subtest("5. pressure on server2 meanwhile is refused (server1 is below full)"):
            over(server2)
            server2.wait_until_succeeds("regrade status --json | jq -e '.refusal != null'", timeout=left(120))
            assert status(server2)["level"] == "full"
            assert node_label(server2, "server2") == ""
            calm(server2)

        server3.systemctl("start k3s.service")
        server3.wait_for_unit("k3s.service", timeout=left(900))
        server2.wait_until_succeeds("k3s kubectl wait --for=condition=Ready node/server3 --timeout=10s", timeout=left(900))

    with subtest("6. turning regrade off on server1 while it is below full is refused"):
        code, out = switch_no_regrade(server1)
        assert code != 0, out
        assert "regrade step to full" in out, out
        server1.succeed("systemctl is-active regrade.service")
        # A refused switch leaves no hold: regrade stays free to step back up.
        server1.fail("test -e /run/regrade/switch-hold")

    with subtest("7. calm fixture values step server1 back up to full by itself"):
        calm(server1)
        wait_level(server1, "full")
        assert status(server1)["last_step"]["from"] == "control-plane", status(server1)
        server1.fail("test -e /etc/rancher/k3s/config.yaml.d/50-regrade.yaml")
        server2.wait_until_succeeds("k3s kubectl get node server1 -o json | jq -e '(.metadata.labels[\"regrade.dev/level\"] // \"\") == \"\"'", timeout=left(300))
        assert json.loads(kubectl(server2, "get node server1 -o json"))["spec"].get("unschedulable") is not True
        assert member_id(server2, "server1") == id_before

    with subtest("8. regrade step down / step up by hand on server2"):
        server2.wait_until_succeeds("k3s kubectl wait --for=condition=Ready node/server1 --timeout=10s", timeout=left(600))
        # Neither over nor calm: the watcher on server2 takes no step of its own meanwhile.
        pressure(server2, 20, 1024 * 1024)
        server2.succeed("regrade step down")
        assert status(server2)["level"] == "control-plane"
        assert node_label(server1, "server2") == "control-plane"
        server2.succeed("regrade step up")
        assert status(server2)["level"] == "full"
        assert node_label(server1, "server2") == ""
        calm(server2)

    with subtest("9. every server at full: turning regrade off succeeds and restarts no k3s"):
        for m in servers:
            wait_level(m, "full")
        before = k3s_invocation(server1)
        code, out = switch_no_regrade(server1)
        assert code == 0, out
        assert k3s_invocation(server1) == before, "k3s.service was restarted"
        # The check held the running regrade from starting a step until it stopped.
        until = int(server1.succeed("head -n1 /run/regrade/switch-hold").strip())
        assert until > int(server1.succeed("date +%s")), until
        server1.fail("systemctl is-active regrade.service")
        server1.succeed("systemctl is-active k3s.service")
  '';
}
