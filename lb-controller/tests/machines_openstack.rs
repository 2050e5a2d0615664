//! The LoadBalancerMachine controller against the real OpenStack of `cargo xtask openstack up` (Nova's fake driver,
//! two compute hosts) and the test binary's real API server (kube-testenv, a namespace per test), under exactly the
//! ServiceAccount and Role of `deploy/openstack-controller.yaml` with a real token; the cluster's token controller
//! fills each machine's token Secret. A machine gets a VM port with the VIP as allowed address pair and a server in
//! the LoadBalancer's server group booted with our user data, whose kubeconfig reaches the machine's own objects
//! with the token the token controller wrote; a server that Nova puts into ERROR (an anti-affinity group whose two
//! hosts are taken: "No valid host was found") is replaced with an event carrying Nova's fault and boots once a host
//! is free; injected Nova quota and Neutron 5xx errors are retried without duplicates; deleting the machines and
//! the LoadBalancer leaves nothing (leak check). The API server refuses nothing (`Refusals`).
//!
//! `#[ignore]`d like `tests/openstack_lb.rs`: the `openstack` stage of `cargo xtask test` runs them with
//! `--ignored --test-threads=1` (the leak check sees the whole project).

mod common;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use base64::Engine as _;
use common::kube::{events, loadbalancermachines, loadbalancers, secrets, Objects};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use kube_testenv::{KubeEnv, Refusals};
use lb_api::{LoadBalancer, LoadBalancerMachine};
use lb_controller::openstack::clouds::FixedCloud;
use lb_controller::openstack::loadbalancer::resources::{self as lb_openstack, DiscardStatus};
use lb_controller::openstack::machine::metrics::MachineMetrics;
use lb_controller::openstack::machine::{self, run};
use lb_controller::openstack::sdk::SdkCloud;
use lb_controller::openstack::Cloud;
use lb_controller::runtime::events::EventPublisher;
use lb_test_support::cascade::{
    connect, controller_token, nova_group_members, nova_server, user_data_files, vm_kubeconfig,
    STEP,
};
use openstack_sdk::api::QueryAsync;
use openstack_sdk::AsyncOpenStack;
use openstack_testenv::{Fault, FaultProxy, LeakCheck, Rule, TestEnv};
use serde_json::{json, Value};

const SYNC_SECRET: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";

/// An admin client of the test binary's API server and a new namespace in it.
async fn namespace() -> Result<(Client, String)> {
    let kube = KubeEnv::shared();
    let admin = kube.client().await?;
    let ns = kube.namespace(&admin, "itest").await?;
    Ok((admin, ns))
}

fn lb(env: &TestEnv, ns: &str, name: &str) -> LoadBalancer {
    let info = &env.info;
    serde_json::from_value(json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": name, "namespace": ns,
                     "annotations": {"loadbalancer.yawol.stackit.cloud/vrrpRouterID": "17"}},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": name}},
            "replicas": 2,
            "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
            "infrastructure": {
                "defaultNetwork": {"networkID": info.network_id, "floatingNetID": info.external_network_id},
                "flavor": {"flavorID": info.flavor_id}, "image": {"imageID": info.image_id},
                "authSecretRef": {"name": "cloud", "namespace": ns}
            },
            "options": {"internalLB": true, "serverGroupPolicy": "anti-affinity"}
        }
    }))
    .expect("fixture parses")
}

