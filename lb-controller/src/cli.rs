//! Command line and environment (yawol-cloud-controller compatible names where they exist).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};
use lb_api::{OpenstackFlavorRef, OpenstackImageRef};

use crate::desired::{ClassFilter, InfrastructureDefaults};

/// Cloud controller for yawol-compatible load balancers.
#[derive(Debug, Parser)]
#[command(name = "lb-controller", version, about)]
pub struct Cli {
    /// What to do (default: run the controller).
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Controller options (for `run`, also accepted without the subcommand).
    #[command(flatten)]
    pub run: RunArgs,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the cloud controller (the default; options may also be given without `run`).
    Run(Box<RunArgs>),
    /// Write the CRD manifests generated from the API types.
    Crds {
        /// Output directory.
        #[arg(long, default_value = "deploy/crds")]
        dir: PathBuf,
        /// Do not write; fail when the files differ from the generated ones.
        #[arg(long)]
        check: bool,
    },
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Options of the controller.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Kubeconfig of the cluster with the Services and Nodes ("inClusterConfig" for the pod's
    /// service account). Defaults to --kubeconfig.
    #[arg(long, env = "TARGET_KUBECONFIG")]
    pub target_kubeconfig: Option<String>,
    /// Kubeconfig of the cluster holding the LoadBalancer objects. Defaults to --kubeconfig.
    #[arg(long, env = "CONTROL_KUBECONFIG")]
    pub control_kubeconfig: Option<String>,
    /// Kubeconfig used when the specific ones are not given (else the usual inference:
    /// $KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<String>,
    /// Load-balancer classes handled (repeatable).
    #[arg(long = "classname", env = "CLASSNAMES", value_delimiter = ',', default_value = lb_api::constants::defaults::LOADBALANCER_CLASS)]
    pub class_names: Vec<String>,
    /// Also handle Services without a class.
    #[arg(long, env = "EMPTY_CLASSNAME", default_value_t = true, action = clap::ArgAction::Set)]
    pub empty_classname: bool,
    /// Address of /metrics ("0" disables).
    #[arg(long, env = "METRICS_BIND_ADDRESS", default_value = ":8080")]
    pub metrics_bind_address: String,
    /// Address of /healthz and /readyz ("0" disables).
    #[arg(long, env = "HEALTH_PROBE_BIND_ADDRESS", default_value = ":8081")]
    pub health_probe_bind_address: String,
    /// Use a Lease in the control cluster so only one instance acts.
    #[arg(long, env = "LEADER_ELECT")]
    pub leader_elect: bool,
    /// Name of the Lease.
    #[arg(
        long,
        env = "LEADER_ELECTION_ID",
        default_value = "lb-cloud-controller"
    )]
    pub leader_election_id: String,
    /// Namespace of the Lease (default: CLUSTER_NAMESPACE).
    #[arg(long, env = "LEADER_ELECTION_NAMESPACE")]
    pub leader_election_namespace: Option<String>,
    /// Lease duration in seconds.
    #[arg(long, env = "LEASES_DURATION", default_value_t = 60)]
    pub leases_duration: u64,
    /// Renew deadline in seconds.
    #[arg(long, env = "LEASES_RENEW_DEADLINE", default_value_t = 50)]
    pub leases_renew_deadline: u64,
    /// Retry period in seconds.
    #[arg(long, env = "LEASES_RETRY_PERIOD", default_value_t = 10)]
    pub leases_retry_period: u64,
    /// Periodic re-check of every Service, in seconds.
    #[arg(long, env = "RESYNC_PERIOD", default_value_t = 600)]
    pub resync_period: u64,
    /// Parallel reconciliations per controller.
    #[arg(long, env = "CONCURRENCY", default_value_t = 16)]
    pub concurrency: u16,
    /// Forward LoadBalancer events at most this old (seconds) when first seen after a start.
    #[arg(long, env = "EVENT_MAX_AGE", default_value_t = 300)]
    pub event_max_age: u64,
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Infrastructure defaults (yawol's environment variables).
    #[command(flatten)]
    pub infra: InfraArgs,
}

