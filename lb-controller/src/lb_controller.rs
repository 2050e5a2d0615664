//! The LoadBalancer controller (control cluster): finalizer, the OpenStack steps of [`crate::lb_openstack`] with the
//! status saved after each, throttled by [`lb_openstack::needs_openstack_reconcile`], Warning events with the
//! cloud's error text, and deletion (child LoadBalancerSets first, then the cloud resources, then the finalizer).
//!
//! The cloud comes from a [`CloudFactory`]: [`SecretClouds`] reads yawol's `cloudprovider.conf` from the Secret named
//! by `spec.infrastructure.authSecretRef` (with the `projectID` override); tests pass a fixed fake.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ObjectReference, Secret};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, Client, Resource, ResourceExt};
use lb_api::constants::finalizers;
use lb_api::{LoadBalancer, LoadBalancerSet, LoadBalancerStatus};
use serde_json::{json, Value};
use tracing::{info, warn};

use crate::events::{EventPublisher, EventType};
use crate::lb_openstack::{self, StatusSink};
use crate::openstack::sdk::SdkCloud;
use crate::openstack::{
    Cloud, CloudError, CloudErrorKind, CloudProviderConf, Credentials, OpenStackCalls,
};

/// Errors of one reconcile (logged, retried with backoff).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Kubernetes API.
    #[error("kubernetes: {0}")]
    Kube(#[from] kube::Error),
    /// No cloud session (credentials Secret, authentication).
    #[error("openstack credentials: {0:#}")]
    Credentials(anyhow::Error),
    /// An OpenStack step.
    #[error("{0}")]
    Step(#[from] lb_openstack::StepError),
}

/// Gives the cloud session for a LoadBalancer.
pub trait CloudFactory: Send + Sync + 'static {
    /// The cloud implementation.
    type Cloud: Cloud + 'static;
    /// The session for `lb` (its credentials Secret and project).
    fn cloud_for(
        &self,
        lb: &LoadBalancer,
    ) -> impl Future<Output = anyhow::Result<Arc<Self::Cloud>>> + Send;
}

/// One cloud for every LoadBalancer (tests, single-project installations).
pub struct FixedCloud<C>(pub Arc<C>);

impl<C: Cloud + 'static> CloudFactory for FixedCloud<C> {
    type Cloud = C;
    async fn cloud_for(&self, _lb: &LoadBalancer) -> anyhow::Result<Arc<C>> {
        Ok(self.0.clone())
    }
}

/// Sessions from the `cloudprovider.conf` Secrets, cached per (Secret, resourceVersion, project) so that rotated
/// credentials take effect and LoadBalancers of one project share a session. Sessions are renewed after
/// [`SecretClouds::MAX_SESSION_AGE`] (Keystone tokens expire).
pub struct SecretClouds {
    client: Client,
    timeout: Duration,
    calls: OpenStackCalls,
    cache: tokio::sync::Mutex<HashMap<String, (Instant, Arc<SdkCloud>)>>,
}

impl SecretClouds {
    /// Keystone's default token lifetime is 1 h; renew well before.
    pub const MAX_SESSION_AGE: Duration = Duration::from_secs(30 * 60);

    /// Reads Secrets with `client`; `timeout` per OpenStack call; calls counted in `calls`.
    pub fn new(client: Client, timeout: Duration, calls: OpenStackCalls) -> Self {
        SecretClouds {
            client,
            timeout,
            calls,
            cache: Default::default(),
        }
    }
}

