//! Shared by lb-controller's real-OpenStack tests (`openstack_lb`, `machines_openstack`, `openstack_cascade`,
//! `openstack_cascade_api_outage`) and `bench openstack`: sessions on the environment of `cargo xtask openstack
//! up`, Nova's view of a server, the leak check plus sweep that ends every test, the
//! controllers' token under `deploy/openstack-controller.yaml`'s RBAC, and [`Cascade`]: the OpenStack-side
//! controllers started through `cli::run_openstack_controllers` on a real API server (kube-testenv) under that
//! RBAC, with the machines' agents played by a background task using the kubeconfig from their VMs' user data.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use futures::StreamExt;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::Api;
use kube_testenv::{KubeEnv, Refusals};
use lb_api::constants::{conditions, lb_annotations};
use lb_api::{LoadBalancer, LoadBalancerMachine};
use lb_controller::cli::run_openstack_controllers;
use lb_controller::metrics::Metrics;
use lb_controller::openstack::clouds::CloudFactory;
use lb_controller::openstack::loadbalancer::{self, RolloutGate};
use lb_controller::openstack::machine::cloudinit::{AGENT_ENV_PATH, KUBECONFIG_PATH};
use lb_controller::openstack::run::{
    run_openstack_controllers_with, OpenStackRunConfig, OpenStackTuning,
};
use lb_controller::openstack::sdk::SdkCloud;
use lb_controller::openstack::{Cloud, CloudProviderConf, OpenStackCalls};
use lb_controller::process::http::Health;
use openstack_sdk::api::QueryAsync;
use openstack_sdk::AsyncOpenStack;
use openstack_testenv::{FaultProxy, LeakCheck, TestEnv};
use serde_json::{json, Value};

/// Per OpenStack call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// Bound of every wait: a step normally takes seconds (Nova's fake driver boots in about 2 s), but the shared
/// 2-core machine can be slow.
pub const STEP: Duration = Duration::from_secs(120);

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
        http::HeaderName::from_static("openstack-api-version"),
        http::HeaderValue::from_static("compute 2.79"),
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
    for r in found.iter().filter(|r| r.kind == "router route") {
        let route = lb_controller::openstack::Route {
            destination: r.name.clone(),
            nexthop: r.detail.trim_start_matches("via ").to_string(),
        };
        cloud.remove_router_routes(&r.id, &[route]).await?;
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
// The cascade on the real API server.

/// A LoadBalancer of the test project in namespace `ns` (network, floating network, flavor and image of the
/// environment), credentials from the Secret `cloud` that [`Cascade::start`] creates.
pub fn lb_json(env: &TestEnv, ns: &str, name: &str, replicas: i32, options: Value) -> Value {
    let info = &env.info;
    json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": name}},
            "replicas": replicas,
            "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
            "endpoints": [{"name": "node-1", "addresses": ["198.51.100.200"]}],
            "infrastructure": {
                "defaultNetwork": {"networkID": info.network_id, "floatingNetID": info.external_network_id},
                "flavor": {"flavorID": info.flavor_id}, "image": {"imageID": info.image_id},
                "authSecretRef": {"name": "cloud", "namespace": ns}
            },
            "options": options
        }
    })
}

/// The deployment manifest whose ServiceAccount and Role the controllers run under.
pub const CONTROLLER_MANIFEST: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../deploy/openstack-controller.yaml"
);
/// Its ServiceAccount.
pub const CONTROLLER_SERVICE_ACCOUNT: &str = "lb-openstack-controller";

/// A token of the OpenStack-side controllers as [`CONTROLLER_MANIFEST`] deploys them, moved into `ns` (its
/// ServiceAccount, Role and RoleBinding there, the rules exactly as written), with the CRDs applied.
pub async fn controller_token(kube: &KubeEnv, admin: &kube::Client, ns: &str) -> Result<String> {
    kube.apply_crds(admin, lb_api::crds().into_iter().map(|(_, c)| c))
        .await?;
    let manifest = std::fs::read_to_string(CONTROLLER_MANIFEST)?;
    kube_testenv::apply_rbac(admin, &manifest, Some(ns)).await?;
    kube.token(admin, ns, CONTROLLER_SERVICE_ACCOUNT).await
}

