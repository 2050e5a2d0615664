//! What the agent must load-balance, from either config source, validated into [`DesiredConfig`].
//!
//! The local file has the shape of a `LoadBalancer` spec (ports, endpoints, options; yawol's field names and
//! types from `lb-api`) plus the VIP and agent-side settings, so the same YAML fragment works in both modes
//! and the "frontend for the API server" use needs no cluster.

use crate::dataplane::model::{Protocol, ServiceId, ServiceSpec};
use crate::health::{HealthCheckSpec, HealthMap, HealthTarget};
use anyhow::{bail, Context, Result};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::ServicePort;
use lb_api::loadbalancer::{LoadBalancerEndpoint, LoadBalancerOptions};
use serde::Deserialize;
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

/// The local config file (`--config`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LocalConfig {
    /// The virtual IP (the LoadBalancer's `status.portIP` in Kubernetes mode), IPv4 or IPv6.
    #[serde(default)]
    pub vip: Option<IpAddr>,
    /// More virtual IPs, for dual stack: at most one per family counting `vip`. Each gets every port.
    #[serde(default)]
    pub vips: Vec<IpAddr>,
    /// Source address towards the backends; default: the VIP. Applies to the VIP of its family.
    #[serde(default)]
    pub snat_address: Option<IpAddr>,
    /// More source addresses (dual stack), at most one per family counting `snatAddress`.
    #[serde(default)]
    pub snat_addresses: Vec<IpAddr>,
    /// Service ports (Kubernetes `ServicePort`: `name`, `protocol`, `port`, `nodePort`).
    #[serde(default)]
    pub ports: Vec<ServicePort>,
    /// Backends: one entry per node with its addresses.
    #[serde(default)]
    pub endpoints: Vec<LoadBalancerEndpoint>,
    /// LoadBalancer options (source ranges, idle timeouts).
    #[serde(default)]
    pub options: LoadBalancerOptions,
    /// Health checking of backends.
    #[serde(default)]
    pub health_check: HealthCheckSpec,
}

/// An address with the field it came from, for error messages.
pub type Named = (String, IpAddr);

impl LocalConfig {
    /// The VIPs with their fields (`vip`, then `vips[i]`).
    pub fn named_vips(&self) -> Vec<Named> {
        named(self.vip, "vip", &self.vips, "vips")
    }

    /// The SNAT addresses with their fields.
    pub fn named_snat(&self) -> Vec<Named> {
        named(
            self.snat_address,
            "snatAddress",
            &self.snat_addresses,
            "snatAddresses",
        )
    }
}

fn named(one: Option<IpAddr>, field: &str, many: &[IpAddr], list: &str) -> Vec<Named> {
    one.map(|a| (field.to_string(), a))
        .into_iter()
        .chain(
            many.iter()
                .enumerate()
                .map(|(i, a)| (format!("{list}[{i}]"), *a)),
        )
        .collect()
}

/// "IPv4" or "IPv6".
pub fn family_name(ip: &IpAddr) -> &'static str {
    if ip.is_ipv4() {
        "IPv4"
    } else {
        "IPv6"
    }
}

impl LocalConfig {
    /// Reads and parses a config file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("parsing config file {}", path.display()))
    }

    /// Parses a config file's text. A key this agent does not know is an error at any depth, as at the top
    /// (`deny_unknown_fields`): the options are yawol's type, lenient for the Kubernetes API's sake (a newer
    /// controller's field must not make a LoadBalancer unreadable), and in a file a misspelt option would
    /// otherwise be ignored in silence.
    pub fn parse(text: &str) -> Result<Self> {
        let mut unknown = Vec::new();
        let c: Self = serde_ignored::deserialize(serde_yaml::Deserializer::from_str(text), |p| {
            unknown.push(p.to_string())
        })?;
        if !unknown.is_empty() {
            bail!("unknown field(s): {}", unknown.join(", "));
        }
        Ok(c)
    }
}

/// A validated desired state: services with every configured backend (health filtering happens later).
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredConfig {
    /// One entry per (VIP, port, protocol), backends = all endpoints × NodePort.
    pub services: Vec<ServiceSpec>,
    /// Health checking.
    pub health_check: HealthCheckSpec,
    /// Sync peers' addresses from the source (Kubernetes: the LoadBalancer's `syncPeers` annotation); `None`:
    /// the agent's `--sync-peer` flags stay in force.
    pub sync_peers: Option<Vec<IpAddr>>,
    /// Whether this machine belongs to the newest revision of the load balancer (its VRRP priority gets a
    /// bonus); `None`: unknown (file mode).
    pub newest_revision: Option<bool>,
    /// Addresses of draining endpoints (`draining: true`): they take no new flows and keep their connections.
    pub draining: BTreeSet<IpAddr>,
    /// Accepted, but worth an operator's look (an endpoint without an address of a VIP's family, an
    /// allow-list without a range of a VIP's family); logged, and in Kubernetes mode reported as Events.
    pub warnings: Vec<String>,
}

