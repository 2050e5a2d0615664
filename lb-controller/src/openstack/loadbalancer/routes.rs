//! Active-active on OpenStack, where tenants cannot speak BGP: the router of the VIP's subnet spreads the VIP
//! over the machines by ECMP. Its extra routes for the VIP's /32 name one next hop per eligible machine (its port
//! address; OVN installs several next hops of one destination as ECMP), and this controller keeps them equal to
//! the machines that report `VIPEligible=True` with a fresh heartbeat.
//!
//! Written against [`Cloud`] with Neutron's `add_extraroutes` / `remove_extraroutes` (`extraroute-atomic`): only
//! the VIP's own routes are touched, never the rest of the router's list, so other writers of that router are
//! safe. Adding first, removing after: a replaced next hop never leaves the VIP without a route.
//!
//! The last next hop is never taken away for a stale heartbeat: when no machine is eligible (every agent lost the
//! API server, or all are starting) the routes stay as they were and the condition says so — a route to a
//! machine that may still serve beats none. Deleting the LoadBalancer, or turning active-active off, removes every
//! route of the VIP from every router on its network ([`remove_all`]).
//!
//! Pure parts ([`active_active`], [`eligible_next_hops`], [`condition`]) are unit-tested; the cloud parts run on
//! the fake and against the real test OpenStack (`tests/openstack_cascade.rs`).

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::NodeCondition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use lb_api::constants::{conditions, service_annotations};
use lb_api::{LoadBalancer, LoadBalancerMachine, LoadBalancerStatus};

use super::ha::machine_of;
use crate::openstack::{Cloud, CloudError, CloudResult, Route};

/// How often an active-active machine's agent writes its heartbeat (`--requeue-period`, set by the machine
/// controller): a crashed machine's next hop goes after [`ELIGIBLE_STALE`].
pub const ELIGIBLE_HEARTBEAT: Duration = Duration::from_secs(10);
/// A `VIPEligible=True` older than this (three missed heartbeats) no longer counts.
pub const ELIGIBLE_STALE: Duration = Duration::from_secs(30);

/// Whether `lb`'s machines run active-active: asked for (`spec.options.activeActive`) and IPv4 only — an IPv6 VIP
/// is not routed to the machines yet, so a dual-stack LoadBalancer stays a VRRP pair ([`active_active_problem`]).
pub fn active_active(lb: &LoadBalancer) -> bool {
    asked(lb) && !lb.spec.wants_ipv6()
}

fn asked(lb: &LoadBalancer) -> bool {
    lb.spec
        .options
        .as_ref()
        .is_some_and(|o| o.is_active_active())
}

/// Why active-active is asked for and not used, if it is.
pub fn active_active_problem(lb: &LoadBalancer) -> Option<String> {
    (asked(lb) && lb.spec.wants_ipv6()).then(|| {
        format!(
            "{}: active-active routes IPv4 VIPs only so far; this dual-stack LoadBalancer runs as a VRRP pair",
            service_annotations::ACTIVE_ACTIVE
        )
    })
}

/// The host route of an IPv4 VIP.
pub fn vip_destination(vip: &str) -> String {
    format!("{vip}/32")
}

/// The machines the VIP should be routed to now: `status.defaultPortIP` of the LoadBalancer's machines that are not
/// being deleted and report `VIPEligible=True` with a heartbeat at most [`ELIGIBLE_STALE`] old.
pub fn eligible_next_hops<'a>(
    lb: &LoadBalancer,
    machines: impl IntoIterator<Item = &'a LoadBalancerMachine>,
    now: jiff::Timestamp,
) -> BTreeSet<String> {
    machines
        .into_iter()
        .filter(|m| machine_of(m, lb) && m.metadata.deletion_timestamp.is_none())
        .filter(|m| fresh_vip_eligible(m, now).is_some_and(|c| c.status == conditions::TRUE))
        .filter_map(|m| m.status.as_ref()?.default_port_ip.clone())
        .filter(|ip| !ip.is_empty())
        .collect()
}

/// The machine's `VIPEligible` condition if its heartbeat is at most [`ELIGIBLE_STALE`] old: its active-active
/// agent still reports (whatever it says).
pub fn fresh_vip_eligible(m: &LoadBalancerMachine, now: jiff::Timestamp) -> Option<&NodeCondition> {
    m.status.as_ref()?.conditions.as_ref()?.iter().find(|c| {
        c.type_ == conditions::VIP_ELIGIBLE
            && c.last_heartbeat_time.as_ref().is_some_and(|t| {
                now.duration_since(t.0).as_secs_f64() <= ELIGIBLE_STALE.as_secs_f64()
            })
    })
}

