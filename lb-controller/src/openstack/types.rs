//! The cloud's resources as the controllers see them: only the fields they read.

use std::fmt;

/// Traffic direction of a security-group rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    /// Towards the ports in the group.
    Ingress,
    /// From the ports in the group.
    Egress,
}

/// IP version of a security-group rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EtherType {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl EtherType {
    /// Neutron's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            EtherType::V4 => "IPv4",
            EtherType::V6 => "IPv6",
        }
    }
}

/// A security-group rule as the controller wants it (what Neutron identifies a rule by, minus IDs).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RuleSpec {
    /// Direction.
    pub direction: Direction,
    /// IP version.
    pub ethertype: EtherType,
    /// `tcp`, `udp`, `icmp`, `ipv6-icmp`, `vrrp`, or `None` for any protocol.
    pub protocol: Option<String>,
    /// First port (TCP/UDP) or ICMP type.
    pub port_range_min: Option<u16>,
    /// Last port (TCP/UDP) or ICMP code.
    pub port_range_max: Option<u16>,
    /// Source (ingress) or destination (egress) prefix.
    pub remote_ip_prefix: Option<String>,
    /// Source group (`vrrp` between the members of our own group).
    pub remote_group_id: Option<String>,
}

/// An existing security-group rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecurityGroupRule {
    /// Rule ID.
    pub id: String,
    /// What the rule allows.
    pub spec: RuleSpec,
}

/// A security group with its rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecurityGroup {
    /// ID.
    pub id: String,
    /// Name.
    pub name: String,
    /// Rules.
    pub rules: Vec<SecurityGroupRule>,
}

/// A floating IP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FloatingIp {
    /// ID.
    pub id: String,
    /// The public address.
    pub address: String,
    /// Description (floating IPs have no name; yawol marks its own with `<ns>/<lb>`).
    pub description: String,
    /// The associated port, if any.
    pub port_id: Option<String>,
    /// `ACTIVE`, `DOWN`, `ERROR`.
    pub status: String,
}

/// Filter for [`super::Cloud::find_floating_ips`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FloatingIpFilter {
    /// Exact address.
    pub address: Option<String>,
    /// Exact description.
    pub description: Option<String>,
}

/// A fixed IP of a port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FixedIp {
    /// Address.
    pub ip_address: String,
    /// Subnet.
    pub subnet_id: String,
}

/// A Neutron port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    /// ID.
    pub id: String,
    /// Name.
    pub name: String,
    /// Network.
    pub network_id: String,
    /// Fixed IPs.
    pub fixed_ips: Vec<FixedIp>,
    /// Security group IDs.
    pub security_groups: Vec<String>,
    /// Allowed address pairs (IP addresses or CIDRs).
    pub allowed_address_pairs: Vec<String>,
    /// Server (or router) using it.
    pub device_id: String,
    /// What uses it: `compute:<zone>` for a server, `network:router_interface` (and its distributed and HA
    /// forms, [`ROUTER_INTERFACE_OWNERS`]) for a router's leg on a subnet.
    pub device_owner: String,
}

/// `device_owner` of a router's interface on a subnet: legacy and OVN routers, distributed (DVR) routers, HA
/// routers.
pub const ROUTER_INTERFACE_OWNERS: [&str; 3] = [
    "network:router_interface",
    "network:router_interface_distributed",
    "network:ha_router_replicated_interface",
];

/// One extra route of a Neutron router: traffic for `destination` (a CIDR) goes to `nexthop`. Several routes of one
/// destination are ECMP next hops (OVN installs them so).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Route {
    /// CIDR.
    pub destination: String,
    /// Next-hop address (on a subnet the router is attached to).
    pub nexthop: String,
}

impl Port {
    /// The address to use as (IPv4) VIP: the first IPv4 fixed IP, else the first one (an IPv6-only network).
    pub fn primary_ip(&self) -> Option<&str> {
        self.fixed_ips
            .iter()
            .find(|f| !f.ip_address.contains(':'))
            .or_else(|| self.fixed_ips.first())
            .map(|f| f.ip_address.as_str())
    }

    /// The fixed IP the port has on `subnet_id`, if any.
    pub fn ip_on_subnet(&self, subnet_id: &str) -> Option<&str> {
        self.fixed_ips
            .iter()
            .find(|f| f.subnet_id == subnet_id)
            .map(|f| f.ip_address.as_str())
    }
}

/// A Neutron subnet (what choosing one for a fixed IP needs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subnet {
    /// ID.
    pub id: String,
    /// Network.
    pub network_id: String,
    /// 4 or 6.
    pub ip_version: u8,
    /// CIDR.
    pub cidr: String,
}

/// A fixed IP asked for in a port update: an existing one (both fields) or a new one from a subnet (`ip_address`
/// `None`: Neutron picks the address).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FixedIpRequest {
    /// Subnet.
    pub subnet_id: String,
    /// Address; `None`: any free one of the subnet.
    pub ip_address: Option<String>,
}

/// What to create a port with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PortSpec {
    /// Name.
    pub name: String,
    /// Network.
    pub network_id: String,
    /// Subnet to take the fixed IP from (Neutron's choice when `None`).
    pub subnet_id: Option<String>,
    /// Security groups.
    pub security_groups: Vec<String>,
    /// Allowed address pairs.
    pub allowed_address_pairs: Vec<String>,
}

