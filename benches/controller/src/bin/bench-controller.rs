//! Controller benchmark against the in-memory API server:
//! 1. time until N new Services all have correct LoadBalancer objects;
//! 2. time until a node going NotReady is reflected in all N LoadBalancers, and back.
//!
//! `cargo xtask bench controller`, or `cargo run --release -p lb-benches --bin bench-controller -- --json bench.json`

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use kube_testenv::fake_api::{FakeApiServer, ResourceKey};
use lb_api::{OpenstackFlavorRef, OpenstackImageRef};
use lb_controller::cloud::loadbalancer_spec::{ClassFilter, InfrastructureDefaults};
use lb_controller::cloud::run::{run_controllers, RunConfig};
use lb_controller::cloud::service;
use lb_controller::metrics::Metrics;
use lb_controller::process::http::Health;
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Number of Services.
    #[arg(long, default_value_t = 1000)]
    services: usize,
    /// Number of nodes.
    #[arg(long, default_value_t = 10)]
    nodes: usize,
    /// Parallel reconciliations.
    #[arg(long, default_value_t = 16)]
    concurrency: u16,
    /// Write the results as JSON to this path.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Give up after this many seconds per phase.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// A few seconds' run that only proves the benchmark runs (`cargo xtask test`): 20 Services, 3 nodes, 60 s
    /// per phase at most.
    #[arg(long)]
    smoke: bool,
}

const NS: &str = "yawol";

fn node(i: usize, ready: bool) -> serde_json::Value {
    json!({
        "metadata": {"name": format!("node-{i:04}")},
        "status": {
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            "addresses": [{"type": "InternalIP", "address": format!("10.{}.{}.{}", i / 65536, (i / 256) % 256, i % 256)}],
        }
    })
}

struct Phase {
    name: &'static str,
    seconds: f64,
    requests: u64,
    writes: u64,
}

async fn measure(
    name: &'static str,
    servers: &[&FakeApiServer],
    timeout: Duration,
    action: impl FnOnce(),
    done: impl Fn() -> bool,
) -> anyhow::Result<Phase> {
    let requests = || servers.iter().map(|s| s.request_count()).sum::<u64>();
    let writes = || servers.iter().map(|s| s.write_count()).sum::<u64>();
    let (r0, w0) = (requests(), writes());
    let start = Instant::now();
    action();
    while !done() {
        anyhow::ensure!(
            start.elapsed() < timeout,
            "phase {name} did not finish within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(Phase {
        name,
        seconds: start.elapsed().as_secs_f64(),
        requests: requests() - r0,
        writes: writes() - w0,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if args.smoke {
        (args.services, args.nodes, args.timeout) = (20, 3, 60);
    }
    let timeout = Duration::from_secs(args.timeout);
    let target = FakeApiServer::new();
    let control = FakeApiServer::new();
    for (_, crd) in lb_api::crds() {
        control.install_crd(&crd);
    }
    let nodes_key = ResourceKey::new("", "nodes");
    let services_key = ResourceKey::new("", "services");
    let lbs_key = ResourceKey::new("yawol.stackit.cloud", "loadbalancers");
    for i in 0..args.nodes {
        target.put(&nodes_key, node(i, true));
    }
    let config = RunConfig {
        service: service::Config {
            defaults: InfrastructureDefaults {
                namespace: NS.into(),
                auth_secret_name: "cloudprovider".into(),
                floating_network_id: "floating".into(),
                network_id: "net".into(),
                subnet_id: None,
                subnet_id_v6: None,
                flavor: OpenstackFlavorRef::by_id("flavor"),
                image: OpenstackImageRef::by_id("image"),
                availability_zone: String::new(),
                internal_lb: false,
            },
            classes: ClassFilter::default(),
            resync: Duration::from_secs(3600),
            deletion_poll: Duration::from_secs(5),
            serve_ipv6: true,
        },
        event_max_age: Duration::from_secs(300),
        event_component: "lb-cloud-controller".into(),
        instance: "bench".into(),
        concurrency: args.concurrency,
    };
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let controllers = tokio::spawn(run_controllers(
        target.client(),
        control.client(),
        config,
        metrics.clone(),
        health.clone(),
        async move {
            let _ = stop_rx.await;
        },
    ));
    while !health.ready.load(std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let servers = [&target, &control];
    // Cheap checks on the raw JSON (typed deserialisation of 1000 objects per poll would compete
    // with the controller for the CPU).
    let count_lbs = |check: &dyn Fn(&serde_json::Value) -> bool| control.count(&lbs_key, check);
    let endpoints = |lb: &serde_json::Value| lb["spec"]["endpoints"].as_array().map_or(0, Vec::len);
    let n = args.services;
    let all_nodes = args.nodes;

    let create = measure(
        "create",
        &servers,
        timeout,
        || {
            for i in 0..n {
                target.put(
                    &services_key,
                    json!({
                        "metadata": {"name": format!("svc-{i:05}"), "namespace": "default"},
                        "spec": {
                            "type": "LoadBalancer",
                            "ipFamilies": ["IPv4"],
                            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30000 + (i % 2000) as i32}],
                        }
                    }),
                );
            }
        },
        || {
            count_lbs(&|lb| {
                endpoints(lb) == all_nodes && lb["spec"]["ports"].as_array().is_some_and(|p| p.len() == 1)
            }) == n
        },
    )
    .await?;

    let down = measure(
        "node_down",
        &servers,
        timeout,
        || {
            target.put(&nodes_key, node(0, false));
        },
        || count_lbs(&|lb| endpoints(lb) == all_nodes - 1) == n,
    )
    .await?;

    let up = measure(
        "node_up",
        &servers,
        timeout,
        || {
            target.put(&nodes_key, node(0, true));
        },
        || count_lbs(&|lb| endpoints(lb) == all_nodes) == n,
    )
    .await?;

    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(30), controllers).await;

    println!(
        "controller benchmark: {n} services, {all_nodes} nodes, concurrency {}",
        args.concurrency
    );
    println!(
        "{:<12} {:>10} {:>12} {:>10} {:>14}",
        "phase", "seconds", "per service", "requests", "LB+svc writes"
    );
    let phases = [create, down, up];
    for p in &phases {
        println!(
            "{:<12} {:>10.3} {:>10.3}ms {:>10} {:>14}",
            p.name,
            p.seconds,
            p.seconds * 1000.0 / n as f64,
            p.requests,
            p.writes
        );
    }
    if let Some(path) = args.json {
        let result = json!({
            "benchmark": "controller",
            "services": n,
            "nodes": all_nodes,
            "concurrency": args.concurrency,
            "phases": phases.iter().map(|p| json!({
                "name": p.name,
                "seconds": p.seconds,
                "requests": p.requests,
                "writes": p.writes,
            })).collect::<Vec<_>>(),
            "create_seconds": phases[0].seconds,
            "node_flap_down_seconds": phases[1].seconds,
            "node_flap_up_seconds": phases[2].seconds,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&result)? + "\n")?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
