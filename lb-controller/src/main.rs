//! `lb-controller`: the cloud controller binary (`run`, default), the OpenStack-side controllers (`controller`) and
//! `crds` (manifest generator).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use lb_controller::cli::{self, Cli, Command, LogFormat};
use lb_controller::cloud::run::{run_controllers, RunConfig};
use lb_controller::cloud::service;
use lb_controller::metrics::Metrics;
use lb_controller::openstack::run::{run_openstack_controllers_with, OpenStackRunConfig};
use lb_controller::process::http::Health;
use lb_controller::process::supervise;
use lb_controller::runtime::stop::Stop;
use tracing::info;

fn main() -> anyhow::Result<()> {
    // Before any TLS connection: two rustls providers are compiled in (see the function's docs).
    lb_controller::openstack::install_crypto_provider();
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Crds { dir, check }) => crds(&dir, check),
        Some(Command::Run(args)) => run(*args),
        Some(Command::Controller(args)) => controller(*args),
        None => run(cli.run),
    }
}

fn run(args: cli::RunArgs) -> anyhow::Result<()> {
    init_logging(args.process.log_format);
    tokio::runtime::Runtime::new()?.block_on(run_controller(args))
}

fn controller(args: cli::ControllerArgs) -> anyhow::Result<()> {
    init_logging(args.process.log_format);
    tokio::runtime::Runtime::new()?.block_on(run_openstack(args))
}

fn crds(dir: &std::path::Path, check: bool) -> anyhow::Result<()> {
    if check {
        let drifted = lb_controller::crds::drift(dir)?;
        anyhow::ensure!(
            drifted.is_empty(),
            "CRD manifests in {} are out of date: {} (run `lb-controller crds`)",
            dir.display(),
            drifted.join(", ")
        );
        println!("CRD manifests in {} are up to date", dir.display());
    } else {
        for path in lb_controller::crds::write(dir)? {
            println!("wrote {}", path.display());
        }
    }
    Ok(())
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

async fn run_controller(args: cli::RunArgs) -> anyhow::Result<()> {
    let stop = stop_on_signals();
    let defaults = args.infra.defaults()?;
    let fallback = args.kubeconfig.as_deref();
    let target = cli::client_for(args.target_kubeconfig.as_deref().or(fallback))
        .await
        .context("target cluster")?;
    let control = cli::client_for(args.control_kubeconfig.as_deref().or(fallback))
        .await
        .context("control cluster")?;
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    let instance = std::env::var("POD_NAME").unwrap_or_else(|_| hostname());
    let config = RunConfig {
        service: service::Config {
            defaults: defaults.clone(),
            classes: args.class_filter(),
            resync: args.resync(),
            deletion_poll: Duration::from_secs(5),
            serve_ipv6: args.serve_ipv6,
        },
        event_max_age: Duration::from_secs(args.event_max_age),
        event_component: "lb-cloud-controller".into(),
        instance: instance.clone(),
        concurrency: args.concurrency.max(1),
    };
    let controllers = run_controllers(
        target,
        control.clone(),
        config,
        metrics.clone(),
        health.clone(),
        stop.clone().wait(),
    );
    let lease_namespace = args
        .leader_election_namespace
        .clone()
        .unwrap_or(defaults.namespace);
    let supervision = args.process.supervision(
        &lease_namespace,
        &args.leader_election_id,
        identity(&instance),
    );
    supervise(
        control,
        supervision,
        metrics,
        health,
        controllers,
        stop.wait(),
    )
    .await
}

async fn run_openstack(args: cli::ControllerArgs) -> anyhow::Result<()> {
    let stop = stop_on_signals();
    let control = cli::client_for(args.kubeconfig.as_deref())
        .await
        .context("control cluster")?;
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    let clouds = args.clouds(control.clone(), metrics.openstack_calls.clone())?;
    let instance = std::env::var("POD_NAME").unwrap_or_else(|_| hostname());
    let config = OpenStackRunConfig {
        namespace: args.namespace.clone(),
        loadbalancer: args.loadbalancer_config(),
        instance: instance.clone(),
    };
    let controllers = run_openstack_controllers_with(
        control.clone(),
        clouds,
        config,
        args.machines.tuning(),
        metrics.clone(),
        health.clone(),
        stop.clone().wait(),
    );
    let supervision = args.process.supervision(
        &args.namespace,
        &args.leader_election_id,
        identity(&instance),
    );
    supervise(
        control,
        supervision,
        metrics,
        health,
        controllers,
        stop.wait(),
    )
    .await
}

/// The process's stop: SIGTERM (what Kubernetes sends a pod) or SIGINT (Ctrl-C). Without the SIGTERM handler the
/// process died at once and a leader never released its Lease: the standby waited out the lease (~60–70 s). Kept
/// as a state ([`Stop`]): the controllers' hook is polled only once their caches are synced, after a signal that
/// may have come earlier.
fn stop_on_signals() -> Stop {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing the SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing the SIGINT handler");
    Stop::on(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        info!("shutting down");
    })
}

fn identity(instance: &str) -> String {
    format!("{instance}_{:08x}", std::process::id() ^ rand_suffix())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "lb-controller".into())
}

fn rand_suffix() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0)
}