impl DesiredConfig {
    /// The VIPs of all services (sorted, unique): what VRRP moves.
    pub fn vips(&self) -> Vec<IpAddr> {
        let v: BTreeSet<IpAddr> = self.services.iter().map(|s| s.id.vip).collect();
        v.into_iter().collect()
    }

    /// Every backend (all services).
    pub fn backends(&self) -> BTreeSet<SocketAddr> {
        self.services
            .iter()
            .flat_map(|s| s.backends.iter().copied())
            .collect()
    }

    /// Backends that are actively checked: those of TCP services, and those of UDP services when a UDP probe
    /// is configured. UDP has no protocol-independent probe (a NodePort may silently drop anything that is not
    /// its application's request), so without one UDP backends follow their node's TCP checks instead (see
    /// [`udp_backend_healthy`]).
    pub fn health_targets(&self) -> BTreeSet<HealthTarget> {
        self.services
            .iter()
            .filter(|s| s.id.protocol == Protocol::Tcp || self.health_check.udp.is_some())
            .flat_map(|s| s.backends.iter().map(|b| (s.id.protocol, *b)))
            .collect()
    }
}

/// A UDP backend without its own probe is healthy unless its node has checked TCP backends and all of them
/// are down.
pub fn udp_backend_healthy(b: &SocketAddr, health: &HealthMap) -> bool {
    let mut checked = health
        .iter()
        .filter(|((p, a), _)| *p == Protocol::Tcp && a.ip() == b.ip())
        .peekable();
    checked.peek().is_none() || checked.any(|(_, up)| *up)
}

impl DesiredConfig {
    /// The services as they must be in the maps now: configured backends minus unhealthy and draining ones.
    pub fn effective(&self, health: &HealthMap) -> Vec<ServiceSpec> {
        self.services
            .iter()
            .map(|s| {
                let mut s = s.clone();
                let protocol = s.id.protocol;
                s.backends.retain(|b| {
                    !self.draining.contains(&b.ip()) && backend_healthy(protocol, b, health)
                });
                s
            })
            .collect()
    }

    /// The backends whose connections stay: the healthy ones, and the draining ones whatever their checks say (a
    /// node being drained may fail them on purpose, as kube-proxy's health check does on a node the autoscaler
    /// removes). A backend that leaves this set has its connections ended (`gc::end_flows`).
    pub fn serving(&self, health: &HealthMap) -> BTreeSet<(Protocol, SocketAddr)> {
        let mut all = self.all_backends();
        all.retain(|(p, b)| self.draining.contains(&b.ip()) || backend_healthy(*p, b, health));
        all
    }

    /// Every configured backend with its service's protocol.
    pub fn all_backends(&self) -> BTreeSet<(Protocol, SocketAddr)> {
        self.services
            .iter()
            .flat_map(|s| s.backends.iter().map(|b| (s.id.protocol, *b)))
            .collect()
    }
}

/// Whether a backend passes its checks: its own when it has any, else a TCP backend counts as healthy (not
/// checked yet) and a UDP one follows its node ([`udp_backend_healthy`]).
fn backend_healthy(protocol: Protocol, b: &SocketAddr, health: &HealthMap) -> bool {
    match health.get(&(protocol, *b)) {
        Some(up) => *up,
        None => protocol == Protocol::Tcp || udp_backend_healthy(b, health),
    }
}

/// Builds the desired state from LoadBalancer-shaped input. Every problem is reported at once, naming the
/// field, so an operator can fix the object in one go; nothing is applied when anything is wrong.
///
/// Dual stack: each VIP (at most one per family) gets every port, and as backends the endpoints' addresses of
/// its own family; a SNAT address applies to the VIP of its family. The data plane does not translate between
/// families, so a SNAT address without a VIP of its family, or a VIP whose family no endpoint has, is refused.
///
/// `proxy_v2`: whether this agent's data plane puts PROXY v2 headers in (XDP does, TC does not). Without, the
/// ports that ask for one are built without it; the caller reports that ([`unsupported_options`]).
pub fn desired(
    vips: &[Named],
    snat: &[Named],
    ports: &[ServicePort],
    endpoints: &[LoadBalancerEndpoint],
    options: &LoadBalancerOptions,
    health_check: HealthCheckSpec,
    proxy_v2: bool,
) -> Result<DesiredConfig> {
    checked(
        vips,
        snat,
        ports,
        endpoints,
        options,
        health_check,
        proxy_v2,
        Vec::new(),
    )
}

