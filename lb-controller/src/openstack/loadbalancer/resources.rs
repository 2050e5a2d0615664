//! The OpenStack half of the LoadBalancer controller: security group and rules, floating IP, VIP port, association,
//! server group — and their deletion. Written against [`Cloud`], so it runs on the real cloud and on the fake.
//!
//! Every step finds its resource (status ID, then name/description) before creating one, so a reconcile that died
//! half-way is repeated without duplicates, and the status is saved after each step (through [`StatusSink`]) so an
//! ID the cloud handed out is never lost. The floating IP is the user-visible identity of a load balancer: an outage
//! or a 404 never makes this code forget it or allocate a different one (see [`ensure_floating_ip`]).

use crate::openstack::{
    Cloud, CloudError, CloudErrorKind, Direction, EtherType, FixedIpRequest, FloatingIp,
    FloatingIpFilter, Port, PortSpec, PortUpdate, RuleSpec, SecurityGroup,
};
use kube::ResourceExt;
use lb_api::constants::lb_annotations as annotations;
use lb_api::{LoadBalancer, LoadBalancerStatus};
use sha2::Digest;
use std::collections::BTreeSet;
use std::fmt;
use std::future::Future;

/// Name of every OpenStack resource of a load balancer (yawol: `<namespace>/<name>`), also the floating IP's
/// description and the rules' description.
pub fn resource_name(lb: &LoadBalancer) -> String {
    format!("{}/{}", lb.namespace().unwrap_or_default(), lb.name_any())
}

/// Suffix yawol gives a user-supplied floating IP that carries our description, so that deleting the load balancer
/// can never mistake it for ours.
pub const USER_MANAGED_SUFFIX: &str = " (user managed)";

/// A failed step, with the cloud's own message (the text of the Warning event).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepError {
    /// `security group`, `floating IP`, `port`, `floating IP association`, `server group`.
    pub step: &'static str,
    /// What the cloud said.
    pub error: CloudError,
}

impl fmt::Display for StepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "reconciling the {} failed: {} ({:?}): {}",
            self.step, self.error.operation, self.error.kind, self.error.message
        )
    }
}

impl std::error::Error for StepError {}

pub(crate) fn step(step: &'static str) -> impl Fn(CloudError) -> StepError {
    move |error| StepError { step, error }
}

/// Where the status goes after each step (the controller merge-patches the status subresource).
pub trait StatusSink: Send {
    /// Persists the status so far.
    fn save(
        &mut self,
        status: &LoadBalancerStatus,
    ) -> impl Future<Output = Result<(), CloudError>> + Send;
}

/// A sink that keeps nothing (tests and one-shot tools).
pub struct DiscardStatus;

impl StatusSink for DiscardStatus {
    async fn save(&mut self, _status: &LoadBalancerStatus) -> Result<(), CloudError> {
        Ok(())
    }
}

fn internal(lb: &LoadBalancer) -> bool {
    lb.spec
        .options
        .as_ref()
        .and_then(|o| o.internal_lb)
        .unwrap_or(false)
}

/// No floating IP: internal load balancers, and IPv6-only ones (floating IPs are IPv4; the VIP port's IPv6 address
/// is public as it is).
fn without_floating_ip(lb: &LoadBalancer) -> bool {
    internal(lb) || !lb.spec.wants_ipv4()
}

fn debug_enabled(lb: &LoadBalancer) -> bool {
    lb.spec.debug_settings.as_ref().is_some_and(|d| d.enabled)
}

fn server_group_policy(lb: &LoadBalancer) -> Option<String> {
    lb.spec
        .options
        .as_ref()
        .and_then(|o| o.server_group_policy.clone())
        .filter(|p| !p.is_empty())
}

fn annotation_true(lb: &LoadBalancer, key: &str) -> bool {
    lb.annotations().get(key).is_some_and(|v| v == "true")
}

/// The floating network: `defaultNetwork.floatingNetID`, else the deprecated top-level field.
pub fn floating_network(lb: &LoadBalancer) -> Option<String> {
    let infra = &lb.spec.infrastructure;
    infra
        .default_network
        .floating_net_id
        .clone()
        .or_else(|| infra.floating_net_id.clone())
        .filter(|s| !s.is_empty())
}

