//! `cargo xtask bench dataplane`: nanoseconds per packet of the load balancer's XDP program, measured with
//! `BPF_PROG_TEST_RUN` (≥ 1M repeats per case), next to a bare `XDP_TX` reflector measured in the same run.
//!
//! The load balancer rewrites the test buffer, so its cases run through a wrapper that first restores the
//! template frame (see `lb-ebpf/src/bin/lb-bench.rs`). The wrapper's own cost (`restore` minus bare
//! `XDP_TX`) is measured and subtracted: `net = wrapped − (restore − tx)`; ratio = `net / reflector`.
//!
//! The IPv6 cases (`tcp6_*`, 84-byte frames: the IPv4 frames' headers and payload plus IPv6's 20 more header bytes)
//! run in the same wrapper and take the product's path: the IPv4 entry logic, then a tail call into the IPv6
//! program and, for a new flow, another into its new-flow program — the product's programs, built into the
//! benchmark object and put into its program array as the agent does (see lb-bench.rs). Their own restore
//! (84 bytes) is measured and subtracted the same way. The report compares IPv6 with IPv4, case by case; the
//! established and other fast cases are measured in rounds (each case once per round), so that the drift of a
//! shared machine does not fall on one family.
//!
//! The PROXY v2 cases (`*_proxy_*`, a service on port 8080 with the header on) are the segment the header is put
//! in front of (measured while the backend has not acknowledged it, so every repeat puts it in), an established
//! segment whose sequence number is shifted, and the backend's reply whose acknowledgement is shifted back;
//! the report compares them with the plain connection's cases.
//!
//! `--sweep` / `--threads N`: only the scaling sweep, the same program on several CPUs at once (`scaling.rs`;
//! `--sweeps K` for the medians of K sweeps, `--combine FILES` for those of sweeps run elsewhere); a smoke run ends
//! with it on one and two threads.

use anyhow::{bail, Context, Result};
use aya::maps::{PerCpuArray, PerCpuValues};
use aya::programs::{TestRun, TestRunOptions};
use clap::Parser;
use lb_agent::dataplane::maps::{FamilyMaps, Maps};
use lb_agent::dataplane::model::{Protocol, ServiceId, ServiceSpec};
use lb_agent::dataplane::programmer::{ip_to_addr, Programmer};
use lb_agent::dataplane::{Dataplane, MapSizes};
use lb_benches::{median, write_json};
use lb_common::{
    Addr, Flow, FlowKey, FlowKeyV4, FlowKeyV6, NextHop, FLOW_F_FORWARD, FLOW_F_REVERSE,
};
use lb_test_support::packets::*;
use serde::Serialize;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

mod scaling;

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
    /// Flow-table size of the production-sized cases, each family's (filled before they run).
    #[arg(long, default_value_t = 4 << 20)]
    production_flows: u32,
    /// A few seconds' run that only proves the benchmark loads and runs (`cargo xtask test`): 1000 repeats, one
    /// run, a 64k-entry production table; JSON under target/bench/smoke/.
    #[arg(long)]
    smoke: bool,
    /// Only the scaling sweep, on 1 and N threads at once (each pinned to a CPU of its own; see scaling.rs).
    #[arg(long, conflicts_with = "sweep")]
    threads: Option<usize>,
    /// Only the scaling sweep, on 1, 2, 4, … threads up to the CPUs present.
    #[arg(long)]
    sweep: bool,
    /// With `--sweep`/`--threads`: run the sweep this many times and report the medians (see scaling.rs).
    #[arg(long, default_value_t = 1)]
    sweeps: usize,
    /// Measure nothing: combine these sweeps' JSON files (`dataplane-scaling.json`, from any machine) into one
    /// table of their medians.
    #[arg(long, num_args = 1.., conflicts_with_all = ["sweep", "threads", "smoke"])]
    combine: Vec<PathBuf>,
}

