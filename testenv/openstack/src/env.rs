//! Finding the environment that `cargo xtask openstack up` started, and connecting to it with `openstack_sdk`.

use anyhow::{Context, Result};
use openstack_sdk::config::{CloudConfig, ConfigFile};
use openstack_sdk::types::ServiceType;
use openstack_sdk::AsyncOpenStack;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Environment variable naming the state directory of the environment (what `up` printed); default
/// `<workspace>/target/openstack`.
pub const DIR_ENV: &str = "LB_OPENSTACK_DIR";

/// What `up` wrote to `testenv.json`: credentials and the resources it created for the tests.
#[derive(Debug, Clone, Deserialize)]
pub struct EnvInfo {
    /// Keystone v3, e.g. `http://127.0.0.1:5000/v3`.
    pub auth_url: String,
    /// The only region, `RegionOne`.
    pub region: String,
    /// ID of the test project (tests run as its member user).
    pub project_id: String,
    /// Name of the test project, `lbtest`.
    pub project_name: String,
    /// The test project's member user, `lbtest`.
    pub username: String,
    /// Password of every user of the environment (`LB_OPENSTACK_PASSWORD` at `up`).
    pub password: String,
    /// Cloud of the test user in `clouds.yaml`, `lbtest`.
    pub cloud: String,
    /// Cloud of admin in `clouds.yaml`, `lbtest-admin`.
    pub admin_cloud: String,
    /// Flavor `lbtest.tiny` (1 vCPU, 256 MiB, 1 GiB).
    pub flavor_id: String,
    /// Image `lbtest-image` (1 MiB raw; the fake driver never boots it).
    pub image_id: String,
    /// The external network `public`: floating IPs come from it.
    pub external_network_id: String,
    /// The external network's subnet (203.0.113.0/24).
    pub external_subnet_id: String,
    /// The test project's network `lbtest-net`; ports on it can have floating IPs (its router has a gateway on the
    /// external network).
    pub network_id: String,
    /// The subnet of `lbtest-net` (198.51.100.0/24).
    pub subnet_id: String,
    /// The router `lbtest-router`: gateway on the external network, interface on the subnet.
    pub router_id: String,
}

/// The running test environment.
#[derive(Debug, Clone)]
pub struct TestEnv {
    /// The state directory holding `clouds.yaml`, `cloudprovider.conf` and `testenv.json`.
    pub dir: PathBuf,
    /// What `up` wrote to `testenv.json`.
    pub info: EnvInfo,
}

impl TestEnv {
    /// The state directory: `$LB_OPENSTACK_DIR`, or `target/openstack` in this workspace.
    pub fn default_dir() -> PathBuf {
        match std::env::var_os(DIR_ENV) {
            Some(dir) => PathBuf::from(dir),
            None => Path::new(env!("CARGO_MANIFEST_DIR"))
                .ancestors()
                .nth(2)
                .expect("testenv/openstack lives two levels below the workspace root")
                .join("target/openstack"),
        }
    }

    /// Loads the environment from [`TestEnv::default_dir`]. Fails, naming the command to run, when it is not up:
    /// integration tests must fail loudly rather than skip.
    pub fn load() -> Result<Self> {
        Self::load_from(&Self::default_dir())
    }

    /// Loads the environment from a state directory.
    pub fn load_from(dir: &Path) -> Result<Self> {
        let file = dir.join("testenv.json");
        let text = std::fs::read_to_string(&file).with_context(|| {
            format!(
                "the OpenStack test environment is not set up: cannot read {} ({DIR_ENV} selects another \
                 directory). Run `cargo xtask openstack up` first",
                file.display()
            )
        })?;
        let info: EnvInfo = serde_json::from_str(&text).with_context(|| {
            format!(
                "parsing {} (re-run `cargo xtask openstack up`)",
                file.display()
            )
        })?;
        Ok(TestEnv {
            dir: dir.to_path_buf(),
            info,
        })
    }

    /// `clouds.yaml` with the clouds [`EnvInfo::cloud`] and [`EnvInfo::admin_cloud`].
    pub fn clouds_yaml(&self) -> PathBuf {
        self.dir.join("clouds.yaml")
    }

    /// yawol-style `[Global]` INI with the test project's credentials.
    pub fn cloudprovider_conf(&self) -> PathBuf {
        self.dir.join("cloudprovider.conf")
    }

    /// The `CloudConfig` of a cloud in `clouds.yaml`; add `<service>_endpoint_override` options to its `options`
    /// to route a service through a [`crate::FaultProxy`] (see [`crate::FaultProxy::route`]).
    pub fn cloud_config(&self, cloud: &str) -> Result<CloudConfig> {
        let path = self.clouds_yaml();
        let file = ConfigFile::builder()
            .add_source(&path)
            .with_context(|| format!("loading {}", path.display()))?
            .build()
            .with_context(|| format!("loading {}", path.display()))?;
        file.get_cloud_config(cloud)
            .with_context(|| format!("reading cloud {cloud} from {}", path.display()))?
            .with_context(|| format!("no cloud {cloud:?} in {}", path.display()))
    }

    /// Connects as the test project's user.
    pub async fn connect(&self) -> Result<AsyncOpenStack> {
        self.connect_with(&self.cloud_config(&self.info.cloud)?)
            .await
    }

    /// Connects as admin (for set-up that needs it, e.g. quotas).
    pub async fn connect_admin(&self) -> Result<AsyncOpenStack> {
        self.connect_with(&self.cloud_config(&self.info.admin_cloud)?)
            .await
    }

    /// Connects with a (possibly modified) cloud configuration and discovers the compute and network endpoints.
    ///
    /// The discovery is needed: without it `openstack_sdk` uses the unversioned catalog URL as is (Neutron's is
    /// `http://127.0.0.1:9696`, so `/floatingips` would be a 404 instead of `/v2.0/floatingips`).
    pub async fn connect_with(&self, config: &CloudConfig) -> Result<AsyncOpenStack> {
        let client: AsyncOpenStack = AsyncOpenStack::builder(config)
            // A token cached on disk would outlive a `down --purge` (new Keystone keys) and belongs to nobody.
            .disable_auth_cache(true)
            .connect()
            .await
            .with_context(|| {
                format!(
                    "authenticating to {} as {:?}: is the OpenStack test environment up? (`cargo xtask openstack up`)",
                    self.info.auth_url,
                    config.name.as_deref().unwrap_or("?")
                )
            })?;
        for service in [ServiceType::Compute, ServiceType::Network] {
            client
                .discover_service_endpoint(&service)
                .await
                .with_context(|| format!("discovering the {service:?} endpoint"))?;
        }
        Ok(client)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_environment_fails_naming_the_command_to_run() {
        let err = TestEnv::load_from(Path::new("/nonexistent/openstack-state")).unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("cargo xtask openstack up"), "{msg}");
    }

    #[test]
    fn reads_what_up_writes() {
        let dir = std::env::temp_dir().join(format!("lbtest-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let info = serde_json::json!({
            "auth_url": "http://127.0.0.1:5000/v3", "region": "RegionOne", "project_id": "p", "project_name": "lbtest",
            "username": "lbtest", "password": "pw", "cloud": "lbtest", "admin_cloud": "lbtest-admin", "flavor_id": "f",
            "image_id": "i", "external_network_id": "e", "external_subnet_id": "es", "network_id": "n",
            "subnet_id": "s", "router_id": "r"
        });
        std::fs::write(dir.join("testenv.json"), info.to_string()).unwrap();
        let env = TestEnv::load_from(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(env.info.router_id, "r");
        assert_eq!(env.clouds_yaml(), dir.join("clouds.yaml"));
    }
}
