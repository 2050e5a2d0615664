//! Kubernetes mode against a real kube-apiserver (kube-testenv: etcd + kube-apiserver with TLS, ServiceAccount
//! tokens, RBAC and the default admission chain). The agent runs with exactly the identity the controller gives a
//! machine: a ServiceAccount token bound to the Role of `lb_controller::openstack::machine::rbac`. The test reads
//! through the admin. No root, no BPF: a fake agent stands in for the data-plane loop, turning `ConfigState` into
//! `AgentStatus` the way `agent::run` does.
//!
//! One cluster for the binary ([`KubeEnv::shared`], a namespace per test); the tests that stop the API server or
//! compact etcd start their own ([`KubeEnv::start`]).

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, NodeCondition, ObjectReference, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
    WatchEvent, WatchParams,
};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Client;
use kube_testenv::{wait_for, KubeEnv};
use lb_agent::dataplane::model::{Protocol, ServiceId};
use lb_agent::health::HealthCheckSpec;
use lb_agent::report::metrics::{ServiceMetrics, SharedSnapshot, Snapshot};
use lb_agent::report::AgentStatus;
use lb_agent::source::config::DesiredConfig;
use lb_agent::source::kubernetes::{self as kube_mode, KubeMode, KubeSettings};
use lb_agent::source::ConfigState;
use lb_api::{LoadBalancer, LoadBalancerMachine};
use lb_controller::openstack::machine::rbac::{self, MachineIdentity};
// yawol-controller's output and the test objects (its per-machine Role, LoadBalancer and machine).
use lb_test_support::yawol;
use serde_json::{json, Value};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

const LB: &str = "lb-1";
const LBM: &str = "lb-1-abcde-xyz12";
const VIP: &str = "192.0.2.10";
/// Heartbeat period in these tests: short, so the tests are fast without controlling tokio time (the API server
/// and kube-runtime run on real time).
const REQUEUE: Duration = Duration::from_millis(150);
/// Upper bound for anything to happen (a real API server on a busy 2-core machine: generous; the bound only turns
/// a hang into a failure).
const WITHIN: Duration = Duration::from_secs(30);
/// Start of the fake clock (seconds since the epoch).
const T0: i64 = 1_700_000_000;

fn lb_json(ns: &str, ports: Value, endpoints: Value, options: Value) -> Value {
    yawol::loadbalancer_json(ns, LB, ports, endpoints, options)
}

fn good_lb(ns: &str) -> Value {
    lb_json(
        ns,
        json!([{"name": "http", "protocol": "TCP", "port": 80, "nodePort": 30080},
               {"name": "dns", "protocol": "UDP", "port": 53, "nodePort": 30053}]),
        json!([{"name": "node-1", "addresses": ["10.0.0.11"]},
               {"name": "node-2", "addresses": ["10.0.0.12", "fd00::12"]}]),
        json!({"loadBalancerSourceRanges": ["10.0.0.0/8"]}),
    )
}

fn lbm_json(ns: &str, name: &str, loadbalancer: &str) -> Value {
    yawol::machine_json(ns, name, loadbalancer)
}

/// The agent's Kubernetes-mode settings for the test's machine in namespace `ns`, on the test's clock.
fn settings(ns: &str, clock: &Arc<Mutex<i64>>) -> KubeSettings {
    let c = clock.clone();
    KubeSettings {
        namespace: ns.to_string(),
        loadbalancer: LB.into(),
        machine: LBM.into(),
        health_check: HealthCheckSpec::default(),
        requeue: REQUEUE,
        clock: Arc::new(move || Time(Timestamp::from_second(*c.lock().unwrap()).unwrap())),
        machine_revision: None,
        ad_hoc_debug: None,
        yawollet: None,
        proxy_v2: true,
    }
}

/// The config in effect in the fake data plane (what `agent::run` would have in its maps).
type InEffect = Arc<Mutex<Option<(Arc<DesiredConfig>, u64)>>>;

