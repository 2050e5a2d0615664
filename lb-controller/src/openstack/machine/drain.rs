//! Draining an active-active machine before its server goes (scale-down, rollout, replacement): its connections
//! are translated to its own port address, so their replies can only come back to it. Its deletion takes its next
//! hop off the router at once (the LoadBalancer controller routes only machines that are not being deleted), and
//! this rule keeps the server while its agent still reports open connections of its own
//! (`status.metrics` `ownConnectionsActive`) with a fresh heartbeat — at most [`super::Config::drain_timeout`]
//! after the deletion started. Nothing is held for a VRRP machine (its connections move with the VIP), a machine
//! whose agent stopped reporting (it serves nothing), or a LoadBalancer that is being deleted (its VIP goes).
//! Pure.

use std::time::Duration;

use lb_api::constants::machine_metrics;
use lb_api::LoadBalancerMachine;

use crate::openstack::loadbalancer::routes::fresh_vip_eligible;

/// Why the server must wait.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Draining {
    /// Connections the agent last reported.
    pub connections: u64,
    /// How much of the drain timeout is left.
    pub left: Duration,
}

/// Whether `lbm` (being deleted) must keep its server now; `lb_going`: its LoadBalancer is gone or being deleted.
pub fn draining(
    lbm: &LoadBalancerMachine,
    lb_going: bool,
    now: jiff::Timestamp,
    timeout: Duration,
) -> Option<Draining> {
    if lb_going {
        return None;
    }
    let since = lbm.metadata.deletion_timestamp.as_ref()?.0;
    let elapsed = now.duration_since(since).as_secs_f64().max(0.0);
    let left = timeout.as_secs_f64() - elapsed;
    if left <= 0.0 {
        return None;
    }
    // Only an active-active agent reports VIPEligible; its heartbeat says it still runs.
    fresh_vip_eligible(lbm, now)?;
    let connections = lbm
        .status
        .as_ref()?
        .metrics
        .as_ref()?
        .iter()
        .find(|m| m.type_ == machine_metrics::OWN_CONNECTIONS_ACTIVE)
        .and_then(|m| m.value.trim().parse::<u64>().ok())?;
    (connections > 0).then(|| Draining {
        connections,
        left: Duration::from_secs_f64(left),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn machine(
        deleted_ago: i64,
        beat_ago: i64,
        own: &str,
        now: jiff::Timestamp,
    ) -> LoadBalancerMachine {
        let at = |s: i64| (now - jiff::SignedDuration::from_secs(s)).to_string();
        serde_json::from_value(json!({
            "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerMachine",
            "metadata": {"name": "m", "namespace": "ns", "deletionTimestamp": at(deleted_ago),
                         "finalizers": ["x"]},
            "spec": {"infrastructure": {"flavor": {}, "image": {}, "authSecretRef": {}}, "portID": "p",
                     "loadBalancerRef": {"name": "lb", "namespace": "ns"}},
            "status": {
                "conditions": [{"type": "VIPEligible", "status": "False", "reason": "NotReady",
                                "lastHeartbeatTime": at(beat_ago), "lastTransitionTime": at(beat_ago)}],
                "metrics": [{"type": "ownConnectionsActive", "value": own, "timestamp": at(beat_ago)}]
            }
        }))
        .unwrap()
    }

    #[test]
    fn holds_only_while_a_live_agent_reports_own_connections_within_the_timeout() {
        let now = jiff::Timestamp::now();
        let t = Duration::from_secs(600);
        let d = draining(&machine(100, 5, "12", now), false, now, t).unwrap();
        assert_eq!(d.connections, 12);
        assert_eq!(d.left.as_secs(), 500);
        assert_eq!(draining(&machine(100, 5, "0", now), false, now, t), None);
        assert_eq!(
            draining(&machine(100, 31, "12", now), false, now, t),
            None,
            "agent gone"
        );
        assert_eq!(
            draining(&machine(601, 5, "12", now), false, now, t),
            None,
            "timed out"
        );
        assert_eq!(
            draining(&machine(100, 5, "12", now), true, now, t),
            None,
            "the LoadBalancer goes"
        );
        assert_eq!(
            draining(&machine(100, 5, "x", now), false, now, t),
            None,
            "unreadable"
        );
        let mut vrrp = machine(100, 5, "12", now);
        vrrp.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].type_ =
            "KeepalivedMaster".into();
        assert_eq!(draining(&vrrp, false, now, t), None, "a VRRP machine");
    }
}
