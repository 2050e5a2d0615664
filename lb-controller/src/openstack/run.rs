//! Wiring of the OpenStack side (`lb-controller controller`, yawol-controller's role): the LoadBalancer,
//! LoadBalancerSet and LoadBalancerMachine controllers over one control-cluster client, sharing the cloud sessions,
//! the Events publisher and `/metrics`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kube::Client;
use tracing::info;

use crate::metrics::Metrics;
use crate::openstack::clouds::CloudFactory;
use crate::openstack::loadbalancer;
use crate::openstack::machine;
use crate::openstack::set;
use crate::process::http::Health;
use crate::runtime::events::EventPublisher;
use crate::runtime::stop::Stop;

/// Settings of the OpenStack-side controllers (`lb-controller controller`, yawol-controller's role).
#[derive(Clone, Debug)]
pub struct OpenStackRunConfig {
    /// Namespace of the LoadBalancer objects.
    pub namespace: String,
    /// LoadBalancer controller settings (resync, deletion poll).
    pub loadbalancer: loadbalancer::Config,
    /// Instance name on the Events (pod name).
    pub instance: String,
}

/// Settings of the LoadBalancerSet and LoadBalancerMachine controllers: the binary's come from its flags (or the
/// same names in the environment); the real-OpenStack benchmark shortens the resync periods.
#[derive(Clone, Debug)]
pub struct OpenStackTuning {
    /// LoadBalancerSet controller.
    pub sets: set::Config,
    /// LoadBalancerMachine controller.
    pub machines: machine::Config,
}

/// Runs the OpenStack-side controllers (LoadBalancer, LoadBalancerSet, LoadBalancerMachine) over `client` with the
/// clouds of `clouds` and `tuning` for the set and machine controllers until `shutdown` resolves, reporting on
/// `metrics`. Events use yawol's `yawol-service` component, so the back channel forwards the LoadBalancer's to the
/// Services. (`cli::run_openstack_controllers` takes the tuning from the environment, as the binary's flags.)
pub async fn run_openstack_controllers_with<F: CloudFactory>(
    client: Client,
    clouds: F,
    config: OpenStackRunConfig,
    tuning: OpenStackTuning,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    // The LoadBalancerMachine controller shares the cloud sessions (`CloudFactory for Arc<F>`) and /metrics.
    let clouds = Arc::new(clouds);
    let machines = machine::prepare(
        client.clone(),
        clouds.clone(),
        &metrics,
        &config.instance,
        tuning.machines,
    );
    let events = Arc::new(EventPublisher::new(
        client.clone(),
        lb_api::constants::defaults::USER_EVENT_COMPONENT,
        &config.instance,
    ));
    let ctx = Arc::new(loadbalancer::Context {
        client: client.clone(),
        clouds,
        events: events.clone(),
        config: config.loadbalancer,
        metrics: metrics.clone(),
    });
    let set_ctx = Arc::new(set::Context {
        client: client.clone(),
        events,
        metrics,
        config: tuning.sets,
    });
    let stop = Stop::on(shutdown);
    let machines = tokio::spawn({
        let (namespace, stop) = (config.namespace.clone(), stop.clone());
        async move { machine::run(machines, &namespace, stop).await }
    });
    // kube-runtime's controllers wait for their own caches; there is no earlier point to report.
    health.ready.store(true, Ordering::SeqCst);
    info!(
        namespace = config.namespace,
        "LoadBalancer and LoadBalancerSet controllers running"
    );
    tokio::join!(
        loadbalancer::run(ctx, &config.namespace, stop.clone()),
        set::run(set_ctx, &config.namespace, stop),
    );
    let _ = machines.await;
    health.ready.store(false, Ordering::SeqCst);
    info!("OpenStack-side controllers stopped");
}
