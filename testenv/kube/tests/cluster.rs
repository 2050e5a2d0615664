//! The test cluster itself: starts, authenticates admins and ServiceAccount tokens under RBAC, survives an API
//! server restart (and serves ServiceAccounts at once after it), and answers 410 Gone after a compaction; `Refusals`
//! records exactly the refused requests.

use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use kube::api::{Api, ListParams, PostParams};
use kube_testenv::KubeEnv;

fn config_map(name: &str) -> ConfigMap {
    serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap()
}

/// A fresh namespace on the shared cluster with a ServiceAccount `nobody` (no Role), and a token for it.
async fn nobody_in(prefix: &str) -> (&'static KubeEnv, String, String) {
    let env = KubeEnv::shared();
    let admin = env.client().await.unwrap();
    let ns = env.namespace(&admin, prefix).await.unwrap();
    let sa: ServiceAccount =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "nobody"}})).unwrap();
    Api::<ServiceAccount>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap();
    let token = env.token(&admin, &ns, "nobody").await.unwrap();
    (env, ns, token)
}

#[tokio::test]
async fn tokens_are_authenticated_and_rbac_is_enforced() {
    let (env, ns, token) = nobody_in("cluster").await;
    let nobody = env.token_client(&token).await.unwrap();
    let err = Api::<ConfigMap>::namespaced(nobody, &ns)
        .list(&ListParams::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 403),
        "a ServiceAccount without a Role is Forbidden: {err}"
    );
}

#[tokio::test]
async fn restart_keeps_data_and_compaction_expires_old_versions() {
    let env = KubeEnv::start().await.unwrap();
    let admin = env.client().await.unwrap();
    let api: Api<ConfigMap> = Api::namespaced(admin.clone(), "default");
    let first = api
        .create(&PostParams::default(), &config_map("a"))
        .await
        .unwrap();
    api.create(&PostParams::default(), &config_map("b"))
        .await
        .unwrap();
    env.stop_apiserver();
    assert!(api.get("a").await.is_err(), "the API server is down");
    env.restart_apiserver().await.unwrap();
    let api: Api<ConfigMap> = Api::namespaced(env.client().await.unwrap(), "default");
    api.get("a").await.unwrap();

    env.compact_etcd().await.unwrap();
    let old = first.metadata.resource_version.unwrap();
    let err = api
        .list(
            &ListParams::default()
                .at(&old)
                .matching(kube::api::VersionMatch::Exact),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 410),
        "a list at a compacted resourceVersion is 410 Gone: {err}"
    );
}

/// `restart_apiserver` returns when the server serves a ServiceAccount as it will for the rest of a test: its next
/// requests — a read its Role allows and namespaced writes, which pass admission — are none of them refused. (With
/// `/readyz` as the only check, a restarted server refused such requests with 403 for up to a second.)
#[tokio::test]
async fn a_restarted_api_server_serves_service_accounts_at_once() {
    let env = KubeEnv::start().await.unwrap();
    let admin = env.client().await.unwrap();
    let ns = env.namespace(&admin, "restart").await.unwrap();
    let rbac = "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: writer, namespace: x}\n---\n\
        apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: writer, namespace: x}\n\
        rules: [{apiGroups: [\"\"], resources: [configmaps], verbs: [get, create]}]\n---\n\
        apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: writer, namespace: x}\n\
        roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: writer}\n\
        subjects: [{kind: ServiceAccount, name: writer, namespace: x}]\n";
    kube_testenv::apply_rbac(&admin, rbac, Some(&ns))
        .await
        .unwrap();
    let token = env.token(&admin, &ns, "writer").await.unwrap();
    // The Role in effect before the restart (RBAC takes a moment to see a new binding).
    let before: Api<ConfigMap> = Api::namespaced(env.token_client(&token).await.unwrap(), &ns);
    kube_testenv::wait_for("the writer's Role in effect", || async {
        Ok(before.get_opt("none").await.is_ok())
    })
    .await
    .unwrap();
    env.stop_apiserver();
    env.restart_apiserver().await.unwrap();
    let refusals = kube_testenv::Refusals::default();
    let writer = refusals
        .client(&env.token_kubeconfig(&token), "writer")
        .await
        .unwrap();
    let api: Api<ConfigMap> = Api::namespaced(writer, &ns);
    for i in 0..5 {
        api.get_opt("none").await.unwrap();
        api.create(&PostParams::default(), &config_map(&format!("after-{i}")))
            .await
            .unwrap();
    }
    refusals.assert_none().unwrap();
}

#[tokio::test]
async fn refused_requests_are_recorded() {
    let (env, ns, token) = nobody_in("refusals").await;
    let refusals = kube_testenv::Refusals::default();
    let nobody = refusals
        .client(&env.token_kubeconfig(&token), "nobody")
        .await
        .unwrap();
    // Every authenticated user may read the version: not a refusal.
    nobody.apiserver_version().await.unwrap();
    refusals.assert_none().unwrap();
    let _ = Api::<ConfigMap>::namespaced(nobody, &ns)
        .list(&ListParams::default())
        .await
        .unwrap_err();
    let stranger = refusals
        .client(&env.token_kubeconfig("not-a-token"), "stranger")
        .await
        .unwrap();
    let _ = stranger.apiserver_version().await.unwrap_err();
    let seen: Vec<(String, u16, String)> = refusals
        .all()
        .into_iter()
        .map(|r| (r.who, r.status, r.request))
        .collect();
    assert_eq!(
        seen,
        [
            (
                "nobody".to_string(),
                403,
                format!("GET /api/v1/namespaces/{ns}/configmaps?")
            ),
            ("stranger".to_string(), 401, "GET /version".to_string()),
        ],
    );
    assert!(refusals.assert_none().is_err());
    // A window a test expects refusals in takes them out of the check.
    let taken = refusals.take_between(std::time::UNIX_EPOCH, std::time::SystemTime::now());
    assert_eq!(taken.len(), 2);
    refusals.assert_none().unwrap();
}