/// A runtime of its own for the agent's tasks (a VM's process, as far as scheduling goes): the test can hold it
/// still ([`AgentRuntime::hold`]) while it changes the world, and then let it see the result.
struct AgentRuntime {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl AgentRuntime {
    fn new() -> Self {
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("agent".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("the agent's runtime");
                handle_tx.send(rt.handle().clone()).unwrap();
                rt.block_on(async {
                    let _ = stopped.await;
                });
            })
            .expect("the agent's thread");
        AgentRuntime {
            handle: handle_rx.recv().unwrap(),
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Blocks the agent's (single-threaded) runtime until the returned guard is dropped: none of its tasks runs,
    /// its timers and sockets are looked at again only then.
    async fn hold(&self) -> Held {
        let (held_tx, held_rx) = tokio::sync::oneshot::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        self.handle.spawn(async move {
            let _ = held_tx.send(());
            let _ = released.recv();
        });
        held_rx.await.expect("the agent's runtime is held");
        Held { _release: release }
    }
}

impl Drop for AgentRuntime {
    fn drop(&mut self) {
        let _ = self.stop.take().map(|s| s.send(()));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Holds the agent's runtime while alive.
struct Held {
    _release: std::sync::mpsc::Sender<()>,
}

/// The cluster side of a test: its namespace and admin views.
struct Cluster {
    ns: String,
    admin: Client,
    /// Admin views of the namespace (the test's reads and writes).
    lbs: Api<LoadBalancer>,
    lbms: Api<LoadBalancerMachine>,
}

impl Cluster {
    /// A fresh namespace (the CRDs applied) on `env`.
    async fn new(env: &KubeEnv) -> Self {
        if std::env::var_os("TEST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter("debug,hyper=info,tower=info,rustls=info")
                .with_test_writer()
                .try_init();
        }
        let admin = env.client().await.expect("admin client");
        env.apply_crds(&admin, lb_api::crds().into_iter().map(|(_, c)| c))
            .await
            .expect("CRDs applied");
        let ns = env
            .namespace(&admin, "kube-mode")
            .await
            .expect("namespace created");
        Cluster {
            lbs: Api::namespaced(admin.clone(), &ns),
            lbms: Api::namespaced(admin.clone(), &ns),
            ns,
            admin,
        }
    }

    /// Creates the machine's ServiceAccount, Role and RoleBinding as the controller builds them
    /// (`lb_controller::openstack::machine::rbac`), mints a token for the ServiceAccount and returns a client that
    /// uses it, once the Role is in effect; also the kubeconfig, for a client in another runtime.
    ///
    /// The controller creates them once the LoadBalancerMachine exists, owned by it. When it does not exist (yet),
    /// they are created without the owner reference: the garbage collector deletes objects whose owner is gone,
    /// and the ServiceAccount's token with them.
    async fn machine_client(&self, env: &KubeEnv) -> (Client, String) {
        let uid = self
            .lbms
            .get_opt(LBM)
            .await
            .expect("reading the LoadBalancerMachine")
            .and_then(|m| m.metadata.uid);
        let id = MachineIdentity {
            namespace: self.ns.clone(),
            machine: LBM.into(),
            machine_uid: uid.clone().unwrap_or_default(),
            loadbalancer: LB.into(),
        };
        let mut sa = rbac::service_account(&id);
        let mut role = rbac::role(&id);
        let mut binding = rbac::role_binding(&id);
        if uid.is_none() {
            sa.metadata.owner_references = None;
            role.metadata.owner_references = None;
            binding.metadata.owner_references = None;
        }
        let pp = PostParams::default();
        Api::<ServiceAccount>::namespaced(self.admin.clone(), &self.ns)
            .create(&pp, &sa)
            .await
            .expect("ServiceAccount created");
        Api::<Role>::namespaced(self.admin.clone(), &self.ns)
            .create(&pp, &role)
            .await
            .expect("Role created");
        Api::<RoleBinding>::namespaced(self.admin.clone(), &self.ns)
            .create(&pp, &binding)
            .await
            .expect("RoleBinding created");
        let token = env
            .token(&self.admin, &self.ns, LBM)
            .await
            .expect("a token for the machine's ServiceAccount");
        let client = env
            .token_client(&token)
            .await
            .expect("a client with the machine's token");
        // RBAC takes effect once the API server's informers have the Role and the binding: until then the agent
        // would be Forbidden and back off.
        let own: Api<LoadBalancerMachine> = Api::namespaced(client.clone(), &self.ns);
        wait_for("the machine's Role in effect", || async {
            Ok(!matches!(own.get(LBM).await, Err(kube::Error::Api(s)) if s.code == 403))
        })
        .await
        .unwrap();
        (client, env.token_kubeconfig(&token))
    }
}

struct Harness {
    ns: String,
    lbs: Api<LoadBalancer>,
    lbms: Api<LoadBalancerMachine>,
    events: Api<Event>,
    /// The client with the machine's token (what the agent uses).
    machine_client: Client,
    clock: Arc<Mutex<i64>>,
    in_effect: InEffect,
    mode: KubeMode,
    _status_tx: watch::Sender<AgentStatus>,
}

impl Harness {
    /// Starts Kubernetes mode with the machine's identity in a fresh namespace of `env`; `seed` creates objects
    /// first (admin views of the namespace, and its name).
    async fn start(
        env: &KubeEnv,
        seed: impl AsyncFnOnce(&Api<LoadBalancer>, &Api<LoadBalancerMachine>, &str),
    ) -> Self {
        Self::start_on(env, None, seed).await
    }

    /// [`Harness::start`] with the agent's tasks (and its client) on `agent`'s runtime instead of the test's.
    async fn start_on(
        env: &KubeEnv,
        agent: Option<&AgentRuntime>,
        seed: impl AsyncFnOnce(&Api<LoadBalancer>, &Api<LoadBalancerMachine>, &str),
    ) -> Self {
        let cluster = Cluster::new(env).await;
        seed(&cluster.lbs, &cluster.lbms, &cluster.ns).await;
        let (machine_client, kubeconfig) = cluster.machine_client(env).await;
        let clock = Arc::new(Mutex::new(T0));
        let settings = settings(&cluster.ns, &clock);
        let (status_tx, status_rx) = watch::channel(AgentStatus::default());
        let snapshot: SharedSnapshot = Arc::new(std::sync::RwLock::new(sample_snapshot()));
        let in_effect = InEffect::default();
        let start = {
            let (status_tx, in_effect) = (status_tx.clone(), in_effect.clone());
            let client = agent.is_none().then(|| machine_client.clone());
            async move {
                let client = match client {
                    Some(client) => client,
                    None => kube_testenv::client_from(&kubeconfig)
                        .await
                        .expect("a client with the machine's token"),
                };
                let mode = kube_mode::start(client, settings, status_rx, snapshot);
                tokio::spawn(fake_agent(mode.config.clone(), status_tx, in_effect));
                mode
            }
        };
        let mode = match agent {
            Some(rt) => rt.handle.spawn(start).await.unwrap(),
            None => start.await,
        };
        Harness {
            events: Api::namespaced(cluster.admin.clone(), &cluster.ns),
            ns: cluster.ns,
            lbs: cluster.lbs,
            lbms: cluster.lbms,
            machine_client,
            clock,
            in_effect,
            mode,
            _status_tx: status_tx,
        }
    }

    /// A second agent for the same machine, as when yawol's user data restarts the agent at boot (the first one
    /// keeps running here: the API server sees the same as with a stop and a start). Dropping the result stops
    /// reporting its status.
    async fn start_again(&self) -> (KubeMode, watch::Sender<AgentStatus>) {
        let (status_tx, status_rx) = watch::channel(AgentStatus::default());
        let mode = kube_mode::start(
            self.machine_client.clone(),
            settings(&self.ns, &self.clock),
            status_rx,
            Arc::new(std::sync::RwLock::new(sample_snapshot())),
        );
        tokio::spawn(fake_agent(
            mode.config.clone(),
            status_tx.clone(),
            InEffect::default(),
        ));
        (mode, status_tx)
    }

    fn advance_clock(&self, secs: i64) -> Time {
        let mut c = self.clock.lock().unwrap();
        *c += secs;
        Time(Timestamp::from_second(*c).unwrap())
    }

    async fn wait_config(
        &self,
        what: &str,
        mut pred: impl FnMut(&ConfigState) -> bool,
    ) -> ConfigState {
        let mut rx = self.mode.config.clone();
        let r = tokio::time::timeout(WITHIN, rx.wait_for(|s| pred(s))).await;
        match r {
            Ok(Ok(s)) => s.clone(),
            _ => panic!(
                "timed out waiting for {what}; config is {:?}",
                *self.mode.config.borrow()
            ),
        }
    }

    async fn machine(&self) -> Option<LoadBalancerMachine> {
        self.lbms
            .get_opt(LBM)
            .await
            .expect("reading the LoadBalancerMachine")
    }

    async fn conditions(&self) -> Vec<NodeCondition> {
        conditions_of(self.machine().await.as_ref())
    }

    /// Waits until the machine's conditions satisfy `pred`.
    async fn wait_conditions(
        &self,
        what: &str,
        pred: impl Fn(&[NodeCondition]) -> bool,
    ) -> Vec<NodeCondition> {
        let pred = &pred;
        eventually(what, || async move {
            let c = self.conditions().await;
            pred(&c).then_some(c)
        })
        .await
    }

    /// The core/v1 Events about the machine.
    async fn events(&self) -> Vec<Event> {
        self.events_about(LBM).await
    }

    /// The core/v1 Events about the object named `name` (the machine, the LoadBalancer).
    async fn events_about(&self, name: &str) -> Vec<Event> {
        self.events
            .list(&ListParams::default())
            .await
            .expect("listing Events")
            .items
            .into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(name))
            .collect()
    }

    async fn patch_spec(&self, spec: Value) -> LoadBalancer {
        self.lbs
            .patch(
                LB,
                &PatchParams::default(),
                &Patch::Merge(&json!({ "spec": spec })),
            )
            .await
            .expect("spec patch accepted by the API server")
    }

    fn in_effect_generation(&self) -> Option<u64> {
        self.in_effect.lock().unwrap().as_ref().map(|(_, g)| *g)
    }
}

fn conditions_of(m: Option<&LoadBalancerMachine>) -> Vec<NodeCondition> {
    m.and_then(|m| m.status.as_ref())
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default()
}

/// Mirrors `agent::run`'s bookkeeping: a valid config is applied (and stays in effect), an invalid one
/// only sets the error.
async fn fake_agent(
    mut rx: watch::Receiver<ConfigState>,
    tx: watch::Sender<AgentStatus>,
    in_effect: InEffect,
) {
    tx.send_modify(|s| s.dataplane_ready = true);
    loop {
        let state = rx.borrow_and_update().clone();
        match state {
            ConfigState::Pending => {}
            ConfigState::Valid(cfg, generation) => {
                *in_effect.lock().unwrap() = Some((cfg, generation));
                tx.send_modify(|s| {
                    s.config_error = None;
                    s.desired_generation = Some(generation);
                    s.applied_generation = Some(generation);
                });
            }
            ConfigState::Invalid(msg, generation) => tx.send_modify(|s| {
                s.config_error = Some(msg);
                s.desired_generation = Some(generation);
            }),
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}

fn sample_snapshot() -> Snapshot {
    let mut s = Snapshot {
        services: vec![ServiceMetrics {
            id: Some(ServiceId {
                vip: VIP.parse().unwrap(),
                port: 80,
                protocol: Protocol::Tcp,
            }),
            active: 7,
            ..Default::default()
        }],
        ..Default::default()
    };
    s.services[0].stats.new_flows = 42;
    s.host.insert("load1", 0.25);
    s
}

/// Polls `f` every 50 ms until it gives a value, for up to [`WITHIN`].
async fn eventually<T, F, Fut>(what: &str, f: F) -> T
where
    F: Fn() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WITHIN;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn find<'a>(c: &'a [NodeCondition], type_: &str) -> Option<&'a NodeCondition> {
    c.iter().find(|c| c.type_ == type_)
}

fn is(c: &[NodeCondition], type_: &str, status: &str) -> bool {
    find(c, type_).is_some_and(|c| c.status == status)
}

fn message<'a>(c: &'a [NodeCondition], type_: &str) -> &'a str {
    find(c, type_)
        .and_then(|c| c.message.as_deref())
        .unwrap_or("")
}

async fn create(
    lbs: &Api<LoadBalancer>,
    lbms: &Api<LoadBalancerMachine>,
    lb: Value,
    port_ip: Option<&str>,
) {
    let ns = lb["metadata"]["namespace"].as_str().unwrap().to_string();
    lbms.create(
        &PostParams::default(),
        &serde_json::from_value(lbm_json(&ns, LBM, LB)).unwrap(),
    )
    .await
    .unwrap();
    lbs.create(&PostParams::default(), &serde_json::from_value(lb).unwrap())
        .await
        .unwrap();
    if let Some(ip) = port_ip {
        set_port_ip(lbs, ip).await;
    }
}

async fn set_port_ip(lbs: &Api<LoadBalancer>, ip: &str) {
    lbs.patch_status(
        LB,
        &PatchParams::default(),
        &Patch::Merge(&json!({"status": {"portIP": ip}})),
    )
    .await
    .unwrap();
}

/// Asserts that `r` is the API server's 403 Forbidden.
fn assert_forbidden<T: std::fmt::Debug>(what: &str, r: Result<T, kube::Error>) {
    match r {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}

#[tokio::test]
async fn without_port_ip_the_config_is_pending_until_the_vip_exists() {
    let h = Harness::start(KubeEnv::shared(), async |lbs, lbms, ns| {
        create(lbs, lbms, good_lb(ns), None).await
    })
    .await;
    let c = h
        .wait_conditions("ConfigReady=False written", |c| {
            is(c, "ConfigReady", "False")
        })
        .await;
    assert_eq!(
        find(&c, "ConfigReady").unwrap().reason.as_deref(),
        Some("ConfigurationPending")
    );
    assert!(matches!(*h.mode.config.borrow(), ConfigState::Pending));
    assert!(is(&c, "EnvoyReady", "True"), "the data plane itself is up");
    assert!(is(&c, "EnvoyUpToDate", "False"));

    set_port_ip(&h.lbs, VIP).await;
    let state = h
        .wait_config("a valid config", |s| matches!(s, ConfigState::Valid(..)))
        .await;
    let ConfigState::Valid(cfg, generation) = state else {
        unreachable!()
    };
    assert_eq!(
        generation, 1,
        "metadata.generation of a new object; status writes do not change it"
    );
    assert_eq!(cfg.services.len(), 2);
    h.wait_conditions("ConfigReady=True", |c| is(c, "ConfigReady", "True"))
        .await;
}

#[tokio::test]
async fn ports_and_endpoints_become_services_and_the_machine_reports_ready() {
    let h = Harness::start(KubeEnv::shared(), async |lbs, lbms, ns| {
        create(lbs, lbms, good_lb(ns), Some(VIP)).await
    })
    .await;
    let ConfigState::Valid(cfg, 1) = h
        .wait_config("valid", |s| matches!(s, ConfigState::Valid(..)))
        .await
    else {
        panic!("generation 1 expected")
    };
    let vip = VIP.parse().unwrap();
    let ids: Vec<_> = cfg.services.iter().map(|s| s.id).collect();
    assert_eq!(
        ids,
        [
            ServiceId {
                vip,
                port: 80,
                protocol: Protocol::Tcp
            },
            ServiceId {
                vip,
                port: 53,
                protocol: Protocol::Udp
            }
        ]
    );
    assert_eq!(
        cfg.services[0].backends,
        [
            "10.0.0.11:30080".parse().unwrap(),
            "10.0.0.12:30080".parse().unwrap()
        ]
    );
    assert_eq!(
        cfg.services[1].backends,
        [
            "10.0.0.11:30053".parse().unwrap(),
            "10.0.0.12:30053".parse().unwrap()
        ]
    );
    assert_eq!(
        cfg.services[0].source_ranges,
        ["10.0.0.0/8".parse().unwrap()]
    );
    assert_eq!(cfg.health_check, HealthCheckSpec::default());

    // Everything an unmodified yawol-controller checks, plus our names.
    let c = h
        .wait_conditions("all conditions True", |c| {
            [
                "ConfigReady",
                "EnvoyReady",
                "EnvoyUpToDate",
                "DataplaneReady",
                "DataplaneUpToDate",
            ]
            .iter()
            .all(|t| is(c, t, "True"))
        })
        .await;
    let names: Vec<_> = c.iter().map(|c| c.type_.as_str()).collect();
    assert_eq!(
        names,
        [
            "ConfigReady",
            "DataplaneReady",
            "DataplaneUpToDate",
            "EnvoyReady",
            "EnvoyUpToDate"
        ]
    );
    // The Event is written before the status that reports the applied generation.
    let events = h.events().await;
    assert!(
        events
            .iter()
            .any(|e| e.type_.as_deref() == Some("Normal") && e.reason.as_deref() == Some("Update")),
        "an Update event when the config is applied: {events:?}"
    );
}

/// The LoadBalancer as written by hand (or by an older controller): a port without `protocol`, no `replicas`. The
/// CRD's defaults (yawol's: TCP, 1) are filled in by the API server, so what is stored and what the agent reads
/// has them, whatever the reader's own fallbacks.
#[tokio::test]
async fn the_api_server_defaults_port_protocol_and_replicas() {
    let raw = |lbs: &Api<LoadBalancer>, ns: &str| -> Api<DynamicObject> {
        Api::namespaced_with(
            lbs.clone().into_client(),
            ns,
            &ApiResource::erase::<LoadBalancer>(&()),
        )
    };
    let h = Harness::start(KubeEnv::shared(), async |lbs, lbms, ns| {
        let mut lb = lb_json(
            ns,
            json!([{"name": "http", "port": 80, "nodePort": 30080}]),
            json!([{"name": "node-1", "addresses": ["10.0.0.11"]}]),
            json!({}),
        );
        lb["spec"].as_object_mut().unwrap().remove("replicas");
        lbms.create(
            &PostParams::default(),
            &serde_json::from_value(lbm_json(ns, LBM, LB)).unwrap(),
        )
        .await
        .unwrap();
        // Untyped: the typed object would carry the client's own defaults.
        raw(lbs, ns)
            .create(&PostParams::default(), &serde_json::from_value(lb).unwrap())
            .await
            .unwrap();
        set_port_ip(lbs, VIP).await;
    })
    .await;
    let stored = raw(&h.lbs, &h.ns).get(LB).await.unwrap();
    assert_eq!(
        stored.data["spec"]["ports"][0]["protocol"], "TCP",
        "defaulted by the CRD schema"
    );
    assert_eq!(
        stored.data["spec"]["replicas"], 1,
        "defaulted by the CRD schema"
    );
    let ConfigState::Valid(cfg, 1) = h
        .wait_config("valid", |s| matches!(s, ConfigState::Valid(..)))
        .await
    else {
        panic!("generation 1 expected")
    };
    assert_eq!(cfg.services[0].id.protocol, Protocol::Tcp);
}

/// `tcpProxyProtocol` with a port filter: exactly the filtered TCP ports get PROXY v2 (an agent at XDP), nothing is
/// reported as unsupported.
#[tokio::test]
async fn proxy_protocol_programs_exactly_the_filtered_ports() {
    let h = Harness::start(KubeEnv::shared(), async |lbs, lbms, ns| {
        let mut lb = lb_json(
            ns,
            json!([{"name": "http", "protocol": "TCP", "port": 80, "nodePort": 30080},
                   {"name": "https", "protocol": "TCP", "port": 443, "nodePort": 30443},
                   {"name": "dns", "protocol": "UDP", "port": 53, "nodePort": 30053}]),
            json!([{"name": "node-1", "addresses": ["10.0.0.11"]}]),
            json!({}),
        );
        lb["spec"]["options"]["tcpProxyProtocol"] = json!(true);
        lb["spec"]["options"]["tcpProxyProtocolPortFilter"] = json!([443]);
        create(lbs, lbms, lb, Some(VIP)).await
    })
    .await;
    let ConfigState::Valid(cfg, _) = h
        .wait_config("valid", |s| matches!(s, ConfigState::Valid(..)))
        .await
    else {
        unreachable!()
    };
    let mut proxied: Vec<(u16, bool)> = cfg
        .services
        .iter()
        .map(|s| (s.id.port, s.proxy_v2))
        .collect();
    proxied.sort();
    assert_eq!(proxied, [(53, false), (80, false), (443, true)]);
    let events = eventually("the Update Event", || async {
        let e = h.events().await;
        e.iter()
            .any(|e| e.reason.as_deref() == Some("Update"))
            .then_some(e)
    })
    .await;
    assert!(
        events
            .iter()
            .all(|e| e.reason.as_deref() != Some("ProxyProtocolNotSupported")),
        "{events:?}"
    );
}

/// yawol's user data starts the agent twice at boot: the second start writes no second `Update` for the
/// generation the first applied, nor a second Event about the spec, on the machine or the LoadBalancer.
#[tokio::test]
async fn a_second_start_repeats_no_event() {
    let h = Harness::start(KubeEnv::shared(), async |lbs, lbms, ns| {
        let mut lb = good_lb(ns);
        // An option this image does not implement: a spec Event on the machine and on the LoadBalancer.
        lb["spec"]["options"]["logForward"] =
            json!({"enabled": true, "lokiUrl": "http://loki:3100"});
        create(lbs, lbms, lb, Some(VIP)).await
    })
    .await;
    let count = |events: &[Event], reason: &str| {
        events
            .iter()
            .filter(|e| e.reason.as_deref() == Some(reason))
            .count()
    };
    let reasons = ["Update", "LogForwardNotSupported"];
    eventually("the first start's Events", || async {
        let on_machine = h.events().await;
        let on_lb = h.events_about(LB).await;
        (reasons.iter().all(|r| count(&on_machine, r) == 1) && count(&on_lb, reasons[1]) == 1)
            .then_some(())
    })
    .await;
    let (second, _status) = h.start_again().await;
    second
        .config
        .clone()
        .wait_for(|s| matches!(s, ConfigState::Valid(..)))
        .await
        .unwrap();
    // The second start's status reporter writes its first status (and would write its Events) within a period.
    h.wait_conditions("the second start's status", |c| {
        find(c, "ConfigReady").is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let on_machine = h.events().await;
    let on_lb = h.events_about(LB).await;
    for r in reasons {
        assert_eq!(
            count(&on_machine, r),
            1,
            "{r} on the machine: {on_machine:#?}"
        );
    }
    assert_eq!(
        count(&on_lb, reasons[1]),
        1,
        "on the LoadBalancer: {on_lb:#?}"
    );
}

#[tokio::test]
async fn a_spec_change_is_a_new_generation_and_status_updates_are_not() {
    let h = Harness::start(KubeEnv::shared(), async |lbs, lbms, ns| {
        create(lbs, lbms, good_lb(ns), Some(VIP)).await
    })
    .await;
    h.wait_config("generation 1", |s| matches!(s, ConfigState::Valid(_, 1)))
        .await;

    // Status-only changes (written by the controllers) must not wake the agent.
    let mut rx = h.mode.config.clone();
    rx.borrow_and_update();
    let lb = h
        .lbs
        .patch_status(
            LB,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"readyReplicas": 1}})),
        )
        .await
        .unwrap();
    assert_eq!(
        lb.metadata.generation,
        Some(1),
        "the status subresource does not bump the generation"
    );
    // The agent's watch delivers the status update (a new resourceVersion) well within this.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !rx.has_changed().unwrap(),
        "a status-only update re-sent the config"
    );

    let lb = h.patch_spec(json!({"ports": [{"name": "https", "protocol": "TCP", "port": 443, "nodePort": 30443}]})).await;
    assert_eq!(lb.metadata.generation, Some(2));
    let ConfigState::Valid(cfg, _) = h
        .wait_config("generation 2", |s| matches!(s, ConfigState::Valid(_, 2)))
        .await
    else {
        unreachable!()
    };
    assert_eq!(cfg.services.len(), 1);
    assert_eq!(cfg.services[0].id.port, 443);
    h.wait_conditions("generation 2 applied", |c| {
        find(c, "EnvoyUpToDate").is_some_and(|c| {
            c.status == "True" && c.message.as_deref().unwrap_or("").contains("generation 2")
        })
    })
    .await;
}

