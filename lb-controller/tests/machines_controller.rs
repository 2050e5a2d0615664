//! The LoadBalancerMachine controller through `kube::Client` against a real API server (kube-testenv, a namespace
//! per test), with the fake cloud: RBAC objects, VM port and server booted with the machine's token and the agent's
//! (HA) arguments, status after each step, ACTIVE wait by requeue, ERROR servers replaced with Nova's fault in an
//! event, injected OpenStack errors (quota, 5xx) retried without duplicates, deletion leaving nothing, metrics
//! series appearing and going; an active-active machine being deleted keeps its server while its agent reports
//! connections of its own.
//!
//! The cluster's token controller fills the machines' token Secrets, as in production.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use common::kube::{
    events, loadbalancermachines, loadbalancers, rolebindings, roles, secrets, serviceaccounts,
    setup, wait, Objects,
};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use lb_api::LoadBalancerMachine;
use lb_controller::openstack::clouds::FixedCloud;
use lb_controller::openstack::fake::FakeCloud;
use lb_controller::openstack::machine::metrics::MachineMetrics;
use lb_controller::openstack::machine::{self, run};
use lb_controller::openstack::{Cloud, CloudErrorKind, PortSpec};
use lb_controller::runtime::events::EventPublisher;
use lb_controller::runtime::stop::Stop;
use serde_json::{json, Value};
use serde_yaml::Value as Yaml;

const SYNC_SECRET: &str = "5f0c9a8e7d6b5a4938271605f4e3d2c1b0a99887766554433221100ffeeddccb";
const NOVA_FAULT: &str = "No valid host was found. There are not enough hosts available.";

struct H {
    client: Client,
    ns: String,
    cloud: Arc<FakeCloud>,
    metrics: Arc<MachineMetrics>,
    vip_port: String,
    task: tokio::task::JoinHandle<()>,
    lbs: Objects,
    machines: Objects,
    events: Objects,
    secrets: Objects,
    /// ServiceAccount, token Secret, Role, RoleBinding: the machine's RBAC objects, all named after it.
    rbac: [Objects; 4],
}

impl H {
    fn new(
        client: Client,
        ns: String,
        cloud: Arc<FakeCloud>,
        metrics: Arc<MachineMetrics>,
    ) -> Self {
        H {
            lbs: loadbalancers(&client, &ns),
            machines: loadbalancermachines(&client, &ns),
            events: events(&client, &ns),
            secrets: secrets(&client, &ns),
            rbac: [
                serviceaccounts(&client, &ns),
                secrets(&client, &ns),
                roles(&client, &ns),
                rolebindings(&client, &ns),
            ],
            client,
            ns,
            cloud,
            metrics,
            vip_port: String::new(),
            task: tokio::spawn(async {}),
        }
    }
    fn lbm_api(&self) -> Api<LoadBalancerMachine> {
        Api::namespaced(self.client.clone(), &self.ns)
    }
    async fn machine(&self, name: &str) -> Value {
        self.machines.get(name).await
    }
    async fn status(&self, name: &str) -> Value {
        self.machine(name).await["status"].clone()
    }
    async fn events(&self, reason: &str, kind: &str) -> Vec<Value> {
        self.events
            .list()
            .await
            .into_iter()
            .filter(|e| e["reason"] == reason && e["involvedObject"]["kind"] == kind)
            .collect()
    }
    /// The events once there are `n` (a controller publishes after the write that a test waits for).
    async fn wait_events(&self, reason: &str, kind: &str, n: usize) -> Vec<Value> {
        wait(&format!("{n} {reason} event(s) on the {kind}"), || async {
            Ok(self.events(reason, kind).await.len() >= n)
        })
        .await;
        self.events(reason, kind).await
    }
    /// Servers that are not being deleted.
    fn servers(&self) -> Vec<lb_controller::openstack::Server> {
        self.cloud.servers()
    }
    fn vm_ports(&self) -> usize {
        self.cloud
            .ports()
            .iter()
            .filter(|p| p.id != self.vip_port)
            .count()
    }
    /// Which of the RBAC objects of machine `name` exist.
    async fn rbac_left(&self, name: &str) -> Vec<String> {
        let mut left = Vec::new();
        for objects in &self.rbac {
            let o = objects.get(name).await;
            if !o.is_null() {
                left.push(format!("{} {name}", o["kind"].as_str().unwrap_or("?")));
            }
        }
        left
    }
    async fn wait_gone(&self, name: &str) {
        wait("machine gone", || async {
            Ok(self.machine(name).await.is_null())
        })
        .await;
    }
    /// The resourceVersion of every object the controller writes (the namespace's default ServiceAccount aside):
    /// unchanged means nothing was written.
    async fn versions(&self) -> BTreeMap<String, String> {
        let mut versions = BTreeMap::new();
        for objects in [&self.lbs, &self.machines, &self.events]
            .into_iter()
            .chain(&self.rbac)
        {
            for o in objects.list().await {
                let id = format!(
                    "{} {}",
                    o["kind"].as_str().unwrap_or("?"),
                    o["metadata"]["name"].as_str().unwrap()
                );
                if id != "ServiceAccount default" {
                    versions.insert(id, o["metadata"]["resourceVersion"].to_string());
                }
            }
        }
        versions
    }
}

