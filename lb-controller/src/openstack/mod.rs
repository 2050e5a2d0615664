//! The OpenStack side (`lb-controller controller`, yawol-controller's role): LoadBalancer → OpenStack resources,
//! LoadBalancerSets and LoadBalancerMachines with their VMs. One folder per controller ([`loadbalancer`], [`set`],
//! [`machine`]), started together by [`run`], with their cloud sessions from [`clouds`].
//!
//! The controllers talk to the cloud only through the [`Cloud`] trait: a small set of find/create/update/delete
//! operations on the resource kinds a load balancer needs (security groups and rules, floating IPs, ports, server
//! groups, servers, and an active-active LoadBalancer's routes on its network's router). The domain-level "ensure" steps (adopt by name, diff rules, never replace a floating IP)
//! live in each controller's `resources.rs` ([`loadbalancer::resources`], [`machine::resources`]) and are written
//! against the trait, so they are unit-tested with `fake::FakeCloud` and run against a real cloud with
//! [`sdk::SdkCloud`] (`openstack_sdk`, async; credentials in [`config`]). Another cloud could plug in by implementing
//! the trait.
//!
//! Every method is one API call (list calls may page internally); implementations count calls in the
//! `yawol_openstack{api,object,operation}` metric ([`OpenStackCalls`]).

pub mod clouds;
pub mod config;
// Test code: in the unit tests, and for the integration tests through the `fake-openstack` feature, which only
// lb-controller's dev-dependency on itself enables; never in the product binary.
#[cfg(any(test, feature = "fake-openstack"))]
pub mod fake;
pub mod loadbalancer;
pub mod machine;
pub mod run;
pub mod sdk;
pub mod set;
mod types;

pub use config::{CloudProviderConf, Credentials};
pub use types::*;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use std::future::Future;

/// Installs rustls' ring provider as the process default (idempotent).
///
/// `openstack_sdk` (through reqwest) enables rustls' aws-lc-rs provider and kube enables ring; with both compiled in,
/// rustls will not choose, and kube's `ClientConfig::builder()` would panic on the first HTTPS connection. Called
/// from `main` and from [`sdk::SdkCloud::connect`].
pub fn install_crypto_provider() {
    // Err only means a provider is already installed, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Result of one cloud call.
pub type CloudResult<T> = Result<T, CloudError>;

/// The OpenStack operations the controllers need, one API call each.
///
/// Deleting something that is already gone is not an error (`Ok(())`): every delete path is idempotent. Lookups by
/// name return every match, because names are not unique in OpenStack and the callers decide what to do with
/// duplicates (adopt one, delete the rest).
pub trait Cloud: Send + Sync {
    /// Security groups named exactly `name`, with their rules.
    fn find_security_groups(
        &self,
        name: &str,
    ) -> impl Future<Output = CloudResult<Vec<SecurityGroup>>> + Send;
    /// Creates a security group (Neutron adds its two default egress rules).
    fn create_security_group(
        &self,
        name: &str,
    ) -> impl Future<Output = CloudResult<SecurityGroup>> + Send;
    /// Deletes a security group.
    fn delete_security_group(&self, id: &str) -> impl Future<Output = CloudResult<()>> + Send;
    /// Adds a rule to a security group.
    fn create_security_group_rule(
        &self,
        security_group_id: &str,
        rule: &RuleSpec,
        description: &str,
    ) -> impl Future<Output = CloudResult<SecurityGroupRule>> + Send;
    /// Deletes a rule.
    fn delete_security_group_rule(&self, id: &str) -> impl Future<Output = CloudResult<()>> + Send;

    /// Floating IPs of the project matching the filter (an empty filter lists them all).
    fn find_floating_ips(
        &self,
        filter: &FloatingIpFilter,
    ) -> impl Future<Output = CloudResult<Vec<FloatingIp>>> + Send;
    /// One floating IP by ID ([`CloudErrorKind::NotFound`] when it is gone).
    fn get_floating_ip(&self, id: &str) -> impl Future<Output = CloudResult<FloatingIp>> + Send;
    /// Allocates a floating IP from an external network.
    fn create_floating_ip(
        &self,
        floating_network_id: &str,
        description: &str,
    ) -> impl Future<Output = CloudResult<FloatingIp>> + Send;
    /// Associates a floating IP with a port (`Some`) or disassociates it (`None`).
    fn set_floating_ip_port(
        &self,
        id: &str,
        port_id: Option<&str>,
    ) -> impl Future<Output = CloudResult<FloatingIp>> + Send;
    /// Changes a floating IP's description.
    fn set_floating_ip_description(
        &self,
        id: &str,
        description: &str,
    ) -> impl Future<Output = CloudResult<FloatingIp>> + Send;
    /// Releases a floating IP.
    fn delete_floating_ip(&self, id: &str) -> impl Future<Output = CloudResult<()>> + Send;

    /// Ports named exactly `name`.
    fn find_ports(&self, name: &str) -> impl Future<Output = CloudResult<Vec<Port>>> + Send;
    /// One port by ID.
    fn get_port(&self, id: &str) -> impl Future<Output = CloudResult<Port>> + Send;
    /// Creates a port.
    fn create_port(&self, spec: &PortSpec) -> impl Future<Output = CloudResult<Port>> + Send;
    /// Replaces a port's security groups and/or allowed address pairs (`None` leaves a field as it is).
    fn update_port(
        &self,
        id: &str,
        update: &PortUpdate,
    ) -> impl Future<Output = CloudResult<Port>> + Send;
    /// Deletes a port.
    fn delete_port(&self, id: &str) -> impl Future<Output = CloudResult<()>> + Send;
    /// The subnets of a network with IP version `ip_version` (4 or 6).
    fn find_subnets(
        &self,
        network_id: &str,
        ip_version: u8,
    ) -> impl Future<Output = CloudResult<Vec<Subnet>>> + Send;

    /// The router interfaces on a network: its ports with a `device_owner` of [`ROUTER_INTERFACE_OWNERS`] (the
    /// router is the port's `device_id`).
    fn find_router_interfaces(
        &self,
        network_id: &str,
    ) -> impl Future<Output = CloudResult<Vec<Port>>> + Send;
    /// A router's extra routes.
    fn router_routes(
        &self,
        router_id: &str,
    ) -> impl Future<Output = CloudResult<Vec<Route>>> + Send;
    /// Adds extra routes to a router in one atomic step (Neutron's `extraroute-atomic`: no read-modify-write of
    /// the whole list, so other writers' routes are safe; a route that exists already changes nothing).
    fn add_router_routes(
        &self,
        router_id: &str,
        routes: &[Route],
    ) -> impl Future<Output = CloudResult<()>> + Send;
    /// Removes extra routes from a router, atomically (a route that is not there changes nothing).
    fn remove_router_routes(
        &self,
        router_id: &str,
        routes: &[Route],
    ) -> impl Future<Output = CloudResult<()>> + Send;

    /// Server groups named exactly `name`.
    fn find_server_groups(
        &self,
        name: &str,
    ) -> impl Future<Output = CloudResult<Vec<ServerGroup>>> + Send;
    /// Creates a server group with one policy.
    fn create_server_group(
        &self,
        name: &str,
        policy: &str,
    ) -> impl Future<Output = CloudResult<ServerGroup>> + Send;
    /// Deletes a server group.
    fn delete_server_group(&self, id: &str) -> impl Future<Output = CloudResult<()>> + Send;

    /// Servers named exactly `name` (Nova's name filter is a regex; implementations filter exactly).
    fn find_servers(&self, name: &str) -> impl Future<Output = CloudResult<Vec<Server>>> + Send;
    /// One server by ID.
    fn get_server(&self, id: &str) -> impl Future<Output = CloudResult<Server>> + Send;
    /// Boots a server.
    fn create_server(&self, spec: &ServerSpec) -> impl Future<Output = CloudResult<Server>> + Send;
    /// Deletes a server (asynchronous in Nova: it may still be listed for a while).
    fn delete_server(&self, id: &str) -> impl Future<Output = CloudResult<()>> + Send;
}

/// Labels of `yawol_openstack`, as in yawol.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpenStackCallLabels {
    /// `neutron` or `nova`.
    pub api: String,
    /// `floatingip`, `port`, `subnet`, `group`, `rule`, `server`, `servergroup`, `router`.
    pub object: String,
    /// `create`, `delete`, `get`, `list`, `update`.
    pub operation: String,
}