#[tokio::test]
async fn an_ipv6_vip_takes_the_ipv6_endpoints_and_warns_once_about_a_node_without_one() {
    let h = Harness::start(KubeEnv::shared(), async |lbs, lbms, ns| {
        create(lbs, lbms, good_lb(ns), Some("2001:db8::10")).await
    })
    .await;
    let ConfigState::Valid(c, 1) = h
        .wait_config("generation 1", |s| matches!(s, ConfigState::Valid(_, 1)))
        .await
    else {
        unreachable!()
    };
    let http = &c.services[0];
    assert_eq!(
        http.id.vip,
        "2001:db8::10".parse::<std::net::IpAddr>().unwrap()
    );
    assert_eq!(http.backends, vec!["[fd00::12]:30080".parse().unwrap()]);
    let needle = "endpoints[0] (node-1) has no IPv6 address";
    let warned = |events: &[Event]| {
        events
            .iter()
            .filter(|e| {
                e.type_.as_deref() == Some("Warning")
                    && e.reason.as_deref() == Some("ConfigurationWarning")
                    && e.message.as_deref().unwrap_or("").contains(needle)
            })
            .count()
    };
    eventually("ConfigurationWarning event", || async {
        (warned(&h.events().await) > 0).then_some(())
    })
    .await;
    // The source ranges name only IPv4: the IPv6 VIP admits no client, which is said too.
    assert!(h.events().await.iter().any(|e| e
        .message
        .as_deref()
        .unwrap_or("")
        .contains("loadBalancerSourceRanges has no IPv6 range")));
    // A new generation with the same warning does not repeat it.
    h.patch_spec(json!({"options": {"loadBalancerSourceRanges": ["10.0.0.0/8", "2001:db8::/32"]}}))
        .await;
    h.wait_config("generation 2", |s| matches!(s, ConfigState::Valid(_, 2)))
        .await;
    h.wait_conditions("up to date", |c| is(c, "EnvoyUpToDate", "True"))
        .await;
    assert_eq!(warned(&h.events().await), 1, "reported once");
}

