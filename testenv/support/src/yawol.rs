//! What yawol-controller gives a LoadBalancerMachine's VM, transcribed from yawol (`github:stackitcloud/yawol`,
//! `internal/helper/loadbalancermachine.go` `GenerateUserData` and its helpers, `internal/helper/yawollet.go`
//! `GetRoleRules`, the LBM controller's `getKubeConfigForServiceAccount`): byte for byte where the output is text,
//! so the image is tested with exactly what a yawol operator's VMs receive. Test fixture only (lb-agent's
//! yawollet tests and the boot test's cluster helper `lb-agent/examples/yawol_boot`); nothing here is product code.

use base64::Engine as _;
use k8s_openapi::api::rbac::v1::PolicyRule;
use std::collections::BTreeMap;

/// The probe address yawol-controller gives yawollet (`--health-probe-bind-address`), which its keepalived
/// check script calls.
pub const PROBE_ADDRESS: &str = "127.0.0.1:8080";
/// yawol's `YawolletHealthCheckScript`.
pub const HEALTH_CHECK_SCRIPT: &str = "/var/lib/yawol/check_yawollet_health.sh";

/// yawol's `LoadBalancerLogForward`.
#[derive(Clone, Debug, Default)]
pub struct LogForward {
    pub enabled: bool,
    pub loki_url: String,
    pub proxy_url: String,
    pub labels: BTreeMap<String, String>,
}

/// The inputs of `GenerateUserData`.
#[derive(Clone, Debug)]
pub struct Machine {
    /// The kubeconfig ([`kubeconfig`]).
    pub kubeconfig: String,
    pub namespace: String,
    pub loadbalancer: String,
    pub machine: String,
    /// The VIP (the LoadBalancer port's IPv4 address).
    pub vip: String,
    /// `--yawollet-requeue-time` of yawol-controller (0: not passed on).
    pub requeue_time: u32,
    pub ntp_pools: Vec<String>,
    pub ntp_servers: Vec<String>,
    /// `spec.options.logForward`.
    pub log_forward: LogForward,
    /// `spec.debugSettings.enabled`.
    pub debug: bool,
}

/// `GenerateUserData`: the `#cloud-config` (it starts with a newline, as yawol's does).
pub fn user_data(m: &Machine) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let (promtail, promtail_rc, promtail_state) = if m.log_forward.enabled {
        (
            promtail_config(&m.loadbalancer, &m.machine, &m.log_forward),
            "add",
            "start",
        )
    } else {
        ("disabled".to_string(), "del", "stop")
    };
    let (ssh_rc, ssh_state) = if m.debug {
        ("add", "start")
    } else {
        ("del", "stop")
    };
    format!(
        r#"
#cloud-config
write_files:
- encoding: b64
  content: {chrony}
  owner: root:root
  path: /etc/chrony/chrony.conf
  permissions: '0644'
- encoding: b64
  content: {kubeconfig}
  owner: yawol:yawol
  path: /etc/yawol/kubeconfig
  permissions: '0600'
- encoding: b64
  content: {keepalived}
  owner: root:root
  path: /etc/keepalived/keepalived.conf
  permissions: '0644'
- encoding: b64
  content: {script}
  owner: root:root
  path: {HEALTH_CHECK_SCRIPT}
  permissions: '0755'
- encoding: b64
  content: {promtail}
  owner: promtail:promtail
  path: /etc/promtail/promtail.yaml
  permissions: '0644'
- content: >
    YAWOLLET_ARGS="{args}"
  path: /etc/yawol/env.conf
runcmd:
  - [ /sbin/rc-service, chronyd, restart ]
  - [ /sbin/rc-service, promtail, {promtail_state} ]
  - [ /sbin/rc-update, {promtail_rc}, promtail, default ]
  - [ /sbin/rc-service, sshd, {ssh_state} ]
  - [ /sbin/rc-update, {ssh_rc}, sshd, default ]
  - [ /sbin/rc-service, keepalived, restart ]
  - [ /sbin/rc-service, envoy, restart ]
  - [ /sbin/rc-service, yawollet, restart ]
"#,
        chrony = b64(&chrony_conf(&m.ntp_pools, &m.ntp_servers)),
        kubeconfig = b64(&m.kubeconfig),
        keepalived = b64(&keepalived_conf(&m.vip)),
        script = b64(&health_check_script(PROBE_ADDRESS)),
        promtail = b64(&promtail),
        args = yawollet_args(m),
    )
}

