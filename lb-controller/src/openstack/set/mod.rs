//! The LoadBalancerSet controller (yawol's `loadbalancerset` controller plus its machine-status reconciler): keeps
//! `spec.replicas` LoadBalancerMachines of the set's template alive, replaces unhealthy ones, and reports the set's
//! status (`replicas`, `readyReplicas`, `availableReplicas`, condition `HasKeepalivedMaster`).
//!
//! The decisions are pure functions ([`machine_view`], [`heartbeat_outage`], [`plan_set`], [`new_machine`]); the
//! reconcile reads, plans, and — only when the plan writes — re-reads the set's machines from the API server and
//! plans again, so a create or delete is never based on a lagging cache.
//!
//! Rules:
//! - **Scale up** one machine at a time: a machine is created only while no machine of the set is *pending* (not
//!   ready and younger than [`LbsControllerConfig::scale_up_timeout`]); a template that never boots therefore costs
//!   one VM per timeout, not `replicas` VMs at once.
//! - **Scale down** one machine per reconcile: unready first, then non-VRRP-masters, else the first by name
//!   ([`machine::scale_down_victim`]), so the VIP moves only when nothing else is left.
//! - **Health** ([`machine::machine_health`], with yawol's `Envoy*` conditions accepted for `Dataplane*`): bad for
//!   3 minutes → condition `MarkedForDeletion`; still bad 2 minutes later → the machine is deleted and the next
//!   reconcile creates its replacement; recovered → the mark is removed.
//! - **Outage guard**: when at least [`LbsControllerConfig::outage_min_machines`] machines of the namespace have
//!   reported heartbeats and *none* of them has a heartbeat younger than 3 minutes, every agent stopped reporting at
//!   once. That is the API server (or the path from the VMs to it, or this controller's view of it) failing, not the
//!   machines: their data planes keep forwarding without the API. While this holds no machine is marked, deleted for
//!   health, or scaled down (gauge `lb_cloud_controller_machine_heartbeat_outage` = 1, one Warning event per set that
//!   had an action held); creating machines and clearing marks stay allowed. A single machine cannot be told apart
//!   from an outage, so below the minimum the per-machine rules (and their 2-minute grace) apply alone.
//! - **Deletion**: every machine is deleted, the set waits until they are gone (their finalizers release the VMs),
//!   then drops its finalizer `stackit.cloud/loadbalancermachine`.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::runtime::retry::{self, Retries};
use crate::runtime::stop::{drive, Stop};
use crate::runtime::watches;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{NodeCondition, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use lb_api::constants::{conditions, finalizers, lb_annotations, lbm_annotations};
use lb_api::{LoadBalancerMachine, LoadBalancerSet, LoadBalancerSetStatus};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::metrics::Metrics;
use crate::openstack::machine::resources::{
    self as machine, Health, CREATION_TIMEOUT, HEARTBEAT_STALE,
};
use crate::runtime::events::{EventPublisher, EventType};
use crate::runtime::finalizer;

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
pub struct LbsControllerConfig {
    /// Periodic reconcile: machine health depends on time, not only on changes (yawol: 10–15 s).
    pub requeue: Duration,
    /// How long a new, not yet ready machine blocks the creation of the next one.
    pub scale_up_timeout: Duration,
    /// Poll interval while the machines of a deleted set go away.
    pub deletion_poll: Duration,
    /// Fewest reporting machines (namespace-wide) for "all heartbeats stale" to count as an outage.
    pub outage_min_machines: usize,
}

impl Default for LbsControllerConfig {
    fn default() -> Self {
        LbsControllerConfig {
            requeue: Duration::from_secs(15),
            scale_up_timeout: Duration::from_secs(300),
            deletion_poll: Duration::from_secs(2),
            outage_min_machines: 2,
        }
    }
}

/// Shared state of the controller.
pub struct LbsContext {
    /// Control-cluster client.
    pub client: Client,
    /// Events on the sets.
    pub events: Arc<EventPublisher>,
    /// `/metrics`.
    pub metrics: Arc<Metrics>,
    /// Settings.
    pub config: LbsControllerConfig,
}

/// What the controller needs to know about one machine.
#[derive(Clone, Debug, PartialEq)]
pub struct MachineView {
    /// Name.
    pub name: String,
    /// `metadata.creationTimestamp`.
    pub created: jiff::Timestamp,
    /// Has a deletion timestamp.
    pub deleting: bool,
    /// The health verdict.
    pub health: Health,
    /// VRRP master with a fresh heartbeat.
    pub master: bool,
    /// Carries `MarkedForDeletion=True`.
    pub marked: bool,
}

impl MachineView {
    /// Ready (a recovered machine whose mark is still to be removed is ready too).
    pub fn ready(&self) -> bool {
        matches!(self.health, Health::Ready | Health::ClearMark)
    }
}

fn age(now: jiff::Timestamp, t: jiff::Timestamp) -> Duration {
    Duration::from_secs_f64(now.duration_since(t).as_secs_f64().max(0.0))
}

fn fresh(c: &NodeCondition, now: jiff::Timestamp) -> bool {
    c.last_heartbeat_time
        .as_ref()
        .is_some_and(|t| age(now, t.0) <= HEARTBEAT_STALE)
}

/// The agent's conditions as the health rules read them: yawol's `EnvoyReady`/`EnvoyUpToDate` stand in for a missing
/// `DataplaneReady`/`DataplaneUpToDate`, so machines of a yawol-era agent are judged by what they report instead of
/// being replaced for a name.
pub fn health_conditions(conds: &[NodeCondition]) -> Vec<NodeCondition> {
    let mut out = conds.to_vec();
    for (ours, yawol) in [
        (conditions::DATAPLANE_READY, conditions::ENVOY_READY),
        (
            conditions::DATAPLANE_UP_TO_DATE,
            conditions::ENVOY_UP_TO_DATE,
        ),
    ] {
        if !conds.iter().any(|c| c.type_ == ours) {
            if let Some(c) = conds.iter().find(|c| c.type_ == yawol) {
                out.push(NodeCondition {
                    type_: ours.to_string(),
                    ..c.clone()
                });
            }
        }
    }
    out
}

/// Judges one machine. The second value is a problem with the machine's input (an unparsable
/// `yawol.stackit.cloud/creationTimeout`, then the 10-minute default applies).
pub fn machine_view(
    m: &LoadBalancerMachine,
    now: jiff::Timestamp,
) -> (MachineView, Option<String>) {
    let mut problem = None;
    let timeout = match m.annotations().get(lbm_annotations::CREATION_TIMEOUT) {
        None => CREATION_TIMEOUT,
        Some(raw) => match lb_api::parse_go_duration(raw) {
            Ok(d) => d,
            Err(e) => {
                problem = Some(format!(
                    "annotation {}={raw:?} on {} is not a Go duration ({e}); using {}s",
                    lbm_annotations::CREATION_TIMEOUT,
                    m.name_any(),
                    CREATION_TIMEOUT.as_secs()
                ));
                CREATION_TIMEOUT
            }
        },
    };
    let created = m.metadata.creation_timestamp.as_ref().map_or(now, |t| t.0);
    let conds = m
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    let health = machine::machine_health(&health_conditions(&conds), &Time(created), now, timeout);
    let master = conds.iter().any(|c| {
        c.type_ == conditions::KEEPALIVED_MASTER && c.status == conditions::TRUE && fresh(c, now)
    });
    let marked = conds
        .iter()
        .any(|c| c.type_ == conditions::MARKED_FOR_DELETION && c.status == conditions::TRUE);
    let view = MachineView {
        name: m.name_any(),
        created,
        deleting: m.metadata.deletion_timestamp.is_some(),
        health,
        master,
        marked,
    };
    (view, problem)
}

/// The newest heartbeat the agent wrote (our own `MarkedForDeletion` does not count).
fn newest_heartbeat(m: &LoadBalancerMachine) -> Option<jiff::Timestamp> {
    m.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .filter(|c| c.type_ != conditions::MARKED_FOR_DELETION)
        .filter_map(|c| c.last_heartbeat_time.as_ref().map(|t| t.0))
        .max()
}

/// The outage guard (module docs): at least `min_machines` live machines have reported heartbeats and none of them
/// has one fresher than [`HEARTBEAT_STALE`].
pub fn heartbeat_outage<'a>(
    machines: impl IntoIterator<Item = &'a LoadBalancerMachine>,
    now: jiff::Timestamp,
    min_machines: usize,
) -> bool {
    let mut reporting = 0;
    for m in machines {
        if m.metadata.deletion_timestamp.is_some() {
            continue;
        }
        if let Some(hb) = newest_heartbeat(m) {
            if age(now, hb) <= HEARTBEAT_STALE {
                return false;
            }
            reporting += 1;
        }
    }
    reporting >= min_machines.max(1)
}

