//! `cargo xtask bench dataplane`: nanoseconds per packet of the load balancer's XDP program, measured with
//! `BPF_PROG_TEST_RUN` (≥ 1M repeats per case), next to a bare `XDP_TX` reflector measured in the same run.
//!
//! The load balancer rewrites the test buffer, so its cases run through a wrapper that first restores the
//! template frame (see `lb-ebpf/src/bin/lb-bench.rs`). The wrapper's own cost (`restore` minus bare
//! `XDP_TX`) is measured and subtracted: `net = wrapped − (restore − tx)`; ratio = `net / reflector`.

use anyhow::{bail, Context, Result};
use aya::maps::Array;
use aya::programs::{TestRun, TestRunOptions};
use clap::Parser;
use lb_agent::dataplane::model::{Protocol, ServiceId, ServiceSpec};
use lb_agent::dataplane::programmer::{ip_to_addr, Programmer};
use lb_agent::dataplane::{Dataplane, MapSizes};
use lb_benches::{median, write_json};
use lb_common::{FlowKeyV4, FlowV4, NextHop, FLOW_F_FORWARD, FLOW_F_REVERSE};
use lb_test_support::packets::*;
use serde::Serialize;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
struct Args {
    /// The benchmark object (built by `cargo xtask build-ebpf`).
    #[arg(long, default_value = "target/bpf/lb-bench.o")]
    object: PathBuf,
    /// Repeats per measurement.
    #[arg(long, default_value_t = 1_000_000)]
    repeat: u32,
    /// Measurements per case (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Flow-table size of the production-sized case (filled before it runs).
    #[arg(long, default_value_t = 4 << 20)]
    production_flows: u32,
    /// A few seconds' run that only proves the benchmark loads and runs (`cargo xtask test`): 1000 repeats, one
    /// run, a 64k-entry production table; JSON under target/bench/smoke/.
    #[arg(long)]
    smoke: bool,
}

const FRAME: usize = 64;

/// Mirror of `BenchPacket` in lb-bench.rs.
#[repr(C)]
#[derive(Clone, Copy)]
struct BenchPacket {
    vary: u32,
    counter: u32,
    data: [u8; FRAME],
}
// SAFETY: repr(C), integers and bytes only, no padding.
unsafe impl aya::Pod for BenchPacket {}

const VIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
const NODES: u8 = 64;

fn node_ip(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, 1, 10 + i)
}

#[derive(Serialize)]
struct Case {
    name: &'static str,
    verdict: &'static str,
    wrapped_ns: f64,
    net_ns: f64,
    ratio_to_reflector: f64,
}

#[derive(Serialize)]
struct Report {
    repeat: u32,
    runs: usize,
    bare_tx_ns: f64,
    reflector_ns: f64,
    restore_ns: f64,
    wrapper_cost_ns: f64,
    cases: Vec<Case>,
    targets: Targets,
}

#[derive(Serialize)]
struct Targets {
    established_max_ratio: f64,
    established_met: bool,
    new_flow_max_ratio: f64,
    new_flow_met: bool,
}

struct Bench {
    dp: Dataplane,
    args: Args,
}

/// Loads the benchmark object with `sizes` and programs the services and next hops every case uses.
fn load(obj: &[u8], sizes: &MapSizes) -> Result<Dataplane> {
    let mut dp = Dataplane::load_object(obj, sizes, None)?;
    for p in ["bench_tx", "bench_reflect", "bench_restore", "bench_lb"] {
        dp.xdp_program(p)?;
    }
    let mut programmer = Programmer::new(sizes.services, sizes.backends, sizes.maglev_slots);
    let svc = |protocol, port, node_port| ServiceSpec {
        id: ServiceId {
            vip: IpAddr::V4(VIP),
            port,
            protocol,
        },
        snat: None,
        idle_timeout: Duration::ZERO,
        source_ranges: vec![],
        // 64 nodes: one SNAT address gives ~64k concurrent flows per node:NodePort, and the new-flow
        // case creates millions.
        backends: (0..NODES)
            .map(|i| SocketAddr::new(IpAddr::V4(node_ip(i)), node_port))
            .collect(),
    };
    let mut denied = svc(Protocol::Tcp, 8443, 30443);
    denied.source_ranges = vec!["192.0.2.0/24".parse()?];
    programmer.apply(
        &mut dp.maps,
        &[
            svc(Protocol::Tcp, 80, 30080),
            svc(Protocol::Udp, 53, 30053),
            denied,
        ],
    )?;
    for i in 0..NODES {
        dp.maps.nexthops.insert(
            &ip_to_addr(IpAddr::V4(node_ip(i))),
            &NextHop {
                mac: node_mac(i + 1),
                _pad: 0,
                ifindex: 0,
            },
        )?;
    }
    Ok(dp)
}

