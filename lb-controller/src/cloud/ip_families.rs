//! A Service's IP families against what the data plane forwards, IPv4 only for now (pure, no I/O).
//!
//! [`decide`] is the one place that says whether a Service is served, which endpoints its LoadBalancer gets and
//! what the Service is told (Warning events and the [`CONDITION_TYPE`] condition on its status):
//!
//! | Service | outcome |
//! |---|---|
//! | `ipFamilies` [IPv4] (or empty), any policy but RequireDualStack | served, condition True |
//! | PreferDualStack with IPv4 among the families | served over IPv4 only, Warning, condition False |
//! | RequireDualStack | refused: cannot be satisfied |
//! | no IPv4 among the families (IPv6 single-stack) | refused: nothing would reach the Service |
//!
//! Refused works like a validation error: no LoadBalancer is created and an existing one is not changed, so
//! traffic that flows keeps flowing until the Service is fixed. A served Service whose nodes have only IPv6
//! InternalIPs gets its LoadBalancer anyway (address allocated, stable; endpoints follow as soon as nodes get IPv4
//! addresses, as for a cluster without nodes yet) plus a `NoIPv4Nodes` Warning, instead of silently zero backends.

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use lb_api::LoadBalancerEndpoint;
use serde_json::{json, Value};

use crate::cloud::endpoints;
use crate::cloud::loadbalancer_spec::{reasons, Warning};

/// `status.conditions[].type` of the Service condition that says whether its IP families are served.
pub const CONDITION_TYPE: &str = "LoadBalancerIPFamilies";
/// The condition's reason when every family of the Service is served.
pub const SERVED: &str = "Served";

const IPV4: &str = "IPv4";
const IPV6: &str = "IPv6";

/// The condition's state (type [`CONDITION_TYPE`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// True when all the Service asks for is served.
    pub served_fully: bool,
    /// [`SERVED`] or one of [`reasons`].
    pub reason: &'static str,
    /// What is (not) served and what to change.
    pub message: String,
}

/// What the reconcile does about a Service's IP families.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The LoadBalancer's endpoints (the nodes' IPv4 InternalIPs); `None`: refused, nothing is created or changed.
    pub endpoints: Option<Vec<LoadBalancerEndpoint>>,
    /// Warning events for the Service.
    pub warnings: Vec<Warning>,
    /// The condition on the Service's status.
    pub verdict: Verdict,
}