fn config() -> machine::Config {
    machine::Config {
        api_endpoint: Some("https://api.control.example:6443".into()),
        ntp_servers: vec!["ntp.example".into()],
        interface: "eth0".into(),
        resync: Duration::from_secs(300),
        poll: Duration::from_millis(20),
        error_backoff_base: Duration::from_millis(20),
        error_backoff_max: Duration::from_millis(200),
        drain_timeout: Duration::from_secs(60),
    }
}

/// A namespace with a LoadBalancer that the LoadBalancer controller has already reconciled (security group, VIP
/// port, VRRP router ID annotation, sync Secret) and the machine controller running.
async fn start_with(prefix: &str, config: machine::Config) -> H {
    let (client, ns) = setup(prefix).await;
    let cloud = Arc::new(FakeCloud::new());
    let vip = cloud
        .create_port(&PortSpec {
            name: format!("{ns}/web"),
            network_id: "net".into(),
            security_groups: vec!["sg-web".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let lbs = loadbalancers(&client, &ns);
    lbs.api()
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
                "metadata": {"name": "web", "namespace": ns,
                             "annotations": {"loadbalancer.yawol.stackit.cloud/vrrpRouterID": "42"}},
                "spec": {
                    "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": "web"}},
                    "replicas": 1,
                    "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
                    "infrastructure": {
                        "defaultNetwork": {"networkID": "net"}, "flavor": {"flavorID": "f"},
                        "image": {"imageID": "i"}, "authSecretRef": {"name": "cloud", "namespace": ns}
                    }
                }
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    // The status through its subresource, as the LoadBalancer controller writes it.
    lbs.patch_status(
        "web",
        json!({"securityGroupID": "sg-web", "portID": vip.id, "portIP": vip.fixed_ips[0].ip_address}),
    )
    .await;
    Api::<Secret>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "web-sync", "namespace": ns},
                "data": {"secret": base64::engine::general_purpose::STANDARD.encode(SYNC_SECRET)}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    cloud.clear_calls();
    let metrics = Arc::new(MachineMetrics::default());
    let ctx = Arc::new(machine::Context::new(
        client.clone(),
        FixedCloud(cloud.clone()),
        Arc::new(EventPublisher::new(client.clone(), "yawol-service", "test")),
        metrics.clone(),
        config,
    ));
    let task = tokio::spawn({
        let ns = ns.clone();
        async move { run(ctx, &ns, Stop::on(std::future::pending())).await }
    });
    H {
        vip_port: vip.id,
        task,
        ..H::new(client, ns, cloud, metrics)
    }
}

async fn start(prefix: &str) -> H {
    start_with(prefix, config()).await
}

fn lbm_json(h: &H, name: &str) -> Value {
    json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerMachine",
        "metadata": {"name": name, "namespace": h.ns, "labels": {"yawol.stackit.cloud/loadbalancer": "web"}},
        "spec": {
            "infrastructure": {
                "defaultNetwork": {"networkID": "net"}, "flavor": {"flavorID": "f"}, "image": {"imageID": "i"},
                "authSecretRef": {"name": "cloud", "namespace": h.ns}
            },
            "portID": h.vip_port, "serverGroupID": "grp-1",
            "loadBalancerRef": {"name": "web", "namespace": h.ns}
        }
    })
}

