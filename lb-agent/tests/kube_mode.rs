//! Kubernetes mode against `FakeApiServer` (an in-memory kube-apiserver that a real `kube::Client` talks
//! to). No root, no BPF: a fake agent stands in for the data-plane loop, turning `ConfigState` into
//! `AgentStatus` the way `agent::run` does.

use k8s_openapi::api::core::v1::NodeCondition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use lb_agent::agent::{AgentStatus, ConfigState};
use lb_agent::config::DesiredConfig;
use lb_agent::health::HealthCheckSpec;
use lb_agent::kube::{self as kube_mode, KubeMode, KubeSettings};
use lb_agent::metrics::{ServiceMetrics, SharedSnapshot, Snapshot};
use lb_agent::model::{Protocol, ServiceId};
use lb_api::fake_api::{FakeApiServer, ResourceKey};
use lb_api::{LoadBalancer, LoadBalancerMachine};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

const NS: &str = "yawol";
const LB: &str = "lb-1";
const LBM: &str = "lb-1-abcde-xyz12";
/// Heartbeat period in these tests: short, so the tests are fast without controlling tokio time (the
/// fake API server and kube-runtime run on real time).
const REQUEUE: Duration = Duration::from_millis(150);
/// Upper bound for anything to happen.
const WITHIN: Duration = Duration::from_secs(5);
/// Start of the fake clock (seconds since the epoch).
const T0: i64 = 1_700_000_000;

fn lb_json(ports: Value, endpoints: Value, options: Value) -> Value {
    json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": LB, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": "abc"}},
            "replicas": 1,
            "ports": ports,
            "endpoints": endpoints,
            "options": options,
            "infrastructure": {
                "defaultNetwork": {"networkID": "net-1"},
                "flavor": {"flavorID": "flavor-1"}, "image": {"imageID": "image-1"},
                "availabilityZone": "az-1", "authSecretRef": {"name": "cloud", "namespace": NS}
            }
        }
    })
}

fn good_lb() -> Value {
    lb_json(
        json!([{"name": "http", "protocol": "TCP", "port": 80, "nodePort": 30080},
               {"name": "dns", "protocol": "UDP", "port": 53, "nodePort": 30053}]),
        json!([{"name": "node-1", "addresses": ["10.0.0.11"]},
               {"name": "node-2", "addresses": ["10.0.0.12", "fd00::12"]}]),
        json!({"loadBalancerSourceRanges": ["10.0.0.0/8"]}),
    )
}

fn lbm_json() -> Value {
    json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerMachine",
        "metadata": {"name": LBM, "namespace": NS},
        "spec": {
            "portID": "port-1",
            "loadBalancerRef": {"name": LB, "namespace": NS},
            "infrastructure": {
                "defaultNetwork": {"networkID": "net-1"},
                "flavor": {"flavorID": "flavor-1"}, "image": {"imageID": "image-1"},
                "availabilityZone": "az-1", "authSecretRef": {"name": "cloud", "namespace": NS}
            }
        }
    })
}

/// The config in effect in the fake data plane (what `agent::run` would have in its maps).
type InEffect = Arc<Mutex<Option<(Arc<DesiredConfig>, u64)>>>;

struct Harness {
    server: FakeApiServer,
    lbs: Api<LoadBalancer>,
    lbms: Api<LoadBalancerMachine>,
    clock: Arc<Mutex<i64>>,
    in_effect: InEffect,
    mode: KubeMode,
    _status_tx: watch::Sender<AgentStatus>,
}

