//! Command line and environment (yawol-cloud-controller compatible names where they exist).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};
use lb_api::{OpenstackFlavorRef, OpenstackImageRef};

use crate::cloud::loadbalancer_spec::{ClassFilter, InfrastructureDefaults};
use crate::metrics::Metrics;
use crate::openstack::clouds::{CloudFactory, FileClouds, SdkClouds, SecretClouds};
use crate::openstack::loadbalancer::{self, RolloutGate};
use crate::openstack::machine;
use crate::openstack::run::{self, OpenStackRunConfig, OpenStackTuning};
use crate::openstack::set;
use crate::openstack::{CloudProviderConf, Credentials, OpenStackCalls};
use crate::process::http::Health;
use crate::process::leader::LeaderElectionConfig;
use crate::process::Supervision;

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
    /// Run the OpenStack-side controllers (yawol-controller's role: LoadBalancer -> OpenStack resources).
    Controller(Box<ControllerArgs>),
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
    /// Probes, metrics, leader election and logs.
    #[command(flatten)]
    pub process: ProcessArgs,
    /// Periodic re-check of every Service, in seconds.
    #[arg(long, env = "RESYNC_PERIOD", default_value_t = 600)]
    pub resync_period: u64,
    /// Parallel reconciliations per controller.
    #[arg(long, env = "CONCURRENCY", default_value_t = 16)]
    pub concurrency: u16,
    /// Forward LoadBalancer events at most this old (seconds) when first seen after a start.
    #[arg(long, env = "EVENT_MAX_AGE", default_value_t = 300)]
    pub event_max_age: u64,
    /// Serve the IPv6 part of Services (dual-stack and IPv6-only). Off for load balancers whose image does not
    /// forward IPv6 (older images): Services asking for IPv6 are then served over IPv4 or refused, with an Event
    /// saying so.
    #[arg(long, env = "SERVE_IPV6", default_value_t = true, action = clap::ArgAction::Set)]
    pub serve_ipv6: bool,
    /// Infrastructure defaults (yawol's environment variables).
    #[command(flatten)]
    pub infra: InfraArgs,
}

/// What both commands' processes share: probes, metrics, the leader Lease's timing, logs.
#[derive(Debug, Args)]
pub struct ProcessArgs {
    /// Address of /metrics ("0" disables).
    #[arg(long, env = "METRICS_BIND_ADDRESS", default_value = ":8080")]
    pub metrics_bind_address: String,
    /// Address of /healthz and /readyz ("0" disables).
    #[arg(long, env = "HEALTH_PROBE_BIND_ADDRESS", default_value = ":8081")]
    pub health_probe_bind_address: String,
    /// Use a Lease in the control cluster so only one instance acts.
    #[arg(long, env = "LEADER_ELECT")]
    pub leader_elect: bool,
    /// Lease duration in seconds.
    #[arg(long, env = "LEASES_DURATION", default_value_t = 60)]
    pub leases_duration: u64,
    /// Renew deadline in seconds.
    #[arg(long, env = "LEASES_RENEW_DEADLINE", default_value_t = 50)]
    pub leases_renew_deadline: u64,
    /// Retry period in seconds.
    #[arg(long, env = "LEASES_RETRY_PERIOD", default_value_t = 10)]
    pub leases_retry_period: u64,
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

impl ProcessArgs {
    /// Where /metrics and the probes are served, and the Lease `namespace/name` held as `identity` when leader
    /// election is on.
    pub fn supervision(&self, namespace: &str, name: &str, identity: String) -> Supervision {
        let election = self.leader_elect.then(|| LeaderElectionConfig {
            namespace: namespace.to_string(),
            name: name.to_string(),
            identity,
            lease_duration: Duration::from_secs(self.leases_duration),
            renew_deadline: Duration::from_secs(self.leases_renew_deadline),
            retry_period: Duration::from_secs(self.leases_retry_period.max(1)),
        });
        Supervision {
            metrics_bind_address: self.metrics_bind_address.clone(),
            health_probe_bind_address: self.health_probe_bind_address.clone(),
            election,
        }
    }
}

/// Options of `lb-controller controller` (yawol-controller's flags that apply to the LoadBalancer controller).
#[derive(Debug, Args)]
pub struct ControllerArgs {
    /// Namespace of the LoadBalancer objects (and of the Lease).
    #[arg(long, env = "CLUSTER_NAMESPACE")]
    pub namespace: String,
    /// Kubeconfig of the control cluster ("inClusterConfig" for the pod's service account; else the usual
    /// inference: $KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<String>,
    /// Name of the Lease (in --namespace).
    #[arg(
        long,
        env = "LEADER_ELECTION_ID",
        default_value = "lb-openstack-controller"
    )]
    pub leader_election_id: String,
    /// Probes, metrics, leader election and logs.
    #[command(flatten)]
    pub process: ProcessArgs,
    /// Timeout of each OpenStack call ("20s", "1m" or seconds).
    #[arg(long, env = "OPENSTACK_TIMEOUT", default_value = "20s", value_parser = parse_duration)]
    pub openstack_timeout: Duration,
    /// OpenStack resync of every LoadBalancer even without changes ("5m", or seconds).
    #[arg(long, env = "LOADBALANCER_RESYNC_PERIOD", default_value = "5m", value_parser = parse_duration)]
    pub resync_period: Duration,
    /// One yawol `cloudprovider.conf` (INI) for every LoadBalancer instead of its `authSecretRef` Secret.
    #[arg(long, env = "CLOUDPROVIDER_CONF", conflicts_with = "clouds_yaml")]
    pub cloudprovider_conf: Option<PathBuf>,
    /// A `clouds.yaml` for every LoadBalancer instead of its `authSecretRef` Secret (cloud: --os-cloud).
    #[arg(long, env = "CLOUDS_YAML")]
    pub clouds_yaml: Option<PathBuf>,
    /// The cloud of --clouds-yaml.
    #[arg(long, env = "OS_CLOUD", default_value = "openstack")]
    pub os_cloud: String,
    /// How long a new LoadBalancerSet's `HasKeepalivedMaster` must have been True before older sets are scaled
    /// to 0 (yawol: 2 min).
    #[arg(long, env = "ROLLOUT_MASTER_FOR", default_value = "2m", value_parser = parse_duration)]
    pub rollout_master_for: Duration,
    /// …or False this long, for agents that do not report VRRP (yawol: 10 min).
    #[arg(long, env = "ROLLOUT_NO_MASTER_FOR", default_value = "10m", value_parser = parse_duration)]
    pub rollout_no_master_for: Duration,
    /// …or missing while the set is at least this old (yawol: 15 min).
    #[arg(long, env = "ROLLOUT_UNKNOWN_AFTER", default_value = "15m", value_parser = parse_duration)]
    pub rollout_unknown_after: Duration,
    /// LoadBalancerSet and LoadBalancerMachine settings.
    #[command(flatten)]
    pub machines: MachineArgs,
}

