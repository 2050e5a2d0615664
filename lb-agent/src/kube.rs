//! Kubernetes mode: the yawollet's role. The agent takes its configuration from its own `LoadBalancer`
//! and reports on its own `LoadBalancerMachine`, so an unmodified yawol-controller can drive machines that
//! run this agent (inventory §3.6).
//!
//! Two tasks, started by [`start`]:
//! - the **config source** watches the one LoadBalancer (field selector on its name) and publishes a
//!   [`ConfigState`] for [`crate::agent::run`]: `Pending` until `status.portIP` (the VIP) is set, `Valid`
//!   with the object's `metadata.generation`, or `Invalid` (plus a Warning Event) — the agent keeps the
//!   last valid configuration forwarding;
//! - the **status reporter** merge-patches `LoadBalancerMachine.status` (status subresource): the
//!   conditions `ConfigReady`, `DataplaneReady`, `DataplaneUpToDate` and the same truths as yawol's
//!   `EnvoyReady` / `EnvoyUpToDate`, heartbeats every requeue period, and yawol's metric list.
//!
//! API errors never end either task: the watch retries with kube-runtime's backoff, status writes with
//! [`Backoff`]. Everything between the API and those actions is in plain functions ([`config_from_lb`],
//! [`conditions`], [`status_events`], [`metrics_list`], [`status_patch`]) covered by unit tests.

use crate::agent::{AgentStatus, ConfigState};
use crate::config::desired;
use crate::health::HealthCheckSpec;
use crate::metrics::SharedSnapshot;
use ::kube::api::{Api, Patch, PatchParams, PostParams};
use ::kube::config::{KubeConfigOptions, Kubeconfig};
use ::kube::runtime::watcher;
use ::kube::{Client, Config};
use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, EventSource, NodeCondition, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use lb_api::constants::{conditions as cond, API_VERSION};
use lb_api::watch::{is_gone, WatchBackoff};
use lb_api::{set_condition, LoadBalancer, LoadBalancerMachine, LoadBalancerMachineMetric};
use serde_json::json;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Mutex};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// `source.component` / `reportingComponent` of the Events the agent writes.
pub const EVENT_COMPONENT: &str = "lb-agent";

/// Longest condition or Event message written. Kubernetes does not cap NodeCondition messages, but a
/// spec with many errors should not bloat the object that every controller watches.
const MAX_MESSAGE: usize = 1024;

/// Condition reasons. The yawol-named conditions use yawol's reasons where yawol has one, so dashboards
/// and alerts written for yawol keep matching.
pub mod reasons {
    /// `ConfigReady=True` (yawol's reason).
    pub const CONFIG_UP_TO_DATE: &str = "EnvoyConfigurationUpToDate";
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
    /// `EnvoyUpToDate=False`.
    pub const ENVOY_NOT_UP_TO_DATE: &str = "EnvoySnapshotNotUpToDate";
    /// `KeepalivedMaster` (yawol's reason, both statuses).
    pub const KEEPALIVED_STATUS: &str = "KeepalivedStatus";
    /// `KeepalivedProcess=True` (yawol's reason).
    pub const KEEPALIVED_RUNNING: &str = "KeepalivedIsRunning";
    /// `KeepalivedProcess=False`.
    pub const KEEPALIVED_NOT_RUNNING: &str = "KeepalivedNotRunning";
}

/// Event reasons.
pub mod event_reasons {
    /// Warning: the LoadBalancer's spec (or VIP) was rejected; the last valid configuration keeps forwarding.
    pub const CONFIG_REJECTED: &str = "ConfigurationRejected";
    /// Warning: a valid configuration could not be written to the data plane.
    pub const APPLY_FAILED: &str = "ApplyFailed";
    /// Warning: the data plane is no longer attached.
    pub const DATAPLANE_NOT_READY: &str = "DataplaneNotReady";
    /// Normal: a new configuration generation is in the data plane (yawol's reason for a new snapshot).
    pub const UPDATE: &str = "Update";
}

/// Source of "now" for condition and metric timestamps; injectable so tests control heartbeats.
pub type Clock = Arc<dyn Fn() -> Time + Send + Sync>;

