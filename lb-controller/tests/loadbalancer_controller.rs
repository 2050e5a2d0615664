//! The LoadBalancer controller through `kube::Client` against the in-memory API server, with the fake cloud
//! (`FakeCloud`): finalizer, status after the OpenStack steps, Warning events with the cloud's text, throttling,
//! deletion with keep-annotations. The same steps run against the real OpenStack in `tests/openstack_lb.rs`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use kube::api::{DeleteParams, PostParams};
use kube::Api;
use lb_api::fake_api::{FakeApiServer, ResourceKey};
use lb_api::LoadBalancer;
use lb_controller::events::EventPublisher;
use lb_controller::lb_controller::{
    run as run_lb_controller, FixedCloud, LbContext, LbControllerConfig,
};
use lb_controller::openstack::fake::FakeCloud;
use lb_controller::openstack::CloudErrorKind;
use serde_json::{json, Value};

const NS: &str = "yawol";

fn lb_json(name: &str) -> Value {
    json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": name}},
            "replicas": 1,
            "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
            "infrastructure": {
                "defaultNetwork": {"networkID": "net", "floatingNetID": "ext"},
                "flavor": {"flavorID": "f"}, "image": {"imageID": "i"},
                "authSecretRef": {"name": "cloud", "namespace": NS}
            }
        }
    })
}

async fn wait_for(what: &str, check: impl FnMut() -> bool) {
    common::wait_within(what, Duration::from_secs(10), check).await
}

struct H {
    api: FakeApiServer,
    cloud: Arc<FakeCloud>,
    task: tokio::task::JoinHandle<()>,
}

async fn start() -> H {
    let api = FakeApiServer::new();
    for (_, crd) in lb_api::crds() {
        api.install_crd(&crd);
    }
    let cloud = Arc::new(FakeCloud::new());
    let client = api.client();
    let ctx = Arc::new(LbContext {
        client: client.clone(),
        clouds: FixedCloud(cloud.clone()),
        events: Arc::new(EventPublisher::new(client, "yawol-controller", "test")),
        config: LbControllerConfig {
            resync: Duration::from_secs(300),
            deletion_poll: Duration::from_millis(20),
            ..Default::default()
        },
        metrics: Arc::new(lb_controller::metrics::Metrics::new()),
    });
    let task =
        tokio::spawn(async move { run_lb_controller(ctx, NS, std::future::pending()).await });
    H { api, cloud, task }
}

fn lbs() -> ResourceKey {
    ResourceKey::new("yawol.stackit.cloud", "loadbalancers")
}

fn events() -> ResourceKey {
    ResourceKey::new("", "events")
}

#[tokio::test]
async fn creates_cloud_resources_records_status_and_cleans_up_on_delete() {
    let h = start().await;
    let api: Api<LoadBalancer> = Api::namespaced(h.api.client(), NS);
    api.create(
        &PostParams::default(),
        &serde_json::from_value(lb_json("web")).unwrap(),
    )
    .await
    .unwrap();
    wait_for("external IP", || {
        h.api
            .get(&lbs(), NS, "web")
            .is_some_and(|l| l["status"]["externalIP"].is_string())
    })
    .await;
    let l = h.api.get(&lbs(), NS, "web").unwrap();
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
    wait_for("ExternalIPAssigned event", || {
        h.api
            .count(&events(), |e| e["reason"] == "ExternalIPAssigned")
            == 1
    })
    .await;

    api.delete("web", &DeleteParams::default()).await.unwrap();
    wait_for("LoadBalancer gone", || {
        h.api.get(&lbs(), NS, "web").is_none()
    })
    .await;
    assert_eq!(
        h.cloud.counts(),
        (0, 0, 0, 0, 0),
        "nothing left in the cloud"
    );
    h.task.abort();
}

