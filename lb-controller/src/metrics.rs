//! Prometheus metrics of the cloud controller and the OpenStack-side controllers (prometheus-client, OpenMetrics
//! text at `/metrics`). yawol's object metrics ([`ObjectMetrics`]: `loadbalancer_*`, `loadbalancerset_*`) and
//! `yawol_openstack` keep yawol's unprefixed names so existing dashboards work; everything of our own is prefixed
//! `lb_cloud_controller_`. `yawol_openstack` is typed `unknown` so its samples keep yawol's name, without the
//! `_total` OpenMetrics appends to counters ([`crate::openstack::CallCounter`]).

use std::collections::HashMap;
use std::sync::atomic::AtomicI64;
use std::sync::Mutex;
use std::time::Duration;

use kube::ResourceExt;
use lb_api::{LoadBalancer, LoadBalancerSet};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::openstack::OpenStackCalls;

/// Labels of per-controller series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    /// `service`, `loadbalancer` (back channel) or `event`.
    pub controller: String,
}

/// Labels of reconcile outcomes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// Controller name.
    pub controller: String,
    /// `ok` or `error`.
    pub result: String,
}

/// Labels of LoadBalancer writes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    /// `create`, `patch` or `delete`.
    pub operation: String,
}

/// Labels of bad-input counts.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InvalidInputLabels {
    /// `loadbalancer` or `loadbalancerset`.
    pub controller: String,
    /// What was wrong (the event reason, e.g. `InvalidConfiguration`).
    pub reason: String,
}

/// Labels of machine deletions by the set controller.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeletionLabels {
    /// `unhealthy` or `scale_down`.
    pub reason: String,
}

