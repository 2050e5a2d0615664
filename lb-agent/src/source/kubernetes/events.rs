//! Events of Kubernetes mode: which core/v1 Events a status change makes, and the recorder that writes
//! them on the LoadBalancerMachine for both the config source and the status reporter.

use super::KubeSettings;
use crate::report::{AgentStatus, SessionState};
use crate::source::ConfigState;
use ::kube::api::{Api, PostParams};
use ::kube::Client;
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use lb_api::constants::{defaults::USER_EVENT_COMPONENT, API_VERSION};
use lb_api::{LoadBalancer, LoadBalancerMachine};
use tokio::sync::Mutex;

/// `source.component` / `reportingComponent` of the Events the agent writes.
pub const EVENT_COMPONENT: &str = "lb-agent";
/// The same when started as `yawollet`: yawollet's event recorder for the LoadBalancerMachine is named so, and
/// `kubectl get events` filters or alerts on the component keep finding these.
pub const YAWOLLET_EVENT_COMPONENT: &str = "yawollet";

/// The component the Events of an agent with these settings are attributed to.
pub fn event_component(settings: &KubeSettings) -> &'static str {
    if settings.yawollet.is_some() {
        YAWOLLET_EVENT_COMPONENT
    } else {
        EVENT_COMPONENT
    }
}

/// Longest condition or Event message written. Kubernetes does not cap NodeCondition messages, but a
/// spec with many errors should not bloat the object that every controller watches.
const MAX_MESSAGE: usize = 1024;

/// Event reasons.
pub mod event_reasons {
    /// Warning: the LoadBalancer's spec (or VIP) was rejected; the last valid configuration keeps forwarding.
    pub const CONFIG_REJECTED: &str = "ConfigurationRejected";
    /// Warning: the LoadBalancer was accepted, but part of it is left out (an endpoint without an address of
    /// a VIP's family) or shuts clients out (source ranges of the other family only).
    pub const CONFIG_WARNING: &str = "ConfigurationWarning";
    /// Warning: a valid configuration could not be written to the data plane.
    pub const APPLY_FAILED: &str = "ApplyFailed";
    /// Warning: the data plane is no longer attached.
    pub const DATAPLANE_NOT_READY: &str = "DataplaneNotReady";
    /// Normal: a new configuration generation is in the data plane (yawol's reason for a new snapshot).
    pub const UPDATE: &str = "Update";
    /// Warning (yawol's type and reason): ad-hoc debug access is on (the key installed, sshd started).
    pub const AD_HOC_DEBUG_ENABLED: &str = "AdHocDebuggingEnabled";
    /// Warning (yawol's reason): ad-hoc debug access was asked for and refused or failed.
    pub const AD_HOC_DEBUG_NOT_ENABLED: &str = "AdHocDebuggingNotEnabled";
    /// Normal: the ad-hoc debug key was removed (the annotation went).
    pub const AD_HOC_DEBUG_DISABLED: &str = "AdHocDebuggingDisabled";
    /// Normal: active-active, the machine announces the VIPs over BGP (it became eligible).
    pub const BGP_ANNOUNCED: &str = "BGPAnnounced";
    /// Warning: active-active, the machine withdrew the VIPs (no longer eligible).
    pub const BGP_WITHDRAWN: &str = "BGPWithdrawn";
    /// Normal: a router's BGP session is established.
    pub const BGP_SESSION_ESTABLISHED: &str = "BGPSessionEstablished";
    /// Warning: an established BGP session went down, or one has not come up for 30 s.
    pub const BGP_SESSION_DOWN: &str = "BGPSessionDown";
    /// Normal: active-active (with BGP or without), the machine became eligible for the VIPs' traffic.
    pub const VIP_ELIGIBLE: &str = "VIPEligible";
    /// Warning: active-active, the machine is no longer eligible (the VIPs are routed to the others).
    pub const VIP_NOT_ELIGIBLE: &str = "VIPNotEligible";
    // Warning: an option the LoadBalancer asks for that this image does not implement; the reason is its
    // condition's (`super::status::unsupported_condition`: `LogForwardNotSupported`, `ProxyProtocolNotSupported`).
}

/// An Event to write on the LoadBalancerMachine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachineEvent {
    /// `Warning` (else `Normal`).
    pub warning: bool,
    /// Machine-readable reason ([`event_reasons`]).
    pub reason: &'static str,
    /// Human-readable message.
    pub message: String,
}