/// Bytes of an IPv4 benchmark frame, and of an IPv6 one (mirrors of lb-bench.rs).
const FRAME: usize = 64;
const FRAME6: usize = 84;

/// Mirror of `BenchPacket` in lb-bench.rs.
#[repr(C)]
#[derive(Clone, Copy)]
struct BenchPacket {
    vary: u32,
    counter: u32,
    len: u32,
    _pad: u32,
    data: [u8; FRAME6],
}
// SAFETY: repr(C), integers and bytes only, no padding.
unsafe impl aya::Pod for BenchPacket {}

const VIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
const NODES: u8 = 64;
/// The VIP's port whose connections get a PROXY v2 header (both families).
const PROXY_PORT: u16 = 8080;

fn node_ip(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, 1, 10 + i)
}

const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 1);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x10);

fn node_ip6(i: u8) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0, 0, 1, 0, 0, 0, 0x10 + i as u16)
}

#[derive(Serialize)]
struct Case {
    name: &'static str,
    /// "ipv4" or "ipv6".
    family: &'static str,
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
    /// The restore of an IPv6 (84-byte) frame, and its own cost (subtracted from the IPv6 cases).
    restore6_ns: f64,
    wrapper6_cost_ns: f64,
    cases: Vec<Case>,
    targets: Targets,
    ipv6_vs_ipv4: V6VsV4,
    proxy_vs_plain_ipv4: ProxyVsPlain,
    proxy_vs_plain_ipv6: ProxyVsPlain,
}

/// A PROXY v2 connection's net cost over a plain one's, same family, same run.
#[derive(Serialize)]
struct ProxyVsPlain {
    /// `*_proxy_established` (sequence shifted) / `*_established`.
    established: f64,
    /// `*_proxy_reply` (acknowledgement shifted back) / `*_reply`.
    reply: f64,
    /// `*_proxy_first_segment` (the header put in; its frame start moved back by the wrapper, not subtracted) /
    /// `*_established`.
    first_segment: f64,
}

#[derive(Serialize)]
struct Targets {
    established_max_ratio: f64,
    established_met: bool,
    new_flow_max_ratio: f64,
    new_flow_met: bool,
}

/// IPv6's net cost over IPv4's, same case, same run.
#[derive(Serialize)]
struct V6VsV4 {
    /// `tcp6_established` / `tcp_established`.
    established: f64,
    /// `tcp6_established_full` / `tcp_established_full`.
    established_full: f64,
    /// `tcp6_reply` / `tcp_reply`.
    reply: f64,
    /// `tcp6_new_flow_syn` / `tcp_new_flow_syn`.
    new_flow: f64,
    /// `tcp6_new_flow_syn_full` / `tcp_new_flow_syn_full`.
    new_flow_full: f64,
    /// The goal for `established`.
    established_max: f64,
    established_met: bool,
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
    // The IPv6 programs into their tail-call slots, as the agent does before it attaches.
    if !dp.load_ipv6_programs(true, false)? {
        bail!("the benchmark object has no IPv6 programs (lb_xdp6): rebuild it (`cargo xtask build-ebpf`)");
    }
    let mut programmer = Programmer::new(sizes.services, sizes.backends, sizes.maglev_slots);
    let svc_on = |vip: IpAddr, protocol, port, node_port| ServiceSpec {
        id: ServiceId {
            vip,
            port,
            protocol,
        },
        snat: None,
        idle_timeout: Duration::ZERO,
        source_ranges: vec![],
        // 64 nodes: one SNAT address gives ~64k concurrent flows per node:NodePort, and the new-flow
        // case creates millions.
        backends: (0..NODES)
            .map(|i| {
                let node = match vip {
                    IpAddr::V4(_) => IpAddr::V4(node_ip(i)),
                    IpAddr::V6(_) => IpAddr::V6(node_ip6(i)),
                };
                SocketAddr::new(node, node_port)
            })
            .collect(),
        proxy_v2: false,
    };
    let svc = |protocol, port, node_port| svc_on(IpAddr::V4(VIP), protocol, port, node_port);
    let mut denied = svc(Protocol::Tcp, 8443, 30443);
    denied.source_ranges = vec!["192.0.2.0/24".parse()?];
    let proxied = |vip| ServiceSpec {
        proxy_v2: true,
        ..svc_on(vip, Protocol::Tcp, PROXY_PORT, 30880)
    };
    programmer.apply(
        &mut dp.maps,
        &[
            svc(Protocol::Tcp, 80, 30080),
            svc(Protocol::Udp, 53, 30053),
            denied,
            svc_on(IpAddr::V6(VIP6), Protocol::Tcp, 80, 30080),
            proxied(IpAddr::V4(VIP)),
            proxied(IpAddr::V6(VIP6)),
        ],
    )?;
    for i in 0..NODES {
        for node in [IpAddr::V4(node_ip(i)), IpAddr::V6(node_ip6(i))] {
            dp.maps.nexthops.insert(
                &ip_to_addr(node),
                &NextHop {
                    mac: node_mac(i + 1),
                    egress: 0,
                    _pad: 0,
                    ifindex: 0,
                },
            )?;
        }
    }
    Ok(dp)
}

