//! The OpenStack-side controllers (LoadBalancer → LoadBalancerSet → LoadBalancerMachine, with the in-memory fake
//! cloud) under exactly the ServiceAccount and Role of `deploy/openstack-controller.yaml`, with a token minted for
//! it on the real API server: the whole chain — including creating each machine's Role, which Kubernetes only
//! allows for permissions the controller holds itself — and its deletion work without a Forbidden.

mod common;

use std::sync::Arc;

use common::kube::{
    fake_cloud_lb, loadbalancermachines, loadbalancers, rolebindings, roles, serviceaccounts, wait,
    OpenStackSide,
};
use kube::api::{Api, DeleteParams, PostParams};
use kube_testenv::KubeEnv;
use lb_controller::openstack::fake::FakeCloud;

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
    let controllers = OpenStackSide::start(controller, cloud.clone(), NS);
    let lb: lb_api::LoadBalancer =
        serde_json::from_value(fake_cloud_lb(NS, "rbac-e2e", 1)).unwrap();
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
    controllers.stop().await;
}