#[tokio::test]
async fn openstack_errors_become_warning_events_and_are_retried() {
    let h = start().await;
    h.cloud.fail_next(
        "create_floating_ip",
        CloudErrorKind::Quota,
        "Quota exceeded for resources: ['floatingip']",
    );
    let api: Api<LoadBalancer> = Api::namespaced(h.api.client(), NS);
    api.create(
        &PostParams::default(),
        &serde_json::from_value(lb_json("q")).unwrap(),
    )
    .await
    .unwrap();
    wait_for("Warning event with the cloud's text", || {
        h.api.count(&events(), |e| {
            e["reason"] == "OpenStackError"
                && e["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("Quota exceeded"))
        }) == 1
    })
    .await;
    // The retry (the status writes of the failed attempt trigger it at once) allocates the floating IP; the security
    // group recorded by the failed attempt is reused, not duplicated.
    wait_for("floating IP after the retry", || {
        h.api
            .get(&lbs(), NS, "q")
            .is_some_and(|l| l["status"]["floatingID"].is_string())
    })
    .await;
    assert_eq!(h.cloud.counts().0, 1, "one security group");
    assert_eq!(h.cloud.counts().1, 1, "one floating IP");
    h.task.abort();
}

#[tokio::test]
async fn keep_annotations_survive_deletion() {
    let h = start().await;
    let api: Api<LoadBalancer> = Api::namespaced(h.api.client(), NS);
    let mut obj = lb_json("keep");
    obj["metadata"]["annotations"] = json!({
        "yawol.stackit.cloud/keepFloatingIP": "true", "yawol.stackit.cloud/keepPort": "true"
    });
    api.create(
        &PostParams::default(),
        &serde_json::from_value(obj).unwrap(),
    )
    .await
    .unwrap();
    wait_for("external IP", || {
        h.api
            .get(&lbs(), NS, "keep")
            .is_some_and(|l| l["status"]["externalIP"].is_string())
    })
    .await;
    api.delete("keep", &DeleteParams::default()).await.unwrap();
    wait_for("LoadBalancer gone", || {
        h.api.get(&lbs(), NS, "keep").is_none()
    })
    .await;
    // Floating IP and port kept; the security group is gone (stripped from the kept port first).
    assert_eq!(h.cloud.counts(), (0, 1, 1, 0, 0));
    h.task.abort();
}

/// The binary's `controller` command starts the controllers through `run::run_openstack_controllers`; the same
/// function here (with the fake cloud instead of `SdkClouds`) reconciles a LoadBalancer and reports readiness.
#[tokio::test]
async fn the_binarys_entry_point_reconciles_a_loadbalancer() {
    use lb_controller::run::{run_openstack_controllers, Health, OpenStackRunConfig};
    use std::sync::atomic::Ordering;

    let server = FakeApiServer::new();
    for (_, crd) in lb_api::crds() {
        server.install_crd(&crd);
    }
    let cloud = Arc::new(FakeCloud::new());
    let health = Arc::new(Health::default());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run_openstack_controllers(
        server.client(),
        FixedCloud(cloud.clone()),
        OpenStackRunConfig {
            namespace: NS.into(),
            loadbalancer: LbControllerConfig::default(),
            instance: "test".into(),
        },
        Arc::new(lb_controller::metrics::Metrics::new()),
        health.clone(),
        async move {
            let _ = stop_rx.await;
        },
    ));
    wait_for("ready", || health.ready.load(Ordering::SeqCst)).await;
    let api: Api<LoadBalancer> = Api::namespaced(server.client(), NS);
    api.create(
        &PostParams::default(),
        &serde_json::from_value(lb_json("bin")).unwrap(),
    )
    .await
    .unwrap();
    wait_for("external IP", || {
        server
            .get(&lbs(), NS, "bin")
            .is_some_and(|l| l["status"]["externalIP"].is_string())
    })
    .await;
    assert_eq!(cloud.counts(), (1, 1, 1, 0, 0));
    // yawol's component, so the cloud controller's back channel forwards the event to the Service.
    wait_for("ExternalIPAssigned event from yawol-service", || {
        server.count(&events(), |e| {
            e["reason"] == "ExternalIPAssigned" && e["source"]["component"] == "yawol-service"
        }) == 1
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
        text.contains(
            r#"yawol_openstack_total{api="neutron",object="floatingip",operation="create"} 1"#
        ),
        "{text}"
    );
    assert!(text.contains("lb_cloud_controller_leader"), "{text}");
    assert!(!text.contains("lb_cloud_controller_yawol"), "{text}");
}
