//! The LoadBalancer → LoadBalancerSet step and the LoadBalancerSet controller through `kube::Client` against the
//! in-memory API server, with the fake cloud. No machine controller runs: the tests play the agents (conditions,
//! `defaultPortIP`, `KeepalivedMaster`) and, where needed, let time pass by back-dating condition timestamps.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::Api;
use lb_api::fake_api::{FakeApiServer, ResourceKey};
use lb_api::{LoadBalancer, LoadBalancerMachine};
use lb_controller::events::EventPublisher;
use lb_controller::lb_controller::{FixedCloud, LbContext, LbControllerConfig, RolloutGate};
use lb_controller::lbs_controller::{LbsContext, LbsControllerConfig};
use lb_controller::metrics::Metrics;
use lb_controller::openstack::fake::FakeCloud;
use serde_json::{json, Value};

const NS: &str = "yawol";

fn lbs() -> ResourceKey {
    ResourceKey::new("yawol.stackit.cloud", "loadbalancers")
}
fn sets() -> ResourceKey {
    ResourceKey::new("yawol.stackit.cloud", "loadbalancersets")
}
fn machines() -> ResourceKey {
    ResourceKey::new("yawol.stackit.cloud", "loadbalancermachines")
}
fn events() -> ResourceKey {
    ResourceKey::new("", "events")
}
fn secrets() -> ResourceKey {
    ResourceKey::new("", "secrets")
}

fn lb_json(name: &str, replicas: i32) -> Value {
    json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": name}},
            "replicas": replicas,
            "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
            "infrastructure": {
                "defaultNetwork": {"networkID": "net", "floatingNetID": "ext"},
                "flavor": {"flavorID": "f"}, "image": {"imageID": "i"},
                "authSecretRef": {"name": "cloud", "namespace": NS}
            }
        }
    })
}

async fn wait_for(what: &str, check: impl FnMut() -> bool) {
    common::wait_within(what, Duration::from_secs(20), check).await
}

