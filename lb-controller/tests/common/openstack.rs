//! Shared by the real-OpenStack tests (`tests/openstack_lb.rs`, `tests/machines_openstack.rs`,
//! `tests/openstack_cascade.rs`) and the OpenStack benchmark (`examples/bench_openstack.rs` includes this file by
//! path): sessions on the environment of `cargo xtask openstack up`, Nova's view of a server, the leak check plus
//! sweep that ends every test, and [`Cascade`]: the OpenStack-side controllers started through
//! `cli::run_openstack_controllers` on the in-memory API server, with Kubernetes' token controller and the
//! machines' agents played by a background task.

#![allow(dead_code)]

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::Api;
use kube_testenv::fake_api::{FakeApiServer, ResourceKey};
use lb_api::constants::{conditions, lb_annotations};
use lb_api::{LoadBalancer, LoadBalancerMachine};
use lb_controller::cli::run_openstack_controllers;
use lb_controller::lb_controller::{CloudFactory, LbControllerConfig, RolloutGate};
use lb_controller::metrics::Metrics;
use lb_controller::openstack::sdk::SdkCloud;
use lb_controller::openstack::{Cloud, CloudProviderConf, OpenStackCalls};
use lb_controller::run::{
    run_openstack_controllers_with, Health, OpenStackRunConfig, OpenStackTuning,
};
use openstack_sdk::api::QueryAsync;
use openstack_sdk::AsyncOpenStack;
use openstack_testenv::{FaultProxy, LeakCheck, TestEnv};
use serde_json::{json, Value};

/// Namespace of the LoadBalancers, sets and machines (also the first part of the OpenStack names).
pub const NS: &str = "itest";
/// The API server URL written into the machines' kubeconfig (`API_ENDPOINT`).
pub const API_ENDPOINT: &str = "https://203.0.113.1:6443";
/// The token the simulated token controller writes into every machine's token Secret.
pub const TOKEN: &str = "itest-machine-token";
/// Per OpenStack call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(20);

pub fn key(group: &str, plural: &str) -> ResourceKey {
    ResourceKey::new(group, plural)
}
pub fn loadbalancers() -> ResourceKey {
    key("yawol.stackit.cloud", "loadbalancers")
}
pub fn sets() -> ResourceKey {
    key("yawol.stackit.cloud", "loadbalancersets")
}
pub fn machines() -> ResourceKey {
    key("yawol.stackit.cloud", "loadbalancermachines")
}
pub fn events() -> ResourceKey {
    key("", "events")
}
pub fn secrets() -> ResourceKey {
    key("", "secrets")
}

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

// ---------------------------------------------------------------------------------------------------------------
// Sessions and Nova's view.

/// A session of the test project through yawol's `cloudprovider.conf` INI (as the controller reads it from a
/// LoadBalancer's Secret), with `(proxy, service type, version)` routed through fault proxies.
pub async fn connect(env: &TestEnv, proxies: &[(&FaultProxy, &str, &str)]) -> Result<SdkCloud> {
    connect_counted(env, proxies, OpenStackCalls::default()).await
}

/// [`connect`], counting the calls in `calls` (e.g. the `yawol_openstack` family of a `Metrics`).
pub async fn connect_counted(
    env: &TestEnv,
    proxies: &[(&FaultProxy, &str, &str)],
    calls: OpenStackCalls,
) -> Result<SdkCloud> {
    connect_routed(env, proxies, None, calls).await
}

/// [`connect_counted`], with Nova behind `nova` when given: the session authenticates through its Keystone proxy,
/// so the catalog sends compute to its Nova proxy.
pub async fn connect_routed(
    env: &TestEnv,
    proxies: &[(&FaultProxy, &str, &str)],
    nova: Option<&NovaProxy>,
    calls: OpenStackCalls,
) -> Result<SdkCloud> {
    let text = std::fs::read_to_string(env.cloudprovider_conf())?;
    let mut conf = CloudProviderConf::parse(&text)?;
    if let Some(nova) = nova {
        conf.auth_url = conf
            .auth_url
            .replace(&nova.keystone_origin, &nova.keystone.url());
    }
    let mut config = conf.to_cloud_config(None)?;
    for (proxy, service, version) in proxies {
        proxy.route(&mut config, service, version);
    }
    SdkCloud::connect(&config, CALL_TIMEOUT, calls).await
}

