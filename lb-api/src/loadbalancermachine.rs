//! `LoadBalancerMachine` (`lbm`): one load-balancer VM running the agent.

// The `printcolumn(...)` arguments of the CustomResource derive repeat `type_ = "string"`,
// which clippy mistakes for duplicated attributes.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::api::core::v1::NodeCondition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::loadbalancer::{LoadBalancerInfrastructure, LoadBalancerRef};

/// Desired state of a LoadBalancerMachine.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "yawol.stackit.cloud",
    version = "v1beta1",
    kind = "LoadBalancerMachine",
    namespaced,
    shortname = "lbm",
    status = "LoadBalancerMachineStatus",
    derive = "PartialEq",
    doc = "LoadBalancerMachine is the Schema for the LoadBalancerMachine's API.",
    printcolumn(
        name = "EnvoyUpToDate",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"EnvoyUpToDate\")].status"
    ),
    printcolumn(
        name = "KeepalivedMaster",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"KeepalivedMaster\")].status"
    ),
    printcolumn(
        name = "Load1",
        type_ = "string",
        json_path = ".status.metrics[?(@.type==\"load1\")].value"
    ),
    printcolumn(
        name = "creationTimestamp",
        type_ = "string",
        json_path = ".status.creationTimestamp"
    ),
    printcolumn(
        name = "AGE",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerMachineSpec {
    /// Infrastructure of the machine (copy of the LoadBalancer's).
    pub infrastructure: LoadBalancerInfrastructure,
    /// OpenStack ID of the LoadBalancer's VIP port.
    #[serde(default, rename = "portID")]
    pub port_id: String,
    /// OpenStack ID of the server group the machine is placed in.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "serverGroupID"
    )]
    pub server_group_id: Option<String>,
    /// The LoadBalancer this machine serves.
    pub load_balancer_ref: LoadBalancerRef,
}

/// Observed state of a LoadBalancerMachine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerMachineStatus {
    /// Conditions written by the agent (`corev1.NodeCondition` shape).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<NodeCondition>>,
    /// Metrics written by the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<Vec<LoadBalancerMachineMetric>>,
    /// Creation time of the OpenStack server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_timestamp: Option<Time>,
    /// Time of the last OpenStack reconciliation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_openstack_reconcile: Option<Time>,
    /// OpenStack server ID.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "serverID")]
    pub server_id: Option<String>,
    /// OpenStack ID of the machine's own port.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "defaultPortID"
    )]
    pub default_port_id: Option<String>,
    /// OpenStack name of the machine's own port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_port_name: Option<String>,
    /// Fixed IP of the machine's own port.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "defaultPortIP"
    )]
    pub default_port_ip: Option<String>,
    /// Deprecated: use `defaultPortID`.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "portID")]
    pub port_id: Option<String>,
    /// `namespace/name` of the machine's ServiceAccount.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// `namespace/name` of the ServiceAccount token Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_secret_name: Option<String>,
    /// `namespace/name` of the machine's Role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role_name: Option<String>,
    /// `namespace/name` of the machine's RoleBinding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role_binding_name: Option<String>,
}

impl LoadBalancerMachineStatus {
    /// The condition of the given type, if present.
    pub fn condition(&self, type_: &str) -> Option<&NodeCondition> {
        self.conditions.as_ref()?.iter().find(|c| c.type_ == type_)
    }

    /// Whether the condition of the given type is present with status "True".
    pub fn is_condition_true(&self, type_: &str) -> bool {
        self.condition(type_)
            .is_some_and(|c| c.status == crate::constants::conditions::TRUE)
    }
}

/// One metric reported by the agent.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct LoadBalancerMachineMetric {
    /// Metric name (e.g. `load1`, `TCP-80-upstream_cx_active`).
    #[serde(rename = "type")]
    pub type_: String,
    /// Value as a decimal string.
    pub value: String,
    /// Sampling time.
    #[serde(rename = "timestamp")]
    pub time: Time,
}

/// Sets (inserts or updates) a `NodeCondition` the way yawol's agent does: the heartbeat is
/// always refreshed, the transition time only changes when the status changes. Returns whether
/// status, reason or message changed (heartbeat-only updates return `false`).
pub fn set_condition(
    conditions: &mut Vec<NodeCondition>,
    type_: &str,
    status: &str,
    reason: &str,
    message: &str,
    now: Time,
) -> bool {
    if let Some(existing) = conditions.iter_mut().find(|c| c.type_ == type_) {
        let status_changed = existing.status != status;
        let changed = status_changed
            || existing.reason.as_deref() != Some(reason)
            || existing.message.as_deref() != Some(message);
        if status_changed || existing.last_transition_time.is_none() {
            existing.last_transition_time = Some(now.clone());
        }
        existing.status = status.to_string();
        existing.reason = Some(reason.to_string());
        existing.message = Some(message.to_string());
        existing.last_heartbeat_time = Some(now);
        return changed;
    }
    conditions.push(NodeCondition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: Some(reason.to_string()),
        message: Some(message.to_string()),
        last_heartbeat_time: Some(now.clone()),
        last_transition_time: Some(now),
    });
    true
}
