//! The in-memory API server's own semantics, which the controller benchmark (`benches/controller/src/bin/bench-controller.rs`)
//! relies on; the controllers' and the agent's tests run against a real kube-apiserver.

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube_testenv::fake_api::{FakeApiServer, ResourceKey};
use serde_json::json;

fn configmap(name: &str, labels: serde_json::Value) -> ConfigMap {
    serde_json::from_value(
        json!({"metadata": {"name": name, "labels": labels}, "data": {"k": "v"}}),
    )
    .unwrap()
}

#[tokio::test]
async fn crud_selectors_conflicts() {
    let server = FakeApiServer::new();
    let api: Api<ConfigMap> = Api::namespaced(server.client(), "ns");
    let a = api
        .create(&PostParams::default(), &configmap("a", json!({"app": "x"})))
        .await
        .unwrap();
    api.create(&PostParams::default(), &configmap("b", json!({"app": "y"})))
        .await
        .unwrap();
    let err = api
        .create(&PostParams::default(), &configmap("a", json!({})))
        .await
        .unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.code == 409));
    assert_eq!(
        api.list(&ListParams::default().labels("app=x"))
            .await
            .unwrap()
            .items
            .len(),
        1
    );
    assert_eq!(
        api.list(&ListParams::default().labels("app in (x,y)"))
            .await
            .unwrap()
            .items
            .len(),
        2
    );
    assert_eq!(
        api.list(&ListParams::default().labels("app!=x"))
            .await
            .unwrap()
            .items
            .len(),
        1
    );
    assert_eq!(
        api.list(&ListParams::default().fields("metadata.name=b"))
            .await
            .unwrap()
            .items
            .len(),
        1
    );
    let other: Api<ConfigMap> = Api::namespaced(server.client(), "other");
    assert!(other
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .is_empty());
    assert_eq!(
        Api::<ConfigMap>::all(server.client())
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        2
    );

    // Stale replace is rejected; merge patch removes nulls.
    let mut stale = a.clone();
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(&json!({"data": {"k": null, "n": "1"}})),
    )
    .await
    .unwrap();
    stale.data = Some([("k".to_string(), "changed".to_string())].into());
    let err = api
        .replace("a", &PostParams::default(), &stale)
        .await
        .unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.code == 409));
    let now = api.get("a").await.unwrap();
    assert_eq!(
        now.data.unwrap().into_iter().collect::<Vec<_>>(),
        [("n".to_string(), "1".to_string())]
    );
    assert!(matches!(api.get("zzz").await.unwrap_err(), kube::Error::Api(s) if s.code == 404));
}

#[tokio::test]
async fn status_subresource_generation_and_finalizers() {
    let server = FakeApiServer::new();
    let api: Api<Service> = Api::namespaced(server.client(), "ns");
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "s", "finalizers": ["example.com/f"]},
        "spec": {"type": "ClusterIP"},
        "status": {"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}},
    }))
    .unwrap();
    let created = api.create(&PostParams::default(), &svc).await.unwrap();
    assert!(created.status.is_none(), "status is ignored on create");
    assert_eq!(created.metadata.generation, Some(1));
    // Main resource writes keep the status; /status writes change only the status.
    api.patch_status("s", &PatchParams::default(), &Patch::Merge(&json!({"status": {"loadBalancer": {"ingress": [{"ip": "5.6.7.8"}]}}, "spec": {"type": "NodePort"}})))
        .await
        .unwrap();
    let s = api.get("s").await.unwrap();
    assert_eq!(s.spec.as_ref().unwrap().type_.as_deref(), Some("ClusterIP"));
    assert_eq!(s.metadata.generation, Some(1));
    api.patch(
        "s",
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"type": "NodePort"}, "status": null})),
    )
    .await
    .unwrap();
    let s = api.get("s").await.unwrap();
    assert_eq!(s.metadata.generation, Some(2));
    assert!(s.status.is_some(), "status kept");

    // Delete with a finalizer only marks the object; removing the finalizer deletes it.
    api.delete("s", &DeleteParams::default()).await.unwrap();
    let s = api.get("s").await.unwrap();
    assert!(s.metadata.deletion_timestamp.is_some());
    api.patch(
        "s",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    assert!(api.get_opt("s").await.unwrap().is_none());
}

#[tokio::test]
async fn watch_replays_from_resource_version_and_streams_live() {
    let server = FakeApiServer::new();
    let api: Api<ConfigMap> = Api::namespaced(server.client(), "ns");
    api.create(&PostParams::default(), &configmap("a", json!({})))
        .await
        .unwrap();
    let list = api.list(&ListParams::default()).await.unwrap();
    let rv = list.metadata.resource_version.unwrap();
    api.create(&PostParams::default(), &configmap("b", json!({})))
        .await
        .unwrap();
    let mut stream = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    let first = tokio::time::timeout(Duration::from_secs(5), stream.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(
        matches!(first, WatchEvent::Added(cm) if cm.metadata.name.as_deref() == Some("b")),
        "replayed"
    );
    api.delete("a", &DeleteParams::default()).await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(5), stream.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(
        matches!(second, WatchEvent::Deleted(cm) if cm.metadata.name.as_deref() == Some("a")),
        "live"
    );
    assert_eq!(server.list(&ResourceKey::new("", "configmaps")).len(), 1);
}

/// The controllers' finalizer changes (JSON patches with `test`) work here as on the real server
/// (`tests/finalizers.rs`): the whole-cascade test runs on this server.
#[tokio::test]
async fn finalizer_json_patches() {
    use lb_controller::runtime::finalizer;
    let server = FakeApiServer::new();
    let api: Api<ConfigMap> = Api::namespaced(server.client(), "ns");
    let fresh = api
        .create(&PostParams::default(), &configmap("f", json!({})))
        .await
        .unwrap();
    finalizer::add(&api, &fresh, "a/one").await.unwrap();
    let copy = api.get("f").await.unwrap();
    finalizer::add(&api, &copy, "b/two").await.unwrap();
    // A stale copy's add is refused (422); nothing is lost.
    let refused = finalizer::add(&api, &copy, "c/three").await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.code == 422),
        "{refused:?}"
    );
    let copy = api.get("f").await.unwrap();
    assert_eq!(
        copy.metadata.finalizers.clone().unwrap(),
        ["a/one", "b/two"]
    );
    finalizer::remove(&api, &copy, "a/one").await.unwrap();
    let copy = api.get("f").await.unwrap();
    finalizer::remove(&api, &copy, "b/two").await.unwrap();
    // Emptied: no list, so the next add's `test` of a missing list holds.
    let copy = api.get("f").await.unwrap();
    assert_eq!(copy.metadata.finalizers, None);
    finalizer::add(&api, &copy, "a/one").await.unwrap();
    // Deleted while a finalizer holds it, gone once the last one is removed.
    api.delete("f", &DeleteParams::default()).await.unwrap();
    let copy = api.get("f").await.unwrap();
    finalizer::remove(&api, &copy, "a/one").await.unwrap();
    assert!(api.get_opt("f").await.unwrap().is_none());
}