/// The security-group rules a load balancer needs, and warnings for source ranges that are not CIDRs.
///
/// Per IP version: egress to anywhere; VRRP (protocol 112) and the agents' state sync (TCP
/// [`lb_api::constants::sync::PORT`]) from members of the same group (the VIP and the flows move between replicas);
/// all ICMP (yawol restricts it to "type 1 code 8", which Neutron reads literally; path-MTU discovery
/// and ping need more). Per service port × source range (empty = anywhere, both families): TCP or UDP on the
/// *service* port (full NAT on the VM: clients talk to the service port, not the node port). SSH when debug is on,
/// unless a service already uses port 22.
pub fn desired_rules(lb: &LoadBalancer, security_group_id: &str) -> (Vec<RuleSpec>, Vec<String>) {
    let mut rules = BTreeSet::new();
    let mut warnings = Vec::new();
    let rule = |direction,
                ethertype,
                protocol: Option<&str>,
                port: Option<u16>,
                prefix: Option<String>,
                group: Option<&str>| RuleSpec {
        direction,
        ethertype,
        protocol: protocol.map(str::to_string),
        port_range_min: port,
        port_range_max: port,
        remote_ip_prefix: prefix,
        remote_group_id: group.map(str::to_string),
    };
    for et in [EtherType::V4, EtherType::V6] {
        rules.insert(rule(Direction::Egress, et, None, None, None, None));
        rules.insert(rule(
            Direction::Ingress,
            et,
            Some("vrrp"),
            None,
            None,
            Some(security_group_id),
        ));
        rules.insert(rule(
            Direction::Ingress,
            et,
            Some("tcp"),
            Some(lb_api::constants::sync::PORT),
            None,
            Some(security_group_id),
        ));
        let icmp = if et == EtherType::V4 {
            "icmp"
        } else {
            "ipv6-icmp"
        };
        rules.insert(rule(Direction::Ingress, et, Some(icmp), None, None, None));
    }
    let mut ranges: Vec<ipnet::IpNet> = Vec::new();
    for raw in lb
        .spec
        .options
        .as_ref()
        .and_then(|o| o.load_balancer_source_ranges.clone())
        .unwrap_or_default()
    {
        match raw.trim().parse::<ipnet::IpNet>() {
            // Neutron stores the network address; comparing normalised prefixes keeps the diff stable.
            Ok(net) => ranges.push(net.trunc()),
            Err(_) => warnings.push(format!(
                "loadBalancerSourceRanges: {raw:?} is not a CIDR; ignored"
            )),
        }
    }
    if ranges.is_empty() {
        ranges = vec![
            "0.0.0.0/0".parse().expect("literal"),
            "::/0".parse().expect("literal"),
        ];
    }
    let ports = lb.spec.ports.clone().unwrap_or_default();
    for p in &ports {
        let proto = match lb_api::port_protocol(p) {
            "TCP" => "tcp",
            "UDP" => "udp",
            other => {
                warnings.push(format!(
                    "port {}: protocol {other} is not supported; no rule",
                    p.port
                ));
                continue;
            }
        };
        let Ok(port) = u16::try_from(p.port) else {
            continue;
        };
        for net in &ranges {
            let et = if net.addr().is_ipv4() {
                EtherType::V4
            } else {
                EtherType::V6
            };
            rules.insert(rule(
                Direction::Ingress,
                et,
                Some(proto),
                Some(port),
                Some(net.to_string()),
                None,
            ));
        }
    }
    if debug_enabled(lb) && !ports.iter().any(|p| p.port == 22) {
        rules.insert(rule(
            Direction::Ingress,
            EtherType::V4,
            Some("tcp"),
            Some(22),
            Some("0.0.0.0/0".into()),
            None,
        ));
        rules.insert(rule(
            Direction::Ingress,
            EtherType::V6,
            Some("tcp"),
            Some(22),
            Some("::/0".into()),
            None,
        ));
    }
    (rules.into_iter().collect(), warnings)
}

