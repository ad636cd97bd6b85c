//! regrade: steps a k3s server down under memory pressure without losing its etcd
//! vote, one server at a time. See ARCHITECTURE.md for the map.
//!
//! A library as well as the binary, so integration tests under `tests/` can drive the
//! cluster and actuator modules against real components.

pub mod actuator;
pub mod backend;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod decide;
pub mod fsutil;
pub mod level;
pub mod logging;
pub mod notify;
pub mod pressure;
pub mod psi_trigger;
pub mod simulate;
pub mod statefile;
pub mod status;
pub mod step;
pub mod units;
pub mod watch;
