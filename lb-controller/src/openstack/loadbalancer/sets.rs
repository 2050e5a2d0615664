//! The LoadBalancer → LoadBalancerSet step, pure (yawol's `reconcileLoadBalancerSet`): the machines' template and
//! its hash ([`machine_template`]), a new set for it ([`new_set`]), and which sets to create, scale and delete
//! ([`plan_sets`]) once the current one is ready and holds the VIP ([`holds_vip`], by the [`RolloutGate`]).
//!
//! The template (infrastructure, VIP port, server group) and the settings that only take effect when a VM boots
//! (debug, log forwarding, server-group policy) are hashed; the set named `<lb>-<hash>` is the current one. A new hash
//! creates a new set with the next revision (`loadbalancer.yawol.stackit.cloud/revision` on the set, its machines and
//! the LoadBalancer) and `spec.replicas` machines; ports, endpoints and options are not in the hash: the agents apply
//! them from the LoadBalancer itself, in place. Older sets keep their machines until the current set is fully ready
//! *and* holds the VIP (`HasKeepalivedMaster` True for 2 min, or False for 10 min — the agent may not report VRRP — or
//! absent on a set older than 15 min); then they are scaled to 0 and deleted once empty.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::ResourceExt;
use lb_api::constants::{conditions, labels, lb_annotations};
use lb_api::{
    LoadBalancer, LoadBalancerMachineSpec, LoadBalancerMachineTemplateSpec, LoadBalancerRef,
    LoadBalancerSet, LoadBalancerSetSpec, LoadBalancerStatus,
};
use serde_json::json;
use sha2::Digest;

use super::RolloutGate;
use crate::openstack::set::keepalived_master;
use crate::runtime::ownership;

/// Problems with the parts of the spec a machine needs (bad input: a set built from them could never boot).
pub fn template_problems(lb: &LoadBalancer) -> Vec<String> {
    let infra = &lb.spec.infrastructure;
    let mut problems = Vec::new();
    if infra.image.effective_id().is_none() {
        problems.push(
            "spec.infrastructure.image.imageID is not set (imageName/imageSearch are not supported); \
             no LoadBalancerSet is created or changed"
                .to_string(),
        );
    }
    if infra.flavor.effective_id().is_none() {
        problems.push(
            "spec.infrastructure.flavor.flavorID is not set (flavorName/flavorSearch are not supported); \
             no LoadBalancerSet is created or changed"
                .to_string(),
        );
    }
    if infra.effective_network_id().is_none() {
        problems.push(
            "spec.infrastructure.defaultNetwork.networkID is not set; no LoadBalancerSet is created or changed"
                .to_string(),
        );
    }
    problems
}

/// The machines' template and its hash (label `lbm-template-hash`, set name `<lb>-<hash>`).
#[derive(Clone, Debug, PartialEq)]
pub struct MachineTemplate {
    /// Spec of every machine of the set.
    pub spec: LoadBalancerMachineSpec,
    /// 16 hex characters of SHA-256 over the spec and the boot-time settings.
    pub hash: String,
}

/// The template for the LoadBalancer as it is now; `None` until the VIP port exists (the machines' ports need its
/// address as allowed address pair) and, with a server-group policy, until the group exists (machines booted outside
/// it would break the requested (anti-)affinity and be rolled over once it appears). `status` is the newest status
/// (the OpenStack step's).
///
/// The hash covers what only a new VM can apply: infrastructure (image, flavor, networks, AZ, project, credentials;
/// deprecated fields migrated first, so the migration alone rolls nothing), VIP port, server group, debug settings,
/// log forwarding, server-group policy. Ports, endpoints and the other options are read by the agents live.
pub fn machine_template(lb: &LoadBalancer, status: &LoadBalancerStatus) -> Option<MachineTemplate> {
    let port_id = status.port_id.clone().filter(|p| !p.is_empty())?;
    let opts = lb.spec.options();
    let server_group_id = status.server_group_id.clone().filter(|g| !g.is_empty());
    if opts.server_group_policy().is_some() && server_group_id.is_none() {
        return None;
    }
    let mut infrastructure = lb.spec.infrastructure.clone();
    infrastructure.migrate_deprecated();
    let spec = LoadBalancerMachineSpec {
        infrastructure,
        port_id,
        server_group_id,
        load_balancer_ref: LoadBalancerRef {
            name: lb.name_any(),
            namespace: lb.namespace().unwrap_or_default(),
        },
    };
    let mut input = json!({
        "spec": spec,
        "debugSettings": lb.spec.debug_settings,
        "logForward": opts.log_forward,
        "serverGroupPolicy": opts.server_group_policy(),
    });
    // The machines boot as a VRRP pair or active-active (their cloud-init differs): switching rolls new ones.
    // Only when on, so the templates of every VRRP LoadBalancer keep their hash.
    if super::routes::active_active(lb) {
        input["activeActive"] = json!(true);
    }
    let digest = sha2::Sha256::digest(input.to_string().as_bytes());
    let hash = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    Some(MachineTemplate { spec, hash })
}

