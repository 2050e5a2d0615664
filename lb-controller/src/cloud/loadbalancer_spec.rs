//! Service (+ nodes + controller defaults) → desired `LoadBalancer` (pure, no I/O).
//!
//! Everything the Service controller decides lives here so it can be unit-tested: class
//! filtering, validation, annotation parsing (with warnings for bad values instead of failures),
//! and the JSON merge patch that brings an existing LoadBalancer to the desired state in one
//! write.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{SecretReference, Service, ServicePort};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use lb_api::constants::service_annotations as ann;
use lb_api::constants::{defaults, lb_annotations};
use lb_api::{
    naming, GoDuration, LoadBalancer, LoadBalancerAdditionalNetwork, LoadBalancerDebugSettings,
    LoadBalancerDefaultNetwork, LoadBalancerEndpoint, LoadBalancerInfrastructure,
    LoadBalancerLogForward, LoadBalancerOptions, LoadBalancerSpec, OpenstackFlavorRef,
    OpenstackImageRef,
};
use serde_json::{Map, Value};

/// Controller-wide infrastructure defaults (yawol's environment variables).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct InfrastructureDefaults {
    /// Namespace of the LoadBalancer objects in the control cluster (`CLUSTER_NAMESPACE`).
    pub namespace: String,
    /// Secret with `cloudprovider.conf` in that namespace (`SECRET_NAME`).
    pub auth_secret_name: String,
    /// Floating IP pool network (`FLOATING_NET_ID`).
    pub floating_network_id: String,
    /// Listener network (`NETWORK_ID`).
    pub network_id: String,
    /// Subnet of the listener network (`SUBNET_ID`), optional.
    pub subnet_id: Option<String>,
    /// IPv6 subnet of the listener network for dual-stack and IPv6 VIPs (`SUBNET_ID_V6`), optional: without it the
    /// OpenStack side takes the network's only IPv6 subnet.
    pub subnet_id_v6: Option<String>,
    /// Machine flavor (`FLAVOR_ID` / `FLAVOR_NAME` / `FLAVOR_SEARCH`).
    pub flavor: OpenstackFlavorRef,
    /// Machine image (`IMAGE_ID` / `IMAGE_NAME` / `IMAGE_SEARCH`).
    pub image: OpenstackImageRef,
    /// Availability zone (`AVAILABILITY_ZONE`), "" for none.
    pub availability_zone: String,
    /// Default for `options.internalLB` (`INTERNAL_LB`).
    pub internal_lb: bool,
}

/// Which Services this controller handles (`--classname`, `--empty-classname`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClassFilter {
    /// Accepted load-balancer classes.
    pub class_names: Vec<String>,
    /// Also handle Services without any class.
    pub accept_empty: bool,
}

impl Default for ClassFilter {
    fn default() -> Self {
        Self {
            class_names: vec![defaults::LOADBALANCER_CLASS.to_string()],
            accept_empty: true,
        }
    }
}

impl ClassFilter {
    /// The Service's class: the deprecated annotation, else `spec.loadBalancerClass`, else "".
    pub fn class_of(service: &Service) -> String {
        annotation(service, ann::CLASS_NAME)
            .map(str::to_string)
            .or_else(|| {
                service
                    .spec
                    .as_ref()
                    .and_then(|s| s.load_balancer_class.clone())
            })
            .unwrap_or_default()
    }

    /// Whether this controller is responsible for the Service's class.
    pub fn accepts(&self, service: &Service) -> bool {
        let class = Self::class_of(service);
        if class.is_empty() {
            self.accept_empty
        } else {
            self.class_names.contains(&class)
        }
    }
}

/// Whether the Service is of type LoadBalancer.
pub fn is_load_balancer_type(service: &Service) -> bool {
    service.spec.as_ref().and_then(|s| s.type_.as_deref()) == Some("LoadBalancer")
}

/// Validation errors that make a Service unusable (reported as Warning events, nothing is created
/// or changed until the Service is fixed).
pub fn validate_service(service: &Service) -> Vec<String> {
    let mut errors = Vec::new();
    let Some(spec) = service.spec.as_ref() else {
        return vec!["service has no spec".into()];
    };
    if spec.allocate_load_balancer_node_ports == Some(false) {
        errors.push(
            "allocateLoadBalancerNodePorts=false is not supported: every port needs a nodePort"
                .into(),
        );
    }
    for port in spec.ports.iter().flatten() {
        let label = port.name.clone().unwrap_or_else(|| port.port.to_string());
        let protocol = lb_api::port_protocol(port);
        if protocol != "TCP" && protocol != "UDP" {
            errors.push(format!(
                "port {label}: unsupported protocol {protocol} (only TCP and UDP)"
            ));
        }
        match port.node_port {
            Some(p) if (1..=65535).contains(&p) => {}
            other => errors.push(format!(
                "port {label}: nodePort {} is not in 1..65535",
                other.unwrap_or(0)
            )),
        }
    }
    errors
}

