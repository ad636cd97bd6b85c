//! k3s's configuration as k3s builds it, case by case: each directory under
//! tests/fixture/k3s-config/ is a host's k3s configuration (its `config.yaml` and
//! `config.yaml.d`, the unit's command line in `argv` and environment in `env`, one per
//! line, `{dir}` standing for the directory), and `expected` what k3s passes itself:
//! every `--flag=value` in k3s's order with the file it comes from, the values a later
//! file's plain key shadowed, and the kubelet's `system-reserved` as the kubelet merges
//! it. `k3s-testdata` and `k3s-single-file` are k3s's own cases
//! (k3s-io/k3s, pkg/configfilearg/testdata and parser_test.go), with k3s's expected order.
//!
//! `REGRADE_BLESS=1` writes `expected` from what the reader says (read it before you commit it).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use regrade::k3s_config::{kubelet, read, Distribution, Effective, Invocation, Source};

fn cases() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixture/k3s-config");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).collect();
    dirs.sort();
    dirs
}

fn lines(dir: &Path, name: &str) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(dir.join(name)).ok()?;
    let d = dir.display().to_string();
    Some(text.lines().filter(|l| !l.is_empty()).map(|l| l.replace("{dir}", &d)).collect())
}

fn effective(dir: &Path) -> Effective {
    let inv = Invocation {
        argv: lines(dir, "argv"),
        env: lines(dir, "env")
            .unwrap_or_default()
            .iter()
            .map(|l| l.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).unwrap())
            .collect(),
    };
    read(&Distribution::k3s().with_default_config(dir.join("config.yaml")), &inv, None).unwrap()
}

/// What the reader says, in `expected`'s words, paths relative to the case.
fn describe(dir: &Path, e: &Effective) -> String {
    let rel = |s: &Source| match s {
        Source::File(p) => p.strip_prefix(dir).unwrap_or(p).display().to_string(),
        Source::CommandLine => "command line".into(),
    };
    let file = |p: &Path| rel(&Source::File(p.to_path_buf()));
    let mut o = String::new();
    for a in &e.args {
        let dash = if a.key.len() == 1 { "-" } else { "--" };
        writeln!(o, "{dash}{}={} <- {}", a.key, a.value, rel(&a.from)).unwrap();
    }
    for s in &e.shadowed {
        writeln!(o, "shadowed {}={} in {} by {}", s.key, s.value, file(&s.was_in), file(&s.by)).unwrap();
    }
    let reserved = kubelet::map_flag(e, "system-reserved");
    for (k, v) in &reserved.entries {
        writeln!(o, "kubelet system-reserved {k}={} <- {}", v.value, rel(&v.from)).unwrap();
    }
    for r in &reserved.replaced {
        writeln!(o, "kubelet replaced {}={} <- {} by {}", r.key, r.value, rel(&r.from), rel(&r.by.from)).unwrap();
    }
    o.replace(&dir.display().to_string(), "{dir}")
}

#[test]
fn every_case_reads_as_k3s_reads_it() {
    let mut failed = Vec::new();
    for dir in cases() {
        let got = describe(&dir, &effective(&dir));
        let expected_path = dir.join("expected");
        if std::env::var_os("REGRADE_BLESS").is_some() {
            std::fs::write(&expected_path, &got).unwrap();
        }
        let want = std::fs::read_to_string(&expected_path).unwrap_or_default();
        if got != want {
            failed.push(format!("{}:\n--- expected\n{want}--- read\n{got}", dir.display()));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// k3s's own expected list for its testdata (parser_test.go, `testDataOutput`), word
/// for word, beside the fixture's `expected`.
#[test]
fn k3s_testdata_gives_k3s_expected_arguments() {
    let dir = cases().into_iter().find(|d| d.ends_with("k3s-testdata")).unwrap();
    let e = effective(&dir);
    let args: Vec<String> = e
        .args
        .iter()
        .filter(|a| a.from != Source::CommandLine)
        .map(|a| format!("{}{}={}", if a.key.len() == 1 { "-" } else { "--" }, a.key, a.value))
        .collect();
    let k3s = [
        "--foo-bar=bar-foo",
        "--alice=bob",
        "--a-slice=1",
        "--a-slice=1.5",
        "--a-slice=2",
        "--a-slice=",
        "--a-slice=three",
        "--isempty=",
        "-c=b",
        "--isfalse=false",
        "--islast=true",
        "--b-string=one",
        "--b-string=two",
        "--c-slice=one",
        "--c-slice=two",
        "--c-slice=three",
        "--d-slice=three",
        "--d-slice=four",
        "--f-string=beta",
        "--e-slice=one",
        "--e-slice=two",
    ];
    assert_eq!(args, k3s);
}
