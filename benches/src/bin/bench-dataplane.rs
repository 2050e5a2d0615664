//! `cargo xtask bench dataplane`: nanoseconds per packet of the load balancer's XDP program, measured with
//! `BPF_PROG_TEST_RUN` (≥ 1M repeats per case), next to a bare `XDP_TX` reflector measured in the same run.
//!
//! The load balancer rewrites the test buffer, so its cases run through a wrapper that first restores the
//! template frame (see `lb-ebpf/src/bin/lb-bench.rs`). The wrapper's own cost (`restore` minus bare
//! `XDP_TX`) is measured and subtracted: `net = wrapped − (restore − tx)`; ratio = `net / reflector`.

#[path = "../../../lb-agent/tests/common/packets.rs"]
mod packets;

use anyhow::{bail, Context, Result};
use aya::maps::Array;
use aya::programs::{TestRun, TestRunOptions};
use clap::Parser;
use lb_agent::dataplane::{Dataplane, MapSizes};
use lb_agent::model::{Protocol, ServiceId, ServiceSpec};
use lb_agent::programmer::{ip_to_addr, Programmer};
use lb_benches::{median, write_json};
use lb_common::{FlowKeyV4, NextHop};
use packets::*;
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

impl Bench {
    fn program(&mut self, name: &str) -> Result<()> {
        self.dp.xdp_program(name).map(|_| ())
    }

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
            .ebpf_mut()
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
    let args = Args::parse();
    let obj = std::fs::read(&args.object).with_context(|| {
        format!(
            "reading {} (run `cargo xtask build-ebpf`)",
            args.object.display()
        )
    })?;
    let sizes = MapSizes {
        // Room for every new flow of the new-flow case (two entries each): measures inserts, not eviction.
        flows: 2 * args.repeat * args.runs as u32 + 4096,
        ..MapSizes::default()
    };
    let dp = Dataplane::load_object(&obj, &sizes, None)?;
    let mut b = Bench { dp, args };
    for p in ["bench_tx", "bench_reflect", "bench_restore", "bench_lb"] {
        b.program(p)?;
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
        &mut b.dp,
        &[
            svc(Protocol::Tcp, 80, 30080),
            svc(Protocol::Udp, 53, 30053),
            denied,
        ],
    )?;
    for i in 0..NODES {
        b.dp.set_nexthop(
            &ip_to_addr(IpAddr::V4(node_ip(i))),
            &NextHop {
                mac: node_mac(i + 1),
                _pad: 0,
                ifindex: 0,
            },
        )?;
    }

    let syn = pad(tcp(CLIENT_MAC, LB_MAC, CLIENT, 40000, VIP, 80, SYN, b""));
    let seg = pad(tcp(
        CLIENT_MAC,
        LB_MAC,
        CLIENT,
        40000,
        VIP,
        80,
        ACK,
        b"0123456789",
    ));
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

    // Establish the TCP and UDP flows once, then find the reply tuple.
    b.set_template(&syn, false)?;
    b.run("bench_lb", &syn, 1)?;
    b.set_template(&dgram, false)?;
    b.run("bench_lb", &dgram, 1)?;
    let key = FlowKeyV4 {
        src: u32::from_ne_bytes(CLIENT.octets()),
        dst: u32::from_ne_bytes(VIP.octets()),
        sport: 40000u16.to_be(),
        dport: 80u16.to_be(),
        proto: 6,
        _pad: [0; 3],
    };
    let f = b.dp.flow(&key)?.context("benchmark flow was not created")?;
    let node = Ipv4Addr::from(f.new_dst.to_ne_bytes());
    let node_i = node.octets()[3] - 10;
    let reply = pad(tcp(
        node_mac(node_i + 1),
        LB_MAC,
        node,
        u16::from_be(f.new_dport),
        VIP,
        u16::from_be(f.new_sport),
        ACK,
        b"0123456789",
    ));

    let cases: [(&'static str, &Vec<u8>, bool); 6] = [
        ("tcp_established", &seg, false),
        ("tcp_reply", &reply, false),
        ("udp_established", &dgram, false),
        ("non_service_pass", &other, false),
        ("source_range_drop", &denied_syn, false),
        // Last: it fills the flow table.
        ("tcp_new_flow_syn", &syn, true),
    ];
    let mut results = Vec::new();
    for (name, frame, vary) in cases {
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
    }

    println!(
        "data plane, BPF_PROG_TEST_RUN, {} repeats x {} runs (median), 64-byte frames",
        b.args.repeat, b.args.runs
    );
    println!("  bare XDP_TX       {bare_tx:7.1} ns/pkt");
    println!("  reflector (MACs)  {reflector:7.1} ns/pkt   <- reference");
    println!("  restore wrapper   {restore:7.1} ns/pkt   (its own cost {wrapper:.1} ns is subtracted below)");
    println!();
    println!(
        "  {:<20} {:>8} {:>11} {:>9} {:>8}",
        "case", "verdict", "wrapped ns", "net ns", "x refl."
    );
    for c in &results {
        println!(
            "  {:<20} {:>8} {:>11.1} {:>9.1} {:>8.2}",
            c.name, c.verdict, c.wrapped_ns, c.net_ns, c.ratio_to_reflector
        );
    }
    let est = results
        .iter()
        .filter(|c| c.name.contains("established") || c.name == "tcp_reply")
        .map(|c| c.ratio_to_reflector)
        .fold(0.0, f64::max);
    let new = results[results.len() - 1].ratio_to_reflector;
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
    let path = write_json("dataplane", &report)?;
    println!("  JSON: {}", path.display());
    Ok(())
}
