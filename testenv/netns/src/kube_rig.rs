//! The real agent in Kubernetes mode on the rig, against a real API server (kube-testenv): a LoadBalancer and its
//! LoadBalancerMachine in a namespace of their own, the machine's Kubernetes access made as the controller makes
//! it (ServiceAccount, token Secret filled in by Kubernetes' token controller, Role, RoleBinding — server-side
//! applied with the controller's builders), and the agent started with the controller's flags and kubeconfig
//! (`lb_controller::openstack::machine::cloudinit`). A change written to the LoadBalancer then travels the way
//! it does in production: API server, the agent's watch, its maps, the packets. The `kube_agent` test checks
//! what arrives; the `kube-config` benchmark times it ([`KubeRig::change_port`] serves both).
//!
//! Behind the `kubernetes` feature: it brings the controller crate (and its OpenStack SDK), which the other
//! users of this library (the netns benchmarks' release builds) need not compile.

use crate::rig::{
    KubeAgent, Rig, RigConfig, TCP_NODE_PORT, TCP_PORT, UDP_NODE_PORT, UDP_PORT, VIP_OCTET,
};
use crate::Host;
use anyhow::{anyhow, bail, Context, Result};
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, Patch, PatchParams, PostParams};
pub use kube_testenv::KubeEnv;
use lb_api::{LoadBalancer, LoadBalancerMachine};
use lb_controller::openstack::machine::cloudinit::{self, UserDataParams};
use lb_controller::openstack::machine::rbac::{self, MachineIdentity};
use lb_controller::openstack::machine::FIELD_MANAGER;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Name of the LoadBalancer.
pub const LB: &str = "lb";
/// Name of the LoadBalancerMachine (and of its ServiceAccount, Secret, Role, RoleBinding).
pub const MACHINE: &str = "lb-abcde-xyz12";
/// Time between two connection attempts while waiting for a port to be forwarded: the resolution of
/// [`KubeRig::change_port`]'s measurement, and each attempt costs the lb a refused SYN.
const PROBE_PACE: Duration = Duration::from_micros(500);
/// How long one attempt waits for its handshake: an unanswered SYN (dropped on the way) is given up after this
/// and counted, instead of waiting out the kernel's one-second retransmission.
const PROBE_CONNECT_TIMEOUT: Duration = Duration::from_millis(200);

/// The rig with its agent in Kubernetes mode. Dropping it stops the agent and the rig; the namespace stays in
/// the cluster, which lives as long as the process ([`KubeEnv::shared`]).
pub struct KubeRig {
    /// The rig (dropped first: the agent stops before its API client's runtime).
    pub rig: Rig,
    /// The namespace of the objects.
    pub namespace: String,
    /// Admin view of the LoadBalancers in the namespace.
    lbs: Api<LoadBalancer>,
    /// Runs the admin client: kept running between calls, so a write reuses a warm connection.
    rt: tokio::runtime::Runtime,
}

/// What [`KubeRig::change_port`] saw.
#[derive(Clone, Debug)]
pub struct PortChange {
    /// The LoadBalancer's `metadata.generation` after the write.
    pub generation: i64,
    /// From sending the write to the API server's answer.
    pub write: Duration,
    /// From sending the write to the first connection through the new port (its SYN forwarded to a backend and
    /// the SYN-ACK back).
    pub first_packet: Duration,
    /// The backend that answered (its echo greeting).
    pub backend: String,
    /// Attempts refused (the port not forwarded yet: the lb's kernel answered RST).
    pub refused: u32,
    /// Attempts whose SYN went unanswered (dropped on the way).
    pub unanswered: u32,
}

