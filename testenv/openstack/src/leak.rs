//! The leak check: lists every resource in the test project and fails on anything a test left behind.
//!
//! Checked: servers, ports, floating IPs, security groups, server groups, plus routers, the baseline router's extra
//! routes and networks. What `up` created for every test (the project's network `lbtest-net` with its router, the router's ports, the `default`
//! security group) is the baseline and not a leak. Run it when no other test of the project is in flight (the
//! `openstack` stage runs the integration tests one at a time), or give the resources of a test a name prefix and
//! check with [`LeakCheck::only_prefixed`].

use crate::env::TestEnv;
use anyhow::{bail, Context, Result};
use openstack_sdk::api::{compute, network, QueryAsync};
use openstack_sdk::AsyncOpenStack;
use serde_json::Value;
use std::fmt;

/// One resource found in the project.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    /// `server`, `port`, `floating IP`, `security group`, `server group`, `router`, `router route` (ID: the
    /// router's, name: the destination, detail: the next hop), `network`.
    pub kind: &'static str,
    /// Its ID.
    pub id: String,
    /// Its name (a floating IP's description, which has no name).
    pub name: String,
    /// A detail that helps find the test that left it (status, device owner, address).
    pub detail: String,
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {:?}", self.kind, self.id, self.name)?;
        if !self.detail.is_empty() {
            write!(f, " ({})", self.detail)?;
        }
        Ok(())
    }
}

/// Lists the project's resources, minus the baseline.
pub struct LeakCheck<'a> {
    env: &'a TestEnv,
    prefix: Option<String>,
}

impl<'a> LeakCheck<'a> {
    /// Checks every resource of the test project.
    pub fn new(env: &'a TestEnv) -> Self {
        LeakCheck { env, prefix: None }
    }

    /// Checks only resources whose name starts with `prefix` (and, for ports and floating IPs, which carry no name
    /// when Nova or a test creates them, those attached to such a server or port): for tests that run in parallel.
    pub fn only_prefixed(mut self, prefix: &str) -> Self {
        self.prefix = Some(prefix.to_string());
        self
    }

    /// Every resource that is not part of the baseline.
    pub async fn find(&self, client: &AsyncOpenStack) -> Result<Vec<Resource>> {
        let info = &self.env.info;
        let mut found = Vec::new();

        let servers = list(
            client,
            compute::v2::server::list_detailed_21::Request::builder().build()?,
            "servers",
        )
        .await?;
        for s in &servers {
            found.push(resource("server", s, str_field(s, "status")));
        }

        let groups = list(
            client,
            compute::v2::server_group::list_20::Request::builder().build()?,
            "server groups",
        )
        .await?;
        for g in &groups {
            found.push(resource("server group", g, format!("policy {}", policy(g))));
        }

        let ports = list(
            client,
            network::v2::port::list::Request::builder()
                .tenant_id(info.project_id.as_str())
                .build()?,
            "ports",
        )
        .await?;
        for p in &ports {
            // The baseline router's interface and gateway ports come and go with the router.
            if str_field(p, "device_id") == info.router_id {
                continue;
            }
            let detail = format!(
                "device_owner {:?}, device_id {:?}",
                str_field(p, "device_owner"),
                str_field(p, "device_id")
            );
            found.push(resource("port", p, detail));
        }

        let fips = list(
            client,
            network::v2::floatingip::list::Request::builder()
                .tenant_id(info.project_id.as_str())
                .build()?,
            "floating IPs",
        )
        .await?;
        for f in &fips {
            let detail = format!(
                "{} on port {:?}",
                str_field(f, "floating_ip_address"),
                str_field(f, "port_id")
            );
            let mut r = resource("floating IP", f, detail);
            if r.name.is_empty() {
                r.name = str_field(f, "description");
            }
            found.push(r);
        }

        let sgs = list(
            client,
            network::v2::security_group::list::Request::builder()
                .tenant_id(info.project_id.as_str())
                .build()?,
            "security groups",
        )
        .await?;
        for g in sgs.iter().filter(|g| str_field(g, "name") != "default") {
            found.push(resource("security group", g, String::new()));
        }

        let routers = list(
            client,
            network::v2::router::list::Request::builder()
                .tenant_id(info.project_id.as_str())
                .build()?,
            "routers",
        )
        .await?;
        for r in &routers {
            if str_field(r, "id") != info.router_id {
                found.push(resource("router", r, String::new()));
                continue;
            }
            // The baseline router has no extra routes: one left is an active-active VIP's that outlived it.
            for route in r
                .get("routes")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                found.push(Resource {
                    kind: "router route",
                    id: info.router_id.clone(),
                    name: str_field(route, "destination"),
                    detail: format!("via {}", str_field(route, "nexthop")),
                });
            }
        }