/// One `yawol_openstack` series: a counter, exposed with the OpenMetrics type `unknown`.
///
/// yawol registers a client_golang `CounterVec` named `yawol_openstack`, and controller-runtime serves it in the
/// Prometheus text format, where a counter keeps its name: the series is `yawol_openstack{…}`, which dashboards and
/// alerts query. prometheus-client writes OpenMetrics, where a counter's samples must end in `_total` (it appends
/// it), which would rename the series. `unknown` samples carry the family name as is, and PromQL (`rate`,
/// `increase`) treats the series exactly as yawol's; only the scraped type metadata says unknown, not counter.
#[derive(Clone, Debug, Default)]
pub struct CallCounter(Counter);

impl CallCounter {
    /// Adds one.
    pub fn inc(&self) {
        self.0.inc();
    }

    /// The count so far.
    pub fn get(&self) -> u64 {
        self.0.get()
    }
}

impl TypedMetric for CallCounter {
    const TYPE: MetricType = MetricType::Unknown;
}

impl EncodeMetric for CallCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        // The gauge sample line is `name{labels} value`, without a suffix.
        encoder.encode_gauge(&self.0.get())
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// The `yawol_openstack` counter: OpenStack calls by api, object and operation (failed ones included).
#[derive(Clone, Default)]
pub struct OpenStackCalls(pub Family<OpenStackCallLabels, CallCounter>);

impl OpenStackCalls {
    /// Registers the family as `yawol_openstack` (samples `yawol_openstack{api,object,operation}`, as yawol's).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "yawol_openstack",
            "Openstack usage counter by api, object, operation",
            self.0.clone(),
        );
    }

    /// Counts one call.
    pub fn inc(&self, api: &str, object: &str, operation: &str) {
        self.0
            .get_or_create(&OpenStackCallLabels {
                api: api.into(),
                object: object.into(),
                operation: operation.into(),
            })
            .inc();
    }

    /// Sum over all series (tests and the steady-state benchmark: calls per reconcile).
    pub fn total(&self) -> u64 {
        let mut sum = 0;
        // Family has no iterator; encode and sum the values instead of tracking a second counter.
        let mut registry = Registry::default();
        registry.register("c", "", self.0.clone());
        let mut text = String::new();
        if prometheus_client::encoding::text::encode(&mut text, &registry).is_ok() {
            for line in text.lines().filter(|l| l.starts_with("c{")) {
                sum += line
                    .rsplit(' ')
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_tls_client_config_can_be_built_with_both_providers_compiled_in() {
        super::install_crypto_provider();
        // What kube does for an HTTPS API server; panics without a process default provider.
        let _ = rustls::ClientConfig::builder()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
    }
}
