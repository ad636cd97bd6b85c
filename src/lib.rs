//! regrade: steps a k3s server down under memory pressure without losing its etcd
//! vote, one server at a time. See ARCHITECTURE.md for the map and docs/behaviour.md
//! for what it does.
//!
//! A library as well as the binary, so integration tests under `tests/` can drive the
//! cluster and actuator modules against real components.

// Value modules: plain data and pure functions, no I/O, importing only each other.
pub mod level;
pub mod levels;
pub mod sample;
pub mod units;

// The core: pure, imports only value modules (tests/testsuite/import_graph.rs).
pub mod decide;

// The edges, each owning its configuration section.
pub mod actuator;
pub mod census;
pub mod cluster;
pub mod etcd;
pub mod fsutil;
pub mod hold;
pub mod k3s_config;
pub mod kill_point;
// The fsync mutation is a test build's; a release (optimised) build refuses it.
#[cfg(all(feature = "fsync-faults", not(debug_assertions)))]
compile_error!("the fsync-faults feature takes fsyncs out of durable writes: test builds only, never a release");
pub mod level_record;
pub mod metrics;
pub mod notify;
pub mod own_time;
pub mod pressure;
pub mod psi_trigger;
pub mod statefile;

// Running steps, and the commands.
pub mod access;
pub mod hand;
pub mod level_keeper;
pub mod logging;
pub mod runtime;
pub mod simulate;
pub mod status;
pub mod step;
pub mod watch;

// The composition: the file and the wiring, which see every section.
pub mod backend;
pub mod config;

// The command line, which nothing in the library imports.
pub mod cli;

#[cfg(any(test, feature = "testing"))]
pub mod testing;
