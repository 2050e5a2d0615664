//! Wiring of the cloud-controller side (`lb-controller run`): caches, triggers and the three loops (Service
//! controller, back-channel controller, event forwarder) over a target and a control client.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::channel::mpsc;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Service};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{controller, watcher};
use kube::{Api, Client, ResourceExt};
use lb_api::LoadBalancer;
use tracing::{debug, info, warn};

use crate::cloud::backchannel;
use crate::cloud::endpoints::NodeFingerprint;
use crate::cloud::service::{self, OwnWrites};
use crate::metrics::Metrics;
use crate::process::http::Health;
use crate::runtime::events::EventPublisher;
use crate::runtime::retry::{self, Retries};
use crate::runtime::stop::{drive, Stop};
use crate::runtime::watches;

/// Everything configurable about the running controllers.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Service controller settings (defaults, classes, resync).
    pub service: service::Config,
    /// Events older than this when first seen are not forwarded.
    pub event_max_age: Duration,
    /// Component name on the Events this controller publishes.
    pub event_component: String,
    /// Instance name on the Events (pod name).
    pub instance: String,
    /// Parallel reconciliations per controller.
    pub concurrency: u16,
}

/// Runs the controllers until `shutdown` resolves (then finishes in-flight reconciliations).
pub async fn run_controllers(
    target: Client,
    control: Client,
    config: RunConfig,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let namespace = config.service.defaults.namespace.clone();
    let (node_trigger_tx, node_trigger_rx) = mpsc::unbounded::<()>();
    let (nodes, node_writer) = reflector::store::<Node>();
    let node_stream = reflector::reflector(
        node_writer,
        watches::events(Api::<Node>::all(target.clone()), watcher::Config::default()),
    );
    let node_task = tokio::spawn(node_triggers(node_stream, node_trigger_tx));

    let lb_api: Api<LoadBalancer> = Api::namespaced(control.clone(), &namespace);
    let (loadbalancers, lb_writer) = reflector::store::<LoadBalancer>();
    let lb_stream = reflector::reflector(
        lb_writer,
        watches::events(lb_api.clone(), watcher::Config::default()),
    );
    let (lb_trigger_tx, lb_trigger_rx) = mpsc::unbounded::<ObjectRef<Service>>();
    let own_writes = OwnWrites::default();
    let lb_task = tokio::spawn(loadbalancer_triggers(
        lb_stream,
        lb_trigger_tx,
        own_writes.clone(),
    ));

    let stop = Stop::on(shutdown);
    info!("waiting for node and LoadBalancer caches");
    let caches =
        async { wait_ready(&nodes).await.is_ok() && wait_ready(&loadbalancers).await.is_ok() };
    tokio::select! {
        synced = caches => if !synced {
            health.failed.store(true, Ordering::SeqCst);
            return;
        },
        () = stop.clone().wait() => {
            node_task.abort();
            lb_task.abort();
            info!("stopped before the caches were synced");
            return;
        }
    }
    info!(
        nodes = nodes.state().len(),
        loadbalancers = loadbalancers.state().len(),
        "caches synced"
    );

    let events = Arc::new(EventPublisher::new(
        target.clone(),
        &config.event_component,
        &config.instance,
    ));
    let service_ctx = Arc::new(service::Context {
        target: target.clone(),
        control: control.clone(),
        config: config.service.clone(),
        nodes: nodes.clone(),
        loadbalancers: loadbalancers.clone(),
        events: events.clone(),
        metrics: metrics.clone(),
        retries: Default::default(),
        reported: Default::default(),
        own_writes,
        releasing: Default::default(),
        draining_dropped: Default::default(),
    });
    let backchannel_ctx = Arc::new(backchannel::Context {
        target: target.clone(),
        control: control.clone(),
        namespace: namespace.clone(),
        loadbalancers: loadbalancers.clone(),
        events,
        metrics: metrics.clone(),
        retries: Retries::new(retry::BASE, retry::OUTAGE_MAX),
        event_max_age: config.event_max_age,
    });

    let controller_config = controller::Config::default().concurrency(config.concurrency);
    let services = watches::controller(
        Api::<Service>::all(target.clone()),
        watcher::Config::default(),
    );
    let services_store = services.store();
    let services = services
        .with_config(controller_config.clone())
        .reconcile_on(lb_trigger_rx)
        .reconcile_all_on(node_trigger_rx)
        .graceful_shutdown_on(stop.clone().wait())
        .run(service::reconcile, service::error_policy, service_ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                debug!(error = %e, "service controller");
            }
        });
    let backchannel = watches::controller(lb_api, watcher::Config::default());
    let backchannel_store = backchannel.store();
    let backchannel = backchannel
        .with_config(controller_config)
        .graceful_shutdown_on(stop.clone().wait())
        .run(
            backchannel::reconcile,
            backchannel::error_policy,
            backchannel_ctx.clone(),
        )
        .for_each(|result| async move {
            if let Err(e) = result {
                debug!(error = %e, "back channel controller");
            }
        });
    let forwarder_stop = stop.clone().wait();
    let forwarder = async move {
        tokio::select! {
            () = backchannel::forward_events(backchannel_ctx) => {}
            () = forwarder_stop => {}
        }
    };

    health.ready.store(true, Ordering::SeqCst);
    info!("controllers running");
    tokio::join!(
        drive(services_store, services, stop.clone()),
        drive(backchannel_store, backchannel, stop),
        forwarder
    );
    health.ready.store(false, Ordering::SeqCst);
    node_task.abort();
    lb_task.abort();
    info!("controllers stopped");
}

