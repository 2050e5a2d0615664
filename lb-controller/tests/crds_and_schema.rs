//! Checked-in CRD manifests match the types; the real API server (kube-testenv) accepts them as they are, applies
//! their defaults and rejects what their validation rejects; the deployment manifests are accepted under real
//! RBAC and admission.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube_testenv::{json_merge, KubeEnv};
use lb_api::LoadBalancer;
use serde::Deserialize;
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

fn yaml_docs(path: &str) -> Vec<serde_json::Value> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde_json::Value::deserialize(d).unwrap())
        .filter(|d| !d.is_null())
        .collect()
}

/// What the server stores is what the files say: no field of our schemas is dropped or rewritten (a structural
/// schema the server had to change, or a field it does not know, would show here).
#[tokio::test]
async fn the_server_stores_the_checked_in_crds_as_written() {
    let env = KubeEnv::shared();
    let client = env.client().await.unwrap();
    let mut files = Vec::new();
    for entry in
        std::fs::read_dir(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds"))
            .unwrap()
    {
        let path = entry.unwrap().path();
        let doc = yaml_docs(path.to_str().unwrap()).remove(0);
        files.push(serde_json::from_value::<CustomResourceDefinition>(doc).unwrap());
    }
    assert_eq!(files.len(), 3);
    env.apply_crds(&client, files.clone()).await.unwrap();
    let api: Api<CustomResourceDefinition> = Api::all(client);
    for file in files {
        let name = file.metadata.name.clone().unwrap();
        let stored = api.get(&name).await.unwrap();
        let (written, stored) = (
            serde_json::to_value(&file.spec).unwrap(),
            serde_json::to_value(&stored.spec).unwrap(),
        );
        // The server adds defaults (names.listKind, conversion); everything written must be there unchanged.
        assert!(
            subset(&written, &stored),
            "{name}: the server changed or dropped part of the spec:\nwritten {written:#}\nstored {stored:#}"
        );
    }
}

/// Whether every field of `written` is in `stored` with the same value (objects may gain fields).
fn subset(written: &serde_json::Value, stored: &serde_json::Value) -> bool {
    use serde_json::Value::{Array, Object};
    match (written, stored) {
        (Object(w), Object(s)) => w
            .iter()
            .all(|(k, v)| s.get(k).is_some_and(|sv| subset(v, sv))),
        (Array(w), Array(s)) => w.len() == s.len() && w.iter().zip(s).all(|(a, b)| subset(a, b)),
        (w, s) => w == s,
    }
}

fn lb(spec: serde_json::Value) -> LoadBalancer {
    serde_json::from_value(json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1",
        "kind": "LoadBalancer",
        "metadata": {"name": "x"},
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
    let env = KubeEnv::shared();
    let client = env.client().await.unwrap();
    let ns = env.namespace(&client, "schema").await.unwrap();
    env.apply_crds(&client, lb_api::crds().into_iter().map(|(_, c)| c))
        .await
        .unwrap();
    let api: Api<LoadBalancer> = Api::namespaced(client.clone(), &ns);
    // Bypass the typed API so that values the Rust types could not even hold reach the server.
    let raw: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &kube::api::ApiResource::erase::<LoadBalancer>(&()),
    );

    // Defaults: replicas 1, internalLB false and a port's protocol TCP (yawol's) are filled in by the server.
    let mut object = serde_json::to_value(lb(base_spec())).unwrap();
    object["spec"].as_object_mut().unwrap().remove("replicas");
    object["spec"]["ports"] = json!([{"name": "http", "port": 80, "nodePort": 30080}]);
    let created = raw
        .create(
            &PostParams::default(),
            &serde_json::from_value(object).unwrap(),
        )
        .await
        .unwrap();
    let created: LoadBalancer =
        serde_json::from_value(serde_json::to_value(created).unwrap()).unwrap();
    assert_eq!(created.spec.replicas, 1);
    assert_eq!(created.spec.options().internal_lb, Some(false));
    assert_eq!(created.spec.ports()[0].protocol.as_deref(), Some("TCP"));

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
        json_merge(&mut spec, &overlay);
        let mut object = serde_json::to_value(lb(base_spec())).unwrap();
        object["metadata"]["name"] = json!(format!("invalid-{i}"));
        object["spec"] = spec;
        let object: DynamicObject = serde_json::from_value(object).unwrap();
        let err = raw
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
    json_merge(&mut spec, &valid);
    let mut object = serde_json::to_value(lb(spec)).unwrap();
    object["metadata"]["name"] = json!("valid");
    api.create(
        &PostParams::default(),
        &serde_json::from_value(object).unwrap(),
    )
    .await
    .unwrap();
}

/// LoadBalancerSet conditions are validated like metav1.Condition (as in yawol's CRD): an empty reason is
/// rejected, the controller's own condition is accepted.
#[tokio::test]
async fn set_conditions_are_validated() {
    let env = KubeEnv::shared();
    let client = env.client().await.unwrap();
    let ns = env.namespace(&client, "conditions").await.unwrap();
    env.apply_crds(&client, lb_api::crds().into_iter().map(|(_, c)| c))
        .await
        .unwrap();
    let sets: Api<lb_api::LoadBalancerSet> = Api::namespaced(client, &ns);
    let mut set = json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerSet",
        "metadata": {"name": "s"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "labels": {"a": "b"},
                "spec": {"loadBalancerRef": {"name": "x", "namespace": &ns}, "infrastructure": base_spec()["infrastructure"]}
            }
        }
    });
    sets.create(
        &PostParams::default(),
        &serde_json::from_value(set.take()).unwrap(),
    )
    .await
    .unwrap();
    let condition = |reason: &str| {
        json!({"status": {"conditions": [{
            "type": "HasKeepalivedMaster", "status": "True", "reason": reason,
            "message": "m", "lastTransitionTime": "2026-01-01T00:00:00Z"
        }]}})
    };
    let err = sets
        .patch_status("s", &PatchParams::default(), &Patch::Merge(condition("")))
        .await
        .expect_err("an empty reason");
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422),
        "{err}"
    );
    sets.patch_status(
        "s",
        &PatchParams::default(),
        &Patch::Merge(condition("KeepalivedMasterInSet")),
    )
    .await
    .unwrap();
}

