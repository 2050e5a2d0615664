//! `LoadBalancerSet` (`lbs`): a revision of a LoadBalancer's machines (like a ReplicaSet).

// The `printcolumn(...)` arguments of the CustomResource derive repeat `type_ = "string"`,
// which clippy mistakes for duplicated attributes.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::loadbalancer::default_replicas;
use crate::loadbalancermachine::LoadBalancerMachineSpec;

/// Desired state of a LoadBalancerSet.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "yawol.stackit.cloud",
    version = "v1beta1",
    kind = "LoadBalancerSet",
    namespaced,
    shortname = "lbs",
    status = "LoadBalancerSetStatus",
    derive = "PartialEq",
    doc = "LoadBalancerSet is the Schema for the LoadBalancerSet's API.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas"
    ),
    printcolumn(name = "DESIRED", type_ = "string", json_path = ".spec.replicas"),
    printcolumn(name = "CURRENT", type_ = "string", json_path = ".status.replicas"),
    printcolumn(name = "READY", type_ = "string", json_path = ".status.readyReplicas"),
    printcolumn(
        name = "HasKeepalivedMaster",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"HasKeepalivedMaster\")].status"
    ),
    printcolumn(
        name = "AGE",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerSetSpec {
    /// Label query over the machines of this set.
    #[schemars(transform = crate::schema::atomic_label_selector)]
    pub selector: LabelSelector,
    /// Number of machines. Defaults to 1.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0))]
    pub replicas: i32,
    /// Template of the machines.
    pub template: LoadBalancerMachineTemplateSpec,
}

/// Template for the machines of a set.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct LoadBalancerMachineTemplateSpec {
    /// Labels of the machines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// Spec of the machines.
    pub spec: LoadBalancerMachineSpec,
}

/// Observed state of a LoadBalancerSet.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerSetStatus {
    /// Available machines (unused by yawol).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available_replicas: Option<i32>,
    /// Ready machines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<i32>,
    /// Desired machines (yawol mirrors `spec.replicas`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Conditions; only `HasKeepalivedMaster` is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = crate::schema::metav1_conditions)]
    pub conditions: Option<Vec<Condition>>,
}
