//! `FakeCloud`: an in-memory [`Cloud`] for unit tests of the reconcile logic (the integration tests use the real
//! OpenStack of `cargo xtask openstack up`). It keeps just enough state to make the controllers' decisions
//! observable (IDs, names, descriptions, associations) and lets tests inject errors per operation.
//!
//! For the machine controller it also keeps what servers were booted with ([`FakeCloud::server_spec`]), lets new
//! servers start in a chosen state with Nova's fault text ([`FakeCloud::push_new_server_state`]), and can make
//! deleted servers linger for a few reads the way Nova's asynchronous delete does
//! ([`FakeCloud::set_server_delete_lag`]).

use super::*;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

#[derive(Default)]
struct State {
    next_id: u64,
    security_groups: BTreeMap<String, SecurityGroup>,
    floating_ips: BTreeMap<String, FloatingIp>,
    ports: BTreeMap<String, Port>,
    subnets: BTreeMap<String, Subnet>,
    server_groups: BTreeMap<String, ServerGroup>,
    servers: BTreeMap<String, Server>,
    /// Router ID → its extra routes.
    routers: BTreeMap<String, BTreeSet<Route>>,
    /// Operation name (`create_floating_ip`) → errors to return, first first.
    faults: BTreeMap<String, Vec<CloudError>>,
    /// Status new servers get (`ACTIVE` unless a test wants `ERROR`/`BUILD`).
    new_server_status: Option<String>,
    /// (status, fault) for the next servers created, first first; then `new_server_status`.
    next_server_states: std::collections::VecDeque<(String, Option<String>)>,
    /// What each server was booted with.
    server_specs: BTreeMap<String, ServerSpec>,
    /// How many reads a deleted server stays visible for.
    delete_lag: u32,
    /// Deleted servers still visible: ID → reads left.
    lingering: BTreeMap<String, u32>,
    calls: Vec<String>,
}

/// In-memory fake of the cloud, named as a fake: never used outside tests.
#[derive(Default)]
pub struct FakeCloud {
    state: Mutex<State>,
}

impl FakeCloud {
    /// An empty project.
    pub fn new() -> Self {
        Self::default()
    }

    /// The next call of `operation` (a [`Cloud`] method name) fails with `kind` and `message`.
    pub fn fail_next(&self, operation: &str, kind: CloudErrorKind, message: &str) {
        self.state
            .lock()
            .unwrap()
            .faults
            .entry(operation.to_string())
            .or_default()
            .push(CloudError::new(kind, operation, message));
    }

    /// Adds a subnet to a network (the fake's addresses come from its CIDR's prefix: `2001:db8::/64` hands out
    /// `2001:db8::<n>`).
    pub fn add_subnet(&self, id: &str, network_id: &str, ip_version: u8, cidr: &str) {
        self.state.lock().unwrap().subnets.insert(
            id.to_string(),
            Subnet {
                id: id.to_string(),
                network_id: network_id.to_string(),
                ip_version,
                cidr: cidr.to_string(),
            },
        );
    }

    /// Adds a router with an interface on `subnet_id` of `network_id` at `address`.
    pub fn add_router(&self, router_id: &str, network_id: &str, subnet_id: &str, address: &str) {
        let mut st = self.state.lock().unwrap();
        st.routers.entry(router_id.to_string()).or_default();
        let id = format!("{router_id}-if-{subnet_id}");
        st.ports.insert(
            id.clone(),
            Port {
                id,
                name: String::new(),
                network_id: network_id.to_string(),
                fixed_ips: vec![FixedIp {
                    ip_address: address.to_string(),
                    subnet_id: subnet_id.to_string(),
                }],
                security_groups: vec![],
                allowed_address_pairs: vec![],
                device_id: router_id.to_string(),
                device_owner: ROUTER_INTERFACE_OWNERS[0].to_string(),
            },
        );
    }

