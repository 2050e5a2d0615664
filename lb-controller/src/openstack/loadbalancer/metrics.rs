//! yawol's LoadBalancer series (seed 001's table), unprefixed under yawol's names so existing dashboards work:
//! `loadbalancer_info`, `loadbalancer_openstack_info`, `loadbalancer_replicas`, `loadbalancer_replicas_current`,
//! `loadbalancer_replicas_ready`, `loadbalancer_deletion_timestamp`. Registered with the process's registry
//! ([`crate::metrics::Metrics::loadbalancers`]), so `/metrics` lists them on either side.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kube::ResourceExt;
use lb_api::LoadBalancer;
use prometheus_client::registry::Registry;

use crate::metrics::{labels, or_nil, Gauges, ObjectLabels, ReplicaGauges};

/// The label sets of `loadbalancer_info` and `loadbalancer_openstack_info` of one LoadBalancer.
type InfoLabels = (ObjectLabels, ObjectLabels);

/// The LoadBalancer gauges. Every series of a LoadBalancer is removed when it goes away ([`Self::forget`]); an info
/// series whose labels change (a new external IP) replaces the old one instead of adding a second.
#[derive(Clone, Default)]
pub struct LoadBalancerMetrics {
    info: Gauges,
    openstack_info: Gauges,
    replicas: ReplicaGauges,
    /// The info label sets last written per LoadBalancer (namespace, name), to remove them when they change.
    written: Arc<Mutex<HashMap<(String, String), InfoLabels>>>,
}

impl LoadBalancerMetrics {
    /// Registers the families under yawol's names.
    pub fn register(&self, registry: &mut Registry) {
        let families: [(&str, &str, &Gauges); 6] = [
            (
                "loadbalancer_info",
                "Loadbalancer Info for LoadBalancer contains labels like isInternal, externalIP, tcpProxyProtocol, \
                 tcpIdleTimeout, udpIdleTimeout, lokiEnabled",
                &self.info,
            ),
            (
                "loadbalancer_openstack_info",
                "Openstack Info contains labels with the OpenStackIDs for LoadBalancer",
                &self.openstack_info,
            ),
            (
                "loadbalancer_replicas",
                "Replicas for LoadBalancer (from lb.spec.replicas, 0 if marked for deletion)",
                &self.replicas.replicas,
            ),
            (
                "loadbalancer_replicas_current",
                "Current replicas for LoadBalancer (from lb.status.replicas)",
                &self.replicas.current,
            ),
            (
                "loadbalancer_replicas_ready",
                "Ready replicas for LoadBalancer (from lb.status.readyReplicas)",
                &self.replicas.ready,
            ),
            (
                "loadbalancer_deletion_timestamp",
                "Deletion timestamp of a LoadBalancer in seconds since epoch (only for LoadBalancers in deletion)",
                &self.replicas.deletion_timestamp,
            ),
        ];
        for (name, help, family) in families {
            registry.register(name, help, family.clone());
        }
    }

    /// Writes every series of a LoadBalancer from the object (status as the controller last wrote it).
    pub fn observe(&self, lb: &LoadBalancer) {
        let ns = lb.namespace().unwrap_or_default();
        let name = lb.name_any();
        let id = labels(&[("lb", &name), ("namespace", &ns)]);
        let opts = lb.spec.options();
        let status = lb.status.clone().unwrap_or_default();
        let duration = |d: &Option<lb_api::GoDuration>| {
            d.as_ref()
                .map_or_else(|| or_nil(None).to_string(), |d| d.to_string())
        };
        let info = labels(&[
            ("lb", &name),
            ("namespace", &ns),
            ("isInternal", &opts.is_internal().to_string()),
            ("tcpProxyProtocol", &opts.tcp_proxy_protocol().to_string()),
            ("externalIP", or_nil(status.external_ip.as_deref())),
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
            ("portID", or_nil(status.port_id.as_deref())),
            ("floatingID", or_nil(status.floating_id.as_deref())),
            (
                "securityGroupID",
                or_nil(status.security_group_id.as_deref()),
            ),
            (
                "flavorID",
                or_nil(lb.spec.infrastructure.flavor.effective_id()),
            ),
        ]);
        {
            let mut known = self.written.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((old_info, old_os)) = known.insert(
                (ns.clone(), name.clone()),
                (info.clone(), openstack.clone()),
            ) {
                if old_info != info {
                    self.info.remove(&old_info);
                }
                if old_os != openstack {
                    self.openstack_info.remove(&old_os);
                }
            }
        }
        self.info.get_or_create(&info).set(1);
        self.openstack_info.get_or_create(&openstack).set(1);
        self.replicas.observe(
            &id,
            &lb.metadata,
            lb.spec.replicas,
            status.replicas,
            status.ready_replicas,
        );
    }

    /// Removes every series of a LoadBalancer (it is gone).
    pub fn forget(&self, namespace: &str, name: &str) {
        let id = labels(&[("lb", name), ("namespace", namespace)]);
        if let Some((info, openstack)) = self
            .written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(namespace.to_string(), name.to_string()))
        {
            self.info.remove(&info);
            self.openstack_info.remove(&openstack);
        }
        self.replicas.remove(&id);
    }

    /// Removes the series of the LoadBalancers for which `keep(namespace, name)` is false (a safety net for objects
    /// that vanished without the controller seeing their deletion).
    pub fn retain(&self, keep: impl Fn(&str, &str) -> bool) {
        let gone: Vec<(String, String)> = self
            .written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .filter(|(ns, name)| !keep(ns, name))
            .cloned()
            .collect();
        for (ns, name) in gone {
            self.forget(&ns, &name);
        }
    }
}
