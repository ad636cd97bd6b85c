//! regrade's integration tests, one test binary (issue 56): each file beside this one
//! is a module, and the binary's build and link (kube, k8s-openapi, rustls and the
//! shared helpers in `common`) are paid once, not once per file. A file's tests are
//! its module's: `cargo test --test testsuite cluster_lease::` runs what
//! `cargo test --test cluster_lease` ran. The gates (`REGRADE_TEST_*`) are as before.
//!
//! Tests share one process. What a test changes process-wide is either its own or
//! serialised: the system bus address (`common::nspawn::system_bus`), a clock offset
//! (`regrade::cluster::clock::set_test_offset`, this thread's). tests/run runs the rig
//! sections with `--test-threads=1` as before. Two tests stay binaries of their own
//! (tests/alloc_per_sample.rs: a counting global allocator and the notify socket in
//! the environment; tests/shed_start_up_code.rs: it changes the whole process's
//! memory locking); `layout` below keeps it so.
//!
//! A new test file goes here, with its `mod` line below.

// Helpers shared by several test modules.
mod common;
mod fixture;
mod incident {
    pub mod member;
    pub mod shared;
}
mod vm {
    pub mod guest;
    pub mod k3s_config;
    pub mod lane;
}

mod layout;

mod bench_idle_api;
mod census_status;
mod cli;
mod cluster_clock_skew;
mod cluster_credential_lifecycle;
mod cluster_drain;
mod cluster_endpoints;
mod cluster_lease;
mod cluster_least_privilege;
mod cluster_node;
mod cluster_peers;
mod cluster_rbac;
mod core_properties;
mod docker_actuator;
mod docker_build;
mod e2e_three_servers;
mod etcd_gate;
mod etcd_member;
mod import_graph;
mod incident_real_pressure;
mod k3s_config;
mod k3s_config_cli;
mod level_kill_points;
mod level_lost_reply;
mod level_reboot;
mod level_sigterm_drain;
mod man_completions;
mod metrics_prometheus;
mod plain_words;
mod pressure_cgroup;
mod simulate_plot;
mod simulator;
mod step_deadline;
mod step_faults_rig;
mod systemd_actuator;
mod systemd_credential_units;
mod systemd_k3s_overrides;
mod systemd_record_start;
mod systemd_stalled_bus;
mod systemd_unit;
mod vm_incident;
mod vm_power_cuts;
