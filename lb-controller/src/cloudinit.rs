//! Cloud-init user data for a load-balancer VM: a pure function of its inputs.
//!
//! `#cloud-config` with base64 `write_files` (so no content can break the YAML):
//! - `/etc/lb-agent/kubeconfig` (0600): API server, CA, and the bearer token of the machine's own ServiceAccount
//!   (scoped by [`crate::rbac`] to its LoadBalancer and LoadBalancerMachine), context namespace = the machine's;
//! - `/etc/lb-agent/agent.env`: the agent's arguments in Kubernetes mode;
//! - `/etc/systemd/system/lb-agent.service`: runs the agent, restarts it when it dies;
//! - `/etc/chrony/chrony.conf`: time sync (heartbeats are compared with the controller's clock), no command port;
//!
//! and `runcmd` restarting chrony and starting the agent (sshd only in debug mode).

use base64::Engine as _;

/// Where the agent's binary lives in the image.
pub const AGENT_BINARY: &str = "/usr/local/bin/lb-agent";
/// The kubeconfig path on the VM.
pub const KUBECONFIG_PATH: &str = "/etc/lb-agent/kubeconfig";

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
    /// Interface carrying the VIP.
    pub interface: String,
    /// NTP servers/pools.
    pub ntp_servers: Vec<String>,
    /// Start sshd (debug settings).
    pub debug_ssh: bool,
}

/// The kubeconfig of the machine's ServiceAccount.
pub fn kubeconfig(p: &UserDataParams) -> String {
    let doc = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "control", "cluster": {"server": p.api_server, "certificate-authority-data": p.ca_data_base64}}],
        "users": [{"name": p.machine, "user": {"token": p.token}}],
        "contexts": [{"name": "lb-agent", "context": {"cluster": "control", "user": p.machine, "namespace": p.namespace}}],
        "current-context": "lb-agent",
    });
    serde_yaml::to_string(&doc).expect("JSON value serialises as YAML")
}

/// The agent's command-line arguments (Kubernetes mode).
pub fn agent_args(p: &UserDataParams) -> Vec<String> {
    vec![
        format!("--namespace={}", p.namespace),
        format!("--loadbalancer-name={}", p.loadbalancer),
        format!("--loadbalancer-machine-name={}", p.machine),
        format!("--kubeconfig={KUBECONFIG_PATH}"),
        format!("--interface={}", p.interface),
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
         [Service]\nEnvironmentFile=/etc/lb-agent/agent.env\nExecStart={AGENT_BINARY} $LB_AGENT_ARGS\n\
         Restart=always\nRestartSec=2\n\n[Install]\nWantedBy=multi-user.target\n"
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
    let files = [
        (KUBECONFIG_PATH, "0600", kubeconfig(p)),
        ("/etc/lb-agent/agent.env", "0644", env),
        ("/etc/systemd/system/lb-agent.service", "0644", unit()),
        ("/etc/chrony/chrony.conf", "0644", chrony(p)),
    ];
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
            interface: "eth0".into(),
            ntp_servers: vec!["pool.ntp.org".into(), "10.0.0.5".into()],
            debug_ssh: false,
        }
    }

    fn file(doc: &Value, path: &str) -> String {
        let f = doc["write_files"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|f| f["path"].as_str() == Some(path))
            .unwrap();
        let raw = base64::engine::general_purpose::STANDARD
            .decode(f["content"].as_str().unwrap())
            .unwrap();
        String::from_utf8(raw).unwrap()
    }

    #[test]
    fn parses_as_cloud_config_with_a_working_kubeconfig_and_agent_args() {
        let text = user_data(&params());
        assert!(text.starts_with("#cloud-config\n"));
        let doc: Value = serde_yaml::from_str(&text).unwrap();
        let kc: Value = serde_yaml::from_str(&file(&doc, KUBECONFIG_PATH)).unwrap();
        assert_eq!(kc["current-context"].as_str(), Some("lb-agent"));
        assert_eq!(
            kc["clusters"][0]["cluster"]["server"].as_str(),
            Some("https://10.0.0.1:6443")
        );
        assert_eq!(
            kc["users"][0]["user"]["token"].as_str(),
            Some("eyJhbGciOi.token")
        );
        assert_eq!(
            kc["contexts"][0]["context"]["namespace"].as_str(),
            Some("yawol")
        );
        // kube's own parser accepts it (what the agent uses).
        let parsed: kube::config::Kubeconfig =
            serde_yaml::from_str(&file(&doc, KUBECONFIG_PATH)).unwrap();
        assert_eq!(parsed.current_context.as_deref(), Some("lb-agent"));
        let env = file(&doc, "/etc/lb-agent/agent.env");
        for arg in [
            "--namespace=yawol",
            "--loadbalancer-name=default--web",
            "--loadbalancer-machine-name=default--web-abc12-x1y2z",
            "--kubeconfig=/etc/lb-agent/kubeconfig",
            "--interface=eth0",
        ] {
            assert!(env.contains(arg), "{arg} missing in {env}");
        }
        let perms = doc["write_files"][0]["permissions"].as_str();
        assert_eq!(perms, Some("0600"), "the token is private");
        let chrony = file(&doc, "/etc/chrony/chrony.conf");
        assert!(
            chrony.contains("pool pool.ntp.org iburst")
                && chrony.contains("server 10.0.0.5 iburst")
        );
        assert!(!text.contains("ssh"), "no sshd without debug");
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
