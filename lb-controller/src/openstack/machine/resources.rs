//! A machine's OpenStack resources, the steps of the LoadBalancerMachine controller against [`Cloud`]: the VM port
//! with the VIP as allowed address pair, the server with user data and server-group hint (adopted by name), its
//! state (ACTIVE / building / ERROR with Nova's fault / gone), and deletion (servers, then ports).

use crate::openstack::{
    Cloud, CloudError, CloudErrorKind, Port, PortSpec, PortUpdate, Server, ServerSpec,
};
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
            // The user data on a disk of the VM: cloud-init's ConfigDrive datasource reads it without a metadata
            // service and without asking the DMI whether this is OpenStack (cloud-init 22.4, the image's, refuses
            // its OpenStack datasource on VMs whose DMI does not say so). image/README.md, "User data".
            config_drive: true,
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
            fixed_ips: None,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openstack::fake::FakeCloud;

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
