//! `LoadBalancer` (`lb`): one per Service; the complete description of what the data plane and
//! the OpenStack controllers must do.
//!
//! Field names, optionality and omission rules mirror yawol's Go types: a Go field tagged
//! `omitempty` (or a pointer, slice or map) is an `Option` here and is omitted when `None`, a
//! Go field without `omitempty` is a plain value that is always written. This makes every object
//! written by yawol deserialize and serialize back unchanged.

// The `printcolumn(...)` arguments of the CustomResource derive repeat `type_ = "string"`,
// which clippy mistakes for duplicated attributes.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Duration;

use k8s_openapi::api::core::v1::{SecretReference, ServicePort};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::constants::defaults;
use crate::duration::{DurationError, GoDuration};

pub(crate) fn default_replicas() -> i32 {
    defaults::REPLICAS
}

/// Desired state of a LoadBalancer.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "yawol.stackit.cloud",
    version = "v1beta1",
    kind = "LoadBalancer",
    namespaced,
    shortname = "lb",
    status = "LoadBalancerStatus",
    derive = "PartialEq",
    doc = "LoadBalancer is the Schema for the YAWOL LoadBalancer API",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas"
    ),
    printcolumn(name = "DESIRED", type_ = "string", json_path = ".spec.replicas"),
    printcolumn(name = "CURRENT", type_ = "string", json_path = ".status.replicas"),
    printcolumn(name = "READY", type_ = "string", json_path = ".status.readyReplicas"),
    printcolumn(
        name = "externalIP",
        type_ = "string",
        json_path = ".status.externalIP"
    ),
    printcolumn(
        name = "AGE",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerSpec {
    /// This label selector matches the load balancer sets deriving from the load balancer.
    #[schemars(transform = crate::schema::atomic_label_selector)]
    pub selector: LabelSelector,
    /// Replicas defines the number of load-balancer machines that should run.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0))]
    pub replicas: i32,
    /// ExistingFloatingIP uses an existing floating IP (by address) as FIP; it is never deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "existingFloatingIP")]
    pub existing_floating_ip: Option<String>,
    /// Debug settings for the load balancer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub debug_settings: Option<LoadBalancerDebugSettings>,
    /// Endpoints (one per node) traffic is balanced to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<Vec<LoadBalancerEndpoint>>,
    /// Ports of the load balancer (copy of the Service's ports); `protocol` defaults to TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = crate::schema::service_ports_protocol_default)]
    pub ports: Option<Vec<ServicePort>>,
    /// Infrastructure (OpenStack placement) parameters.
    pub infrastructure: LoadBalancerInfrastructure,
    /// Options for additional load-balancer settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<LoadBalancerOptions>,
    /// IP families the load balancer serves (`IPv4`, `IPv6`; a copy of the Service's `ipFamilies`, the
    /// primary first). Absent or empty: IPv4 only, as in yawol, which does not know the field. With `IPv6` the
    /// VIP port also gets an IPv6 fixed IP, published in `status.portIPv6`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("items" = {"type": "string", "enum": ["IPv4", "IPv6"]}))]
    pub ip_families: Option<Vec<String>>,
}

static EMPTY_OPTIONS: LazyLock<LoadBalancerOptions> = LazyLock::new(LoadBalancerOptions::default);
static EMPTY_DEBUG: LazyLock<LoadBalancerDebugSettings> =
    LazyLock::new(LoadBalancerDebugSettings::default);

impl LoadBalancerSpec {
    /// The options, or all-default options when the object has none.
    pub fn options(&self) -> &LoadBalancerOptions {
        self.options.as_ref().unwrap_or(&EMPTY_OPTIONS)
    }

    /// The debug settings, or disabled debugging when the object has none.
    pub fn debug_settings(&self) -> &LoadBalancerDebugSettings {
        self.debug_settings.as_ref().unwrap_or(&EMPTY_DEBUG)
    }

    /// The endpoints (empty when unset).
    pub fn endpoints(&self) -> &[LoadBalancerEndpoint] {
        self.endpoints.as_deref().unwrap_or_default()
    }

    /// The ports (empty when unset).
    pub fn ports(&self) -> &[ServicePort] {
        self.ports.as_deref().unwrap_or_default()
    }

    /// Whether IPv4 is served: `ipFamilies` absent or empty (yawol's objects) or naming `IPv4`.
    pub fn wants_ipv4(&self) -> bool {
        match self.ip_families.as_deref() {
            None | Some([]) => true,
            Some(families) => families.iter().any(|f| f == IP_FAMILY_V4),
        }
    }

    /// Whether IPv6 is served (`ipFamilies` names `IPv6`).
    pub fn wants_ipv6(&self) -> bool {
        self.ip_families
            .as_deref()
            .is_some_and(|families| families.iter().any(|f| f == IP_FAMILY_V6))
    }
}

/// `ipFamilies` value of IPv4 (the Service's spelling).
pub const IP_FAMILY_V4: &str = "IPv4";
/// `ipFamilies` value of IPv6 (the Service's spelling).
pub const IP_FAMILY_V6: &str = "IPv6";

/// The protocol of a load-balancer port: its `protocol`, TCP when absent (the schema default,
/// like for a Service's ports).
pub fn port_protocol(port: &ServicePort) -> &str {
    port.protocol.as_deref().unwrap_or(defaults::PORT_PROTOCOL)
}

/// Additional load-balancer settings.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerOptions {
    /// InternalLB: no floating IP; the external IP is the VIP's fixed IP. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "internalLB")]
    #[schemars(extend("default" = false))]
    pub internal_lb: Option<bool>,
    /// Allow-list of source CIDRs (copy of the Service's). Empty: everything is allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balancer_source_ranges: Option<Vec<String>>,
    /// Send a HAProxy PROXY protocol v2 header upstream on TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_proxy_protocol: Option<bool>,
    /// Service ports that get the PROXY header; empty: all TCP ports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "tcpProxyProtocolPortFilter")]
    pub tcp_proxy_protocol_ports_filter: Option<Vec<i32>>,
    /// TCP idle timeout (Go duration); "0s" disables it. Default 1h.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_idle_timeout: Option<GoDuration>,
    /// UDP idle timeout (Go duration); "0s" disables it. Default 1m.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp_idle_timeout: Option<GoDuration>,
    /// Log forwarding to a Loki instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_forward: Option<LoadBalancerLogForward>,
    /// Nova server group policy; empty: no server group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["", "affinity", "anti-affinity", "soft-affinity", "soft-anti-affinity"]))]
    pub server_group_policy: Option<String>,
    /// Active-active (not in yawol): every machine serves the VIP at once, the VIP network's router spreads it
    /// over them by ECMP (its extra routes, one next hop per eligible machine, kept by the controller), each
    /// machine translates to its own port address. Default false: one VRRP master at a time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_active: Option<bool>,
}

