//! The LoadBalancer controller (control cluster, yawol-controller's LoadBalancer role). A reconcile is `apply` or,
//! once the LoadBalancer is being deleted, `cleanup`:
//!
//! - `apply`: the finalizer; the OpenStack resources ([`resources`]: security group, floating IP, VIP port, server
//!   group) with the status saved after each, throttled by [`resources::needs_openstack_reconcile`], Warning events
//!   with the cloud's error text; the HA settings ([`ha`]: the VRRP router id, allocated once under a lock from a fresh
//!   list and never changed while valid; the Secret `<lb>-sync`, created once and never replaced); the LoadBalancerSets
//!   ([`sets`]: a new set per machine template, old ones retired once the current one holds the VIP); the revision and
//!   sync-peer annotations and the replica counts; for an active-active LoadBalancer the VIP's routes on its
//!   subnet's router ([`routes`], condition `ActiveActive`).
//! - `cleanup`: the child LoadBalancerSets first, then the cloud resources, then the finalizer.
//!
//! Bad input (no image/flavor/network ID, an unparsable revision or router id) gets a Warning event and
//! `lb_cloud_controller_invalid_input_total` once per distinct problem, and changes nothing that exists: no set is
//! created, scaled or deleted on an invalid template.
//!
//! The cloud comes from a [`CloudFactory`] ([`crate::openstack::clouds`]); tests pass a fixed fake.

pub mod ha;
pub mod metrics;
pub mod resources;
pub mod routes;
pub mod sets;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use lb_api::constants::{finalizers, lb_annotations, sync};
use lb_api::{LoadBalancer, LoadBalancerMachine, LoadBalancerSet, LoadBalancerStatus};
use serde_json::{json, Value};
use tracing::{debug, info, warn};

use crate::metrics::Metrics;
use crate::openstack::clouds::CloudFactory;
use crate::openstack::{CloudError, CloudErrorKind};
use crate::runtime::api_errors::{is_conflict, is_not_found};
use crate::runtime::changes::{hash_of, relevant_changes};
use crate::runtime::events::{EventPublisher, EventType};
use crate::runtime::finalizer;
use crate::runtime::ownership::{self, label_selector};
use crate::runtime::reported::Reported;
use crate::runtime::retry::{self, Retries};
use crate::runtime::stop::{drive, Stop};
use crate::runtime::watches;
use ha::{router_id, sync_peers, sync_secret_name, taken_router_ids};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use resources::StatusSink;
use sets::{machine_template, plan_sets, replica_sums, revision_of, set_of, template_problems};

/// Errors of one reconcile (logged, retried with backoff).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Kubernetes API.
    #[error("kubernetes: {0}")]
    Kube(#[from] kube::Error),
    /// No cloud session (credentials Secret, authentication).
    #[error("openstack credentials: {0:#}")]
    Credentials(anyhow::Error),
    /// An OpenStack step.
    #[error("{0}")]
    Step(#[from] resources::StepError),
    /// The set or machine cache never synced (its watch ended).
    #[error("LoadBalancerSet/LoadBalancerMachine cache not ready")]
    Cache,
}

/// Controller name in `lb_cloud_controller_reconciles_total` and `..._invalid_input_total`.
pub const CONTROLLER: &str = "loadbalancer";

/// When the current LoadBalancerSet counts as holding the VIP (yawol's `LBSetHasKeepalivedMaster`), which lets the
/// older sets go.
#[derive(Clone, Debug)]
pub struct RolloutGate {
    /// `HasKeepalivedMaster` True at least this long (yawol: 2 min): the new master is stable.
    pub master_for: Duration,
    /// `HasKeepalivedMaster` False at least this long (yawol: 10 min): the agents do not report VRRP; readiness has to
    /// do.
    pub no_master_for: Duration,
    /// No `HasKeepalivedMaster` condition and the set at least this old (yawol: 15 min): a set controller that does
    /// not report the condition.
    pub unknown_after: Duration,
}

impl Default for RolloutGate {
    fn default() -> Self {
        RolloutGate {
            master_for: Duration::from_secs(120),
            no_master_for: Duration::from_secs(600),
            unknown_after: Duration::from_secs(900),
        }
    }
}

/// Settings of the LoadBalancer controller.
#[derive(Clone, Debug)]
pub struct Config {
    /// OpenStack resync even without changes (yawol: 5 min); also the requeue period.
    pub resync: Duration,
    /// Poll interval while child LoadBalancerSets go away.
    pub deletion_poll: Duration,
    /// When old LoadBalancerSets may be scaled down.
    pub rollout: RolloutGate,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            resync: Duration::from_secs(300),
            deletion_poll: Duration::from_secs(2),
            rollout: RolloutGate::default(),
        }
    }
}

