{
  description = "regrade: steps a k3s server down under memory pressure without losing its etcd vote, one server at a time";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.11";

  outputs = {
    self,
    nixpkgs,
  }: let
    inherit (nixpkgs) lib;
    systems = ["x86_64-linux" "aarch64-linux"];
    forAllSystems = f: lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});

    # Only what cargo needs: a change to the README or the VM test rebuilds nothing.
    src = lib.fileset.toSource {
      root = ./.;
      fileset = lib.fileset.unions [./Cargo.toml ./Cargo.lock ./rustfmt.toml ./build.rs ./src];
    };

    regradeFor = pkgs: features:
      pkgs.rustPlatform.buildRustPackage {
        pname = "regrade";
        version = (lib.importTOML ./Cargo.toml).package.version;
        inherit src;
        cargoLock.lockFile = ./Cargo.lock;
        buildFeatures = features;
        nativeBuildInputs = [pkgs.installShellFiles];
        # build.rs writes the man pages and completions from the clap definitions here.
        preBuild = ''
          export REGRADE_GEN_DIR=$PWD/target/regrade-gen
        '';
        postInstall = ''
          installManPage target/regrade-gen/man/*.1
          installShellCompletion --cmd regrade \
            --bash target/regrade-gen/completions/regrade.bash \
            --zsh target/regrade-gen/completions/_regrade \
            --fish target/regrade-gen/completions/regrade.fish
        '';
        # Unit tests run here; the integration tests need root, systemd, an API server or
        # dockerd and skip with a notice when their REGRADE_* variable is unset, as it is
        # in the build sandbox.
        doCheck = true;
        meta = {
          description = "Steps a k3s server down under memory pressure without losing its etcd vote";
          license = lib.licenses.asl20;
          mainProgram = "regrade";
          platforms = lib.platforms.linux;
        };
      };
  in {
    packages = forAllSystems (pkgs: {
      default = regradeFor pkgs [];
      regrade-docker = regradeFor pkgs ["docker"];
      # Statically linked (musl), for the Docker images: rancher/k3s has no C library
      # (deploy/docker/README.md).
      regrade-static = regradeFor pkgs.pkgsStatic ["docker"];
    });

    overlays.default = final: _prev: {
      regrade = regradeFor final [];
    };

    # A `key`, so a fleet that imports this from a shared profile and from a host file
    # gets it once (lib.evalModules drops modules whose key it has seen).
    nixosModules.default = {pkgs, ...}: {
      key = "regrade#nixosModules.default";
      _file = "${toString ./flake.nix}#nixosModules.default";
      imports = [./nixos/module.nix];
      services.regrade.package = lib.mkDefault self.packages.${pkgs.stdenv.hostPlatform.system}.default;
    };

    checks = forAllSystems (pkgs: {
      package = self.packages.${pkgs.stdenv.hostPlatform.system}.default;
      three-servers = pkgs.testers.runNixOSTest (import ./nixos/tests/three-servers.nix {inherit self pkgs;});
      clippy = (regradeFor pkgs []).overrideAttrs (old: {
        pname = "regrade-clippy";
        nativeBuildInputs = old.nativeBuildInputs ++ [pkgs.clippy];
        # No postBuild hooks: cargoInstallHook's would look for release binaries.
        buildPhase = ''
          runHook preBuild
          cargo clippy --offline --all-targets --all-features -- -D warnings
        '';
        doCheck = false;
        installPhase = "touch $out";
      });
      # rustfmt follows `mod` from the crate roots and reads rustfmt.toml; no cargo, so
      # no dependency resolution in the sandbox.
      fmt = pkgs.runCommand "regrade-fmt" {nativeBuildInputs = [pkgs.rustfmt];} ''
        cd ${src}
        rustfmt --check --edition 2021 build.rs src/lib.rs src/main.rs
        touch $out
      '';
    });

    devShells = forAllSystems (pkgs: {
      default = pkgs.mkShell {
        inputsFrom = [self.packages.${pkgs.stdenv.hostPlatform.system}.default];
        packages = [pkgs.clippy pkgs.rustfmt pkgs.rust-analyzer pkgs.alejandra pkgs.deadnix];
      };
    });

    formatter = forAllSystems (pkgs: pkgs.alejandra);
  };
}
