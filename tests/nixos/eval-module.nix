# Evaluates nixos/module.nix with nixpkgs' `lib` (lib.evalModules) against stub
# declarations of the NixOS options it reads and sets, for an enabled server, a disabled
# one, the README's example cluster, the VM test's nodes and each misconfiguration its
# assertions must refuse. Run by tests/nixos/eval-module.sh:
#   nix-instantiate --eval --strict --json tests/nixos/eval-module.nix \
#     --arg lib 'import /path/to/nixpkgs.lib/lib' --argstr tmp /some/dir \
#     --argstr example /some/dir/example/flake.nix
#
# The stubs declare only what the module touches, each with the type, default and merge
# of the real declaration; what NixOS does with the values (unit files, tmpfiles) is the
# VM test's to show. The real files they follow (NixOS/nixpkgs, at the commit the
# project's source index holds; the nixos-25.11 forms of these declarations):
#   services.k3s.*            nixos/modules/services/cluster/rancher/default.nix
#                             (011c1bdb102b0191d091f747cbefff1539f3a96d) and .../rancher/k3s.nix
#                             (01bb496ce68f871fd31af75d4edaaab9346453a0, clusterInit, disableAgent)
#   systemd.services.*        nixos/lib/systemd-unit-options.nix (unitOption: a list in any
#                             definition concatenates them all, else all must be equal)
#   system.preSwitchChecks    nixos/modules/system/activation/pre-switch-check.nix (attrsOf str)
#   networking.firewall.*     nixos/modules/services/networking/firewall.nix
#                             (0192bb844360b5b42ebaf7f575f84d79910a5927; it adds "lo" to
#                             trustedInterfaces when enabled)
#   environment.etc.*         nixos/modules/system/etc/etc.nix (source: path, no default)
#   assertions, warnings      nixos/modules/misc/assertions.nix
{
  lib,
  tmp,
  example ? null,
}: let
  inherit (lib) mkOption types;

  # Stand-ins for store objects: string-interpolate to a fake store path, keep their text.
  stubDrv = name: attrs:
    {
      type = "derivation";
      inherit name;
      outPath = "${builtins.storeDir}/00000000000000000000000000000000-${name}";
    }
    // attrs;

  tomlValue =
    types.nullOr (types.oneOf [
      types.bool
      types.int
      types.float
      types.str
      types.path
      (types.attrsOf tomlValue)
      (types.listOf tomlValue)
    ])
    // {description = "TOML value";};

  pkgs = {
    formats.toml = _: {
      type = types.attrsOf tomlValue;
      generate = name: value: stubDrv name {inherit value;};
    };
    runCommand = name: env: text: stubDrv name {inherit env text;};
    writeShellScript = name: text: stubDrv name {inherit text;};
    writeText = name: text: stubDrv name {inherit text;};
    coreutils = stubDrv "coreutils" {};
    regrade = stubDrv "regrade-0.1.0" {};
    k3s = stubDrv "k3s" {};
    stdenv = {
      buildPlatform.canExecute = _: true;
      hostPlatform.system = "x86_64-linux";
    };
  };

  # nixos/lib/systemd-unit-options.nix's unitOption.
  unitOption = lib.mkOptionType {
    name = "systemd option";
    merge = loc: defs: let
      defs' = lib.filterOverrides defs;
    in
      if lib.any (d: builtins.isList d.value) defs'
      then lib.concatMap (d: lib.toList d.value) defs'
      else lib.mergeEqualOption loc defs';
  };
  unitNames = mkOption {
    type = types.listOf types.str;
    default = [];
  };

  # networking.firewall's commonOptions "incoming".
  firewallPorts = {
    allowedTCPPorts = mkOption {
      type = types.listOf types.port;
      default = [];
      apply = ports: lib.unique (builtins.sort builtins.lessThan ports);
    };
    allowedUDPPorts = mkOption {
      type = types.listOf types.port;
      default = [];
      apply = ports: lib.unique (builtins.sort builtins.lessThan ports);
    };
    allowedTCPPortRanges = mkOption {
      type = types.listOf (types.attrsOf types.port);
      default = [];
    };
    allowedUDPPortRanges = mkOption {
      type = types.listOf (types.attrsOf types.port);
      default = [];
    };
  };

  stubs = {config, ...}: {
    _file = "tests/nixos/eval-module.nix#stubs";
    options = {
      assertions = mkOption {
        type = types.listOf types.unspecified;
        default = [];
      };
      warnings = mkOption {
        type = types.listOf types.str;
        default = [];
      };
      networking.hostName = mkOption {
        type = types.str;
        default = "nixos";
      };
      networking.firewall =
        {
          enable = mkOption {
            type = types.bool;
            default = true;
          };
          trustedInterfaces = mkOption {
            type = types.listOf types.str;
            default = [];
          };
          interfaces = mkOption {
            default = {};
            type = types.attrsOf (types.submodule [{options = firewallPorts;}]);
          };
        }
        // firewallPorts;
      services.k3s = {
        enable = lib.mkEnableOption "k3s";
        package = mkOption {
          type = types.package;
          default = pkgs.k3s;
        };
        role = mkOption {
          type = types.enum ["server" "agent"];
          default = "server";
        };
        serverAddr = mkOption {
          type = types.str;
          default = "";
        };
        token = mkOption {
          type = types.str;
          default = "";
        };
        tokenFile = mkOption {
          type = types.nullOr types.path;
          default = null;
        };
        extraFlags = mkOption {
          type = types.either types.str (types.listOf types.str);
          default = [];
        };
        environmentFile = mkOption {
          type = types.nullOr types.path;
          default = null;
        };
        configPath = mkOption {
          type = types.nullOr types.path;
          default = null;
        };
        disable = mkOption {
          type = types.listOf types.str;
          default = [];
        };
        nodeName = mkOption {
          type = types.nullOr types.str;
          default = null;
        };
        nodeIP = mkOption {
          type = types.nullOr types.str;
          default = null;
        };
        images = mkOption {
          type = types.listOf types.package;
          default = [];
        };
        clusterInit = mkOption {
          type = types.bool;
          default = false;
        };
        disableAgent = mkOption {
          type = types.bool;
          default = false;
        };
        # Newer nixpkgs (rancher/default.nix since 25.05): the kubelet's config file.
        extraKubeletConfig = mkOption {
          type = types.attrs;
          default = {};
        };
        # rancher/default.nix's manifestModule; `source` has no default and is derived
        # from `content` when that is set (there with mkDerivedConfig).
        manifests = mkOption {
          default = {};
          type = types.attrsOf (types.submodule ({
            name,
            config,
            ...
          }: {
            options = {
              enable = mkOption {
                type = types.bool;
                default = true;
              };
              target = mkOption {type = types.nonEmptyStr;};
              content = mkOption {
                type = types.nullOr (types.either types.attrs (types.listOf types.attrs));
                default = null;
              };
              source = mkOption {type = types.path;};
            };
            config = {
              target = lib.mkDefault "${name}.yaml";
              source = lib.mkIf (config.content != null) (stubDrv "${name}-manifest-${name}" {inherit (config) content;});
            };
          }));
        };
      };
      systemd.services = mkOption {
        default = {};
        type = types.attrsOf (types.submodule {
          options = {
            description = mkOption {
              type = types.singleLineStr;
              default = "";
            };
            wantedBy = unitNames;
            requires = unitNames;
            after = unitNames;
            wants = unitNames;
            before = unitNames;
            restartTriggers = mkOption {
              type = types.listOf types.unspecified;
              default = [];
            };
            startLimitIntervalSec = mkOption {type = types.int;};
            serviceConfig = mkOption {
              type = types.attrsOf unitOption;
              default = {};
            };
          };
        });
      };
      # nixos/lib/systemd-unit-options.nix's slice options, as far as the module sets them.
      systemd.slices = mkOption {
        default = {};
        type = types.attrsOf (types.submodule {
          options.sliceConfig = mkOption {
            type = types.attrsOf unitOption;
            default = {};
          };
        });
      };
      # nixos/lib/systemd-unit-options.nix's timer options, as far as the module sets them.
      systemd.timers = mkOption {
        default = {};
        type = types.attrsOf (types.submodule {
          options = {
            description = mkOption {
              type = types.singleLineStr;
              default = "";
            };
            wantedBy = unitNames;
            timerConfig = mkOption {
              type = types.attrsOf unitOption;
              default = {};
            };
          };
        });
      };
      # nixos/lib/systemd-unit-options.nix's path options, as far as the module sets them.
      systemd.paths = mkOption {
        default = {};
        type = types.attrsOf (types.submodule {
          options = {
            description = mkOption {
              type = types.singleLineStr;
              default = "";
            };
            wantedBy = unitNames;
            pathConfig = mkOption {
              type = types.attrsOf unitOption;
              default = {};
            };
          };
        });
      };
      systemd.tmpfiles.rules = mkOption {
        type = types.listOf types.str;
        default = [];
      };
      environment.systemPackages = mkOption {
        type = types.listOf types.package;
        default = [];
      };
      environment.etc = mkOption {
        default = {};
        type = types.attrsOf (types.submodule {
          options.source = mkOption {type = types.path;};
        });
      };
      system.preSwitchChecks = mkOption {
        type = types.attrsOf types.str;
        default = {};
      };
    };
    # What firewall.nix itself sets.
    config.networking.firewall.trustedInterfaces = lib.mkIf config.networking.firewall.enable ["lo"];
  };

  # What nixpkgs' k3s module itself puts on the unit and checks, so the module's
  # definitions must merge with them.
  k3sBase = {config, ...}: let
    cfg = config.services.k3s;
  in {
    _file = "tests/nixos/eval-module.nix#k3sBase";
    config = lib.mkIf cfg.enable {
      assertions = [
        {
          assertion = cfg.role == "agent" -> !cfg.disableAgent;
          message = "k3s: disableAgent must be false if role is 'agent'";
        }
        {
          assertion = cfg.role == "agent" -> !cfg.clusterInit;
          message = "k3s: clusterInit must be false if role is 'agent'";
        }
      ];
      environment.systemPackages = [cfg.package];
      systemd.services.k3s = {
        description = "k3s service";
        after = ["firewall.service" "network-online.target"];
        wants = ["firewall.service" "network-online.target"];
        wantedBy = ["multi-user.target"];
        serviceConfig = {
          Type =
            if cfg.role == "agent"
            then "exec"
            else "notify";
          KillMode = "process";
          Delegate = "yes";
          Restart = "always";
          RestartSec = "5s";
          TimeoutStartSec = 0;
          EnvironmentFile = cfg.environmentFile;
          ExecStart = lib.concatStringsSep " " (
            ["${cfg.package}/bin/k3s ${cfg.role}"]
            ++ lib.optional cfg.clusterInit "--cluster-init"
            ++ lib.optional (cfg.serverAddr != "") "--server ${cfg.serverAddr}"
            ++ lib.optional (cfg.nodeName != null) "--node-name=${cfg.nodeName}"
            ++ lib.flatten cfg.extraFlags
          );
        };
      };
    };
  };

  # The flake's outputs with a stand-in nixpkgs input: only what nixosModules.default
  # needs is ever forced.
  flake = (import ../../flake.nix).outputs {
    self = flake // {packages.x86_64-linux.default = pkgs.regrade;};
    nixpkgs = {inherit lib;};
  };

  server = {
    services.k3s = {
      enable = true;
      role = "server";
      configPath = "${tmp}/config.yaml";
    };
    services.regrade = {
      enable = true;
      apiServers = ["https://192.168.1.2:6443" "https://192.168.1.3:6443"];
      settings.systemd.record = "${tmp}/started-level";
      settings.state_file = "${tmp}/state.json";
      settings.pressure = {
        threshold = 30;
        mem_available_floor = "256MiB";
        sustain = "30s";
      };
      settings.levels.etcd-only.taint_effect = "NoSchedule";
    };
    networking.firewall = {
      allowedTCPPorts = [6443 2379 2380 10250];
      allowedUDPPorts = [8472];
    };
  };

  evalWith = modules:
    (lib.evalModules {
      specialArgs = {inherit pkgs;};
      modules = [stubs k3sBase] ++ modules;
    })
    .config;
  eval = extra: evalWith [../../nixos/module.nix server extra];

  failing = c: map (a: a.message) (lib.filter (a: !a.assertion) c.assertions);
  # Whether evaluating `f c` throws (a type error, a conflicting definition).
  evaluates = v: (builtins.tryEval (builtins.deepSeq v true)).success;
  # A value, or "evaluation error" (e.g. an option today's module does not declare), so
  # one failing scenario is reported as such and the others still run.
  try = v: let
    r = builtins.tryEval (builtins.deepSeq v v);
  in
    if r.success
    then r.value
    else "evaluation error";
  tryEach = lib.mapAttrs (_: try);
  sandboxOf = c: let
    sc = c.systemd.services.regrade.serviceConfig;
  in {
    TemporaryFileSystem = sc.TemporaryFileSystem or "missing";
    BindReadOnlyPaths = sc.BindReadOnlyPaths or "missing";
  };

  summary = c: {
    failingAssertions = failing c;
    inherit (c) warnings;
    # What /etc/regrade/regrade.toml holds (the stub toml.generate keeps the value).
    settings = let
      src = c.environment.etc."regrade/regrade.toml".source or null;
    in
      if src == null
      then null
      # (A module that runs check-config without `settings` in its env: the option.)
      else src.value or src.env.settings.value or (lib.filterAttrsRecursive (_: v: v != null) c.services.regrade.settings);
    etc = lib.mapAttrs (_: v: toString v.source) c.environment.etc;
    tmpfiles = c.systemd.tmpfiles.rules;
    manifests = lib.mapAttrs (_: m: m.content or null) c.services.k3s.manifests;
    units = lib.mapAttrs (_: u: {inherit (u) after wants before serviceConfig;}) c.systemd.services;
    preSwitchChecks = c.system.preSwitchChecks;
    credentialsCommand = c.systemd.services.regrade-credentials.serviceConfig.ExecStart or null;
    credentialsTimer = c.systemd.timers.regrade-credentials or null;
    credentialsPath = c.systemd.paths.regrade-credentials or null;
    firewall = {inherit (c.networking.firewall) enable allowedTCPPorts allowedUDPPorts;};
  };

  # The VM test's nodes, evaluated as far as these stubs reach: the settings it reads
  # from tests/nixos/vm-settings.toml must merge with the module's typed options.
  vmTest = import ../../nixos/tests/three-servers.nix {
    self.nixosModules.default = ../../nixos/module.nix;
    pkgs =
      pkgs
      // {
        inherit lib;
        writeText = name: _: stubDrv name {};
        buildEnv = _: stubDrv "env" {};
        dockerTools.buildImage = _: stubDrv "pause-image" {};
        tini = stubDrv "tini" {};
        jq = stubDrv "jq" {};
        etcd = stubDrv "etcd" {};
        curl = stubDrv "curl" {};
      };
  };
  vmIp = name: "192.168.1.${lib.removePrefix "server" name}";
  vmStubs = {
    options = {
      virtualisation.memorySize = mkOption {type = types.int;};
      virtualisation.diskSize = mkOption {type = types.int;};
      networking.primaryIPAddress = mkOption {type = types.str;};
      system.switch.enable = mkOption {type = types.bool;};
      specialisation = mkOption {
        type = types.attrsOf (types.submodule {
          options.configuration = mkOption {type = types.deferredModule;};
        });
      };
    };
  };
  vmNode = name: extra:
    (lib.evalModules {
      specialArgs = {
        inherit pkgs;
        nodes = lib.genAttrs ["server1" "server2" "server3"] (n: {networking.primaryIPAddress = vmIp n;});
      };
      modules = [stubs vmStubs k3sBase vmTest.nodes.${name} {networking.primaryIPAddress = vmIp name;}] ++ extra;
    })
    .config;
  vmServer1 = vmNode "server1" [];
  vmServer1Off = vmNode "server1" [vmServer1.specialisation.no-regrade.configuration];

  # The README's example cluster (nixos/README-section.md's flake, written out by
  # eval-module.sh with empty hardware files), with nixosSystem evaluating these stubs.
  readmeExample = let
    outputs = (import example).outputs {
      nixpkgs.lib =
        lib
        // {
          nixosSystem = {modules, ...}: {config = evalWith modules;};
        };
      regrade = flake;
    };
  in
    lib.mapAttrs (_: s: summary s.config) outputs.nixosConfigurations;

  enabled = eval {};
  disabled = eval {services.regrade.enable = lib.mkForce false;};
  adminCreds = eval {services.regrade.kubeconfig = "/etc/rancher/k3s/k3s.yaml";};
  # k3s before and after Kubernetes 1.30 (ValidatingAdmissionPolicy GA).
  k3sAt = version: eval {services.k3s.package = lib.mkForce (pkgs.k3s // {inherit version;});};
  admissionPolicy =
    lib.mapAttrs (_: c: {
      manifests = builtins.attrNames c.services.k3s.manifests;
      inherit (c) warnings;
    }) {
      k3s129 = k3sAt "1.29.9+k3s1";
      k3s130 = k3sAt "1.30.0+k3s1";
      k3s133 = k3sAt "1.33.5+k3s1";
    };
  # Every path key away from its default.
  pathsElsewhere = {
    level_record = "/srv/regrade/level.json";
    state_file = lib.mkForce "/srv/regrade-state/state.json";
    systemd.record = lib.mkForce "/srv/regrade-run/started-level";
  };
  elsewhere = eval {services.regrade.settings = pathsElsewhere;};
  elsewhereOff = eval {
    services.regrade.enable = lib.mkForce false;
    services.regrade.settings = pathsElsewhere;
  };

  # Item by item, what users write (issue 15's list).
  twice = evalWith [flake.nixosModules.default flake.nixosModules.default server];
  named = eval {services.k3s.nodeName = "k3s-a";};
  # The base `server` opens the ports globally; these replace that.
  closeGlobal = {
    networking.firewall.allowedTCPPorts = lib.mkForce [];
    networking.firewall.allowedUDPPorts = lib.mkForce [];
  };
  firewallClosed = eval closeGlobal;
  firewallPerInterface = evalWith [
    ../../nixos/module.nix
    server
    closeGlobal
    {
      networking.firewall.interfaces.eth1 = {
        allowedTCPPorts = [6443 10250];
        allowedTCPPortRanges = [
          {
            from = 2379;
            to = 2380;
          }
        ];
        allowedUDPPorts = [8472];
      };
    }
  ];
  firewallTrusted = evalWith [../../nixos/module.nix server closeGlobal {networking.firewall.trustedInterfaces = ["eth1"];}];
  yml = eval {services.regrade.settings.systemd.dropin = "${tmp}/config.yaml.d/50-regrade.yml";};
  metrics = eval {
    services.regrade.metrics = {
      enable = true;
      openFirewall = true;
    };
  };
  metrics6 = eval {
    services.regrade.metrics = {
      enable = true;
      listenAddress = "::1";
      port = 9600;
    };
  };
  etcdCustom = eval {
    services.regrade.settings.etcd = {
      endpoints = ["https://127.0.0.1:2379"];
      key_file = "/etc/regrade/etcd.key";
    };
  };
  dataDir = eval {services.regrade.k3sDataDir = "/srv/k3s";};
  drain = eval {
    services.regrade.settings.levels.control-plane = {
      drain = true;
      drain_timeout = "3m";
      on_drain_timeout = "delete";
    };
  };
  badDrain = eval {services.regrade.settings.levels.control-plane.on_drain_timeout = "wait";};
in {
  enabled = summary enabled;
  disabled = summary disabled;
  # The daemon's sandbox, the directories made at boot and the switch-time check follow
  # the configured paths.
  pathsElsewhere = {
    readWritePaths = elsewhere.systemd.services.regrade.serviceConfig.ReadWritePaths;
    tmpfiles = elsewhere.systemd.tmpfiles.rules;
    settings = {inherit (elsewhere.services.regrade.settings) level_record state_file;};
    preSwitchCheck = elsewhereOff.system.preSwitchChecks.regrade-not-below-full;
  };
  adminKubeconfig = {
    kubeconfig = adminCreds.services.regrade.settings.cluster.kubeconfig;
    credentialsUnit = adminCreds.systemd.services ? regrade-credentials || adminCreds.systemd.timers ? regrade-credentials;
  };
  inherit admissionPolicy;
  # The shortest lifetime: the timer's period follows it (a quarter), and the pair is in
  # the settings check-config reads.
  shortLifetime = let
    c = eval {services.regrade.credential.lifetime = "10m";};
  in {
    failingAssertions = failing c;
    timer = c.systemd.timers.regrade-credentials.timerConfig;
    settings = c.services.regrade.settings.credential;
  };
  vm = {
    server1 = summary vmServer1;
    server2Settings = (summary (vmNode "server2" [])).settings;
    server2K3s = {inherit ((vmNode "server2" []).services.k3s) clusterInit serverAddr;};
    specialisationOff = {
      regradeUnit = vmServer1Off.systemd.services ? regrade;
      preSwitchCheck = vmServer1Off.system.preSwitchChecks ? regrade-not-below-full;
      k3sUnchanged = vmServer1Off.systemd.services.k3s.serviceConfig == vmServer1.systemd.services.k3s.serviceConfig;
    };
  };
  # services.regrade.protect: on by default, on k3s.service and system.slice whether
  # regrade is on or off; each lever off by itself with null.
  protect = let
    k3sUnit = c: c.systemd.services.k3s.serviceConfig;
    levers = c: {
      memoryLow = (k3sUnit c).MemoryLow or null;
      sliceMemoryLow = c.systemd.slices.system.sliceConfig.MemoryLow or null;
      oomScoreAdjust = (k3sUnit c).OOMScoreAdjust or null;
      reserved = lib.filter (lib.hasInfix "40-regrade-reserved.yaml") c.systemd.tmpfiles.rules;
    };
    off = eval {
      services.regrade.protect = {
        memoryLow = null;
        oomScoreAdjust = null;
        systemReservedMemory = null;
      };
    };
  in {
    enabled = levers enabled;
    disabled = levers disabled;
    off = levers off;
    reservedText = lib.head (lib.filter (lib.hasInfix "40-regrade-reserved.yaml") enabled.systemd.tmpfiles.rules);
    # With the pods capped regrade reads the server's PSI; the operator's setting wins.
    pressureSource = let
      source = c: c.services.regrade.settings.pressure.source;
    in {
      reserved = source enabled;
      unreserved = source off;
      set = source (eval {services.regrade.settings.pressure.source = "/proc/pressure/memory";});
    };
    # pressure.memory_cgroup with the host's source: regrade reads that cgroup's
    # memory.pressure (cgroup v2), which the PSI trigger writes to.
    cgroupPsiWritable =
      (eval {
        services.regrade.protect.systemReservedMemory = null;
        services.regrade.settings.pressure.memory_cgroup = "/sys/fs/cgroup/kubepods.slice";
      })
      .systemd
      .services
      .regrade
      .serviceConfig
      .ReadWritePaths;
  };
  # Turning regrade off must leave k3s.service's definition exactly as it was.
  k3sUnitUnchangedWhenDisabled =
    enabled.systemd.services.k3s.serviceConfig == disabled.systemd.services.k3s.serviceConfig;

  # 1. the flake's module imported twice (a shared profile and a host file).
  importedTwice = tryEach {
    evaluates = evaluates (toString twice.services.regrade.package);
    failingAssertions = failing twice;
  };
  # 3. k3s's --node-name is the Node regrade patches.
  nodeName = tryEach {
    setting = named.services.regrade.settings.cluster.node_name or "missing";
    k3sFlag = lib.hasInfix "--node-name=k3s-a" named.systemd.services.k3s.serviceConfig.ExecStart;
    unset = enabled.services.regrade.settings.cluster ? node_name && enabled.services.regrade.settings.cluster.node_name != null;
  };
  # 6. the firewall: closed ports are named; open ones (globally, per interface, a
  # trusted interface) are not; the README's example cluster forms.
  firewall = tryEach {
    closed = firewallClosed.warnings;
    open = enabled.warnings;
    perInterface = firewallPerInterface.warnings;
    trusted = firewallTrusted.warnings;
  };
  readme =
    if example == null
    then null
    else tryEach readmeExample;
  # 8. a .yml drop-in.
  ymlDropin = try (failing yml);
  # The round-2 keys: rendered only when set, so today's regrade reads the file.
  roundTwo = {
    defaultKeys = tryEach {
      etcd = enabled.services.regrade.settings ? etcd && lib.filterAttrs (_: v: v != null) enabled.services.regrade.settings.etcd != {};
      metrics = enabled.services.regrade.settings ? metrics;
      drain = lib.any (k: (enabled.services.regrade.settings.levels.control-plane.${k} or null) != null) ["drain" "drain_timeout" "on_drain_timeout"];
      firewallPorts = enabled.networking.firewall.allowedTCPPorts;
    };
    metrics = tryEach {
      listen = metrics.services.regrade.settings.metrics.listen or "missing";
      firewall = metrics.networking.firewall.allowedTCPPorts;
      listen6 = metrics6.services.regrade.settings.metrics.listen or "missing";
      firewall6 = metrics6.networking.firewall.allowedTCPPorts;
    };
    etcd = tryEach {
      sandbox = sandboxOf enabled;
      custom = lib.filterAttrs (_: v: v != null) etcdCustom.services.regrade.settings.etcd;
      customSandbox = (sandboxOf etcdCustom).BindReadOnlyPaths;
      dataDir = lib.filterAttrs (_: v: v != null) (dataDir.services.regrade.settings.etcd or {});
      dataDirSandbox = sandboxOf dataDir;
    };
    drain = try (lib.filterAttrs (_: v: v != null) (removeAttrs drain.services.regrade.settings.levels.control-plane ["taint_effect" "k3s"]));
    badDrainRefused = try (!(evaluates badDrain.services.regrade.settings.levels.control-plane.on_drain_timeout));
  };

  # The module-system rules the scenarios rest on, so that a lib (nixpkgs', or
  # tests/nixos/minilib.nix in CI) that broke them shows here.
  libSemantics = let
    ev = modules: (lib.evalModules {modules = [stubs] ++ modules;}).config;
    pkgDefs = n: ev (builtins.genList (_: {services.k3s.package = lib.mkDefault pkgs.k3s;}) n);
    keyed = {
      key = "same";
      services.k3s.package = lib.mkDefault pkgs.k3s;
    };
  in {
    onePackageDefinition = evaluates (pkgDefs 1).services.k3s.package;
    twoPackageDefinitionsRefused = !(evaluates (pkgDefs 2).services.k3s.package);
    sameKeyOnce = evaluates (ev [keyed keyed]).services.k3s.package;
    forceBeatsDefault = (ev [{services.k3s.role = lib.mkForce "agent";} {services.k3s.role = lib.mkDefault "server";}]).services.k3s.role == "agent";
    conflictingStrRefused = !(evaluates (ev [{services.k3s.serverAddr = "a";} {services.k3s.serverAddr = "b";}]).services.k3s.serverAddr);
    undeclaredRefused = !(evaluates (ev [{services.k3s.noSuchOption = true;}]).services.k3s.enable);
    mkIfFalseDropped = (ev [(lib.mkIf false {services.k3s.enable = true;})]).services.k3s.enable == false;
    unitListsConcatenate =
      (ev [{systemd.services.a.serviceConfig.X = ["1"];} {systemd.services.a.serviceConfig.X = "2";}]).systemd.services.a.serviceConfig.X
      == ["1" "2"];
    nullMixRefused = !(evaluates (ev [{services.k3s.nodeName = "a";} {services.k3s.nodeName = null;}]).services.k3s.nodeName);
    wrongTypeRefused = !(evaluates (ev [{services.k3s.clusterInit = "yes";}]).services.k3s.clusterInit);
  };

  misconfigured = lib.mapAttrs (_: c: try (failing (eval c))) {
    k3sOff.services.k3s.enable = lib.mkForce false;
    agent.services.k3s.role = lib.mkForce "agent";
    noOtherServers.services.regrade.apiServers = lib.mkForce [];
    configPathInStore.services.k3s.configPath = lib.mkForce "${builtins.storeDir}/0000-k3s-config.yaml";
    configPathLiteral.services.k3s.configPath = lib.mkForce ./eval-module.nix;
    dropinElsewhere.services.regrade.settings.systemd.dropin = lib.mkForce "/etc/regrade/50-regrade.yaml";
    dropinNotYaml.services.regrade.settings.systemd.dropin = lib.mkForce "${tmp}/config.yaml.d/50-regrade.conf";
    # 2. no clusterInit, no serverAddr, no configPath: k3s on SQLite.
    noEtcd.services.k3s.configPath = lib.mkForce null;
    # 5. a server without its agent has no Node.
    disableAgent.services.k3s.disableAgent = true;
    # issue 59: a 10-minute token and a 15-minute timer: expired between runs.
    credentialGap.services.regrade.credential = {
      lifetime = "10m";
      renewPeriod = "15m";
    };
  };
  # Options removed in earlier rounds fail with what replaced them (mkRemovedOptionModule).
  removedOptions = lib.mapAttrs (_: c: let
    msgs = try (failing (eval c));
  in
    if builtins.isList msgs
    then map (m: lib.hasInfix "no longer has any effect" m && lib.hasInfix "regrade" m && lib.hasInfix "deploy/rbac.yaml" m) msgs
    else msgs) {
    serviceAccount.services.regrade.rbac.serviceAccount = "regrade";
    namespace.services.regrade.rbac.namespace = "kube-system";
  };
  # A host that already reserves system memory for the kubelet: regrade's reservation
  # (read after it, and the kubelet keeps the last value) is not installed, and it says so.
  operatorReserves = let
    reservedRules = c: lib.filter (lib.hasInfix "40-regrade-reserved.yaml") c.systemd.tmpfiles.rules;
    seen = c: {
      reserved = reservedRules c;
      warned = lib.any (lib.hasInfix "protect.systemReservedMemory (768Mi) is not installed") c.warnings;
      source = c.services.regrade.settings.pressure.source;
    };
  in
    tryEach {
      extraFlags = seen (eval {services.k3s.extraFlags = ["--kubelet-arg=system-reserved=memory=2Gi"];});
      extraFlagsString = seen (eval {services.k3s.extraFlags = "--node-ip=10.0.0.1 --kubelet-arg system-reserved=cpu=1,memory=2Gi";});
      kubeletConfig = seen (eval {services.k3s.extraKubeletConfig.systemReserved.memory = "2Gi";});
      otherKubeletArg = seen (eval {services.k3s.extraFlags = ["--kubelet-arg=max-pods=50"];});
    };
  # Each way a server has etcd passes the no-etcd assertion.
  etcdWays = lib.mapAttrs (_: c: try (failing (eval ({services.k3s.configPath = lib.mkForce null;} // c)))) {
    clusterInit.services.k3s.clusterInit = true;
    serverAddr.services.k3s.serverAddr = "https://192.168.1.1:6443";
    extraFlagInit.services.k3s.extraFlags = ["--cluster-init"];
    extraFlagServer.services.k3s.extraFlags = "--server=https://192.168.1.1:6443";
  };
}
