//! [`Cloud`] on a real OpenStack through `openstack_sdk` (async).

use super::*;
use anyhow::Context as _;
use base64::Engine as _;
use openstack_sdk::api::compute::v2 as nova;
use openstack_sdk::api::network::v2 as neutron;
use openstack_sdk::api::{ignore, ApiError, QueryAsync};
use openstack_sdk::config::CloudConfig;
use openstack_sdk::types::ServiceType;
use openstack_sdk::AsyncOpenStack;
use serde_json::Value;
use std::borrow::Cow;
use std::time::Duration;

/// Per-call timeout when none is configured (yawol's `--openstack-timeout` default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(20);

/// An authenticated `openstack_sdk` session with the compute and network endpoints discovered.
pub struct SdkCloud {
    client: AsyncOpenStack,
    timeout: Duration,
    calls: OpenStackCalls,
}

impl SdkCloud {
    /// Authenticates and discovers the Nova and Neutron endpoints.
    ///
    /// The discovery is required: without it `openstack_sdk` uses the unversioned catalog URL as it is (Neutron's
    /// `http://host:9696`, so `/floatingips` is a 404 instead of `/v2.0/floatingips`).
    pub async fn connect(
        config: &CloudConfig,
        timeout: Duration,
        calls: OpenStackCalls,
    ) -> anyhow::Result<Self> {
        let connect = async {
            let client: AsyncOpenStack = AsyncOpenStack::builder(config)
                // Tokens cached on disk would be shared between LoadBalancers of different projects.
                .disable_auth_cache(true)
                .connect()
                .await
                .context("authenticating to OpenStack")?;
            for service in [ServiceType::Compute, ServiceType::Network] {
                client
                    .discover_service_endpoint(&service)
                    .await
                    .with_context(|| format!("discovering the {service:?} endpoint"))?;
            }
            anyhow::Ok(client)
        };
        // Authentication plus two discoveries: allow three calls' worth of time.
        let client = tokio::time::timeout(timeout * 3, connect)
            .await
            .map_err(|_| {
                anyhow::anyhow!("connecting to OpenStack timed out after {:?}", timeout * 3)
            })??;
        Ok(SdkCloud {
            client,
            timeout,
            calls,
        })
    }

    /// The metric this session counts its calls in.
    pub fn calls(&self) -> &OpenStackCalls {
        &self.calls
    }

    /// Runs one API call with the per-call timeout, counting it and classifying its error.
    async fn call<T, E, F>(
        &self,
        api: &str,
        object: &str,
        operation: &str,
        what: &str,
        fut: F,
    ) -> CloudResult<T>
    where
        F: std::future::Future<Output = Result<T, ApiError<E>>>,
        E: std::error::Error + Send + Sync + 'static,
    {
        self.calls.inc(api, object, operation);
        match tokio::time::timeout(self.timeout, fut).await {
            Err(_) => Err(CloudError::new(
                CloudErrorKind::Unavailable,
                what,
                format!("no answer within {:?}", self.timeout),
            )),
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(api_error(what, e)),
        }
    }

    async fn delete_call<E, F>(
        &self,
        api: &str,
        object: &str,
        what: &str,
        fut: F,
    ) -> CloudResult<()>
    where
        F: std::future::Future<Output = Result<(), ApiError<E>>>,
        E: std::error::Error + Send + Sync + 'static,
    {
        match self.call(api, object, "delete", what, fut).await {
            Err(e) if e.is_not_found() => Ok(()),
            other => other,
        }
    }
}

