//! Config sources: where the agent's [`ConfigState`] comes from, one per mode.
//! Each publishes on a watch channel that [`crate::agent::run`] reads, so everything after the source is
//! shared by both modes.
//! - [`file`](mod@file): a local YAML file, polled;
//! - [`kubernetes`]: the machine's own `LoadBalancer` (watched), with the `LoadBalancerMachine` status
//!   reporter and Event recorder that Kubernetes mode adds;
//! - [`config`]: the desired config both produce, and its validation.

pub mod config;
pub mod file;
pub mod kubernetes;

use config::DesiredConfig;
use std::sync::Arc;

/// What a config source says.
#[derive(Clone, Debug, Default)]
pub enum ConfigState {
    /// Nothing read yet.
    #[default]
    Pending,
    /// A valid desired state with its generation (source-defined, increasing).
    Valid(Arc<DesiredConfig>, u64),
    /// The latest input was invalid; the last valid state keeps forwarding.
    Invalid(String, u64),
}
