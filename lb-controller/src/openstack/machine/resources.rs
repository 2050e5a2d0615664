//! The OpenStack half of the LoadBalancerMachine controller (VM port with the VIP as allowed address pair, server
//! with user data and server-group hint, ACTIVE/ERROR, deletion) and the machine health rules of yawol's LBM status
//! controller, as pure functions.

use crate::openstack::{
    Cloud, CloudError, CloudErrorKind, Port, PortSpec, PortUpdate, Server, ServerSpec,
};
use k8s_openapi::api::core::v1::NodeCondition;
use lb_api::constants::conditions;
use std::time::Duration;

/// What a machine needs from the cloud.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MachineSpec {
    /// Server name (yawol: `<lbm>`); also the port name when [`MachineSpec::port_name`] is empty.
    pub name: String,
    /// VM port name (yawol: `<namespace>/<lbm>`, kept so that machines created by yawol are adopted); empty: `name`.
    pub port_name: String,
    /// Default network of the VM port.
    pub network_id: String,
    /// Optional subnet of the VM port.
    pub subnet_id: Option<String>,
    /// The load balancer's security group.
    pub security_group_id: String,
    /// Fixed IPs of the VIP port: allowed address pairs, so VRRP can move the VIP onto this VM.
    pub vip_addresses: Vec<String>,
    /// Flavor ID.
    pub flavor_id: String,
    /// Image ID.
    pub image_id: String,
    /// Availability zone.
    pub availability_zone: Option<String>,
    /// Extra NICs.
    pub additional_networks: Vec<String>,
    /// Cloud-init.
    pub user_data: String,
    /// Debug key pair.
    pub key_name: Option<String>,
    /// Server group hint.
    pub server_group_id: Option<String>,
}

impl MachineSpec {
    /// The VM port's name.
    pub fn port_name(&self) -> &str {
        if self.port_name.is_empty() {
            &self.name
        } else {
            &self.port_name
        }
    }

    /// What Nova is asked to boot.
    pub fn server_spec(&self, port_id: &str) -> ServerSpec {
        ServerSpec {
            name: self.name.clone(),
            flavor_id: self.flavor_id.clone(),
            image_id: self.image_id.clone(),
            availability_zone: self.availability_zone.clone(),
            port_id: port_id.to_string(),
            additional_networks: self.additional_networks.clone(),
            user_data: self.user_data.clone(),
            key_name: self.key_name.clone(),
            server_group_id: self.server_group_id.clone(),
        }
    }
}

/// The VM port: adopted by name or created, with our security group and the VIP as allowed address pair (fixed
/// up when either differs).
pub async fn ensure_vm_port<C: Cloud>(cloud: &C, spec: &MachineSpec) -> Result<Port, CloudError> {
    let mut found = cloud.find_ports(spec.port_name()).await?;
    found.sort_by(|a, b| a.id.cmp(&b.id));
    let Some(port) = found.into_iter().next() else {
        return cloud
            .create_port(&PortSpec {
                name: spec.port_name().to_string(),
                network_id: spec.network_id.clone(),
                subnet_id: spec.subnet_id.clone(),
                security_groups: vec![spec.security_group_id.clone()],
                allowed_address_pairs: spec.vip_addresses.clone(),
            })
            .await;
    };
    let mut pairs = port.allowed_address_pairs.clone();
    pairs.sort();
    let mut want = spec.vip_addresses.clone();
    want.sort();
    if port.security_groups != [spec.security_group_id.clone()] || pairs != want {
        let update = PortUpdate {
            security_groups: Some(vec![spec.security_group_id.clone()]),
            allowed_address_pairs: Some(spec.vip_addresses.clone()),
        };
        return cloud.update_port(&port.id, &update).await;
    }
    Ok(port)
}

/// The server: adopted by name (an interrupted create must not boot a second VM) or booted on the VM port.
pub async fn ensure_server<C: Cloud>(
    cloud: &C,
    spec: &MachineSpec,
    port_id: &str,
) -> Result<Server, CloudError> {
    if let Some(s) = find_server(cloud, &spec.name, &[]).await? {
        return Ok(s);
    }
    cloud.create_server(&spec.server_spec(port_id)).await
}

