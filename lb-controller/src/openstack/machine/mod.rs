//! The LoadBalancerMachine controller (control cluster, yawol-controller's LBM role). A reconcile is `apply` or,
//! once the machine is being deleted, `cleanup`:
//!
//! - `apply`, each step saving its status fields at once: the Kubernetes access of the machine's agent ([`rbac`]),
//!   the VM port with the VIP as allowed address pair, and the server booted with [`cloudinit`] user data in the
//!   LoadBalancer's server group ([`resources`]);
//! - `cleanup`: server, then port, then the RBAC objects, then the finalizer `yawol.stackit.cloud/controller4`.
//!
//! Metrics in [`metrics`]. Nothing blocks a worker: waiting for the token controller, for Nova to report ACTIVE or to
//! finish a delete is a requeue after [`Config::poll`]. A server in ERROR is deleted and booted again,
//! with a Warning event carrying Nova's fault text. OpenStack errors become Warning events (on the machine and on
//! its LoadBalancer, so the cloud controller forwards them to the Service) and
//! `loadbalancermachine_openstack_errors_total`; the status keeps what exists and the reconcile is retried with
//! exponential backoff ([`Config::error_backoff_base`] … [`Config::error_backoff_max`]).
//! Every OpenStack object is found by name before it is created, so an interrupted reconcile resumes instead of
//! duplicating.
//!
//! The decisions are pure functions in [`plan`] ([`machine_spec`], [`openstack_due`], [`server_action`],
//! [`status_patch`], …) with unit tests; `apply` and `cleanup` only sequence them with the API calls.

pub mod cloudinit;
pub mod drain;
pub mod metrics;
pub mod plan;
pub mod rbac;
pub mod resources;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, Client, Resource, ResourceExt};
use lb_api::constants::{finalizers, sync};
use lb_api::ha::HaSettings;
use lb_api::{LoadBalancer, LoadBalancerMachine, LoadBalancerMachineStatus};
use tracing::{debug, info, warn};

use crate::openstack::clouds::CloudFactory;
use crate::openstack::loadbalancer::ha;
use crate::openstack::{Cloud, CloudError};
use crate::runtime::api_errors::is_not_found;
use crate::runtime::events::{EventPublisher, EventType};
use crate::runtime::finalizer;
use crate::runtime::retry::Retries;
use cloudinit::UserDataParams;
use metrics::MachineMetrics;
use plan::{
    created_time, credentials_key, identity, inputs_hash, lb_namespace, machine_names,
    machine_spec, openstack_due, qualified, server_action, status_patch, Blocked, ServerAction,
};
use rbac::MachineIdentity;
use resources::DeletionProgress;

/// Field manager of the server-side applied RBAC objects.
pub const FIELD_MANAGER: &str = "lb-controller";

/// Settings of the LoadBalancerMachine controller.
#[derive(Clone, Debug)]
pub struct Config {
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
    /// Longest an active-active machine being deleted keeps its server while its own connections drain
    /// ([`drain`]).
    pub drain_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            api_endpoint: None,
            ntp_servers: vec!["pool.ntp.org".into()],
            interface: "eth0".into(),
            resync: Duration::from_secs(300),
            poll: Duration::from_secs(2),
            error_backoff_base: Duration::from_secs(2),
            error_backoff_max: Duration::from_secs(300),
            drain_timeout: Duration::from_secs(600),
        }
    }
}

/// Errors of one reconcile (logged, retried with the machine's backoff: [`error_policy`]).
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
    /// Machines whose drain has been announced (one Event each).
    draining: std::collections::HashSet<String>,
}

/// RBAC and VM port of a machine, as the last full pass left them.
struct Prepared {
    inputs: u64,
    at: std::time::Instant,
    port_id: String,
    vip: String,
}

/// Shared state of the controller.
pub struct Context<F: CloudFactory> {
    /// Control-cluster client.
    pub client: Client,
    /// Cloud sessions (keyed by the machine's `spec.infrastructure`: auth Secret and project).
    pub clouds: F,
    /// Events on the machines and their LoadBalancers.
    pub events: Arc<EventPublisher>,
    /// `loadbalancermachine*` metrics.
    pub metrics: Arc<MachineMetrics>,
    /// Settings.
    pub config: Config,
    /// Where reconciles are counted (`lb_cloud_controller_reconciles_total{controller="loadbalancermachine"}` and
    /// the duration histogram), next to the other two controllers'; [`prepare`] sets it.
    pub controller_metrics: Option<Arc<crate::metrics::Metrics>>,
    memory: Mutex<Memory>,
    /// Failures per machine (`ns/name`), for the error policy's backoff.
    retries: Retries<String>,
}