/// Nova behind a fault proxy, reached the way `openstack_sdk` normally finds it. An endpoint override
/// ([`FaultProxy::route`]) cannot be used for Nova: the SDK skips version discovery for it, knows no microversion
/// range and sends e.g. microversion 2.0, which Nova rejects with 406. Instead a second proxy in front of Keystone
/// rewrites Nova's URL in the tokens' catalog to the Nova proxy; a session authenticated through it
/// ([`connect_routed`]) discovers Nova through the proxy and sends every Nova call there.
pub struct NovaProxy {
    /// In front of Nova: inject faults here.
    pub nova: FaultProxy,
    /// In front of Keystone, pointing the catalog's compute endpoint at `nova`.
    pub keystone: FaultProxy,
    /// Keystone's origin as the environment's `auth_url` names it (`http://127.0.0.1:5000`).
    keystone_origin: String,
}

impl NovaProxy {
    /// Nova's origin in the environment's catalog.
    pub const NOVA: &'static str = "http://127.0.0.1:8774";

    /// Starts both proxies.
    pub async fn start(env: &TestEnv) -> Result<Self> {
        // `http://127.0.0.1:5000/v3` → `http://127.0.0.1:5000`.
        let url = &env.info.auth_url;
        let host_at = url.find("://").context("auth_url without scheme")? + 3;
        let keystone_origin = match url[host_at..].find('/') {
            Some(i) => url[..host_at + i].to_string(),
            None => url.clone(),
        };
        let nova = FaultProxy::start(Self::NOVA).await?;
        let keystone = FaultProxy::start(&keystone_origin).await?;
        keystone.rewrite_responses(Self::NOVA, &nova.url());
        Ok(NovaProxy {
            nova,
            keystone,
            keystone_origin,
        })
    }
}

/// Nova's view of a server at a recent microversion (as admin: `OS-EXT-SRV-ATTR:user_data`, `server_groups`,
/// the embedded flavor).
pub async fn nova_server(admin: &AsyncOpenStack, id: &str) -> Result<Value> {
    use openstack_sdk::api::compute::v2::server::get_20;
    let mut req = get_20::Request::builder();
    req.id(id).header(
        axum::http::HeaderName::from_static("openstack-api-version"),
        axum::http::HeaderValue::from_static("compute 2.79"),
    );
    let v: Value = req.build()?.query_async(admin).await?;
    Ok(v)
}

/// The member server IDs of a Nova server group.
pub async fn nova_group_members(admin: &AsyncOpenStack, id: &str) -> Result<Vec<String>> {
    use openstack_sdk::api::compute::v2::server_group::get_21;
    let v: Value = get_21::Request::builder()
        .id(id)
        .build()?
        .query_async(admin)
        .await?;
    Ok(v["members"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m.as_str().map(str::to_string))
        .collect())
}

/// The files of the cloud-config Nova stores for a server (`nova_server`'s answer): `(path, decoded content)`.
pub fn user_data_files(nova: &Value) -> Result<Vec<(String, String)>> {
    let user_data = nova["OS-EXT-SRV-ATTR:user_data"]
        .as_str()
        .context("Nova returned no user_data (admin, microversion >= 2.3)")?;
    let user_data =
        String::from_utf8(base64::engine::general_purpose::STANDARD.decode(user_data)?)?;
    anyhow::ensure!(
        user_data.starts_with("#cloud-config\n"),
        "not a cloud-config: {user_data}"
    );
    let doc: serde_yaml::Value = serde_yaml::from_str(&user_data)?;
    doc["write_files"]
        .as_sequence()
        .context("write_files")?
        .iter()
        .map(|f| {
            let raw = base64::engine::general_purpose::STANDARD
                .decode(f["content"].as_str().unwrap_or(""))?;
            Ok((
                f["path"].as_str().unwrap_or("").to_string(),
                String::from_utf8_lossy(&raw).into_owned(),
            ))
        })
        .collect()
}