/// [`desired`] with problems the caller already found (`errors`), reported together with the others.
#[allow(clippy::too_many_arguments)]
fn checked(
    vips: &[Named],
    snat: &[Named],
    ports: &[ServicePort],
    endpoints: &[LoadBalancerEndpoint],
    options: &LoadBalancerOptions,
    health_check: HealthCheckSpec,
    proxy_v2: bool,
    mut errors: Vec<String>,
) -> Result<DesiredConfig> {
    let mut warnings = Vec::new();
    if vips.is_empty() {
        errors.push("vip: no VIP is given (vip or vips)".into());
    }
    let mut by_family: Vec<Named> = Vec::new();
    for (field, ip) in vips {
        match by_family.iter().find(|(_, v)| v.is_ipv4() == ip.is_ipv4()) {
            Some((_, v)) if v == ip => errors.push(format!("{field}: {ip} is listed twice")),
            Some((f, v)) => errors.push(format!(
                "{field}: a second {} VIP ({ip}, besides {v} in {f}); one VIP per family",
                family_name(ip)
            )),
            None => by_family.push((field.clone(), *ip)),
        }
    }
    let mut snat_by_family: Vec<IpAddr> = Vec::new();
    for (field, s) in snat {
        if snat_by_family.iter().any(|x| x.is_ipv4() == s.is_ipv4()) {
            errors.push(format!(
                "{field}: a second {} SNAT address ({s}); one per family",
                family_name(s)
            ));
        } else if !by_family.iter().any(|(_, v)| v.is_ipv4() == s.is_ipv4()) {
            let vips: Vec<String> = by_family.iter().map(|(_, v)| v.to_string()).collect();
            errors.push(format!(
                "{field}: SNAT address {s} is not of the VIP's family (VIP {}); no NAT46/NAT64",
                vips.join(", ")
            ));
        } else {
            snat_by_family.push(*s);
        }
    }
    let tcp_idle = options
        .tcp_idle_timeout()
        .map_err(|e| errors.push(format!("options.tcpIdleTimeout: {e}")))
        .unwrap_or_default();
    let udp_idle = options
        .udp_idle_timeout()
        .map_err(|e| errors.push(format!("options.udpIdleTimeout: {e}")))
        .unwrap_or_default();
    let mut source_ranges = Vec::new();
    for (i, r) in options.source_ranges().iter().enumerate() {
        match r.trim().parse::<IpNet>() {
            Ok(net) => source_ranges.push(net),
            Err(_) => errors.push(format!(
                "options.loadBalancerSourceRanges[{i}]: {r:?} is not a CIDR (e.g. 192.0.2.0/24)"
            )),
        }
    }
    // Endpoint addresses by node, both families.
    let mut draining = BTreeSet::new();
    let mut nodes: Vec<(String, Vec<IpAddr>)> = Vec::new();
    for (i, ep) in endpoints.iter().enumerate() {
        let mut ips = Vec::new();
        for (j, a) in ep.addresses().iter().enumerate() {
            match a.trim().parse::<IpAddr>() {
                Ok(ip) => ips.push(ip),
                Err(_) => errors.push(format!(
                    "endpoints[{i}] ({}).addresses[{j}]: {a:?} is not an IP address",
                    ep.name
                )),
            }
        }
        if ep.is_draining() {
            draining.extend(ips.iter().copied());
        }
        nodes.push((format!("endpoints[{i}] ({})", ep.name), ips));
    }
    // Backends of each VIP: its family's addresses. A VIP that no endpoint can serve while endpoints exist is
    // a mixed-family service, refused; a node lacking that family is left out of this VIP's services only.
    let mut addrs_of: Vec<(IpAddr, Vec<IpAddr>)> = Vec::new();
    for (field, vip) in &by_family {
        let family = family_name(vip);
        let mut addrs: Vec<IpAddr> = nodes
            .iter()
            .flat_map(|(_, ips)| ips.iter().filter(|a| a.is_ipv4() == vip.is_ipv4()))
            .copied()
            .collect();
        addrs.sort();
        addrs.dedup();
        let parsed_any = nodes.iter().any(|(_, ips)| !ips.is_empty());
        if addrs.is_empty() && parsed_any {
            errors.push(format!(
                "{field}: {family} VIP {vip} but no endpoint has an {family} address (a service's backends \
                 must be of its VIP's family)"
            ));
        } else {
            for (what, ips) in &nodes {
                if !ips.is_empty() && !ips.iter().any(|a| a.is_ipv4() == vip.is_ipv4()) {
                    warnings.push(format!(
                        "{what} has no {family} address: not a backend of the {family} VIP {vip}"
                    ));
                }
            }
        }
        if !source_ranges.is_empty()
            && !source_ranges
                .iter()
                .any(|r| r.addr().is_ipv4() == vip.is_ipv4())
        {
            warnings.push(format!(
                "options.loadBalancerSourceRanges has no {family} range: the {family} VIP {vip} admits no client"
            ));
        }
        addrs_of.push((*vip, addrs));
    }
    let mut ports_ok = Vec::new();
    let mut seen = BTreeSet::new();
    for (i, p) in ports.iter().enumerate() {
        let what = format!(
            "ports[{i}]{}",
            p.name
                .as_deref()
                .map(|n| format!(" ({n})"))
                .unwrap_or_default()
        );
        let protocol = match p.protocol.as_deref().unwrap_or("TCP") {
            "TCP" => Protocol::Tcp,
            "UDP" => Protocol::Udp,
            other => {
                errors.push(format!(
                    "{what}: protocol {other:?} is not supported (TCP or UDP)"
                ));
                continue;
            }
        };
        if !(1..=65535).contains(&p.port) {
            errors.push(format!("{what}: port {} is out of range 1-65535", p.port));
            continue;
        }
        let node_port = match p.node_port {
            Some(np) if (1..=65535).contains(&np) => np as u16,
            Some(np) => {
                errors.push(format!("{what}: nodePort {np} is out of range 1-65535"));
                continue;
            }
            None => {
                errors.push(format!("{what}: nodePort is missing"));
                continue;
            }
        };
        if !seen.insert((p.port, protocol)) {
            errors.push(format!(
                "{what}: {} {} is listed twice",
                protocol.name(),
                p.port
            ));
            continue;
        }
        ports_ok.push((protocol, p.port as u16, node_port));
    }
    if options.tcp_proxy_protocol() {
        for port in options.tcp_proxy_protocol_ports_filter.iter().flatten() {
            if !ports_ok
                .iter()
                .any(|(proto, p, _)| *proto == Protocol::Tcp && i32::from(*p) == *port)
            {
                warnings.push(format!(
                    "options.tcpProxyProtocolPortFilter names port {port}, which is no TCP port of this load \
                     balancer: no PROXY header is sent for it"
                ));
            }
        }
    }
    let mut services = Vec::new();
    for (vip, addrs) in &addrs_of {
        for &(protocol, port, node_port) in &ports_ok {
            services.push(ServiceSpec {
                id: ServiceId {
                    vip: *vip,
                    port,
                    protocol,
                },
                snat: snat_by_family
                    .iter()
                    .find(|s| s.is_ipv4() == vip.is_ipv4())
                    .copied(),
                idle_timeout: match protocol {
                    Protocol::Tcp => tcp_idle,
                    Protocol::Udp => udp_idle,
                },
                // All of them: the programmer writes the VIP's family's and keeps the allow-list on when
                // the other family's are all there is.
                source_ranges: source_ranges.clone(),
                backends: addrs
                    .iter()
                    .map(|a| SocketAddr::new(*a, node_port))
                    .collect(),
                proxy_v2: proxy_v2
                    && protocol == Protocol::Tcp
                    && options.tcp_proxy_protocol_for_port(port.into()),
            });
        }
    }
    if let Err(e) = health_check.validate() {
        errors.push(format!("healthCheck: {e}"));
    }
    if !errors.is_empty() {
        bail!("invalid configuration:\n  - {}", errors.join("\n  - "));
    }
    Ok(DesiredConfig {
        services,
        health_check,
        sync_peers: None,
        newest_revision: None,
        draining,
        warnings,
    })
}