/// The machine controller on the API server, which holds the LoadBalancer (as the LoadBalancer controller left it:
/// status with the OpenStack resources, router ID annotation), its sync Secret, and the machines.
struct Harness {
    ns: String,
    admin: Client,
    /// What the API server refused the controller (and the test's machine clients).
    refusals: Refusals,
    lb: LoadBalancer,
    machines: Objects,
    events: Objects,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Harness {
    async fn start(admin: &Client, cloud: Arc<SdkCloud>, lb: &LoadBalancer) -> Result<Harness> {
        let kube = KubeEnv::shared();
        let ns = lb.metadata.namespace.clone().context("namespace")?;
        let token = controller_token(kube, admin, &ns).await?;
        let refusals = Refusals::default();
        let client = refusals
            .client(&kube.token_kubeconfig(&token), "machine controller")
            .await?;
        let mut object = lb.clone();
        object.status = None;
        Api::<LoadBalancer>::namespaced(admin.clone(), &ns)
            .create(&PostParams::default(), &object)
            .await?;
        // The status through its subresource, as the LoadBalancer controller writes it.
        loadbalancers(admin, &ns)
            .patch_status(
                lb.metadata.name.as_deref().context("name")?,
                serde_json::to_value(&lb.status)?,
            )
            .await;
        secrets(admin, &ns)
            .api()
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": format!("{}-sync", lb.metadata.name.as_deref().unwrap()), "namespace": ns},
                    "data": {"secret": base64::engine::general_purpose::STANDARD.encode(SYNC_SECRET)}
                }))?,
            )
            .await?;
        let ctx = Arc::new(machine::Context::new(
            client.clone(),
            FixedCloud(cloud),
            Arc::new(EventPublisher::new(client, "yawol-service", "itest")),
            Arc::new(MachineMetrics::default()),
            machine::Config {
                // The VMs' kubeconfig names this API server, so the test can use it.
                api_endpoint: Some(kube.url()),
                poll: Duration::from_millis(500),
                error_backoff_base: Duration::from_millis(500),
                error_backoff_max: Duration::from_secs(5),
                ..machine::Config::default()
            },
        ));
        let task = tokio::spawn({
            let ns = ns.clone();
            async move {
                run(
                    ctx,
                    &ns,
                    lb_controller::runtime::stop::Stop::on(std::future::pending()),
                )
                .await
            }
        });
        Ok(Harness {
            machines: loadbalancermachines(admin, &ns),
            events: events(admin, &ns),
            ns,
            admin: admin.clone(),
            refusals,
            lb: lb.clone(),
            task,
        })
    }

    async fn status(&self, machine: &str) -> Value {
        self.machines.get(machine).await["status"].clone()
    }

    async fn events(&self, reason: &str) -> Vec<String> {
        self.events
            .list()
            .await
            .into_iter()
            .filter(|e| {
                e["reason"] == reason && e["involvedObject"]["kind"] == "LoadBalancerMachine"
            })
            .map(|e| e["message"].as_str().unwrap_or("").to_string())
            .collect()
    }

    /// Creates a machine of the LoadBalancer (the cluster's token controller fills its token Secret).
    async fn create(&self, name: &str) -> Result<()> {
        let st = self.lb.status.clone().unwrap_or_default();
        let lbm: LoadBalancerMachine = serde_json::from_value(json!({
            "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerMachine",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {
                "infrastructure": self.lb.spec.infrastructure,
                "portID": st.port_id, "serverGroupID": st.server_group_id,
                "loadBalancerRef": {"name": self.lb.metadata.name, "namespace": self.ns}
            }
        }))?;
        Api::<LoadBalancerMachine>::namespaced(self.admin.clone(), &self.ns)
            .create(&PostParams::default(), &lbm)
            .await?;
        Ok(())
    }

    /// Polls `check` every 50 ms until it holds (at most [`STEP`]); returns the time it took.
    async fn wait<F, Fut>(&self, what: &str, check: F) -> Result<Duration>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<bool>>,
    {
        let t0 = Instant::now();
        kube_testenv::wait_within(what, STEP, check).await?;
        Ok(t0.elapsed())
    }

    async fn wait_active(&self, machine: &str) -> Result<Duration> {
        self.wait(&format!("{machine} ACTIVE"), || async {
            Ok(self.status(machine).await["lastOpenstackReconcile"].is_string())
        })
        .await
    }

    async fn delete(&self, machine: &str) -> Result<Duration> {
        Api::<LoadBalancerMachine>::namespaced(self.admin.clone(), &self.ns)
            .delete(machine, &DeleteParams::default())
            .await?;
        self.wait(&format!("{machine} deleted"), || async {
            Ok(!self.machines.exists(machine).await)
        })
        .await
    }
}

