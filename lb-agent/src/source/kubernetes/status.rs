//! The status reporter of Kubernetes mode: the agent's status as `LoadBalancerMachine.status` conditions
//! (ours and yawol's names) and metrics, written on every change and as a heartbeat.

use super::events::{status_events, truncate, Recorder};
use super::{KubeSettings, LbFacts};
use crate::ha::VipEligibility;
use crate::report::metrics::SharedSnapshot;
use crate::report::{AgentStatus, SessionState};
use crate::source::config::UnsupportedOption;
use crate::source::ConfigState;
use ::kube::api::{Api, Patch, PatchParams};
use anyhow::Result;
use k8s_openapi::api::core::v1::NodeCondition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use lb_api::constants::conditions as cond;
use lb_api::{set_condition, LoadBalancerMachine, LoadBalancerMachineMetric};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Condition types of this agent beyond [`lb_api::constants::conditions`].
pub mod types {
    /// yawol's: keepalived's statistics can be read (yawollet: its stats file is fresh).
    pub const KEEPALIVED_STATS_FILE: &str = "KeepalivedStatsFile";
    /// Present only while the LoadBalancer asks for log forwarding: always False, this image ships no logs.
    pub const LOG_FORWARD: &str = "LogForward";
    /// Present only while the LoadBalancer asks for PROXY protocol on one of its TCP ports: always False, the data
    /// plane inserts no PROXY header yet (it forwards all the same).
    pub const PROXY_PROTOCOL: &str = "ProxyProtocol";
    /// Active-active: the machine announces the VIPs over BGP (eligible: data plane attached, config current,
    /// flows synced).
    pub const BGP_ANNOUNCED: &str = "BGPAnnounced";
    /// Active-active: every upstream router's BGP session is established.
    pub const BGP_SESSIONS: &str = "BGPSessions";
    // Active-active, with BGP or without: `lb_api`'s `VIPEligible` (the controller routes the VIPs by it).
}

/// Condition reasons. The yawol-named conditions use yawol's reasons where yawol has one, so dashboards
/// and alerts written for yawol keep matching (`loadbalancermachine_condition{reason=…}`): yawollet uses
/// `EnvoySnapshotUpToDate` for `EnvoyUpToDate` in both statuses, and so does this agent.
pub mod reasons {
    /// `ConfigReady=True` (yawol's reason; as yawollet, only in the first status write of a new configuration).
    pub const CONFIG_UP_TO_DATE: &str = "EnvoyConfigurationUpToDate";
    /// `ConfigReady=True` as yawollet writes it in every later status write: the configuration is unchanged
    /// (yawollet's words: "envoy config is already up to date"). Only when started as yawollet.
    pub const CONFIG_UNCHANGED: &str = "EnvoyConfigurationCreated";
    /// `ConfigReady=False`: invalid LoadBalancer or a configuration the data plane refused (yawol's reason).
    pub const CONFIG_FAILED: &str = "EnvoyConfigurationFailed";
    /// `ConfigReady=False`: no configuration yet (LoadBalancer not read, or no `status.portIP`).
    pub const CONFIG_PENDING: &str = "ConfigurationPending";
    /// `DataplaneReady=True`.
    pub const DATAPLANE_READY: &str = "DataplaneAttached";
    /// `DataplaneReady=False`.
    pub const DATAPLANE_NOT_READY: &str = "DataplaneNotAttached";
    /// `EnvoyReady=True` (yawol's reason).
    pub const ENVOY_READY: &str = "EnvoyReady";
    /// `EnvoyReady=False` (yawol's reason).
    pub const ENVOY_NOT_READY: &str = "EnvoyNotReady";
    /// `DataplaneUpToDate=True`.
    pub const DATAPLANE_UP_TO_DATE: &str = "ConfigurationApplied";
    /// `DataplaneUpToDate=False`.
    pub const DATAPLANE_NOT_UP_TO_DATE: &str = "ConfigurationNotApplied";
    /// `EnvoyUpToDate=True` (yawol's reason).
    pub const ENVOY_UP_TO_DATE: &str = "EnvoySnapshotUpToDate";
    /// `EnvoyUpToDate=False` (yawol's reason: the same word as for True).
    pub const ENVOY_NOT_UP_TO_DATE: &str = "EnvoySnapshotUpToDate";
    /// `BGPAnnounced=True`.
    pub const BGP_ANNOUNCING: &str = "Announcing";
    /// `BGPAnnounced=False`: not eligible (or BIRD does not run yet).
    pub const BGP_WITHDRAWN: &str = "Withdrawn";
    /// `BGPSessions=True`.
    pub const BGP_ESTABLISHED: &str = "Established";
    /// `BGPSessions=False`: a router's session is down, or BIRD does not answer.
    pub const BGP_NOT_ESTABLISHED: &str = "NotEstablished";
    /// `VIPEligible=True`.
    pub const VIP_ELIGIBLE: &str = "Eligible";
    /// `VIPEligible=False`: the data plane is not attached or does not run the latest configuration.
    pub const VIP_NOT_READY: &str = "NotReady";
    /// `VIPEligible=False`: the flow table has not caught up with the peers yet.
    pub const VIP_NOT_SYNCED: &str = "NotSynced";
    /// `KeepalivedMaster` (yawol's reason, both statuses).
    pub const KEEPALIVED_STATUS: &str = "KeepalivedStatus";
    /// `KeepalivedProcess=True` (yawol's reason).
    pub const KEEPALIVED_RUNNING: &str = "KeepalivedIsRunning";
    /// `KeepalivedProcess=False` (yawol's reason when its process check fails).
    pub const KEEPALIVED_NOT_RUNNING: &str = "CouldNotKeepalivedProcess";
    /// `KeepalivedStatsFile=True` (yawol's reason).
    pub const STATS_UP_TO_DATE: &str = "StatsUpToDate";
    /// `KeepalivedStatsFile=False` (yawol's reason).
    pub const COULD_NOT_READ_STATS: &str = "CouldNotReadStats";
    /// `LogForward=False`.
    pub const LOG_FORWARD_NOT_SUPPORTED: &str = "LogForwardNotSupported";
    /// `ProxyProtocol=False`.
    pub const PROXY_PROTOCOL_NOT_SUPPORTED: &str = "ProxyProtocolNotSupported";
}

