//! The cloud controller: turns Services of type LoadBalancer (target cluster) into yawol-compatible
//! `LoadBalancer` objects (control cluster), keeps their endpoints in line with the nodes, and
//! reports external IPs and events back to the Services.
//!
//! Layout: pure decisions in [`desired`] and [`endpoints`]; I/O in [`service_controller`],
//! [`backchannel`], [`leader`]; wiring in [`run`]. The tests and the benchmark run
//! the controllers against `lb_api::fake_api::FakeApiServer` (feature `fake-api-server`).

pub mod backchannel;
pub mod cli;
pub mod crds;
pub mod desired;
pub mod endpoints;
pub mod events;
pub mod http;
pub mod leader;
pub mod metrics;
pub mod run;
pub mod service_controller;