    /// A router's extra routes, sorted.
    pub fn routes(&self, router_id: &str) -> Vec<Route> {
        self.state
            .lock()
            .unwrap()
            .routers
            .get(router_id)
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// A port as the fake holds it.
    pub fn port(&self, id: &str) -> Option<Port> {
        self.state.lock().unwrap().ports.get(id).cloned()
    }

    /// Status of servers created from now on.
    pub fn set_new_server_status(&self, status: &str) {
        self.state.lock().unwrap().new_server_status = Some(status.to_string());
    }

    /// Sets a server's status (e.g. ERROR after it was ACTIVE).
    pub fn set_server_status(&self, id: &str, status: &str) {
        if let Some(s) = self.state.lock().unwrap().servers.get_mut(id) {
            s.status = status.to_string();
        }
    }

    /// Sets a server's status and Nova's fault message (`ERROR` with "No valid host was found").
    pub fn set_server_fault(&self, id: &str, status: &str, fault: &str) {
        if let Some(s) = self.state.lock().unwrap().servers.get_mut(id) {
            s.status = status.to_string();
            s.fault = Some(fault.to_string());
        }
    }

    /// The next server created starts with `status` and `fault` (queued: one call per server).
    pub fn push_new_server_state(&self, status: &str, fault: Option<&str>) {
        self.state
            .lock()
            .unwrap()
            .next_server_states
            .push_back((status.to_string(), fault.map(str::to_string)));
    }

    /// The next `times` calls of `operation` fail with `kind` and `message`.
    pub fn fail_times(&self, operation: &str, kind: CloudErrorKind, message: &str, times: usize) {
        for _ in 0..times {
            self.fail_next(operation, kind, message);
        }
    }

    /// Deleted servers stay visible (listed and readable, unchanged) for `reads` more `get_server`/`find_servers`
    /// calls each, like Nova finishing a delete asynchronously. 0 (default): gone at once.
    pub fn set_server_delete_lag(&self, reads: u32) {
        self.state.lock().unwrap().delete_lag = reads;
    }

    /// All servers.
    pub fn servers(&self) -> Vec<Server> {
        self.state
            .lock()
            .unwrap()
            .servers
            .values()
            .cloned()
            .collect()
    }

    /// What a server was booted with (user data, port, server-group hint, …).
    pub fn server_spec(&self, id: &str) -> Option<ServerSpec> {
        self.state.lock().unwrap().server_specs.get(id).cloned()
    }

    /// How often `operation` was called so far.
    pub fn call_count(&self, operation: &str) -> usize {
        self.state
            .lock()
            .unwrap()
            .calls
            .iter()
            .filter(|c| *c == operation)
            .count()
    }

    /// Adds a floating IP that someone else allocated.
    pub fn add_floating_ip(&self, address: &str, description: &str) -> FloatingIp {
        let mut st = self.state.lock().unwrap();
        let id = next(&mut st, "fip");
        let fip = FloatingIp {
            id: id.clone(),
            address: address.into(),
            description: description.into(),
            port_id: None,
            status: "DOWN".into(),
        };
        st.floating_ips.insert(id, fip.clone());
        fip
    }

    /// Every call so far, by method name.
    pub fn calls(&self) -> Vec<String> {
        self.state.lock().unwrap().calls.clone()
    }

    /// Forgets the call log.
    pub fn clear_calls(&self) {
        self.state.lock().unwrap().calls.clear();
    }

    /// Counts of what exists: (security groups, floating IPs, ports, server groups, servers).
    pub fn counts(&self) -> (usize, usize, usize, usize, usize) {
        let st = self.state.lock().unwrap();
        (
            st.security_groups.len(),
            st.floating_ips.len(),
            st.ports.len(),
            st.server_groups.len(),
            st.servers.len(),
        )
    }

    /// All floating IPs.
    pub fn floating_ips(&self) -> Vec<FloatingIp> {
        self.state
            .lock()
            .unwrap()
            .floating_ips
            .values()
            .cloned()
            .collect()
    }

    /// All security groups.
    pub fn security_groups(&self) -> Vec<SecurityGroup> {
        self.state
            .lock()
            .unwrap()
            .security_groups
            .values()
            .cloned()
            .collect()
    }

    /// All ports.
    pub fn ports(&self) -> Vec<Port> {
        self.state.lock().unwrap().ports.values().cloned().collect()
    }

    fn enter(&self, op: &str) -> CloudResult<std::sync::MutexGuard<'_, State>> {
        let mut st = self.state.lock().unwrap();
        st.calls.push(op.to_string());
        if let Some(list) = st.faults.get_mut(op) {
            if !list.is_empty() {
                return Err(list.remove(0));
            }
        }
        Ok(st)
    }
}

/// One read of the lingering deleted servers: each loses a read; those out of reads are removed for good.
fn age_lingering(st: &mut State) {
    let mut gone = Vec::new();
    for (id, left) in st.lingering.iter_mut() {
        if *left == 0 {
            gone.push(id.clone());
        } else {
            *left -= 1;
        }
    }
    for id in gone {
        st.lingering.remove(&id);
        st.servers.remove(&id);
        st.server_specs.remove(&id);
        for p in st.ports.values_mut() {
            if p.device_id == id {
                p.device_id.clear();
            }
        }
    }
}