/// Fills the flow table to its capacity with established-looking connections from other clients (both
/// entries each), as a busy load balancer's table is; returns the entries written.
fn fill(dp: &mut Dataplane, capacity: u32) -> Result<u32> {
    let mut n = 0;
    let mut i = 0u32;
    while n + 2 <= capacity {
        let client = u32::from_ne_bytes(Ipv4Addr::from(0x6400_0000 + (i >> 8)).octets());
        let node = u32::from_ne_bytes(node_ip((i % NODES as u32) as u8).octets());
        let vip = u32::from_ne_bytes(VIP.octets());
        // SNAT ports scattered over the range as the data plane's hash-seeded search leaves them (a contiguous
        // block would make every search that starts inside it walk the whole block).
        let scattered = 1024 + ((i >> 6) as u64 * 40499 % 64512) as u16;
        let (cport, sport) = ((1024 + (i & 0xff) as u16).to_be(), scattered.to_be());
        let fwd_key = FlowKeyV4 {
            src: client,
            dst: vip,
            sport: cport,
            dport: 80u16.to_be(),
            proto: 6,
            _pad: [0; 3],
        };
        let fwd = FlowV4 {
            new_src: vip,
            new_dst: node,
            new_sport: sport,
            new_dport: 30080u16.to_be(),
            flags: FLOW_F_FORWARD,
            last_seen_ns: u64::MAX / 2,
            ..Default::default()
        };
        let rev = FlowV4 {
            new_src: vip,
            new_dst: client,
            new_sport: 80u16.to_be(),
            new_dport: cport,
            flags: FLOW_F_REVERSE,
            last_seen_ns: u64::MAX / 2,
            ..Default::default()
        };
        dp.maps.set_flow(&fwd_key, &fwd)?;
        dp.maps.set_flow(&fwd.partner_key(6), &rev)?;
        n += 2;
        i += 1;
    }
    Ok(n)
}

impl Bench {
    fn set_template(&mut self, frame: &[u8], vary: bool) -> Result<()> {
        if frame.len() != FRAME {
            bail!(
                "benchmark frames must be {FRAME} bytes, got {}",
                frame.len()
            );
        }
        let mut data = [0u8; FRAME];
        data.copy_from_slice(frame);
        let map = self
            .dp
            .ebpf_mut()?
            .map_mut("BENCH")
            .context("BENCH map missing: is this lb-bench.o?")?;
        let mut a: Array<_, BenchPacket> = Array::try_from(map)?;
        a.set(
            0,
            BenchPacket {
                vary: vary as u32,
                counter: 0,
                data,
            },
            0,
        )?;
        Ok(())
    }

    /// Runs `prog` on `frame` with `repeat` repeats and returns (ns per run, return value).
    fn run(&mut self, prog: &str, frame: &[u8], repeat: u32) -> Result<(f64, u32)> {
        let mut out = vec![0u8; frame.len() + 256];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.data_out = Some(&mut out);
        opts.repeat = repeat;
        let r = self
            .dp
            .xdp_program(prog)?
            .test_run(opts)
            .with_context(|| format!("test run of {prog}"))?;
        Ok((duration_ns(r.duration), r.return_value))
    }

    /// Median ns per packet over `runs` measurements.
    fn measure(&mut self, prog: &str, frame: &[u8]) -> Result<(f64, u32)> {
        let mut v = Vec::new();
        let mut ret = 0;
        for _ in 0..self.args.runs {
            let (ns, r) = self.run(prog, frame, self.args.repeat)?;
            v.push(ns);
            ret = r;
        }
        Ok((median(v), ret))
    }
}

