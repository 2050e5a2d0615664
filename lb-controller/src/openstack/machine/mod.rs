//! The LoadBalancerMachine controller (control cluster, yawol-controller's LBM role): per machine the Kubernetes
//! access of its agent ([`rbac`]), the VM port with the VIP as allowed address pair and the server booted
//! with [`cloudinit`] user data in the LoadBalancer's server group ([`resources`]), the status fields
//! saved after each step, and deletion (server, then port, then the RBAC objects, then the finalizer
//! `yawol.stackit.cloud/controller4`). Metrics in [`metrics`].
//!
//! Nothing blocks a worker: waiting for the token controller, for Nova to report ACTIVE or to finish a delete is a
//! requeue after [`LbmControllerConfig::poll`]. A server in ERROR is deleted and booted again, with a Warning event
//! carrying Nova's fault text. OpenStack errors become Warning events (on the machine and on its LoadBalancer, so
//! the cloud controller forwards them to the Service) and `loadbalancermachine_openstack_errors_total`; the status
//! keeps what exists and the reconcile is retried with exponential backoff. Every OpenStack object is found by
//! name before it is created, so an interrupted reconcile resumes instead of duplicating.
//!
//! The decisions are pure functions ([`machine_spec`], [`openstack_due`], [`server_action`], [`status_patch`],
//! [`backoff`], …) with unit tests; [`reconcile`] only sequences them with the API calls.

pub mod cloudinit;
pub mod metrics;
pub mod rbac;
pub mod resources;

use std::collections::HashMap;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, Client, Resource, ResourceExt};
use lb_api::constants::{finalizers, lb_annotations, sync};
use lb_api::ha::HaSettings;

use lb_api::{LoadBalancer, LoadBalancerMachine, LoadBalancerMachineStatus};
use serde_json::{json, Value};
use tracing::{debug, info, warn};

use crate::openstack::clouds::CloudFactory;
use crate::openstack::{Cloud, CloudError};
use crate::runtime::events::{EventPublisher, EventType};
use crate::runtime::finalizer;
use crate::runtime::retry::Retries;
use cloudinit::UserDataParams;
use metrics::LbmMetrics;
use rbac::MachineIdentity;
use resources::{DeletionProgress, MachineSpec, ServerState};

/// Field manager of the server-side applied RBAC objects.
pub const FIELD_MANAGER: &str = "lb-controller";

/// Settings of the LoadBalancerMachine controller.
#[derive(Clone, Debug)]
pub struct LbmControllerConfig {
    /// API server URL as the VMs reach it, written into their kubeconfig (yawol's `API_ENDPOINT`). Without it no
    /// server is booted (a Warning event says why): the agent could not reach its objects.
    pub api_endpoint: Option<String>,
    /// NTP servers/pools for the VMs' chrony.
    pub ntp_servers: Vec<String>,
    /// The VM interface carrying the VIP.
    pub interface: String,
    /// OpenStack resync of a machine whose server is ACTIVE (yawol: 5 min); also the steady-state requeue.
    pub resync: Duration,
    /// Poll interval while waiting (token, server ACTIVE, server deletion, LoadBalancer prerequisites).
    pub poll: Duration,
    /// First retry after an error; doubled per consecutive failure…
    pub error_backoff_base: Duration,
    /// …up to this.
    pub error_backoff_max: Duration,
}

impl Default for LbmControllerConfig {
    fn default() -> Self {
        LbmControllerConfig {
            api_endpoint: None,
            ntp_servers: vec!["pool.ntp.org".into()],
            interface: "eth0".into(),
            resync: Duration::from_secs(300),
            poll: Duration::from_secs(2),
            error_backoff_base: Duration::from_secs(2),
            error_backoff_max: Duration::from_secs(300),
        }
    }
}