struct H {
    api: FakeApiServer,
    cloud: Arc<FakeCloud>,
    metrics: Arc<Metrics>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for H {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Rollout gate in milliseconds instead of minutes; the set controller looks every 50 ms.
fn fast_gate() -> RolloutGate {
    RolloutGate {
        master_for: Duration::from_millis(300),
        no_master_for: Duration::from_secs(3600),
        unknown_after: Duration::from_secs(3600),
    }
}

async fn start() -> H {
    start_with(LbsControllerConfig {
        requeue: Duration::from_millis(50),
        scale_up_timeout: Duration::from_secs(3600),
        deletion_poll: Duration::from_millis(20),
        outage_min_machines: 2,
    })
    .await
}

async fn start_with(set_config: LbsControllerConfig) -> H {
    let api = FakeApiServer::new();
    for (_, crd) in lb_api::crds() {
        api.install_crd(&crd);
    }
    let cloud = Arc::new(FakeCloud::new());
    let metrics = Arc::new(Metrics::new());
    let client = api.client();
    let events = Arc::new(EventPublisher::new(client.clone(), "yawol-service", "test"));
    let ctx = Arc::new(LbContext {
        client: client.clone(),
        clouds: FixedCloud(cloud.clone()),
        events: events.clone(),
        config: LbControllerConfig {
            resync: Duration::from_secs(300),
            deletion_poll: Duration::from_millis(20),
            rollout: fast_gate(),
        },
        metrics: metrics.clone(),
    });
    let set_ctx = Arc::new(LbsContext {
        client,
        events,
        metrics: metrics.clone(),
        config: set_config,
    });
    let tasks = vec![
        tokio::spawn(async move {
            lb_controller::lb_controller::run(
                ctx,
                NS,
                lb_controller::stop::Stop::on(std::future::pending()),
            )
            .await
        }),
        tokio::spawn(async move {
            lb_controller::lbs_controller::run(
                set_ctx,
                NS,
                lb_controller::stop::Stop::on(std::future::pending()),
            )
            .await
        }),
    ];
    H {
        api,
        cloud,
        metrics,
        tasks,
    }
}

impl H {
    fn lb(&self, name: &str) -> Value {
        self.api.get(&lbs(), NS, name).unwrap_or(Value::Null)
    }
    fn sets_of(&self, lb: &str) -> Vec<Value> {
        self.api
            .list(&sets())
            .into_iter()
            .filter(|s| s["spec"]["template"]["spec"]["loadBalancerRef"]["name"] == lb)
            .collect()
    }
    fn set(&self, name: &str) -> Value {
        self.api.get(&sets(), NS, name).unwrap_or(Value::Null)
    }
    fn machines_of_set(&self, set: &str) -> Vec<Value> {
        let mut v: Vec<Value> = self
            .api
            .list(&machines())
            .into_iter()
            .filter(|m| m["metadata"]["ownerReferences"][0]["name"] == set)
            .collect();
        v.sort_by_key(|m| m["metadata"]["name"].as_str().unwrap_or("").to_string());
        v
    }
    fn machine_names(&self, set: &str) -> BTreeSet<String> {
        self.machines_of_set(set)
            .iter()
            .map(|m| m["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    }
    fn events_with(&self, reason: &str) -> usize {
        self.api.count(&events(), |e| e["reason"] == reason)
    }
    fn reconciles(&self, controller: &str) -> u64 {
        self.metrics.reconcile_count(controller)
    }
    fn lb_api(&self) -> Api<LoadBalancer> {
        Api::namespaced(self.api.client(), NS)
    }
    fn lbm_api(&self) -> Api<LoadBalancerMachine> {
        Api::namespaced(self.api.client(), NS)
    }

    async fn create_lb(&self, obj: Value) {
        self.lb_api()
            .create(
                &PostParams::default(),
                &serde_json::from_value(obj).unwrap(),
            )
            .await
            .unwrap();
    }

    async fn patch_lb(&self, name: &str, patch: Value) {
        self.lb_api()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }

    /// Plays the agent of `machine`: fresh, healthy conditions (optionally VRRP master) and its port address.
    async fn agent(&self, machine: &str, ip: &str, master: bool) {
        self.report(machine, Some(ip), conds(10, master)).await;
    }

    async fn report(&self, machine: &str, ip: Option<&str>, conditions: Vec<Value>) {
        let mut status = json!({"conditions": conditions});
        if let Some(ip) = ip {
            status["defaultPortIP"] = json!(ip);
        }
        self.lbm_api()
            .patch_status(
                machine,
                &PatchParams::default(),
                &Patch::Merge(&json!({ "status": status })),
            )
            .await
            .unwrap();
    }

    /// Waits for `count` machines of `set`, playing a healthy agent for each as it appears (one at a time: the set
    /// controller creates the next only when the previous is ready). Returns the names in creation order.
    async fn bring_up(&self, set: &str, count: usize, ip_base: u8) -> Vec<String> {
        let mut seen = Vec::new();
        while seen.len() < count {
            let want = seen.len() + 1;
            wait_for(&format!("machine {want} of {set}"), || {
                self.machines_of_set(set).len() >= want
            })
            .await;
            let next = self
                .machine_names(set)
                .into_iter()
                .find(|n| !seen.contains(n))
                .unwrap();
            let ip = format!("10.0.{ip_base}.{}", seen.len() + 1);
            self.agent(&next, &ip, false).await;
            seen.push(next);
        }
        seen
    }

    /// Waits for a LoadBalancer reconcile after `since` (a count taken before a change), then until the LoadBalancer
    /// controller is quiet while the set controller looks five more times, so "nothing happened" means something.
    async fn settled(&self, since: u64) {
        wait_for("a LoadBalancer reconcile", || {
            self.reconciles("loadbalancer") > since
        })
        .await;
        loop {
            let before = self.reconciles("loadbalancer");
            self.reconciled("loadbalancerset", 5).await;
            if self.reconciles("loadbalancer") == before {
                return;
            }
        }
    }

    /// Waits until `controller` has reconciled `n` more times (so "nothing happened" means something).
    async fn reconciled(&self, controller: &str, n: u64) {
        let start = self.reconciles(controller);
        wait_for(&format!("{n} {controller} reconciles"), || {
            self.reconciles(controller) >= start + n
        })
        .await;
    }
}

fn ago(secs: i64) -> String {
    (jiff::Timestamp::now() - jiff::SignedDuration::from_secs(secs)).to_string()
}

fn cond(type_: &str, status: &str, heartbeat_ago: i64, transition_ago: i64) -> Value {
    json!({"type": type_, "status": status, "lastHeartbeatTime": ago(heartbeat_ago),
           "lastTransitionTime": ago(transition_ago)})
}

fn conds(heartbeat_ago: i64, master: bool) -> Vec<Value> {
    let mut c: Vec<Value> = ["ConfigReady", "DataplaneReady", "DataplaneUpToDate"]
        .iter()
        .map(|t| cond(t, "True", heartbeat_ago, 3600))
        .collect();
    c.push(cond(
        "KeepalivedMaster",
        if master { "True" } else { "False" },
        heartbeat_ago,
        3600,
    ));
    c
}

/// The current set of `lb` once it exists: `(name, hash)`.
async fn current_set(h: &H, lb: &str, revision: &str) -> String {
    wait_for(&format!("revision {revision} of {lb}"), || {
        h.lb(lb)["metadata"]["annotations"]["loadbalancer.yawol.stackit.cloud/revision"] == revision
            && h.sets_of(lb).iter().any(|s| {
                s["metadata"]["annotations"]["loadbalancer.yawol.stackit.cloud/revision"]
                    == revision
            })
    })
    .await;
    h.sets_of(lb)
        .into_iter()
        .find(|s| {
            s["metadata"]["annotations"]["loadbalancer.yawol.stackit.cloud/revision"] == revision
        })
        .unwrap()["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn sets_create_n_machines_one_at_a_time() {
    let h = start().await;
    h.create_lb(lb_json("web", 3)).await;
    let set = current_set(&h, "web", "1").await;
    let s = h.set(&set);
    let hash = s["metadata"]["labels"]["lbm-template-hash"]
        .as_str()
        .unwrap();
    assert_eq!(set, format!("web-{hash}"));
    assert_eq!(s["spec"]["replicas"], 3);
    assert_eq!(s["metadata"]["ownerReferences"][0]["kind"], "LoadBalancer");
    assert_eq!(
        s["spec"]["template"]["spec"]["portID"],
        h.lb("web")["status"]["portID"]
    );
    wait_for("set finalizer", || {
        h.set(&set)["metadata"]["finalizers"] == json!(["stackit.cloud/loadbalancermachine"])
    })
    .await;

    // One machine; while it boots, no second one, however often the controller looks.
    wait_for("first machine", || h.machines_of_set(&set).len() == 1).await;
    h.reconciled("loadbalancerset", 5).await;
    assert_eq!(h.machines_of_set(&set).len(), 1);
    let m = &h.machines_of_set(&set)[0];
    let name = m["metadata"]["name"].as_str().unwrap();
    assert!(name.starts_with(&format!("{set}-")) && name.len() == set.len() + 6);
    assert_eq!(m["metadata"]["labels"]["lbm-template-hash"], hash);
    assert_eq!(
        m["metadata"]["labels"]["yawol.stackit.cloud/loadbalancer"],
        "web"
    );
    assert_eq!(
        m["metadata"]["annotations"]["loadbalancer.yawol.stackit.cloud/revision"],
        "1"
    );
    assert_eq!(m["metadata"]["ownerReferences"][0]["name"], set.as_str());
    assert_eq!(m["spec"], s["spec"]["template"]["spec"]);

    h.bring_up(&set, 3, 1).await;
    wait_for("LB status 3/3", || {
        let st = &h.lb("web")["status"];
        st["replicas"] == 3 && st["readyReplicas"] == 3
    })
    .await;
    let st = &h.set(&set)["status"];
    assert_eq!(
        (&st["replicas"], &st["readyReplicas"]),
        (&json!(3), &json!(3))
    );
    assert_eq!(st["conditions"][0]["type"], "HasKeepalivedMaster");
    assert_eq!(st["conditions"][0]["status"], "False");
    assert_eq!(h.events_with("MachineCreated"), 3);
    assert_eq!(h.sets_of("web").len(), 1);
}

#[tokio::test]
async fn sets_hot_changes_keep_the_set_rolling_changes_replace_it_after_the_vip_moved() {
    let h = start().await;
    h.create_lb(lb_json("web", 2)).await;
    let old = current_set(&h, "web", "1").await;
    let old_machines = h.bring_up(&old, 2, 1).await;
    h.agent(&old_machines[0], "10.0.1.1", true).await;
    wait_for("old set has a master", || {
        h.set(&old)["status"]["conditions"][0]["status"] == "True"
    })
    .await;

    // Hot: ports, endpoints, options. The OpenStack step runs (new rules), no new set.
    let hash_before = h.lb("web")["status"]["openstackReconcileHash"].clone();
    let since = h.reconciles("loadbalancer");
    h.patch_lb(
        "web",
        json!({"spec": {
            "ports": [{"name": "https", "port": 443, "nodePort": 30443, "protocol": "TCP"}],
            "endpoints": [{"name": "n1", "addresses": ["10.9.0.1"]}],
            "options": {"tcpIdleTimeout": "5m0s", "loadBalancerSourceRanges": ["10.0.0.0/8"]}
        }}),
    )
    .await;
    wait_for("OpenStack step after the port change", || {
        h.lb("web")["status"]["openstackReconcileHash"] != hash_before
    })
    .await;
    h.settled(since).await;
    assert_eq!(h.sets_of("web").len(), 1, "hot change: no new set");
    assert_eq!(h.machine_names(&old).len(), 2);

    // Rolling: a new flavor.
    h.patch_lb(
        "web",
        json!({"spec": {"infrastructure": {"flavor": {"flavorID": "f2"}}}}),
    )
    .await;
    let new = current_set(&h, "web", "2").await;
    assert_ne!(new, old);
    assert_eq!(
        h.set(&new)["spec"]["template"]["spec"]["infrastructure"]["flavor"]["flavorID"],
        "f2"
    );
    assert!(h.events_with("LoadBalancerSetCreated") >= 2);
    let new_machines = h.bring_up(&new, 2, 2).await;
    assert_eq!(
        h.machines_of_set(&new)[0]["metadata"]["annotations"]
            ["loadbalancer.yawol.stackit.cloud/revision"],
        "2"
    );
    // Ready, but the VIP is still on the old set: the old set keeps its machines.
    wait_for("new set ready", || {
        h.set(&new)["status"]["readyReplicas"] == 2
    })
    .await;
    wait_for("LB status counts both sets", || {
        h.lb("web")["status"]["readyReplicas"] == 4
    })
    .await;
    h.reconciled("loadbalancerset", 5).await;
    assert_eq!(h.set(&old)["spec"]["replicas"], 2);
    assert_eq!(h.machine_names(&old).len(), 2);

    // The VIP moves: old master released, a new machine takes it.
    h.agent(&old_machines[0], "10.0.1.1", false).await;
    h.agent(&new_machines[1], "10.0.2.2", true).await;
    wait_for("new set has a master", || {
        h.set(&new)["status"]["conditions"][0]["status"] == "True"
    })
    .await;
    // After the gate (300 ms of mastership) the old set goes to 0, empties and is deleted.
    wait_for("old set deleted", || h.set(&old).is_null()).await;
    assert!(h.machine_names(&old).is_empty());
    assert_eq!(h.events_with("LoadBalancerSetScaledDown"), 1);
    assert_eq!(h.events_with("LoadBalancerSetDeleted"), 1);
    assert_eq!(h.machine_names(&new).len(), 2, "the new set is untouched");
    wait_for("LB status back to 2/2", || {
        let st = &h.lb("web")["status"];
        st["replicas"] == 2 && st["readyReplicas"] == 2
    })
    .await;
}

#[tokio::test]
async fn sets_scale_down_removes_unready_then_non_masters() {
    let h = start().await;
    h.create_lb(lb_json("web", 3)).await;
    let set = current_set(&h, "web", "1").await;
    let m = h.bring_up(&set, 3, 1).await;
    // m[0] is master, m[1] is unready, m[2] is ready.
    h.agent(&m[0], "10.0.1.1", true).await;
    let mut bad = conds(5, false);
    bad[1] = cond("DataplaneReady", "False", 5, 20);
    h.report(&m[1], None, bad).await;
    wait_for("status 3/2", || h.set(&set)["status"]["readyReplicas"] == 2).await;

    h.patch_lb("web", json!({"spec": {"replicas": 2}})).await;
    wait_for("unready machine removed", || {
        !h.machine_names(&set).contains(&m[1])
    })
    .await;
    assert_eq!(h.machine_names(&set).len(), 2);

    h.patch_lb("web", json!({"spec": {"replicas": 1}})).await;
    wait_for("non-master removed", || {
        !h.machine_names(&set).contains(&m[2])
    })
    .await;
    h.reconciled("loadbalancerset", 3).await;
    assert_eq!(
        h.machine_names(&set),
        BTreeSet::from([m[0].clone()]),
        "the master stays"
    );
    wait_for("LB status 1/1", || h.lb("web")["status"]["replicas"] == 1).await;
    assert_eq!(
        h.metrics
            .encode()
            .lines()
            .filter(|l| l.starts_with(
                r#"lb_cloud_controller_machine_deletions_total{reason="scale_down"} 2"#
            ))
            .count(),
        1
    );
}

#[tokio::test]
async fn sets_unhealthy_machine_is_marked_then_replaced() {
    let h = start().await;
    h.create_lb(lb_json("web", 2)).await;
    let set = current_set(&h, "web", "1").await;
    let m = h.bring_up(&set, 2, 1).await;
    // m[0] stops reporting: heartbeats 7 minutes old. m[1] keeps reporting (no outage).
    h.report(&m[0], Some("10.0.1.1"), conds(420, false)).await;
    wait_for("MarkedForDeletion written", || {
        h.api.get(&machines(), NS, &m[0]).is_some_and(|x| {
            x["status"]["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["type"] == "MarkedForDeletion" && c["status"] == "True")
        })
    })
    .await;
    assert_eq!(h.events_with("MachineMarkedForDeletion"), 1);
    assert!(
        h.machine_names(&set).contains(&m[0]),
        "not deleted within the grace"
    );

    // Two minutes pass without recovery.
    let mut c = conds(560, false);
    c.push(cond("MarkedForDeletion", "True", 130, 130));
    h.report(&m[0], Some("10.0.1.1"), c).await;
    wait_for("dead machine deleted", || {
        !h.machine_names(&set).contains(&m[0])
    })
    .await;
    wait_for("replacement created", || h.machine_names(&set).len() == 2).await;
    assert!(h.machine_names(&set).contains(&m[1]));
    assert_eq!(h.events_with("MachineDeleted"), 1);
    assert!(h
        .metrics
        .encode()
        .contains(r#"lb_cloud_controller_machine_deletions_total{reason="unhealthy"} 1"#));
}

#[tokio::test]
async fn sets_no_deletion_while_every_heartbeat_is_stale() {
    let h = start().await;
    h.create_lb(lb_json("web", 2)).await;
    let set = current_set(&h, "web", "1").await;
    let m = h.bring_up(&set, 2, 1).await;
    // The API server is away: one agent's heartbeat ages (it gets marked: the other still reports)…
    h.report(&m[0], Some("10.0.1.1"), conds(600, false)).await;
    let marked = |name: &str| {
        h.api.get(&machines(), NS, name).is_some_and(|x| {
            x["status"]["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["type"] == "MarkedForDeletion")
        })
    };
    wait_for("first machine marked", || marked(&m[0])).await;
    // …then every agent's: the guard holds the next mark.
    h.report(&m[1], Some("10.0.1.2"), conds(600, false)).await;
    wait_for("the guard holds", || {
        h.events_with("MachineDeletionHeld") >= 1
    })
    .await;
    assert!(!marked(&m[1]));
    // Time passes: the first machine's mark is past its grace. Still nothing is deleted.
    let mut c = conds(800, false);
    c.push(cond("MarkedForDeletion", "True", 200, 200));
    h.report(&m[0], Some("10.0.1.1"), c).await;
    h.reconciled("loadbalancerset", 5).await;
    assert_eq!(h.machine_names(&set), m.iter().cloned().collect());
    assert!(h
        .metrics
        .encode()
        .contains("lb_cloud_controller_machine_heartbeat_outage 1"));

    // One agent is back: now the other one really is dead, and goes.
    h.agent(&m[1], "10.0.1.2", true).await;
    wait_for("dead machine deleted", || {
        !h.machine_names(&set).contains(&m[0])
    })
    .await;
    assert!(h.machine_names(&set).contains(&m[1]));
    assert!(h
        .metrics
        .encode()
        .contains("lb_cloud_controller_machine_heartbeat_outage 0"));
}

#[tokio::test]
async fn sets_router_ids_are_distinct_per_network_and_the_sync_secret_is_created_once() {
    let h = start().await;
    // Two names that prefer the same id.
    let none = BTreeSet::new();
    let mut by_id = std::collections::HashMap::new();
    let (a, b) = (0..1000)
        .map(|i| format!("lb-{i}"))
        .find_map(|n| {
            let id = lb_api::ha::router_id_for(NS, &n, &none).unwrap();
            by_id.insert(id, n.clone()).map(|other| (other, n))
        })
        .unwrap();
    let mut other_net = lb_json("elsewhere", 1);
    other_net["spec"]["infrastructure"]["defaultNetwork"]["networkID"] = json!("net-2");
    for obj in [
        lb_json(&a, 1),
        lb_json(&b, 1),
        lb_json("third", 1),
        other_net,
    ] {
        h.create_lb(obj).await;
    }
    let id = |name: &str| {
        h.lb(name)["metadata"]["annotations"]["loadbalancer.yawol.stackit.cloud/vrrpRouterID"]
            .as_str()
            .map(|s| s.parse::<u8>().unwrap())
    };
    wait_for("router ids", || {
        [a.as_str(), b.as_str(), "third", "elsewhere"]
            .iter()
            .all(|n| id(n).is_some())
    })
    .await;
    let ids: BTreeSet<u8> = [&a, &b, "third"].iter().map(|n| id(n).unwrap()).collect();
    assert_eq!(ids.len(), 3, "distinct on one network: {ids:?}");

    // The sync secret: created once, owned by the LoadBalancer, never rewritten.
    let secret_name = format!("{a}-sync");
    wait_for("sync secret", || {
        h.api.get(&secrets(), NS, &secret_name).is_some()
    })
    .await;
    let s = h.api.get(&secrets(), NS, &secret_name).unwrap();
    assert!(s["data"]["secret"].as_str().is_some_and(|v| v.len() > 40));
    assert_eq!(s["metadata"]["ownerReferences"][0]["name"], a.as_str());
    let before = id(&a);
    let since = h.reconciles("loadbalancer");
    h.patch_lb(&a, json!({"spec": {"replicas": 2}})).await;
    h.settled(since).await;
    assert_eq!(
        h.api.get(&secrets(), NS, &secret_name).unwrap()["data"],
        s["data"]
    );
    assert_eq!(id(&a), before, "never re-allocated");

    // A broken Secret is reported, not replaced.
    let mut broken = h.api.get(&secrets(), NS, &format!("{b}-sync")).unwrap();
    broken["data"] = json!({});
    h.api.put(&secrets(), broken);
    h.patch_lb(&b, json!({"spec": {"replicas": 2}})).await;
    wait_for("warning about the secret", || {
        h.api.count(&events(), |e| {
            e["reason"] == "InvalidConfiguration"
                && e["message"].as_str().is_some_and(|m| m.contains("-sync"))
        }) == 1
    })
    .await;
    assert_eq!(
        h.api.get(&secrets(), NS, &format!("{b}-sync")).unwrap()["data"],
        json!({})
    );
}

#[tokio::test]
async fn sets_sync_peers_follow_the_machines() {
    let h = start().await;
    h.create_lb(lb_json("web", 2)).await;
    let set = current_set(&h, "web", "1").await;
    let peers = || {
        h.lb("web")["metadata"]["annotations"]["loadbalancer.yawol.stackit.cloud/syncPeers"]
            .as_str()
            .map(str::to_string)
    };
    wait_for("empty peers", || peers().as_deref() == Some("")).await;
    wait_for("first machine", || h.machines_of_set(&set).len() == 1).await;
    let m1 = h.machines_of_set(&set)[0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    h.agent(&m1, "10.0.0.20", false).await;
    wait_for("one peer", || peers().as_deref() == Some("10.0.0.20")).await;
    wait_for("second machine", || h.machines_of_set(&set).len() == 2).await;
    let m2 = h
        .machine_names(&set)
        .into_iter()
        .find(|n| *n != m1)
        .unwrap();
    h.agent(&m2, "10.0.0.3", false).await;
    wait_for("two peers, sorted", || {
        peers().as_deref() == Some("10.0.0.20,10.0.0.3")
    })
    .await;
    // A machine goes away: its address leaves the list (its replacement has none yet).
    h.lbm_api()
        .delete(&m1, &DeleteParams::default())
        .await
        .unwrap();
    wait_for("one peer again", || peers().as_deref() == Some("10.0.0.3")).await;
}

#[tokio::test]
async fn sets_metrics_series_appear_and_disappear_and_deletion_removes_sets_first() {
    let h = start().await;
    h.create_lb(lb_json("web", 1)).await;
    let set = current_set(&h, "web", "1").await;
    let m = h.bring_up(&set, 1, 1).await;
    wait_for("LB ready", || h.lb("web")["status"]["readyReplicas"] == 1).await;
    let text = h.metrics.encode();
    for series in [
        r#"loadbalancer_replicas{lb="web",namespace="yawol"} 1"#,
        r#"loadbalancer_replicas_current{lb="web",namespace="yawol"} 1"#,
        r#"loadbalancer_replicas_ready{lb="web",namespace="yawol"} 1"#,
        &format!(r#"loadbalancerset_replicas{{lb="web",lbs="{set}",namespace="yawol"}} 1"#),
        &format!(r#"loadbalancerset_replicas_ready{{lb="web",lbs="{set}",namespace="yawol"}} 1"#),
        &format!(r#"loadbalancerset_replicas_current{{lb="web",lbs="{set}",namespace="yawol"}} 1"#),
    ] {
        assert!(text.contains(series), "{series} in\n{text}");
    }
    let ip = h.lb("web")["status"]["externalIP"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(text.contains(&format!(
        r#"loadbalancer_info{{lb="web",namespace="yawol",isInternal="false",tcpProxyProtocol="false",externalIP="{ip}""#
    )));
    assert!(text.contains(r#"loadbalancer_openstack_info{lb="web",namespace="yawol",portID=""#));
    assert!(text.contains(r#"flavorID="f"} 1"#));
    assert!(!text.contains("loadbalancer_deletion_timestamp{"));

    // The machine's VM is still going away (the machine controller's finalizer): the LoadBalancer waits for its
    // sets, and its cloud resources stay.
    let mut obj = h.api.get(&machines(), NS, &m[0]).unwrap();
    obj["metadata"]["finalizers"] = json!(["yawol.stackit.cloud/controller4"]);
    h.api.put(&machines(), obj);
    h.lb_api()
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("set and machine deleting", || {
        h.set(&set)["metadata"]["deletionTimestamp"].is_string()
            && h.api.get(&machines(), NS, &m[0]).unwrap()["metadata"]["deletionTimestamp"]
                .is_string()
    })
    .await;
    h.reconciled("loadbalancerset", 5).await;
    assert!(h.lb("web")["metadata"]["deletionTimestamp"].is_string());
    assert_eq!(h.cloud.counts().0, 1, "security group still there");
    assert_eq!(h.cloud.counts().2, 1, "VIP port still there");
    let text = h.metrics.encode();
    assert!(text.contains(r#"loadbalancer_deletion_timestamp{lb="web",namespace="yawol"}"#));
    assert!(text.contains(r#"loadbalancer_replicas{lb="web",namespace="yawol"} 0"#));
    assert!(text.contains(&format!(
        r#"loadbalancerset_deletion_timestamp{{lb="web",lbs="{set}",namespace="yawol"}}"#
    )));

    // The VM is gone: machine, set, cloud resources and LoadBalancer follow, and so do their series.
    h.lbm_api()
        .patch(
            &m[0],
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    wait_for("LoadBalancer gone", || h.lb("web").is_null()).await;
    assert!(h.set(&set).is_null());
    assert_eq!(h.cloud.counts(), (0, 0, 0, 0, 0));
    assert!(h.api.get(&secrets(), NS, "web-sync").is_none());
    let text = h.metrics.encode();
    assert!(
        !text.lines().any(|l| l.contains(r#"lb="web""#)),
        "no series of the deleted LoadBalancer:\n{text}"
    );
}

#[tokio::test]
async fn sets_bad_input_is_reported_and_changes_nothing() {
    let h = start().await;
    h.create_lb(lb_json("web", 1)).await;
    let set = current_set(&h, "web", "1").await;
    h.bring_up(&set, 1, 1).await;
    let since = h.reconciles("loadbalancer");
    h.patch_lb(
        "web",
        json!({"spec": {"infrastructure": {"image": {"imageID": ""}}},
               "metadata": {"annotations": {"loadbalancer.yawol.stackit.cloud/vrrpRouterID": "300"}}}),
    )
    .await;
    wait_for("warning events", || {
        h.api.count(&events(), |e| {
            e["reason"] == "InvalidConfiguration"
                && e["message"].as_str().is_some_and(|m| m.contains("imageID"))
        }) == 1
    })
    .await;
    // The bad router id is replaced by a valid one (the agents cannot use it), with its own warning.
    wait_for("router id fixed", || {
        h.lb("web")["metadata"]["annotations"]["loadbalancer.yawol.stackit.cloud/vrrpRouterID"]
            .as_str()
            .is_some_and(|v| v.parse::<u8>().is_ok_and(|id| id > 0))
    })
    .await;
    h.settled(since).await;
    assert_eq!(h.sets_of("web").len(), 1, "no set for a broken template");
    assert_eq!(
        h.set(&set)["spec"]["replicas"],
        1,
        "the running set is kept"
    );
    assert_eq!(h.machine_names(&set).len(), 1);
    let text = h.metrics.encode();
    assert!(
        text.contains(
            r#"lb_cloud_controller_invalid_input_total{controller="loadbalancer",reason="InvalidConfiguration"} 2"#
        ),
        "counted once per distinct problem:\n{text}"
    );
}

/// `run_openstack_controllers` (the binary's path, settings from the environment) runs the set controller too.
#[tokio::test]
async fn sets_the_binarys_entry_point_creates_sets_and_machines() {
    use lb_controller::run::{run_openstack_controllers, Health, OpenStackRunConfig};
    let server = FakeApiServer::new();
    for (_, crd) in lb_api::crds() {
        server.install_crd(&crd);
    }
    let metrics = Arc::new(Metrics::new());
    let task = tokio::spawn(run_openstack_controllers(
        server.client(),
        FixedCloud(Arc::new(FakeCloud::new())),
        OpenStackRunConfig {
            namespace: NS.into(),
            loadbalancer: LbControllerConfig::default(),
            instance: "test".into(),
        },
        metrics.clone(),
        Arc::new(Health::default()),
        std::future::pending(),
    ));
    Api::<LoadBalancer>::namespaced(server.client(), NS)
        .create(
            &PostParams::default(),
            &serde_json::from_value(lb_json("bin", 1)).unwrap(),
        )
        .await
        .unwrap();
    wait_for("a machine", || server.list(&machines()).len() == 1).await;
    assert_eq!(server.list(&sets()).len(), 1);
    assert!(metrics
        .encode()
        .contains(r#"loadbalancer_replicas{lb="bin",namespace="yawol"} 1"#));
    task.abort();
}
