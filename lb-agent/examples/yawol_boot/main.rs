//! The Kubernetes side of the boot test's yawol boot (`cargo xtask image boot-test`, see
//! `xtask/src/image/boot_test.rs`): a real kube-apiserver (kube-testenv) holding one LoadBalancer and its
//! LoadBalancerMachine as yawol-controller leaves them, the machine's ServiceAccount, token Secret, Role (yawol's
//! six rules, [`yawol::role_rules`]) and RoleBinding, and the user data yawol-controller would give the VM
//! ([`yawol::user_data`], with the kubeconfig of that token).
//!
//! Talks over stdin/stdout, one JSON object per stdout line:
//! - prints `{"ready": {...}}` once everything exists (the user data is in `--out`);
//! - `adhoc-on` / `adhoc-off` on stdin: sets / removes the LoadBalancer's ad-hoc debug annotations (yawol's
//!   `adHocDebug`, `adHocDebugSSHKey`), answered by `{"adhoc": ...}`;
//! - `report FLOWS`: waits (up to `--report-within`) until the machine is what yawol-controller counts as ready,
//!   its KeepalivedMaster condition True and `TCP-<port>-upstream_cx_total` at least FLOWS, then prints
//!   `{"report": {...}}`: conditions, metrics, Events, yawol-controller's verdict, and the API server's own count
//!   of refused requests (401/403) — the VM's agent is the only client that could be refused;
//! - end of stdin: stops the cluster and exits.

use lb_test_support::yawol;