/// Changes to a port; `None` keeps a field.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PortUpdate {
    /// New security groups.
    pub security_groups: Option<Vec<String>>,
    /// New allowed address pairs.
    pub allowed_address_pairs: Option<Vec<String>>,
    /// New fixed IPs (the whole list: an existing address left out is released).
    pub fixed_ips: Option<Vec<FixedIpRequest>>,
}

/// A Nova server group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerGroup {
    /// ID.
    pub id: String,
    /// Name.
    pub name: String,
    /// `affinity`, `anti-affinity`, `soft-affinity` or `soft-anti-affinity`.
    pub policy: String,
}

/// A Nova server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Server {
    /// ID.
    pub id: String,
    /// Name.
    pub name: String,
    /// `BUILD`, `ACTIVE`, `ERROR`, `DELETED`, …
    pub status: String,
    /// Nova's fault message when in ERROR.
    pub fault: Option<String>,
    /// When Nova created it (RFC 3339).
    pub created: Option<String>,
    /// Whether Nova gives it a config drive.
    pub config_drive: bool,
}

/// What to boot a server with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServerSpec {
    /// Name.
    pub name: String,
    /// Flavor ID.
    pub flavor_id: String,
    /// Image ID.
    pub image_id: String,
    /// Availability zone (`None`: Nova's default).
    pub availability_zone: Option<String>,
    /// The pre-made port of the default network (first NIC).
    pub port_id: String,
    /// Further networks, one auto-created port each.
    pub additional_networks: Vec<String>,
    /// Cloud-init user data, plain text (implementations base64-encode it).
    pub user_data: String,
    /// Existing Nova key pair (debug only).
    pub key_name: Option<String>,
    /// Scheduler hint `group`.
    pub server_group_id: Option<String>,
    /// Ask Nova for a config drive.
    pub config_drive: bool,
}

/// What went wrong, as far as the controllers' decisions go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloudErrorKind {
    /// 404: the resource is gone (or was never there).
    NotFound,
    /// 409: conflict (in use, concurrent change).
    Conflict,
    /// Quota exceeded (Neutron 409 `OverQuota`, Nova 403/413).
    Quota,
    /// 4xx other than the above: the request was wrong (bad CIDR, unknown network …).
    BadRequest,
    /// 5xx, connection errors, timeouts: try again later, change nothing.
    Unavailable,
    /// Anything else (unparsable response, client set-up).
    Other,
}

/// A failed cloud call, with the cloud's own error text (for events).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloudError {
    /// Classification.
    pub kind: CloudErrorKind,
    /// What was being done (`creating floating IP`).
    pub operation: String,
    /// The cloud's message.
    pub message: String,
}

impl CloudError {
    /// A new error.
    pub fn new(
        kind: CloudErrorKind,
        operation: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        CloudError {
            kind,
            operation: operation.into(),
            message: message.into(),
        }
    }

    /// 404.
    pub fn is_not_found(&self) -> bool {
        self.kind == CloudErrorKind::NotFound
    }
}

impl fmt::Display for CloudError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {:?}: {}", self.operation, self.kind, self.message)
    }
}

impl std::error::Error for CloudError {}

/// Classifies an HTTP status and body the way the controllers need it.
pub fn classify(status: u16, message: &str) -> CloudErrorKind {
    let lower = message.to_ascii_lowercase();
    if lower.contains("quota") || lower.contains("overquota") || status == 413 {
        return CloudErrorKind::Quota;
    }
    match status {
        404 => CloudErrorKind::NotFound,
        409 => CloudErrorKind::Conflict,
        408 | 429 => CloudErrorKind::Unavailable,
        400..=499 => CloudErrorKind::BadRequest,
        500..=599 => CloudErrorKind::Unavailable,
        _ => CloudErrorKind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        assert_eq!(
            classify(404, "Port x could not be found"),
            CloudErrorKind::NotFound
        );
        assert_eq!(
            classify(409, "Quota exceeded for resources: ['floatingip']"),
            CloudErrorKind::Quota
        );
        assert_eq!(
            classify(403, "Quota exceeded for instances"),
            CloudErrorKind::Quota
        );
        assert_eq!(classify(413, "OverLimit"), CloudErrorKind::Quota);
        assert_eq!(classify(409, "in use"), CloudErrorKind::Conflict);
        assert_eq!(classify(503, "down"), CloudErrorKind::Unavailable);
        assert_eq!(classify(400, "bad cidr"), CloudErrorKind::BadRequest);
    }

    #[test]
    fn primary_ip_prefers_ipv4() {
        let p = Port {
            id: "p".into(),
            name: "n".into(),
            network_id: "net".into(),
            fixed_ips: vec![
                FixedIp {
                    ip_address: "2001:db8::5".into(),
                    subnet_id: "s6".into(),
                },
                FixedIp {
                    ip_address: "10.0.0.5".into(),
                    subnet_id: "s4".into(),
                },
            ],
            security_groups: vec![],
            allowed_address_pairs: vec![],
            device_id: String::new(),
            device_owner: String::new(),
        };
        assert_eq!(p.primary_ip(), Some("10.0.0.5"));
    }
}