async fn create_machine(h: &H, name: &str) {
    h.lbm_api()
        .create(
            &PostParams::default(),
            &serde_json::from_value(lbm_json(h, name)).unwrap(),
        )
        .await
        .unwrap();
}

/// The ServiceAccount token of machine `name`, once Kubernetes' token controller has filled in its Secret.
async fn token(h: &H, name: &str) -> String {
    wait("token Secret filled in", || async {
        Ok(h.secrets.get(name).await["data"]["token"].is_string())
    })
    .await;
    let token = h.secrets.get(name).await["data"]["token"]
        .as_str()
        .unwrap()
        .to_string();
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(token)
            .unwrap(),
    )
    .unwrap()
}

async fn wait_active(h: &H, name: &str) {
    wait("lastOpenstackReconcile (server ACTIVE)", || async {
        Ok(h.status(name).await["lastOpenstackReconcile"].is_string())
    })
    .await;
}

fn decoded_file(doc: &Yaml, path: &str) -> String {
    let f = doc["write_files"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|f| f["path"].as_str() == Some(path))
        .unwrap_or_else(|| panic!("{path} missing"));
    let raw = base64::engine::general_purpose::STANDARD
        .decode(f["content"].as_str().unwrap())
        .unwrap();
    String::from_utf8(raw).unwrap()
}