/// The LoadBalancer's security group, VIP port and server group, as the LoadBalancer controller creates them.
async fn loadbalancer(cloud: &SdkCloud, lb: &mut LoadBalancer) -> Result<()> {
    let mut status = lb.status.clone().unwrap_or_default();
    let mut warnings = Vec::new();
    let r =
        lb_openstack::reconcile(cloud, lb, &mut status, &mut DiscardStatus, &mut warnings).await;
    lb.status = Some(status);
    r?;
    Ok(())
}

/// Deletes whatever the machines left (by their names) and the LoadBalancer's resources.
async fn teardown(cloud: &SdkCloud, lb: &LoadBalancer, machines: &[&str]) -> Result<()> {
    let ns = lb.metadata.namespace.as_deref().unwrap_or_default();
    for m in machines {
        lb_controller::openstack::machine::resources::delete_machine(
            cloud,
            m,
            None,
            Duration::from_secs(90),
        )
        .await?;
        for p in cloud.find_ports(&format!("{ns}/{m}")).await? {
            cloud.delete_port(&p.id).await?;
        }
    }
    lb_openstack::delete(cloud, lb).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn openstack_machine_boots_with_user_data_in_the_group_and_deletion_leaves_nothing(
) -> Result<()> {
    let env = TestEnv::load()?;
    let cloud = Arc::new(connect(&env, &[]).await?);
    let direct = env.connect().await?;
    let admin = env.connect_admin().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;
    let (kube_admin, ns) = namespace().await?;
    let mut l = lb(&env, &ns, "itest-lbm");
    let scenario = async {
        loadbalancer(&cloud, &mut l).await?;
        let st = l.status.clone().unwrap();
        let h = Harness::start(&kube_admin, cloud.clone(), &l).await?;
        let t0 = Instant::now();
        h.create("itest-lbm-m1").await?;
        h.wait_active("itest-lbm-m1").await?;
        let t_active = t0.elapsed();
        let ms = h.status("itest-lbm-m1").await;
        let server_id = ms["serverID"].as_str().context("serverID")?.to_string();
        for k in [
            "defaultPortID",
            "defaultPortIP",
            "creationTimestamp",
            "serviceAccountName",
        ] {
            ensure!(ms[k].is_string(), "{k} missing in {ms}");
        }

        // Nova: the server is in the LoadBalancer's group and carries our user data byte for byte.
        let nova = nova_server(&admin, &server_id).await?;
        let members = nova_group_members(&admin, st.server_group_id.as_deref().unwrap()).await?;
        ensure!(
            members.contains(&server_id),
            "not in the server group: {members:?}"
        );
        let files: Vec<String> = user_data_files(&nova)?
            .into_iter()
            .map(|(_, content)| content)
            .collect();
        let token = secrets(&kube_admin, &ns).get("itest-lbm-m1").await["data"]["token"]
            .as_str()
            .map(|t| base64::engine::general_purpose::STANDARD.decode(t))
            .context("the token controller filled the token Secret")??;
        let token = String::from_utf8(token)?;
        ensure!(
            files.iter().any(|f| f.contains(&token)),
            "the token controller's token in the kubeconfig"
        );
        ensure!(
            files.iter().any(|f| f.contains("--vrrp-router-id=17")),
            "HA arguments"
        );
        ensure!(files.iter().any(|f| f == SYNC_SECRET), "sync secret file");

        // Neutron: the VM port carries the VIP as allowed address pair and belongs to the server.
        let port = cloud
            .get_port(ms["defaultPortID"].as_str().unwrap())
            .await?;
        ensure!(
            port.allowed_address_pairs == st.port_ip.clone().into_iter().collect::<Vec<_>>(),
            "VIP as allowed address pair: {port:?}"
        );
        ensure!(port.device_id == server_id, "port on the server: {port:?}");
        ensure!(
            port.name == format!("{ns}/itest-lbm-m1"),
            "yawol's port name: {port:?}"
        );

        // The VM's kubeconfig works: it reaches the machine's own objects on this API server.
        let vm = h
            .refusals
            .client(
                &vm_kubeconfig(&admin, &server_id).await?,
                "the VM of itest-lbm-m1",
            )
            .await?;
        Api::<LoadBalancerMachine>::namespaced(vm.clone(), &ns)
            .get("itest-lbm-m1")
            .await?;
        Api::<LoadBalancer>::namespaced(vm, &ns)
            .get("itest-lbm")
            .await?;

        let t_delete = h.delete("itest-lbm-m1").await?;
        ensure!(
            cloud.find_servers("itest-lbm-m1").await?.is_empty(),
            "server left"
        );
        ensure!(
            cloud
                .find_ports(&format!("{ns}/itest-lbm-m1"))
                .await?
                .is_empty(),
            "port left"
        );
        eprintln!(
            "timing: machine ACTIVE after {:.2}s, deleted in {:.2}s",
            t_active.as_secs_f64(),
            t_delete.as_secs_f64()
        );
        h.refusals.assert_none()
    }
    .await;
    let cleanup = teardown(&cloud, &l, &["itest-lbm-m1"]).await;
    let leaks = LeakCheck::new(&env).assert_clean(&direct).await;
    scenario?;
    cleanup?;
    leaks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn openstack_error_server_is_replaced_and_boots_once_a_host_is_free() -> Result<()> {
    let env = TestEnv::load()?;
    let cloud = Arc::new(connect(&env, &[]).await?);
    let direct = env.connect().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;
    let (kube_admin, ns) = namespace().await?;
    let mut l = lb(&env, &ns, "itest-err");
    let machines = ["itest-err-m1", "itest-err-m2", "itest-err-m3"];
    let scenario = async {
        loadbalancer(&cloud, &mut l).await?;
        let h = Harness::start(&kube_admin, cloud.clone(), &l).await?;
        // Two machines take both compute hosts of the anti-affinity group (one at a time: Nova's late check fails
        // simultaneous boots on one host, which the controller would also repair, but slower).
        for m in &machines[..2] {
            h.create(m).await?;
            h.wait_active(m).await?;
        }
        // The third has no valid host: ERROR, replaced (and ERROR again) while the group is full.
        h.create(machines[2]).await?;
        h.wait("ServerError event with Nova's fault", || async {
            Ok(h.events("ServerError")
                .await
                .iter()
                .any(|m| m.contains("No valid host")))
        })
        .await?;
        let first_error = h.events("ServerError").await;
        eprintln!("Nova's fault in the event: {}", first_error[0]);
        ensure!(
            h.status(machines[2]).await["lastOpenstackReconcile"].is_null(),
            "not ACTIVE"
        );
        // A host becomes free: the next replacement boots.
        h.delete(machines[0]).await?;
        let t = h.wait_active(machines[2]).await?;
        eprintln!(
            "timing: replacement ACTIVE {:.2}s after a host was freed; {} ServerError event(s)",
            t.as_secs_f64(),
            h.events("ServerError").await.len()
        );
        let servers = cloud.find_servers(machines[2]).await?;
        ensure!(
            servers.len() == 1 && servers[0].status == "ACTIVE",
            "exactly one server left for the machine: {servers:?}"
        );
        ensure!(
            cloud
                .find_ports(&format!("{ns}/{}", machines[2]))
                .await?
                .len()
                == 1,
            "one VM port, kept across replacements"
        );
        for m in &machines[1..] {
            h.delete(m).await?;
        }
        h.refusals.assert_none()
    }
    .await;
    let cleanup = teardown(&cloud, &l, &machines).await;
    let leaks = LeakCheck::new(&env).assert_clean(&direct).await;
    scenario?;
    cleanup?;
    leaks
}

/// The project's Nova `instances` quota (admin).
async fn instances_quota(admin: &AsyncOpenStack, project: &str) -> Result<i64> {
    use openstack_sdk::api::compute::v2::quota_set::get_20;
    let v: Value = get_20::Request::builder()
        .id(project)
        .build()?
        .query_async(admin)
        .await?;
    v["instances"].as_i64().context("instances quota")
}

async fn set_instances_quota(admin: &AsyncOpenStack, project: &str, limit: i64) -> Result<()> {
    use openstack_sdk::api::compute::v2::quota_set::set_257;
    let quota = set_257::QuotaSetBuilder::default()
        .instances(i32::try_from(limit)?)
        .build()?;
    let _: Value = set_257::Request::builder()
        .id(project)
        .quota_set(quota)
        .build()?
        .query_async(admin)
        .await?;
    Ok(())
}

/// Nova's real quota error (the project's `instances` quota set to 0 for a moment) and Neutron 5xx errors injected
/// by the fault proxy. (Nova 5xx are injected in `tests/openstack_cascade.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn openstack_machine_quota_and_5xx_are_retried_without_duplicates() -> Result<()> {
    let env = TestEnv::load()?;
    let neutron = FaultProxy::start("http://127.0.0.1:9696").await?;
    let cloud = Arc::new(connect(&env, &[(&neutron, "network", "v2.0")]).await?);
    // Cleanup goes around the proxy, so an injected fault cannot make it leak.
    let plain = connect(&env, &[]).await?;
    let direct = env.connect().await?;
    let admin = env.connect_admin().await?;
    let project = env.info.project_id.clone();
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;
    let quota = instances_quota(&admin, &project).await?;
    let (kube_admin, ns) = namespace().await?;
    let mut l = lb(&env, &ns, "itest-q");
    let scenario = async {
        loadbalancer(&cloud, &mut l).await?;
        neutron.inject(
            Rule::new("POST", "/ports").times(2),
            Fault::internal_error(),
        );
        set_instances_quota(&admin, &project, 0).await?;
        let h = Harness::start(&kube_admin, cloud.clone(), &l).await?;
        h.create("itest-q-m1").await?;
        h.wait("Nova's quota error in an event", || async {
            Ok(h.events("OpenStackError")
                .await
                .iter()
                .any(|m| m.contains("Quota exceeded for instances")))
        })
        .await?;
        ensure!(
            cloud.find_servers("itest-q-m1").await?.is_empty(),
            "no server while over quota"
        );
        set_instances_quota(&admin, &project, quota).await?;
        h.wait_active("itest-q-m1").await?;
        let errors = h.events("OpenStackError").await;
        eprintln!("events: {errors:#?}");
        ensure!(
            errors
                .iter()
                .any(|m| m.contains("injected internal server error")),
            "Neutron's 500 in an event: {errors:?}"
        );
        ensure!(neutron.injected_count() == 2, "faults injected");
        ensure!(
            cloud.find_servers("itest-q-m1").await?.len() == 1,
            "one server"
        );
        ensure!(
            cloud.find_ports(&format!("{ns}/itest-q-m1")).await?.len() == 1,
            "one VM port"
        );
        // Deletion through a 503 on the port delete: retried, nothing left.
        neutron.inject(
            Rule::new("DELETE", "/ports/").times(1),
            Fault::unavailable(),
        );
        h.delete("itest-q-m1").await?;
        ensure!(
            h.events("OpenStackError")
                .await
                .iter()
                .any(|m| m.starts_with("deletion:")),
            "the failed deletion step was reported"
        );
        h.refusals.assert_none()
    }
    .await;
    let restored = set_instances_quota(&admin, &project, quota).await;
    neutron.clear();
    let cleanup = teardown(&plain, &l, &["itest-q-m1"]).await;
    let leaks = LeakCheck::new(&env).assert_clean(&direct).await;
    scenario?;
    restored?;
    cleanup?;
    leaks
}
