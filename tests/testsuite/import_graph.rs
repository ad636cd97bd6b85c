//! The module import graph of the library's non-test code (issue 17): printed, and
//! checked. No cycle between top-level modules; the core (`decide`) imports only value
//! modules, which themselves import only value modules, so the core cannot reach a
//! file, the API or k3s however deep one follows its imports; nothing but `main.rs`
//! imports the command line (`cli`); and only `cluster` uses the Kubernetes API crates,
//! only `actuator` the D-Bus and Docker ones.
//!
//! It reads `src/` as text: every `crate::NAME` path (in `use` items and inline) of a
//! file outside its `#[cfg(test)]` items is an edge from the file's top-level module
//! to NAME; `main.rs` counts its `regrade::NAME` paths. Comments are skipped.
//! Run with `--nocapture` to see the graph (tests/run does).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Plain data and pure functions: no I/O, no edge.
const VALUE_MODULES: [&str; 4] = ["level", "levels", "sample", "units"];
const CORE: &str = "decide";

/// The crates that reach the outside world, and the modules that may use each: only
/// `cluster` talks to the Kubernetes API, only `actuator` talks to systemd and Docker,
/// and HTTP goes out from `actuator` (Docker's engine) and `etcd` (etcd's gateway) and
/// is served by `metrics` alone (`/metrics`, `/healthz`).
/// (`k8s_openapi::jiff`, a time library, is not the API.)
const WORLD_CRATES: [(&str, &[&str]); 5] = [
    ("kube", &["cluster"]),
    ("k8s_openapi::api", &["cluster"]),
    ("zbus", &["actuator"]),
    ("hyper", &["actuator", "etcd", "metrics"]),
    ("hyper_util", &["actuator", "etcd", "metrics"]),
];

type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a file of `src/` belongs to (`cluster/lease.rs` -> `cluster`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
    first.trim_end_matches(".rs").to_string()
}

/// The code of `text` without comments and without `#[cfg(test)]` items (a `mod` with
/// its braces, or a `use`/other item up to its `;`).
fn non_test_code(text: &str) -> String {
    let mut code = String::new();
    for line in text.lines() {
        let l = line.trim_start();
        if l.starts_with("//") {
            continue;
        }
        let l = match line.find("//") {
            Some(i) if !line[..i].contains('"') => &line[..i],
            _ => line,
        };
        code.push_str(l);
        code.push('\n');
    }
    let mut out = String::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..i]);
        let after = &rest[i + "#[cfg(test)]".len()..];
        // Skip the item: up to the end of its first brace block, or its `;`.
        let brace = after.find('{');
        let semi = after.find(';');
        let end = match (brace, semi) {
            (Some(b), Some(s)) if s < b => s + 1,
            (Some(b), _) => {
                let mut depth = 0usize;
                let mut end = after.len();
                for (k, c) in after[b..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = b + k + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (None, Some(s)) => s + 1,
            (None, None) => after.len(),
        };
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The NAMEs of every `prefix::NAME` and `prefix::{NAME, ...}` path in `code`.
fn imported(code: &str, prefix: &str) -> BTreeSet<String> {
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut out = BTreeSet::new();
    let pat = format!("{prefix}::");
    for (i, _) in code.match_indices(&pat) {
        let before = code[..i].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue; // `foo_crate::`, `$crate::`, `x::crate::`
        }
        let rest = &code[i + pat.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `crate::{a, b::{C, D}, self}`: the first name of each top-level item.
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.insert(ident(item.trim()));
                        item.clear();
                    }
                    _ if depth == 0 => item.push(c),
                    _ => {}
                }
            }
            out.insert(ident(item.trim()));
            out.remove("");
            out.remove("self");
        } else {
            let n = ident(rest);
            if !n.is_empty() {
                out.insert(n);
            }
        }
    }
    out
}

/// Each module's non-test code, by top-level module.
fn sources() -> BTreeMap<String, String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    rust_files(&src, &mut files);
    let mut out = BTreeMap::<String, String>::new();
    for f in files {
        let code = non_test_code(&std::fs::read_to_string(&f).unwrap());
        out.entry(module_of(&src, &f)).or_default().push_str(&code);
    }
    out
}

fn graph() -> Graph {
    let mut g = Graph::new();
    for (m, code) in sources() {
        let prefix = if m == "main" { "regrade" } else { "crate" };
        let deps = g.entry(m.clone()).or_default();
        for d in imported(&code, prefix) {
            if d != m {
                deps.insert(d);
            }
        }
    }
    g.remove("lib"); // declares the modules, imports none
    g
}

/// A cycle, as the modules on it, if the graph has one.
fn find_cycle(g: &Graph) -> Option<Vec<String>> {
    fn visit(g: &Graph, n: &str, path: &mut Vec<String>, done: &mut BTreeSet<String>) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == n) {
            let mut c = path[i..].to_vec();
            c.push(n.to_string());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_string());
        for d in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(g, d, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    g.keys().find_map(|n| visit(g, n, &mut vec![], &mut done))
}

