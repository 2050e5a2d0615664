//! The LoadBalancerMachine controller through `kube::Client` against the in-memory API server, with the fake cloud:
//! RBAC objects, VM port and server booted with the machine's token and the agent's (HA) arguments, status after
//! each step, ACTIVE wait by requeue, ERROR servers replaced with Nova's fault in an event, injected OpenStack
//! errors (quota, 5xx) retried without duplicates, deletion leaving nothing, metrics series appearing and going.
//!
//! The in-memory API server has no token controller: the tests write the ServiceAccount token into the token Secret
//! themselves, as Kubernetes would.

mod common;

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::Api;
use lb_api::fake_api::{FakeApiServer, ResourceKey};
use lb_api::LoadBalancerMachine;
use lb_controller::events::EventPublisher;
use lb_controller::lb_controller::FixedCloud;
use lb_controller::lbm_controller::{run, LbmContext, LbmControllerConfig};
use lb_controller::lbm_metrics::LbmMetrics;
use lb_controller::openstack::fake::FakeCloud;
use lb_controller::openstack::{Cloud, CloudErrorKind, PortSpec};
use serde_json::{json, Value};
use serde_yaml::Value as Yaml;

const NS: &str = "yawol";
const TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.machine-token";
const SYNC_SECRET: &str = "5f0c9a8e7d6b5a4938271605f4e3d2c1b0a99887766554433221100ffeeddccb";
const NOVA_FAULT: &str = "No valid host was found. There are not enough hosts available.";

fn key(group: &str, plural: &str) -> ResourceKey {
    ResourceKey::new(group, plural)
}
fn machines() -> ResourceKey {
    key("yawol.stackit.cloud", "loadbalancermachines")
}
fn events() -> ResourceKey {
    key("", "events")
}
fn rbac_keys() -> [ResourceKey; 4] {
    [
        key("", "serviceaccounts"),
        key("", "secrets"),
        key("rbac.authorization.k8s.io", "roles"),
        key("rbac.authorization.k8s.io", "rolebindings"),
    ]
}

async fn wait_for(what: &str, check: impl FnMut() -> bool) {
    common::wait_within(what, Duration::from_secs(10), check).await
}

struct H {
    api: FakeApiServer,
    cloud: Arc<FakeCloud>,
    metrics: Arc<LbmMetrics>,
    vip_port: String,
    task: tokio::task::JoinHandle<()>,
}

impl H {
    fn machine(&self, name: &str) -> Option<Value> {
        self.api.get(&machines(), NS, name)
    }
    fn status(&self, name: &str) -> Value {
        self.machine(name)
            .map(|m| m["status"].clone())
            .unwrap_or(Value::Null)
    }
    fn events(&self, reason: &str, kind: &str) -> Vec<Value> {
        self.api
            .list(&events())
            .into_iter()
            .filter(|e| e["reason"] == reason && e["involvedObject"]["kind"] == kind)
            .collect()
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
}

fn config() -> LbmControllerConfig {
    LbmControllerConfig {
        api_endpoint: Some("https://api.control.example:6443".into()),
        ntp_servers: vec!["ntp.example".into()],
        interface: "eth0".into(),
        resync: Duration::from_secs(300),
        poll: Duration::from_millis(20),
        error_backoff_base: Duration::from_millis(20),
        error_backoff_max: Duration::from_millis(200),
    }
}

/// The in-memory API server with a LoadBalancer that the LoadBalancer controller has already reconciled (security
/// group, VIP port, VRRP router ID annotation, sync Secret) and the machine controller running.
async fn start_with(config: LbmControllerConfig) -> H {
    let api = FakeApiServer::new();
    for (_, crd) in lb_api::crds() {
        api.install_crd(&crd);
    }
    let cloud = Arc::new(FakeCloud::new());
    let vip = cloud
        .create_port(&PortSpec {
            name: format!("{NS}/web"),
            network_id: "net".into(),
            security_groups: vec!["sg-web".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    api.put(
        &key("yawol.stackit.cloud", "loadbalancers"),
        json!({
            "metadata": {"name": "web", "namespace": NS,
                         "annotations": {"loadbalancer.yawol.stackit.cloud/vrrpRouterID": "42"}},
            "spec": {
                "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": "web"}},
                "replicas": 1,
                "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
                "infrastructure": {
                    "defaultNetwork": {"networkID": "net"}, "flavor": {"flavorID": "f"},
                    "image": {"imageID": "i"}, "authSecretRef": {"name": "cloud", "namespace": NS}
                }
            },
            "status": {"securityGroupID": "sg-web", "portID": vip.id, "portIP": vip.fixed_ips[0].ip_address}
        }),
    );
    api.put(
        &key("", "secrets"),
        json!({
            "metadata": {"name": "web-sync", "namespace": NS},
            "data": {"secret": base64::engine::general_purpose::STANDARD.encode(SYNC_SECRET)}
        }),
    );
    cloud.clear_calls();
    let client = api.client();
    let metrics = Arc::new(LbmMetrics::default());
    let ctx = Arc::new(LbmContext::new(
        client.clone(),
        FixedCloud(cloud.clone()),
        Arc::new(EventPublisher::new(client, "yawol-service", "test")),
        metrics.clone(),
        config,
    ));
    let task = tokio::spawn(async move { run(ctx, NS, std::future::pending()).await });
    H {
        api,
        cloud,
        metrics,
        vip_port: vip.id,
        task,
    }
}

async fn start() -> H {
    start_with(config()).await
}

fn lbm_json(h: &H, name: &str) -> Value {
    json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerMachine",
        "metadata": {"name": name, "namespace": NS, "labels": {"yawol.stackit.cloud/loadbalancer": "web"}},
        "spec": {
            "infrastructure": {
                "defaultNetwork": {"networkID": "net"}, "flavor": {"flavorID": "f"}, "image": {"imageID": "i"},
                "authSecretRef": {"name": "cloud", "namespace": NS}
            },
            "portID": h.vip_port, "serverGroupID": "grp-1",
            "loadBalancerRef": {"name": "web", "namespace": NS}
        }
    })
}