async fn wait_ready<K: kube::Resource + Clone + 'static>(store: &Store<K>) -> Result<(), ()>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    store
        .wait_until_ready()
        .await
        .map_err(|_| warn!("cache writer dropped before sync"))
}

/// Drives the LoadBalancer cache and, after the cache has applied a change, asks the Service
/// controller to reconcile the LoadBalancer's Service (so edits by others are reverted and
/// deletions are noticed).
async fn loadbalancer_triggers<S>(
    stream: S,
    trigger: mpsc::UnboundedSender<ObjectRef<Service>>,
    own_writes: OwnWrites,
) where
    S: Stream<Item = Result<watcher::Event<LoadBalancer>, watcher::Error>>,
{
    futures::pin_mut!(stream);
    while let Some(item) = stream.next().await {
        let lb = match item {
            Ok(watcher::Event::Apply(lb)) if own_writes.is_own(&lb) => continue,
            Ok(watcher::Event::Delete(lb)) => {
                own_writes.forget(&lb.name_any());
                lb
            }
            Ok(watcher::Event::Apply(lb) | watcher::Event::InitApply(lb)) => lb,
            Ok(watcher::Event::Init | watcher::Event::InitDone) => continue,
            Err(e) => {
                warn!(error = %e, "LoadBalancer watch failed; retrying with backoff");
                continue;
            }
        };
        if let Some((namespace, name)) = backchannel::service_of(&lb) {
            if trigger
                .unbounded_send(ObjectRef::new(&name).within(&namespace))
                .is_err()
            {
                return;
            }
        }
    }
}

/// Drives the node cache and emits one trigger whenever the endpoint-relevant state of any node
/// changes (readiness, termination, addresses, add/delete). Heartbeat-only updates are ignored,
/// so a 1000-node cluster does not cause a reconcile storm.
async fn node_triggers<S>(stream: S, trigger: mpsc::UnboundedSender<()>)
where
    S: Stream<Item = Result<watcher::Event<Node>, watcher::Error>>,
{
    futures::pin_mut!(stream);
    let mut known: HashMap<String, NodeFingerprint> = HashMap::new();
    let mut relist: Option<HashMap<String, NodeFingerprint>> = None;
    let mut synced = false;
    while let Some(item) = stream.next().await {
        let event = match item {
            Ok(event) => event,
            Err(e) => {
                warn!(error = %e, "node watch failed; retrying with backoff");
                continue;
            }
        };
        let changed = match event {
            watcher::Event::Apply(node) => {
                let fingerprint = NodeFingerprint::of(&node);
                known.insert(node.name_any(), fingerprint.clone()) != Some(fingerprint)
            }
            watcher::Event::Delete(node) => known.remove(&node.name_any()).is_some(),
            watcher::Event::Init => {
                relist = Some(HashMap::new());
                false
            }
            watcher::Event::InitApply(node) => {
                relist
                    .get_or_insert_with(HashMap::new)
                    .insert(node.name_any(), NodeFingerprint::of(&node));
                false
            }
            watcher::Event::InitDone => {
                let fresh = relist.take().unwrap_or_default();
                let changed = fresh != known;
                known = fresh;
                // The first sync is not a change: the Service controller starts after it anyway.
                let changed = changed && synced;
                synced = true;
                changed
            }
        };
        if changed {
            debug!("node change: reconciling all services");
            if trigger.unbounded_send(()).is_err() {
                return;
            }
        }
    }
}
