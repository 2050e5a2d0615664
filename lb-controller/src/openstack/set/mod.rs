//! The LoadBalancerSet controller (yawol's `loadbalancerset` controller plus its machine-status reconciler): keeps
//! `spec.replicas` LoadBalancerMachines of the set's template alive, replaces unhealthy ones, and reports the set's
//! status (`replicas`, `readyReplicas`, `availableReplicas`, condition `HasKeepalivedMaster`).
//!
//! A reconcile is `apply` or, once the set is being deleted, `cleanup`. The decisions are pure functions in
//! [`plan`] ([`machine_view`], [`heartbeat_outage`], [`plan_set`], [`new_machine`]) over the health rules of
//! [`health`]; `apply` reads, plans, and — only when the plan writes — re-reads the set's machines from the API server
//! and plans again, so a create or delete is never based on a lagging cache.
//!
//! Rules:
//! - **Scale up** one machine at a time: a machine is created only while no machine of the set is *pending* (not
//!   ready and younger than [`Config::scale_up_timeout`]); a template that never boots therefore costs
//!   one VM per timeout, not `replicas` VMs at once.
//! - **Scale down** one machine per reconcile: unready first, then non-VRRP-masters, else the first by name
//!   ([`health::scale_down_victim`]), so the VIP moves only when nothing else is left.
//! - **Health** ([`health::machine_health`], with yawol's `Envoy*` conditions accepted for `Dataplane*`): bad for
//!   3 minutes → condition `MarkedForDeletion`; still bad 2 minutes later → the machine is deleted and the next
//!   reconcile creates its replacement; recovered → the mark is removed.
//! - **Outage guard**: when at least [`Config::outage_min_machines`] machines of the namespace have
//!   reported heartbeats and *none* of them has a heartbeat younger than 3 minutes, every agent stopped reporting at
//!   once. That is the API server (or the path from the VMs to it, or this controller's view of it) failing, not the
//!   machines: their data planes keep forwarding without the API. While this holds no machine is marked, deleted for
//!   health, or scaled down (gauge `lb_cloud_controller_machine_heartbeat_outage` = 1, one Warning event per set that
//!   had an action held); creating machines and clearing marks stay allowed. A single machine cannot be told apart
//!   from an outage, so below the minimum the per-machine rules (and their 2-minute grace) apply alone.
//! - **Deletion**: every machine is deleted, the set waits until they are gone (their finalizers release the VMs),
//!   then drops its finalizer `stackit.cloud/loadbalancermachine`.

pub mod health;
pub mod metrics;
pub mod plan;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;

use k8s_openapi::api::core::v1::NodeCondition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use lb_api::constants::{conditions, finalizers};
use lb_api::{LoadBalancerMachine, LoadBalancerSet};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::metrics::Metrics;
use crate::runtime::api_errors::{is_conflict, is_not_found};
use crate::runtime::changes::relevant_changes;
use crate::runtime::events::{EventPublisher, EventType};
use crate::runtime::finalizer;
use crate::runtime::ownership::label_selector;
use crate::runtime::reported::Reported;
use crate::runtime::retry::{self, Retries};
use crate::runtime::stop::{drive, Stop};
use crate::runtime::watches;
use health::HEARTBEAT_STALE;
pub use plan::keepalived_master;
use plan::{
    heartbeat_outage, machine_fingerprint, machine_view, new_machine, owned_by, plan_set,
    random_suffix, DeleteReason, MachineView,
};

/// Controller name in `lb_cloud_controller_reconciles_total` and `..._invalid_input_total`.
pub const CONTROLLER: &str = "loadbalancerset";

/// Errors of one reconcile (logged, retried).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Kubernetes API.
    #[error("kubernetes: {0}")]
    Kube(#[from] kube::Error),
    /// The machine cache never synced (the watch ended).
    #[error("machine cache not ready")]
    Cache,
}

/// Settings of the LoadBalancerSet controller.
#[derive(Clone, Debug)]
pub struct Config {
    /// Periodic reconcile: machine health depends on time, not only on changes (yawol: 10–15 s).
    pub requeue: Duration,
    /// How long a new, not yet ready machine blocks the creation of the next one.
    pub scale_up_timeout: Duration,
    /// Poll interval while the machines of a deleted set go away.
    pub deletion_poll: Duration,
    /// Fewest reporting machines (namespace-wide) for "all heartbeats stale" to count as an outage.
    pub outage_min_machines: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            requeue: Duration::from_secs(15),
            scale_up_timeout: Duration::from_secs(300),
            deletion_poll: Duration::from_secs(2),
            outage_min_machines: 2,
        }
    }
}

