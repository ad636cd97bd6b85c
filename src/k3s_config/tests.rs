//! The reading rules one by one, over files in a temporary directory. k3s's own
//! cases (its testdata) are fixtures in tests/fixture/k3s-config/, run by
//! tests/testsuite/k3s_config.rs.

use super::*;
use std::fs;

struct Host {
    dir: tempfile::TempDir,
}

impl Host {
    fn new() -> Host {
        let h = Host { dir: tempfile::tempdir().unwrap() };
        fs::create_dir(h.dropins()).unwrap();
        h
    }
    fn config(&self) -> PathBuf {
        self.dir.path().join("config.yaml")
    }
    fn dropins(&self) -> PathBuf {
        self.dir.path().join("config.yaml.d")
    }
    fn put(&self, name: &str, text: &str) -> PathBuf {
        let p = if name == "config.yaml" { self.config() } else { self.dropins().join(name) };
        fs::write(&p, text).unwrap();
        p
    }
    fn read(&self, argv: &[&str]) -> Effective {
        let inv = Invocation { argv: Some(argv.iter().map(|s| s.to_string()).collect()), env: Vec::new() };
        read(&Distribution::k3s().with_default_config(self.config()), &inv, None).unwrap()
    }
}

fn values<'a>(e: &'a Effective, key: &'a str) -> Vec<&'a str> {
    e.all(key).map(|a| a.value.as_str()).collect()
}

#[test]
fn a_later_plain_key_replaces_and_names_what_it_shadowed() {
    let h = Host::new();
    let ours = h.put("40-regrade-reserved.yaml", "kubelet-arg+:\n  - \"system-reserved=memory=768Mi\"\n");
    let site = h.put("90-site.yaml", "kubelet-arg: [max-pods=50]\n");
    let e = h.read(&["k3s", "server"]);
    assert_eq!(values(&e, "kubelet-arg"), ["max-pods=50"]);
    assert_eq!(
        e.shadowed,
        [Shadowed {
            key: "kubelet-arg".into(),
            value: "system-reserved=memory=768Mi".into(),
            was_in: ours,
            by: site.clone()
        }]
    );
    assert_eq!(e.last("kubelet-arg").unwrap().from, Source::File(site));
}

#[test]
fn an_append_extends_what_came_before_and_alone_is_a_plain_value() {
    let h = Host::new();
    h.put("config.yaml", "kubelet-arg: [system-reserved=memory=2Gi]\nnode-label+: a=b\n");
    h.put("40-regrade-reserved.yaml", "kubelet-arg+:\n  - system-reserved=memory=768Mi\n");
    let e = h.read(&["k3s", "server"]);
    assert_eq!(values(&e, "kubelet-arg"), ["system-reserved=memory=2Gi", "system-reserved=memory=768Mi"]);
    assert_eq!(values(&e, "node-label"), ["a=b"]);
    assert!(e.shadowed.is_empty());
}

#[test]
fn only_yaml_and_yml_files_are_read_in_byte_order() {
    let h = Host::new();
    h.put("9-b.yml", "node-name: nine\n");
    h.put("10-a.yaml", "node-name: ten\n");
    h.put("UPPER.YAML", "node-name: upper\n");
    h.put("lower.yaml", "node-name: lower\n");
    h.put("zz.yaml.disabled", "node-name: disabled\n");
    h.put("zz-notes.txt", "node-name: notes\n");
    fs::create_dir(h.dropins().join("zzz.yaml")).unwrap();
    let e = h.read(&["k3s", "server"]);
    let names: Vec<_> = e.files.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["10-a.yaml", "9-b.yml", "UPPER.YAML", "lower.yaml"]);
    assert_eq!(e.last("node-name").unwrap().value, "lower");
}

#[test]
fn the_command_line_comes_after_every_file() {
    let h = Host::new();
    h.put("50-regrade.yaml", "disable-apiserver: true\nkubelet-arg: [a=1]\n");
    let e = h.read(&["/bin/k3s", "server", "--disable-apiserver=false", "--kubelet-arg", "b=2", "--cluster-init", "x"]);
    assert_eq!(e.last("disable-apiserver").unwrap().from, Source::CommandLine);
    assert_eq!(go_bool(e.last("disable-apiserver")), Some(false));
    assert_eq!(values(&e, "kubelet-arg"), ["a=1", "b=2"]);
    assert_eq!(values(&e, "cluster-init"), ["true"], "a boolean takes no separate value");
}