/// The condition (type, reason) that reports an option this image does not implement; the Warning Event about it
/// has the same reason.
pub fn unsupported_condition(option: UnsupportedOption) -> (&'static str, &'static str) {
    match option {
        UnsupportedOption::LogForward => (types::LOG_FORWARD, reasons::LOG_FORWARD_NOT_SUPPORTED),
        UnsupportedOption::ProxyProtocol => {
            (types::PROXY_PROTOCOL, reasons::PROXY_PROTOCOL_NOT_SUPPORTED)
        }
    }
}

/// What the conditions depend on besides the agent's status.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Context {
    /// From the LoadBalancer.
    pub facts: LbFacts,
    /// keepalived's statistics were read at the last metrics refresh.
    pub keepalived_stats: bool,
    /// Started as `yawollet` ([`super::KubeSettings::yawollet`]).
    pub yawollet: Option<super::yawollet::Compat>,
    /// This write is the first to report the configuration generation it reports.
    pub new_config: bool,
}

/// The channels between the status reporter and the config source.
pub(super) struct Feedback {
    /// What the source learnt from the LoadBalancer.
    pub facts: watch::Receiver<LbFacts>,
    /// The machine's revision from its annotation, for the source (only sent without `--machine-revision`).
    pub revision: watch::Sender<Option<String>>,
}

/// One condition's truth before it becomes a `NodeCondition`.
struct Truth {
    type_: &'static str,
    ok: bool,
    reason: &'static str,
    message: String,
}

/// The agent's conditions under both naming schemes. The yawol names carry exactly the same status as
/// ours: yawol-controller counts a machine ready when `ConfigReady`, `EnvoyReady` and `EnvoyUpToDate`
/// are all True with a fresh heartbeat, and replaces it when one stays False for 3 minutes.
fn truths(s: &AgentStatus, ctx: &Context) -> Vec<Truth> {
    let (config_ok, config_reason, config_msg) = match (&s.config_error, s.desired_generation) {
        (Some(e), _) => (false, reasons::CONFIG_FAILED, truncate(e)),
        (None, Some(g)) => (
            true,
            // yawollet says "updated" once, when it sets a new snapshot, and "created" in every reconcile after.
            if ctx.yawollet.is_some() && !ctx.new_config {
                reasons::CONFIG_UNCHANGED
            } else {
                reasons::CONFIG_UP_TO_DATE
            },
            format!("configuration generation {g} is valid"),
        ),
        (None, None) => (
            false,
            reasons::CONFIG_PENDING,
            "waiting for the LoadBalancer and its status.portIP (VIP)".to_string(),
        ),
    };
    let ready_msg = match (s.dataplane_ready, s.attached.as_slice()) {
        (true, []) => "the data plane is attached".to_string(),
        // One interface, as yawol's machines have: the hook alone.
        (true, [(_, mode)]) => format!("the data plane is attached ({})", mode.describe()),
        (true, all) => {
            let each: Vec<String> = all
                .iter()
                .map(|(i, m)| format!("{i}: {}", m.describe()))
                .collect();
            format!("the data plane is attached ({})", each.join(", "))
        }
        (false, _) => "the data plane is not attached".to_string(),
    };
    // Slow, not broken: said beside the hook (see `dataplane::nic`).
    let ready_msg = if s.dataplane_ready && !s.xdp_tx_locked.is_empty() {
        format!(
            "{ready_msg}; XDP_TX shares the stack's transmit queues under a lock on {} (too few virtio-net queue \
             pairs)",
            s.xdp_tx_locked.join(", ")
        )
    } else {
        ready_msg
    };
    let up_to_date = s.up_to_date();
    let up_msg = up_to_date_message(s);
    let pick = |ok: bool, yes: &'static str, no: &'static str| if ok { yes } else { no };
    let mut v = vec![
        Truth {
            type_: cond::CONFIG_READY,
            ok: config_ok,
            reason: config_reason,
            message: config_msg,
        },
        Truth {
            type_: cond::DATAPLANE_READY,
            ok: s.dataplane_ready,
            reason: pick(
                s.dataplane_ready,
                reasons::DATAPLANE_READY,
                reasons::DATAPLANE_NOT_READY,
            ),
            message: ready_msg.to_string(),
        },
        Truth {
            type_: cond::ENVOY_READY,
            ok: s.dataplane_ready,
            reason: pick(
                s.dataplane_ready,
                reasons::ENVOY_READY,
                reasons::ENVOY_NOT_READY,
            ),
            message: ready_msg.to_string(),
        },
        Truth {
            type_: cond::DATAPLANE_UP_TO_DATE,
            ok: up_to_date,
            reason: pick(
                up_to_date,
                reasons::DATAPLANE_UP_TO_DATE,
                reasons::DATAPLANE_NOT_UP_TO_DATE,
            ),
            message: up_msg.clone(),
        },
        Truth {
            type_: cond::ENVOY_UP_TO_DATE,
            ok: up_to_date,
            reason: pick(
                up_to_date,
                reasons::ENVOY_UP_TO_DATE,
                reasons::ENVOY_NOT_UP_TO_DATE,
            ),
            message: up_msg,
        },
    ];
    // yawollet with `--keepalived-stats-file=""` writes neither of the stats-based conditions.
    let stats_conditions = ctx.yawollet.is_none_or(|y| y.keepalived_stats);
    if let Some(state) = s.vrrp {
        let running = state.is_reported();
        v.push(Truth {
            type_: cond::KEEPALIVED_PROCESS,
            ok: running,
            reason: pick(
                running,
                reasons::KEEPALIVED_RUNNING,
                reasons::KEEPALIVED_NOT_RUNNING,
            ),
            message: format!("keepalived state: {state}"),
        });
    }
    if let Some(state) = s.vrrp.filter(|_| stats_conditions) {
        v.push(Truth {
            type_: cond::KEEPALIVED_MASTER,
            ok: state == crate::ha::vrrp::VrrpState::Master,
            reason: reasons::KEEPALIVED_STATUS,
            message: format!("VRRP state {state}"),
        });
        v.push(Truth {
            type_: types::KEEPALIVED_STATS_FILE,
            ok: ctx.keepalived_stats,
            reason: pick(
                ctx.keepalived_stats,
                reasons::STATS_UP_TO_DATE,
                reasons::COULD_NOT_READ_STATS,
            ),
            message: if ctx.keepalived_stats {
                "keepalived's statistics were read at the last refresh".to_string()
            } else {
                "keepalived's statistics could not be read".to_string()
            },
        });
    }
    if let Some(b) = &s.bgp {
        let announcing = b.announced > 0;
        v.push(Truth {
            type_: types::BGP_ANNOUNCED,
            ok: announcing,
            reason: pick(
                announcing,
                reasons::BGP_ANNOUNCING,
                reasons::BGP_WITHDRAWN,
            ),
            message: if announcing {
                format!("{} VIPs announced over BGP", b.announced)
            } else {
                "the VIPs are not announced: the machine is not eligible (data plane attached, config current, flows synced)".to_string()
            },
        });
        let down: Vec<String> = b
            .sessions
            .iter()
            .filter(|(_, st)| *st != SessionState::Established)
            .map(|(peer, st)| match st {
                SessionState::Stuck => format!("{peer} (down for 30 s or longer)"),
                _ => peer.to_string(),
            })
            .collect();
        let up = !b.sessions.is_empty() && down.is_empty();
        v.push(Truth {
            type_: types::BGP_SESSIONS,
            ok: up,
            reason: pick(up, reasons::BGP_ESTABLISHED, reasons::BGP_NOT_ESTABLISHED),
            message: if up {
                format!("BGP sessions established with {} routers", b.sessions.len())
            } else if b.sessions.is_empty() {
                "BIRD does not answer on its control socket (not started, or restarting)"
                    .to_string()
            } else {
                format!(
                    "BGP session not established with {} (the agent's log has BIRD's reason)",
                    down.join(", ")
                )
            },
        });
    }
    if let Some(e) = s.vip_eligibility {
        let (reason, message) = vip_eligibility_words(e);
        v.push(Truth {
            type_: cond::VIP_ELIGIBLE,
            ok: e.eligible(),
            reason,
            message: message.to_string(),
        });
    }
    for u in &ctx.facts.unsupported {
        let (type_, reason) = unsupported_condition(u.option);
        v.push(Truth {
            type_,
            ok: false,
            reason,
            message: truncate(&u.message),
        });
    }
    v
}

