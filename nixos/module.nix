# services.regrade: steps a k3s server down under memory pressure without losing its
# etcd vote, one server at a time (docs/behaviour.md, "The NixOS contract").
{
  config,
  lib,
  pkgs,
  ...
}: let
  cfg = config.services.regrade;
  k3s = config.services.k3s;
  toml = pkgs.formats.toml {};

  # The path regrade reads by default, so `regrade status` by hand finds it too.
  configPath = "/etc/regrade/regrade.toml";
  # A stable path for k3s's ExecStartPre: k3s.service's unit text then never changes when
  # regrade is upgraded or turned off, so neither restarts k3s (docs/behaviour.md,
  # "The NixOS contract").
  hookPath = "/etc/regrade/record-start";

  # k3s reads `<config>.d/*.yaml` and `*.yml` after its config file; with no --config,
  # that is /etc/rancher/k3s/config.yaml.d.
  k3sConfigFile =
    if k3s.configPath == null
    then "/etc/rancher/k3s/config.yaml"
    else toString k3s.configPath;
  defaultDropin = "${k3sConfigFile}.d/50-regrade.yaml";
  # services.regrade.protect.systemReservedMemory, as k3s reads it from its config drop-ins.
  reservedFile = pkgs.writeText "40-regrade-reserved.yaml" ''
    kubelet-arg+:
      - "system-reserved=memory=${toString cfg.protect.systemReservedMemory}"
  '';
  # k3s's and the system's memory PSI (cgroup v2: k3s.service is in system.slice, the
  # pods in kubepods.slice beside it); the default pressure source while the pods are capped.
  serverPsi = "/sys/fs/cgroup/system.slice/memory.pressure";
  psiSource =
    if cfg.settings.pressure.source == null
    then "/proc/pressure/memory"
    else cfg.settings.pressure.source;
  # With pressure.memory_cgroup on cgroup v2 and the source left at the host's file,
  # regrade reads that cgroup's memory.pressure instead (src/pressure.rs,
  # resolve_psi_source); on cgroup v1 the file does not exist ("-" below skips it).
  memoryCgroup = cfg.settings.pressure.memory_cgroup or null;
  cgroupPsi =
    if memoryCgroup != null && psiSource == "/proc/pressure/memory"
    then "${memoryCgroup}/memory.pressure"
    else null;
  dropinDir = dirOf cfg.settings.systemd.dropin;
  recordFile = cfg.settings.systemd.record;
  stateFile = cfg.settings.state_file;
  # The level record (src/level_record.rs): on disk, so it survives a reboot below full.
  levelRecordFile = cfg.settings.level_record or "/var/lib/regrade/level.json";
  # Outside the StateDirectory, the daemon's sandbox must be opened to it.
  levelRecordElsewhere = dirOf levelRecordFile != "/var/lib/regrade";
  # Left by the switch-time check; `regrade watch` starts no step while it holds (src/hold.rs
  # reads it: `switch-hold` beside the state file).
  holdFile = "${dirOf stateFile}/switch-hold";

  # k3s's etcd client certificates (k3s writes them under its data dir at first start).
  etcdTls = "${cfg.k3sDataDir}/server/tls/etcd";
  etcdSettings = cfg.settings.etcd;
  etcdFiles = {
    ca_file = "${etcdTls}/server-ca.crt";
    cert_file = "${etcdTls}/client.crt";
    key_file = "${etcdTls}/client.key";
  };
  # What regrade.service reads: the configured file, or k3s's.
  etcdFile = key:
    if etcdSettings.${key} != null
    then etcdSettings.${key}
    else etcdFiles.${key};

  # k3s runs embedded etcd when it initialises a cluster or joins one; a config file or
  # extra flags may say so too (they are not read here).
  k3sFlags = lib.flatten [k3s.extraFlags];
  # A memory reservation the operator already makes through the k3s module: regrade's own
  # must not be installed after it. The kubelet keeps the last `system-reserved` value per
  # key, and its flags beat its config file (extraKubeletConfig, in newer nixpkgs), so
  # regrade's 40-regrade-reserved.yaml would replace a larger reservation with its own.
  # (A reservation in configPath's file is not seen here; `regrade status` names it.)
  operatorReservesMemory =
    lib.any (f: lib.hasInfix "system-reserved" f && lib.hasInfix "memory=" f) k3sFlags
    || ((k3s.extraKubeletConfig or {}).systemReserved.memory or null) != null;
  installReserved = cfg.protect.systemReservedMemory != null && !configPathInStore && !operatorReservesMemory;
  flagGiven = flag: lib.any (f: f == flag || lib.hasPrefix "${flag} " f || lib.hasPrefix "${flag}=" f) k3sFlags;
  embeddedEtcd =
    k3s.clusterInit
    || k3s.serverAddr != ""
    || k3s.configPath != null
    || flagGiven "--cluster-init"
    || flagGiven "--server";

  # k3s's Kubernetes version (nixpkgs' k3s is e.g. "1.33.5+k3s1"; unknown: taken as current).
  k3sVersion = k3s.package.version or "";
  # ValidatingAdmissionPolicy is GA (admissionregistration.k8s.io/v1) from Kubernetes 1.30.
  admissionPolicyServed = k3sVersion == "" || builtins.compareVersions k3sVersion "1.30" >= 0;

  # The ports k3s servers with embedded etcd and flannel's VXLAN need open between them.
  k3sPorts = {
    tcp = [6443 2379 2380 10250];
    udp = [8472];
  };
  fw = config.networking.firewall;
  portOpen = proto: port: let
    allowed = fw."allowed${proto}Ports" ++ lib.concatMap (i: i."allowed${proto}Ports") (lib.attrValues fw.interfaces);
    ranges = fw."allowed${proto}PortRanges" ++ lib.concatMap (i: i."allowed${proto}PortRanges") (lib.attrValues fw.interfaces);
  in
    lib.elem port allowed || lib.any (r: r.from <= port && port <= r.to) ranges;
  closedPorts =
    map (p: "${toString p}/tcp") (lib.filter (p: !portOpen "TCP" p) k3sPorts.tcp)
    ++ map (p: "${toString p}/udp") (lib.filter (p: !portOpen "UDP" p) k3sPorts.udp);

  metricsListen =
    if lib.hasInfix ":" cfg.metrics.listenAddress
    then "[${cfg.metrics.listenAddress}]:${toString cfg.metrics.port}"
    else "${cfg.metrics.listenAddress}:${toString cfg.metrics.port}";

  # A path literal (./k3s.yaml) is copied into the store when k3s.service names it.
  configPathInStore =
    k3s.configPath
    != null
    && (builtins.isPath k3s.configPath || lib.hasPrefix builtins.storeDir (toString k3s.configPath));

  mintCredentials = cfg.kubeconfig == null;
  mintedKubeconfig = "/var/lib/regrade/kubeconfig";

  # Typed options default to null, meaning "regrade's built-in default"; TOML has no null.
  # The sections a regrade before `[etcd]`/`[metrics]` does not know are left out whole
  # when nothing in them is set, so that regrade still reads the file. (Other empty
  # tables stay: an empty `levels.<level>.k3s` means "no flags".)
  nonNull = lib.filterAttrsRecursive (_: v: v != null) cfg.settings;
  settingsFile = toml.generate "regrade.toml" (lib.filterAttrs (n: v: !(lib.elem n ["etcd" "metrics"] && v == {})) nonNull);

  # Checked at build time, so a wrong key fails `nixos-rebuild`, not the running daemon.
  checkedSettings =
    if cfg.checkConfig
    then
      pkgs.runCommand "regrade.toml" {settings = settingsFile;} ''
        ${cfg.package}/bin/regrade --config "$settings" check-config >/dev/null
        cp "$settings" $out
      ''
    else settingsFile;

  recordStart = pkgs.writeShellScript "regrade-record-start" ''
    exec ${cfg.package}/bin/regrade --config ${configPath} record-start
  '';

  # Runs before every start of k3s (ExecStartPre with "-": it can never fail k3s's start).
  k3sStartHook = pkgs.writeShellScript "regrade-k3s-start-hook" ''
    if [ -x ${hookPath} ]; then
      exec ${hookPath}
    fi
    # regrade is off: a record left from when it was on would be stale once k3s restarts.
    ${pkgs.coreutils}/bin/rm -f -- ${lib.escapeShellArg recordFile}
  '';

  # This server's own credential (docs/behaviour.md, "Least privilege"): `regrade credential`
  # asks the local API server, then the other servers', with k3s's admin credentials (which
  # only this oneshot, root, reads; the daemon never holds them) for a token of the
  # ServiceAccount regrade/<Node> bound to the Node, and writes it beside the kubeconfig
  # naming it. It keeps a token while the API server accepts it, until less than half of its
  # lifetime and one renewal period are left (settings.credential, which it reads).
  mintCommand = "${cfg.package}/bin/regrade --config ${configPath} credential --admin-kubeconfig /etc/rancher/k3s/k3s.yaml";
  # "90s", "15m", "24h", "7d" in seconds (the credential options' pattern).
  seconds = d: let
    m = builtins.match "([0-9]+)(s|m|h|d)" d;
  in
    builtins.fromJSON (builtins.elemAt m 0)
    * {
      s = 1;
      m = 60;
      h = 3600;
      d = 86400;
    }
    .${builtins.elemAt m 1};
  lifetimeSeconds = seconds cfg.credential.lifetime;
  # The timer's period: at most a quarter of the lifetime (regrade check-config's rule), and
  # no more than 15 minutes.
  renewPeriodSeconds =
    if cfg.credential.renewPeriod != null
    then seconds cfg.credential.renewPeriod
    else if lifetimeSeconds / 4 < 900
    then lifetimeSeconds / 4
    else 900;
  renewPeriod = "${toString renewPeriodSeconds}s";
  # Written by `regrade watch` at the API server's first 401 (src/cluster/rejected.rs).
  rejectedNote = "${mintedKubeconfig}.rejected";
  nullOr = t: lib.types.nullOr t;
  flagValue = with lib.types; oneOf [bool int str (listOf str)];
  levelOptions = name: example: {
    freeformType = toml.type;
    options = {
      taint_effect = lib.mkOption {
        type = nullOr (lib.types.enum ["NoSchedule" "PreferNoSchedule" "NoExecute"]);
        default = null;
        example = "NoSchedule";
        description = ''
          Effect of regrade's taint on the Node while at `${name}`. `null`: regrade's
          default, `NoSchedule` (nothing new lands; the drain moves the pods within
          their PodDisruptionBudgets). `NoExecute` deletes every pod that does not
          tolerate it, DaemonSet pods included, bypassing PodDisruptionBudgets.
        '';
      };
      drain = lib.mkOption {
        type = nullOr lib.types.bool;
        default = null;
        example = false;
        description = "Evict the Node's pods through the Eviction API on the way down to `${name}` (PodDisruptionBudgets respected, DaemonSet and mirror pods left). `null`: regrade's default (on). Needs a regrade that knows `drain`.";
      };
      drain_timeout = lib.mkOption {
        type = nullOr lib.types.str;
        default = null;
        example = "5m";
        description = "How long the drain may take before `on_drain_timeout` applies. `null`: regrade's default (2m).";
      };
      on_drain_timeout = lib.mkOption {
        type = nullOr (lib.types.enum ["proceed" "delete"]);
        default = null;
        example = "delete";
        description = "When the drain's deadline passes with pods left: `proceed` (the step completes, the pods stay, each named) or `delete` (delete them, as `kubectl drain --disable-eviction`). `null`: `proceed`.";
      };
      k3s = lib.mkOption {
        type = nullOr (lib.types.attrsOf flagValue);
        default = null;
        inherit example;
        description = ''
          k3s flags (config.yaml keys, without dashes) in force at `${name}`, written to the
          k3s config drop-in. `null`: regrade's built-in flags (none for `control-plane`;
          `disable-apiserver`, `disable-controller-manager`, `disable-scheduler` for
          `etcd-only`). Adding `disable-agent` is possible but k3s does not support it with
          embedded etcd (such servers were seen restarting every 15 minutes).
        '';
      };
    };
  };