/// A rule as Neutron may report it, normalised for comparison: protocol numbers to names, "anywhere" prefixes to
/// none (Neutron treats `0.0.0.0/0` and no prefix alike).
fn normalise(rule: &RuleSpec) -> RuleSpec {
    let mut r = rule.clone();
    r.protocol = r.protocol.map(|p| match p.as_str() {
        "112" => "vrrp".into(),
        "6" => "tcp".into(),
        "17" => "udp".into(),
        "1" => "icmp".into(),
        "58" | "icmpv6" => "ipv6-icmp".into(),
        _ => p,
    });
    if matches!(
        r.remote_ip_prefix.as_deref(),
        Some("0.0.0.0/0") | Some("::/0")
    ) {
        r.remote_ip_prefix = None;
    }
    r
}

/// Which existing rules to delete (their IDs) and which desired rules to create.
pub fn rule_diff(group: &SecurityGroup, desired: &[RuleSpec]) -> (Vec<String>, Vec<RuleSpec>) {
    let want: BTreeSet<RuleSpec> = desired.iter().map(normalise).collect();
    let have: BTreeSet<RuleSpec> = group.rules.iter().map(|r| normalise(&r.spec)).collect();
    let delete = group
        .rules
        .iter()
        .filter(|r| !want.contains(&normalise(&r.spec)))
        .map(|r| r.id.clone())
        .collect();
    let create = desired
        .iter()
        .filter(|r| !have.contains(&normalise(r)))
        .cloned()
        .collect();
    (delete, create)
}

/// Hash of everything the OpenStack reconcile depends on besides IDs: a change triggers a reconcile before the
/// periodic resync.
pub fn openstack_hash(lb: &LoadBalancer) -> String {
    let opts = lb.spec.options.clone().unwrap_or_default();
    let mut input = serde_json::json!({
        "ports": lb.spec.ports,
        "sourceRanges": opts.load_balancer_source_ranges,
        "debug": lb.spec.debug_settings,
        "serverGroupPolicy": opts.server_group_policy,
        "internal": opts.internal_lb,
        "existingFloatingIP": lb.spec.existing_floating_ip,
        "adHocDebug": lb.annotations().get(annotations::AD_HOC_DEBUG),
        "network": lb.spec.infrastructure.default_network,
    });
    // Only when set: the hash of every IPv4 LoadBalancer stays what it was (no reconcile of all of them on upgrade).
    if let Some(families) = &lb.spec.ip_families {
        input["ipFamilies"] = serde_json::json!(families);
    }
    let digest = sha2::Sha256::digest(input.to_string().as_bytes());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Whether the OpenStack part must run now: never ran, stale (older than `resync`), hash changed, or the floating IP
/// state does not match internal/external.
pub fn needs_openstack_reconcile(
    lb: &LoadBalancer,
    now: jiff::Timestamp,
    resync: std::time::Duration,
) -> bool {
    let status = lb.status.clone().unwrap_or_default();
    let Some(last) = status.last_openstack_reconcile.as_ref() else {
        return true;
    };
    let age = now.duration_since(last.0);
    if age.as_secs_f64() > resync.as_secs_f64() {
        return true;
    }
    if status.openstack_reconcile_hash.as_deref() != Some(openstack_hash(lb).as_str()) {
        return true;
    }
    if without_floating_ip(lb) == status.floating_id.is_some() {
        return true;
    }
    if lb.spec.wants_ipv6() != status.port_ipv6.is_some() {
        return true;
    }
    status.external_ip.is_none()
}

/// Runs every step in order, saving the status after each. Stops at the first failing step; the status keeps
/// whatever was recorded before (IDs are never dropped on an error).
pub async fn reconcile<C: Cloud, S: StatusSink>(
    cloud: &C,
    lb: &LoadBalancer,
    status: &mut LoadBalancerStatus,
    sink: &mut S,
    warnings: &mut Vec<String>,
) -> Result<(), StepError> {
    let name = resource_name(lb);

    let sg = ensure_security_group(cloud, lb, &name, warnings)
        .await
        .map_err(step("security group"))?;
    status.security_group_id = Some(sg.id.clone());
    status.security_group_name = Some(name.clone());
    sink.save(status).await.map_err(step("status"))?;

    let fip = ensure_floating_ip(cloud, lb, &name, status)
        .await
        .map_err(step("floating IP"))?;
    match &fip {
        Some(f) => {
            status.floating_id = Some(f.id.clone());
            status.floating_name = Some(name.clone());
            status.external_ip = Some(f.address.clone());
        }
        None => {
            status.floating_id = None;
            status.floating_name = None;
        }
    }
    sink.save(status).await.map_err(step("status"))?;

    let port = ensure_vip_port(cloud, lb, &name, &sg.id, status)
        .await
        .map_err(step("port"))?;
    status.port_id = Some(port.id.clone());
    status.port_name = Some(name.clone());
    status.port_ip = port.primary_ip().map(str::to_string);
    let port = if lb.spec.wants_ipv6() {
        let (port, ipv6) = ensure_vip_ipv6(cloud, lb, port)
            .await
            .map_err(step("port's IPv6 address"))?;
        status.port_ipv6 = Some(ipv6);
        port
    } else {
        // An IPv6 address the port keeps from before is no longer served: not published, not a VIP.
        status.port_ipv6 = None;
        port
    };
    if !lb.spec.wants_ipv4() {
        status.external_ip = status.port_ipv6.clone();
    } else if internal(lb) {
        status.external_ip = status.port_ip.clone();
    }
    sink.save(status).await.map_err(step("status"))?;

    if let Some(f) = &fip {
        if f.port_id.as_deref() != Some(port.id.as_str()) {
            cloud
                .set_floating_ip_port(&f.id, Some(&port.id))
                .await
                .map_err(step("floating IP association"))?;
        }
    }

    match ensure_server_group(cloud, lb, &name)
        .await
        .map_err(step("server group"))?
    {
        Some(g) => {
            status.server_group_id = Some(g.id);
            status.server_group_name = Some(name.clone());
        }
        None => {
            status.server_group_id = None;
            status.server_group_name = None;
        }
    }
    status.openstack_reconcile_hash = Some(openstack_hash(lb));
    status.last_openstack_reconcile = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        jiff::Timestamp::now(),
    ));
    sink.save(status).await.map_err(step("status"))?;
    Ok(())
}

