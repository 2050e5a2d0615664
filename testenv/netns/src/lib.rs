//! `lb-testbed`: the network-namespace test bed of the load balancer, shared by `cargo xtask demo`, the
//! end-to-end tests and the connection benchmarks.
//!
//! - [`topology`]: switch namespace with a bridge; client, lb and N backend namespaces on one /24, torn down on
//!   drop.
//! - [`echo`]: TCP/UDP echo servers that greet with their id (which backend answered).
//! - [`load`]: many short TCP connections / UDP flows, every byte verified, latency percentiles.
//! - [`hold`]: long-lived connections that must never break.
//! - [`rawsend`]: malformed Ethernet frames through AF_PACKET.
//! - [`stormgen`]: the same frames as a storm of XDP live frames (about twice one socket's rate).
//! - [`synflood`]: SYNs from spoofed sources through AF_PACKET.
//! - [`ha`]: two or three load-balancer replicas with VRRP and state sync sharing one VIP.
//! - [`rig`]: the load balancer under test (topology + echo servers + the real agent); [`demo`] uses it.
//! - `kube_rig` (feature `kubernetes`): the rig's agent in Kubernetes mode against a real API server.
//! - [`forward`]: a TCP forwarder from a namespace to the caller's loopback (how that agent reaches the API server).
//! - [`process`]: command runner with clear errors, [`ChildGuard`], tool/root checks, [`binary_path`].
//!
//! The same functions are available as subcommands of the `lb-testbed` binary (run inside a namespace with
//! [`Topology::spawn`]), which print JSON reports that deserialize into the report types here.

pub mod demo;
pub mod echo;
pub mod forward;
pub mod ha;
pub mod hold;
#[cfg(feature = "kubernetes")]
pub mod kube_rig;
pub mod load;
pub mod process;
pub mod proxy_backend;
pub mod rawsend;
pub mod rig;
pub mod stormgen;
pub mod synflood;
pub mod topology;

pub use topology::{
    binary_path, is_root, ChildGuard, ChildOutput, Host, HostInfo, Topology, TopologyConfig,
};
