//! Test support shared across crates, so that no crate reaches into another's `tests/` or `examples/` by path:
//! - [`packets`]: frames for the data-plane tests and benchmarks, built with etherparse, and a parser of what
//!   comes out;
//! - [`yawol`]: what yawol-controller gives a LoadBalancerMachine's VM (user data, kubeconfig, Role), for the
//!   agent's yawollet tests and the VM boot test;
//! - [`cascade`]: the OpenStack-side controllers on a real API server against the test OpenStack, with the
//!   machines' agents played, for the controller's OpenStack tests and `bench openstack` (feature `cascade`).
//!
//! Nothing here ships: only tests, benchmarks and examples depend on this crate.

#[cfg(feature = "cascade")]
pub mod cascade;
pub mod packets;
pub mod yawol;