impl LoadBalancerOptions {
    /// Whether the machines run active-active behind the router instead of a VRRP pair.
    pub fn is_active_active(&self) -> bool {
        self.active_active.unwrap_or(false)
    }

    /// Whether this is an internal load balancer (no floating IP).
    pub fn is_internal(&self) -> bool {
        self.internal_lb.unwrap_or(false)
    }

    /// Whether the PROXY protocol header is sent on TCP.
    pub fn tcp_proxy_protocol(&self) -> bool {
        self.tcp_proxy_protocol.unwrap_or(false)
    }

    /// Whether the PROXY header is sent for the given *service* port (not node port).
    pub fn tcp_proxy_protocol_for_port(&self, service_port: i32) -> bool {
        self.tcp_proxy_protocol()
            && match self.tcp_proxy_protocol_ports_filter.as_deref() {
                None | Some([]) => true,
                Some(ports) => ports.contains(&service_port),
            }
    }

    /// The TCP service ports among `ports` that ask for a PROXY header, in their order.
    pub fn tcp_proxy_protocol_ports(&self, ports: &[ServicePort]) -> Vec<i32> {
        ports
            .iter()
            .filter(|p| port_protocol(p) == "TCP" && self.tcp_proxy_protocol_for_port(p.port))
            .map(|p| p.port)
            .collect()
    }