#[tokio::test]
async fn creates_rbac_port_and_server_then_deletion_leaves_nothing() {
    let h = start("lbm-create").await;
    let ns = h.ns.clone();
    create_machine(&h, "web-abc-x1").await;

    // RBAC and the port come first; the server waits for the token controller (no worker blocked meanwhile).
    wait("RBAC objects", || async {
        Ok(h.rbac_left("web-abc-x1").await.len() == 4)
    })
    .await;
    wait("VM port in the status", || async {
        Ok(h.status("web-abc-x1").await["defaultPortID"].is_string())
    })
    .await;
    let m = h.machine("web-abc-x1").await;
    assert_eq!(
        m["metadata"]["finalizers"],
        json!(["yawol.stackit.cloud/controller4"])
    );
    let role = h.rbac[2].get("web-abc-x1").await;
    assert!(role["rules"]
        .to_string()
        .contains("loadbalancermachines/status"));
    let binding = h.rbac[3].get("web-abc-x1").await;
    assert_eq!(binding["subjects"][0]["name"], "web-abc-x1");
    let secret = h.secrets.get("web-abc-x1").await;
    assert_eq!(secret["type"], "kubernetes.io/service-account-token");

    // The real token controller fills the Secret at once, so the wait for it cannot be watched from outside; that
    // the server is booted with the filled-in token (the user data below) shows the controller waited.
    let token = token(&h, "web-abc-x1").await;
    wait_active(&h, "web-abc-x1").await;
    let st = h.status("web-abc-x1").await;
    for k in [
        "serviceAccountName",
        "serviceAccountSecretName",
        "roleName",
        "roleBindingName",
        "defaultPortName",
    ] {
        assert_eq!(st[k], format!("{ns}/web-abc-x1"), "{k} in {st}");
    }
    for k in [
        "serverID",
        "defaultPortID",
        "defaultPortIP",
        "creationTimestamp",
    ] {
        assert!(st[k].is_string(), "{k} in {st}");
    }
    assert_eq!(h.servers().len(), 1);
    assert_eq!(h.vm_ports(), 1);

    // The VM port: our security group and the VIP as allowed address pair; the server on it, in the group.
    let port = h
        .cloud
        .ports()
        .into_iter()
        .find(|p| Some(p.id.as_str()) == st["defaultPortID"].as_str())
        .unwrap();
    let vip = h
        .cloud
        .ports()
        .into_iter()
        .find(|p| p.id == h.vip_port)
        .unwrap();
    assert_eq!(port.security_groups, ["sg-web"]);
    assert_eq!(
        port.allowed_address_pairs,
        [vip.fixed_ips[0].ip_address.clone()]
    );
    let server = &h.servers()[0];
    assert_eq!(Some(server.id.as_str()), st["serverID"].as_str());
    assert_eq!(server.name, "web-abc-x1");
    let boot = h.cloud.server_spec(&server.id).unwrap();
    assert_eq!(boot.port_id, port.id);
    assert_eq!(boot.server_group_id.as_deref(), Some("grp-1"));
    assert_eq!(
        (boot.flavor_id.as_str(), boot.image_id.as_str()),
        ("f", "i")
    );
    // The user data also on a config drive (read without OpenStack DMI).
    assert!(boot.config_drive);

    // The user data: cloud-config with the scoped kubeconfig, the agent's (HA) arguments and the sync secret.
    assert!(boot.user_data.starts_with("#cloud-config\n"));
    let doc: Yaml = serde_yaml::from_str(&boot.user_data).unwrap();
    let kc: kube::config::Kubeconfig =
        serde_yaml::from_str(&decoded_file(&doc, "/etc/lb-agent/kubeconfig")).unwrap();
    assert_eq!(
        kc.clusters[0].cluster.as_ref().unwrap().server.as_deref(),
        Some("https://api.control.example:6443")
    );
    assert_eq!(
        serde_json::to_value(&kc.auth_infos[0]).unwrap()["user"]["token"],
        token.as_str()
    );
    let env = decoded_file(&doc, "/etc/lb-agent/agent.env");
    for arg in [
        &format!("--namespace={ns}"),
        "--loadbalancer-name=web",
        "--loadbalancer-machine-name=web-abc-x1",
        "--vrrp-router-id=42",
        "--sync-listen=0.0.0.0:9190",
        "--sync-secret-file=/etc/lb-agent/sync-secret",
    ] {
        assert!(env.contains(arg), "{arg} in {env}");
    }
    assert!(env.contains(&format!("LB_VIP={}", vip.fixed_ips[0].ip_address)));
    assert_eq!(decoded_file(&doc, "/etc/lb-agent/sync-secret"), SYNC_SECRET);
    assert!(decoded_file(&doc, "/etc/chrony/chrony.conf").contains("server ntp.example iburst"));
    assert_eq!(
        h.wait_events("ServerCreated", "LoadBalancerMachine", 1)
            .await
            .len(),
        1
    );

    // Steady state: another reconcile (a status write by the agent) calls no OpenStack API and writes nothing.
    h.cloud.clear_calls();
    let mut expected = h.versions().await;
    let written = h
        .lbm_api()
        .patch_status(
            "web-abc-x1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"metrics": [
                {"type": "load1", "value": "0.5", "timestamp": "2026-01-01T00:00:00Z"}]}})),
        )
        .await
        .unwrap();
    expected.insert(
        "LoadBalancerMachine web-abc-x1".into(),
        json!(written.metadata.resource_version.unwrap()).to_string(),
    );
    let series = format!(
        r#"loadbalancermachine{{type="load1",lb="web",lbm="web-abc-x1",namespace="{ns}"}} 0.5"#
    );
    wait("agent metric exported", || async {
        Ok(h.metrics.encode().contains(&series))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(h.cloud.calls().is_empty(), "{:?}", h.cloud.calls());
    assert_eq!(h.versions().await, expected, "only the agent's write");

    // Deletion: server, port, RBAC objects, finalizer; nothing left but the LoadBalancer's VIP port.
    h.lbm_api()
        .delete("web-abc-x1", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone("web-abc-x1").await;
    assert!(h.servers().is_empty());
    assert_eq!(h.vm_ports(), 0);
    assert_eq!(h.cloud.counts(), (0, 0, 1, 0, 0), "only the VIP port");
    let left = h.rbac_left("web-abc-x1").await;
    assert!(left.is_empty(), "{left:?} left");
    assert!(
        h.secrets.exists("web-sync").await,
        "the LoadBalancer's sync Secret is not the machine's"
    );
    // Forgotten right after the finalizer write, which a reader can see first.
    wait("series removed", || async {
        Ok(!h.metrics.encode().contains("web-abc-x1"))
    })
    .await;
    h.task.abort();
}

/// What an active-active agent writes: `VIPEligible` with a heartbeat `age_s` old and its own open connections.
async fn report_own_connections(h: &H, name: &str, connections: u64, age_s: i64) {
    let beat = (jiff::Timestamp::now() - jiff::SignedDuration::from_secs(age_s)).to_string();
    h.lbm_api()
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "conditions": [{"type": "VIPEligible", "status": "True", "reason": "Eligible", "message": "",
                                "lastHeartbeatTime": beat, "lastTransitionTime": beat}],
                "metrics": [{"type": "ownConnectionsActive", "value": connections.to_string(),
                             "timestamp": beat}]}})),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn an_active_active_machine_keeps_its_server_while_its_own_connections_drain() {
    let h = start("drain").await;
    create_machine(&h, "web-abc-d1").await;
    create_machine(&h, "web-abc-d2").await;
    wait_active(&h, "web-abc-d1").await;
    wait_active(&h, "web-abc-d2").await;

    // Its agent reports 3 connections of its own: deleted, the machine keeps its server and says why.
    report_own_connections(&h, "web-abc-d1", 3, 0).await;
    h.lbm_api()
        .delete("web-abc-d1", &DeleteParams::default())
        .await
        .unwrap();
    let ev = h
        .wait_events("MachineDraining", "LoadBalancerMachine", 1)
        .await;
    assert!(
        ev[0]["message"]
            .as_str()
            .unwrap()
            .contains("3 connection(s)"),
        "{ev:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.servers().len(), 2, "the draining machine's server stays");
    assert!(!h.machine("web-abc-d1").await.is_null());
    // The last one ends: the server goes, then the machine.
    report_own_connections(&h, "web-abc-d1", 0, 0).await;
    h.wait_gone("web-abc-d1").await;
    assert_eq!(h.servers().len(), 1);

    // An agent that stopped reporting (heartbeat 60 s old) holds nothing back.
    report_own_connections(&h, "web-abc-d2", 5, 60).await;
    h.lbm_api()
        .delete("web-abc-d2", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone("web-abc-d2").await;
    assert!(h.servers().is_empty());
    assert_eq!(
        h.events("MachineDraining", "LoadBalancerMachine")
            .await
            .len(),
        1,
        "announced once, for the first machine only"
    );
    h.task.abort();
}

#[tokio::test]
async fn waits_for_active_by_requeue() {
    let h = start("lbm-requeue").await;
    h.cloud.push_new_server_state("BUILD", None);
    create_machine(&h, "slow").await;
    wait("serverID recorded while building", || async {
        Ok(h.status("slow").await["serverID"].is_string())
    })
    .await;
    let id = h.status("slow").await["serverID"]
        .as_str()
        .unwrap()
        .to_string();
    // Polled again and again (requeue), not waited for in a worker; nothing else is booted meanwhile.
    let polls = h.cloud.call_count("get_server");
    wait("several polls", || async {
        Ok(h.cloud.call_count("get_server") >= polls + 3)
    })
    .await;
    assert!(h.status("slow").await["lastOpenstackReconcile"].is_null());
    assert_eq!(h.servers().len(), 1);
    // A poll only asks Nova: no port lookups, no RBAC writes.
    let (ports, versions, polls) = (
        h.cloud.call_count("find_ports"),
        h.versions().await,
        h.cloud.call_count("get_server"),
    );
    wait("more polls", || async {
        Ok(h.cloud.call_count("get_server") >= polls + 3)
    })
    .await;
    assert_eq!(h.cloud.call_count("find_ports"), ports);
    assert_eq!(h.versions().await, versions);
    // Another machine proceeds meanwhile: the worker is free.
    create_machine(&h, "fast").await;
    wait_active(&h, "fast").await;
    assert!(h.status("slow").await["lastOpenstackReconcile"].is_null());

    h.cloud.set_server_status(&id, "ACTIVE");
    wait_active(&h, "slow").await;
    assert_eq!(
        h.status("slow").await["serverID"],
        id.as_str(),
        "same server"
    );
    assert_eq!(h.servers().len(), 2);
    h.task.abort();
}

#[tokio::test]
async fn error_server_is_replaced_with_novas_fault_in_an_event() {
    let h = start("lbm-error").await;
    h.cloud.push_new_server_state("ERROR", Some(NOVA_FAULT));
    // Nova keeps a deleted server listed for a while: it must not be adopted again nor reported twice.
    h.cloud.set_server_delete_lag(5);
    create_machine(&h, "err").await;
    wait_active(&h, "err").await;
    let events = h.wait_events("ServerError", "LoadBalancerMachine", 1).await;
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(events[0]["count"], 1, "one report per broken server");
    assert!(events[0]["message"].as_str().unwrap().contains(NOVA_FAULT));
    // Also on the LoadBalancer, so the cloud controller forwards it to the Service.
    let on_lb = h.wait_events("ServerError", "LoadBalancer", 1).await;
    assert!(on_lb[0]["message"].as_str().unwrap().contains(NOVA_FAULT));
    assert_eq!(on_lb[0]["source"]["component"], "yawol-service");
    wait("ERROR server gone", || async { Ok(h.servers().len() == 1) }).await;
    let servers = h.servers();
    assert_eq!(servers[0].status, "ACTIVE");
    let st = h.status("err").await;
    assert_eq!(st["serverID"], servers[0].id.as_str());
    assert_eq!(h.vm_ports(), 1, "the port is kept for the new server");
    assert_eq!(
        h.cloud.server_spec(&servers[0].id).unwrap().port_id,
        st["defaultPortID"].as_str().unwrap()
    );
    h.task.abort();
}

#[tokio::test]
async fn a_server_that_fails_later_is_replaced_at_the_next_resync() {
    let h = start_with(
        "lbm-late",
        machine::Config {
            resync: Duration::from_millis(100),
            ..config()
        },
    )
    .await;
    create_machine(&h, "late").await;
    wait_active(&h, "late").await;
    let first = h.status("late").await["serverID"]
        .as_str()
        .unwrap()
        .to_string();
    h.cloud
        .set_server_fault(&first, "ERROR", "Host lbtest-compute-1 went away");
    wait("replacement", || async {
        let st = h.status("late").await;
        Ok(st["serverID"].as_str().is_some_and(|s| s != first)
            && st["lastOpenstackReconcile"].is_string())
    })
    .await;
    assert!(
        h.wait_events("ServerError", "LoadBalancerMachine", 1).await[0]["message"]
            .as_str()
            .unwrap()
            .contains("went away")
    );
    assert_eq!(h.servers().len(), 1);
    h.task.abort();
}

#[tokio::test]
async fn openstack_errors_become_events_and_are_retried_without_duplicates() {
    let h = start("lbm-os-errors").await;
    h.cloud.fail_times(
        "create_port",
        CloudErrorKind::Unavailable,
        "503 Service Unavailable: neutron is restarting",
        2,
    );
    h.cloud.fail_next(
        "create_server",
        CloudErrorKind::Quota,
        "Quota exceeded for instances: Requested 1, but already used 10 of 10 instances",
    );
    // A 5xx right after the server was booted: the retry must adopt it, not boot a second one.
    h.cloud
        .fail_next("get_server", CloudErrorKind::Unavailable, "502 Bad Gateway");
    create_machine(&h, "q").await;
    wait_active(&h, "q").await;

    let has = |warnings: &[Value], needle: &str| {
        warnings
            .iter()
            .any(|e| e["message"].as_str().unwrap().contains(needle))
    };
    let warnings = h.events("OpenStackError", "LoadBalancerMachine").await;
    assert!(
        has(&warnings, "Quota exceeded for instances"),
        "{warnings:#?}"
    );
    assert!(has(&warnings, "neutron is restarting"), "{warnings:#?}");
    assert!(has(&warnings, "502 Bad Gateway"), "{warnings:#?}");
    assert!(has(
        &h.events("OpenStackError", "LoadBalancer").await,
        "Quota exceeded"
    ));
    assert_eq!(h.servers().len(), 1, "no duplicate server");
    assert_eq!(h.vm_ports(), 1, "no duplicate port");
    assert_eq!(
        h.cloud.call_count("create_server"),
        2,
        "failed once, then once"
    );
    let text = h.metrics.encode();
    for series in [
        r#"loadbalancermachine_openstack_errors_total{step="port",kind="Unavailable"} 2"#,
        r#"loadbalancermachine_openstack_errors_total{step="server",kind="Quota"} 1"#,
        r#"loadbalancermachine_openstack_errors_total{step="server",kind="Unavailable"} 1"#,
    ] {
        assert!(text.contains(series), "{series} in {text}");
    }

    // Deletion with a failing Neutron: the finalizer stays until the port is really gone.
    h.cloud.fail_next(
        "delete_port",
        CloudErrorKind::Unavailable,
        "504 Gateway Timeout",
    );
    h.lbm_api()
        .delete("q", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone("q").await;
    assert!(has(
        &h.events("OpenStackError", "LoadBalancerMachine").await,
        "504 Gateway Timeout"
    ));
    assert_eq!(h.cloud.counts(), (0, 0, 1, 0, 0), "only the VIP port");
    let left = h.rbac_left("q").await;
    assert!(left.is_empty(), "{left:?} left");
    h.task.abort();
}

#[tokio::test]
async fn an_interrupted_create_is_adopted_not_duplicated() {
    // A previous controller booted the server and died before recording it.
    let h = start("lbm-adopt").await;
    let port = h
        .cloud
        .create_port(&PortSpec {
            name: format!("{}/orphaned", h.ns),
            network_id: "net".into(),
            security_groups: vec!["sg-web".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let server = h
        .cloud
        .create_server(&lb_controller::openstack::ServerSpec {
            name: "orphaned".into(),
            port_id: port.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    h.cloud.clear_calls();
    create_machine(&h, "orphaned").await;
    wait_active(&h, "orphaned").await;
    let st = h.status("orphaned").await;
    assert_eq!(st["serverID"], server.id.as_str());
    assert_eq!(st["defaultPortID"], port.id.as_str());
    assert_eq!(h.cloud.call_count("create_server"), 0);
    assert_eq!(h.cloud.call_count("create_port"), 0);
    // The port is fixed up (VIP as allowed address pair) rather than replaced.
    let fixed = h
        .cloud
        .ports()
        .into_iter()
        .find(|p| p.id == port.id)
        .unwrap();
    assert_eq!(fixed.allowed_address_pairs.len(), 1);
    assert!(h.secrets.exists("orphaned").await, "RBAC still applied");
    h.task.abort();
}

#[tokio::test]
async fn missing_api_endpoint_is_reported_and_boots_nothing() {
    let h = start_with(
        "lbm-no-endpoint",
        machine::Config {
            api_endpoint: None,
            ..config()
        },
    )
    .await;
    create_machine(&h, "noapi").await;
    wait("InvalidConfiguration event", || async {
        Ok(h.events("InvalidConfiguration", "LoadBalancerMachine")
            .await
            .iter()
            .any(|e| e["message"].as_str().unwrap().contains("API_ENDPOINT")))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(h.servers().is_empty());
    assert_eq!(
        h.vm_ports(),
        0,
        "no port for a machine that cannot get a server"
    );
    // Deletion still works.
    h.lbm_api()
        .delete("noapi", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone("noapi").await;
    assert_eq!(h.vm_ports(), 0);
    h.task.abort();
}

#[tokio::test]
async fn metrics_series_appear_and_disappear() {
    let h = start("lbm-metrics").await;
    create_machine(&h, "m1").await;
    wait_active(&h, "m1").await;
    let server = h.status("m1").await["serverID"]
        .as_str()
        .unwrap()
        .to_string();
    h.lbm_api()
        .patch_status(
            "m1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "metrics": [
                    {"type": "TCP-80-upstream_cx_active", "value": "12", "timestamp": "2026-01-01T00:00:00Z"},
                    {"type": "keepalivedIsMaster", "value": "1", "timestamp": "2026-01-01T00:00:00Z"}],
                "conditions": [{"type": "ConfigReady", "status": "True", "reason": "ConfigApplied",
                                "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                                "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})),
        )
        .await
        .unwrap();
    let base = format!(r#"lb="web",lbm="m1",namespace="{}""#, h.ns);
    wait("series", || async {
        let t = h.metrics.encode();
        Ok(t.contains(&format!(
            r#"loadbalancermachine{{type="TCP-80-upstream_cx_active",{base}}} 12"#
        )) && t.contains(&format!(
            r#"loadbalancermachine_condition{{{base},condition="ConfigReady",reason="ConfigApplied",status="True"}} 1"#
        )) && t.contains(&format!(r#"serverID="{server}",flavorID="f",imageID="i"}} 1"#)))
    })
    .await;
    assert!(!h
        .metrics
        .encode()
        .contains("loadbalancermachine_deletion_timestamp{"));
    // While the server is deleted (Nova is slow), the deletion timestamp is exported.
    h.cloud.set_server_delete_lag(20);
    h.lbm_api()
        .delete("m1", &DeleteParams::default())
        .await
        .unwrap();
    wait("deletion timestamp", || async {
        Ok(h.metrics
            .encode()
            .contains(&format!("loadbalancermachine_deletion_timestamp{{{base}}}")))
    })
    .await;
    h.wait_gone("m1").await;
    // Forgotten right after the finalizer write, which a reader can see first.
    wait("series removed", || async {
        Ok(!h.metrics.encode().contains("lbm=\"m1\""))
    })
    .await;
    h.task.abort();
}

/// The binary's `controller` command starts every OpenStack-side controller through
/// `cli::run_openstack_controllers`: a LoadBalancer becomes a set, a machine, and an ACTIVE server booted with the
/// LoadBalancer's router ID, sync secret and server group; the machine series are on the binary's /metrics; deleting
/// the LoadBalancer removes everything down to the RBAC objects.
#[tokio::test]
async fn the_binarys_entry_point_runs_the_machine_controller() {
    use lb_controller::cli::run_openstack_controllers;
    use lb_controller::openstack::loadbalancer;
    use lb_controller::openstack::run::OpenStackRunConfig;
    use lb_controller::process::http::Health;

    // Only this test of the binary reads the environment (`cli::run_openstack_controllers`).
    std::env::set_var("API_ENDPOINT", "https://api.control.example:6443");
    let (client, ns) = setup("lbm-binary").await;
    let cloud = Arc::new(FakeCloud::new());
    let metrics = Arc::new(lb_controller::metrics::Metrics::new());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run_openstack_controllers(
        client.clone(),
        FixedCloud(cloud.clone()),
        OpenStackRunConfig {
            namespace: ns.clone(),
            loadbalancer: loadbalancer::Config::default(),
            instance: "test".into(),
        },
        metrics.clone(),
        Arc::new(Health::default()),
        async move {
            let _ = stop_rx.await;
        },
    ));
    let lb: lb_api::LoadBalancer = serde_json::from_value(json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": "e2e", "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": "e2e"}},
            "replicas": 1,
            "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
            "infrastructure": {
                "defaultNetwork": {"networkID": "net", "floatingNetID": "ext"},
                "flavor": {"flavorID": "f"}, "image": {"imageID": "i"},
                "authSecretRef": {"name": "cloud", "namespace": ns}
            },
            "options": {"serverGroupPolicy": "anti-affinity"}
        }
    }))
    .unwrap();
    Api::<lb_api::LoadBalancer>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &lb)
        .await
        .unwrap();
    let h = H::new(
        client.clone(),
        ns.clone(),
        cloud.clone(),
        Arc::new(MachineMetrics::default()),
    );
    wait("a LoadBalancerMachine", || async {
        Ok(!h.machines.list().await.is_empty())
    })
    .await;
    let name = h.machines.list().await[0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    wait_active(&h, &name).await;

    let lb = h.lbs.get("e2e").await;
    let server_id = h.status(&name).await["serverID"]
        .as_str()
        .unwrap()
        .to_string();
    let boot = cloud.server_spec(&server_id).unwrap();
    assert_eq!(
        boot.server_group_id.as_deref(),
        lb["status"]["serverGroupID"].as_str(),
        "scheduled into the LoadBalancer's server group"
    );
    let doc: Yaml = serde_yaml::from_str(&boot.user_data).unwrap();
    let env = decoded_file(&doc, "/etc/lb-agent/agent.env");
    let router_id = lb["metadata"]["annotations"]["loadbalancer.yawol.stackit.cloud/vrrpRouterID"]
        .as_str()
        .unwrap();
    assert!(
        env.contains(&format!("--vrrp-router-id={router_id}")),
        "{env}"
    );
    let sync = h.secrets.get("e2e-sync").await;
    let sync = base64::engine::general_purpose::STANDARD
        .decode(sync["data"]["secret"].as_str().unwrap())
        .unwrap();
    assert_eq!(
        decoded_file(&doc, "/etc/lb-agent/sync-secret").as_bytes(),
        &sync[..]
    );
    let text = metrics.encode();
    assert!(
        text.contains(&format!(
            r#"loadbalancermachine_openstack_info{{lb="e2e",lbm="{name}""#
        )),
        "{text}"
    );

    Api::<lb_api::LoadBalancer>::namespaced(client.clone(), &ns)
        .delete("e2e", &DeleteParams::default())
        .await
        .unwrap();
    wait("LoadBalancer gone", || async {
        Ok(!h.lbs.exists("e2e").await)
    })
    .await;
    assert_eq!(cloud.counts(), (0, 0, 0, 0, 0), "nothing left in the cloud");
    let left = h.rbac_left(&name).await;
    assert!(left.is_empty(), "{left:?} left");
    assert!(!metrics.encode().contains(&name), "machine series removed");
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("stops on shutdown")
        .unwrap();
}