/// Finds (or creates) the group named `name` — deleting duplicates — and makes its rules exactly the desired ones:
/// unwanted rules first (a narrowed source range takes effect before anything is opened), then missing ones.
pub async fn ensure_security_group<C: Cloud>(
    cloud: &C,
    lb: &LoadBalancer,
    name: &str,
    warnings: &mut Vec<String>,
) -> Result<SecurityGroup, CloudError> {
    let mut groups = cloud.find_security_groups(name).await?;
    groups.sort_by(|a, b| a.id.cmp(&b.id));
    let recorded = lb.status.as_ref().and_then(|s| s.security_group_id.clone());
    // Prefer the recorded group; any other group of that name is a duplicate from an interrupted create.
    let pos = recorded
        .and_then(|id| groups.iter().position(|g| g.id == id))
        .unwrap_or(0);
    let group = if groups.is_empty() {
        cloud.create_security_group(name).await?
    } else {
        let g = groups.remove(pos);
        for dup in groups {
            if let Err(e) = cloud.delete_security_group(&dup.id).await {
                warnings.push(format!(
                    "deleting duplicate security group {}: {}",
                    dup.id, e.message
                ));
            }
        }
        g
    };
    let (desired, w) = desired_rules(lb, &group.id);
    warnings.extend(w);
    let (delete, create) = rule_diff(&group, &desired);
    for id in delete {
        cloud.delete_security_group_rule(&id).await?;
    }
    for rule in create {
        match cloud
            .create_security_group_rule(&group.id, &rule, name)
            .await
        {
            // Already there (we raced ourselves, or Neutron normalised differently): nothing to do.
            Err(e) if e.kind == CloudErrorKind::Conflict && e.message.contains("Exists") => {}
            other => {
                other?;
            }
        }
    }
    Ok(group)
}

