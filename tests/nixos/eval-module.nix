# Evaluates nixos/module.nix with the real nixpkgs `lib` (lib.evalModules) against stub
# declarations of the NixOS options it sets, for an enabled server, a disabled one and
# each misconfiguration its assertions must refuse. Run by tests/nixos/eval-module.sh:
#   nix-instantiate --eval --strict --json tests/nixos/eval-module.nix \
#     --arg lib 'import /path/to/nixpkgs.lib/lib' --argstr tmp /some/dir
# The stubs declare only what the module touches; what NixOS does with the values
# (unit files, tmpfiles) is the VM test's to show.
{
  lib,
  tmp,
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
    runCommand = name: _: text: stubDrv name {inherit text;};
    writeShellScript = name: text: stubDrv name {inherit text;};
    coreutils = stubDrv "coreutils" {};
    regrade = stubDrv "regrade-0.1.0" {};
    k3s = stubDrv "k3s" {};
    stdenv = {
      buildPlatform.canExecute = _: true;
      hostPlatform = {};
    };
  };

  # NixOS's systemd unit options merge a list with other definitions by concatenation.
  unitOption = lib.mkOptionType {
    name = "systemd option";
    merge = _: defs:
      if lib.any (d: builtins.isList d.value) defs
      then lib.concatMap (d: lib.toList d.value) defs
      else (lib.last defs).value;
  };

  stubs = {
    options = {
      assertions = mkOption {
        type = types.listOf types.unspecified;
        default = [];
      };
      warnings = mkOption {
        type = types.listOf types.str;
        default = [];
      };
      services.k3s = {
        enable = mkOption {
          type = types.bool;
          default = false;
        };
        role = mkOption {
          type = types.enum ["server" "agent"];
          default = "server";
        };
        configPath = mkOption {
          type = types.nullOr types.path;
          default = null;
        };
        package = mkOption {
          type = types.package;
          default = pkgs.k3s;
        };
        manifests = mkOption {
          default = {};
          type = types.attrsOf (types.submodule {
            options.source = mkOption {
              type = types.nullOr types.path;
              default = null;
            };
            options.content = mkOption {
              type = types.nullOr (types.either types.attrs (types.listOf types.attrs));
              default = null;
            };
          });
        };
      };
      systemd.services = mkOption {
        default = {};
        type = types.attrsOf (types.submodule {
          options = {
            description = mkOption {
              type = types.str;
              default = "";
            };
            wantedBy = mkOption {
              type = types.listOf types.str;
              default = [];
            };
            after = mkOption {
              type = types.listOf types.str;
              default = [];
            };
            wants = mkOption {
              type = types.listOf types.str;
              default = [];
            };
            before = mkOption {
              type = types.listOf types.str;
              default = [];
            };
            restartTriggers = mkOption {
              type = types.listOf types.unspecified;
              default = [];
            };
            startLimitIntervalSec = mkOption {
              type = types.nullOr types.int;
              default = null;
            };
            serviceConfig = mkOption {
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
        type = types.attrsOf types.lines;
        default = {};
      };
    };
  };

  # What nixpkgs' k3s module itself puts on the unit, so the hook must merge with it.
  k3sBase = {
    systemd.services.k3s.serviceConfig = {
      Type = "notify";
      ExecStart = "${pkgs.k3s}/bin/k3s server";
    };
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
  };

  eval = extra:
    (lib.evalModules {
      specialArgs = {inherit pkgs;};
      modules = [stubs ../../nixos/module.nix k3sBase server extra];
    })
    .config;

  failing = c: map (a: a.message) (lib.filter (a: !a.assertion) c.assertions);

  summary = c: {
    failingAssertions = failing c;
    settings = lib.filterAttrsRecursive (_: v: v != null) c.services.regrade.settings;
    etc = lib.mapAttrs (_: v: toString v.source) c.environment.etc;
    tmpfiles = c.systemd.tmpfiles.rules;
    manifests = lib.mapAttrs (_: m: m.content or null) c.services.k3s.manifests;
    units = lib.mapAttrs (_: u: {inherit (u) after wants before serviceConfig;}) c.systemd.services;
    preSwitchChecks = c.system.preSwitchChecks;
    credentialsScript = c.systemd.services.regrade-credentials.serviceConfig.ExecStart.text or null;
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
      networking.firewall.enable = mkOption {type = types.bool;};
      networking.primaryIPAddress = mkOption {type = types.str;};
      system.switch.enable = mkOption {type = types.bool;};
      specialisation = mkOption {
        type = types.attrsOf (types.submodule {
          options.configuration = mkOption {type = types.deferredModule;};
        });
      };
      services.k3s = {
        tokenFile = mkOption {type = types.path;};
        clusterInit = mkOption {type = types.bool;};
        serverAddr = mkOption {type = types.str;};
        images = mkOption {type = types.listOf types.package;};
        extraFlags = mkOption {type = types.either types.str (types.listOf types.str);};
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

  enabled = eval {};
  disabled = eval {services.regrade.enable = lib.mkForce false;};
  adminCreds = eval {services.regrade.kubeconfig = "/etc/rancher/k3s/k3s.yaml";};
in {
  enabled = summary enabled;
  disabled = summary disabled;
  adminKubeconfig = {
    kubeconfig = adminCreds.services.regrade.settings.cluster.kubeconfig;
    credentialsUnit = adminCreds.systemd.services ? regrade-credentials;
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
  # Turning regrade off must leave k3s.service's definition exactly as it was.
  k3sUnitUnchangedWhenDisabled =
    enabled.systemd.services.k3s.serviceConfig == disabled.systemd.services.k3s.serviceConfig;
  misconfigured = lib.mapAttrs (_: c: failing (eval c)) {
    k3sOff.services.k3s.enable = lib.mkForce false;
    agent.services.k3s.role = lib.mkForce "agent";
    noOtherServers.services.regrade.apiServers = lib.mkForce [];
    configPathInStore.services.k3s.configPath = lib.mkForce "${builtins.storeDir}/0000-k3s-config.yaml";
    configPathLiteral.services.k3s.configPath = lib.mkForce ./eval-module.nix;
    dropinElsewhere.services.regrade.settings.systemd.dropin = lib.mkForce "/etc/regrade/50-regrade.yaml";
    dropinNotYaml.services.regrade.settings.systemd.dropin = lib.mkForce "${tmp}/config.yaml.d/50-regrade.yml";
  };
}