/// Infrastructure defaults, from yawol's environment variables.
#[derive(Debug, Args)]
pub struct InfraArgs {
    /// Namespace of the LoadBalancer objects in the control cluster.
    #[arg(long, env = "CLUSTER_NAMESPACE")]
    pub cluster_namespace: Option<String>,
    /// Secret with cloudprovider.conf in that namespace.
    #[arg(long, env = "SECRET_NAME")]
    pub secret_name: Option<String>,
    /// Floating IP pool network ID.
    #[arg(long, env = "FLOATING_NET_ID")]
    pub floating_net_id: Option<String>,
    /// Listener network ID.
    #[arg(long, env = "NETWORK_ID")]
    pub network_id: Option<String>,
    /// Listener subnet ID.
    #[arg(long, env = "SUBNET_ID")]
    pub subnet_id: Option<String>,
    /// Flavor ID.
    #[arg(long, env = "FLAVOR_ID")]
    pub flavor_id: Option<String>,
    /// Flavor name.
    #[arg(long, env = "FLAVOR_NAME")]
    pub flavor_name: Option<String>,
    /// Flavor metadata search.
    #[arg(long, env = "FLAVOR_SEARCH")]
    pub flavor_search: Option<String>,
    /// Image ID.
    #[arg(long, env = "IMAGE_ID")]
    pub image_id: Option<String>,
    /// Image name.
    #[arg(long, env = "IMAGE_NAME")]
    pub image_name: Option<String>,
    /// Image metadata search.
    #[arg(long, env = "IMAGE_SEARCH")]
    pub image_search: Option<String>,
    /// Availability zone.
    #[arg(long, env = "AVAILABILITY_ZONE")]
    pub availability_zone: Option<String>,
    /// Make load balancers internal by default.
    #[arg(long, env = "INTERNAL_LB", action = clap::ArgAction::Set, default_value_t = false)]
    pub internal_lb: bool,
}

impl InfraArgs {
    /// Validated defaults; lists every missing required setting at once.
    pub fn defaults(&self) -> anyhow::Result<InfrastructureDefaults> {
        let mut missing = Vec::new();
        let mut required =
            |value: &Option<String>, name: &str| match value.as_deref().filter(|v| !v.is_empty()) {
                Some(v) => v.to_string(),
                None => {
                    missing.push(name.to_string());
                    String::new()
                }
            };
        let namespace = required(&self.cluster_namespace, "CLUSTER_NAMESPACE");
        let auth_secret_name = required(&self.secret_name, "SECRET_NAME");
        let floating_network_id = required(&self.floating_net_id, "FLOATING_NET_ID");
        let network_id = required(&self.network_id, "NETWORK_ID");
        let flavor = OpenstackFlavorRef {
            flavor_id: self.flavor_id.clone(),
            flavor_name: self.flavor_name.clone(),
            flavor_search: self.flavor_search.clone(),
            ..Default::default()
        };
        if flavor == OpenstackFlavorRef::default() {
            missing.push("one of FLAVOR_ID, FLAVOR_NAME, FLAVOR_SEARCH".into());
        }
        let image = OpenstackImageRef {
            image_id: self.image_id.clone(),
            image_name: self.image_name.clone(),
            image_search: self.image_search.clone(),
            ..Default::default()
        };
        if image == OpenstackImageRef::default() {
            missing.push("one of IMAGE_ID, IMAGE_NAME, IMAGE_SEARCH".into());
        }
        if !missing.is_empty() {
            bail!("missing required settings: {}", missing.join(", "));
        }
        Ok(InfrastructureDefaults {
            namespace,
            auth_secret_name,
            floating_network_id,
            network_id,
            subnet_id: self.subnet_id.clone().filter(|s| !s.is_empty()),
            flavor,
            image,
            availability_zone: self.availability_zone.clone().unwrap_or_default(),
            internal_lb: self.internal_lb,
        })
    }
}

impl RunArgs {
    /// The class filter.
    pub fn class_filter(&self) -> ClassFilter {
        ClassFilter {
            class_names: self.class_names.clone(),
            accept_empty: self.empty_classname,
        }
    }

    /// Resync period.
    pub fn resync(&self) -> Duration {
        Duration::from_secs(self.resync_period.max(1))
    }
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

/// A kube client from a kubeconfig path, the literal `inClusterConfig`, or inference.
pub async fn client_for(kubeconfig: Option<&str>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some("inClusterConfig") => kube::Config::incluster().context("in-cluster configuration")?,
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {path}"))?;
            kube::Config::from_custom_kubeconfig(
                kubeconfig,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .with_context(|| format!("loading kubeconfig {path}"))?
        }
        None => kube::Config::infer()
            .await
            .context("inferring kubeconfig")?,
    };
    kube::Client::try_from(config).context("creating kube client")
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

    #[test]
    fn missing_settings_are_listed_together() {
        let cli = Cli::try_parse_from(["lb-controller", "--cluster-namespace", "ns"]).unwrap();
        let err = cli.run.infra.defaults().unwrap_err().to_string();
        for name in [
            "SECRET_NAME",
            "FLOATING_NET_ID",
            "NETWORK_ID",
            "FLAVOR_ID",
            "IMAGE_ID",
        ] {
            assert!(err.contains(name), "{err}");
        }
    }

    #[test]
    fn crds_subcommand() {
        let cli = Cli::try_parse_from(["lb-controller", "crds", "--check"]).unwrap();
        assert!(matches!(
            cli.command,
            Some(Command::Crds { check: true, .. })
        ));
    }
}