    /// The source ranges (empty: allow all).
    pub fn source_ranges(&self) -> &[String] {
        self.load_balancer_source_ranges
            .as_deref()
            .unwrap_or_default()
    }

    /// Effective TCP idle timeout; `Duration::ZERO` means "no timeout".
    pub fn tcp_idle_timeout(&self) -> Result<Duration, DurationError> {
        self.tcp_idle_timeout
            .as_ref()
            .map_or(Ok(defaults::TCP_IDLE_TIMEOUT), GoDuration::to_std)
    }

    /// Effective UDP idle timeout; `Duration::ZERO` means "no timeout".
    pub fn udp_idle_timeout(&self) -> Result<Duration, DurationError> {
        self.udp_idle_timeout
            .as_ref()
            .map_or(Ok(defaults::UDP_IDLE_TIMEOUT), GoDuration::to_std)
    }

    /// The server group policy, `None` when unset or empty.
    pub fn server_group_policy(&self) -> Option<&str> {
        self.server_group_policy
            .as_deref()
            .filter(|p| !p.is_empty())
    }
}

/// Log forwarding to a Loki instance.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerLogForward {
    /// Whether log forwarding is enabled.
    #[serde(default)]
    pub enabled: bool,
    /// Loki push URL (e.g. `http://example.com:3100/loki/api/v1/push`).
    #[serde(default)]
    pub loki_url: String,
    /// HTTP proxy used for the Loki push.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_url: Option<String>,
    /// Extra Loki labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

/// Debug settings of a load balancer.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerDebugSettings {
    /// Whether debugging (sshd, TCP/22 in the security group) is enabled.
    #[serde(default)]
    pub enabled: bool,
    /// Nova keypair name for debugging.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "sshkeyName")]
    pub sshkey_name: Option<String>,
}

/// A backend of the load balancer (a node).
#[derive(
    Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, JsonSchema,
)]
pub struct LoadBalancerEndpoint {
    /// Name of the endpoint (node name).
    pub name: String,
    /// Addresses of the endpoint (IPv4 and/or IPv6; the agent also accepts DNS names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addresses: Option<Vec<String>>,
    /// The node is going away but still serves (an extension of yawol's schema): it takes no new connections,
    /// and its established ones stay until they close, whatever its health checks say. A backend that fails
    /// its checks or leaves the list without draining has its connections ended (TCP clients get a reset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draining: Option<bool>,
}

impl LoadBalancerEndpoint {
    /// The addresses (empty when unset).
    pub fn addresses(&self) -> &[String] {
        self.addresses.as_deref().unwrap_or_default()
    }

    /// Whether the node is draining (see [`Self::draining`]).
    pub fn is_draining(&self) -> bool {
        self.draining.unwrap_or(false)
    }
}

/// OpenStack placement of a load balancer (also embedded in machine specs).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerInfrastructure {
    /// Deprecated: use `defaultNetwork.floatingNetID`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "floatingNetID")]
    pub floating_net_id: Option<String>,
    /// Deprecated: use `defaultNetwork.networkID`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "networkID")]
    pub network_id: Option<String>,
    /// Default (listener) network of the load balancer.
    #[serde(default)]
    pub default_network: LoadBalancerDefaultNetwork,
    /// Additional networks attached to the machines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub additional_networks: Option<Vec<LoadBalancerAdditionalNetwork>>,
    /// OpenStack flavor of the machines.
    pub flavor: OpenstackFlavorRef,
    /// OpenStack image of the machines.
    pub image: OpenstackImageRef,
    /// OpenStack availability zone.
    #[serde(default)]
    pub availability_zone: String,
    /// Secret holding `cloudprovider.conf`.
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub auth_secret_ref: SecretReference,
    /// OpenStack project overriding the secret's project (immutable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "projectID")]
    pub project_id: Option<String>,
}

