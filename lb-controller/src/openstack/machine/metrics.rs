//! Prometheus metrics of the LoadBalancerMachine controller, with yawol's names and labels (seed 001):
//!
//! | metric | labels | value |
//! |---|---|---|
//! | `loadbalancermachine` | type, lb, lbm, namespace | every numeric `status.metrics` entry |
//! | `loadbalancermachine_condition` | lb, lbm, namespace, condition, reason, status | 1 per `status.conditions` entry |
//! | `loadbalancermachine_openstack_info` | lb, lbm, namespace, portID, serverID, flavorID, imageID | 1 |
//! | `loadbalancermachine_deletion_timestamp` | lb, lbm, namespace | deletion timestamp (s since epoch), only while deleting |
//! | `loadbalancermachine_openstack_errors_total` | step, kind | failed OpenStack steps of the machine controller |
//!
//! The per-machine series are replaced as a whole on every update ([`MachineMetrics::update`]), so a metric or condition
//! the agent stops reporting disappears, and all of them go when the machine goes ([`MachineMetrics::remove`],
//! [`MachineMetrics::retain`]). The families are registered on the binary's registry with [`MachineMetrics::register`].

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use kube::ResourceExt;
use lb_api::LoadBalancerMachine;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::{labels as l, or_nil, ObjectLabels};

/// A label set in yawol's label names.
pub type Labels = ObjectLabels;

type FloatGauge = Gauge<f64, AtomicU64>;

/// The series one machine should have right now.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MachineSeries {
    /// `loadbalancermachine`: labels and value per numeric agent metric.
    pub metrics: Vec<(Labels, f64)>,
    /// `loadbalancermachine_condition`: one label set per condition (value 1).
    pub conditions: Vec<Labels>,
    /// `loadbalancermachine_openstack_info` (value 1).
    pub openstack_info: Labels,
    /// `loadbalancermachine_deletion_timestamp`, only while deleting.
    pub deletion_timestamp: Option<(Labels, f64)>,
}

/// The series of `lbm` (pure; unit-tested). Non-numeric agent metrics are skipped like in yawol.
pub fn machine_series(lbm: &LoadBalancerMachine) -> MachineSeries {
    let ns = lbm.namespace().unwrap_or_default();
    let name = lbm.name_any();
    let lb = lbm.spec.load_balancer_ref.name.as_str();
    let base = [
        ("lb", lb),
        ("lbm", name.as_str()),
        ("namespace", ns.as_str()),
    ];
    let status = lbm.status.clone().unwrap_or_default();
    let metrics = status
        .metrics
        .iter()
        .flatten()
        .filter_map(|m| {
            let value = m.value.trim().parse::<f64>().ok()?;
            let mut labels = l(&[("type", m.type_.as_str())]);
            labels.extend(l(&base));
            Some((labels, value))
        })
        .collect();
    let conditions = status
        .conditions
        .iter()
        .flatten()
        .map(|c| {
            let mut labels = l(&base);
            labels.extend(l(&[
                ("condition", c.type_.as_str()),
                ("reason", c.reason.as_deref().unwrap_or("")),
                ("status", c.status.as_str()),
            ]));
            labels
        })
        .collect();
    let infra = &lbm.spec.infrastructure;
    let mut openstack_info = l(&base);
    openstack_info.extend(l(&[
        ("portID", or_nil(status.default_port_id.as_deref())),
        ("serverID", or_nil(status.server_id.as_deref())),
        ("flavorID", or_nil(infra.flavor.effective_id())),
        ("imageID", or_nil(infra.image.effective_id())),
    ]));
    let deletion_timestamp = lbm
        .metadata
        .deletion_timestamp
        .as_ref()
        .map(|t| (l(&base), t.0.as_second() as f64));
    MachineSeries {
        metrics,
        conditions,
        openstack_info,
        deletion_timestamp,
    }
}

/// Label sets currently exported for one machine, so they can be removed.
#[derive(Default)]
struct Exported {
    metrics: Vec<Labels>,
    conditions: Vec<Labels>,
    openstack_info: Vec<Labels>,
    deletion_timestamp: Vec<Labels>,
}

/// The LoadBalancerMachine controller's metric families. Cheap to share behind an `Arc`.
#[derive(Default)]
pub struct MachineMetrics {
    /// `loadbalancermachine`.
    pub machine: Family<Labels, FloatGauge>,
    /// `loadbalancermachine_condition`.
    pub condition: Family<Labels, Gauge>,
    /// `loadbalancermachine_openstack_info`.
    pub openstack_info: Family<Labels, Gauge>,
    /// `loadbalancermachine_deletion_timestamp`.
    pub deletion_timestamp: Family<Labels, FloatGauge>,
    /// `loadbalancermachine_openstack_errors_total{step,kind}`.
    pub openstack_errors: Family<Labels, Counter>,
    exported: Mutex<HashMap<(String, String), Exported>>,
}

