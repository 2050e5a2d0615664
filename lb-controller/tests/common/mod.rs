//! Test harness: the cloud controller running against two in-memory API servers (target and
//! control cluster), plus helpers to create objects and wait for conditions.
//!
//! Waiting is event-driven on the controller side; the tests only poll the fake store for the
//! expected state (every few milliseconds, bounded by a generous timeout), so they do not depend
//! on timing.
//!
//! [`openstack`]: the helpers of the real-OpenStack tests (sessions, Nova's view, leak check and sweep, the whole
//! OpenStack-side cascade on the in-memory API server with the agents played).

#![allow(dead_code)]

pub mod kube;
pub mod openstack;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ::kube::api::{Patch, PatchParams, PostParams};
use ::kube::Api;
use k8s_openapi::api::core::v1::Service;
use lb_api::fake_api::{FakeApiServer, ResourceKey};
use lb_api::LoadBalancer;
use lb_api::{OpenstackFlavorRef, OpenstackImageRef};
use lb_controller::desired::{ClassFilter, InfrastructureDefaults};
use lb_controller::metrics::Metrics;
use lb_controller::run::{run_controllers, Health, RunConfig};
use lb_controller::service_controller::ServiceControllerConfig;
use serde_json::{json, Value};
use tokio::sync::oneshot;

/// Namespace of the LoadBalancers in the control cluster.
pub const LB_NS: &str = "yawol";

pub fn services() -> ResourceKey {
    ResourceKey::new("", "services")
}
pub fn nodes() -> ResourceKey {
    ResourceKey::new("", "nodes")
}
pub fn events() -> ResourceKey {
    ResourceKey::new("", "events")
}
pub fn loadbalancers() -> ResourceKey {
    ResourceKey::new("yawol.stackit.cloud", "loadbalancers")
}

pub fn defaults() -> InfrastructureDefaults {
    InfrastructureDefaults {
        namespace: LB_NS.into(),
        auth_secret_name: "cloudprovider".into(),
        floating_network_id: "floating-net".into(),
        network_id: "cluster-net".into(),
        subnet_id: None,
        flavor: OpenstackFlavorRef::by_id("flavor-1"),
        image: OpenstackImageRef::by_id("image-1"),
        availability_zone: "az-1".into(),
        internal_lb: false,
    }
}

pub fn run_config(classes: ClassFilter) -> RunConfig {
    RunConfig {
        service: ServiceControllerConfig {
            defaults: defaults(),
            classes,
            resync: Duration::from_secs(600),
            deletion_poll: Duration::from_millis(50),
        },
        event_max_age: Duration::from_secs(300),
        event_component: "lb-cloud-controller".into(),
        instance: "test".into(),
        concurrency: 8,
    }
}

pub struct Harness {
    pub target: FakeApiServer,
    pub control: FakeApiServer,
    pub metrics: Arc<Metrics>,
    pub health: Arc<Health>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Harness {
    /// Split clusters (separate target and control API servers), default class filter.
    pub async fn start() -> Self {
        Self::start_with(true, ClassFilter::default(), |_| {}).await
    }

    /// `split = false` uses one API server for both roles. `seed` runs before the controllers
    /// start (objects that exist "before" the controller).
    pub async fn start_with(split: bool, classes: ClassFilter, seed: impl FnOnce(&Self)) -> Self {
        if std::env::var_os("TEST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter("debug,hyper=info,tower=info")
                .with_test_writer()
                .try_init();
        }
        let target = FakeApiServer::new();
        let control = if split {
            FakeApiServer::new()
        } else {
            target.clone()
        };
        for (_, crd) in lb_api::crds() {
            control.install_crd(&crd);
        }
        let mut harness = Self {
            target,
            control,
            metrics: Arc::new(Metrics::new()),
            health: Arc::new(Health::default()),
            stop: None,
            task: None,
        };
        seed(&harness);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(run_controllers(
            harness.target.client(),
            harness.control.client(),
            run_config(classes),
            harness.metrics.clone(),
            harness.health.clone(),
            async move {
                let _ = stopped.await;
            },
        ));
        harness.stop = Some(stop);
        harness.task = Some(task);
        let health = harness.health.clone();
        wait_until("controllers ready", || {
            health.ready.load(std::sync::atomic::Ordering::SeqCst)
        })
        .await;
        harness
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .expect("controllers stop")
                .unwrap();
        }
    }

