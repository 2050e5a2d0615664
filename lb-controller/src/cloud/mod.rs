//! The cloud-controller side (`lb-controller run`, yawol-cloud-controller's role): Services of type LoadBalancer in
//! the target cluster become `LoadBalancer` objects in the control cluster, and their state comes back.
//!
//! - [`loadbalancer_spec`]: Service (+ nodes + defaults) → the LoadBalancer it should have (pure);
//! - [`endpoints`]: which nodes receive traffic (pure);
//! - [`ip_families`]: whether the Service's IP families are served, its endpoints, its condition (pure);
//! - [`service`]: the Service controller that writes it (finalizer, one merge patch per change, deletion);
//! - [`backchannel`]: external IP and events back onto the Service;
//! - [`run`]: the caches, triggers and loops of this side.

pub mod backchannel;
pub mod endpoints;
pub mod ip_families;
pub mod loadbalancer_spec;
pub mod run;
pub mod service;
