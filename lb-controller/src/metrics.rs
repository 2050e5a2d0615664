//! Prometheus metrics of the cloud controller and the OpenStack-side controllers (prometheus-client, OpenMetrics
//! text at `/metrics`): the process's registry and the `lb_cloud_controller_*` series. yawol's object series keep
//! yawol's unprefixed names so existing dashboards work and live in their controller's room
//! ([`crate::openstack::loadbalancer::metrics`], [`crate::openstack::set::metrics`] — registered here, so both sides
//! list them — and [`crate::openstack::machine::metrics`], registered by that controller), as does `yawol_openstack`
//! ([`crate::openstack::OpenStackCalls`]); everything of our own is prefixed `lb_cloud_controller_`. `yawol_openstack` is typed `unknown` so its samples keep yawol's name, without the
//! `_total` OpenMetrics appends to counters ([`crate::openstack::CallCounter`]).

use std::sync::atomic::AtomicI64;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::openstack::loadbalancer::metrics::LoadBalancerMetrics;
use crate::openstack::set::metrics::SetMetrics;
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
    /// Services rejected by validation or for their IP families (each distinct problem counted once).
    pub invalid_services: Counter,
    /// Annotation values that were ignored or are not honoured, e.g. PROXY protocol, and served Services' IP-family
    /// problems (IPv6 not served, no node with IPv4) (each distinct problem counted once).
    pub annotation_warnings: Counter,
    /// Events re-emitted from LoadBalancers onto Services.
    pub events_forwarded: Counter,
    /// External IPs written to Service status.
    pub ingress_updates: Counter,
    /// 1 while this instance holds the leader lease.
    pub leader: Gauge<i64, AtomicI64>,
    /// `yawol_openstack{api,object,operation}` (unprefixed, as in yawol): pass it to the OpenStack sessions.
    pub openstack_calls: OpenStackCalls,
    /// yawol's `loadbalancer_*` series (unprefixed, as in yawol).
    pub loadbalancers: LoadBalancerMetrics,
    /// yawol's `loadbalancerset_*` series (unprefixed, as in yawol).
    pub sets: SetMetrics,
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
        let loadbalancers = LoadBalancerMetrics::default();
        loadbalancers.register(&mut root);
        let sets = SetMetrics::default();
        sets.register(&mut root);
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
            "Services rejected by validation or for their IP families",
            invalid_services.clone(),
        );
        registry.register(
            "annotation_warnings",
            "Service annotation values ignored or not honoured, IP families not fully served",
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
            loadbalancers,
            sets,
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

/// Label set of yawol's object series: yawol's label names (some camelCase, which the derive macro cannot spell), so
/// a `Vec` of pairs. The LoadBalancer, set and machine series use it.
pub type ObjectLabels = Vec<(String, String)>;

/// A family of integer gauges over [`ObjectLabels`].
pub(crate) type Gauges = Family<ObjectLabels, Gauge<i64, AtomicI64>>;

/// The label value of an optional field as yawol writes it: `nil` when unset (dashboards and alerts match on it).
pub(crate) fn or_nil(v: Option<&str>) -> &str {
    v.unwrap_or("nil")
}

/// An [`ObjectLabels`] from borrowed pairs.
pub(crate) fn labels(pairs: &[(&str, &str)]) -> ObjectLabels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// yawol's four replica gauges of one object kind (`<kind>_replicas`, `_replicas_current`, `_replicas_ready`,
/// `_deletion_timestamp`), one series per object; each kind registers them under its names.
#[derive(Clone, Default)]
pub(crate) struct ReplicaGauges {
    /// `spec.replicas`, 0 while the object is being deleted.
    pub replicas: Gauges,
    /// `status.replicas`.
    pub current: Gauges,
    /// `status.readyReplicas`.
    pub ready: Gauges,
    /// The deletion timestamp in seconds since the epoch, only while the object is being deleted.
    pub deletion_timestamp: Gauges,
}

impl ReplicaGauges {
    /// Writes the object's series `id`.
    pub fn observe(
        &self,
        id: &ObjectLabels,
        meta: &ObjectMeta,
        spec_replicas: i32,
        current: Option<i32>,
        ready: Option<i32>,
    ) {
        let deleting = meta.deletion_timestamp.as_ref().map(|t| t.0.as_second());
        let desired = if deleting.is_some() { 0 } else { spec_replicas };
        self.replicas.get_or_create(id).set(i64::from(desired));
        self.current
            .get_or_create(id)
            .set(i64::from(current.unwrap_or(0)));
        self.ready
            .get_or_create(id)
            .set(i64::from(ready.unwrap_or(0)));
        match deleting {
            Some(t) => {
                self.deletion_timestamp.get_or_create(id).set(t);
            }
            None => {
                self.deletion_timestamp.remove(id);
            }
        }
    }

    /// Removes the object's series `id`.
    pub fn remove(&self, id: &ObjectLabels) {
        for family in [
            &self.replicas,
            &self.current,
            &self.ready,
            &self.deletion_timestamp,
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