/// The floating IP, by precedence: none for internal LBs (ours is released, a user's is only disassociated);
/// `existingFloatingIP` by address (renamed if it carries our description); the one recorded in the status; one with
/// our description; a new one.
///
/// When the recorded ID answers 404 the address in the status is looked up instead (Neutron may have been restored,
/// or the ID was wrong); if that is gone too this is an error, not a new allocation: a different address would
/// silently break every DNS record and allow-list pointing at the old one. An outage is always an error that leaves
/// the status untouched.
pub async fn ensure_floating_ip<C: Cloud>(
    cloud: &C,
    lb: &LoadBalancer,
    name: &str,
    status: &LoadBalancerStatus,
) -> Result<Option<FloatingIp>, CloudError> {
    let existing = lb
        .spec
        .existing_floating_ip
        .clone()
        .filter(|s| !s.is_empty());
    if without_floating_ip(lb) {
        if let Some(id) = &status.floating_id {
            if existing.is_some() || annotation_true(lb, annotations::KEEP_FLOATING_IP) {
                match cloud.set_floating_ip_port(id, None).await {
                    Err(e) if !e.is_not_found() => return Err(e),
                    _ => {}
                }
            } else {
                cloud.delete_floating_ip(id).await?;
            }
        }
        return Ok(None);
    }
    if let Some(address) = existing {
        let found = cloud
            .find_floating_ips(&FloatingIpFilter {
                address: Some(address.clone()),
                description: None,
            })
            .await?;
        let Some(fip) = found.into_iter().next() else {
            return Err(CloudError::new(
                CloudErrorKind::BadRequest,
                "looking up existingFloatingIP",
                format!("no floating IP {address} in the project"),
            ));
        };
        if fip.description == name {
            return cloud
                .set_floating_ip_description(&fip.id, &format!("{name}{USER_MANAGED_SUFFIX}"))
                .await
                .map(Some);
        }
        return Ok(Some(fip));
    }
    if let Some(id) = &status.floating_id {
        match cloud.get_floating_ip(id).await {
            Ok(f) => return Ok(Some(f)),
            Err(e) if e.is_not_found() => {
                if let Some(address) = &status.external_ip {
                    let found = cloud
                        .find_floating_ips(&FloatingIpFilter {
                            address: Some(address.clone()),
                            description: None,
                        })
                        .await?;
                    if let Some(f) = found.into_iter().next() {
                        return Ok(Some(f));
                    }
                }
                return Err(CloudError::new(
                    CloudErrorKind::NotFound,
                    "reading the floating IP recorded in status",
                    format!(
                        "floating IP {id} ({}) no longer exists; not allocating a different address. Clear \
                         status.floatingID and status.externalIP to accept a new one",
                        status.external_ip.as_deref().unwrap_or("?")
                    ),
                ));
            }
            Err(e) => return Err(e),
        }
    }
    let mut ours = cloud
        .find_floating_ips(&FloatingIpFilter {
            address: None,
            description: Some(name.to_string()),
        })
        .await?;
    ours.sort_by(|a, b| a.id.cmp(&b.id));
    if let Some(f) = ours.into_iter().next() {
        return Ok(Some(f));
    }
    let Some(network) = floating_network(lb) else {
        return Err(CloudError::new(
            CloudErrorKind::BadRequest,
            "creating floating IP",
            "spec.infrastructure.defaultNetwork.floatingNetID is not set",
        ));
    };
    cloud.create_floating_ip(&network, name).await.map(Some)
}

