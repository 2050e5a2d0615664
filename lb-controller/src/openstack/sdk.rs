//! [`Cloud`] on a real OpenStack through `openstack_sdk` (async).

use super::*;
use anyhow::Context as _;
use base64::Engine as _;
use openstack_sdk::api::compute::v2 as nova;
use openstack_sdk::api::network::v2 as neutron;
use openstack_sdk::api::{ignore, raw, ApiError, AsyncClient, QueryAsync, RestEndpoint};
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

    /// Runs one API call with the per-call timeout, counting it.
    async fn call<T, F>(
        &self,
        api: &str,
        object: &str,
        operation: &str,
        what: &str,
        fut: F,
    ) -> CloudResult<T>
    where
        F: std::future::Future<Output = CloudResult<T>>,
    {
        self.calls.inc(api, object, operation);
        match tokio::time::timeout(self.timeout, fut).await {
            Err(_) => Err(CloudError::new(
                CloudErrorKind::Unavailable,
                what,
                format!("no answer within {:?}", self.timeout),
            )),
            Ok(r) => r,
        }
    }

    /// One request's answer as JSON (see [`answer`]).
    async fn ask<E: RestEndpoint + Sync>(
        &self,
        api: &str,
        object: &str,
        operation: &str,
        what: &str,
        req: E,
    ) -> CloudResult<Value> {
        self.call(
            api,
            object,
            operation,
            what,
            answer(what, req, &self.client),
        )
        .await
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
        let fut = async { fut.await.map_err(|e| api_error(what, e)) };
        match self.call(api, object, "delete", what, fut).await {
            Err(e) if e.is_not_found() => Ok(()),
            other => other,
        }
    }
}

/// The body of one request's answer under the endpoint's response key (`port`, `ports`, …), or the cloud's
/// error. This is openstack_sdk's `query_async` without its panic: that indexes the body by the response key,
/// which panics when a 2xx body is JSON but not an object (`[]`, `"x"`, `1` — a proxy's or a broken cloud's
/// answer would take the controller down); here it is an error naming what came instead. Public (hidden) for
/// the `openstack_answers` fuzz target.
#[doc(hidden)]
pub async fn answer<E, C>(what: &str, req: E, client: &C) -> CloudResult<Value>
where
    E: RestEndpoint + Sync,
    C: AsyncClient + Sync,
{
    let key = req.response_key();
    // Statuses other than 2xx come back as the cloud's error (openstack_sdk reads its message).
    let rsp = raw(req)
        .query_async(client)
        .await
        .map_err(|e| api_error(what, e))?;
    let body: Value = serde_json::from_slice(rsp.body())
        .map_err(|e| unreadable(what, format!("the body is not JSON: {e}")))?;
    let Some(key) = key else {
        return Ok(body);
    };
    match body {
        Value::Object(mut o) => o
            .remove(key.as_ref())
            .ok_or_else(|| unreadable(what, format!("no {key:?} in the answer"))),
        other => Err(unreadable(
            what,
            format!("expected an object with {key:?}, got {}", json_kind(&other)),
        )),
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

/// An answer the controllers cannot act on (the cloud's, or whatever answered in its place).
fn unreadable(what: &str, problem: impl std::fmt::Display) -> CloudError {
    CloudError::new(
        CloudErrorKind::Other,
        what,
        format!("unreadable answer: {problem}"),
    )
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// The fields of one resource in an answer. Neutron and Nova always send the fields read as required here; one
/// missing, or any field of the wrong type, is an error naming `resource.field` — never a default that a
/// decision (delete by ID, compare rules, publish an address) would then act on.
struct Fields<'a> {
    what: &'a str,
    resource: &'static str,
    map: &'a serde_json::Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn of(what: &'a str, resource: &'static str, v: &'a Value) -> CloudResult<Self> {
        match v {
            Value::Object(map) => Ok(Fields {
                what,
                resource,
                map,
            }),
            other => Err(unreadable(
                what,
                format!("{resource}: expected an object, got {}", json_kind(other)),
            )),
        }
    }

    fn error(&self, key: &str, problem: impl std::fmt::Display) -> CloudError {
        unreadable(self.what, format!("{}.{key} {problem}", self.resource))
    }

    /// Present and not null.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    /// A string, possibly empty; absent or null reads as empty.
    fn text(&self, key: &str) -> CloudResult<String> {
        match self.get(key) {
            None => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(self.error(key, format!("is {}, not a string", json_kind(other)))),
        }
    }

    /// A non-empty string that must be there (IDs, addresses, states).
    fn required(&self, key: &str) -> CloudResult<String> {
        if self.get(key).is_none() {
            return Err(self.error(key, "missing"));
        }
        let s = self.text(key)?;
        if s.is_empty() {
            return Err(self.error(key, "is empty"));
        }
        Ok(s)
    }

    /// A string that may be absent, null or empty (`None`).
    fn optional(&self, key: &str) -> CloudResult<Option<String>> {
        Ok(Some(self.text(key)?).filter(|s| !s.is_empty()))
    }

    /// A port number or null.
    fn port(&self, key: &str) -> CloudResult<Option<u16>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .map(Some)
                .ok_or_else(|| self.error(key, format!("is {v}, not a port number"))),
        }
    }

    /// A list that must be there.
    fn list(&self, key: &str) -> CloudResult<&'a [Value]> {
        match self.get(key) {
            None => Err(self.error(key, "missing")),
            Some(Value::Array(a)) => Ok(a),
            Some(other) => Err(self.error(key, format!("is {}, not a list", json_kind(other)))),
        }
    }

    /// A list of strings that must be there.
    fn strings(&self, key: &str) -> CloudResult<Vec<String>> {
        self.list(key)?
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| self.error(key, format!("holds {}, not a string", json_kind(v))))
            })
            .collect()
    }
}