#[tokio::test]
async fn an_invalid_spec_is_rejected_with_a_warning_and_the_last_config_keeps_forwarding() {
    let h = Harness::start(KubeEnv::shared(), async |lbs, lbms, ns| {
        create(lbs, lbms, good_lb(ns), Some(VIP)).await
    })
    .await;
    let ConfigState::Valid(good, 1) = h
        .wait_config("generation 1", |s| matches!(s, ConfigState::Valid(_, 1)))
        .await
    else {
        unreachable!()
    };
    h.wait_conditions("ready", |c| is(c, "EnvoyUpToDate", "True"))
        .await;

    // All three pass the CRD's schema (a CIDR is a plain string, any protocol string and port number are
    // accepted, as for yawol): the agent is the one to reject them.
    let cases = [
        (
            "bad CIDR",
            json!({"options": {"loadBalancerSourceRanges": ["10.0.0.0/33"]}}),
            "loadBalancerSourceRanges[0]",
        ),
        (
            "unknown protocol",
            json!({"ports": [{"protocol": "SCTP", "port": 80, "nodePort": 30080}]}),
            "protocol \"SCTP\"",
        ),
        (
            "port 0",
            json!({"ports": [{"protocol": "TCP", "port": 0, "nodePort": 30080}]}),
            "port 0 is out of range",
        ),
    ];
    let uid = h.machine().await.unwrap().metadata.uid;
    for (what, spec, needle) in cases {
        // Back to the good spec between cases, so each rejection stands alone.
        h.patch_spec(good_lb(&h.ns)["spec"].clone()).await;
        h.wait_config("valid again", |s| matches!(s, ConfigState::Valid(..)))
            .await;

        let generation = h.patch_spec(spec).await.metadata.generation.unwrap() as u64;
        let state = h
            .wait_config(
                what,
                |s| matches!(s, ConfigState::Invalid(_, g) if *g == generation),
            )
            .await;
        let ConfigState::Invalid(msg, _) = state else {
            unreachable!()
        };
        assert!(msg.contains(needle), "{what}: {needle:?} not in {msg}");

        let event = eventually(&format!("{what}: Warning event"), || async {
            h.events().await.into_iter().find(|e| {
                e.type_.as_deref() == Some("Warning")
                    && e.reason.as_deref() == Some("ConfigurationRejected")
                    && e.message.as_deref().unwrap_or("").contains(needle)
            })
        })
        .await;
        assert_eq!(event.involved_object.uid, uid, "kubectl describe finds it");
        assert_eq!(
            event.involved_object.kind.as_deref(),
            Some("LoadBalancerMachine")
        );
        assert_eq!(
            event.source.as_ref().and_then(|s| s.component.as_deref()),
            Some("lb-agent")
        );
        // The same on the LoadBalancer, for the cloud controller to re-emit on the Service: once, whichever
        // replica wrote it.
        let on_lb = eventually(
            &format!("{what}: Warning event on the LoadBalancer"),
            || async {
                let found: Vec<Event> = h
                    .events_about(LB)
                    .await
                    .into_iter()
                    .filter(|e| {
                        e.reason.as_deref() == Some("ConfigurationRejected")
                            && e.message.as_deref().unwrap_or("").contains(needle)
                    })
                    .collect();
                (!found.is_empty()).then_some(found)
            },
        )
        .await;
        assert_eq!(on_lb.len(), 1, "{what}: one Event on the LoadBalancer");
        assert_eq!(
            on_lb[0].involved_object.kind.as_deref(),
            Some("LoadBalancer")
        );
        assert_eq!(
            on_lb[0]
                .source
                .as_ref()
                .and_then(|s| s.component.as_deref()),
            Some("yawol-service")
        );

        let (in_effect, _) = h.in_effect.lock().unwrap().clone().unwrap();
        assert_eq!(
            in_effect.services, good.services,
            "{what}: the last good config keeps forwarding"
        );

        let c = h
            .wait_conditions(&format!("{what}: ConfigReady=False"), |c| {
                find(c, "ConfigReady").is_some_and(|c| {
                    c.status == "False" && c.message.as_deref().unwrap_or("").contains(needle)
                })
            })
            .await;
        assert_eq!(
            find(&c, "ConfigReady").unwrap().reason.as_deref(),
            Some("EnvoyConfigurationFailed")
        );
        assert!(
            is(&c, "EnvoyReady", "True"),
            "{what}: the data plane is still up"
        );
        assert!(
            is(&c, "DataplaneUpToDate", "False"),
            "{what}: the desired generation is not in the maps"
        );
    }
    assert!(
        !h.events()
            .await
            .iter()
            .any(|e| e.reason.as_deref() == Some("ApplyFailed")),
        "rejections are not reported twice"
    );
}