/// Why a machine is deleted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeleteReason {
    /// The health rules gave up on it (the message says why).
    Unhealthy(String),
    /// The set has more machines than replicas.
    ScaleDown,
}

/// What one reconcile of a set does.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SetPlan {
    /// Create one machine.
    pub create: bool,
    /// Machines to delete.
    pub delete: Vec<(String, DeleteReason)>,
    /// Machines to mark `MarkedForDeletion` (with the reason).
    pub mark: Vec<(String, String)>,
    /// Machines whose mark is removed (they recovered).
    pub clear_mark: Vec<String>,
    /// Actions the outage guard held back (for the event).
    pub held: Vec<String>,
    /// The status after this reconcile.
    pub status: LoadBalancerSetStatus,
}

impl SetPlan {
    /// Whether the plan writes machines.
    pub fn writes_machines(&self) -> bool {
        self.create
            || !self.delete.is_empty()
            || !self.mark.is_empty()
            || !self.clear_mark.is_empty()
    }
}

/// The set's `HasKeepalivedMaster` condition, if it has one (written by this controller, read by the rollout gate).
pub fn keepalived_master(set: &LoadBalancerSet) -> Option<&Condition> {
    set.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| {
            c.iter()
                .find(|c| c.type_ == conditions::HAS_KEEPALIVED_MASTER)
        })
}