/// `YAWOLLET_ARGS` (with yawol's trailing blank).
pub fn yawollet_args(m: &Machine) -> String {
    let mut a = format!(
        "--namespace={} --loadbalancer-name={} --loadbalancer-machine-name={} --listen-address={} \
         --health-probe-bind-address={PROBE_ADDRESS} --kubeconfig /etc/yawol/kubeconfig ",
        m.namespace, m.loadbalancer, m.machine, m.vip
    );
    if m.requeue_time > 0 {
        a.push_str(&format!("--requeue-time={} ", m.requeue_time));
    }
    a
}

/// `generateChronyConfig` (template `chrony.conf.tpl`; pool.ntp.org when neither pools nor servers are given).
pub fn chrony_conf(pools: &[String], servers: &[String]) -> String {
    let default = ["pool.ntp.org".to_string()];
    let pools = if pools.is_empty() && servers.is_empty() {
        &default[..]
    } else {
        pools
    };
    let mut s = String::new();
    for p in pools {
        s.push_str(&format!("pool {p} iburst\n"));
    }
    for p in servers {
        s.push_str(&format!("server {p} iburst\n"));
    }
    s.push_str(
        "# Settings from alpine default chrony config
driftfile /var/lib/chrony/chrony.drift
rtcsync
# prevent chrony from opening ports on the LoadBalancer machine
cmdport 0

# Settings from cloud-init generated chrony config
# Stop bad estimates upsetting machine clock.
maxupdateskew 100.0
# Step the system clock instead of slewing it if the adjustment is larger than
# one second, but only in the first three clock updates.
makestep 1 3
",
    );
    s
}

/// `generateKeepalivedConfig`.
pub fn keepalived_conf(vip: &str) -> String {
    format!(
        r#"! Configuration File for keepalived

global_defs {{
	router_id envoy
	max_auto_priority -1
	vrrp_garp_master_repeat 5
	vrrp_garp_interval 1
	vrrp_garp_lower_prio_repeat 1
	vrrp_garp_master_refresh 300
	vrrp_garp_master_refresh_repeat 1
	vrrp_higher_prio_send_advert true

	# Don't run scripts configured to be run as root if any part of the path
	# is writable by a non-root user.
	enable_script_security
	# Specify the default username/groupname to run scripts under.
	# If this option is not specified, the user defaults to keepalived_script
	# if that user exists, otherwise the uid/gid under which keepalived is running.
	# If groupname is not specified, it defaults to the user's group.
	# script_user username [groupname] # leave empty for using default keepalived_script user
}}

vrrp_track_process envoy {{
	process envoy
	weight 100
}}

# check the yawollet's readyz endpoint
vrrp_script yawollethealth {{
	script "{HEALTH_CHECK_SCRIPT}"
	interval 2
	timeout 10
	# assume script initially is in failed state
	init_fail
	rise 1
	fall 3
	weight 10
}}

vrrp_instance ENVOY {{
	state BACKUP
	interface eth0
	virtual_router_id 100
	priority 50
	advert_int 4

	authentication {{
		auth_type PASS
		auth_pass yawol
	}}

	virtual_ipaddress {{
		{vip}
	}}

	track_process {{
		envoy
	}}

	track_script {{
		yawollethealth
	}}
}}"#
    )
}