/// All metrics; cheap to share behind an `Arc`.
pub struct Metrics {
    /// Reconciliations by controller and result.
    pub reconciles: Family<ResultLabels, Counter>,
    /// Reconciliation latency by controller.
    pub reconcile_duration: Family<ControllerLabels, Histogram>,
    /// Writes to LoadBalancer objects by operation.
    pub loadbalancer_writes: Family<OperationLabels, Counter>,
    /// Services rejected by validation (each distinct problem counted once).
    pub invalid_services: Counter,
    /// Annotation values that were ignored (each distinct problem counted once).
    pub annotation_warnings: Counter,
    /// Events re-emitted from LoadBalancers onto Services.
    pub events_forwarded: Counter,
    /// External IPs written to Service status.
    pub ingress_updates: Counter,
    /// 1 while this instance holds the leader lease.
    pub leader: Gauge<i64, AtomicI64>,
    /// `yawol_openstack{api,object,operation}` (unprefixed, as in yawol): pass it to the OpenStack sessions.
    pub openstack_calls: OpenStackCalls,
    /// yawol's LoadBalancer and LoadBalancerSet series (unprefixed, as in yawol).
    pub objects: ObjectMetrics,
    /// Bad input in LoadBalancers / LoadBalancerSets (each also a Warning event), by controller and reason.
    pub invalid_input: Family<InvalidInputLabels, Counter>,
    /// LoadBalancerMachines deleted by the set controller, by reason.
    pub machine_deletions: Family<DeletionLabels, Counter>,
    /// 1 while the set controller's outage guard holds every machine deletion (no machine has a fresh heartbeat).
    pub heartbeat_outage: Gauge<i64, AtomicI64>,
    registry: Mutex<Registry>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers all metrics (prefix `lb_cloud_controller`, except `yawol_openstack`).
    pub fn new() -> Self {
        let mut root = Registry::default();
        let openstack_calls = OpenStackCalls::default();
        openstack_calls.register(&mut root);
        let objects = ObjectMetrics::default();
        objects.register(&mut root);
        let registry = root.sub_registry_with_prefix("lb_cloud_controller");
        let reconciles = Family::<ResultLabels, Counter>::default();
        let reconcile_duration = Family::<ControllerLabels, Histogram>::new_with_constructor(
            (|| Histogram::new(exponential_buckets(0.0005, 2.0, 16))) as fn() -> Histogram,
        );
        let loadbalancer_writes = Family::<OperationLabels, Counter>::default();
        let invalid_services = Counter::default();
        let annotation_warnings = Counter::default();
        let events_forwarded = Counter::default();
        let ingress_updates = Counter::default();
        let leader = Gauge::<i64, AtomicI64>::default();
        let invalid_input = Family::<InvalidInputLabels, Counter>::default();
        let machine_deletions = Family::<DeletionLabels, Counter>::default();
        let heartbeat_outage = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "invalid_input",
            "Bad input in LoadBalancers and LoadBalancerSets (each also a Warning event)",
            invalid_input.clone(),
        );
        registry.register(
            "machine_deletions",
            "LoadBalancerMachines deleted by the LoadBalancerSet controller",
            machine_deletions.clone(),
        );
        registry.register(
            "machine_heartbeat_outage",
            "1 while no LoadBalancerMachine has a fresh heartbeat and machine deletions are held",
            heartbeat_outage.clone(),
        );
        registry.register(
            "reconciles",
            "Reconciliations by controller and result",
            reconciles.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Reconciliation latency",
            reconcile_duration.clone(),
        );
        registry.register(
            "loadbalancer_writes",
            "Writes to LoadBalancer objects",
            loadbalancer_writes.clone(),
        );
        registry.register(
            "invalid_services",
            "Services rejected by validation",
            invalid_services.clone(),
        );
        registry.register(
            "annotation_warnings",
            "Service annotation values ignored",
            annotation_warnings.clone(),
        );
        registry.register(
            "events_forwarded",
            "LoadBalancer events re-emitted on Services",
            events_forwarded.clone(),
        );
        registry.register(
            "ingress_updates",
            "External IPs written to Service status",
            ingress_updates.clone(),
        );
        registry.register(
            "leader",
            "1 while this instance is the leader",
            leader.clone(),
        );
        Self {
            reconciles,
            reconcile_duration,
            loadbalancer_writes,
            invalid_services,
            annotation_warnings,
            events_forwarded,
            ingress_updates,
            leader,
            openstack_calls,
            objects,
            invalid_input,
            machine_deletions,
            heartbeat_outage,
            registry: Mutex::new(root),
        }
    }

    /// Registers more families on the same `/metrics` (unprefixed; e.g. another controller's yawol-named series).
    pub fn register_more(&self, register: impl FnOnce(&mut Registry)) {
        register(&mut self.registry.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Counts one piece of bad input.
    pub fn invalid(&self, controller: &str, reason: &str) {
        self.invalid_input
            .get_or_create(&InvalidInputLabels {
                controller: controller.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts one machine deletion by the set controller.
    pub fn machine_deleted(&self, reason: &str) {
        self.machine_deletions
            .get_or_create(&DeletionLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Records one reconciliation.
    pub fn observe_reconcile(&self, controller: &str, ok: bool, took: Duration) {
        self.reconciles
            .get_or_create(&ResultLabels {
                controller: controller.to_string(),
                result: if ok { "ok" } else { "error" }.to_string(),
            })
            .inc();
        self.reconcile_duration
            .get_or_create(&ControllerLabels {
                controller: controller.to_string(),
            })
            .observe(took.as_secs_f64());
    }

    /// Counts a LoadBalancer write.
    pub fn loadbalancer_write(&self, operation: &str) {
        self.loadbalancer_writes
            .get_or_create(&OperationLabels {
                operation: operation.to_string(),
            })
            .inc();
    }

    /// Number of reconciliations of a controller so far (any result); used by tests to know a
    /// change has been processed.
    pub fn reconcile_count(&self, controller: &str) -> u64 {
        ["ok", "error"]
            .iter()
            .map(|result| {
                self.reconciles
                    .get_or_create(&ResultLabels {
                        controller: controller.to_string(),
                        result: result.to_string(),
                    })
                    .get()
            })
            .sum()
    }

    /// OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        prometheus_client::encoding::text::encode(&mut text, &registry)
            .expect("writing to a String cannot fail");
        text
    }
}

/// Label set of the object series: yawol's label names (some camelCase), so a `Vec` of pairs.
pub type ObjectLabels = Vec<(String, String)>;

type Gauges = Family<ObjectLabels, Gauge<i64, AtomicI64>>;

/// The label sets of `loadbalancer_info` and `loadbalancer_openstack_info` of one LoadBalancer.
type InfoLabels = (ObjectLabels, ObjectLabels);

/// yawol's LoadBalancer and LoadBalancerSet gauges (seed 001's table). Every series of an object is removed when the
/// object goes away ([`ObjectMetrics::forget_loadbalancer`], [`ObjectMetrics::forget_set`]); an info series whose
/// labels change (a new external IP) replaces the old one instead of adding a second.
#[derive(Clone, Default)]
pub struct ObjectMetrics {
    lb_info: Gauges,
    lb_openstack_info: Gauges,
    lb_replicas: Gauges,
    lb_replicas_current: Gauges,
    lb_replicas_ready: Gauges,
    lb_deletion_timestamp: Gauges,
    lbs_replicas: Gauges,
    lbs_replicas_current: Gauges,
    lbs_replicas_ready: Gauges,
    lbs_deletion_timestamp: Gauges,
    /// The info label sets last written per LoadBalancer (namespace, name), to remove them when they change.
    info: std::sync::Arc<Mutex<HashMap<(String, String), InfoLabels>>>,
    /// The sets with series, (namespace, name) → their label set.
    sets: std::sync::Arc<Mutex<HashMap<(String, String), ObjectLabels>>>,
}

fn labels(pairs: &[(&str, &str)]) -> ObjectLabels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn deletion_seconds(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Option<i64> {
    meta.deletion_timestamp.as_ref().map(|t| t.0.as_second())
}

impl ObjectMetrics {
    /// Registers the families under yawol's names.
    pub fn register(&self, registry: &mut Registry) {
        let families: [(&str, &str, &Gauges); 10] = [
            (
                "loadbalancer_info",
                "Loadbalancer Info for LoadBalancer contains labels like isInternal, externalIP, tcpProxyProtocol, \
                 tcpIdleTimeout, udpIdleTimeout, lokiEnabled",
                &self.lb_info,
            ),
            (
                "loadbalancer_openstack_info",
                "Openstack Info contains labels with the OpenStackIDs for LoadBalancer",
                &self.lb_openstack_info,
            ),
            (
                "loadbalancer_replicas",
                "Replicas for LoadBalancer (from lb.spec.replicas, 0 if marked for deletion)",
                &self.lb_replicas,
            ),
            (
                "loadbalancer_replicas_current",
                "Current replicas for LoadBalancer (from lb.status.replicas)",
                &self.lb_replicas_current,
            ),
            (
                "loadbalancer_replicas_ready",
                "Ready replicas for LoadBalancer (from lb.status.readyReplicas)",
                &self.lb_replicas_ready,
            ),
            (
                "loadbalancer_deletion_timestamp",
                "Deletion timestamp of a LoadBalancer in seconds since epoch (only for LoadBalancers in deletion)",
                &self.lb_deletion_timestamp,
            ),
            (
                "loadbalancerset_replicas",
                "Replicas for LoadBalancerSet (from lbs.spec.replicas, 0 if marked for deletion)",
                &self.lbs_replicas,
            ),
            (
                "loadbalancerset_replicas_current",
                "Current replicas for LoadBalancerSet (from lbs.status.replicas)",
                &self.lbs_replicas_current,
            ),
            (
                "loadbalancerset_replicas_ready",
                "Ready replicas for LoadBalancerSet (from lbs.status.readyReplicas)",
                &self.lbs_replicas_ready,
            ),
            (
                "loadbalancerset_deletion_timestamp",
                "Deletion timestamp of a LoadBalancerSet in seconds since epoch (only for sets in deletion)",
                &self.lbs_deletion_timestamp,
            ),
        ];
        for (name, help, family) in families {
            registry.register(name, help, family.clone());
        }
    }

    /// Writes every series of a LoadBalancer from the object (status as the controller last wrote it).
    pub fn observe_loadbalancer(&self, lb: &LoadBalancer) {
        let ns = lb.namespace().unwrap_or_default();
        let name = lb.name_any();
        let id = labels(&[("lb", &name), ("namespace", &ns)]);
        let opts = lb.spec.options();
        let status = lb.status.clone().unwrap_or_default();
        let duration =
            |d: &Option<lb_api::GoDuration>| d.as_ref().map(|d| d.to_string()).unwrap_or_default();
        let info = labels(&[
            ("lb", &name),
            ("namespace", &ns),
            ("isInternal", &opts.is_internal().to_string()),
            ("tcpProxyProtocol", &opts.tcp_proxy_protocol().to_string()),
            ("externalIP", status.external_ip.as_deref().unwrap_or("")),
            ("tcpIdleTimeout", &duration(&opts.tcp_idle_timeout)),
            ("udpIdleTimeout", &duration(&opts.udp_idle_timeout)),
            (
                "lokiEnabled",
                &opts
                    .log_forward
                    .as_ref()
                    .is_some_and(|l| l.enabled)
                    .to_string(),
            ),
        ]);
        let openstack = labels(&[
            ("lb", &name),
            ("namespace", &ns),
            ("portID", status.port_id.as_deref().unwrap_or("")),
            ("floatingID", status.floating_id.as_deref().unwrap_or("")),
            (
                "securityGroupID",
                status.security_group_id.as_deref().unwrap_or(""),
            ),
            (
                "flavorID",
                lb.spec.infrastructure.flavor.effective_id().unwrap_or(""),
            ),
        ]);
        {
            let mut known = self.info.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((old_info, old_os)) = known.insert(
                (ns.clone(), name.clone()),
                (info.clone(), openstack.clone()),
            ) {
                if old_info != info {
                    self.lb_info.remove(&old_info);
                }
                if old_os != openstack {
                    self.lb_openstack_info.remove(&old_os);
                }
            }
        }
        self.lb_info.get_or_create(&info).set(1);
        self.lb_openstack_info.get_or_create(&openstack).set(1);
        let deleting = deletion_seconds(&lb.metadata);
        let desired = if deleting.is_some() {
            0
        } else {
            lb.spec.replicas
        };
        self.lb_replicas.get_or_create(&id).set(i64::from(desired));
        self.lb_replicas_current
            .get_or_create(&id)
            .set(i64::from(status.replicas.unwrap_or(0)));
        self.lb_replicas_ready
            .get_or_create(&id)
            .set(i64::from(status.ready_replicas.unwrap_or(0)));
        match deleting {
            Some(t) => {
                self.lb_deletion_timestamp.get_or_create(&id).set(t);
            }
            None => {
                self.lb_deletion_timestamp.remove(&id);
            }
        }
    }

    /// Removes every series of a LoadBalancer (it is gone).
    pub fn forget_loadbalancer(&self, namespace: &str, name: &str) {
        let id = labels(&[("lb", name), ("namespace", namespace)]);
        if let Some((info, openstack)) = self
            .info
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(namespace.to_string(), name.to_string()))
        {
            self.lb_info.remove(&info);
            self.lb_openstack_info.remove(&openstack);
        }
        for family in [
            &self.lb_replicas,
            &self.lb_replicas_current,
            &self.lb_replicas_ready,
            &self.lb_deletion_timestamp,
        ] {
            family.remove(&id);
        }
    }

    fn set_id(set: &LoadBalancerSet) -> ObjectLabels {
        labels(&[
            ("lb", &set.spec.template.spec.load_balancer_ref.name),
            ("lbs", &set.name_any()),
            ("namespace", &set.namespace().unwrap_or_default()),
        ])
    }

    /// Writes every series of a LoadBalancerSet from the object.
    pub fn observe_set(&self, set: &LoadBalancerSet) {
        let id = Self::set_id(set);
        self.sets.lock().unwrap_or_else(|e| e.into_inner()).insert(
            (set.namespace().unwrap_or_default(), set.name_any()),
            id.clone(),
        );
        let status = set.status.clone().unwrap_or_default();
        let deleting = deletion_seconds(&set.metadata);
        let desired = if deleting.is_some() {
            0
        } else {
            set.spec.replicas
        };
        self.lbs_replicas.get_or_create(&id).set(i64::from(desired));
        self.lbs_replicas_current
            .get_or_create(&id)
            .set(i64::from(status.replicas.unwrap_or(0)));
        self.lbs_replicas_ready
            .get_or_create(&id)
            .set(i64::from(status.ready_replicas.unwrap_or(0)));
        match deleting {
            Some(t) => {
                self.lbs_deletion_timestamp.get_or_create(&id).set(t);
            }
            None => {
                self.lbs_deletion_timestamp.remove(&id);
            }
        }
    }

    /// Removes every series of a LoadBalancerSet (it is gone).
    pub fn forget_set(&self, set: &LoadBalancerSet) {
        self.sets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(set.namespace().unwrap_or_default(), set.name_any()));
        self.remove_set_series(&Self::set_id(set));
    }

    /// Removes the series of the LoadBalancers for which `keep(namespace, name)` is false (a safety net for objects
    /// that vanished without the controller seeing their deletion).
    pub fn retain_loadbalancers(&self, keep: impl Fn(&str, &str) -> bool) {
        let gone: Vec<(String, String)> = self
            .info
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .filter(|(ns, name)| !keep(ns, name))
            .cloned()
            .collect();
        for (ns, name) in gone {
            self.forget_loadbalancer(&ns, &name);
        }
    }

    /// Removes the series of the sets for which `keep(namespace, name)` is false.
    pub fn retain_sets(&self, keep: impl Fn(&str, &str) -> bool) {
        let gone: Vec<ObjectLabels> = {
            let mut sets = self.sets.lock().unwrap_or_else(|e| e.into_inner());
            let keys: Vec<(String, String)> = sets
                .keys()
                .filter(|(ns, name)| !keep(ns, name))
                .cloned()
                .collect();
            keys.iter().filter_map(|k| sets.remove(k)).collect()
        };
        for id in gone {
            self.remove_set_series(&id);
        }
    }

    fn remove_set_series(&self, id: &ObjectLabels) {
        for family in [
            &self.lbs_replicas,
            &self.lbs_replicas_current,
            &self.lbs_replicas_ready,
            &self.lbs_deletion_timestamp,
        ] {
            family.remove(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `yawol_openstack` is exposed under yawol's sample name and labels (yawol serves
    /// `yawol_openstack{api="neutron",object="port",operation="list"} 3`), unprefixed and without `_total`;
    /// our own counters keep OpenMetrics' `_total`.
    #[test]
    fn yawol_openstack_has_yawols_name_and_labels() {
        let m = Metrics::new();
        for _ in 0..3 {
            m.openstack_calls.inc("neutron", "port", "list");
        }
        m.openstack_calls.inc("nova", "server", "create");
        m.loadbalancer_write("create");
        let text = m.encode();
        let lines: Vec<&str> = text.lines().collect();
        for want in [
            // yawol's help text; prometheus-client appends the period to every registered help.
            "# HELP yawol_openstack Openstack usage counter by api, object, operation.",
            "# TYPE yawol_openstack unknown",
            r#"yawol_openstack{api="neutron",object="port",operation="list"} 3"#,
            r#"yawol_openstack{api="nova",object="server",operation="create"} 1"#,
            r#"lb_cloud_controller_loadbalancer_writes_total{operation="create"} 1"#,
        ] {
            assert!(lines.contains(&want), "{want:?} missing in\n{text}");
        }
        assert!(!text.contains("yawol_openstack_total"), "{text}");
        assert_eq!(m.openstack_calls.total(), 4);
    }

    /// Like a client_golang vector, the family shows nothing before its first call.
    #[test]
    fn yawol_openstack_is_absent_until_counted() {
        assert!(!Metrics::new().encode().contains("yawol_openstack"));
    }
}