fn next(st: &mut State, kind: &str) -> String {
    st.next_id += 1;
    format!("{kind}-{}", st.next_id)
}

fn not_found(what: &str, id: &str) -> CloudError {
    CloudError::new(
        CloudErrorKind::NotFound,
        what,
        format!("{id} could not be found"),
    )
}

impl Cloud for FakeCloud {
    async fn find_security_groups(&self, name: &str) -> CloudResult<Vec<SecurityGroup>> {
        let st = self.enter("find_security_groups")?;
        Ok(st
            .security_groups
            .values()
            .filter(|g| g.name == name)
            .cloned()
            .collect())
    }

    async fn create_security_group(&self, name: &str) -> CloudResult<SecurityGroup> {
        let mut st = self.enter("create_security_group")?;
        let id = next(&mut st, "sg");
        // Neutron's two default egress rules.
        let mut rules = Vec::new();
        for ethertype in [EtherType::V4, EtherType::V6] {
            let rid = next(&mut st, "rule");
            rules.push(SecurityGroupRule {
                id: rid,
                spec: RuleSpec {
                    direction: Direction::Egress,
                    ethertype,
                    protocol: None,
                    port_range_min: None,
                    port_range_max: None,
                    remote_ip_prefix: None,
                    remote_group_id: None,
                },
            });
        }
        let sg = SecurityGroup {
            id: id.clone(),
            name: name.into(),
            rules,
        };
        st.security_groups.insert(id, sg.clone());
        Ok(sg)
    }

    async fn delete_security_group(&self, id: &str) -> CloudResult<()> {
        let mut st = self.enter("delete_security_group")?;
        if st
            .ports
            .values()
            .any(|p| p.security_groups.iter().any(|g| g == id))
        {
            return Err(CloudError::new(
                CloudErrorKind::Conflict,
                "deleting security group",
                "in use",
            ));
        }
        st.security_groups.remove(id);
        Ok(())
    }

    async fn create_security_group_rule(
        &self,
        security_group_id: &str,
        rule: &RuleSpec,
        _description: &str,
    ) -> CloudResult<SecurityGroupRule> {
        let mut st = self.enter("create_security_group_rule")?;
        let id = next(&mut st, "rule");
        let r = SecurityGroupRule {
            id,
            spec: rule.clone(),
        };
        let sg = st
            .security_groups
            .get_mut(security_group_id)
            .ok_or_else(|| not_found("creating rule", security_group_id))?;
        if sg.rules.iter().any(|x| x.spec == rule.clone()) {
            return Err(CloudError::new(
                CloudErrorKind::Conflict,
                "creating rule",
                "SecurityGroupRuleExists",
            ));
        }
        sg.rules.push(r.clone());
        Ok(r)
    }

    async fn delete_security_group_rule(&self, id: &str) -> CloudResult<()> {
        let mut st = self.enter("delete_security_group_rule")?;
        for sg in st.security_groups.values_mut() {
            sg.rules.retain(|r| r.id != id);
        }
        Ok(())
    }

    async fn find_floating_ips(&self, filter: &FloatingIpFilter) -> CloudResult<Vec<FloatingIp>> {
        let st = self.enter("find_floating_ips")?;
        Ok(st
            .floating_ips
            .values()
            .filter(|f| filter.address.as_ref().is_none_or(|a| &f.address == a))
            .filter(|f| {
                filter
                    .description
                    .as_ref()
                    .is_none_or(|d| &f.description == d)
            })
            .cloned()
            .collect())
    }

    async fn get_floating_ip(&self, id: &str) -> CloudResult<FloatingIp> {
        let st = self.enter("get_floating_ip")?;
        st.floating_ips
            .get(id)
            .cloned()
            .ok_or_else(|| not_found("reading floating IP", id))
    }

    async fn create_floating_ip(&self, _net: &str, description: &str) -> CloudResult<FloatingIp> {
        let mut st = self.enter("create_floating_ip")?;
        let id = next(&mut st, "fip");
        let address = format!("203.0.113.{}", st.next_id % 250 + 1);
        let fip = FloatingIp {
            id: id.clone(),
            address,
            description: description.into(),
            port_id: None,
            status: "DOWN".into(),
        };
        st.floating_ips.insert(id, fip.clone());
        Ok(fip)
    }