/// The router of the VIP's subnet: the router whose interface on `network_id` has an address on `subnet_id`.
pub async fn find_router<C: Cloud>(
    cloud: &C,
    network_id: &str,
    subnet_id: &str,
) -> CloudResult<Option<String>> {
    Ok(cloud
        .find_router_interfaces(network_id)
        .await?
        .into_iter()
        .find(|p| p.fixed_ips.iter().any(|f| f.subnet_id == subnet_id))
        .map(|p| p.device_id))
}

/// What [`set_next_hops`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RouteChange {
    /// Next hops added.
    pub added: Vec<String>,
    /// Next hops removed.
    pub removed: Vec<String>,
}

/// Makes the routes of `destination` on `router` name exactly `next_hops` (added first, then the others removed);
/// an empty `next_hops` changes nothing (see the module docs). One read, at most one add and one remove.
pub async fn set_next_hops<C: Cloud>(
    cloud: &C,
    router: &str,
    destination: &str,
    next_hops: &BTreeSet<String>,
) -> CloudResult<RouteChange> {
    let mut change = RouteChange::default();
    if next_hops.is_empty() {
        return Ok(change);
    }
    let present: BTreeSet<String> = cloud
        .router_routes(router)
        .await?
        .into_iter()
        .filter(|r| r.destination == destination)
        .map(|r| r.nexthop)
        .collect();
    let route = |nexthop: &String| Route {
        destination: destination.to_string(),
        nexthop: nexthop.clone(),
    };
    change.added = next_hops.difference(&present).cloned().collect();
    change.removed = present.difference(next_hops).cloned().collect();
    if !change.added.is_empty() {
        let add: Vec<Route> = change.added.iter().map(route).collect();
        cloud.add_router_routes(router, &add).await?;
    }
    if !change.removed.is_empty() {
        let remove: Vec<Route> = change.removed.iter().map(route).collect();
        cloud.remove_router_routes(router, &remove).await?;
    }
    Ok(change)
}

/// Removes every route of `destination` from every router on `network_id`; returns how many went. Idempotent.
pub async fn remove_all<C: Cloud>(
    cloud: &C,
    network_id: &str,
    destination: &str,
) -> CloudResult<usize> {
    let routers: BTreeSet<String> = cloud
        .find_router_interfaces(network_id)
        .await?
        .into_iter()
        .map(|p| p.device_id)
        .collect();
    let mut removed = 0;
    for router in routers {
        let ours: Vec<Route> = cloud
            .router_routes(&router)
            .await?
            .into_iter()
            .filter(|r| r.destination == destination)
            .collect();
        if !ours.is_empty() {
            cloud.remove_router_routes(&router, &ours).await?;
            removed += ours.len();
        }
    }
    Ok(removed)
}

/// What the routes step found, for [`condition`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The VIP's routes name `next_hops` on `router` (empty `next_hops`: none eligible, routes left as they were).
    Programmed {
        /// Router ID.
        router: String,
        /// The eligible machines' addresses.
        next_hops: BTreeSet<String>,
    },
    /// No VIP port or address yet (nothing to say: the condition waits).
    NoVip,
    /// The VIP's subnet has no router.
    NoRouter {
        /// The VIP's subnet.
        subnet: String,
    },
    /// OpenStack failed.
    Failed(CloudError),
}