/// `VIPEligible`'s reason and message (the Event on a loss of eligibility says the same).
pub(super) fn vip_eligibility_words(e: VipEligibility) -> (&'static str, &'static str) {
    match e {
        VipEligibility::Eligible => (
            reasons::VIP_ELIGIBLE,
            "the machine takes the VIPs' traffic: data plane attached, configuration current, flows synced with its peers",
        ),
        VipEligibility::NotReady => (
            reasons::VIP_NOT_READY,
            "not eligible for the VIPs' traffic: the data plane is not attached or does not run the latest configuration",
        ),
        VipEligibility::NotSynced => (
            reasons::VIP_NOT_SYNCED,
            "not eligible for the VIPs' traffic: the flow table has not caught up with the peers yet",
        ),
    }
}

fn up_to_date_message(s: &AgentStatus) -> String {
    let generation = |g: Option<u64>| g.map_or_else(|| "none".to_string(), |g| g.to_string());
    if !s.dataplane_ready {
        "the data plane is not attached".to_string()
    } else if let Some(why) = &s.source_stale {
        format!(
            "not confirmed: {why}; the data plane runs generation {}",
            generation(s.applied_generation)
        )
    } else if s.config_error.is_some() {
        format!(
            "the latest configuration (generation {}) is not in the data plane; generation {} keeps forwarding",
            generation(s.desired_generation),
            generation(s.applied_generation)
        )
    } else if s.up_to_date() {
        format!(
            "the data plane runs configuration generation {}",
            generation(s.applied_generation)
        )
    } else {
        format!(
            "the data plane runs generation {}, desired is {}",
            generation(s.applied_generation),
            generation(s.desired_generation)
        )
    }
}

/// The machine's new `status.conditions`: ours set from `status` and `ctx` (heartbeat = `now`; transition
/// time only changes when a status flips), `LogForward` / `ProxyProtocol` removed when the LoadBalancer no longer
/// asks for the option, conditions written by others (`MarkedForDeletion`) kept as they are, sorted by type like
/// yawol's.
pub fn conditions(
    prev: &[NodeCondition],
    status: &AgentStatus,
    ctx: &Context,
    now: &Time,
) -> Vec<NodeCondition> {
    let mut out = prev.to_vec();
    for option in UnsupportedOption::ALL {
        if ctx.facts.unsupported.iter().all(|u| u.option != option) {
            let (type_, _) = unsupported_condition(option);
            out.retain(|c| c.type_ != type_);
        }
    }
    for t in truths(status, ctx) {
        let value = if t.ok { cond::TRUE } else { cond::FALSE };
        set_condition(&mut out, t.type_, value, t.reason, &t.message, now.clone());
    }
    out.sort_by(|a, b| a.type_.cmp(&b.type_));
    out
}

