//! What the agent says about itself, for the status a source reports (Kubernetes mode: the
//! LoadBalancerMachine's conditions).

/// What the agent reports about itself (Kubernetes mode turns it into conditions).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentStatus {
    /// The data plane is loaded and attached.
    pub dataplane_ready: bool,
    /// The interfaces it is attached to and the hook on each (for the status message), once attached.
    pub attached: Vec<(String, crate::dataplane::AttachMode)>,
    /// The attached interfaces where native XDP transmits through the stack's queues under a lock (see
    /// `dataplane::nic`).
    pub xdp_tx_locked: Vec<String>,
    /// The latest config was invalid (message), or `None`.
    pub config_error: Option<String>,
    /// Generation of the latest input seen from the source.
    pub desired_generation: Option<u64>,
    /// Generation of the config now in the maps.
    pub applied_generation: Option<u64>,
    /// VRRP state, when this machine runs VRRP (`KeepalivedMaster`/`KeepalivedProcess` conditions).
    pub vrrp: Option<crate::ha::vrrp::VrrpState>,
    /// The BGP announcement, when this machine runs active-active over BGP (`BGPAnnounced`/`BGPSessions`
    /// conditions).
    pub bgp: Option<BgpStatus>,
    /// Whether the machine should get the VIPs' traffic, when it runs active-active (`VIPEligible` condition).
    pub vip_eligibility: Option<crate::ha::VipEligibility>,
    /// Why `desired_generation` cannot be confirmed as the latest input (Kubernetes mode: the watch of the
    /// LoadBalancer failed and has not relisted since, or the agent loop has not taken the latest published
    /// generation yet); `None` when it can. Set by the status reporter, not by the agent loop.
    pub source_stale: Option<String>,
}

impl AgentStatus {
    /// The maps match the latest valid input, and the source is known to have given the latest input.
    pub fn up_to_date(&self) -> bool {
        self.source_stale.is_none()
            && self.dataplane_ready
            && self.config_error.is_none()
            && self.applied_generation.is_some()
            && self.applied_generation == self.desired_generation
    }
}

/// The BGP announcement as the status reports it: coarse on purpose (BIRD's words for a session that is down
/// change every few seconds; the status is written when it changes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BgpStatus {
    /// VIPs announced.
    pub announced: usize,
    /// Each router's session (empty while BIRD does not answer).
    pub sessions: Vec<(std::net::IpAddr, SessionState)>,
}

/// A BGP session as the status reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionState {
    /// Routes are exchanged.
    Established,
    /// Not yet (BIRD connecting, or the router just went away).
    Connecting,
    /// Down for 30 s or longer.
    Stuck,
}

impl From<&crate::ha::bgp::BgpSnapshot> for BgpStatus {
    fn from(s: &crate::ha::bgp::BgpSnapshot) -> Self {
        let state = |x: &crate::ha::bgp::BgpSession| match (x.established, x.stuck) {
            (true, _) => SessionState::Established,
            (false, true) => SessionState::Stuck,
            (false, false) => SessionState::Connecting,
        };
        BgpStatus {
            announced: s.announced.len(),
            sessions: s.sessions.iter().map(|x| (x.peer, state(x))).collect(),
        }
    }
}
