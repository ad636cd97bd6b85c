//! `regrade entrypoint -- k3s server ARGS...`: the k3s container's entrypoint (SPEC §5,
//! docker). In every build, since the container runs it whether or not this build
//! has the Docker actuator. (Being implemented: issue 6.)

use std::ffi::OsString;
use std::process::ExitCode;

use crate::config::Config;

pub fn run(_cfg: &Config, _command: &[OsString]) -> anyhow::Result<ExitCode> {
    anyhow::bail!("entrypoint is not implemented yet (issue 6)")
}
