//! Cloud-init user data for a load-balancer VM: a pure function of its inputs.
//!
//! `#cloud-config` with base64 `write_files` (so no content can break the YAML):
//! - `/etc/lb-agent/kubeconfig` (0600): API server, CA, and the bearer token of the machine's own ServiceAccount
//!   (scoped by [`super::rbac`] to its LoadBalancer and LoadBalancerMachine), context namespace = the machine's;
//! - `/etc/lb-agent/agent.env` (0600): the agent's arguments ([`agent_args`]): Kubernetes mode, then the VRRP and
//!   state-sync flags for the LoadBalancer's [`HaSettings`] ([`ha_args`]);
//! - `/etc/lb-agent/sync-secret` (0600): the state-sync secret of the load balancer (the machine's Role cannot read
//!   Secrets, so the controller hands it over here);
//! - `/etc/systemd/system/lb-agent.service`: runs the agent, restarts it when it dies;
//! - `/etc/chrony/chrony.conf`: time sync (heartbeats are compared with the controller's clock), no command port;
//!
//! and `runcmd` restarting chrony and starting the agent (sshd only in debug mode).

use base64::Engine as _;
use lb_api::ha::HaSettings;

/// Where the agent's binary lives in the image.
pub const AGENT_BINARY: &str = "/usr/local/bin/lb-agent";
/// The kubeconfig path on the VM.
pub const KUBECONFIG_PATH: &str = "/etc/lb-agent/kubeconfig";
/// The agent's environment file (its arguments) on the VM.
pub const AGENT_ENV_PATH: &str = "/etc/lb-agent/agent.env";
/// The state-sync secret on the VM (mode 0600; [`ha_args`] points the agent at it: the secret never goes on a
/// command line).
pub const SYNC_SECRET_PATH: &str = "/etc/lb-agent/sync-secret";

/// Everything the user data depends on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UserDataParams {
    /// API server URL as reachable from the VMs (yawol's `API_ENDPOINT`).
    pub api_server: String,
    /// The cluster CA, base64 PEM (as in the token Secret's `ca.crt`, re-encoded).
    pub ca_data_base64: String,
    /// The ServiceAccount token.
    pub token: String,
    /// Namespace of the LoadBalancer and the machine.
    pub namespace: String,
    /// LoadBalancer name.
    pub loadbalancer: String,
    /// LoadBalancerMachine name.
    pub machine: String,
    /// The VIP (for information in the env file; the agent reads the LoadBalancer status).
    pub vip: String,
    /// The interfaces the agent forwards on: the one carrying the VIP first, then one per additional network
    /// (see `machine::interfaces`).
    pub interfaces: Vec<String>,
    /// NTP servers/pools.
    pub ntp_servers: Vec<String>,
    /// Start sshd (debug settings).
    pub debug_ssh: bool,
    /// VRRP and state sync: the agent gets [`ha_args`] after its Kubernetes-mode arguments and the secret is written
    /// to [`SYNC_SECRET_PATH`] (0600). `None`: a machine without either.
    pub ha: Option<HaSettings>,
    /// Active-active ([`active_active_args`]): the machine's own port address, which it translates to. `None`: a
    /// VRRP pair (with [`Self::ha`]).
    pub active_active_address: Option<String>,
    /// Revision of the machine's LoadBalancerSet (`--machine-revision`): equal to the LoadBalancer's current
    /// revision, the agent raises its VRRP priority, so a rollout's new machines take the VIP.
    pub machine_revision: Option<String>,
}

/// The kubeconfig of the machine's ServiceAccount.
pub fn kubeconfig(p: &UserDataParams) -> String {
    let mut cluster = serde_json::json!({"server": p.api_server});
    // An empty CA would be decoded (and fail) by the client; without one it uses the system roots.
    if !p.ca_data_base64.is_empty() {
        cluster["certificate-authority-data"] = p.ca_data_base64.clone().into();
    }
    let doc = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "control", "cluster": cluster}],
        "users": [{"name": p.machine, "user": {"token": p.token}}],
        "contexts": [{"name": "lb-agent", "context": {"cluster": "control", "user": p.machine, "namespace": p.namespace}}],
        "current-context": "lb-agent",
    });
    serde_yaml::to_string(&doc).expect("JSON value serialises as YAML")
}