/// A LoadBalancer option this agent does not implement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnsupportedOption {
    /// `options.logForward`: this image ships no logs.
    LogForward,
    /// `options.tcpProxyProtocol` on an agent attached at TC: only the XDP hook inserts the PROXY v2 header.
    ProxyProtocol,
}

impl UnsupportedOption {
    /// Every option this agent does not implement.
    pub const ALL: [UnsupportedOption; 2] = [Self::LogForward, Self::ProxyProtocol];

    /// The option's field in the LoadBalancer spec / the config file.
    pub fn field(self) -> &'static str {
        match self {
            Self::LogForward => "options.logForward",
            Self::ProxyProtocol => "options.tcpProxyProtocol",
        }
    }
}

/// An option the configuration asks for that this agent cannot honour, and what that means. Never ignored
/// silently: Kubernetes mode reports it on the LoadBalancerMachine (a False condition and a Warning Event) and
/// keeps forwarding, since the object is written by a controller from the user's Service; file mode refuses the
/// file, as it does any other field it cannot honour.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unsupported {
    /// Which option.
    pub option: UnsupportedOption,
    /// For the operator: what is asked for and what happens instead.
    pub message: String,
}

/// The options among `options` (for the service ports `ports`) that this agent does not implement; `proxy_v2`:
/// whether its data plane inserts PROXY v2 headers (every XDP mode; not TC).
pub fn unsupported_options(
    ports: &[ServicePort],
    options: &LoadBalancerOptions,
    proxy_v2: bool,
) -> Vec<Unsupported> {
    let mut out = Vec::new();
    if let Some(lf) = options.log_forward.as_ref().filter(|l| l.enabled) {
        out.push(Unsupported {
            option: UnsupportedOption::LogForward,
            message: format!(
                "logForward to {} is not supported by this load-balancer image (no log shipper); the machine's \
                 logs stay in its journal",
                lf.loki_url
            ),
        });
    }
    let proxied = options.tcp_proxy_protocol_ports(ports);
    if !proxied.is_empty() && !proxy_v2 {
        let ports: Vec<String> = proxied.iter().map(i32::to_string).collect();
        out.push(Unsupported {
            option: UnsupportedOption::ProxyProtocol,
            message: format!(
                "tcpProxyProtocol needs the XDP hook and this agent runs at TC (--attach-mode tc): TCP port(s) {} \
                 are forwarded without a PROXY protocol header, so the backends see the load balancer's address \
                 instead of the client's",
                ports.join(", ")
            ),
        });
    }
    out
}