#[tokio::test]
async fn heartbeats_advance_while_transition_times_stay_and_metrics_are_written() {
    let h = Harness::start(KubeEnv::shared(), async |lbs, lbms, ns| {
        create(lbs, lbms, good_lb(ns), Some(VIP)).await
    })
    .await;
    let t0 = Time(Timestamp::from_second(T0).unwrap());
    let first = h
        .wait_conditions("all True", |c| {
            c.len() == 5 && c.iter().all(|c| c.status == "True")
        })
        .await;
    // Transition times come from the first True (possibly after a False while the agent started).
    let transitions: Vec<_> = first
        .iter()
        .map(|c| c.last_transition_time.clone())
        .collect();
    for c in &first {
        assert_eq!(c.last_heartbeat_time.as_ref(), Some(&t0));
    }

    let m = h.machine().await.unwrap().status.unwrap().metrics.unwrap();
    let get = |name: &str| m.iter().find(|x| x.type_ == name).map(|x| x.value.clone());
    assert_eq!(get("TCP-80-upstream_cx_total").as_deref(), Some("42"));
    assert_eq!(get("TCP-80-upstream_cx_active").as_deref(), Some("7"));
    assert_eq!(get("load1").as_deref(), Some("0.25"));
    assert!(
        m.iter().all(|x| x.time == t0),
        "metrics stamped with the clock"
    );

    // Nothing changes but time: the next requeue refreshes every heartbeat.
    for step in 1..=2 {
        let now = h.advance_clock(30);
        let c = h
            .wait_conditions(&format!("heartbeat {step}"), |c| {
                c.iter()
                    .all(|c| c.last_heartbeat_time.as_ref() == Some(&now))
            })
            .await;
        let after: Vec<_> = c.iter().map(|c| c.last_transition_time.clone()).collect();
        assert_eq!(
            after, transitions,
            "transition times stay while statuses do not change"
        );
        let m = h.machine().await.unwrap().status.unwrap().metrics.unwrap();
        assert!(
            m.iter().all(|x| x.time == now),
            "metrics refreshed with the heartbeat"
        );
    }
}

#[tokio::test]
async fn conditions_written_by_others_survive() {
    let h = Harness::start(KubeEnv::shared(), async |lbs, lbms, ns| {
        create(lbs, lbms, good_lb(ns), Some(VIP)).await;
        let marked = json!({"status": {"conditions": [{
            "type": "MarkedForDeletion", "status": "True", "reason": "PendingDeletion", "message": "stale",
            "lastHeartbeatTime": "2023-01-01T00:00:00Z", "lastTransitionTime": "2023-01-01T00:00:00Z"
        }]}});
        lbms.patch_status(LBM, &PatchParams::default(), &Patch::Merge(&marked))
            .await
            .unwrap();
    })
    .await;
    let c = h
        .wait_conditions("ours written", |c| is(c, "EnvoyUpToDate", "True"))
        .await;
    let marked = find(&c, "MarkedForDeletion").expect("the controller's condition is kept");
    assert_eq!(marked.message.as_deref(), Some("stale"));
    assert_eq!(c.len(), 6);
}

#[tokio::test]
async fn a_missing_machine_or_loadbalancer_is_retried_not_fatal() {
    // Nothing exists yet (the machine's identity does, unowned): the config stays Pending, status writes fail
    // (404) and are retried.
    let h = Harness::start(KubeEnv::shared(), async |_, _, _| {}).await;
    tokio::time::sleep(REQUEUE * 4).await;
    assert!(
        !h.mode.is_finished(),
        "the tasks survive a missing LoadBalancerMachine"
    );
    assert!(matches!(*h.mode.config.borrow(), ConfigState::Pending));
    assert!(h.machine().await.is_none());

    create(&h.lbs, &h.lbms, good_lb(&h.ns), Some(VIP)).await;
    h.wait_config("valid once the LoadBalancer exists", |s| {
        matches!(s, ConfigState::Valid(_, 1))
    })
    .await;
    h.wait_conditions("status once the machine exists", |c| {
        is(c, "EnvoyUpToDate", "True")
    })
    .await;

    // The LoadBalancer going away keeps the last config (the machine is about to be deleted anyway).
    h.lbs.delete(LB, &Default::default()).await.unwrap();
    wait_for("the LoadBalancer gone", || async {
        Ok(h.lbs.get_opt(LB).await?.is_none())
    })
    .await
    .unwrap();
    tokio::time::sleep(REQUEUE * 4).await;
    assert!(matches!(*h.mode.config.borrow(), ConfigState::Valid(_, 1)));
    assert!(!h.mode.is_finished());
}

/// The API server is down when the agent starts (a VM booting during a control-plane outage): every request fails
/// with "connection refused", the tasks survive and retry with backoff, and once the API server is back the agent
/// gets its configuration and reports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_api_server_is_retried_with_backoff() {
    let env = KubeEnv::start().await.expect("a private cluster");
    let cluster = Cluster::new(&env).await;
    create(&cluster.lbs, &cluster.lbms, good_lb(&cluster.ns), Some(VIP)).await;
    let (client, _) = cluster.machine_client(&env).await;
    // Blocks while the API server shuts down (SIGTERM, then waiting for it).
    tokio::task::block_in_place(|| env.stop_apiserver());

    let (status_tx, status_rx) = watch::channel(AgentStatus {
        dataplane_ready: true,
        ..Default::default()
    });
    let settings = KubeSettings {
        namespace: cluster.ns.clone(),
        loadbalancer: LB.into(),
        machine: LBM.into(),
        health_check: HealthCheckSpec::default(),
        requeue: REQUEUE,
        clock: kube_mode::system_clock(),
        machine_revision: None,
        ad_hoc_debug: None,
        yawollet: None,
        proxy_v2: true,
    };
    let mode = kube_mode::start(client, settings, status_rx, SharedSnapshot::default());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!mode.is_finished(), "no task ended or panicked");
    assert!(matches!(*mode.config.borrow(), ConfigState::Pending));

    env.restart_apiserver()
        .await
        .expect("the API server restarts");
    let mut config = mode.config.clone();
    tokio::time::timeout(
        WITHIN,
        config.wait_for(|s| matches!(s, ConfigState::Valid(_, 1))),
    )
    .await
    .expect("the configuration once the API server is back")
    .unwrap();
    // The agent's status as the fake agent of the other tests would have it.
    status_tx.send_modify(|s| {
        s.desired_generation = Some(1);
        s.applied_generation = Some(1);
    });
    eventually("the status written once the API server is back", || async {
        let m = cluster.lbms.get_opt(LBM).await.ok().flatten();
        let c = conditions_of(m.as_ref());
        is(&c, "DataplaneUpToDate", "True").then_some(())
    })
    .await;
    assert!(!mode.is_finished());
}

