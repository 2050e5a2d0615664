//! yawol's LoadBalancerSet series (seed 001's table), unprefixed under yawol's names so existing dashboards work:
//! `loadbalancerset_replicas`, `loadbalancerset_replicas_current`, `loadbalancerset_replicas_ready`,
//! `loadbalancerset_deletion_timestamp`. Registered with the process's registry ([`crate::metrics::Metrics::sets`]),
//! so `/metrics` lists them on either side.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kube::ResourceExt;
use lb_api::LoadBalancerSet;
use prometheus_client::registry::Registry;

use crate::metrics::{deletion_seconds, labels, Gauges, ObjectLabels};

/// The LoadBalancerSet gauges. Every series of a set is removed when it goes away ([`Self::forget`]).
#[derive(Clone, Default)]
pub struct SetMetrics {
    replicas: Gauges,
    replicas_current: Gauges,
    replicas_ready: Gauges,
    deletion_timestamp: Gauges,
    /// The sets with series, (namespace, name) → their label set.
    written: Arc<Mutex<HashMap<(String, String), ObjectLabels>>>,
}

impl SetMetrics {
    /// Registers the families under yawol's names.
    pub fn register(&self, registry: &mut Registry) {
        let families: [(&str, &str, &Gauges); 4] = [
            (
                "loadbalancerset_replicas",
                "Replicas for LoadBalancerSet (from lbs.spec.replicas, 0 if marked for deletion)",
                &self.replicas,
            ),
            (
                "loadbalancerset_replicas_current",
                "Current replicas for LoadBalancerSet (from lbs.status.replicas)",
                &self.replicas_current,
            ),
            (
                "loadbalancerset_replicas_ready",
                "Ready replicas for LoadBalancerSet (from lbs.status.readyReplicas)",
                &self.replicas_ready,
            ),
            (
                "loadbalancerset_deletion_timestamp",
                "Deletion timestamp of a LoadBalancerSet in seconds since epoch (only for sets in deletion)",
                &self.deletion_timestamp,
            ),
        ];
        for (name, help, family) in families {
            registry.register(name, help, family.clone());
        }
    }

    fn id(set: &LoadBalancerSet) -> ObjectLabels {
        labels(&[
            ("lb", &set.spec.template.spec.load_balancer_ref.name),
            ("lbs", &set.name_any()),
            ("namespace", &set.namespace().unwrap_or_default()),
        ])
    }

    /// Writes every series of a LoadBalancerSet from the object.
    pub fn observe(&self, set: &LoadBalancerSet) {
        let id = Self::id(set);
        self.written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
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
        self.replicas.get_or_create(&id).set(i64::from(desired));
        self.replicas_current
            .get_or_create(&id)
            .set(i64::from(status.replicas.unwrap_or(0)));
        self.replicas_ready
            .get_or_create(&id)
            .set(i64::from(status.ready_replicas.unwrap_or(0)));
        match deleting {
            Some(t) => {
                self.deletion_timestamp.get_or_create(&id).set(t);
            }
            None => {
                self.deletion_timestamp.remove(&id);
            }
        }
    }

    /// Removes every series of a LoadBalancerSet (it is gone).
    pub fn forget(&self, set: &LoadBalancerSet) {
        self.written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(set.namespace().unwrap_or_default(), set.name_any()));
        self.remove_series(&Self::id(set));
    }

    /// Removes the series of the sets for which `keep(namespace, name)` is false.
    pub fn retain(&self, keep: impl Fn(&str, &str) -> bool) {
        let gone: Vec<ObjectLabels> = {
            let mut sets = self.written.lock().unwrap_or_else(|e| e.into_inner());
            let keys: Vec<(String, String)> = sets
                .keys()
                .filter(|(ns, name)| !keep(ns, name))
                .cloned()
                .collect();
            keys.iter().filter_map(|k| sets.remove(k)).collect()
        };
        for id in gone {
            self.remove_series(&id);
        }
    }

    fn remove_series(&self, id: &ObjectLabels) {
        for family in [
            &self.replicas,
            &self.replicas_current,
            &self.replicas_ready,
            &self.deletion_timestamp,
        ] {
            family.remove(id);
        }
    }
}