async fn create_machine(h: &H, name: &str) {
    let api: Api<LoadBalancerMachine> = Api::namespaced(h.api.client(), NS);
    api.create(
        &PostParams::default(),
        &serde_json::from_value(lbm_json(h, name)).unwrap(),
    )
    .await
    .unwrap();
}

/// What Kubernetes' token controller does: fill in the token Secret once it exists.
async fn fill_token(h: &H, name: &str) {
    wait_for("token Secret", || {
        h.api.get(&key("", "secrets"), NS, name).is_some()
    })
    .await;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(h.api.client(), NS)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"token": b64(TOKEN), "ca.crt": b64("-----BEGIN CERTIFICATE-----\n")}})),
        )
        .await
        .unwrap();
}

async fn wait_active(h: &H, name: &str) {
    wait_for("lastOpenstackReconcile (server ACTIVE)", || {
        h.status(name)["lastOpenstackReconcile"].is_string()
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
    let h = start().await;
    create_machine(&h, "web-abc-x1").await;

    // RBAC and the port come first; the server waits for the token controller (no worker blocked meanwhile).
    wait_for("RBAC objects", || {
        rbac_keys()
            .iter()
            .all(|k| h.api.get(k, NS, "web-abc-x1").is_some())
    })
    .await;
    wait_for("VM port in the status", || {
        h.status("web-abc-x1")["defaultPortID"].is_string()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(h.servers().is_empty(), "no server without a token");
    let m = h.machine("web-abc-x1").unwrap();
    assert_eq!(
        m["metadata"]["finalizers"],
        json!(["yawol.stackit.cloud/controller4"])
    );
    let role = h
        .api
        .get(&key("rbac.authorization.k8s.io", "roles"), NS, "web-abc-x1")
        .unwrap();
    assert!(role["rules"]
        .to_string()
        .contains("loadbalancermachines/status"));
    let binding = h
        .api
        .get(
            &key("rbac.authorization.k8s.io", "rolebindings"),
            NS,
            "web-abc-x1",
        )
        .unwrap();
    assert_eq!(binding["subjects"][0]["name"], "web-abc-x1");
    let secret = h.api.get(&key("", "secrets"), NS, "web-abc-x1").unwrap();
    assert_eq!(secret["type"], "kubernetes.io/service-account-token");

    fill_token(&h, "web-abc-x1").await;
    wait_active(&h, "web-abc-x1").await;
    let st = h.status("web-abc-x1");
    for (k, v) in [
        ("serviceAccountName", "yawol/web-abc-x1"),
        ("serviceAccountSecretName", "yawol/web-abc-x1"),
        ("roleName", "yawol/web-abc-x1"),
        ("roleBindingName", "yawol/web-abc-x1"),
        ("defaultPortName", "yawol/web-abc-x1"),
    ] {
        assert_eq!(st[k], v, "{k} in {st}");
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
        TOKEN
    );
    let env = decoded_file(&doc, "/etc/lb-agent/agent.env");
    for arg in [
        "--namespace=yawol",
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
    assert_eq!(h.events("ServerCreated", "LoadBalancerMachine").len(), 1);

    // Steady state: another reconcile (a status write by the agent) calls no OpenStack API and writes nothing.
    h.cloud.clear_calls();
    let writes = h.api.write_count();
    Api::<LoadBalancerMachine>::namespaced(h.api.client(), NS)
        .patch_status(
            "web-abc-x1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"metrics": [
                {"type": "load1", "value": "0.5", "timestamp": "2026-01-01T00:00:00Z"}]}})),
        )
        .await
        .unwrap();
    wait_for("agent metric exported", || {
        h.metrics.encode().contains(
            r#"loadbalancermachine{type="load1",lb="web",lbm="web-abc-x1",namespace="yawol"} 0.5"#,
        )
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(h.cloud.calls().is_empty(), "{:?}", h.cloud.calls());
    assert_eq!(h.api.write_count(), writes + 1, "only the agent's write");

    // Deletion: server, port, RBAC objects, finalizer; nothing left but the LoadBalancer's VIP port.
    Api::<LoadBalancerMachine>::namespaced(h.api.client(), NS)
        .delete("web-abc-x1", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("machine gone", || h.machine("web-abc-x1").is_none()).await;
    assert!(h.servers().is_empty());
    assert_eq!(h.vm_ports(), 0);
    assert_eq!(h.cloud.counts(), (0, 0, 1, 0, 0), "only the VIP port");
    for k in rbac_keys() {
        assert!(h.api.get(&k, NS, "web-abc-x1").is_none(), "{k:?} left");
    }
    assert!(
        h.api.get(&key("", "secrets"), NS, "web-sync").is_some(),
        "the LoadBalancer's sync Secret is not the machine's"
    );
    assert!(!h.metrics.encode().contains("web-abc-x1"), "series removed");
    h.task.abort();
}

#[tokio::test]
async fn waits_for_active_by_requeue() {
    let h = start().await;
    h.cloud.push_new_server_state("BUILD", None);
    create_machine(&h, "slow").await;
    fill_token(&h, "slow").await;
    wait_for("serverID recorded while building", || {
        h.status("slow")["serverID"].is_string()
    })
    .await;
    let id = h.status("slow")["serverID"].as_str().unwrap().to_string();
    // Polled again and again (requeue), not waited for in a worker; nothing else is booted meanwhile.
    let polls = h.cloud.call_count("get_server");
    wait_for("several polls", || {
        h.cloud.call_count("get_server") >= polls + 3
    })
    .await;
    assert!(h.status("slow")["lastOpenstackReconcile"].is_null());
    assert_eq!(h.servers().len(), 1);
    // A poll only asks Nova: no port lookups, no RBAC writes.
    let (ports, writes, polls) = (
        h.cloud.call_count("find_ports"),
        h.api.write_count(),
        h.cloud.call_count("get_server"),
    );
    wait_for("more polls", || {
        h.cloud.call_count("get_server") >= polls + 3
    })
    .await;
    assert_eq!(h.cloud.call_count("find_ports"), ports);
    assert_eq!(h.api.write_count(), writes);
    // Another machine proceeds meanwhile: the worker is free.
    create_machine(&h, "fast").await;
    fill_token(&h, "fast").await;
    wait_active(&h, "fast").await;
    assert!(h.status("slow")["lastOpenstackReconcile"].is_null());

    h.cloud.set_server_status(&id, "ACTIVE");
    wait_active(&h, "slow").await;
    assert_eq!(h.status("slow")["serverID"], id.as_str(), "same server");
    assert_eq!(h.servers().len(), 2);
    h.task.abort();
}

#[tokio::test]
async fn error_server_is_replaced_with_novas_fault_in_an_event() {
    let h = start().await;
    h.cloud.push_new_server_state("ERROR", Some(NOVA_FAULT));
    // Nova keeps a deleted server listed for a while: it must not be adopted again nor reported twice.
    h.cloud.set_server_delete_lag(5);
    create_machine(&h, "err").await;
    fill_token(&h, "err").await;
    wait_active(&h, "err").await;
    let events = h.events("ServerError", "LoadBalancerMachine");
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(events[0]["count"], 1, "one report per broken server");
    assert!(events[0]["message"].as_str().unwrap().contains(NOVA_FAULT));
    // Also on the LoadBalancer, so the cloud controller forwards it to the Service.
    let on_lb = h.events("ServerError", "LoadBalancer");
    assert!(on_lb[0]["message"].as_str().unwrap().contains(NOVA_FAULT));
    assert_eq!(on_lb[0]["source"]["component"], "yawol-service");
    wait_for("ERROR server gone", || h.servers().len() == 1).await;
    let servers = h.servers();
    assert_eq!(servers[0].status, "ACTIVE");
    assert_eq!(h.status("err")["serverID"], servers[0].id.as_str());
    assert_eq!(h.vm_ports(), 1, "the port is kept for the new server");
    assert_eq!(
        h.cloud.server_spec(&servers[0].id).unwrap().port_id,
        h.status("err")["defaultPortID"].as_str().unwrap()
    );
    h.task.abort();
}

#[tokio::test]
async fn a_server_that_fails_later_is_replaced_at_the_next_resync() {
    let h = start_with(LbmControllerConfig {
        resync: Duration::from_millis(100),
        ..config()
    })
    .await;
    create_machine(&h, "late").await;
    fill_token(&h, "late").await;
    wait_active(&h, "late").await;
    let first = h.status("late")["serverID"].as_str().unwrap().to_string();
    h.cloud
        .set_server_fault(&first, "ERROR", "Host lbtest-compute-1 went away");
    wait_for("replacement", || {
        h.status("late")["serverID"]
            .as_str()
            .is_some_and(|s| s != first)
            && h.status("late")["lastOpenstackReconcile"].is_string()
    })
    .await;
    assert!(h.events("ServerError", "LoadBalancerMachine")[0]["message"]
        .as_str()
        .unwrap()
        .contains("went away"));
    assert_eq!(h.servers().len(), 1);
    h.task.abort();
}

#[tokio::test]
async fn openstack_errors_become_events_and_are_retried_without_duplicates() {
    let h = start().await;
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
    fill_token(&h, "q").await;
    wait_active(&h, "q").await;

    let warnings = h.events("OpenStackError", "LoadBalancerMachine");
    let text = |needle: &str| {
        warnings
            .iter()
            .any(|e| e["message"].as_str().unwrap().contains(needle))
    };
    assert!(text("Quota exceeded for instances"), "{warnings:#?}");
    assert!(text("neutron is restarting"), "{warnings:#?}");
    assert!(text("502 Bad Gateway"), "{warnings:#?}");
    assert!(h
        .events("OpenStackError", "LoadBalancer")
        .iter()
        .any(|e| e["message"].as_str().unwrap().contains("Quota exceeded")));
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
    Api::<LoadBalancerMachine>::namespaced(h.api.client(), NS)
        .delete("q", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("machine gone", || h.machine("q").is_none()).await;
    assert!(h
        .events("OpenStackError", "LoadBalancerMachine")
        .iter()
        .any(|e| e["message"]
            .as_str()
            .unwrap()
            .contains("504 Gateway Timeout")));
    assert_eq!(h.cloud.counts(), (0, 0, 1, 0, 0), "only the VIP port");
    for k in rbac_keys() {
        assert!(h.api.get(&k, NS, "q").is_none(), "{k:?} left");
    }
    h.task.abort();
}

#[tokio::test]
async fn an_interrupted_create_is_adopted_not_duplicated() {
    // A previous controller booted the server and died before recording it.
    let h = start().await;
    let port = h
        .cloud
        .create_port(&PortSpec {
            name: format!("{NS}/orphaned"),
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
    let st = h.status("orphaned");
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
    assert!(
        h.api.get(&key("", "secrets"), NS, "orphaned").is_some(),
        "RBAC still applied"
    );
    h.task.abort();
}

#[tokio::test]
async fn missing_api_endpoint_is_reported_and_boots_nothing() {
    let h = start_with(LbmControllerConfig {
        api_endpoint: None,
        ..config()
    })
    .await;
    create_machine(&h, "noapi").await;
    wait_for("InvalidConfiguration event", || {
        h.events("InvalidConfiguration", "LoadBalancerMachine")
            .iter()
            .any(|e| e["message"].as_str().unwrap().contains("API_ENDPOINT"))
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
    Api::<LoadBalancerMachine>::namespaced(h.api.client(), NS)
        .delete("noapi", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("machine gone", || h.machine("noapi").is_none()).await;
    assert_eq!(h.vm_ports(), 0);
    h.task.abort();
}

#[tokio::test]
async fn metrics_series_appear_and_disappear() {
    let h = start().await;
    create_machine(&h, "m1").await;
    fill_token(&h, "m1").await;
    wait_active(&h, "m1").await;
    let server = h.status("m1")["serverID"].as_str().unwrap().to_string();
    Api::<LoadBalancerMachine>::namespaced(h.api.client(), NS)
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
    let base = r#"lb="web",lbm="m1",namespace="yawol""#;
    wait_for("series", || {
        let t = h.metrics.encode();
        t.contains(&format!(
            r#"loadbalancermachine{{type="TCP-80-upstream_cx_active",{base}}} 12"#
        )) && t.contains(&format!(
            r#"loadbalancermachine_condition{{{base},condition="ConfigReady",reason="ConfigApplied",status="True"}} 1"#
        )) && t.contains(&format!(r#"serverID="{server}",flavorID="f",imageID="i"}} 1"#))
    })
    .await;
    assert!(!h
        .metrics
        .encode()
        .contains("loadbalancermachine_deletion_timestamp{"));
    // While the server is deleted (Nova is slow), the deletion timestamp is exported.
    h.cloud.set_server_delete_lag(20);
    Api::<LoadBalancerMachine>::namespaced(h.api.client(), NS)
        .delete("m1", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("deletion timestamp", || {
        h.metrics
            .encode()
            .contains(&format!("loadbalancermachine_deletion_timestamp{{{base}}}"))
    })
    .await;
    wait_for("machine gone", || h.machine("m1").is_none()).await;
    let t = h.metrics.encode();
    assert!(!t.contains("lbm=\"m1\""), "{t}");
    h.task.abort();
}

async fn wait_long(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..600 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

/// The binary's `controller` command starts every OpenStack-side controller through
/// `run::run_openstack_controllers`: a LoadBalancer becomes a set, a machine, and an ACTIVE server booted with the
/// LoadBalancer's router ID, sync secret and server group; the machine series are on the binary's /metrics; deleting
/// the LoadBalancer removes everything down to the RBAC objects.
#[tokio::test]
async fn the_binarys_entry_point_runs_the_machine_controller() {
    use lb_controller::lb_controller::LbControllerConfig;
    use lb_controller::run::{run_openstack_controllers, Health, OpenStackRunConfig};

    // Only this test of the binary reads the environment (`OpenStackTuning::from_env`).
    std::env::set_var("API_ENDPOINT", "https://api.control.example:6443");
    let server = FakeApiServer::new();
    for (_, crd) in lb_api::crds() {
        server.install_crd(&crd);
    }
    let cloud = Arc::new(FakeCloud::new());
    let metrics = Arc::new(lb_controller::metrics::Metrics::new());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run_openstack_controllers(
        server.client(),
        FixedCloud(cloud.clone()),
        OpenStackRunConfig {
            namespace: NS.into(),
            loadbalancer: LbControllerConfig::default(),
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
        "metadata": {"name": "e2e", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": "e2e"}},
            "replicas": 1,
            "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
            "infrastructure": {
                "defaultNetwork": {"networkID": "net", "floatingNetID": "ext"},
                "flavor": {"flavorID": "f"}, "image": {"imageID": "i"},
                "authSecretRef": {"name": "cloud", "namespace": NS}
            },
            "options": {"serverGroupPolicy": "anti-affinity"}
        }
    }))
    .unwrap();
    Api::<lb_api::LoadBalancer>::namespaced(server.client(), NS)
        .create(&PostParams::default(), &lb)
        .await
        .unwrap();
    let machine = || -> Option<Value> { server.list(&machines()).into_iter().next() };
    wait_long("a LoadBalancerMachine", || machine().is_some()).await;
    let name = machine().unwrap()["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let h = H {
        api: server.clone(),
        cloud: cloud.clone(),
        metrics: Arc::new(LbmMetrics::default()),
        vip_port: String::new(),
        task: tokio::spawn(async {}),
    };
    fill_token(&h, &name).await;
    wait_long("server ACTIVE", || {
        h.status(&name)["lastOpenstackReconcile"].is_string()
    })
    .await;

    let lb = server
        .get(&key("yawol.stackit.cloud", "loadbalancers"), NS, "e2e")
        .unwrap();
    let server_id = h.status(&name)["serverID"].as_str().unwrap().to_string();
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
    let sync = server.get(&key("", "secrets"), NS, "e2e-sync").unwrap();
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

    Api::<lb_api::LoadBalancer>::namespaced(server.client(), NS)
        .delete("e2e", &DeleteParams::default())
        .await
        .unwrap();
    wait_long("LoadBalancer gone", || {
        server
            .get(&key("yawol.stackit.cloud", "loadbalancers"), NS, "e2e")
            .is_none()
    })
    .await;
    assert_eq!(cloud.counts(), (0, 0, 0, 0, 0), "nothing left in the cloud");
    for k in rbac_keys() {
        assert!(server.get(&k, NS, &name).is_none(), "{k:?} left");
    }
    assert!(!metrics.encode().contains(&name), "machine series removed");
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("stops on shutdown")
        .unwrap();
}