/// Decides for `service` given the cluster's `nodes` (see the module docs).
pub fn decide<'a, I>(service: &Service, nodes: I) -> Decision
where
    I: IntoIterator<Item = &'a Node> + Clone,
{
    let spec = service.spec.as_ref();
    // The API server always fills `ipFamilies`; a Service without them (an older server, a test object) is IPv4.
    let families: Vec<String> = spec
        .and_then(|s| s.ip_families.clone())
        .filter(|f| !f.is_empty())
        .unwrap_or_else(|| vec![IPV4.into()]);
    let policy = spec
        .and_then(|s| s.ip_family_policy.as_deref())
        .unwrap_or("SingleStack");
    let listed = families.join(", ");
    let unserved: Vec<&str> = families
        .iter()
        .map(String::as_str)
        .filter(|f| *f != IPV4)
        .collect();

    let refusal = if policy == "RequireDualStack" {
        Some(format!(
            "ipFamilyPolicy RequireDualStack (ipFamilies [{listed}]) cannot be satisfied: this load balancer \
             forwards IPv4 only (IPv6 is not supported yet), so no LoadBalancer is created or changed; set \
             ipFamilyPolicy to PreferDualStack (served over IPv4) or to SingleStack with ipFamilies [IPv4]"
        ))
    } else if !families.iter().any(|f| f == IPV4) {
        Some(format!(
            "ipFamilies [{listed}] (ipFamilyPolicy {policy}) without IPv4: this load balancer forwards IPv4 only \
             (IPv6 is not supported yet), so no LoadBalancer is created or changed; set ipFamilyPolicy to \
             PreferDualStack (adds IPv4 where the cluster has an IPv4 service range) or recreate the Service with \
             ipFamilies [IPv4]"
        ))
    } else {
        None
    };
    if let Some(message) = refusal {
        return Decision {
            endpoints: None,
            warnings: vec![Warning {
                reason: reasons::IP_FAMILY_NOT_SUPPORTED,
                message: message.clone(),
            }],
            verdict: Verdict {
                served_fully: false,
                reason: reasons::IP_FAMILY_NOT_SUPPORTED,
                message,
            },
        };
    }

    // Never IPv6 endpoints: the data plane could not reach them.
    let endpoints = endpoints::endpoints_for(nodes.clone(), &[IPV4.into()]);
    let mut warnings = Vec::new();
    if !unserved.is_empty() {
        warnings.push(Warning {
            reason: reasons::IP_FAMILY_NOT_SUPPORTED,
            message: format!(
                "ipFamilies [{listed}] (ipFamilyPolicy {policy}): {} not served yet; the load balancer forwards \
                 IPv4 only and publishes only its IPv4 address",
                unserved.join(", ")
            ),
        });
    }
    // Only an empty list needs explaining: with some IPv4 nodes, IPv6-only ones are left out like nodes
    // without any address.
    let ipv6_only = if endpoints.is_empty() {
        endpoints::endpoints_for(nodes, &[IPV6.into()]).len()
    } else {
        0
    };
    if ipv6_only > 0 {
        warnings.push(Warning {
            reason: reasons::NO_IPV4_NODES,
            message: format!(
                "none of the {ipv6_only} node(s) that would receive traffic has an IPv4 InternalIP (IPv6 only) and \
                 this load balancer forwards IPv4 only: it has no backends until the nodes get IPv4 addresses"
            ),
        });
    }
    let verdict = match warnings.as_slice() {
        [] => Verdict {
            served_fully: true,
            reason: SERVED,
            message: format!("ipFamilies [{listed}]: served over IPv4"),
        },
        // No backends at all is the graver of the two: its reason, both messages.
        all => Verdict {
            served_fully: false,
            reason: all.last().expect("not empty").reason,
            message: all
                .iter()
                .map(|w| w.message.as_str())
                .collect::<Vec<_>>()
                .join("; "),
        },
    };
    Decision {
        endpoints: Some(endpoints),
        warnings,
        verdict,
    }
}

/// The strategic merge patch of the Service's status that sets the condition to `verdict`, or `None` when it
/// already says that (no write, no watch event). Other conditions and `loadBalancer` are untouched: Service
/// conditions merge by `type`. The transition time stays while the status does.
pub fn condition_patch(service: &Service, verdict: &Verdict, now: Time) -> Option<Value> {
    let status = if verdict.served_fully {
        "True"
    } else {
        "False"
    };
    let generation = service.metadata.generation;
    let current = service
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == CONDITION_TYPE));
    let transition = match current {
        Some(c)
            if c.status == status
                && c.reason == verdict.reason
                && c.message == verdict.message
                && c.observed_generation == generation =>
        {
            return None
        }
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => now,
    };
    Some(json!({"status": {"conditions": [{
        "type": CONDITION_TYPE,
        "status": status,
        "reason": verdict.reason,
        "message": verdict.message,
        "observedGeneration": generation,
        "lastTransitionTime": transition,
    }]}}))
}

