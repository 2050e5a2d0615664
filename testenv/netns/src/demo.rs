//! `lb-testbed demo` (run by `cargo xtask demo`): real TCP and UDP through the XDP load balancer, a table of
//! what happened, one backend stopped and seen to leave after its health check, everything torn down.

use crate::load::LoadReport;
use crate::rig::{Rig, RigConfig, TCP_NODE_PORT, TCP_PORT, UDP_PORT};
use crate::Host;
use anyhow::{bail, Result};
use std::time::{Duration, Instant};

/// First UDP source port of the demo's flows: below the kernel's ephemeral range (32768-60999), so no socket
/// of the kernel's choosing can take one of them.
const UDP_FIRST_PORT: u16 = 20000;
/// The round after a backend left.
const SECOND_ROUND_CONNECTIONS: usize = 1000;
const SECOND_ROUND_UDP_FLOWS: usize = 300;
/// The IPv6 round: connections and flows to the IPv6 VIP of the same (dual-stack) load balancer.
const IPV6_CONNECTIONS: usize = 1000;
const IPV6_UDP_FLOWS: usize = 300;
const IPV6_UDP_FIRST_PORT: u16 = 40000;

/// Demo settings.
#[derive(Clone, Debug)]
pub struct DemoConfig {
    /// TCP connections in the first round.
    pub connections: usize,
    /// UDP flows in the first round.
    pub udp_flows: usize,
    /// Agent attach mode.
    pub attach_mode: String,
}