/// The wall clock, truncated to whole seconds: `metav1.Time` is serialized with second precision, and
/// truncating here keeps what is compared in memory equal to what the API server stores.
pub fn system_clock() -> Clock {
    Arc::new(|| {
        let now = Timestamp::now();
        Time(Timestamp::from_second(now.as_second()).unwrap_or(now))
    })
}

/// Settings of Kubernetes mode.
#[derive(Clone)]
pub struct KubeSettings {
    /// Namespace of the LoadBalancer and the LoadBalancerMachine.
    pub namespace: String,
    /// Name of this machine's LoadBalancer.
    pub loadbalancer: String,
    /// Name of this machine's LoadBalancerMachine.
    pub machine: String,
    /// Health checking of backends (the LoadBalancer has no such field; it comes from the agent's flags).
    pub health_check: HealthCheckSpec,
    /// Heartbeat period: the status is rewritten at least this often (yawol's `--requeue-time`).
    pub requeue: Duration,
    /// Time source of heartbeats and metric timestamps.
    pub clock: Clock,
    /// Revision of this machine's LoadBalancerSet (`--machine-revision`), compared with the LoadBalancer's.
    pub machine_revision: Option<String>,
}

impl std::fmt::Debug for KubeSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeSettings")
            .field("namespace", &self.namespace)
            .field("loadbalancer", &self.loadbalancer)
            .field("machine", &self.machine)
            .field("health_check", &self.health_check)
            .field("requeue", &self.requeue)
            .finish_non_exhaustive()
    }
}

/// A kube client from `--kubeconfig`, else the usual inference ($KUBECONFIG, ~/.kube/config, in-cluster).
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client> {
    crate::tls::install_crypto_provider();
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))?
        }
        None => Config::infer()
            .await
            .context("no Kubernetes configuration found (give --kubeconfig, set $KUBECONFIG, or run in a pod)")?,
    };
    Client::try_from(config).context("creating the Kubernetes client")
}

/// The running Kubernetes mode. Dropping it stops both tasks.
pub struct KubeMode {
    /// The configuration for [`crate::agent::run`].
    pub config: watch::Receiver<ConfigState>,
    tasks: Vec<JoinHandle<()>>,
}

impl KubeMode {
    /// Whether any task has ended (they only end when the agent's status channel closes, or on a panic).
    pub fn is_finished(&self) -> bool {
        self.tasks.iter().any(JoinHandle::is_finished)
    }
}

