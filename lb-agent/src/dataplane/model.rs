//! The agent's internal model of what the data plane must do: one entry per (VIP, port, protocol). Both
//! config sources (local file, Kubernetes) produce it; [`crate::dataplane::programmer`] turns it into map writes.

use ipnet::IpNet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// Transport protocol of a service port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl Protocol {
    /// IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => lb_common::PROTO_TCP,
            Protocol::Udp => lb_common::PROTO_UDP,
        }
    }

    /// Upper-case name as in Kubernetes Service ports and yawol metric names.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        }
    }

    /// Default idle timeout (Envoy's, which yawol users know): TCP 1 h, UDP 1 min.
    pub fn default_idle_timeout(self) -> Duration {
        match self {
            Protocol::Tcp => Duration::from_secs(3600),
            Protocol::Udp => Duration::from_secs(60),
        }
    }
}

/// Identity of a service in the data plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceId {
    /// Virtual IP.
    pub vip: IpAddr,
    /// Service port.
    pub port: u16,
    /// Protocol.
    pub protocol: Protocol,
}

impl std::fmt::Display for ServiceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}-{}@{}",
            self.protocol.name(),
            self.port,
            SocketAddr::new(self.vip, self.port)
        )
    }
}

/// One load-balanced service port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceSpec {
    /// (VIP, port, protocol).
    pub id: ServiceId,
    /// Source address towards backends; `None` = the VIP (lets a standby replica take over return traffic).
    pub snat: Option<IpAddr>,
    /// Idle timeout of flows; zero = never expire.
    pub idle_timeout: Duration,
    /// Allowed client prefixes, of either family; empty = everyone. Only the VIP's family's can match, so a
    /// list of the other family's alone admits no client.
    pub source_ranges: Vec<IpNet>,
    /// Backends that take new flows (the healthy ones), as node address + NodePort.
    pub backends: Vec<SocketAddr>,
    /// TCP: each connection's backend gets a PROXY protocol v2 header before the client's bytes.
    pub proxy_v2: bool,
}
