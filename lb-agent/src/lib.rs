//! The load-balancer agent: loads the XDP data plane and programs it (see README "Architecture").
//!
//! Flow of information: a config source ([`source::file`](mod@source::file) or [`source::kubernetes`])
//! → [`config::DesiredConfig`] → health filtering ([`health`]) → [`programmer::Programmer`] → maps ([`dataplane::Dataplane`]).
pub mod agent;
pub mod arena;
pub mod config;
pub mod dataplane;
pub mod flow_filter;
pub mod flowstore;
pub mod gc;
pub mod ha;
pub mod health;
pub mod hostmetrics;
pub mod inspect;
pub mod maglev;
pub mod map_batch;
pub mod metrics;
pub mod model;
pub mod neighbor;
pub mod programmer;
pub mod source;
pub mod sync;
pub mod vrrp;

/// TLS set-up shared by every client the agent builds.
pub mod tls {
    /// Installs ring as the process's rustls crypto provider (idempotent). Needed because a workspace build
    /// can enable more than one provider through feature unification, and rustls then will not pick one.
    pub fn install_crypto_provider() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}