/// Reasons of the Service controller's Warning events.
pub mod reasons {
    /// The Service cannot be served ([`super::validate_service`]); nothing is created or changed.
    pub const VALIDATION: &str = "validation";
    /// An annotation's value was ignored or a change of it refused; the rest is applied.
    pub const ANNOTATION: &str = "annotation";
    /// `tcpProxyProtocolPortsFilter` names a port of the Service that is not TCP: PROXY protocol is TCP only, the
    /// port is forwarded without a header.
    pub const PROXY_PROTOCOL_PORT_NOT_TCP: &str = "ProxyProtocolPortNotTcp";
    /// `tcpProxyProtocolPortsFilter` names a number that is no port of the Service: it selects nothing.
    pub const PROXY_PROTOCOL_PORT_UNKNOWN: &str = "ProxyProtocolPortUnknown";
    /// No node that would receive traffic has an IPv4 InternalIP: a single-stack LoadBalancer has no backends, a
    /// PreferDualStack one is served over IPv6 only, a RequireDualStack Service is refused
    /// ([`crate::cloud::ip_families`]).
    pub const NO_IPV4_NODES: &str = "NoIPv4Nodes";
    /// The same for IPv6 InternalIPs.
    pub const NO_IPV6_NODES: &str = "NoIPv6Nodes";
    /// The Service asks for IPv6 and this installation does not serve it (the controller's `--serve-ipv6` is off):
    /// a PreferDualStack Service is served over IPv4 only, an IPv6-only or RequireDualStack one is refused.
    pub const IP_FAMILY_NOT_SUPPORTED: &str = "IPFamilyNotSupported";
    /// The installed LoadBalancer CRD does not store `endpoints[].draining`: terminating nodes are left out
    /// instead of draining.
    pub const DRAINING_NOT_STORED: &str = "DrainingNotStored";
    /// `activeActive` with fewer than two replicas: the machine serves the VIP alone (routed, without a standby).
    pub const ACTIVE_ACTIVE_TOO_FEW_REPLICAS: &str = "ActiveActiveTooFewReplicas";
}

/// A problem with a Service, reported as a Warning event on it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Warning {
    /// The event's reason (one of [`reasons`]).
    pub reason: &'static str,
    /// The event's message.
    pub message: String,
}

impl Warning {
    /// Each message as a warning with `reason`.
    pub fn all(reason: &'static str, messages: Vec<String>) -> Vec<Warning> {
        messages
            .into_iter()
            .map(|message| Warning { reason, message })
            .collect()
    }
}

/// The result of translating a Service.
#[derive(Clone, Debug, PartialEq)]
pub struct Desired {
    /// The LoadBalancer spec the Service asks for.
    pub spec: LoadBalancerSpec,
    /// Annotations that were ignored or are not honoured (reported as Warning events).
    pub warnings: Vec<Warning>,
}

/// Builds the desired LoadBalancer spec from a Service, the endpoints and the defaults.
pub fn desired_spec(
    service: &Service,
    endpoints: Vec<LoadBalancerEndpoint>,
    defaults: &InfrastructureDefaults,
) -> Desired {
    let mut warnings = Vec::new();
    let namespace = service.metadata.namespace.as_deref().unwrap_or("default");
    let name = service.metadata.name.as_deref().unwrap_or_default();
    let spec = service.spec.clone().unwrap_or_default();

    let replicas = match annotation(service, ann::REPLICAS) {
        None => defaults::REPLICAS,
        Some(text) => match text.trim().parse::<i32>() {
            Ok(n) if n >= 0 => n,
            _ => {
                warnings.push(format!(
                    "annotation {}={text:?} is not a non-negative integer; using {}",
                    ann::REPLICAS,
                    defaults::REPLICAS
                ));
                defaults::REPLICAS
            }
        },
    };

    let debug = bool_annotation(service, ann::DEBUG, &mut warnings).unwrap_or(false);
    let debug_settings = LoadBalancerDebugSettings {
        enabled: debug,
        sshkey_name: if debug {
            annotation(service, ann::DEBUG_SSH_KEY).map(str::to_string)
        } else {
            None
        },
    };

    let infrastructure = infrastructure(service, defaults, &mut warnings);
    let options = options(service, defaults, &mut warnings);

    let selector = LabelSelector {
        match_labels: Some(BTreeMap::from([(
            lb_api::constants::labels::LOADBALANCER.to_string(),
            naming::loadbalancer_selector_value(&defaults.namespace, namespace, name),
        )])),
        ..Default::default()
    };

    let mut warnings = Warning::all(reasons::ANNOTATION, warnings);
    if options.is_active_active() && replicas < 2 {
        warnings.push(Warning {
            reason: reasons::ACTIVE_ACTIVE_TOO_FEW_REPLICAS,
            message: format!(
                "annotation {}=\"true\" wants {} of 2 or more, it is {replicas}: the VIP is routed to {} without \
                 a second one to take over",
                ann::ACTIVE_ACTIVE,
                ann::REPLICAS,
                if replicas == 1 { "the one machine" } else { "no machine" },
            ),
        });
    }
    warnings.extend(proxy_protocol_filter_warnings(
        &options,
        spec.ports.as_deref().unwrap_or_default(),
    ));

    Desired {
        spec: LoadBalancerSpec {
            selector,
            replicas,
            existing_floating_ip: annotation(service, ann::EXISTING_FLOATING_IP)
                .map(str::to_string),
            debug_settings: Some(debug_settings),
            endpoints: (!endpoints.is_empty()).then_some(endpoints),
            ports: spec.ports.filter(|p| !p.is_empty()).map(with_protocol),
            infrastructure,
            options: Some(options),
            // Set by the caller from the IP-family decision ([`ip_families_field`]).
            ip_families: None,
        },
        warnings,
    }
}

/// `spec.ipFamilies` of a LoadBalancer serving `families`: absent for IPv4 alone, so IPv4 LoadBalancers stay
/// exactly what yawol writes (and existing ones see no diff).
pub fn ip_families_field(families: &[String]) -> Option<Vec<String>> {
    match families {
        [] => None,
        [only] if only == lb_api::IP_FAMILY_V4 => None,
        all => Some(all.to_vec()),
    }
}