/// Fills a family's flow table to its capacity with established-looking connections from other clients (both
/// entries each, written by `Maps::set_flows`: marked in the flow filter and spread over the CPUs, so that every
/// CPU's share of a table with per-CPU LRU lists is full), as a busy load balancer's table is; returns the entries
/// written. `client(i)` is the address of the `i`-th 256 connections' client.
fn fill<A: FamilyMaps>(
    maps: &mut Maps,
    capacity: u32,
    vip: A,
    client: impl Fn(u32) -> A,
    node: impl Fn(u8) -> A,
) -> Result<u32> {
    const BATCH: usize = 1 << 16;
    let mut batch = Vec::with_capacity(BATCH);
    let mut n = 0;
    let mut i = 0u32;
    while n + 2 <= capacity {
        // SNAT ports scattered over the range as the data plane's hash-seeded search leaves them (a contiguous
        // block would make every search that starts inside it walk the whole block).
        let scattered = 1024 + ((i >> 6) as u64 * 40499 % 64512) as u16;
        let (cport, sport) = ((1024 + (i & 0xff) as u16).to_be(), scattered.to_be());
        let client = client(i >> 8);
        let fwd_key = FlowKey {
            src: client,
            dst: vip,
            sport: cport,
            dport: 80u16.to_be(),
            proto: 6,
            _pad: [0; 3],
        };
        let fwd = Flow {
            new_src: vip,
            new_dst: node((i % NODES as u32) as u8),
            new_sport: sport,
            new_dport: 30080u16.to_be(),
            flags: FLOW_F_FORWARD,
            last_seen_ns: u64::MAX / 2,
            ..Default::default()
        };
        let rev = Flow {
            new_src: vip,
            new_dst: client,
            new_sport: 80u16.to_be(),
            new_dport: cport,
            flags: FLOW_F_REVERSE,
            last_seen_ns: u64::MAX / 2,
            ..Default::default()
        };
        batch.push((fwd_key, fwd));
        batch.push((fwd.partner_key(6), rev));
        n += 2;
        i += 1;
        if batch.len() >= BATCH {
            maps.set_flows(&batch)?;
            batch.clear();
        }
    }
    maps.set_flows(&batch)?;
    Ok(n)
}

/// Both families' flow tables filled ([`fill`]); returns the entries written into each.
fn fill_both(dp: &mut Dataplane, sizes: &MapSizes) -> Result<(u32, u32)> {
    let m = &mut dp.maps;
    let v4 = |a: Ipv4Addr| u32::from_ne_bytes(a.octets());
    let v6 = |a: Ipv6Addr| Addr { bytes: a.octets() }.v6_raw();
    let n4 = fill(
        m,
        sizes.flows,
        v4(VIP),
        |i| v4(Ipv4Addr::from(0x6400_0000 + i)),
        |i| v4(node_ip(i)),
    )?;
    let n6 = fill(
        m,
        sizes.flows_v6,
        v6(VIP6),
        |i| v6(Ipv6Addr::from(0x2001_0db8_6400_u128 << 80 | i as u128)),
        |i| v6(node_ip6(i)),
    )?;
    Ok((n4, n6))
}

