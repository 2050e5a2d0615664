//! `cargo xtask bench scaleout`: one VIP served active-active by 1, 2 and 3 replicas behind a BGP router with
//! ECMP (the netns rig of the `active_active` tests: a router namespace between the client and the replicas),
//! in one run.
//!
//! For each replica count: short TCP connections through the VIP as fast as the client makes them
//! (connections/s), the packets the replicas forwarded meanwhile (packets/s), each replica's share of the new
//! flows, its XDP program's time per packet (BPF run-time stats of the program attached on its interface) and
//! its agent's CPU time per connection through the VIP (full-mesh sync: every agent sends its own flows' events
//! and applies every peer's, so its work follows the VIP's connections, not its share of them).
//! Between the counts a replica is added while held connections run, and at the end one is drained: connections
//! broken per change.
//!
//! On this 2-core machine the client, the router, the replicas and the backends share the same two CPUs, so the
//! aggregate cannot grow with the replicas; what should hold is that a replica's cost per packet does not grow with
//! N and its agent's per VIP connection stays bounded. On a machine with more cores the same run shows the
//! aggregate once the client is no longer the bottleneck (raise `--concurrency`): a veth runs its XDP program in
//! the NAPI poll of the CPU that sent into it, so the replicas' work spreads over the CPUs the router and the
//! backends send from.

use anyhow::{bail, Context, Result};
use clap::Parser;
use lb_benches::{fmt_num, print_table, process_cpu, wait, write_json};
use lb_testbed::ha::{hold_args, survival, HaRig, HaRigConfig};
use lb_testbed::rig::TCP_PORT;
use lb_testbed::Host;
use serde::Serialize;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// Short TCP connections per replica count.
    #[arg(long, default_value_t = 20000)]
    connections: usize,
    /// Connections in flight at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// TCP connections held across each replica change (plus a tenth as many UDP flows).
    #[arg(long, default_value_t = 500)]
    held: usize,
    /// A short run that only proves the benchmark runs (`cargo xtask test`): 300 connections per count, 30
    /// held; JSON under target/bench/smoke/.
    #[arg(long)]
    smoke: bool,
}

/// One replica's numbers for one replica count.
#[derive(Serialize, Clone)]
struct ReplicaRow {
    replica: String,
    new_flows: f64,
    share: f64,
    packets: f64,
    xdp_ns_per_packet: f64,
    /// The agent's CPU time per connection through the VIP (any replica's): with full-mesh sync every agent sends
    /// its own flows to N − 1 peers and applies everyone else's, about (N − 1)/N × (send + apply) per connection
    /// of the VIP, bounded as N grows — the figure to compare across counts, not a share of its own flows.
    agent_cpu_us_per_vip_connection: f64,
}

#[derive(Serialize)]
struct CountRow {
    replicas: usize,
    connections: usize,
    failed: usize,
    /// Failures by kind (the load generator's words).
    errors: std::collections::BTreeMap<String, usize>,
    /// The first failed connections, with the client socket's state.
    first_failures: Vec<lb_testbed::load::TcpFailure>,
    seconds: f64,
    connections_per_s: f64,
    packets_per_s: f64,
    per_replica: Vec<ReplicaRow>,
}

#[derive(Serialize)]
struct Change {
    what: String,
    held: usize,
    broken: usize,
    survival: f64,
    longest_gap_ms: f64,
    /// The first broken connections.
    first_broken: Vec<lb_testbed::hold::HeldConnection>,
}

#[derive(Serialize)]
struct Report {
    counts: Vec<CountRow>,
    changes: Vec<Change>,
}

/// What one replica has done so far.
#[derive(Clone, Copy, Default)]
struct Counters {
    new_flows: f64,
    packets: f64,
    xdp_ns: u64,
    xdp_runs: u64,
    agent_cpu_s: f64,
}

impl Counters {
    fn read(r: &HaRig, h: Host) -> Result<Counters> {
        let body = r.http_get(h, "/metrics")?;
        let m = |name: &str| lb_testbed::rig::parse_metric(&body, name, "");
        let (xdp_ns, xdp_runs) = xdp_stats(r, h)?;
        Ok(Counters {
            new_flows: m("lb_upstream_cx_total"),
            packets: m("lb_client_packets_total") + m("lb_backend_packets_total"),
            xdp_ns,
            xdp_runs,
            agent_cpu_s: r.agent_pid(h).map_or(0.0, |p| process_cpu(p as i32)),
        })
    }
}

