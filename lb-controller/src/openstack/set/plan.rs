//! The set controller's decisions, pure: each machine judged ([`machine_view`], by the rules of [`super::health`]),
//! the outage guard ([`heartbeat_outage`]), what one reconcile does ([`plan_set`]), the set's
//! `HasKeepalivedMaster` condition, and a new machine ([`new_machine`]).

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashSet};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::NodeCondition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use kube::ResourceExt;
use lb_api::constants::{conditions, lb_annotations, lbm_annotations};
use lb_api::{LoadBalancerMachine, LoadBalancerSet, LoadBalancerSetStatus};

use super::health::{self, Health, CREATION_TIMEOUT, HEARTBEAT_STALE};
use super::Config;
use crate::runtime::changes::hash_of;
use crate::runtime::ownership;

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
    /// VRRP master, or eligible for an active-active VIP, with a fresh heartbeat.
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
    let health = health::machine_health(&health_conditions(&conds), &Time(created), now, timeout);
    // Active-active machines all hold the VIP while the router routes it to them (`VIPEligible`), which lets a
    // rollout's old set go the same way as a new VRRP master does.
    let master = conds.iter().any(|c| {
        (c.type_ == conditions::KEEPALIVED_MASTER || c.type_ == conditions::VIP_ELIGIBLE)
            && c.status == conditions::TRUE
            && fresh(c, now)
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
            format!("{name} is VRRP master (or routed active-active)"),
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
    config: &Config,
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
        if let Some(victim) = health::scale_down_victim(&candidates) {
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
    let mut annotations = BTreeMap::new();
    if let Some(rev) = set.annotations().get(lb_annotations::REVISION) {
        annotations.insert(lb_annotations::REVISION.to_string(), rev.clone());
    }
    LoadBalancerMachine {
        metadata: ObjectMeta {
            name: Some(format!("{}-{suffix}", set.name_any())),
            namespace: set.namespace(),
            labels: set.spec.template.labels.clone(),
            annotations: Some(annotations),
            owner_references: Some(vec![ownership::owner_reference(set)]),
            ..Default::default()
        },
        spec: set.spec.template.spec.clone(),
        status: None,
    }
}

/// Whether `m` belongs to `set`: controlled by it (by UID), or — for objects without owner references — carrying the
/// set's selector labels.
pub fn owned_by(m: &LoadBalancerMachine, set: &LoadBalancerSet) -> bool {
    ownership::belongs_to(
        &m.metadata,
        "LoadBalancerSet",
        &set.metadata,
        &set.spec.selector,
    )
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

#[cfg(test)]
mod tests;
