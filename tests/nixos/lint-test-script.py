"""lint-test-script.py EVALUATED.json PRELUDE.py WORKDIR

Lints the VM test's script as nixpkgs' driver.nix does before it builds the driver:
  - pyflakes on the script, with the node names and the driver's symbols as
    PYFLAKES_BUILTINS (driver.nix: unless skipLint);
  - mypy on the typed prelude, one line of node hints (`server1: Machine; ...`, as
    driver.nix echoes them), the container and VLAN hint lines (empty here) and the
    script, with driver.nix's flags (unless skipTypeCheck).
EVALUATED.json is tests/nixos/vm-test-options.nix's output. Any message from either
tool fails. mypy's line numbers are given in the script too (prelude lines subtracted).
Run with a Python that has pyflakes and mypy (lint.sh installs them).
"""

import ast
import json
import keyword
import os
import re
import subprocess
import sys

evaluated, prelude_path, work = sys.argv[1:4]
d = json.load(open(evaluated))
prelude = open(prelude_path).read()
script = d["testScript"]
fail = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        fail.append(what)


# The switches that would make the driver skip what is run below.
check(not d["skipLint"] and not d["skipTypeCheck"],
      "the VM test leaves skipLint and skipTypeCheck off (skipLint %s, skipTypeCheck %s)" % (d["skipLint"], d["skipTypeCheck"]))
check(not d["interactiveSet"], "the VM test sets nothing under `interactive` (the interactive driver lints the same script)")
check(not d["containerNames"], "the VM test has no containers (only QEMU nodes: %s)" % d["nodeNames"])
names = d["pythonNames"]
# pythonizeName leaves keywords alone: a node named `class` would break the script.
check(all(n.isidentifier() and not keyword.iskeyword(n) for n in names) and names[:len(d["nodeNames"])] == d["nodeNames"],
      "every node name is its own Python variable (not a keyword, nothing rewritten): %s" % d["nodeNames"])
check(re.fullmatch(r"[A-Za-z0-9+_?=-][A-Za-z0-9+._?=-]*", d["name"]) is not None,
      "the test's name %r can be part of a store path name (nixos-test-driver-NAME, vm-test-run-NAME)" % d["name"])
check(d["globalTimeout"] > 120, "globalTimeout = %d s, more than the script's 120 s margin" % d["globalTimeout"])

# The driver symbols: the names the prelude annotates at its top level.
symbols = [n.target.id for n in ast.parse(prelude).body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]

script_file = os.path.join(work, "test-script")
with open(script_file, "w") as f:
    f.write(script)
env = dict(os.environ, PYFLAKES_BUILTINS=",".join(names + symbols))
r = subprocess.run([sys.executable, "-m", "pyflakes", script_file], env=env, cwd=work, capture_output=True, text=True)
out = (r.stdout + r.stderr).replace(script_file, "test-script").strip()
if out:
    print(out)
check(r.returncode == 0 and not out, "pyflakes test-script, builtins: the nodes and %d driver symbols" % len(symbols))

typed_file = os.path.join(work, "testScriptWithTypes")
hints = " ".join("%s: Machine;" % n for n in names)
# driver.nix: cat prelude; echo node hints; echo container hints; echo VLAN hints; echo -n script.
head = prelude + hints + "\n" + "\n" + "\n"
offset = head.count("\n")
with open(typed_file, "w") as f:
    f.write(head + script)
r = subprocess.run(
    [sys.executable, "-m", "mypy", "--no-implicit-optional", "--pretty", "--no-color-output",
     # The driver's Python (3.13 in nixos-25.11) is mypy's default target there.
     "--python-version", "3.13", "--cache-dir", os.path.join(work, ".mypy_cache"), "testScriptWithTypes"],
    cwd=work, capture_output=True, text=True)


def in_script(m):
    n = int(m.group(1))
    return "testScriptWithTypes:%d (test-script:%d):" % (n, n - offset) if n > offset else m.group(0)


out = re.sub(r"testScriptWithTypes:(\d+):", in_script, (r.stdout + r.stderr).strip())
messages = [line for line in out.splitlines() if re.search(r":\d+(:\d+)?( \(test-script:\d+\))?: (error|warning|note):", line)]
print("\n".join("     " + line for line in out.splitlines()))
check(r.returncode == 0 and not messages, "mypy --no-implicit-optional over the typed prelude and test-script")

sys.exit(1 if fail else 0)