/// Shared state.
pub struct Context<F: CloudFactory> {
    /// Control-cluster client.
    pub client: Client,
    /// Cloud sessions.
    pub clouds: F,
    /// Events on the LoadBalancers (the back channel forwards them to the Service).
    pub events: Arc<EventPublisher>,
    /// Settings.
    pub config: Config,
    /// `/metrics` (yawol's `loadbalancer_*` series, bad-input counts, reconciles).
    pub metrics: Arc<Metrics>,
}

/// Merge-patches the OpenStack fields of the status, with explicit nulls for cleared ones (a merge patch without
/// the key would keep the old value, e.g. a floating IP after switching to internal).
struct KubeStatus {
    api: Api<LoadBalancer>,
    name: String,
}

/// The status fields the OpenStack steps own, as a merge patch.
pub fn status_patch(s: &LoadBalancerStatus) -> Value {
    json!({"status": {
        "securityGroupID": s.security_group_id, "securityGroupName": s.security_group_name,
        "floatingID": s.floating_id, "floatingName": s.floating_name, "externalIP": s.external_ip,
        "portID": s.port_id, "portName": s.port_name, "portIP": s.port_ip, "portIPv6": s.port_ipv6,
        "serverGroupID": s.server_group_id, "serverGroupName": s.server_group_name,
        "lastOpenstackReconcile": s.last_openstack_reconcile, "openstackReconcileHash": s.openstack_reconcile_hash,
    }})
}

impl StatusSink for KubeStatus {
    async fn save(&mut self, status: &LoadBalancerStatus) -> Result<(), CloudError> {
        self.api
            .patch_status(
                &self.name,
                &PatchParams::default(),
                &Patch::Merge(&status_patch(status)),
            )
            .await
            .map(|_| ())
            .map_err(|e| {
                CloudError::new(
                    CloudErrorKind::Unavailable,
                    "saving LoadBalancer status",
                    e.to_string(),
                )
            })
    }
}

fn object_ref(lb: &LoadBalancer) -> ObjectReference {
    lb.object_ref(&())
}

fn selector(lb: &LoadBalancer) -> String {
    label_selector(lb.spec.selector.match_labels.as_ref())
}

/// Shared by the reconciles of one running controller.
struct Running<F: CloudFactory> {
    ctx: Arc<Context<F>>,
    sets: Store<LoadBalancerSet>,
    machines: Store<LoadBalancerMachine>,
    /// Router ids are allocated one at a time (list, pick, write), so two LoadBalancers never pick the same.
    router_ids: tokio::sync::Mutex<()>,
    /// Bad input already reported (each problem once while it lasts).
    reported: Reported,
    /// Failures per LoadBalancer, for the error policy's backoff.
    retries: Retries<ObjectRef<LoadBalancer>>,
    /// Active-active routes as last programmed, by LoadBalancer UID: an unchanged set of eligible machines costs
    /// no cloud call until the resync period has passed.
    routes: std::sync::Mutex<BTreeMap<String, Programmed>>,
}

/// The routes memory (a panic elsewhere leaves it usable: it is only a cache).
fn programmed<F: CloudFactory>(
    run: &Running<F>,
) -> std::sync::MutexGuard<'_, BTreeMap<String, Programmed>> {
    run.routes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the routes step last did for one LoadBalancer.
#[derive(Clone)]
struct Programmed {
    router: String,
    next_hops: std::collections::BTreeSet<String>,
    at: Instant,
}

