//! The load-balancer agent: loads the XDP data plane and programs it (see docs/design.md).
//!
//! Rooms, each importing only from the rooms listed before it:
//! - [`cpus`]: the CPUs this process may run on, and pinning a thread to one.
//! - [`health`]: the backends' health checks.
//! - [`dataplane`]: the data plane's user side — loading and pinning the programs, map access, the desired state
//!   ([`dataplane::model`]) programmed into the maps ([`dataplane::programmer`], with [`dataplane::maglev`] and
//!   the [`dataplane::arena`]), the flow filter, the GC, next hops.
//! - [`ha`]: high availability — VRRP through keepalived ([`ha::vrrp`]), connection-state sync ([`ha::sync`])
//!   and the flow store that applies a peer's records ([`ha::flowstore`]).
//! - [`report`]: what the agent tells — metrics, host metrics, inspection and traces for `lbctl`.
//! - [`source`]: where the desired config comes from — a file ([`source::file`](mod@source::file)) or
//!   Kubernetes ([`source::kubernetes`]) — as a [`source::config::DesiredConfig`].
//! - [`agent`]: the main loop: source → health filtering → programmer → maps, HA and reporting alongside.
pub mod agent;
pub mod cpus;
pub mod dataplane;
pub mod ha;
pub mod health;
pub mod report;
pub mod snat_ports;
pub mod source;

/// TLS set-up shared by every client the agent builds.
pub mod tls {
    /// Installs ring as the process's rustls crypto provider (idempotent). Needed because a workspace build
    /// can enable more than one provider through feature unification, and rustls then will not pick one.
    pub fn install_crypto_provider() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}