/// Run time and run count of the XDP program attached on replica `h`'s interface (BPF stats on).
fn xdp_stats(r: &HaRig, h: Host) -> Result<(u64, u64)> {
    let out = r
        .topo
        .exec(h, ["ip", "-d", "link", "show", "dev", r.topo.ifname(h)])?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let words: Vec<&str> = text.split_whitespace().collect();
    let id: u32 = words
        .windows(3)
        .find(|w| w[0].starts_with("prog/xdp") && w[1] == "id")
        .and_then(|w| w[2].parse().ok())
        .with_context(|| format!("no XDP program on {h}: {text}"))?;
    for p in aya::programs::loaded_programs().flatten() {
        if p.id() == id {
            return Ok((p.run_time().as_nanos() as u64, p.run_count()));
        }
    }
    bail!("XDP program {id} of {h} not found")
}

/// Short connections through `running` replicas.
fn measure(r: &HaRig, a: &Args, running: &[Host]) -> Result<CountRow> {
    let before: Vec<Counters> = running
        .iter()
        .map(|h| Counters::read(r, *h))
        .collect::<Result<_>>()?;
    let tcp = format!("{}:{TCP_PORT}", r.vip);
    let n = a.connections.to_string();
    let c = a.concurrency.to_string();
    let t = Instant::now();
    let rep = r
        .load(&["--tcp", &tcp, "--connections", &n, "--concurrency", &c])?
        .tcp
        .context("no TCP report")?;
    let seconds = t.elapsed().as_secs_f64();
    // The agents refresh their counters every second.
    let settled = |after: &[Counters]| {
        let flows: f64 = after
            .iter()
            .zip(&before)
            .map(|(x, b)| x.new_flows - b.new_flows)
            .sum();
        flows >= rep.ok as f64
    };
    let mut after = Vec::new();
    wait("the counters to settle", Duration::from_secs(5), || {
        after = running
            .iter()
            .map(|h| Counters::read(r, *h))
            .collect::<Result<_>>()?;
        Ok(settled(&after))
    })?;
    let total_flows: f64 = after
        .iter()
        .zip(&before)
        .map(|(x, b)| x.new_flows - b.new_flows)
        .sum();
    let mut per_replica = Vec::new();
    let mut packets = 0.0;
    for ((h, x), b) in running.iter().zip(&after).zip(&before) {
        let flows = x.new_flows - b.new_flows;
        let runs = (x.xdp_runs - b.xdp_runs) as f64;
        packets += x.packets - b.packets;
        per_replica.push(ReplicaRow {
            replica: h.name(),
            new_flows: flows,
            share: flows / total_flows.max(1.0),
            packets: x.packets - b.packets,
            xdp_ns_per_packet: (x.xdp_ns - b.xdp_ns) as f64 / runs.max(1.0),
            agent_cpu_us_per_vip_connection: (x.agent_cpu_s - b.agent_cpu_s) * 1e6
                / total_flows.max(1.0),
        });
    }
    Ok(CountRow {
        replicas: running.len(),
        connections: rep.requested,
        failed: rep.failed,
        errors: rep.errors.clone(),
        first_failures: rep.failures.iter().take(10).cloned().collect(),
        seconds,
        connections_per_s: rep.ok as f64 / seconds,
        packets_per_s: packets / seconds,
        per_replica,
    })
}