async fn reconcile<F: CloudFactory>(
    lb: Arc<LoadBalancer>,
    run: Arc<Running<F>>,
) -> Result<Action, Error> {
    let started = Instant::now();
    let mut problems = Vec::new();
    let result = if lb.meta().deletion_timestamp.is_some() {
        cleanup(&lb, &run).await
    } else {
        apply(&lb, &run, &mut problems).await
    };
    for p in run
        .reported
        .fresh(&lb.uid().unwrap_or_default(), &problems, result.is_ok())
    {
        run.ctx.metrics.invalid(CONTROLLER, "InvalidConfiguration");
        run.ctx
            .events
            .publish_best_effort(
                &object_ref(&lb),
                EventType::Warning,
                "InvalidConfiguration",
                &p,
            )
            .await;
    }
    run.ctx
        .metrics
        .observe_reconcile(CONTROLLER, result.is_ok(), started.elapsed());
    if result.is_ok() {
        run.retries.succeeded(&ObjectRef::from_obj(lb.as_ref()));
    }
    result
}

/// Deletion: the child LoadBalancerSets first (their machines hold ports in our security group), then the cloud
/// resources, the sync Secret, and the finalizer.
async fn cleanup<F: CloudFactory>(lb: &LoadBalancer, run: &Running<F>) -> Result<Action, Error> {
    let ctx = &run.ctx;
    let ns = lb.namespace().unwrap_or_default();
    let name = lb.name_any();
    let api: Api<LoadBalancer> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.metrics.loadbalancers.observe(lb);
    if !finalizer::has(lb, finalizers::LOADBALANCER) {
        ctx.metrics.loadbalancers.forget(&ns, &name);
        return Ok(Action::await_change());
    }
    let sets: Api<LoadBalancerSet> = Api::namespaced(ctx.client.clone(), &ns);
    let children: Vec<LoadBalancerSet> = sets
        .list(&ListParams::default().labels(&selector(lb)))
        .await?
        .items
        .into_iter()
        .filter(|s| set_of(s, lb))
        .collect();
    if !children.is_empty() {
        for s in children
            .iter()
            .filter(|s| s.meta().deletion_timestamp.is_none())
        {
            sets.delete(&s.name_any(), &DeleteParams::default()).await?;
        }
        return Ok(Action::requeue(ctx.config.deletion_poll));
    }
    let cloud = ctx.clouds.cloud_for(lb).await.map_err(Error::Credentials)?;
    if let Err(e) = resources::delete(cloud.as_ref(), lb).await {
        ctx.events
            .publish_best_effort(
                &object_ref(lb),
                EventType::Warning,
                "OpenStackDeletionFailed",
                &e.to_string(),
            )
            .await;
        return Err(e.into());
    }
    // The owner reference lets the garbage collector do this too; explicit, so nothing depends on it.
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    match secrets
        .delete(&sync_secret_name(lb), &DeleteParams::default())
        .await
    {
        Err(e) if !is_not_found(&e) => return Err(e.into()),
        _ => {}
    }
    finalizer::remove(&api, lb, finalizers::LOADBALANCER).await?;
    ctx.metrics.loadbalancers.forget(&ns, &name);
    run.reported.forget(&lb.uid().unwrap_or_default());
    programmed(run).remove(&lb.uid().unwrap_or_default());
    info!(lb = %name, "OpenStack resources deleted");
    Ok(Action::await_change())
}

