//! The OpenStack-side controllers (LoadBalancer → LoadBalancerSet → LoadBalancerMachine, through
//! `run::run_openstack_controllers_with`) on a real API server of its own (kube-testenv, under the RBAC of
//! `deploy/openstack-controller.yaml`) against the real OpenStack of `cargo xtask openstack up` (Keystone, Neutron,
//! Nova with the fake driver), through the real `SdkCloud` with credentials from the LoadBalancer's Secret
//! (`SecretClouds`). Per run, one LoadBalancer with `--replicas`:
//! 1. time from its creation to the floating IP in its status, and to all servers ACTIVE with the machines ready;
//! 2. steady state: OpenStack calls (`yawol_openstack`) and reconciles of the three controllers while nothing
//!    changes, first in the quiet time before any resync is due, then over `--periods` resync periods;
//! 3. time from its deletion to the LoadBalancer object gone (every server, port, floating IP, group deleted), then
//!    the leak check over the project.
//!
//! The harness (`lb_test_support::cascade`) plays the agents (with their VMs' kubeconfig): a machine reports ready
//! as soon as its server is ACTIVE (the fake driver boots nothing), so the times are the controllers' and the
//! cloud's, without an image's boot time; the set controller creates machines one after another, each once the
//! previous is ready.
//!
//! `cargo xtask bench openstack` (starts the environment if needed, writes `target/bench/openstack.json`), or by
//! hand with the environment up:
//! `cargo run --release -p lb-benches --bin bench-openstack -- --json target/bench/openstack.json`

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use lb_controller::metrics::Metrics;
use lb_controller::openstack::clouds::SecretClouds;
use lb_controller::openstack::loadbalancer::{self, RolloutGate};
use lb_controller::openstack::machine;
use lb_controller::openstack::run::OpenStackTuning;
use lb_controller::openstack::set;
use lb_test_support::cascade::{self, connect, lb_json, Cascade, CascadeConfig, CALL_TIMEOUT};
use openstack_testenv::{LeakCheck, TestEnv};
use serde_json::{json, Value};

#[derive(Parser)]
struct Args {
    /// Runs (one LoadBalancer each, one after the other); medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Replicas of the LoadBalancer.
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// OpenStack resync period of the LoadBalancer and machine controllers, seconds (production: 300).
    #[arg(long, default_value_t = 20)]
    resync: u64,
    /// Resync periods of the steady-state window.
    #[arg(long, default_value_t = 3)]
    periods: u32,
    /// Seconds between the simulated agents' heartbeats (the agent's --requeue-period; its default is 30).
    #[arg(long, default_value_t = 5)]
    heartbeat: u64,
    /// Write the results as JSON to this path.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// A short run that only proves the benchmark runs (`cargo xtask test`'s openstack stage): one run of one
    /// replica, 5 s resync, one period, 2 s heartbeats.
    #[arg(long)]
    smoke: bool,
}

const STEP: Duration = Duration::from_secs(180);
const CONTROLLERS: [&str; 3] = ["loadbalancer", "loadbalancerset", "loadbalancermachine"];

/// Everything measured in one run.
#[derive(Debug, Default)]
struct Run {
    fip: f64,
    active: f64,
    delete: f64,
    quiet_seconds: f64,
    quiet_reconciles: u64,
    quiet_calls: u64,
    window_seconds: f64,
    window_reconciles: BTreeMap<String, u64>,
    window_calls: u64,
    window_calls_by_kind: BTreeMap<String, u64>,
    lb_passes: u64,
    machine_passes: u64,
}

impl Run {
    fn window_reconciles_total(&self) -> u64 {
        self.window_reconciles.values().sum()
    }
    fn calls_per_reconcile(&self) -> f64 {
        self.window_calls as f64 / self.window_reconciles_total().max(1) as f64
    }
    fn calls_per_pass(&self) -> f64 {
        self.window_calls as f64 / (self.lb_passes + self.machine_passes).max(1) as f64
    }
}

fn reconciles(metrics: &Metrics) -> BTreeMap<String, u64> {
    CONTROLLERS
        .iter()
        .map(|c| (c.to_string(), metrics.reconcile_count(c)))
        .collect()
}

/// `yawol_openstack` by `api/object/operation`, from the exposition text.
fn calls_by_kind(metrics: &Metrics) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in metrics.encode().lines() {
        let Some(rest) = line.strip_prefix("yawol_openstack{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = |k: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        let key = format!(
            "{} {} {}",
            label("api"),
            label("object"),
            label("operation")
        );
        *out.entry(key).or_default() += value.trim().parse::<f64>().unwrap_or(0.0) as u64;
    }
    out
}

