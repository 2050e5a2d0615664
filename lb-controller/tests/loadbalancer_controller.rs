//! The LoadBalancer controller through `kube::Client` against a real API server (kube-testenv, a namespace per
//! test), with the fake cloud (`FakeCloud`): finalizer, status after the OpenStack steps, Warning events with the
//! cloud's text, throttling, deletion with keep-annotations. The same steps run against the real OpenStack in
//! `tests/openstack_lb.rs`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::kube::{events, loadbalancers, setup, wait, Objects};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use lb_api::LoadBalancer;
use lb_controller::openstack::clouds::FixedCloud;
use lb_controller::openstack::fake::FakeCloud;
use lb_controller::openstack::loadbalancer::{self, run as run_lb_controller};
use lb_controller::openstack::CloudErrorKind;
use lb_controller::runtime::events::EventPublisher;
use lb_controller::runtime::stop::Stop;
use serde_json::{json, Value};

fn lb_json(ns: &str, name: &str) -> Value {
    json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": name}},
            "replicas": 1,
            "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
            "infrastructure": {
                "defaultNetwork": {"networkID": "net", "floatingNetID": "ext"},
                "flavor": {"flavorID": "f"}, "image": {"imageID": "i"},
                "authSecretRef": {"name": "cloud", "namespace": ns}
            }
        }
    })
}

struct H {
    client: Client,
    ns: String,
    cloud: Arc<FakeCloud>,
    lbs: Objects,
    events: Objects,
    task: tokio::task::JoinHandle<()>,
}

impl H {
    fn api(&self) -> Api<LoadBalancer> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    async fn create(&self, obj: Value) {
        self.api()
            .create(
                &PostParams::default(),
                &serde_json::from_value(obj).unwrap(),
            )
            .await
            .unwrap();
    }

    /// Waits until the OpenStack step is done: its status fields are saved one step at a time, the reconcile
    /// time and hash last.
    async fn wait_reconciled(&self, name: &str) {
        wait("external IP and lastOpenstackReconcile", || async {
            let status = &self.lbs.get(name).await["status"];
            Ok(status["externalIP"].is_string() && status["lastOpenstackReconcile"].is_string())
        })
        .await;
    }

    async fn wait_gone(&self, name: &str) {
        wait("LoadBalancer gone", || async {
            Ok(!self.lbs.exists(name).await)
        })
        .await;
    }
}

async fn start(prefix: &str) -> H {
    let (client, ns) = setup(prefix).await;
    let cloud = Arc::new(FakeCloud::new());
    let ctx = Arc::new(loadbalancer::Context {
        client: client.clone(),
        clouds: FixedCloud(cloud.clone()),
        events: Arc::new(EventPublisher::new(
            client.clone(),
            "yawol-controller",
            "test",
        )),
        config: loadbalancer::Config {
            resync: Duration::from_secs(300),
            deletion_poll: Duration::from_millis(20),
            ..Default::default()
        },
        metrics: Arc::new(lb_controller::metrics::Metrics::new()),
    });
    let task = tokio::spawn({
        let ns = ns.clone();
        async move { run_lb_controller(ctx, &ns, Stop::on(std::future::pending())).await }
    });
    H {
        lbs: loadbalancers(&client, &ns),
        events: events(&client, &ns),
        client,
        ns,
        cloud,
        task,
    }
}

#[tokio::test]
async fn creates_cloud_resources_records_status_and_cleans_up_on_delete() {
    let h = start("lb-create").await;
    h.create(lb_json(&h.ns, "web")).await;
    h.wait_reconciled("web").await;
    let l = h.lbs.get("web").await;
    assert_eq!(
        l["metadata"]["finalizers"],
        json!(["yawol.stackit.cloud/controller2"])
    );
    for key in [
        "securityGroupID",
        "floatingID",
        "portID",
        "portIP",
        "openstackReconcileHash",
        "lastOpenstackReconcile",
    ] {
        assert!(l["status"][key].is_string(), "{key} in {}", l["status"]);
    }
    assert_eq!(h.cloud.counts(), (1, 1, 1, 0, 0));
    wait("ExternalIPAssigned event", || async {
        Ok(h.events
            .count(|e| e["reason"] == "ExternalIPAssigned")
            .await
            == 1)
    })
    .await;

    h.api()
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone("web").await;
    assert_eq!(
        h.cloud.counts(),
        (0, 0, 0, 0, 0),
        "nothing left in the cloud"
    );
    h.task.abort();
}