    pub fn service_api(&self, namespace: &str) -> Api<Service> {
        Api::namespaced(self.target.client(), namespace)
    }

    pub fn lb_api(&self) -> Api<LoadBalancer> {
        Api::namespaced(self.control.client(), LB_NS)
    }

    /// Creates a Service of type LoadBalancer through the API (like a user would).
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
                "ipFamilies": ["IPv4"],
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080, "targetPort": 8080}],
            }
        });
        lb_api::fake_api::json_merge(&mut service["spec"], &extra_spec);
        let service: Service = serde_json::from_value(service).unwrap();
        self.service_api(namespace)
            .create(&PostParams::default(), &service)
            .await
            .unwrap()
    }

    pub async fn patch_service(&self, namespace: &str, name: &str, patch: Value) {
        self.service_api(namespace)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }

    /// Stores a node (with status) directly.
    pub fn put_node(&self, name: &str, ready: &str, addresses: &[&str]) {
        self.put_node_with(name, ready, addresses, json!({}), vec![]);
    }

    pub fn put_node_with(
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
        self.target.put(
            &nodes(),
            json!({
                "metadata": {"name": name},
                "spec": spec,
                "status": {"conditions": conditions, "addresses": addresses},
            }),
        );
    }

    pub fn lb(&self, lb_name: &str) -> Option<LoadBalancer> {
        self.control
            .get(&loadbalancers(), LB_NS, lb_name)
            .map(|v| serde_json::from_value(v).unwrap())
    }

    pub fn service(&self, namespace: &str, name: &str) -> Option<Service> {
        self.target
            .get(&services(), namespace, name)
            .map(|v| serde_json::from_value(v).unwrap())
    }

    /// Waits until the LoadBalancer exists and satisfies `check`.
    pub async fn wait_lb(
        &self,
        lb_name: &str,
        what: &str,
        check: impl Fn(&LoadBalancer) -> bool,
    ) -> LoadBalancer {
        wait_until(what, || self.lb(lb_name).is_some_and(|lb| check(&lb))).await;
        self.lb(lb_name).unwrap()
    }

    /// Events (core/v1) about an object in the target cluster: (type, reason, message).
    pub fn events_for(&self, namespace: &str, name: &str) -> Vec<(String, String, String)> {
        self.target
            .list(&events())
            .into_iter()
            .filter(|e| {
                e["involvedObject"]["name"] == name && e["involvedObject"]["namespace"] == namespace
            })
            .map(|e| {
                (
                    e["type"].as_str().unwrap_or("").to_string(),
                    e["reason"].as_str().unwrap_or("").to_string(),
                    e["message"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect()
    }

    pub async fn wait_event(&self, namespace: &str, name: &str, type_: &str, contains: &str) {
        wait_until(&format!("{type_} event containing {contains:?}"), || {
            self.events_for(namespace, name)
                .iter()
                .any(|(t, _, m)| t == type_ && m.contains(contains))
        })
        .await;
    }

    /// Sets the LoadBalancer status as the OpenStack controllers would.
    pub async fn set_lb_status(&self, lb_name: &str, status: Value) {
        self.lb_api()
            .patch_status(
                lb_name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": status})),
            )
            .await
            .unwrap();
    }

    /// Waits until the service controller processed at least `n` more reconciliations than
    /// `before` — to assert that something did *not* happen after the controller looked.
    pub async fn wait_reconciles(&self, before: u64, n: u64) {
        let metrics = self.metrics.clone();
        wait_until("reconciliations", move || {
            metrics.reconcile_count("service") >= before + n
        })
        .await;
    }
}

/// Polls `condition` until it holds (panics after 20 s with `what`).
pub async fn wait_until(what: &str, condition: impl FnMut() -> bool) {
    wait_within(what, Duration::from_secs(20), condition).await
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

/// Polls an async condition.
pub async fn wait_until_async<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !condition().await {
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub fn endpoint_names(lb: &LoadBalancer) -> Vec<String> {
    lb.spec.endpoints().iter().map(|e| e.name.clone()).collect()
}