    async fn set_floating_ip_port(
        &self,
        id: &str,
        port_id: Option<&str>,
    ) -> CloudResult<FloatingIp> {
        let mut st = self.enter("set_floating_ip_port")?;
        let fip = st
            .floating_ips
            .get_mut(id)
            .ok_or_else(|| not_found("associating", id))?;
        fip.port_id = port_id.map(str::to_string);
        fip.status = if port_id.is_some() { "ACTIVE" } else { "DOWN" }.into();
        Ok(fip.clone())
    }

    async fn set_floating_ip_description(
        &self,
        id: &str,
        description: &str,
    ) -> CloudResult<FloatingIp> {
        let mut st = self.enter("set_floating_ip_description")?;
        let fip = st
            .floating_ips
            .get_mut(id)
            .ok_or_else(|| not_found("renaming", id))?;
        fip.description = description.into();
        Ok(fip.clone())
    }

    async fn delete_floating_ip(&self, id: &str) -> CloudResult<()> {
        let mut st = self.enter("delete_floating_ip")?;
        st.floating_ips.remove(id);
        Ok(())
    }

    async fn find_ports(&self, name: &str) -> CloudResult<Vec<Port>> {
        let st = self.enter("find_ports")?;
        Ok(st
            .ports
            .values()
            .filter(|p| p.name == name)
            .cloned()
            .collect())
    }

    async fn get_port(&self, id: &str) -> CloudResult<Port> {
        let st = self.enter("get_port")?;
        st.ports
            .get(id)
            .cloned()
            .ok_or_else(|| not_found("reading port", id))
    }

    async fn create_port(&self, spec: &PortSpec) -> CloudResult<Port> {
        let mut st = self.enter("create_port")?;
        let id = next(&mut st, "port");
        let port = Port {
            id: id.clone(),
            name: spec.name.clone(),
            network_id: spec.network_id.clone(),
            fixed_ips: vec![FixedIp {
                ip_address: format!("198.51.100.{}", st.next_id % 250 + 1),
                subnet_id: spec.subnet_id.clone().unwrap_or_else(|| "subnet".into()),
            }],
            security_groups: spec.security_groups.clone(),
            allowed_address_pairs: spec.allowed_address_pairs.clone(),
            device_id: String::new(),
            device_owner: String::new(),
        };
        st.ports.insert(id, port.clone());
        Ok(port)
    }

    async fn update_port(&self, id: &str, update: &PortUpdate) -> CloudResult<Port> {
        let mut st = self.enter("update_port")?;
        let st = &mut *st;
        let port = st
            .ports
            .get_mut(id)
            .ok_or_else(|| not_found("updating port", id))?;
        if let Some(g) = &update.security_groups {
            port.security_groups = g.clone();
        }
        if let Some(p) = &update.allowed_address_pairs {
            port.allowed_address_pairs = p.clone();
        }
        let Some(wanted) = &update.fixed_ips else {
            return Ok(port.clone());
        };
        let mut fixed = Vec::new();
        for request in wanted {
            let ip_address = match &request.ip_address {
                Some(ip) => ip.clone(),
                None => {
                    let Some(subnet) = st.subnets.get(&request.subnet_id) else {
                        return Err(CloudError::new(
                            CloudErrorKind::BadRequest,
                            "updating port",
                            format!("subnet {} not found", request.subnet_id),
                        ));
                    };
                    let prefix = subnet.cidr.split('/').next().unwrap_or_default();
                    let n = st.next_id % 250 + 1;
                    st.next_id += 1;
                    if subnet.ip_version == 6 {
                        format!("{}::{n:x}", prefix.trim_end_matches(':'))
                    } else {
                        let base: Vec<&str> = prefix.split('.').take(3).collect();
                        format!("{}.{n}", base.join("."))
                    }
                }
            };
            fixed.push(FixedIp {
                ip_address,
                subnet_id: request.subnet_id.clone(),
            });
        }
        let port = st.ports.get_mut(id).expect("looked up above");
        port.fixed_ips = fixed;
        Ok(port.clone())
    }

    async fn find_subnets(&self, network_id: &str, ip_version: u8) -> CloudResult<Vec<Subnet>> {
        let st = self.enter("find_subnets")?;
        Ok(st
            .subnets
            .values()
            .filter(|s| s.network_id == network_id && s.ip_version == ip_version)
            .cloned()
            .collect())
    }