/// yawol's metric list (`status.metrics`), every entry stamped `now`.
pub fn metrics_list(metrics: &[(String, String)], now: &Time) -> Vec<LoadBalancerMachineMetric> {
    metrics
        .iter()
        .map(|(type_, value)| LoadBalancerMachineMetric {
            type_: type_.clone(),
            value: value.clone(),
            time: now.clone(),
        })
        .collect()
}

/// The merge patch for the status subresource. Conditions and metrics are whole lists (JSON merge
/// patch replaces arrays), so the patch carries the `resourceVersion` they were computed from: a
/// concurrent writer (the controller's `MarkedForDeletion`) makes it fail with 409 instead of being
/// overwritten.
pub fn status_patch(
    resource_version: Option<&str>,
    conditions: &[NodeCondition],
    metrics: &[LoadBalancerMachineMetric],
) -> serde_json::Value {
    let mut patch = json!({ "status": { "conditions": conditions, "metrics": metrics } });
    if let Some(rv) = resource_version {
        patch["metadata"] = json!({ "resourceVersion": rv });
    }
    patch
}

/// Exponential backoff for status writes: from `min(1 s, max)`, doubling, capped at `max` (the requeue
/// period, so an outage never delays heartbeats more than a normal period would).
#[derive(Clone, Debug)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// A backoff capped at `max`.
    pub fn new(max: Duration) -> Self {
        let first = Duration::from_secs(1).min(max);
        Backoff {
            first,
            max,
            next: first,
        }
    }

    /// The delay before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(self.max);
        d
    }

    /// Back to the first delay (after a success).
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

/// The status reporter: writes the machine's status on every change of the agent's status (or of what the source
/// learnt from the LoadBalancer) and at least every requeue period (heartbeat).
pub(super) struct StatusReporter {
    pub machines: Api<LoadBalancerMachine>,
    pub settings: KubeSettings,
    pub recorder: Arc<Recorder>,
    /// What the config source published.
    pub config: watch::Receiver<ConfigState>,
    /// What the agent loop publishes.
    pub status: watch::Receiver<AgentStatus>,
    /// Why the config source is not in sync with the API server (`None`: it is).
    pub stale: watch::Receiver<Option<String>>,
    /// The agent's metrics.
    pub snapshot: SharedSnapshot,
    pub feedback: Feedback,
}

impl StatusReporter {
    /// Runs until the agent's status channel closes.
    pub(super) async fn run(mut self) {
        let what = format!(
            "LoadBalancerMachine {}/{}",
            self.settings.namespace, self.settings.machine
        );
        let mut backoff = Backoff::new(self.settings.requeue);
        // Events compare against an agent that has done nothing yet.
        let mut seen = AgentStatus::default();
        // The status last written successfully: an unchanged status waits for the heartbeat, so health-check
        // churn (which re-sends the same status) does not turn into API writes.
        let mut written: Option<(AgentStatus, LbFacts)> = None;
        let mut deadline = Instant::now();
        loop {
            tokio::select! {
                r = self.status.changed() => {
                    if r.is_err() {
                        tracing::info!("the agent stopped; status reporting ends");
                        return;
                    }
                }
                // The source ends only with the agent; then the branch above ends the loop.
                Ok(()) = self.stale.changed() => {}
                Ok(()) = self.feedback.facts.changed() => {}
                _ = tokio::time::sleep_until(deadline) => {}
            }
            let current = self.current_status();
            let facts = self.feedback.facts.borrow_and_update().clone();
            if written.as_ref() == Some(&(current.clone(), facts.clone()))
                && Instant::now() < deadline
            {
                continue;
            }
            let events = status_events(&seen, &current, &self.config.borrow());
            for e in &events {
                self.recorder.publish(e).await;
            }
            seen = current.clone();
            let new_config = written.as_ref().map(|(w, _)| w.desired_generation)
                != Some(current.desired_generation);
            match self.write_status(&current, &facts, new_config).await {
                Ok(()) => {
                    tracing::debug!(object = %what, "status written");
                    written = Some((current, facts));
                    backoff.reset();
                    deadline = Instant::now() + self.settings.requeue;
                }
                Err(e) => {
                    let delay = backoff.next_delay();
                    tracing::warn!(object = %what, error = %format!("{e:#}"), retry_in = ?delay, "writing the status failed");
                    written = None;
                    deadline = Instant::now() + delay;
                }
            }
        }
    }

    /// The agent's own status plus whether the configuration source is in sync — and whether the agent has taken
    /// what the source last published: right after a relist the source is in sync while the agent loop may not
    /// have seen the new generation yet, and its status would claim the old one is up to date.
    fn current_status(&mut self) -> AgentStatus {
        let status = self.status.borrow_and_update().clone();
        let published = match &*self.config.borrow() {
            ConfigState::Valid(_, g) | ConfigState::Invalid(_, g) => Some(*g),
            ConfigState::Pending => None,
        };
        let source_stale = self.stale.borrow_and_update().clone().or_else(|| {
            published
                .filter(|g| status.desired_generation != Some(*g))
                .map(|g| format!("the agent has not taken generation {g} of the LoadBalancer yet"))
        });
        AgentStatus {
            source_stale,
            ..status
        }
    }

