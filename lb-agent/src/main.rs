//! `lb-agent`: runs on each load-balancer VM. Every flag can also be set by the environment variable shown
//! in `--help`.

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use lb_agent::agent::{self, AgentOptions, AgentStatus};
use lb_agent::dataplane::{AttachMode, MapSizes};
use lb_agent::metrics::SharedSnapshot;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Copy, ValueEnum, Debug)]
enum Mode {
    /// Native XDP, falling back to generic XDP with a warning.
    Xdp,
    /// Native XDP only.
    XdpNative,
    /// Generic XDP only.
    XdpGeneric,
    /// TC ingress (tcx): keeps GSO/GRO super-packets; for bulk TCP on virtio/veth.
    Tc,
}

#[derive(Clone, Copy, ValueEnum, Debug)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Parser, Debug)]
#[command(version, about = "XDP load-balancer agent: programs the data plane from a LoadBalancer")]
struct Cli {
    /// Interface that carries the VIP (traffic comes in and goes out here).
    #[arg(long, env = "LB_INTERFACE")]
    interface: String,
    /// Local config file (LoadBalancer-shaped YAML); reloaded when it changes.
    #[arg(long, env = "LB_CONFIG", conflicts_with = "loadbalancer_name")]
    config: Option<PathBuf>,
    /// Kubernetes mode: kubeconfig (default: in-cluster or $KUBECONFIG).
    #[arg(long, env = "LB_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Kubernetes mode: namespace of the LoadBalancer and LoadBalancerMachine.
    #[arg(long, env = "LB_NAMESPACE")]
    namespace: Option<String>,
    /// Kubernetes mode: name of this machine's LoadBalancer.
    #[arg(long, env = "LB_LOADBALANCER_NAME")]
    loadbalancer_name: Option<String>,
    /// Kubernetes mode: name of this machine's LoadBalancerMachine.
    #[arg(long, env = "LB_LOADBALANCER_MACHINE_NAME")]
    loadbalancer_machine_name: Option<String>,
    /// Attach mode.
    #[arg(long, env = "LB_ATTACH_MODE", value_enum, default_value = "xdp")]
    attach_mode: Mode,
    /// Source address towards backends for every service (default: each service's VIP).
    #[arg(long, env = "LB_SNAT_ADDRESS")]
    snat_address: Option<IpAddr>,
    /// SNAT source-port range, `MIN-MAX`.
    #[arg(long, env = "LB_SNAT_PORTS", default_value = "1024-65535")]
    snat_ports: String,
    /// Seed of the flow hash; must be equal on all replicas so they choose the same backends.
    #[arg(long, env = "LB_HASH_SEED", default_value_t = lb_common::Config::default().hash_seed)]
    hash_seed: u32,
    /// bpffs directory for pinned maps and links (state survives agent restarts and upgrades).
    #[arg(long, env = "LB_PIN_DIR", default_value = "/sys/fs/bpf/lb")]
    pin_dir: PathBuf,
    /// Do not pin: the data plane and its flows end with the process (tests, experiments).
    #[arg(long, env = "LB_NO_PIN")]
    no_pin: bool,
    /// Connection-tracking entries (two per connection; ~120 bytes each).
    #[arg(long, env = "LB_MAX_FLOWS", default_value_t = lb_common::defaults::MAX_FLOWS)]
    max_flows: u32,
    /// Services (VIP, port, protocol).
    #[arg(long, env = "LB_MAX_SERVICES", default_value_t = lb_common::defaults::MAX_SERVICES)]
    max_services: u32,
    /// Backend slots.
    #[arg(long, env = "LB_MAX_BACKENDS", default_value_t = lb_common::defaults::MAX_BACKENDS)]
    max_backends: u32,
    /// Maglev table slots over all services (4 bytes each).
    #[arg(long, env = "LB_MAGLEV_SLOTS", default_value_t = lb_common::defaults::MAGLEV_SLOTS)]
    maglev_slots: u32,
    /// Metrics and probes listen address (`/metrics`, `/healthz`, `/readyz`).
    #[arg(long, env = "LB_METRICS_ADDRESS", default_value = "127.0.0.1:9100")]
    metrics_address: SocketAddr,
    /// Idle-flow collection period (seconds).
    #[arg(long, env = "LB_GC_INTERVAL", default_value_t = 10)]
    gc_interval: u64,
    /// Log format.
    #[arg(long, env = "LB_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
}

fn parse_ports(s: &str) -> Result<(u16, u16)> {
    let (a, b) = s
        .split_once('-')
        .context("--snat-ports must look like MIN-MAX")?;
    let (a, b): (u16, u16) = (a.trim().parse()?, b.trim().parse()?);
    if a == 0 || a > b {
        bail!("--snat-ports: need 1 <= MIN <= MAX");
    }
    Ok((a, b))
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    match cli.log_format {
        LogFormat::Text => tracing_subscriber::fmt().with_env_filter(filter).init(),
        LogFormat::Json => tracing_subscriber::fmt().json().with_env_filter(filter).init(),
    }
    let (min, max) = parse_ports(&cli.snat_ports)?;
    let opts = AgentOptions {
        interface: cli.interface.clone(),
        attach_mode: match cli.attach_mode {
            Mode::Xdp => AttachMode::Xdp,
            Mode::XdpNative => AttachMode::XdpNative,
            Mode::XdpGeneric => AttachMode::XdpGeneric,
            Mode::Tc => AttachMode::Tc,
        },
        pin_dir: (!cli.no_pin).then(|| cli.pin_dir.join(&cli.interface)),
        sizes: MapSizes {
            flows: cli.max_flows,
            services: cli.max_services,
            backends: cli.max_backends,
            maglev_slots: cli.maglev_slots,
            ..MapSizes::default()
        },
        dataplane: lb_common::Config {
            snat_port_min: min,
            snat_port_max: max,
            hash_seed: cli.hash_seed,
        },
        snat_override: cli.snat_address,
        gc_interval: Duration::from_secs(cli.gc_interval.max(1)),
        neighbor_interval: Duration::from_secs(5),
        detach_on_exit: false,
    };
    if opts.pin_dir.is_some() {
        ensure_bpffs()?;
    }
    let config_rx = match (&cli.config, &cli.loadbalancer_name) {
        (Some(path), None) => agent::watch_file(path.clone(), Duration::from_secs(1)),
        (None, Some(_)) => bail!(
            "Kubernetes mode (--loadbalancer-name) is not available in this build yet; use --config"
        ),
        _ => bail!("give either --config FILE or the Kubernetes flags (--namespace, --loadbalancer-name, --loadbalancer-machine-name)"),
    };
    let (status_tx, _status_rx) = tokio::sync::watch::channel(AgentStatus::default());
    let snapshot: SharedSnapshot = Default::default();
    let metrics_addr = cli.metrics_address;
    let snap2 = snapshot.clone();
    tokio::spawn(async move {
        if let Err(e) = lb_agent::metrics::serve(metrics_addr, snap2).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    agent::run(opts, config_rx, status_tx, snapshot, shutdown).await
}

/// Mounts bpffs at /sys/fs/bpf if it is not mounted (pinning needs it).
fn ensure_bpffs() -> Result<()> {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    if mounts.lines().any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf")) {
        return Ok(());
    }
    std::fs::create_dir_all("/sys/fs/bpf")?;
    let status = std::process::Command::new("mount")
        .args(["-t", "bpf", "bpf", "/sys/fs/bpf"])
        .status()
        .context("running mount -t bpf")?;
    if !status.success() {
        bail!("mounting bpffs at /sys/fs/bpf failed; mount it or pass --no-pin");
    }
    Ok(())
}