/// `HasKeepalivedMaster` for the new state; the transition time survives an unchanged status (so the LoadBalancer's
/// rollout gate can measure how long it has held).
pub fn master_condition(
    prev: Option<&Condition>,
    master: Option<&str>,
    now: jiff::Timestamp,
) -> Condition {
    let (status, reason, message) = match master {
        Some(name) => (
            conditions::TRUE,
            conditions::REASON_KEEPALIVED_MASTER_IN_SET,
            format!("{name} is VRRP master"),
        ),
        None => (
            conditions::FALSE,
            conditions::REASON_NO_KEEPALIVED_MASTER_IN_SET,
            "no machine of the set reports KeepalivedMaster=True".to_string(),
        ),
    };
    let last_transition_time = match prev {
        Some(p) if p.status == status => p.last_transition_time.clone(),
        _ => Time(now),
    };
    Condition {
        type_: conditions::HAS_KEEPALIVED_MASTER.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        last_transition_time,
        observed_generation: None,
    }
}

/// Plans one reconcile of `set` over its machines (`views`, any order). `outage`: [`heartbeat_outage`] holds.
pub fn plan_set(
    set: &LoadBalancerSet,
    views: &[MachineView],
    now: jiff::Timestamp,
    outage: bool,
    config: &LbsControllerConfig,
) -> SetPlan {
    let mut plan = SetPlan::default();
    let desired = if set.metadata.deletion_timestamp.is_some() {
        0
    } else {
        usize::try_from(set.spec.replicas).unwrap_or(0)
    };
    let mut live: Vec<&MachineView> = views.iter().filter(|m| !m.deleting).collect();
    live.sort_by(|a, b| a.name.cmp(&b.name));
    let mut doomed: HashSet<&str> = HashSet::new();
    for m in &live {
        match &m.health {
            Health::Delete(_) if outage => plan.held.push(format!("delete {}", m.name)),
            Health::Delete(reason) => {
                doomed.insert(&m.name);
                plan.delete
                    .push((m.name.clone(), DeleteReason::Unhealthy(reason.clone())));
            }
            Health::MarkForDeletion(_) if outage => plan.held.push(format!("mark {}", m.name)),
            Health::MarkForDeletion(reason) => plan.mark.push((m.name.clone(), reason.clone())),
            Health::ClearMark => plan.clear_mark.push(m.name.clone()),
            Health::Ready | Health::Unready(_) => {}
        }
    }
    let remaining: Vec<&MachineView> = live
        .iter()
        .copied()
        .filter(|m| !doomed.contains(m.name.as_str()))
        .collect();
    if remaining.len() < desired {
        let pending = remaining
            .iter()
            .any(|m| !m.ready() && age(now, m.created) < config.scale_up_timeout);
        plan.create = !pending;
    } else if remaining.len() > desired {
        let candidates: Vec<(String, bool, bool)> = remaining
            .iter()
            .map(|m| (m.name.clone(), m.ready(), m.master))
            .collect();
        if let Some(victim) = machine::scale_down_victim(&candidates) {
            if outage {
                plan.held.push(format!("scale down {victim}"));
            } else {
                if let Some(m) = remaining.iter().find(|m| m.name == victim) {
                    doomed.insert(&m.name);
                }
                plan.delete.push((victim, DeleteReason::ScaleDown));
            }
        }
    }
    let staying: Vec<&MachineView> = remaining
        .iter()
        .copied()
        .filter(|m| !doomed.contains(m.name.as_str()))
        .collect();
    let ready = staying.iter().filter(|m| m.ready()).count();
    let available = staying.iter().filter(|m| m.ready() && !m.marked).count();
    let master = staying.iter().find(|m| m.master).map(|m| m.name.as_str());
    let prev = keepalived_master(set);
    let count = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
    plan.status = LoadBalancerSetStatus {
        replicas: Some(count(staying.len() + usize::from(plan.create))),
        ready_replicas: Some(count(ready)),
        available_replicas: Some(count(available)),
        conditions: Some(vec![master_condition(prev, master, now)]),
    };
    plan
}