/// The LoadBalancer's `ActiveActive` condition for `outcome` with `replicas` asked for (none while there is no VIP);
/// the transition time survives an unchanged status.
pub fn condition(
    prev: Option<&Condition>,
    outcome: &Outcome,
    vip: &str,
    replicas: i32,
    now: jiff::Timestamp,
) -> Option<Condition> {
    let (status, reason, message) = match outcome {
        Outcome::NoVip => return None,
        Outcome::NoRouter { subnet } => (
            conditions::FALSE,
            conditions::REASON_NO_ROUTER,
            format!(
                "no router has an interface on the VIP's subnet {subnet}: nothing routes {vip} to the machines \
                 (attach the subnet to a router)"
            ),
        ),
        Outcome::Failed(e) => (
            conditions::FALSE,
            conditions::REASON_ROUTES_FAILED,
            format!(
                "changing the routes of {vip} failed: {} ({:?}): {}",
                e.operation, e.kind, e.message
            ),
        ),
        Outcome::Programmed { next_hops, .. } if next_hops.is_empty() => (
            conditions::FALSE,
            conditions::REASON_NO_ELIGIBLE_MACHINE,
            format!(
                "no machine reports {}=True with a heartbeat younger than {}s; the routes of {vip} stay as they were",
                conditions::VIP_ELIGIBLE,
                ELIGIBLE_STALE.as_secs()
            ),
        ),
        Outcome::Programmed { router, next_hops } => {
            let list = next_hops.iter().cloned().collect::<Vec<_>>().join(", ");
            if replicas < 2 {
                (
                    conditions::FALSE,
                    conditions::REASON_TOO_FEW_REPLICAS,
                    format!(
                        "{replicas} replica(s) asked for, active-active wants 2 or more: router {router} routes \
                         {vip} to {list} without a second machine"
                    ),
                )
            } else {
                (
                    conditions::TRUE,
                    conditions::REASON_ROUTES_PROGRAMMED,
                    format!(
                        "router {router} routes {vip} to {} machine(s): {list}",
                        next_hops.len()
                    ),
                )
            }
        }
    };
    let last_transition_time = match prev {
        Some(p) if p.status == status => p.last_transition_time.clone(),
        _ => Time(now),
    };
    Some(Condition {
        type_: conditions::ACTIVE_ACTIVE.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        last_transition_time,
        observed_generation: None,
    })
}

/// The LoadBalancer's `ActiveActive` condition, if it has one.
pub fn current_condition(lb: &LoadBalancer) -> Option<&Condition> {
    lb.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == conditions::ACTIVE_ACTIVE)
}

/// One routes step for an active-active LoadBalancer: finds the router of the VIP's subnet (unless `router` is
/// known) and makes the VIP's routes there `next_hops`. Returns the outcome and the changes made.
pub async fn program<C: Cloud>(
    cloud: &C,
    status: &LoadBalancerStatus,
    router: Option<String>,
    next_hops: &BTreeSet<String>,
) -> (Outcome, RouteChange) {
    let (Some(vip), Some(port_id)) = (
        status.port_ip.as_deref().filter(|s| !s.is_empty()),
        status.port_id.as_deref().filter(|s| !s.is_empty()),
    ) else {
        return (Outcome::NoVip, RouteChange::default());
    };
    let router = match router {
        Some(r) => r,
        None => {
            let port = match cloud.get_port(port_id).await {
                Ok(p) => p,
                Err(e) => return (Outcome::Failed(e), RouteChange::default()),
            };
            let Some(subnet) = port
                .fixed_ips
                .iter()
                .find(|f| f.ip_address == vip)
                .map(|f| f.subnet_id.clone())
            else {
                return (Outcome::NoVip, RouteChange::default());
            };
            match find_router(cloud, &port.network_id, &subnet).await {
                Ok(Some(r)) => r,
                Ok(None) => return (Outcome::NoRouter { subnet }, RouteChange::default()),
                Err(e) => return (Outcome::Failed(e), RouteChange::default()),
            }
        }
    };
    match set_next_hops(cloud, &router, &vip_destination(vip), next_hops).await {
        Ok(change) => (
            Outcome::Programmed {
                router,
                next_hops: next_hops.clone(),
            },
            change,
        ),
        Err(e) => (Outcome::Failed(e), RouteChange::default()),
    }
}

/// Removes the VIP's routes of a LoadBalancer that is or was active-active (its `ActiveActive` condition says it
/// was) from every router on its network; nothing to do for the others. Returns how many went.
pub async fn remove_routes<C: Cloud>(cloud: &C, lb: &LoadBalancer) -> CloudResult<usize> {
    if !active_active(lb) && current_condition(lb).is_none() {
        return Ok(0);
    }
    let vip = lb.status.as_ref().and_then(|s| s.port_ip.as_deref());
    match (lb.spec.infrastructure.effective_network_id(), vip) {
        (Some(network), Some(vip)) if !vip.is_empty() => {
            remove_all(cloud, network, &vip_destination(vip)).await
        }
        _ => Ok(0),
    }
}
