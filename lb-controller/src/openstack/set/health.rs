//! The machine health rules of yawol's LBM status controller, as the set controller applies them: when a machine is
//! ready, unready, marked for deletion or deleted, and which one a scale-down removes. Pure.

use k8s_openapi::api::core::v1::NodeCondition;
use lb_api::constants::conditions;
use std::time::Duration;

/// Conditions that must be True for a machine to be ready (our agent's names; yawol's Envoy* names are accepted
/// by the agent's compatibility layer, not here).
pub const READY_CONDITIONS: [&str; 3] = [
    conditions::CONFIG_READY,
    conditions::DATAPLANE_READY,
    conditions::DATAPLANE_UP_TO_DATE,
];

/// Heartbeats older than this make a machine unready.
pub const HEARTBEAT_STALE: Duration = Duration::from_secs(180);
/// A machine without any condition this long after creation is replaced.
pub const CREATION_TIMEOUT: Duration = Duration::from_secs(600);
/// An unready machine is marked for deletion after this long…
pub const UNREADY_BEFORE_MARK: Duration = Duration::from_secs(180);
/// …and deleted if still unready this long after the mark (the grace that protects healthy VMs from an API-server
/// outage: their heartbeats resume and the mark is removed).
pub const DELETION_GRACE: Duration = Duration::from_secs(120);

/// What the health check says about a machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// Ready.
    Ready,
    /// Not ready (yet); no action.
    Unready(String),
    /// Bad long enough: add the `MarkedForDeletion` condition.
    MarkForDeletion(String),
    /// Marked and still bad after the grace period: delete the LoadBalancerMachine.
    Delete(String),
    /// Marked but recovered: remove the mark.
    ClearMark,
}

fn age(now: jiff::Timestamp, t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time) -> Duration {
    let d = now.duration_since(t.0);
    Duration::from_secs_f64(d.as_secs_f64().max(0.0))
}

/// yawol's machine rules (seed 001): unready when there are no conditions, a heartbeat is older than 3 min, or a
/// required condition is missing/False; bad (to be replaced) when it has no conditions 10 min after creation
/// (`creation_timeout`), or has been unready for 3 more minutes; replacement goes through a `MarkedForDeletion`
/// mark and a 2-minute grace, so ~5 min for a dead VM.
pub fn machine_health(
    conditions: &[NodeCondition],
    created: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
    now: jiff::Timestamp,
    creation_timeout: Duration,
) -> Health {
    let mark = conditions
        .iter()
        .find(|c| c.type_ == conditions::MARKED_FOR_DELETION && c.status == conditions::TRUE);
    let relevant: Vec<&NodeCondition> = conditions
        .iter()
        .filter(|c| c.type_ != conditions::MARKED_FOR_DELETION)
        .collect();
    let mut reason = None;
    let mut bad_since: Option<Duration> = None;
    if relevant.is_empty() {
        reason = Some("no conditions reported yet".to_string());
        let a = age(now, created);
        if a > creation_timeout {
            bad_since = Some(a - creation_timeout + UNREADY_BEFORE_MARK);
        }
    } else {
        for c in &relevant {
            if let Some(hb) = &c.last_heartbeat_time {
                let a = age(now, hb);
                if a > HEARTBEAT_STALE {
                    reason.get_or_insert(format!("{} heartbeat {}s old", c.type_, a.as_secs()));
                    bad_since =
                        Some(bad_since.map_or(a - HEARTBEAT_STALE, |b| b.max(a - HEARTBEAT_STALE)));
                }
            }
        }
        for want in READY_CONDITIONS {
            match relevant.iter().find(|c| c.type_ == want) {
                None => {
                    reason.get_or_insert(format!("{want} missing"));
                    let a = age(now, created);
                    if a > creation_timeout {
                        bad_since = Some(
                            bad_since
                                .unwrap_or_default()
                                .max(a - creation_timeout + UNREADY_BEFORE_MARK),
                        );
                    }
                }
                Some(c) if c.status != conditions::TRUE => {
                    reason.get_or_insert(format!("{want} is {}", c.status));
                    let since = c
                        .last_transition_time
                        .as_ref()
                        .map(|t| age(now, t))
                        .unwrap_or_default();
                    bad_since = Some(bad_since.unwrap_or_default().max(since));
                }
                Some(_) => {}
            }
        }
    }
    match (reason, mark) {
        (None, None) => Health::Ready,
        (None, Some(_)) => Health::ClearMark,
        (Some(r), Some(m)) => {
            let marked_for = m
                .last_transition_time
                .as_ref()
                .map(|t| age(now, t))
                .unwrap_or_default();
            if marked_for >= DELETION_GRACE {
                Health::Delete(r)
            } else {
                Health::Unready(r)
            }
        }
        (Some(r), None) => match bad_since {
            Some(d) if d >= UNREADY_BEFORE_MARK => Health::MarkForDeletion(r),
            _ => Health::Unready(r),
        },
    }
}