/// Events for a change of the agent's status. Rejected configurations are reported by the config source
/// (it knows the message); here a config error whose message is not the current `Invalid` one is an
/// apply failure.
pub fn status_events(
    prev: &AgentStatus,
    cur: &AgentStatus,
    config: &ConfigState,
) -> Vec<MachineEvent> {
    let mut events = Vec::new();
    if let Some(err) = &cur.config_error {
        let rejected = matches!(config, ConfigState::Invalid(m, _) if m == err);
        if prev.config_error.as_ref() != Some(err) && !rejected {
            events.push(MachineEvent {
                warning: true,
                reason: event_reasons::APPLY_FAILED,
                message: truncate(&format!("applying the configuration failed: {err}")),
            });
        }
    }
    if prev.dataplane_ready && !cur.dataplane_ready {
        events.push(MachineEvent {
            warning: true,
            reason: event_reasons::DATAPLANE_NOT_READY,
            message: "the data plane is no longer attached".to_string(),
        });
    }
    events.extend(vip_eligibility_events(prev, cur));
    events.extend(bgp_events(prev, cur));
    if let Some(g) = cur.applied_generation {
        if prev.applied_generation != Some(g) {
            events.push(MachineEvent {
                warning: false,
                reason: event_reasons::UPDATE,
                message: format!("data plane updated to configuration generation {g}"),
            });
        }
    }
    events
}

/// Events for a change of the machine's eligibility (active-active): became eligible, or no longer is. A start
/// that is not eligible yet is no Event (every start is so for a moment).
fn vip_eligibility_events(prev: &AgentStatus, cur: &AgentStatus) -> Option<MachineEvent> {
    let cur = cur.vip_eligibility?;
    let was = prev.vip_eligibility.is_some_and(|e| e.eligible());
    match (was, cur.eligible()) {
        (false, true) => Some(MachineEvent {
            warning: false,
            reason: event_reasons::VIP_ELIGIBLE,
            message: "the machine is eligible for the VIPs' traffic (data plane attached, configuration current, flows synced)".to_string(),
        }),
        (true, false) => Some(MachineEvent {
            warning: true,
            reason: event_reasons::VIP_NOT_ELIGIBLE,
            message: super::status::vip_eligibility_words(cur).1.to_string(),
        }),
        _ => None,
    }
}

/// Events for a change of the BGP announcement (active-active): announced or withdrawn, a session established,
/// lost, or not up for 30 s. A session still connecting is no Event (every start has one for a moment).
fn bgp_events(prev: &AgentStatus, cur: &AgentStatus) -> Vec<MachineEvent> {
    let Some(b) = &cur.bgp else {
        return Vec::new();
    };
    let mut events = Vec::new();
    let was_announced = prev.bgp.as_ref().is_some_and(|p| p.announced > 0);
    if b.announced > 0 && !was_announced {
        events.push(MachineEvent {
            warning: false,
            reason: event_reasons::BGP_ANNOUNCED,
            message: format!("{} VIPs announced over BGP", b.announced),
        });
    } else if b.announced == 0 && was_announced {
        events.push(MachineEvent {
            warning: true,
            reason: event_reasons::BGP_WITHDRAWN,
            message: "the VIPs were withdrawn: the machine is not eligible (data plane attached, config current, flows synced)".to_string(),
        });
    }
    let before = |peer: &std::net::IpAddr| {
        prev.bgp
            .as_ref()
            .and_then(|p| p.sessions.iter().find(|(q, _)| q == peer))
            .map(|(_, st)| *st)
    };
    for (peer, st) in &b.sessions {
        let was = before(peer);
        match st {
            SessionState::Established if was != Some(SessionState::Established) => {
                events.push(MachineEvent {
                    warning: false,
                    reason: event_reasons::BGP_SESSION_ESTABLISHED,
                    message: format!("BGP session with {peer} established"),
                })
            }
            SessionState::Connecting if was == Some(SessionState::Established) => {
                events.push(MachineEvent {
                    warning: true,
                    reason: event_reasons::BGP_SESSION_DOWN,
                    message: format!("BGP session with {peer} went down"),
                })
            }
            SessionState::Stuck if was != Some(SessionState::Stuck) => events.push(MachineEvent {
                warning: true,
                reason: event_reasons::BGP_SESSION_DOWN,
                message: format!(
                    "BGP session with {peer} not established for 30 s: the VIPs are not announced to it (the agent's log has BIRD's reason)"
                ),
            }),
            _ => {}
        }
    }
    events
}

