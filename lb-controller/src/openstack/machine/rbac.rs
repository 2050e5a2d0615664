//! Per-machine Kubernetes access: a ServiceAccount, its long-lived token Secret, a Role that reaches only the
//! machine's own LoadBalancer and LoadBalancerMachine (+ status) and lets it write events, and the RoleBinding.
//! All named after the machine and owned by it, so they go when it goes. Pure builders; the LBM controller applies
//! them with server-side apply.

use base64::Engine as _;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use lb_api::constants::GROUP;
use std::collections::BTreeMap;

/// Who the objects are for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachineIdentity {
    /// Namespace of the LoadBalancer and the machine.
    pub namespace: String,
    /// LoadBalancerMachine name (also the name of all four objects).
    pub machine: String,
    /// LoadBalancerMachine UID (owner reference).
    pub machine_uid: String,
    /// LoadBalancer name.
    pub loadbalancer: String,
}

fn meta(id: &MachineIdentity) -> ObjectMeta {
    ObjectMeta {
        name: Some(id.machine.clone()),
        namespace: Some(id.namespace.clone()),
        owner_references: Some(vec![OwnerReference {
            api_version: lb_api::constants::API_VERSION.into(),
            kind: "LoadBalancerMachine".into(),
            name: id.machine.clone(),
            uid: id.machine_uid.clone(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]),
        ..Default::default()
    }
}

/// The ServiceAccount.
pub fn service_account(id: &MachineIdentity) -> ServiceAccount {
    ServiceAccount {
        metadata: meta(id),
        automount_service_account_token: Some(false),
        ..Default::default()
    }
}

/// The token Secret (type `kubernetes.io/service-account-token`; Kubernetes ≥ 1.24 no longer creates one, and the
/// token controller fills in `token` and `ca.crt`).
pub fn token_secret(id: &MachineIdentity) -> Secret {
    let mut m = meta(id);
    m.annotations = Some(BTreeMap::from([(
        "kubernetes.io/service-account.name".to_string(),
        id.machine.clone(),
    )]));
    Secret {
        metadata: m,
        type_: Some("kubernetes.io/service-account-token".into()),
        ..Default::default()
    }
}

/// What the token controller writes into the token Secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenData {
    /// The ServiceAccount's bearer token.
    pub token: String,
    /// The cluster CA (`ca.crt`, PEM) base64-encoded for a kubeconfig; empty when the Secret has none.
    pub ca_base64: String,
}

/// The token and CA of a token Secret, once Kubernetes' token controller has filled it in (`None` before: the
/// controller waits instead of booting a VM that cannot authenticate).
pub fn token_data(secret: &Secret) -> Option<TokenData> {
    let data = secret.data.as_ref()?;
    let token = String::from_utf8(data.get("token")?.0.clone()).ok()?;
    if token.trim().is_empty() {
        return None;
    }
    let ca_base64 = data
        .get("ca.crt")
        .map(|ca| base64::engine::general_purpose::STANDARD.encode(&ca.0))
        .unwrap_or_default();
    Some(TokenData {
        token: token.trim().to_string(),
        ca_base64,
    })
}

fn rule(groups: &[&str], resources: &[&str], names: Option<&str>, verbs: &[&str]) -> PolicyRule {
    PolicyRule {
        api_groups: Some(groups.iter().map(|s| s.to_string()).collect()),
        resources: Some(resources.iter().map(|s| s.to_string()).collect()),
        resource_names: names.map(|n| vec![n.to_string()]),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// The Role: the machine's own LoadBalancer and LoadBalancerMachine, by name, for every verb the agent uses —
/// including list and watch, which Kubernetes authorises against `resourceNames` when the request carries the field
/// selector `metadata.name=<name>` (the agent's watch does; a list of the namespace is Forbidden). yawol's Role
/// grants list/watch on the whole namespace, so each VM could read every other load balancer's endpoints. Events:
/// `create` only (a create has no name to scope by; the agent never patches an Event).
pub fn role(id: &MachineIdentity) -> Role {
    Role {
        metadata: meta(id),
        rules: Some(vec![
            rule(&[""], &["events"], None, &["create"]),
            rule(
                &[GROUP],
                &["loadbalancers"],
                Some(&id.loadbalancer),
                &["get", "list", "watch"],
            ),
            // Read only: the agent writes nothing but its machine's status (yawol's Role also lets it rewrite the
            // machine's spec and metadata).
            rule(
                &[GROUP],
                &["loadbalancermachines"],
                Some(&id.machine),
                &["get", "list", "watch"],
            ),
            rule(
                &[GROUP],
                &["loadbalancermachines/status"],
                Some(&id.machine),
                &["get", "update", "patch"],
            ),
        ]),
    }
}

/// The RoleBinding of the Role to the ServiceAccount.
pub fn role_binding(id: &MachineIdentity) -> RoleBinding {
    RoleBinding {
        metadata: meta(id),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: id.machine.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: id.machine.clone(),
            namespace: Some(id.namespace.clone()),
            ..Default::default()
        }]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> MachineIdentity {
        MachineIdentity {
            namespace: "yawol".into(),
            machine: "web-abc-x1".into(),
            machine_uid: "uid-1".into(),
            loadbalancer: "web".into(),
        }
    }

    /// The rules' shape; what the API server makes of them is proven under real RBAC with a real token in
    /// `lb-agent/tests/kube_mode.rs` (`the_machine_token_reaches_only_its_own_objects`).
    #[test]
    fn every_rule_but_event_creation_is_name_scoped() {
        let rules = role(&id()).rules.unwrap();
        for rule in &rules {
            let resources = rule.resources.as_ref().unwrap();
            if resources == &["events"] {
                assert_eq!(rule.verbs, ["create"], "{rule:?}");
                continue;
            }
            let names = rule.resource_names.as_ref().expect("name-scoped");
            assert!(names == &["web-abc-x1"] || names == &["web"], "{rule:?}");
            assert!(
                !rule.verbs.iter().any(|v| v == "delete" || v == "create"),
                "{rule:?}"
            );
        }
    }

    #[test]
    fn token_only_once_filled_in() {
        use k8s_openapi::ByteString;
        let mut secret = token_secret(&id());
        assert_eq!(token_data(&secret), None);
        secret.data = Some(BTreeMap::from([(
            "token".to_string(),
            ByteString(b"".to_vec()),
        )]));
        assert_eq!(token_data(&secret), None, "empty token");
        secret.data = Some(BTreeMap::from([
            ("token".to_string(), ByteString(b"tok\n".to_vec())),
            ("ca.crt".to_string(), ByteString(b"PEM".to_vec())),
        ]));
        assert_eq!(
            token_data(&secret),
            Some(TokenData {
                token: "tok".into(),
                ca_base64: "UEVN".into()
            })
        );
    }

    #[test]
    fn binding_secret_and_owner() {
        let b = role_binding(&id());
        assert_eq!(b.role_ref.name, "web-abc-x1");
        let s = &b.subjects.unwrap()[0];
        assert_eq!(
            (s.kind.as_str(), s.name.as_str(), s.namespace.as_deref()),
            ("ServiceAccount", "web-abc-x1", Some("yawol"))
        );
        let secret = token_secret(&id());
        assert_eq!(
            secret.type_.as_deref(),
            Some("kubernetes.io/service-account-token")
        );
        assert_eq!(
            secret.metadata.annotations.unwrap()["kubernetes.io/service-account.name"],
            "web-abc-x1"
        );
        let owner = &service_account(&id()).metadata.owner_references.unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("LoadBalancerMachine", "uid-1")
        );
    }
}
