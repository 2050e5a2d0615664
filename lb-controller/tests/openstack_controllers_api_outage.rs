//! A 60 s outage of the control cluster's API server under the OpenStack-side controllers (the binary's
//! `run_openstack_controllers`, the fake cloud, the agents played by the test, which keep trying to report through
//! the outage): a LoadBalancer with two healthy machines loses nothing — no server deleted or created, no machine
//! replaced — although every heartbeat is a minute old when the server comes back, and the controllers work again
//! afterwards (a scale-up reaches the cloud). The restarted server answers every watch's old resourceVersion with
//! 410 Gone; before `lb_api::watch::relist_at_once` each watch then waited out its grown backoff (up to a minute)
//! and the scale-up did not arrive within two minutes.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::kube::{
    fake_cloud_lb, loadbalancermachines, loadbalancers, wait, Objects, OpenStackSide,
};
use kube::Client;
use kube_testenv::{wait_within, KubeEnv};
use lb_controller::openstack::fake::FakeCloud;
use serde_json::json;

/// Plays every machine's agent once: fresh, healthy conditions for each machine whose server is up (the first by
/// name is the VRRP master). Errors (the API server is down) are the agent's problem, as they are on a real VM.
async fn report(machines: &Objects) {
    let Ok(all) = machines.api().list(&Default::default()).await else {
        return;
    };
    let now = jiff::Timestamp::now().to_string();
    let since = (jiff::Timestamp::now() - jiff::SignedDuration::from_secs(3600)).to_string();
    let mut names: Vec<String> = all
        .items
        .iter()
        .filter(|m| m.metadata.deletion_timestamp.is_none())
        .filter(|m| m.data["status"]["lastOpenstackReconcile"].is_string())
        .filter_map(|m| m.metadata.name.clone())
        .collect();
    names.sort();
    for (i, name) in names.iter().enumerate() {
        let cond = |t: &str, s: &str| json!({"type": t, "status": s, "lastHeartbeatTime": now, "lastTransitionTime": since});
        let master = if i == 0 { "True" } else { "False" };
        let conditions = json!([
            cond("ConfigReady", "True"),
            cond("DataplaneReady", "True"),
            cond("DataplaneUpToDate", "True"),
            cond("KeepalivedMaster", master),
        ]);
        let _ = machines
            .api()
            .patch_status(
                name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(json!({"status": {"conditions": conditions}})),
            )
            .await;
    }
}

async fn machine_names(machines: &Objects) -> Vec<String> {
    let mut names: Vec<String> = machines
        .list()
        .await
        .iter()
        .map(|m| {
            m["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    names.sort();
    names
}

fn server_ids(cloud: &FakeCloud) -> Vec<String> {
    let mut ids: Vec<String> = cloud.servers().into_iter().map(|s| s.id).collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minute_without_the_api_server_deletes_no_server_and_no_machine() {
    if std::env::var_os("TEST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("info,lb_controller=debug,kube_runtime=debug")
            .with_test_writer()
            .try_init();
    }
    // The machine controller only creates ports and servers with the API server's address for the VMs.
    std::env::set_var("API_ENDPOINT", "https://api.control.example:6443");
    // Its own API server: this test stops it.
    let env = KubeEnv::start().await.unwrap();
    let admin: Client = env.client().await.unwrap();
    env.apply_crds(&admin, lb_api::crds().into_iter().map(|(_, c)| c))
        .await
        .unwrap();
    let ns = env.namespace(&admin, "outage").await.unwrap();
    let cloud = Arc::new(FakeCloud::new());
    let controllers = OpenStackSide::start(admin.clone(), cloud.clone(), &ns);
    let machines = loadbalancermachines(&admin, &ns);
    let agents = {
        let machines = machines.clone();
        tokio::spawn(async move {
            loop {
                report(&machines).await;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        })
    };
    loadbalancers(&admin, &ns)
        .api()
        .create(
            &Default::default(),
            &serde_json::from_value(fake_cloud_lb(&ns, "outage", 2)).unwrap(),
        )
        .await
        .unwrap();
    wait("two machines with ACTIVE servers", || async {
        Ok(machines
            .count(|m| m["status"]["lastOpenstackReconcile"].is_string())
            .await
            == 2
            && cloud.servers().len() == 2)
    })
    .await;
    // Settled: the set has what it wants, nothing more is being created.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (names, servers) = (machine_names(&machines).await, server_ids(&cloud));
    let (created, deleted) = (
        cloud.call_count("create_server"),
        cloud.call_count("delete_server"),
    );
    assert_eq!((names.len(), servers.len()), (2, 2));

    env.stop_apiserver();
    tokio::time::sleep(Duration::from_secs(60)).await;
    env.restart_apiserver().await.unwrap();
    // The controllers relist after their watch backoff (at most 30 s) and the agents report again.
    tokio::time::sleep(Duration::from_secs(40)).await;

    assert_eq!(server_ids(&cloud), servers, "the same servers");
    assert_eq!(
        (
            cloud.call_count("create_server"),
            cloud.call_count("delete_server")
        ),
        (created, deleted),
        "no server created or deleted"
    );
    assert_eq!(machine_names(&machines).await, names, "the same machines");
    assert_eq!(
        machines
            .count(|m| !m["metadata"]["deletionTimestamp"].is_null())
            .await,
        0,
        "no machine being deleted"
    );

    // Working again: a scale-up reaches the cloud.
    loadbalancers(&admin, &ns)
        .patch("outage", json!({"spec": {"replicas": 3}}))
        .await;
    wait_within(
        "a third server after the outage",
        Duration::from_secs(120),
        || async { Ok(cloud.servers().len() == 3) },
    )
    .await
    .unwrap();

    agents.abort();
    controllers.stop().await;
}