impl TryFrom<&LocalConfig> for DesiredConfig {
    type Error = anyhow::Error;

    /// [`DesiredConfig::from_file`] for a data plane that inserts PROXY v2 headers.
    fn try_from(c: &LocalConfig) -> Result<Self> {
        DesiredConfig::from_file(c, true)
    }
}

impl DesiredConfig {
    /// File mode: an option the agent cannot honour makes the file invalid (see [`Unsupported`]), reported with
    /// the file's other problems; `proxy_v2` as for [`unsupported_options`].
    pub fn from_file(c: &LocalConfig, proxy_v2: bool) -> Result<Self> {
        let unsupported: Vec<String> = unsupported_options(&c.ports, &c.options, proxy_v2)
            .into_iter()
            .map(|u| format!("{}: {}", u.option.field(), u.message))
            .collect();
        checked(
            &c.named_vips(),
            &c.named_snat(),
            &c.ports,
            &c.endpoints,
            &c.options,
            c.health_check.clone(),
            proxy_v2,
            unsupported,
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Duration;

    const GOOD: &str = r#"
vip: 10.200.0.100
ports:
  - {name: http, protocol: TCP, port: 80, nodePort: 30080}
  - {name: dns, protocol: UDP, port: 53, nodePort: 30053}
endpoints:
  - {name: node-1, addresses: [10.200.0.11]}
  - {name: node-2, addresses: [10.200.0.12, "fd00::12"]}
options:
  loadBalancerSourceRanges: [10.0.0.0/8]
  tcpIdleTimeout: 2h0m0s
  udpIdleTimeout: 0s
"#;

    #[test]
    fn a_loadbalancer_shaped_file_becomes_services() {
        let c: LocalConfig = serde_yaml::from_str(GOOD).unwrap();
        let d = DesiredConfig::try_from(&c).unwrap();
        assert_eq!(d.services.len(), 2);
        let tcp = &d.services[0];
        assert_eq!(tcp.id.port, 80);
        assert_eq!(tcp.idle_timeout, Duration::from_secs(7200));
        assert_eq!(tcp.backends.len(), 2, "IPv6 address of a v4 VIP ignored");
        assert_eq!(tcp.backends[0], "10.200.0.11:30080".parse().unwrap());
        assert_eq!(
            d.services[1].idle_timeout,
            Duration::ZERO,
            "0s = never expire"
        );
        assert_eq!(
            tcp.source_ranges,
            vec!["10.0.0.0/8".parse::<IpNet>().unwrap()]
        );
    }

    #[test]
    fn a_draining_endpoint_takes_no_new_flows_and_keeps_serving_whatever_its_checks_say() {
        let c: LocalConfig = serde_yaml::from_str(
            "vip: 10.0.0.1\nports: [{port: 80, nodePort: 30080}, {port: 53, protocol: UDP, nodePort: 30053}]\n\
             endpoints: [{name: a, addresses: [10.0.0.11]}, {name: b, addresses: [10.0.0.12], draining: true}]\n",
        )
        .unwrap();
        let cfg = DesiredConfig::try_from(&c).unwrap();
        let a = |port| SocketAddr::from(([10, 0, 0, 11], port));
        let b = |port| SocketAddr::from(([10, 0, 0, 12], port));
        // Both fail their TCP checks: a stops serving, b (draining) keeps its connections.
        let health: HealthMap = [
            ((Protocol::Tcp, a(30080)), false),
            ((Protocol::Tcp, b(30080)), false),
        ]
        .into();
        let services = cfg.effective(&health);
        assert!(
            services.iter().all(|s| s.backends.is_empty()),
            "{services:?}"
        );
        assert_eq!(
            cfg.serving(&health),
            [(Protocol::Tcp, b(30080)), (Protocol::Udp, b(30053))].into()
        );
        assert_eq!(cfg.all_backends().len(), 4);
        let healthy = cfg.effective(&HealthMap::new());
        assert_eq!(healthy[0].backends, [a(30080)], "no new flows to b");
    }

    #[test]
    fn defaults_are_envoys() {
        let c: LocalConfig = serde_yaml::from_str(
            "vip: 10.0.0.1\nports: [{port: 80, nodePort: 30080}]\nendpoints: []\n",
        )
        .unwrap();
        let d = DesiredConfig::try_from(&c).unwrap();
        assert_eq!(d.services[0].id.protocol, Protocol::Tcp);
        assert_eq!(d.services[0].idle_timeout, Duration::from_secs(3600));
        assert!(d.services[0].backends.is_empty());
    }

    #[test]
    fn an_unknown_key_is_an_error_at_any_depth() {
        let base = "vip: 10.0.0.1\nports: [{port: 80, nodePort: 30080}]\nendpoints: []\n";
        assert!(LocalConfig::parse(base).is_ok());
        // yawol's option is `tcpProxyProtocolPortFilter`: the plural would be ignored by the options' own type.
        let e = LocalConfig::parse(&format!(
            "{base}options: {{tcpProxyProtocol: true, tcpProxyProtocolPortsFilter: [80]}}\n"
        ))
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("options.tcpProxyProtocolPortsFilter"),
            "{e:#}"
        );
        let e = LocalConfig::parse(&format!("{base}healthCheck: {{intervall: 1s}}\n")).unwrap_err();
        assert!(format!("{e:#}").contains("intervall"), "{e:#}");
        assert!(LocalConfig::parse(&format!("{base}vipp: 10.0.0.2\n")).is_err());
    }

    #[test]
    fn every_problem_is_reported_by_field() {
        let bad = r#"
vip: 10.0.0.1
ports:
  - {name: a, protocol: SCTP, port: 80, nodePort: 30080}
  - {name: b, protocol: TCP, port: 0, nodePort: 30081}
  - {name: c, protocol: TCP, port: 81}
  - {name: d, protocol: UDP, port: 82, nodePort: 70000}
endpoints:
  - {name: node-1, addresses: [not-an-ip]}
options:
  loadBalancerSourceRanges: [10.0.0.0/33]
  tcpIdleTimeout: forever
"#;
        let c: LocalConfig = serde_yaml::from_str(bad).unwrap();
        let e = DesiredConfig::try_from(&c).unwrap_err().to_string();
        for needle in [
            "ports[0] (a): protocol \"SCTP\"",
            "ports[1] (b): port 0",
            "ports[2] (c): nodePort is missing",
            "ports[3] (d): nodePort 70000",
            "endpoints[0] (node-1).addresses[0]",
            "loadBalancerSourceRanges[0]",
            "options.tcpIdleTimeout",
        ] {
            assert!(e.contains(needle), "missing {needle:?} in:\n{e}");
        }
    }

    #[test]
    fn unhealthy_backends_leave_and_udp_follows_its_node() {
        let c: LocalConfig = serde_yaml::from_str(GOOD).unwrap();
        let d = DesiredConfig::try_from(&c).unwrap();
        assert_eq!(d.health_targets().len(), 2, "only TCP backends are probed");
        let mut h = HealthMap::new();
        h.insert((Protocol::Tcp, "10.200.0.11:30080".parse().unwrap()), false);
        h.insert((Protocol::Tcp, "10.200.0.12:30080".parse().unwrap()), true);
        let e = d.effective(&h);
        assert_eq!(e[0].backends, vec!["10.200.0.12:30080".parse().unwrap()]);
        assert_eq!(
            e[1].backends,
            vec!["10.200.0.12:30053".parse().unwrap()],
            "node 11 is down for UDP too"
        );
    }

    #[test]
    fn a_udp_probe_checks_udp_backends_themselves() {
        let c: LocalConfig = serde_yaml::from_str(&format!(
            "{GOOD}healthCheck:\n  udp: {{payload: {{hex: \"00 01\"}}, expect: {{text: ok}}}}\n"
        ))
        .unwrap();
        let d = DesiredConfig::try_from(&c).unwrap();
        let udp: SocketAddr = "10.200.0.12:30053".parse().unwrap();
        assert!(d.health_targets().contains(&(Protocol::Udp, udp)));
        assert_eq!(d.health_targets().len(), 4, "TCP and UDP backends");
        // The probe decides, not the node's TCP checks: node 11 is down for TCP but its UDP probe answers.
        let mut h = HealthMap::new();
        h.insert((Protocol::Tcp, "10.200.0.11:30080".parse().unwrap()), false);
        h.insert((Protocol::Udp, "10.200.0.11:30053".parse().unwrap()), true);
        h.insert((Protocol::Udp, udp), false);
        assert_eq!(
            d.effective(&h)[1].backends,
            vec!["10.200.0.11:30053".parse().unwrap()]
        );
        let bad: LocalConfig = serde_yaml::from_str(&format!(
            "{GOOD}healthCheck:\n  udp: {{payload: {{hex: abc}}}}\n"
        ))
        .unwrap();
        let e = DesiredConfig::try_from(&bad).unwrap_err().to_string();
        assert!(e.contains("healthCheck: udp.payload"), "{e}");
    }

    #[test]
    fn file_mode_refuses_options_it_cannot_honour() {
        // An agent at TC: no PROXY v2.
        let with = |options: &str| {
            let c: LocalConfig = serde_yaml::from_str(&format!("{GOOD}{options}")).unwrap();
            DesiredConfig::from_file(&c, false).map(|_| ())
        };
        let e = with("  tcpProxyProtocol: true\n").unwrap_err().to_string();
        assert!(
            e.contains("options.tcpProxyProtocol: tcpProxyProtocol needs the XDP hook and this agent runs at TC"),
            "{e}"
        );
        // At XDP the ports named get the header, and a filter port that is no TCP port is a warning.
        let c: LocalConfig = serde_yaml::from_str(&format!(
            "{GOOD}  tcpProxyProtocol: true\n  tcpProxyProtocolPortFilter: [80, 53]\n"
        ))
        .unwrap();
        let d = DesiredConfig::try_from(&c).unwrap();
        let proxied: Vec<(Protocol, u16, bool)> = d
            .services
            .iter()
            .map(|s| (s.id.protocol, s.id.port, s.proxy_v2))
            .collect();
        assert!(proxied.contains(&(Protocol::Tcp, 80, true)), "{proxied:?}");
        assert!(proxied.iter().all(|(p, _, on)| *p == Protocol::Tcp || !on));
        // A data plane that puts no header in (TC) gets no such service from the Kubernetes side's builder.
        let no_header = desired(
            &c.named_vips(),
            &[],
            &c.ports,
            &c.endpoints,
            &c.options,
            c.health_check.clone(),
            false,
        )
        .unwrap();
        assert!(no_header.services.iter().all(|s| !s.proxy_v2));
        assert!(
            d.warnings
                .iter()
                .any(|w| w.contains("names port 53, which is no TCP port")),
            "{:?}",
            d.warnings
        );
        let e = with(
            "  logForward: {enabled: true, lokiUrl: \"http://loki:3100\"}\n  tcpProxyProtocol: true\n",
        )
        .unwrap_err()
        .to_string();
        for needle in [
            "options.logForward: logForward to http://loki:3100",
            "options.tcpProxyProtocol",
        ] {
            assert!(e.contains(needle), "missing {needle:?} in:\n{e}");
        }
        // Set but asking for nothing: accepted.
        with("  tcpProxyProtocol: false\n  logForward: {enabled: false, lokiUrl: \"\"}\n").unwrap();
        with("  tcpProxyProtocol: true\n  tcpProxyProtocolPortFilter: [443]\n").unwrap();
    }

    const DUAL: &str = r#"
vip: 10.200.0.100
vips: ["fd00::100"]
snatAddresses: ["fd00::5"]
ports:
  - {name: http, protocol: TCP, port: 80, nodePort: 30080}
endpoints:
  - {name: node-1, addresses: [10.200.0.11]}
  - {name: node-2, addresses: [10.200.0.12, "fd00::12"]}
options:
  loadBalancerSourceRanges: [10.0.0.0/8]
"#;

    #[test]
    fn dual_stack_gives_each_vip_its_familys_backends() {
        let c: LocalConfig = serde_yaml::from_str(DUAL).unwrap();
        let d = DesiredConfig::try_from(&c).unwrap();
        assert_eq!(d.services.len(), 2, "one service per VIP and port");
        let (v4, v6) = (&d.services[0], &d.services[1]);
        assert_eq!(v4.id.vip, "10.200.0.100".parse::<IpAddr>().unwrap());
        assert_eq!(v4.backends.len(), 2);
        assert_eq!(
            v4.snat, None,
            "the SNAT address is IPv6: the IPv4 VIP keeps its own"
        );
        assert_eq!(v6.id.vip, "fd00::100".parse::<IpAddr>().unwrap());
        assert_eq!(v6.backends, vec!["[fd00::12]:30080".parse().unwrap()]);
        assert_eq!(v6.snat, Some("fd00::5".parse().unwrap()));
        assert_eq!(d.vips().len(), 2);
        assert!(
            d.warnings.iter().any(|w| {
                w.contains(
                "endpoints[0] (node-1) has no IPv6 address: not a backend of the IPv6 VIP fd00::100"
            )
            }),
            "{:?}",
            d.warnings
        );
        assert!(
            d.warnings.iter().any(|w| w.contains(
                "loadBalancerSourceRanges has no IPv6 range: the IPv6 VIP fd00::100 admits no client"
            )),
            "{:?}",
            d.warnings
        );
        assert_eq!(d.warnings.len(), 2, "{:?}", d.warnings);
        // Both families' ranges go to every service; the programmer writes the VIP's family's.
        assert_eq!(v6.source_ranges, v4.source_ranges);
    }

    #[test]
    fn an_ipv6_vip_alone_works() {
        let c: LocalConfig = serde_yaml::from_str(
            "vip: \"2001:db8::1\"\nports: [{port: 443, nodePort: 30443}]\nendpoints: [{name: n, addresses: [\"2001:db8::11\", 10.0.0.11]}]\n",
        )
        .unwrap();
        let d = DesiredConfig::try_from(&c).unwrap();
        assert_eq!(
            d.services[0].backends,
            vec!["[2001:db8::11]:30443".parse().unwrap()]
        );
        assert!(d.warnings.is_empty(), "{:?}", d.warnings);
    }

    #[test]
    fn family_mismatches_are_refused_by_field() {
        let bad = |yaml: &str| {
            let c: LocalConfig = serde_yaml::from_str(yaml).unwrap();
            DesiredConfig::try_from(&c).unwrap_err().to_string()
        };
        let e =
            bad("vip: 10.0.0.1\nsnatAddress: \"fd00::1\"\nports: [{port: 80, nodePort: 30080}]\n");
        assert!(
            e.contains(
                "snatAddress: SNAT address fd00::1 is not of the VIP's family (VIP 10.0.0.1)"
            ),
            "{e}"
        );
        let e = bad("vip: \"fd00::100\"\nports: [{port: 80, nodePort: 30080}]\nendpoints: [{name: n, addresses: [10.0.0.11]}]\n");
        assert!(
            e.contains("vip: IPv6 VIP fd00::100 but no endpoint has an IPv6 address"),
            "{e}"
        );
        let e = bad("vip: 10.0.0.1\nvips: [10.0.0.2]\nports: [{port: 80, nodePort: 30080}]\n");
        assert!(
            e.contains("vips[0]: a second IPv4 VIP (10.0.0.2, besides 10.0.0.1 in vip)"),
            "{e}"
        );
        let e = bad("ports: [{port: 80, nodePort: 30080}]\n");
        assert!(e.contains("vip: no VIP is given"), "{e}");
        let e = bad("vips: [10.0.0.1, \"fd00::1\"]\nsnatAddress: 10.0.0.5\nsnatAddresses: [10.0.0.6]\nports: [{port: 80, nodePort: 30080}]\n");
        assert!(
            e.contains("snatAddresses[0]: a second IPv4 SNAT address (10.0.0.6)"),
            "{e}"
        );
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let e = serde_yaml::from_str::<LocalConfig>("vip: 10.0.0.1\nprots: []\n").unwrap_err();
        assert!(e.to_string().contains("prots"));
    }
}