/// Shared state of the controller.
pub struct Context {
    /// Control-cluster client.
    pub client: Client,
    /// Events on the sets.
    pub events: Arc<EventPublisher>,
    /// `/metrics`.
    pub metrics: Arc<Metrics>,
    /// Settings.
    pub config: Config,
}

/// Shared by the reconciles of one running controller.
struct Running {
    ctx: Arc<Context>,
    machines: Store<LoadBalancerMachine>,
    reported: Reported,
    /// Per set UID: the actions the outage guard last held (one event per change, not per reconcile).
    held: Mutex<HashMap<String, String>>,
    /// Failures per set, for the error policy's backoff.
    retries: Retries<ObjectRef<LoadBalancerSet>>,
}

impl Running {
    async fn publish(&self, set: &LoadBalancerSet, t: EventType, reason: &str, msg: &str) {
        let object = set.object_ref(&());
        self.ctx
            .events
            .publish_best_effort(&object, t, reason, msg)
            .await;
    }
}

/// One reconcile of a set: [`apply`], or [`cleanup`] once it is being deleted; bad input is reported once.
async fn reconcile(set: Arc<LoadBalancerSet>, run: Arc<Running>) -> Result<Action, Error> {
    let started = std::time::Instant::now();
    let mut problems = Vec::new();
    let result = if set.meta().deletion_timestamp.is_some() {
        cleanup(&set, &run).await
    } else {
        apply(&set, &run, &mut problems).await
    };
    let uid = set.uid().unwrap_or_default();
    for p in run.reported.fresh(&uid, &problems, result.is_ok()) {
        run.ctx.metrics.invalid(CONTROLLER, "InvalidConfiguration");
        run.publish(&set, EventType::Warning, "InvalidConfiguration", &p)
            .await;
    }
    run.ctx
        .metrics
        .observe_reconcile(CONTROLLER, result.is_ok(), started.elapsed());
    if result.is_ok() {
        run.retries.succeeded(&ObjectRef::from_obj(set.as_ref()));
    }
    result
}

/// The set's machines as the API server has them now (not the cache, which may miss the last create).
async fn live_machines(
    machines: &Api<LoadBalancerMachine>,
    set: &LoadBalancerSet,
) -> Result<Vec<LoadBalancerMachine>, kube::Error> {
    let selector = label_selector(set.spec.selector.match_labels.as_ref());
    let list = machines
        .list(&ListParams::default().labels(&selector))
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter(|m| owned_by(m, set))
        .collect())
}

/// Deletion: every machine first (their finalizers release the VMs), then the set's finalizer.
async fn cleanup(set: &LoadBalancerSet, run: &Running) -> Result<Action, Error> {
    let ctx = &run.ctx;
    if !finalizer::has(set, finalizers::LOADBALANCERSET) {
        // Not ours to finish (someone removed the finalizer): it goes any moment.
        ctx.metrics.sets.forget(set);
        return Ok(Action::await_change());
    }
    let ns = set.namespace().unwrap_or_default();
    let sets: Api<LoadBalancerSet> = Api::namespaced(ctx.client.clone(), &ns);
    let machines: Api<LoadBalancerMachine> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.metrics.sets.observe(set);
    let live = live_machines(&machines, set).await?;
    for m in live
        .iter()
        .filter(|m| m.metadata.deletion_timestamp.is_none())
    {
        match machines
            .delete(&m.name_any(), &DeleteParams::default())
            .await
        {
            Err(e) if is_not_found(&e) => {}
            other => {
                other?;
            }
        }
    }
    if !live.is_empty() {
        return Ok(Action::requeue(ctx.config.deletion_poll));
    }
    finalizer::remove(&sets, set, finalizers::LOADBALANCERSET).await?;
    ctx.metrics.sets.forget(set);
    let uid = set.uid().unwrap_or_default();
    run.reported.forget(&uid);
    run.held
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&uid);
    info!(set = %set.name_any(), "machines deleted, finalizer removed");
    Ok(Action::await_change())
}