/// The VIP port: recorded ID, else by name, else new (on the default network, optional subnet); its security
/// groups are forced to exactly ours. A recorded port that is gone (404) is recreated: its address is internal, the
/// floating IP follows it.
pub async fn ensure_vip_port<C: Cloud>(
    cloud: &C,
    lb: &LoadBalancer,
    name: &str,
    security_group_id: &str,
    status: &LoadBalancerStatus,
) -> Result<Port, CloudError> {
    let mut port = None;
    if let Some(id) = &status.port_id {
        match cloud.get_port(id).await {
            Ok(p) => port = Some(p),
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e),
        }
    }
    if port.is_none() {
        let mut found = cloud.find_ports(name).await?;
        found.sort_by(|a, b| a.id.cmp(&b.id));
        port = found.into_iter().next();
    }
    let port = match port {
        Some(p) => p,
        None => {
            let net = &lb.spec.infrastructure.default_network;
            cloud
                .create_port(&PortSpec {
                    name: name.to_string(),
                    network_id: net.network_id.clone(),
                    subnet_id: net.subnet_id.clone().filter(|s| !s.is_empty()),
                    security_groups: vec![security_group_id.to_string()],
                    allowed_address_pairs: vec![],
                })
                .await?
        }
    };
    if port.security_groups != [security_group_id] {
        let update = PortUpdate {
            security_groups: Some(vec![security_group_id.to_string()]),
            ..Default::default()
        };
        return cloud.update_port(&port.id, &update).await;
    }
    Ok(port)
}

