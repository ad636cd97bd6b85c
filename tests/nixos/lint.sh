#!/usr/bin/env bash
# lint.sh: what can be checked of the Nix side on a machine without nixpkgs.
#   - every .nix file: `nix-instantiate --parse` (Debian's nix-bin), `deadnix --fail`,
#     `alejandra --check` (tests/nixos/alejandra-check, the alejandra 3.1.0 library);
#   - the VM test as nixpkgs' test framework takes it (tests/nixos/vm-test-options.nix: its
#     options exist and have their types), and its script linted as driver.nix lints it
#     before building the driver: pyflakes with the nodes and the driver's symbols as
#     builtins, mypy with a typed prelude (tests/nixos/lint-test-script.py);
#   - the settings the VM test gives regrade (tests/nixos/vm-settings.toml) pass
#     `regrade check-config` with the binary built from this tree;
#   - deploy/rbac.yaml binds the namespace whose ServiceAccounts `regrade credential` mints
#     tokens for, and deploy/admission-policy.yaml matches them;
#   - the switch-time check, run as NixOS runs it (tests/nixos/pre-switch-check-test.sh);
#   - tests/nixos/eval-module.sh: the module evaluated with the module system, nixpkgs'
#     lib with NIXPKGS_LIB=DIR (a nixpkgs lib checkout), else tests/nixos/minilib.nix.
# Tools go to ${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}/nix-lint, outside the repo
# (pyflakes and mypy from PyPI into a virtualenv there).
# Env: REGRADE_BIN (a built regrade; default: cargo build, target/debug/regrade).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${REGRADE_TEST_CACHE:-$HOME/.cache/regrade-tests}/nix-lint"
bin="$cache/bin"
mkdir -p "$cache"
export PATH="$bin:$PATH"

if ! command -v nix-instantiate >/dev/null; then
  apt-get install -y nix-bin || { apt-get update && apt-get install -y nix-bin; }
fi
# writeShellApplication runs shellcheck on the pre-switch checks; so does pre-switch-check-test.sh.
if ! command -v shellcheck >/dev/null; then
  apt-get install -y shellcheck || { apt-get update && apt-get install -y shellcheck; }
fi
if ! "$bin/deadnix" --version 2>/dev/null | grep -q '1\.3\.1'; then
  cargo install --locked --version 1.3.1 --root "$cache" --target-dir "$cache/target" deadnix
fi
# pyflakes and mypy near the versions nixos-25.11's driver runs.
py="$cache/python/bin/python"
if ! "$py" -c 'import importlib.metadata as m, sys; sys.exit(m.version("pyflakes") != "3.4.0" or m.version("mypy") != "1.18.2")' 2>/dev/null; then
  if ! python3 -m venv --clear "$cache/python"; then
    apt-get install -y python3-venv || { apt-get update && apt-get install -y python3-venv; }
    python3 -m venv --clear "$cache/python"
  fi
  "$py" -m pip install --quiet --disable-pip-version-check pyflakes==3.4.0 mypy==1.18.2
fi
# A path install rebuilds only what changed; the target dir is kept in the cache.
cargo install --quiet --locked --root "$cache" --target-dir "$cache/target" --path "$here/alejandra-check"

cd "$repo"
mapfile -t nixfiles < <(git ls-files '*.nix' 2>/dev/null || find . -name '*.nix' -not -path './target/*')
[ "${#nixfiles[@]}" -gt 0 ] || { echo "lint: no .nix files found in $repo" >&2; exit 1; }
for f in "${nixfiles[@]}"; do
  nix-instantiate --parse "$f" >/dev/null
done
echo "ok   nix-instantiate --parse: ${#nixfiles[@]} files"
deadnix --fail "${nixfiles[@]}"
echo "ok   deadnix --fail"
alejandra-check "${nixfiles[@]}"
echo "ok   alejandra --check"
python3 -c 'import json, sys; json.load(open("flake.lock"))'
echo "ok   flake.lock is JSON"

# The VM test as the test framework evaluates it, and its script (Python inside a Nix
# string, interpolations done) linted as driver.nix lints it: a message here would fail
# the driver's build, and with it checks.<system>.three-servers.
vmlint="$(mktemp -d)"
trap 'rm -rf "$vmlint"' EXIT
if [ -n "${NIXPKGS_LIB:-}" ]; then vmlib="import ${NIXPKGS_LIB}/lib"; else vmlib="import $here/minilib.nix"; fi
nix-instantiate --eval --strict --json "$here/vm-test-options.nix" --arg lib "$vmlib" >"$vmlint/evaluated.json"
echo "ok   nixos/tests/three-servers.nix evaluates as a test module (name, globalTimeout, nodes, testScript)"
"$py" "$here/lint-test-script.py" "$vmlint/evaluated.json" "$here/test-script-prelude.py" "$vmlint"

regrade="${REGRADE_BIN:-}"
if [ -z "$regrade" ]; then
  cargo build --quiet
  regrade="$repo/target/debug/regrade"
fi
"$regrade" --config tests/nixos/vm-settings.toml check-config >/dev/null
echo "ok   regrade check-config tests/nixos/vm-settings.toml"

# `regrade credential` (the module's regrade-credentials.service) mints each server's token
# for a ServiceAccount of the namespace regrade (src/cluster/credential.rs): the RBAC must
# make that namespace and bind its group, and the admission policy must match it.
if [ -f deploy/rbac.yaml ] && [ -f deploy/admission-policy.yaml ]; then
  python3 - deploy/rbac.yaml deploy/admission-policy.yaml <<'PY'
import re, sys
docs = re.split(r"(?m)^---\s*$", open(sys.argv[1]).read())
kinds = lambda k: [d for d in docs if re.search(r"(?m)^kind:\s*%s\s*$" % k, d)]
if not any(re.search(r"(?m)^\s+name:\s*regrade\s*$", d) for d in kinds("Namespace")):
    sys.exit("deploy/rbac.yaml makes no Namespace regrade, where regrade credential makes each server's ServiceAccount")
bindings = kinds("RoleBinding") + kinds("ClusterRoleBinding")
bad = [d for d in bindings if "name: system:serviceaccounts:regrade" not in d or "kind: ServiceAccount" in d]
if not bindings or bad:
    sys.exit("deploy/rbac.yaml: every binding must name the group system:serviceaccounts:regrade (and no one "
             "ServiceAccount); these do not:\n" + "\n---".join(bad))
policy = open(sys.argv[2]).read()
if "startsWith('system:serviceaccount:regrade:')" not in policy:
    sys.exit("deploy/admission-policy.yaml does not match the ServiceAccounts of the namespace regrade")
PY
  echo "ok   deploy/rbac.yaml binds the namespace regrade's ServiceAccounts; deploy/admission-policy.yaml matches them"
else
  echo "lint: deploy/rbac.yaml or deploy/admission-policy.yaml is missing; nixos/module.nix installs them through services.k3s.manifests" >&2
  exit 1
fi

# The switch-time check as switch-to-configuration runs it: needs no nixpkgs.
bash "$here/pre-switch-check-test.sh"

bash "$here/eval-module.sh" "${NIXPKGS_LIB:-}" "$regrade"
