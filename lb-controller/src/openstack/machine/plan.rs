//! The machine controller's decisions, pure: the names of a machine's objects ([`machine_names`]), what the cloud
//! is asked for ([`machine_spec`]), whether the OpenStack steps are due ([`openstack_due`]), what to do about the
//! server ([`server_action`]), and the status fields this controller owns ([`status_patch`]).

use std::hash::{Hash, Hasher};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use lb_api::{LoadBalancer, LoadBalancerMachine, LoadBalancerMachineStatus};
use serde_json::{json, Value};

use super::rbac::MachineIdentity;
use super::resources::{MachineSpec, ServerState};

/// The OpenStack and Kubernetes names of a machine's objects (yawol's: server and RBAC objects `<lbm>`, VM port
/// `<namespace>/<lbm>`, so machines created by yawol are adopted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachineNames {
    /// Namespace of the machine (and of its RBAC objects).
    pub namespace: String,
    /// LoadBalancerMachine name; also the ServiceAccount, token Secret, Role and RoleBinding name.
    pub machine: String,
    /// Nova server name.
    pub server: String,
    /// Neutron VM port name.
    pub port: String,
}

/// The names of `lbm`'s objects.
pub fn machine_names(lbm: &LoadBalancerMachine) -> MachineNames {
    let namespace = lbm.namespace().unwrap_or_default();
    let machine = lbm.name_any();
    MachineNames {
        port: format!("{namespace}/{machine}"),
        server: machine.clone(),
        namespace,
        machine,
    }
}

/// Why the machine cannot proceed yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Blocked {
    /// The configuration is wrong and will not fix itself (Warning event `InvalidConfiguration`).
    Invalid(String),
    /// Something another controller provides is not there yet (poll).
    Waiting(String),
}

/// The cloud-side description of the machine from its spec and its LoadBalancer, without VIP addresses and user
/// data (those need cloud and API calls). Pure.
pub fn machine_spec(lbm: &LoadBalancerMachine, lb: &LoadBalancer) -> Result<MachineSpec, Blocked> {
    let names = machine_names(lbm);
    let infra = &lbm.spec.infrastructure;
    let network_id = infra.effective_network_id().ok_or_else(|| {
        Blocked::Invalid("spec.infrastructure.defaultNetwork.networkID is empty".into())
    })?;
    // Like yawol, only IDs are implemented for flavor and image.
    let flavor_id = infra.flavor.effective_id().ok_or_else(|| {
        Blocked::Invalid(
            "spec.infrastructure.flavor.flavorID is not set (names and searches are not supported)"
                .into(),
        )
    })?;
    let image_id = infra.image.effective_id().ok_or_else(|| {
        Blocked::Invalid(
            "spec.infrastructure.image.imageID is not set (names and searches are not supported)"
                .into(),
        )
    })?;
    let status = lb.status.clone().unwrap_or_default();
    let security_group_id = status
        .security_group_id
        .filter(|s| !s.is_empty())
        .ok_or_else(|| Blocked::Waiting("the LoadBalancer has no security group yet".into()))?;
    let debug = lb.spec.debug_settings();
    Ok(MachineSpec {
        name: names.server,
        port_name: names.port,
        network_id: network_id.to_string(),
        subnet_id: infra
            .default_network
            .subnet_id
            .clone()
            .filter(|s| !s.is_empty()),
        security_group_id,
        vip_addresses: Vec::new(),
        flavor_id: flavor_id.to_string(),
        image_id: image_id.to_string(),
        availability_zone: Some(infra.availability_zone.clone()).filter(|s| !s.is_empty()),
        additional_networks: infra
            .additional_networks()
            .iter()
            .map(|n| n.network_id.clone())
            .collect(),
        user_data: String::new(),
        key_name: debug
            .enabled
            .then(|| debug.sshkey_name.clone())
            .flatten()
            .filter(|k| !k.is_empty()),
        server_group_id: lbm.spec.server_group_id.clone().filter(|s| !s.is_empty()),
    })
}