/// Settings of the LoadBalancerSet and LoadBalancerMachine controllers: flags of `lb-controller controller`, and
/// the same names in the environment for [`run_openstack_controllers`] (yawol's `API_ENDPOINT` and
/// `NTP_SERVERS` among them).
#[derive(Debug, Parser)]
pub struct MachineArgs {
    /// API server URL as the VMs reach it, written into their kubeconfig. Without it no server is booted (a Warning
    /// event says why).
    #[arg(long, env = "API_ENDPOINT")]
    pub api_endpoint: Option<String>,
    /// NTP servers or pools for the VMs' chrony (comma-separated; names with "pool" are pools).
    #[arg(
        long,
        env = "NTP_SERVERS",
        value_delimiter = ',',
        default_value = "pool.ntp.org"
    )]
    pub ntp_servers: Vec<String>,
    /// The VM interface that carries the VIP and the data plane.
    #[arg(long, env = "VM_INTERFACE", default_value = "eth0")]
    pub vm_interface: String,
    /// OpenStack resync of a machine whose server is ACTIVE (yawol: 5 min).
    #[arg(long, env = "MACHINE_RESYNC_PERIOD", default_value = "5m", value_parser = parse_duration)]
    pub machine_resync_period: Duration,
    /// How long a new machine that is not ready yet holds back the creation of the next one.
    #[arg(long, env = "SCALE_UP_TIMEOUT", default_value = "5m", value_parser = parse_duration)]
    pub scale_up_timeout: Duration,
    /// Longest an active-active machine being deleted keeps its server while the connections translated to its
    /// address drain (its agent reports them; it gets no new ones).
    #[arg(long, env = "ACTIVE_ACTIVE_DRAIN_TIMEOUT", default_value = "10m", value_parser = parse_duration)]
    pub active_active_drain_timeout: Duration,
}

impl MachineArgs {
    /// The settings from the environment alone (no command line).
    pub fn from_env() -> anyhow::Result<Self> {
        Ok(Self::try_parse_from(["lb-controller"])?)
    }

    /// The controllers' settings: these values over the defaults.
    pub fn tuning(&self) -> OpenStackTuning {
        let api_endpoint = self.api_endpoint.as_deref().map(str::trim);
        OpenStackTuning {
            sets: set::Config {
                scale_up_timeout: self.scale_up_timeout,
                ..Default::default()
            },
            machines: machine::Config {
                api_endpoint: api_endpoint.filter(|s| !s.is_empty()).map(str::to_string),
                ntp_servers: self
                    .ntp_servers
                    .iter()
                    .map(|s| s.trim())
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect(),
                interface: self.vm_interface.clone(),
                resync: self.machine_resync_period.max(Duration::from_secs(1)),
                drain_timeout: self.active_active_drain_timeout,
                ..Default::default()
            },
        }
    }
}

