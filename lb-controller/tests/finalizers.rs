//! The finalizer helper against the real API server: a change made from a stale copy of an object (a watch cache
//! lags behind) never drops a finalizer someone else added or removed meanwhile — the lost update a merge patch
//! of the whole list made — and unrelated changes (status, labels) do not get in its way.

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::ResourceExt;
use kube_testenv::KubeEnv;
use lb_controller::runtime::finalizer;
use serde_json::json;

const OURS: &str = "yawol.stackit.cloud/test";
const OTHER: &str = "example.com/other";

async fn setup() -> (Api<ConfigMap>, ConfigMap) {
    let env = KubeEnv::shared();
    let client = env.client().await.unwrap();
    let ns = env.namespace(&client, "finalizers").await.unwrap();
    let api: Api<ConfigMap> = Api::namespaced(client, &ns);
    let cm = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "cm"}})).unwrap(),
        )
        .await
        .unwrap();
    (api, cm)
}

async fn set_finalizers(api: &Api<ConfigMap>, list: &[&str]) -> ConfigMap {
    api.patch(
        "cm",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": list}})),
    )
    .await
    .unwrap()
}

async fn finalizers(api: &Api<ConfigMap>) -> Vec<String> {
    api.get("cm").await.unwrap().finalizers().to_vec()
}

#[tokio::test]
async fn a_stale_copy_never_drops_anothers_finalizer() {
    let (api, stale) = setup().await;
    // Adding: someone else added theirs after our copy was taken.
    set_finalizers(&api, &[OTHER]).await;
    let refused = finalizer::add(&api, &stale, OURS).await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.code == 422),
        "{refused:?}"
    );
    assert_eq!(
        finalizers(&api).await,
        vec![OTHER],
        "theirs kept, the add refused"
    );
    let fresh = api.get("cm").await.unwrap();
    finalizer::add(&api, &fresh, OURS).await.unwrap();
    assert_eq!(finalizers(&api).await, vec![OTHER, OURS]);

    // Removing: theirs was added after our copy, ours stays at its index: removed, theirs kept.
    let stale = set_finalizers(&api, &[OURS]).await;
    set_finalizers(&api, &[OURS, OTHER]).await;
    finalizer::remove(&api, &stale, OURS).await.unwrap();
    assert_eq!(finalizers(&api).await, vec![OTHER]);

    // Removing: the list moved under our copy (ours no longer where the copy has it): refused, nothing lost.
    let stale = set_finalizers(&api, &[OTHER, OURS]).await;
    set_finalizers(&api, &[OURS]).await;
    let refused = finalizer::remove(&api, &stale, OURS).await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.code == 422),
        "{refused:?}"
    );
    assert_eq!(finalizers(&api).await, vec![OURS]);

    // Other changes since the copy (labels, data) do not matter: only the list is compared.
    let copy = api.get("cm").await.unwrap();
    api.patch(
        "cm",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}, "data": {"k": "v"}})),
    )
    .await
    .unwrap();
    finalizer::remove(&api, &copy, OURS).await.unwrap();
    assert_eq!(finalizers(&api).await, Vec::<String>::new());
    // An emptied list is no list: adding to it from a fresh copy works.
    let emptied = api.get("cm").await.unwrap();
    finalizer::add(&api, &emptied, OURS).await.unwrap();
    let copy = api.get("cm").await.unwrap();
    finalizer::remove(&api, &copy, OURS).await.unwrap();
    // Gone already: a removal from a copy that still lists it is done (404), as the controllers expect.
    api.delete("cm", &DeleteParams::default()).await.unwrap();
    finalizer::remove(&api, &copy, OURS).await.unwrap();
}