/// A list answer (`ports`, `servers`, …), each element read by `parse`.
#[doc(hidden)]
pub fn parse_list<T>(
    what: &str,
    v: &Value,
    parse: impl Fn(&str, &Value) -> CloudResult<T>,
) -> CloudResult<Vec<T>> {
    match v {
        Value::Array(items) => items.iter().map(|i| parse(what, i)).collect(),
        other => Err(unreadable(
            what,
            format!("expected a list, got {}", json_kind(other)),
        )),
    }
}

/// A Neutron security-group rule.
#[doc(hidden)]
pub fn parse_rule(what: &str, v: &Value) -> CloudResult<SecurityGroupRule> {
    let f = Fields::of(what, "security_group_rule", v)?;
    Ok(SecurityGroupRule {
        id: f.required("id")?,
        spec: RuleSpec {
            direction: match f.required("direction")?.as_str() {
                "ingress" => Direction::Ingress,
                "egress" => Direction::Egress,
                other => return Err(f.error("direction", format!("is {other:?}"))),
            },
            ethertype: match f.required("ethertype")?.as_str() {
                "IPv4" => EtherType::V4,
                "IPv6" => EtherType::V6,
                other => return Err(f.error("ethertype", format!("is {other:?}"))),
            },
            protocol: f.optional("protocol")?,
            port_range_min: f.port("port_range_min")?,
            port_range_max: f.port("port_range_max")?,
            remote_ip_prefix: f.optional("remote_ip_prefix")?,
            remote_group_id: f.optional("remote_group_id")?,
        },
    })
}

/// A Neutron security group with its rules.
#[doc(hidden)]
pub fn parse_sg(what: &str, v: &Value) -> CloudResult<SecurityGroup> {
    let f = Fields::of(what, "security_group", v)?;
    Ok(SecurityGroup {
        id: f.required("id")?,
        name: f.text("name")?,
        rules: f
            .list("security_group_rules")?
            .iter()
            .map(|r| parse_rule(what, r))
            .collect::<CloudResult<_>>()?,
    })
}

/// A Neutron floating IP.
#[doc(hidden)]
pub fn parse_fip(what: &str, v: &Value) -> CloudResult<FloatingIp> {
    let f = Fields::of(what, "floatingip", v)?;
    Ok(FloatingIp {
        id: f.required("id")?,
        address: f.required("floating_ip_address")?,
        description: f.text("description")?,
        port_id: f.optional("port_id")?,
        status: f.required("status")?,
    })
}