/// Errors of one reconcile (logged, retried with [`backoff`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Kubernetes API.
    #[error("kubernetes: {0}")]
    Kube(#[from] kube::Error),
    /// No cloud session (credentials Secret, authentication).
    #[error("openstack credentials: {0:#}")]
    Credentials(anyhow::Error),
    /// An OpenStack step failed.
    #[error("{step}: {error}")]
    OpenStack {
        /// Which step (`port`, `server`, …).
        step: &'static str,
        /// The cloud's error.
        error: CloudError,
    },
}

/// What the controller remembers between reconciles (lost on restart, which only costs one extra OpenStack pass).
#[derive(Default)]
struct Memory {
    /// Servers this controller asked Nova to delete and that may still be listed → their machine (`ns/name`).
    deleting: HashMap<String, String>,
    /// Per machine: hash of the inputs of the last pass that ended with an ACTIVE server.
    applied: HashMap<String, u64>,
    /// Per machine: RBAC objects and VM port done for these inputs, so polls for ACTIVE only ask Nova.
    prepared: HashMap<String, Prepared>,
}

/// RBAC and VM port of a machine, as the last full pass left them.
struct Prepared {
    inputs: u64,
    at: std::time::Instant,
    port_id: String,
    vip: String,
}

/// Shared state of the controller.
pub struct LbmContext<F: CloudFactory> {
    /// Control-cluster client.
    pub client: Client,
    /// Cloud sessions (keyed by the machine's `spec.infrastructure`: auth Secret and project).
    pub clouds: F,
    /// Events on the machines and their LoadBalancers.
    pub events: Arc<EventPublisher>,
    /// `loadbalancermachine*` metrics.
    pub metrics: Arc<LbmMetrics>,
    /// Settings.
    pub config: LbmControllerConfig,
    /// Where reconciles are counted (`lb_cloud_controller_reconciles_total{controller="loadbalancermachine"}` and
    /// the duration histogram), next to the other two controllers'; [`prepare`] sets it.
    pub controller_metrics: Option<Arc<crate::metrics::Metrics>>,
    memory: Mutex<Memory>,
    /// Failures per machine (`ns/name`), for the error policy's backoff.
    retries: Retries<String>,
}

impl<F: CloudFactory> LbmContext<F> {
    /// A context; `events` should use yawol's `yawol-service` component so the back channel forwards them.
    pub fn new(
        client: Client,
        clouds: F,
        events: Arc<EventPublisher>,
        metrics: Arc<LbmMetrics>,
        config: LbmControllerConfig,
    ) -> Self {
        LbmContext {
            client,
            clouds,
            events,
            metrics,
            controller_metrics: None,
            memory: Mutex::default(),
            retries: Retries::new(config.error_backoff_base, config.error_backoff_max),
            config,
        }
    }

    fn mem<T>(&self, f: impl FnOnce(&mut Memory) -> T) -> T {
        f(&mut self.memory.lock().unwrap())
    }
}

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
    lb.status
        .as_ref()
        .and_then(|s| s.port_ip.clone())
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

/// The VRRP router ID from the LoadBalancer's `vrrpRouterID` annotation (1..=255).
pub fn router_id(lb: &LoadBalancer) -> Option<u8> {
    let v: u16 = lb
        .annotations()
        .get(lb_annotations::VRRP_ROUTER_ID)?
        .trim()
        .parse()
        .ok()?;
    u8::try_from(v).ok().filter(|id| *id != 0)
}

