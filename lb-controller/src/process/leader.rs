//! Leader election through a `coordination.k8s.io/v1` Lease (client-go semantics): the holder
//! renews `renewTime` every retry period; others take over once `renewTime + leaseDuration` has
//! passed. A leader that cannot renew within the renew deadline stops (the process exits and is
//! restarted), so two instances never act at the same time for longer than the lease allows.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{PostParams, ResourceExt};
use kube::{Api, Client};
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::runtime::api_errors::is_conflict;

/// Lease parameters (yawol's `--leases-*` flags).
#[derive(Clone, Debug)]
pub struct LeaderElectionConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This instance's identity (pod name + random suffix).
    pub identity: String,
    /// How long a lease is valid after its last renewal.
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before giving up.
    pub renew_deadline: Duration,
    /// Interval between acquire/renew attempts.
    pub retry_period: Duration,
}

/// What to do with the current Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Nobody holds a valid lease: take it.
    Acquire,
    /// We hold it: renew it.
    Renew,
    /// Someone else holds a valid lease.
    Wait,
}

/// Pure decision from the current Lease (if any).
pub fn decide(
    lease: Option<&Lease>,
    identity: &str,
    now: Timestamp,
    default_duration: Duration,
) -> Decision {
    let Some(spec) = lease.and_then(|l| l.spec.as_ref()) else {
        return Decision::Acquire;
    };
    let holder = spec.holder_identity.as_deref().unwrap_or("");
    if holder == identity {
        return Decision::Renew;
    }
    if holder.is_empty() {
        return Decision::Acquire;
    }
    let duration = spec
        .lease_duration_seconds
        .map(|s| Duration::from_secs(s.max(0) as u64))
        .unwrap_or(default_duration);
    let renewed = spec
        .renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .map(|t| t.0);
    match renewed {
        Some(renewed)
            if now.duration_since(renewed).unsigned_abs() < duration && renewed <= now =>
        {
            Decision::Wait
        }
        Some(renewed) if renewed > now => Decision::Wait, // clock skew: be conservative
        _ => Decision::Acquire,
    }
}

/// Error ending leadership.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// Renewal did not succeed within the renew deadline.
    #[error("lost the leader lease {0}: could not renew within the deadline")]
    Lost(String),
}

struct Elector {
    api: Api<Lease>,
    config: LeaderElectionConfig,
}

impl Elector {
    /// One acquire/renew attempt; `Ok(true)` when we hold the lease afterwards.
    async fn try_acquire_or_renew(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let current = self.api.get_opt(&self.config.name).await?;
        let decision = decide(
            current.as_ref(),
            &self.config.identity,
            now,
            self.config.lease_duration,
        );
        if decision == Decision::Wait {
            return Ok(false);
        }
        let transitions = current
            .as_ref()
            .and_then(|l| l.spec.as_ref())
            .and_then(|s| s.lease_transitions)
            .unwrap_or(0);
        let acquire_time = match (&decision, current.as_ref().and_then(|l| l.spec.as_ref())) {
            (Decision::Renew, Some(spec)) => spec.acquire_time.clone(),
            _ => Some(MicroTime(now)),
        };
        let spec = LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: Some(self.config.lease_duration.as_secs() as i32),
            acquire_time,
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(if decision == Decision::Acquire && current.is_some() {
                transitions + 1
            } else {
                transitions
            }),
            ..Default::default()
        };
        let result = match current {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.config.name.clone()),
                        namespace: Some(self.config.namespace.clone()),
                        ..Default::default()
                    },
                    spec: Some(spec),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            Some(mut lease) => {
                // Replace with the read resourceVersion: a concurrent writer makes this fail.
                lease.spec = Some(spec);
                self.api
                    .replace(&lease.name_any(), &PostParams::default(), &lease)
                    .await
            }
        };
        match result {
            Ok(_) => Ok(true),
            Err(e) if is_conflict(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Gives the lease up so a standby takes over at once (on shutdown).
    async fn release(&self) {
        if let Ok(Some(mut lease)) = self.api.get_opt(&self.config.name).await {
            if let Some(spec) = lease.spec.as_mut() {
                if spec.holder_identity.as_deref() == Some(&self.config.identity) {
                    spec.holder_identity = None;
                    spec.lease_duration_seconds = Some(1);
                    let _ = self
                        .api
                        .replace(&self.config.name, &PostParams::default(), &lease)
                        .await;
                }
            }
        }
    }
}

/// Waits until this instance holds the lease, then runs `work` while renewing it. Returns `Ok` when `work`
/// finishes (it watches the shutdown signal itself; the lease is then released, so a standby takes over within one
/// retry period) or when `shutdown` resolves before leadership was won, and an error when the lease is lost.
pub async fn run_as_leader<F, S>(
    client: Client,
    config: LeaderElectionConfig,
    metrics: Arc<Metrics>,
    work: F,
    shutdown: S,
) -> Result<(), LeaderError>
where
    F: Future<Output = ()>,
    S: Future<Output = ()>,
{
    let elector = Elector {
        api: Api::namespaced(client, &config.namespace),
        config: config.clone(),
    };
    info!(
        lease = config.name,
        identity = config.identity,
        "waiting for leadership"
    );
    let acquire = async {
        loop {
            match elector.try_acquire_or_renew().await {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => warn!(error = %e, "leader election attempt failed"),
            }
            tokio::time::sleep(config.retry_period).await;
        }
    };
    tokio::select! {
        () = acquire => {}
        () = shutdown => {
            info!(lease = config.name, "shut down while waiting for leadership");
            return Ok(());
        }
    }
    info!(
        lease = config.name,
        identity = config.identity,
        "became leader"
    );
    metrics.leader.set(1);
    let renew = async {
        let mut last_renewal = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(config.retry_period).await;
            match elector.try_acquire_or_renew().await {
                Ok(true) => last_renewal = tokio::time::Instant::now(),
                Ok(false) => return LeaderError::Lost(config.name.clone()),
                Err(e) => warn!(error = %e, "lease renewal failed"),
            }
            if last_renewal.elapsed() > config.renew_deadline {
                return LeaderError::Lost(config.name.clone());
            }
        }
    };
    let result = tokio::select! {
        () = work => Ok(()),
        lost = renew => Err(lost),
    };
    metrics.leader.set(0);
    if result.is_ok() {
        elector.release().await;
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: &str, renewed: i64, duration: i32) -> Lease {
        Lease {
            metadata: ObjectMeta::default(),
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                lease_duration_seconds: Some(duration),
                renew_time: Some(MicroTime(Timestamp::from_second(renewed).unwrap())),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn decisions() {
        let now = Timestamp::from_second(1000).unwrap();
        let d = Duration::from_secs(60);
        assert_eq!(decide(None, "me", now, d), Decision::Acquire);
        assert_eq!(
            decide(Some(&lease("me", 990, 60)), "me", now, d),
            Decision::Renew
        );
        assert_eq!(
            decide(Some(&lease("other", 990, 60)), "me", now, d),
            Decision::Wait
        );
        assert_eq!(
            decide(Some(&lease("other", 900, 60)), "me", now, d),
            Decision::Acquire
        );
        assert_eq!(
            decide(Some(&lease("", 999, 60)), "me", now, d),
            Decision::Acquire
        );
        assert_eq!(
            decide(Some(&lease("other", 1010, 60)), "me", now, d),
            Decision::Wait
        );
    }
}