/// The set as it should be: finalizer, machines judged and planned ([`plan_set`]), marks, deletions, at most one
/// create, the status.
async fn apply(
    set: &LoadBalancerSet,
    run: &Running,
    problems: &mut Vec<String>,
) -> Result<Action, Error> {
    let ctx = &run.ctx;
    run.machines
        .wait_until_ready()
        .await
        .map_err(|_| Error::Cache)?;
    let ns = set.namespace().unwrap_or_default();
    let name = set.name_any();
    let sets: Api<LoadBalancerSet> = Api::namespaced(ctx.client.clone(), &ns);
    let machines: Api<LoadBalancerMachine> = Api::namespaced(ctx.client.clone(), &ns);

    finalizer::add(&sets, set, finalizers::LOADBALANCERSET).await?;

    let now = jiff::Timestamp::now();
    let all = run.machines.state();
    let outage = heartbeat_outage(
        all.iter().map(|m| m.as_ref()),
        now,
        ctx.config.outage_min_machines,
    );
    ctx.metrics.heartbeat_outage.set(i64::from(outage));
    let cached: Vec<LoadBalancerMachine> = all
        .iter()
        .filter(|m| owned_by(m, set))
        .map(|m| m.as_ref().clone())
        .collect();
    let views = |ms: &[LoadBalancerMachine]| -> (Vec<MachineView>, Vec<String>) {
        let mut problems = Vec::new();
        let v = ms
            .iter()
            .map(|m| {
                let (v, p) = machine_view(m, now);
                problems.extend(p);
                v
            })
            .collect();
        (v, problems)
    };
    let (v, found) = views(&cached);
    problems.extend(found);
    let mut plan = plan_set(set, &v, now, outage, &ctx.config);
    let mut current = cached;
    if plan.writes_machines() {
        // Writes are decided on the API server's view, never on a cache that may miss the last create.
        current = live_machines(&machines, set).await?;
        let (v, _) = views(&current);
        plan = plan_set(set, &v, now, outage, &ctx.config);
    }
    let held = (!plan.held.is_empty()).then(|| {
        format!(
            "no LoadBalancerMachine in the namespace has a heartbeat younger than {}s: treating it as an API outage, \
             not as machine failures; held: {}",
            HEARTBEAT_STALE.as_secs(),
            plan.held.join(", ")
        )
    });
    let new_hold = {
        let mut last = run.held.lock().unwrap_or_else(|e| e.into_inner());
        let uid = set.uid().unwrap_or_default();
        match &held {
            Some(msg) => last.insert(uid, msg.clone()).as_ref() != Some(msg),
            None => {
                last.remove(&uid);
                false
            }
        }
    };
    if let (Some(msg), true) = (&held, new_hold) {
        warn!(set = %name, "{msg}");
        run.publish(set, EventType::Warning, "MachineDeletionHeld", msg)
            .await;
    }
    let by_name: HashMap<String, &LoadBalancerMachine> =
        current.iter().map(|m| (m.name_any(), m)).collect();

    for (m, reason) in &plan.mark {
        let Some(obj) = by_name.get(m) else { continue };
        let mut conds = obj
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        lb_api::set_condition(
            &mut conds,
            conditions::MARKED_FOR_DELETION,
            conditions::TRUE,
            conditions::REASON_PENDING_DELETION,
            reason,
            Time(now),
        );
        if write_conditions(&machines, obj, conds).await? {
            run.publish(
                set,
                EventType::Warning,
                "MachineMarkedForDeletion",
                &format!(
                    "{m}: {reason}; deleted in {}s unless it recovers",
                    health::DELETION_GRACE.as_secs()
                ),
            )
            .await;
        }
    }
    for m in &plan.clear_mark {
        let Some(obj) = by_name.get(m) else { continue };
        let conds: Vec<NodeCondition> = obj
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default()
            .into_iter()
            .filter(|c| c.type_ != conditions::MARKED_FOR_DELETION)
            .collect();
        if write_conditions(&machines, obj, conds).await? {
            run.publish(
                set,
                EventType::Normal,
                "MachineRecovered",
                &format!("{m} is healthy again"),
            )
            .await;
        }
    }
    for (m, reason) in &plan.delete {
        let Some(obj) = by_name.get(m) else { continue };
        let dp = DeleteParams {
            // Only the object we judged: a newer version (a heartbeat that just arrived) is judged again.
            preconditions: Some(Preconditions {
                uid: obj.uid(),
                resource_version: obj.resource_version(),
            }),
            ..Default::default()
        };
        match machines.delete(m, &dp).await {
            Err(e) if is_not_found(&e) || is_conflict(&e) => {
                debug!(machine = %m, error = %e, "machine changed or gone; judged again next time");
                continue;
            }
            other => {
                other?;
            }
        }
        let (t, label, msg) = match reason {
            DeleteReason::Unhealthy(r) => {
                (EventType::Warning, "unhealthy", format!("deleted {m}: {r}"))
            }
            DeleteReason::ScaleDown => (
                EventType::Normal,
                "scale_down",
                format!("deleted {m}: scale down"),
            ),
        };
        ctx.metrics.machine_deleted(label);
        info!(set = %name, "{msg}");
        run.publish(set, t, "MachineDeleted", &msg).await;
    }
    if plan.create {
        let machine = new_machine(set, &random_suffix());
        let mname = machine.name_any();
        match machines.create(&PostParams::default(), &machine).await {
            Ok(_) => {
                info!(set = %name, machine = %mname, "machine created");
                run.publish(
                    set,
                    EventType::Normal,
                    "MachineCreated",
                    &format!("created {mname}"),
                )
                .await;
            }
            Err(e) if is_conflict(&e) => debug!(machine = %mname, "name taken; next time"),
            Err(e) => return Err(e.into()),
        }
    }
    if set.status.as_ref() != Some(&plan.status) {
        sets.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": plan.status})),
        )
        .await?;
    }
    let mut observed = set.clone();
    observed.status = Some(plan.status.clone());
    ctx.metrics.sets.observe(&observed);
    Ok(Action::requeue(ctx.config.requeue))
}