/// Cuts a message to [`MAX_MESSAGE`] bytes at a character boundary.
pub(super) fn truncate(s: &str) -> String {
    if s.len() <= MAX_MESSAGE {
        return s.to_string();
    }
    let mut end = MAX_MESSAGE - '…'.len_utf8();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Writes core/v1 Events about the LoadBalancerMachine. Best effort: failures are logged, never retried
/// (the same problem shows in the conditions, which are retried).
pub(super) struct Recorder {
    events: Api<Event>,
    machines: Api<LoadBalancerMachine>,
    namespace: String,
    machine: String,
    component: &'static str,
    /// The machine's uid, looked up once: `kubectl describe` finds Events by it.
    uid: Mutex<Option<String>>,
}

impl Recorder {
    pub(super) fn new(client: Client, settings: &KubeSettings) -> Self {
        Recorder {
            events: Api::namespaced(client.clone(), &settings.namespace),
            machines: Api::namespaced(client, &settings.namespace),
            namespace: settings.namespace.clone(),
            machine: settings.machine.clone(),
            component: event_component(settings),
            uid: Mutex::new(None),
        }
    }

    /// Writes `event` on the LoadBalancerMachine. `Update` is a fact about one configuration generation: it is
    /// named by its reason and message, so that a second start of the agent (yawol's user data restarts it at
    /// boot) finds it there instead of writing it again. Other events are each one occurrence.
    pub(super) async fn publish(&self, event: &MachineEvent) {
        let name =
            (event.reason == event_reasons::UPDATE).then(|| event_name(&self.machine, event));
        let machine = self.machine_ref().await;
        self.write(machine, self.component, name, event).await;
    }

    /// Writes `event`, which is about the LoadBalancer's spec (a rejection, a warning, an unsupported option), on
    /// the machine and on the LoadBalancer too, attributed to yawol's `yawol-service`: the cloud controller (ours
    /// and yawol's) re-emits those on the Service, where its owner looks. Every replica sees the same spec, so
    /// both Events are named by their reason and message: the first replica (or start) writes them, the others
    /// find them there.
    pub(super) async fn publish_spec_event(&self, lb: &LoadBalancer, event: &MachineEvent) {
        let machine = self.machine_ref().await;
        self.write(
            machine,
            self.component,
            Some(event_name(&self.machine, event)),
            event,
        )
        .await;
        let name = lb.metadata.name.clone().unwrap_or_default();
        let on_lb = ObjectReference {
            api_version: Some(API_VERSION.to_string()),
            kind: Some("LoadBalancer".to_string()),
            name: Some(name.clone()),
            namespace: Some(self.namespace.clone()),
            uid: lb.metadata.uid.clone(),
            ..Default::default()
        };
        self.write(
            on_lb,
            USER_EVENT_COMPONENT,
            Some(event_name(&name, event)),
            event,
        )
        .await;
    }

    /// The reference to this machine (its uid looked up once: `kubectl describe` finds Events by it).
    async fn machine_ref(&self) -> ObjectReference {
        let uid = {
            let mut uid = self.uid.lock().await;
            if uid.is_none() {
                *uid = self
                    .machines
                    .get(&self.machine)
                    .await
                    .ok()
                    .and_then(|m| m.metadata.uid);
            }
            uid.clone()
        };
        ObjectReference {
            api_version: Some(API_VERSION.to_string()),
            kind: Some("LoadBalancerMachine".to_string()),
            name: Some(self.machine.clone()),
            namespace: Some(self.namespace.clone()),
            uid,
            ..Default::default()
        }
    }

    /// Creates the Event about `involved` (named `name`, or a generated name); one that exists under its name is
    /// left as it is.
    async fn write(
        &self,
        involved: ObjectReference,
        component: &'static str,
        name: Option<String>,
        event: &MachineEvent,
    ) {
        let kind = involved.kind.clone().unwrap_or_default();
        let generate_name = name
            .is_none()
            .then(|| format!("{}.", involved.name.clone().unwrap_or_default()));
        let now = Time(Timestamp::now());
        let ev = Event {
            metadata: ObjectMeta {
                name,
                generate_name,
                namespace: Some(self.namespace.clone()),
                ..Default::default()
            },
            involved_object: involved,
            type_: Some(if event.warning { "Warning" } else { "Normal" }.to_string()),
            reason: Some(event.reason.to_string()),
            message: Some(event.message.clone()),
            count: Some(1),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            source: Some(EventSource {
                component: Some(component.to_string()),
                host: None,
            }),
            reporting_component: Some(component.to_string()),
            reporting_instance: Some(self.machine.clone()),
            ..Default::default()
        };
        match self.events.create(&PostParams::default(), &ev).await {
            Ok(_) => {}
            Err(::kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => {
                tracing::warn!(error = %e, reason = event.reason, %kind, "could not write an Event")
            }
        }
    }
}

/// The name of an Event about `object` that is the same wherever and whenever it is written for the same reason
/// and message (FNV-1a of both: a hash that is the same in every build, unlike std's).
fn event_name(object: &str, event: &MachineEvent) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in event.reason.bytes().chain([0]).chain(event.message.bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{object}.{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::kubernetes::test_support::running;

    /// The events between two statuses (config unchanged): whether each is a warning, and its reason.
    fn reasons(prev: &AgentStatus, cur: &AgentStatus) -> Vec<(bool, &'static str)> {
        status_events(prev, cur, &ConfigState::Pending)
            .iter()
            .map(|e| (e.warning, e.reason))
            .collect()
    }

    #[test]
    fn events_on_edges_only() {
        let idle = AgentStatus {
            dataplane_ready: true,
            ..Default::default()
        };
        let e = status_events(&idle, &running(1), &ConfigState::Pending);
        assert_eq!(e.len(), 1);
        assert_eq!((e[0].warning, e[0].reason), (false, "Update"));
        assert!(status_events(&running(1), &running(1), &ConfigState::Pending).is_empty());

        // A rejected spec is reported by the config source, not again here.
        let rejected = AgentStatus {
            config_error: Some("bad".into()),
            ..running(1)
        };
        let invalid = ConfigState::Invalid("bad".into(), 2);
        assert!(status_events(&running(1), &rejected, &invalid).is_empty());
        // Any other error is an apply failure.
        let e = status_events(&running(1), &rejected, &ConfigState::Pending);
        assert_eq!((e[0].warning, e[0].reason), (true, "ApplyFailed"));
        assert!(status_events(&rejected, &rejected, &ConfigState::Pending).is_empty());

        let detached = AgentStatus {
            dataplane_ready: false,
            ..running(1)
        };
        let e = status_events(&running(1), &detached, &ConfigState::Pending);
        assert_eq!(e[0].reason, "DataplaneNotReady");
    }

    #[test]
    fn bgp_events_on_announcement_and_session_edges() {
        use crate::report::BgpStatus;
        let router: std::net::IpAddr = "10.0.0.1".parse().unwrap();
        let with = |announced, st| AgentStatus {
            bgp: Some(BgpStatus {
                announced,
                sessions: vec![(router, st)],
            }),
            ..running(1)
        };
        let connecting = with(0, SessionState::Connecting);
        // BIRD's first answer: still connecting, nothing to say.
        assert!(reasons(&running(1), &connecting).is_empty());
        let up = with(1, SessionState::Established);
        assert_eq!(
            reasons(&connecting, &up),
            [(false, "BGPAnnounced"), (false, "BGPSessionEstablished")]
        );
        assert!(reasons(&up, &up).is_empty());
        // The router goes away: the session is down (the announcement stays in BIRD's config).
        let lost = with(1, SessionState::Connecting);
        assert_eq!(reasons(&up, &lost), [(true, "BGPSessionDown")]);
        // A router that never answers: one Warning when it has been down for 30 s, none while connecting.
        let stuck = with(0, SessionState::Stuck);
        assert_eq!(reasons(&connecting, &stuck), [(true, "BGPSessionDown")]);
        assert!(reasons(&stuck, &stuck).is_empty());
        // No longer eligible.
        assert_eq!(
            reasons(&up, &with(0, SessionState::Established)),
            [(true, "BGPWithdrawn")]
        );
    }

    #[test]
    fn vip_eligibility_events_on_edges() {
        use crate::ha::VipEligibility;
        let with = |e| AgentStatus {
            vip_eligibility: Some(e),
            ..running(1)
        };
        let (not_ready, not_synced, eligible) = (
            with(VipEligibility::NotReady),
            with(VipEligibility::NotSynced),
            with(VipEligibility::Eligible),
        );
        // Starting up: not eligible yet, nothing to say.
        assert!(reasons(&running(1), &not_ready).is_empty());
        assert!(reasons(&not_ready, &not_synced).is_empty());
        assert_eq!(reasons(&not_synced, &eligible), [(false, "VIPEligible")]);
        assert!(reasons(&eligible, &eligible).is_empty());
        let lost = status_events(&eligible, &not_synced, &ConfigState::Pending);
        assert_eq!(
            lost.iter()
                .map(|e| (e.warning, e.reason))
                .collect::<Vec<_>>(),
            [(true, "VIPNotEligible")]
        );
        assert!(
            lost[0].message.contains("caught up with the peers"),
            "{lost:?}"
        );
        assert_eq!(reasons(&eligible, &not_ready), [(true, "VIPNotEligible")]);
        // Not active-active: none.
        assert!(reasons(&running(1), &running(1)).is_empty());
    }

    #[test]
    fn long_messages_are_cut_at_a_char_boundary() {
        let s = "ä".repeat(2000);
        let cut = truncate(&s);
        assert!(cut.len() <= MAX_MESSAGE);
        assert!(cut.ends_with('…'));
        assert_eq!(truncate("short"), "short");
    }
}