use anyhow::{Context, Result};
use clap::Parser;
use k8s_openapi::api::core::v1::{Event, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::Client;
use kube_testenv::KubeEnv;
use lb_api::{LoadBalancer, LoadBalancerMachine};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::io::AsyncBufReadExt;

const LB: &str = "default--boot-test";
const LBM: &str = "default--boot-test-6f7c9d8b5-x1y2z";
const REVISION: &str = "loadbalancer.yawol.stackit.cloud/revision";
/// yawol-controller's readiness: the three conditions True with a heartbeat younger than this.
const READY_HEARTBEAT: Duration = Duration::from_secs(180);
/// A well-formed `ssh-rsa` public key (yawol's pattern); nobody holds its private key.
const DEBUG_KEY: &str =
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQDbootTestKeyNobodyHoldsThePrivateHalf0123456789+/=";

#[derive(Parser)]
struct Args {
    /// Directory for the user data.
    #[arg(long)]
    out: PathBuf,
    /// The VIP (the LoadBalancer's status.portIP, keepalived's VIP, yawollet's --listen-address).
    #[arg(long)]
    vip: String,
    /// The LoadBalancer's backend as the VM reaches it (one endpoint) ...
    #[arg(long)]
    backend: String,
    /// ... and its nodePort.
    #[arg(long)]
    node_port: u16,
    /// The service port.
    #[arg(long, default_value_t = 80)]
    port: u16,
    /// Host name of the API server in the VM's kubeconfig (yawol-controller's API_ENDPOINT): one the server's
    /// certificate names (kube-testenv's: localhost, 127.0.0.1, kubernetes.default.svc); the VM resolves it.
    #[arg(long, default_value = "kubernetes.default.svc")]
    api_host: String,
    /// yawol-controller's --yawollet-requeue-time (seconds).
    #[arg(long, default_value_t = 10)]
    requeue_time: u32,
    /// Turn on logForward in the LoadBalancer (to this Loki URL), which the image reports as not supported.
    #[arg(long)]
    loki_url: Option<String>,
    /// How long `report` waits for the machine to be ready.
    #[arg(long, default_value_t = 120)]
    report_within: u64,
}

fn emit(v: Value) {
    println!("{v}");
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let env = KubeEnv::start().await.context("starting the API server")?;
    let admin = env.client().await?;
    env.apply_crds(&admin, lb_api::crds().into_iter().map(|(_, c)| c))
        .await?;
    let ns = env.namespace(&admin, "yawol").await?;
    let lbs: Api<LoadBalancer> = Api::namespaced(admin.clone(), &ns);
    let lbms: Api<LoadBalancerMachine> = Api::namespaced(admin.clone(), &ns);
    let pp = PostParams::default();

    // The LoadBalancer and machine as yawol-controller leaves them once the VIP port exists (revision 1).
    let infrastructure = json!({
        "defaultNetwork": {"networkID": "net-1"},
        "flavor": {"flavorID": "flavor-1"}, "image": {"imageID": "lb-vm-image"},
        "availabilityZone": "nova", "authSecretRef": {"name": "cloud", "namespace": ns}
    });
    let mut options = json!({});
    if let Some(url) = &args.loki_url {
        options["logForward"] = json!({"enabled": true, "lokiUrl": url});
    }
    let lb: LoadBalancer = serde_json::from_value(json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": LB, "namespace": ns, "annotations": {REVISION: "1"}},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": "boottest"}},
            "replicas": 1,
            "ports": [{"name": "echo", "protocol": "TCP", "port": args.port, "nodePort": args.node_port}],
            "endpoints": [{"name": "host", "addresses": [args.backend]}],
            "infrastructure": infrastructure,
            "options": options,
        }
    }))?;
    lbs.create(&pp, &lb)
        .await
        .context("creating the LoadBalancer")?;
    lbs.patch_status(
        LB,
        &PatchParams::default(),
        &Patch::Merge(
            json!({"status": {"portIP": args.vip, "portID": "vip-port-1", "replicas": 1}}),
        ),
    )
    .await
    .context("the LoadBalancer's status")?;
    let lbm: LoadBalancerMachine = serde_json::from_value(json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerMachine",
        "metadata": {"name": LBM, "namespace": ns, "annotations": {REVISION: "1"},
                     "labels": {"yawol.stackit.cloud/loadbalancer": "boottest"}},
        "spec": {"portID": "vip-port-1", "loadBalancerRef": {"name": LB, "namespace": ns},
                 "infrastructure": infrastructure}
    }))?;
    lbms.create(&pp, &lbm)
        .await
        .context("creating the LoadBalancerMachine")?;

    // The machine's identity exactly as yawol-controller creates it (controllers/yawol-controller/
    // loadbalancermachine: ServiceAccount, a service-account-token Secret, Role with GetRoleRules, RoleBinding).
    let meta = |name: &str| ObjectMeta {
        name: Some(name.to_string()),
        namespace: Some(ns.clone()),
        ..Default::default()
    };
    Api::<ServiceAccount>::namespaced(admin.clone(), &ns)
        .create(
            &pp,
            &ServiceAccount {
                metadata: meta(LBM),
                ..Default::default()
            },
        )
        .await?;
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), &ns);
    let mut secret_meta = meta(LBM);
    secret_meta.annotations = Some(
        [(
            "kubernetes.io/service-account.name".to_string(),
            LBM.to_string(),
        )]
        .into(),
    );
    secrets
        .create(
            &pp,
            &Secret {
                metadata: secret_meta,
                type_: Some("kubernetes.io/service-account-token".into()),
                ..Default::default()
            },
        )
        .await?;
    Api::<Role>::namespaced(admin.clone(), &ns)
        .create(
            &pp,
            &Role {
                metadata: meta(LBM),
                rules: Some(yawol::role_rules(LB, LBM)),
            },
        )
        .await?;
    Api::<RoleBinding>::namespaced(admin.clone(), &ns)
        .create(
            &pp,
            &RoleBinding {
                metadata: meta(LBM),
                role_ref: RoleRef {
                    api_group: "rbac.authorization.k8s.io".into(),
                    kind: "Role".into(),
                    name: LBM.into(),
                },
                subjects: Some(vec![Subject {
                    kind: "ServiceAccount".into(),
                    name: LBM.into(),
                    namespace: Some(ns.clone()),
                    ..Default::default()
                }]),
            },
        )
        .await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let (token, ca) = loop {
        let s = secrets.get(LBM).await?;
        let data = s.data.unwrap_or_default();
        if let (Some(t), Some(ca)) = (data.get("token"), data.get("ca.crt")) {
            break (String::from_utf8(t.0.clone())?, ca.0.clone());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the token controller did not fill the machine's Secret"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let port = env.url().rsplit(':').next().unwrap_or_default().to_string();
    let kubeconfig = yawol::kubeconfig(
        &format!("https://{}:{port}", args.api_host),
        &ca,
        &token,
        &ns,
    );
    let machine = yawol::Machine {
        kubeconfig,
        namespace: ns.clone(),
        loadbalancer: LB.into(),
        machine: LBM.into(),
        vip: args.vip.clone(),
        requeue_time: args.requeue_time,
        ntp_pools: vec![],
        ntp_servers: vec![],
        log_forward: yawol::LogForward {
            enabled: args.loki_url.is_some(),
            loki_url: args.loki_url.clone().unwrap_or_default(),
            ..Default::default()
        },
        debug: false,
    };
    std::fs::create_dir_all(&args.out)?;
    let user_data = args.out.join("user-data");
    std::fs::write(&user_data, yawol::user_data(&machine))?;
    let refused_before = refused_requests(&admin).await?;
    emit(json!({"ready": {
        "user_data": user_data, "api_port": port, "namespace": ns, "loadbalancer": LB, "machine": LBM,
        "yawollet_args": yawol::yawollet_args(&machine),
    }}));

    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("adhoc-on") => {
                let patch = json!({"metadata": {"annotations": {
                    "yawol.stackit.cloud/adHocDebug": "true",
                    "yawol.stackit.cloud/adHocDebugSSHKey": DEBUG_KEY,
                }}});
                lbs.patch(LB, &PatchParams::default(), &Patch::Merge(patch))
                    .await?;
                emit(json!({"adhoc": {"on": true, "key": DEBUG_KEY}}));
            }
            Some("adhoc-off") => {
                let patch = json!({"metadata": {"annotations": {
                    "yawol.stackit.cloud/adHocDebug": null,
                    "yawol.stackit.cloud/adHocDebugSSHKey": null,
                }}});
                lbs.patch(LB, &PatchParams::default(), &Patch::Merge(patch))
                    .await?;
                emit(json!({"adhoc": {"on": false}}));
            }
            Some("report") => {
                let flows: u64 = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
                let report =
                    report(&admin, &lbms, &ns, args.port, flows, args.report_within).await?;
                let refused = refused_requests(&admin).await? - refused_before;
                let mut r = report;
                r["refused_requests"] = json!(refused);
                emit(json!({ "report": r }));
            }
            Some(other) => emit(json!({"error": format!("unknown command {other}")})),
            None => {}
        }
    }
    Ok(())
}