in {
  # Options removed in earlier versions fail with what replaced them, not "does not exist".
  imports = [
    (lib.mkRemovedOptionModule ["services" "regrade" "rbac" "serviceAccount"] ''
      Each server now has its own ServiceAccount, regrade/<Node>, bound to its Node and minted by
      regrade-credentials.service (services.regrade.credential); deploy/rbac.yaml names them.
      Remove the setting; services.regrade.kubeconfig chooses another credential.'')
    (lib.mkRemovedOptionModule ["services" "regrade" "rbac" "namespace"] ''
      regrade's RBAC lives in the namespace `regrade` (deploy/rbac.yaml), which
      services.regrade.rbac.enable installs; it is not configurable. Remove the setting.'')
  ];

  options.services.regrade = {
    enable = lib.mkEnableOption ''
      regrade on this k3s server: under sustained memory pressure it steps the server
      down (control-plane, then etcd-only) keeping its etcd vote, one server of the
      cluster at a time, and steps it back up once memory is calm'';

    package = lib.mkOption {
      type = lib.types.package;
      default = pkgs.regrade;
      defaultText = lib.literalExpression "regrade.packages.\${system}.default (the flake's module sets it)";
      description = "The regrade package. Build it with the `docker` feature only for the Docker backend.";
    };

    apiServers = lib.mkOption {
      type = lib.types.listOf (lib.types.strMatching "https://.+");
      default = [];
      example = ["https://10.0.0.2:6443" "https://10.0.0.3:6443"];
      description = ''
        API endpoints of the OTHER k3s servers. At `etcd-only` this server runs no API
        server of its own, so regrade reaches the cluster through these (tried in turn).
        Written to `cluster.api_servers`.
      '';
    };

    kubeconfig = lib.mkOption {
      type = nullOr lib.types.str;
      default = null;
      example = "/etc/rancher/k3s/k3s.yaml";
      description = ''
        Credentials regrade uses for the Kubernetes API. `null` (the default): this
        server's own credential, a token of the ServiceAccount regrade/<Node> bound to its
        Node with only the rights of deploy/rbac.yaml and deploy/admission-policy.yaml,
        written to ${mintedKubeconfig} (and `.token` beside it) by
        `regrade-credentials.service` and renewed by its timer. Give
        `/etc/rancher/k3s/k3s.yaml` to run with k3s's admin credentials instead (more rights
        than regrade needs: `regrade check-access` names it over-privileged).
      '';
    };

    credential = {
      lifetime = lib.mkOption {
        type = lib.types.strMatching "[0-9]+(s|m|h|d)";
        default = "24h";
        example = "7d";
        description = ''
          How long each token of this server's credential is valid (at least 10m). A new
          token is minted once less than half of this and one `renewPeriod` are left, so
          the API servers may be unreachable for half of it before regrade loses its
          credential; a running `regrade watch` uses the new token at its next request,
          with no restart. A token the API server rejects (its Node deleted and registered
          again) is replaced at once: `regrade watch` notes the first 401 and
          `regrade-credentials.path` starts the credential unit.
        '';
      };
      renewPeriod = lib.mkOption {
        type = nullOr (lib.types.strMatching "[0-9]+(s|m|h|d)");
        default = null;
        example = "5m";
        description = ''
          How often `regrade-credentials.timer` runs the credential unit. `null`: a quarter
          of `lifetime`, at most 15 minutes. More than a quarter of `lifetime` is refused
          (a token could expire between runs).
        '';
      };
    };

    rbac = {
      enable = lib.mkOption {
        type = lib.types.bool;
        default = true;
        description = ''
          Install regrade's RBAC (deploy/rbac.yaml: the namespace `regrade` whose
          ServiceAccounts, one per server, may read Nodes and patch them, the Lease, node
          Leases, Events, the drain's pods list and pods/eviction, pods delete for
          `on_drain_timeout = "delete"`) and, with k3s 1.30 or later, the admission policy
          (deploy/admission-policy.yaml: each server's credential may change only its own
          Node, and on it only regrade's marks) through `services.k3s.manifests`, so the
          cluster applies them. Turn off to manage them yourself.
        '';
      };
    };

    k3sDataDir = lib.mkOption {
      type = lib.types.str;
      default = "/var/lib/rancher/k3s";
      description = ''
        k3s's data directory (its `--data-dir`; the nixpkgs module keeps the default). The
        etcd client certificates regrade reads by default are under
        `<k3sDataDir>/server/tls/etcd/`: `server-ca.crt`, `client.crt`, `client.key`.
      '';
    };

    switchHoldSeconds = lib.mkOption {
      type = lib.types.ints.between 30 900;
      default = 300;
      description = ''
        How long the switch-time check (of a configuration with regrade off) holds the
        running `regrade watch` from starting a step, so no step starts between the check
        and regrade.service stopping. The hold ends on its own.
      '';
    };

    protect = {
      memoryLow = lib.mkOption {
        type = lib.types.nullOr lib.types.str;
        default = "512M";
        example = "1G";
        description = ''
          `MemoryLow=` on k3s.service and on system.slice (cgroup v2 only; ignored on v1):
          under memory pressure the kernel reclaims from unprotected cgroups (the pods,
          under /kubepods) before it takes k3s's and its etcd member's pages below this.
          In place before any thrash, whether regrade is on or off. Sized from the
          measured footprint (docs/incident.md: a k3s server at control-plane 321 MiB PSS
          with the workload drained, 98 MiB at etcd-only; Talos gives etcd 256 MiB). Cost:
          the pods lose up to this much sooner under pressure. Measured: it keeps k3s's
          pages but not its time (k3s's allocations still stall in the host's reclaim),
          and with the pods uncapped it lengthened a thrash (docs/incident-vm.md);
          `systemReservedMemory` is the lever that moved the member's time away. A change
          applies at the switch, and (NixOS restarts a unit whose settings change)
          restarts k3s once. `null`: not set. `regrade status` says whether it is in force.
        '';
      };
      oomScoreAdjust = lib.mkOption {
        type = lib.types.nullOr (lib.types.ints.between (-1000) 1000);
        default = -999;
        description = ''
          `OOMScoreAdjust=` of k3s.service. k3s runs at 0 until its embedded kubelet sets
          -999 on its own process, and the kubelet starts only once an API server
          answers: during every restart of k3s (a step into etcd-only included) the
          largest process on the host would be the OOM killer's first pick. -999 is the
          kubelet's own value, from the start. Cost: the OOM killer picks other processes
          (the pods first) instead. A change restarts k3s once at the switch. `null`: not set.
        '';
      };
      systemReservedMemory = lib.mkOption {
        type = lib.types.nullOr lib.types.str;
        default = "768Mi";
        description = ''
          The kubelet's `system-reserved` memory, through a k3s config drop-in
          (`<config>.d/40-regrade-reserved.yaml`, `kubelet-arg+`). k3s reserves nothing,
          so /kubepods may take all of RAM; with this the kubelet caps it at RAM less this
          (enforce-node-allocatable=pods, the default) and schedules against that.
          Measured: the one protection that shortened how long the etcd member is away
          under a thrash (docs/incident.md, docs/incident-vm.md). Sized on a 2 GiB host,
          where the kernel, k3s and the system took about 510 MiB outside the pods' cap:
          512Mi left the kernel in global reclaim (member away 15-40 s of a 9-minute
          thrash), 768Mi did not (1.4 and 1.9 s). A bigger host or a fuller k3s needs
          more: what is outside /kubepods at its busiest, plus 256 MiB. Cost: this much
          less allocatable memory for pods on the server.
          k3s reads it at its next start (no restart at the switch). `null`: not set.
        '';
      };
    };

    metrics = {
      enable = lib.mkEnableOption "regrade's Prometheus metrics endpoint (`[metrics] listen`)";
      listenAddress = lib.mkOption {
        type = lib.types.str;
        default = "127.0.0.1";
        example = "0.0.0.0";
        description = "Address the metrics endpoint listens on. Loopback (the default) is the recommendation; scrape through a local agent.";
      };
      port = lib.mkOption {
        type = lib.types.port;
        default = 9559;
        description = "TCP port of the metrics endpoint.";
      };
      openFirewall = lib.mkOption {
        type = lib.types.bool;
        default = false;
        description = "Open `port` in the NixOS firewall (only useful with a non-loopback `listenAddress`).";
      };
    };

    watchdogSec = lib.mkOption {
      type = lib.types.ints.positive;
      default = 60;
      example = 120;
      description = "systemd's `WatchdogSec` for regrade.service, in seconds; regrade pings at half of it, also while a step runs.";
    };

    checkConfig = lib.mkOption {
      type = lib.types.bool;
      default = pkgs.stdenv.buildPlatform.canExecute pkgs.stdenv.hostPlatform;
      defaultText = lib.literalExpression "pkgs.stdenv.buildPlatform.canExecute pkgs.stdenv.hostPlatform";
      description = "Run `regrade check-config` on the generated file at build time.";
    };

    settings = lib.mkOption {
      default = {};
      description = ''
        regrade's configuration (/etc/regrade/regrade.toml); see `regrade check-config`
        and the README for every key. The keys operators change most are typed here; any
        other key may be set too. `null` leaves regrade's built-in default.
      '';
      example = lib.literalExpression ''
        {
          step_up = "automatic";
          pressure = {
            threshold = 40;
            mem_available_floor = "512MiB";
            sustain = "1m";
            cooldown = "5m";
          };
          levels.control-plane.taint_effect = "NoSchedule";
        }
      '';
      type = lib.types.submodule {
        freeformType = toml.type;
        options = {
          step_up = lib.mkOption {
            type = nullOr (lib.types.enum ["automatic" "manual"]);
            default = null;
            example = "manual";
            description = "`manual`: never step back up by itself (`regrade step up` does). `null`: `automatic`.";
          };
          state_file = lib.mkOption {
            type = lib.types.str;
            default = "/run/regrade/state.json";
            description = "Where `regrade watch` publishes its level, streaks and last step for `regrade status` (and the switch-time check).";
          };
          pressure = lib.mkOption {
            default = {};
            description = "When a sample is over or calm (docs/behaviour.md, section Decision rules).";
            type = lib.types.submodule {
              freeformType = toml.type;
              options = {
                threshold = lib.mkOption {
                  type = nullOr (lib.types.either lib.types.int lib.types.float);
                  default = null;
                  example = 40;
                  description = "PSI percent (of `metric`, default some_avg10) at or above which a sample may be over. `null`: 40.";
                };
                calm_threshold = lib.mkOption {
                  type = nullOr (lib.types.either lib.types.int lib.types.float);
                  default = null;
                  example = 10;
                  description = "PSI percent below which a sample may be calm. `null`: `threshold`.";
                };
                source = lib.mkOption {
                  type = nullOr lib.types.str;
                  default = null;
                  example = "/proc/pressure/memory";
                  description = ''
                    The PSI file regrade reads. Default here: system.slice's `memory.pressure` (the stalls of k3s
                    and the system) while `protect.systemReservedMemory` caps the pods, since host-wide their own
                    thrash inside the cap counts as the server's and steps it for nothing (docs/incident-vm.md);
                    otherwise, or `null` with the reservation off, `/proc/pressure/memory`.
                  '';
                };
                mem_available_floor = lib.mkOption {
                  type = nullOr (lib.types.either lib.types.ints.unsigned lib.types.str);
                  default = null;
                  example = "512MiB";
                  description = "Over also needs MemAvailable below this, calm at or above it. `null`: 512MiB; `\"none\"`: decide on PSI alone.";
                };
                sustain = lib.mkOption {
                  type = nullOr lib.types.str;
                  default = null;
                  example = "2m";
                  description = "How long a streak of over (or calm) samples must last before a step. `null`: 1m.";
                };
                cooldown = lib.mkOption {
                  type = nullOr lib.types.str;
                  default = null;
                  example = "10m";
                  description = "Least time between two steps, in either direction. `null`: 5m.";
                };
              };
            };
          };
          levels = lib.mkOption {
            default = {};
            description = "Per-level settings below `full`.";
            type = lib.types.submodule {
              freeformType = toml.type;
              options = {
                step_timeout = lib.mkOption {
                  type = nullOr lib.types.str;
                  default = null;
                  example = "25m";
                  description = "The deadline of one step, from taking the Lease to releasing it; past it the step is rolled back and reported. Must be longer than a step's waits at their bounds together (the longest `drain_timeout`, the restart's health and ready timeouts, `etcd.catch_up_timeout`; or a failed restart's health and ready timeouts twice, with its undoing). `null`: regrade's default (25m).";
                };
                control-plane = lib.mkOption {
                  default = {};
                  description = "The `control-plane` level: cordoned, tainted, labelled, k3s not restarted.";
                  type = lib.types.submodule (levelOptions "control-plane" {});
                };
                etcd-only = lib.mkOption {
                  default = {};
                  description = "The `etcd-only` level: k3s restarted without API server, controller manager and scheduler.";
                  type = lib.types.submodule (levelOptions "etcd-only" {
                    disable-apiserver = true;
                    disable-controller-manager = true;
                    disable-scheduler = true;
                  });
                };
              };
            };
          };
          cluster = lib.mkOption {
            default = {};
            description = "Coordination across servers (the Lease, the peer gate, the API endpoints).";
            type = lib.types.submodule {
              freeformType = toml.type;
              options = {
                api_servers = lib.mkOption {
                  type = lib.types.listOf lib.types.str;
                  default = [];
                  description = "Set from `services.regrade.apiServers`; set that instead.";
                };
                kubeconfig = lib.mkOption {
                  type = nullOr lib.types.str;
                  default = null;
                  description = "Set from `services.regrade.kubeconfig` (the minted least-privilege kubeconfig by default).";
                };
                node_name = lib.mkOption {
                  type = nullOr lib.types.str;
                  default = null;
                  description = "This server's Node name. Set from `services.k3s.nodeName` (k3s's `--node-name`); `null`: the host name, as k3s.";
                };
              };
            };
          };
          etcd = lib.mkOption {
            default = {};
            description = ''
              How regrade asks this server's etcd member about its peers before a k3s
              restart. Each key is written only when set, so a regrade that does not know
              `[etcd]` yet still reads the file; regrade.service can read the certificate
              files either way (and nothing else of k3s's data directory).
            '';
            type = lib.types.submodule {
              freeformType = toml.type;
              options = {
                endpoints = lib.mkOption {
                  type = nullOr (lib.types.listOf (lib.types.strMatching "https?://.+"));
                  default = null;
                  example = ["https://127.0.0.1:2379"];
                  description = "etcd client URLs of this server's member. `null`: `https://127.0.0.1:2379`.";
                };
                ca_file = lib.mkOption {
                  type = nullOr lib.types.str;
                  default = null;
                  description = "CA of etcd's server certificate. `null`: k3s's, `<k3sDataDir>/server/tls/etcd/server-ca.crt`.";
                };
                cert_file = lib.mkOption {
                  type = nullOr lib.types.str;
                  default = null;
                  description = "etcd client certificate. `null`: k3s's, `<k3sDataDir>/server/tls/etcd/client.crt`.";
                };
                key_file = lib.mkOption {
                  type = nullOr lib.types.str;
                  default = null;
                  description = "Its key. `null`: k3s's, `<k3sDataDir>/server/tls/etcd/client.key`.";
                };
              };
            };
          };
          systemd = lib.mkOption {
            default = {};
            description = "The systemd actuator.";
            type = lib.types.submodule {
              freeformType = toml.type;
              options = {
                dropin = lib.mkOption {
                  type = lib.types.str;
                  default = defaultDropin;
                  defaultText = lib.literalExpression ''"''${services.k3s.configPath or "/etc/rancher/k3s/config.yaml"}.d/50-regrade.yaml"'';
                  description = "The k3s config drop-in regrade writes below `full`; it must be in the directory k3s reads drop-ins from.";
                };
                record = lib.mkOption {
                  type = lib.types.str;
                  default = "/run/regrade/started-level";
                  description = "Where the ExecStartPre hook of k3s.service records the level k3s started at.";
                };
              };
            };
          };
        };
      };
    };
  };

  config = lib.mkMerge [
    # Whenever k3s runs, whether regrade is on or off: the same ExecStartPre line, so
    # turning regrade on or off, or upgrading it, never changes (and restarts) k3s.service.
    (lib.mkIf k3s.enable {
      systemd.services.k3s.serviceConfig = {
        ExecStartPre = ["-${k3sStartHook}"];
        # The static protections (services.regrade.protect), also whenever k3s runs,
        # so turning regrade on or off does not change them either.
        MemoryLow = lib.mkIf (cfg.protect.memoryLow != null) cfg.protect.memoryLow;
        OOMScoreAdjust = lib.mkIf (cfg.protect.oomScoreAdjust != null) cfg.protect.oomScoreAdjust;
      };
      # cgroup v2 protects k3s.service only within its slice's own protection.
      systemd.slices.system.sliceConfig.MemoryLow = lib.mkIf (cfg.protect.memoryLow != null) cfg.protect.memoryLow;
      systemd.tmpfiles.rules = lib.mkIf installReserved [
        "L+ ${k3sConfigFile}.d/40-regrade-reserved.yaml - - - - ${reservedFile}"
      ];
      warnings =
        lib.optional (cfg.protect.systemReservedMemory != null && operatorReservesMemory) ''
          services.regrade.protect.systemReservedMemory (${toString cfg.protect.systemReservedMemory}) is not installed: services.k3s already reserves system memory for the kubelet (extraFlags or extraKubeletConfig.systemReserved), and regrade's reservation, read after it, would replace it. Set protect.systemReservedMemory = null to say so and silence this.'';
    })

    # Turning regrade off while the server is below full would leave it there: nothing
    # would step it back up. This check is part of the configuration being switched TO,
    # so it runs when that configuration has regrade off.
    (lib.mkIf (!cfg.enable) {
      # The text runs in NixOS's pre-switch-checks script; nixos/pre-switch-check.sh says how.
      system.preSwitchChecks.regrade-not-below-full =
        ''
          regrade_dropin=${lib.escapeShellArg cfg.settings.systemd.dropin}
          regrade_record=${lib.escapeShellArg recordFile}
          regrade_state=${lib.escapeShellArg stateFile}
          regrade_level_record=${lib.escapeShellArg levelRecordFile}
          regrade_hold=${lib.escapeShellArg holdFile}
          regrade_hold_seconds=${toString cfg.switchHoldSeconds}
          regrade_bin=${pkgs.coreutils}/bin
        ''
        + builtins.readFile ./pre-switch-check.sh;
    })

    (lib.mkIf cfg.enable {
      assertions = [
        {
          assertion = k3s.enable;
          message = "services.regrade.enable needs services.k3s.enable = true: regrade steps this host's k3s server down and up.";
        }
        {
          assertion = k3s.role == "server";
          message = ''services.regrade: services.k3s.role is "${k3s.role}", but regrade steps k3s SERVERS (etcd voters) only; an agent has no etcd member to protect. Enable regrade on the servers, not on this agent.'';
        }
        {
          assertion = cfg.apiServers != [];
          message = "services.regrade.apiServers is empty: list the API endpoints of the other k3s servers (e.g. [ \"https://10.0.0.2:6443\" \"https://10.0.0.3:6443\" ]). At etcd-only this server has no API server of its own and reaches the cluster through theirs.";
        }
        {
          assertion = !configPathInStore;
          message = "services.regrade: services.k3s.configPath (${toString k3s.configPath}) ${
            if builtins.isPath k3s.configPath
            then "is a Nix path, so k3s reads a copy in the Nix store"
            else "is in the Nix store"
          }, where its drop-in directory (<config>.d) cannot be written: regrade could not change k3s's flags. Give a path outside the store as a string (e.g. \"/etc/rancher/k3s/config.yaml\", written with environment.etc) or leave configPath unset.";
        }
        {
          assertion = configPathInStore || dropinDir == "${k3sConfigFile}.d";
          message = "services.regrade.settings.systemd.dropin = \"${cfg.settings.systemd.dropin}\" is not in ${k3sConfigFile}.d, the directory k3s reads config drop-ins from: k3s would never see regrade's flags.";
        }
        {
          assertion = lib.hasSuffix ".yaml" cfg.settings.systemd.dropin || lib.hasSuffix ".yml" cfg.settings.systemd.dropin;
          message = "services.regrade.settings.systemd.dropin = \"${cfg.settings.systemd.dropin}\" must end in .yaml or .yml: k3s reads only those files of ${k3sConfigFile}.d.";
        }
        {
          assertion = k3s.role != "server" || embeddedEtcd;
          message = "services.regrade: this k3s server runs no etcd: with neither services.k3s.clusterInit, nor serverAddr, nor configPath (nor --cluster-init or --server in extraFlags), k3s keeps its data in embedded SQLite, so there is no etcd vote for regrade to protect. Set services.k3s.clusterInit = true on the first server and serverAddr on the others, or leave regrade off on this host.";
        }
        {
          assertion = !mintCredentials || (lifetimeSeconds >= 600 && renewPeriodSeconds > 0 && renewPeriodSeconds * 4 <= lifetimeSeconds);
          message = "services.regrade.credential: renewPeriod = ${renewPeriod} with lifetime = ${cfg.credential.lifetime} leaves a gap: the lifetime must be at least 10m and the timer must run at least every quarter of it (${toString (lifetimeSeconds / 4)}s), or a token can expire between two runs.";
        }
        {
          assertion = !k3s.disableAgent;
          message = "services.regrade: services.k3s.disableAgent = true runs this server without its kubelet, so it has no Node for regrade to cordon, taint and label. Keep the agent on the servers regrade runs on (or leave regrade off here).";
        }
      ];

      # firewall.nix trusts "lo" itself; another trusted interface is taken to be the cluster's.
      warnings =
        lib.optional (cfg.rbac.enable && !admissionPolicyServed) ''
          services.regrade: k3s ${k3sVersion} (Kubernetes before 1.30) serves no ValidatingAdmissionPolicy, so deploy/admission-policy.yaml is not installed: regrade's credential is bounded by its RBAC alone and may patch any field of any Node. Upgrade k3s to 1.30 or later for the policy.''
        ++ lib.optional (fw.enable && lib.remove "lo" fw.trustedInterfaces == [] && closedPorts != []) ''
          services.regrade: the NixOS firewall is on and does not open ${lib.concatStringsSep ", " closedPorts}, which k3s servers with embedded etcd need between them (API 6443/tcp, etcd 2379-2380/tcp, kubelet 10250/tcp, flannel VXLAN 8472/udp); the nixpkgs k3s module opens none. Without them the servers cannot form a cluster: open them (networking.firewall.allowedTCPPorts / allowedUDPPorts, or per interface).'';

      services.regrade.settings = {
        cluster = {
          api_servers = cfg.apiServers;
          kubeconfig = lib.mkDefault (
            if mintCredentials
            then mintedKubeconfig
            else cfg.kubeconfig
          );
          # k3s registers the Node under --node-name; regrade must patch that one.
          node_name = lib.mkIf (k3s.nodeName != null) (lib.mkDefault k3s.nodeName);
        };
        # What regrade-credentials.timer runs on (check-config refuses a pair with a gap).
        credential = lib.mkIf mintCredentials {
          lifetime = cfg.credential.lifetime;
          renew_period = renewPeriod;
        };
        # Only a non-default data dir needs the paths written (regrade's defaults are k3s's).
        etcd = lib.mkIf (cfg.k3sDataDir != "/var/lib/rancher/k3s") (lib.mapAttrs (_: lib.mkDefault) etcdFiles);
        metrics = lib.mkIf cfg.metrics.enable {listen = metricsListen;};
        # The pods capped: the server's pressure, not theirs (settings.pressure.source).
        pressure.source = lib.mkIf (cfg.protect.systemReservedMemory != null || operatorReservesMemory) (lib.mkDefault serverPsi);
      };

      networking.firewall.allowedTCPPorts = lib.mkIf (cfg.metrics.enable && cfg.metrics.openFirewall) [cfg.metrics.port];

      environment.systemPackages = [cfg.package];
      environment.etc."regrade/regrade.toml".source = checkedSettings;
      environment.etc."regrade/record-start".source = recordStart;

      systemd.tmpfiles.rules =
        [
          # Both must exist before regrade.service starts: its sandbox can only grant
          # write access to paths that exist.
          "d ${dropinDir} 0755 root root -"
          "d ${dirOf recordFile} 0755 root root -"
        ]
        ++ lib.optional (dirOf stateFile != dirOf recordFile) "d ${dirOf stateFile} 0755 root root -"
        ++ lib.optional levelRecordElsewhere "d ${dirOf levelRecordFile} 0755 root root -";

      # Two files: on a cluster without ValidatingAdmissionPolicy the policy's would fail
      # to apply, and the RBAC must not fail with it.
      services.k3s.manifests = lib.mkIf cfg.rbac.enable (
        {regrade-rbac.source = ../deploy/rbac.yaml;}
        // lib.optionalAttrs admissionPolicyServed {regrade-admission-policy.source = ../deploy/admission-policy.yaml;}
      );

      # Nothing of regrade's starts k3s: the units order after k3s.service and never want
      # it, so an operator's `systemctl stop k3s` (an etcd snapshot restore needs k3s
      # stopped on every server) holds. Only a gated step restarts k3s.
      systemd.services.regrade-credentials = lib.mkIf mintCredentials {
        description = "regrade: this server's own credential (a token bound to its Node), minted and renewed";
        after = ["k3s.service"];
        before = ["regrade.service"];
        startLimitIntervalSec = 0;
        serviceConfig = {
          # Not RemainAfterExit: the timer starts it again to renew the token.
          Type = "oneshot";
          ExecStart = mintCommand;
          # Until k3s has registered the Node and applied deploy/rbac.yaml.
          Restart = "on-failure";
          RestartSec = "10s";
          StateDirectory = "regrade";
          StateDirectoryMode = "0700";
        };
      };

      systemd.timers.regrade-credentials = lib.mkIf mintCredentials {
        description = "regrade: renew this server's credential by half of its lifetime";
        wantedBy = ["timers.target"];
        timerConfig = {
          OnBootSec = renewPeriod;
          OnUnitActiveSec = renewPeriod;
        };
      };

      # regrade watch writes the note at the API server's first 401: renew now.
      systemd.paths.regrade-credentials = lib.mkIf mintCredentials {
        description = "regrade: renew this server's credential when the API server rejects it";
        wantedBy = ["paths.target"];
        pathConfig.PathChanged = rejectedNote;
      };

      systemd.services.regrade = {
        description = "regrade: steps this k3s server down under memory pressure, one server at a time";
        wantedBy = ["multi-user.target"];
        after = ["k3s.service" "network-online.target"] ++ lib.optional mintCredentials "regrade-credentials.service";
        wants = ["network-online.target"] ++ lib.optional mintCredentials "regrade-credentials.service";
        restartTriggers = [checkedSettings];
        startLimitIntervalSec = 0;
        serviceConfig = {
          Type = "notify";
          NotifyAccess = "main";
          ExecStart = "${cfg.package}/bin/regrade --config ${configPath} watch";
          Restart = "always";
          RestartSec = "5s";
          WatchdogSec = cfg.watchdogSec;
          # regrade finishes a running step before it honours SIGTERM, so k3s is never
          # left between levels: a step ends by levels.step_timeout (25 min by default)
          # plus its rollback's 60 s. Stopping must not kill it midway.
          TimeoutStopSec = "30min";
          # Ahead of the workloads for a CPU: regrade needs little (0.2 s a step), but a
          # host that thrashes keeps its cores busy, and in the incident test a step into
          # etcd-only waited 0.22 s for a CPU at the default priority.
          Nice = -10;
          # Ahead of the workloads for the disk: a step makes a few durable writes (its
          # level record, the drop-in), and under thrash each waited 0.2-0.3 s behind the
          # page-ins on the disk's queue. In the realtime class the I/O scheduler
          # (mq-deadline, bfq) serves them first. regrade's I/O is those few writes.
          IOSchedulingClass = "realtime";
          # The API servers discovered from default/kubernetes (cluster.endpoints_cache)
          # and the etcd members last seen (etcd.members_cache) are cached here; ProtectSystem = "strict" leaves /var read-only otherwise.
          # Shared with regrade-credentials, which writes the minted kubeconfig here.
          StateDirectory = "regrade";
          StateDirectoryMode = "0700";

          # Root, but only to write root's k3s drop-in and talk to systemd on the system
          # bus; every other capability is dropped. CAP_IPC_LOCK: mlockall, so a host that
          # thrashes cannot page the watcher out.
          CapabilityBoundingSet = ["CAP_IPC_LOCK"];
          NoNewPrivileges = true;
          ProtectSystem = "strict";
          ReadWritePaths = lib.unique (
            [dropinDir (dirOf recordFile) (dirOf stateFile)]
            ++ lib.optional levelRecordElsewhere (dirOf levelRecordFile)
            # The PSI trigger writes to a cgroup's memory.pressure, which
            # ProtectControlGroups would make read-only.
            ++ lib.optional (lib.hasPrefix "/sys/fs/cgroup/" psiSource) "-${psiSource}"
            ++ lib.optional (cgroupPsi != null && lib.hasPrefix "/sys/fs/cgroup/" cgroupPsi) "-${cgroupPsi}"
          );
          # Of k3s's data directory (its tokens, its CA keys), only the etcd client
          # certificates are visible, read-only: an empty read-only tmpfs over it with the
          # three files bound in (systemd.exec(5) gives this pairing as its example).
          # "-": a missing file is for regrade to name, not a unit that cannot start.
          TemporaryFileSystem = ["${cfg.k3sDataDir}:ro"];
          BindReadOnlyPaths = map (k: "-${etcdFile k}") ["ca_file" "cert_file" "key_file"];
          ProtectHome = true;
          PrivateTmp = true;
          PrivateDevices = true;
          ProtectKernelTunables = true;
          ProtectKernelModules = true;
          ProtectKernelLogs = true;
          ProtectControlGroups = true;
          ProtectClock = true;
          ProtectHostname = true;
          # Not ProcSubset=pid: it hides /proc/pressure and /proc/meminfo.
          ProtectProc = "invisible";
          RestrictAddressFamilies = ["AF_UNIX" "AF_INET" "AF_INET6"];
          RestrictNamespaces = true;
          RestrictRealtime = true;
          RestrictSUIDSGID = true;
          LockPersonality = true;
          MemoryDenyWriteExecute = true;
          RemoveIPC = true;
          SystemCallArchitectures = "native";
          SystemCallFilter = ["@system-service" "@memlock" "~@privileged"];
          UMask = "0022";
        };
      };
    })
  ];
}