/// The server named `name` to adopt, if any: the lowest ID, skipping `exclude` (servers this controller already
/// deleted: Nova lists them until they are gone, and adopting one would leave the machine without a VM).
pub async fn find_server<C: Cloud>(
    cloud: &C,
    name: &str,
    exclude: &[String],
) -> Result<Option<Server>, CloudError> {
    let mut found: Vec<Server> = cloud
        .find_servers(name)
        .await?
        .into_iter()
        .filter(|s| !exclude.contains(&s.id) && s.status != "DELETED")
        .collect();
    found.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(found.into_iter().next())
}

/// Where a server is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerState {
    /// Booted.
    Active,
    /// Still building (poll again later: the controller requeues instead of blocking a worker like yawol's 600 s
    /// synchronous wait).
    Building(String),
    /// ERROR: the machine must be replaced (Nova's fault message for the event).
    Error(String),
    /// Gone.
    Gone,
}

/// The server's state, one call.
pub async fn server_state<C: Cloud>(cloud: &C, id: &str) -> Result<ServerState, CloudError> {
    match cloud.get_server(id).await {
        Ok(s) if s.status == "ACTIVE" => Ok(ServerState::Active),
        Ok(s) if s.status == "ERROR" => Ok(ServerState::Error(
            s.fault.unwrap_or_else(|| "no fault message".into()),
        )),
        Ok(s) if s.status == "DELETED" => Ok(ServerState::Gone),
        Ok(s) => Ok(ServerState::Building(s.status)),
        Err(e) if e.is_not_found() => Ok(ServerState::Gone),
        Err(e) => Err(e),
    }
}

