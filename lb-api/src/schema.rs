//! Schema adjustments for fields whose types come from k8s-openapi, whose derived schemas lack
//! the markers and validation that controller-gen adds to yawol's CRDs. Used as
//! `#[schemars(transform = ...)]` on the fields; the CRD tests check the generated result.

use schemars::Schema;
use serde_json::{json, Value};

/// The JSON object at `pointer` inside `schema`. Panics when the k8s-openapi schema no longer
/// has that shape: CRD generation (and its tests) must fail loudly rather than silently lose
/// a marker.
fn at<'a>(schema: &'a mut Schema, pointer: &str) -> &'a mut serde_json::Map<String, Value> {
    schema
        .pointer_mut(pointer)
        .and_then(Value::as_object_mut)
        .unwrap_or_else(|| panic!("schema has no object at {pointer:?}"))
}

/// `metav1.LabelSelector` as controller-gen renders it: the selector is an atomic map and its
/// `matchExpressions` (and their `values`) are atomic lists, so server-side apply replaces them
/// as a whole instead of merging.
pub(crate) fn atomic_label_selector(schema: &mut Schema) {
    schema.insert("x-kubernetes-map-type".into(), json!("atomic"));
    at(schema, "/properties/matchExpressions")
        .insert("x-kubernetes-list-type".into(), json!("atomic"));
    at(
        schema,
        "/properties/matchExpressions/items/properties/values",
    )
    .insert("x-kubernetes-list-type".into(), json!("atomic"));
}

/// `[]corev1.ServicePort`: `protocol` defaults to `TCP` on the server, like for a Service.
pub(crate) fn service_ports_protocol_default(schema: &mut Schema) {
    at(schema, "/items/properties/protocol").insert("default".into(), json!("TCP"));
}

/// `[]metav1.Condition` with the validation of the upstream type's kubebuilder markers
/// (the k8s-openapi schema only has the types, formats and required fields).
pub(crate) fn metav1_conditions(schema: &mut Schema) {
    let properties = at(schema, "/items/properties");
    let mut add = |name: &str, validation: Value| {
        let property = properties
            .get_mut(name)
            .and_then(Value::as_object_mut)
            .unwrap_or_else(|| panic!("metav1.Condition schema has no {name:?}"));
        property.extend(validation.as_object().cloned().unwrap_or_default());
    };
    add(
        "type",
        json!({
            "maxLength": 316,
            "pattern": CONDITION_TYPE_PATTERN,
        }),
    );
    add("status", json!({"enum": ["True", "False", "Unknown"]}));
    add("observedGeneration", json!({"minimum": 0}));
    add("lastTransitionTime", json!({"format": "date-time"}));
    add(
        "reason",
        json!({
            "maxLength": 1024,
            "minLength": 1,
            "pattern": CONDITION_REASON_PATTERN,
        }),
    );
    add("message", json!({"maxLength": 32768}));
    at(schema, "/items").insert(
        "required".into(),
        json!(["lastTransitionTime", "message", "reason", "status", "type"]),
    );
}

/// `metav1.Condition.type`: CamelCase, optionally prefixed with a DNS subdomain and `/`.
pub const CONDITION_TYPE_PATTERN: &str = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$";

/// `metav1.Condition.reason`: a non-empty CamelCase identifier.
pub const CONDITION_REASON_PATTERN: &str = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$";