/// Lower-case consonants and digits, like the API server's `generateName` (no vowels: no words in names).
const NAME_ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";

/// Five random characters for a machine name.
pub fn random_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    COUNTER.fetch_add(1, Ordering::Relaxed).hash(&mut h);
    jiff::Timestamp::now().as_nanosecond().hash(&mut h);
    let mut x = h.finish();
    (0..5)
        .map(|_| {
            let c = NAME_ALPHABET[(x % NAME_ALPHABET.len() as u64) as usize];
            x /= NAME_ALPHABET.len() as u64;
            c as char
        })
        .collect()
}

/// A new machine of `set`: `<set>-<suffix>`, the template's labels and spec, the set's revision annotation, the set
/// as controlling owner.
pub fn new_machine(set: &LoadBalancerSet, suffix: &str) -> LoadBalancerMachine {
    let mut annotations = std::collections::BTreeMap::new();
    if let Some(rev) = set.annotations().get(lb_annotations::REVISION) {
        annotations.insert(lb_annotations::REVISION.to_string(), rev.clone());
    }
    LoadBalancerMachine {
        metadata: ObjectMeta {
            name: Some(format!("{}-{suffix}", set.name_any())),
            namespace: set.namespace(),
            labels: set.spec.template.labels.clone(),
            annotations: Some(annotations),
            owner_references: Some(vec![crate::runtime::ownership::owner_reference(set)]),
            ..Default::default()
        },
        spec: set.spec.template.spec.clone(),
        status: None,
    }
}

/// Whether `m` belongs to `set`: controlled by it (by UID), or — for objects without owner references — carrying the
/// set's selector labels.
pub fn owned_by(m: &LoadBalancerMachine, set: &LoadBalancerSet) -> bool {
    crate::runtime::ownership::belongs_to(
        &m.metadata,
        "LoadBalancerSet",
        &set.metadata,
        &set.spec.selector,
    )
}

/// `key=value,…` of a label map (list selector).
pub fn label_selector(labels: Option<&std::collections::BTreeMap<String, String>>) -> String {
    labels
        .into_iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// A watch stream reduced to the changes that matter: an object is passed on when `fingerprint` changes and always
/// when it is deleted (a fingerprint filter alone would swallow deletions). Heartbeat-only updates of machines, every
/// 30 s per agent, thus wake nobody.
pub fn relevant_changes<K, S>(
    stream: S,
    fingerprint: fn(&K) -> u64,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send
where
    K: Resource + Send + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    let mut seen: HashMap<String, u64> = HashMap::new();
    let key = |k: &K| {
        let m = k.meta();
        format!(
            "{}/{}/{}",
            m.namespace.as_deref().unwrap_or(""),
            m.name.as_deref().unwrap_or(""),
            m.uid.as_deref().unwrap_or("")
        )
    };
    stream.filter_map(move |event| {
        let out = match event {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                let f = fingerprint(&o);
                (seen.insert(key(&o), f) != Some(f)).then_some(Ok(o))
            }
            Ok(watcher::Event::Delete(o)) => {
                seen.remove(&key(&o));
                Some(Ok(o))
            }
            Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
            Err(e) => Some(Err(e)),
        };
        std::future::ready(out)
    })
}

fn hash_of(value: &impl Hash) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut h);
    h.finish()
}

