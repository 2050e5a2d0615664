//! The cloud controller: turns Services of type LoadBalancer (target cluster) into yawol-compatible
//! `LoadBalancer` objects (control cluster), keeps their endpoints in line with the nodes, and
//! reports external IPs and events back to the Services.

pub mod crds;