impl Harness {
    /// Starts Kubernetes mode against a fresh fake API server; `seed` creates objects first.
    async fn start(seed: impl AsyncFnOnce(&Api<LoadBalancer>, &Api<LoadBalancerMachine>)) -> Self {
        if std::env::var_os("TEST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter("debug,hyper=info,tower=info")
                .with_test_writer()
                .try_init();
        }
        let server = FakeApiServer::new();
        for (_, crd) in lb_api::crds() {
            server.install_crd(&crd);
        }
        let client = server.client();
        let lbs: Api<LoadBalancer> = Api::namespaced(client.clone(), NS);
        let lbms: Api<LoadBalancerMachine> = Api::namespaced(client.clone(), NS);
        seed(&lbs, &lbms).await;
        let clock = Arc::new(Mutex::new(T0));
        let c = clock.clone();
        let settings = KubeSettings {
            namespace: NS.into(),
            loadbalancer: LB.into(),
            machine: LBM.into(),
            health_check: HealthCheckSpec::default(),
            requeue: REQUEUE,
            clock: Arc::new(move || Time(Timestamp::from_second(*c.lock().unwrap()).unwrap())),
            machine_revision: None,
        };
        let (status_tx, status_rx) = watch::channel(AgentStatus::default());
        let snapshot: SharedSnapshot = Arc::new(std::sync::RwLock::new(sample_snapshot()));
        let mode = kube_mode::start(client, settings, status_rx, snapshot);
        let in_effect = InEffect::default();
        tokio::spawn(fake_agent(
            mode.config.clone(),
            status_tx.clone(),
            in_effect.clone(),
        ));
        Harness {
            server,
            lbs,
            lbms,
            clock,
            in_effect,
            mode,
            _status_tx: status_tx,
        }
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

    fn machine(&self) -> Option<LoadBalancerMachine> {
        let v = self.server.get(
            &ResourceKey::new("yawol.stackit.cloud", "loadbalancermachines"),
            NS,
            LBM,
        )?;
        Some(serde_json::from_value(v).expect("LBM deserializes"))
    }

    fn conditions(&self) -> Vec<NodeCondition> {
        self.machine()
            .and_then(|m| m.status)
            .and_then(|s| s.conditions)
            .unwrap_or_default()
    }

    /// Waits until the machine's conditions satisfy `pred`.
    async fn wait_conditions(
        &self,
        what: &str,
        pred: impl Fn(&[NodeCondition]) -> bool,
    ) -> Vec<NodeCondition> {
        eventually(what, || {
            let c = self.conditions();
            pred(&c).then_some(c)
        })
        .await
    }

    fn events(&self) -> Vec<Value> {
        self.server
            .list(&ResourceKey::new("", "events"))
            .into_iter()
            .filter(|e| e["involvedObject"]["name"] == LBM)
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
                vip: "192.0.2.10".parse().unwrap(),
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

async fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + WITHIN;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn find<'a>(c: &'a [NodeCondition], type_: &str) -> Option<&'a NodeCondition> {
    c.iter().find(|c| c.type_ == type_)
}

fn is(c: &[NodeCondition], type_: &str, status: &str) -> bool {
    find(c, type_).is_some_and(|c| c.status == status)
}

async fn create(
    lbs: &Api<LoadBalancer>,
    lbms: &Api<LoadBalancerMachine>,
    lb: Value,
    port_ip: Option<&str>,
) {
    lbms.create(
        &PostParams::default(),
        &serde_json::from_value(lbm_json()).unwrap(),
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

#[tokio::test]
async fn without_port_ip_the_config_is_pending_until_the_vip_exists() {
    let h = Harness::start(async |lbs, lbms| create(lbs, lbms, good_lb(), None).await).await;
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

    set_port_ip(&h.lbs, "192.0.2.10").await;
    let state = h
        .wait_config("a valid config", |s| matches!(s, ConfigState::Valid(..)))
        .await;
    let ConfigState::Valid(cfg, generation) = state else {
        unreachable!()
    };
    assert_eq!(generation, 1, "metadata.generation of a new object");
    assert_eq!(cfg.services.len(), 2);
    h.wait_conditions("ConfigReady=True", |c| is(c, "ConfigReady", "True"))
        .await;
}

#[tokio::test]
async fn ports_and_endpoints_become_services_and_the_machine_reports_ready() {
    let h =
        Harness::start(async |lbs, lbms| create(lbs, lbms, good_lb(), Some("192.0.2.10")).await)
            .await;
    let ConfigState::Valid(cfg, 1) = h
        .wait_config("valid", |s| matches!(s, ConfigState::Valid(..)))
        .await
    else {
        panic!("generation 1 expected")
    };
    let vip = "192.0.2.10".parse().unwrap();
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
    let events = h.events();
    assert!(
        events
            .iter()
            .any(|e| e["type"] == "Normal" && e["reason"] == "Update"),
        "an Update event when the config is applied: {events:?}"
    );
}

#[tokio::test]
async fn a_spec_change_is_a_new_generation_and_status_updates_are_not() {
    let h =
        Harness::start(async |lbs, lbms| create(lbs, lbms, good_lb(), Some("192.0.2.10")).await)
            .await;
    h.wait_config("generation 1", |s| matches!(s, ConfigState::Valid(_, 1)))
        .await;

    // Status-only changes (written by the controllers) must not wake the agent.
    let mut rx = h.mode.config.clone();
    rx.borrow_and_update();
    h.lbs
        .patch_status(
            LB,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"readyReplicas": 1}})),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
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
async fn an_invalid_spec_is_rejected_with_a_warning_and_the_last_config_keeps_forwarding() {
    let h =
        Harness::start(async |lbs, lbms| create(lbs, lbms, good_lb(), Some("192.0.2.10")).await)
            .await;
    let ConfigState::Valid(good, 1) = h
        .wait_config("generation 1", |s| matches!(s, ConfigState::Valid(_, 1)))
        .await
    else {
        unreachable!()
    };
    h.wait_conditions("ready", |c| is(c, "EnvoyUpToDate", "True"))
        .await;

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
    for (what, spec, needle) in cases {
        // Back to the good spec between cases, so each rejection stands alone.
        h.patch_spec(good_lb()["spec"].clone()).await;
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

        let event = eventually(&format!("{what}: Warning event"), || {
            h.events().into_iter().find(|e| {
                e["type"] == "Warning"
                    && e["reason"] == "ConfigurationRejected"
                    && e["message"].as_str().unwrap_or("").contains(needle)
            })
        })
        .await;
        let uid = h.machine().unwrap().metadata.uid;
        assert_eq!(
            event["involvedObject"]["uid"].as_str(),
            uid.as_deref(),
            "kubectl describe finds it"
        );
        assert_eq!(event["involvedObject"]["kind"], "LoadBalancerMachine");
        assert_eq!(event["source"]["component"], "lb-agent");

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
        !h.events().iter().any(|e| e["reason"] == "ApplyFailed"),
        "rejections are not reported twice"
    );
}

#[tokio::test]
async fn heartbeats_advance_while_transition_times_stay_and_metrics_are_written() {
    let h =
        Harness::start(async |lbs, lbms| create(lbs, lbms, good_lb(), Some("192.0.2.10")).await)
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

    let m = h.machine().unwrap().status.unwrap().metrics.unwrap();
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
        let m = h.machine().unwrap().status.unwrap().metrics.unwrap();
        assert!(
            m.iter().all(|x| x.time == now),
            "metrics refreshed with the heartbeat"
        );
    }
}