#[test]
fn the_config_file_is_the_environments_then_the_command_lines_then_the_default() {
    let h = Host::new();
    let other = h.dir.path().join("other.yaml");
    fs::write(&other, "node-name: other\n").unwrap();
    let env_file = h.dir.path().join("env.yaml");
    fs::write(&env_file, "node-name: env\n").unwrap();
    h.put("config.yaml", "node-name: default\n");
    let dist = Distribution::k3s().with_default_config(h.config());
    let name = |argv: &[&str], env: &[(&str, &str)]| {
        let inv = Invocation {
            argv: Some(argv.iter().map(|s| s.to_string()).collect()),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        };
        read(&dist, &inv, None).unwrap().last("node-name").map(|a| a.value.clone())
    };
    let other_flag = format!("--config={}", other.display());
    assert_eq!(name(&["k3s", "server"], &[]).as_deref(), Some("default"));
    assert_eq!(name(&["k3s", "server", &other_flag], &[]).as_deref(), Some("other"));
    assert_eq!(name(&["k3s", "server", "-c", other.to_str().unwrap()], &[]).as_deref(), Some("other"));
    let env = [("K3S_CONFIG_FILE", env_file.to_str().unwrap())];
    assert_eq!(name(&["k3s", "server", &other_flag], &env).as_deref(), Some("env"));
    assert_eq!(name(&["k3s", "server"], &[("RKE2_CONFIG_FILE", "/nowhere")]).as_deref(), Some("default"));
}

#[test]
fn rke2_is_another_path_and_variable_read_the_same_way() {
    let h = Host::new();
    h.put("config.yaml", "disable-apiserver: yes\n");
    let dist = Distribution::rke2();
    assert_eq!(dist.default_config, Path::new("/etc/rancher/rke2/config.yaml"));
    let inv = Invocation { argv: None, env: vec![("RKE2_CONFIG_FILE".into(), h.config().display().to_string())] };
    let e = read(&dist, &inv, None).unwrap();
    assert_eq!(go_bool(e.last("disable-apiserver")), Some(true));
}

#[test]
fn an_overlay_is_read_as_the_file_would_be() {
    let h = Host::new();
    h.put("90-site.yaml", "disable-apiserver: false\n");
    let ours = h.dropins().join("50-regrade.yaml");
    let dist = Distribution::k3s().with_default_config(h.config());
    let overlay = Overlay { path: &ours, content: Some("disable-apiserver: true\n") };
    let e = read(&dist, &Invocation::default(), Some(overlay)).unwrap();
    assert!(e.reads(&ours));
    assert_eq!(e.last("disable-apiserver").unwrap().from, Source::File(h.dropins().join("90-site.yaml")));
    assert_eq!(e.shadowed.len(), 1);
    assert!(!fs::exists(&ours).unwrap(), "nothing is written");
    let gone = read(&dist, &Invocation::default(), Some(Overlay { path: &ours, content: None })).unwrap();
    assert!(!gone.reads(&ours));
}

#[test]
fn a_broken_file_is_named() {
    let h = Host::new();
    let p = h.put("60-broken.yaml", "kubelet-arg: [a\n");
    let e = read(&Distribution::k3s().with_default_config(h.config()), &Invocation::default(), None).unwrap_err();
    assert!(format!("{e:#}").contains(&p.display().to_string()), "{e:#}");
}

#[test]
fn an_environment_file_is_read_as_systemd_reads_it() {
    let env = environment_file("# c\nK3S_CONFIG_FILE=\"/etc/k3s/a.yaml\"\n; other\n\nK3S_TOKEN = x\nnot a var\n");
    assert_eq!(env, [("K3S_CONFIG_FILE".into(), "/etc/k3s/a.yaml".into()), ("K3S_TOKEN".into(), "x".into())]);
}
