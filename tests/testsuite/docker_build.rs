//! The Docker actuator is code behind `#[cfg(feature = "docker")]` (issue 6) and brings
//! no crate of its own: the `docker` feature leaves regrade's dependencies as they are.
//! Runs `cargo tree` on this package (offline, from Cargo.lock); no root needed.

use std::process::Command;

/// regrade's own (depth 1) normal dependencies, with or without the feature.
fn direct_dependencies(features: &[&str]) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["tree", "--offline", "--locked", "-e", "normal", "--depth", "1", "--prefix", "none"])
        .args(["--no-default-features"])
        .args(features)
        .output()
        .unwrap();
    assert!(out.status.success(), "cargo tree: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .skip(1) // regrade itself
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

/// Since the etcd gate (issue 11) hyper, hyper-util and http-body-util are in every
/// build (its HTTP client; kube's client already pulled them in), so the Docker actuator
/// needs no crate of its own: the `docker` feature adds code only, no dependency.
#[test]
fn the_docker_feature_adds_no_dependency() {
    let default = direct_dependencies(&[]);
    assert!(default.iter().any(|d| d == "kube"), "cargo tree listed no dependencies: {default:?}");
    let docker = direct_dependencies(&["--features", "docker"]);
    assert_eq!(default, docker, "the docker feature changes the dependencies");
    for d in ["hyper", "hyper-util", "http-body-util"] {
        assert!(docker.iter().any(|x| x == d), "{d} is not a dependency: {docker:?}");
    }
}