impl Bench {
    /// Makes `frame` (IPv4, `FRAME` bytes, or IPv6, `FRAME6` bytes) the wrapper's template on every CPU; with
    /// `vary`, every repeat gets another source address and port.
    fn set_template(&mut self, frame: &[u8], vary: bool) -> Result<()> {
        self.set_templates(&[frame], vary)
    }

    /// Makes `frames[k]` CPU `k`'s template (the CPUs past the list get the first): each thread of the scaling
    /// sweep, pinned to its CPU, runs its own flows.
    fn set_templates(&mut self, frames: &[&[u8]], vary: bool) -> Result<()> {
        let packet = |frame: &[u8]| {
            if frame.len() != FRAME && frame.len() != FRAME6 {
                bail!(
                    "benchmark frames must be {FRAME} (IPv4) or {FRAME6} (IPv6) bytes, got {}",
                    frame.len()
                );
            }
            let mut data = [0u8; FRAME6];
            data[..frame.len()].copy_from_slice(frame);
            Ok(BenchPacket {
                vary: vary as u32,
                counter: 0,
                len: frame.len() as u32,
                _pad: 0,
                data,
            })
        };
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
        let values = (0..cpus)
            .map(|k| packet(frames.get(k).unwrap_or(&frames[0])))
            .collect::<Result<Vec<_>>>()?;
        let map = self
            .dp
            .ebpf_mut()?
            .map_mut("BENCH")
            .context("BENCH map missing: is this lb-bench.o?")?;
        let mut a: PerCpuArray<_, BenchPacket> = PerCpuArray::try_from(map)?;
        a.set(0, PerCpuValues::try_from(values)?, 0)?;
        Ok(())
    }

    /// Runs `prog` on `frame` with `repeat` repeats and returns (ns per run, return value, the frame afterwards).
    fn run(&mut self, prog: &str, frame: &[u8], repeat: u32) -> Result<(f64, u32, Vec<u8>)> {
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
        out.truncate(r.data_size_out as usize);
        Ok((duration_ns(r.duration), r.return_value, out))
    }

    /// Median ns per packet over `runs` measurements.
    fn measure(&mut self, prog: &str, frame: &[u8]) -> Result<(f64, u32)> {
        let mut v = Vec::new();
        let mut ret = 0;
        for _ in 0..self.args.runs {
            let (ns, r, _) = self.run(prog, frame, self.args.repeat)?;
            v.push(ns);
            ret = r;
        }
        Ok((median(v), ret))
    }

    /// Median ns per packet and return value of `bench_lb` on each case's frame (its template, not varied),
    /// measured in rounds — every case once per round, `runs` rounds — so that the drift of a shared machine falls
    /// on all of them alike, not on those measured last (IPv6's established path is compared with IPv4's).
    fn measure_rounds(&mut self, cases: &[(&str, &[u8])]) -> Result<Vec<(f64, u32)>> {
        let mut ns = vec![Vec::new(); cases.len()];
        let mut ret = vec![0; cases.len()];
        for _ in 0..self.args.runs {
            for (i, (_, frame)) in cases.iter().enumerate() {
                self.set_template(frame, false)?;
                let (t, r, _) = self.run("bench_lb", frame, self.args.repeat)?;
                ns[i].push(t);
                ret[i] = r;
            }
        }
        Ok(ns.into_iter().map(median).zip(ret).collect())
    }