/// `namespace/name`, as yawol records object names in the status.
pub fn qualified(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// The machine's identity for [`rbac`].
pub fn identity(lbm: &LoadBalancerMachine) -> MachineIdentity {
    let n = machine_names(lbm);
    MachineIdentity {
        namespace: n.namespace,
        machine: n.machine,
        machine_uid: lbm.uid().unwrap_or_default(),
        loadbalancer: lbm.spec.load_balancer_ref.name.clone(),
    }
}

/// A LoadBalancer carrying only what [`CloudFactory::cloud_for`] reads (credentials Secret, project), from the
/// machine's own infrastructure copy: the machine can be cleaned up even when its LoadBalancer is gone.
fn credentials_key(lbm: &LoadBalancerMachine) -> LoadBalancer {
    let lb_ns = lb_namespace(lbm);
    serde_json::from_value(json!({
        "apiVersion": lb_api::constants::API_VERSION, "kind": "LoadBalancer",
        "metadata": {"name": lbm.spec.load_balancer_ref.name, "namespace": lb_ns},
        "spec": {"selector": {}, "infrastructure": lbm.spec.infrastructure},
    }))
    .expect("a LoadBalancer from a machine's infrastructure deserialises")
}

fn lb_namespace(lbm: &LoadBalancerMachine) -> String {
    Some(lbm.spec.load_balancer_ref.namespace.clone())
        .filter(|s| !s.is_empty())
        .or_else(|| lbm.namespace())
        .unwrap_or_default()
}

/// The machine's status as saved so far; [`StatusWriter::save`] patches only what changed.
struct StatusWriter {
    api: Api<LoadBalancerMachine>,
    name: String,
    saved: LoadBalancerMachineStatus,
    now: LoadBalancerMachineStatus,
}

impl StatusWriter {
    async fn save(&mut self) -> Result<(), kube::Error> {
        if let Some(patch) = status_patch(&self.saved, &self.now) {
            self.api
                .patch_status(&self.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            self.saved = self.now.clone();
        }
        Ok(())
    }
}

/// Event targets of one reconcile and the OpenStack error path.
struct Scope<'a, F: CloudFactory> {
    ctx: &'a LbmContext<F>,
    machine: ObjectReference,
    name: String,
    lb: Option<ObjectReference>,
}

impl<F: CloudFactory> Scope<'_, F> {
    async fn event(&self, t: EventType, reason: &str, msg: &str) {
        if let Err(e) = self.ctx.events.publish(&self.machine, t, reason, msg).await {
            warn!(error = %e, "publishing event");
        }
    }

    /// An event on the machine and, for the Service owner, on its LoadBalancer.
    async fn event_both(&self, t: EventType, reason: &str, msg: &str) {
        self.event(t, reason, msg).await;
        if let Some(lb) = &self.lb {
            let msg = format!("LoadBalancerMachine {}: {msg}", self.name);
            if let Err(e) = self.ctx.events.publish(lb, t, reason, &msg).await {
                warn!(error = %e, "publishing event");
            }
        }
    }

    /// Runs one OpenStack call; a failure becomes a Warning event, a metric and [`Error::OpenStack`].
    async fn os<T>(
        &self,
        step: &'static str,
        call: impl Future<Output = Result<T, CloudError>>,
    ) -> Result<T, Error> {
        match call.await {
            Ok(v) => Ok(v),
            Err(error) => {
                self.ctx
                    .metrics
                    .openstack_error(step, &format!("{:?}", error.kind));
                self.event_both(
                    EventType::Warning,
                    "OpenStackError",
                    &format!("{step}: {error}"),
                )
                .await;
                Err(Error::OpenStack { step, error })
            }
        }
    }
}

/// Controller name in `lb_cloud_controller_reconciles_total`.
pub const CONTROLLER: &str = "loadbalancermachine";

/// One reconcile of a LoadBalancerMachine.
pub async fn reconcile<F: CloudFactory>(
    lbm: Arc<LoadBalancerMachine>,
    ctx: Arc<LbmContext<F>>,
) -> Result<Action, Error> {
    let started = std::time::Instant::now();
    let key = qualified(&lbm.namespace().unwrap_or_default(), &lbm.name_any());
    let result = if lbm.meta().deletion_timestamp.is_some() {
        delete(&lbm, &ctx).await
    } else {
        apply(&lbm, &ctx).await
    };
    if result.is_ok() {
        ctx.retries.succeeded(&key);
    }
    if let Some(metrics) = &ctx.controller_metrics {
        metrics.observe_reconcile(CONTROLLER, result.is_ok(), started.elapsed());
    }
    result
}