impl ControllerArgs {
    /// Fixed credentials from --cloudprovider-conf / --clouds-yaml (read and checked now), or `None` for the
    /// per-LoadBalancer Secrets.
    pub fn credentials(&self) -> anyhow::Result<Option<Credentials>> {
        if let Some(path) = &self.cloudprovider_conf {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let conf = CloudProviderConf::parse(&text)
                .with_context(|| format!("parsing {}", path.display()))?;
            return Ok(Some(Credentials::CloudProviderConf(conf)));
        }
        if let Some(path) = &self.clouds_yaml {
            let credentials = Credentials::CloudsYaml {
                path: path.clone(),
                cloud: self.os_cloud.clone(),
            };
            credentials.cloud_config(None)?;
            return Ok(Some(credentials));
        }
        Ok(None)
    }

    /// The clouds of the LoadBalancer controller, counting calls in `calls`.
    pub fn clouds(
        &self,
        control: kube::Client,
        calls: OpenStackCalls,
    ) -> anyhow::Result<SdkClouds> {
        Ok(match self.credentials()? {
            Some(credentials) => {
                SdkClouds::File(FileClouds::new(credentials, self.openstack_timeout, calls))
            }
            None => SdkClouds::Secrets(SecretClouds::new(control, self.openstack_timeout, calls)),
        })
    }

    /// LoadBalancer controller settings.
    pub fn loadbalancer_config(&self) -> loadbalancer::Config {
        loadbalancer::Config {
            resync: self.resync_period.max(Duration::from_secs(1)),
            rollout: RolloutGate {
                master_for: self.rollout_master_for,
                no_master_for: self.rollout_no_master_for,
                unknown_after: self.rollout_unknown_after,
            },
            ..Default::default()
        }
    }
}

