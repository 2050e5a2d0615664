//! The cloud controller: turns Services of type LoadBalancer (target cluster) into yawol-compatible
//! `LoadBalancer` objects (control cluster), keeps their endpoints in line with the nodes, and
//! reports external IPs and events back to the Services.
//!
//! Layout: pure decisions in [`desired`] and [`endpoints`]; I/O in [`service_controller`],
//! [`backchannel`], [`leader`]; wiring in [`run`]; [`fake_api`] is the in-memory API server used
//! by the tests and the benchmark.

pub mod backchannel;
pub mod cli;
pub mod crds;
pub mod desired;
pub mod endpoints;
pub mod events;
pub mod fake_api;
pub mod http;
pub mod leader;
pub mod metrics;
pub mod run;
pub mod service_controller;
