//! Which cloud session serves a LoadBalancer (and its machines): the [`CloudFactory`] the OpenStack-side controllers
//! take their [`Cloud`] from. [`SecretClouds`] reads yawol's `cloudprovider.conf` from the Secret named by
//! `spec.infrastructure.authSecretRef` (with the `projectID` override), [`FileClouds`] one credentials file for
//! every LoadBalancer, [`FixedCloud`] one given cloud (tests); sessions are cached and renewed.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client, ResourceExt};
use lb_api::LoadBalancer;

use crate::openstack::sdk::SdkCloud;
use crate::openstack::{Cloud, CloudProviderConf, Credentials, OpenStackCalls};

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

/// Both controllers of `lb-controller controller` take their sessions from one factory.
impl<F: CloudFactory> CloudFactory for Arc<F> {
    type Cloud = F::Cloud;
    fn cloud_for(
        &self,
        lb: &LoadBalancer,
    ) -> impl Future<Output = anyhow::Result<Arc<Self::Cloud>>> + Send {
        (**self).cloud_for(lb)
    }
}
