//! Back channel (control cluster → target cluster): a ready LoadBalancer's external IP goes into
//! `Service.status.loadBalancer.ingress`, and the user-facing events of the LoadBalancer
//! controllers are re-emitted on the Service.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, ObjectReference, Service};
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use lb_api::constants::{defaults, lb_annotations};
use lb_api::{naming, LoadBalancer};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::metrics::Metrics;
use crate::runtime::events::{EventPublisher, EventType};
use crate::runtime::retry::Retries;
use crate::runtime::watches;

/// Shared state of the back-channel controllers.
pub struct Context {
    /// Client of the cluster holding the Services.
    pub target: Client,
    /// Client of the cluster holding the LoadBalancers and their events.
    pub control: Client,
    /// Namespace of the LoadBalancers.
    pub namespace: String,
    /// Cache of the LoadBalancers.
    pub loadbalancers: Store<LoadBalancer>,
    /// Event publisher on the target cluster.
    pub events: Arc<EventPublisher>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Failures per LoadBalancer, for the error policy's backoff.
    pub retries: Retries<ObjectRef<LoadBalancer>>,
    /// Events older than this when first seen are not forwarded (they were forwarded before a
    /// restart, or are stale).
    pub event_max_age: Duration,
}

/// Errors of the back channel; retried with backoff.
#[derive(Debug, thiserror::Error)]
#[error("{action}: {source}")]
pub struct Error {
    action: String,
    #[source]
    source: kube::Error,
}

/// The Service a LoadBalancer belongs to (`yawol.stackit.cloud/serviceName` annotation).
pub fn service_of(lb: &LoadBalancer) -> Option<(String, String)> {
    let reference = lb.annotations().get(lb_annotations::SERVICE_NAME)?;
    let (namespace, name) = naming::parse_namespaced_name(reference)?;
    Some((namespace.to_string(), name.to_string()))
}

/// `ingress[].ipMode` (Kubernetes ≥ 1.30) for a LoadBalancer. `VIP` lets kube-proxy short-circuit in-cluster
/// traffic to the address straight to the Service's endpoints instead of sending it out through the load balancer.
/// With a PROXY header on any TCP port that would deliver in-cluster connections without the header, and backends
/// that expect it refuse them: `Proxy` then, so that the traffic goes through the load balancer, which inserts it.
pub fn ingress_ip_mode(lb: &LoadBalancer) -> &'static str {
    let options = lb.spec.options();
    if options.tcp_proxy_protocol_ports(lb.spec.ports()).is_empty() {
        "VIP"
    } else {
        "Proxy"
    }
}

/// The IPs to publish, if the LoadBalancer is ready: its addresses and either ready machines or zero desired
/// machines (yawol PR #521: keep reporting the IP when scaled to 0). One address per served family, in the order of
/// `spec.ipFamilies` (the Service's primary family first): IPv4 is `status.externalIP` (the floating IP, or the
/// VIP of an internal load balancer), IPv6 is `status.portIPv6` (the VIP port's IPv6 address: no floating IP for
/// IPv6). An IPv6-only LoadBalancer's `externalIP` is that same address. Empty: nothing to publish yet.
pub fn publishable_ips(lb: &LoadBalancer) -> Vec<&str> {
    if lb.meta().deletion_timestamp.is_some() {
        return Vec::new();
    }
    let Some(status) = lb.status.as_ref() else {
        return Vec::new();
    };
    let ready = lb.spec.replicas == 0 || status.ready_replicas.unwrap_or(0) > 0;
    if !ready {
        return Vec::new();
    }
    fn nonempty(ip: &Option<String>) -> Option<&str> {
        ip.as_deref().filter(|ip| !ip.is_empty())
    }
    let families: &[String] = match lb.spec.ip_families.as_deref() {
        None | Some([]) => &[],
        Some(families) => families,
    };
    let mut ips: Vec<&str> = Vec::new();
    if families.is_empty() {
        ips.extend(nonempty(&status.external_ip));
    }
    for family in families {
        let ip = match family.as_str() {
            lb_api::IP_FAMILY_V4 => nonempty(&status.external_ip),
            lb_api::IP_FAMILY_V6 => nonempty(&status.port_ipv6),
            _ => None,
        };
        ips.extend(ip.filter(|ip| !ips.contains(ip)));
    }
    ips
}

