//! Credentials: yawol's `cloudprovider.conf` INI (the LoadBalancer's `authSecretRef` Secret, key
//! `cloudprovider.conf`) and `clouds.yaml`, both turned into an `openstack_sdk` [`CloudConfig`].

use anyhow::{bail, Context, Result};
use openstack_sdk::config::{CloudConfig, ConfigFile};
use std::collections::BTreeMap;
use std::path::Path;

/// The `[Global]` section of yawol's `cloudprovider.conf`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CloudProviderConf {
    /// `auth-url` (Keystone v3).
    pub auth_url: String,
    /// `username`.
    pub username: String,
    /// `password`.
    pub password: String,
    /// `domain-name` (user and project domain).
    pub domain_name: Option<String>,
    /// `domain-id`.
    pub domain_id: Option<String>,
    /// `project-id` (or legacy `tenant-id`).
    pub project_id: Option<String>,
    /// `project-name` (or legacy `tenant-name`).
    pub project_name: Option<String>,
    /// `region`.
    pub region: Option<String>,
    /// `ca-file`: PEM bundle to trust (`OS_CACERT` overrides it, as in yawol).
    pub ca_file: Option<String>,
}

impl CloudProviderConf {
    /// Parses the INI text. Keys outside `[Global]` are ignored; inline `#`/`;` comments and quotes are stripped
    /// (gcfg, which yawol uses, does the same).
    pub fn parse(text: &str) -> Result<Self> {
        let mut section = String::new();
        let mut global = BTreeMap::new();
        for (n, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
                continue;
            }
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = name.trim().to_ascii_lowercase();
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                bail!("cloudprovider.conf line {}: expected `key = value`", n + 1);
            };
            if section != "global" {
                continue;
            }
            global.insert(
                key.trim().to_ascii_lowercase(),
                unquote(strip_comment(value.trim())),
            );
        }
        let get = |k: &str| global.get(k).filter(|v| !v.is_empty()).cloned();
        let conf = CloudProviderConf {
            auth_url: get("auth-url").context("cloudprovider.conf: [Global] auth-url missing")?,
            username: get("username").context("cloudprovider.conf: [Global] username missing")?,
            password: get("password").context("cloudprovider.conf: [Global] password missing")?,
            domain_name: get("domain-name"),
            domain_id: get("domain-id"),
            project_id: get("project-id").or_else(|| get("tenant-id")),
            project_name: get("project-name").or_else(|| get("tenant-name")),
            region: get("region"),
            ca_file: get("ca-file"),
        };
        if conf.project_id.is_none() && conf.project_name.is_none() {
            bail!("cloudprovider.conf: [Global] needs project-id or project-name");
        }
        Ok(conf)
    }

    /// The `openstack_sdk` configuration: password auth scoped to the project. `project_id_override` is the
    /// LoadBalancer's `spec.infrastructure.projectID`. A project ID wins over a name (unambiguous).
    pub fn to_cloud_config(&self, project_id_override: Option<&str>) -> Result<CloudConfig> {
        let project_id = project_id_override
            .map(str::to_string)
            .or_else(|| self.project_id.clone());
        let mut auth = serde_json::json!({
            "auth_url": self.auth_url,
            "username": self.username,
            "password": self.password,
        });
        let obj = auth.as_object_mut().expect("object literal");
        if let Some(d) = &self.domain_name {
            obj.insert("user_domain_name".into(), d.as_str().into());
            obj.insert("project_domain_name".into(), d.as_str().into());
        }
        if let Some(d) = &self.domain_id {
            obj.insert("user_domain_id".into(), d.as_str().into());
            obj.insert("project_domain_id".into(), d.as_str().into());
        }
        match (&project_id, &self.project_name) {
            (Some(id), _) => obj.insert("project_id".into(), id.as_str().into()),
            (None, Some(name)) => obj.insert("project_name".into(), name.as_str().into()),
            (None, None) => unreachable!("checked in parse"),
        };
        let cacert = std::env::var("OS_CACERT")
            .ok()
            .filter(|v| !v.is_empty())
            .or_else(|| self.ca_file.clone());
        let config = serde_json::json!({
            "auth": auth,
            "auth_type": "password",
            "region_name": self.region,
            "interface": "public",
            "cacert": cacert,
            "name": "cloudprovider.conf",
        });
        serde_json::from_value(config).context("building the OpenStack client configuration")
    }
}