/// The IPv6 subnet of the VIP: `defaultNetwork.subnetIDv6`, else the network's only IPv6 subnet (none or several
/// are an error that says what to set).
pub async fn ipv6_subnet<C: Cloud>(
    cloud: &C,
    lb: &LoadBalancer,
    network_id: &str,
) -> Result<String, CloudError> {
    let net = &lb.spec.infrastructure.default_network;
    if let Some(id) = net.subnet_id_v6.as_ref().filter(|s| !s.is_empty()) {
        return Ok(id.clone());
    }
    let mut subnets = cloud.find_subnets(network_id, 6).await?;
    subnets.sort_by(|a, b| a.id.cmp(&b.id));
    match subnets.as_slice() {
        [only] => Ok(only.id.clone()),
        [] => Err(CloudError::new(
            CloudErrorKind::BadRequest,
            "choosing the IPv6 subnet of the VIP",
            format!(
                "network {network_id} has no IPv6 subnet, and spec.ipFamilies asks for IPv6: add one, or serve \
                 IPv4 only"
            ),
        )),
        several => Err(CloudError::new(
            CloudErrorKind::BadRequest,
            "choosing the IPv6 subnet of the VIP",
            format!(
                "network {network_id} has {} IPv6 subnets ({}): set spec.infrastructure.defaultNetwork.subnetIDv6 \
                 (the controller's SUBNET_ID_V6) to the one for the VIP",
                several.len(),
                several
                    .iter()
                    .map(|s| format!("{} {}", s.id, s.cidr))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

/// The VIP port with an IPv6 fixed IP from [`ipv6_subnet`] (added to its fixed IPs when missing, the existing ones
/// kept), and that address: the IPv6 VIP and the load balancer's public IPv6 address.
pub async fn ensure_vip_ipv6<C: Cloud>(
    cloud: &C,
    lb: &LoadBalancer,
    port: Port,
) -> Result<(Port, String), CloudError> {
    let subnet = ipv6_subnet(cloud, lb, &port.network_id).await?;
    if let Some(ip) = port.ip_on_subnet(&subnet) {
        let ip = ip.to_string();
        return Ok((port, ip));
    }
    let mut fixed: Vec<FixedIpRequest> = port
        .fixed_ips
        .iter()
        .map(|f| FixedIpRequest {
            subnet_id: f.subnet_id.clone(),
            ip_address: Some(f.ip_address.clone()),
        })
        .collect();
    fixed.push(FixedIpRequest {
        subnet_id: subnet.clone(),
        ip_address: None,
    });
    let update = PortUpdate {
        fixed_ips: Some(fixed),
        ..Default::default()
    };
    let port = cloud.update_port(&port.id, &update).await?;
    match port.ip_on_subnet(&subnet) {
        Some(ip) => {
            let ip = ip.to_string();
            Ok((port, ip))
        }
        None => Err(CloudError::new(
            CloudErrorKind::Other,
            "adding an IPv6 fixed IP to the VIP port",
            format!(
                "port {} has no address on subnet {subnet} after the update",
                port.id
            ),
        )),
    }
}

/// The server group with the requested policy (recreated when the policy differs: Nova cannot change it); without
/// a policy, groups of that name are deleted.
pub async fn ensure_server_group<C: Cloud>(
    cloud: &C,
    lb: &LoadBalancer,
    name: &str,
) -> Result<Option<crate::openstack::ServerGroup>, CloudError> {
    let groups = cloud.find_server_groups(name).await?;
    let Some(policy) = server_group_policy(lb) else {
        for g in groups {
            cloud.delete_server_group(&g.id).await?;
        }
        return Ok(None);
    };
    let mut keep = None;
    for g in groups {
        if keep.is_none() && g.policy == policy {
            keep = Some(g);
        } else {
            cloud.delete_server_group(&g.id).await?;
        }
    }
    match keep {
        Some(g) => Ok(Some(g)),
        None => cloud.create_server_group(name, &policy).await.map(Some),
    }
}

/// Deletes the load balancer's OpenStack resources (machines must be gone first: their ports use the group):
/// an active-active VIP's routes ([`super::routes::remove_routes`]), server groups, floating IP (unless `keepFloatingIP` or it is an `existingFloatingIP`), VIP port (unless
/// `keepPort`), security group (unless `keepSecurityGroup`). Finds resources by status ID and by name, so orphans of
/// interrupted creates go too. Idempotent.
pub async fn delete<C: Cloud>(cloud: &C, lb: &LoadBalancer) -> Result<(), StepError> {
    let name = resource_name(lb);
    let status = lb.status.clone().unwrap_or_default();
    // First, while the VIP port still names the address: a route to a VIP that is gone would be left pointing at
    // machines that are gone too.
    super::routes::remove_routes(cloud, lb)
        .await
        .map_err(step("router routes"))?;
    for g in cloud
        .find_server_groups(&name)
        .await
        .map_err(step("server group"))?
    {
        cloud
            .delete_server_group(&g.id)
            .await
            .map_err(step("server group"))?;
    }
    let user_fip = lb
        .spec
        .existing_floating_ip
        .as_ref()
        .is_some_and(|s| !s.is_empty());
    if !user_fip && !annotation_true(lb, annotations::KEEP_FLOATING_IP) {
        let mut ids: BTreeSet<String> = status.floating_id.iter().cloned().collect();
        let ours = cloud
            .find_floating_ips(&FloatingIpFilter {
                address: None,
                description: Some(name.clone()),
            })
            .await
            .map_err(step("floating IP"))?;
        ids.extend(ours.into_iter().map(|f| f.id));
        for id in ids {
            cloud
                .delete_floating_ip(&id)
                .await
                .map_err(step("floating IP"))?;
        }
    }
    if !annotation_true(lb, annotations::KEEP_PORT) {
        let mut ids: BTreeSet<String> = status.port_id.iter().cloned().collect();
        ids.extend(
            cloud
                .find_ports(&name)
                .await
                .map_err(step("port"))?
                .into_iter()
                .map(|p| p.id),
        );
        for id in ids {
            cloud.delete_port(&id).await.map_err(step("port"))?;
        }
    } else if !annotation_true(lb, annotations::KEEP_SECURITY_GROUP) {
        // A kept port must not keep a reference to a group that is about to go (Neutron refuses with 409).
        for p in cloud.find_ports(&name).await.map_err(step("port"))? {
            let update = PortUpdate {
                security_groups: Some(vec![]),
                ..Default::default()
            };
            cloud
                .update_port(&p.id, &update)
                .await
                .map_err(step("port"))?;
        }
    }
    if !annotation_true(lb, annotations::KEEP_SECURITY_GROUP) {
        let mut ids: BTreeSet<String> = status.security_group_id.iter().cloned().collect();
        ids.extend(
            cloud
                .find_security_groups(&name)
                .await
                .map_err(step("security group"))?
                .into_iter()
                .map(|g| g.id),
        );
        for id in ids {
            cloud
                .delete_security_group(&id)
                .await
                .map_err(step("security group"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