impl CloudFactory for SecretClouds {
    type Cloud = SdkCloud;
    async fn cloud_for(&self, lb: &LoadBalancer) -> anyhow::Result<Arc<SdkCloud>> {
        use anyhow::Context as _;
        let r = &lb.spec.infrastructure.auth_secret_ref;
        let ns = r
            .namespace
            .clone()
            .or_else(|| lb.namespace())
            .unwrap_or_default();
        let name = r.name.clone().unwrap_or_default();
        let secret = Api::<Secret>::namespaced(self.client.clone(), &ns)
            .get(&name)
            .await
            .with_context(|| format!("reading Secret {ns}/{name}"))?;
        let project = lb
            .spec
            .infrastructure
            .project_id
            .clone()
            .filter(|p| !p.is_empty());
        let key = format!(
            "{ns}/{name}@{}#{}",
            secret.metadata.resource_version.as_deref().unwrap_or(""),
            project.as_deref().unwrap_or("")
        );
        let mut cache = self.cache.lock().await;
        if let Some((at, cloud)) = cache.get(&key) {
            if at.elapsed() < Self::MAX_SESSION_AGE {
                return Ok(cloud.clone());
            }
        }
        let data = secret
            .data
            .as_ref()
            .and_then(|d| d.get("cloudprovider.conf"))
            .with_context(|| format!("Secret {ns}/{name} has no key cloudprovider.conf"))?;
        let text = String::from_utf8(data.0.clone()).context("cloudprovider.conf is not UTF-8")?;
        let config = CloudProviderConf::parse(&text)?.to_cloud_config(project.as_deref())?;
        let cloud = Arc::new(SdkCloud::connect(&config, self.timeout, self.calls.clone()).await?);
        // Old sessions of this Secret are dropped with their key.
        cache.retain(|k, _| !k.starts_with(&format!("{ns}/{name}@")) || k == &key);
        cache.insert(key, (Instant::now(), cloud.clone()));
        Ok(cloud)
    }
}

/// Sessions from one credentials file (`--cloudprovider-conf` or a `clouds.yaml` cloud) for every LoadBalancer,
/// connected on first use, one per project (the LoadBalancer's `projectID` override), renewed like
/// [`SecretClouds`]. `spec.infrastructure.authSecretRef` is not read.
pub struct FileClouds {
    credentials: Credentials,
    timeout: Duration,
    calls: OpenStackCalls,
    cache: tokio::sync::Mutex<HashMap<String, (Instant, Arc<SdkCloud>)>>,
}

impl FileClouds {
    /// `timeout` per OpenStack call; calls counted in `calls`.
    pub fn new(credentials: Credentials, timeout: Duration, calls: OpenStackCalls) -> Self {
        FileClouds {
            credentials,
            timeout,
            calls,
            cache: Default::default(),
        }
    }
}

impl CloudFactory for FileClouds {
    type Cloud = SdkCloud;
    async fn cloud_for(&self, lb: &LoadBalancer) -> anyhow::Result<Arc<SdkCloud>> {
        let project = lb
            .spec
            .infrastructure
            .project_id
            .clone()
            .filter(|p| !p.is_empty());
        let key = project.clone().unwrap_or_default();
        let mut cache = self.cache.lock().await;
        if let Some((at, cloud)) = cache.get(&key) {
            if at.elapsed() < SecretClouds::MAX_SESSION_AGE {
                return Ok(cloud.clone());
            }
        }
        let config = self.credentials.cloud_config(project.as_deref())?;
        let cloud = Arc::new(SdkCloud::connect(&config, self.timeout, self.calls.clone()).await?);
        cache.insert(key, (Instant::now(), cloud.clone()));
        Ok(cloud)
    }
}

/// The real clouds the binary chooses between (`lb-controller controller`): per-LoadBalancer Secrets (default) or
/// one credentials file.
pub enum SdkClouds {
    /// [`SecretClouds`].
    Secrets(SecretClouds),
    /// [`FileClouds`].
    File(FileClouds),
}

impl CloudFactory for SdkClouds {
    type Cloud = SdkCloud;
    async fn cloud_for(&self, lb: &LoadBalancer) -> anyhow::Result<Arc<SdkCloud>> {
        match self {
            SdkClouds::Secrets(c) => c.cloud_for(lb).await,
            SdkClouds::File(c) => c.cloud_for(lb).await,
        }
    }
}