/// Which machine a scale-down removes: unready first, then non-VRRP-master, else the first (names sorted for
/// determinism). Input: (name, ready, master).
pub fn scale_down_victim(machines: &[(String, bool, bool)]) -> Option<String> {
    let mut m: Vec<&(String, bool, bool)> = machines.iter().collect();
    m.sort_by(|a, b| a.0.cmp(&b.0));
    m.iter()
        .find(|x| !x.1)
        .or_else(|| m.iter().find(|x| !x.2))
        .or_else(|| m.first())
        .map(|x| x.0.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn t(now: jiff::Timestamp, secs_ago: i64) -> Time {
        Time(now - jiff::SignedDuration::from_secs(secs_ago))
    }

    fn cond(type_: &str, status: &str, hb: Time, tr: Time) -> NodeCondition {
        NodeCondition {
            type_: type_.into(),
            status: status.into(),
            last_heartbeat_time: Some(hb),
            last_transition_time: Some(tr),
            ..Default::default()
        }
    }

    fn healthy(now: jiff::Timestamp) -> Vec<NodeCondition> {
        READY_CONDITIONS
            .iter()
            .map(|c| cond(c, "True", t(now, 10), t(now, 1000)))
            .collect()
    }

    #[test]
    fn health_rules() {
        let now = jiff::Timestamp::now();
        let created = t(now, 60);
        assert_eq!(
            machine_health(&healthy(now), &created, now, CREATION_TIMEOUT),
            Health::Ready
        );
        // Booting, no conditions: unready, not replaced before the creation timeout.
        assert!(matches!(
            machine_health(&[], &created, now, CREATION_TIMEOUT),
            Health::Unready(_)
        ));
        assert!(matches!(
            machine_health(&[], &t(now, 800), now, CREATION_TIMEOUT),
            Health::MarkForDeletion(_)
        ));
        // Stale heartbeat: unready after 3 min, marked after 6.
        let mut c = healthy(now);
        c[0].last_heartbeat_time = Some(t(now, 200));
        assert!(matches!(
            machine_health(&c, &created, now, CREATION_TIMEOUT),
            Health::Unready(_)
        ));
        c[0].last_heartbeat_time = Some(t(now, 400));
        assert!(matches!(
            machine_health(&c, &created, now, CREATION_TIMEOUT),
            Health::MarkForDeletion(_)
        ));
        // Marked: deleted only after the grace; recovered → mark cleared.
        let mut marked = c.clone();
        marked.push(cond(
            conditions::MARKED_FOR_DELETION,
            "True",
            t(now, 30),
            t(now, 30),
        ));
        assert!(matches!(
            machine_health(&marked, &created, now, CREATION_TIMEOUT),
            Health::Unready(_)
        ));
        marked.last_mut().unwrap().last_transition_time = Some(t(now, 130));
        assert!(matches!(
            machine_health(&marked, &created, now, CREATION_TIMEOUT),
            Health::Delete(_)
        ));
        let mut recovered = healthy(now);
        recovered.push(marked.last().unwrap().clone());
        assert_eq!(
            machine_health(&recovered, &created, now, CREATION_TIMEOUT),
            Health::ClearMark
        );
        // A False condition for 4 min.
        let mut f = healthy(now);
        f[1] = cond(conditions::DATAPLANE_READY, "False", t(now, 5), t(now, 240));
        assert!(matches!(
            machine_health(&f, &created, now, CREATION_TIMEOUT),
            Health::MarkForDeletion(_)
        ));
    }

    #[test]
    fn scale_down_order() {
        let m = |n: &str, r, k| (n.to_string(), r, k);
        assert_eq!(
            scale_down_victim(&[
                m("a", true, true),
                m("b", false, false),
                m("c", true, false)
            ])
            .unwrap(),
            "b"
        );
        assert_eq!(
            scale_down_victim(&[m("a", true, true), m("c", true, false)]).unwrap(),
            "c"
        );
        assert_eq!(
            scale_down_victim(&[m("b", true, true), m("a", true, true)]).unwrap(),
            "a"
        );
        assert_eq!(scale_down_victim(&[]), None);
    }
}