/// The LoadBalancer as it should be, step by step: finalizer, cloud resources ([`ensure_cloud_resources`]), HA
/// settings ([`ensure_router_id`], [`ensure_sync_secret`]), sets ([`apply_sets`]), active-active routes
/// ([`ensure_routes`]), the revision and sync-peer annotations, the replica counts.
async fn apply<F: CloudFactory>(
    lb: &LoadBalancer,
    run: &Running<F>,
    problems: &mut Vec<String>,
) -> Result<Action, Error> {
    let ctx = &run.ctx;
    let ns = lb.namespace().unwrap_or_default();
    let name = lb.name_any();
    let api: Api<LoadBalancer> = Api::namespaced(ctx.client.clone(), &ns);

    finalizer::add(&api, lb, finalizers::LOADBALANCER).await?;

    let now = jiff::Timestamp::now();
    let mut status = lb.status.clone().unwrap_or_default();
    // A failing cloud stops the OpenStack step, not the rest: sets, HA settings and peers only need what the status
    // already records. The error is returned at the end (retry with backoff).
    let openstack_error = ensure_cloud_resources(lb, run, now, &mut status).await;

    ensure_router_id(lb, run, problems).await?;
    ensure_sync_secret(lb, run, problems).await?;

    // Both caches must have synced once, or an empty cache would read as "no sets, no machines".
    run.sets
        .wait_until_ready()
        .await
        .map_err(|_| Error::Cache)?;
    run.machines
        .wait_until_ready()
        .await
        .map_err(|_| Error::Cache)?;
    let mut sets: Vec<LoadBalancerSet> = run
        .sets
        .state()
        .iter()
        .filter(|s| set_of(s, lb))
        .map(|s| s.as_ref().clone())
        .collect();
    let (mut requeue, revision) = apply_sets(lb, run, &status, now, &mut sets, problems).await?;
    let routes_error = match ensure_routes(lb, run, &status, now, problems).await {
        Ok(recheck) => {
            requeue = requeue.min(recheck.unwrap_or(requeue));
            None
        }
        Err(e) => Some(e),
    };
    let mut annotations = serde_json::Map::new();
    if let Some(rev) = revision {
        annotations.insert(lb_annotations::REVISION.into(), json!(rev.to_string()));
    }
    let peers = sync_peers(lb, run.machines.state().iter().map(|m| m.as_ref()));
    if lb.annotations().get(lb_annotations::SYNC_PEERS) != Some(&peers) {
        annotations.insert(lb_annotations::SYNC_PEERS.into(), json!(peers));
    }
    if !annotations.is_empty() {
        api.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": annotations}})),
        )
        .await?;
    }

    let (replicas, ready) = replica_sums(&sets);
    let old = lb.status.clone().unwrap_or_default();
    if old.replicas != Some(replicas) || old.ready_replicas != Some(ready) {
        api.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"replicas": replicas, "readyReplicas": ready}})),
        )
        .await?;
    }
    status.replicas = Some(replicas);
    status.ready_replicas = Some(ready);
    let mut observed = lb.clone();
    observed.status = Some(status);
    ctx.metrics.loadbalancers.observe(&observed);

    match openstack_error.or(routes_error) {
        Some(e) => Err(e),
        None => Ok(Action::requeue(requeue)),
    }
}

/// The routes step of an active-active LoadBalancer ([`routes`]): the VIP's routes follow the eligible machines,
/// the `ActiveActive` condition says what they are or why not, with an event when it changes. A LoadBalancer that
/// was active-active and is no longer loses its routes and the condition. Returns when to look again (a machine
/// whose heartbeat goes stale sends no change).
async fn ensure_routes<F: CloudFactory>(
    lb: &LoadBalancer,
    run: &Running<F>,
    status: &LoadBalancerStatus,
    now: jiff::Timestamp,
    problems: &mut Vec<String>,
) -> Result<Option<Duration>, Error> {
    let ctx = &run.ctx;
    let uid = lb.uid().unwrap_or_default();
    problems.extend(routes::active_active_problem(lb));
    if !routes::active_active(lb) {
        programmed(run).remove(&uid);
        let Some(_) = routes::current_condition(lb) else {
            return Ok(None);
        };
        let cloud = ctx.clouds.cloud_for(lb).await.map_err(Error::Credentials)?;
        let removed = routes::remove_routes(cloud.as_ref(), lb)
            .await
            .map_err(resources::step("router routes"))?;
        write_active_active_condition(lb, run, None).await?;
        ctx.events
            .publish_best_effort(
                &object_ref(lb),
                EventType::Normal,
                "ActiveActiveOff",
                &format!("not active-active any more: removed {removed} route(s) of the VIP"),
            )
            .await;
        return Ok(None);
    }
    let next_hops =
        routes::eligible_next_hops(lb, run.machines.state().iter().map(|m| m.as_ref()), now);
    let cached = programmed(run).get(&uid).cloned();
    let outcome = match cached {
        Some(c) if c.next_hops == next_hops && c.at.elapsed() < ctx.config.resync => {
            routes::Outcome::Programmed {
                router: c.router,
                next_hops,
            }
        }
        cached => {
            let cloud = ctx.clouds.cloud_for(lb).await.map_err(Error::Credentials)?;
            let (outcome, change) =
                routes::program(cloud.as_ref(), status, cached.map(|c| c.router), &next_hops).await;
            if change != routes::RouteChange::default() {
                info!(lb = %lb.name_any(), added = ?change.added, removed = ?change.removed, "VIP routes changed");
            }
            outcome
        }
    };
    match &outcome {
        routes::Outcome::Programmed { router, next_hops } => {
            programmed(run).insert(
                uid,
                Programmed {
                    router: router.clone(),
                    next_hops: next_hops.clone(),
                    at: Instant::now(),
                },
            );
        }
        _ => {
            programmed(run).remove(&uid);
        }
    }
    let vip = routes::vip_destination(status.port_ip.as_deref().unwrap_or("-"));
    if let Some(condition) = routes::condition(
        routes::current_condition(lb),
        &outcome,
        &vip,
        lb.spec.replicas,
        now,
    ) {
        write_active_active_condition(lb, run, Some(condition)).await?;
    }
    match outcome {
        routes::Outcome::Failed(error) => Err(resources::StepError {
            step: "router routes",
            error,
        }
        .into()),
        _ => Ok(Some(routes::ELIGIBLE_HEARTBEAT)),
    }
}