        let networks = list(
            client,
            network::v2::network::list::Request::builder()
                .tenant_id(info.project_id.as_str())
                .build()?,
            "networks",
        )
        .await?;
        for n in networks
            .iter()
            .filter(|n| str_field(n, "id") != info.network_id)
        {
            found.push(resource("network", n, String::new()));
        }

        if let Some(prefix) = &self.prefix {
            found = filter_prefixed(found, &servers, &ports, prefix);
        }
        Ok(found)
    }

    /// Fails with the list of everything left behind.
    pub async fn assert_clean(&self, client: &AsyncOpenStack) -> Result<()> {
        let leaks = self.find(client).await?;
        if !leaks.is_empty() {
            let list: Vec<String> = leaks.iter().map(|r| format!("  - {r}")).collect();
            bail!(
                "leak check: {} resource(s) left in project {} ({}):\n{}",
                leaks.len(),
                self.env.info.project_name,
                self.env.info.project_id,
                list.join("\n")
            );
        }
        Ok(())
    }
}

/// Keeps resources named with `prefix`, plus nameless ports of such servers or such ports' floating IPs.
fn filter_prefixed(
    found: Vec<Resource>,
    servers: &[Value],
    ports: &[Value],
    prefix: &str,
) -> Vec<Resource> {
    let server_ids: Vec<String> = servers
        .iter()
        .filter(|s| str_field(s, "name").starts_with(prefix))
        .map(|s| str_field(s, "id"))
        .collect();
    let port_ids: Vec<String> = ports
        .iter()
        .filter(|p| {
            str_field(p, "name").starts_with(prefix)
                || server_ids.contains(&str_field(p, "device_id"))
        })
        .map(|p| str_field(p, "id"))
        .collect();
    found
        .into_iter()
        .filter(|r| {
            r.name.starts_with(prefix)
                || (r.kind == "port" && port_ids.contains(&r.id))
                || (r.kind == "floating IP"
                    && port_ids.iter().any(|p| r.detail.contains(p.as_str())))
        })
        .collect()
}

async fn list<E>(client: &AsyncOpenStack, endpoint: E, what: &str) -> Result<Vec<Value>>
where
    E: QueryAsync<Vec<Value>, AsyncOpenStack>,
{
    endpoint
        .query_async(client)
        .await
        .with_context(|| format!("leak check: listing {what}"))
}

fn resource(kind: &'static str, v: &Value, detail: String) -> Resource {
    Resource {
        kind,
        id: str_field(v, "id"),
        name: str_field(v, "name"),
        detail,
    }
}

fn str_field(v: &Value, key: &str) -> String {
    v.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

/// `policy` (microversion 2.64+) or `policies[0]` (older).
fn policy(group: &Value) -> String {
    group
        .get("policy")
        .and_then(Value::as_str)
        .or_else(|| {
            group
                .get("policies")
                .and_then(|p| p.get(0))
                .and_then(Value::as_str)
        })
        .unwrap_or_default()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prefix_filter_keeps_named_resources_and_their_nameless_ports_and_fips() {
        let servers = vec![
            json!({"id": "s1", "name": "t1-vm"}),
            json!({"id": "s2", "name": "other"}),
        ];
        let ports = vec![
            json!({"id": "p1", "name": "", "device_id": "s1"}),
            json!({"id": "p2", "name": "", "device_id": "s2"}),
        ];
        let r = |kind, id: &str, name: &str, detail: &str| Resource {
            kind,
            id: id.into(),
            name: name.into(),
            detail: detail.into(),
        };
        let found = vec![
            r("server", "s1", "t1-vm", ""),
            r("server", "s2", "other", ""),
            r("port", "p1", "", ""),
            r("port", "p2", "", ""),
            r("floating IP", "f1", "", "203.0.113.5 on port \"p1\""),
            r("floating IP", "f2", "", "203.0.113.6 on port \"p2\""),
        ];
        let kept: Vec<String> = filter_prefixed(found, &servers, &ports, "t1-")
            .into_iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(kept, ["s1", "p1", "f1"]);
    }
}
