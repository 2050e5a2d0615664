//! Node → endpoint selection (pure): which nodes receive traffic and with which addresses.
//!
//! Rules (yawol's, PR #341/#382/#386, and draining):
//! - a node is *terminating* when it has a deletion timestamp, the cluster-autoscaler taint
//!   `ToBeDeletedByClusterAutoscaler`, or a `Terminating=True` condition; terminating nodes never
//!   receive new connections;
//! - endpoints are the non-terminating nodes whose `Ready` condition is `True`, and the terminating ones
//!   that are still Ready as *draining* endpoints: the agent sends them no new connections and lets their
//!   established ones finish (a node that simply vanished from the list would have its connections reset);
//! - meltdown protection: if *no* non-terminating node is Ready (e.g. the control plane lost
//!   contact with every kubelet), all non-terminating nodes are kept instead of an empty list;
//! - addresses are the node's `InternalIP`s, filtered by the Service's `ipFamilies`.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::Node;
use lb_api::LoadBalancerEndpoint;

/// Taint set by the cluster autoscaler on nodes it is about to remove.
pub const AUTOSCALER_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Whether the node is going away (see module docs).
pub fn is_terminating(node: &Node) -> bool {
    if node.metadata.deletion_timestamp.is_some() {
        return true;
    }
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|taints| taints.iter().any(|t| t.key == AUTOSCALER_TAINT));
    tainted || condition_is_true(node, "Terminating")
}

/// Whether the node's `Ready` condition is `True`.
pub fn is_ready(node: &Node) -> bool {
    condition_is_true(node, "Ready")
}

fn condition_is_true(node: &Node, type_: &str) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|conditions| conditions.iter().find(|c| c.type_ == type_))
        .is_some_and(|c| c.status == "True")
}

/// The node's InternalIP addresses of the requested families (`"IPv4"`, `"IPv6"`); an empty
/// family list means all families. Order follows the node's address list.
pub fn node_addresses(node: &Node, ip_families: &[String]) -> Vec<String> {
    let wants = |ip: &IpAddr| {
        ip_families.is_empty()
            || ip_families.iter().any(|f| match f.as_str() {
                "IPv4" => ip.is_ipv4(),
                "IPv6" => ip.is_ipv6(),
                _ => false,
            })
    };
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP")
        .filter(|a| a.address.parse::<IpAddr>().is_ok_and(|ip| wants(&ip)))
        .map(|a| a.address.clone())
        .collect()
}

/// The endpoints for a Service with the given `ipFamilies`, sorted by node name. Nodes without
/// an address of the requested families are left out (they could not receive traffic anyway).
pub fn endpoints_for<'a>(
    nodes: impl IntoIterator<Item = &'a Node>,
    ip_families: &[String],
) -> Vec<LoadBalancerEndpoint> {
    let nodes: Vec<&Node> = nodes.into_iter().collect();
    let any_ready = nodes.iter().any(|n| !is_terminating(n) && is_ready(n));
    let mut endpoints: Vec<LoadBalancerEndpoint> = nodes
        .into_iter()
        .filter_map(|node| {
            let draining = is_terminating(node);
            let serves = if draining {
                is_ready(node)
            } else {
                // Meltdown protection: with no Ready node at all, keep every non-terminating node.
                !any_ready || is_ready(node)
            };
            let addresses = node_addresses(node, ip_families);
            (serves && !addresses.is_empty()).then(|| LoadBalancerEndpoint {
                name: node.metadata.name.clone().unwrap_or_default(),
                addresses: Some(addresses),
                draining: draining.then_some(true),
            })
        })
        .collect();
    endpoints.sort_by(|a, b| a.name.cmp(&b.name));
    endpoints
}

/// What about a node matters for endpoints; node updates that do not change it (heartbeats,
/// image lists, labels) do not trigger any reconciliation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NodeFingerprint {
    ready: bool,
    terminating: bool,
    internal_ips: Vec<String>,
}