/// Sets (or, with `None`, removes) the LoadBalancer's `ActiveActive` condition when it differs from what the
/// LoadBalancer has, with an event saying the new state (Normal when True, Warning otherwise).
async fn write_active_active_condition<F: CloudFactory>(
    lb: &LoadBalancer,
    run: &Running<F>,
    condition: Option<Condition>,
) -> Result<(), Error> {
    let old = routes::current_condition(lb);
    let same = |a: &Condition, b: &Condition| {
        (&a.status, &a.reason, &a.message) == (&b.status, &b.reason, &b.message)
    };
    match (old, &condition) {
        (None, None) => return Ok(()),
        (Some(o), Some(n)) if same(o, n) => return Ok(()),
        _ => {}
    }
    let mut all: Vec<_> = lb
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|c| c.type_ != lb_api::constants::conditions::ACTIVE_ACTIVE)
        .collect();
    if let Some(c) = &condition {
        all.push(c.clone());
    }
    let api: Api<LoadBalancer> =
        Api::namespaced(run.ctx.client.clone(), &lb.namespace().unwrap_or_default());
    // A merge patch replaces the list: this controller is the only writer of a LoadBalancer's conditions.
    api.patch_status(
        &lb.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"conditions": all}})),
    )
    .await?;
    if let Some(c) = condition {
        let kind = if c.status == lb_api::constants::conditions::TRUE {
            EventType::Normal
        } else {
            EventType::Warning
        };
        run.ctx
            .events
            .publish_best_effort(&object_ref(lb), kind, &c.reason, &c.message)
            .await;
    }
    Ok(())
}