/// Hash of what the cloud objects are made from (the spec before VIP addresses and user data, plus the VIP
/// fallback): a change runs the OpenStack steps before the resync is due.
pub fn inputs_hash(spec: &MachineSpec, lb: &LoadBalancer) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    format!("{spec:?}").hash(&mut h);
    // The IPv6 VIP too: an address added to the VIP port later must reach the allowed address pairs.
    lb.status
        .as_ref()
        .map(|s| (s.port_ip.clone(), s.port_ipv6.clone()))
        .hash(&mut h);
    h.finish()
}

/// Whether the OpenStack steps must run: no server or port recorded, inputs changed since the last ACTIVE pass (or
/// none since start), or the last pass is older than `resync`.
pub fn openstack_due(
    status: &LoadBalancerMachineStatus,
    applied: Option<u64>,
    inputs: u64,
    now: jiff::Timestamp,
    resync: Duration,
) -> bool {
    if status.server_id.is_none() || status.default_port_id.is_none() || applied != Some(inputs) {
        return true;
    }
    match &status.last_openstack_reconcile {
        None => true,
        Some(t) => now.duration_since(t.0).as_secs_f64() >= resync.as_secs_f64(),
    }
}

/// What to do about the recorded server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerAction {
    /// ACTIVE: done.
    Ready,
    /// Still building (Nova's status): poll.
    Wait(String),
    /// ERROR: delete it and boot a new one (Nova's fault text for the event).
    Replace(String),
    /// We deleted it and Nova still lists it: poll, never adopt it.
    AwaitDeletion,
    /// Gone: forget it (the next step finds or boots one).
    Forget,
}

/// The decision for a server in `state`; `deleting` when this controller already asked Nova to delete it.
pub fn server_action(state: &ServerState, deleting: bool) -> ServerAction {
    match state {
        ServerState::Gone => ServerAction::Forget,
        _ if deleting => ServerAction::AwaitDeletion,
        ServerState::Active => ServerAction::Ready,
        ServerState::Building(s) => ServerAction::Wait(s.clone()),
        ServerState::Error(fault) => ServerAction::Replace(fault.clone()),
    }
}

/// Status keys this controller owns (the agent owns `conditions` and `metrics`).
pub const OWNED_STATUS_KEYS: [&str; 10] = [
    "serverID",
    "creationTimestamp",
    "defaultPortID",
    "defaultPortName",
    "defaultPortIP",
    "serviceAccountName",
    "serviceAccountSecretName",
    "roleName",
    "roleBindingName",
    "lastOpenstackReconcile",
];

/// The merge patch that turns the owned fields of `old` into those of `new` (explicit nulls for cleared ones), or
/// `None` when they are equal — so a reconcile that changes nothing writes nothing and triggers no watch event.
pub fn status_patch(
    old: &LoadBalancerMachineStatus,
    new: &LoadBalancerMachineStatus,
) -> Option<Value> {
    let old = serde_json::to_value(old).unwrap_or_default();
    let new = serde_json::to_value(new).unwrap_or_default();
    let mut patch = serde_json::Map::new();
    for key in OWNED_STATUS_KEYS {
        let (a, b) = (old.get(key), new.get(key));
        if a != b {
            patch.insert(key.to_string(), b.cloned().unwrap_or(Value::Null));
        }
    }
    (!patch.is_empty()).then(|| json!({ "status": patch }))
}