/// Reconciles one LoadBalancer: publish its IP on the Service.
pub async fn reconcile(lb: Arc<LoadBalancer>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_ip(&lb, &ctx).await;
    ctx.metrics
        .observe_reconcile("loadbalancer", result.is_ok(), started.elapsed());
    if result.is_ok() {
        ctx.retries.succeeded(&ObjectRef::from_obj(lb.as_ref()));
    }
    result
}

async fn reconcile_ip(lb: &LoadBalancer, ctx: &Context) -> Result<Action, Error> {
    let ips = publishable_ips(lb);
    let (false, Some((namespace, name))) = (ips.is_empty(), service_of(lb)) else {
        return Ok(Action::await_change());
    };
    let api: Api<Service> = Api::namespaced(ctx.target.clone(), &namespace);
    let service = api.get_opt(&name).await.map_err(|source| Error {
        action: format!("reading service {namespace}/{name}"),
        source,
    })?;
    let Some(service) = service else {
        return Ok(Action::await_change());
    };
    if service.meta().deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let current: Vec<(Option<&str>, Option<&str>)> = service
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|l| l.ingress.as_ref())
        .map(|i| {
            i.iter()
                .map(|i| (i.ip.as_deref(), i.ip_mode.as_deref()))
                .collect()
        })
        .unwrap_or_default();
    // Also rewrites ingresses published before `ipMode` was set, and those of a LoadBalancer whose PROXY protocol
    // was switched on or off.
    let mode = ingress_ip_mode(lb);
    if current
        .iter()
        .copied()
        .eq(ips.iter().map(|ip| (Some(*ip), Some(mode))))
    {
        return Ok(Action::await_change());
    }
    let ingress: Vec<_> = ips
        .iter()
        .map(|ip| json!({"ip": ip, "ipMode": mode}))
        .collect();
    let patch = json!({"status": {"loadBalancer": {"ingress": ingress}}});
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|source| Error {
            action: format!("writing ingress of service {namespace}/{name}"),
            source,
        })?;
    ctx.metrics.ingress_updates.inc();
    if current
        .iter()
        .map(|(ip, _)| *ip)
        .eq(ips.iter().map(|ip| Some(*ip)))
    {
        // Only `ipMode` changed (an ingress published by an older version or by yawol, or PROXY protocol switched):
        // nothing to tell the user.
        return Ok(Action::await_change());
    }
    let ip = ips.join(", ");
    info!(service = %format!("{namespace}/{name}"), ip, "published external IP");
    let reference: ObjectReference = service.object_ref(&());
    let message = format!("LoadBalancer is successfully created with IP {ip}");
    ctx.events
        .publish_best_effort(&reference, EventType::Normal, "creation", &message)
        .await;
    Ok(Action::await_change())
}

/// A failed reconcile is retried with the LoadBalancer's backoff (1 s doubling, at most a minute: [`Retries`]).
pub fn error_policy(lb: Arc<LoadBalancer>, error: &Error, ctx: Arc<Context>) -> Action {
    let reference = ObjectRef::from_obj(lb.as_ref());
    let (failures, delay) = ctx.retries.failed(&reference);
    warn!(loadbalancer = %reference, %error, failures, retry_in = ?delay, "back channel reconcile failed");
    Action::requeue(delay)
}

/// Whether an Event should be forwarded: about a LoadBalancer and from the user-facing source.
pub fn is_forwardable(event: &Event) -> bool {
    let component = event.source.as_ref().and_then(|s| s.component.as_deref());
    let reporting = event.reporting_component.as_deref();
    event.involved_object.kind.as_deref() == Some("LoadBalancer")
        && (component == Some(defaults::USER_EVENT_COMPONENT)
            || reporting == Some(defaults::USER_EVENT_COMPONENT))
}

fn event_count(event: &Event) -> i32 {
    event
        .count
        .or_else(|| event.series.as_ref().and_then(|s| s.count))
        .unwrap_or(1)
}