/// The OpenStack step ([`resources::reconcile`], status saved after each resource) when it is due
/// ([`resources::needs_openstack_reconcile`]); its failure, already published as a Warning event, is returned for the
/// end of the reconcile.
async fn ensure_cloud_resources<F: CloudFactory>(
    lb: &LoadBalancer,
    run: &Running<F>,
    now: jiff::Timestamp,
    status: &mut LoadBalancerStatus,
) -> Option<Error> {
    let ctx = &run.ctx;
    let mut openstack_error = None;
    if resources::needs_openstack_reconcile(lb, now, ctx.config.resync) {
        match ctx.clouds.cloud_for(lb).await {
            Err(e) => {
                ctx.events
                    .publish_best_effort(
                        &object_ref(lb),
                        EventType::Warning,
                        "OpenStackCredentials",
                        &format!("{e:#}"),
                    )
                    .await;
                openstack_error = Some(Error::Credentials(e));
            }
            Ok(cloud) => {
                let had_ip = status.external_ip.clone();
                let mut sink = KubeStatus {
                    api: Api::namespaced(ctx.client.clone(), &lb.namespace().unwrap_or_default()),
                    name: lb.name_any(),
                };
                let mut warnings = Vec::new();
                let result =
                    resources::reconcile(cloud.as_ref(), lb, status, &mut sink, &mut warnings)
                        .await;
                for w in &warnings {
                    ctx.events
                        .publish_best_effort(
                            &object_ref(lb),
                            EventType::Warning,
                            "InvalidConfiguration",
                            w,
                        )
                        .await;
                }
                match result {
                    Err(e) => {
                        ctx.events
                            .publish_best_effort(
                                &object_ref(lb),
                                EventType::Warning,
                                "OpenStackError",
                                &e.to_string(),
                            )
                            .await;
                        openstack_error = Some(e.into());
                    }
                    Ok(()) if status.external_ip != had_ip => {
                        let msg = format!(
                            "external IP {}",
                            status.external_ip.as_deref().unwrap_or("-")
                        );
                        ctx.events
                            .publish_best_effort(
                                &object_ref(lb),
                                EventType::Normal,
                                "ExternalIPAssigned",
                                &msg,
                            )
                            .await;
                    }
                    Ok(()) => {}
                }
            }
        }
    }

    openstack_error
}

/// The set step ([`plan_sets`] on the sets of the cache, `sets`, which gains a set it creates): creates, scales and
/// deletes sets. Returns when to look again and the revision the LoadBalancer's annotation should name, if it changes.
async fn apply_sets<F: CloudFactory>(
    lb: &LoadBalancer,
    run: &Running<F>,
    status: &LoadBalancerStatus,
    now: jiff::Timestamp,
    sets: &mut Vec<LoadBalancerSet>,
    problems: &mut Vec<String>,
) -> Result<(Duration, Option<u64>), Error> {
    let ctx = &run.ctx;
    let ns = lb.namespace().unwrap_or_default();
    let name = lb.name_any();
    let mut annotated = None;
    let mut requeue = ctx.config.resync;
    if let Err(msg) = revision_of(&lb.metadata) {
        problems.push(msg);
    }
    let invalid = template_problems(lb);
    let template = if invalid.is_empty() {
        machine_template(lb, status)
    } else {
        problems.extend(invalid);
        None
    };
    if let Some(template) = template {
        let plan = plan_sets(lb, &template, sets, now, &ctx.config.rollout);
        let set_api: Api<LoadBalancerSet> = Api::namespaced(ctx.client.clone(), &ns);
        // The LoadBalancer's revision names the set that exists for its template, never one that could not be made.
        let mut revision = Some(plan.revision);
        if let Some(new) = &plan.create {
            match set_api.create(&PostParams::default(), new).await {
                Ok(created) => {
                    let msg = format!(
                        "created LoadBalancerSet {} (revision {}, {} replicas)",
                        created.name_any(),
                        plan.revision,
                        new.spec.replicas
                    );
                    info!(lb = %name, "{msg}");
                    ctx.events
                        .publish_best_effort(
                            &object_ref(lb),
                            EventType::Normal,
                            "LoadBalancerSetCreated",
                            &msg,
                        )
                        .await;
                    sets.push(created);
                }
                // Our cache is behind, or the old set of that name is still being deleted: look again shortly.
                Err(e) if is_conflict(&e) => {
                    debug!(lb = %name, "set {} exists; retrying", new.name_any());
                    requeue = requeue.min(ctx.config.deletion_poll);
                    revision = None;
                }
                Err(e) => return Err(e.into()),
            }
        }
        for (set, replicas) in &plan.scale {
            set_api
                .patch(
                    set,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"replicas": replicas}})),
                )
                .await?;
            if *replicas == 0 {
                let msg = format!("scaling old LoadBalancerSet {set} to 0: the current set is ready and holds the VIP");
                ctx.events
                    .publish_best_effort(
                        &object_ref(lb),
                        EventType::Normal,
                        "LoadBalancerSetScaledDown",
                        &msg,
                    )
                    .await;
            }
        }
        for set in &plan.delete {
            match set_api.delete(set, &DeleteParams::default()).await {
                Err(e) if !is_not_found(&e) => return Err(e.into()),
                _ => {}
            }
            ctx.events
                .publish_best_effort(
                    &object_ref(lb),
                    EventType::Normal,
                    "LoadBalancerSetDeleted",
                    &format!("deleted old LoadBalancerSet {set}"),
                )
                .await;
        }
        annotated = revision.filter(|r| revision_of(&lb.metadata).ok().flatten() != Some(*r));
        if let Some(d) = plan.recheck {
            requeue = requeue.min(d.max(Duration::from_millis(100)));
        }
    }

    Ok((requeue, annotated))
}