impl LoadBalancerInfrastructure {
    /// The listener network ID, falling back to the deprecated top-level field.
    pub fn effective_network_id(&self) -> Option<&str> {
        Some(self.default_network.network_id.as_str())
            .filter(|id| !id.is_empty())
            .or(self.network_id.as_deref().filter(|id| !id.is_empty()))
    }

    /// The floating network ID, falling back to the deprecated top-level field.
    pub fn effective_floating_net_id(&self) -> Option<&str> {
        self.default_network
            .floating_net_id
            .as_deref()
            .or(self.floating_net_id.as_deref())
            .filter(|id| !id.is_empty())
    }

    /// The additional networks (empty when unset).
    pub fn additional_networks(&self) -> &[LoadBalancerAdditionalNetwork] {
        self.additional_networks.as_deref().unwrap_or_default()
    }

    /// Moves the deprecated top-level network fields into `defaultNetwork` (yawol's migration).
    /// Returns whether anything changed.
    pub fn migrate_deprecated(&mut self) -> bool {
        let mut changed = false;
        if let Some(id) = self.network_id.take() {
            if self.default_network.network_id.is_empty() {
                self.default_network.network_id = id;
            }
            changed = true;
        }
        if let Some(id) = self.floating_net_id.take() {
            if self.default_network.floating_net_id.is_none() {
                self.default_network.floating_net_id = Some(id);
            }
            changed = true;
        }
        changed |= self.flavor.migrate_deprecated();
        changed |= self.image.migrate_deprecated();
        changed
    }
}

/// An additional network attached to the machines.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct LoadBalancerAdditionalNetwork {
    /// OpenStack network ID.
    #[serde(rename = "networkID")]
    pub network_id: String,
}

/// The default/listener network of the load balancer.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct LoadBalancerDefaultNetwork {
    /// Floating IP pool network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "floatingNetID")]
    pub floating_net_id: Option<String>,
    /// Listener network ID.
    #[serde(default, rename = "networkID")]
    pub network_id: String,
    /// Subnet for VIP and machine ports (fixed IP from that subnet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "subnetID")]
    pub subnet_id: Option<String>,
    /// IPv6 subnet of the listener network for the VIP port's IPv6 fixed IP, when `spec.ipFamilies` names IPv6.
    /// Unset: the network's only IPv6 subnet (several are an error that asks for this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "subnetIDv6")]
    pub subnet_id_v6: Option<String>,
}

/// Reference to an OpenStack image. Only `imageID` is implemented by yawol.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct OpenstackImageRef {
    /// Image ID.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "imageID")]
    pub image_id: Option<String>,
    /// Image name (used only when no ID is given).
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "imageName")]
    pub image_name: Option<String>,
    /// Search string over image metadata (used only when neither ID nor name is given).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "imageSearch"
    )]
    pub image_search: Option<String>,
    /// Deprecated: use `imageID`.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "image_id")]
    pub image_id_old: Option<String>,
    /// Deprecated: use `imageName`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "image_name"
    )]
    pub image_name_old: Option<String>,
    /// Deprecated: use `imageSearch`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "image_search"
    )]
    pub image_search_old: Option<String>,
}

impl OpenstackImageRef {
    /// A reference by ID.
    pub fn by_id(id: impl Into<String>) -> Self {
        Self {
            image_id: Some(id.into()),
            ..Self::default()
        }
    }

    /// The image ID, falling back to the deprecated snake_case field.
    pub fn effective_id(&self) -> Option<&str> {
        self.image_id
            .as_deref()
            .or(self.image_id_old.as_deref())
            .filter(|s| !s.is_empty())
    }

    /// Moves deprecated snake_case fields to their camelCase names. Returns whether anything changed.
    pub fn migrate_deprecated(&mut self) -> bool {
        migrate(&mut self.image_id, &mut self.image_id_old)
            | migrate(&mut self.image_name, &mut self.image_name_old)
            | migrate(&mut self.image_search, &mut self.image_search_old)
    }
}