/// Held connections across `change` (which returns once the routes are as they will stay).
fn across(
    r: &mut HaRig,
    a: &Args,
    what: &str,
    change: impl FnOnce(&mut HaRig) -> Result<()>,
) -> Result<Change> {
    let udp = (a.held / 10).max(1);
    let args = hold_args(
        &r.vip.to_string(),
        a.held,
        udp,
        Duration::from_millis(100),
        Duration::from_secs(5),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let hold = r.start_hold(&args)?;
    // Every running replica has every held flow before the routes change.
    let want = a.held + udp;
    let running: Vec<Host> = r
        .topo
        .lbs()
        .into_iter()
        .filter(|h| r.agent_pid(*h).is_some())
        .collect();
    wait(
        "the held flows to be synced",
        Duration::from_secs(30),
        || {
            for h in &running {
                if r.forward_flows::<u32>(*h)?.len() < want {
                    return Ok(false);
                }
            }
            Ok(true)
        },
    )?;
    change(r)?;
    std::thread::sleep(Duration::from_secs(3));
    let rep = hold.stop()?;
    Ok(Change {
        what: what.into(),
        held: rep.tcp_connections + rep.udp_flows,
        broken: rep.broken,
        survival: survival(&rep),
        longest_gap_ms: rep.max_gap_ms,
        first_broken: rep
            .connections
            .iter()
            .filter(|c| c.broken)
            .take(10)
            .cloned()
            .collect(),
    })
}

fn main() -> Result<()> {
    let mut a = Args::parse();
    if a.smoke {
        (a.connections, a.held) = (300, 30);
    }
    if !lb_testbed::is_root() {
        bail!("bench scaleout needs root");
    }
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).ok();
    let mut cfg = HaRigConfig::new()?;
    cfg.replicas = 3;
    cfg.active_active = true;
    cfg.start_agents = false;
    let mut r = HaRig::start(cfg)?;
    let lbs = r.topo.lbs();
    let mut counts = Vec::new();
    let mut changes = Vec::new();
    r.start_agent(lbs[0], 100)?;
    r.wait_next_hops(&lbs[..1], Duration::from_secs(30))?;
    counts.push(measure(&r, &a, &lbs[..1])?);
    for n in 2..=lbs.len() {
        let new = lbs[n - 1];
        let routes = lbs[..n].to_vec();
        changes.push(across(
            &mut r,
            &a,
            &format!("{} → {n} replicas (added {new})", n - 1),
            |r| {
                r.start_agent(new, 100)?;
                r.wait_next_hops(&routes, Duration::from_secs(30))
            },
        )?);
        counts.push(measure(&r, &a, &lbs[..n])?);
    }
    let drained = lbs[0];
    let rest = lbs[1..].to_vec();
    changes.push(across(
        &mut r,
        &a,
        &format!(
            "{} → {} replicas (drained {drained})",
            lbs.len(),
            rest.len()
        ),
        |r| {
            r.stop_agent(drained, libc::SIGTERM)?;
            r.wait_next_hops(&rest, Duration::from_secs(10))
        },
    )?);

    let rows: Vec<Vec<String>> = counts
        .iter()
        .map(|c| {
            let spread: Vec<String> = c
                .per_replica
                .iter()
                .map(|p| format!("{:.0}", p.share * 100.0))
                .collect();
            let xdp: Vec<String> = c
                .per_replica
                .iter()
                .map(|p| fmt_num(p.xdp_ns_per_packet))
                .collect();
            let agent: Vec<String> = c
                .per_replica
                .iter()
                .map(|p| fmt_num(p.agent_cpu_us_per_vip_connection))
                .collect();
            vec![
                c.replicas.to_string(),
                fmt_num(c.connections_per_s),
                fmt_num(c.packets_per_s),
                spread.join(" / "),
                xdp.join(" / "),
                agent.join(" / "),
                c.failed.to_string(),
            ]
        })
        .collect();
    print_table(
        &[
            "replicas",
            "connections/s",
            "packets/s",
            "new flows % per replica",
            "XDP ns/packet per replica",
            "agent CPU µs per VIP connection, per replica",
            "failed",
        ],
        &rows,
    );
    let rows: Vec<Vec<String>> = changes
        .iter()
        .map(|c| {
            vec![
                c.what.clone(),
                c.held.to_string(),
                c.broken.to_string(),
                format!("{:.0}", c.longest_gap_ms),
            ]
        })
        .collect();
    for c in counts.iter().filter(|c| c.failed > 0) {
        println!(
            "{} replicas: failed connections {:?}, first: {:?}",
            c.replicas,
            c.errors,
            c.first_failures.first()
        );
    }
    for c in changes.iter().filter(|c| c.broken > 0) {
        println!("{}: first broken {:?}", c.what, c.first_broken.first());
    }
    print_table(&["change", "held", "broken", "longest pause ms"], &rows);
    let path = write_json("scaleout", a.smoke, &Report { counts, changes })?;
    println!("JSON: {}", path.display());
    Ok(())
}