/// A Neutron port.
#[doc(hidden)]
pub fn parse_port(what: &str, v: &Value) -> CloudResult<Port> {
    let f = Fields::of(what, "port", v)?;
    Ok(Port {
        id: f.required("id")?,
        name: f.text("name")?,
        network_id: f.required("network_id")?,
        fixed_ips: f
            .list("fixed_ips")?
            .iter()
            .map(|ip| {
                let ip = Fields::of(what, "port.fixed_ips[]", ip)?;
                Ok(FixedIp {
                    ip_address: ip.required("ip_address")?,
                    subnet_id: ip.required("subnet_id")?,
                })
            })
            .collect::<CloudResult<_>>()?,
        security_groups: f.strings("security_groups")?,
        // Absent without Neutron's allowed-address-pairs extension.
        allowed_address_pairs: match f.get("allowed_address_pairs") {
            None => Vec::new(),
            Some(_) => f
                .list("allowed_address_pairs")?
                .iter()
                .map(|p| {
                    Fields::of(what, "port.allowed_address_pairs[]", p)?.required("ip_address")
                })
                .collect::<CloudResult<_>>()?,
        },
        device_id: f.text("device_id")?,
        device_owner: f.text("device_owner")?,
    })
}

/// A Neutron router's extra routes (none without the `extraroute` extension, which leaves the key out).
#[doc(hidden)]
pub fn parse_router_routes(what: &str, v: &Value) -> CloudResult<Vec<Route>> {
    let f = Fields::of(what, "router", v)?;
    if f.get("routes").is_none() {
        return Ok(Vec::new());
    }
    f.list("routes")?
        .iter()
        .map(|r| {
            let r = Fields::of(what, "router.routes[]", r)?;
            Ok(Route {
                destination: r.required("destination")?,
                nexthop: r.required("nexthop")?,
            })
        })
        .collect()
}

/// A Neutron subnet.
#[doc(hidden)]
pub fn parse_subnet(what: &str, v: &Value) -> CloudResult<Subnet> {
    let f = Fields::of(what, "subnet", v)?;
    let ip_version = match f.get("ip_version") {
        Some(Value::Number(n)) if n.as_u64() == Some(4) || n.as_u64() == Some(6) => {
            n.as_u64().unwrap_or_default() as u8
        }
        other => {
            return Err(f.error(
                "ip_version",
                format!(
                    "is {}, not 4 or 6",
                    other.map_or("missing".into(), |v| v.to_string())
                ),
            ))
        }
    };
    Ok(Subnet {
        id: f.required("id")?,
        network_id: f.required("network_id")?,
        ip_version,
        cidr: f.required("cidr")?,
    })
}

/// A Nova server group.
#[doc(hidden)]
pub fn parse_server_group(what: &str, v: &Value) -> CloudResult<ServerGroup> {
    let f = Fields::of(what, "server_group", v)?;
    // `policy` from microversion 2.64 on, `policies[0]` before.
    let policy = match f.optional("policy")? {
        Some(p) => p,
        None => f
            .strings("policies")?
            .into_iter()
            .next()
            .ok_or_else(|| f.error("policies", "is empty"))?,
    };
    Ok(ServerGroup {
        id: f.required("id")?,
        name: f.text("name")?,
        policy,
    })
}

/// A Nova server.
#[doc(hidden)]
pub fn parse_server(what: &str, v: &Value) -> CloudResult<Server> {
    let f = Fields::of(what, "server", v)?;
    Ok(Server {
        id: f.required("id")?,
        name: f.text("name")?,
        status: f.required("status")?,
        fault: match f.get("fault") {
            None => None,
            Some(fault) => Fields::of(what, "server.fault", fault)?.optional("message")?,
        },
        created: f.optional("created")?,
        // A string ("True" or "") in Nova's API; a boolean is taken too.
        config_drive: match f.get("config_drive") {
            Some(Value::String(s)) => s.eq_ignore_ascii_case("true") || s == "1",
            Some(Value::Bool(b)) => *b,
            _ => false,
        },
    })
}

