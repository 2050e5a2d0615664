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