async fn apply<F: CloudFactory>(
    lbm: &LoadBalancerMachine,
    ctx: &LbmContext<F>,
) -> Result<Action, Error> {
    let names = machine_names(lbm);
    let key = qualified(&names.namespace, &names.machine);
    let api: Api<LoadBalancerMachine> = Api::namespaced(ctx.client.clone(), &names.namespace);
    ctx.metrics.update(lbm);

    finalizer::add(&api, lbm, finalizers::LOADBALANCERMACHINE).await?;

    let mut scope = Scope {
        ctx,
        machine: lbm.object_ref(&()),
        name: names.machine.clone(),
        lb: None,
    };
    // Checked before anything is created: a machine that cannot get a server should not hold a port either.
    let Some(api_server) = ctx.config.api_endpoint.clone() else {
        scope
            .event(
                EventType::Warning,
                "InvalidConfiguration",
                "API_ENDPOINT is not set: the machine's agent would have no API server to talk to",
            )
            .await;
        return Ok(Action::requeue(ctx.config.resync));
    };
    let lb_api: Api<LoadBalancer> = Api::namespaced(ctx.client.clone(), &lb_namespace(lbm));
    let Some(lb) = lb_api.get_opt(&lbm.spec.load_balancer_ref.name).await? else {
        debug!(lbm = %key, "LoadBalancer not found; waiting");
        return Ok(Action::requeue(ctx.config.poll * 5));
    };
    scope.lb = Some(lb.object_ref(&()));

    let mut spec = match machine_spec(lbm, &lb) {
        Ok(s) => s,
        Err(Blocked::Invalid(msg)) => {
            scope
                .event(EventType::Warning, "InvalidConfiguration", &msg)
                .await;
            return Ok(Action::requeue(ctx.config.resync));
        }
        Err(Blocked::Waiting(msg)) => {
            debug!(lbm = %key, "{msg}; waiting");
            return Ok(Action::requeue(ctx.config.poll));
        }
    };
    let inputs = inputs_hash(&spec, &lb);
    let recorded = lbm.status.clone().unwrap_or_default();
    let applied = ctx.mem(|m| m.applied.get(&key).copied());
    let now = jiff::Timestamp::now();
    if !openstack_due(&recorded, applied, inputs, now, ctx.config.resync) {
        return Ok(Action::requeue(ctx.config.resync));
    }
    let mut status = StatusWriter {
        api: api.clone(),
        name: names.machine.clone(),
        saved: recorded.clone(),
        now: recorded,
    };

    let cloud = match ctx.clouds.cloud_for(&credentials_key(lbm)).await {
        Ok(c) => c,
        Err(e) => {
            scope
                .event_both(
                    EventType::Warning,
                    "OpenStackCredentials",
                    &format!("{e:#}"),
                )
                .await;
            return Err(Error::Credentials(e));
        }
    };
    let cloud = cloud.as_ref();

    // Steps 1 and 2 again only when the inputs changed, the resync is due, or after a restart.
    let prepared = ctx.mem(|m| {
        m.prepared
            .get(&key)
            .filter(|p| {
                p.inputs == inputs
                    && p.at.elapsed() < ctx.config.resync
                    && status.now.default_port_id.as_deref() == Some(p.port_id.as_str())
            })
            .map(|p| (p.port_id.clone(), p.vip.clone()))
    });
    let (port_id, vip) = match prepared {
        Some(p) => p,
        None => {
            // 1. The agent's Kubernetes access.
            let id = identity(lbm);
            apply_rbac(&ctx.client, &id).await?;
            let q = |n: &str| Some(qualified(&names.namespace, n));
            status.now.service_account_name = q(&id.machine);
            status.now.service_account_secret_name = q(&id.machine);
            status.now.role_name = q(&id.machine);
            status.now.role_binding_name = q(&id.machine);
            status.save().await?;

            // 2. The VM port, with every fixed IP of the VIP port as allowed address pair (VRRP moves the VIP).
            let (vip_addresses, vip) = match vip_of(cloud, lbm, &lb, &scope).await? {
                Some(v) => v,
                None => {
                    debug!(lbm = %key, "no VIP yet; waiting");
                    return Ok(Action::requeue(ctx.config.poll));
                }
            };
            spec.vip_addresses = vip_addresses;
            let port = scope
                .os("port", resources::ensure_vm_port(cloud, &spec))
                .await?;
            status.now.default_port_id = Some(port.id.clone());
            status.now.default_port_name = Some(port.name.clone());
            status.now.default_port_ip = port.primary_ip().map(str::to_string);
            status.save().await?;
            ctx.mem(|m| {
                m.prepared.insert(
                    key.clone(),
                    Prepared {
                        inputs,
                        at: std::time::Instant::now(),
                        port_id: port.id.clone(),
                        vip: vip.clone(),
                    },
                )
            });
            (port.id, vip)
        }
    };

    // 3. The server: a bounded loop because forgetting a gone server leads straight to finding or booting one.
    for _ in 0..4 {
        let Some(server_id) = status.now.server_id.clone() else {
            let exclude: Vec<String> = ctx.mem(|m| m.deleting.keys().cloned().collect());
            if let Some(found) = scope
                .os(
                    "server",
                    resources::find_server(cloud, &spec.name, &exclude),
                )
                .await?
            {
                info!(lbm = %key, server = %found.id, "adopting server");
                status.now.server_id = Some(found.id.clone());
                status.now.creation_timestamp = Some(created_time(found.created.as_deref()));
                status.save().await?;
                continue;
            }
            spec.user_data = match user_data(ctx, &scope, lbm, &lb, &api_server, &vip).await? {
                Ok(u) => u,
                Err(after) => return Ok(Action::requeue(after)),
            };
            let server = scope
                .os("server", cloud.create_server(&spec.server_spec(&port_id)))
                .await?;
            status.now.server_id = Some(server.id.clone());
            status.now.creation_timestamp = Some(created_time(server.created.as_deref()));
            status.now.last_openstack_reconcile = None;
            status.save().await?;
            scope
                .event(
                    EventType::Normal,
                    "ServerCreated",
                    &format!("server {} booting", server.id),
                )
                .await;
            continue;
        };
        let state = scope
            .os("server", resources::server_state(cloud, &server_id))
            .await?;
        let deleting = ctx.mem(|m| m.deleting.contains_key(&server_id));
        match server_action(&state, deleting) {
            ServerAction::Ready => {
                status.now.last_openstack_reconcile = Some(Time(jiff::Timestamp::now()));
                status.save().await?;
                ctx.mem(|m| m.applied.insert(key.clone(), inputs));
                return Ok(Action::requeue(ctx.config.resync));
            }
            ServerAction::Wait(nova_status) => {
                debug!(lbm = %key, server = %server_id, %nova_status, "waiting for ACTIVE");
                ctx.mem(|m| m.applied.remove(&key));
                return Ok(Action::requeue(ctx.config.poll));
            }
            ServerAction::AwaitDeletion => return Ok(Action::requeue(ctx.config.poll)),
            ServerAction::Replace(fault) => {
                ctx.mem(|m| m.applied.remove(&key));
                scope
                    .event_both(
                        EventType::Warning,
                        "ServerError",
                        &format!("server {server_id} is in ERROR, replacing it: {fault}"),
                    )
                    .await;
                scope
                    .os("server deletion", cloud.delete_server(&server_id))
                    .await?;
                ctx.mem(|m| m.deleting.insert(server_id.clone(), key.clone()));
                status.now.last_openstack_reconcile = None;
                status.save().await?;
                return Ok(Action::requeue(ctx.config.poll));
            }
            ServerAction::Forget => {
                ctx.mem(|m| {
                    m.deleting.remove(&server_id);
                    m.applied.remove(&key);
                });
                status.now.server_id = None;
                status.now.creation_timestamp = None;
                status.now.last_openstack_reconcile = None;
                status.save().await?;
            }
        }
    }
    Ok(Action::requeue(ctx.config.poll))
}