/// Settings of the LoadBalancer controller.
#[derive(Clone, Debug)]
pub struct LbControllerConfig {
    /// OpenStack resync even without changes (yawol: 5 min); also the requeue period.
    pub resync: Duration,
    /// Poll interval while child LoadBalancerSets go away.
    pub deletion_poll: Duration,
}

impl Default for LbControllerConfig {
    fn default() -> Self {
        LbControllerConfig {
            resync: Duration::from_secs(300),
            deletion_poll: Duration::from_secs(2),
        }
    }
}

/// Shared state.
pub struct LbContext<F: CloudFactory> {
    /// Control-cluster client.
    pub client: Client,
    /// Cloud sessions.
    pub clouds: F,
    /// Events on the LoadBalancers (the back channel forwards them to the Service).
    pub events: Arc<EventPublisher>,
    /// Settings.
    pub config: LbControllerConfig,
}

/// Merge-patches the OpenStack fields of the status, with explicit nulls for cleared ones (a merge patch without
/// the key would keep the old value, e.g. a floating IP after switching to internal).
struct KubeStatus {
    api: Api<LoadBalancer>,
    name: String,
}

/// The status fields the OpenStack steps own, as a merge patch.
pub fn status_patch(s: &LoadBalancerStatus) -> Value {
    json!({"status": {
        "securityGroupID": s.security_group_id, "securityGroupName": s.security_group_name,
        "floatingID": s.floating_id, "floatingName": s.floating_name, "externalIP": s.external_ip,
        "portID": s.port_id, "portName": s.port_name, "portIP": s.port_ip,
        "serverGroupID": s.server_group_id, "serverGroupName": s.server_group_name,
        "lastOpenstackReconcile": s.last_openstack_reconcile, "openstackReconcileHash": s.openstack_reconcile_hash,
    }})
}

impl StatusSink for KubeStatus {
    async fn save(&mut self, status: &LoadBalancerStatus) -> Result<(), CloudError> {
        self.api
            .patch_status(
                &self.name,
                &PatchParams::default(),
                &Patch::Merge(&status_patch(status)),
            )
            .await
            .map(|_| ())
            .map_err(|e| {
                CloudError::new(
                    CloudErrorKind::Unavailable,
                    "saving LoadBalancer status",
                    e.to_string(),
                )
            })
    }
}

fn object_ref(lb: &LoadBalancer) -> ObjectReference {
    lb.object_ref(&())
}