/// Merge-patches a machine's conditions guarded by the version they were computed from (the agent writes the same
/// list). Returns false when the machine changed meanwhile (judged again next time).
async fn write_conditions(
    api: &Api<LoadBalancerMachine>,
    m: &LoadBalancerMachine,
    conds: Vec<NodeCondition>,
) -> Result<bool, Error> {
    let patch = json!({
        "metadata": {"resourceVersion": m.resource_version()},
        "status": {"conditions": conds},
    });
    match api
        .patch_status(
            &m.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(e) if is_conflict(&e) || is_not_found(&e) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// A failed reconcile is retried with the set's backoff (1 s doubling, at most a minute: [`Retries`]).
fn error_policy(set: Arc<LoadBalancerSet>, error: &Error, run: Arc<Running>) -> Action {
    let reference = ObjectRef::from_obj(set.as_ref());
    let (failures, delay) = run.retries.failed(&reference);
    warn!(set = %reference, %error, failures, retry_in = ?delay, "LoadBalancerSet reconcile failed");
    Action::requeue(delay)
}

/// Runs the LoadBalancerSet controller over the sets of `namespace` until `shutdown`.
pub async fn run(ctx: Arc<Context>, namespace: &str, stop: Stop) {
    let sets: Api<LoadBalancerSet> = Api::namespaced(ctx.client.clone(), namespace);
    let machines: Api<LoadBalancerMachine> = Api::namespaced(ctx.client.clone(), namespace);
    let (store, writer) = reflector::store();
    let machine_events = watches::events(machines, watcher::Config::default()).reflect(writer);
    let metrics = ctx.metrics.clone();
    let running = Arc::new(Running {
        ctx,
        machines: store,
        reported: Reported::default(),
        held: Mutex::default(),
        retries: Retries::new(retry::BASE, retry::OUTAGE_MAX),
    });
    let controller = watches::controller(sets, watcher::Config::default());
    let store = controller.store();
    let gc = tokio::spawn(forget_vanished_sets(store.clone(), metrics));
    let run = controller
        .owns_stream(relevant_changes(machine_events, machine_fingerprint))
        .graceful_shutdown_on(stop.clone().wait())
        .run(reconcile, error_policy, running)
        .for_each(|r| async move {
            if let Err(e) = r {
                debug!(error = %e, "loadbalancerset controller");
            }
        });
    drive(store, run, stop).await;
    gc.abort();
}

/// Series of sets that vanished without a reconcile seeing their deletion (finalizer removed by someone else).
async fn forget_vanished_sets(store: Store<LoadBalancerSet>, metrics: Arc<Metrics>) {
    if store.wait_until_ready().await.is_err() {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_secs(60));
    loop {
        tick.tick().await;
        metrics.sets.retain(|ns, name| {
            store
                .get(&reflector::ObjectRef::new(name).within(ns))
                .is_some()
        });
    }
}