/// The agent's command-line arguments (Kubernetes mode, then the HA ones).
pub fn agent_args(p: &UserDataParams) -> Vec<String> {
    let mut args = vec![
        format!("--namespace={}", p.namespace),
        format!("--loadbalancer-name={}", p.loadbalancer),
        format!("--loadbalancer-machine-name={}", p.machine),
        format!("--kubeconfig={KUBECONFIG_PATH}"),
        format!("--interface={}", p.interfaces.join(",")),
    ];
    match (&p.ha, &p.active_active_address) {
        (Some(ha), Some(address)) => args.extend(active_active_args(ha, address)),
        (Some(ha), None) => args.extend(ha_args(ha)),
        (None, _) => {}
    }
    if let Some(r) = &p.machine_revision {
        args.push(format!("--machine-revision={r}"));
    }
    args
}

/// lb-agent's flags for the HA settings:
///
/// - `--vrrp-router-id=<1..255>`, `--vrrp-priority=<1..254>`, `--vrrp-advert-interval=<Go duration>`
/// - `--sync-listen=0.0.0.0:<port>` and `--sync-secret-file=<SYNC_SECRET_PATH>` (written by this cloud-init)
///
/// Not emitted because the controller does not know them when it writes cloud-init (the agent learns them from
/// the LoadBalancerMachines of its LoadBalancer) or because the defaults fit: `--vrrp-peer` and `--sync-peer`
/// (repeatable; no `--vrrp-peer` = multicast), `--keepalived-binary` (default `/usr/sbin/keepalived`).
pub fn ha_args(settings: &HaSettings) -> Vec<String> {
    let mut args = vec![
        format!("--vrrp-router-id={}", settings.router_id),
        format!("--vrrp-priority={}", settings.base_priority),
        format!(
            "--vrrp-advert-interval={}",
            lb_api::format_go_duration(settings.advert_interval)
        ),
    ];
    args.extend(sync_args(settings));
    args
}

/// lb-agent's flags for an active-active machine (no VRRP; the LoadBalancer controller routes the VIP to it while
/// it reports `VIPEligible`, see `loadbalancer::routes`):
///
/// - `--active-active`, `--snat-address=<the machine's port address>` (replies come back to the machine that
///   holds the connection);
/// - `--requeue-period` = `loadbalancer::routes::ELIGIBLE_HEARTBEAT`: its heartbeat says it still serves, and a
///   crashed machine's route goes after three missed ones;
/// - the state-sync flags as for VRRP (every machine syncs with every other).
pub fn active_active_args(settings: &HaSettings, address: &str) -> Vec<String> {
    let mut args = vec![
        "--active-active".to_string(),
        format!("--snat-address={address}"),
        format!(
            "--requeue-period={}",
            lb_api::format_go_duration(crate::openstack::loadbalancer::routes::ELIGIBLE_HEARTBEAT)
        ),
    ];
    args.extend(sync_args(settings));
    args
}

fn sync_args(settings: &HaSettings) -> [String; 2] {
    [
        format!("--sync-listen=0.0.0.0:{}", settings.sync_port),
        format!("--sync-secret-file={SYNC_SECRET_PATH}"),
    ]
}

fn chrony(p: &UserDataParams) -> String {
    let mut out = String::new();
    for s in &p.ntp_servers {
        // Names with "pool" are pools (several addresses), like yawol's --ntp-pool.
        let kind = if s.contains("pool") { "pool" } else { "server" };
        out.push_str(&format!("{kind} {s} iburst\n"));
    }
    out.push_str("driftfile /var/lib/chrony/chrony.drift\nmakestep 1.0 3\nrtcsync\ncmdport 0\n");
    out
}

fn unit() -> String {
    format!(
        "[Unit]\nDescription=lb-agent (XDP load balancer)\nAfter=network-online.target\nWants=network-online.target\n\n\
         [Service]\nEnvironmentFile={AGENT_ENV_PATH}\nExecStart={AGENT_BINARY} $LB_AGENT_ARGS\n\
         Restart=always\nRestartSec=2\n\
         # keepalived (started by the agent) and the pinned data plane outlive an agent restart: the VIP stays.\n\
         KillMode=process\n\n[Install]\nWantedBy=multi-user.target\n"
    )
}