/// Opens a connection from CLIENT:`port` to VIP:80 on the current data plane — the client's SYN, the backend's
/// SYN-ACK, the client's ACK — and returns its established segment and a reply from its backend.
fn open_connection(b: &mut Bench, port: u16) -> Result<(Vec<u8>, Vec<u8>)> {
    let syn = pad(tcp(CLIENT_MAC, LB_MAC, CLIENT, port, VIP, 80, SYN, b""));
    b.set_template(&syn, false)?;
    let (_, verdict) = b.run("bench_lb", &syn, 1)?;
    let key = FlowKeyV4 {
        src: u32::from_ne_bytes(CLIENT.octets()),
        dst: u32::from_ne_bytes(VIP.octets()),
        sport: port.to_be(),
        dport: 80u16.to_be(),
        proto: 6,
        _pad: [0; 3],
    };
    let (_, f) = b.dp.maps.handshake(&key)?.with_context(|| {
        format!(
            "the SYN from port {port} opened no handshake (verdict {}, counters {:?})",
            verdict_name(verdict),
            b.dp.maps.stats.totals().unwrap_or_default()
        )
    })?;
    let f = f.fwd;
    let node = Ipv4Addr::from(f.new_dst.to_ne_bytes());
    let from_node = |flags, payload: &[u8]| {
        pad(tcp(
            node_mac(node.octets()[3] - 9),
            LB_MAC,
            node,
            u16::from_be(f.new_dport),
            VIP,
            u16::from_be(f.new_sport),
            flags,
            payload,
        ))
    };
    let seg = pad(tcp(
        CLIENT_MAC,
        LB_MAC,
        CLIENT,
        port,
        VIP,
        80,
        ACK,
        b"0123456789",
    ));
    for frame in [&from_node(SYN_ACK, b""), &seg] {
        b.set_template(frame, false)?;
        b.run("bench_lb", frame, 1)?;
    }
    b.dp.maps
        .flows
        .get(&key)?
        .with_context(|| format!("the connection from port {port} was not established"))?;
    Ok((seg, from_node(ACK, b"0123456789")))
}

fn duration_ns(d: Duration) -> f64 {
    d.as_secs_f64() * 1e9
}

fn pad(mut f: Vec<u8>) -> Vec<u8> {
    f.resize(FRAME, 0);
    f
}