/// `created` of a Nova server as a status time (now when Nova did not say).
fn created_time(created: Option<&str>) -> Time {
    Time(
        created
            .and_then(|c| c.parse::<jiff::Timestamp>().ok())
            .unwrap_or_else(jiff::Timestamp::now),
    )
}

/// The VIP addresses (all fixed IPs of the LoadBalancer's VIP port) and the address the agent serves, or `None`
/// while there is no VIP yet.
async fn vip_of<F: CloudFactory, C: Cloud>(
    cloud: &C,
    lbm: &LoadBalancerMachine,
    lb: &LoadBalancer,
    scope: &Scope<'_, F>,
) -> Result<Option<(Vec<String>, String)>, Error> {
    let fallback = lb
        .status
        .as_ref()
        .and_then(|s| s.port_ip.clone())
        .filter(|s| !s.is_empty());
    if lbm.spec.port_id.is_empty() {
        return Ok(fallback.map(|ip| (vec![ip.clone()], ip)));
    }
    let port = match cloud.get_port(&lbm.spec.port_id).await {
        Ok(p) => p,
        // The LoadBalancer controller recreates a vanished VIP port; the set then rolls new machines.
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return scope.os("vip port", async { Err(e) }).await,
    };
    let addresses: Vec<String> = port
        .fixed_ips
        .iter()
        .map(|f| f.ip_address.clone())
        .collect();
    let vip = port.primary_ip().map(str::to_string).or(fallback);
    Ok(vip.map(|v| (addresses, v)))
}