/// `namespace/name`, as yawol records object names in the status.
pub fn qualified(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// The machine's identity for [`super::rbac`].
pub fn identity(lbm: &LoadBalancerMachine) -> MachineIdentity {
    let n = machine_names(lbm);
    MachineIdentity {
        namespace: n.namespace,
        machine: n.machine,
        machine_uid: lbm.uid().unwrap_or_default(),
        loadbalancer: lbm.spec.load_balancer_ref.name.clone(),
    }
}

/// A LoadBalancer carrying only what [`crate::openstack::clouds::CloudFactory::cloud_for`] reads (credentials
/// Secret, project), from the machine's own infrastructure copy: the machine can be cleaned up even when its
/// LoadBalancer is gone.
pub(super) fn credentials_key(lbm: &LoadBalancerMachine) -> LoadBalancer {
    let lb_ns = lb_namespace(lbm);
    serde_json::from_value(json!({
        "apiVersion": lb_api::constants::API_VERSION, "kind": "LoadBalancer",
        "metadata": {"name": lbm.spec.load_balancer_ref.name, "namespace": lb_ns},
        "spec": {"selector": {}, "infrastructure": lbm.spec.infrastructure},
    }))
    .expect("a LoadBalancer from a machine's infrastructure deserialises")
}

pub(super) fn lb_namespace(lbm: &LoadBalancerMachine) -> String {
    Some(lbm.spec.load_balancer_ref.namespace.clone())
        .filter(|s| !s.is_empty())
        .or_else(|| lbm.namespace())
        .unwrap_or_default()
}

/// `created` of a Nova server as a status time (now when Nova did not say).
pub(super) fn created_time(created: Option<&str>) -> Time {
    Time(
        created
            .and_then(|c| c.parse::<jiff::Timestamp>().ok())
            .unwrap_or_else(jiff::Timestamp::now),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lbm() -> LoadBalancerMachine {
        serde_json::from_value(json!({
            "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerMachine",
            "metadata": {"name": "web-abc-x1", "namespace": "yawol", "uid": "u1"},
            "spec": {
                "infrastructure": {
                    "defaultNetwork": {"networkID": "net", "subnetID": "sub"},
                    "additionalNetworks": [{"networkID": "extra"}],
                    "flavor": {"flavorID": "f"}, "image": {"imageID": "i"},
                    "availabilityZone": "az1", "authSecretRef": {"name": "cloud"}
                },
                "portID": "vip-port", "serverGroupID": "sg-group",
                "loadBalancerRef": {"name": "web", "namespace": "yawol"}
            }
        }))
        .unwrap()
    }

    fn lb(status: Value, annotations: Value) -> LoadBalancer {
        serde_json::from_value(json!({
            "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
            "metadata": {"name": "web", "namespace": "yawol", "annotations": annotations},
            "spec": {
                "selector": {}, "debugSettings": {"enabled": true, "sshkeyName": "key"},
                "infrastructure": {"flavor": {}, "image": {}, "authSecretRef": {}}
            },
            "status": status
        }))
        .unwrap()
    }

    #[test]
    fn names_follow_yawol() {
        let n = machine_names(&lbm());
        assert_eq!(n.server, "web-abc-x1");
        assert_eq!(n.port, "yawol/web-abc-x1");
        assert_eq!(qualified("yawol", "x"), "yawol/x");
        let id = identity(&lbm());
        assert_eq!(
            (id.machine_uid.as_str(), id.loadbalancer.as_str()),
            ("u1", "web")
        );
    }

    #[test]
    fn spec_from_machine_and_loadbalancer() {
        let l = lb(
            json!({"securityGroupID": "sg", "portIP": "10.0.0.5"}),
            json!({}),
        );
        let s = machine_spec(&lbm(), &l).unwrap();
        assert_eq!(s.name, "web-abc-x1");
        assert_eq!(s.port_name(), "yawol/web-abc-x1");
        assert_eq!(s.network_id, "net");
        assert_eq!(s.subnet_id.as_deref(), Some("sub"));
        assert_eq!(s.security_group_id, "sg");
        assert_eq!(s.availability_zone.as_deref(), Some("az1"));
        assert_eq!(s.additional_networks, ["extra"]);
        assert_eq!(s.key_name.as_deref(), Some("key"), "debug key pair");
        assert_eq!(s.server_group_id.as_deref(), Some("sg-group"));
        // Waiting for the LoadBalancer controller, or a configuration that will not work.
        assert!(matches!(
            machine_spec(&lbm(), &lb(json!({}), json!({}))),
            Err(Blocked::Waiting(_))
        ));
        let mut no_flavor = lbm();
        no_flavor.spec.infrastructure.flavor.flavor_id = None;
        no_flavor.spec.infrastructure.flavor.flavor_name = Some("m1".into());
        assert!(
            matches!(machine_spec(&no_flavor, &l), Err(Blocked::Invalid(m)) if m.contains("flavorID"))
        );
        // The VIP fallback is part of the inputs.
        let other = lb(
            json!({"securityGroupID": "sg", "portIP": "10.0.0.6"}),
            json!({}),
        );
        assert_ne!(inputs_hash(&s, &l), inputs_hash(&s, &other));
        assert_eq!(inputs_hash(&s, &l), inputs_hash(&s.clone(), &l));
    }

    #[test]
    fn openstack_pass_only_when_due() {
        let now = jiff::Timestamp::now();
        let ago = |s: i64| Some(Time(now - jiff::SignedDuration::from_secs(s)));
        let done = LoadBalancerMachineStatus {
            server_id: Some("s".into()),
            default_port_id: Some("p".into()),
            last_openstack_reconcile: ago(10),
            ..Default::default()
        };
        let resync = Duration::from_secs(300);
        assert!(!openstack_due(&done, Some(1), 1, now, resync));
        assert!(
            openstack_due(&done, Some(1), 2, now, resync),
            "inputs changed"
        );
        assert!(
            openstack_due(&done, None, 1, now, resync),
            "not verified since start"
        );
        let old = LoadBalancerMachineStatus {
            last_openstack_reconcile: ago(301),
            ..done.clone()
        };
        assert!(openstack_due(&old, Some(1), 1, now, resync), "resync");
        let building = LoadBalancerMachineStatus {
            last_openstack_reconcile: None,
            ..done.clone()
        };
        assert!(openstack_due(&building, Some(1), 1, now, resync));
        let no_server = LoadBalancerMachineStatus {
            server_id: None,
            ..done
        };
        assert!(openstack_due(&no_server, Some(1), 1, now, resync));
    }

    #[test]
    fn server_decisions() {
        use ServerState::*;
        assert_eq!(server_action(&Active, false), ServerAction::Ready);
        assert_eq!(
            server_action(&Building("BUILD".into()), false),
            ServerAction::Wait("BUILD".into())
        );
        assert_eq!(
            server_action(&Error("No valid host".into()), false),
            ServerAction::Replace("No valid host".into())
        );
        // A server we deleted is never adopted or replaced twice while Nova still lists it.
        assert_eq!(
            server_action(&Error("x".into()), true),
            ServerAction::AwaitDeletion
        );
        assert_eq!(server_action(&Active, true), ServerAction::AwaitDeletion);
        assert_eq!(server_action(&Gone, true), ServerAction::Forget);
        assert_eq!(server_action(&Gone, false), ServerAction::Forget);
    }

    #[test]
    fn status_patch_touches_only_owned_changed_fields() {
        let old = LoadBalancerMachineStatus {
            server_id: Some("s1".into()),
            default_port_id: Some("p".into()),
            metrics: Some(vec![]),
            ..Default::default()
        };
        assert_eq!(status_patch(&old, &old), None, "no write without a change");
        let mut new = old.clone();
        new.server_id = None;
        new.role_name = Some("yawol/m".into());
        new.metrics = None; // the agent's field: never patched
        assert_eq!(
            status_patch(&old, &new),
            Some(json!({"status": {"serverID": null, "roleName": "yawol/m"}}))
        );
    }

    #[test]
    fn credentials_come_from_the_machine() {
        let key = credentials_key(&lbm());
        assert_eq!(key.namespace().as_deref(), Some("yawol"));
        assert_eq!(key.name_any(), "web");
        assert_eq!(key.spec.infrastructure, lbm().spec.infrastructure);
    }

    #[test]
    fn created_time_parses_nova() {
        assert_eq!(
            created_time(Some("2026-01-01T00:00:00Z")).0.as_second(),
            1767225600
        );
        let t = created_time(None).0;
        assert!(jiff::Timestamp::now().duration_since(t).as_secs_f64() < 5.0);
    }
}