/// The strategic merge patch that removes the condition (the Service is no longer ours), or `None` without one.
pub fn condition_removal(service: &Service) -> Option<Value> {
    service
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == CONDITION_TYPE))
        .then(|| json!({"status": {"conditions": [{"type": CONDITION_TYPE, "$patch": "delete"}]}}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(spec: Value) -> Service {
        let mut svc = json!({
            "metadata": {"name": "web", "namespace": "default", "generation": 2},
            "spec": {"type": "LoadBalancer", "ports": [{"port": 80, "nodePort": 30080}]},
        });
        merge_into(&mut svc["spec"], spec);
        serde_json::from_value(svc).unwrap()
    }

    fn merge_into(target: &mut Value, patch: Value) {
        for (k, v) in patch.as_object().unwrap() {
            target[k] = v.clone();
        }
    }

    fn node(name: &str, ips: &[&str]) -> Node {
        let addresses: Vec<_> = ips
            .iter()
            .map(|ip| json!({"type": "InternalIP", "address": ip}))
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "status": {"conditions": [{"type": "Ready", "status": "True"}], "addresses": addresses},
        }))
        .unwrap()
    }

    fn dual_and_v6_nodes() -> Vec<Node> {
        vec![node("a", &["10.0.0.1", "fd00::1"]), node("b", &["fd00::2"])]
    }

    fn reasons_of(d: &Decision) -> Vec<&str> {
        d.warnings.iter().map(|w| w.reason).collect()
    }

    #[test]
    fn ipv4_single_stack_is_served_with_ipv4_endpoints() {
        let nodes = dual_and_v6_nodes();
        for spec in [
            json!({"ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack"}),
            // Filled by every API server; absent: IPv4.
            json!({}),
            json!({"ipFamilies": []}),
        ] {
            let d = decide(&service(spec.clone()), &nodes);
            let endpoints = d.endpoints.expect("served");
            assert_eq!(endpoints.len(), 1, "{spec}: only the node with IPv4");
            assert_eq!(endpoints[0].addresses(), ["10.0.0.1"], "{spec}: no IPv6");
            assert!(d.warnings.is_empty(), "{spec}: {:?}", d.warnings);
            assert!(d.verdict.served_fully);
            assert_eq!(d.verdict.reason, "Served");
        }
    }

    #[test]
    fn prefer_dual_stack_is_served_over_ipv4_with_a_warning() {
        let nodes = dual_and_v6_nodes();
        for families in [json!(["IPv4", "IPv6"]), json!(["IPv6", "IPv4"])] {
            let d = decide(
                &service(json!({"ipFamilies": families, "ipFamilyPolicy": "PreferDualStack"})),
                &nodes,
            );
            let endpoints = d.endpoints.as_ref().expect("served");
            assert_eq!(endpoints[0].addresses(), ["10.0.0.1"]);
            assert_eq!(endpoints.len(), 1);
            assert_eq!(reasons_of(&d), ["IPFamilyNotSupported"]);
            assert!(d.warnings[0].message.contains("IPv6 not served yet"));
            assert!(d.warnings[0]
                .message
                .contains("publishes only its IPv4 address"));
            assert!(!d.verdict.served_fully);
            assert_eq!(d.verdict.reason, "IPFamilyNotSupported");
            assert_eq!(d.verdict.message, d.warnings[0].message);
        }
    }

    #[test]
    fn ipv6_single_stack_and_require_dual_stack_are_refused() {
        let nodes = dual_and_v6_nodes();
        let cases = [
            (
                json!({"ipFamilies": ["IPv6"], "ipFamilyPolicy": "SingleStack"}),
                "without IPv4",
            ),
            (
                json!({"ipFamilies": ["IPv6"], "ipFamilyPolicy": "PreferDualStack"}),
                "without IPv4",
            ),
            (
                json!({"ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "RequireDualStack"}),
                "RequireDualStack",
            ),
            (
                json!({"ipFamilies": ["IPv6", "IPv4"], "ipFamilyPolicy": "RequireDualStack"}),
                "RequireDualStack",
            ),
        ];
        for (spec, says) in cases {
            let d = decide(&service(spec.clone()), &nodes);
            assert_eq!(d.endpoints, None, "{spec}: refused");
            assert_eq!(reasons_of(&d), ["IPFamilyNotSupported"], "{spec}");
            let message = &d.warnings[0].message;
            assert!(message.contains(says), "{spec}: {message}");
            assert!(
                message.contains("no LoadBalancer is created or changed")
                    && message.contains("ipFamilyPolicy to"),
                "{spec}: says what happens and what to change: {message}"
            );
            assert!(!d.verdict.served_fully);
            assert_eq!(d.verdict.reason, "IPFamilyNotSupported");
        }
    }

    #[test]
    fn nodes_with_only_ipv6_are_a_warning_not_silence() {
        let v6_only = [node("a", &["fd00::1"]), node("b", &["fd00::2"])];
        let d = decide(&service(json!({"ipFamilies": ["IPv4"]})), &v6_only);
        assert_eq!(d.endpoints, Some(vec![]), "created, without backends");
        assert_eq!(reasons_of(&d), ["NoIPv4Nodes"]);
        assert!(d.warnings[0].message.contains("none of the 2 node(s)"));
        assert!(!d.verdict.served_fully);
        assert_eq!(d.verdict.reason, "NoIPv4Nodes");

        // Both problems: the graver reason, both messages.
        let d = decide(
            &service(json!({"ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "PreferDualStack"})),
            &v6_only,
        );
        assert_eq!(reasons_of(&d), ["IPFamilyNotSupported", "NoIPv4Nodes"]);
        assert_eq!(d.verdict.reason, "NoIPv4Nodes");
        assert!(d.verdict.message.contains("not served yet; the load"));
        assert!(d.verdict.message.contains("; none of the 2 node(s)"));

        // No nodes at all (a new cluster) or nodes without any InternalIP: nothing IPv6 to explain.
        let none: [Node; 0] = [];
        let d = decide(&service(json!({})), &none);
        assert!(d.warnings.is_empty() && d.verdict.served_fully);
        let d = decide(&service(json!({})), &[node("a", &[])]);
        assert!(d.warnings.is_empty() && d.verdict.served_fully);
        // One IPv4 node is enough: the IPv6-only ones are left out quietly, like nodes without addresses.
        let mixed = [node("a", &["10.0.0.1"]), node("b", &["fd00::2"])];
        assert!(decide(&service(json!({})), &mixed).warnings.is_empty());
    }

    fn with_condition(condition: Value) -> Service {
        let mut svc = service(json!({}));
        svc.status = Some(serde_json::from_value(json!({"conditions": [condition]})).unwrap());
        svc
    }

    fn time(s: &str) -> Time {
        serde_json::from_value(json!(s)).unwrap()
    }

    #[test]
    fn condition_is_written_only_when_it_changes() {
        let now = time("2025-01-02T03:04:05Z");
        let served = decide(&service(json!({})), &dual_and_v6_nodes()).verdict;
        let patch = condition_patch(&service(json!({})), &served, now.clone()).expect("new");
        assert_eq!(
            patch,
            json!({"status": {"conditions": [{
                "type": "LoadBalancerIPFamilies", "status": "True", "reason": "Served",
                "message": "ipFamilies [IPv4]: served over IPv4", "observedGeneration": 2,
                "lastTransitionTime": "2025-01-02T03:04:05Z",
            }]}})
        );
        let stored = patch["status"]["conditions"][0].clone();
        assert_eq!(
            condition_patch(&with_condition(stored.clone()), &served, now.clone()),
            None,
            "unchanged: no write"
        );

        // Same status, another message or generation: rewritten, the transition time kept.
        let mut older = stored.clone();
        older["observedGeneration"] = json!(1);
        older["lastTransitionTime"] = json!("2024-01-01T00:00:00Z");
        let patch = condition_patch(&with_condition(older), &served, now.clone()).unwrap();
        assert_eq!(
            patch["status"]["conditions"][0]["lastTransitionTime"],
            "2024-01-01T00:00:00Z"
        );
        assert_eq!(patch["status"]["conditions"][0]["observedGeneration"], 2);

        // Another status: a transition now.
        let refused = decide(
            &service(json!({"ipFamilies": ["IPv6"]})),
            &dual_and_v6_nodes(),
        )
        .verdict;
        let patch = condition_patch(&with_condition(stored.clone()), &refused, now).unwrap();
        let condition = &patch["status"]["conditions"][0];
        assert_eq!(condition["status"], "False");
        assert_eq!(condition["reason"], "IPFamilyNotSupported");
        assert_eq!(condition["lastTransitionTime"], "2025-01-02T03:04:05Z");

        assert_eq!(
            condition_removal(&with_condition(stored)),
            Some(json!({"status": {"conditions": [
                {"type": "LoadBalancerIPFamilies", "$patch": "delete"}
            ]}}))
        );
        let other = with_condition(json!({"type": "Other", "status": "True", "reason": "R",
            "message": "", "lastTransitionTime": "2024-01-01T00:00:00Z"}));
        assert_eq!(condition_removal(&other), None);
    }
}
