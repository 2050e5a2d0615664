//! Which parent a child object belongs to (LoadBalancer → LoadBalancerSet → LoadBalancerMachine).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use kube::Resource;
use std::collections::BTreeMap;

/// Whether `child` belongs to the parent of `kind` with `meta` and `selector`: in the same namespace and
/// controlled by it (by UID), or — for objects without a controller reference, e.g. restored from a backup or
/// made by an older controller — carrying every label of the parent's selector (an empty selector matches
/// nothing).
pub fn belongs_to(
    child: &ObjectMeta,
    kind: &str,
    parent: &ObjectMeta,
    selector: &LabelSelector,
) -> bool {
    if child.namespace != parent.namespace {
        return false;
    }
    let controller = child
        .owner_references
        .iter()
        .flatten()
        .find(|r| r.controller == Some(true));
    if let Some(r) = controller {
        return r.kind == kind && Some(&r.uid) == parent.uid.as_ref();
    }
    let Some(want) = selector.match_labels.as_ref().filter(|l| !l.is_empty()) else {
        return false;
    };
    let labels = child.labels.as_ref();
    want.iter()
        .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
}

/// The controller reference a child gets to its `owner` (garbage collection follows it, and [`belongs_to`]
/// decides by it).
pub fn owner_reference<K: Resource<DynamicType = ()>>(owner: &K) -> OwnerReference {
    OwnerReference {
        api_version: K::api_version(&()).to_string(),
        kind: K::kind(&()).to_string(),
        name: owner.meta().name.clone().unwrap_or_default(),
        uid: owner.meta().uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// `key=value,…` of a label map: the list selector of a parent's children.
pub fn label_selector(labels: Option<&BTreeMap<String, String>>) -> String {
    labels
        .into_iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}
