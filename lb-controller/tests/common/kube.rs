//! Helpers of the suites that run against the real API server (kube-testenv): a namespace per test in the test
//! binary's shared cluster, JSON views of objects through the admin client, a bounded async wait, the RBAC of a deployment manifest.
//!
//! The module is named like the `kube` crate and `common/mod.rs` imports `kube::api` and `kube::Api` through it:
//! the crate's items are re-exported here, so both keep working.

pub use ::kube::*;

use std::future::Future;

use ::kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams};
use kube_testenv::KubeEnv;
use serde_json::{json, Value};

/// An admin client and a fresh namespace `<prefix>-<n>` of the shared cluster, with the CRDs installed.
pub async fn setup(prefix: &str) -> (Client, String) {
    if std::env::var_os("TEST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("debug,hyper=info,tower=info,rustls=info,h2=info")
            .with_test_writer()
            .try_init();
    }
    let env = KubeEnv::shared();
    let client = env.client().await.expect("admin client");
    env.apply_crds(&client, lb_api::crds().into_iter().map(|(_, c)| c))
        .await
        .expect("CRDs");
    let ns = env.namespace(&client, prefix).await.expect("namespace");
    (client, ns)
}

/// [`kube_testenv::wait_for`] (every 50 ms, at most 60 s), panicking on timeout.
pub async fn wait<F, Fut>(what: &str, check: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    kube_testenv::wait_for(what, check)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// One resource of one namespace, seen as JSON through the admin client.
#[derive(Clone)]
pub struct Objects(Api<DynamicObject>);

impl Objects {
    pub fn new(
        client: &Client,
        ns: &str,
        group: &str,
        version: &str,
        kind: &str,
        plural: &str,
    ) -> Self {
        let resource =
            ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
        Self(Api::namespaced_with(client.clone(), ns, &resource))
    }

    pub fn api(&self) -> &Api<DynamicObject> {
        &self.0
    }

    /// The object, `Value::Null` when there is none.
    pub async fn get(&self, name: &str) -> Value {
        match self.0.get_opt(name).await.expect("GET") {
            Some(o) => serde_json::to_value(o).unwrap(),
            None => Value::Null,
        }
    }

    pub async fn exists(&self, name: &str) -> bool {
        !self.get(name).await.is_null()
    }

    pub async fn list(&self) -> Vec<Value> {
        self.0
            .list(&ListParams::default())
            .await
            .expect("LIST")
            .items
            .into_iter()
            .map(|o| serde_json::to_value(o).unwrap())
            .collect()
    }

    pub async fn count(&self, filter: impl Fn(&Value) -> bool) -> usize {
        self.list().await.iter().filter(|o| filter(o)).count()
    }

    /// Merge-patches the status subresource.
    pub async fn patch_status(&self, name: &str, status: Value) {
        self.0
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(&json!({ "status": status })),
            )
            .await
            .expect("PATCH status");
    }

    /// Merge-patches the object (not its status).
    pub async fn patch(&self, name: &str, patch: Value) {
        self.0
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("PATCH");
    }
}

const YAWOL: &str = "yawol.stackit.cloud";

pub fn loadbalancers(client: &Client, ns: &str) -> Objects {
    Objects::new(
        client,
        ns,
        YAWOL,
        "v1beta1",
        "LoadBalancer",
        "loadbalancers",
    )
}
pub fn loadbalancersets(client: &Client, ns: &str) -> Objects {
    Objects::new(
        client,
        ns,
        YAWOL,
        "v1beta1",
        "LoadBalancerSet",
        "loadbalancersets",
    )
}
pub fn loadbalancermachines(client: &Client, ns: &str) -> Objects {
    Objects::new(
        client,
        ns,
        YAWOL,
        "v1beta1",
        "LoadBalancerMachine",
        "loadbalancermachines",
    )
}
pub fn events(client: &Client, ns: &str) -> Objects {
    Objects::new(client, ns, "", "v1", "Event", "events")
}
pub fn secrets(client: &Client, ns: &str) -> Objects {
    Objects::new(client, ns, "", "v1", "Secret", "secrets")
}
pub fn serviceaccounts(client: &Client, ns: &str) -> Objects {
    Objects::new(client, ns, "", "v1", "ServiceAccount", "serviceaccounts")
}
pub fn roles(client: &Client, ns: &str) -> Objects {
    Objects::new(
        client,
        ns,
        "rbac.authorization.k8s.io",
        "v1",
        "Role",
        "roles",
    )
}
pub fn rolebindings(client: &Client, ns: &str) -> Objects {
    Objects::new(
        client,
        ns,
        "rbac.authorization.k8s.io",
        "v1",
        "RoleBinding",
        "rolebindings",
    )
}

/// A client of the controller as `file` deploys it: the CRDs and the manifest's RBAC objects applied, a token
/// minted for its ServiceAccount `namespace/service_account`.
pub async fn deployed_controller(
    env: &KubeEnv,
    admin: &Client,
    file: &str,
    namespace: &str,
    service_account: &str,
) -> Client {
    env.apply_crds(admin, lb_api::crds().into_iter().map(|(_, c)| c))
        .await
        .unwrap();
    apply_rbac(admin, file).await;
    let token = env.token(admin, namespace, service_account).await.unwrap();
    env.token_client(&token).await.unwrap()
}

/// Applies the RBAC objects of a deployment manifest (everything but the Deployment) as the admin.
async fn apply_rbac(admin: &Client, file: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let text = std::fs::read_to_string(path).unwrap();
    kube_testenv::apply_rbac(admin, &text, None)
        .await
        .unwrap_or_else(|e| panic!("{file}: {e:#}"));
}

/// A LoadBalancer for the fake cloud (`lb_controller::openstack::fake`, any network, flavor and image id):
/// `replicas` machines serving one TCP port.
pub fn fake_cloud_lb(ns: &str, name: &str, replicas: i32) -> Value {
    json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": name}},
            "replicas": replicas,
            "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
            "infrastructure": {
                "defaultNetwork": {"networkID": "net", "floatingNetID": "ext"},
                "flavor": {"flavorID": "f"}, "image": {"imageID": "i"},
                "authSecretRef": {"name": "cloud", "namespace": ns}
            }
        }
    })
}

/// The OpenStack-side controllers as the binary starts them (`cli::run_openstack_controllers`) over `client` and a
/// fake cloud, in one namespace, until [`OpenStackSide::stop`].
pub struct OpenStackSide {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl OpenStackSide {
    pub fn start(
        client: Client,
        cloud: std::sync::Arc<lb_controller::openstack::fake::FakeCloud>,
        namespace: &str,
    ) -> Self {
        use lb_controller::openstack::clouds::FixedCloud;
        use lb_controller::openstack::loadbalancer;
        use lb_controller::openstack::run::OpenStackRunConfig;
        use lb_controller::process::http::Health;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(lb_controller::cli::run_openstack_controllers(
            client,
            FixedCloud(cloud),
            OpenStackRunConfig {
                namespace: namespace.into(),
                loadbalancer: loadbalancer::Config::default(),
                instance: "test".into(),
            },
            std::sync::Arc::new(lb_controller::metrics::Metrics::new()),
            std::sync::Arc::new(Health::default()),
            async move {
                let _ = stopped.await;
            },
        ));
        OpenStackSide { stop, task }
    }

    /// Stops the controllers; they must be done within 30 s.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(std::time::Duration::from_secs(30), self.task)
            .await
            .expect("the controllers stop")
            .unwrap();
    }
}
