//! Test harness of `cloud_controller.rs`: the cloud controller running against real API servers (kube-testenv) in
//! the target and control roles, plus helpers to create objects and wait for conditions.
//!
//! The controller watches Services and Nodes cluster-wide, so every test has a target cluster of its own (a private
//! kube-testenv cluster, ≈3 s): two controllers on one target would both handle every Service (they share the
//! Service finalizer: see the ignored `two_controllers_with_different_classes_share_a_target`). The control
//! cluster is the test binary's shared one with a LoadBalancer namespace per test, or the private one
//! ([`Clusters::Single`]), or a second private one ([`Clusters::SplitPrivate`], both API servers can be stopped).
//!
//! The controller's clients go through a counting TCP proxy (every request attempt during an outage is a new
//! connection); the test's own reads and writes use admin clients directly. Waiting polls the API (every 50 ms,
//! at most 60 s), so the tests do not depend on timing.
//!
//! The real-OpenStack tests' helpers (sessions, Nova's view, leak check and sweep, the whole OpenStack-side cascade
//! on a real API server with the agents played) are `lb_test_support::cascade`, shared with `bench openstack`.

#![allow(dead_code)]

pub mod kube;

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ::kube::api::{
    DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use ::kube::{Api, Client};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Event, Node, Service};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube_testenv::KubeEnv;
use lb_api::LoadBalancer;
use lb_api::{OpenstackFlavorRef, OpenstackImageRef};
use lb_controller::cloud::loadbalancer_spec::{ClassFilter, InfrastructureDefaults};
use lb_controller::cloud::run::{run_controllers, RunConfig};
use lb_controller::cloud::service;
use lb_controller::metrics::{Metrics, OperationLabels};
use lb_controller::process::http::Health;
use serde_json::{json, Value};
use tokio::sync::oneshot;

/// Default namespace of the LoadBalancers in the control cluster (`cloud_controller.rs` uses one per test).
pub const LB_NS: &str = "yawol";
/// The component the cloud controller under test publishes its events as.
pub const EVENT_COMPONENT: &str = "lb-cloud-controller";

pub fn defaults() -> InfrastructureDefaults {
    InfrastructureDefaults {
        namespace: LB_NS.into(),
        auth_secret_name: "cloudprovider".into(),
        floating_network_id: "floating-net".into(),
        network_id: "cluster-net".into(),
        subnet_id: None,
        subnet_id_v6: None,
        flavor: OpenstackFlavorRef::by_id("flavor-1"),
        image: OpenstackImageRef::by_id("image-1"),
        availability_zone: "az-1".into(),
        internal_lb: false,
    }
}

pub fn run_config(classes: ClassFilter) -> RunConfig {
    RunConfig {
        service: service::Config {
            defaults: defaults(),
            classes,
            resync: Duration::from_secs(600),
            deletion_poll: Duration::from_millis(50),
            // The tests cover the controller's IPv6 behaviour; the gate itself is a unit test of `ip_families`.
            serve_ipv6: true,
        },
        event_max_age: Duration::from_secs(300),
        event_component: EVENT_COMPONENT.into(),
        instance: "test".into(),
        concurrency: 8,
    }
}

/// Which clusters play the target and control roles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clusters {
    /// Target: a private cluster; control: the shared cluster (a LoadBalancer namespace of the test's own).
    Split,
    /// Target and control: two private clusters (both API servers can be stopped).
    SplitPrivate,
    /// One private cluster in both roles.
    Single,
}