/// Parses "20s", "5m", "1h", "500ms" or plain seconds.
pub fn parse_duration(text: &str) -> anyhow::Result<Duration> {
    let t = text.trim();
    let (number, unit) = t
        .find(|c: char| !c.is_ascii_digit())
        .map_or((t, ""), |i| t.split_at(i));
    let n: u64 = number
        .parse()
        .with_context(|| format!("bad duration {text:?}"))?;
    Ok(match unit {
        "" | "s" => Duration::from_secs(n),
        "ms" => Duration::from_millis(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        _ => bail!("bad duration {text:?} (use s, m, h or ms)"),
    })
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
    /// IPv6 subnet of the listener network for IPv6 VIPs (default: the network's only IPv6 subnet).
    #[arg(long = "subnet-id-v6", env = "SUBNET_ID_V6")]
    pub subnet_id_v6: Option<String>,
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
            subnet_id_v6: self.subnet_id_v6.clone().filter(|s| !s.is_empty()),
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

/// The OpenStack-side controllers as the binary runs them, with the set and machine settings taken from the
/// environment variables of the `controller` command's flags alone (yawol's `API_ENDPOINT`, `NTP_SERVERS`, …;
/// [`MachineArgs`]): a bad value there marks `health` failed and returns. Otherwise
/// [`crate::openstack::run::run_openstack_controllers_with`].
pub async fn run_openstack_controllers<F: CloudFactory>(
    client: kube::Client,
    clouds: F,
    config: OpenStackRunConfig,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let tuning = match MachineArgs::from_env() {
        Ok(args) => args.tuning(),
        Err(e) => {
            tracing::error!(
                error = format!("{e:#}"),
                "controller settings from the environment"
            );
            health.failed.store(true, Ordering::SeqCst);
            return;
        }
    };
    run::run_openstack_controllers_with(client, clouds, config, tuning, metrics, health, shutdown)
        .await
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
    fn controller_subcommand() {
        let cli = Cli::try_parse_from([
            "lb-controller",
            "controller",
            "--namespace",
            "yawol",
            "--kubeconfig",
            "inClusterConfig",
            "--leader-elect",
            "--leader-election-id",
            "lease",
            "--metrics-bind-address",
            ":9090",
            "--health-probe-bind-address",
            "0",
            "--openstack-timeout",
            "30s",
            "--resync-period",
            "2m",
            "--cloudprovider-conf",
            "/etc/cloud/cloudprovider.conf",
            "--log-format",
            "json",
        ])
        .unwrap();
        let Some(Command::Controller(args)) = cli.command else {
            panic!("not the controller command: {:?}", cli.command);
        };
        assert_eq!(args.namespace, "yawol");
        assert_eq!(args.kubeconfig.as_deref(), Some("inClusterConfig"));
        assert!(args.process.leader_elect);
        assert_eq!(args.leader_election_id, "lease");
        assert_eq!(args.process.metrics_bind_address, ":9090");
        assert_eq!(args.process.health_probe_bind_address, "0");
        assert_eq!(args.openstack_timeout, Duration::from_secs(30));
        assert_eq!(args.loadbalancer_config().resync, Duration::from_secs(120));
        assert_eq!(
            args.cloudprovider_conf.as_deref(),
            Some(std::path::Path::new("/etc/cloud/cloudprovider.conf"))
        );
        assert_eq!(args.process.log_format, LogFormat::Json);
    }

    #[test]
    fn controller_defaults_and_errors() {
        let cli =
            Cli::try_parse_from(["lb-controller", "controller", "--namespace", "ns"]).unwrap();
        let Some(Command::Controller(args)) = cli.command else {
            panic!("not the controller command");
        };
        assert_eq!(args.openstack_timeout, Duration::from_secs(20));
        assert_eq!(args.resync_period, Duration::from_secs(300));
        assert_eq!(args.leader_election_id, "lb-openstack-controller");
        assert!(!args.process.leader_elect);
        assert!(args.credentials().unwrap().is_none(), "Secrets by default");
        // One source of fixed credentials at most; a bad timeout is rejected.
        assert!(Cli::try_parse_from([
            "lb-controller",
            "controller",
            "--namespace",
            "ns",
            "--cloudprovider-conf",
            "a",
            "--clouds-yaml",
            "b",
        ])
        .is_err());
        assert!(Cli::try_parse_from([
            "lb-controller",
            "controller",
            "--namespace",
            "ns",
            "--openstack-timeout",
            "soon",
        ])
        .is_err());
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
    }

    #[test]
    fn machine_and_rollout_settings() {
        let cli = Cli::try_parse_from([
            "lb-controller",
            "controller",
            "--namespace",
            "ns",
            "--api-endpoint",
            " https://api.example:6443 ",
            "--ntp-servers",
            "ntp1.example, 2.pool.example",
            "--vm-interface",
            "ens3",
            "--machine-resync-period",
            "1m",
            "--scale-up-timeout",
            "90s",
            "--rollout-master-for",
            "30s",
        ])
        .unwrap();
        let Some(Command::Controller(args)) = cli.command else {
            panic!("not the controller command");
        };
        let tuning = args.machines.tuning();
        let m = &tuning.machines;
        assert_eq!(m.api_endpoint.as_deref(), Some("https://api.example:6443"));
        assert_eq!(m.ntp_servers, ["ntp1.example", "2.pool.example"]);
        assert_eq!(m.interface, "ens3");
        assert_eq!(m.resync, Duration::from_secs(60));
        assert_eq!(tuning.sets.scale_up_timeout, Duration::from_secs(90));
        let gate = args.loadbalancer_config().rollout;
        assert_eq!(gate.master_for, Duration::from_secs(30));
        assert_eq!(gate.no_master_for, Duration::from_secs(600));
        assert_eq!(gate.unknown_after, Duration::from_secs(900));

        // Defaults: no endpoint (no servers are booted), the public NTP pool, yawol's periods.
        let cli =
            Cli::try_parse_from(["lb-controller", "controller", "--namespace", "ns"]).unwrap();
        let Some(Command::Controller(args)) = cli.command else {
            panic!("not the controller command");
        };
        let tuning = args.machines.tuning();
        assert_eq!(tuning.machines.api_endpoint, None);
        assert_eq!(tuning.machines.ntp_servers, ["pool.ntp.org"]);
        assert_eq!(tuning.machines.resync, Duration::from_secs(300));
        assert_eq!(tuning.sets.scale_up_timeout, Duration::from_secs(300));
        assert!(Cli::try_parse_from([
            "lb-controller",
            "controller",
            "--namespace",
            "ns",
            "--scale-up-timeout",
            "later",
        ])
        .is_err());
    }

    #[test]
    fn cloudprovider_conf_file_is_read_at_start() {
        let path = std::env::temp_dir().join(format!("lbc-conf-{}", std::process::id()));
        std::fs::write(
            &path,
            "[Global]\nauth-url = http://127.0.0.1:5000/v3\nusername = u\npassword = p\n\
             domain-name = Default\nproject-id = abc\n",
        )
        .unwrap();
        let cli = Cli::try_parse_from([
            "lb-controller",
            "controller",
            "--namespace",
            "ns",
            "--cloudprovider-conf",
            path.to_str().unwrap(),
        ])
        .unwrap();
        let Some(Command::Controller(args)) = cli.command else {
            panic!("not the controller command");
        };
        assert!(matches!(
            args.credentials().unwrap(),
            Some(Credentials::CloudProviderConf(_))
        ));
        std::fs::remove_file(&path).unwrap();
        assert!(args.credentials().is_err(), "a missing file fails at start");
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