/// Renders the user data, or says how long to wait for what it needs (the ServiceAccount token, the
/// LoadBalancer's VRRP router ID and sync secret).
async fn user_data<F: CloudFactory>(
    ctx: &LbmContext<F>,
    scope: &Scope<'_, F>,
    lbm: &LoadBalancerMachine,
    lb: &LoadBalancer,
    api_server: &str,
    vip: &str,
) -> Result<Result<String, Duration>, Error> {
    let names = machine_names(lbm);
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &names.namespace);
    // Kubernetes' token controller fills the token Secret asynchronously. (The in-memory test API server has no
    // token controller: its tests write the token themselves.)
    let token = match secrets.get_opt(&names.machine).await? {
        Some(s) => rbac::token_data(&s),
        None => None,
    };
    let Some(token) = token else {
        debug!(lbm = %names.machine, "waiting for the token controller");
        return Ok(Err(ctx.config.poll));
    };
    let Some(router_id) = router_id(lb) else {
        debug!(lbm = %names.machine, "waiting for the LoadBalancer's VRRP router ID");
        return Ok(Err(ctx.config.poll));
    };
    let lb_secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &lb_namespace(lbm));
    let sync_secret = lb_secrets
        .get_opt(&format!("{}{}", lb.name_any(), sync::SECRET_SUFFIX))
        .await?
        .and_then(|s| s.data?.get(sync::SECRET_KEY).cloned())
        .and_then(|b| String::from_utf8(b.0).ok())
        .filter(|s| !s.is_empty());
    let Some(sync_secret) = sync_secret else {
        debug!(lbm = %names.machine, "waiting for the LoadBalancer's sync secret");
        return Ok(Err(ctx.config.poll));
    };
    let ha = HaSettings {
        router_id,
        base_priority: lb_api::ha::DEFAULT_BASE_PRIORITY,
        advert_interval: lb_api::ha::DEFAULT_ADVERT_INTERVAL,
        sync_port: sync::PORT,
        sync_secret,
    };
    if let Err(e) = ha.validate() {
        scope
            .event(
                EventType::Warning,
                "InvalidConfiguration",
                &format!("HA settings of the LoadBalancer: {e}"),
            )
            .await;
        return Ok(Err(ctx.config.resync));
    }
    let params = UserDataParams {
        api_server: api_server.to_string(),
        ca_data_base64: token.ca_base64,
        token: token.token,
        namespace: names.namespace.clone(),
        loadbalancer: lb.name_any(),
        machine: names.machine.clone(),
        vip: vip.to_string(),
        interface: ctx.config.interface.clone(),
        ntp_servers: ctx.config.ntp_servers.clone(),
        debug_ssh: lb.spec.debug_settings().enabled,
        ha: Some(ha),
        machine_revision: lbm
            .annotations()
            .get(lb_api::constants::lb_annotations::REVISION)
            .cloned(),
    };
    Ok(Ok(cloudinit::user_data(&params)))
}