/// The kubeconfig a machine's VM gets: the file of that name in the user data Nova stores for `server` (as admin).
pub async fn vm_kubeconfig(nova: &AsyncOpenStack, server: &str) -> Result<String> {
    let files = user_data_files(&nova_server(nova, server).await?)?;
    file_of(&files, KUBECONFIG_PATH)
        .with_context(|| format!("no kubeconfig in the user data of server {server}"))
}

/// The content of the file at `path` among [`user_data_files`].
fn file_of(files: &[(String, String)], path: &str) -> Option<String> {
    files
        .iter()
        .find(|(p, _)| p == path)
        .map(|(_, content)| content.clone())
}

/// How the cascade runs.
#[derive(Clone, Debug)]
pub struct CascadeConfig {
    /// LoadBalancer controller: the rollout gate is 1 s of VRRP mastership instead of 2 min, so a rolling update
    /// finishes within a test; everything else as in production.
    pub loadbalancer: loadbalancer::Config,
    /// `None`: `run_openstack_controllers` (the binary's path, with its settings from the environment);
    /// `Some`: `run_openstack_controllers_with` these (the benchmark shortens the resync periods). Either way the
    /// machines' API endpoint is the test API server's URL, so the kubeconfig in their user data works.
    pub tuning: Option<OpenStackTuning>,
    /// How often the played agents rewrite their conditions (the agent's `--requeue-period`, 30 s).
    pub heartbeat: Duration,
}