fn event_time(event: &Event) -> Option<k8s_openapi::jiff::Timestamp> {
    event
        .last_timestamp
        .as_ref()
        .map(|t| t.0)
        .or_else(|| event.event_time.as_ref().map(|t| t.0))
        .or_else(|| event.first_timestamp.as_ref().map(|t| t.0))
        .or_else(|| event.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

/// Watches Events in the control namespace and re-emits the forwardable ones on the Services.
/// Runs until the watch stream ends (never, in practice); watch errors are retried with backoff.
pub async fn forward_events(ctx: Arc<Context>) {
    let api: Api<Event> = Api::namespaced(ctx.control.clone(), &ctx.namespace);
    let config = watcher::Config::default().fields("involvedObject.kind=LoadBalancer");
    let mut forwarded: HashMap<String, i32> = HashMap::new();
    let stream = watches::events(api, config).applied_objects();
    futures::pin_mut!(stream);
    while let Some(item) = stream.next().await {
        let event = match item {
            Ok(event) => event,
            Err(e) => {
                warn!(error = %e, "event watch failed; retrying");
                continue;
            }
        };
        if !is_forwardable(&event) {
            continue;
        }
        let uid = event.metadata.uid.clone().unwrap_or_default();
        let count = event_count(&event);
        let first_sight = !forwarded.contains_key(&uid);
        if forwarded.get(&uid).is_some_and(|seen| *seen >= count) {
            continue;
        }
        forwarded.insert(uid, count);
        if first_sight {
            let fresh = event_time(&event).is_some_and(|t| {
                k8s_openapi::jiff::Timestamp::now()
                    .duration_since(t)
                    .unsigned_abs()
                    <= ctx.event_max_age
            });
            if !fresh {
                debug!(event = event.name_any(), "skipping old event");
                continue;
            }
        }
        if let Err(e) = forward(&ctx, &event).await {
            warn!(error = %e, event = event.name_any(), "could not forward event");
        }
        if forwarded.len() > 50_000 {
            forwarded.clear();
        }
    }
}

async fn forward(ctx: &Context, event: &Event) -> Result<(), kube::Error> {
    let Some(lb_name) = event.involved_object.name.as_deref() else {
        return Ok(());
    };
    let lb = ctx
        .loadbalancers
        .get(&ObjectRef::new(lb_name).within(&ctx.namespace));
    let lb = match lb {
        Some(lb) => lb,
        None => match Api::<LoadBalancer>::namespaced(ctx.control.clone(), &ctx.namespace)
            .get_opt(lb_name)
            .await?
        {
            Some(lb) => Arc::new(lb),
            None => return Ok(()),
        },
    };
    let Some((namespace, name)) = service_of(&lb) else {
        return Ok(());
    };
    let Some(service) = Api::<Service>::namespaced(ctx.target.clone(), &namespace)
        .get_opt(&name)
        .await?
    else {
        return Ok(());
    };
    let type_ = if event.type_.as_deref() == Some("Warning") {
        EventType::Warning
    } else {
        EventType::Normal
    };
    ctx.events
        .publish(
            &service.object_ref(&()),
            type_,
            event.reason.as_deref().unwrap_or("LoadBalancer"),
            event.message.as_deref().unwrap_or_default(),
        )
        .await?;
    ctx.metrics.events_forwarded.inc();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lb(replicas: i32, status: serde_json::Value) -> LoadBalancer {
        serde_json::from_value(json!({
            "apiVersion": "yawol.stackit.cloud/v1beta1",
            "kind": "LoadBalancer",
            "metadata": {"name": "default--web", "namespace": "yawol",
                         "annotations": {"yawol.stackit.cloud/serviceName": "default/web"}},
            "spec": {"selector": {}, "replicas": replicas,
                     "infrastructure": {"flavor": {}, "image": {}, "authSecretRef": {}}},
            "status": status,
        }))
        .unwrap()
    }

    fn publishable_ip(lb: &LoadBalancer) -> Option<&str> {
        match publishable_ips(lb).as_slice() {
            [] => None,
            [ip] => Some(*ip),
            more => panic!("one IP expected: {more:?}"),
        }
    }

    #[test]
    fn dual_stack_publishes_both_addresses_primary_first() {
        let status = json!({"externalIP": "203.0.113.5", "portIP": "10.0.0.5",
                            "portIPv6": "2001:db8::5", "readyReplicas": 1});
        let with = |families: serde_json::Value| {
            let mut l = lb(1, status.clone());
            l.spec.ip_families = serde_json::from_value(families).unwrap();
            l
        };
        let dual = with(json!(["IPv4", "IPv6"]));
        assert_eq!(publishable_ips(&dual), ["203.0.113.5", "2001:db8::5"]);
        let dual = with(json!(["IPv6", "IPv4"]));
        assert_eq!(publishable_ips(&dual), ["2001:db8::5", "203.0.113.5"]);
        // IPv6 only: externalIP is the IPv6 address too; published once.
        let mut v6 = lb(
            1,
            json!({"externalIP": "2001:db8::5", "portIPv6": "2001:db8::5", "readyReplicas": 1}),
        );
        v6.spec.ip_families = Some(vec!["IPv6".into()]);
        assert_eq!(publishable_ips(&v6), ["2001:db8::5"]);
        // Without spec.ipFamilies (IPv4, yawol's objects) a stale portIPv6 is not published.
        assert_eq!(publishable_ips(&lb(1, status.clone())), ["203.0.113.5"]);
        // The IPv6 address not there yet: the IPv4 one is published alone.
        let mut partial = with(json!(["IPv4", "IPv6"]));
        partial.status.as_mut().unwrap().port_ipv6 = None;
        assert_eq!(publishable_ips(&partial), ["203.0.113.5"]);
    }

    #[test]
    fn ip_is_published_only_when_ready_or_scaled_to_zero() {
        assert_eq!(publishable_ip(&lb(1, json!({}))), None);
        assert_eq!(
            publishable_ip(&lb(1, json!({"externalIP": "1.2.3.4"}))),
            None
        );
        assert_eq!(
            publishable_ip(&lb(1, json!({"externalIP": "1.2.3.4", "readyReplicas": 0}))),
            None
        );
        assert_eq!(
            publishable_ip(&lb(1, json!({"externalIP": "1.2.3.4", "readyReplicas": 1}))),
            Some("1.2.3.4")
        );
        assert_eq!(
            publishable_ip(&lb(0, json!({"externalIP": "1.2.3.4"}))),
            Some("1.2.3.4")
        );
        let mut deleting = lb(0, json!({"externalIP": "1.2.3.4"}));
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert_eq!(publishable_ip(&deleting), None);
        assert_eq!(
            service_of(&lb(1, json!({}))),
            Some(("default".into(), "web".into()))
        );
    }

    #[test]
    fn ip_mode_is_proxy_when_a_tcp_port_gets_a_proxy_header() {
        let with = |spec: serde_json::Value| {
            let mut l = lb(1, json!({}));
            l.spec.ports = serde_json::from_value(spec["ports"].clone()).unwrap();
            l.spec.options = serde_json::from_value(spec["options"].clone()).unwrap();
            ingress_ip_mode(&l)
        };
        let tcp_udp = json!([{"port": 80, "protocol": "TCP"}, {"port": 53, "protocol": "UDP"}]);
        assert_eq!(with(json!({"ports": tcp_udp})), "VIP");
        let on = |options: serde_json::Value| with(json!({"ports": tcp_udp, "options": options}));
        assert_eq!(on(json!({"tcpProxyProtocol": false})), "VIP");
        assert_eq!(on(json!({"tcpProxyProtocol": true})), "Proxy");
        assert_eq!(
            on(json!({"tcpProxyProtocol": true, "tcpProxyProtocolPortFilter": [80]})),
            "Proxy"
        );
        assert_eq!(
            on(json!({"tcpProxyProtocol": true, "tcpProxyProtocolPortFilter": []})),
            "Proxy",
            "an empty filter: every TCP port"
        );
        // The filter selects no TCP port: no header anywhere, nothing for kube-proxy to bypass.
        assert_eq!(
            on(json!({"tcpProxyProtocol": true, "tcpProxyProtocolPortFilter": [53, 8080]})),
            "VIP"
        );
        assert_eq!(
            with(json!({"ports": [{"port": 53, "protocol": "UDP"}],
                        "options": {"tcpProxyProtocol": true}})),
            "VIP"
        );
    }

    #[test]
    fn only_user_facing_loadbalancer_events_are_forwarded() {
        let event = |kind: &str, component: Option<&str>, reporting: Option<&str>| -> Event {
            serde_json::from_value(json!({
                "metadata": {"name": "e"},
                "involvedObject": {"kind": kind, "name": "default--web"},
                "source": {"component": component},
                "reportingComponent": reporting,
            }))
            .unwrap()
        };
        assert!(is_forwardable(&event(
            "LoadBalancer",
            Some("yawol-service"),
            None
        )));
        assert!(is_forwardable(&event(
            "LoadBalancer",
            None,
            Some("yawol-service")
        )));
        assert!(!is_forwardable(&event(
            "LoadBalancer",
            Some("yawol-controller"),
            None
        )));
        assert!(!is_forwardable(&event(
            "LoadBalancerSet",
            Some("yawol-service"),
            None
        )));
    }
}