/// Allocates the VRRP router id once (see the module docs); a valid one is never changed.
async fn ensure_router_id<F: CloudFactory>(
    lb: &LoadBalancer,
    run: &Running<F>,
    problems: &mut Vec<String>,
) -> Result<(), Error> {
    match router_id(lb) {
        Ok(Some(_)) => return Ok(()),
        Ok(None) => {}
        Err(msg) => problems.push(msg),
    }
    let ctx = &run.ctx;
    let ns = lb.namespace().unwrap_or_default();
    let api: Api<LoadBalancer> = Api::namespaced(ctx.client.clone(), &ns);
    let _one_at_a_time = run.router_ids.lock().await;
    // A fresh list, not the cache: the previous allocation (under this lock) must be visible.
    let all = api.list(&ListParams::default()).await?.items;
    if let Some(me) = all.iter().find(|o| o.uid() == lb.uid()) {
        if let Ok(Some(_)) = router_id(me) {
            return Ok(());
        }
    }
    let taken = taken_router_ids(lb, &all);
    match lb_api::ha::router_id_for(&ns, &lb.name_any(), &taken) {
        Some(id) => {
            api.patch(
                &lb.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {
                    lb_annotations::VRRP_ROUTER_ID: id.to_string()
                }}})),
            )
            .await?;
            info!(lb = %lb.name_any(), id, "VRRP router id allocated");
        }
        None => {
            let msg = format!(
                "no free VRRP router id on network {}: all 255 are used by other LoadBalancers",
                lb.spec.infrastructure.effective_network_id().unwrap_or("?")
            );
            problems.push(msg);
        }
    }
    Ok(())
}

/// Creates the sync Secret when it is missing. An existing Secret is never rewritten: a missing key is reported,
/// not replaced (an operator may be rotating it; deleting the Secret gets a new one).
async fn ensure_sync_secret<F: CloudFactory>(
    lb: &LoadBalancer,
    run: &Running<F>,
    problems: &mut Vec<String>,
) -> Result<(), Error> {
    let ctx = &run.ctx;
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &lb.namespace().unwrap_or_default());
    let name = sync_secret_name(lb);
    if let Some(existing) = api.get_opt(&name).await? {
        let ok = existing
            .data
            .as_ref()
            .and_then(|d| d.get(sync::SECRET_KEY))
            .is_some_and(|v| !v.0.is_empty());
        if !ok {
            let msg = format!(
                "Secret {name} has no key {:?}; not replacing it (delete the Secret to get a new one)",
                sync::SECRET_KEY
            );
            problems.push(msg);
        }
        return Ok(());
    }
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: lb.namespace(),
            labels: lb.spec.selector.match_labels.clone(),
            owner_references: Some(vec![ownership::owner_reference(lb)]),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            sync::SECRET_KEY.to_string(),
            ByteString(lb_api::ha::new_sync_secret().into_bytes()),
        )])),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            ctx.events
                .publish_best_effort(
                    &object_ref(lb),
                    EventType::Normal,
                    "SyncSecretCreated",
                    &format!("created Secret {name} for state sync between the machines"),
                )
                .await;
            Ok(())
        }
        Err(e) if is_conflict(&e) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// A failed step is retried with the LoadBalancer's backoff (1 s doubling, at most a minute: [`Retries`]).
