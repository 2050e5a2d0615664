//! `/metrics`, `/healthz` and `/readyz`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::metrics::Metrics;

/// Liveness/readiness shared with the probe endpoints.
#[derive(Debug, Default)]
pub struct Health {
    /// Caches are synced and the controllers run.
    pub ready: AtomicBool,
    /// A controller loop ended unexpectedly.
    pub failed: AtomicBool,
}

/// Parses `:8080`, `0.0.0.0:8080`, `[::]:8080`; "0" or "" disables (None).
pub fn parse_bind_address(text: &str) -> anyhow::Result<Option<SocketAddr>> {
    match text {
        "" | "0" => Ok(None),
        t if t.starts_with(':') => Ok(Some(
            format!("0.0.0.0{t}")
                .parse()
                .with_context(|| format!("bad address {t:?}"))?,
        )),
        t => Ok(Some(
            t.parse().with_context(|| format!("bad address {t:?}"))?,
        )),
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_addresses() {
        assert_eq!(
            parse_bind_address(":8080").unwrap(),
            Some("0.0.0.0:8080".parse().unwrap())
        );
        assert_eq!(
            parse_bind_address("127.0.0.1:9").unwrap(),
            Some("127.0.0.1:9".parse().unwrap())
        );
        assert_eq!(parse_bind_address("0").unwrap(), None);
        assert!(parse_bind_address("nope").is_err());
    }
}