enum Cluster {
    Shared(&'static KubeEnv),
    Private(Arc<KubeEnv>),
}

impl Cluster {
    fn env(&self) -> &KubeEnv {
        match self {
            Cluster::Shared(env) => env,
            Cluster::Private(env) => env,
        }
    }
}

/// A TCP proxy in front of an API server that records when a connection was refused while it was down (with the
/// server down, every request attempt of the controllers is one connection) and can cut them: a stopping API server
/// waits up to 10 s for the open watches, a crashed one just drops them.
struct Proxy {
    url: String,
    refused: Arc<Mutex<Vec<Instant>>>,
    down: Arc<AtomicBool>,
    cut: tokio::sync::watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream_url: &str) -> Proxy {
        let upstream: u16 = upstream_url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("an API server URL with a port");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let refused = Arc::new(Mutex::new(Vec::new()));
        let down = Arc::new(AtomicBool::new(false));
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let (record, is_down, cuts) = (refused.clone(), down.clone(), cut.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if is_down.load(Ordering::SeqCst) {
                    record.lock().unwrap().push(Instant::now());
                    continue;
                }
                let mut cut = cuts.subscribe();
                tokio::spawn(async move {
                    if let Ok(mut server) =
                        tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    {
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                            _ = cut.changed() => {}
                        }
                    }
                });
            }
        });
        Proxy {
            url: format!("https://127.0.0.1:{port}"),
            refused,
            down,
            cut,
            task,
        }
    }

    /// Down: open connections are cut, new ones closed at once (and recorded).
    fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
        if down {
            self.cut.send_modify(|n| *n += 1);
        }
    }

    /// An admin client through the proxy (the serving certificate is for 127.0.0.1, any port).
    async fn client(&self, env: &KubeEnv) -> Client {
        let kubeconfig = env.admin_kubeconfig().replace(&env.url(), &self.url);
        kube_testenv::client_from(&kubeconfig).await.unwrap()
    }
}

