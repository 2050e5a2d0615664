//! Checked-in CRD manifests match the types; the schema's defaults and validation behave like
//! the API server would apply them (through the fake API server).

use kube::api::{Api, PostParams};
use lb_api::fake_api::FakeApiServer;
use lb_api::LoadBalancer;
use serde_json::json;

#[test]
fn checked_in_crds_match_the_types() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds");
    let drifted = lb_controller::crds::drift(&dir).unwrap();
    assert!(
        drifted.is_empty(),
        "deploy/crds is out of date ({}); regenerate with `cargo run -p lb-controller -- crds`",
        drifted.join(", ")
    );
}

fn lb(spec: serde_json::Value) -> LoadBalancer {
    serde_json::from_value(json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1",
        "kind": "LoadBalancer",
        "metadata": {"name": "x", "namespace": "ns"},
        "spec": spec,
    }))
    .unwrap()
}

fn base_spec() -> serde_json::Value {
    json!({
        "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": "abc"}},
        "infrastructure": {
            "authSecretRef": {"name": "s", "namespace": "ns"},
            "defaultNetwork": {"networkID": "n"},
            "flavor": {"flavorID": "f"},
            "image": {"imageID": "i"},
            "availabilityZone": "",
        },
        "options": {},
    })
}

#[tokio::test]
async fn schema_defaults_and_validation() {
    let server = FakeApiServer::new();
    for (_, crd) in lb_api::crds() {
        server.install_crd(&crd);
    }
    let api: Api<LoadBalancer> = Api::namespaced(server.client(), "ns");

    // Defaults: replicas 1 and internalLB false are filled in by the server.
    let mut raw = serde_json::to_value(lb(base_spec())).unwrap();
    raw["spec"].as_object_mut().unwrap().remove("replicas");
    let request: LoadBalancer = serde_json::from_value(raw).unwrap();
    let created = api.create(&PostParams::default(), &request).await.unwrap();
    assert_eq!(created.spec.replicas, 1);
    assert_eq!(created.spec.options().internal_lb, Some(false));

    let invalid = [
        ("negative replicas", json!({"replicas": -1})),
        (
            "bad idle timeout",
            json!({"options": {"tcpIdleTimeout": "1 hour"}}),
        ),
        (
            "bad server group policy",
            json!({"options": {"serverGroupPolicy": "spread"}}),
        ),
        ("bad protocol type", json!({"ports": [{"port": "eighty"}]})),
    ];
    for (i, (what, overlay)) in invalid.into_iter().enumerate() {
        let mut spec = base_spec();
        lb_api::fake_api::json_merge(&mut spec, &overlay);
        let mut object = serde_json::to_value(lb(base_spec())).unwrap();
        object["metadata"]["name"] = json!(format!("invalid-{i}"));
        object["spec"] = spec;
        // Bypass the typed API so that values the Rust types could not even hold reach the server.
        let api_raw: Api<kube::api::DynamicObject> = Api::namespaced_with(
            server.client(),
            "ns",
            &kube::api::ApiResource::erase::<LoadBalancer>(&()),
        );
        let object: kube::api::DynamicObject = serde_json::from_value(object).unwrap();
        let err = api_raw
            .create(&PostParams::default(), &object)
            .await
            .expect_err(what);
        match err {
            kube::Error::Api(status) => assert_eq!(status.code, 422, "{what}: {status:?}"),
            other => panic!("{what}: unexpected {other}"),
        }
    }
    let valid = json!({"options": {"tcpIdleTimeout": "1h0m0s", "udpIdleTimeout": "0s", "serverGroupPolicy": ""}});
    let mut spec = base_spec();
    lb_api::fake_api::json_merge(&mut spec, &valid);
    let mut object = serde_json::to_value(lb(spec)).unwrap();
    object["metadata"]["name"] = json!("valid");
    api.create(
        &PostParams::default(),
        &serde_json::from_value(object).unwrap(),
    )
    .await
    .unwrap();
}

#[test]
fn deployment_manifest_parses_and_grants_what_the_controller_uses() {
    use serde::Deserialize;
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/cloud-controller.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let docs: Vec<serde_json::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde_json::Value::deserialize(d).unwrap())
        .collect();
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
            "Deployment"
        ]
    );
    let rules = serde_json::to_string(&docs[1]["rules"]).unwrap()
        + &serde_json::to_string(&docs[3]["rules"]).unwrap();
    for needle in [
        "services/status",
        "nodes",
        "loadbalancers",
        "leases",
        "events",
    ] {
        assert!(rules.contains(needle), "RBAC lacks {needle}");
    }
}