    async fn find_router_interfaces(&self, network_id: &str) -> CloudResult<Vec<Port>> {
        let st = self.enter("find_router_interfaces")?;
        Ok(st
            .ports
            .values()
            .filter(|p| {
                p.network_id == network_id
                    && ROUTER_INTERFACE_OWNERS.contains(&p.device_owner.as_str())
            })
            .cloned()
            .collect())
    }

    async fn router_routes(&self, router_id: &str) -> CloudResult<Vec<Route>> {
        let st = self.enter("router_routes")?;
        st.routers
            .get(router_id)
            .map(|r| r.iter().cloned().collect())
            .ok_or_else(|| not_found("reading router", router_id))
    }

    async fn add_router_routes(&self, router_id: &str, routes: &[Route]) -> CloudResult<()> {
        let mut st = self.enter("add_router_routes")?;
        let router = st
            .routers
            .get_mut(router_id)
            .ok_or_else(|| not_found("adding router routes", router_id))?;
        router.extend(routes.iter().cloned());
        Ok(())
    }

    async fn remove_router_routes(&self, router_id: &str, routes: &[Route]) -> CloudResult<()> {
        let mut st = self.enter("remove_router_routes")?;
        let router = st
            .routers
            .get_mut(router_id)
            .ok_or_else(|| not_found("removing router routes", router_id))?;
        for r in routes {
            router.remove(r);
        }
        Ok(())
    }

    async fn delete_port(&self, id: &str) -> CloudResult<()> {
        let mut st = self.enter("delete_port")?;
        st.ports.remove(id);
        // Neutron disassociates floating IPs of a deleted port.
        for f in st.floating_ips.values_mut() {
            if f.port_id.as_deref() == Some(id) {
                f.port_id = None;
            }
        }
        Ok(())
    }

    async fn find_server_groups(&self, name: &str) -> CloudResult<Vec<ServerGroup>> {
        let st = self.enter("find_server_groups")?;
        Ok(st
            .server_groups
            .values()
            .filter(|g| g.name == name)
            .cloned()
            .collect())
    }

    async fn create_server_group(&self, name: &str, policy: &str) -> CloudResult<ServerGroup> {
        let mut st = self.enter("create_server_group")?;
        let id = next(&mut st, "sgrp");
        let g = ServerGroup {
            id: id.clone(),
            name: name.into(),
            policy: policy.into(),
        };
        st.server_groups.insert(id, g.clone());
        Ok(g)
    }

    async fn delete_server_group(&self, id: &str) -> CloudResult<()> {
        let mut st = self.enter("delete_server_group")?;
        st.server_groups.remove(id);
        Ok(())
    }

    async fn find_servers(&self, name: &str) -> CloudResult<Vec<Server>> {
        let mut st = self.enter("find_servers")?;
        age_lingering(&mut st);
        Ok(st
            .servers
            .values()
            .filter(|s| s.name == name)
            .cloned()
            .collect())
    }

    async fn get_server(&self, id: &str) -> CloudResult<Server> {
        let mut st = self.enter("get_server")?;
        age_lingering(&mut st);
        st.servers
            .get(id)
            .cloned()
            .ok_or_else(|| not_found("reading server", id))
    }

    async fn create_server(&self, spec: &ServerSpec) -> CloudResult<Server> {
        let mut st = self.enter("create_server")?;
        let id = next(&mut st, "server");
        let (status, fault) = st.next_server_states.pop_front().unwrap_or_else(|| {
            (
                st.new_server_status
                    .clone()
                    .unwrap_or_else(|| "ACTIVE".into()),
                None,
            )
        });
        let server = Server {
            id: id.clone(),
            name: spec.name.clone(),
            status,
            fault,
            created: Some("2026-01-01T00:00:00Z".into()),
            config_drive: spec.config_drive,
        };
        if let Some(p) = st.ports.get_mut(&spec.port_id) {
            p.device_id = id.clone();
        }
        st.servers.insert(id.clone(), server.clone());
        st.server_specs.insert(id, spec.clone());
        Ok(server)
    }

    async fn delete_server(&self, id: &str) -> CloudResult<()> {
        let mut st = self.enter("delete_server")?;
        if st.delete_lag > 0 && st.servers.contains_key(id) {
            // Nova: accepted, still there for a while.
            if !st.lingering.contains_key(id) {
                let lag = st.delete_lag;
                st.lingering.insert(id.to_string(), lag);
            }
            return Ok(());
        }
        st.servers.remove(id);
        st.server_specs.remove(id);
        for p in st.ports.values_mut() {
            if p.device_id == id {
                p.device_id.clear();
            }
        }
        Ok(())
    }
}