    /// Sends `frame` once through the load balancer; it must be forwarded (`XDP_TX`): returns the forwarded frame.
    fn forward(&mut self, frame: &[u8], what: &str) -> Result<Parsed> {
        self.set_template(frame, false)?;
        let (_, verdict, out) = self.run("bench_lb", frame, 1)?;
        if verdict != XDP_TX {
            bail!(
                "{what} was not forwarded (verdict {}, counters {:?})",
                verdict_name(verdict),
                self.dp.maps.stats.totals().unwrap_or_default()
            );
        }
        Ok(parse(&out))
    }
}

const XDP_TX: u32 = 3;

/// A connection opened by [`open_connection`], as segments to send through the load balancer again.
struct Conn {
    /// The client's handshake-completing ACK, carrying its first 10 bytes (on a PROXY port: the segment the header
    /// goes in front of, again on every repeat until the backend acknowledges it).
    first: Vec<u8>,
    /// The backend's reply: 10 bytes, acknowledging the client's first 10 (and a PROXY header).
    reply: Vec<u8>,
    /// The client's next 10 bytes.
    next: Vec<u8>,
}

/// Opens a connection from `client`:`port` to `vip`:`dport` (either family) on the current data plane — the
/// client's SYN, the backend's SYN-ACK, the client's ACK with its first bytes — and returns its segments. On a
/// PROXY port the forwarded ACK must have grown by the header.
fn open_connection(
    b: &mut Bench,
    client: IpAddr,
    vip: IpAddr,
    port: u16,
    dport: u16,
) -> Result<Conn> {
    const ISN: u32 = 1000;
    const BACKEND_ISN: u32 = 5000;
    let to_vip = |flags, seq_ack, payload: &[u8]| {
        pad(tcp_seq(
            CLIENT_MAC,
            LB_MAC,
            (client, port),
            (vip, dport),
            flags,
            seq_ack,
            payload,
        ))
    };
    let syn = b.forward(
        &to_vip(SYN, (ISN, 0), b""),
        &format!("the SYN from port {port}"),
    )?;
    // The backend answers the SNAT address and port the SYN came from.
    let from_node = |flags, seq_ack, payload: &[u8]| {
        pad(tcp_seq(
            syn.dst_mac,
            LB_MAC,
            (syn.dst, syn.dport),
            (syn.src, syn.sport),
            flags,
            seq_ack,
            payload,
        ))
    };
    let first = to_vip(ACK, (ISN + 1, BACKEND_ISN + 1), b"0123456789");
    b.forward(
        &from_node(SYN_ACK, (BACKEND_ISN, ISN + 1), b""),
        "the SYN-ACK",
    )?;
    let sent = b.forward(&first, "the handshake's ACK")?;
    let header = match (dport == PROXY_PORT, vip) {
        (false, _) => 0,
        (true, IpAddr::V4(_)) => lb_common::proxy::HEADER_LEN_V4 as u32,
        (true, IpAddr::V6(_)) => lb_common::proxy::HEADER_LEN_V6 as u32,
    };
    if sent.payload.len() != 10 + header as usize {
        bail!(
            "the handshake's ACK left with {} bytes of payload, not {}",
            sent.payload.len(),
            10 + header
        );
    }
    let established = match (client, vip) {
        (IpAddr::V4(c), IpAddr::V4(v)) => {
            b.dp.maps
                .flows
                .get(&FlowKeyV4 {
                    src: u32::from_ne_bytes(c.octets()),
                    dst: u32::from_ne_bytes(v.octets()),
                    sport: port.to_be(),
                    dport: dport.to_be(),
                    proto: 6,
                    _pad: [0; 3],
                })?
                .is_some()
        }
        (IpAddr::V6(c), IpAddr::V6(v)) => {
            b.dp.maps
                .flows_v6
                .get(&FlowKeyV6 {
                    src: Addr { bytes: c.octets() }.v6_raw(),
                    dst: Addr { bytes: v.octets() }.v6_raw(),
                    sport: port.to_be(),
                    dport: dport.to_be(),
                    proto: 6,
                    _pad: [0; 3],
                })?
                .is_some()
        }
        _ => bail!("{client} and {vip} are of different families"),
    };
    if !established {
        bail!("the connection from {client} port {port} was not established");
    }
    Ok(Conn {
        first,
        reply: from_node(ACK, (BACKEND_ISN + 1, ISN + 1 + header + 10), b"0123456789"),
        next: to_vip(ACK, (ISN + 11, BACKEND_ISN + 11), b"0123456789"),
    })
}

