//! A Service's IP families against the nodes' addresses (pure, no I/O).
//!
//! [`decide`] is the one place that says whether a Service is served, over which families, which endpoints its
//! LoadBalancer gets and what the Service is told (Warning events and the [`CONDITION_TYPE`] condition on its
//! status). The data plane forwards IPv4 and IPv6; what limits a family is whether the nodes that would receive
//! traffic have InternalIPs of it:
//!
//! | Service | outcome |
//! |---|---|
//! | SingleStack (IPv4 or IPv6), nodes with addresses of the family | served, condition True |
//! | PreferDualStack or RequireDualStack, nodes with addresses of both families | served over both, condition True |
//! | PreferDualStack, no node with addresses of one family | served over the other, Warning, condition False |
//! | RequireDualStack, no node with addresses of one family | refused: cannot be satisfied |
//! | SingleStack, no node with addresses of its family (but nodes of the other) | served without backends, Warning |
//!
//! Refused works like a validation error: no LoadBalancer is created and an existing one is not changed, so
//! traffic that flows keeps flowing until the Service or the nodes are fixed — never a LoadBalancer without
//! backends for a family the Service requires. A cluster without any node (or none with an InternalIP yet) is
//! served over every family it asks for: the endpoints follow when nodes come. A single-stack Service whose
//! nodes have only the other family gets its LoadBalancer anyway (address allocated, stable) plus a
//! `NoIPv4Nodes`/`NoIPv6Nodes` Warning, instead of silently zero backends.
//!
//! All of this when IPv6 is served at all (`serve_ipv6`, the controller's `--serve-ipv6`, on by default): turned
//! off (load balancers of an image that does not forward IPv6), a Service asking for IPv6 is told so
//! (`IPFamilyNotSupported`): PreferDualStack is served over IPv4 only, IPv6-only and RequireDualStack are refused.

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use lb_api::{LoadBalancerEndpoint, IP_FAMILY_V4 as IPV4, IP_FAMILY_V6 as IPV6};
use serde_json::{json, Value};

use crate::cloud::endpoints;
use crate::cloud::loadbalancer_spec::{reasons, Warning};

/// `status.conditions[].type` of the Service condition that says whether its IP families are served.
pub const CONDITION_TYPE: &str = "LoadBalancerIPFamilies";
/// The condition's reason when every family of the Service is served.
pub const SERVED: &str = "Served";

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
    /// The families the LoadBalancer serves, the Service's primary first (empty when refused).
    pub families: Vec<String>,
    /// The LoadBalancer's endpoints (the nodes' InternalIPs of the served families); `None`: refused, nothing is
    /// created or changed.
    pub endpoints: Option<Vec<LoadBalancerEndpoint>>,
    /// Warning events for the Service.
    pub warnings: Vec<Warning>,
    /// The condition on the Service's status.
    pub verdict: Verdict,
}

/// The reason of a family without nodes.
fn no_nodes_reason(family: &str) -> &'static str {
    if family == IPV6 {
        reasons::NO_IPV6_NODES
    } else {
        reasons::NO_IPV4_NODES
    }
}

