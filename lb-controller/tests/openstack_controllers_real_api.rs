//! The OpenStack-side controllers (LoadBalancer → LoadBalancerSet → LoadBalancerMachine, with the in-memory fake
//! cloud) under exactly the ServiceAccount and Role of `deploy/openstack-controller.yaml`, with a token minted for
//! it on the real API server: the whole chain — including creating each machine's Role, which Kubernetes only
//! allows for permissions the controller holds itself — and its deletion work without a Forbidden.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::kube::{
    loadbalancermachines, loadbalancers, rolebindings, roles, serviceaccounts, wait,
};
use kube::api::{Api, DeleteParams, PostParams};
use kube_testenv::KubeEnv;
use lb_controller::cli::run_openstack_controllers;
use lb_controller::lb_controller::{FixedCloud, LbControllerConfig};
use lb_controller::openstack::fake::FakeCloud;
use lb_controller::run::{Health, OpenStackRunConfig};
use serde_json::json;

/// Where `deploy/openstack-controller.yaml` lets the controller work (its Role's namespace).
const NS: &str = "kube-system";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cascade_runs_under_the_deploy_rbac_with_a_real_token() {
    // The machine controller only creates ports and servers with the API server's address for the VMs.
    std::env::set_var("API_ENDPOINT", "https://api.control.example:6443");
    let env = KubeEnv::shared();
    let admin = env.client().await.unwrap();
    let controller = common::kube::deployed_controller(
        env,
        &admin,
        "../deploy/openstack-controller.yaml",
        NS,
        "lb-openstack-controller",
    )
    .await;

    let cloud = Arc::new(FakeCloud::new());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run_openstack_controllers(
        controller,
        FixedCloud(cloud.clone()),
        OpenStackRunConfig {
            namespace: NS.into(),
            loadbalancer: LbControllerConfig::default(),
            instance: "test".into(),
        },
        Arc::new(lb_controller::metrics::Metrics::new()),
        Arc::new(Health::default()),
        async move {
            let _ = stop_rx.await;
        },
    ));
    let lb: lb_api::LoadBalancer = serde_json::from_value(json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": "rbac-e2e", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": "rbac-e2e"}},
            "replicas": 1,
            "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
            "infrastructure": {
                "defaultNetwork": {"networkID": "net", "floatingNetID": "ext"},
                "flavor": {"flavorID": "f"}, "image": {"imageID": "i"},
                "authSecretRef": {"name": "cloud", "namespace": NS}
            }
        }
    }))
    .unwrap();
    Api::<lb_api::LoadBalancer>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &lb)
        .await
        .unwrap();

    let machines = loadbalancermachines(&admin, NS);
    wait("a machine with its server ACTIVE", || async {
        Ok(machines
            .list()
            .await
            .iter()
            .any(|m| m["status"]["lastOpenstackReconcile"].is_string()))
    })
    .await;
    let name = machines.list().await[0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    // The objects only a controller holding the machine's permissions may create.
    for (what, objects) in [
        ("ServiceAccount", serviceaccounts(&admin, NS)),
        ("Role", roles(&admin, NS)),
        ("RoleBinding", rolebindings(&admin, NS)),
    ] {
        assert!(objects.exists(&name).await, "the machine's {what}");
    }

    Api::<lb_api::LoadBalancer>::namespaced(admin.clone(), NS)
        .delete("rbac-e2e", &DeleteParams::default())
        .await
        .unwrap();
    let lbs = loadbalancers(&admin, NS);
    wait("the LoadBalancer gone", || async {
        Ok(!lbs.exists("rbac-e2e").await)
    })
    .await;
    assert_eq!(cloud.counts(), (0, 0, 0, 0, 0), "nothing left in the cloud");
    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the controllers stop")
        .unwrap();
}