impl Default for CascadeConfig {
    fn default() -> Self {
        CascadeConfig {
            loadbalancer: loadbalancer::Config {
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

/// What the played agents do.
#[derive(Default)]
struct Agents {
    /// Machines whose agent the test plays itself (e.g. reporting them unhealthy).
    sick: HashSet<String>,
    /// The VRRP master per LoadBalancer.
    masters: HashMap<String, String>,
    /// Machines booted active-active (`--active-active` in their user data): they report `VIPEligible` instead
    /// of `KeepalivedMaster`.
    active_active: HashSet<String>,
    /// Each running agent's client: the kubeconfig from its VM's user data (its own ServiceAccount's token).
    clients: HashMap<String, kube::Client>,
    /// When each agent last tried to write: at most once a second, since the view it decides from can lag (e.g.
    /// right after an outage) and a real agent writes on its requeue period, not in a loop.
    tried: HashMap<String, Instant>,
}

/// The kinds the tests look at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    LoadBalancers,
    Sets,
    Machines,
    Events,
    Secrets,
}

impl Kind {
    const ALL: [Kind; 5] = [
        Kind::LoadBalancers,
        Kind::Sets,
        Kind::Machines,
        Kind::Events,
        Kind::Secrets,
    ];

    fn resource(self) -> ApiResource {
        let (group, kind, plural) = match self {
            Kind::LoadBalancers => ("yawol.stackit.cloud", "LoadBalancer", "loadbalancers"),
            Kind::Sets => ("yawol.stackit.cloud", "LoadBalancerSet", "loadbalancersets"),
            Kind::Machines => (
                "yawol.stackit.cloud",
                "LoadBalancerMachine",
                "loadbalancermachines",
            ),
            Kind::Events => ("", "Event", "events"),
            Kind::Secrets => ("", "Secret", "secrets"),
        };
        let version = if group.is_empty() { "v1" } else { "v1beta1" };
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
    }
}

/// The test's view of the namespace: a reflector per [`Kind`] through the admin client, so the tests' synchronous
/// checks can poll it every 50 ms without loading the API server. An instrument, not a client under test: while the
/// API server is away it retries every second ([`EverySecond`]), so what a test measures after an outage is the
/// controllers' and agents' recovery, not its own watch's backoff (kube-runtime's default one grows to 30 s: the
/// view lagged ~18 s behind a restarted server).
#[derive(Clone)]
struct View(Vec<(Kind, Store<DynamicObject>)>);

/// A watch retry every second, never growing (for [`View`]).
struct EverySecond;

impl Iterator for EverySecond {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(Duration::from_secs(1))
    }
}

impl kube::runtime::utils::Backoff for EverySecond {
    fn reset(&mut self) {}
}

impl View {
    /// Starts the reflectors and waits until each has listed once.
    async fn start(
        admin: &kube::Client,
        ns: &str,
    ) -> Result<(View, Vec<tokio::task::JoinHandle<()>>)> {
        let mut stores = Vec::new();
        let mut tasks = Vec::new();
        for kind in Kind::ALL {
            let resource = kind.resource();
            let api: Api<DynamicObject> = Api::namespaced_with(admin.clone(), ns, &resource);
            let writer = reflector::store::Writer::new(resource);
            let store = writer.as_reader();
            let stream = lb_api::watch::relist_at_once(watcher(api, watcher::Config::default()))
                .backoff(EverySecond)
                .reflect(writer)
                .for_each(|_| std::future::ready(()));
            tasks.push(tokio::spawn(stream));
            stores.push((kind, store));
        }
        for (kind, store) in &stores {
            tokio::time::timeout(Duration::from_secs(60), store.wait_until_ready())
                .await
                .with_context(|| {
                    format!("the test's watch of {kind:?} did not list within 60 s")
                })??;
        }
        Ok((View(stores), tasks))
    }

    fn list(&self, kind: Kind) -> Vec<Value> {
        let (_, store) = self.0.iter().find(|(k, _)| *k == kind).expect("every kind");
        store
            .state()
            .iter()
            .map(|o| serde_json::to_value(&**o).expect("an object serialises"))
            .collect()
    }
}

/// The OpenStack-side controllers against the real cloud and the real API server, plus the agents, which the tests
/// play (Nova's fake driver boots no VM).
///
/// The controllers run as the binary does (`cli::run_openstack_controllers`, or `run_openstack_controllers_with`
/// for [`CascadeConfig::tuning`]) in a namespace of their own on `kube` under exactly the ServiceAccount and Role of
/// [`CONTROLLER_MANIFEST`], with a real token; Kubernetes' token controller (the kube-controller-manager) fills each
/// machine's token Secret. An agent starts once its machine's server is ACTIVE (`status.lastOpenstackReconcile`)
/// with the kubeconfig Nova holds in that server's user data — its own ServiceAccount's token, scoped by the Role the
/// machine controller wrote — and reports `ConfigReady`, `DataplaneReady`, `DataplaneUpToDate` True with a heartbeat
/// every [`CascadeConfig::heartbeat`], and `KeepalivedMaster` True on one machine per LoadBalancer — like keepalived
/// with the agents' revision bonus, the newest revision's oldest machine, kept while it stays eligible and is of the
/// newest revision; a machine booted active-active (`--active-active` in its user data) reports `VIPEligible` True
/// instead of `KeepalivedMaster`. Every request of the controllers and agents goes through [`Cascade::refusals`]; a 401 or 403
/// fails [`Cascade::stop`].
pub struct Cascade {
    /// The namespace of the LoadBalancers, sets and machines (also the first part of the OpenStack names).
    pub ns: String,
    /// The API server's admin, for the test's own reads and writes.
    pub admin: kube::Client,
    /// The API server URL written into the machines' kubeconfig (`API_ENDPOINT`).
    pub api_endpoint: String,
    pub metrics: Arc<Metrics>,
    pub health: Arc<Health>,
    /// What the API server refused the controllers and the agents.
    pub refusals: Refusals,
    view: View,
    agents: Arc<Mutex<Agents>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    controllers: Option<tokio::task::JoinHandle<()>>,
    background: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Cascade {
    fn drop(&mut self) {
        for task in &self.background {
            task.abort();
        }
        if let Some(c) = &self.controllers {
            c.abort();
        }
    }
}

impl Cascade {
    /// Starts everything in a new namespace of `kube`. `clouds` gets the controllers' client (for `SecretClouds`)
    /// and should count its calls in `metrics.openstack_calls` (the `yawol_openstack` family), as the binary's do.
    pub async fn start<F: CloudFactory>(
        kube: &KubeEnv,
        env: &TestEnv,
        metrics: Arc<Metrics>,
        config: CascadeConfig,
        clouds: impl FnOnce(kube::Client) -> F,
    ) -> Result<Cascade> {
        if std::env::var_os("TEST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter("info,lb_controller=debug,kube_runtime=debug")
                .with_test_writer()
                .try_init();
        }
        let admin = kube.client().await?;
        let ns = kube.namespace(&admin, "itest").await?;
        let token = controller_token(kube, &admin, &ns).await?;
        let refusals = Refusals::default();
        let client = refusals
            .client(&kube.token_kubeconfig(&token), "controllers")
            .await?;
        // The LoadBalancers' authSecretRef, for `SecretClouds`.
        let conf = std::fs::read_to_string(env.cloudprovider_conf())?;
        let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
            "metadata": {"name": "cloud", "namespace": ns},
            "data": {"cloudprovider.conf": b64(&conf)}
        }))?;
        Api::namespaced(admin.clone(), &ns)
            .create(&PostParams::default(), &secret)
            .await?;
        let (view, mut background) = View::start(&admin, &ns).await?;

        let clouds = clouds(client.clone());
        let api_endpoint = kube.url();
        let run_config = OpenStackRunConfig {
            namespace: ns.clone(),
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
                std::env::set_var("API_ENDPOINT", &api_endpoint);
                tokio::spawn(run_openstack_controllers(
                    client,
                    clouds,
                    run_config,
                    metrics.clone(),
                    health.clone(),
                    shutdown,
                ))
            }
            Some(mut tuning) => {
                tuning.machines.api_endpoint = Some(api_endpoint.clone());
                tokio::spawn(run_openstack_controllers_with(
                    client,
                    clouds,
                    run_config,
                    tuning,
                    metrics.clone(),
                    health.clone(),
                    shutdown,
                ))
            }
        };
        let agents = Arc::new(Mutex::new(Agents::default()));
        background.push(tokio::spawn(play_agents(
            view.clone(),
            agents.clone(),
            env.connect_admin().await?,
            refusals.clone(),
            ns.clone(),
            config.heartbeat,
        )));
        Ok(Cascade {
            ns,
            admin,
            api_endpoint,
            metrics,
            health,
            refusals,
            view,
            agents,
            stop: Some(stop_tx),
            controllers: Some(controllers),
            background,
        })
    }

    /// Whether the controllers still run (their task has not ended).
    pub fn controllers_running(&self) -> bool {
        self.controllers.as_ref().is_some_and(|c| !c.is_finished())
    }

    /// Stops the controllers (in-flight reconciles finish) and the played agents; fails when the API server refused
    /// the controllers or an agent anything.
    pub async fn stop(mut self) -> Result<()> {
        for task in &self.background {
            task.abort();
        }
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.controllers.take() {
            tokio::time::timeout(Duration::from_secs(60), task)
                .await
                .context("the controllers did not stop within 60 s")??;
        }
        self.refusals.assert_none()
    }

    /// The objects of `kind` in the namespace, as the test's watch has them.
    pub fn list(&self, kind: Kind) -> Vec<Value> {
        self.view.list(kind)
    }

    /// The object of `kind` named `name` as the test's watch has it, `Value::Null` when there is none.
    pub fn get(&self, kind: Kind, name: &str) -> Value {
        self.list(kind)
            .into_iter()
            .find(|o| o["metadata"]["name"] == name)
            .unwrap_or(Value::Null)
    }

    /// The objects of `kind` as the API server has them now (for checks that must not race the watch).
    pub async fn list_now(&self, kind: Kind) -> Result<Vec<Value>> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.admin.clone(), &self.ns, &kind.resource());
        Ok(api
            .list(&Default::default())
            .await?
            .items
            .iter()
            .map(serde_json::to_value)
            .collect::<Result<_, _>>()?)
    }

    pub fn lb(&self, name: &str) -> Value {
        self.get(Kind::LoadBalancers, name)
    }

    pub fn status(&self, lb: &str) -> Value {
        self.lb(lb)["status"].clone()
    }

    pub fn set(&self, name: &str) -> Value {
        self.get(Kind::Sets, name)
    }

    /// The sets of `lb`, by revision.
    pub fn sets_of(&self, lb: &str) -> Vec<Value> {
        let mut v: Vec<Value> = self
            .list(Kind::Sets)
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
        self.get(Kind::Machines, name)
    }

    /// The machines of `lb` (any set, also those being deleted), by name.
    pub fn machines_of(&self, lb: &str) -> Vec<Value> {
        let mut v: Vec<Value> = self
            .list(Kind::Machines)
            .into_iter()
            .filter(|m| m["spec"]["loadBalancerRef"]["name"] == lb)
            .collect();
        v.sort_by_key(name_of);
        v
    }

    /// Machines of `set` that are not being deleted.
    pub fn live_machines_of_set(&self, set: &str) -> Vec<Value> {
        self.list(Kind::Machines)
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
        self.list(Kind::Events)
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
        self.list(Kind::Events)
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

    /// The decoded entry `key` of the Secret `name`, if both exist.
    pub fn secret_data(&self, name: &str, key: &str) -> Option<String> {
        let value = self.get(Kind::Secrets, name)["data"][key]
            .as_str()?
            .to_string();
        let raw = base64::engine::general_purpose::STANDARD
            .decode(value)
            .ok()?;
        String::from_utf8(raw).ok()
    }

    pub fn lb_api(&self) -> Api<LoadBalancer> {
        Api::namespaced(self.admin.clone(), &self.ns)
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

    /// The played VRRP master of `lb`.
    pub fn master(&self, lb: &str) -> Option<String> {
        self.agents.lock().unwrap().masters.get(lb).cloned()
    }

    /// Writes `conditions` as the whole condition list of `machine`, through its agent's client (the test playing
    /// its agent).
    pub async fn report(&self, machine: &str, conditions: Vec<Value>) -> Result<()> {
        let client = self
            .agents
            .lock()
            .unwrap()
            .clients
            .get(machine)
            .cloned()
            .with_context(|| format!("no agent runs for {machine}"))?;
        write_conditions(&client, &self.ns, machine, conditions).await
    }
}

/// A merge patch of the machine's `status.conditions`, as the agent writes them.
async fn write_conditions(
    client: &kube::Client,
    ns: &str,
    machine: &str,
    conditions: Vec<Value>,
) -> Result<()> {
    Api::<LoadBalancerMachine>::namespaced(client.clone(), ns)
        .patch_status(
            machine,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"conditions": conditions}})),
        )
        .await?;
    Ok(())
}