#[test]
fn deployment_manifest_parses_and_grants_what_the_controller_uses() {
    let docs = yaml_docs("../deploy/cloud-controller.yaml");
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

/// Both deployment manifests as a whole are accepted by the real server (schema, admission), checked with a
/// server-side dry run so the test cluster is left as it was.
#[tokio::test]
async fn deployment_manifests_pass_a_server_side_dry_run() {
    let env = KubeEnv::shared();
    let client = env.client().await.unwrap();
    env.apply_crds(&client, lb_api::crds().into_iter().map(|(_, c)| c))
        .await
        .unwrap();
    let discovery = kube::Discovery::new(client.clone()).run().await.unwrap();
    for file in [
        "../deploy/cloud-controller.yaml",
        "../deploy/openstack-controller.yaml",
    ] {
        for doc in yaml_docs(file) {
            let object: DynamicObject = serde_json::from_value(doc.clone()).unwrap();
            let gvk =
                kube::api::GroupVersionKind::try_from(object.types.as_ref().unwrap()).unwrap();
            let (resource, caps) = discovery.resolve_gvk(&gvk).unwrap();
            let name = object.metadata.name.clone().unwrap();
            let api: Api<DynamicObject> = match (caps.scope, &object.metadata.namespace) {
                (kube::discovery::Scope::Namespaced, Some(ns)) => {
                    Api::namespaced_with(client.clone(), ns, &resource)
                }
                _ => Api::all_with(client.clone(), &resource),
            };
            let params = PatchParams::apply("crds-and-schema").dry_run();
            api.patch(&name, &params, &Patch::Apply(&object))
                .await
                .unwrap_or_else(|e| panic!("{file}: {} {name}: {e}", gvk.kind));
        }
    }
}