impl NodeFingerprint {
    /// The fingerprint of a node.
    pub fn of(node: &Node) -> Self {
        Self {
            ready: is_ready(node),
            terminating: is_terminating(node),
            internal_ips: node_addresses(node, &[]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str, ready: &str, ips: &[&str]) -> Node {
        let addresses: Vec<_> = std::iter::once(json!({"type": "Hostname", "address": name}))
            .chain(
                ips.iter()
                    .map(|ip| json!({"type": "InternalIP", "address": ip})),
            )
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "status": {
                "conditions": [{"type": "Ready", "status": ready}],
                "addresses": addresses,
            }
        }))
        .unwrap()
    }

    fn names(eps: &[LoadBalancerEndpoint]) -> Vec<&str> {
        eps.iter().map(|e| e.name.as_str()).collect()
    }

    #[test]
    fn only_ready_nodes_sorted() {
        let nodes = [
            node("c", "True", &["10.0.0.3"]),
            node("a", "True", &["10.0.0.1"]),
            node("b", "False", &["10.0.0.2"]),
            node("d", "Unknown", &["10.0.0.4"]),
        ];
        let eps = endpoints_for(&nodes, &["IPv4".into()]);
        assert_eq!(names(&eps), ["a", "c"]);
        assert_eq!(eps[0].addresses(), ["10.0.0.1"]);
    }

    #[test]
    fn terminating_nodes_still_ready_are_draining_endpoints() {
        let mut tainted = node("tainted", "True", &["10.0.0.1"]);
        tainted.spec = Some(
            serde_json::from_value(
                json!({"taints": [{"key": AUTOSCALER_TAINT, "effect": "NoSchedule"}]}),
            )
            .unwrap(),
        );
        let mut condition = node("condition", "True", &["10.0.0.2"]);
        condition
            .status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()
            .push(
                serde_json::from_value(json!({"type": "Terminating", "status": "True"})).unwrap(),
            );
        let mut deleting = node("deleting", "True", &["10.0.0.3"]);
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        let healthy = node("healthy", "True", &["10.0.0.4"]);
        let mut gone = node("gone", "False", &["10.0.0.5"]);
        gone.spec = tainted.spec.clone();
        let eps = endpoints_for([&tainted, &condition, &deleting, &healthy, &gone], &[]);
        assert_eq!(names(&eps), ["condition", "deleting", "healthy", "tainted"]);
        let draining: Vec<bool> = eps.iter().map(|e| e.is_draining()).collect();
        assert_eq!(draining, [true, true, false, true]);
    }

    #[test]
    fn meltdown_keeps_all_non_terminating_nodes() {
        let mut tainted = node("tainted", "False", &["10.0.0.9"]);
        tainted.spec = Some(
            serde_json::from_value(
                json!({"taints": [{"key": AUTOSCALER_TAINT, "effect": "NoSchedule"}]}),
            )
            .unwrap(),
        );
        let nodes = [
            node("a", "False", &["10.0.0.1"]),
            node("b", "Unknown", &["10.0.0.2"]),
            tainted,
        ];
        assert_eq!(names(&endpoints_for(&nodes, &[])), ["a", "b"]);
        assert!(endpoints_for(&[] as &[Node], &[]).is_empty());
    }

    #[test]
    fn ip_family_filtering() {
        let nodes = [
            node("a", "True", &["10.0.0.1", "fd00::1"]),
            node("b", "True", &["fd00::2"]),
        ];
        let v4 = endpoints_for(&nodes, &["IPv4".into()]);
        assert_eq!(names(&v4), ["a"]);
        assert_eq!(v4[0].addresses(), ["10.0.0.1"]);
        let v6 = endpoints_for(&nodes, &["IPv6".into()]);
        assert_eq!(names(&v6), ["a", "b"]);
        assert_eq!(v6[0].addresses(), ["fd00::1"]);
        let dual = endpoints_for(&nodes, &["IPv4".into(), "IPv6".into()]);
        assert_eq!(dual[0].addresses(), ["10.0.0.1", "fd00::1"]);
        assert_eq!(endpoints_for(&nodes, &[])[0].addresses().len(), 2);
    }

    #[test]
    fn fingerprint_ignores_irrelevant_changes() {
        let a = node("a", "True", &["10.0.0.1"]);
        let mut relabeled = a.clone();
        relabeled.metadata.labels = Some([("x".to_string(), "y".to_string())].into());
        assert_eq!(NodeFingerprint::of(&a), NodeFingerprint::of(&relabeled));
        assert_ne!(
            NodeFingerprint::of(&a),
            NodeFingerprint::of(&node("a", "False", &["10.0.0.1"]))
        );
        assert_ne!(
            NodeFingerprint::of(&a),
            NodeFingerprint::of(&node("a", "True", &["10.0.0.2"]))
        );
    }
}