impl Drop for KubeMode {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Starts the config source and the status reporter. `status` is what the agent loop publishes,
/// `snapshot` its metrics. Must be called inside a Tokio runtime.
pub fn start(
    client: Client,
    settings: KubeSettings,
    status: watch::Receiver<AgentStatus>,
    snapshot: SharedSnapshot,
) -> KubeMode {
    let (tx, rx) = watch::channel(ConfigState::Pending);
    let (stale_tx, stale_rx) = watch::channel(Some("not listed yet".to_string()));
    let recorder = Arc::new(Recorder::new(client.clone(), &settings));
    let lbs: Api<LoadBalancer> = Api::namespaced(client.clone(), &settings.namespace);
    let machines: Api<LoadBalancerMachine> = Api::namespaced(client, &settings.namespace);
    let source = tokio::spawn(run_config_source(
        lbs,
        settings.clone(),
        tx,
        stale_tx,
        recorder.clone(),
    ));
    let reporter = tokio::spawn(run_status_reporter(
        machines,
        settings,
        recorder,
        rx.clone(),
        status,
        stale_rx,
        snapshot,
    ));
    KubeMode {
        config: rx,
        tasks: vec![source, reporter],
    }
}

// ---------------------------------------------------------------------------------------------------
// Pure logic
// ---------------------------------------------------------------------------------------------------

/// The agent's configuration from its LoadBalancer: the VIP is `status.portIP` (`Pending` until the
/// controller has created the port), services from the spec, generation = `metadata.generation`.
pub fn config_from_lb(lb: &LoadBalancer, health_check: &HealthCheckSpec) -> ConfigState {
    let generation = lb.metadata.generation.unwrap_or(0).max(0) as u64;
    let port_ip = lb
        .status
        .as_ref()
        .and_then(|s| s.port_ip.as_deref())
        .map(str::trim)
        .filter(|s| !s.is_empty());
    let Some(port_ip) = port_ip else {
        return ConfigState::Pending;
    };
    let vip: IpAddr = match port_ip.parse() {
        Ok(ip) => ip,
        Err(_) => {
            return ConfigState::Invalid(
                format!("status.portIP: {port_ip:?} is not an IP address"),
                generation,
            )
        }
    };
    // SNAT: `None` = the VIP, which lets a standby replica take over return traffic; the agent's
    // --snat-address overrides it in the agent loop.
    match desired(
        vip,
        None,
        lb.spec.ports(),
        lb.spec.endpoints(),
        lb.spec.options(),
        health_check.clone(),
    ) {
        Ok(c) => ConfigState::Valid(Arc::new(c), generation),
        Err(e) => ConfigState::Invalid(format!("{e:#}"), generation),
    }
}

/// Adds what HA needs from the LoadBalancer's annotations to a valid config: the sync peers (machines'
/// addresses, written by the controller) and whether this machine is of the newest revision. A malformed peer
/// is skipped with a warning; the others still sync.
pub fn with_ha_hints(
    state: ConfigState,
    lb: &LoadBalancer,
    machine_revision: Option<&str>,
) -> ConfigState {
    let ConfigState::Valid(cfg, generation) = state else {
        return state;
    };
    let ann = lb.metadata.annotations.as_ref();
    let peers = ann
        .and_then(|a| a.get(lb_api::constants::lb_annotations::SYNC_PEERS))
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .filter_map(|p| match p.parse::<IpAddr>() {
                    Ok(ip) => Some(ip),
                    Err(_) => {
                        tracing::warn!(
                            peer = p,
                            "ignoring a malformed sync peer in the LoadBalancer annotation"
                        );
                        None
                    }
                })
                .collect::<Vec<_>>()
        });
    let newest = machine_revision.map(|mine| {
        ann.and_then(|a| a.get(lb_api::constants::lb_annotations::REVISION))
            .is_some_and(|current| current.trim() == mine.trim())
    });
    let mut c = (*cfg).clone();
    c.sync_peers = peers;
    c.newest_revision = newest;
    ConfigState::Valid(Arc::new(c), generation)
}