pub struct Harness {
    /// Admin client of the target cluster (Services, Nodes, Events).
    pub target: Client,
    /// Admin client of the control cluster (LoadBalancers).
    pub control: Client,
    /// The test's LoadBalancer namespace in the control cluster (`defaults.namespace`).
    pub lb_ns: String,
    pub metrics: Arc<Metrics>,
    pub health: Arc<Health>,
    classes: ClassFilter,
    target_cluster: Cluster,
    control_cluster: Option<Cluster>,
    target_proxy: Proxy,
    control_proxy: Proxy,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Harness {
    /// Split clusters, default class filter, controllers running.
    pub async fn start() -> Self {
        Self::start_with(Clusters::Split, ClassFilter::default()).await
    }

    pub async fn start_with(clusters: Clusters, classes: ClassFilter) -> Self {
        let mut harness = Self::new(clusters, classes).await;
        harness.run().await;
        harness
    }

    /// The clusters, CRDs and namespace, without the controllers: create what exists "before" the controller,
    /// then [`Harness::run`].
    pub async fn new(clusters: Clusters, classes: ClassFilter) -> Self {
        if std::env::var_os("TEST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter("debug,hyper=info,tower=info,rustls=info")
                .with_test_writer()
                .try_init();
        }
        let private = || async { Arc::new(KubeEnv::start().await.expect("a private cluster")) };
        let target_cluster = Cluster::Private(private().await);
        let control_cluster = match clusters {
            Clusters::Split => Some(Cluster::Shared(KubeEnv::shared())),
            Clusters::SplitPrivate => Some(Cluster::Private(private().await)),
            Clusters::Single => None,
        };
        let target_env = target_cluster.env();
        let control_env = control_cluster.as_ref().map_or(target_env, |c| c.env());
        let target = target_env.client().await.unwrap();
        let control = control_env.client().await.unwrap();
        control_env
            .apply_crds(&control, lb_api::crds().into_iter().map(|(_, c)| c))
            .await
            .unwrap();
        let lb_ns = control_env.namespace(&control, "lbs").await.unwrap();
        let target_proxy = Proxy::start(&target_env.url()).await;
        let control_proxy = Proxy::start(&control_env.url()).await;
        Self {
            target,
            control,
            lb_ns,
            metrics: Arc::new(Metrics::new()),
            health: Arc::new(Health::default()),
            classes,
            target_cluster,
            control_cluster,
            target_proxy,
            control_proxy,
            stop: None,
            task: None,
        }
    }

    fn target_env(&self) -> &KubeEnv {
        self.target_cluster.env()
    }

    fn control_env(&self) -> &KubeEnv {
        self.control_cluster
            .as_ref()
            .map_or(self.target_env(), |c| c.env())
    }

    /// The controllers' clients (target, control), through the counting proxies.
    pub async fn controller_clients(&self) -> (Client, Client) {
        (
            self.target_proxy.client(self.target_env()).await,
            self.control_proxy.client(self.control_env()).await,
        )
    }

    /// The run configuration of this test (its LoadBalancer namespace, its class filter).
    pub fn config(&self) -> RunConfig {
        let mut config = run_config(self.classes.clone());
        config.service.defaults.namespace = self.lb_ns.clone();
        config
    }

    /// A new namespace in the control cluster.
    pub async fn control_namespace(&self, prefix: &str) -> String {
        self.control_env()
            .namespace(&self.control, prefix)
            .await
            .unwrap()
    }

    /// Starts the controllers and waits until they are ready and have looked at every existing Service once.
    pub async fn run(&mut self) {
        let (target, control) = self.controller_clients().await;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(run_controllers(
            target,
            control,
            self.config(),
            self.metrics.clone(),
            self.health.clone(),
            async move {
                let _ = stopped.await;
            },
        ));
        self.stop = Some(stop);
        self.task = Some(task);
        let health = self.health.clone();
        eventually("controllers ready", || {
            let ready = health.ready.load(Ordering::SeqCst);
            async move { ready }
        })
        .await;
        // E.g. the `kubernetes` Service: its reconcile must not count for a test's "n more reconciles".
        let services = self.service_count().await;
        eventually("initial reconciles", || async {
            self.metrics.reconcile_count("service") >= services
        })
        .await;
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(30), task)
                .await
                .expect("controllers stop")
                .unwrap();
        }
        // The private clusters stop with `self` (blocking: SIGTERM and wait).
        tokio::task::block_in_place(move || drop(self));
    }

    /// Number of Services in the target cluster.
    pub async fn service_count(&self) -> u64 {
        Api::<Service>::all(self.target.clone())
            .list_metadata(&ListParams::default())
            .await
            .unwrap()
            .items
            .len() as u64
    }

    /// When the controllers tried to connect while the API servers were down (both clusters), in order.
    pub fn refused_connections(&self) -> Vec<Instant> {
        let mut all = self.target_proxy.refused.lock().unwrap().clone();
        all.extend(self.control_proxy.refused.lock().unwrap().iter());
        all.sort();
        all
    }

    /// Stops the API servers of both clusters (private ones only: [`Clusters::SplitPrivate`] or
    /// [`Clusters::Single`]), after cutting the controllers' connections (see [`Proxy`]); both at once.
    pub fn stop_apiservers(&self) {
        assert!(
            !matches!(self.control_cluster, Some(Cluster::Shared(_))),
            "the shared cluster's API server is never stopped"
        );
        self.target_proxy.set_down(true);
        self.control_proxy.set_down(true);
        tokio::task::block_in_place(|| {
            std::thread::scope(|scope| {
                scope.spawn(|| self.target_env().stop_apiserver());
                if self.control_cluster.is_some() {
                    scope.spawn(|| self.control_env().stop_apiserver());
                }
            })
        });
    }

    /// Restarts the API servers stopped by [`Harness::stop_apiservers`] and renews the admin clients.
    pub async fn restart_apiservers(&mut self) {
        if self.control_cluster.is_some() {
            let (target, control) = tokio::join!(
                self.target_env().restart_apiserver(),
                self.control_env().restart_apiserver()
            );
            target.unwrap();
            control.unwrap();
        } else {
            self.target_env().restart_apiserver().await.unwrap();
        }
        self.target_proxy.set_down(false);
        self.control_proxy.set_down(false);
        self.target = self.target_env().client().await.unwrap();
        self.control = self.control_env().client().await.unwrap();
    }

    pub fn service_api(&self, namespace: &str) -> Api<Service> {
        Api::namespaced(self.target.clone(), namespace)
    }

    pub fn lb_api(&self) -> Api<LoadBalancer> {
        Api::namespaced(self.control.clone(), &self.lb_ns)
    }

    pub fn node_api(&self) -> Api<Node> {
        Api::all(self.target.clone())
    }

    /// Creates a Service of type LoadBalancer through the API (like a user would: the server allocates the
    /// nodePort and the clusterIP and defaults the rest). `extra_spec` is merged into the spec (RFC 7386: a
    /// `ports` list replaces the default one).
    pub async fn create_service(
        &self,
        namespace: &str,
        name: &str,
        annotations: Value,
        extra_spec: Value,
    ) -> Service {
        let mut service = json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
            "spec": {
                "type": "LoadBalancer",
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
            }
        });
        kube_testenv::json_merge(&mut service["spec"], &extra_spec);
        let service: Service = serde_json::from_value(service).unwrap();
        self.service_api(namespace)
            .create(&PostParams::default(), &service)
            .await
            .unwrap_or_else(|e| panic!("creating service {namespace}/{name}: {e}"))
    }

    /// JSON merge patch (RFC 7386, not the strategic one: a `ports` list replaces the Service's).
    pub async fn patch_service(&self, namespace: &str, name: &str, patch: Value) {
        self.service_api(namespace)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap_or_else(|e| panic!("patching service {namespace}/{name}: {e}"));
    }

    /// Creates or updates a node: Ready condition and InternalIP addresses (status), no taints.
    pub async fn put_node(&self, name: &str, ready: &str, addresses: &[&str]) {
        self.put_node_with(name, ready, addresses, json!({}), vec![])
            .await;
    }

    /// Creates or updates a node as a whole: `spec` (taints not in it are removed), the conditions (Ready and
    /// `extra_conditions`, nothing else) and the InternalIP addresses.
    pub async fn put_node_with(
        &self,
        name: &str,
        ready: &str,
        addresses: &[&str],
        spec: Value,
        extra_conditions: Vec<Value>,
    ) {
        let mut conditions = vec![json!({"type": "Ready", "status": ready})];
        conditions.extend(extra_conditions);
        let addresses: Vec<Value> = addresses
            .iter()
            .map(|a| json!({"type": "InternalIP", "address": a}))
            .collect();
        let status = json!({"conditions": conditions, "addresses": addresses});
        let nodes = self.node_api();
        if nodes.get_opt(name).await.unwrap().is_none() {
            let node: Node = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": spec,
                "status": status,
            }))
            .unwrap();
            let created = nodes.create(&PostParams::default(), &node).await.unwrap();
            // A Node is created with its status (as a kubelet registers it), unless the server drops it.
            if created
                .status
                .and_then(|s| s.conditions)
                .is_some_and(|c| !c.is_empty())
            {
                return;
            }
        } else {
            let mut spec = spec;
            if spec.get("taints").is_none() {
                spec["taints"] = Value::Null;
            }
            nodes
                .patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({ "spec": spec })),
                )
                .await
                .unwrap();
        }
        nodes
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(&json!({ "status": status })),
            )
            .await
            .unwrap();
    }

    pub async fn delete_node(&self, name: &str) {
        self.node_api()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }

    pub async fn lb(&self, lb_name: &str) -> Option<LoadBalancer> {
        self.lb_api().get_opt(lb_name).await.unwrap()
    }

    pub async fn service(&self, namespace: &str, name: &str) -> Option<Service> {
        self.service_api(namespace).get_opt(name).await.unwrap()
    }

    /// Waits until the LoadBalancer exists and satisfies `check`; returns the version that did.
    pub async fn wait_lb(
        &self,
        lb_name: &str,
        what: &str,
        check: impl Fn(&LoadBalancer) -> bool,
    ) -> LoadBalancer {
        poll(what, || async {
            self.lb(lb_name).await.filter(|lb| check(lb))
        })
        .await
    }

    /// Events (core/v1) the cloud controller published about an object in the target cluster: (type, reason,
    /// message, count). The apiserver's own controllers write events about Services too (its cluster-IP repair
    /// loop warns "ClusterIPNotAllocated" when it runs between an allocation and the Service's creation); they
    /// are not ours to assert on.
    pub async fn events_for(
        &self,
        namespace: &str,
        name: &str,
    ) -> Vec<(String, String, String, i32)> {
        Api::<Event>::namespaced(self.target.clone(), namespace)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(name))
            .filter(|e| e.reporting_component.as_deref() == Some(EVENT_COMPONENT))
            .map(|e| {
                (
                    e.type_.unwrap_or_default(),
                    e.reason.unwrap_or_default(),
                    e.message.unwrap_or_default(),
                    e.count.unwrap_or_default(),
                )
            })
            .collect()
    }

    pub async fn wait_event(&self, namespace: &str, name: &str, type_: &str, contains: &str) {
        eventually(
            &format!("{type_} event containing {contains:?}"),
            || async {
                self.events_for(namespace, name)
                    .await
                    .iter()
                    .any(|(t, _, m, _)| t == type_ && m.contains(contains))
            },
        )
        .await;
    }

    /// Sets the LoadBalancer status as the OpenStack controllers would.
    pub async fn set_lb_status(&self, lb_name: &str, status: Value) {
        self.lb_api()
            .patch_status(
                lb_name,
                &PatchParams::default(),
                &Patch::Merge(&json!({ "status": status })),
            )
            .await
            .unwrap();
    }

    /// Waits until the service controller processed at least `n` more reconciliations than
    /// `before` — to assert that something did *not* happen after the controller looked.
    pub async fn wait_reconciles(&self, before: u64, n: u64) {
        eventually("reconciliations", || async {
            self.metrics.reconcile_count("service") >= before + n
        })
        .await;
    }

    /// Installs `crd` in the control cluster in place of ours (another version of a CRD).
    pub async fn apply_control_crd(&self, crd: CustomResourceDefinition) {
        let env = self
            .control_cluster
            .as_ref()
            .map_or(self.target_cluster.env(), |c| c.env());
        env.apply_crds(&self.control, [crd]).await.unwrap();
    }

    /// The controller's count of its LoadBalancer writes ([`controller_lb_writes`]) once it has counted the
    /// writes the test already saw: the count goes up after the server answered, a GET may see the object first.
    pub async fn controller_lb_writes_settled(&self) -> u64 {
        let seen = self
            .lb_api()
            .list_metadata(&ListParams::default())
            .await
            .unwrap()
            .items
            .len() as u64;
        self.controller_lb_writes_reaching(seen).await
    }

    /// The controller's count of its LoadBalancer writes once it has reached `at_least` (see above).
    pub async fn controller_lb_writes_reaching(&self, at_least: u64) -> u64 {
        eventually("the controller counted its writes", || async {
            controller_lb_writes(&self.metrics) >= at_least
        })
        .await;
        controller_lb_writes(&self.metrics)
    }

    /// Records every write to the test's LoadBalancers from now on: a watch from the current resourceVersion
    /// delivers one event per effective write (a no-op write changes nothing and is not seen).
    pub async fn record_lb_writes(&self) -> LbWrites {
        let api = self.lb_api();
        let version = api
            .list_metadata(&ListParams::default())
            .await
            .unwrap()
            .metadata
            .resource_version
            .expect("a list resourceVersion");
        let stream = api
            .watch(&WatchParams::default().timeout(290), &version)
            .await
            .unwrap();
        let seen: Arc<Mutex<Vec<LoadBalancer>>> = Arc::default();
        let record = seen.clone();
        let task = tokio::spawn(async move {
            let mut stream = stream.boxed();
            while let Ok(Some(event)) = stream.try_next().await {
                match event {
                    WatchEvent::Added(lb) | WatchEvent::Modified(lb) | WatchEvent::Deleted(lb) => {
                        record.lock().unwrap().push(lb)
                    }
                    WatchEvent::Bookmark(_) => {}
                    WatchEvent::Error(e) => panic!("LoadBalancer watch: {e}"),
                }
            }
        });
        LbWrites { seen, task }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.target_proxy.task.abort();
        self.control_proxy.task.abort();
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// The writes to a namespace's LoadBalancers since [`Harness::record_lb_writes`], as the objects they produced.
pub struct LbWrites {
    seen: Arc<Mutex<Vec<LoadBalancer>>>,
    task: tokio::task::JoinHandle<()>,
}

impl LbWrites {
    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    pub fn objects(&self) -> Vec<LoadBalancer> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for LbWrites {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// LoadBalancer writes the controller counted (its `loadbalancer_writes` metric, all operations).
pub fn controller_lb_writes(metrics: &Metrics) -> u64 {
    ["create", "patch", "delete"]
        .iter()
        .map(|operation| {
            metrics
                .loadbalancer_writes
                .get_or_create(&OperationLabels {
                    operation: operation.to_string(),
                })
                .get()
        })
        .sum()
}

/// Polls `check` (every 50 ms) until it returns something; panics with `what` after 60 s.
pub async fn poll<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(value) = check().await {
            return value;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls an async condition (every 50 ms); panics with `what` after 60 s.
pub async fn eventually<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    poll(what, || {
        let holds = condition();
        async move { holds.await.then_some(()) }
    })
    .await
}

/// Polls `condition` until it holds (panics after `timeout` with `what`).
pub async fn wait_within(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !condition() {
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The endpoints' names, a draining one as `name (draining)`.
pub fn endpoint_names(lb: &LoadBalancer) -> Vec<String> {
    lb.spec
        .endpoints()
        .iter()
        .map(|e| match e.is_draining() {
            true => format!("{} (draining)", e.name),
            false => e.name.clone(),
        })
        .collect()
}