/// The machine's token reaches its own LoadBalancer and LoadBalancerMachine (+ status) and creates Events; nothing
/// else: not the namespace's lists, not another machine's objects, not Secrets, not other namespaces.
#[tokio::test]
async fn the_machine_token_reaches_only_its_own_objects() {
    let env = KubeEnv::shared();
    let h = Harness::start(env, async |lbs, lbms, ns| {
        create(lbs, lbms, good_lb(ns), Some(VIP)).await;
        // Another load balancer and its machine in the same namespace.
        let mut other = good_lb(ns);
        other["metadata"]["name"] = json!("lb-2");
        lbs.create(
            &PostParams::default(),
            &serde_json::from_value(other).unwrap(),
        )
        .await
        .unwrap();
        lbms.create(
            &PostParams::default(),
            &serde_json::from_value(lbm_json(ns, "lb-2-fghij-abc34", "lb-2")).unwrap(),
        )
        .await
        .unwrap();
    })
    .await;
    // Another namespace with objects of the same names.
    let other_ns = Cluster::new(env).await;
    create(
        &other_ns.lbs,
        &other_ns.lbms,
        good_lb(&other_ns.ns),
        Some(VIP),
    )
    .await;

    let client = h.machine_client.clone();
    let lbs: Api<LoadBalancer> = Api::namespaced(client.clone(), &h.ns);
    let lbms: Api<LoadBalancerMachine> = Api::namespaced(client.clone(), &h.ns);
    let own = format!("metadata.name={LB}");
    let own_machine = format!("metadata.name={LBM}");

    // Allowed: what the agent does.
    assert_eq!(
        lbs.get(LB).await.unwrap().metadata.name.as_deref(),
        Some(LB)
    );
    let list = lbs.list(&ListParams::default().fields(&own)).await.unwrap();
    assert_eq!(list.items.len(), 1);
    let version = list.metadata.resource_version.clone().unwrap();
    let mut stream = lbs
        .watch(&WatchParams::default().fields(&own), &version)
        .await
        .expect("a watch of its own LoadBalancer")
        .boxed();
    h.lbs
        .patch(
            LB,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {"test": "watched"}}})),
        )
        .await
        .unwrap();
    let event = tokio::time::timeout(WITHIN, async {
        loop {
            match stream.next().await {
                Some(Ok(WatchEvent::Bookmark(_))) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the watch delivers the change");
    assert!(
        matches!(&event, Some(Ok(WatchEvent::Modified(lb))) if lb.metadata.name.as_deref() == Some(LB)),
        "{event:?}"
    );
    drop(stream);
    lbms.list(&ListParams::default().fields(&own_machine))
        .await
        .unwrap();
    lbms.get(LBM).await.unwrap();
    let marked = json!({"status": {"conditions": [{
        "type": "KeepalivedMaster", "status": "True", "reason": "KeepalivedStatus", "message": "test",
        "lastHeartbeatTime": "2023-01-01T00:00:00Z", "lastTransitionTime": "2023-01-01T00:00:00Z"
    }]}});
    lbms.patch_status(LBM, &PatchParams::default(), &Patch::Merge(&marked))
        .await
        .expect("patching its own status");
    let event = |ns: &str| Event {
        metadata: ObjectMeta {
            generate_name: Some(format!("{LBM}.")),
            namespace: Some(ns.to_string()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("yawol.stackit.cloud/v1beta1".into()),
            kind: Some("LoadBalancerMachine".into()),
            name: Some(LBM.into()),
            namespace: Some(ns.to_string()),
            ..Default::default()
        },
        type_: Some("Normal".into()),
        reason: Some("Test".into()),
        message: Some("from the machine's token".into()),
        ..Default::default()
    };
    Api::<Event>::namespaced(client.clone(), &h.ns)
        .create(&PostParams::default(), &event(&h.ns))
        .await
        .expect("creating an Event");

    // Forbidden: everything else.
    assert_forbidden(
        "listing the namespace's LoadBalancers",
        lbs.list(&ListParams::default()).await,
    );
    assert_forbidden(
        "watching the namespace's LoadBalancers",
        lbs.watch(&WatchParams::default(), &version)
            .await
            .map(|_| ()),
    );
    assert_forbidden(
        "listing the namespace's LoadBalancerMachines",
        lbms.list(&ListParams::default()).await,
    );
    assert_forbidden(
        "listing another LoadBalancer by field selector",
        lbs.list(&ListParams::default().fields("metadata.name=lb-2"))
            .await,
    );
    assert_forbidden("getting another LoadBalancer", lbs.get("lb-2").await);
    assert_forbidden(
        "getting another LoadBalancerMachine",
        lbms.get("lb-2-fghij-abc34").await,
    );
    assert_forbidden(
        "patching another machine's status",
        lbms.patch_status(
            "lb-2-fghij-abc34",
            &PatchParams::default(),
            &Patch::Merge(&marked),
        )
        .await,
    );
    let mut other_machine: LoadBalancerMachine = h.lbms.get("lb-2-fghij-abc34").await.unwrap();
    other_machine.status = serde_json::from_value(marked["status"].clone()).unwrap();
    assert_forbidden(
        "updating another machine's status",
        lbms.replace_status("lb-2-fghij-abc34", &PostParams::default(), &other_machine)
            .await,
    );
    assert_forbidden(
        "patching its own LoadBalancer",
        lbs.patch(
            LB,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"replicas": 3}})),
        )
        .await,
    );
    assert_forbidden(
        "patching its own LoadBalancer's status",
        lbs.patch_status(
            LB,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"portIP": "192.0.2.99"}})),
        )
        .await,
    );
    assert_forbidden(
        "deleting its own LoadBalancerMachine",
        lbms.delete(LBM, &DeleteParams::default()).await,
    );
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &h.ns);
    assert_forbidden(
        "listing Secrets",
        secrets.list(&ListParams::default()).await,
    );
    assert_forbidden("reading a Secret", secrets.get("cloud").await);
    assert_forbidden(
        "listing Events",
        Api::<Event>::namespaced(client.clone(), &h.ns)
            .list(&ListParams::default())
            .await,
    );
    let other_lbs: Api<LoadBalancer> = Api::namespaced(client.clone(), &other_ns.ns);
    let other_lbms: Api<LoadBalancerMachine> = Api::namespaced(client.clone(), &other_ns.ns);
    assert_forbidden(
        "getting the same-named LoadBalancer in another namespace",
        other_lbs.get(LB).await,
    );
    assert_forbidden(
        "listing the same-named LoadBalancer in another namespace",
        other_lbs.list(&ListParams::default().fields(&own)).await,
    );
    assert_forbidden(
        "getting the same-named LoadBalancerMachine in another namespace",
        other_lbms.get(LBM).await,
    );
    assert_forbidden(
        "patching the same-named machine's status in another namespace",
        other_lbms
            .patch_status(LBM, &PatchParams::default(), &Patch::Merge(&marked))
            .await,
    );
    assert_forbidden(
        "creating an Event in another namespace",
        Api::<Event>::namespaced(client.clone(), &other_ns.ns)
            .create(&PostParams::default(), &event(&other_ns.ns))
            .await,
    );
    assert_forbidden(
        "listing LoadBalancers of all namespaces",
        Api::<LoadBalancer>::all(client.clone())
            .list(&ListParams::default().fields(&own))
            .await,
    );

    // Nothing forbidden was done after all.
    assert!(h.lbs.get_opt("lb-2").await.unwrap().is_some());
    assert!(h.machine().await.is_some());
}

/// Records every version of the LoadBalancerMachine the API server stores from its start on (an admin watch).
struct MachineVersions {
    seen: Arc<Mutex<Vec<LoadBalancerMachine>>>,
    task: tokio::task::JoinHandle<()>,
}

impl MachineVersions {
    /// Starts watching; returns once the watch has listed (every later version is then seen).
    async fn start(lbms: &Api<LoadBalancerMachine>) -> Self {
        let seen: Arc<Mutex<Vec<LoadBalancerMachine>>> = Arc::default();
        let (listed_tx, listed) = tokio::sync::oneshot::channel();
        let task = {
            let seen = seen.clone();
            let lbms = lbms.clone();
            tokio::spawn(async move {
                let cfg = watcher::Config::default().fields(&format!("metadata.name={LBM}"));
                let mut stream = std::pin::pin!(watcher(lbms, cfg).default_backoff());
                let mut listed_tx = Some(listed_tx);
                while let Some(event) = stream.next().await {
                    match event {
                        Ok(watcher::Event::Apply(m) | watcher::Event::InitApply(m)) => {
                            seen.lock().unwrap().push(m)
                        }
                        Ok(watcher::Event::InitDone) => {
                            let _ = listed_tx.take().map(|tx| tx.send(()));
                        }
                        _ => {}
                    }
                }
            })
        };
        tokio::time::timeout(WITHIN, listed)
            .await
            .expect("the machine's versions listed")
            .unwrap();
        MachineVersions { seen, task }
    }

