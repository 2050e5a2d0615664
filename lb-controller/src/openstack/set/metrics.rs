//! yawol's LoadBalancerSet series (seed 001's table), unprefixed under yawol's names so existing dashboards work:
//! `loadbalancerset_replicas`, `loadbalancerset_replicas_current`, `loadbalancerset_replicas_ready`,
//! `loadbalancerset_deletion_timestamp`. Registered with the process's registry ([`crate::metrics::Metrics::sets`]),
//! so `/metrics` lists them on either side.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kube::ResourceExt;
use lb_api::LoadBalancerSet;
use prometheus_client::registry::Registry;

use crate::metrics::{labels, Gauges, ObjectLabels, ReplicaGauges};

/// The LoadBalancerSet gauges. Every series of a set is removed when it goes away ([`Self::forget`]).
#[derive(Clone, Default)]
pub struct SetMetrics {
    replicas: ReplicaGauges,
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
                &self.replicas.replicas,
            ),
            (
                "loadbalancerset_replicas_current",
                "Current replicas for LoadBalancerSet (from lbs.status.replicas)",
                &self.replicas.current,
            ),
            (
                "loadbalancerset_replicas_ready",
                "Ready replicas for LoadBalancerSet (from lbs.status.readyReplicas)",
                &self.replicas.ready,
            ),
            (
                "loadbalancerset_deletion_timestamp",
                "Deletion timestamp of a LoadBalancerSet in seconds since epoch (only for sets in deletion)",
                &self.replicas.deletion_timestamp,
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
        self.replicas.observe(
            &id,
            &set.metadata,
            set.spec.replicas,
            status.replicas,
            status.ready_replicas,
        );
    }

    /// Removes every series of a LoadBalancerSet (it is gone).
    pub fn forget(&self, set: &LoadBalancerSet) {
        self.written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(set.namespace().unwrap_or_default(), set.name_any()));
        self.replicas.remove(&Self::id(set));
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
            self.replicas.remove(&id);
        }
    }
}