/// Nova's answer to a create: the new server's ID (and adminPass); the rest comes with the next get.
#[doc(hidden)]
pub fn parse_created_server(what: &str, v: &Value) -> CloudResult<String> {
    Fields::of(what, "server", v)?.required("id")
}

/// The request of Neutron's `add_extraroutes` or `remove_extraroutes` (`$call`): the same body in two modules
/// of distinct types, hence a macro rather than a function.
macro_rules! extraroutes_request {
    ($call:ident, $what:expr, $router_id:expr, $routes:expr) => {{
        use neutron::router::$call::{Request, RouterBuilder, RoutesBuilder};
        let routes = $routes
            .iter()
            .map(|r| {
                RoutesBuilder::default()
                    .destination(r.destination.as_str())
                    .nexthop(r.nexthop.as_str())
                    .build()
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(bad_request($what))?;
        Request::builder()
            .id($router_id)
            .router(
                RouterBuilder::default()
                    .routes(routes)
                    .build()
                    .map_err(bad_request($what))?,
            )
            .build()
            .map_err(bad_request($what))?
    }};
}

impl Cloud for SdkCloud {
    async fn find_security_groups(&self, name: &str) -> CloudResult<Vec<SecurityGroup>> {
        let what = "listing security groups";
        let req = neutron::security_group::list::Request::builder()
            .name(name)
            .build()
            .map_err(bad_request(what))?;
        let v = self.ask("neutron", "group", "list", what, req).await?;
        Ok(parse_list(what, &v, parse_sg)?
            .into_iter()
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
        let v = self.ask("neutron", "group", "create", what, req).await?;
        parse_sg(what, &v)
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
        let v = self.ask("neutron", "rule", "create", what, req).await?;
        parse_rule(what, &v)
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
        let v = self.ask("neutron", "floatingip", "list", what, req).await?;
        Ok(parse_list(what, &v, parse_fip)?
            .into_iter()
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
        let v = self.ask("neutron", "floatingip", "get", what, req).await?;
        parse_fip(what, &v)
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
        let v = self
            .ask("neutron", "floatingip", "create", what, req)
            .await?;
        parse_fip(what, &v)
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
        let v = self
            .ask("neutron", "floatingip", "update", what, req)
            .await?;
        parse_fip(what, &v)
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
        let v = self
            .ask("neutron", "floatingip", "update", what, req)
            .await?;
        parse_fip(what, &v)
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
        let v = self.ask("neutron", "port", "list", what, req).await?;
        Ok(parse_list(what, &v, parse_port)?
            .into_iter()
            .filter(|p| p.name == name)
            .collect())
    }

    async fn get_port(&self, id: &str) -> CloudResult<Port> {
        let what = "reading port";
        let req = neutron::port::get::Request::builder()
            .id(id)
            .build()
            .map_err(bad_request(what))?;
        let v = self.ask("neutron", "port", "get", what, req).await?;
        parse_port(what, &v)
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
        let v = self.ask("neutron", "port", "create", what, req).await?;
        parse_port(what, &v)
    }

    async fn update_port(&self, id: &str, update: &PortUpdate) -> CloudResult<Port> {
        use neutron::port::set::{AllowedAddressPairsBuilder, FixedIpsBuilder, PortBuilder};
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
        if let Some(fixed) = &update.fixed_ips {
            let fixed = fixed
                .iter()
                .map(|f| {
                    let mut b = FixedIpsBuilder::default();
                    b.subnet_id(f.subnet_id.as_str());
                    if let Some(ip) = &f.ip_address {
                        b.ip_address(ip.as_str());
                    }
                    b.build()
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(bad_request(what))?;
            b.fixed_ips(fixed);
        }
        let req = neutron::port::set::Request::builder()
            .id(id)
            .port(b.build().map_err(bad_request(what))?)
            .build()
            .map_err(bad_request(what))?;
        let v = self.ask("neutron", "port", "update", what, req).await?;
        parse_port(what, &v)
    }

    async fn find_subnets(&self, network_id: &str, ip_version: u8) -> CloudResult<Vec<Subnet>> {
        let what = "listing subnets";
        let req = neutron::subnet::list::Request::builder()
            .network_id(network_id)
            .ip_version(i32::from(ip_version))
            .build()
            .map_err(bad_request(what))?;
        let v = self.ask("neutron", "subnet", "list", what, req).await?;
        // Filtered again: a server that ignores a query parameter must not hand us another network's subnet.
        Ok(parse_list(what, &v, parse_subnet)?
            .into_iter()
            .filter(|s| s.network_id == network_id && s.ip_version == ip_version)
            .collect())
    }

    async fn find_router_interfaces(&self, network_id: &str) -> CloudResult<Vec<Port>> {
        let what = "listing router interfaces";
        // One owner per query (Neutron filters on one value); a network's routers are all of one kind, so the
        // first owner with ports ends the search.
        for owner in ROUTER_INTERFACE_OWNERS {
            let req = neutron::port::list::Request::builder()
                .network_id(network_id)
                .device_owner(owner)
                .build()
                .map_err(bad_request(what))?;
            let v = self.ask("neutron", "port", "list", what, req).await?;
            // Filtered again: a server that ignores a query parameter must not hand us a server's port.
            let found: Vec<Port> = parse_list(what, &v, parse_port)?
                .into_iter()
                .filter(|p| p.network_id == network_id && p.device_owner == owner)
                .collect();
            if !found.is_empty() {
                return Ok(found);
            }
        }
        Ok(Vec::new())
    }

    async fn router_routes(&self, router_id: &str) -> CloudResult<Vec<Route>> {
        let what = "reading router";
        let req = neutron::router::get::Request::builder()
            .id(router_id)
            .build()
            .map_err(bad_request(what))?;
        let v = self.ask("neutron", "router", "get", what, req).await?;
        parse_router_routes(what, &v)
    }

    async fn add_router_routes(&self, router_id: &str, routes: &[Route]) -> CloudResult<()> {
        let what = "adding router routes";
        let req = extraroutes_request!(add_extraroutes, what, router_id, routes);
        self.ask("neutron", "router", "update", what, req)
            .await
            .map(|_| ())
    }

    async fn remove_router_routes(&self, router_id: &str, routes: &[Route]) -> CloudResult<()> {
        let what = "removing router routes";
        let req = extraroutes_request!(remove_extraroutes, what, router_id, routes);
        self.ask("neutron", "router", "update", what, req)
            .await
            .map(|_| ())
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
        let v = self.ask("nova", "servergroup", "list", what, req).await?;
        Ok(parse_list(what, &v, parse_server_group)?
            .into_iter()
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
        let v = self.ask("nova", "servergroup", "create", what, req).await?;
        parse_server_group(what, &v)
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
        let v = self.ask("nova", "server", "list", what, req).await?;
        Ok(parse_list(what, &v, parse_server)?
            .into_iter()
            .filter(|s| s.name == name)
            .collect())
    }

    async fn get_server(&self, id: &str) -> CloudResult<Server> {
        let what = "reading server";
        let req = nova::server::get_20::Request::builder()
            .id(id)
            .build()
            .map_err(bad_request(what))?;
        let v = self.ask("nova", "server", "get", what, req).await?;
        parse_server(what, &v)
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
        if spec.config_drive {
            b.config_drive(true);
        }
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
        let v = self.ask("nova", "server", "create", what, req).await?;
        // The create answer carries only the ID (and adminPass); the rest comes with the next get.
        Ok(Server {
            id: parse_created_server(what, &v)?,
            name: spec.name.clone(),
            status: "BUILD".into(),
            fault: None,
            created: None,
            config_drive: spec.config_drive,
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

#[cfg(test)]
mod tests {
    use super::*;
    use openstack_sdk::test::client::FakeOpenStackClient;
    use serde_json::json;
    use std::io::{Read, Write};

    /// A real HTTP server on loopback that answers every request with `status` and `body`.
    fn answering(status: &str, body: &'static str) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let status = status.to_string();
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = write!(
                    conn,
                    "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                     Connection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        format!("http://{addr}/v2.0/")
    }

    async fn get_port(status: &str, body: &'static str) -> CloudResult<Port> {
        let client = FakeOpenStackClient::new(answering(status, body));
        let req = neutron::port::get::Request::builder()
            .id("p1")
            .build()
            .unwrap();
        let v = answer("reading port", req, &client).await?;
        parse_port("reading port", &v)
    }

    /// openstack_sdk's `query_async` (which the calls used before) panics on a 2xx body that is JSON but not an
    /// object; `answer` names what came instead. Non-JSON bodies and the cloud's errors keep their meaning.
    #[tokio::test]
    async fn an_answer_that_is_not_an_object_is_an_error_not_a_panic() {
        let err = get_port("200 OK", "[]").await.unwrap_err();
        assert_eq!(err.kind, CloudErrorKind::Other);
        assert!(err.message.contains("\"port\""), "{err}");
        let err = get_port("200 OK", "{}").await.unwrap_err();
        assert!(err.message.contains("no \"port\""), "{err}");
        let err = get_port("200 OK", "not json").await.unwrap_err();
        assert!(err.message.contains("not JSON"), "{err}");
        let err = get_port(
            "404 Not Found",
            r#"{"NeutronError": {"message": "Port p1 could not be found"}}"#,
        )
        .await
        .unwrap_err();
        assert!(err.is_not_found(), "{err}");
        let port = get_port(
            "200 OK",
            r#"{"port": {"id": "p1", "name": "n", "network_id": "net", "device_id": "",
                "fixed_ips": [{"ip_address": "10.0.0.5", "subnet_id": "s"}], "security_groups": ["g"],
                "allowed_address_pairs": [{"ip_address": "10.0.0.9", "mac_address": "fa:16:3e:00:00:01"}]}}"#,
        )
        .await
        .unwrap();
        assert_eq!(port.primary_ip(), Some("10.0.0.5"));
        assert_eq!(port.allowed_address_pairs, ["10.0.0.9"]);
    }

    /// Before, a port range beyond 65535 was cut to 16 bits (70000 read as 4464) and a resource without an ID, or
    /// with a field of the wrong type, read as one with "" — silently, for the controllers to compare or delete.
    #[test]
    fn a_field_out_of_range_or_missing_is_named() {
        let rule = json!({"id": "r", "direction": "ingress", "ethertype": "IPv4", "protocol": "tcp",
            "port_range_min": 70000, "port_range_max": 70000});
        let err = parse_rule("w", &rule).unwrap_err();
        assert!(
            err.message.contains("security_group_rule.port_range_min"),
            "{err}"
        );
        let err = parse_fip(
            "w",
            &json!({"floating_ip_address": "1.2.3.4", "status": "DOWN"}),
        )
        .unwrap_err();
        assert!(err.message.contains("floatingip.id missing"), "{err}");
        let err = parse_server("w", &json!({"id": "s", "name": "n", "status": 3})).unwrap_err();
        assert!(err.message.contains("server.status is a number"), "{err}");
        let err = parse_rule(
            "w",
            &json!({"id": "r", "direction": "sideways", "ethertype": "IPv4"}),
        )
        .unwrap_err();
        assert!(err.message.contains("direction is \"sideways\""), "{err}");
        let err = parse_list("w", &json!({"ports": []}), parse_port).unwrap_err();
        assert!(err.message.contains("expected a list"), "{err}");
        let group = parse_server_group(
            "w",
            &json!({"id": "g", "name": "n", "policies": ["anti-affinity"]}),
        );
        assert_eq!(group.unwrap().policy, "anti-affinity");
    }

    #[test]
    fn a_subnet_needs_its_ip_version() {
        let subnet = parse_subnet(
            "w",
            &json!({"id": "s6", "network_id": "n", "ip_version": 6, "cidr": "2001:db8::/64"}),
        )
        .unwrap();
        assert_eq!(subnet.ip_version, 6);
        assert_eq!(subnet.cidr, "2001:db8::/64");
        for bad in [json!(5), json!("6"), serde_json::Value::Null] {
            let err = parse_subnet(
                "w",
                &json!({"id": "s", "network_id": "n", "ip_version": bad, "cidr": "10.0.0.0/8"}),
            )
            .unwrap_err();
            assert!(err.message.contains("subnet.ip_version"), "{err}");
        }
    }
}