/// Whether two states would make the agent do the same thing (no need to wake it).
pub fn same_config(a: &ConfigState, b: &ConfigState) -> bool {
    match (a, b) {
        (ConfigState::Pending, ConfigState::Pending) => true,
        (ConfigState::Valid(a, ga), ConfigState::Valid(b, gb)) => ga == gb && a == b,
        (ConfigState::Invalid(a, ga), ConfigState::Invalid(b, gb)) => ga == gb && a == b,
        _ => false,
    }
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
fn truths(s: &AgentStatus) -> Vec<Truth> {
    let (config_ok, config_reason, config_msg) = match (&s.config_error, s.desired_generation) {
        (Some(e), _) => (false, reasons::CONFIG_FAILED, truncate(e)),
        (None, Some(g)) => (
            true,
            reasons::CONFIG_UP_TO_DATE,
            format!("configuration generation {g} is valid"),
        ),
        (None, None) => (
            false,
            reasons::CONFIG_PENDING,
            "waiting for the LoadBalancer and its status.portIP (VIP)".to_string(),
        ),
    };
    let ready_msg = match (s.dataplane_ready, s.attached) {
        (true, Some(mode)) => format!("the data plane is attached ({})", mode.describe()),
        (true, None) => "the data plane is attached".to_string(),
        (false, _) => "the data plane is not attached".to_string(),
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
        v.push(Truth {
            type_: cond::KEEPALIVED_MASTER,
            ok: state == crate::vrrp::VrrpState::Master,
            reason: reasons::KEEPALIVED_STATUS,
            message: format!("VRRP state {state}"),
        });
    }
    v
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

/// The machine's new `status.conditions`: ours set from `status` (heartbeat = `now`; transition time
/// only changes when a status flips), conditions written by others (`MarkedForDeletion`, keepalived)
/// kept as they are, sorted by type like yawol's.
pub fn conditions(prev: &[NodeCondition], status: &AgentStatus, now: &Time) -> Vec<NodeCondition> {
    let mut out = prev.to_vec();
    for t in truths(status) {
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

/// Cuts a message to [`MAX_MESSAGE`] bytes at a character boundary.
fn truncate(s: &str) -> String {
    if s.len() <= MAX_MESSAGE {
        return s.to_string();
    }
    let mut end = MAX_MESSAGE - '…'.len_utf8();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
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

// ---------------------------------------------------------------------------------------------------
// Actions
// ---------------------------------------------------------------------------------------------------

/// Writes core/v1 Events about the LoadBalancerMachine. Best effort: failures are logged, never retried
/// (the same problem shows in the conditions, which are retried).
struct Recorder {
    events: Api<Event>,
    machines: Api<LoadBalancerMachine>,
    namespace: String,
    machine: String,
    /// The machine's uid, looked up once: `kubectl describe` finds Events by it.
    uid: Mutex<Option<String>>,
}

impl Recorder {
    fn new(client: Client, settings: &KubeSettings) -> Self {
        Recorder {
            events: Api::namespaced(client.clone(), &settings.namespace),
            machines: Api::namespaced(client, &settings.namespace),
            namespace: settings.namespace.clone(),
            machine: settings.machine.clone(),
            uid: Mutex::new(None),
        }
    }

    async fn publish(&self, event: &MachineEvent) {
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
        let now = Time(Timestamp::now());
        let ev = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!("{}.", self.machine)),
                namespace: Some(self.namespace.clone()),
                ..Default::default()
            },
            involved_object: ObjectReference {
                api_version: Some(API_VERSION.to_string()),
                kind: Some("LoadBalancerMachine".to_string()),
                name: Some(self.machine.clone()),
                namespace: Some(self.namespace.clone()),
                uid,
                ..Default::default()
            },
            type_: Some(if event.warning { "Warning" } else { "Normal" }.to_string()),
            reason: Some(event.reason.to_string()),
            message: Some(event.message.clone()),
            count: Some(1),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            source: Some(EventSource {
                component: Some(EVENT_COMPONENT.to_string()),
                host: None,
            }),
            reporting_component: Some(EVENT_COMPONENT.to_string()),
            reporting_instance: Some(self.machine.clone()),
            ..Default::default()
        };
        if let Err(e) = self.events.create(&PostParams::default(), &ev).await {
            tracing::warn!(error = %e, reason = event.reason, "could not write an Event on the LoadBalancerMachine");
        }
    }
}

/// Watches the LoadBalancer and publishes its configuration; runs until aborted. `stale` says whether what was
/// published is known to be the latest: from a watch error until a fresh list has completed it names the error.
///
/// Every error starts a fresh watcher (a list, then a watch): kube-runtime's watcher resumes a broken watch from
/// its last resourceVersion without a list, and nothing then tells when it has caught up, while a completed list
/// is a definite "in sync" (one object, by name: the list is cheap). A 410 Gone (the watch's resourceVersion was
/// compacted away: the server is up and asks for a relist) is relisted at once instead of waiting out a backoff
/// grown earlier. Other errors wait for the backoff (0.8 s doubling to 30 s, jitter): after an outage the first list
/// comes at its next step, while the status says the configuration is not confirmed.
async fn run_config_source(
    lbs: Api<LoadBalancer>,
    settings: KubeSettings,
    tx: watch::Sender<ConfigState>,
    stale: watch::Sender<Option<String>>,
    recorder: Arc<Recorder>,
) {
    let name = &settings.loadbalancer;
    let what = format!("LoadBalancer {}/{name}", settings.namespace);
    // The name as a field selector also makes the list and watch authorised by the per-machine Role's
    // resourceNames (a namespace-wide list is Forbidden to the machine's token).
    let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut backoff = WatchBackoff::default();
    loop {
        let mut stream = std::pin::pin!(watcher(lbs.clone(), cfg.clone()));
        // A relist (Init … InitDone) is buffered so a LoadBalancer missing after the relist is noticed.
        let mut relisted: Option<LoadBalancer> = None;
        let error = loop {
            let Some(event) = stream.next().await else {
                break None;
            };
            match event {
                Ok(watcher::Event::Init) => relisted = None,
                Ok(watcher::Event::InitApply(lb)) => relisted = Some(lb),
                Ok(watcher::Event::InitDone) => {
                    match relisted.take() {
                        Some(lb) => publish(&lb, &settings, &tx, &recorder).await,
                        None => tracing::warn!(object = %what,
                            "not found; waiting for it (a configuration already in the data plane keeps forwarding)"),
                    }
                    if stale.send_replace(None).is_some() {
                        tracing::info!(object = %what, "listed again; the configuration source is in sync");
                    }
                }
                Ok(watcher::Event::Apply(lb)) => publish(&lb, &settings, &tx, &recorder).await,
                Ok(watcher::Event::Delete(_)) => tracing::warn!(object = %what,
                    "deleted; the configuration in the data plane keeps forwarding until the machine is removed"),
                Err(e) => break Some(e),
            }
        };
        let delay = match &error {
            Some(e) if is_gone(e) => Duration::ZERO,
            _ => backoff.next().unwrap_or(Duration::from_secs(30)),
        };
        let message = error.map_or_else(|| "the watch ended".to_string(), |e| e.to_string());
        tracing::warn!(object = %what, error = %message, retry_in = ?delay, "watch failed; listing again");
        stale.send_replace(Some(truncate(&format!(
            "the LoadBalancer watch is not in sync with the API server ({message})"
        ))));
        tokio::time::sleep(delay).await;
    }
}

/// Sends the LoadBalancer's configuration to the agent if it changed; reports rejections.
async fn publish(
    lb: &LoadBalancer,
    settings: &KubeSettings,
    tx: &watch::Sender<ConfigState>,
    recorder: &Recorder,
) {
    let state = with_ha_hints(
        config_from_lb(lb, &settings.health_check),
        lb,
        settings.machine_revision.as_deref(),
    );
    // Status-only updates (replica counts, reconcile timestamps) must not wake the agent.
    if same_config(&tx.borrow(), &state) {
        return;
    }
    match &state {
        ConfigState::Pending => {
            tracing::info!("LoadBalancer has no status.portIP (VIP) yet; waiting")
        }
        ConfigState::Valid(c, generation) => {
            tracing::info!(
                generation,
                services = c.services.len(),
                "new configuration from the LoadBalancer"
            )
        }
        ConfigState::Invalid(msg, generation) => {
            tracing::error!(generation, error = %msg, "LoadBalancer rejected; the last valid configuration keeps forwarding");
            recorder
                .publish(&MachineEvent {
                    warning: true,
                    reason: event_reasons::CONFIG_REJECTED,
                    message: truncate(&format!(
                        "LoadBalancer generation {generation} rejected, the last valid configuration keeps forwarding: {msg}"
                    )),
                })
                .await;
        }
    }
    // No receiver only happens during shutdown.
    let _ = tx.send(state);
}

/// Writes the machine's status on every change of the agent's status and at least every requeue
/// period (heartbeat); runs until the agent's status channel closes.
async fn run_status_reporter(
    machines: Api<LoadBalancerMachine>,
    settings: KubeSettings,
    recorder: Arc<Recorder>,
    config: watch::Receiver<ConfigState>,
    mut status: watch::Receiver<AgentStatus>,
    mut stale: watch::Receiver<Option<String>>,
    snapshot: SharedSnapshot,
) {
    let what = format!(
        "LoadBalancerMachine {}/{}",
        settings.namespace, settings.machine
    );
    let mut backoff = Backoff::new(settings.requeue);
    // Events compare against an agent that has done nothing yet.
    let mut seen = AgentStatus::default();
    // The status last written successfully: an unchanged status waits for the heartbeat, so health-check
    // churn (which re-sends the same status) does not turn into API writes.
    let mut written: Option<AgentStatus> = None;
    let mut deadline = Instant::now();
    // The agent's own status plus whether the configuration source is in sync — and whether the agent has taken
    // what the source last published: right after a relist the source is in sync while the agent loop may not have
    // seen the new generation yet, and its status would claim the old one is up to date.
    let current_status = |status: &mut watch::Receiver<AgentStatus>,
                          stale: &mut watch::Receiver<Option<String>>| {
        let status = status.borrow_and_update().clone();
        let published = match &*config.borrow() {
            ConfigState::Valid(_, g) | ConfigState::Invalid(_, g) => Some(*g),
            ConfigState::Pending => None,
        };
        let source_stale = stale.borrow_and_update().clone().or_else(|| {
            published
                .filter(|g| status.desired_generation != Some(*g))
                .map(|g| format!("the agent has not taken generation {g} of the LoadBalancer yet"))
        });
        AgentStatus {
            source_stale,
            ..status
        }
    };
    loop {
        tokio::select! {
            r = status.changed() => {
                if r.is_err() {
                    tracing::info!("the agent stopped; status reporting ends");
                    return;
                }
            }
            // The source ends only with the agent; then the branch above ends the loop.
            Ok(()) = stale.changed() => {}
            _ = tokio::time::sleep_until(deadline) => {}
        }
        let current = current_status(&mut status, &mut stale);
        if written.as_ref() == Some(&current) && Instant::now() < deadline {
            continue;
        }
        let events = status_events(&seen, &current, &config.borrow());
        for e in &events {
            recorder.publish(e).await;
        }
        seen = current.clone();
        match write_status(&machines, &settings, &current, &snapshot).await {
            Ok(()) => {
                tracing::debug!(object = %what, "status written");
                written = Some(current);
                backoff.reset();
                deadline = Instant::now() + settings.requeue;
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

/// Read-modify-write of the machine's status (conditions of others are kept), retried on conflicts.
async fn write_status(
    machines: &Api<LoadBalancerMachine>,
    settings: &KubeSettings,
    status: &AgentStatus,
    snapshot: &SharedSnapshot,
) -> Result<()> {
    const ATTEMPTS: usize = 3;
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
        let prev = lbm
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_deref())
            .unwrap_or_default();
        let now = (settings.clock)();
        let conds = conditions(prev, status, &now);
        let metrics = metrics_list(
            &snapshot
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .yawol_metrics(),
            &now,
        );
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    fn t(s: i64) -> Time {
        Time(Timestamp::from_second(1_700_000_000 + s).unwrap())
    }

    fn running(generation: u64) -> AgentStatus {
        AgentStatus {
            dataplane_ready: true,
            config_error: None,
            desired_generation: Some(generation),
            applied_generation: Some(generation),
            vrrp: None,
            attached: Some(crate::dataplane::AttachMode::Tc),
            source_stale: None,
        }
    }

    #[test]
    fn the_message_names_the_hook_and_a_stale_source_is_not_up_to_date() {
        let c = conditions(&[], &running(3), &t(0));
        assert_eq!(
            find(&c, cond::DATAPLANE_READY).message.as_deref(),
            Some("the data plane is attached (TC (tcx))")
        );
        assert_eq!(find(&c, cond::DATAPLANE_UP_TO_DATE).status, cond::TRUE);
        let stale = AgentStatus {
            source_stale: Some(
                "the LoadBalancer watch is not in sync with the API server (watch stream failed)"
                    .into(),
            ),
            ..running(3)
        };
        let c = conditions(&[], &stale, &t(0));
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
        let c = conditions(&[], &s, &t(0));
        assert!(
            c.iter().all(|c| !c.type_.starts_with("Keepalived")),
            "no VRRP, no conditions"
        );
        s.vrrp = Some(crate::vrrp::VrrpState::Master);
        let c = conditions(&[], &s, &t(0));
        assert_eq!(find(&c, cond::KEEPALIVED_MASTER).status, cond::TRUE);
        assert_eq!(find(&c, cond::KEEPALIVED_PROCESS).status, cond::TRUE);
        s.vrrp = Some(crate::vrrp::VrrpState::Stopped);
        let c = conditions(&c, &s, &t(1));
        assert_eq!(find(&c, cond::KEEPALIVED_MASTER).status, cond::FALSE);
        assert_eq!(find(&c, cond::KEEPALIVED_PROCESS).status, cond::FALSE);
    }

    #[test]
    fn ha_hints_come_from_the_loadbalancer_annotations() {
        use lb_api::constants::lb_annotations::{REVISION, SYNC_PEERS};
        let mut l = lb(json!({
            "spec": {"ports": [{"name": "web", "protocol": "TCP", "port": 80, "nodePort": 30080}]},
            "status": {"portIP": "10.0.0.9"}
        }));
        let base = config_from_lb(&l, &HealthCheckSpec::default());
        let ConfigState::Valid(c, _) = with_ha_hints(base.clone(), &l, Some("3")) else {
            panic!("valid")
        };
        assert_eq!(
            (c.sync_peers.clone(), c.newest_revision),
            (None, Some(false))
        );
        l.metadata.annotations = Some(
            [
                (
                    SYNC_PEERS.to_string(),
                    "10.0.0.5, bogus,10.0.0.6".to_string(),
                ),
                (REVISION.to_string(), "3".to_string()),
            ]
            .into(),
        );
        let ConfigState::Valid(c, _) = with_ha_hints(base, &l, Some("3")) else {
            panic!("valid")
        };
        let peers: Vec<IpAddr> = vec!["10.0.0.5".parse().unwrap(), "10.0.0.6".parse().unwrap()];
        assert_eq!(c.sync_peers, Some(peers), "the malformed peer is skipped");
        assert_eq!(c.newest_revision, Some(true));
    }

    fn find<'a>(c: &'a [NodeCondition], type_: &str) -> &'a NodeCondition {
        c.iter()
            .find(|c| c.type_ == type_)
            .unwrap_or_else(|| panic!("no {type_} in {c:?}"))
    }

    fn lb(json: serde_json::Value) -> LoadBalancer {
        let mut base = json!({
            "apiVersion": API_VERSION, "kind": "LoadBalancer",
            "metadata": {"name": "lb", "namespace": "ns", "generation": 3},
            "spec": {
                "selector": {},
                "infrastructure": {
                    "defaultNetwork": {"networkID": "net"},
                    "flavor": {"flavorID": "f"}, "image": {"imageID": "i"},
                    "availabilityZone": "az", "authSecretRef": {"name": "s", "namespace": "ns"}
                }
            }
        });
        kube_testenv::json_merge(&mut base, &json);
        serde_json::from_value(base).unwrap()
    }

    #[test]
    fn fresh_machine_gets_all_five_conditions_in_both_namings() {
        let c = conditions(&[], &running(3), &t(0));
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
        let first = conditions(&[], &running(1), &t(0));
        let again = conditions(&first, &running(1), &t(30));
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
        let c = conditions(&again, &lagging, &t(60));
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
        let c = conditions(std::slice::from_ref(&marked), &running(1), &t(0));
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
        let c = conditions(&[], &s, &t(0));
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
        let c = conditions(&[], &s, &t(0));
        assert_eq!(
            find(&c, "ConfigReady").reason.as_deref(),
            Some("ConfigurationPending")
        );
        assert_eq!(find(&c, "ConfigReady").status, "False");
        assert_eq!(find(&c, "DataplaneUpToDate").status, "False");
        let c = conditions(&[], &AgentStatus::default(), &t(0));
        assert_eq!(find(&c, "EnvoyReady").status, "False");
        assert_eq!(
            find(&c, "EnvoyReady").reason.as_deref(),
            Some("EnvoyNotReady")
        );
    }

    #[test]
    fn lb_without_port_ip_is_pending() {
        let l = lb(json!({"spec": {"ports": [{"port": 80, "nodePort": 30080}]}}));
        assert!(matches!(
            config_from_lb(&l, &HealthCheckSpec::default()),
            ConfigState::Pending
        ));
        let l = lb(json!({"status": {"portIP": " "}}));
        assert!(matches!(
            config_from_lb(&l, &HealthCheckSpec::default()),
            ConfigState::Pending
        ));
    }

    #[test]
    fn lb_spec_becomes_services_with_the_objects_generation() {
        let l = lb(json!({
            "status": {"portIP": "192.0.2.10"},
            "spec": {
                "ports": [{"name": "web", "protocol": "TCP", "port": 80, "nodePort": 30080},
                          {"protocol": "UDP", "port": 53, "nodePort": 30053}],
                "endpoints": [{"name": "n1", "addresses": ["10.0.0.1"]}, {"name": "n2", "addresses": ["10.0.0.2", "fd00::2"]}],
                "options": {"loadBalancerSourceRanges": ["10.0.0.0/8"], "udpIdleTimeout": "10s"}
            }
        }));
        let ConfigState::Valid(c, generation) = config_from_lb(&l, &HealthCheckSpec::default())
        else {
            panic!("not valid")
        };
        assert_eq!(generation, 3);
        assert_eq!(c.services.len(), 2);
        let tcp = &c.services[0];
        assert_eq!(tcp.id.vip, "192.0.2.10".parse::<IpAddr>().unwrap());
        assert_eq!((tcp.id.port, tcp.id.protocol), (80, Protocol::Tcp));
        assert_eq!(
            tcp.backends,
            vec![
                "10.0.0.1:30080".parse().unwrap(),
                "10.0.0.2:30080".parse().unwrap()
            ]
        );
        assert_eq!(tcp.snat, None, "SNAT to the VIP");
        assert_eq!(c.services[1].idle_timeout, Duration::from_secs(10));
        assert_eq!(
            c.health_check,
            HealthCheckSpec::default(),
            "health checks from the flags"
        );
    }

    #[test]
    fn bad_vip_or_spec_is_invalid_with_the_generation() {
        let l = lb(json!({"status": {"portIP": "not-an-ip"}}));
        let ConfigState::Invalid(msg, 3) = config_from_lb(&l, &HealthCheckSpec::default()) else {
            panic!()
        };
        assert!(msg.contains("status.portIP"), "{msg}");
        let l = lb(json!({
            "status": {"portIP": "192.0.2.10"},
            "spec": {"ports": [{"protocol": "SCTP", "port": 80, "nodePort": 30080}, {"port": 0, "nodePort": 30081}],
                     "options": {"loadBalancerSourceRanges": ["10.0.0.0/33"]}}
        }));
        let ConfigState::Invalid(msg, 3) = config_from_lb(&l, &HealthCheckSpec::default()) else {
            panic!()
        };
        for needle in ["protocol \"SCTP\"", "port 0", "loadBalancerSourceRanges[0]"] {
            assert!(msg.contains(needle), "{needle} missing in {msg}");
        }
    }

    #[test]
    fn same_config_ignores_identity_but_not_generation() {
        let l = lb(
            json!({"status": {"portIP": "192.0.2.10"}, "spec": {"ports": [{"port": 80, "nodePort": 30080}]}}),
        );
        let a = config_from_lb(&l, &HealthCheckSpec::default());
        let b = config_from_lb(&l, &HealthCheckSpec::default());
        assert!(same_config(&a, &b));
        let mut l2 = l.clone();
        l2.metadata.generation = Some(4);
        assert!(!same_config(
            &a,
            &config_from_lb(&l2, &HealthCheckSpec::default())
        ));
        assert!(!same_config(&a, &ConfigState::Pending));
        assert!(same_config(&ConfigState::Pending, &ConfigState::Pending));
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
    fn patch_carries_resource_version_and_yawol_metric_shape() {
        let m = metrics_list(&[("load1".into(), "0.5".into())], &t(0));
        let p = status_patch(Some("42"), &conditions(&[], &running(1), &t(0)), &m);
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
    fn long_messages_are_cut_at_a_char_boundary() {
        let s = "ä".repeat(2000);
        let cut = truncate(&s);
        assert!(cut.len() <= MAX_MESSAGE);
        assert!(cut.ends_with('…'));
        assert_eq!(truncate("short"), "short");
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
