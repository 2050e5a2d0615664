//! Kubernetes mode: the yawollet's role. The agent takes its configuration from its own `LoadBalancer`
//! and reports on its own `LoadBalancerMachine`, so an unmodified yawol-controller can drive machines that
//! run this agent (inventory §3.6).
//!
//! Two tasks, started by [`start`]:
//! - the **config source** ([`watch`]) watches the one LoadBalancer (field selector on its name) and
//!   publishes a [`ConfigState`] for [`crate::agent::run`]: `Pending` until `status.portIP` (the VIP) is set,
//!   `Valid` with the object's `metadata.generation`, or `Invalid` (plus a Warning Event) — the agent keeps
//!   the last valid configuration forwarding;
//! - the **status reporter** ([`status`]) merge-patches `LoadBalancerMachine.status` (status subresource):
//!   the conditions `ConfigReady`, `DataplaneReady`, `DataplaneUpToDate` and the same truths as yawol's
//!   `EnvoyReady` / `EnvoyUpToDate`, heartbeats every requeue period, and yawol's metric list.
//!
//! Both write core/v1 Events on the machine through one recorder ([`events`]). Besides the configuration the
//! source acts on what else the LoadBalancer asks of a machine: ad-hoc debug access ([`debug`]), and options this
//! image does not implement (log forwarding, PROXY protocol: [`crate::source::config::unsupported_options`]) — each
//! reported as a False condition (`LogForward`, `ProxyProtocol`) and a Warning Event with the same reason, never
//! ignored silently ([`LbFacts`]); the machine keeps forwarding. The machine's revision, when no `--machine-revision` is given, comes from
//! the LoadBalancerMachine's revision annotation (yawol-controller writes no flag for it): the reporter reads it
//! and hands it to the source. [`yawollet`] translates yawollet's command line (yawol-compatible images).
//!
//! API errors never end either task: the watch retries with `lb_api::watch::WatchBackoff`, status writes
//! with [`status::Backoff`]. Everything between the API and those actions is in plain functions
//! ([`watch::config_from_lb`], [`status::conditions`], [`events::status_events`], [`status::metrics_list`],
//! [`status::status_patch`]) covered by unit tests.

pub mod debug;
pub mod events;
pub mod status;
pub mod watch;
pub mod yawollet;

use crate::health::HealthCheckSpec;
use crate::report::metrics::SharedSnapshot;
use crate::report::AgentStatus;
use crate::source::ConfigState;
use ::kube::api::Api;
use ::kube::config::{KubeConfigOptions, Kubeconfig};
use ::kube::{Client, Config};
use anyhow::{Context, Result};
use events::Recorder;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use lb_api::{LoadBalancer, LoadBalancerMachine};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
// Renamed: `watch` here is the config source's module.
use tokio::sync::watch as channel;
use tokio::task::JoinHandle;

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
    /// Revision of this machine's LoadBalancerSet (`--machine-revision`), compared with the LoadBalancer's;
    /// `None`: the LoadBalancerMachine's revision annotation.
    pub machine_revision: Option<String>,
    /// Ad-hoc debug access on this machine (`None`: the annotations are not acted on, e.g. in tests).
    pub ad_hoc_debug: Option<debug::AdHocDebugSettings>,
    /// Started as `yawollet`: what yawollet does differently (`None`: lb-agent's own behaviour).
    pub yawollet: Option<yawollet::Compat>,
    /// The data plane inserts PROXY v2 headers (every XDP mode; not TC), so `tcpProxyProtocol` is honoured.
    pub proxy_v2: bool,
}

/// What the config source learnt from the LoadBalancer that goes into the machine's status but not into the
/// data plane.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LbFacts {
    /// Options of the LoadBalancer this image does not implement (each a False condition,
    /// [`status::unsupported_condition`]).
    pub unsupported: Vec<crate::source::config::Unsupported>,
}

impl std::fmt::Debug for KubeSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeSettings")
            .field("namespace", &self.namespace)
            .field("loadbalancer", &self.loadbalancer)
            .field("machine", &self.machine)
            .field("health_check", &self.health_check)
            .field("requeue", &self.requeue)
            .field("yawollet", &self.yawollet)
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
    pub config: channel::Receiver<ConfigState>,
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
    status: channel::Receiver<AgentStatus>,
    snapshot: SharedSnapshot,
) -> KubeMode {
    let (tx, rx) = channel::channel(ConfigState::Pending);
    let (stale_tx, stale_rx) = channel::channel(Some("not listed yet".to_string()));
    let (facts_tx, facts_rx) = channel::channel(LbFacts::default());
    let (revision_tx, revision_rx) = channel::channel(settings.machine_revision.clone());
    let recorder = Arc::new(Recorder::new(client.clone(), &settings));
    let lbs: Api<LoadBalancer> = Api::namespaced(client.clone(), &settings.namespace);
    let machines: Api<LoadBalancerMachine> = Api::namespaced(client, &settings.namespace);
    let source = tokio::spawn(watch::run_config_source(
        lbs,
        settings.clone(),
        tx,
        stale_tx,
        recorder.clone(),
        watch::Extras {
            facts: facts_tx,
            revision: revision_rx,
            ad_hoc_debug: settings
                .ad_hoc_debug
                .clone()
                .map(|s| debug::AdHocDebug::new(s, &settings.machine)),
            unsupported_reported: Vec::new(),
            warnings_reported: Vec::new(),
        },
    ));
    let reporter = tokio::spawn(
        status::StatusReporter {
            machines,
            settings,
            recorder,
            config: rx.clone(),
            status,
            stale: stale_rx,
            snapshot,
            feedback: status::Feedback {
                facts: facts_rx,
                revision: revision_tx,
            },
        }
        .run(),
    );
    KubeMode {
        config: rx,
        tasks: vec![source, reporter],
    }
}

/// Fixtures shared by the unit tests of the status reporter and the Event rules.
#[cfg(test)]
mod test_support {
    use crate::report::AgentStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;

    pub fn t(s: i64) -> Time {
        Time(Timestamp::from_second(1_700_000_000 + s).unwrap())
    }

    pub fn running(generation: u64) -> AgentStatus {
        AgentStatus {
            dataplane_ready: true,
            config_error: None,
            desired_generation: Some(generation),
            applied_generation: Some(generation),
            vrrp: None,
            bgp: None,
            vip_eligibility: None,
            attached: vec![("eth0".into(), crate::dataplane::AttachMode::Tc)],
            xdp_tx_locked: Vec::new(),
            source_stale: None,
        }
    }
}