fn error_policy<F: CloudFactory>(
    lb: Arc<LoadBalancer>,
    error: &Error,
    run: Arc<Running<F>>,
) -> Action {
    let reference = ObjectRef::from_obj(lb.as_ref());
    let (failures, delay) = run.retries.failed(&reference);
    warn!(loadbalancer = %reference, %error, failures, retry_in = ?delay, "LoadBalancer reconcile failed");
    Action::requeue(delay)
}

/// What of a set the LoadBalancer reacts to: replicas, status, deletion, labels, revision.
fn set_fingerprint(s: &LoadBalancerSet) -> u64 {
    hash_of(&(
        s.metadata.deletion_timestamp.is_some(),
        s.spec.replicas,
        serde_json::to_string(&s.status).unwrap_or_default(),
        s.labels(),
        s.annotations().get(lb_annotations::REVISION),
    ))
}

/// What of a machine the LoadBalancer reacts to: its address (sync peers), deletion, owner, whether it is eligible
/// for an active-active VIP (not its heartbeats: [`ensure_routes`] rechecks those on a timer).
fn machine_fingerprint(m: &LoadBalancerMachine) -> u64 {
    let eligible = m
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| {
            c.iter()
                .find(|c| c.type_ == lb_api::constants::conditions::VIP_ELIGIBLE)
        })
        .map(|c| c.status.clone());
    hash_of(&(
        m.metadata.deletion_timestamp.is_some(),
        eligible,
        m.status.as_ref().and_then(|s| s.default_port_ip.clone()),
        &m.spec.load_balancer_ref.name,
        &m.spec.load_balancer_ref.namespace,
    ))
}

/// Runs the LoadBalancer controller over the LoadBalancers of `namespace` until `shutdown`.
pub async fn run<F: CloudFactory>(ctx: Arc<Context<F>>, namespace: &str, stop: Stop) {
    let api: Api<LoadBalancer> = Api::namespaced(ctx.client.clone(), namespace);
    let sets: Api<LoadBalancerSet> = Api::namespaced(ctx.client.clone(), namespace);
    let machines: Api<LoadBalancerMachine> = Api::namespaced(ctx.client.clone(), namespace);
    let (set_store, set_writer) = reflector::store();
    let set_events = watches::events(sets, watcher::Config::default()).reflect(set_writer);
    let (machine_store, machine_writer) = reflector::store();
    let machine_events =
        watches::events(machines, watcher::Config::default()).reflect(machine_writer);
    let running = Arc::new(Running {
        ctx,
        sets: set_store,
        machines: machine_store,
        router_ids: tokio::sync::Mutex::new(()),
        reported: Reported::default(),
        retries: Retries::new(retry::BASE, retry::OUTAGE_MAX),
        routes: std::sync::Mutex::new(BTreeMap::new()),
    });
    let controller = watches::controller(api, watcher::Config::default());
    let store = controller.store();
    let gc = tokio::spawn(forget_vanished_loadbalancers(
        store.clone(),
        running.ctx.metrics.clone(),
        running.ctx.config.resync,
    ));
    let run = controller
        .owns_stream(relevant_changes(set_events, set_fingerprint))
        .watches_stream(
            relevant_changes(machine_events, machine_fingerprint),
            |m: LoadBalancerMachine| {
                let ns = m.namespace().unwrap_or_default();
                let r = m.spec.load_balancer_ref;
                let ns = if r.namespace.is_empty() {
                    ns
                } else {
                    r.namespace
                };
                Some(ObjectRef::new(&r.name).within(&ns))
            },
        )
        .graceful_shutdown_on(stop.clone().wait())
        .run(reconcile, error_policy, running)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "loadbalancer controller");
            }
        });
    drive(store, run, stop).await;
    gc.abort();
}

/// Series of LoadBalancers that vanished without a reconcile seeing their deletion (finalizer removed by someone
/// else).
async fn forget_vanished_loadbalancers(
    store: Store<LoadBalancer>,
    metrics: Arc<Metrics>,
    period: Duration,
) {
    if store.wait_until_ready().await.is_err() {
        return;
    }
    let mut tick = tokio::time::interval(period);
    loop {
        tick.tick().await;
        metrics
            .loadbalancers
            .retain(|ns, name| store.get(&ObjectRef::new(name).within(ns)).is_some());
    }
}

#[cfg(test)]
mod tests;