/// Runs the demo; `on_topology` receives the topology id as soon as it exists (for Ctrl-C cleanup).
/// Returns an error unless traffic flowed as expected.
pub fn run(cfg: &DemoConfig, on_topology: impl FnOnce(&str)) -> Result<()> {
    let t0 = Instant::now();
    let mut rc = RigConfig::new()?;
    rc.attach_mode = cfg.attach_mode.clone();
    rc.topology.ipv6 = true;
    println!("==> building client, lb and 3 backend namespaces on one L2 segment; starting echo servers and lb-agent ({} mode)", cfg.attach_mode);
    let mut rig = Rig::start_with(rc, on_topology)?;
    let vip = rig.vip;
    let vip6 = rig.vip6.expect("the demo's rig is dual-stack");
    println!("    VIPs {vip} and {vip6}: TCP {TCP_PORT} -> backends:{TCP_NODE_PORT}, UDP {UDP_PORT} -> backends:30053 (ready in {:.1}s)", t0.elapsed().as_secs_f64());

    println!(
        "==> {} TCP connections (1 KiB echoed each) and {} UDP flows to the VIP",
        cfg.connections, cfg.udp_flows
    );
    let tcp = format!("{vip}:{TCP_PORT}");
    let udp = format!("{vip}:{UDP_PORT}");
    let conns = cfg.connections.to_string();
    let flows = cfg.udp_flows.to_string();
    let r = rig.load(&[
        "--tcp",
        &tcp,
        "--connections",
        &conns,
        "--payload",
        "1024",
        "--udp",
        &udp,
        "--udp-flows",
        &flows,
        // Distinct source ports: with ephemeral ports the kernel hands a port freed by a finished flow to a later
        // one, which the load balancer rightly counts as the same flow (≈ 8 of 1000 did).
        "--udp-first-port",
        &UDP_FIRST_PORT.to_string(),
    ])?;
    print_report(&r);
    let mut problems = Vec::new();
    check_flow_counts(&rig, cfg.connections, cfg.udp_flows, &mut problems)?;
    check_round("", &r, &rig, &mut problems);

    println!(
        "==> the same load balancer over IPv6: {IPV6_CONNECTIONS} TCP connections and {IPV6_UDP_FLOWS} UDP flows to {vip6}"
    );
    let r6 = rig.load(&[
        "--tcp",
        &format!("[{vip6}]:{TCP_PORT}"),
        "--connections",
        &IPV6_CONNECTIONS.to_string(),
        "--payload",
        "1024",
        "--udp",
        &format!("[{vip6}]:{UDP_PORT}"),
        "--udp-flows",
        &IPV6_UDP_FLOWS.to_string(),
        "--udp-first-port",
        &IPV6_UDP_FIRST_PORT.to_string(),
    ])?;
    print_report(&r6);
    let (tcp_made, udp_made) = (
        cfg.connections + IPV6_CONNECTIONS,
        cfg.udp_flows + IPV6_UDP_FLOWS,
    );
    check_flow_counts(&rig, tcp_made, udp_made, &mut problems)?;
    check_round("IPv6: ", &r6, &rig, &mut problems);

    println!("==> stopping backend-2's server; waiting for its health check to take it out");
    rig.stop_backend(2)?;
    let stopped = Instant::now();
    let b2 = format!("{}:{TCP_NODE_PORT}", rig.topo.ip(Host::Backend(2)));
    loop {
        if rig.metric("lb_backend_healthy", &format!("backend=\"{b2}\""))? == 0.0 {
            break;
        }
        if stopped.elapsed() > Duration::from_secs(20) {
            bail!("backend-2 still healthy after 20 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "    backend-2 out after {:.1}s (interval 1s, 2 failures)",
        stopped.elapsed().as_secs_f64()
    );
    let r2 = rig.load(&[
        "--tcp",
        &tcp,
        "--connections",
        &SECOND_ROUND_CONNECTIONS.to_string(),
        "--payload",
        "1024",
        "--udp",
        &udp,
        "--udp-flows",
        &SECOND_ROUND_UDP_FLOWS.to_string(),
        "--udp-first-port",
        &(UDP_FIRST_PORT as usize + cfg.udp_flows).to_string(),
    ])?;
    print_report(&r2);
    let (t2, u2) = (r2.tcp.as_ref().unwrap(), r2.udp.as_ref().unwrap());
    if t2.failed > 0 || u2.failed > 0 {
        problems.push(format!(
            "after the stop: {} TCP and {} UDP failures",
            t2.failed, u2.failed
        ));
    }
    if t2.per_backend.contains_key("backend-2") || u2.per_backend.contains_key("backend-2") {
        problems.push("backend-2 still got new flows after leaving".into());
    }
    check_flow_counts(
        &rig,
        tcp_made + SECOND_ROUND_CONNECTIONS,
        udp_made + SECOND_ROUND_UDP_FLOWS,
        &mut problems,
    )?;
    drop(rig);
    println!(
        "==> torn down; demo took {:.1}s",
        t0.elapsed().as_secs_f64()
    );
    if problems.is_empty() {
        println!("RESULT: ok — traffic flowed as expected");
        Ok(())
    } else {
        bail!("demo failed: {}", problems.join("; "))
    }
}

/// Every connection and flow of a round succeeded, and every backend got some.
fn check_round(what: &str, r: &LoadReport, rig: &Rig, problems: &mut Vec<String>) {
    let (t, u) = (r.tcp.as_ref().unwrap(), r.udp.as_ref().unwrap());
    if t.failed > 0 || u.failed > 0 {
        problems.push(format!(
            "{what}{} TCP and {} UDP failures",
            t.failed, u.failed
        ));
    }
    for b in rig.topo.backends() {
        if t.per_backend.get(&b.name()).copied().unwrap_or(0) == 0 {
            problems.push(format!("{what}{b} got no TCP connection"));
        }
    }
}

fn print_report(r: &LoadReport) {
    if let (Some(t), Some(u)) = (&r.tcp, &r.udp) {
        println!(
            "    {:<12} {:>10} {:>10}",
            "backend", "TCP conns", "UDP flows"
        );
        let mut names: Vec<&String> = t.per_backend.keys().chain(u.per_backend.keys()).collect();
        names.sort();
        names.dedup();
        for n in names {
            println!(
                "    {:<12} {:>10} {:>10}",
                n,
                t.per_backend.get(n).copied().unwrap_or(0),
                u.per_backend.get(n).copied().unwrap_or(0)
            );
        }
        println!(
            "    TCP: {} ok, {} failed, {:.0} conn/s, connect p50 {:.2} ms p99 {:.2} ms, {} bytes echoed",
            t.ok, t.failed, t.connections_per_s, t.connect_ms.p50, t.connect_ms.p99, t.bytes_received
        );
        println!(
            "    UDP: {} ok, {} failed, rtt p50 {:.2} ms p99 {:.2} ms",
            u.ok, u.failed, u.rtt_ms.p50, u.rtt_ms.p99
        );
    }
}

/// Prints the agent's counters and checks that it counted exactly the flows the client made so far: every TCP
/// connection and every UDP flow is a distinct 5-tuple, so each must be one new flow on the load balancer.
fn check_flow_counts(
    rig: &Rig,
    tcp_flows: usize,
    udp_flows: usize,
    problems: &mut Vec<String>,
) -> Result<()> {
    print_agent(rig)?;
    for (proto, port, made) in [("TCP", TCP_PORT, tcp_flows), ("UDP", UDP_PORT, udp_flows)] {
        let l = format!("protocol=\"{proto}\",port=\"{port}\"");
        let counted = rig.metric("lb_upstream_cx_total", &l)?;
        if counted != made as f64 {
            problems.push(format!(
                "the agent counted {counted} {proto} flows where the client made {made}"
            ));
        }
    }
    Ok(())
}

fn print_agent(rig: &Rig) -> Result<()> {
    // The agent refreshes its counters every second and its connection counts every GC pass (1 s here).
    std::thread::sleep(Duration::from_millis(2100));
    let m = |n: &str, l: &str| rig.metric(n, l).unwrap_or(f64::NAN);
    println!("    agent /metrics:");
    for (proto, port) in [("TCP", TCP_PORT), ("UDP", UDP_PORT)] {
        let l = format!("protocol=\"{proto}\",port=\"{port}\"");
        println!(
            "      {proto}-{port}: upstream_cx_total {} active {} tx_bytes {} rx_bytes {} connect_fail {}",
            m("lb_upstream_cx_total", &l),
            m("lb_upstream_cx_active", &l),
            m("lb_upstream_cx_tx_bytes_total", &l),
            m("lb_upstream_cx_rx_bytes_total", &l),
            m("lb_upstream_cx_connect_fail_total", &l)
        );
    }
    println!(
        "      data plane: drop_malformed {} drop_no_flow {} pass_not_service {}; flow tables {} (IPv4) + {} (IPv6) \
         entries",
        m("lb_dataplane_packets_total", "reason=\"drop_malformed\""),
        m("lb_dataplane_packets_total", "reason=\"drop_no_flow\""),
        m("lb_dataplane_packets_total", "reason=\"pass_not_service\""),
        m("lb_flow_table_entries", ""),
        m("lb_flow_table_v6_entries", "")
    );
    Ok(())
}