/// `generateYawolletHealthCheckScript`.
pub fn health_check_script(probe: &str) -> String {
    format!(
        r#"#!/usr/bin/env sh
set -o errexit
set -o pipefail
set -o nounset

# call the yawollet readyz endpoint
# This will return exit code 0 if all readyz check are successful, exit code 1 otherwise
code=$(wget --quiet --server-response --timeout=2 -O /dev/null http://{probe}/readyz 2>&1 | awk 'NR==1{{print $2}}')
if [[ "$code" -eq 200 ]] ; then
  exit 0
else
  exit 1
fi
"#
    )
}

/// `generatePromtailConfig` (labels marshalled sorted, indented by `addRootIndent(…, 10)`, which leaves ten
/// blanks after the last newline).
pub fn promtail_config(lb: &str, lbm: &str, lf: &LogForward) -> String {
    let mut labels = lf.labels.clone();
    labels.insert("job".into(), "yawol-logs".into());
    labels.insert("lbm".into(), lbm.into());
    labels.insert("lb".into(), lb.into());
    labels.insert("application".into(), "messages".into());
    labels.insert("__path__".into(), "/var/log/messages".into());
    let yaml = serde_yaml::to_string(&labels).expect("a string map serialises");
    let indent = " ".repeat(10);
    let labels = format!("{indent}{}", yaml.replace('\n', &format!("\n{indent}")));
    format!(
        "server:
  disable: true

positions:
  filename: /tmp/positions.yaml

clients:
  - url: '{}'
    proxy_url: '{}'

scrape_configs:
  - job_name: messages
    static_configs:
      - targets:
          - localhost
        labels:
{labels}",
        lf.loki_url, lf.proxy_url
    )
}

/// `getKubeConfigForServiceAccount`: clientcmd's `latest.Codec` encoding of the ServiceAccount's token and CA for
/// `api_endpoint` (yawol-controller's `API_ENDPOINT`), context namespace = the token Secret's namespace. That codec
/// is client-go's YAML serializer: the object as JSON, turned into YAML with sorted keys (sigs.k8s.io/yaml), which
/// is what this writes (serde_json's map is sorted; serde_yaml writes block style, sequences unindented as yaml.v2).
pub fn kubeconfig(api_endpoint: &str, ca_pem: &[u8], token: &str, namespace: &str) -> String {
    let doc = serde_json::json!({
        "kind": "Config",
        "apiVersion": "v1",
        "preferences": {},
        "clusters": [{"name": "default-cluster", "cluster": {
            "server": api_endpoint,
            "certificate-authority-data": base64::engine::general_purpose::STANDARD.encode(ca_pem),
        }}],
        "users": [{"name": "user", "user": {"token": token}}],
        "contexts": [{"name": "context", "context": {
            "cluster": "default-cluster", "user": "user", "namespace": namespace,
        }}],
        "current-context": "context",
    });
    serde_yaml::to_string(&doc).expect("a JSON value serialises as YAML")
}

/// `GetRoleRules`: the Role yawol-controller gives each machine's ServiceAccount (six rules; events in the core
/// group only; list/watch on the whole namespace, get and writes by name).
pub fn role_rules(loadbalancer: &str, machine: &str) -> Vec<PolicyRule> {
    let rule = |verbs: &[&str], group: &str, resource: &str, name: Option<&str>| PolicyRule {
        verbs: verbs.iter().map(|v| v.to_string()).collect(),
        api_groups: Some(vec![group.to_string()]),
        resources: Some(vec![resource.to_string()]),
        resource_names: name.map(|n| vec![n.to_string()]),
        ..Default::default()
    };
    let g = "yawol.stackit.cloud";
    vec![
        rule(&["create", "patch"], "", "events", None),
        rule(&["list", "watch"], g, "loadbalancers", None),
        rule(&["get"], g, "loadbalancers", Some(loadbalancer)),
        rule(&["list", "watch"], g, "loadbalancermachines", None),
        rule(
            &["get", "update", "patch"],
            g,
            "loadbalancermachines",
            Some(machine),
        ),
        rule(
            &["get", "update", "patch"],
            g,
            "loadbalancermachines/status",
            Some(machine),
        ),
    ]
}

/// The `infrastructure` of the test objects below: fixed OpenStack ids that nothing in an agent's test reads.
fn infrastructure(ns: &str) -> serde_json::Value {
    serde_json::json!({
        "defaultNetwork": {"networkID": "net-1"},
        "flavor": {"flavorID": "flavor-1"}, "image": {"imageID": "image-1"},
        "availabilityZone": "az-1", "authSecretRef": {"name": "cloud", "namespace": ns}
    })
}

/// A LoadBalancer object `ns/name` with the given spec parts, as the agents' Kubernetes-mode tests create it
/// (one replica, its own selector, the fixed infrastructure).
pub fn loadbalancer_json(
    ns: &str,
    name: &str,
    ports: serde_json::Value,
    endpoints: serde_json::Value,
    options: serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": name}},
            "replicas": 1,
            "ports": ports,
            "endpoints": endpoints,
            "options": options,
            "infrastructure": infrastructure(ns),
        }
    })
}

/// The LoadBalancerMachine `ns/name` of LoadBalancer `loadbalancer`, as those tests create it.
pub fn machine_json(ns: &str, name: &str, loadbalancer: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerMachine",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "portID": "port-1",
            "loadBalancerRef": {"name": loadbalancer, "namespace": ns},
            "infrastructure": infrastructure(ns),
        }
    })
}

#[cfg(test)]
mod kubeconfig_tests {
    /// The shape client-go's YAML serializer gives it: sorted keys, block style, sequences unindented.
    #[test]
    fn the_kubeconfig_is_yaml_as_client_go_writes_it() {
        let k = super::kubeconfig("https://10.0.2.2:6443", b"CA", "tok", "ns");
        assert_eq!(
            k,
            "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority-data: Q0E=\n    server: https://10.0.2.2:6443\n  \
             name: default-cluster\ncontexts:\n- context:\n    cluster: default-cluster\n    namespace: ns\n    user: user\n  \
             name: context\ncurrent-context: context\nkind: Config\npreferences: {}\nusers:\n- name: user\n  user:\n    \
             token: tok\n"
        );
    }
}