fn api_error<E: std::error::Error + Send + Sync + 'static>(
    what: &str,
    e: ApiError<E>,
) -> CloudError {
    match &e {
        ApiError::OpenStack { status, msg, .. } => {
            CloudError::new(classify(status.as_u16(), msg), what, msg.clone())
        }
        ApiError::OpenStackService { status, data, .. } => {
            CloudError::new(classify(status.as_u16(), data), what, data.clone())
        }
        ApiError::OpenStackUnrecognized { status, obj, .. } => {
            let text = obj.to_string();
            CloudError::new(classify(status.as_u16(), &text), what, text)
        }
        ApiError::ResourceNotFound => {
            CloudError::new(CloudErrorKind::NotFound, what, e.to_string())
        }
        // Connection refused/reset and the like: the API is away.
        ApiError::Client { .. } | ApiError::Session { .. } => {
            CloudError::new(CloudErrorKind::Unavailable, what, format!("{e}"))
        }
        _ => CloudError::new(CloudErrorKind::Other, what, e.to_string()),
    }
}

fn bad_request<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> CloudError + '_ {
    move |e| {
        CloudError::new(
            CloudErrorKind::Other,
            what,
            format!("building the request: {e}"),
        )
    }
}

fn s(v: &Value, key: &str) -> String {
    v.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

fn opt_s(v: &Value, key: &str) -> Option<String> {
    v.get(key)
        .and_then(Value::as_str)
        .filter(|x| !x.is_empty())
        .map(str::to_string)
}

fn parse_rule(v: &Value) -> SecurityGroupRule {
    SecurityGroupRule {
        id: s(v, "id"),
        spec: RuleSpec {
            direction: if s(v, "direction") == "egress" {
                Direction::Egress
            } else {
                Direction::Ingress
            },
            ethertype: if s(v, "ethertype") == "IPv6" {
                EtherType::V6
            } else {
                EtherType::V4
            },
            protocol: opt_s(v, "protocol"),
            port_range_min: v
                .get("port_range_min")
                .and_then(Value::as_u64)
                .map(|p| p as u16),
            port_range_max: v
                .get("port_range_max")
                .and_then(Value::as_u64)
                .map(|p| p as u16),
            remote_ip_prefix: opt_s(v, "remote_ip_prefix"),
            remote_group_id: opt_s(v, "remote_group_id"),
        },
    }
}

fn parse_sg(v: &Value) -> SecurityGroup {
    SecurityGroup {
        id: s(v, "id"),
        name: s(v, "name"),
        rules: v["security_group_rules"]
            .as_array()
            .into_iter()
            .flatten()
            .map(parse_rule)
            .collect(),
    }
}

fn parse_fip(v: &Value) -> FloatingIp {
    FloatingIp {
        id: s(v, "id"),
        address: s(v, "floating_ip_address"),
        description: s(v, "description"),
        port_id: opt_s(v, "port_id"),
        status: s(v, "status"),
    }
}

fn parse_port(v: &Value) -> Port {
    Port {
        id: s(v, "id"),
        name: s(v, "name"),
        network_id: s(v, "network_id"),
        fixed_ips: v["fixed_ips"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|f| FixedIp {
                ip_address: s(f, "ip_address"),
                subnet_id: s(f, "subnet_id"),
            })
            .collect(),
        security_groups: v["security_groups"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect(),
        allowed_address_pairs: v["allowed_address_pairs"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| s(p, "ip_address"))
            .collect(),
        device_id: s(v, "device_id"),
    }
}

fn parse_server_group(v: &Value) -> ServerGroup {
    // `policy` from microversion 2.64 on, `policies[0]` before.
    let policy = opt_s(v, "policy")
        .or_else(|| {
            v["policies"]
                .get(0)
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_default();
    ServerGroup {
        id: s(v, "id"),
        name: s(v, "name"),
        policy,
    }
}

fn parse_server(v: &Value) -> Server {
    Server {
        id: s(v, "id"),
        name: s(v, "name"),
        status: s(v, "status"),
        fault: v
            .get("fault")
            .and_then(|f| f.get("message"))
            .and_then(Value::as_str)
            .map(str::to_string),
        created: opt_s(v, "created"),
    }
}

impl Cloud for SdkCloud {
    async fn find_security_groups(&self, name: &str) -> CloudResult<Vec<SecurityGroup>> {
        let what = "listing security groups";
        let req = neutron::security_group::list::Request::builder()
            .name(name)
            .build()
            .map_err(bad_request(what))?;
        let list: Vec<Value> = self
            .call(
                "neutron",
                "group",
                "list",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(list
            .iter()
            .map(parse_sg)
            .filter(|g| g.name == name)
            .collect())
    }

    async fn create_security_group(&self, name: &str) -> CloudResult<SecurityGroup> {
        let what = "creating security group";
        let req = neutron::security_group::create::Request::builder()
            .security_group(
                neutron::security_group::create::SecurityGroupBuilder::default()
                    .name(name)
                    .build()
                    .map_err(bad_request(what))?,
            )
            .build()
            .map_err(bad_request(what))?;
        let v: Value = self
            .call(
                "neutron",
                "group",
                "create",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(parse_sg(&v))
    }

    async fn delete_security_group(&self, id: &str) -> CloudResult<()> {
        let what = "deleting security group";
        let req = neutron::security_group::delete::Request::builder()
            .id(id)
            .build()
            .map_err(bad_request(what))?;
        self.delete_call(
            "neutron",
            "group",
            what,
            ignore(req).query_async(&self.client),
        )
        .await
    }

    async fn create_security_group_rule(
        &self,
        security_group_id: &str,
        rule: &RuleSpec,
        description: &str,
    ) -> CloudResult<SecurityGroupRule> {
        use neutron::security_group_rule::create::{
            Direction as D, Ethertype, SecurityGroupRuleBuilder,
        };
        let what = "creating security group rule";
        let mut b = SecurityGroupRuleBuilder::default();
        b.security_group_id(security_group_id)
            .description(description)
            .direction(match rule.direction {
                Direction::Ingress => D::Ingress,
                Direction::Egress => D::Egress,
            })
            .ethertype(match rule.ethertype {
                EtherType::V4 => Ethertype::Ipv4,
                EtherType::V6 => Ethertype::Ipv6,
            });
        if let Some(p) = &rule.protocol {
            b.protocol(p.as_str());
        }
        if let Some(p) = rule.port_range_min {
            b.port_range_min(Some(i32::from(p)));
        }
        if let Some(p) = rule.port_range_max {
            b.port_range_max(Some(i32::from(p)));
        }
        if let Some(p) = &rule.remote_ip_prefix {
            b.remote_ip_prefix(p.as_str());
        }
        if let Some(g) = &rule.remote_group_id {
            b.remote_group_id(g.as_str());
        }
        let req = neutron::security_group_rule::create::Request::builder()
            .security_group_rule(b.build().map_err(bad_request(what))?)
            .build()
            .map_err(bad_request(what))?;
        let v: Value = self
            .call(
                "neutron",
                "rule",
                "create",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(parse_rule(&v))
    }

    async fn delete_security_group_rule(&self, id: &str) -> CloudResult<()> {
        let what = "deleting security group rule";
        let req = neutron::security_group_rule::delete::Request::builder()
            .id(id)
            .build()
            .map_err(bad_request(what))?;
        self.delete_call(
            "neutron",
            "rule",
            what,
            ignore(req).query_async(&self.client),
        )
        .await
    }

    async fn find_floating_ips(&self, filter: &FloatingIpFilter) -> CloudResult<Vec<FloatingIp>> {
        let what = "listing floating IPs";
        let mut b = neutron::floatingip::list::Request::builder();
        if let Some(a) = &filter.address {
            b.floating_ip_address(a.as_str());
        }
        if let Some(d) = &filter.description {
            b.description(d.as_str());
        }
        let req = b.build().map_err(bad_request(what))?;
        let list: Vec<Value> = self
            .call(
                "neutron",
                "floatingip",
                "list",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(list
            .iter()
            .map(parse_fip)
            .filter(|f| filter.address.as_ref().is_none_or(|a| &f.address == a))
            .filter(|f| {
                filter
                    .description
                    .as_ref()
                    .is_none_or(|d| &f.description == d)
            })
            .collect())
    }

    async fn get_floating_ip(&self, id: &str) -> CloudResult<FloatingIp> {
        let what = "reading floating IP";
        let req = neutron::floatingip::get::Request::builder()
            .id(id)
            .build()
            .map_err(bad_request(what))?;
        let v: Value = self
            .call(
                "neutron",
                "floatingip",
                "get",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(parse_fip(&v))
    }

    async fn create_floating_ip(
        &self,
        floating_network_id: &str,
        description: &str,
    ) -> CloudResult<FloatingIp> {
        let what = "creating floating IP";
        let req = neutron::floatingip::create::Request::builder()
            .floatingip(
                neutron::floatingip::create::FloatingipBuilder::default()
                    .floating_network_id(floating_network_id)
                    .description(description)
                    .build()
                    .map_err(bad_request(what))?,
            )
            .build()
            .map_err(bad_request(what))?;
        let v: Value = self
            .call(
                "neutron",
                "floatingip",
                "create",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(parse_fip(&v))
    }

    async fn set_floating_ip_port(
        &self,
        id: &str,
        port_id: Option<&str>,
    ) -> CloudResult<FloatingIp> {
        let what = "associating floating IP";
        let req = neutron::floatingip::set::Request::builder()
            .id(id)
            .floatingip(
                neutron::floatingip::set::FloatingipBuilder::default()
                    .port_id(port_id.map(Cow::from))
                    .build()
                    .map_err(bad_request(what))?,
            )
            .build()
            .map_err(bad_request(what))?;
        let v: Value = self
            .call(
                "neutron",
                "floatingip",
                "update",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(parse_fip(&v))
    }

    async fn set_floating_ip_description(
        &self,
        id: &str,
        description: &str,
    ) -> CloudResult<FloatingIp> {
        let what = "renaming floating IP";
        let req = neutron::floatingip::set::Request::builder()
            .id(id)
            .floatingip(
                neutron::floatingip::set::FloatingipBuilder::default()
                    .description(description)
                    .build()
                    .map_err(bad_request(what))?,
            )
            .build()
            .map_err(bad_request(what))?;
        let v: Value = self
            .call(
                "neutron",
                "floatingip",
                "update",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(parse_fip(&v))
    }

    async fn delete_floating_ip(&self, id: &str) -> CloudResult<()> {
        let what = "deleting floating IP";
        let req = neutron::floatingip::delete::Request::builder()
            .id(id)
            .build()
            .map_err(bad_request(what))?;
        self.delete_call(
            "neutron",
            "floatingip",
            what,
            ignore(req).query_async(&self.client),
        )
        .await
    }

    async fn find_ports(&self, name: &str) -> CloudResult<Vec<Port>> {
        let what = "listing ports";
        let req = neutron::port::list::Request::builder()
            .name(name)
            .build()
            .map_err(bad_request(what))?;
        let list: Vec<Value> = self
            .call(
                "neutron",
                "port",
                "list",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(list
            .iter()
            .map(parse_port)
            .filter(|p| p.name == name)
            .collect())
    }

    async fn get_port(&self, id: &str) -> CloudResult<Port> {
        let what = "reading port";
        let req = neutron::port::get::Request::builder()
            .id(id)
            .build()
            .map_err(bad_request(what))?;
        let v: Value = self
            .call(
                "neutron",
                "port",
                "get",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(parse_port(&v))
    }

    async fn create_port(&self, spec: &PortSpec) -> CloudResult<Port> {
        use neutron::port::create::{AllowedAddressPairsBuilder, FixedIpsBuilder, PortBuilder};
        let what = "creating port";
        let mut b = PortBuilder::default();
        b.name(spec.name.as_str())
            .network_id(spec.network_id.as_str())
            .security_groups(
                spec.security_groups
                    .iter()
                    .map(|g| Cow::from(g.as_str()))
                    .collect::<Vec<_>>(),
            );
        if let Some(subnet) = &spec.subnet_id {
            b.fixed_ips(vec![FixedIpsBuilder::default()
                .subnet_id(subnet.as_str())
                .build()
                .map_err(bad_request(what))?]);
        }
        if !spec.allowed_address_pairs.is_empty() {
            let pairs = spec
                .allowed_address_pairs
                .iter()
                .map(|ip| {
                    AllowedAddressPairsBuilder::default()
                        .ip_address(ip.as_str())
                        .build()
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(bad_request(what))?;
            b.allowed_address_pairs(pairs);
        }
        let req = neutron::port::create::Request::builder()
            .port(b.build().map_err(bad_request(what))?)
            .build()
            .map_err(bad_request(what))?;
        let v: Value = self
            .call(
                "neutron",
                "port",
                "create",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(parse_port(&v))
    }

    async fn update_port(&self, id: &str, update: &PortUpdate) -> CloudResult<Port> {
        use neutron::port::set::{AllowedAddressPairsBuilder, PortBuilder};
        let what = "updating port";
        let mut b = PortBuilder::default();
        if let Some(groups) = &update.security_groups {
            b.security_groups(
                groups
                    .iter()
                    .map(|g| Cow::from(g.as_str()))
                    .collect::<Vec<_>>(),
            );
        }
        if let Some(pairs) = &update.allowed_address_pairs {
            let pairs = pairs
                .iter()
                .map(|ip| {
                    AllowedAddressPairsBuilder::default()
                        .ip_address(ip.as_str())
                        .build()
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(bad_request(what))?;
            b.allowed_address_pairs(pairs);
        }
        let req = neutron::port::set::Request::builder()
            .id(id)
            .port(b.build().map_err(bad_request(what))?)
            .build()
            .map_err(bad_request(what))?;
        let v: Value = self
            .call(
                "neutron",
                "port",
                "update",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(parse_port(&v))
    }

    async fn delete_port(&self, id: &str) -> CloudResult<()> {
        let what = "deleting port";
        let req = neutron::port::delete::Request::builder()
            .id(id)
            .build()
            .map_err(bad_request(what))?;
        self.delete_call(
            "neutron",
            "port",
            what,
            ignore(req).query_async(&self.client),
        )
        .await
    }

    async fn find_server_groups(&self, name: &str) -> CloudResult<Vec<ServerGroup>> {
        let what = "listing server groups";
        let req = nova::server_group::list_20::Request::builder()
            .build()
            .map_err(bad_request(what))?;
        let list: Vec<Value> = self
            .call(
                "nova",
                "servergroup",
                "list",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(list
            .iter()
            .map(parse_server_group)
            .filter(|g| g.name == name)
            .collect())
    }

    async fn create_server_group(&self, name: &str, policy: &str) -> CloudResult<ServerGroup> {
        use nova::server_group::create_264::{Policy, ServerGroupBuilder};
        let what = "creating server group";
        let policy = match policy {
            "affinity" => Policy::Affinity,
            "anti-affinity" => Policy::AntiAffinity,
            "soft-affinity" => Policy::SoftAffinity,
            "soft-anti-affinity" => Policy::SoftAntiAffinity,
            other => {
                return Err(CloudError::new(
                    CloudErrorKind::BadRequest,
                    what,
                    format!("unknown server group policy {other:?}"),
                ))
            }
        };
        let req = nova::server_group::create_264::Request::builder()
            .server_group(
                ServerGroupBuilder::default()
                    .name(name)
                    .policy(policy)
                    .build()
                    .map_err(bad_request(what))?,
            )
            .build()
            .map_err(bad_request(what))?;
        let v: Value = self
            .call(
                "nova",
                "servergroup",
                "create",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(parse_server_group(&v))
    }

    async fn delete_server_group(&self, id: &str) -> CloudResult<()> {
        let what = "deleting server group";
        let req = nova::server_group::delete::Request::builder()
            .id(id)
            .build()
            .map_err(bad_request(what))?;
        self.delete_call(
            "nova",
            "servergroup",
            what,
            ignore(req).query_async(&self.client),
        )
        .await
    }

    async fn find_servers(&self, name: &str) -> CloudResult<Vec<Server>> {
        let what = "listing servers";
        // Nova's name filter is a regular expression: anchor it and filter exactly afterwards.
        let pattern = format!("^{}$", regex_escape(name));
        let req = nova::server::list_detailed_21::Request::builder()
            .name(pattern.as_str())
            .build()
            .map_err(bad_request(what))?;
        let list: Vec<Value> = self
            .call(
                "nova",
                "server",
                "list",
                what,
                req.query_async(&self.client),
            )
            .await?;
        Ok(list
            .iter()
            .map(parse_server)
            .filter(|s| s.name == name)
            .collect())
    }

    async fn get_server(&self, id: &str) -> CloudResult<Server> {
        let what = "reading server";
        let req = nova::server::get_20::Request::builder()
            .id(id)
            .build()
            .map_err(bad_request(what))?;
        let v: Value = self
            .call("nova", "server", "get", what, req.query_async(&self.client))
            .await?;
        Ok(parse_server(&v))
    }

    async fn create_server(&self, spec: &ServerSpec) -> CloudResult<Server> {
        use nova::server::create_294::{
            NetworksBuilder, OsSchHntSchedulerHintsBuilder, ServerBuilder, ServerNetworks,
        };
        let what = "creating server";
        let mut networks = vec![NetworksBuilder::default()
            .port(Some(Cow::from(spec.port_id.as_str())))
            .build()
            .map_err(bad_request(what))?];
        for net in &spec.additional_networks {
            networks.push(
                NetworksBuilder::default()
                    .uuid(net.as_str())
                    .build()
                    .map_err(bad_request(what))?,
            );
        }
        let user_data = base64::engine::general_purpose::STANDARD.encode(&spec.user_data);
        let mut b = ServerBuilder::default();
        b.name(spec.name.as_str())
            .flavor_ref(spec.flavor_id.as_str())
            .image_ref(spec.image_id.as_str())
            .networks(ServerNetworks::F1(networks))
            .user_data(user_data.as_str());
        if let Some(az) = &spec.availability_zone {
            b.availability_zone(az.as_str());
        }
        if let Some(key) = &spec.key_name {
            b.key_name(key.as_str());
        }
        let mut req = nova::server::create_294::Request::builder();
        req.server(b.build().map_err(bad_request(what))?);
        if let Some(group) = &spec.server_group_id {
            req.os_sch_hnt_scheduler_hints(
                OsSchHntSchedulerHintsBuilder::default()
                    .group(vec![Cow::from(group.as_str())])
                    .build()
                    .map_err(bad_request(what))?,
            );
        }
        let req = req.build().map_err(bad_request(what))?;
        let v: Value = self
            .call(
                "nova",
                "server",
                "create",
                what,
                req.query_async(&self.client),
            )
            .await?;
        // The create answer carries only the ID (and adminPass); the rest comes with the next get.
        Ok(Server {
            id: s(&v, "id"),
            name: spec.name.clone(),
            status: "BUILD".into(),
            fault: None,
            created: None,
        })
    }

    async fn delete_server(&self, id: &str) -> CloudResult<()> {
        let what = "deleting server";
        let req = nova::server::delete::Request::builder()
            .id(id)
            .build()
            .map_err(bad_request(what))?;
        self.delete_call(
            "nova",
            "server",
            what,
            ignore(req).query_async(&self.client),
        )
        .await
    }
}

fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