/// Reference to an OpenStack flavor. Only `flavorID` is implemented by yawol.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct OpenstackFlavorRef {
    /// Flavor ID.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "flavorID")]
    pub flavor_id: Option<String>,
    /// Flavor name (used only when no ID is given).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "flavorName"
    )]
    pub flavor_name: Option<String>,
    /// Search string over flavor metadata (used only when neither ID nor name is given).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "flavorSearch"
    )]
    pub flavor_search: Option<String>,
    /// Deprecated: use `flavorID`.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "flavor_id")]
    pub flavor_id_old: Option<String>,
    /// Deprecated: use `flavorName`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "flavor_name"
    )]
    pub flavor_name_old: Option<String>,
    /// Deprecated: use `flavorSearch`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "flavor_search"
    )]
    pub flavor_search_old: Option<String>,
}

impl OpenstackFlavorRef {
    /// A reference by ID.
    pub fn by_id(id: impl Into<String>) -> Self {
        Self {
            flavor_id: Some(id.into()),
            ..Self::default()
        }
    }

    /// The flavor ID, falling back to the deprecated snake_case field.
    pub fn effective_id(&self) -> Option<&str> {
        self.flavor_id
            .as_deref()
            .or(self.flavor_id_old.as_deref())
            .filter(|s| !s.is_empty())
    }

    /// Moves deprecated snake_case fields to their camelCase names. Returns whether anything changed.
    pub fn migrate_deprecated(&mut self) -> bool {
        migrate(&mut self.flavor_id, &mut self.flavor_id_old)
            | migrate(&mut self.flavor_name, &mut self.flavor_name_old)
            | migrate(&mut self.flavor_search, &mut self.flavor_search_old)
    }
}

fn migrate(new: &mut Option<String>, old: &mut Option<String>) -> bool {
    match old.take() {
        Some(value) => {
            if new.is_none() {
                *new = Some(value);
            }
            true
        }
        None => false,
    }
}

/// Reference to a LoadBalancer object.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct LoadBalancerRef {
    /// Name of the LoadBalancer.
    pub name: String,
    /// Namespace of the LoadBalancer.
    pub namespace: String,
}

/// Observed state of a LoadBalancer.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerStatus {
    /// Ready machines (sum over all sets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<i32>,
    /// Machines (sum over all sets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Current external IP (floating IP, or the VIP for internal load balancers).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "externalIP"
    )]
    pub external_ip: Option<String>,
    /// OpenStack ID of the floating IP.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "floatingID"
    )]
    pub floating_id: Option<String>,
    /// OpenStack name of the floating IP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub floating_name: Option<String>,
    /// OpenStack ID of the VIP port.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "portID")]
    pub port_id: Option<String>,
    /// OpenStack name of the VIP port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_name: Option<String>,
    /// Fixed IP of the VIP port: the IPv4 VIP.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "portIP")]
    pub port_ip: Option<String>,
    /// IPv6 fixed IP of the VIP port, set only when `spec.ipFamilies` names IPv6: the IPv6 VIP, which is also
    /// the load balancer's public IPv6 address (IPv6 gets no floating IP).
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "portIPv6")]
    pub port_ipv6: Option<String>,
    /// OpenStack ID of the server group.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "serverGroupID"
    )]
    pub server_group_id: Option<String>,
    /// OpenStack name of the server group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_group_name: Option<String>,
    /// OpenStack ID of the security group.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "securityGroupID"
    )]
    pub security_group_id: Option<String>,
    /// OpenStack name of the security group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security_group_name: Option<String>,
    /// Deprecated: use `securityGroupID`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "security_group_id"
    )]
    pub security_group_id_old: Option<String>,
    /// Deprecated: use `securityGroupName`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "security_group_name"
    )]
    pub security_group_name_old: Option<String>,
    /// Time of the last OpenStack reconciliation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_openstack_reconcile: Option<Time>,
    /// Hash of the OpenStack-relevant settings at the last reconciliation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub openstack_reconcile_hash: Option<String>,
    /// Conditions of the LoadBalancer (not in yawol): `ActiveActive` says whether the router spreads the VIP over
    /// the machines, and why not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = crate::schema::metav1_conditions)]
    pub conditions: Option<Vec<Condition>>,
}