/// Server-side applies the four RBAC objects of a machine.
async fn apply_rbac(client: &Client, id: &MachineIdentity) -> Result<(), kube::Error> {
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let ns = id.namespace.as_str();
    let name = id.machine.as_str();
    Api::<ServiceAccount>::namespaced(client.clone(), ns)
        .patch(name, &pp, &Patch::Apply(&rbac::service_account(id)))
        .await?;
    Api::<Secret>::namespaced(client.clone(), ns)
        .patch(name, &pp, &Patch::Apply(&rbac::token_secret(id)))
        .await?;
    Api::<Role>::namespaced(client.clone(), ns)
        .patch(name, &pp, &Patch::Apply(&rbac::role(id)))
        .await?;
    Api::<RoleBinding>::namespaced(client.clone(), ns)
        .patch(name, &pp, &Patch::Apply(&rbac::role_binding(id)))
        .await?;
    Ok(())
}

/// Deletes the four RBAC objects (already gone is fine): binding first, so access ends before its pieces go.
async fn delete_rbac(client: &Client, namespace: &str, name: &str) -> Result<(), kube::Error> {
    async fn gone<K>(api: Api<K>, name: &str) -> Result<(), kube::Error>
    where
        K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }
    gone(
        Api::<RoleBinding>::namespaced(client.clone(), namespace),
        name,
    )
    .await?;
    gone(Api::<Role>::namespaced(client.clone(), namespace), name).await?;
    gone(Api::<Secret>::namespaced(client.clone(), namespace), name).await?;
    gone(
        Api::<ServiceAccount>::namespaced(client.clone(), namespace),
        name,
    )
    .await?;
    Ok(())
}

/// Deletion under the finalizer: server (waiting for Nova by requeue), then VM port, then RBAC objects, then the
/// metrics and the finalizer. A failure at any point keeps the finalizer, so the next attempt finishes the job.
async fn delete<F: CloudFactory>(
    lbm: &LoadBalancerMachine,
    ctx: &LbmContext<F>,
) -> Result<Action, Error> {
    let names = machine_names(lbm);
    let key = qualified(&names.namespace, &names.machine);
    if !finalizer::has(lbm, finalizers::LOADBALANCERMACHINE) {
        ctx.metrics.remove(&names.namespace, &names.machine);
        return Ok(Action::await_change());
    }
    ctx.metrics.update(lbm);
    let scope = Scope {
        ctx,
        machine: lbm.object_ref(&()),
        name: names.machine.clone(),
        lb: None,
    };
    let cloud = match ctx.clouds.cloud_for(&credentials_key(lbm)).await {
        Ok(c) => c,
        Err(e) => {
            scope
                .event(
                    EventType::Warning,
                    "OpenStackCredentials",
                    &format!("{e:#}"),
                )
                .await;
            return Err(Error::Credentials(e));
        }
    };
    let server_id = lbm.status.as_ref().and_then(|s| s.server_id.clone());
    let progress = scope
        .os(
            "deletion",
            resources::delete_machine_step(
                cloud.as_ref(),
                &names.server,
                &names.port,
                server_id.as_deref(),
            ),
        )
        .await?;
    if let DeletionProgress::Waiting(ids) = progress {
        debug!(lbm = %key, ?ids, "waiting for Nova to delete");
        ctx.mem(|m| {
            m.deleting
                .extend(ids.into_iter().map(|id| (id, key.clone())))
        });
        return Ok(Action::requeue(ctx.config.poll));
    }
    delete_rbac(&ctx.client, &names.namespace, &names.machine).await?;
    let api: Api<LoadBalancerMachine> = Api::namespaced(ctx.client.clone(), &names.namespace);
    finalizer::remove(&api, lbm, finalizers::LOADBALANCERMACHINE).await?;
    ctx.mem(|m| {
        m.deleting.retain(|_, machine| *machine != key);
        m.applied.remove(&key);
        m.prepared.remove(&key);
    });
    ctx.metrics.remove(&names.namespace, &names.machine);
    info!(lbm = %key, "machine deleted");
    Ok(Action::await_change())
}

