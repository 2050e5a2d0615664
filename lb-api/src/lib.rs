//! Kubernetes API types of the load balancer, wire-compatible with yawol's
//! `yawol.stackit.cloud/v1beta1` CRDs: [`LoadBalancer`], [`LoadBalancerSet`] and
//! [`LoadBalancerMachine`], plus the annotation/label/finalizer names, Go-duration helpers and
//! naming helpers shared by the cloud controller, the OpenStack controllers and the agent, and the
//! HA settings of a LoadBalancer's machines with their rules ([`ha`]: router id, priority, advert
//! interval, sync secret; how they reach the agent is the controller's cloud-init's business).
//!
//! Objects written by yawol deserialize and serialize back unchanged: optional Go fields are
//! `Option`s here (omitted when `None`); use the accessor methods (e.g.
//! [`LoadBalancerSpec::options`], [`LoadBalancerOptions::tcp_idle_timeout`]) for defaults.
//!
//! The crate re-exports the exact `kube` and `k8s_openapi` versions it is built with; depend on
//! them through the workspace (`kube.workspace = true`) so that only one k8s-openapi version
//! feature is enabled (it is chosen once in the workspace `Cargo.toml`).

pub mod constants;
pub mod duration;
pub mod ha;
pub mod loadbalancer;
pub mod loadbalancermachine;
pub mod loadbalancerset;
pub mod naming;
pub mod schema;
#[cfg(feature = "runtime")]
pub mod watch;

pub use k8s_openapi;
pub use kube;

pub use duration::{format_go_duration, parse_go_duration, DurationError, GoDuration};
pub use loadbalancer::{port_protocol, IP_FAMILY_V4, IP_FAMILY_V6};
pub use loadbalancer::{
    LoadBalancer, LoadBalancerAdditionalNetwork, LoadBalancerDebugSettings,
    LoadBalancerDefaultNetwork, LoadBalancerEndpoint, LoadBalancerInfrastructure,
    LoadBalancerLogForward, LoadBalancerOptions, LoadBalancerRef, LoadBalancerSpec,
    LoadBalancerStatus, OpenstackFlavorRef, OpenstackImageRef,
};
pub use loadbalancermachine::{
    set_condition, LoadBalancerMachine, LoadBalancerMachineMetric, LoadBalancerMachineSpec,
    LoadBalancerMachineStatus,
};
pub use loadbalancerset::{
    LoadBalancerMachineTemplateSpec, LoadBalancerSet, LoadBalancerSetSpec, LoadBalancerSetStatus,
};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// The three CRDs, ready to install, with the file stem they are written under
/// (`deploy/crds/<stem>.yaml`). Prefer this over `LoadBalancer::crd()`: the schemas are adjusted
/// to yawol's semantics (see [`yawol_schema_semantics`]).
pub fn crds() -> Vec<(&'static str, CustomResourceDefinition)> {
    [
        ("yawol.stackit.cloud_loadbalancers", LoadBalancer::crd()),
        (
            "yawol.stackit.cloud_loadbalancersets",
            LoadBalancerSet::crd(),
        ),
        (
            "yawol.stackit.cloud_loadbalancermachines",
            LoadBalancerMachine::crd(),
        ),
    ]
    .into_iter()
    .map(|(stem, crd)| (stem, yawol_schema_semantics(crd)))
    .collect()
}

/// Schema properties that carry a server-side default in yawol's CRDs (`replicas`,
/// `options.internalLB`, `ports[].protocol`). Every other `default` that schemars derives from
/// `#[serde(default)]` is removed, so the API server does not add fields yawol would not add.
const SCHEMA_DEFAULTS: &[&str] = &["replicas", "internalLB", "protocol"];

/// Adjusts a derived CRD to yawol's (controller-gen) semantics:
/// - no `nullable: true`: the API server then prunes explicit `null`s like it does for yawol,
///   instead of storing them;
/// - server-side defaults only where yawol declares them ([`SCHEMA_DEFAULTS`]).
pub fn yawol_schema_semantics(mut crd: CustomResourceDefinition) -> CustomResourceDefinition {
    for version in &mut crd.spec.versions {
        let Some(validation) = version.schema.as_mut() else {
            continue;
        };
        let Some(schema) = validation.open_api_v3_schema.take() else {
            continue;
        };
        let mut value = serde_json::to_value(schema).expect("JSONSchemaProps serialises");
        clean_schema(&mut value);
        validation.open_api_v3_schema =
            Some(serde_json::from_value(value).expect("cleaned schema is still JSONSchemaProps"));
    }
    crd
}

fn clean_schema(schema: &mut serde_json::Value) {
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    object.remove("nullable");
    if let Some(serde_json::Value::Object(properties)) = object.get_mut("properties") {
        for (name, property) in properties.iter_mut() {
            if !SCHEMA_DEFAULTS.contains(&name.as_str()) {
                if let Some(property) = property.as_object_mut() {
                    property.remove("default");
                }
            }
            clean_schema(property);
        }
    }
    for key in ["items", "additionalProperties"] {
        if let Some(sub) = object.get_mut(key) {
            clean_schema(sub);
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(serde_json::Value::Array(subs)) = object.get_mut(key) {
            subs.iter_mut().for_each(clean_schema);
        }
    }
}
