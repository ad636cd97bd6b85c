//! The default build carries no Docker dependency (issue 6): the Docker actuator's
//! dependencies are optional, enabled only by the `docker` feature (its code is behind
//! `#[cfg(feature = "docker")]` in src/actuator/mod.rs and src/config.rs).
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

const DOCKER_ONLY: [&str; 3] = ["hyper", "hyper-util", "http-body-util"];

#[test]
fn the_default_build_has_no_docker_dependency() {
    let default = direct_dependencies(&[]);
    assert!(default.iter().any(|d| d == "kube"), "cargo tree listed no dependencies: {default:?}");
    for d in DOCKER_ONLY {
        assert!(!default.iter().any(|x| x == d), "{d} is a dependency of the default build: {default:?}");
    }
    let docker = direct_dependencies(&["--features", "docker"]);
    for d in DOCKER_ONLY {
        assert!(docker.iter().any(|x| x == d), "the docker feature does not enable {d}: {docker:?}");
    }
}