/// Labels of the sets and machines of a template: the LoadBalancer's selector plus `lbm-template-hash`.
pub fn template_labels(lb: &LoadBalancer, hash: &str) -> BTreeMap<String, String> {
    let mut l = lb.spec.selector.match_labels.clone().unwrap_or_default();
    l.insert(labels::LBM_TEMPLATE_HASH.to_string(), hash.to_string());
    l
}

/// `<lb>-<hash>`.
pub fn set_name(lb: &LoadBalancer, hash: &str) -> String {
    format!("{}-{hash}", lb.name_any())
}

/// The revision annotation of an object: `None` when absent, an error text when it is not a number.
pub fn revision_of(meta: &ObjectMeta) -> Result<Option<u64>, String> {
    match meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(lb_annotations::REVISION))
    {
        None => Ok(None),
        Some(v) => v.trim().parse::<u64>().map(Some).map_err(|_| {
            format!(
                "annotation {}={v:?} on {} is not a number; counting it as 0",
                lb_annotations::REVISION,
                meta.name.as_deref().unwrap_or("?")
            )
        }),
    }
}

/// A new set for `template` at `revision`, with `spec.replicas` of the LoadBalancer, owned by it.
pub fn new_set(lb: &LoadBalancer, template: &MachineTemplate, revision: u64) -> LoadBalancerSet {
    let l = template_labels(lb, &template.hash);
    LoadBalancerSet {
        metadata: ObjectMeta {
            name: Some(set_name(lb, &template.hash)),
            namespace: lb.namespace(),
            labels: Some(l.clone()),
            annotations: Some(BTreeMap::from([(
                lb_annotations::REVISION.to_string(),
                revision.to_string(),
            )])),
            owner_references: Some(vec![ownership::owner_reference(lb)]),
            ..Default::default()
        },
        spec: LoadBalancerSetSpec {
            selector: LabelSelector {
                match_labels: Some(l.clone()),
                match_expressions: None,
            },
            replicas: lb.spec.replicas,
            template: LoadBalancerMachineTemplateSpec {
                labels: Some(l),
                spec: template.spec.clone(),
            },
        },
        status: None,
    }
}

/// Whether `set` belongs to `lb`: controlled by it (by UID), or — without owner references, e.g. restored from a
/// backup — carrying the LoadBalancer's selector labels.
pub fn set_of(set: &LoadBalancerSet, lb: &LoadBalancer) -> bool {
    ownership::belongs_to(
        &set.metadata,
        "LoadBalancer",
        &lb.metadata,
        &lb.spec.selector,
    )
}

fn since(now: jiff::Timestamp, t: jiff::Timestamp) -> Duration {
    Duration::from_secs_f64(now.duration_since(t).as_secs_f64().max(0.0))
}

/// How long until `set` holds the VIP by [`RolloutGate`]: zero when it does now, `None` when only a status change can
/// make it (the condition is not counting towards anything).
pub fn vip_wait(
    set: &LoadBalancerSet,
    now: jiff::Timestamp,
    gate: &RolloutGate,
) -> Option<Duration> {
    let cond = keepalived_master(set);
    let (start, need) = match cond {
        Some(c) if c.status == conditions::TRUE => (c.last_transition_time.0, gate.master_for),
        Some(c) if c.status == conditions::FALSE => (c.last_transition_time.0, gate.no_master_for),
        Some(_) => return None,
        None => (
            set.metadata
                .creation_timestamp
                .as_ref()
                .map_or(now, |t| t.0),
            gate.unknown_after,
        ),
    };
    Some(need.saturating_sub(since(now, start)))
}

