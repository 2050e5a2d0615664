//! The generated CRDs carry yawol's names, subresources, columns, defaults and validation.

use lb_api::k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::Value;

fn crd(stem: &str) -> (CustomResourceDefinition, Value) {
    let crd = lb_api::crds()
        .into_iter()
        .find(|(s, _)| *s == stem)
        .unwrap()
        .1;
    let schema = serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap(),
    )
    .unwrap();
    (crd, schema)
}

fn at<'a>(schema: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(schema, |s, p| {
        if *p == "[]" {
            &s["items"]
        } else {
            &s["properties"][*p]
        }
    })
}

#[test]
fn loadbalancer_crd() {
    let (crd, schema) = crd("yawol.stackit.cloud_loadbalancers");
    assert_eq!(
        crd.metadata.name.as_deref(),
        Some("loadbalancers.yawol.stackit.cloud")
    );
    assert_eq!(crd.spec.group, "yawol.stackit.cloud");
    assert_eq!(crd.spec.scope, "Namespaced");
    assert_eq!(crd.spec.names.short_names, Some(vec!["lb".to_string()]));
    let version = &crd.spec.versions[0];
    assert_eq!(version.name, "v1beta1");
    let sub = version.subresources.as_ref().unwrap();
    assert!(sub.status.is_some());
    let scale = sub.scale.as_ref().unwrap();
    assert_eq!(scale.spec_replicas_path, ".spec.replicas");
    assert_eq!(scale.status_replicas_path, ".status.replicas");
    let columns: Vec<_> = version
        .additional_printer_columns
        .as_ref()
        .unwrap()
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(
        columns,
        ["DESIRED", "CURRENT", "READY", "externalIP", "AGE"]
    );

    let replicas = at(&schema, &["spec", "replicas"]);
    assert_eq!(replicas["default"], 1);
    assert_eq!(replicas["minimum"], 0.0);
    assert_eq!(
        at(&schema, &["spec", "options", "internalLB"])["default"],
        false
    );
    assert!(at(&schema, &["spec", "options", "tcpIdleTimeout"])["pattern"].is_string());
    let policies = &at(&schema, &["spec", "options", "serverGroupPolicy"])["enum"];
    assert_eq!(policies.as_array().unwrap().len(), 5);
    assert_eq!(
        at(&schema, &["spec", "ports", "[]", "targetPort"])["x-kubernetes-int-or-string"],
        true
    );
    let required = schema["properties"]["spec"]["required"].as_array().unwrap();
    assert!(required.contains(&"selector".into()) && required.contains(&"infrastructure".into()));
    // Deprecated snake_case names are part of the schema (otherwise the API server prunes them).
    assert!(at(&schema, &["spec", "infrastructure", "flavor", "flavor_id"]).is_object());
    assert!(at(&schema, &["status", "security_group_id"]).is_object());
    assert!(!serde_json::to_string(&schema).unwrap().contains("nullable"));
}

#[test]
fn loadbalancerset_and_machine_crds() {
    let (lbs, _) = crd("yawol.stackit.cloud_loadbalancersets");
    assert_eq!(lbs.spec.names.short_names, Some(vec!["lbs".to_string()]));
    assert!(lbs.spec.versions[0]
        .subresources
        .as_ref()
        .unwrap()
        .scale
        .is_some());
    let (lbm, schema) = crd("yawol.stackit.cloud_loadbalancermachines");
    assert_eq!(lbm.spec.names.short_names, Some(vec!["lbm".to_string()]));
    let sub = lbm.spec.versions[0].subresources.as_ref().unwrap();
    assert!(sub.status.is_some() && sub.scale.is_none());
    let condition = at(&schema, &["status", "conditions", "[]"]);
    assert!(condition["properties"]["lastHeartbeatTime"].is_object());
}

/// Paths (`spec.ports[].protocol`) of every property that has a `default`.
fn defaults(schema: &Value, path: &str, out: &mut Vec<String>) {
    if let Some(properties) = schema["properties"].as_object() {
        for (name, property) in properties {
            let child = if path.is_empty() {
                name.clone()
            } else {
                format!("{path}.{name}")
            };
            if property.get("default").is_some() {
                out.push(child.clone());
            }
            defaults(property, &child, out);
        }
    }
    if schema.get("items").is_some() {
        defaults(&schema["items"], &format!("{path}[]"), out);
    }
}

