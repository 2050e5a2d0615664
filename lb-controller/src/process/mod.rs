//! The process around the controllers, the same for both commands of the binary: `/metrics` and the probes
//! ([`http`]), the leader Lease ([`leader`]), and [`supervise`], which runs one side's controllers inside them.

pub mod http;
pub mod leader;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kube::Client;

use crate::metrics::Metrics;
use http::Health;
use leader::LeaderElectionConfig;

/// The process around the controllers: where /metrics and the probes are served, and the leader Lease.
#[derive(Clone, Debug)]
pub struct Supervision {
    /// Address of /metrics (`http::parse_bind_address`; "0" disables).
    pub metrics_bind_address: String,
    /// Address of /healthz and /readyz ("0" disables).
    pub health_probe_bind_address: String,
    /// Leader election through a Lease in the control cluster, if enabled.
    pub election: Option<LeaderElectionConfig>,
}

/// Serves /metrics, /healthz and /readyz, then runs `controllers` (as the leader when an election is configured)
/// until they finish. Both commands of the binary run through this. Fails when the lease is lost or a controller
/// loop failed; a server that cannot bind ends the process.
pub async fn supervise(
    control: Client,
    supervision: Supervision,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    controllers: impl std::future::Future<Output = ()>,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let router = http::router(
        metrics.clone(),
        health.clone(),
        supervision.election.is_some(),
    );
    for address in [
        &supervision.metrics_bind_address,
        &supervision.health_probe_bind_address,
    ] {
        if let Some(addr) = http::parse_bind_address(address)? {
            let router = router.clone();
            tokio::spawn(async move {
                if let Err(e) = http::serve(addr, router).await {
                    tracing::error!(error = %e, "http server failed");
                    std::process::exit(1);
                }
            });
        }
    }
    match supervision.election {
        Some(election) => {
            leader::run_as_leader(control, election, metrics, controllers, shutdown).await?
        }
        None => controllers.await,
    }
    anyhow::ensure!(
        !health.failed.load(Ordering::SeqCst),
        "a controller loop failed"
    );
    Ok(())
}