/// Servers of the project whose name starts with `prefix`: `(id, name, status)`.
pub async fn servers_named(
    env: &TestEnv,
    direct: &AsyncOpenStack,
    prefix: &str,
) -> Result<Vec<(String, String, String)>> {
    Ok(LeakCheck::new(env)
        .only_prefixed(prefix)
        .find(direct)
        .await?
        .into_iter()
        .filter(|r| r.kind == "server")
        .map(|r| (r.id, r.name, r.detail))
        .collect())
}

/// Creates (or finds) a public flavor named `name` like the environment's (1 vCPU, 256 MiB, 1 GiB): a second flavor
/// for rolling updates. Returns its ID.
pub async fn ensure_flavor(admin: &AsyncOpenStack, name: &str) -> Result<String> {
    use openstack_sdk::api::compute::v2::flavor::{create_21, list_20};
    let list: Vec<Value> = list_20::Request::builder()
        .build()?
        .query_async(admin)
        .await?;
    if let Some(f) = list.iter().find(|f| f["name"] == name) {
        return Ok(f["id"].as_str().unwrap_or_default().to_string());
    }
    let flavor = create_21::FlavorBuilder::default()
        .name(name)
        .vcpus(1)
        .ram(256)
        .disk(1)
        .build()?;
    let v: Value = create_21::Request::builder()
        .flavor(flavor)
        .build()?
        .query_async(admin)
        .await?;
    v["id"]
        .as_str()
        .map(str::to_string)
        .context("flavor without id")
}