/// Everything `from` reaches through its imports.
fn reach(g: &Graph, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![from.to_string()];
    while let Some(n) = todo.pop() {
        for d in g.get(&n).into_iter().flatten() {
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    seen
}

/// The rules; `Err` says which is broken and where.
fn check(g: &Graph) -> Result<(), String> {
    if let Some(c) = find_cycle(g) {
        return Err(format!("import cycle: {}", c.join(" -> ")));
    }
    let on_cli: Vec<_> =
        g.iter().filter(|(m, deps)| *m != "main" && deps.contains("cli")).map(|(m, _)| m.as_str()).collect();
    if !on_cli.is_empty() {
        return Err(format!("the library imports the command line: {} -> cli", on_cli.join(", ")));
    }
    let not_value: Vec<_> = reach(g, CORE).into_iter().filter(|m| !VALUE_MODULES.contains(&m.as_str())).collect();
    if !not_value.is_empty() {
        return Err(format!(
            "{CORE} reaches modules that are not value modules ({}): {}",
            VALUE_MODULES.join(", "),
            not_value.join(", ")
        ));
    }
    Ok(())
}

/// Layers from the bottom: each module after everything it imports.
fn layers(g: &Graph) -> Vec<Vec<String>> {
    let mut placed: BTreeSet<String> = BTreeSet::new();
    let mut out = vec![];
    while placed.len() < g.len() {
        let layer: Vec<String> = g
            .iter()
            .filter(|(m, deps)| !placed.contains(*m) && deps.iter().all(|d| placed.contains(d) || !g.contains_key(d)))
            .map(|(m, _)| m.clone())
            .collect();
        if layer.is_empty() {
            break;
        }
        placed.extend(layer.iter().cloned());
        out.push(layer);
    }
    out
}

#[test]
fn the_module_graph_has_no_cycle_and_the_core_imports_only_values() {
    let g = graph();
    println!("module import graph of src/ (non-test code), from the bottom up:");
    for (i, layer) in layers(&g).iter().enumerate() {
        for m in layer {
            let deps: Vec<_> = g[m].iter().map(String::as_str).collect();
            let tag = if VALUE_MODULES.contains(&m.as_str()) { " (value)" } else { "" };
            println!("  L{i} {m}{tag} -> {}", if deps.is_empty() { "-".into() } else { deps.join(", ") });
        }
    }
    assert!(g.contains_key(CORE) && g.contains_key("cluster") && g.len() > 15, "the graph was not read: {g:?}");
    if let Err(e) = check(&g) {
        panic!("{e}");
    }
    println!("no cycle; {CORE} reaches only value modules: {:?}", reach(&g, CORE));
}

#[test]
fn only_cluster_talks_to_the_api_and_only_actuator_to_systemd_and_docker() {
    let mut wrong = vec![];
    for (m, code) in sources() {
        for (krate, owner) in WORLD_CRATES {
            let path = if krate.contains("::") { krate.to_string() } else { format!("{krate}::") };
            let uses = code.match_indices(&path).any(|(i, _)| {
                !code[..i].chars().next_back().is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
            });
            if uses && !owner.contains(&m.as_str()) {
                wrong.push(format!("{m} uses {krate}:: (only {} may)", owner.join(" and ")));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("; "));
}

#[test]
fn the_checker_sees_a_cycle_and_a_core_that_reaches_an_edge() {
    let g = |edges: &[(&str, &str)]| {
        let mut g = Graph::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    assert!(check(&g(&[("decide", "level"), ("config", "decide")])).is_ok());
    let e = check(&g(&[("decide", "level"), ("config", "cluster"), ("cluster", "config")])).unwrap_err();
    assert!(e.contains("cycle") && e.contains("cluster -> config -> cluster"), "{e}");
    let e = check(&g(&[("decide", "levels"), ("levels", "config")])).unwrap_err();
    assert!(e.contains("config"), "{e}");
    let e = check(&g(&[("decide", "level"), ("watch", "cli"), ("main", "cli")])).unwrap_err();
    assert!(e.contains("watch -> cli"), "{e}");
}

#[test]
fn paths_are_read_as_rust_writes_them() {
    let code = non_test_code(
        "use crate::a::B;\nuse crate::{b, c::{D, E}, self};\n// use crate::comment;\nlet x = crate::d::f();\n\
         #[cfg(test)]\nmod tests {\n    use crate::t;\n    fn f() { if x { crate::u(); } }\n}\n#[cfg(test)]\nuse crate::v;\n\
         fn g() { crate::w::x() }\n",
    );
    let got: Vec<_> = imported(&code, "crate").into_iter().collect();
    assert_eq!(got, ["a", "b", "c", "d", "w"]);
}
