//! A LoadBalancer's HA settings as its machines get them: the VRRP router id in annotation
//! `loadbalancer.yawol.stackit.cloud/vrrpRouterID` (distinct among the LoadBalancers on one network, chosen by
//! `lb_api::ha::router_id_for`), the shared sync secret in the Secret `<lb>-sync`, and annotation
//! `loadbalancer.yawol.stackit.cloud/syncPeers` with the sorted `status.defaultPortIP`s of the live machines. The
//! LoadBalancer controller writes them (`apply`); the machine controller reads them into the cloud-init.
//! Pure.

use std::collections::BTreeSet;

use kube::ResourceExt;
use lb_api::constants::{lb_annotations, sync};
use lb_api::{LoadBalancer, LoadBalancerMachine};

/// Whether machine `m` serves `lb` (its `spec.loadBalancerRef`).
pub fn machine_of(m: &LoadBalancerMachine, lb: &LoadBalancer) -> bool {
    let r = &m.spec.load_balancer_ref;
    let ns = if r.namespace.is_empty() {
        m.namespace()
    } else {
        Some(r.namespace.clone())
    };
    r.name == lb.name_any() && ns == lb.namespace()
}

/// The sync peers: sorted, distinct `status.defaultPortIP`s of the LoadBalancer's machines that are not being
/// deleted, comma-separated ("" when there are none).
pub fn sync_peers<'a>(
    lb: &LoadBalancer,
    machines: impl IntoIterator<Item = &'a LoadBalancerMachine>,
) -> String {
    let ips: BTreeSet<String> = machines
        .into_iter()
        .filter(|m| machine_of(m, lb) && m.metadata.deletion_timestamp.is_none())
        .filter_map(|m| m.status.as_ref()?.default_port_ip.clone())
        .filter(|ip| !ip.is_empty())
        .collect();
    ips.into_iter().collect::<Vec<_>>().join(",")
}

/// The VRRP router id annotation: `None` when absent, an error text when it is not in 1..=255.
pub fn router_id(lb: &LoadBalancer) -> Result<Option<u8>, String> {
    match lb.annotations().get(lb_annotations::VRRP_ROUTER_ID) {
        None => Ok(None),
        Some(v) => match v.trim().parse::<u8>() {
            Ok(id) if id > 0 => Ok(Some(id)),
            _ => Err(format!(
                "annotation {}={v:?} is not a VRRP router id (1..255); allocating a new one",
                lb_annotations::VRRP_ROUTER_ID
            )),
        },
    }
}

/// Router ids used by the other LoadBalancers on the same network (VRRP ids only need to differ per L2 segment).
pub fn taken_router_ids(lb: &LoadBalancer, all: &[LoadBalancer]) -> BTreeSet<u8> {
    let net = lb.spec.infrastructure.effective_network_id();
    all.iter()
        .filter(|o| !(o.name_any() == lb.name_any() && o.namespace() == lb.namespace()))
        .filter(|o| o.spec.infrastructure.effective_network_id() == net)
        .filter_map(|o| router_id(o).ok().flatten())
        .collect()
}

/// Name of the sync Secret: `<lb>-sync`.
pub fn sync_secret_name(lb: &LoadBalancer) -> String {
    format!("{}{}", lb.name_any(), sync::SECRET_SUFFIX)
}