#[test]
fn port_protocol_defaults_to_tcp() {
    let (_, schema) = crd("yawol.stackit.cloud_loadbalancers");
    let protocol = at(&schema, &["spec", "ports", "[]", "protocol"]);
    assert_eq!(protocol["default"], "TCP");
    assert_eq!(protocol["type"], "string");
    let mut found = Vec::new();
    defaults(&schema, "", &mut found);
    assert_eq!(
        found,
        [
            "spec.options.internalLB",
            "spec.ports[].protocol",
            "spec.replicas"
        ]
    );
    for stem in [
        "yawol.stackit.cloud_loadbalancersets",
        "yawol.stackit.cloud_loadbalancermachines",
    ] {
        let mut found = Vec::new();
        defaults(&crd(stem).1, "", &mut found);
        let expected: &[&str] = if stem.ends_with("sets") {
            &["spec.replicas"]
        } else {
            &[]
        };
        assert_eq!(found, expected, "{stem}");
    }

    // Without the server's default, the Rust side still reads a missing protocol as TCP.
    let port: lb_api::k8s_openapi::api::core::v1::ServicePort =
        serde_json::from_value(serde_json::json!({"port": 80})).unwrap();
    assert_eq!(port.protocol, None);
    assert_eq!(lb_api::port_protocol(&port), "TCP");
}

fn assert_atomic_selector(selector: &Value, what: &str) {
    assert_eq!(selector["x-kubernetes-map-type"], "atomic", "{what}");
    let expressions = &selector["properties"]["matchExpressions"];
    assert_eq!(expressions["x-kubernetes-list-type"], "atomic", "{what}");
    assert_eq!(
        expressions["items"]["properties"]["values"]["x-kubernetes-list-type"], "atomic",
        "{what}"
    );
    assert!(selector["properties"]["matchLabels"]["additionalProperties"].is_object());
}

#[test]
fn selectors_and_secret_refs_are_atomic() {
    let (_, lb) = crd("yawol.stackit.cloud_loadbalancers");
    assert_atomic_selector(at(&lb, &["spec", "selector"]), "lb selector");
    let secret = at(&lb, &["spec", "infrastructure", "authSecretRef"]);
    assert_eq!(secret["x-kubernetes-map-type"], "atomic");
    assert_eq!(secret["type"], "object");

    let (_, lbs) = crd("yawol.stackit.cloud_loadbalancersets");
    assert_atomic_selector(at(&lbs, &["spec", "selector"]), "lbs selector");
    let secret = at(
        &lbs,
        &[
            "spec",
            "template",
            "spec",
            "infrastructure",
            "authSecretRef",
        ],
    );
    assert_eq!(secret["x-kubernetes-map-type"], "atomic");

    let (_, lbm) = crd("yawol.stackit.cloud_loadbalancermachines");
    let secret = at(&lbm, &["spec", "infrastructure", "authSecretRef"]);
    assert_eq!(secret["x-kubernetes-map-type"], "atomic");

    // Only those: nothing else of ours is marked.
    for (stem, schema, expected) in [("lb", &lb, 4), ("lbs", &lbs, 4), ("lbm", &lbm, 1)] {
        let text = serde_json::to_string(schema).unwrap();
        assert_eq!(
            text.matches("\"x-kubernetes-map-type\"").count()
                + text.matches("\"x-kubernetes-list-type\"").count(),
            expected,
            "{stem}"
        );
    }
}

#[test]
fn loadbalancerset_conditions_are_validated_like_metav1_condition() {
    let (_, schema) = crd("yawol.stackit.cloud_loadbalancersets");
    let condition = at(&schema, &["status", "conditions", "[]"]);
    let property = |name: &str| &condition["properties"][name];
    assert_eq!(property("type")["maxLength"], 316);
    assert_eq!(
        property("type")["pattern"],
        r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
    );
    assert_eq!(property("reason")["minLength"], 1);
    assert_eq!(property("reason")["maxLength"], 1024);
    assert_eq!(
        property("reason")["pattern"],
        "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
    );
    assert_eq!(
        property("status")["enum"],
        serde_json::json!(["True", "False", "Unknown"])
    );
    assert_eq!(property("message")["maxLength"], 32768);
    assert_eq!(property("lastTransitionTime")["format"], "date-time");
    assert_eq!(property("observedGeneration")["minimum"], 0.0);
    assert_eq!(
        condition["required"],
        serde_json::json!(["lastTransitionTime", "message", "reason", "status", "type"])
    );
    assert_eq!(
        property("type")["pattern"],
        lb_api::schema::CONDITION_TYPE_PATTERN
    );
    assert_eq!(
        property("reason")["pattern"],
        lb_api::schema::CONDITION_REASON_PATTERN
    );
}