/// The ports `tcpProxyProtocolPortsFilter` names that get no PROXY header, so that the user is told and does not
/// find out from a backend refusing connections. A number that is both a TCP and a UDP port (DNS) is served: the TCP
/// port gets the header. Without PROXY protocol the filter does nothing and nothing is said.
fn proxy_protocol_filter_warnings(
    options: &LoadBalancerOptions,
    ports: &[ServicePort],
) -> Vec<Warning> {
    let filter = match options.tcp_proxy_protocol_ports_filter.as_deref() {
        Some(filter) if options.tcp_proxy_protocol() => filter,
        _ => return Vec::new(),
    };
    let (mut not_tcp, mut unknown) = (Vec::new(), Vec::new());
    for &wanted in filter {
        let mut protocols = ports
            .iter()
            .filter(|p| p.port == wanted)
            .map(lb_api::port_protocol)
            .peekable();
        let list = if protocols.peek().is_none() {
            &mut unknown
        } else if protocols.all(|p| p != "TCP") {
            &mut not_tcp
        } else {
            continue;
        };
        if !list.contains(&wanted) {
            list.push(wanted);
        }
    }
    let join = |ports: &[i32]| {
        ports
            .iter()
            .map(i32::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut warnings = Vec::new();
    if !not_tcp.is_empty() {
        warnings.push(Warning {
            reason: reasons::PROXY_PROTOCOL_PORT_NOT_TCP,
            message: format!(
                "annotation {} names port(s) {} of the Service that are not TCP: PROXY protocol is TCP only, \
                 they are forwarded without a PROXY header",
                ann::TCP_PROXY_PROTOCOL_PORTS_FILTER,
                join(&not_tcp)
            ),
        });
    }
    if !unknown.is_empty() {
        warnings.push(Warning {
            reason: reasons::PROXY_PROTOCOL_PORT_UNKNOWN,
            message: format!(
                "annotation {} names port(s) {} that the Service does not have (the filter names the Service's \
                 ports, not node or target ports): they select nothing",
                ann::TCP_PROXY_PROTOCOL_PORTS_FILTER,
                join(&unknown)
            ),
        });
    }
    warnings
}

/// The ports with `protocol` filled in (TCP when absent), as the LoadBalancer CRD's schema
/// default stores them: the desired spec then equals the stored one.
fn with_protocol(mut ports: Vec<ServicePort>) -> Vec<ServicePort> {
    for port in &mut ports {
        if port.protocol.is_none() {
            port.protocol = Some(lb_api::port_protocol(port).to_string());
        }
    }
    ports
}

fn infrastructure(
    service: &Service,
    defaults: &InfrastructureDefaults,
    warnings: &mut Vec<String>,
) -> LoadBalancerInfrastructure {
    let network_override = annotation(service, ann::DEFAULT_NETWORK_ID);
    let network_id = network_override.unwrap_or(&defaults.network_id).to_string();
    // The default subnet belongs to the default network: only use it with that network.
    let subnet_id = annotation(service, ann::DEFAULT_SUBNET_ID)
        .map(str::to_string)
        .or_else(|| {
            network_override
                .is_none()
                .then(|| defaults.subnet_id.clone())
                .flatten()
        });
    let subnet_id_v6 = network_override
        .is_none()
        .then(|| defaults.subnet_id_v6.clone())
        .flatten();
    let floating_net_id = annotation(service, ann::FLOATING_NETWORK_ID)
        .unwrap_or(&defaults.floating_network_id)
        .to_string();

    let mut additional: Vec<String> = annotation(service, ann::ADDITIONAL_NETWORKS)
        .map(|list| split_list(list).map(str::to_string).collect())
        .unwrap_or_default();
    let skip_default = bool_annotation(
        service,
        ann::SKIP_CLOUD_CONTROLLER_DEFAULT_NETWORK_ID,
        warnings,
    )
    .unwrap_or(false);
    // With an overridden listener network the machines still need the cluster network to reach
    // the nodes, unless the user says they do not.
    if network_id != defaults.network_id && !skip_default && !defaults.network_id.is_empty() {
        additional.push(defaults.network_id.clone());
    }
    let mut seen = std::collections::HashSet::new();
    additional.retain(|id| id != &network_id && seen.insert(id.clone()));

    LoadBalancerInfrastructure {
        floating_net_id: None,
        network_id: None,
        default_network: LoadBalancerDefaultNetwork {
            floating_net_id: Some(floating_net_id).filter(|s| !s.is_empty()),
            network_id,
            subnet_id: subnet_id.filter(|s| !s.is_empty()),
            subnet_id_v6: subnet_id_v6.filter(|s| !s.is_empty()),
        },
        additional_networks: (!additional.is_empty()).then(|| {
            additional
                .into_iter()
                .map(|network_id| LoadBalancerAdditionalNetwork { network_id })
                .collect()
        }),
        flavor: annotation(service, ann::FLAVOR_ID)
            .map(OpenstackFlavorRef::by_id)
            .unwrap_or_else(|| defaults.flavor.clone()),
        image: annotation(service, ann::IMAGE_ID)
            .map(OpenstackImageRef::by_id)
            .unwrap_or_else(|| defaults.image.clone()),
        availability_zone: annotation(service, ann::AVAILABILITY_ZONE)
            .unwrap_or(&defaults.availability_zone)
            .to_string(),
        auth_secret_ref: SecretReference {
            name: Some(defaults.auth_secret_name.clone()),
            namespace: Some(defaults.namespace.clone()),
        },
        project_id: annotation(service, ann::PROJECT_ID).map(str::to_string),
    }
}

const SERVER_GROUP_POLICIES: [&str; 4] = [
    "affinity",
    "anti-affinity",
    "soft-affinity",
    "soft-anti-affinity",
];

fn options(
    service: &Service,
    defaults: &InfrastructureDefaults,
    warnings: &mut Vec<String>,
) -> LoadBalancerOptions {
    let spec = service.spec.as_ref();
    let internal =
        bool_annotation(service, ann::INTERNAL_LB, warnings).unwrap_or(defaults.internal_lb);

    // spec.loadBalancerSourceRanges wins over the annotation (yawol's rule).
    let mut source_ranges: Vec<String> =
        match spec.and_then(|s| s.load_balancer_source_ranges.clone()) {
            Some(ranges) => ranges,
            None => annotation(service, ann::LOAD_BALANCER_SOURCE_RANGES)
                .map(|list| split_list(list).map(str::to_string).collect())
                .unwrap_or_default(),
        };
    source_ranges.retain(|cidr| {
        let valid = is_cidr(cidr);
        if !valid {
            warnings.push(format!(
                "source range {cidr:?} is not a valid CIDR; ignoring it"
            ));
        }
        valid
    });

    let proxy_protocol =
        bool_annotation(service, ann::TCP_PROXY_PROTOCOL, warnings).unwrap_or(false);
    let ports_filter = annotation(service, ann::TCP_PROXY_PROTOCOL_PORTS_FILTER).and_then(|list| {
        let parsed: Result<Vec<i32>, _> = split_list(list).map(|p| p.parse::<i32>()).collect();
        match parsed {
            Ok(ports) if ports.iter().all(|p| (1..=65535).contains(p)) => Some(ports),
            _ => {
                warnings.push(format!(
                    "annotation {}={list:?} is not a list of ports; PROXY protocol applies to all TCP ports",
                    ann::TCP_PROXY_PROTOCOL_PORTS_FILTER
                ));
                None
            }
        }
    });

    let duration = |key: &str, warnings: &mut Vec<String>| {
        annotation(service, key).and_then(|text| match lb_api::parse_go_duration(text.trim()) {
            Ok(d) => Some(GoDuration::from_std(d)),
            Err(e) => {
                warnings.push(format!("annotation {key}: {e}; ignoring the option"));
                None
            }
        })
    };
    let tcp_idle_timeout = duration(ann::TCP_IDLE_TIMEOUT, warnings);
    let udp_idle_timeout = duration(ann::UDP_IDLE_TIMEOUT, warnings);

    let log_forward_enabled = bool_annotation(service, ann::LOG_FORWARD, warnings).unwrap_or(false);
    // yawol always writes `logForward` (disabled: `{enabled: false, lokiUrl: ""}`); doing the same
    // keeps adopted objects free of spurious diffs.
    let log_forward = Some(if !log_forward_enabled {
        LoadBalancerLogForward::default()
    } else {
        let labels: BTreeMap<String, String> = service
            .metadata
            .annotations
            .iter()
            .flatten()
            .filter_map(|(k, v)| {
                k.strip_prefix(ann::LOG_LABEL_PREFIX)
                    .filter(|label| !label.is_empty())
                    .map(|label| (label.to_string(), v.clone()))
            })
            .collect();
        LoadBalancerLogForward {
            enabled: true,
            loki_url: annotation(service, ann::LOG_FORWARD_LOKI_URL)
                .unwrap_or_default()
                .to_string(),
            proxy_url: annotation(service, ann::LOG_FORWARD_PROXY_URL).map(str::to_string),
            labels: (!labels.is_empty()).then_some(labels),
        }
    });

    let server_group_policy = annotation(service, ann::SERVER_GROUP_POLICY).and_then(|policy| {
        if SERVER_GROUP_POLICIES.contains(&policy) {
            Some(policy.to_string())
        } else {
            warnings.push(format!(
                "annotation {}={policy:?} is not one of {}; no server group is used",
                ann::SERVER_GROUP_POLICY,
                SERVER_GROUP_POLICIES.join(", ")
            ));
            None
        }
    });

    let active_active = bool_annotation(service, ann::ACTIVE_ACTIVE, warnings).unwrap_or(false);

    LoadBalancerOptions {
        internal_lb: Some(internal),
        load_balancer_source_ranges: (!source_ranges.is_empty()).then_some(source_ranges),
        tcp_proxy_protocol: proxy_protocol.then_some(true),
        // Kept even without PROXY protocol (yawol does the same; it only matters when enabled).
        tcp_proxy_protocol_ports_filter: ports_filter,
        tcp_idle_timeout,
        udp_idle_timeout,
        log_forward,
        server_group_policy,
        // Absent unless asked for: VRRP LoadBalancers stay exactly what yawol writes.
        active_active: active_active.then_some(true),
    }
}

/// Non-empty annotation value.
fn annotation<'a>(service: &'a Service, key: &str) -> Option<&'a str> {
    service
        .metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
        .filter(|v| !v.is_empty())
}

