//! `/metrics`, `/healthz` and `/readyz`.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::metrics::Metrics;
use crate::run::Health;

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    /// Whether this instance takes part in leader election (a standby is ready but idle).
    leader_election: bool,
}

/// The probe and metrics routes.
pub fn router(metrics: Arc<Metrics>, health: Arc<Health>, leader_election: bool) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState {
            metrics,
            health,
            leader_election,
        })
}

async fn metrics_handler(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

async fn healthz(State(state): State<AppState>) -> impl IntoResponse {
    if state.health.failed.load(Ordering::SeqCst) {
        (StatusCode::SERVICE_UNAVAILABLE, "controller loop failed\n")
    } else {
        (StatusCode::OK, "ok\n")
    }
}

async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let leader = state.metrics.leader.get() == 1;
    let standby = state.leader_election && !leader;
    if state.health.ready.load(Ordering::SeqCst) || standby {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "caches not synced\n")
    }
}

/// Serves `router` on `addr` until the process ends.
pub async fn serve(addr: SocketAddr, router: Router) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("binding {addr}: {e}"))?;
    axum::serve(listener, router).await?;
    Ok(())
}