/// The machine's status once yawol-controller would count it ready with the VIP and `flows` connections (or
/// whatever it is after `within` seconds), with yawol-controller's verdict and the machine's Events.
async fn report(
    admin: &Client,
    lbms: &Api<LoadBalancerMachine>,
    ns: &str,
    port: u16,
    flows: u64,
    within: u64,
) -> Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(within);
    let flows_metric = format!("TCP-{port}-upstream_cx_total");
    loop {
        let m = lbms.get(LBM).await?;
        let status = m.status.clone().unwrap_or_default();
        let conditions = status.conditions.clone().unwrap_or_default();
        let metrics: Vec<(String, String)> = status
            .metrics
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|m| (m.type_, m.value))
            .collect();
        let (ready, why) = yawol_ready(&conditions);
        let master = conditions
            .iter()
            .any(|c| c.type_ == "KeepalivedMaster" && c.status == "True");
        let counted = metrics
            .iter()
            .find(|(t, _)| *t == flows_metric)
            .and_then(|(_, v)| v.parse::<u64>().ok())
            .unwrap_or(0);
        if (ready && master && counted >= flows) || Instant::now() >= deadline {
            let events: Vec<Value> = Api::<Event>::namespaced(admin.clone(), ns)
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .map(|e| {
                    json!({
                        "object": format!("{}/{}", e.involved_object.kind.unwrap_or_default(),
                                          e.involved_object.name.unwrap_or_default()),
                        "type": e.type_, "reason": e.reason, "message": e.message,
                        "component": e.source.and_then(|s| s.component),
                    })
                })
                .collect();
            // yawol-controller parses every value as a float (strconv.ParseFloat) and skips the others.
            let unparsable: Vec<&String> = metrics
                .iter()
                .filter(|(_, v)| v.parse::<f64>().is_err())
                .map(|(t, _)| t)
                .collect();
            return Ok(json!({
                "yawol_ready": ready,
                "yawol_not_ready_because": why,
                "keepalived_master": master,
                "flows_counted": counted,
                "conditions": conditions.iter().map(|c| json!({
                    "type": c.type_, "status": c.status, "reason": c.reason, "message": c.message,
                })).collect::<Vec<_>>(),
                "metrics": metrics.iter().map(|(t, v)| json!([t, v])).collect::<Vec<_>>(),
                "unparsable_metrics": unparsable,
                "events": events,
            }));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// yawol-controller's `isMachineReady` (`helper.AreRelevantConditionsMet` with a 180 s heartbeat): ConfigReady,
/// EnvoyReady and EnvoyUpToDate present, True, and beaten within the last 180 s.
fn yawol_ready(conditions: &[k8s_openapi::api::core::v1::NodeCondition]) -> (bool, String) {
    if conditions.is_empty() {
        return (false, "no conditions set".into());
    }
    let now = k8s_openapi::jiff::Timestamp::now();
    for ty in ["ConfigReady", "EnvoyReady", "EnvoyUpToDate"] {
        let Some(c) = conditions.iter().find(|c| c.type_ == ty) else {
            return (
                false,
                format!("required condition {ty} not present on machine"),
            );
        };
        if c.status != "True" {
            return (
                false,
                format!("condition {ty} is in status {} ({:?})", c.status, c.reason),
            );
        }
        let fresh = c
            .last_heartbeat_time
            .as_ref()
            .is_some_and(|t| now.duration_since(t.0).as_secs() < READY_HEARTBEAT.as_secs() as i64);
        if !fresh {
            return (false, format!("condition {ty} heartbeat is stale"));
        }
    }
    (true, String::new())
}

/// The API server's count of requests it answered 401 or 403 (`apiserver_request_total`).
async fn refused_requests(admin: &Client) -> Result<u64> {
    let text = admin
        .request_text(http::Request::get("/metrics").body(Vec::new())?)
        .await
        .context("the API server's /metrics")?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
        .filter(|l| l.contains("code=\"403\"") || l.contains("code=\"401\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum())
}