fn selector(lb: &LoadBalancer) -> String {
    lb.spec
        .selector
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// One reconcile of a LoadBalancer.
pub async fn reconcile<F: CloudFactory>(
    lb: Arc<LoadBalancer>,
    ctx: Arc<LbContext<F>>,
) -> Result<Action, Error> {
    let ns = lb.namespace().unwrap_or_default();
    let name = lb.name_any();
    let api: Api<LoadBalancer> = Api::namespaced(ctx.client.clone(), &ns);
    let has_finalizer = lb
        .finalizers()
        .iter()
        .any(|f| f == finalizers::LOADBALANCER);

    if lb.meta().deletion_timestamp.is_some() {
        if !has_finalizer {
            return Ok(Action::await_change());
        }
        // Machines hold ports in our security group: the sets (and their machines) go first.
        let sets: Api<LoadBalancerSet> = Api::namespaced(ctx.client.clone(), &ns);
        let children = sets
            .list(&ListParams::default().labels(&selector(&lb)))
            .await?;
        if !children.items.is_empty() {
            for s in children
                .items
                .iter()
                .filter(|s| s.meta().deletion_timestamp.is_none())
            {
                sets.delete(&s.name_any(), &DeleteParams::default()).await?;
            }
            return Ok(Action::requeue(ctx.config.deletion_poll));
        }
        let cloud = ctx
            .clouds
            .cloud_for(&lb)
            .await
            .map_err(Error::Credentials)?;
        if let Err(e) = lb_openstack::delete(cloud.as_ref(), &lb).await {
            publish(
                &ctx,
                &lb,
                EventType::Warning,
                "OpenStackDeletionFailed",
                &e.to_string(),
            )
            .await;
            return Err(e.into());
        }
        let rest: Vec<String> = lb
            .finalizers()
            .iter()
            .filter(|f| *f != finalizers::LOADBALANCER)
            .cloned()
            .collect();
        api.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": rest}})),
        )
        .await?;
        info!(lb = %name, "OpenStack resources deleted");
        return Ok(Action::await_change());
    }

    if !has_finalizer {
        let mut all: Vec<String> = lb.finalizers().to_vec();
        all.push(finalizers::LOADBALANCER.to_string());
        api.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": all}})),
        )
        .await?;
    }

    let now = jiff::Timestamp::now();
    if lb_openstack::needs_openstack_reconcile(&lb, now, ctx.config.resync) {
        let cloud = match ctx.clouds.cloud_for(&lb).await {
            Ok(c) => c,
            Err(e) => {
                publish(
                    &ctx,
                    &lb,
                    EventType::Warning,
                    "OpenStackCredentials",
                    &format!("{e:#}"),
                )
                .await;
                return Err(Error::Credentials(e));
            }
        };
        let mut status = lb.status.clone().unwrap_or_default();
        let had_ip = status.external_ip.clone();
        let mut sink = KubeStatus {
            api: api.clone(),
            name: name.clone(),
        };
        let mut warnings = Vec::new();
        let result =
            lb_openstack::reconcile(cloud.as_ref(), &lb, &mut status, &mut sink, &mut warnings)
                .await;
        for w in &warnings {
            publish(&ctx, &lb, EventType::Warning, "InvalidConfiguration", w).await;
        }
        if let Err(e) = result {
            publish(
                &ctx,
                &lb,
                EventType::Warning,
                "OpenStackError",
                &e.to_string(),
            )
            .await;
            return Err(e.into());
        }
        if status.external_ip != had_ip {
            let msg = format!(
                "external IP {}",
                status.external_ip.as_deref().unwrap_or("-")
            );
            publish(&ctx, &lb, EventType::Normal, "ExternalIPAssigned", &msg).await;
        }
    }
    Ok(Action::requeue(ctx.config.resync))
}

async fn publish<F: CloudFactory>(
    ctx: &LbContext<F>,
    lb: &LoadBalancer,
    t: EventType,
    reason: &str,
    msg: &str,
) {
    if let Err(e) = ctx.events.publish(&object_ref(lb), t, reason, msg).await {
        warn!(error = %e, "publishing event");
    }
}

/// Backoff on errors: the step is retried; the cloud's own backoff is not known, so a fixed 10 s keeps the call
/// rate low during an outage without delaying recovery much.
pub fn error_policy<F: CloudFactory>(
    _lb: Arc<LoadBalancer>,
    error: &Error,
    _ctx: Arc<LbContext<F>>,
) -> Action {
    warn!(%error, "LoadBalancer reconcile failed");
    Action::requeue(Duration::from_secs(10))
}

/// Runs the LoadBalancer controller over the LoadBalancers of `namespace` until `shutdown`.
pub async fn run<F: CloudFactory>(
    ctx: Arc<LbContext<F>>,
    namespace: &str,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    use futures::StreamExt;
    use kube::runtime::{watcher, Controller};
    let api: Api<LoadBalancer> = Api::namespaced(ctx.client.clone(), namespace);
    let sets: Api<LoadBalancerSet> = Api::namespaced(ctx.client.clone(), namespace);
    Controller::new(api, watcher::Config::default())
        .owns(sets, watcher::Config::default())
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "loadbalancer controller");
            }
        })
        .await;
}