/// Waits until `lb` has `n` ready replicas, all in its set of revision `rev` with ACTIVE servers; returns the
/// set's name and its `(machine, server)` pairs.
pub async fn ready(
    c: &Cascade,
    lb: &str,
    rev: u64,
    n: usize,
) -> Result<(String, Vec<(String, String)>)> {
    c.wait(
        &format!("{lb}: {n} ready machines of revision {rev}"),
        STEP,
        |c| {
            let st = c.status(lb);
            c.set_of_revision(lb, rev).is_some_and(|s| {
                c.active_in_set(&s).len() == n && c.live_machines_of_set(&s).len() == n
            }) && st["readyReplicas"] == n
                && st["replicas"] == n
        },
    )
    .await?;
    let set = c.set_of_revision(lb, rev).context("set")?;
    let active = c.active_in_set(&set);
    Ok((set, active))
}

/// Waits until Nova lists exactly `ids` (in any order) among the servers named `<prefix>…`.
pub async fn nova_servers_are(
    env: &TestEnv,
    direct: &AsyncOpenStack,
    prefix: &str,
    ids: &[String],
) -> Result<()> {
    let mut want: Vec<String> = ids.to_vec();
    want.sort();
    wait_for(
        &format!("Nova's servers {prefix}* = {want:?}"),
        STEP,
        || {
            let want = want.clone();
            async move {
                let mut have: Vec<String> = servers_named(env, direct, prefix)
                    .await?
                    .into_iter()
                    .map(|(id, _, _)| id)
                    .collect();
                have.sort();
                Ok(have == want)
            }
        },
    )
    .await
    .map(|_| ())
}

