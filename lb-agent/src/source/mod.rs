//! Config sources: where the agent's [`ConfigState`](crate::agent::ConfigState) comes from, one per mode.
//! Each publishes on a watch channel that [`crate::agent::run`] reads, so everything after the source is
//! shared by both modes.
//! - [`file`](mod@file): a local YAML file, polled;
//! - [`kubernetes`]: the machine's own `LoadBalancer` (watched), with the `LoadBalancerMachine` status
//!   reporter and Event recorder that Kubernetes mode adds.

pub mod file;
pub mod kubernetes;