fn strip_comment(value: &str) -> &str {
    // Only ` #`/` ;` start an inline comment: passwords may contain `#` without a space before it.
    let cut = [" #", " ;", "\t#", "\t;"]
        .iter()
        .filter_map(|m| value.find(m))
        .min();
    cut.map_or(value, |i| value[..i].trim_end())
}

fn unquote(value: &str) -> String {
    value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value)
        .replace("\\\"", "\"")
}

/// Where the controller gets OpenStack credentials from.
#[derive(Clone, Debug)]
pub enum Credentials {
    /// yawol's INI (from the Secret named by the LoadBalancer).
    CloudProviderConf(CloudProviderConf),
    /// A cloud of a `clouds.yaml` file.
    CloudsYaml {
        /// The file.
        path: std::path::PathBuf,
        /// The cloud's name in it.
        cloud: String,
    },
}

impl Credentials {
    /// The `openstack_sdk` configuration.
    pub fn cloud_config(&self, project_id_override: Option<&str>) -> Result<CloudConfig> {
        match self {
            Credentials::CloudProviderConf(conf) => conf.to_cloud_config(project_id_override),
            Credentials::CloudsYaml { path, cloud } => {
                let mut config = clouds_yaml(path, cloud)?;
                if let (Some(id), Some(auth)) = (project_id_override, config.auth.as_mut()) {
                    auth.project_id = Some(id.to_string());
                    auth.project_name = None;
                }
                Ok(config)
            }
        }
    }
}

/// One cloud of a `clouds.yaml` file.
pub fn clouds_yaml(path: &Path, cloud: &str) -> Result<CloudConfig> {
    let file = ConfigFile::builder()
        .add_source(path)
        .with_context(|| format!("loading {}", path.display()))?
        .build()
        .with_context(|| format!("loading {}", path.display()))?;
    file.get_cloud_config(cloud)
        .with_context(|| format!("reading cloud {cloud} from {}", path.display()))?
        .with_context(|| format!("no cloud {cloud:?} in {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONF: &str =
        "# comment\n[Global]\nauth-url = http://127.0.0.1:5000/v3\nusername = lbtest\n\
        password = \"p#w;x\" # the password\ndomain-name = Default\nproject-id = abc ; inline\n\
        project-name = lbtest\nregion = RegionOne\n[LoadBalancer]\nuse-octavia = false\n";

    #[test]
    fn parses_yawol_ini() {
        let c = CloudProviderConf::parse(CONF).unwrap();
        assert_eq!(c.auth_url, "http://127.0.0.1:5000/v3");
        assert_eq!(c.password, "p#w;x");
        assert_eq!(c.project_id.as_deref(), Some("abc"));
        assert_eq!(c.domain_name.as_deref(), Some("Default"));
        assert_eq!(c.region.as_deref(), Some("RegionOne"));
    }

    #[test]
    fn legacy_tenant_and_missing_fields() {
        let c = CloudProviderConf::parse(
            "[Global]\nauth-url=u\nusername=a\npassword=b\ntenant-name=t\n",
        )
        .unwrap();
        assert_eq!(c.project_name.as_deref(), Some("t"));
        let err = CloudProviderConf::parse("[Global]\nauth-url=u\nusername=a\n").unwrap_err();
        assert!(err.to_string().contains("password"), "{err}");
        assert!(
            CloudProviderConf::parse("[Global]\nauth-url=u\nusername=a\npassword=b\n").is_err()
        );
    }

    #[test]
    fn cloud_config_scopes_to_project_and_honours_override() {
        let c = CloudProviderConf::parse(CONF).unwrap();
        let cfg = c.to_cloud_config(None).unwrap();
        let auth = cfg.auth.as_ref().unwrap();
        assert_eq!(auth.project_id.as_deref(), Some("abc"));
        assert_eq!(auth.user_domain_name.as_deref(), Some("Default"));
        assert_eq!(cfg.region_name.as_deref(), Some("RegionOne"));
        let cfg = c.to_cloud_config(Some("other")).unwrap();
        assert_eq!(cfg.auth.unwrap().project_id.as_deref(), Some("other"));
    }
}