/// Polls until the server is ACTIVE (or fails on ERROR / after `timeout`). For tools and tests; the controller
/// uses [`server_state`] and requeues.
pub async fn wait_active<C: Cloud>(
    cloud: &C,
    id: &str,
    timeout: Duration,
) -> Result<(), CloudError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match server_state(cloud, id).await? {
            ServerState::Active => return Ok(()),
            ServerState::Error(fault) => {
                return Err(CloudError::new(
                    CloudErrorKind::Other,
                    "waiting for server",
                    format!("ERROR: {fault}"),
                ))
            }
            ServerState::Gone => {
                return Err(CloudError::new(
                    CloudErrorKind::NotFound,
                    "waiting for server",
                    id,
                ))
            }
            ServerState::Building(_) if tokio::time::Instant::now() > deadline => {
                return Err(CloudError::new(
                    CloudErrorKind::Unavailable,
                    "waiting for server",
                    "not ACTIVE in time",
                ))
            }
            ServerState::Building(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// Deletes the machine's servers (by ID and by name) and waits until Nova has released them (their ports cannot
/// go before), then the VM ports. Idempotent.
pub async fn delete_machine<C: Cloud>(
    cloud: &C,
    name: &str,
    server_id: Option<&str>,
    timeout: Duration,
) -> Result<(), CloudError> {
    let mut ids: Vec<String> = server_id.into_iter().map(str::to_string).collect();
    ids.extend(cloud.find_servers(name).await?.into_iter().map(|s| s.id));
    ids.sort();
    ids.dedup();
    for id in &ids {
        cloud.delete_server(id).await?;
    }
    let deadline = tokio::time::Instant::now() + timeout;
    for id in &ids {
        while server_state(cloud, id).await? != ServerState::Gone {
            if tokio::time::Instant::now() > deadline {
                return Err(CloudError::new(
                    CloudErrorKind::Unavailable,
                    "deleting server",
                    format!("{id} still there"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    for p in cloud.find_ports(name).await? {
        cloud.delete_port(&p.id).await?;
    }
    Ok(())
}

/// Where a non-blocking deletion stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeletionProgress {
    /// Servers and ports are gone.
    Done,
    /// Nova is still deleting these servers; call again later (the ports cannot go before them).
    Waiting(Vec<String>),
}

/// One non-blocking deletion step for a machine: asks Nova to delete every server of the machine (the recorded ID
/// and any with its name, so an interrupted create leaks nothing) that is still there, and once none is left deletes
/// the VM ports named `port_name`. Idempotent; the controller calls it again until [`DeletionProgress::Done`]
/// instead of sleeping in a worker like [`delete_machine`].
pub async fn delete_machine_step<C: Cloud>(
    cloud: &C,
    server_name: &str,
    port_name: &str,
    server_id: Option<&str>,
) -> Result<DeletionProgress, CloudError> {
    let mut ids: Vec<String> = server_id.into_iter().map(str::to_string).collect();
    ids.extend(
        cloud
            .find_servers(server_name)
            .await?
            .into_iter()
            .map(|s| s.id),
    );
    ids.sort();
    ids.dedup();
    let mut pending = Vec::new();
    for id in ids {
        if server_state(cloud, &id).await? == ServerState::Gone {
            continue;
        }
        match cloud.delete_server(&id).await {
            // Nova may refuse a second delete while the first one runs; it is still going away.
            Ok(()) => {}
            Err(e) if e.kind == CloudErrorKind::Conflict => {}
            Err(e) => return Err(e),
        }
        pending.push(id);
    }
    if !pending.is_empty() {
        return Ok(DeletionProgress::Waiting(pending));
    }
    for p in cloud.find_ports(port_name).await? {
        cloud.delete_port(&p.id).await?;
    }
    Ok(DeletionProgress::Done)
}

/// Conditions that must be True for a machine to be ready (our agent's names; yawol's Envoy* names are accepted
/// by the agent's compatibility layer, not here).
pub const READY_CONDITIONS: [&str; 3] = [
    conditions::CONFIG_READY,
    conditions::DATAPLANE_READY,
    conditions::DATAPLANE_UP_TO_DATE,
];

/// Heartbeats older than this make a machine unready.
pub const HEARTBEAT_STALE: Duration = Duration::from_secs(180);
/// A machine without any condition this long after creation is replaced.
pub const CREATION_TIMEOUT: Duration = Duration::from_secs(600);
/// An unready machine is marked for deletion after this long…
pub const UNREADY_BEFORE_MARK: Duration = Duration::from_secs(180);
/// …and deleted if still unready this long after the mark (the grace that protects healthy VMs from an API-server
/// outage: their heartbeats resume and the mark is removed).
pub const DELETION_GRACE: Duration = Duration::from_secs(120);

/// What the health check says about a machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// Ready.
    Ready,
    /// Not ready (yet); no action.
    Unready(String),
    /// Bad long enough: add the `MarkedForDeletion` condition.
    MarkForDeletion(String),
    /// Marked and still bad after the grace period: delete the LoadBalancerMachine.
    Delete(String),
    /// Marked but recovered: remove the mark.
    ClearMark,
}

fn age(now: jiff::Timestamp, t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time) -> Duration {
    let d = now.duration_since(t.0);
    Duration::from_secs_f64(d.as_secs_f64().max(0.0))
}

/// yawol's machine rules (seed 001): unready when there are no conditions, a heartbeat is older than 3 min, or a
/// required condition is missing/False; bad (to be replaced) when it has no conditions 10 min after creation
/// (`creation_timeout`), or has been unready for 3 more minutes; replacement goes through a `MarkedForDeletion`
/// mark and a 2-minute grace, so ~5 min for a dead VM.
pub fn machine_health(
    conditions: &[NodeCondition],
    created: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
    now: jiff::Timestamp,
    creation_timeout: Duration,
) -> Health {
    let mark = conditions
        .iter()
        .find(|c| c.type_ == conditions::MARKED_FOR_DELETION && c.status == conditions::TRUE);
    let relevant: Vec<&NodeCondition> = conditions
        .iter()
        .filter(|c| c.type_ != conditions::MARKED_FOR_DELETION)
        .collect();
    let mut reason = None;
    let mut bad_since: Option<Duration> = None;
    if relevant.is_empty() {
        reason = Some("no conditions reported yet".to_string());
        let a = age(now, created);
        if a > creation_timeout {
            bad_since = Some(a - creation_timeout + UNREADY_BEFORE_MARK);
        }
    } else {
        for c in &relevant {
            if let Some(hb) = &c.last_heartbeat_time {
                let a = age(now, hb);
                if a > HEARTBEAT_STALE {
                    reason.get_or_insert(format!("{} heartbeat {}s old", c.type_, a.as_secs()));
                    bad_since =
                        Some(bad_since.map_or(a - HEARTBEAT_STALE, |b| b.max(a - HEARTBEAT_STALE)));
                }
            }
        }
        for want in READY_CONDITIONS {
            match relevant.iter().find(|c| c.type_ == want) {
                None => {
                    reason.get_or_insert(format!("{want} missing"));
                    let a = age(now, created);
                    if a > creation_timeout {
                        bad_since = Some(
                            bad_since
                                .unwrap_or_default()
                                .max(a - creation_timeout + UNREADY_BEFORE_MARK),
                        );
                    }
                }
                Some(c) if c.status != conditions::TRUE => {
                    reason.get_or_insert(format!("{want} is {}", c.status));
                    let since = c
                        .last_transition_time
                        .as_ref()
                        .map(|t| age(now, t))
                        .unwrap_or_default();
                    bad_since = Some(bad_since.unwrap_or_default().max(since));
                }
                Some(_) => {}
            }
        }
    }
    match (reason, mark) {
        (None, None) => Health::Ready,
        (None, Some(_)) => Health::ClearMark,
        (Some(r), Some(m)) => {
            let marked_for = m
                .last_transition_time
                .as_ref()
                .map(|t| age(now, t))
                .unwrap_or_default();
            if marked_for >= DELETION_GRACE {
                Health::Delete(r)
            } else {
                Health::Unready(r)
            }
        }
        (Some(r), None) => match bad_since {
            Some(d) if d >= UNREADY_BEFORE_MARK => Health::MarkForDeletion(r),
            _ => Health::Unready(r),
        },
    }
}

/// Which machine a scale-down removes: unready first, then non-VRRP-master, else the first (names sorted for
/// determinism). Input: (name, ready, master).
pub fn scale_down_victim(machines: &[(String, bool, bool)]) -> Option<String> {
    let mut m: Vec<&(String, bool, bool)> = machines.iter().collect();
    m.sort_by(|a, b| a.0.cmp(&b.0));
    m.iter()
        .find(|x| !x.1)
        .or_else(|| m.iter().find(|x| !x.2))
        .or_else(|| m.first())
        .map(|x| x.0.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openstack::fake::FakeCloud;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn t(now: jiff::Timestamp, secs_ago: i64) -> Time {
        Time(now - jiff::SignedDuration::from_secs(secs_ago))
    }

    fn cond(type_: &str, status: &str, hb: Time, tr: Time) -> NodeCondition {
        NodeCondition {
            type_: type_.into(),
            status: status.into(),
            last_heartbeat_time: Some(hb),
            last_transition_time: Some(tr),
            ..Default::default()
        }
    }

    fn healthy(now: jiff::Timestamp) -> Vec<NodeCondition> {
        READY_CONDITIONS
            .iter()
            .map(|c| cond(c, "True", t(now, 10), t(now, 1000)))
            .collect()
    }

    #[test]
    fn health_rules() {
        let now = jiff::Timestamp::now();
        let created = t(now, 60);
        assert_eq!(
            machine_health(&healthy(now), &created, now, CREATION_TIMEOUT),
            Health::Ready
        );
        // Booting, no conditions: unready, not replaced before the creation timeout.
        assert!(matches!(
            machine_health(&[], &created, now, CREATION_TIMEOUT),
            Health::Unready(_)
        ));
        assert!(matches!(
            machine_health(&[], &t(now, 800), now, CREATION_TIMEOUT),
            Health::MarkForDeletion(_)
        ));
        // Stale heartbeat: unready after 3 min, marked after 6.
        let mut c = healthy(now);
        c[0].last_heartbeat_time = Some(t(now, 200));
        assert!(matches!(
            machine_health(&c, &created, now, CREATION_TIMEOUT),
            Health::Unready(_)
        ));
        c[0].last_heartbeat_time = Some(t(now, 400));
        assert!(matches!(
            machine_health(&c, &created, now, CREATION_TIMEOUT),
            Health::MarkForDeletion(_)
        ));
        // Marked: deleted only after the grace; recovered → mark cleared.
        let mut marked = c.clone();
        marked.push(cond(
            conditions::MARKED_FOR_DELETION,
            "True",
            t(now, 30),
            t(now, 30),
        ));
        assert!(matches!(
            machine_health(&marked, &created, now, CREATION_TIMEOUT),
            Health::Unready(_)
        ));
        marked.last_mut().unwrap().last_transition_time = Some(t(now, 130));
        assert!(matches!(
            machine_health(&marked, &created, now, CREATION_TIMEOUT),
            Health::Delete(_)
        ));
        let mut recovered = healthy(now);
        recovered.push(marked.last().unwrap().clone());
        assert_eq!(
            machine_health(&recovered, &created, now, CREATION_TIMEOUT),
            Health::ClearMark
        );
        // A False condition for 4 min.
        let mut f = healthy(now);
        f[1] = cond(conditions::DATAPLANE_READY, "False", t(now, 5), t(now, 240));
        assert!(matches!(
            machine_health(&f, &created, now, CREATION_TIMEOUT),
            Health::MarkForDeletion(_)
        ));
    }

    #[test]
    fn scale_down_order() {
        let m = |n: &str, r, k| (n.to_string(), r, k);
        assert_eq!(
            scale_down_victim(&[
                m("a", true, true),
                m("b", false, false),
                m("c", true, false)
            ])
            .unwrap(),
            "b"
        );
        assert_eq!(
            scale_down_victim(&[m("a", true, true), m("c", true, false)]).unwrap(),
            "c"
        );
        assert_eq!(
            scale_down_victim(&[m("b", true, true), m("a", true, true)]).unwrap(),
            "a"
        );
        assert_eq!(scale_down_victim(&[]), None);
    }

    #[tokio::test]
    async fn machine_lifecycle_on_the_fake() {
        let cloud = FakeCloud::new();
        let spec = MachineSpec {
            name: "yawol/lb-abc-x1".into(),
            network_id: "net".into(),
            security_group_id: "sg".into(),
            vip_addresses: vec!["198.51.100.10".into()],
            flavor_id: "f".into(),
            image_id: "i".into(),
            user_data: "#cloud-config\n".into(),
            ..Default::default()
        };
        let port = ensure_vm_port(&cloud, &spec).await.unwrap();
        assert_eq!(port.allowed_address_pairs, ["198.51.100.10"]);
        let server = ensure_server(&cloud, &spec, &port.id).await.unwrap();
        // Idempotent: adopted, not duplicated.
        assert_eq!(
            ensure_server(&cloud, &spec, &port.id).await.unwrap().id,
            server.id
        );
        assert_eq!(
            server_state(&cloud, &server.id).await.unwrap(),
            ServerState::Active
        );
        cloud.set_server_status(&server.id, "ERROR");
        assert!(matches!(
            server_state(&cloud, &server.id).await.unwrap(),
            ServerState::Error(_)
        ));
        delete_machine(&cloud, &spec.name, Some(&server.id), Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(cloud.counts(), (0, 0, 0, 0, 0));
    }

    #[tokio::test]
    async fn step_deletion_waits_for_nova_then_removes_ports() {
        let cloud = FakeCloud::new();
        let spec = MachineSpec {
            name: "lb-abc-x1".into(),
            port_name: "yawol/lb-abc-x1".into(),
            network_id: "net".into(),
            security_group_id: "sg".into(),
            vip_addresses: vec!["198.51.100.10".into()],
            ..Default::default()
        };
        let port = ensure_vm_port(&cloud, &spec).await.unwrap();
        assert_eq!(port.name, "yawol/lb-abc-x1", "yawol's port name");
        let server = ensure_server(&cloud, &spec, &port.id).await.unwrap();
        assert_eq!(server.name, "lb-abc-x1");
        // An orphan with the same name (an interrupted create) goes too.
        let orphan = cloud
            .create_server(&spec.server_spec(&port.id))
            .await
            .unwrap();
        cloud.set_server_delete_lag(2);
        let step = || delete_machine_step(&cloud, &spec.name, spec.port_name(), Some(&server.id));
        let mut waits = 0;
        while let DeletionProgress::Waiting(ids) = step().await.unwrap() {
            assert!(ids.contains(&orphan.id) || ids.contains(&server.id));
            assert_eq!(cloud.ports().len(), 1, "the port waits for the servers");
            waits += 1;
            assert!(waits < 10);
        }
        assert!(waits >= 1, "Nova's lag was observed");
        assert_eq!(cloud.counts(), (0, 0, 0, 0, 0));
        // Idempotent.
        assert_eq!(step().await.unwrap(), DeletionProgress::Done);
    }

    #[tokio::test]
    async fn find_server_skips_excluded_and_deleted() {
        let cloud = FakeCloud::new();
        let spec = MachineSpec {
            name: "m".into(),
            ..Default::default()
        };
        let a = cloud.create_server(&spec.server_spec("p")).await.unwrap();
        let b = cloud.create_server(&spec.server_spec("p")).await.unwrap();
        assert_eq!(
            find_server(&cloud, "m", &[]).await.unwrap().unwrap().id,
            a.id
        );
        assert_eq!(
            find_server(&cloud, "m", std::slice::from_ref(&a.id))
                .await
                .unwrap()
                .unwrap()
                .id,
            b.id
        );
        cloud.set_server_status(&b.id, "DELETED");
        assert_eq!(find_server(&cloud, "m", &[a.id]).await.unwrap(), None);
    }
}