fn duration_ns(d: Duration) -> f64 {
    d.as_secs_f64() * 1e9
}

/// `f` padded to the benchmark frame size of its family.
fn pad(mut f: Vec<u8>) -> Vec<u8> {
    let len = if f[12..14] == [0x86, 0xdd] {
        FRAME6
    } else {
        FRAME
    };
    assert!(f.len() <= len, "a {}-byte frame exceeds {len}", f.len());
    f.resize(len, 0);
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
    if !args.combine.is_empty() {
        return scaling::combine_files(&args.combine);
    }
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
        // entries, so that runs of both designs compare): measures inserts, not eviction. IPv6 the same.
        flows: room,
        transient: room,
        flows_v6: room,
        transient_v6: room,
        ..MapSizes::default()
    };
    let production = MapSizes {
        // Katran's production flow table (4M), filled; our default transient table, which the SYNs overrun. IPv6's
        // flow table the same size (its default is smaller): the cases compare with IPv4's.
        flows: args.production_flows,
        flows_v6: args.production_flows,
        ..MapSizes::default()
    };
    let cpus = lb_benches::allowed_cpus()?.len();
    let counts = match (args.threads, args.sweep) {
        (Some(n), _) => Some(if n > 1 { vec![1, n] } else { vec![1] }),
        (None, true) => Some(scaling::sweep_counts(cpus)),
        (None, false) => None,
    };
    if let Some(counts) = counts {
        let mut b = Bench {
            dp: load(&obj, &MapSizes::default())?,
            args,
        };
        let sweeps = b.args.sweeps;
        return scaling::run(&mut b, &obj, &counts, sweeps);
    }
    let mut b = Bench {
        dp: load(&obj, &sizes)?,
        args,
    };
    let syn = pad(tcp(CLIENT_MAC, LB_MAC, CLIENT, 40000, VIP, 80, SYN, b""));
    let syn6 = pad(tcp(CLIENT_MAC, LB_MAC, CLIENT6, 40000, VIP6, 80, SYN, b""));
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
    b.set_template(&syn6, false)?;
    let (restore6, _) = b.measure("bench_restore", &syn6)?;
    let wrapper6 = (restore6 - bare_tx).max(0.0);

    // Establish the TCP connections and the UDP flow once.
    let c4 = open_connection(&mut b, CLIENT.into(), VIP.into(), 40000, 80)?;
    let c6 = open_connection(&mut b, CLIENT6.into(), VIP6.into(), 40000, 80)?;
    let p4 = open_connection(&mut b, CLIENT.into(), VIP.into(), 40000, PROXY_PORT)?;
    let p6 = open_connection(&mut b, CLIENT6.into(), VIP6.into(), 40000, PROXY_PORT)?;
    b.forward(&dgram, "the UDP datagram")?;

    let mut results = Vec::new();
    let mut record = |name, frame: &[u8], (ns, ret): (f64, u32)| {
        let (family, wrapper) = if frame.len() == FRAME6 {
            ("ipv6", wrapper6)
        } else {
            ("ipv4", wrapper)
        };
        let net = (ns - wrapper).max(0.0);
        results.push(Case {
            name,
            family,
            verdict: verdict_name(ret),
            wrapped_ns: ns,
            net_ns: net,
            ratio_to_reflector: net / reflector,
        });
    };
    // PROXY: the first segment gets the header put in on every repeat while the backend has not acknowledged it;
    // then the backend's reply acknowledges it, and the connection's segments only have their numbers shifted.
    let inserting: [(&'static str, &[u8]); 2] = [
        ("tcp_proxy_first_segment", &p4.first),
        ("tcp6_proxy_first_segment", &p6.first),
    ];
    let inserted = b.measure_rounds(&inserting)?;
    for p in [&p4, &p6] {
        b.forward(&p.reply, "the PROXY backend's reply")?;
    }
    let fast: [(&'static str, &[u8]); 11] = [
        ("tcp_established", &c4.first),
        ("tcp_reply", &c4.reply),
        ("udp_established", &dgram),
        ("non_service_pass", &other),
        ("source_range_drop", &denied_syn),
        ("tcp_proxy_established", &p4.next),
        ("tcp_proxy_reply", &p4.reply),
        ("tcp6_established", &c6.first),
        ("tcp6_reply", &c6.reply),
        ("tcp6_proxy_established", &p6.next),
        ("tcp6_proxy_reply", &p6.reply),
    ];
    for ((name, frame), m) in fast.into_iter().zip(b.measure_rounds(&fast)?) {
        record(name, frame, m);
    }
    // (Listed after the fast cases, measured before them.)
    for ((name, frame), m) in inserting.into_iter().zip(inserted) {
        record(name, frame, m);
    }
    // Last: they fill the handshake tables (sized to hold every one of them: no eviction).
    for (name, frame) in [("tcp_new_flow_syn", &syn), ("tcp6_new_flow_syn", &syn6)] {
        b.set_template(frame, true)?;
        record(name, frame, b.measure("bench_lb", frame)?);
    }
    // The steady state of a busy load balancer: production-sized flow tables, full, and the default handshake
    // tables, which the SYNs overrun (every insert evicts).
    b.dp = load(&obj, &production)?;
    let (filled, filled6) = fill_both(&mut b.dp, &production)?;
    for (name, frame) in [
        ("tcp_new_flow_syn_full", &syn),
        ("tcp6_new_flow_syn_full", &syn6),
    ] {
        b.set_template(frame, true)?;
        record(name, frame, b.measure("bench_lb", frame)?);
    }
    let c4 = open_connection(&mut b, CLIENT.into(), VIP.into(), 40001, 80)?;
    let c6 = open_connection(&mut b, CLIENT6.into(), VIP6.into(), 40001, 80)?;
    let full: [(&'static str, &[u8]); 2] = [
        ("tcp_established_full", &c4.first),
        ("tcp6_established_full", &c6.first),
    ];
    for ((name, frame), m) in full.into_iter().zip(b.measure_rounds(&full)?) {
        record(name, frame, m);
    }
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
    b.set_template(&spoofed, true)?;
    record(
        "tcp_syn_guard_drop_full",
        &spoofed,
        b.measure("bench_lb", &spoofed)?,
    );
    // Printed and written IPv4 first, each family in the order measured.
    results.sort_by_key(|c| c.family);

    println!(
        "data plane, BPF_PROG_TEST_RUN, {} repeats x {} runs (median), 64-byte IPv4 / 84-byte IPv6 frames",
        b.args.repeat, b.args.runs
    );
    println!(
        "  *_full: flow tables of {} entries holding {filled} (IPv4) and {filled6} (IPv6), handshake tables of {} \
         and {} entries",
        production.flows, production.transient, production.transient_v6
    );
    println!("  bare XDP_TX       {bare_tx:7.1} ns/pkt");
    println!("  reflector (MACs)  {reflector:7.1} ns/pkt   <- reference");
    println!("  restore wrapper   {restore:7.1} ns/pkt   (its own cost {wrapper:.1} ns is subtracted below)");
    println!(
        "  restore, IPv6     {restore6:7.1} ns/pkt   (its own cost {wrapper6:.1} ns is subtracted from tcp6_*)"
    );
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
    // The targets are IPv4's (IPv6's is its ratio to IPv4, below).
    let v4 = || results.iter().filter(|c| c.family == "ipv4");
    let est = v4()
        .filter(|c| !c.name.contains("proxy"))
        .filter(|c| c.name.contains("established") || c.name == "tcp_reply")
        .map(|c| c.ratio_to_reflector)
        .fold(0.0, f64::max);
    let new = v4()
        .filter(|c| c.name.starts_with("tcp_new_flow"))
        .map(|c| c.ratio_to_reflector)
        .fold(0.0, f64::max);
    let targets = Targets {
        established_max_ratio: est,
        established_met: est <= 1.5,
        new_flow_max_ratio: new,
        new_flow_met: new <= 3.0,
    };
    let net = |name: &str| {
        results
            .iter()
            .find(|c| c.name == name)
            .map_or(f64::NAN, |c| c.net_ns)
    };
    let v6_over_v4 = |case: &str| net(&case.replacen("tcp", "tcp6", 1)) / net(case);
    let established = v6_over_v4("tcp_established");
    let ipv6_vs_ipv4 = V6VsV4 {
        established,
        established_full: v6_over_v4("tcp_established_full"),
        reply: v6_over_v4("tcp_reply"),
        new_flow: v6_over_v4("tcp_new_flow_syn"),
        new_flow_full: v6_over_v4("tcp_new_flow_syn_full"),
        established_max: 1.3,
        established_met: established <= 1.3,
    };
    let proxy = |v6: bool| {
        let (plain, proxied) = if v6 {
            ("tcp6", "tcp6_proxy")
        } else {
            ("tcp", "tcp_proxy")
        };
        ProxyVsPlain {
            established: net(&format!("{proxied}_established"))
                / net(&format!("{plain}_established")),
            reply: net(&format!("{proxied}_reply")) / net(&format!("{plain}_reply")),
            first_segment: net(&format!("{proxied}_first_segment"))
                / net(&format!("{plain}_established")),
        }
    };
    let (proxy4, proxy6) = (proxy(false), proxy(true));
    let met = |m: bool| if m { "met" } else { "NOT met" };
    println!();
    println!(
        "  targets: established ≤ 1.5x reflector: {} ({est:.2}x); new flow ≤ 3x: {} ({new:.2}x)",
        met(targets.established_met),
        met(targets.new_flow_met),
    );
    println!(
        "  IPv6 / IPv4, net: established {:.2}x (goal ≤ {:.1}x: {}), reply {:.2}x, new flow {:.2}x; full tables: \
         established {:.2}x, new flow {:.2}x",
        ipv6_vs_ipv4.established,
        ipv6_vs_ipv4.established_max,
        met(ipv6_vs_ipv4.established_met),
        ipv6_vs_ipv4.reply,
        ipv6_vs_ipv4.new_flow,
        ipv6_vs_ipv4.established_full,
        ipv6_vs_ipv4.new_flow_full,
    );
    for (family, p) in [("IPv4", &proxy4), ("IPv6", &proxy6)] {
        println!(
            "  PROXY / plain, {family}, net: established {:.2}x, reply {:.2}x, first segment (header put in) {:.2}x",
            p.established, p.reply, p.first_segment
        );
    }
    let report = Report {
        repeat: b.args.repeat,
        runs: b.args.runs,
        bare_tx_ns: bare_tx,
        reflector_ns: reflector,
        restore_ns: restore,
        wrapper_cost_ns: wrapper,
        restore6_ns: restore6,
        wrapper6_cost_ns: wrapper6,
        cases: results,
        targets,
        ipv6_vs_ipv4,
        proxy_vs_plain_ipv4: proxy4,
        proxy_vs_plain_ipv6: proxy6,
    };
    let path = write_json("dataplane", b.args.smoke, &report)?;
    println!("  JSON: {}", path.display());
    if b.args.smoke {
        // The sweep's code paths too (threads on CPUs of their own), at smoke size.
        scaling::run(&mut b, &obj, &scaling::sweep_counts(cpus.min(2)), 1)?;
    }
    Ok(())
}