fn diff(after: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// `lastOpenstackReconcile` of the LoadBalancer and of each of its machines.
fn passes(c: &Cascade, lb: &str) -> (Option<String>, BTreeMap<String, String>) {
    let lb_last = c.status(lb)["lastOpenstackReconcile"]
        .as_str()
        .map(str::to_string);
    let machines = c
        .machines_of(lb)
        .iter()
        .filter_map(|m| {
            Some((
                cascade::name_of(m),
                m["status"]["lastOpenstackReconcile"].as_str()?.to_string(),
            ))
        })
        .collect();
    (lb_last, machines)
}

async fn one_run(env: &TestEnv, c: &Cascade, args: &Args, name: &str) -> Result<Run> {
    let mut run = Run::default();
    let n = args.replicas;
    let resync = Duration::from_secs(args.resync);
    let t0 = Instant::now();
    c.create_lb(lb_json(
        env,
        &c.ns,
        name,
        n as i32,
        json!({"serverGroupPolicy": "soft-anti-affinity"}),
    ))
    .await?;
    c.wait("floating IP", STEP, |c| {
        c.status(name)["externalIP"].is_string()
    })
    .await?;
    run.fip = t0.elapsed().as_secs_f64();
    c.wait(&format!("{n} ACTIVE servers, {n} ready"), STEP, |c| {
        let st = c.status(name);
        let active = c
            .machines_of(name)
            .iter()
            .filter(|m| {
                m["status"]["lastOpenstackReconcile"].is_string()
                    && m["metadata"]["deletionTimestamp"].is_null()
            })
            .count();
        active == n && st["readyReplicas"] == n && st["replicas"] == n
    })
    .await?;
    run.active = t0.elapsed().as_secs_f64();

    // Quiet: until the earliest resync is due, nothing may call OpenStack, however often the controllers run.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (lb_last, machine_last) = passes(c, name);
    let earliest = lb_last
        .iter()
        .chain(machine_last.values())
        .filter_map(|t| t.parse::<jiff::Timestamp>().ok())
        .min()
        .context("no lastOpenstackReconcile")?;
    let due = earliest + jiff::SignedDuration::try_from(resync)?;
    let quiet = due.duration_since(jiff::Timestamp::now()).as_secs_f64() - 1.0;
    let calls0 = c.metrics.openstack_calls.total();
    let rec0 = reconciles(&c.metrics);
    if quiet > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(quiet)).await;
    }
    run.quiet_seconds = quiet.max(0.0);
    run.quiet_calls = c.metrics.openstack_calls.total() - calls0;
    run.quiet_reconciles = diff(&reconciles(&c.metrics), &rec0).values().sum();

    // Resync periods: count the passes (new lastOpenstackReconcile values) and every call.
    let calls1 = c.metrics.openstack_calls.total();
    let kinds1 = calls_by_kind(&c.metrics);
    let rec1 = reconciles(&c.metrics);
    let (mut lb_seen, mut machines_seen) = passes(c, name);
    let window = resync * args.periods;
    let t1 = Instant::now();
    while t1.elapsed() < window {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (l, ms) = passes(c, name);
        if l.is_some() && l != lb_seen {
            run.lb_passes += 1;
            lb_seen = l;
        }
        for (m, t) in ms {
            if machines_seen.get(&m) != Some(&t) {
                run.machine_passes += 1;
                machines_seen.insert(m, t);
            }
        }
    }
    run.window_seconds = t1.elapsed().as_secs_f64();
    run.window_calls = c.metrics.openstack_calls.total() - calls1;
    run.window_calls_by_kind = diff(&calls_by_kind(&c.metrics), &kinds1);
    run.window_reconciles = diff(&reconciles(&c.metrics), &rec1);

    run.delete = c.delete_lb(name, STEP).await?.as_secs_f64();
    Ok(run)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = Args::parse();
    if args.smoke {
        (
            args.runs,
            args.replicas,
            args.resync,
            args.periods,
            args.heartbeat,
        ) = (1, 1, 5, 1, 2);
    }
    anyhow::ensure!(
        args.runs > 0 && args.replicas > 0,
        "--runs and --replicas must be > 0"
    );
    let env = TestEnv::load()?;
    let cloud = connect(&env, &[]).await?;
    let direct = env.connect().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("the test project must be empty before the benchmark")?;
    let resync = Duration::from_secs(args.resync);
    let metrics = Arc::new(Metrics::new());
    let calls = metrics.openstack_calls.clone();
    let config = CascadeConfig {
        loadbalancer: loadbalancer::Config {
            resync,
            deletion_poll: Duration::from_millis(500),
            rollout: RolloutGate::default(),
        },
        tuning: Some(OpenStackTuning {
            sets: set::Config::default(),
            machines: machine::Config {
                // The cascade sets the API server's URL.
                api_endpoint: None,
                resync,
                ..machine::Config::default()
            },
        }),
        heartbeat: Duration::from_secs(args.heartbeat),
    };
    let kube = kube_testenv::KubeEnv::start().await?;
    let c = Cascade::start(&kube, &env, metrics, config, move |client| {
        SecretClouds::new(client, CALL_TIMEOUT, calls)
    })
    .await?;
    let ns = c.ns.clone();
    let mut runs = Vec::new();
    let mut failure = None;
    for i in 1..=args.runs {
        let name = format!("bench-{i}");
        match one_run(&env, &c, &args, &name).await {
            Ok(r) => {
                eprintln!(
                    "run {i}: floating IP {:.2}s, {} ACTIVE {:.2}s, deleted {:.2}s; quiet {:.0}s: {} calls / {} reconciles; \
                     {} periods: {} calls / {} reconciles, {} LB + {} machine resync passes",
                    r.fip, args.replicas, r.active, r.delete, r.quiet_seconds, r.quiet_calls, r.quiet_reconciles,
                    args.periods, r.window_calls, r.window_reconciles_total(), r.lb_passes, r.machine_passes
                );
                runs.push(r);
            }
            Err(e) => {
                failure = Some(e.context(format!("run {i}")));
                break;
            }
        }
    }
    let stopped = c.stop().await;
    let leaks = LeakCheck::new(&env).assert_clean(&direct).await;
    if leaks.is_err() {
        let _ = cascade::sweep(&env, &cloud, &direct).await;
    }
    if let Some(e) = failure {
        return Err(e);
    }
    stopped?;
    leaks?;

    let med = |f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
    let min = |f: fn(&Run) -> f64| runs.iter().map(f).fold(f64::INFINITY, f64::min);
    let max = |f: fn(&Run) -> f64| runs.iter().map(f).fold(0.0, f64::max);
    type Field = fn(&Run) -> f64;
    let rows: [(&str, Field); 3] = [
        ("create -> floating IP in status", |r| r.fip),
        ("create -> all servers ACTIVE, ready", |r| r.active),
        ("delete -> gone, nothing left", |r| r.delete),
    ];
    println!(
        "OpenStack controllers vs the test OpenStack (Nova fake driver): 1 LoadBalancer x {} replicas, {} runs (median)",
        args.replicas, args.runs
    );
    println!(
        "  {:<38} {:>8} {:>8} {:>8}",
        "phase", "median", "min", "max"
    );
    for (label, f) in rows {
        println!(
            "  {:<38} {:>7.2}s {:>7.2}s {:>7.2}s",
            label,
            med(f),
            min(f),
            max(f)
        );
    }
    let last = runs.last().unwrap();
    println!(
        "steady state, no changes, agents' heartbeat every {}s, resync every {}s (production: 300 s):",
        args.heartbeat, args.resync
    );
    println!(
        "  before any resync is due ({:.0}s): {} OpenStack calls in {} reconciles (median)",
        med(|r| r.quiet_seconds),
        med(|r| r.quiet_calls as f64),
        med(|r| r.quiet_reconciles as f64)
    );
    println!(
        "  over {} resync periods: {} calls in {} reconciles = {:.2} calls/reconcile; {} LB + {} machine resync passes = {:.1} calls/pass (median)",
        args.periods,
        med(|r| r.window_calls as f64),
        med(|r| r.window_reconciles_total() as f64),
        med(Run::calls_per_reconcile),
        med(|r| r.lb_passes as f64),
        med(|r| r.machine_passes as f64),
        med(Run::calls_per_pass)
    );
    println!(
        "  last run's reconciles {:?}; calls {:?}",
        last.window_reconciles, last.window_calls_by_kind
    );

    if let Some(path) = args.json {
        let run_json = |r: &Run| -> Value {
            json!({
                "floating_ip_seconds": r.fip,
                "all_active_seconds": r.active,
                "delete_seconds": r.delete,
                "quiet_seconds": r.quiet_seconds,
                "quiet_openstack_calls": r.quiet_calls,
                "quiet_reconciles": r.quiet_reconciles,
                "window_seconds": r.window_seconds,
                "window_openstack_calls": r.window_calls,
                "window_openstack_calls_by_kind": r.window_calls_by_kind,
                "window_reconciles": r.window_reconciles,
                "lb_resync_passes": r.lb_passes,
                "machine_resync_passes": r.machine_passes,
                "calls_per_reconcile": r.calls_per_reconcile(),
                "calls_per_resync_pass": r.calls_per_pass(),
            })
        };
        let result = json!({
            "benchmark": "openstack",
            "namespace": ns,
            "replicas": args.replicas,
            "runs": args.runs,
            "resync_seconds": args.resync,
            "periods": args.periods,
            "heartbeat_seconds": args.heartbeat,
            "floating_ip_seconds": med(|r| r.fip),
            "all_active_seconds": med(|r| r.active),
            "delete_seconds": med(|r| r.delete),
            "quiet_openstack_calls": med(|r| r.quiet_calls as f64),
            "quiet_reconciles": med(|r| r.quiet_reconciles as f64),
            "calls_per_reconcile": med(Run::calls_per_reconcile),
            "calls_per_resync_pass": med(Run::calls_per_pass),
            "per_run": runs.iter().map(run_json).collect::<Vec<_>>(),
        });
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&path, serde_json::to_string_pretty(&result)? + "\n")?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