pub async fn delete_flavor(admin: &AsyncOpenStack, id: &str) -> Result<()> {
    use openstack_sdk::api::compute::v2::flavor::delete;
    openstack_sdk::api::ignore(delete::Request::builder().id(id).build()?)
        .query_async(admin)
        .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------------
// End of every test: the leak check, and a sweep when it fails.

/// Deletes everything the leak check finds in the test project (servers first, security groups last), so that a
/// failed test does not fail the ones after it. Only for after the check has reported.
pub async fn sweep(env: &TestEnv, cloud: &SdkCloud, direct: &AsyncOpenStack) -> Result<()> {
    let found = LeakCheck::new(env).find(direct).await?;
    let of = |kind: &str| -> Vec<String> {
        found
            .iter()
            .filter(|r| r.kind == kind)
            .map(|r| r.id.clone())
            .collect()
    };
    for id in of("server") {
        cloud.delete_server(&id).await?;
    }
    let deadline = Instant::now() + Duration::from_secs(90);
    for id in of("server") {
        while cloud.get_server(&id).await.is_ok() {
            if Instant::now() > deadline {
                bail!("sweep: server {id} is not going away");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    for id in of("floating IP") {
        cloud.delete_floating_ip(&id).await?;
    }
    for id in of("port") {
        cloud.delete_port(&id).await?;
    }
    for id in of("server group") {
        cloud.delete_server_group(&id).await?;
    }
    for id in of("security group") {
        cloud.delete_security_group(&id).await?;
    }
    Ok(())
}

/// The end of a test: the leak check over the whole project (tests run one at a time), a sweep if it found
/// something, and the first error of `scenario`, `cleanup` and the check.
pub async fn finish(
    env: &TestEnv,
    cloud: &SdkCloud,
    direct: &AsyncOpenStack,
    scenario: Result<()>,
    cleanup: Result<()>,
) -> Result<()> {
    let leaks = LeakCheck::new(env).assert_clean(direct).await;
    if leaks.is_err() {
        if let Err(e) = sweep(env, cloud, direct).await {
            eprintln!("sweep after the leak check failed: {e:#}");
        }
    }
    scenario.and(cleanup).and(leaks)
}

// ---------------------------------------------------------------------------------------------------------------
// The cascade on the in-memory API server.

/// A LoadBalancer of the test project (network, floating network, flavor and image of the environment), credentials
/// from the Secret `cloud` that [`Cascade::start`] creates.
pub fn lb_json(env: &TestEnv, name: &str, replicas: i32, options: Value) -> Value {
    let info = &env.info;
    json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": name}},
            "replicas": replicas,
            "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
            "endpoints": [{"name": "node-1", "addresses": ["198.51.100.200"]}],
            "infrastructure": {
                "defaultNetwork": {"networkID": info.network_id, "floatingNetID": info.external_network_id},
                "flavor": {"flavorID": info.flavor_id}, "image": {"imageID": info.image_id},
                "authSecretRef": {"name": "cloud", "namespace": NS}
            },
            "options": options
        }
    })
}

/// How the cascade runs.
#[derive(Clone, Debug)]
pub struct CascadeConfig {
    /// LoadBalancer controller: the rollout gate is 1 s of VRRP mastership instead of 2 min, so a rolling update
    /// finishes within a test; everything else as in production.
    pub loadbalancer: LbControllerConfig,
    /// `None`: `run_openstack_controllers` (the binary's path, with its settings from the environment);
    /// `Some`: `run_openstack_controllers_with` these (the benchmark shortens the resync periods).
    pub tuning: Option<OpenStackTuning>,
    /// How often the simulated agents rewrite their conditions (the agent's `--requeue-period`, 30 s).
    pub heartbeat: Duration,
}

impl Default for CascadeConfig {
    fn default() -> Self {
        CascadeConfig {
            loadbalancer: LbControllerConfig {
                resync: Duration::from_secs(300),
                deletion_poll: Duration::from_millis(500),
                rollout: RolloutGate {
                    master_for: Duration::from_secs(1),
                    ..RolloutGate::default()
                },
            },
            tuning: None,
            heartbeat: Duration::from_secs(30),
        }
    }
}

/// What the simulated agents do.
#[derive(Default)]
struct Agents {
    /// Machines whose agent the test plays itself (e.g. reporting them unhealthy).
    sick: HashSet<String>,
    /// The VRRP master per LoadBalancer.
    masters: std::collections::HashMap<String, String>,
}

/// The OpenStack-side controllers on an in-memory API server against the real cloud, plus the parts of a cluster
/// the tests play: the token controller (fills every machine's token Secret) and the agents. An agent starts
/// reporting once its machine's server is ACTIVE (`status.lastOpenstackReconcile`): `ConfigReady`,
/// `DataplaneReady`, `DataplaneUpToDate` True with a heartbeat every [`CascadeConfig::heartbeat`], and
/// `KeepalivedMaster` True on one machine per LoadBalancer — like keepalived with the agents' revision bonus, the
/// newest revision's oldest machine, kept while it stays eligible and is of the newest revision.
pub struct Cascade {
    pub api: FakeApiServer,
    pub metrics: Arc<Metrics>,
    agents: Arc<Mutex<Agents>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    controllers: Option<tokio::task::JoinHandle<()>>,
    helpers: tokio::task::JoinHandle<()>,
}

impl Drop for Cascade {
    fn drop(&mut self) {
        self.helpers.abort();
        if let Some(c) = &self.controllers {
            c.abort();
        }
    }
}

impl Cascade {
    /// Starts everything. `clouds` should count its calls in `metrics.openstack_calls` (the `yawol_openstack`
    /// family), as the binary's do.
    /// `clouds` gets the in-memory API server's client (for `SecretClouds`).
    pub async fn start<F: CloudFactory>(
        env: &TestEnv,
        metrics: Arc<Metrics>,
        config: CascadeConfig,
        clouds: impl FnOnce(kube::Client) -> F,
    ) -> Result<Cascade> {
        let api = FakeApiServer::new();
        let clouds = clouds(api.client());
        for (_, crd) in lb_api::crds() {
            api.install_crd(&crd);
        }
        // The LoadBalancers' authSecretRef, for `SecretClouds`.
        let conf = std::fs::read_to_string(env.cloudprovider_conf())?;
        api.put(
            &secrets(),
            json!({"metadata": {"name": "cloud", "namespace": NS},
                   "data": {"cloudprovider.conf": b64(&conf)}}),
        );
        let run_config = OpenStackRunConfig {
            namespace: NS.into(),
            loadbalancer: config.loadbalancer.clone(),
            instance: "itest".into(),
        };
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stop_rx.await;
        };
        let health = Arc::new(Health::default());
        let controllers = match config.tuning.clone() {
            None => {
                // `run_openstack_controllers` reads the machine settings like the binary does.
                std::env::set_var("API_ENDPOINT", API_ENDPOINT);
                tokio::spawn(run_openstack_controllers(
                    api.client(),
                    clouds,
                    run_config,
                    metrics.clone(),
                    health,
                    shutdown,
                ))
            }
            Some(tuning) => tokio::spawn(run_openstack_controllers_with(
                api.client(),
                clouds,
                run_config,
                tuning,
                metrics.clone(),
                health,
                shutdown,
            )),
        };
        let agents = Arc::new(Mutex::new(Agents::default()));
        let helpers = tokio::spawn(play_cluster(api.clone(), agents.clone(), config.heartbeat));
        Ok(Cascade {
            api,
            metrics,
            agents,
            stop: Some(stop_tx),
            controllers: Some(controllers),
            helpers,
        })
    }

    /// Stops the controllers (in-flight reconciles finish) and the simulated cluster.
    pub async fn stop(mut self) -> Result<()> {
        self.helpers.abort();
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.controllers.take() {
            tokio::time::timeout(Duration::from_secs(60), task)
                .await
                .context("the controllers did not stop within 60 s")??;
        }
        Ok(())
    }

    pub fn lb(&self, name: &str) -> Value {
        self.api
            .get(&loadbalancers(), NS, name)
            .unwrap_or(Value::Null)
    }

    pub fn status(&self, lb: &str) -> Value {
        self.lb(lb)["status"].clone()
    }

    pub fn set(&self, name: &str) -> Value {
        self.api.get(&sets(), NS, name).unwrap_or(Value::Null)
    }

    /// The sets of `lb`, by revision.
    pub fn sets_of(&self, lb: &str) -> Vec<Value> {
        let mut v: Vec<Value> = self
            .api
            .list(&sets())
            .into_iter()
            .filter(|s| s["spec"]["template"]["spec"]["loadBalancerRef"]["name"] == lb)
            .collect();
        v.sort_by_key(revision);
        v
    }

    /// The name of `lb`'s set of `revision`, if it exists.
    pub fn set_of_revision(&self, lb: &str, rev: u64) -> Option<String> {
        self.sets_of(lb)
            .iter()
            .find(|s| revision(s) == rev)
            .and_then(|s| s["metadata"]["name"].as_str().map(str::to_string))
    }

    pub fn machine(&self, name: &str) -> Value {
        self.api.get(&machines(), NS, name).unwrap_or(Value::Null)
    }

    /// The machines of `lb` (any set, also those being deleted), by name.
    pub fn machines_of(&self, lb: &str) -> Vec<Value> {
        let mut v: Vec<Value> = self
            .api
            .list(&machines())
            .into_iter()
            .filter(|m| m["spec"]["loadBalancerRef"]["name"] == lb)
            .collect();
        v.sort_by_key(name_of);
        v
    }

    /// Machines of `set` that are not being deleted.
    pub fn live_machines_of_set(&self, set: &str) -> Vec<Value> {
        self.api
            .list(&machines())
            .into_iter()
            .filter(|m| {
                m["metadata"]["ownerReferences"][0]["name"] == set
                    && m["metadata"]["deletionTimestamp"].is_null()
            })
            .collect()
    }

    /// `(machine, serverID)` of the machines of `set` whose server is ACTIVE, not being deleted.
    pub fn active_in_set(&self, set: &str) -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = self
            .live_machines_of_set(set)
            .iter()
            .filter(|m| m["status"]["lastOpenstackReconcile"].is_string())
            .filter_map(|m| Some((name_of(m), m["status"]["serverID"].as_str()?.to_string())))
            .collect();
        v.sort();
        v
    }

    /// Messages of the events with `reason` about the LoadBalancer `lb`.
    pub fn lb_events(&self, lb: &str, reason: &str) -> Vec<String> {
        self.api
            .list(&events())
            .into_iter()
            .filter(|e| {
                e["reason"] == reason
                    && e["involvedObject"]["kind"] == "LoadBalancer"
                    && e["involvedObject"]["name"] == lb
            })
            .map(|e| e["message"].as_str().unwrap_or("").to_string())
            .collect()
    }

    /// `(object name, message)` of the events with `reason` about objects of `kind`.
    pub fn events_of(&self, kind: &str, reason: &str) -> Vec<(String, String)> {
        self.api
            .list(&events())
            .into_iter()
            .filter(|e| e["reason"] == reason && e["involvedObject"]["kind"] == kind)
            .map(|e| {
                (
                    e["involvedObject"]["name"]
                        .as_str()
                        .unwrap_or("")
                        .to_string(),
                    e["message"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect()
    }

    pub fn lb_api(&self) -> Api<LoadBalancer> {
        Api::namespaced(self.api.client(), NS)
    }

    pub fn lbm_api(&self) -> Api<LoadBalancerMachine> {
        Api::namespaced(self.api.client(), NS)
    }

    pub async fn create_lb(&self, obj: Value) -> Result<()> {
        self.lb_api()
            .create(&PostParams::default(), &serde_json::from_value(obj)?)
            .await?;
        Ok(())
    }

    pub async fn patch_lb(&self, name: &str, patch: Value) -> Result<()> {
        self.lb_api()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// Deletes the LoadBalancer and waits until the controllers have let it go (its finalizer is removed after
    /// every set, machine and cloud resource); returns how long that took.
    pub async fn delete_lb(&self, name: &str, timeout: Duration) -> Result<Duration> {
        let t0 = Instant::now();
        self.lb_api().delete(name, &DeleteParams::default()).await?;
        self.wait(&format!("LoadBalancer {name} gone"), timeout, |c| {
            c.lb(name).is_null()
        })
        .await?;
        Ok(t0.elapsed())
    }

    /// Polls `check` every 50 ms; fails after `timeout` naming `what`. Returns the time it took.
    pub async fn wait(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut(&Self) -> bool,
    ) -> Result<Duration> {
        let t0 = Instant::now();
        while !check(self) {
            if t0.elapsed() > timeout {
                bail!("timed out after {timeout:?} waiting for {what}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(t0.elapsed())
    }

    /// The agent of `machine` is played by the test from now on (or again by the background agent).
    pub fn set_sick(&self, machine: &str, sick: bool) {
        let mut a = self.agents.lock().unwrap();
        if sick {
            a.sick.insert(machine.to_string());
        } else {
            a.sick.remove(machine);
        }
    }

    /// The simulated VRRP master of `lb`.
    pub fn master(&self, lb: &str) -> Option<String> {
        self.agents.lock().unwrap().masters.get(lb).cloned()
    }

    /// Writes `conditions` as the whole condition list of `machine` (the test playing its agent).
    pub async fn report(&self, machine: &str, conditions: Vec<Value>) -> Result<()> {
        self.lbm_api()
            .patch_status(
                machine,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": {"conditions": conditions}})),
            )
            .await?;
        Ok(())
    }
}

/// Polls an asynchronous `check` (e.g. an OpenStack query) every 250 ms until it holds.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool>>,
{
    let t0 = Instant::now();
    loop {
        if check().await? {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() > timeout {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

pub fn name_of(o: &Value) -> String {
    o["metadata"]["name"].as_str().unwrap_or("").to_string()
}

/// The revision annotation of a set or machine (0 without).
pub fn revision(o: &Value) -> u64 {
    o["metadata"]["annotations"][lb_annotations::REVISION]
        .as_str()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0)
}

/// `now - secs` as a Kubernetes time.
pub fn ago(secs: i64) -> String {
    (jiff::Timestamp::now() - jiff::SignedDuration::from_secs(secs)).to_string()
}

/// A machine condition with its heartbeat and transition `…_ago` seconds back.
pub fn condition(type_: &str, status: &str, heartbeat_ago: i64, transition_ago: i64) -> Value {
    json!({"type": type_, "status": status, "reason": "Itest", "message": "",
           "lastHeartbeatTime": ago(heartbeat_ago), "lastTransitionTime": ago(transition_ago)})
}

const AGENT_CONDITIONS: [&str; 4] = [
    conditions::CONFIG_READY,
    conditions::DATAPLANE_READY,
    conditions::DATAPLANE_UP_TO_DATE,
    conditions::KEEPALIVED_MASTER,
];

/// The token controller and the agents (see [`Cascade`]), every 100 ms.
async fn play_cluster(api: FakeApiServer, agents: Arc<Mutex<Agents>>, heartbeat: Duration) {
    let client = api.client();
    let secret_api: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), NS);
    let lbm_api: Api<LoadBalancerMachine> = Api::namespaced(client, NS);
    loop {
        for s in api.list(&secrets()) {
            if s["type"] == "kubernetes.io/service-account-token" && s["data"]["token"].is_null() {
                let patch = json!({"data": {"token": b64(TOKEN), "ca.crt": b64("PEM")}});
                let _ = secret_api
                    .patch(&name_of(&s), &PatchParams::default(), &Patch::Merge(&patch))
                    .await;
            }
        }
        let all = api.list(&machines());
        let writes = agent_writes(&all, &agents, heartbeat);
        for (machine, conds) in writes {
            let _ = lbm_api
                .patch_status(
                    &machine,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"status": {"conditions": conds}})),
                )
                .await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Elects the masters and returns the condition lists to write.
fn agent_writes(
    all: &[Value],
    agents: &Mutex<Agents>,
    heartbeat: Duration,
) -> Vec<(String, Vec<Value>)> {
    let mut a = agents.lock().unwrap();
    let eligible = |m: &&Value| {
        m["metadata"]["deletionTimestamp"].is_null()
            && m["status"]["lastOpenstackReconcile"].is_string()
    };
    let mut lbs: Vec<String> = all
        .iter()
        .filter_map(|m| {
            m["spec"]["loadBalancerRef"]["name"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    lbs.sort();
    lbs.dedup();
    for lb in &lbs {
        let candidates: Vec<&Value> = all
            .iter()
            .filter(eligible)
            .filter(|m| m["spec"]["loadBalancerRef"]["name"] == lb.as_str())
            .filter(|m| !a.sick.contains(&name_of(m)))
            .collect();
        let newest = candidates.iter().map(|m| revision(m)).max();
        let keep = a.masters.get(lb).and_then(|cur| {
            candidates
                .iter()
                .find(|m| name_of(m) == *cur && Some(revision(m)) == newest)
                .map(|m| name_of(m))
        });
        let elected = keep.or_else(|| {
            candidates
                .iter()
                .filter(|m| Some(revision(m)) == newest)
                .min_by_key(|m| {
                    (
                        m["metadata"]["creationTimestamp"]
                            .as_str()
                            .unwrap_or("")
                            .to_string(),
                        name_of(m),
                    )
                })
                .map(|m| name_of(m))
        });
        match elected {
            Some(m) => a.masters.insert(lb.clone(), m),
            None => a.masters.remove(lb),
        };
    }
    let now = jiff::Timestamp::now();
    let mut writes = Vec::new();
    for m in all.iter().filter(eligible) {
        let name = name_of(m);
        if a.sick.contains(&name) {
            continue;
        }
        let lb = m["spec"]["loadBalancerRef"]["name"].as_str().unwrap_or("");
        let master = a.masters.get(lb) == Some(&name);
        let current: Vec<Value> = m["status"]["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let find = |t: &str| current.iter().find(|c| c["type"] == t);
        let due = AGENT_CONDITIONS.iter().any(|t| {
            let want = if *t == conditions::KEEPALIVED_MASTER && !master {
                conditions::FALSE
            } else {
                conditions::TRUE
            };
            match find(t) {
                None => true,
                Some(c) => {
                    c["status"] != want
                        || c["lastHeartbeatTime"]
                            .as_str()
                            .and_then(|t| t.parse::<jiff::Timestamp>().ok())
                            .is_none_or(|t| {
                                now.duration_since(t).as_secs_f64() >= heartbeat.as_secs_f64()
                            })
                }
            }
        });
        if !due {
            continue;
        }
        let mut conds: Vec<Value> = current
            .iter()
            .filter(|c| !AGENT_CONDITIONS.contains(&c["type"].as_str().unwrap_or("")))
            .cloned()
            .collect();
        for t in AGENT_CONDITIONS {
            let want = if t == conditions::KEEPALIVED_MASTER && !master {
                conditions::FALSE
            } else {
                conditions::TRUE
            };
            let transition = match find(t) {
                Some(c) if c["status"] == want => c["lastTransitionTime"].clone(),
                _ => json!(now.to_string()),
            };
            conds.push(json!({"type": t, "status": want, "reason": "Itest", "message": "",
                              "lastHeartbeatTime": now.to_string(), "lastTransitionTime": transition}));
        }
        writes.push((name, conds));
    }
    writes
}