    /// The conditions of every version seen so far whose `DataplaneUpToDate` heartbeat is `heartbeat`.
    fn written_at(&self, heartbeat: &Time) -> Vec<Vec<NodeCondition>> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|m| conditions_of(Some(m)))
            .filter(|c| {
                find(c, "DataplaneUpToDate").and_then(|c| c.last_heartbeat_time.as_ref())
                    == Some(heartbeat)
            })
            .collect()
    }
}

impl Drop for MachineVersions {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn up_to_date_at(c: &[NodeCondition], generation: u64) -> bool {
    is(c, "DataplaneUpToDate", "True")
        && message(c, "DataplaneUpToDate")
            .ends_with(&format!("runs configuration generation {generation}"))
}

/// Waits until the API server serves `generation` of the LoadBalancer from its watch cache (what a list at
/// resourceVersion 0 — the agent's relist — reads) and the machine's token is authorised again (RBAC comes up
/// with the API server): whatever the agent does next sees the new generation.
async fn settled(h: &Harness, generation: i64) {
    let cached = ListParams::default()
        .fields(&format!("metadata.name={LB}"))
        .at("0")
        .matching(kube::api::VersionMatch::NotOlderThan);
    wait_for("the new generation in the API server's cache", || async {
        let list = h.lbs.list(&cached).await?;
        Ok(list.items.first().and_then(|lb| lb.metadata.generation) == Some(generation))
    })
    .await
    .unwrap();
    let own: Api<LoadBalancerMachine> = Api::namespaced(h.machine_client.clone(), &h.ns);
    wait_for("the machine's token authorised again", || async {
        Ok(own.get(LBM).await.is_ok())
    })
    .await
    .unwrap();
}

/// An API-server outage, etcd compacted and the LoadBalancer changed when it comes back.
///
/// 1. A long outage (the agent's relists are refused, its backoff grows): once the API server is back, the agent
///    says `DataplaneUpToDate=False` ("not confirmed: the LoadBalancer watch is not in sync …") until it has
///    listed again, never True for the generation it had, and then reaches the new one. Not at once: each refused
///    request dropped the watch's resourceVersion, so the first request after the outage is a fresh list (never
///    a 410), made when the backoff grown during the outage runs out (bounded by its cap plus jitter here).
/// 2. A restart the agent only notices when its watch resumes (it was held meanwhile, like a short restart
///    between two reads of the stream): the resumed watch's resourceVersion is compacted away, the API server
///    answers 410 Gone, and the agent relists at once instead of waiting out the backoff grown in 1.
///
/// The agent runs on a runtime of its own, held while the test restarts the API server, compacts and patches:
/// the LoadBalancer has changed before the agent can look, whatever its backoff's jitter.
#[tokio::test]
async fn a_410_after_compaction_relists_at_once_and_up_to_date_waits_for_it() {
    let env = KubeEnv::start().await.expect("a private cluster");
    let agent = AgentRuntime::new();
    let h = Harness::start_on(&env, Some(&agent), async |lbs, lbms, ns| {
        create(lbs, lbms, good_lb(ns), Some(VIP)).await
    })
    .await;
    h.wait_conditions("generation 1 up to date", |c| up_to_date_at(c, 1))
        .await;

    // 1. The outage. The API server stops listening at SIGTERM but keeps the agent's watch open until it is
    //    killed (`stop_apiserver` waits 10 s for it to exit): the watch breaks then. 12 s of refused requests
    //    after that are four failed relists at least (0.8 s doubling, jitter adds up to as much again), so the
    //    agent's next delay is 12.8 s or more.
    let stopping = Instant::now();
    env.stop_apiserver();
    let stop_took = stopping.elapsed();
    tokio::time::sleep(Duration::from_secs(12)).await;
    let held = agent.hold().await;
    let back = h.advance_clock(600);
    env.restart_apiserver()
        .await
        .expect("the API server restarts");
    env.compact_etcd().await.expect("etcd compacted");
    let lb = h.patch_spec(json!({"ports": [{"name": "https", "protocol": "TCP", "port": 443, "nodePort": 30443}]})).await;
    assert_eq!(lb.metadata.generation, Some(2));
    settled(&h, 2).await;
    let versions = MachineVersions::start(&h.lbms).await;
    drop(held);
    let released = Instant::now();
    let mut config = h.mode.config.clone();
    tokio::time::timeout(
        Duration::from_secs(75),
        config.wait_for(|s| matches!(s, ConfigState::Valid(_, 2))),
    )
    .await
    .expect("generation 2 in the agent's config (its backoff is capped at 30 s, plus up to 100% jitter)")
    .unwrap();
    let relisted_after = released.elapsed();
    eventually("generation 2 in effect", || async {
        (h.in_effect_generation() == Some(2)).then_some(())
    })
    .await;
    h.wait_conditions("generation 2 up to date", |c| up_to_date_at(c, 2))
        .await;
    let written = versions.written_at(&back);
    drop(versions);
    let summary: Vec<String> = written
        .iter()
        .map(|c| {
            format!(
                "{} {}",
                find(c, "DataplaneUpToDate").unwrap().status,
                message(c, "DataplaneUpToDate")
            )
        })
        .collect();
    eprintln!(
        "outage: stop took {stop_took:?}; generation 2 reached the agent {relisted_after:?} after the API \
         server was back; statuses since: {summary:#?}"
    );
    let first = written.first().expect("statuses written after the restart");
    assert!(
        is(first, "DataplaneUpToDate", "False")
            && message(first, "DataplaneUpToDate")
                .starts_with("not confirmed: the LoadBalancer watch is not in sync"),
        "the first status after the restart says the generation is not confirmed: {summary:#?}"
    );
    assert!(
        is(first, "EnvoyUpToDate", "False"),
        "the same truth under yawol's name: {first:?}"
    );
    assert!(
        !written.iter().any(|c| up_to_date_at(c, 1)),
        "generation 1 reported up to date after the API server came back with generation 2: {summary:#?}"
    );

    // 2. The resumed watch meets a compacted history: 410 Gone, relisted at once.
    let held = agent.hold().await;
    env.stop_apiserver();
    env.restart_apiserver()
        .await
        .expect("the API server restarts");
    env.compact_etcd().await.expect("etcd compacted");
    let lb = h.patch_spec(json!({"ports": [{"name": "https", "protocol": "TCP", "port": 8443, "nodePort": 30443}]})).await;
    assert_eq!(lb.metadata.generation, Some(3));
    settled(&h, 3).await;
    drop(held);
    let released = Instant::now();
    tokio::time::timeout(
        Duration::from_secs(10),
        config.wait_for(|s| matches!(s, ConfigState::Valid(_, 3))),
    )
    .await
    .unwrap_or_else(|_| {
        panic!(
            "generation 3 not in the agent's config {:?} after its watch resumed: it waited for its backoff \
             (12.8 s or more after 1) instead of relisting at once on 410 Gone",
            released.elapsed()
        )
    })
    .unwrap();
    eprintln!(
        "410: generation 3 reached the agent {:?} after it resumed",
        released.elapsed()
    );
    h.wait_conditions("generation 3 up to date", |c| up_to_date_at(c, 3))
        .await;
}

/// On a machine a yawol-controller manages, the agent runs under yawol's Role (`GetRoleRules`: six rules, events
/// in the core group only) with no `--machine-revision`. That Role is enough for all of Kubernetes mode — the
/// watch, the status, Events, the revision from the machine's annotation, ad-hoc debug, the reports of logForward
/// and PROXY protocol (not implemented: False conditions and Warning Events, while the machine is ready and
/// forwards) — and the API server refuses none of its requests. Started as yawollet, it writes yawollet's
/// steady-state `ConfigReady` reason and attributes its Events to `yawollet`.
#[tokio::test]
async fn under_yawols_role_revision_ad_hoc_debug_and_unsupported_options() {
    const REVISION: &str = "loadbalancer.yawol.stackit.cloud/revision";
    const KEY: &str = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQDkubeModeTest+/=";
    let env = KubeEnv::shared();
    let cluster = Cluster::new(env).await;
    let ns = cluster.ns.clone();
    let mut lb = good_lb(&ns);
    lb["metadata"]["annotations"] = json!({ REVISION: "2" });
    lb["spec"]["options"]["logForward"] =
        json!({"enabled": true, "lokiUrl": "http://loki.example:3100/loki/api/v1/push"});
    // What yawol-controller and ours write for `tcpProxyProtocol: "true"` + `tcpProxyProtocolPortsFilter: "80,443"`.
    lb["spec"]["options"]["tcpProxyProtocol"] = json!(true);
    lb["spec"]["options"]["tcpProxyProtocolPortFilter"] = json!([80, 443]);
    let mut lbm = lbm_json(&ns, LBM, LB);
    lbm["metadata"]["annotations"] = json!({ REVISION: "2" });
    let pp = PostParams::default();
    cluster
        .lbms
        .create(&pp, &serde_json::from_value(lbm).unwrap())
        .await
        .unwrap();
    cluster
        .lbs
        .create(&pp, &serde_json::from_value(lb).unwrap())
        .await
        .unwrap();
    set_port_ip(&cluster.lbs, VIP).await;

    // The machine's identity as yawol-controller creates it.
    let meta = || ObjectMeta {
        name: Some(LBM.into()),
        namespace: Some(ns.clone()),
        ..Default::default()
    };
    Api::<ServiceAccount>::namespaced(cluster.admin.clone(), &ns)
        .create(
            &pp,
            &ServiceAccount {
                metadata: meta(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    Api::<Role>::namespaced(cluster.admin.clone(), &ns)
        .create(
            &pp,
            &Role {
                metadata: meta(),
                rules: Some(yawol::role_rules(LB, LBM)),
            },
        )
        .await
        .unwrap();
    let mut binding = rbac::role_binding(&MachineIdentity {
        namespace: ns.clone(),
        machine: LBM.into(),
        machine_uid: String::new(),
        loadbalancer: LB.into(),
    });
    binding.metadata.owner_references = None;
    Api::<RoleBinding>::namespaced(cluster.admin.clone(), &ns)
        .create(&pp, &binding)
        .await
        .unwrap();
    let token = env.token(&cluster.admin, &ns, LBM).await.unwrap();
    // A client outside the record waits for RBAC to take effect; the agent's records every refusal.
    let probe: Api<LoadBalancerMachine> =
        Api::namespaced(env.token_client(&token).await.unwrap(), &ns);
    wait_for("yawol's Role in effect", || async {
        Ok(!matches!(probe.get(LBM).await, Err(kube::Error::Api(s)) if s.code == 403))
    })
    .await
    .unwrap();
    let refusals = kube_testenv::Refusals::default();
    let client = refusals
        .client(&env.token_kubeconfig(&token), "agent")
        .await
        .unwrap();

    // Ad-hoc debug on a key file of the test's, sshd played by a log of the calls.
    let dir = std::env::temp_dir().join(format!("kube-mode-adhoc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("authorized_keys");
    std::fs::write(&keys, "").unwrap();
    let calls = dir.join("sshd");
    let sshd = |what: &str| {
        vec![
            "sh".to_string(),
            "-c".to_string(),
            format!("echo {what} >> {}", calls.display()),
        ]
    };
    let settings = KubeSettings {
        namespace: ns.clone(),
        loadbalancer: LB.into(),
        machine: LBM.into(),
        health_check: HealthCheckSpec::default(),
        requeue: REQUEUE,
        clock: kube_mode::system_clock(),
        machine_revision: None,
        ad_hoc_debug: Some(kube_mode::debug::AdHocDebugSettings {
            user: "yawoldebug".into(),
            authorized_keys: keys.clone(),
            start_sshd: sshd("start"),
            stop_sshd: sshd("stop"),
        }),
        // Started as yawollet, as on such a machine.
        yawollet: Some(kube_mode::yawollet::Compat {
            keepalived_stats: true,
        }),
        // An agent at TC, which inserts no PROXY v2 header: `tcpProxyProtocol` is reported as not implemented.
        proxy_v2: false,
    };
    let (status_tx, status_rx) = watch::channel(AgentStatus::default());
    let mode = kube_mode::start(client, settings, status_rx, SharedSnapshot::default());
    tokio::spawn(fake_agent(
        mode.config.clone(),
        status_tx,
        InEffect::default(),
    ));

    // The revision comes from the machine's annotation: this machine is of the newest revision.
    let mut config = mode.config.clone();
    tokio::time::timeout(
        WITHIN,
        config
            .wait_for(|s| matches!(s, ConfigState::Valid(c, _) if c.newest_revision == Some(true))),
    )
    .await
    .expect("the revision learnt from the machine's annotation")
    .unwrap();
    let machine = |c: &[NodeCondition]| {
        ["ConfigReady", "EnvoyReady", "EnvoyUpToDate"]
            .iter()
            .all(|t| is(c, t, "True"))
            && is(c, "LogForward", "False")
            && is(c, "ProxyProtocol", "False")
    };
    let c = eventually("ready, LogForward=False, ProxyProtocol=False", || async {
        let c = conditions_of(cluster.lbms.get_opt(LBM).await.unwrap().as_ref());
        machine(&c).then_some(c)
    })
    .await;
    assert_eq!(
        find(&c, "LogForward").unwrap().reason.as_deref(),
        Some("LogForwardNotSupported")
    );
    // yawollet's steady-state reason: "updated" was for the write that reported the new configuration.
    eventually("ConfigReady=True/EnvoyConfigurationCreated", || async {
        let c = conditions_of(cluster.lbms.get_opt(LBM).await.unwrap().as_ref());
        (find(&c, "ConfigReady").and_then(|c| c.reason.as_deref())
            == Some("EnvoyConfigurationCreated"))
        .then_some(())
    })
    .await;
    let pp = find(&c, "ProxyProtocol").unwrap();
    assert_eq!(pp.reason.as_deref(), Some("ProxyProtocolNotSupported"));
    assert!(
        pp.message
            .as_deref()
            .unwrap()
            .contains("TCP port(s) 80 are forwarded without a PROXY protocol header"),
        "{pp:?}"
    );

    let annotate = |v: Value| {
        let lbs = cluster.lbs.clone();
        async move {
            lbs.patch(
                LB,
                &PatchParams::default(),
                &Patch::Merge(&json!({"metadata": {"annotations": v}})),
            )
            .await
            .unwrap();
        }
    };
    annotate(json!({
        "yawol.stackit.cloud/adHocDebug": "true",
        "yawol.stackit.cloud/adHocDebugSSHKey": KEY,
    }))
    .await;
    eventually("the key installed", || async {
        (std::fs::read_to_string(&keys).unwrap() == format!("{KEY}\n")).then_some(())
    })
    .await;
    annotate(json!({
        "yawol.stackit.cloud/adHocDebug": null,
        "yawol.stackit.cloud/adHocDebugSSHKey": null,
    }))
    .await;
    eventually("the key removed", || async {
        std::fs::read_to_string(&keys)
            .unwrap()
            .is_empty()
            .then_some(())
    })
    .await;
    // sshd is stopped after the key file is emptied: wait for it too.
    eventually("sshd started once and stopped once", || async {
        (std::fs::read_to_string(&calls).unwrap() == "start\nstop\n").then_some(())
    })
    .await;
    let events: Api<Event> = Api::namespaced(cluster.admin.clone(), &ns);
    let items = eventually("the Events", || async {
        let items = events.list(&ListParams::default()).await.unwrap().items;
        [
            "LogForwardNotSupported",
            "ProxyProtocolNotSupported",
            "AdHocDebuggingEnabled",
            "AdHocDebuggingDisabled",
        ]
        .iter()
        .all(|r| items.iter().any(|e| e.reason.as_deref() == Some(r)))
        .then_some(items)
    })
    .await;
    let reasons: Vec<&str> = items.iter().filter_map(|e| e.reason.as_deref()).collect();
    assert!(reasons.contains(&"Update"), "{reasons:?}");
    // yawollet's recorder name on the machine, so filters and alerts on the component keep finding them; the
    // unsupported options also on the LoadBalancer as `yawol-service`, which yawol's controller re-emits on the
    // Service (written under yawol's Role: events create in the namespace).
    for e in &items {
        let component = e.source.as_ref().and_then(|s| s.component.as_deref());
        let expected = match e.involved_object.kind.as_deref() {
            Some("LoadBalancer") => "yawol-service",
            _ => "yawollet",
        };
        assert_eq!(
            (component, e.reporting_component.as_deref()),
            (Some(expected), Some(expected)),
            "{e:?}"
        );
    }
    let on_lb: Vec<&str> = items
        .iter()
        .filter(|e| e.involved_object.kind.as_deref() == Some("LoadBalancer"))
        .filter_map(|e| e.reason.as_deref())
        .collect();
    assert!(
        on_lb.contains(&"LogForwardNotSupported") && on_lb.contains(&"ProxyProtocolNotSupported"),
        "{on_lb:?}"
    );
    refusals.assert_none().unwrap();
    drop(mode);
    let _ = std::fs::remove_dir_all(&dir);
}