/// Whether the current set holds the VIP (see [`vip_wait`]).
pub fn holds_vip(set: &LoadBalancerSet, now: jiff::Timestamp, gate: &RolloutGate) -> bool {
    vip_wait(set, now, gate) == Some(Duration::ZERO)
}

/// What the set step does.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SetsPlan {
    /// A set to create (the template is new).
    pub create: Option<LoadBalancerSet>,
    /// `(set, replicas)` to patch.
    pub scale: Vec<(String, i32)>,
    /// Old, empty sets to delete.
    pub delete: Vec<String>,
    /// The LoadBalancer's revision annotation.
    pub revision: u64,
    /// Reconcile again after this long (the rollout gate is waiting on time, not on a change).
    pub recheck: Option<Duration>,
}

/// The set step ([module docs](self)). `sets`: the LoadBalancer's sets, any order.
pub fn plan_sets(
    lb: &LoadBalancer,
    template: &MachineTemplate,
    sets: &[LoadBalancerSet],
    now: jiff::Timestamp,
    gate: &RolloutGate,
) -> SetsPlan {
    let mut plan = SetsPlan::default();
    let rev = |s: &LoadBalancerSet| revision_of(&s.metadata).ok().flatten().unwrap_or(0);
    let max_rev = sets
        .iter()
        .map(rev)
        .chain(revision_of(&lb.metadata).ok().flatten())
        .max()
        .unwrap_or(0);
    let alive: Vec<&LoadBalancerSet> = sets
        .iter()
        .filter(|s| s.metadata.deletion_timestamp.is_none())
        .collect();
    let current = alive
        .iter()
        .filter(|s| s.labels().get(labels::LBM_TEMPLATE_HASH) == Some(&template.hash))
        .max_by_key(|s| (rev(s), s.name_any()))
        .copied();
    let want = lb.spec.replicas.max(0);
    let retire = match current {
        None => {
            plan.revision = max_rev + 1;
            plan.create = Some(new_set(lb, template, plan.revision));
            false
        }
        Some(cur) => {
            plan.revision = rev(cur).max(1);
            if cur.spec.replicas != want {
                plan.scale.push((cur.name_any(), want));
            }
            let ready = cur
                .status
                .as_ref()
                .and_then(|s| s.ready_replicas)
                .unwrap_or(0);
            if want == 0 {
                true
            } else if cur.spec.replicas == want && ready >= want {
                match vip_wait(cur, now, gate) {
                    Some(d) if d.is_zero() => true,
                    wait => {
                        plan.recheck = wait;
                        false
                    }
                }
            } else {
                false
            }
        }
    };
    let current_name = current.map(|c| c.name_any());
    for s in alive {
        if Some(s.name_any()) == current_name {
            continue;
        }
        let has = s.status.as_ref().and_then(|st| st.replicas).unwrap_or(0);
        if s.spec.replicas == 0 && has == 0 {
            plan.delete.push(s.name_any());
        } else if s.spec.replicas != 0 && retire {
            plan.scale.push((s.name_any(), 0));
        }
    }
    if !sets
        .iter()
        .any(|s| Some(s.name_any()) != current_name && s.spec.replicas > 0)
    {
        // Nothing old left to retire: no reason to look again before the resync.
        plan.recheck = None;
    }
    plan
}

/// `(replicas, readyReplicas)` of the LoadBalancer: sums over its sets.
pub fn replica_sums(sets: &[LoadBalancerSet]) -> (i32, i32) {
    sets.iter().fold((0, 0), |(r, ready), s| {
        let st = s.status.clone().unwrap_or_default();
        (
            r + st.replicas.unwrap_or(0),
            ready + st.ready_replicas.unwrap_or(0),
        )
    })
}