/// Sets `new` in `family` and removes the label sets of `old` that are not in `new`.
fn replace<M: Default + Clone, V>(
    family: &Family<Labels, M>,
    old: &mut Vec<Labels>,
    new: Vec<(Labels, V)>,
    set: impl Fn(&M, V),
) {
    let keep: Vec<Labels> = new.iter().map(|(k, _)| k.clone()).collect();
    for stale in old.iter().filter(|o| !keep.contains(o)) {
        family.remove(stale);
    }
    for (labels, value) in new {
        set(&family.get_or_create(&labels), value);
    }
    *old = keep;
}

fn set_float(g: &FloatGauge, v: f64) {
    g.set(v);
}

fn set_int(g: &Gauge, v: i64) {
    g.set(v);
}

impl MachineMetrics {
    /// Registers the families (unprefixed, yawol's names).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "loadbalancermachine",
            "Metrics of loadbalancermachine (all metrics from lbm.status.metrics)",
            self.machine.clone(),
        );
        registry.register(
            "loadbalancermachine_condition",
            "Conditions of loadbalancermachine (lbm.status.conditions)",
            self.condition.clone(),
        );
        registry.register(
            "loadbalancermachine_openstack_info",
            "Openstack Info contains labels with the OpenStackIDs for LoadBalancerMachine",
            self.openstack_info.clone(),
        );
        registry.register(
            "loadbalancermachine_deletion_timestamp",
            "Deletion timestamp of a LoadBalancerMachine in seconds since epoch (only present while deleting)",
            self.deletion_timestamp.clone(),
        );
        registry.register(
            "loadbalancermachine_openstack_errors",
            "Failed OpenStack steps of the LoadBalancerMachine controller by step and error kind",
            self.openstack_errors.clone(),
        );
    }

    /// Replaces the series of `lbm` with what its object says now.
    pub fn update(&self, lbm: &LoadBalancerMachine) {
        let series = machine_series(lbm);
        let key = (lbm.namespace().unwrap_or_default(), lbm.name_any());
        let mut exported = self.exported.lock().unwrap();
        let e = exported.entry(key).or_default();
        replace(&self.machine, &mut e.metrics, series.metrics, set_float);
        let ones = |v: Vec<Labels>| v.into_iter().map(|k| (k, 1)).collect::<Vec<_>>();
        replace(
            &self.condition,
            &mut e.conditions,
            ones(series.conditions),
            set_int,
        );
        replace(
            &self.openstack_info,
            &mut e.openstack_info,
            ones(vec![series.openstack_info]),
            set_int,
        );
        replace(
            &self.deletion_timestamp,
            &mut e.deletion_timestamp,
            series.deletion_timestamp.into_iter().collect(),
            set_float,
        );
    }

    /// Removes every series of the machine `namespace/name`.
    pub fn remove(&self, namespace: &str, name: &str) {
        let removed = self
            .exported
            .lock()
            .unwrap()
            .remove(&(namespace.to_string(), name.to_string()));
        if let Some(e) = removed {
            self.drop_series(e);
        }
    }

    /// Removes the series of every machine for which `keep(namespace, name)` is false (machines that vanished
    /// without the controller seeing their deletion, e.g. a finalizer removed by hand).
    pub fn retain(&self, keep: impl Fn(&str, &str) -> bool) {
        let gone: Vec<Exported> = {
            let mut exported = self.exported.lock().unwrap();
            let keys: Vec<(String, String)> = exported
                .keys()
                .filter(|(ns, name)| !keep(ns, name))
                .cloned()
                .collect();
            keys.iter().filter_map(|k| exported.remove(k)).collect()
        };
        for e in gone {
            self.drop_series(e);
        }
    }

    fn drop_series(&self, e: Exported) {
        for k in &e.metrics {
            self.machine.remove(k);
        }
        for k in &e.conditions {
            self.condition.remove(k);
        }
        for k in &e.openstack_info {
            self.openstack_info.remove(k);
        }
        for k in &e.deletion_timestamp {
            self.deletion_timestamp.remove(k);
        }
    }

    /// Counts a failed OpenStack step.
    pub fn openstack_error(&self, step: &str, kind: &str) {
        self.openstack_errors
            .get_or_create(&l(&[("step", step), ("kind", kind)]))
            .inc();
    }

    /// The families alone in OpenMetrics text (tests; the binary serves them through its own registry).
    pub fn encode(&self) -> String {
        let mut registry = Registry::default();
        self.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry)
            .expect("writing to a String cannot fail");
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lbm(metrics: serde_json::Value, deleting: bool) -> LoadBalancerMachine {
        let mut v = json!({
            "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerMachine",
            "metadata": {"name": "web-abc-x1", "namespace": "yawol"},
            "spec": {
                "infrastructure": {
                    "defaultNetwork": {"networkID": "net"}, "flavor": {"flavorID": "f1"},
                    "image": {"imageID": "i1"}, "authSecretRef": {"name": "cloud"}
                },
                "portID": "vip", "loadBalancerRef": {"name": "web", "namespace": "yawol"}
            },
            "status": {
                "serverID": "srv-1", "defaultPortID": "port-1",
                "metrics": metrics,
                "conditions": [{"type": "ConfigReady", "status": "True", "reason": "Applied",
                                "lastHeartbeatTime": "2026-01-01T00:00:00Z"}]
            }
        });
        if deleting {
            v["metadata"]["deletionTimestamp"] = json!("2026-01-02T00:00:00Z");
        }
        serde_json::from_value(v).unwrap()
    }

    fn m(t: &str, v: &str) -> serde_json::Value {
        json!({"type": t, "value": v, "timestamp": "2026-01-01T00:00:00Z"})
    }

    #[test]
    fn series_from_the_object() {
        let s = machine_series(&lbm(
            json!([
                m("load1", "0.25"),
                m("TCP-80-upstream_cx_active", "7"),
                m("bad", "n/a")
            ]),
            false,
        ));
        assert_eq!(s.metrics.len(), 2, "non-numeric skipped");
        assert_eq!(s.metrics[0].1, 0.25);
        assert_eq!(s.metrics[0].0[0], ("type".to_string(), "load1".to_string()));
        assert_eq!(s.conditions.len(), 1);
        assert!(s.conditions[0].contains(&("reason".into(), "Applied".into())));
        for (k, v) in [
            ("portID", "port-1"),
            ("serverID", "srv-1"),
            ("flavorID", "f1"),
            ("imageID", "i1"),
        ] {
            assert!(s.openstack_info.contains(&(k.into(), v.into())), "{k}");
        }
        assert!(s.deletion_timestamp.is_none());
        // A machine without a server or port yet: yawol writes `nil` for what is unset.
        let mut fresh = lbm(json!([]), false);
        fresh.status = None;
        let f = machine_series(&fresh);
        for k in ["portID", "serverID"] {
            assert!(f.openstack_info.contains(&(k.into(), "nil".into())), "{k}");
        }
        let d = machine_series(&lbm(json!([]), true));
        assert_eq!(d.deletion_timestamp.unwrap().1, 1767312000.0);
    }

    #[test]
    fn series_follow_the_object_and_go_with_it() {
        let metrics = MachineMetrics::default();
        metrics.update(&lbm(json!([m("load1", "1.5"), m("memFree", "100")]), false));
        let text = metrics.encode();
        assert!(
            text.contains(r#"loadbalancermachine{type="load1",lb="web",lbm="web-abc-x1",namespace="yawol"} 1.5"#),
            "{text}"
        );
        assert!(text.contains(r#"loadbalancermachine_condition{lb="web",lbm="web-abc-x1",namespace="yawol",condition="ConfigReady",reason="Applied",status="True"} 1"#), "{text}");
        assert!(
            text.contains(r#"portID="port-1",serverID="srv-1",flavorID="f1",imageID="i1"} 1"#),
            "{text}"
        );
        assert!(
            !text.contains("loadbalancermachine_deletion_timestamp{"),
            "{text}"
        );
        // A metric the agent stops reporting disappears; deletion adds the timestamp.
        metrics.update(&lbm(json!([m("load1", "2")]), true));
        let text = metrics.encode();
        assert!(!text.contains("memFree"), "{text}");
        assert!(text.contains(r#"loadbalancermachine_deletion_timestamp{lb="web",lbm="web-abc-x1",namespace="yawol"} 1767312000"#), "{text}");
        metrics.remove("yawol", "web-abc-x1");
        let text = metrics.encode();
        assert!(!text.contains("web-abc-x1"), "{text}");
        // retain drops machines that are not known any more.
        metrics.update(&lbm(json!([m("load1", "2")]), false));
        metrics.retain(|_, name| name != "web-abc-x1");
        assert!(!metrics.encode().contains("web-abc-x1"));
    }

    #[test]
    fn errors_are_counted() {
        let metrics = MachineMetrics::default();
        metrics.openstack_error("server", "Quota");
        metrics.openstack_error("server", "Quota");
        assert!(metrics.encode().contains(
            r#"loadbalancermachine_openstack_errors_total{step="server",kind="Quota"} 2"#
        ));
    }
}