impl KubeRig {
    /// Creates the objects in a fresh namespace of `env` and starts `cfg`'s rig with the agent in Kubernetes mode
    /// (`cfg.kubernetes` is set here); returns once the agent forwards the LoadBalancer's ports. The LoadBalancer
    /// has TCP [`TCP_PORT`] and UDP [`UDP_PORT`] to every backend's NodePorts, and `options` (its `spec.options`).
    pub fn start(env: &KubeEnv, mut cfg: RigConfig, options: Value) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let topo = &cfg.topology;
        let vip = topo.addr(VIP_OCTET);
        let backends: Vec<Ipv4Addr> = (1..=cfg.backends)
            .map(|i| topo.ip(Host::Backend(i)))
            .collect();
        let interface = topo.host_ifname.clone();
        let active_active = options["activeActive"] == json!(true);
        let (namespace, lbs, agent) = rt.block_on(async {
            let admin = env.client().await?;
            env.apply_crds(&admin, lb_api::crds().into_iter().map(|(_, c)| c))
                .await?;
            let ns = env.namespace(&admin, "kube-agent").await?;
            let lbs: Api<LoadBalancer> = Api::namespaced(admin.clone(), &ns);
            let pp = PostParams::default();
            let lbm = Api::<LoadBalancerMachine>::namespaced(admin.clone(), &ns)
                .create(&pp, &serde_json::from_value(machine_json(&ns))?)
                .await
                .context("creating the LoadBalancerMachine")?;
            lbs.create(
                &pp,
                &serde_json::from_value(lb_json(&ns, &backends, options))?,
            )
            .await
            .context("creating the LoadBalancer")?;
            // The VIP, as the controller writes it once its port exists.
            lbs.patch_status(
                LB,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": {"portIP": vip.to_string()}})),
            )
            .await
            .context("setting the LoadBalancer's status.portIP")?;
            let id = MachineIdentity {
                namespace: ns.clone(),
                machine: MACHINE.into(),
                machine_uid: lbm
                    .metadata
                    .uid
                    .context("a LoadBalancerMachine without uid")?,
                loadbalancer: LB.into(),
            };
            apply_machine_access(&admin, &id).await?;
            let token = machine_token(&admin, &ns).await?;
            // Active-active: the machine's flags as the controller writes them (its own address as SNAT
            // address, sync without peers), the sync secret in a file of the rig's instead of the VM's path.
            let sync_secret = std::env::temp_dir().join(format!("{ns}-sync-secret"));
            let (ha, active_active_address) = if active_active {
                let settings = lb_api::ha::HaSettings::new(&ns, LB, &Default::default())?;
                std::fs::write(&sync_secret, &settings.sync_secret)?;
                (Some(settings), Some(topo.ip(Host::Lb).to_string()))
            } else {
                (None, None)
            };
            let params = UserDataParams {
                api_server: env.url(),
                ca_data_base64: token.ca_base64,
                token: token.token,
                namespace: ns.clone(),
                loadbalancer: LB.into(),
                machine: MACHINE.into(),
                vip: vip.to_string(),
                interfaces: vec![interface],
                ha,
                active_active_address,
                ..UserDataParams::default()
            };
            let kubeconfig = cloudinit::kubeconfig(&params);
            wait_rbac_in_effect(&kubeconfig, &ns).await?;
            // The VM's paths (kubeconfig) and NIC name are the rig's to give.
            let args = cloudinit::agent_args(&params)
                .into_iter()
                .filter(|a| !a.starts_with("--kubeconfig=") && !a.starts_with("--interface="))
                .map(|a| match a.strip_prefix("--sync-secret-file=") {
                    Some(_) => format!("--sync-secret-file={}", sync_secret.display()),
                    None => a,
                })
                .collect();
            let api_server = env
                .url()
                .trim_start_matches("https://")
                .parse()
                .context("the API server's address")?;
            anyhow::Ok((
                ns,
                lbs,
                KubeAgent {
                    args,
                    kubeconfig,
                    api_server,
                },
            ))
        })?;
        cfg.kubernetes = Some(agent);
        let rig = Rig::start(cfg)?;
        let kr = KubeRig {
            rig,
            namespace,
            lbs,
            rt,
        };
        // Ready means a config in the maps; the ports themselves are what the callers count on.
        kr.wait_services("the LoadBalancer's ports in the maps", |s| {
            service(s, "TCP", TCP_PORT).is_some() && service(s, "UDP", UDP_PORT).is_some()
        })?;
        Ok(kr)
    }

    /// Merge-patches the LoadBalancer's `spec` with `spec` (a list replaces the list); returns the new
    /// `metadata.generation`.
    pub fn patch_spec(&self, spec: Value) -> Result<i64> {
        let lb = self
            .rt
            .block_on(self.lbs.patch(
                LB,
                &PatchParams::default(),
                &Patch::Merge(&json!({ "spec": spec })),
            ))
            .context("patching the LoadBalancer's spec")?;
        lb.metadata
            .generation
            .context("a LoadBalancer without generation")
    }

    /// The LoadBalancerMachine's `status`, as the agent last wrote it.
    pub fn machine_status(&self) -> Result<Value> {
        let api: Api<LoadBalancerMachine> =
            Api::namespaced(self.lbs.clone().into_client(), &self.namespace);
        let m = self
            .rt
            .block_on(api.get(MACHINE))
            .context("reading the LoadBalancerMachine")?;
        Ok(serde_json::to_value(m)?["status"].clone())
    }

    /// The `spec.ports` with the TCP service on `tcp_port` (and UDP [`UDP_PORT`] as before).
    pub fn ports(tcp_port: u16) -> Value {
        json!([
            {"name": "tcp", "protocol": "TCP", "port": tcp_port, "nodePort": TCP_NODE_PORT},
            {"name": "udp", "protocol": "UDP", "port": UDP_PORT, "nodePort": UDP_NODE_PORT},
        ])
    }

    /// The services in the maps (`lbctl services`).
    pub fn services(&self) -> Result<Vec<Value>> {
        let v = self.rig.lbctl_json(&["services"])?;
        v.as_array()
            .cloned()
            .ok_or_else(|| anyhow!("lbctl services is not a list: {v}"))
    }

    /// Waits (30 s at most) until the services in the maps satisfy `pred`; returns them.
    pub fn wait_services(&self, what: &str, pred: impl Fn(&[Value]) -> bool) -> Result<Vec<Value>> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = self.services()?;
            if pred(&s) {
                return Ok(s);
            }
            if Instant::now() > deadline {
                bail!(
                    "timed out waiting for {what}; the maps hold {}\nagent log:\n{}",
                    Value::from(s),
                    self.rig.agent_log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits (30 s at most) until the agent reports generation `generation` applied (`lb_config_generation`).
    pub fn wait_generation(&self, generation: i64) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.rig.metric("lb_config_generation", "")? < generation as f64 {
            if Instant::now() > deadline {
                bail!(
                    "generation {generation} not applied after 30 s\nagent log:\n{}",
                    self.rig.agent_log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Moves the TCP service to `port` by writing the LoadBalancer, and times it: from the write to the first
    /// connection forwarded through `port`, which a client in the client namespace tries every
    /// [`PROBE_PACE`] from before the write on. Fails when `port` is forwarded before the write, or not within
    /// `within`.
    pub fn change_port(&self, port: u16, within: Duration) -> Result<PortChange> {
        // A warm connection to the API server, so the write is timed and not a TLS handshake.
        self.rt.block_on(self.lbs.get(LB))?;
        let target = SocketAddr::from((self.rig.vip, port));
        let (started_tx, started) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            let prober = s.spawn(move || {
                let deadline = Instant::now() + within;
                self.rig.topo.run_in(Host::Client, move || {
                    first_forwarded(target, started_tx, deadline)
                })?
            });
            // The first refusal: the port was not forwarded before the write.
            if started.recv().is_err() {
                let r = prober.join().map_err(|_| anyhow!("the prober panicked"))?;
                return Err(match r {
                    Ok(f) => anyhow!(
                        "{target} was forwarded (to {}) before the LoadBalancer named it",
                        f.backend
                    ),
                    Err(e) => e,
                });
            }
            let t0 = Instant::now();
            let generation = self.patch_spec(json!({ "ports": Self::ports(port) }))?;
            let write = t0.elapsed();
            let f = prober
                .join()
                .map_err(|_| anyhow!("the prober panicked"))?
                .with_context(|| {
                    format!(
                        "after the LoadBalancer's port moved to {port}\nagent log:\n{}",
                        self.rig.agent_log()
                    )
                })?;
            Ok(PortChange {
                generation,
                write,
                first_packet: f.at.saturating_duration_since(t0),
                backend: f.backend,
                refused: f.refused,
                unanswered: f.unanswered,
            })
        })
    }
}

/// The service `protocol`/`port` among `lbctl services`' entries.
pub fn service<'a>(services: &'a [Value], protocol: &str, port: u16) -> Option<&'a Value> {
    services
        .iter()
        .find(|s| s["protocol"] == protocol && s["port"] == port)
}