#[tokio::test]
async fn conditions_written_by_others_survive() {
    let h = Harness::start(async |lbs, lbms| {
        create(lbs, lbms, good_lb(), Some("192.0.2.10")).await;
        let marked = json!({"status": {"conditions": [{
            "type": "MarkedForDeletion", "status": "True", "reason": "PendingDeletion", "message": "stale",
            "lastHeartbeatTime": "2023-01-01T00:00:00Z", "lastTransitionTime": "2023-01-01T00:00:00Z"
        }]}});
        lbms.patch_status(LBM, &PatchParams::default(), &Patch::Merge(&marked)).await.unwrap();
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
    // Nothing exists yet: the config stays Pending, status writes fail and are retried.
    let h = Harness::start(async |_, _| {}).await;
    tokio::time::sleep(REQUEUE * 4).await;
    assert!(
        !h.mode.is_finished(),
        "the tasks survive a missing LoadBalancerMachine"
    );
    assert!(matches!(*h.mode.config.borrow(), ConfigState::Pending));
    assert!(h.machine().is_none());

    create(&h.lbs, &h.lbms, good_lb(), Some("192.0.2.10")).await;
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
    tokio::time::sleep(REQUEUE * 2).await;
    assert!(matches!(*h.mode.config.borrow(), ConfigState::Valid(_, 1)));
    assert!(!h.mode.is_finished());
}

#[tokio::test]
async fn an_unreachable_api_server_is_retried_with_backoff() {
    // Nothing listens on the discard port: every request fails with "connection refused".
    // A real client (rustls inside), so pick the crypto provider as the agent's main does.
    lb_agent::tls::install_crypto_provider();
    let client =
        kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
    let (_status_tx, status_rx) = watch::channel(AgentStatus {
        dataplane_ready: true,
        ..Default::default()
    });
    let settings = KubeSettings {
        namespace: NS.into(),
        loadbalancer: LB.into(),
        machine: LBM.into(),
        health_check: HealthCheckSpec::default(),
        requeue: REQUEUE,
        clock: kube_mode::system_clock(),
        machine_revision: None,
    };
    let mode = kube_mode::start(client, settings, status_rx, SharedSnapshot::default());
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!mode.is_finished(), "no task ended or panicked");
    assert!(matches!(*mode.config.borrow(), ConfigState::Pending));
}