    /// Read-modify-write of the machine's status (conditions of others are kept), retried on conflicts. Without
    /// `--machine-revision` the machine's revision annotation read on the way goes to the source.
    async fn write_status(
        &self,
        status: &AgentStatus,
        facts: &LbFacts,
        new_config: bool,
    ) -> Result<()> {
        const ATTEMPTS: usize = 3;
        let (machines, settings) = (&self.machines, &self.settings);
        let name = &settings.machine;
        for attempt in 1..=ATTEMPTS {
            let lbm = machines.get(name).await.map_err(|e| match &e {
                ::kube::Error::Api(s) if s.is_not_found() => anyhow::anyhow!(
                    "LoadBalancerMachine {}/{name} does not exist (check --namespace and --loadbalancer-machine-name)",
                    settings.namespace
                ),
                // kube's error text already includes its cause: one line, no `{:#}` chain repeating it.
                _ => anyhow::anyhow!("reading LoadBalancerMachine {}/{name}: {e}", settings.namespace),
            })?;
            if settings.machine_revision.is_none() {
                let annotated = lbm
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(lb_api::constants::lb_annotations::REVISION))
                    .map(|r| r.trim().to_string());
                self.feedback.revision.send_if_modified(|r| {
                    let changed = *r != annotated;
                    if changed {
                        tracing::info!(revision = ?annotated, "the machine's revision (from its annotation)");
                    }
                    *r = annotated.clone();
                    changed
                });
            }
            let prev = lbm
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_deref())
                .unwrap_or_default();
            let now = (settings.clock)();
            let yawollet = settings.yawollet;
            let (metrics, keepalived_stats) = {
                let snap = self.snapshot.read().unwrap_or_else(|e| e.into_inner());
                let stats = snap.ha.as_ref().is_some_and(|h| h.vrrp_stats.is_some());
                let with_stats = yawollet.is_none_or(|y| y.keepalived_stats);
                (snap.yawol_metrics(with_stats), stats)
            };
            let ctx = Context {
                facts: facts.clone(),
                keepalived_stats,
                yawollet,
                new_config,
            };
            let conds = conditions(prev, status, &ctx, &now);
            let metrics = metrics_list(&metrics, &now);
            let patch = status_patch(lbm.metadata.resource_version.as_deref(), &conds, &metrics);
            match machines
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => return Ok(()),
                Err(::kube::Error::Api(s)) if s.is_conflict() && attempt < ATTEMPTS => {
                    tracing::debug!(
                        attempt,
                        "LoadBalancerMachine changed meanwhile; retrying the status write"
                    );
                }
                Err(e) => {
                    return Err(anyhow::anyhow!(
                        "patching LoadBalancerMachine {}/{name} status: {e}",
                        settings.namespace
                    ))
                }
            }
        }
        unreachable!("the last attempt returns")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::kubernetes::test_support::{running, t};

    #[test]
    fn the_message_names_the_hook_and_a_stale_source_is_not_up_to_date() {
        let c = conditions(&[], &running(3), &Context::default(), &t(0));
        assert_eq!(
            find(&c, cond::DATAPLANE_READY).message.as_deref(),
            Some("the data plane is attached (TC (tcx))")
        );
        assert_eq!(find(&c, cond::DATAPLANE_UP_TO_DATE).status, cond::TRUE);
        // On more interfaces, each with its hook.
        let two = AgentStatus {
            attached: vec![
                ("eth0".into(), crate::dataplane::AttachMode::XdpNative),
                ("eth1".into(), crate::dataplane::AttachMode::XdpGeneric),
            ],
            ..running(3)
        };
        let c = conditions(&[], &two, &Context::default(), &t(0));
        assert_eq!(
            find(&c, cond::DATAPLANE_READY).message.as_deref(),
            Some("the data plane is attached (eth0: XDP, eth1: generic XDP)")
        );
        // Native XDP transmitting under a lock is said, and stays ready.
        let locked = AgentStatus {
            attached: vec![("eth0".into(), crate::dataplane::AttachMode::XdpNative)],
            xdp_tx_locked: vec!["eth0".into()],
            ..running(3)
        };
        let c = conditions(&[], &locked, &Context::default(), &t(0));
        let ready = find(&c, cond::DATAPLANE_READY);
        assert_eq!(ready.status, cond::TRUE);
        assert_eq!(
            ready.message.as_deref(),
            Some(
                "the data plane is attached (XDP); XDP_TX shares the stack's transmit queues under a lock on eth0 \
                 (too few virtio-net queue pairs)"
            )
        );
        let stale = AgentStatus {
            source_stale: Some(
                "the LoadBalancer watch is not in sync with the API server (watch stream failed)"
                    .into(),
            ),
            ..running(3)
        };
        let c = conditions(&[], &stale, &Context::default(), &t(0));
        let up = find(&c, cond::DATAPLANE_UP_TO_DATE);
        assert_eq!(up.status, cond::FALSE);
        assert!(
            up.message.as_deref().unwrap().starts_with(
                "not confirmed: the LoadBalancer watch is not in sync with the API server (watch stream failed)"
            ),
            "{up:?}"
        );
        assert_eq!(find(&c, cond::ENVOY_UP_TO_DATE).status, cond::FALSE);
        assert_eq!(find(&c, cond::DATAPLANE_READY).status, cond::TRUE);
    }

    #[test]
    fn vrrp_state_becomes_keepalived_conditions() {
        let mut s = running(1);
        let c = conditions(&[], &s, &Context::default(), &t(0));
        assert!(
            c.iter().all(|c| !c.type_.starts_with("Keepalived")),
            "no VRRP, no conditions"
        );
        s.vrrp = Some(crate::ha::vrrp::VrrpState::Master);
        let c = conditions(&[], &s, &Context::default(), &t(0));
        assert_eq!(find(&c, cond::KEEPALIVED_MASTER).status, cond::TRUE);
        assert_eq!(find(&c, cond::KEEPALIVED_PROCESS).status, cond::TRUE);
        s.vrrp = Some(crate::ha::vrrp::VrrpState::Stopped);
        let c = conditions(&c, &s, &Context::default(), &t(1));
        assert_eq!(find(&c, cond::KEEPALIVED_MASTER).status, cond::FALSE);
        assert_eq!(find(&c, cond::KEEPALIVED_PROCESS).status, cond::FALSE);
    }

    #[test]
    fn the_bgp_announcement_becomes_conditions() {
        use crate::report::BgpStatus;
        let mut s = running(1);
        let c = conditions(&[], &s, &Context::default(), &t(0));
        assert!(
            c.iter().all(|c| !c.type_.starts_with("BGP")),
            "no BGP, no conditions"
        );
        let router: std::net::IpAddr = "10.0.0.1".parse().unwrap();
        s.bgp = Some(BgpStatus {
            announced: 1,
            sessions: vec![(router, SessionState::Established)],
        });
        let c = conditions(&[], &s, &Context::default(), &t(0));
        assert_eq!(find(&c, types::BGP_ANNOUNCED).status, cond::TRUE);
        assert_eq!(find(&c, types::BGP_SESSIONS).status, cond::TRUE);
        s.bgp = Some(BgpStatus {
            announced: 0,
            sessions: vec![(router, SessionState::Stuck)],
        });
        let c = conditions(&c, &s, &Context::default(), &t(1));
        let announced = find(&c, types::BGP_ANNOUNCED);
        assert_eq!(
            (announced.status.as_str(), announced.reason.as_deref()),
            (cond::FALSE, Some(reasons::BGP_WITHDRAWN))
        );
        let sessions = find(&c, types::BGP_SESSIONS);
        assert_eq!(sessions.status, cond::FALSE);
        assert!(sessions.message.as_deref().unwrap().contains("10.0.0.1"));
    }

    #[test]
    fn vip_eligibility_becomes_a_condition_when_active_active() {
        let mut s = running(1);
        let c = conditions(&[], &s, &Context::default(), &t(0));
        assert!(
            c.iter().all(|c| c.type_ != cond::VIP_ELIGIBLE),
            "not active-active, no condition"
        );
        let state = |c: &[NodeCondition]| {
            let c = find(c, "VIPEligible");
            (
                c.status.clone(),
                c.reason.clone().unwrap(),
                c.last_heartbeat_time.clone().unwrap(),
                c.last_transition_time.clone().unwrap(),
            )
        };
        let four = |st: &str, r: &str, beat: i64, flip: i64| {
            (st.to_string(), r.to_string(), t(beat), t(flip))
        };
        s.vip_eligibility = Some(VipEligibility::NotReady);
        let c = conditions(&[], &s, &Context::default(), &t(0));
        assert_eq!(state(&c), four("False", "NotReady", 0, 0));
        // Still not eligible for another reason: no transition.
        s.vip_eligibility = Some(VipEligibility::NotSynced);
        let c = conditions(&c, &s, &Context::default(), &t(1));
        assert_eq!(state(&c), four("False", "NotSynced", 1, 0));
        assert!(find(&c, "VIPEligible")
            .message
            .as_deref()
            .unwrap()
            .contains("caught up with the peers"));
        s.vip_eligibility = Some(VipEligibility::Eligible);
        let c = conditions(&c, &s, &Context::default(), &t(2));
        assert_eq!(state(&c), four("True", "Eligible", 2, 2));
        // The heartbeat moves, the transition time stays.
        let c = conditions(&c, &s, &Context::default(), &t(30));
        assert_eq!(state(&c), four("True", "Eligible", 30, 2));
        s.vip_eligibility = Some(VipEligibility::NotReady);
        let c = conditions(&c, &s, &Context::default(), &t(31));
        assert_eq!(state(&c), four("False", "NotReady", 31, 31));
    }

    /// What yawol-controller and yawol's dashboards read: the yawol-named conditions with yawollet's reasons.
    #[test]
    fn yawols_condition_types_and_reasons() {
        let reason = |c: &[NodeCondition], ty: &str| {
            let c = find(c, ty);
            (c.status.clone(), c.reason.clone().unwrap())
        };
        let pair = |s: &str, r: &str| (s.to_string(), r.to_string());
        let mut s = running(1);
        s.vrrp = Some(crate::ha::vrrp::VrrpState::Master);
        let ctx = Context {
            keepalived_stats: true,
            ..Default::default()
        };
        let c = conditions(&[], &s, &ctx, &t(0));
        assert_eq!(
            reason(&c, "ConfigReady"),
            pair("True", "EnvoyConfigurationUpToDate")
        );
        assert_eq!(reason(&c, "EnvoyReady"), pair("True", "EnvoyReady"));
        assert_eq!(
            reason(&c, "EnvoyUpToDate"),
            pair("True", "EnvoySnapshotUpToDate")
        );
        assert_eq!(
            reason(&c, "KeepalivedMaster"),
            pair("True", "KeepalivedStatus")
        );
        assert_eq!(
            reason(&c, "KeepalivedProcess"),
            pair("True", "KeepalivedIsRunning")
        );
        assert_eq!(
            reason(&c, "KeepalivedStatsFile"),
            pair("True", "StatsUpToDate")
        );
        // The False side.
        let down = AgentStatus {
            dataplane_ready: false,
            config_error: Some("bad".into()),
            vrrp: Some(crate::ha::vrrp::VrrpState::Stopped),
            ..running(1)
        };
        let c = conditions(&c, &down, &Context::default(), &t(1));
        assert_eq!(
            reason(&c, "ConfigReady"),
            pair("False", "EnvoyConfigurationFailed")
        );
        assert_eq!(reason(&c, "EnvoyReady"), pair("False", "EnvoyNotReady"));
        assert_eq!(
            reason(&c, "EnvoyUpToDate"),
            pair("False", "EnvoySnapshotUpToDate")
        );
        assert_eq!(
            reason(&c, "KeepalivedMaster"),
            pair("False", "KeepalivedStatus")
        );
        assert_eq!(
            reason(&c, "KeepalivedProcess"),
            pair("False", "CouldNotKeepalivedProcess")
        );
        assert_eq!(
            reason(&c, "KeepalivedStatsFile"),
            pair("False", "CouldNotReadStats")
        );
    }

    /// Started as yawollet: `ConfigReady`'s reasons follow yawollet's reconciles, and `--keepalived-stats-file=""`
    /// leaves out the conditions yawollet takes from keepalived's stats file.
    #[test]
    fn as_yawollet_config_ready_and_stats_conditions() {
        use crate::source::kubernetes::yawollet::Compat;
        let mut s = running(1);
        s.vrrp = Some(crate::ha::vrrp::VrrpState::Master);
        let ctx = |keepalived_stats: bool, new_config: bool| Context {
            keepalived_stats: true,
            yawollet: Some(Compat { keepalived_stats }),
            new_config,
            ..Default::default()
        };
        let reason = |c: &[NodeCondition]| find(c, "ConfigReady").reason.clone().unwrap();
        let first = conditions(&[], &s, &ctx(true, true), &t(0));
        assert_eq!(reason(&first), "EnvoyConfigurationUpToDate");
        let later = conditions(&first, &s, &ctx(true, false), &t(1));
        assert_eq!(reason(&later), "EnvoyConfigurationCreated");
        assert_eq!(
            find(&later, "ConfigReady").last_transition_time,
            find(&first, "ConfigReady").last_transition_time,
            "a reason change is no transition"
        );
        // lb-agent's own mode keeps one reason.
        let own = Context {
            new_config: false,
            ..Default::default()
        };
        assert_eq!(
            reason(&conditions(&[], &s, &own, &t(0))),
            "EnvoyConfigurationUpToDate"
        );

        assert!([
            "KeepalivedMaster",
            "KeepalivedStatsFile",
            "KeepalivedProcess"
        ]
        .iter()
        .all(|ty| later.iter().any(|c| c.type_ == *ty)));
        let off = conditions(&[], &s, &ctx(false, false), &t(0));
        assert!(
            off.iter()
                .all(|c| c.type_ != "KeepalivedMaster" && c.type_ != "KeepalivedStatsFile"),
            "{off:?}"
        );
        assert_eq!(find(&off, "KeepalivedProcess").status, cond::TRUE);
    }

    #[test]
    fn unsupported_options_are_reported_false_while_asked_for() {
        let options = serde_json::from_value(json!({
            "logForward": {"enabled": true, "lokiUrl": "http://loki:3100/loki/api/v1/push"},
            "tcpProxyProtocol": true,
        }))
        .unwrap();
        let ports: Vec<k8s_openapi::api::core::v1::ServicePort> = serde_json::from_value(json!([
            {"port": 443, "protocol": "TCP", "nodePort": 30443},
            {"port": 53, "protocol": "UDP", "nodePort": 30053},
        ]))
        .unwrap();
        let both = Context {
            facts: LbFacts {
                unsupported: crate::source::config::unsupported_options(&ports, &options, false),
            },
            ..Default::default()
        };
        let c = conditions(&[], &running(1), &both, &t(0));
        let lf = find(&c, "LogForward");
        assert_eq!(lf.status, "False");
        assert_eq!(lf.reason.as_deref(), Some("LogForwardNotSupported"));
        assert!(
            lf.message.as_deref().unwrap().contains("http://loki:3100"),
            "{lf:?}"
        );
        let pp = find(&c, "ProxyProtocol");
        assert_eq!(pp.status, "False");
        assert_eq!(pp.reason.as_deref(), Some("ProxyProtocolNotSupported"));
        assert!(
            pp.message
                .as_deref()
                .unwrap()
                .contains("TCP port(s) 443 are"),
            "the UDP port is not named: {pp:?}"
        );
        // Readiness is not affected: the three conditions yawol-controller checks stay True.
        for ty in ["ConfigReady", "EnvoyReady", "EnvoyUpToDate"] {
            assert_eq!(find(&c, ty).status, "True");
        }
        let proxy_only = Context {
            facts: LbFacts {
                unsupported: both.facts.unsupported[1..].to_vec(),
            },
            ..Default::default()
        };
        let c = conditions(&c, &running(1), &proxy_only, &t(1));
        assert!(
            c.iter().all(|c| c.type_ != "LogForward"),
            "gone with the option"
        );
        assert_eq!(find(&c, "ProxyProtocol").status, "False");
        let c = conditions(&c, &running(1), &Context::default(), &t(2));
        assert!(
            c.iter().all(|c| c.type_ != "ProxyProtocol"),
            "gone with the option"
        );
    }

    fn find<'a>(c: &'a [NodeCondition], type_: &str) -> &'a NodeCondition {
        c.iter()
            .find(|c| c.type_ == type_)
            .unwrap_or_else(|| panic!("no {type_} in {c:?}"))
    }

    #[test]
    fn fresh_machine_gets_all_five_conditions_in_both_namings() {
        let c = conditions(&[], &running(3), &Context::default(), &t(0));
        let types: Vec<_> = c.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(
            types,
            [
                "ConfigReady",
                "DataplaneReady",
                "DataplaneUpToDate",
                "EnvoyReady",
                "EnvoyUpToDate"
            ],
            "sorted by type"
        );
        for c in &c {
            assert_eq!(c.status, "True", "{c:?}");
            assert_eq!(c.last_heartbeat_time, Some(t(0)));
            assert_eq!(c.last_transition_time, Some(t(0)));
        }
        assert_eq!(
            find(&c, "EnvoyUpToDate").reason.as_deref(),
            Some("EnvoySnapshotUpToDate")
        );
        assert!(find(&c, "DataplaneUpToDate")
            .message
            .as_deref()
            .unwrap()
            .contains("generation 3"));
    }

    #[test]
    fn heartbeat_moves_transition_time_only_on_flips() {
        let first = conditions(&[], &running(1), &Context::default(), &t(0));
        let again = conditions(&first, &running(1), &Context::default(), &t(30));
        for c in &again {
            assert_eq!(c.last_heartbeat_time, Some(t(30)));
            assert_eq!(
                c.last_transition_time,
                Some(t(0)),
                "{} did not flip",
                c.type_
            );
        }
        // A newer desired generation not yet applied: UpToDate flips, the rest only beat.
        let lagging = AgentStatus {
            desired_generation: Some(2),
            ..running(1)
        };
        let c = conditions(&again, &lagging, &Context::default(), &t(60));
        for ty in ["DataplaneUpToDate", "EnvoyUpToDate"] {
            assert_eq!(find(&c, ty).status, "False");
            assert_eq!(find(&c, ty).last_transition_time, Some(t(60)));
        }
        assert_eq!(find(&c, "ConfigReady").last_transition_time, Some(t(0)));
        assert_eq!(find(&c, "EnvoyReady").last_heartbeat_time, Some(t(60)));
    }

    #[test]
    fn conditions_of_others_are_kept() {
        let marked = NodeCondition {
            type_: cond::MARKED_FOR_DELETION.into(),
            status: "True".into(),
            reason: Some(cond::REASON_PENDING_DELETION.into()),
            message: None,
            last_heartbeat_time: Some(t(-5)),
            last_transition_time: Some(t(-5)),
        };
        let c = conditions(
            std::slice::from_ref(&marked),
            &running(1),
            &Context::default(),
            &t(0),
        );
        assert_eq!(c.len(), 6);
        assert_eq!(find(&c, "MarkedForDeletion"), &marked, "untouched");
    }

    #[test]
    fn invalid_config_makes_config_and_up_to_date_false_but_not_ready() {
        let s = AgentStatus {
            config_error: Some("invalid configuration:\n  - ports[0]: port 0".into()),
            desired_generation: Some(2),
            ..running(1)
        };
        let c = conditions(&[], &s, &Context::default(), &t(0));
        assert_eq!(find(&c, "ConfigReady").status, "False");
        assert_eq!(
            find(&c, "ConfigReady").reason.as_deref(),
            Some("EnvoyConfigurationFailed")
        );
        assert!(find(&c, "ConfigReady")
            .message
            .as_deref()
            .unwrap()
            .contains("port 0"));
        assert_eq!(find(&c, "EnvoyUpToDate").status, "False");
        assert!(find(&c, "EnvoyUpToDate")
            .message
            .as_deref()
            .unwrap()
            .contains("generation 1 keeps forwarding"));
        assert_eq!(find(&c, "EnvoyReady").status, "True");
        assert_eq!(find(&c, "DataplaneReady").status, "True");
    }

    #[test]
    fn nothing_configured_yet_is_pending() {
        let s = AgentStatus {
            dataplane_ready: true,
            ..Default::default()
        };
        let c = conditions(&[], &s, &Context::default(), &t(0));
        assert_eq!(
            find(&c, "ConfigReady").reason.as_deref(),
            Some("ConfigurationPending")
        );
        assert_eq!(find(&c, "ConfigReady").status, "False");
        assert_eq!(find(&c, "DataplaneUpToDate").status, "False");
        let c = conditions(&[], &AgentStatus::default(), &Context::default(), &t(0));
        assert_eq!(find(&c, "EnvoyReady").status, "False");
        assert_eq!(
            find(&c, "EnvoyReady").reason.as_deref(),
            Some("EnvoyNotReady")
        );
    }

    #[test]
    fn patch_carries_resource_version_and_yawol_metric_shape() {
        let m = metrics_list(&[("load1".into(), "0.5".into())], &t(0));
        let p = status_patch(
            Some("42"),
            &conditions(&[], &running(1), &Context::default(), &t(0)),
            &m,
        );
        assert_eq!(p["metadata"]["resourceVersion"], "42");
        assert_eq!(
            p["status"]["metrics"][0],
            json!({"type": "load1", "value": "0.5", "timestamp": "2023-11-14T22:13:20Z"})
        );
        let c = &p["status"]["conditions"][0];
        for key in [
            "type",
            "status",
            "reason",
            "message",
            "lastHeartbeatTime",
            "lastTransitionTime",
        ] {
            assert!(c.get(key).is_some(), "{key} missing in {c}");
        }
        assert!(status_patch(None, &[], &[]).get("metadata").is_none());
    }

    #[test]
    fn backoff_doubles_up_to_the_requeue_period() {
        let mut b = Backoff::new(Duration::from_secs(5));
        let d: Vec<_> = (0..5).map(|_| b.next_delay().as_secs()).collect();
        assert_eq!(d, [1, 2, 4, 5, 5]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_secs(1));
        assert_eq!(
            Backoff::new(Duration::from_millis(200)).next_delay(),
            Duration::from_millis(200)
        );
    }
}
