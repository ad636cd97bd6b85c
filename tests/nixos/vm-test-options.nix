# The VM test (nixos/tests/three-servers.nix) evaluated as a module of the NixOS test
# framework, against declarations that follow nixpkgs' nixos/lib/testing/*.nix (name.nix,
# driver.nix, driver-configuration.nix, testScript.nix, nodes.nix, interactive.nix), so
# an option the framework lacks, or a value of the wrong type, fails here and not in
# `nix flake check`. The nodes themselves are evaluated by eval-module.nix; here they are
# only modules. Gives what the driver derives before it lints the script: the script
# string, the node names as Python identifiers (driver.nix's rule) and the switches.
# lib: nixpkgs' lib, or tests/nixos/minilib.nix.
{lib}: let
  inherit (lib) mkOption types;
  # minilib has no functionTo; nixpkgs' checks only that the value is a function.
  functionTo =
    types.functionTo
    or (t:
      lib.mkOptionType {
        name = "functionTo";
        description = "function that evaluates to a(n) ${t.description}";
        check = builtins.isFunction;
        merge = lib.mergeOneOption;
      });

  test = import ../../nixos/tests/three-servers.nix {
    self = {};
    pkgs = {inherit lib;};
  };

  framework = {config, ...}: {
    options = {
      name = mkOption {type = types.str;};
      globalTimeout = mkOption {
        type = types.int;
        default = 60 * 60;
      };
      # What driver-configuration.nix hands the driver, from globalTimeout.
      driverConfiguration.global_timeout = mkOption {type = types.ints.unsigned;};
      nodes = mkOption {
        type = types.attrsOf types.deferredModule;
        default = {};
      };
      containers = mkOption {
        type = types.attrsOf types.deferredModule;
        default = {};
      };
      defaults = mkOption {
        type = types.deferredModule;
        default = {};
      };
      testScript = mkOption {type = types.either types.str (functionTo types.str);};
      skipLint = mkOption {
        type = types.bool;
        default = false;
      };
      skipTypeCheck = mkOption {
        type = types.bool;
        default = false;
      };
      # The whole test module again, for the interactive driver (which lints too).
      interactive = mkOption {
        type = types.deferredModule;
        default = {};
      };
      meta.maintainers = mkOption {
        type = types.listOf types.unspecified;
        default = [];
      };
    };
    config.driverConfiguration.global_timeout = config.globalTimeout;
  };

  c = (lib.evalModules {modules = [framework test];}).config;

  # driver.nix's pythonizeName: a first character that cannot start an identifier, and
  # any later one that cannot be in one, become "_".
  pythonize = name: let
    chars = lib.stringToCharacters or (s: builtins.genList (i: builtins.substring i 1 s) (builtins.stringLength s)) name;
    fix = ok: ch:
      if builtins.match ok ch == null
      then "_"
      else ch;
  in
    lib.concatStringsSep "" ([(fix "[A-Za-z_]" (builtins.head chars))] ++ map (fix "[A-Za-z0-9_]") (builtins.tail chars));
  nodeNames = builtins.attrNames c.nodes;
  # With exactly one node the driver also names it `machine`.
  machineNames = nodeNames ++ lib.optional (builtins.length nodeNames == 1 && nodeNames != ["machine"]) "machine";
in {
  inherit (c) name skipLint skipTypeCheck;
  globalTimeout = c.driverConfiguration.global_timeout;
  testScriptIsFunction = builtins.isFunction c.testScript;
  testScript =
    if builtins.isFunction c.testScript
    then throw "testScript is a function of the nodes; this lint renders only a string testScript"
    else c.testScript;
  inherit nodeNames;
  pythonNames = map pythonize machineNames;
  containerNames = builtins.attrNames c.containers;
  # What the interactive driver would add (it is built and linted the same way).
  interactiveSet = test ? interactive;
}