#[tokio::test]
async fn openstack_errors_become_warning_events_and_are_retried() {
    let h = start("lb-errors").await;
    h.cloud.fail_next(
        "create_floating_ip",
        CloudErrorKind::Quota,
        "Quota exceeded for resources: ['floatingip']",
    );
    h.create(lb_json(&h.ns, "q")).await;
    wait("Warning event with the cloud's text", || async {
        Ok(h.events
            .count(|e| {
                e["reason"] == "OpenStackError"
                    && e["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("Quota exceeded"))
            })
            .await
            == 1)
    })
    .await;
    // The retry (the status writes of the failed attempt trigger it at once) allocates the floating IP; the security
    // group recorded by the failed attempt is reused, not duplicated.
    wait("floating IP after the retry", || async {
        Ok(h.lbs.get("q").await["status"]["floatingID"].is_string())
    })
    .await;
    assert_eq!(h.cloud.counts().0, 1, "one security group");
    assert_eq!(h.cloud.counts().1, 1, "one floating IP");
    h.task.abort();
}

#[tokio::test]
async fn keep_annotations_survive_deletion() {
    let h = start("lb-keep").await;
    let mut obj = lb_json(&h.ns, "keep");
    obj["metadata"]["annotations"] = json!({
        "yawol.stackit.cloud/keepFloatingIP": "true", "yawol.stackit.cloud/keepPort": "true"
    });
    h.create(obj).await;
    h.wait_reconciled("keep").await;
    h.api()
        .delete("keep", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone("keep").await;
    // Floating IP and port kept; the security group is gone (stripped from the kept port first).
    assert_eq!(h.cloud.counts(), (0, 1, 1, 0, 0));
    h.task.abort();
}

/// The binary's `controller` command starts the controllers through `cli::run_openstack_controllers`; the same
/// function here (with the fake cloud instead of `SdkClouds`) reconciles a LoadBalancer and reports readiness.
#[tokio::test]
async fn the_binarys_entry_point_reconciles_a_loadbalancer() {
    use lb_controller::cli::run_openstack_controllers;
    use lb_controller::openstack::run::OpenStackRunConfig;
    use lb_controller::process::http::Health;
    use std::sync::atomic::Ordering;

    let (client, ns) = setup("lb-binary").await;
    let cloud = Arc::new(FakeCloud::new());
    let health = Arc::new(Health::default());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run_openstack_controllers(
        client.clone(),
        FixedCloud(cloud.clone()),
        OpenStackRunConfig {
            namespace: ns.clone(),
            loadbalancer: loadbalancer::Config::default(),
            instance: "test".into(),
        },
        Arc::new(lb_controller::metrics::Metrics::new()),
        health.clone(),
        async move {
            let _ = stop_rx.await;
        },
    ));
    wait("ready", || async {
        Ok(health.ready.load(Ordering::SeqCst))
    })
    .await;
    let api: Api<LoadBalancer> = Api::namespaced(client.clone(), &ns);
    api.create(
        &PostParams::default(),
        &serde_json::from_value(lb_json(&ns, "bin")).unwrap(),
    )
    .await
    .unwrap();
    let lbs = loadbalancers(&client, &ns);
    wait("external IP and lastOpenstackReconcile", || async {
        let status = &lbs.get("bin").await["status"];
        Ok(status["externalIP"].is_string() && status["lastOpenstackReconcile"].is_string())
    })
    .await;
    assert_eq!(cloud.counts(), (1, 1, 1, 0, 0));
    // yawol's component, so the cloud controller's back channel forwards the event to the Service.
    let events = events(&client, &ns);
    wait("ExternalIPAssigned event from yawol-service", || async {
        Ok(events
            .count(|e| {
                e["reason"] == "ExternalIPAssigned" && e["source"]["component"] == "yawol-service"
            })
            .await
            == 1)
    })
    .await;
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("stops on shutdown")
        .unwrap();
    assert!(!health.ready.load(Ordering::SeqCst));
}

/// `yawol_openstack` is served unprefixed on the binary's /metrics next to the `lb_cloud_controller_*` families.
#[test]
fn yawol_openstack_is_on_the_metrics_registry() {
    let metrics = lb_controller::metrics::Metrics::new();
    metrics
        .openstack_calls
        .inc("neutron", "floatingip", "create");
    let text = metrics.encode();
    assert!(
        text.contains(r#"yawol_openstack{api="neutron",object="floatingip",operation="create"} 1"#),
        "{text}"
    );
    assert!(text.contains("lb_cloud_controller_leader"), "{text}");
    assert!(!text.contains("lb_cloud_controller_yawol"), "{text}");
}