/// A boolean annotation with Go's `strconv.ParseBool` syntax; invalid values are warned about
/// and treated as absent.
fn bool_annotation(service: &Service, key: &str, warnings: &mut Vec<String>) -> Option<bool> {
    let text = annotation(service, key)?;
    let parsed = parse_go_bool(text.trim());
    if parsed.is_none() {
        warnings.push(format!(
            "annotation {key}={text:?} is not a boolean; ignoring it"
        ));
    }
    parsed
}

/// Go's `strconv.ParseBool`.
pub fn parse_go_bool(text: &str) -> Option<bool> {
    match text {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

fn split_list(list: &str) -> impl Iterator<Item = &str> {
    list.split(',').map(str::trim).filter(|s| !s.is_empty())
}

fn is_cidr(text: &str) -> bool {
    let Some((ip, prefix)) = text.split_once('/') else {
        return false;
    };
    match (ip.parse::<IpAddr>(), prefix.parse::<u8>()) {
        (Ok(IpAddr::V4(_)), Ok(p)) => p <= 32,
        (Ok(IpAddr::V6(_)), Ok(p)) => p <= 128,
        _ => false,
    }
}

/// The first ingress IP of the Service's status.
pub fn service_ingress_ip(service: &Service) -> Option<&str> {
    service_ingress_ips(service).into_iter().next()
}

/// Every ingress IP of the Service's status (one per served family).
pub fn service_ingress_ips(service: &Service) -> Vec<&str> {
    service
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|l| l.ingress.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|i| i.ip.as_deref().filter(|ip| !ip.is_empty()))
        .collect()
}

/// A complete new LoadBalancer object for a Service.
pub fn new_loadbalancer(
    service: &Service,
    spec: LoadBalancerSpec,
    defaults: &InfrastructureDefaults,
) -> LoadBalancer {
    let namespace = service.metadata.namespace.as_deref().unwrap_or("default");
    let name = service.metadata.name.as_deref().unwrap_or_default();
    LoadBalancer {
        metadata: ObjectMeta {
            name: Some(naming::loadbalancer_name(namespace, name)),
            namespace: Some(defaults.namespace.clone()),
            annotations: Some(BTreeMap::from([(
                lb_annotations::SERVICE_NAME.to_string(),
                naming::service_reference(namespace, name),
            )])),
            ..Default::default()
        },
        spec,
        status: None,
    }
}

/// Applies the rules that protect fields of an existing LoadBalancer from changes
/// (yawol: `projectID` is immutable; `existingFloatingIP` cannot change once an IP is assigned).
/// Returns the adjusted spec and warnings about rejected changes.
pub fn protect_immutable(
    mut desired: LoadBalancerSpec,
    current: &LoadBalancerSpec,
    service: &Service,
) -> (LoadBalancerSpec, Vec<String>) {
    let mut warnings = Vec::new();
    if current.infrastructure.project_id.is_some()
        && desired.infrastructure.project_id != current.infrastructure.project_id
    {
        warnings.push(format!(
            "annotation {} cannot be changed after creation (current {:?}); keeping it",
            ann::PROJECT_ID,
            current
                .infrastructure
                .project_id
                .as_deref()
                .unwrap_or_default()
        ));
        desired.infrastructure.project_id = current.infrastructure.project_id.clone();
    }
    let published = service_ingress_ips(service);
    // The floating IP is one of the published addresses (the IPv6 one may come first).
    if let Some(assigned) = published
        .iter()
        .find(|ip| !ip.contains(':'))
        .or(published.first())
    {
        if desired.existing_floating_ip != current.existing_floating_ip
            && desired.existing_floating_ip.as_deref() != Some(*assigned)
        {
            warnings.push(format!(
                "annotation {} cannot be changed after the IP {assigned} was assigned; keeping {:?}",
                ann::EXISTING_FLOATING_IP,
                current.existing_floating_ip.as_deref().unwrap_or("none")
            ));
            desired.existing_floating_ip = current.existing_floating_ip.clone();
        }
    }
    // The selector is fixed at creation (sets and machines are labelled with it).
    desired.selector = current.selector.clone();
    (desired, warnings)
}

/// RFC 7386 merge patch that turns `current` into `desired` (`None` when they are equal).
/// Objects are diffed per key (removed keys become `null`), everything else is replaced.
pub fn merge_patch_diff(current: &Value, desired: &Value) -> Option<Value> {
    match (current, desired) {
        (Value::Object(cur), Value::Object(des)) => {
            let mut patch = Map::new();
            for (key, want) in des {
                match cur.get(key) {
                    Some(have) => {
                        if let Some(sub) = merge_patch_diff(have, want) {
                            patch.insert(key.clone(), sub);
                        }
                    }
                    None => {
                        patch.insert(key.clone(), want.clone());
                    }
                }
            }
            for key in cur.keys().filter(|k| !des.contains_key(*k)) {
                patch.insert(key.clone(), Value::Null);
            }
            (!patch.is_empty()).then_some(Value::Object(patch))
        }
        _ if current == desired => None,
        _ => Some(desired.clone()),
    }
}

/// The spec fields a patch touches, for logs and events ("ports", "endpoints", ...).
pub fn changed_fields(spec_patch: &Value) -> Vec<String> {
    spec_patch
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn defaults() -> InfrastructureDefaults {
        InfrastructureDefaults {
            namespace: "kube-system".into(),
            auth_secret_name: "cloudprovider".into(),
            floating_network_id: "floating".into(),
            network_id: "net".into(),
            subnet_id: Some("subnet".into()),
            subnet_id_v6: None,
            flavor: OpenstackFlavorRef::by_id("flavor"),
            image: OpenstackImageRef::by_id("image"),
            availability_zone: "az1".into(),
            internal_lb: false,
        }
    }

    fn service(annotations: Value) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "default", "annotations": annotations},
            "spec": {
                "type": "LoadBalancer",
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080, "targetPort": 8080}],
                "ipFamilies": ["IPv4"],
            }
        }))
        .unwrap()
    }

    #[test]
    fn plain_service_uses_defaults() {
        let d = desired_spec(&service(json!({})), vec![], &defaults());
        assert!(d.warnings.is_empty(), "{:?}", d.warnings);
        let spec = d.spec;
        assert_eq!(spec.replicas, 1);
        let infra = &spec.infrastructure;
        assert_eq!(infra.default_network.network_id, "net");
        assert_eq!(infra.default_network.subnet_id.as_deref(), Some("subnet"));
        assert_eq!(
            infra.default_network.floating_net_id.as_deref(),
            Some("floating")
        );
        assert_eq!(infra.flavor.flavor_id.as_deref(), Some("flavor"));
        assert_eq!(
            infra.auth_secret_ref.namespace.as_deref(),
            Some("kube-system")
        );
        assert!(infra.additional_networks.is_none());
        assert_eq!(spec.options().internal_lb, Some(false));
        assert_eq!(spec.ports().len(), 1);
        assert!(!spec.debug_settings().enabled);
        let selector = spec.selector.match_labels.unwrap();
        assert_eq!(selector["yawol.stackit.cloud/loadbalancer"].len(), 16);
    }

    #[test]
    fn every_annotation_is_honoured() {
        let svc = service(json!({
            "yawol.stackit.cloud/imageId": "img2",
            "yawol.stackit.cloud/flavorId": "flv2",
            "yawol.stackit.cloud/defaultNetworkID": "net2",
            "yawol.stackit.cloud/defaultSubnetID": "sub2",
            "yawol.stackit.cloud/floatingNetworkID": "fip2",
            "yawol.stackit.cloud/projectID": "proj",
            "yawol.stackit.cloud/availabilityZone": "az2",
            "yawol.stackit.cloud/internalLB": "true",
            "yawol.stackit.cloud/debug": "true",
            "yawol.stackit.cloud/debugsshkey": "key",
            "yawol.stackit.cloud/replicas": "3",
            "yawol.stackit.cloud/existingFloatingIP": "192.0.2.1",
            "yawol.stackit.cloud/loadBalancerSourceRanges": "10.0.0.0/8, 2001:db8::/32",
            "yawol.stackit.cloud/tcpProxyProtocol": "true",
            "yawol.stackit.cloud/tcpProxyProtocolPortsFilter": "80,443",
            "yawol.stackit.cloud/tcpIdleTimeout": "330s",
            "yawol.stackit.cloud/udpIdleTimeout": "2m",
            "yawol.stackit.cloud/logForward": "true",
            "yawol.stackit.cloud/logForwardLokiURL": "http://loki",
            "yawol.stackit.cloud/logForwardProxyURL": "http://proxy",
            "logging.yawol.stackit.cloud/team": "a",
            "yawol.stackit.cloud/serverGroupPolicy": "anti-affinity",
            "yawol.stackit.cloud/additionalNetworks": "extra1,extra2",
        }));
        let d = desired_spec(&svc, vec![], &defaults());
        // Every annotation is applied; the filter's 443 is no port of the Service, which is said, never silent.
        assert_eq!(
            d.warnings,
            [Warning {
                reason: "ProxyProtocolPortUnknown",
                message: "annotation yawol.stackit.cloud/tcpProxyProtocolPortsFilter names port(s) 443 that the \
                          Service does not have (the filter names the Service's ports, not node or target ports): \
                          they select nothing"
                    .into(),
            }],
        );
        let s = d.spec;
        let infra = &s.infrastructure;
        assert_eq!(infra.image.image_id.as_deref(), Some("img2"));
        assert_eq!(infra.flavor.flavor_id.as_deref(), Some("flv2"));
        assert_eq!(infra.default_network.network_id, "net2");
        assert_eq!(infra.default_network.subnet_id.as_deref(), Some("sub2"));
        assert_eq!(
            infra.default_network.floating_net_id.as_deref(),
            Some("fip2")
        );
        assert_eq!(infra.project_id.as_deref(), Some("proj"));
        assert_eq!(infra.availability_zone, "az2");
        let extra: Vec<_> = infra
            .additional_networks()
            .iter()
            .map(|n| n.network_id.as_str())
            .collect();
        assert_eq!(
            extra,
            ["extra1", "extra2", "net"],
            "controller default network appended"
        );
        assert_eq!(s.replicas, 3);
        assert_eq!(s.existing_floating_ip.as_deref(), Some("192.0.2.1"));
        assert!(s.debug_settings().enabled);
        assert_eq!(s.debug_settings().sshkey_name.as_deref(), Some("key"));
        let o = s.options();
        assert!(o.is_internal());
        assert_eq!(o.source_ranges(), ["10.0.0.0/8", "2001:db8::/32"]);
        assert!(o.tcp_proxy_protocol());
        assert_eq!(o.tcp_proxy_protocol_ports_filter, Some(vec![80, 443]));
        assert_eq!(o.tcp_idle_timeout.as_ref().unwrap().as_str(), "5m30s");
        assert_eq!(o.udp_idle_timeout.as_ref().unwrap().as_str(), "2m0s");
        let lf = o.log_forward.as_ref().unwrap();
        assert!(lf.enabled);
        assert_eq!(lf.loki_url, "http://loki");
        assert_eq!(lf.proxy_url.as_deref(), Some("http://proxy"));
        assert_eq!(lf.labels.as_ref().unwrap()["team"], "a");
        assert_eq!(o.server_group_policy(), Some("anti-affinity"));
    }

    /// The Service's PROXY protocol warnings (reason, message) with ports TCP 80 and 443, UDP 53, TCP and UDP 5353.
    fn proxy_warnings(annotations: Value) -> Vec<(&'static str, String)> {
        let mut svc = service(annotations);
        let ports = svc.spec.as_mut().unwrap().ports.as_mut().unwrap();
        for (port, protocol) in [(443, "TCP"), (53, "UDP"), (5353, "TCP"), (5353, "UDP")] {
            ports.push(
                serde_json::from_value(
                    json!({"port": port, "protocol": protocol, "nodePort": 30000 + port}),
                )
                .unwrap(),
            );
        }
        desired_spec(&svc, vec![], &defaults())
            .warnings
            .into_iter()
            .filter(|w| w.reason != reasons::ANNOTATION)
            .map(|w| (w.reason, w.message))
            .collect()
    }

    #[test]
    fn proxy_protocol_on_tcp_ports_is_served_without_warning() {
        for annotations in [
            json!({"yawol.stackit.cloud/tcpProxyProtocol": "true"}),
            json!({"yawol.stackit.cloud/tcpProxyProtocol": "true",
                   "yawol.stackit.cloud/tcpProxyProtocolPortsFilter": "80,443"}),
            // 5353 is also a TCP port: that one gets the header.
            json!({"yawol.stackit.cloud/tcpProxyProtocol": "true",
                   "yawol.stackit.cloud/tcpProxyProtocolPortsFilter": "5353"}),
            // The filter only matters with PROXY protocol on.
            json!({"yawol.stackit.cloud/tcpProxyProtocol": "false",
                   "yawol.stackit.cloud/tcpProxyProtocolPortsFilter": "53,8080"}),
            json!({"yawol.stackit.cloud/tcpProxyProtocolPortsFilter": "53,8080"}),
        ] {
            let warnings = proxy_warnings(annotations.clone());
            assert!(warnings.is_empty(), "{annotations}: {warnings:?}");
        }
    }

    #[test]
    fn active_active_is_carried_and_warns_below_two_replicas() {
        let desired = |a: Value| desired_spec(&service(a), vec![], &defaults());
        let d = desired(json!({}));
        assert_eq!(d.spec.options.unwrap().active_active, None);
        let d = desired(json!({"yawol.stackit.cloud/activeActive": "true",
                               "yawol.stackit.cloud/replicas": "3"}));
        assert!(d.warnings.is_empty(), "{:?}", d.warnings);
        assert_eq!(d.spec.options.unwrap().active_active, Some(true));
        let d = desired(json!({"yawol.stackit.cloud/activeActive": "true"}));
        assert_eq!(d.spec.options.unwrap().active_active, Some(true));
        assert_eq!(d.warnings.len(), 1, "{:?}", d.warnings);
        assert_eq!(
            d.warnings[0].reason,
            reasons::ACTIVE_ACTIVE_TOO_FEW_REPLICAS
        );
        assert!(
            d.warnings[0].message.contains("it is 1"),
            "{:?}",
            d.warnings
        );
        let d = desired(json!({"yawol.stackit.cloud/activeActive": "yes"}));
        assert_eq!(d.spec.options.unwrap().active_active, None);
        assert_eq!(d.warnings[0].reason, reasons::ANNOTATION);
    }

    #[test]
    fn proxy_protocol_filter_naming_a_udp_port_warns() {
        let warnings = proxy_warnings(json!({
            "yawol.stackit.cloud/tcpProxyProtocol": "true",
            "yawol.stackit.cloud/tcpProxyProtocolPortsFilter": "80,53,53",
        }));
        assert_eq!(
            warnings,
            [(
                reasons::PROXY_PROTOCOL_PORT_NOT_TCP,
                "annotation yawol.stackit.cloud/tcpProxyProtocolPortsFilter names port(s) 53 of the Service that \
                 are not TCP: PROXY protocol is TCP only, they are forwarded without a PROXY header"
                    .to_string()
            )]
        );
    }

    #[test]
    fn proxy_protocol_filter_naming_no_port_of_the_service_warns() {
        let warnings = proxy_warnings(json!({
            "yawol.stackit.cloud/tcpProxyProtocol": "true",
            "yawol.stackit.cloud/tcpProxyProtocolPortsFilter": "8080, 53, 443, 30080",
        }));
        let reasons: Vec<_> = warnings.iter().map(|(r, _)| *r).collect();
        assert_eq!(
            reasons,
            [
                reasons::PROXY_PROTOCOL_PORT_NOT_TCP,
                reasons::PROXY_PROTOCOL_PORT_UNKNOWN
            ]
        );
        assert!(warnings[0].1.contains("port(s) 53 "), "{warnings:?}");
        assert!(
            warnings[1].1.contains("port(s) 8080, 30080 that"),
            "a node port is no service port: {warnings:?}"
        );
    }

    #[test]
    fn skip_default_network() {
        let svc = service(json!({
            "yawol.stackit.cloud/defaultNetworkID": "net2",
            "yawol.stackit.cloud/skipCloudControllerDefaultNetworkID": "true",
        }));
        let s = desired_spec(&svc, vec![], &defaults()).spec;
        assert!(s.infrastructure.additional_networks.is_none());
        assert_eq!(
            s.infrastructure.default_network.subnet_id, None,
            "default subnet belongs to the default network"
        );
    }

    #[test]
    fn invalid_annotations_warn_and_fall_back() {
        let svc = service(json!({
            "yawol.stackit.cloud/replicas": "many",
            "yawol.stackit.cloud/internalLB": "yes",
            "yawol.stackit.cloud/tcpProxyProtocol": "true",
            "yawol.stackit.cloud/tcpProxyProtocolPortsFilter": "80,http",
            "yawol.stackit.cloud/tcpIdleTimeout": "10 minutes",
            "yawol.stackit.cloud/udpIdleTimeout": "-5s",
            "yawol.stackit.cloud/serverGroupPolicy": "spread",
            "yawol.stackit.cloud/loadBalancerSourceRanges": "10.0.0.0/8,not-a-cidr",
        }));
        let d = desired_spec(&svc, vec![], &defaults());
        let reasons: Vec<_> = d.warnings.iter().map(|w| w.reason).collect();
        assert_eq!(reasons, ["annotation"; 7], "{:#?}", d.warnings);
        let o = d.spec.options();
        assert_eq!(
            o.tcp_proxy_protocol_ports(d.spec.ports()),
            [80],
            "an invalid filter means all TCP ports"
        );
        assert_eq!(d.spec.replicas, 1);
        assert!(!o.is_internal());
        assert!(o.tcp_proxy_protocol());
        assert_eq!(o.tcp_proxy_protocol_ports_filter, None);
        assert!(o.tcp_idle_timeout.is_none() && o.udp_idle_timeout.is_none());
        assert_eq!(o.server_group_policy(), None);
        assert_eq!(o.source_ranges(), ["10.0.0.0/8"]);
    }

    #[test]
    fn spec_source_ranges_win_over_annotation() {
        let mut svc =
            service(json!({"yawol.stackit.cloud/loadBalancerSourceRanges": "10.0.0.0/8"}));
        svc.spec.as_mut().unwrap().load_balancer_source_ranges =
            Some(vec!["192.168.0.0/16".into()]);
        let s = desired_spec(&svc, vec![], &defaults()).spec;
        assert_eq!(s.options().source_ranges(), ["192.168.0.0/16"]);
    }

    #[test]
    fn class_filter() {
        let filter = ClassFilter::default();
        let mut svc = service(json!({}));
        assert!(filter.accepts(&svc));
        svc.spec.as_mut().unwrap().load_balancer_class = Some("other".into());
        assert!(!filter.accepts(&svc));
        svc.spec.as_mut().unwrap().load_balancer_class = Some("stackit.cloud/yawol".into());
        assert!(filter.accepts(&svc));
        // The deprecated annotation wins.
        svc.metadata.annotations =
            Some([(ann::CLASS_NAME.to_string(), "other".to_string())].into());
        assert!(!filter.accepts(&svc));
        let strict = ClassFilter {
            class_names: vec!["x".into()],
            accept_empty: false,
        };
        assert!(!strict.accepts(&service(json!({}))));
    }

    #[test]
    fn ports_get_the_schema_default_protocol() {
        let mut svc = service(json!({}));
        let ports = svc.spec.as_mut().unwrap().ports.as_mut().unwrap();
        ports[0].protocol = None;
        ports.push(
            serde_json::from_value(json!({"port": 53, "protocol": "UDP", "nodePort": 30053}))
                .unwrap(),
        );
        let spec = desired_spec(&svc, vec![], &defaults()).spec;
        let protocols: Vec<_> = spec.ports().iter().map(|p| p.protocol.as_deref()).collect();
        assert_eq!(protocols, [Some("TCP"), Some("UDP")]);
    }

    #[test]
    fn validation() {
        let mut svc = service(json!({}));
        assert!(validate_service(&svc).is_empty());
        let spec = svc.spec.as_mut().unwrap();
        spec.allocate_load_balancer_node_ports = Some(false);
        spec.ports.as_mut().unwrap().push(
            serde_json::from_value(json!({"port": 9, "protocol": "SCTP", "nodePort": 30009}))
                .unwrap(),
        );
        spec.ports
            .as_mut()
            .unwrap()
            .push(serde_json::from_value(json!({"port": 10, "protocol": "UDP"})).unwrap());
        assert_eq!(
            validate_service(&svc).len(),
            3,
            "{:?}",
            validate_service(&svc)
        );
    }

    #[test]
    fn immutable_fields_are_protected() {
        let defaults = defaults();
        let created = desired_spec(&service(json!({"yawol.stackit.cloud/projectID": "p1", "yawol.stackit.cloud/existingFloatingIP": "192.0.2.1"})), vec![], &defaults).spec;
        let mut svc = service(
            json!({"yawol.stackit.cloud/projectID": "p2", "yawol.stackit.cloud/existingFloatingIP": "192.0.2.2"}),
        );
        svc.status = Some(
            serde_json::from_value(json!({"loadBalancer": {"ingress": [{"ip": "192.0.2.1"}]}}))
                .unwrap(),
        );
        let wanted = desired_spec(&svc, vec![], &defaults).spec;
        let (kept, warnings) = protect_immutable(wanted, &created, &svc);
        assert_eq!(warnings.len(), 2);
        assert_eq!(kept.infrastructure.project_id.as_deref(), Some("p1"));
        assert_eq!(kept.existing_floating_ip.as_deref(), Some("192.0.2.1"));
    }

    #[test]
    fn merge_patch_diff_minimal() {
        let current = json!({"a": 1, "b": {"c": 2, "d": 3}, "e": [1, 2], "gone": true});
        let desired = json!({"a": 1, "b": {"c": 2, "d": 4}, "e": [1], "new": "x"});
        let patch = merge_patch_diff(&current, &desired).unwrap();
        assert_eq!(
            patch,
            json!({"b": {"d": 4}, "e": [1], "gone": null, "new": "x"})
        );
        let mut applied = current.clone();
        kube_testenv::json_merge(&mut applied, &patch);
        assert_eq!(applied, desired);
        assert_eq!(merge_patch_diff(&desired, &desired), None);
    }
}
