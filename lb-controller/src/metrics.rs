//! Prometheus metrics of the cloud controller (prometheus-client, OpenMetrics text at `/metrics`).

use std::sync::atomic::AtomicI64;
use std::time::Duration;

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
    registry: Registry,
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
            registry: root,
        }
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
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }
}