/// The complete user data.
pub fn user_data(p: &UserDataParams) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let env = format!(
        "LB_AGENT_ARGS=\"{}\"\nLB_VIP={}\n",
        agent_args(p).join(" "),
        p.vip
    );
    // 0600: the arguments may name secrets (the HA flags), and only root runs the agent.
    let mut files = vec![
        (KUBECONFIG_PATH, "0600", kubeconfig(p)),
        (AGENT_ENV_PATH, "0600", env),
        ("/etc/systemd/system/lb-agent.service", "0644", unit()),
        ("/etc/chrony/chrony.conf", "0644", chrony(p)),
    ];
    if let Some(ha) = &p.ha {
        files.push((SYNC_SECRET_PATH, "0600", ha.sync_secret.clone()));
    }
    let mut runcmd = vec![
        serde_json::json!(["systemctl", "restart", "chrony"]),
        serde_json::json!(["systemctl", "daemon-reload"]),
        serde_json::json!(["systemctl", "enable", "--now", "lb-agent.service"]),
    ];
    if p.debug_ssh {
        runcmd.push(serde_json::json!(["systemctl", "enable", "--now", "ssh"]));
    }
    let doc = serde_json::json!({
        "write_files": files.iter().map(|(path, perm, content)| serde_json::json!({
            "path": path, "permissions": perm, "owner": "root:root", "encoding": "b64", "content": b64(content),
        })).collect::<Vec<_>>(),
        "runcmd": runcmd,
    });
    format!(
        "#cloud-config\n{}",
        serde_yaml::to_string(&doc).expect("JSON value serialises as YAML")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_yaml::Value;

    fn params() -> UserDataParams {
        UserDataParams {
            api_server: "https://10.0.0.1:6443".into(),
            ca_data_base64: "Q0FDRVJU".into(),
            token: "eyJhbGciOi.token".into(),
            namespace: "yawol".into(),
            loadbalancer: "default--web".into(),
            machine: "default--web-abc12-x1y2z".into(),
            vip: "198.51.100.10".into(),
            interfaces: vec!["eth0".into()],
            ntp_servers: vec!["pool.ntp.org".into(), "10.0.0.5".into()],
            debug_ssh: false,
            ha: Some(HaSettings {
                router_id: 42,
                base_priority: 100,
                advert_interval: std::time::Duration::from_millis(200),
                sync_port: 9190,
                sync_secret: "0123456789abcdef0123456789abcdef-sync".into(),
            }),
            active_active_address: None,
            machine_revision: Some("3".into()),
        }
    }

    fn entry<'a>(doc: &'a Value, path: &str) -> Option<&'a Value> {
        doc["write_files"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|f| f["path"].as_str() == Some(path))
    }

    fn file(doc: &Value, path: &str) -> String {
        let f = entry(doc, path).unwrap_or_else(|| panic!("{path} not written"));
        assert_eq!(f["encoding"].as_str(), Some("b64"));
        let raw = base64::engine::general_purpose::STANDARD
            .decode(f["content"].as_str().unwrap())
            .unwrap();
        String::from_utf8(raw).unwrap()
    }

    fn perms<'a>(doc: &'a Value, path: &str) -> Option<&'a str> {
        entry(doc, path)?["permissions"].as_str()
    }

    #[test]
    fn a_machine_with_additional_networks_forwards_on_their_interfaces_too() {
        use crate::openstack::machine::interfaces;
        assert_eq!(interfaces("eth0", 0), ["eth0"]);
        assert_eq!(interfaces("eth0", 2), ["eth0", "eth1", "eth2"]);
        assert_eq!(interfaces("ens3", 1), ["ens3", "ens4"]);
        let p = UserDataParams {
            interfaces: interfaces("eth0", 1),
            ..params()
        };
        assert!(agent_args(&p).contains(&"--interface=eth0,eth1".to_string()));
    }

    #[test]
    fn parses_as_cloud_config_with_a_working_kubeconfig_and_agent_args() {
        let text = user_data(&params());
        assert!(text.starts_with("#cloud-config\n"));
        let doc: Value = serde_yaml::from_str(&text).unwrap();
        assert!(doc["write_files"].is_sequence() && doc["runcmd"].is_sequence());
        // kube's own parser accepts it (what the agent uses) and it carries the machine's scoped token.
        let kc: kube::config::Kubeconfig =
            serde_yaml::from_str(&file(&doc, KUBECONFIG_PATH)).unwrap();
        assert_eq!(kc.current_context.as_deref(), Some("lb-agent"));
        let ctx = kc.contexts[0].context.as_ref().unwrap();
        assert_eq!(ctx.namespace.as_deref(), Some("yawol"));
        let cluster = kc.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://10.0.0.1:6443"));
        assert_eq!(
            cluster.certificate_authority_data.as_deref(),
            Some("Q0FDRVJU")
        );
        // The token is a SecretString in kube's type; its serialisation shows it.
        let user = serde_json::to_value(&kc.auth_infos[0]).unwrap();
        assert_eq!(kc.auth_infos[0].name, "default--web-abc12-x1y2z");
        assert_eq!(user["user"]["token"], "eyJhbGciOi.token");
        let env = file(&doc, AGENT_ENV_PATH);
        for arg in [
            "--namespace=yawol",
            "--loadbalancer-name=default--web",
            "--loadbalancer-machine-name=default--web-abc12-x1y2z",
            "--kubeconfig=/etc/lb-agent/kubeconfig",
            "--interface=eth0",
            "--vrrp-router-id=42",
            "--vrrp-priority=100",
            "--vrrp-advert-interval=200ms",
            "--sync-listen=0.0.0.0:9190",
            "--sync-secret-file=/etc/lb-agent/sync-secret",
            "--machine-revision=3",
        ] {
            assert!(env.contains(arg), "{arg} missing in {env}");
        }
        assert!(
            file(&doc, "/etc/systemd/system/lb-agent.service").contains("KillMode=process"),
            "an agent restart leaves keepalived (and the VIP) alone"
        );
        // The env file is what the unit passes to the agent.
        assert!(file(&doc, "/etc/systemd/system/lb-agent.service")
            .contains("EnvironmentFile=/etc/lb-agent/agent.env"));
        assert_eq!(
            file(&doc, SYNC_SECRET_PATH),
            "0123456789abcdef0123456789abcdef-sync"
        );
        for private in [KUBECONFIG_PATH, AGENT_ENV_PATH, SYNC_SECRET_PATH] {
            assert_eq!(perms(&doc, private), Some("0600"), "{private} is private");
        }
        assert!(
            !text.contains("0123456789abcdef") && !text.contains("eyJhbGciOi"),
            "secrets only base64-encoded inside files"
        );
        let chrony = file(&doc, "/etc/chrony/chrony.conf");
        assert!(
            chrony.contains("pool pool.ntp.org iburst")
                && chrony.contains("server 10.0.0.5 iburst")
        );
        assert!(!text.contains("ssh"), "no sshd without debug");
        // The flags come first from Kubernetes mode, then exactly the HA ones, then the revision.
        let args = agent_args(&params());
        let ha = ha_args(params().ha.as_ref().unwrap());
        assert_eq!(args[5..5 + ha.len()], ha[..]);
        assert_eq!(args.last().unwrap(), "--machine-revision=3");
    }

    #[test]
    fn ha_args_carry_the_settings() {
        let s = HaSettings {
            router_id: 42,
            base_priority: 100,
            advert_interval: std::time::Duration::from_millis(200),
            sync_port: 9190,
            sync_secret: lb_api::ha::new_sync_secret(),
        };
        s.validate().unwrap();
        let args = ha_args(&s);
        assert_eq!(
            args,
            vec![
                "--vrrp-router-id=42",
                "--vrrp-priority=100",
                "--vrrp-advert-interval=200ms",
                "--sync-listen=0.0.0.0:9190",
                "--sync-secret-file=/etc/lb-agent/sync-secret",
            ]
        );
        assert!(
            args.iter().all(|a| !a.contains(&s.sync_secret)),
            "the secret must not be on the command line"
        );
    }

    #[test]
    fn an_active_active_machine_runs_without_vrrp_and_translates_to_its_own_address() {
        let mut p = params();
        p.active_active_address = Some("198.51.100.23".into());
        let args = agent_args(&p);
        assert!(args.iter().all(|a| !a.starts_with("--vrrp")), "{args:?}");
        for want in [
            "--active-active",
            "--snat-address=198.51.100.23",
            "--requeue-period=10s",
            "--sync-listen=0.0.0.0:9190",
            "--sync-secret-file=/etc/lb-agent/sync-secret",
            "--machine-revision=3",
        ] {
            assert!(args.iter().any(|a| a == want), "{want} missing: {args:?}");
        }
        // The secret still goes in its file.
        let doc: Value = serde_yaml::from_str(&user_data(&p)).unwrap();
        assert!(entry(&doc, SYNC_SECRET_PATH).is_some());
    }

    #[test]
    fn without_ha_or_ca() {
        let mut p = params();
        p.ha = None;
        p.ca_data_base64.clear();
        let doc: Value = serde_yaml::from_str(&user_data(&p)).unwrap();
        assert!(entry(&doc, SYNC_SECRET_PATH).is_none());
        assert!(!file(&doc, AGENT_ENV_PATH).contains("--vrrp"));
        let kc: kube::config::Kubeconfig =
            serde_yaml::from_str(&file(&doc, KUBECONFIG_PATH)).unwrap();
        let cluster = kc.clusters[0].cluster.as_ref().unwrap();
        assert!(cluster.certificate_authority_data.is_none());
    }

    #[test]
    fn debug_starts_sshd_and_output_is_deterministic() {
        let mut p = params();
        assert_eq!(user_data(&p), user_data(&p));
        p.debug_ssh = true;
        let doc: Value = serde_yaml::from_str(&user_data(&p)).unwrap();
        assert!(doc["runcmd"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|c| c[3].as_str() == Some("ssh")));
    }
}
