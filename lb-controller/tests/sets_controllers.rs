//! The LoadBalancer → LoadBalancerSet step and the LoadBalancerSet controller through `kube::Client` against a real
//! API server (kube-testenv, a namespace per test), with the fake cloud. No machine controller runs: the tests play
//! the agents (conditions, `defaultPortIP`, `KeepalivedMaster`) and, where needed, let time pass by back-dating
//! condition timestamps (status patches, as the agents write them).

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use common::kube::{
    fake_cloud_lb, loadbalancermachines, loadbalancers, loadbalancersets, secrets, setup, wait,
    Objects,
};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use lb_api::{LoadBalancer, LoadBalancerMachine};
use lb_controller::metrics::Metrics;
use lb_controller::openstack::clouds::FixedCloud;
use lb_controller::openstack::fake::FakeCloud;
use lb_controller::openstack::loadbalancer::{self, RolloutGate};
use lb_controller::openstack::set;
use lb_controller::runtime::events::EventPublisher;
use serde_json::{json, Value};

struct H {
    client: Client,
    ns: String,
    cloud: Arc<FakeCloud>,
    metrics: Arc<Metrics>,
    lbs: Objects,
    sets: Objects,
    machines: Objects,
    events: Objects,
    secrets: Objects,
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

async fn start(prefix: &str) -> H {
    start_with(
        prefix,
        set::Config {
            requeue: Duration::from_millis(50),
            scale_up_timeout: Duration::from_secs(3600),
            deletion_poll: Duration::from_millis(20),
            outage_min_machines: 2,
        },
    )
    .await
}

async fn start_with(prefix: &str, set_config: set::Config) -> H {
    let (client, ns) = setup(prefix).await;
    let cloud = Arc::new(FakeCloud::new());
    let metrics = Arc::new(Metrics::new());
    let events = Arc::new(EventPublisher::new(client.clone(), "yawol-service", "test"));
    let ctx = Arc::new(loadbalancer::Context {
        client: client.clone(),
        clouds: FixedCloud(cloud.clone()),
        events: events.clone(),
        config: loadbalancer::Config {
            resync: Duration::from_secs(300),
            deletion_poll: Duration::from_millis(20),
            rollout: fast_gate(),
        },
        metrics: metrics.clone(),
    });
    let set_ctx = Arc::new(set::Context {
        client: client.clone(),
        events,
        metrics: metrics.clone(),
        config: set_config,
    });
    let tasks = vec![
        tokio::spawn({
            let ns = ns.clone();
            async move {
                lb_controller::openstack::loadbalancer::run(
                    ctx,
                    &ns,
                    lb_controller::runtime::stop::Stop::on(std::future::pending()),
                )
                .await
            }
        }),
        tokio::spawn({
            let ns = ns.clone();
            async move {
                lb_controller::openstack::set::run(
                    set_ctx,
                    &ns,
                    lb_controller::runtime::stop::Stop::on(std::future::pending()),
                )
                .await
            }
        }),
    ];
    H {
        lbs: loadbalancers(&client, &ns),
        sets: loadbalancersets(&client, &ns),
        machines: loadbalancermachines(&client, &ns),
        events: common::kube::events(&client, &ns),
        secrets: secrets(&client, &ns),
        client,
        ns,
        cloud,
        metrics,
        tasks,
    }
}

impl H {
    async fn lb(&self, name: &str) -> Value {
        self.lbs.get(name).await
    }
    async fn sets_of(&self, lb: &str) -> Vec<Value> {
        self.sets
            .list()
            .await
            .into_iter()
            .filter(|s| s["spec"]["template"]["spec"]["loadBalancerRef"]["name"] == lb)
            .collect()
    }
    async fn set(&self, name: &str) -> Value {
        self.sets.get(name).await
    }
    async fn machines_of_set(&self, set: &str) -> Vec<Value> {
        let mut v: Vec<Value> = self
            .machines
            .list()
            .await
            .into_iter()
            .filter(|m| m["metadata"]["ownerReferences"][0]["name"] == set)
            .collect();
        v.sort_by_key(|m| m["metadata"]["name"].as_str().unwrap_or("").to_string());
        v
    }
    async fn machine_names(&self, set: &str) -> BTreeSet<String> {
        self.machines_of_set(set)
            .await
            .iter()
            .map(|m| m["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    }
    async fn events_with(&self, reason: &str) -> usize {
        self.events.count(|e| e["reason"] == reason).await
    }
    /// Exactly `n` events with `reason`, once there are that many: a controller publishes its event after the
    /// write that a test waits for, so a reader can see the write first.
    async fn assert_events(&self, reason: &str, n: usize) {
        wait(&format!("{n} {reason} events"), || async {
            Ok(self.events_with(reason).await >= n)
        })
        .await;
        assert_eq!(self.events_with(reason).await, n, "{reason} events");
    }
    fn reconciles(&self, controller: &str) -> u64 {
        self.metrics.reconcile_count(controller)
    }
    fn lb_api(&self) -> Api<LoadBalancer> {
        Api::namespaced(self.client.clone(), &self.ns)
    }
    fn lbm_api(&self) -> Api<LoadBalancerMachine> {
        Api::namespaced(self.client.clone(), &self.ns)
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
        self.machines.patch_status(machine, status).await;
    }

    /// Waits for `count` machines of `set`, playing a healthy agent for each as it appears (one at a time: the set
    /// controller creates the next only when the previous is ready). Returns the names in creation order.
    async fn bring_up(&self, set: &str, count: usize, ip_base: u8) -> Vec<String> {
        let mut seen = Vec::new();
        while seen.len() < count {
            let want = seen.len() + 1;
            wait(&format!("machine {want} of {set}"), || async {
                Ok(self.machines_of_set(set).await.len() >= want)
            })
            .await;
            let next = self
                .machine_names(set)
                .await
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
        wait("a LoadBalancer reconcile", || async {
            Ok(self.reconciles("loadbalancer") > since)
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
        wait(&format!("{n} {controller} reconciles"), || async {
            Ok(self.reconciles(controller) >= start + n)
        })
        .await;
    }

    /// Whether machine `name` carries a `MarkedForDeletion` condition (with `status`, if given).
    async fn marked(&self, name: &str, status: Option<&str>) -> bool {
        self.machines.get(name).await["status"]["conditions"]
            .as_array()
            .is_some_and(|c| {
                c.iter().any(|c| {
                    c["type"] == "MarkedForDeletion" && status.is_none_or(|s| c["status"] == s)
                })
            })
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

const REVISION: &str = "loadbalancer.yawol.stackit.cloud/revision";

/// The current set of `lb` once it exists: its name.
async fn current_set(h: &H, lb: &str, revision: &str) -> String {
    let of_revision = |sets: Vec<Value>| {
        sets.into_iter()
            .find(|s| s["metadata"]["annotations"][REVISION] == revision)
    };
    wait(&format!("revision {revision} of {lb}"), || async {
        Ok(
            h.lb(lb).await["metadata"]["annotations"][REVISION] == revision
                && of_revision(h.sets_of(lb).await).is_some(),
        )
    })
    .await;
    of_revision(h.sets_of(lb).await).unwrap()["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn sets_create_n_machines_one_at_a_time() {
    let h = start("sets-create").await;
    h.create_lb(fake_cloud_lb(&h.ns, "web", 3)).await;
    let set = current_set(&h, "web", "1").await;
    let s = h.set(&set).await;
    let hash = s["metadata"]["labels"]["lbm-template-hash"]
        .as_str()
        .unwrap();
    assert_eq!(set, format!("web-{hash}"));
    assert_eq!(s["spec"]["replicas"], 3);
    assert_eq!(s["metadata"]["ownerReferences"][0]["kind"], "LoadBalancer");
    assert_eq!(
        s["spec"]["template"]["spec"]["portID"],
        h.lb("web").await["status"]["portID"]
    );
    wait("set finalizer", || async {
        Ok(h.set(&set).await["metadata"]["finalizers"]
            == json!(["stackit.cloud/loadbalancermachine"]))
    })
    .await;

    // One machine; while it boots, no second one, however often the controller looks.
    wait("first machine", || async {
        Ok(h.machines_of_set(&set).await.len() == 1)
    })
    .await;
    h.reconciled("loadbalancerset", 5).await;
    let machines = h.machines_of_set(&set).await;
    assert_eq!(machines.len(), 1);
    let m = &machines[0];
    let name = m["metadata"]["name"].as_str().unwrap();
    assert!(name.starts_with(&format!("{set}-")) && name.len() == set.len() + 6);
    assert_eq!(m["metadata"]["labels"]["lbm-template-hash"], hash);
    assert_eq!(
        m["metadata"]["labels"]["yawol.stackit.cloud/loadbalancer"],
        "web"
    );
    assert_eq!(m["metadata"]["annotations"][REVISION], "1");
    assert_eq!(m["metadata"]["ownerReferences"][0]["name"], set.as_str());
    assert_eq!(m["spec"], s["spec"]["template"]["spec"]);

    h.bring_up(&set, 3, 1).await;
    wait("LB status 3/3", || async {
        let st = &h.lb("web").await["status"];
        Ok(st["replicas"] == 3 && st["readyReplicas"] == 3)
    })
    .await;
    let st = &h.set(&set).await["status"];
    assert_eq!(
        (&st["replicas"], &st["readyReplicas"]),
        (&json!(3), &json!(3))
    );
    assert_eq!(st["conditions"][0]["type"], "HasKeepalivedMaster");
    assert_eq!(st["conditions"][0]["status"], "False");
    h.assert_events("MachineCreated", 3).await;
    assert_eq!(h.sets_of("web").await.len(), 1);
}

#[tokio::test]
async fn sets_hot_changes_keep_the_set_rolling_changes_replace_it_after_the_vip_moved() {
    let h = start("sets-rolling").await;
    h.create_lb(fake_cloud_lb(&h.ns, "web", 2)).await;
    let old = current_set(&h, "web", "1").await;
    let old_machines = h.bring_up(&old, 2, 1).await;
    h.agent(&old_machines[0], "10.0.1.1", true).await;
    wait("old set has a master", || async {
        Ok(h.set(&old).await["status"]["conditions"][0]["status"] == "True")
    })
    .await;

    // Hot: ports, endpoints, options. The OpenStack step runs (new rules), no new set.
    let hash_before = h.lb("web").await["status"]["openstackReconcileHash"].clone();
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
    wait("OpenStack step after the port change", || async {
        Ok(h.lb("web").await["status"]["openstackReconcileHash"] != hash_before)
    })
    .await;
    h.settled(since).await;
    assert_eq!(h.sets_of("web").await.len(), 1, "hot change: no new set");
    assert_eq!(h.machine_names(&old).await.len(), 2);

    // Rolling: a new flavor.
    h.patch_lb(
        "web",
        json!({"spec": {"infrastructure": {"flavor": {"flavorID": "f2"}}}}),
    )
    .await;
    let new = current_set(&h, "web", "2").await;
    assert_ne!(new, old);
    assert_eq!(
        h.set(&new).await["spec"]["template"]["spec"]["infrastructure"]["flavor"]["flavorID"],
        "f2"
    );
    wait("a second LoadBalancerSetCreated event", || async {
        Ok(h.events_with("LoadBalancerSetCreated").await >= 2)
    })
    .await;
    let new_machines = h.bring_up(&new, 2, 2).await;
    assert_eq!(
        h.machines_of_set(&new).await[0]["metadata"]["annotations"][REVISION],
        "2"
    );
    // Ready, but the VIP is still on the old set: the old set keeps its machines.
    wait("new set ready", || async {
        Ok(h.set(&new).await["status"]["readyReplicas"] == 2)
    })
    .await;
    wait("LB status counts both sets", || async {
        Ok(h.lb("web").await["status"]["readyReplicas"] == 4)
    })
    .await;
    h.reconciled("loadbalancerset", 5).await;
    assert_eq!(h.set(&old).await["spec"]["replicas"], 2);
    assert_eq!(h.machine_names(&old).await.len(), 2);

    // The VIP moves: old master released, a new machine takes it.
    h.agent(&old_machines[0], "10.0.1.1", false).await;
    h.agent(&new_machines[1], "10.0.2.2", true).await;
    wait("new set has a master", || async {
        Ok(h.set(&new).await["status"]["conditions"][0]["status"] == "True")
    })
    .await;
    // After the gate (300 ms of mastership) the old set goes to 0, empties and is deleted.
    wait("old set deleted", || async {
        Ok(h.set(&old).await.is_null())
    })
    .await;
    assert!(h.machine_names(&old).await.is_empty());
    h.assert_events("LoadBalancerSetScaledDown", 1).await;
    h.assert_events("LoadBalancerSetDeleted", 1).await;
    assert_eq!(
        h.machine_names(&new).await.len(),
        2,
        "the new set is untouched"
    );
    wait("LB status back to 2/2", || async {
        let st = &h.lb("web").await["status"];
        Ok(st["replicas"] == 2 && st["readyReplicas"] == 2)
    })
    .await;
}

#[tokio::test]
async fn sets_scale_down_removes_unready_then_non_masters() {
    let h = start("sets-scale-down").await;
    h.create_lb(fake_cloud_lb(&h.ns, "web", 3)).await;
    let set = current_set(&h, "web", "1").await;
    let m = h.bring_up(&set, 3, 1).await;
    // m[0] is master, m[1] is unready, m[2] is ready.
    h.agent(&m[0], "10.0.1.1", true).await;
    let mut bad = conds(5, false);
    bad[1] = cond("DataplaneReady", "False", 5, 20);
    h.report(&m[1], None, bad).await;
    wait("status 3/2", || async {
        Ok(h.set(&set).await["status"]["readyReplicas"] == 2)
    })
    .await;

    h.patch_lb("web", json!({"spec": {"replicas": 2}})).await;
    wait("unready machine removed", || async {
        Ok(!h.machine_names(&set).await.contains(&m[1]))
    })
    .await;
    assert_eq!(h.machine_names(&set).await.len(), 2);

    h.patch_lb("web", json!({"spec": {"replicas": 1}})).await;
    wait("non-master removed", || async {
        Ok(!h.machine_names(&set).await.contains(&m[2]))
    })
    .await;
    h.reconciled("loadbalancerset", 3).await;
    assert_eq!(
        h.machine_names(&set).await,
        BTreeSet::from([m[0].clone()]),
        "the master stays"
    );
    wait("LB status 1/1", || async {
        Ok(h.lb("web").await["status"]["replicas"] == 1)
    })
    .await;
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
    let h = start("sets-unhealthy").await;
    h.create_lb(fake_cloud_lb(&h.ns, "web", 2)).await;
    let set = current_set(&h, "web", "1").await;
    let m = h.bring_up(&set, 2, 1).await;
    // m[0] stops reporting: heartbeats 7 minutes old. m[1] keeps reporting (no outage).
    h.report(&m[0], Some("10.0.1.1"), conds(420, false)).await;
    wait("MarkedForDeletion written", || async {
        Ok(h.marked(&m[0], Some("True")).await)
    })
    .await;
    h.assert_events("MachineMarkedForDeletion", 1).await;
    assert!(
        h.machine_names(&set).await.contains(&m[0]),
        "not deleted within the grace"
    );

    // Two minutes pass without recovery.
    let mut c = conds(560, false);
    c.push(cond("MarkedForDeletion", "True", 130, 130));
    h.report(&m[0], Some("10.0.1.1"), c).await;
    wait("dead machine deleted", || async {
        Ok(!h.machine_names(&set).await.contains(&m[0]))
    })
    .await;
    wait("replacement created", || async {
        Ok(h.machine_names(&set).await.len() == 2)
    })
    .await;
    assert!(h.machine_names(&set).await.contains(&m[1]));
    h.assert_events("MachineDeleted", 1).await;
    assert!(h
        .metrics
        .encode()
        .contains(r#"lb_cloud_controller_machine_deletions_total{reason="unhealthy"} 1"#));
}

#[tokio::test]
async fn sets_no_deletion_while_every_heartbeat_is_stale() {
    let h = start("sets-outage").await;
    h.create_lb(fake_cloud_lb(&h.ns, "web", 2)).await;
    let set = current_set(&h, "web", "1").await;
    let m = h.bring_up(&set, 2, 1).await;
    // The API server is away: one agent's heartbeat ages (it gets marked: the other still reports)…
    h.report(&m[0], Some("10.0.1.1"), conds(600, false)).await;
    wait("first machine marked", || async {
        Ok(h.marked(&m[0], None).await)
    })
    .await;
    // …then every agent's: the guard holds the next mark.
    h.report(&m[1], Some("10.0.1.2"), conds(600, false)).await;
    wait("the guard holds", || async {
        Ok(h.events_with("MachineDeletionHeld").await >= 1)
    })
    .await;
    assert!(!h.marked(&m[1], None).await);
    // Time passes: the first machine's mark is past its grace. Still nothing is deleted.
    let mut c = conds(800, false);
    c.push(cond("MarkedForDeletion", "True", 200, 200));
    h.report(&m[0], Some("10.0.1.1"), c).await;
    h.reconciled("loadbalancerset", 5).await;
    assert_eq!(h.machine_names(&set).await, m.iter().cloned().collect());
    assert!(h
        .metrics
        .encode()
        .contains("lb_cloud_controller_machine_heartbeat_outage 1"));

    // One agent is back: now the other one really is dead, and goes.
    h.agent(&m[1], "10.0.1.2", true).await;
    wait("dead machine deleted", || async {
        Ok(!h.machine_names(&set).await.contains(&m[0]))
    })
    .await;
    assert!(h.machine_names(&set).await.contains(&m[1]));
    wait("outage over", || async {
        Ok(h.metrics
            .encode()
            .contains("lb_cloud_controller_machine_heartbeat_outage 0"))
    })
    .await;
}

#[tokio::test]
async fn sets_router_ids_are_distinct_per_network_and_the_sync_secret_is_created_once() {
    let h = start("sets-router-ids").await;
    // Two names that prefer the same id.
    let none = BTreeSet::new();
    let mut by_id = std::collections::HashMap::new();
    let (a, b) = (0..1000)
        .map(|i| format!("lb-{i}"))
        .find_map(|n| {
            let id = lb_api::ha::router_id_for(&h.ns, &n, &none).unwrap();
            by_id.insert(id, n.clone()).map(|other| (other, n))
        })
        .unwrap();
    let mut other_net = fake_cloud_lb(&h.ns, "elsewhere", 1);
    other_net["spec"]["infrastructure"]["defaultNetwork"]["networkID"] = json!("net-2");
    for obj in [
        fake_cloud_lb(&h.ns, &a, 1),
        fake_cloud_lb(&h.ns, &b, 1),
        fake_cloud_lb(&h.ns, "third", 1),
        other_net,
    ] {
        h.create_lb(obj).await;
    }
    let id = |lb: Value| {
        lb["metadata"]["annotations"]["loadbalancer.yawol.stackit.cloud/vrrpRouterID"]
            .as_str()
            .map(|s| s.parse::<u8>().unwrap())
    };
    wait("router ids", || async {
        for n in [a.as_str(), b.as_str(), "third", "elsewhere"] {
            if id(h.lb(n).await).is_none() {
                return Ok(false);
            }
        }
        Ok(true)
    })
    .await;
    let mut ids = BTreeSet::new();
    for n in [&a, &b, "third"] {
        ids.insert(id(h.lb(n).await).unwrap());
    }
    assert_eq!(ids.len(), 3, "distinct on one network: {ids:?}");

    // The sync secret: created once, owned by the LoadBalancer, never rewritten.
    let secret_name = format!("{a}-sync");
    wait("sync secret", || async {
        Ok(h.secrets.exists(&secret_name).await)
    })
    .await;
    let s = h.secrets.get(&secret_name).await;
    assert!(s["data"]["secret"].as_str().is_some_and(|v| v.len() > 40));
    assert_eq!(s["metadata"]["ownerReferences"][0]["name"], a.as_str());
    let before = id(h.lb(&a).await);
    let since = h.reconciles("loadbalancer");
    h.patch_lb(&a, json!({"spec": {"replicas": 2}})).await;
    h.settled(since).await;
    assert_eq!(h.secrets.get(&secret_name).await["data"], s["data"]);
    assert_eq!(id(h.lb(&a).await), before, "never re-allocated");

    // A broken Secret is reported, not replaced.
    let broken = format!("{b}-sync");
    wait("second sync secret", || async {
        Ok(h.secrets.exists(&broken).await)
    })
    .await;
    h.secrets
        .patch(&broken, json!({"data": {"secret": null}}))
        .await;
    h.patch_lb(&b, json!({"spec": {"replicas": 2}})).await;
    wait("warning about the secret", || async {
        Ok(h.events
            .count(|e| {
                e["reason"] == "InvalidConfiguration"
                    && e["message"].as_str().is_some_and(|m| m.contains("-sync"))
            })
            .await
            == 1)
    })
    .await;
    // (The server omits an empty `data`.)
    let data = &h.secrets.get(&broken).await["data"];
    assert!(data.is_null() || *data == json!({}), "{data}");
}

#[tokio::test]
async fn sets_sync_peers_follow_the_machines() {
    let h = start("sets-peers").await;
    h.create_lb(fake_cloud_lb(&h.ns, "web", 2)).await;
    let set = current_set(&h, "web", "1").await;
    let peers = || async {
        h.lb("web").await["metadata"]["annotations"]["loadbalancer.yawol.stackit.cloud/syncPeers"]
            .as_str()
            .map(str::to_string)
    };
    wait("empty peers", || async {
        Ok(peers().await.as_deref() == Some(""))
    })
    .await;
    wait("first machine", || async {
        Ok(h.machines_of_set(&set).await.len() == 1)
    })
    .await;
    let m1 = h.machines_of_set(&set).await[0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    h.agent(&m1, "10.0.0.20", false).await;
    wait("one peer", || async {
        Ok(peers().await.as_deref() == Some("10.0.0.20"))
    })
    .await;
    wait("second machine", || async {
        Ok(h.machines_of_set(&set).await.len() == 2)
    })
    .await;
    let m2 = h
        .machine_names(&set)
        .await
        .into_iter()
        .find(|n| *n != m1)
        .unwrap();
    h.agent(&m2, "10.0.0.3", false).await;
    wait("two peers, sorted", || async {
        Ok(peers().await.as_deref() == Some("10.0.0.20,10.0.0.3"))
    })
    .await;
    // A machine goes away: its address leaves the list (its replacement has none yet).
    h.lbm_api()
        .delete(&m1, &DeleteParams::default())
        .await
        .unwrap();
    wait("one peer again", || async {
        Ok(peers().await.as_deref() == Some("10.0.0.3"))
    })
    .await;
}

/// The series of a LoadBalancer and its set appear; deleting the LoadBalancer deletes its sets first (a machine whose
/// VM is still going away holds everything); then machine, set, cloud resources and LoadBalancer go. Returns once
/// the LoadBalancer and its sync Secret are gone.
async fn metrics_then_deletion(prefix: &str) -> H {
    let h = start(prefix).await;
    let ns = h.ns.clone();
    h.create_lb(fake_cloud_lb(&ns, "web", 1)).await;
    let set = current_set(&h, "web", "1").await;
    let m = h.bring_up(&set, 1, 1).await;
    wait("LB ready", || async {
        Ok(h.lb("web").await["status"]["readyReplicas"] == 1)
    })
    .await;
    let series = [
        format!(r#"loadbalancer_replicas{{lb="web",namespace="{ns}"}} 1"#),
        format!(r#"loadbalancer_replicas_current{{lb="web",namespace="{ns}"}} 1"#),
        format!(r#"loadbalancer_replicas_ready{{lb="web",namespace="{ns}"}} 1"#),
        format!(r#"loadbalancerset_replicas{{lb="web",lbs="{set}",namespace="{ns}"}} 1"#),
        format!(r#"loadbalancerset_replicas_ready{{lb="web",lbs="{set}",namespace="{ns}"}} 1"#),
        format!(r#"loadbalancerset_replicas_current{{lb="web",lbs="{set}",namespace="{ns}"}} 1"#),
    ];
    // Observed when the reconciles that wrote the statuses end, which a reader can see first.
    wait("the series of LoadBalancer and set", || async {
        let text = h.metrics.encode();
        Ok(series.iter().all(|s| text.contains(s)))
    })
    .await;
    let text = h.metrics.encode();
    let ip = h.lb("web").await["status"]["externalIP"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(text.contains(&format!(
        r#"loadbalancer_info{{lb="web",namespace="{ns}",isInternal="false",tcpProxyProtocol="false",externalIP="{ip}""#
    )));
    assert!(text.contains(&format!(
        r#"loadbalancer_openstack_info{{lb="web",namespace="{ns}",portID=""#
    )));
    assert!(text.contains(r#"flavorID="f"} 1"#));
    assert!(!text.contains("loadbalancer_deletion_timestamp{"));

    // The machine's VM is still going away (the machine controller's finalizer): the LoadBalancer waits for its
    // sets, and its cloud resources stay.
    h.machines
        .patch(
            &m[0],
            json!({"metadata": {"finalizers": ["yawol.stackit.cloud/controller4"]}}),
        )
        .await;
    h.lb_api()
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    wait("set and machine deleting", || async {
        Ok(
            h.set(&set).await["metadata"]["deletionTimestamp"].is_string()
                && h.machines.get(&m[0]).await["metadata"]["deletionTimestamp"].is_string(),
        )
    })
    .await;
    h.reconciled("loadbalancerset", 5).await;
    assert!(h.lb("web").await["metadata"]["deletionTimestamp"].is_string());
    assert_eq!(h.cloud.counts().0, 1, "security group still there");
    assert_eq!(h.cloud.counts().2, 1, "VIP port still there");
    let text = h.metrics.encode();
    assert!(text.contains(&format!(
        r#"loadbalancer_deletion_timestamp{{lb="web",namespace="{ns}"}}"#
    )));
    assert!(text.contains(&format!(
        r#"loadbalancer_replicas{{lb="web",namespace="{ns}"}} 0"#
    )));
    assert!(text.contains(&format!(
        r#"loadbalancerset_deletion_timestamp{{lb="web",lbs="{set}",namespace="{ns}"}}"#
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
    wait("LoadBalancer gone", || async {
        Ok(h.lb("web").await.is_null())
    })
    .await;
    assert!(h.set(&set).await.is_null());
    assert_eq!(h.cloud.counts(), (0, 0, 0, 0, 0));
    // The sync Secret is owned by the LoadBalancer: the garbage collector deletes it once its owner is gone.
    wait("sync Secret collected", || async {
        Ok(!h.secrets.exists("web-sync").await)
    })
    .await;
    h
}

#[tokio::test]
async fn sets_metrics_series_appear_and_deletion_removes_sets_first() {
    metrics_then_deletion("sets-metrics").await;
}

/// Seen against the real API server about once in ten runs under load: the reconcile that removed the finalizer is
/// followed at once by one on the cached copy that still has it (a set or machine event was queued meanwhile). That
/// one observes the object again (`observe_loadbalancer`, `observe_set` at the top of the deletion branch), then its
/// finalizer patch got a 404 and the `forget_*` after it never ran: the series stayed until the periodic sweep (60 s
/// for sets, `resync` for LoadBalancers, 300 s here). `finalizer::remove` now takes a 404 as done.
#[tokio::test]
async fn sets_series_of_a_deleted_loadbalancer_disappear() {
    let h = metrics_then_deletion("sets-series-gone").await;
    // The controllers forget the series right after their finalizer writes, which a reader can see first.
    let left = || {
        h.metrics
            .encode()
            .lines()
            .filter(|l| l.contains(r#"lb="web""#))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    if let Err(e) = kube_testenv::wait_for("no series of the deleted LoadBalancer", || async {
        Ok(left().is_empty())
    })
    .await
    {
        panic!("{e:#}: {:#?}", left());
    }
}

#[tokio::test]
async fn sets_bad_input_is_reported_and_changes_nothing() {
    let h = start("sets-bad-input").await;
    h.create_lb(fake_cloud_lb(&h.ns, "web", 1)).await;
    let set = current_set(&h, "web", "1").await;
    h.bring_up(&set, 1, 1).await;
    let since = h.reconciles("loadbalancer");
    h.patch_lb(
        "web",
        json!({"spec": {"infrastructure": {"image": {"imageID": ""}}},
               "metadata": {"annotations": {"loadbalancer.yawol.stackit.cloud/vrrpRouterID": "300"}}}),
    )
    .await;
    wait("warning events", || async {
        Ok(h.events
            .count(|e| {
                e["reason"] == "InvalidConfiguration"
                    && e["message"].as_str().is_some_and(|m| m.contains("imageID"))
            })
            .await
            == 1)
    })
    .await;
    // The bad router id is replaced by a valid one (the agents cannot use it), with its own warning.
    wait("router id fixed", || async {
        Ok(h.lb("web").await["metadata"]["annotations"]
            ["loadbalancer.yawol.stackit.cloud/vrrpRouterID"]
            .as_str()
            .is_some_and(|v| v.parse::<u8>().is_ok_and(|id| id > 0)))
    })
    .await;
    h.settled(since).await;
    assert_eq!(
        h.sets_of("web").await.len(),
        1,
        "no set for a broken template"
    );
    assert_eq!(
        h.set(&set).await["spec"]["replicas"],
        1,
        "the running set is kept"
    );
    assert_eq!(h.machine_names(&set).await.len(), 1);
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
    use lb_controller::cli::run_openstack_controllers;
    use lb_controller::openstack::run::OpenStackRunConfig;
    use lb_controller::process::http::Health;
    let (client, ns) = setup("sets-binary").await;
    let metrics = Arc::new(Metrics::new());
    let task = tokio::spawn(run_openstack_controllers(
        client.clone(),
        FixedCloud(Arc::new(FakeCloud::new())),
        OpenStackRunConfig {
            namespace: ns.clone(),
            loadbalancer: loadbalancer::Config::default(),
            instance: "test".into(),
        },
        metrics.clone(),
        Arc::new(Health::default()),
        std::future::pending(),
    ));
    Api::<LoadBalancer>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &serde_json::from_value(fake_cloud_lb(&ns, "bin", 1)).unwrap(),
        )
        .await
        .unwrap();
    let machines = loadbalancermachines(&client, &ns);
    wait("a machine", || async {
        Ok(machines.list().await.len() == 1)
    })
    .await;
    assert_eq!(loadbalancersets(&client, &ns).list().await.len(), 1);
    // Recorded when the LoadBalancer's reconcile ends, which can be after the set controller made the machine.
    let series = format!(r#"loadbalancer_replicas{{lb="bin",namespace="{ns}"}} 1"#);
    wait("the LoadBalancer's series", || async {
        Ok(metrics.encode().contains(&series))
    })
    .await;
    task.abort();
}