impl<F: CloudFactory> Context<F> {
    /// A context; `events` should use yawol's `yawol-service` component so the back channel forwards them.
    pub fn new(
        client: Client,
        clouds: F,
        events: Arc<EventPublisher>,
        metrics: Arc<MachineMetrics>,
        config: Config,
    ) -> Self {
        Context {
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
    ctx: &'a Context<F>,
    machine: ObjectReference,
    name: String,
    lb: Option<ObjectReference>,
}

impl<F: CloudFactory> Scope<'_, F> {
    async fn event(&self, t: EventType, reason: &str, msg: &str) {
        let events = &self.ctx.events;
        events
            .publish_best_effort(&self.machine, t, reason, msg)
            .await;
    }

    /// An event on the machine and, for the Service owner, on its LoadBalancer.
    async fn event_both(&self, t: EventType, reason: &str, msg: &str) {
        self.event(t, reason, msg).await;
        if let Some(lb) = &self.lb {
            let msg = format!("LoadBalancerMachine {}: {msg}", self.name);
            let events = &self.ctx.events;
            events.publish_best_effort(lb, t, reason, &msg).await;
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
    ctx: Arc<Context<F>>,
) -> Result<Action, Error> {
    let started = std::time::Instant::now();
    let key = qualified(&lbm.namespace().unwrap_or_default(), &lbm.name_any());
    let result = if lbm.meta().deletion_timestamp.is_some() {
        cleanup(&lbm, &ctx).await
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
    ctx: &Context<F>,
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
            let port_ip = status.now.default_port_ip.clone();
            spec.user_data =
                match user_data(ctx, &scope, lbm, &lb, &api_server, &vip, port_ip).await? {
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
/// LoadBalancer's VRRP router ID and sync secret; an active-active machine's port address, `port_ip`).
async fn user_data<F: CloudFactory>(
    ctx: &Context<F>,
    scope: &Scope<'_, F>,
    lbm: &LoadBalancerMachine,
    lb: &LoadBalancer,
    api_server: &str,
    vip: &str,
    port_ip: Option<String>,
) -> Result<Result<String, Duration>, Error> {
    let names = machine_names(lbm);
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &names.namespace);
    // Kubernetes' token controller fills the token Secret asynchronously: until it has, the machine waits.
    let token = match secrets.get_opt(&names.machine).await? {
        Some(s) => rbac::token_data(&s),
        None => None,
    };
    let Some(token) = token else {
        debug!(lbm = %names.machine, "waiting for the token controller");
        return Ok(Err(ctx.config.poll));
    };
    let Some(router_id) = ha::router_id(lb).ok().flatten() else {
        debug!(lbm = %names.machine, "waiting for the LoadBalancer's VRRP router ID");
        return Ok(Err(ctx.config.poll));
    };
    let lb_secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &lb_namespace(lbm));
    let sync_secret = lb_secrets
        .get_opt(&ha::sync_secret_name(lb))
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
    let active_active_address = if crate::openstack::loadbalancer::routes::active_active(lb) {
        match port_ip.filter(|ip| !ip.is_empty()) {
            Some(ip) => Some(ip),
            None => {
                debug!(lbm = %names.machine, "waiting for the machine port's address (active-active)");
                return Ok(Err(ctx.config.poll));
            }
        }
    } else {
        None
    };
    let params = UserDataParams {
        api_server: api_server.to_string(),
        ca_data_base64: token.ca_base64,
        token: token.token,
        namespace: names.namespace.clone(),
        loadbalancer: lb.name_any(),
        machine: names.machine.clone(),
        vip: vip.to_string(),
        interfaces: interfaces(
            &ctx.config.interface,
            lbm.spec.infrastructure.additional_networks().len(),
        ),
        ntp_servers: ctx.config.ntp_servers.clone(),
        debug_ssh: lb.spec.debug_settings().enabled,
        ha: Some(ha),
        active_active_address,
        machine_revision: lbm
            .annotations()
            .get(lb_api::constants::lb_annotations::REVISION)
            .cloned(),
    };
    Ok(Ok(cloudinit::user_data(&params)))
}

/// The interfaces of a machine with `additional` networks besides its default one, whose interface is `primary`:
/// Nova attaches the additional networks' ports after the default one, in order, and the guest names them by
/// the same scheme with the trailing number counted up (`eth0`, `eth1`, …; `ens3`, `ens4`, … on predictable
/// names). The agent forwards on all of them, so a backend reachable only through an additional network is
/// served.
pub fn interfaces(primary: &str, additional: usize) -> Vec<String> {
    let stem = primary.trim_end_matches(|c: char| c.is_ascii_digit());
    let first: usize = primary[stem.len()..].parse().unwrap_or(0);
    std::iter::once(primary.to_string())
        .chain((1..=additional).map(|i| format!("{stem}{}", first + i)))
        .collect()
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
            Err(e) if is_not_found(&e) => Ok(()),
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
async fn cleanup<F: CloudFactory>(
    lbm: &LoadBalancerMachine,
    ctx: &Context<F>,
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
    if let Some(wait) = drain_wait(lbm, &scope, &key).await? {
        return Ok(Action::requeue(wait));
    }
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
        m.draining.remove(&key);
    });
    ctx.metrics.remove(&names.namespace, &names.machine);
    info!(lbm = %key, "machine deleted");
    Ok(Action::await_change())
}

/// How long a machine being deleted must wait before its server goes ([`drain`]): `None` when it need not.
async fn drain_wait<F: CloudFactory>(
    lbm: &LoadBalancerMachine,
    scope: &Scope<'_, F>,
    key: &str,
) -> Result<Option<Duration>, Error> {
    let ctx = scope.ctx;
    let now = jiff::Timestamp::now();
    if lbm
        .status
        .as_ref()
        .and_then(|s| s.server_id.as_ref())
        .is_none()
        || drain::draining(lbm, false, now, ctx.config.drain_timeout).is_none()
    {
        return Ok(None);
    }
    // Only now the LoadBalancer: when it goes too, its VIP goes and there is nothing to drain for.
    let lb_api: Api<LoadBalancer> = Api::namespaced(ctx.client.clone(), &lb_namespace(lbm));
    let lb_going = lb_api
        .get_opt(&lbm.spec.load_balancer_ref.name)
        .await?
        .is_none_or(|lb| lb.metadata.deletion_timestamp.is_some());
    let Some(d) = drain::draining(lbm, lb_going, now, ctx.config.drain_timeout) else {
        return Ok(None);
    };
    if ctx.mem(|m| m.draining.insert(key.to_string())) {
        let msg = format!(
            "draining: the server stays while {} connection(s) translated to this machine's address are open, \
             at most {}s more (it no longer gets new ones)",
            d.connections,
            d.left.as_secs()
        );
        scope
            .event(EventType::Normal, "MachineDraining", &msg)
            .await;
    }
    Ok(Some(
        ctx.config.poll.max(Duration::from_secs(5)).min(d.left),
    ))
}

/// Retries with per-machine exponential backoff ([`Config::error_backoff_base`] doubling up to
/// [`Config::error_backoff_max`], [`Retries`]).
pub fn error_policy<F: CloudFactory>(
    lbm: Arc<LoadBalancerMachine>,
    error: &Error,
    ctx: Arc<Context<F>>,
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
    config: Config,
) -> Arc<Context<Arc<F>>> {
    let lbm_metrics = Arc::new(MachineMetrics::default());
    metrics.register_more(|registry| lbm_metrics.register(registry));
    let events = Arc::new(EventPublisher::new(
        client.clone(),
        lb_api::constants::defaults::USER_EVENT_COMPONENT,
        instance,
    ));
    if config.api_endpoint.is_none() {
        warn!("API_ENDPOINT is not set: LoadBalancerMachines get no servers until it is");
    }
    let mut ctx = Context::new(client, clouds, events, lbm_metrics, config);
    ctx.controller_metrics = Some(metrics.clone());
    Arc::new(ctx)
}

/// Runs the LoadBalancerMachine controller over the machines of `namespace` until `shutdown`.
pub async fn run<F: CloudFactory>(
    ctx: Arc<Context<F>>,
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