/// Decides for `service` given the cluster's `nodes`, serving IPv6 only with `serve_ipv6` (see the module docs).
pub fn decide<'a, I>(service: &Service, nodes: I, serve_ipv6: bool) -> Decision
where
    I: IntoIterator<Item = &'a Node> + Clone,
{
    let spec = service.spec.as_ref();
    // The API server always fills `ipFamilies`; a Service without them (an older server, a test object) is IPv4.
    let mut families: Vec<String> = spec
        .and_then(|s| s.ip_families.clone())
        .filter(|f| !f.is_empty())
        .unwrap_or_else(|| vec![IPV4.into()]);
    families.dedup();
    let policy = spec
        .and_then(|s| s.ip_family_policy.as_deref())
        .unwrap_or("SingleStack");
    let listed = families.join(", ");
    let mut warnings = Vec::new();
    if !serve_ipv6 && families.iter().any(|f| f == IPV6) {
        let why = "this installation does not serve IPv6 (the controller's --serve-ipv6 is off)";
        if policy == "RequireDualStack" || !families.iter().any(|f| f == IPV4) {
            let message = format!(
                "ipFamilies [{listed}] (ipFamilyPolicy {policy}) cannot be served: {why}, so no LoadBalancer is \
                 created or changed; set ipFamilies to [IPv4], or ipFamilyPolicy to PreferDualStack"
            );
            return Decision {
                families: Vec::new(),
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
        warnings.push(Warning {
            reason: reasons::IP_FAMILY_NOT_SUPPORTED,
            message: format!(
                "ipFamilies [{listed}] (ipFamilyPolicy {policy}): IPv6 not served: {why}; served over IPv4 only"
            ),
        });
        families.retain(|f| f == IPV4);
    }

    // Only nodes that would receive new traffic count (ready, not terminating), and only when there are some: a
    // cluster without nodes yet gets every family it asks for.
    let receiving = |families: &[String]| {
        endpoints::endpoints_for(nodes.clone(), families)
            .iter()
            .filter(|e| !e.is_draining())
            .count()
    };
    let any = receiving(&[]);
    let missing: Vec<&str> = families
        .iter()
        .map(String::as_str)
        .filter(|f| any > 0 && receiving(&[f.to_string()]) == 0)
        .collect();
    // No node count in the text: the message (event and condition) would change with every node added.
    let lacks =
        |family: &str| format!("no node that would receive traffic has an {family} InternalIP");

    if policy == "RequireDualStack" && !missing.is_empty() {
        let family = missing[0];
        let message = format!(
            "ipFamilyPolicy RequireDualStack (ipFamilies [{listed}]) cannot be satisfied: {}, so no LoadBalancer \
             is created or changed; give the nodes {family} addresses or set ipFamilyPolicy to PreferDualStack \
             (served over the families the nodes have)",
            lacks(family)
        );
        return Decision {
            families: Vec::new(),
            endpoints: None,
            warnings: vec![Warning {
                reason: no_nodes_reason(family),
                message: message.clone(),
            }],
            verdict: Verdict {
                served_fully: false,
                reason: no_nodes_reason(family),
                message,
            },
        };
    }

    let served: Vec<String> = if missing.len() < families.len() {
        // Dual-stack with one family missing: served over the other, said so.
        for family in &missing {
            let others: Vec<&str> = families
                .iter()
                .map(String::as_str)
                .filter(|f| !missing.contains(f))
                .collect();
            warnings.push(Warning {
                reason: no_nodes_reason(family),
                message: format!(
                    "ipFamilies [{listed}] (ipFamilyPolicy {policy}): {family} not served: {}; served over {} \
                     only until they do",
                    lacks(family),
                    others.join(" and ")
                ),
            });
        }
        families
            .iter()
            .filter(|f| !missing.contains(&f.as_str()))
            .cloned()
            .collect()
    } else {
        // No node has any family the Service asks for: created without backends (the address is allocated and
        // stays), said so, and the endpoints follow once the nodes get such addresses.
        for family in &missing {
            warnings.push(Warning {
                reason: no_nodes_reason(family),
                message: format!(
                    "{} (only the other family): it has no backends until the nodes get {family} addresses",
                    lacks(family)
                ),
            });
        }
        families.clone()
    };
    let endpoints = endpoints::endpoints_for(nodes, &served);
    let verdict = match warnings.as_slice() {
        [] => Verdict {
            served_fully: true,
            reason: SERVED,
            message: format!(
                "ipFamilies [{listed}]: served over {}",
                served.join(" and ")
            ),
        },
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
        families: served,
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

    /// The decisions once IPv6 is served (the gate itself: `ipv6_is_refused_or_narrowed_until_served`).
    fn decide<'a, I>(service: &Service, nodes: I) -> Decision
    where
        I: IntoIterator<Item = &'a Node> + Clone,
    {
        super::decide(service, nodes, true)
    }

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

    fn v4_nodes() -> Vec<Node> {
        vec![node("a", &["10.0.0.1"]), node("b", &["10.0.0.2"])]
    }

    #[test]
    fn single_stack_is_served_with_the_family_s_endpoints() {
        let nodes = dual_and_v6_nodes();
        for spec in [
            json!({"ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack"}),
            // Filled by every API server; absent: IPv4.
            json!({}),
            json!({"ipFamilies": []}),
        ] {
            let d = decide(&service(spec.clone()), &nodes);
            assert_eq!(d.families, ["IPv4"], "{spec}");
            let endpoints = d.endpoints.expect("served");
            assert_eq!(endpoints.len(), 1, "{spec}: only the node with IPv4");
            assert_eq!(endpoints[0].addresses(), ["10.0.0.1"], "{spec}: no IPv6");
            assert!(d.warnings.is_empty(), "{spec}: {:?}", d.warnings);
            assert!(d.verdict.served_fully);
            assert_eq!(d.verdict.reason, "Served");
        }
        let d = decide(
            &service(json!({"ipFamilies": ["IPv6"], "ipFamilyPolicy": "SingleStack"})),
            &nodes,
        );
        assert_eq!(d.families, ["IPv6"]);
        let endpoints = d.endpoints.expect("served");
        assert_eq!(endpoints.len(), 2);
        assert_eq!(endpoints[0].addresses(), ["fd00::1"], "no IPv4");
        assert_eq!(endpoints[1].addresses(), ["fd00::2"]);
        assert!(d.warnings.is_empty() && d.verdict.served_fully);
        assert_eq!(d.verdict.message, "ipFamilies [IPv6]: served over IPv6");
    }

    #[test]
    fn dual_stack_is_served_over_both_families_with_both_addresses() {
        let nodes = dual_and_v6_nodes();
        for policy in ["PreferDualStack", "RequireDualStack"] {
            for families in [json!(["IPv4", "IPv6"]), json!(["IPv6", "IPv4"])] {
                let d = decide(
                    &service(json!({"ipFamilies": families, "ipFamilyPolicy": policy})),
                    &nodes,
                );
                assert_eq!(json!(d.families), families, "primary first");
                let endpoints = d.endpoints.as_ref().expect("served");
                assert_eq!(endpoints.len(), 2);
                assert_eq!(endpoints[0].addresses(), ["10.0.0.1", "fd00::1"]);
                assert_eq!(endpoints[1].addresses(), ["fd00::2"]);
                assert!(d.warnings.is_empty(), "{:?}", d.warnings);
                assert!(d.verdict.served_fully);
                assert!(
                    d.verdict.message.ends_with("served over IPv4 and IPv6")
                        || d.verdict.message.ends_with("served over IPv6 and IPv4")
                );
            }
        }
    }

    #[test]
    fn prefer_dual_stack_without_nodes_of_a_family_is_served_over_the_other_with_a_warning() {
        let d = decide(
            &service(json!({"ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "PreferDualStack"})),
            &v4_nodes(),
        );
        assert_eq!(d.families, ["IPv4"]);
        let endpoints = d.endpoints.as_ref().expect("served");
        assert_eq!(endpoints.len(), 2);
        assert_eq!(reasons_of(&d), ["NoIPv6Nodes"]);
        let message = &d.warnings[0].message;
        assert!(
            message.contains("IPv6 not served: no node that would receive traffic"),
            "{message}"
        );
        assert!(message.contains("served over IPv4 only"), "{message}");
        assert!(!d.verdict.served_fully);
        assert_eq!(d.verdict.reason, "NoIPv6Nodes");
        assert_eq!(&d.verdict.message, message);
    }

    #[test]
    fn require_dual_stack_without_nodes_of_a_family_is_refused() {
        for (nodes, family) in [
            (v4_nodes(), "IPv6"),
            (vec![node("a", &["fd00::1"])], "IPv4"),
        ] {
            let d = decide(
                &service(
                    json!({"ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "RequireDualStack"}),
                ),
                &nodes,
            );
            assert_eq!(
                d.endpoints, None,
                "refused, never an LB without {family} backends"
            );
            assert!(d.families.is_empty());
            let reason = format!("No{family}Nodes");
            assert_eq!(reasons_of(&d), [reason.as_str()]);
            let message = &d.warnings[0].message;
            assert!(message.contains("RequireDualStack"), "{message}");
            assert!(
                message.contains("no LoadBalancer is created or changed")
                    && message.contains("ipFamilyPolicy to PreferDualStack")
                    && message.contains(&format!("has an {family} InternalIP")),
                "says what happens and what to change: {message}"
            );
            assert!(!d.verdict.served_fully);
            assert_eq!(d.verdict.reason, reason);
        }
        // No nodes yet: nothing to decide by, served over both.
        let none: [Node; 0] = [];
        let d = decide(
            &service(json!({"ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "RequireDualStack"})),
            &none,
        );
        assert_eq!(d.families, ["IPv4", "IPv6"]);
        assert_eq!(d.endpoints, Some(vec![]));
        assert!(d.verdict.served_fully);
    }

    #[test]
    fn single_stack_nodes_of_the_other_family_only_are_a_warning_not_silence() {
        let v6_only = [node("a", &["fd00::1"]), node("b", &["fd00::2"])];
        let d = decide(&service(json!({"ipFamilies": ["IPv4"]})), &v6_only);
        assert_eq!(d.endpoints, Some(vec![]), "created, without backends");
        assert_eq!(d.families, ["IPv4"]);
        assert_eq!(reasons_of(&d), ["NoIPv4Nodes"]);
        assert!(d.warnings[0]
            .message
            .contains("no node that would receive traffic has an IPv4 InternalIP"));
        assert!(d.warnings[0]
            .message
            .contains("no backends until the nodes get IPv4 addresses"));
        assert!(!d.verdict.served_fully);
        assert_eq!(d.verdict.reason, "NoIPv4Nodes");

        let d = decide(&service(json!({"ipFamilies": ["IPv6"]})), &v4_nodes());
        assert_eq!(d.endpoints, Some(vec![]));
        assert_eq!(reasons_of(&d), ["NoIPv6Nodes"]);

        // No nodes at all (a new cluster) or nodes without any InternalIP: nothing to explain.
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
            &service(json!({"ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "RequireDualStack"})),
            &v4_nodes(),
        )
        .verdict;
        let patch = condition_patch(&with_condition(stored.clone()), &refused, now).unwrap();
        let condition = &patch["status"]["conditions"][0];
        assert_eq!(condition["status"], "False");
        assert_eq!(condition["reason"], "NoIPv6Nodes");
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

    #[test]
    fn ipv6_is_refused_or_narrowed_until_served() {
        let gated = |spec: Value| super::decide(&service(spec), &dual_and_v6_nodes(), false);
        // PreferDualStack: IPv4 only, said so.
        let d = gated(json!({"ipFamilies": ["IPv6", "IPv4"], "ipFamilyPolicy": "PreferDualStack"}));
        assert_eq!(d.families, vec![IPV4.to_string()]);
        assert!(d.endpoints.as_ref().unwrap().iter().all(|e| e
            .addresses
            .iter()
            .flatten()
            .all(|a| !a.contains(':'))));
        assert_eq!(d.verdict.reason, reasons::IP_FAMILY_NOT_SUPPORTED);
        assert!(!d.verdict.served_fully);
        assert!(
            d.warnings[0].message.contains("--serve-ipv6"),
            "{:?}",
            d.warnings
        );
        // IPv6 only and RequireDualStack: refused, nothing created or changed.
        for spec in [
            json!({"ipFamilies": ["IPv6"]}),
            json!({"ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "RequireDualStack"}),
        ] {
            let d = gated(spec);
            assert_eq!((d.families.len(), d.endpoints.is_none()), (0, true));
            assert_eq!(d.warnings[0].reason, reasons::IP_FAMILY_NOT_SUPPORTED);
        }
        // IPv4 alone is untouched by the gate.
        let d = gated(json!({"ipFamilies": ["IPv4"]}));
        assert!(d.verdict.served_fully && d.warnings.is_empty());
    }
}