pub fn server_ids(active: &[(String, String)]) -> Vec<String> {
    active.iter().map(|(_, s)| s.clone()).collect()
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

/// What an active-active agent reports: `VIPEligible` in place of `KeepalivedMaster`.
const ACTIVE_ACTIVE_CONDITIONS: [&str; 4] = [
    conditions::CONFIG_READY,
    conditions::DATAPLANE_READY,
    conditions::DATAPLANE_UP_TO_DATE,
    conditions::VIP_ELIGIBLE,
];

/// The agents (see [`Cascade`]), every 100 ms: an agent starts with its VM's kubeconfig once its machine's server is
/// ACTIVE and ends with the machine. Failed writes (e.g. the API server is away) are retried at the next round, as
/// the agent's requeue would.
async fn play_agents(
    view: View,
    agents: Arc<Mutex<Agents>>,
    nova: AsyncOpenStack,
    refusals: Refusals,
    ns: String,
    heartbeat: Duration,
) {
    loop {
        let all = view.list(Kind::Machines);
        for m in all.iter().filter(|m| agent_may_run(m)) {
            let name = name_of(m);
            let Some(server) = m["status"]["serverID"].as_str() else {
                continue;
            };
            if agents.lock().unwrap().clients.contains_key(&name) {
                continue;
            }
            // One read of the server for both files the played agent needs.
            let files = match nova_server(&nova, server)
                .await
                .and_then(|v| user_data_files(&v))
            {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("agent of {name}: no user data yet: {e:#}");
                    continue;
                }
            };
            let Some(kubeconfig) = file_of(&files, KUBECONFIG_PATH) else {
                eprintln!("agent of {name}: no kubeconfig in its server's user data");
                continue;
            };
            let active_active =
                file_of(&files, AGENT_ENV_PATH).is_some_and(|env| env.contains("--active-active"));
            match refusals
                .client(&kubeconfig, &format!("agent of {name}"))
                .await
            {
                Ok(client) => {
                    let mut a = agents.lock().unwrap();
                    if active_active {
                        a.active_active.insert(name.clone());
                    }
                    a.clients.insert(name, client);
                }
                Err(e) => eprintln!("agent of {name}: its kubeconfig does not load: {e:#}"),
            }
        }
        {
            let mut a = agents.lock().unwrap();
            let live = |name: &String| {
                all.iter()
                    .any(|m| name_of(m) == *name && m["metadata"]["deletionTimestamp"].is_null())
            };
            a.clients.retain(|name, _| live(name));
            a.tried.retain(|name, _| live(name));
            let running: HashSet<String> = a.clients.keys().cloned().collect();
            a.active_active.retain(|name| running.contains(name));
        }
        let writes = agent_writes(&all, &agents, heartbeat);
        for (machine, conds) in writes {
            let client = {
                let mut a = agents.lock().unwrap();
                if a.tried
                    .get(&machine)
                    .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
                {
                    continue;
                }
                a.tried.insert(machine.clone(), Instant::now());
                a.clients.get(&machine).cloned()
            };
            if let Some(client) = client {
                let _ = write_conditions(&client, &ns, &machine, conds).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A machine whose server is ACTIVE and which is not being deleted: its agent runs.
fn agent_may_run(m: &Value) -> bool {
    m["metadata"]["deletionTimestamp"].is_null()
        && m["status"]["lastOpenstackReconcile"].is_string()
}

/// Elects the masters and returns the condition lists to write.
fn agent_writes(
    all: &[Value],
    agents: &Mutex<Agents>,
    heartbeat: Duration,
) -> Vec<(String, Vec<Value>)> {
    let mut a = agents.lock().unwrap();
    let running: HashSet<String> = a.clients.keys().cloned().collect();
    let eligible = |m: &&Value| agent_may_run(m) && running.contains(&name_of(m));
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
        let types = if a.active_active.contains(&name) {
            ACTIVE_ACTIVE_CONDITIONS
        } else {
            AGENT_CONDITIONS
        };
        let current: Vec<Value> = m["status"]["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let find = |t: &str| current.iter().find(|c| c["type"] == t);
        let due = types.iter().any(|t| {
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
            .filter(|c| {
                let t = c["type"].as_str().unwrap_or("");
                !AGENT_CONDITIONS.contains(&t) && !ACTIVE_ACTIVE_CONDITIONS.contains(&t)
            })
            .cloned()
            .collect();
        for t in types {
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