/// What of a machine the set controller reacts to: deletion, owner, labels, condition statuses (not heartbeats).
pub fn machine_fingerprint(m: &LoadBalancerMachine) -> u64 {
    let conds: Vec<(String, String)> = m
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .map(|c| (c.type_.clone(), c.status.clone()))
        .collect();
    hash_of(&(
        m.metadata.deletion_timestamp.is_some(),
        m.metadata
            .owner_references
            .as_ref()
            .map(|o| serde_json::to_string(o).unwrap_or_default()),
        m.labels(),
        conds,
    ))
}

/// Bad input per object, so that each problem is counted and gets its Warning event once when it appears — and again
/// only after it was gone (fixed) for a whole reconcile, not on every reconcile while it lasts.
#[derive(Default)]
pub(crate) struct Reported(Mutex<HashMap<String, HashSet<String>>>);

impl Reported {
    /// The problems of `problems` not reported yet for the object `uid`. With `complete` (the reconcile finished, so
    /// `problems` is everything the object has now) the ones no longer present are forgotten.
    pub(crate) fn fresh(&self, uid: &str, problems: &[String], complete: bool) -> Vec<String> {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let known = all.entry(uid.to_string()).or_default();
        let new: Vec<String> = problems
            .iter()
            .filter(|p| !known.contains(*p))
            .cloned()
            .collect();
        if complete {
            *known = problems.iter().cloned().collect();
        } else {
            known.extend(new.iter().cloned());
        }
        if known.is_empty() {
            all.remove(uid);
        }
        new
    }

    /// The object is gone.
    pub(crate) fn forget(&self, uid: &str) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(uid);
    }
}

/// Shared by the reconciles of one running controller.
struct Running {
    ctx: Arc<LbsContext>,
    machines: Store<LoadBalancerMachine>,
    reported: Reported,
    /// Per set UID: the actions the outage guard last held (one event per change, not per reconcile).
    held: Mutex<HashMap<String, String>>,
    /// Failures per set, for the error policy's backoff.
    retries: Retries<ObjectRef<LoadBalancerSet>>,
}

impl Running {
    async fn publish(&self, set: &LoadBalancerSet, t: EventType, reason: &str, msg: &str) {
        publish(&self.ctx.events, &set.object_ref(&()), t, reason, msg).await;
    }
}

async fn publish(
    events: &EventPublisher,
    object: &ObjectReference,
    t: EventType,
    reason: &str,
    msg: &str,
) {
    if let Err(e) = events.publish(object, t, reason, msg).await {
        warn!(error = %e, "publishing event");
    }
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

async fn reconcile(set: Arc<LoadBalancerSet>, run: Arc<Running>) -> Result<Action, Error> {
    let started = std::time::Instant::now();
    let mut problems = Vec::new();
    let result = reconcile_inner(&set, &run, &mut problems).await;
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

async fn reconcile_inner(
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
    let has_finalizer = finalizer::has(set, finalizers::LOADBALANCERSET);
    let list_live = || async {
        let selector = label_selector(set.spec.selector.match_labels.as_ref());
        let list = machines
            .list(&ListParams::default().labels(&selector))
            .await?;
        Ok::<_, kube::Error>(
            list.items
                .into_iter()
                .filter(|m| owned_by(m, set))
                .collect::<Vec<_>>(),
        )
    };

    if set.meta().deletion_timestamp.is_some() {
        if !has_finalizer {
            // Not ours to finish (someone removed the finalizer): it goes any moment.
            ctx.metrics.objects.forget_set(set);
            return Ok(Action::await_change());
        }
        ctx.metrics.objects.observe_set(set);
        let live = list_live().await?;
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
        ctx.metrics.objects.forget_set(set);
        let uid = set.uid().unwrap_or_default();
        run.reported.forget(&uid);
        run.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&uid);
        info!(set = %name, "machines deleted, finalizer removed");
        return Ok(Action::await_change());
    }

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
        current = list_live().await?;
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
                    machine::DELETION_GRACE.as_secs()
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
    ctx.metrics.objects.observe_set(&observed);
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
pub async fn run(ctx: Arc<LbsContext>, namespace: &str, stop: Stop) {
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
        metrics.objects.retain_sets(|ns, name| {
            store
                .get(&reflector::ObjectRef::new(name).within(ns))
                .is_some()
        });
    }
}

#[cfg(test)]
mod tests;