/// Retries with per-machine exponential backoff ([`backoff`]).
pub fn error_policy<F: CloudFactory>(
    lbm: Arc<LoadBalancerMachine>,
    error: &Error,
    ctx: Arc<LbmContext<F>>,
) -> Action {
    let key = qualified(&lbm.namespace().unwrap_or_default(), &lbm.name_any());
    let (failures, delay) = ctx.retries.failed(&key);
    warn!(lbm = %key, %error, failures, ?delay, "LoadBalancerMachine reconcile failed");
    Action::requeue(delay)
}

/// The context `cli::run_openstack_controllers` starts this controller with: `config` (the binary's comes from
/// flags or the environment, [`crate::cli::MachineArgs`]), the `loadbalancermachine*` families and the reconcile
/// counts on the binary's `/metrics`, the cloud sessions shared with the LoadBalancer controller, events as
/// `yawol-service`.
pub fn prepare<F: CloudFactory>(
    client: Client,
    clouds: Arc<F>,
    metrics: &Arc<crate::metrics::Metrics>,
    instance: &str,
    config: LbmControllerConfig,
) -> Arc<LbmContext<Arc<F>>> {
    let lbm_metrics = Arc::new(LbmMetrics::default());
    metrics.register_more(|registry| lbm_metrics.register(registry));
    let events = Arc::new(EventPublisher::new(
        client.clone(),
        lb_api::constants::defaults::USER_EVENT_COMPONENT,
        instance,
    ));
    if config.api_endpoint.is_none() {
        warn!("API_ENDPOINT is not set: LoadBalancerMachines get no servers until it is");
    }
    let mut ctx = LbmContext::new(client, clouds, events, lbm_metrics, config);
    ctx.controller_metrics = Some(metrics.clone());
    Arc::new(ctx)
}

/// Runs the LoadBalancerMachine controller over the machines of `namespace` until `shutdown`.
pub async fn run<F: CloudFactory>(
    ctx: Arc<LbmContext<F>>,
    namespace: &str,
    stop: crate::runtime::stop::Stop,
) {
    use futures::StreamExt;
    use kube::runtime::reflector::ObjectRef;
    use kube::runtime::watcher;
    let api: Api<LoadBalancerMachine> = Api::namespaced(ctx.client.clone(), namespace);
    let controller = crate::runtime::watches::controller(api, watcher::Config::default());
    // Series of machines that vanished without a reconcile seeing their deletion (finalizer removed by hand).
    let store = controller.store();
    let metrics = ctx.metrics.clone();
    let period = ctx.config.resync;
    let gc = tokio::spawn({
        let store = store.clone();
        async move {
            if store.wait_until_ready().await.is_err() {
                return;
            }
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                metrics.retain(|ns, name| store.get(&ObjectRef::new(name).within(ns)).is_some());
            }
        }
    });
    let run = controller
        .graceful_shutdown_on(stop.clone().wait())
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                debug!(error = %e, "loadbalancermachine controller");
            }
        });
    crate::runtime::stop::drive(store, run, stop).await;
    gc.abort();
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
    fn router_id_from_the_annotation() {
        let with = |v: &str| lb(json!({}), json!({lb_annotations::VRRP_ROUTER_ID: v}));
        assert_eq!(router_id(&with("42")), Some(42));
        assert_eq!(router_id(&with(" 255 ")), Some(255));
        for bad in ["0", "256", "x", ""] {
            assert_eq!(router_id(&with(bad)), None, "{bad}");
        }
        assert_eq!(router_id(&lb(json!({}), json!({}))), None);
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