fn verdict_name(v: u32) -> &'static str {
    match v {
        0 => "ABORTED",
        1 => "DROP",
        2 => "PASS",
        3 => "TX",
        _ => "?",
    }
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    if args.smoke {
        (args.repeat, args.runs, args.production_flows) = (1000, 1, 1 << 16);
    }
    let obj = std::fs::read(&args.object).with_context(|| {
        format!(
            "reading {} (run `cargo xtask build-ebpf`)",
            args.object.display()
        )
    })?;
    let room = 2 * args.repeat * args.runs as u32 + 4096;
    let sizes = MapSizes {
        // Room for every entry the new-flow case makes (one per SYN; sized for two, as when a handshake had two
        // entries, so that runs of both designs compare): measures inserts, not eviction.
        flows: room,
        transient: room,
        ..MapSizes::default()
    };
    let production = MapSizes {
        // Katran's production flow table (4M), filled; our default transient table, which the SYNs overrun.
        flows: args.production_flows,
        ..MapSizes::default()
    };
    let mut b = Bench {
        dp: load(&obj, &sizes)?,
        args,
    };
    let syn = pad(tcp(CLIENT_MAC, LB_MAC, CLIENT, 40000, VIP, 80, SYN, b""));
    let dgram = pad(udp(
        CLIENT_MAC,
        LB_MAC,
        CLIENT,
        5353,
        VIP,
        53,
        b"0123456789",
    ));
    let other = pad(tcp(CLIENT_MAC, LB_MAC, CLIENT, 40000, VIP, 22, SYN, b""));
    let denied_syn = pad(tcp(CLIENT_MAC, LB_MAC, CLIENT, 40000, VIP, 8443, SYN, b""));

    // Baselines.
    let (bare_tx, _) = b.measure("bench_tx", &syn)?;
    let (reflector, _) = b.measure("bench_reflect", &syn)?;
    b.set_template(&syn, false)?;
    let (restore, _) = b.measure("bench_restore", &syn)?;
    let wrapper = (restore - bare_tx).max(0.0);

    // Establish the TCP connection and the UDP flow once.
    let (seg, reply) = open_connection(&mut b, 40000)?;
    b.set_template(&dgram, false)?;
    b.run("bench_lb", &dgram, 1)?;

    let cases: [(&'static str, &Vec<u8>, bool); 6] = [
        ("tcp_established", &seg, false),
        ("tcp_reply", &reply, false),
        ("udp_established", &dgram, false),
        ("non_service_pass", &other, false),
        ("source_range_drop", &denied_syn, false),
        // Last: it fills the handshake table (sized to hold every one of them: no eviction).
        ("tcp_new_flow_syn", &syn, true),
    ];
    let mut results = Vec::new();
    let mut case = |b: &mut Bench, name, frame: &Vec<u8>, vary| -> Result<()> {
        b.set_template(frame, vary)?;
        let (ns, ret) = b.measure("bench_lb", frame)?;
        let net = (ns - wrapper).max(0.0);
        results.push(Case {
            name,
            verdict: verdict_name(ret),
            wrapped_ns: ns,
            net_ns: net,
            ratio_to_reflector: net / reflector,
        });
        Ok(())
    };
    for (name, frame, vary) in cases {
        case(&mut b, name, frame, vary)?;
    }
    // The steady state of a busy load balancer: a production-sized flow table, full, and the default handshake
    // table, which the SYNs overrun (every insert evicts).
    b.dp = load(&obj, &production)?;
    let filled = fill(&mut b.dp, production.flows)?;
    case(&mut b, "tcp_new_flow_syn_full", &syn, true)?;
    let (seg, _) = open_connection(&mut b, 40001)?;
    case(&mut b, "tcp_established_full", &seg, false)?;
    // A SYN flood with the rate guard on, over its rate: what a spoofed SYN costs once the guard drops it. (Other
    // sources than the cases above, whose handshakes are still in the table.)
    b.dp.maps.config.set(
        lb_common::CONFIG_INDEX,
        &lb_common::Config::default().with_syn_rate(1, 1),
    )?;
    let spoofed = pad(tcp(
        CLIENT_MAC,
        LB_MAC,
        Ipv4Addr::new(100, 64, 0, 0),
        40000,
        VIP,
        80,
        SYN,
        b"",
    ));
    case(&mut b, "tcp_syn_guard_drop_full", &spoofed, true)?;

    println!(
        "data plane, BPF_PROG_TEST_RUN, {} repeats x {} runs (median), 64-byte frames",
        b.args.repeat, b.args.runs
    );
    println!(
        "  *_full: flow table of {} entries holding {filled}, handshake table of {} entries",
        production.flows, production.transient
    );
    println!("  bare XDP_TX       {bare_tx:7.1} ns/pkt");
    println!("  reflector (MACs)  {reflector:7.1} ns/pkt   <- reference");
    println!("  restore wrapper   {restore:7.1} ns/pkt   (its own cost {wrapper:.1} ns is subtracted below)");
    println!();
    println!(
        "  {:<24} {:>8} {:>11} {:>9} {:>8}",
        "case", "verdict", "wrapped ns", "net ns", "x refl."
    );
    for c in &results {
        println!(
            "  {:<24} {:>8} {:>11.1} {:>9.1} {:>8.2}",
            c.name, c.verdict, c.wrapped_ns, c.net_ns, c.ratio_to_reflector
        );
    }
    let est = results
        .iter()
        .filter(|c| c.name.contains("established") || c.name == "tcp_reply")
        .map(|c| c.ratio_to_reflector)
        .fold(0.0, f64::max);
    let new = results
        .iter()
        .filter(|c| c.name.starts_with("tcp_new_flow"))
        .map(|c| c.ratio_to_reflector)
        .fold(0.0, f64::max);
    let targets = Targets {
        established_max_ratio: est,
        established_met: est <= 1.5,
        new_flow_max_ratio: new,
        new_flow_met: new <= 3.0,
    };
    println!();
    println!(
        "  targets: established ≤ 1.5x reflector: {} ({est:.2}x); new flow ≤ 3x: {} ({new:.2}x)",
        if targets.established_met {
            "met"
        } else {
            "NOT met"
        },
        if targets.new_flow_met {
            "met"
        } else {
            "NOT met"
        },
    );
    let report = Report {
        repeat: b.args.repeat,
        runs: b.args.runs,
        bare_tx_ns: bare_tx,
        reflector_ns: reflector,
        restore_ns: restore,
        wrapper_cost_ns: wrapper,
        cases: results,
        targets,
    };
    let path = write_json("dataplane", b.args.smoke, &report)?;
    println!("  JSON: {}", path.display());
    Ok(())
}