/// A connection made through the load balancer.
struct Forwarded {
    at: Instant,
    backend: String,
    refused: u32,
    unanswered: u32,
}

/// Connects to `target` every [`PROBE_PACE`] until a connection is made and the backend greets; sends on
/// `started` after the first refusal.
fn first_forwarded(
    target: SocketAddr,
    started: std::sync::mpsc::Sender<()>,
    deadline: Instant,
) -> Result<Forwarded> {
    let (mut refused, mut unanswered) = (0, 0);
    loop {
        match TcpStream::connect_timeout(&target, PROBE_CONNECT_TIMEOUT) {
            Ok(s) => {
                let at = Instant::now();
                s.set_read_timeout(Some(Duration::from_secs(5)))?;
                let mut greeting = String::new();
                BufReader::new(s)
                    .read_line(&mut greeting)
                    .with_context(|| format!("reading the greeting through {target}"))?;
                let backend = greeting.trim().to_string();
                if !backend.starts_with("backend-") {
                    bail!("{target} answered {greeting:?}, not a backend's greeting");
                }
                return Ok(Forwarded {
                    at,
                    backend,
                    refused,
                    unanswered,
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                refused += 1;
                if refused == 1 {
                    let _ = started.send(());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => unanswered += 1,
            Err(e) => return Err(e).with_context(|| format!("connecting to {target}")),
        }
        if Instant::now() > deadline {
            bail!("no connection through {target} ({refused} refused, {unanswered} unanswered)");
        }
        std::thread::sleep(PROBE_PACE);
    }
}

/// The machine's ServiceAccount, token Secret, Role and RoleBinding, server-side applied as the controller does.
async fn apply_machine_access(admin: &kube::Client, id: &MachineIdentity) -> Result<()> {
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let (ns, name) = (id.namespace.as_str(), id.machine.as_str());
    Api::<ServiceAccount>::namespaced(admin.clone(), ns)
        .patch(name, &pp, &Patch::Apply(&rbac::service_account(id)))
        .await?;
    Api::<Secret>::namespaced(admin.clone(), ns)
        .patch(name, &pp, &Patch::Apply(&rbac::token_secret(id)))
        .await?;
    Api::<Role>::namespaced(admin.clone(), ns)
        .patch(name, &pp, &Patch::Apply(&rbac::role(id)))
        .await?;
    Api::<RoleBinding>::namespaced(admin.clone(), ns)
        .patch(name, &pp, &Patch::Apply(&rbac::role_binding(id)))
        .await?;
    Ok(())
}

/// The token and CA that Kubernetes' token controller writes into the machine's token Secret.
async fn machine_token(admin: &kube::Client, ns: &str) -> Result<rbac::TokenData> {
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), ns);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(t) = secrets
            .get_opt(MACHINE)
            .await?
            .as_ref()
            .and_then(rbac::token_data)
        {
            return Ok(t);
        }
        if Instant::now() > deadline {
            bail!("the token controller did not fill in Secret {ns}/{MACHINE} within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the machine's token may read its LoadBalancerMachine: RBAC takes effect once the API server's
/// informers have the Role and the binding, and an agent refused before would back off for seconds.
async fn wait_rbac_in_effect(kubeconfig: &str, ns: &str) -> Result<()> {
    let own: Api<LoadBalancerMachine> =
        Api::namespaced(kube_testenv::client_from(kubeconfig).await?, ns);
    kube_testenv::wait_for("the machine's Role in effect", || async {
        Ok(own.get(MACHINE).await.is_ok())
    })
    .await
}

fn lb_json(ns: &str, backends: &[Ipv4Addr], options: Value) -> Value {
    let endpoints: Vec<Value> = backends
        .iter()
        .enumerate()
        .map(|(i, ip)| json!({"name": format!("node-{}", i + 1), "addresses": [ip.to_string()]}))
        .collect();
    lb_test_support::yawol::loadbalancer_json(
        ns,
        LB,
        KubeRig::ports(TCP_PORT),
        Value::Array(endpoints),
        options,
    )
}

fn machine_json(ns: &str) -> Value {
    lb_test_support::yawol::machine_json(ns, MACHINE, LB)
}
