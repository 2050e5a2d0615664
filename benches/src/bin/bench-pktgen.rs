//! `cargo xtask bench pktgen`: packets per second forwarded by the load balancer on the netns topology,
//! generated with `BPF_PROG_TEST_RUN` in XDP live-frames mode (this kernel has no pktgen module).
//!
//! ```text
//!  client ns: bench_gen (live frames, XDP_TX out of eth0)
//!     → bridge → lb ns eth0: [the load balancer | bench_fwd reference] XDP_TX
//!     → bridge → backend ns eth0: bench_sink (counts frames carrying the magic trailer, drops them)
//! ```
//!
//! The reference is `bench_fwd`: a bare `XDP_TX` forwarder on the same interface that only rewrites the
//! MACs towards a backend. Both run through exactly the same veths and bridge, so the ratio isolates the
//! load balancer. On veths every hop of the chain runs in the generating CPU's softirq, so the
//! forwarded rate is "the whole chain on one core"; the in-program cost per packet on the LB's interface
//! comes from `BPF_ENABLE_STATS` (run_time_ns / run_cnt) of the program attached there.
//!
//! `--cpus N`: every case also with the generator on N CPUs at once (a thread pinned to each, its own template and
//! flows: the generator's map is per CPU), so N softirqs run the chain side by side, as N NIC queues would; the
//! table gives each case on one CPU and on N, in rounds.
//!
//! `--routed`: the routed topology (backends on bridge br1 behind the lb's second interface eth1; the agent
//! runs with `--interface eth0,eth1`), and the reference is `bench_fwd_redir`, which rewrites the MACs
//! the same way (source: eth1's) and `XDP_REDIRECT`s through a device map to eth1:
//!
//! ```text
//!  client → br0 → lb ns eth0: [the load balancer | bench_fwd_redir] → eth1 → br1 → backend eth0: bench_sink
//! ```

use anyhow::{bail, Context, Result};
use aya::maps::{Array, DevMap, PerCpuArray, PerCpuValues};
use aya::programs::{TestRun, TestRunAttrs, TestRunOptions, Xdp, XdpMode};
use aya::Ebpf;
use clap::Parser;
use lb_agent::dataplane::{Dataplane, MapSizes};
use lb_benches::{
    allowed_cpus, cpu_model, fmt_num, in_netns, median, pin_cpu, print_table, prog_stats,
    write_json,
};
use lb_test_support::packets::*;
use lb_testbed::rig::{Rig, RigConfig};
use lb_testbed::{Host, Topology, TopologyConfig};
use serde::Serialize;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// The benchmark object (built by `cargo xtask build-ebpf`).
    #[arg(long, default_value = "target/bpf/lb-bench.o")]
    object: PathBuf,
    /// `xdp-pass.o` for the bridge side of the reference forwarder's veth.
    #[arg(long, default_value = "target/bpf/xdp-pass.o")]
    xdp_pass: PathBuf,
    /// Seconds of generation per measurement (≤ 20).
    #[arg(long, default_value_t = 3.0)]
    secs: f64,
    /// Measurements per case (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Live-frames batch size.
    #[arg(long, default_value_t = 64)]
    batch: u32,
    /// Load-balancer attach modes to measure (besides the reference).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "xdp-native,xdp-generic,tc"
    )]
    modes: Vec<String>,
    /// CPU the generator (and with it the whole veth chain) runs on.
    #[arg(long, default_value_t = 1)]
    cpu: usize,
    /// Also measure with the generator on this many CPUs at once (the first ones this process may use), each
    /// thread on flows of its own: every case on `--cpu` alone and on N CPUs, in rounds.
    #[arg(long, default_value_t = 1)]
    cpus: usize,
    /// The routed topology: backends behind the load balancer's second interface, the reference an
    /// `XDP_REDIRECT` forwarder to it (JSON `pktgen-routed`).
    #[arg(long)]
    routed: bool,
    /// A few seconds' run that only proves the benchmark loads and delivers (`cargo xtask test`): 0.2 s, one run
    /// per case, every mode, on one CPU and on two; JSON under target/bench/smoke/.
    #[arg(long)]
    smoke: bool,
}

const FRAME: usize = 64;
const MAGIC: &[u8; 8] = b"LBPKTGEN";
/// Source ports cycled by the established/UDP cases (flows created once, then hit).
const PORT_MASK: u32 = 1023;

/// Mirror of `GenPacket` in lb-bench.rs.
#[repr(C)]
#[derive(Clone, Copy)]
struct GenPacket {
    mode: u32,
    mask: u32,
    counter: u32,
    _pad: u32,
    data: [u8; FRAME],
}
// SAFETY: repr(C), integers and bytes only, no padding.
unsafe impl aya::Pod for GenPacket {}

/// Mirror of `FwdCfg` in lb-bench.rs.
#[repr(C)]
#[derive(Clone, Copy)]
struct FwdCfg {
    n: u32,
    _pad: u32,
    src: [u8; 8],
    dst: [[u8; 8]; 4],
}
// SAFETY: as above.
unsafe impl aya::Pod for FwdCfg {}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    SynNew,
    TcpEstablished,
    Udp,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::SynNew => "tcp_syn_new_flow",
            Kind::TcpEstablished => "tcp_established",
            Kind::Udp => "udp_1024_flows",
        }
    }
}

#[derive(Serialize, Clone)]
struct Case {
    path: String,
    kind: &'static str,
    /// CPUs generating at once (each running the veth chain of its frames).
    cpus: usize,
    generated_mpps: f64,
    forwarded_mpps: f64,
    delivered_pct: f64,
    /// ns per packet inside the program on the LB's interface (BPF stats), when known.
    lb_prog_ns: Option<f64>,
    ratio_to_reference: f64,
}

#[derive(Serialize)]
struct Report {
    routed: bool,
    secs: f64,
    runs: usize,
    batch: u32,
    frame_bytes: usize,
    /// CPUs of the machine, and its CPU model.
    cpus: usize,
    cpu_model: String,
    /// The CPU sets the generator ran on.
    generator_cpus: Vec<Vec<usize>>,
    cases: Vec<Case>,
    target_ratio: f64,
    target_met: Option<bool>,
}

struct Gen {
    /// Loaded lb-bench.o (generator, reference forwarder and sink share it).
    dp: Dataplane,
    client_ns: String,
    client_if: String,
    batch: u32,
    /// The CPU sets each case is measured on: `--cpu` alone, then (with `--cpus N`) N CPUs at once.
    cpu_sets: Vec<Vec<usize>>,
}

impl Gen {
    /// Makes `frame` every generating CPU's template. The CPUs of the largest set each get flows of their own: in
    /// mode 0 (ports cycled) a counter starting at their share of the ports, in mode 1 (a new flow per frame)
    /// another last octet of the source address.
    fn set_template(&mut self, frame: &[u8], mode: u32, mask: u32) -> Result<()> {
        let largest = self.cpu_sets.iter().max_by_key(|s| s.len()).cloned();
        let largest = largest.unwrap_or_default();
        let possible = aya::util::nr_cpus().map_err(|(_, e)| e)?;
        let values = (0..possible)
            .map(|cpu| {
                let k = largest.iter().position(|&c| c == cpu).unwrap_or(0);
                let mut data = [0u8; FRAME];
                data.copy_from_slice(frame);
                let mut counter = 0;
                if mode == 1 {
                    data[29] ^= k as u8;
                } else {
                    counter = k as u32 * ((mask + 1) / largest.len().max(1) as u32);
                }
                GenPacket {
                    mode,
                    mask,
                    counter,
                    _pad: 0,
                    data,
                }
            })
            .collect::<Vec<_>>();
        let mut a: PerCpuArray<_, GenPacket> =
            PerCpuArray::try_from(self.dp.ebpf_mut()?.map_mut("GEN").context("GEN map")?)?;
        a.set(0, PerCpuValues::try_from(values)?, 0)?;
        Ok(())
    }

    fn sink_count(&mut self) -> Result<u64> {
        let a: PerCpuArray<_, u64> =
            PerCpuArray::try_from(self.dp.ebpf_mut()?.map("SINK").context("SINK map")?)?;
        Ok(a.get(&0, 0)?.iter().sum())
    }

    /// Generates for `secs` seconds on every CPU of `cpus` at once; returns (frames, seconds).
    fn generate(&mut self, secs: f64, cpus: &[usize]) -> Result<(u64, f64)> {
        let frame = [0u8; FRAME];
        let (ns, ifname, batch) = (self.client_ns.clone(), self.client_if.clone(), self.batch);
        let prog = &*self.dp.xdp_program("bench_gen")?;
        let start = Barrier::new(cpus.len());
        let per_cpu = std::thread::scope(|s| {
            let threads: Vec<_> = cpus
                .iter()
                .map(|&cpu| {
                    let (ns, ifname, start, frame) = (&ns, &ifname, &start, &frame);
                    s.spawn(move || {
                        // Every thread reaches the barrier, also one that failed before it: the others wait there.
                        let waited = AtomicBool::new(false);
                        let r = in_netns(ns, || {
                            pin_cpu(cpu);
                            let ifindex = nix_ifindex(ifname);
                            start.wait();
                            waited.store(true, Ordering::Relaxed);
                            let ifindex = ifindex?;
                            // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index,
                            // egress_ifindex.
                            let mut ctx = [0u8; 24];
                            ctx[4..8].copy_from_slice(&(FRAME as u32).to_ne_bytes());
                            ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
                            let t0 = Instant::now();
                            let mut sent = 0u64;
                            loop {
                                let repeat = 1 << 18;
                                let mut opts = TestRunOptions::new();
                                opts.data_in = Some(frame);
                                opts.ctx_in = Some(&ctx);
                                opts.repeat = repeat;
                                opts.attrs = TestRunAttrs::new().xdp_live_frames(batch);
                                prog.test_run(opts).context("live-frames test run")?;
                                sent += repeat as u64;
                                if t0.elapsed().as_secs_f64() >= secs {
                                    break;
                                }
                            }
                            Ok((sent, t0.elapsed().as_secs_f64()))
                        });
                        if !waited.load(Ordering::Relaxed) {
                            start.wait();
                        }
                        r
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("a generator thread panicked"))
                .collect::<Result<Vec<_>>>()
        })?;
        let sent = per_cpu.iter().map(|r| r.0).sum();
        let secs = per_cpu.iter().map(|r| r.1).fold(0.0, f64::max);
        Ok((sent, secs))
    }
}

fn nix_ifindex(name: &str) -> Result<u32> {
    let c = std::ffi::CString::new(name)?;
    // SAFETY: valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        bail!("no interface {name} in this namespace");
    }
    Ok(i)
}

fn frame(
    kind: Kind,
    client_mac: [u8; 6],
    lb_mac: [u8; 6],
    client: Ipv4Addr,
    vip: Ipv4Addr,
) -> Vec<u8> {
    let mut f = match kind {
        Kind::Udp => {
            let mut p = vec![0u8; 14];
            p.extend_from_slice(MAGIC);
            udp(client_mac, lb_mac, client, 20000, vip, 53, &p)
        }
        k => {
            let mut p = vec![0u8; 2];
            p.extend_from_slice(MAGIC);
            let flags = if k == Kind::SynNew { SYN } else { ACK };
            tcp(client_mac, lb_mac, client, 20000, vip, 80, flags, &p)
        }
    };
    assert_eq!(f.len(), FRAME, "benchmark frames are {FRAME} bytes");
    f.truncate(FRAME);
    f
}

/// Measures every kind on a prepared path; `lb_prog` names the program on the LB's interface.
fn measure_path(
    g: &mut Gen,
    path: &str,
    lb_prog: &str,
    topo: &Topology,
    vip: Ipv4Addr,
    args: &Args,
) -> Result<Vec<Case>> {
    let mut out = Vec::new();
    for kind in [Kind::Udp, Kind::TcpEstablished, Kind::SynNew] {
        let client = topo.ip(Host::Client);
        let f = frame(
            kind,
            topo.mac(Host::Client),
            topo.mac(Host::Lb),
            client,
            vip,
        );
        // TCP flows exist only after a completed handshake (a flood of SYNs no longer creates them): real
        // connections from the cycled ports, held open while their tuples are generated.
        let _held = if kind == Kind::TcpEstablished && path != "reference" {
            Some(connect_cycled_ports(&g.client_ns, vip)?)
        } else {
            None
        };
        let mode = if kind == Kind::SynNew { 1 } else { 0 };
        g.set_template(&f, mode, PORT_MASK)?;
        // Warm-up (flow creation for the cycled ports), on every CPU that will generate.
        let sets = g.cpu_sets.clone();
        g.generate(0.2, sets.last().context("no CPU set")?)?;
        // Every CPU set once per round: the drift of a shared machine falls on all of them alike.
        let mut m: Vec<Runs> = sets.iter().map(|_| Runs::default()).collect();
        for _ in 0..args.runs {
            for (i, cpus) in sets.iter().enumerate() {
                std::thread::sleep(Duration::from_millis(100));
                let before = g.sink_count()?;
                let st0 = prog_stats(lb_prog);
                let (sent, secs) = g.generate(args.secs, cpus)?;
                std::thread::sleep(Duration::from_millis(100));
                let got = g.sink_count()? - before;
                let st1 = prog_stats(lb_prog);
                let r = &mut m[i];
                r.generated.push(sent as f64 / secs / 1e6);
                r.forwarded.push(got as f64 / secs / 1e6);
                let cnt = st1.1.saturating_sub(st0.1);
                r.sent += sent;
                r.ran += cnt;
                if cnt > 0 {
                    r.ns.push(st1.0.saturating_sub(st0.0) as f64 / cnt as f64);
                }
            }
        }
        for (cpus, r) in sets.iter().zip(m) {
            let (sent_total, ran_total) = (r.sent, r.ran);
            let generated = median(r.generated);
            let forwarded = median(r.forwarded);
            // A path that delivers nothing, or whose program never saw the frames, is a broken rig, not a result.
            if forwarded == 0.0 {
                bail!(
                    "{path} {} on {} CPU(s): 0 of {sent_total} generated frames reached the sink ({lb_prog} ran {ran_total} times)",
                    kind.name(),
                    cpus.len()
                );
            }
            // A measurement needs (nearly) every frame to reach the program. A smoke run only needs them to reach it
            // at all: its 0.2 s are one batch of live frames, and when other work on the machine delays the softirq
            // that drains the veths, most of such a batch overflows their rings (seen: 26 % of the SYNs reached
            // lb_xdp), which a few seconds of generation average out.
            // On several CPUs at once a queue's softirq may get more frames than it can take (two CPUs' flows
            // hashed to one of the lb's veth queues): the frames lost on the way are a result there, shown as
            // "delivered", and only frames that never reach the program at all mean a broken rig.
            let needed = if args.smoke || cpus.len() > 1 {
                1.0
            } else {
                0.9 * sent_total as f64
            };
            if (ran_total as f64) < needed {
                bail!(
                    "{path} {} on {} CPU(s): {lb_prog} ran {ran_total} times for {sent_total} generated frames: the frames do not reach it",
                    kind.name(),
                    cpus.len()
                );
            }
            let c = Case {
                path: path.to_string(),
                kind: kind.name(),
                cpus: cpus.len(),
                generated_mpps: generated,
                forwarded_mpps: forwarded,
                delivered_pct: if generated > 0.0 {
                    100.0 * forwarded / generated
                } else {
                    0.0
                },
                lb_prog_ns: (!r.ns.is_empty()).then(|| median(r.ns)),
                ratio_to_reference: f64::NAN,
            };
            eprintln!(
                "  {path:<12} {:<18} {} CPU(s): gen {:.3} Mpps, forwarded {:.3} Mpps",
                c.kind, c.cpus, c.generated_mpps, c.forwarded_mpps
            );
            out.push(c);
        }
    }
    Ok(out)
}

/// One CPU set's measurements of a case.
#[derive(Default)]
struct Runs {
    generated: Vec<f64>,
    forwarded: Vec<f64>,
    ns: Vec<f64>,
    sent: u64,
    ran: u64,
}

/// Opens one real TCP connection to VIP:80 from each source port the established case cycles through (20000 +
/// 0..=PORT_MASK), in the client's namespace; they stay open while the returned sockets live.
fn connect_cycled_ports(client_ns: &str, vip: Ipv4Addr) -> Result<Vec<std::net::TcpStream>> {
    in_netns(client_ns, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let mut held = Vec::new();
            for i in 0..=PORT_MASK {
                let sock = tokio::net::TcpSocket::new_v4()?;
                sock.set_reuseaddr(true)?;
                // Closed with a reset, not a FIN: a FIN would leave the port in TIME_WAIT towards VIP:80 for a
                // minute, and the next attach mode connecting from the same port failed with EADDRINUSE.
                sock.set_zero_linger()?;
                sock.bind((Ipv4Addr::UNSPECIFIED, 20000 + i as u16).into())?;
                let s =
                    tokio::time::timeout(Duration::from_secs(5), sock.connect((vip, 80).into()))
                        .await
                        .context("connecting through the VIP timed out")?
                        .with_context(|| format!("connecting from port {}", 20000 + i))?;
                held.push(s.into_std()?);
            }
            anyhow::Ok(held)
        })
    })
}

/// Attaches the sink on every backend's interface; the returned links stay attached while `g` lives.
fn attach_sinks(g: &mut Gen, topo: &Topology) -> Result<()> {
    let prog: &mut Xdp = g.dp.xdp_program("bench_sink")?;
    for b in topo.backends().collect::<Vec<_>>() {
        let ifname = topo.ifname(b).to_string();
        in_netns(topo.netns(b), || {
            prog.attach(&ifname, XdpMode::Driver)
                .with_context(|| format!("attaching bench_sink to {b}"))
                .map(|_| ())
        })?;
    }
    Ok(())
}

fn detach_all(g: &mut Gen, name: &str) -> Result<()> {
    let prog: &mut Xdp = g.dp.xdp_program(name)?;
    // Dropping the program's links detaches them: unload and reload the program.
    prog.unload()?;
    Ok(())
}

fn warm_bridge(topo: &Topology, from: Host) {
    // Teach the bridge every MAC (ARP requests and replies) so that nothing is flooded to every sink.
    let targets: Vec<Ipv4Addr> = topo
        .hosts()
        .filter(|h| h.host != from)
        .map(|h| h.ip)
        .collect();
    let _ = in_netns(topo.netns(from), || {
        let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
        for t in &targets {
            let _ = s.send_to(b"warm", (*t, 9));
        }
        std::thread::sleep(Duration::from_millis(300));
        Ok(())
    });
}

fn run_reference(args: &Args, obj: &[u8], sizes: &MapSizes) -> Result<Vec<Case>> {
    let topo = Topology::new(TopologyConfig {
        prefix: "lbb".into(),
        routed: args.routed,
        queues: args.cpus,
        ..TopologyConfig::default()
    })?;
    // Routed: the frames leave by the backend side (its MAC their source) through the device map's slot 0.
    let (fwd, fwd_mac) = match topo.backend_side(Host::Lb) {
        Some(b) => ("bench_fwd_redir", b.mac),
        None => ("bench_fwd", topo.mac(Host::Lb)),
    };
    let vip = topo.addr(100);
    let mut g = Gen {
        dp: Dataplane::load_object(obj, sizes, None)?,
        client_ns: topo.netns(Host::Client).to_string(),
        client_if: topo.ifname(Host::Client).to_string(),
        batch: args.batch,
        cpu_sets: cpu_sets(args)?,
    };
    // The forwarder's config: its own MAC, the backends'.
    let mut cfg = FwdCfg {
        n: topo.backend_count().min(4) as u32,
        _pad: 0,
        src: [0; 8],
        dst: [[0; 8]; 4],
    };
    cfg.src[..6].copy_from_slice(&fwd_mac);
    for (i, b) in topo.backends().take(4).enumerate() {
        cfg.dst[i][..6].copy_from_slice(&topo.mac(b));
    }
    {
        let mut a: Array<_, FwdCfg> =
            Array::try_from(g.dp.ebpf_mut()?.map_mut("FWD").context("FWD map")?)?;
        a.set(0, cfg, 0)?;
    }
    if let Some(b) = topo.backend_side(Host::Lb) {
        let ifname = b.ifname.clone();
        let mut d: DevMap<_> =
            DevMap::try_from(g.dp.ebpf_mut()?.map_mut("FWD_DEV").context("FWD_DEV map")?)?;
        // The kernel resolves a device map's ifindex in the updating thread's namespace: set it from the lb's.
        in_netns(topo.netns(Host::Lb), || {
            let ifindex = nix_ifindex(&ifname)?;
            d.set(0, ifindex, None, 0)
                .with_context(|| format!("FWD_DEV[0] = lb {ifname}"))
        })?;
    }
    // xdp_pass on the bridge side of the lb's veths (veth delivers XDP_TX and XDP_REDIRECT frames only to a peer
    // with NAPI; routed, the backend side's is where the frames leave).
    let mut pass = Ebpf::load_file(&args.xdp_pass)
        .with_context(|| format!("loading {}", args.xdp_pass.display()))?;
    {
        let p: &mut Xdp = pass
            .program_mut("xdp_pass")
            .context("xdp_pass")?
            .try_into()?;
        p.load()?;
        let mut ports = vec![topo.switch_port(Host::Lb).to_string()];
        ports.extend(topo.backend_side(Host::Lb).map(|b| b.switch_port.clone()));
        in_netns(topo.switch_netns(), || {
            for port in &ports {
                p.attach(port, XdpMode::Driver)
                    .with_context(|| format!("xdp_pass on {port}"))?;
            }
            Ok(())
        })?;
    }
    {
        let lb_if = topo.ifname(Host::Lb).to_string();
        let p: &mut Xdp = g.dp.xdp_program(fwd)?;
        in_netns(topo.netns(Host::Lb), || {
            p.attach(&lb_if, XdpMode::Driver)
                .map(|_| ())
                .with_context(|| format!("{fwd} on lb"))
        })?;
    }
    attach_sinks(&mut g, &topo)?;
    warm_bridge(&topo, Host::Lb);
    warm_bridge(&topo, Host::Client);
    let cases = measure_path(&mut g, "reference", fwd, &topo, vip, args);
    detach_all(&mut g, fwd).ok();
    detach_all(&mut g, "bench_sink").ok();
    drop(pass);
    drop(g);
    drop(topo);
    cases
}

fn run_lb(args: &Args, obj: &[u8], sizes: &MapSizes, mode: &str) -> Result<Vec<Case>> {
    let mut cfg = RigConfig::new()?;
    cfg.attach_mode = mode.to_string();
    cfg.topology.prefix = "lbb".into();
    // Routed, the rig starts the agent with `--interface eth0,eth1` and gives both bridge ports xdp_pass.
    cfg.topology.routed = args.routed;
    // A receive queue per generating CPU on every veth, as a NIC has one per vCPU.
    cfg.topology.queues = args.cpus;
    // A new flow per frame is what the SYN case measures: with the SYN rate guard on, all but its rate would be
    // dropped (`bench synflood` measures the guard).
    cfg.agent_args = vec!["--syn-rate-limit".into(), "0".into()];
    let rig = Rig::start(cfg)?;
    let topo = &rig.topo;
    // The established case connects from fixed ports (20000 + 0..=PORT_MASK). The client's ephemeral range is
    // 1024-65535 (the rig's tuning), so the check below could leave one of them in TIME_WAIT from a socket
    // without SO_REUSEADDR, and binding it again failed (EADDRINUSE): reserved, no ephemeral port lands there.
    in_netns(topo.netns(Host::Client), || {
        std::fs::write(
            "/proc/sys/net/ipv4/ip_local_reserved_ports",
            format!("20000-{}", 20000 + PORT_MASK),
        )
        .context("reserving the established case's ports in the client's namespace")
    })?;
    let mut g = Gen {
        dp: Dataplane::load_object(obj, sizes, None)?,
        client_ns: topo.netns(Host::Client).to_string(),
        client_if: topo.ifname(Host::Client).to_string(),
        batch: args.batch,
        cpu_sets: cpu_sets(args)?,
    };
    attach_sinks(&mut g, topo)?;
    // With native XDP on the lb the rig turns GRO off on every bridge port, and a veth only takes the frames its
    // peer sends by XDP_TX when it has NAPI (GRO or an XDP program): without this, every generated frame died on
    // the client's bridge port and native XDP measured 0 Mpps (lb_xdp ran 55 times for 29.6M frames).
    let _client_port_napi = if matches!(mode, "xdp" | "xdp-native") {
        Some(lb_testbed::rig::attach_xdp_pass(
            topo,
            &args.xdp_pass,
            Host::Client,
        )?)
    } else {
        None
    };
    warm_bridge(topo, Host::Lb);
    warm_bridge(topo, Host::Client);
    // One real connection through the VIP: next hops resolved, service answering.
    let r = rig.load(&["--tcp", &format!("{}:80", rig.vip), "--connections", "20"])?;
    if r.tcp.as_ref().map(|t| t.ok).unwrap_or(0) == 0 {
        bail!(
            "the load balancer does not forward ({mode}): {}",
            rig.agent_log()
        );
    }
    let prog = if mode == "tc" { "lb_tc" } else { "lb_xdp" };
    let cases = measure_path(&mut g, &format!("lb {mode}"), prog, topo, rig.vip, args);
    detach_all(&mut g, "bench_sink").ok();
    drop(g);
    drop(rig);
    cases
}

/// The CPU sets every case is measured on: `--cpu` alone, and with `--cpus N` (N > 1) the first N CPUs this
/// process may use.
fn cpu_sets(args: &Args) -> Result<Vec<Vec<usize>>> {
    let allowed = allowed_cpus()?;
    if !allowed.contains(&args.cpu) {
        bail!(
            "--cpu {}: this process may run on CPUs {allowed:?}",
            args.cpu
        );
    }
    if args.cpus > allowed.len() {
        bail!(
            "--cpus {}: this process may run on {} CPUs",
            args.cpus,
            allowed.len()
        );
    }
    let mut sets = vec![vec![args.cpu]];
    if args.cpus > 1 {
        sets.push(allowed[..args.cpus].to_vec());
    }
    Ok(sets)
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    if args.smoke {
        (args.secs, args.runs) = (0.2, 1);
        // The several-CPU path too, where the machine has two.
        args.cpus = args.cpus.max(allowed_cpus()?.len().min(2));
    }
    if args.secs > 20.0 {
        bail!("--secs must be ≤ 20");
    }
    lb_testbed::topology::preflight()?;
    Topology::cleanup_stale("lbb")?;
    let obj = std::fs::read(&args.object).with_context(|| {
        format!(
            "reading {} (run `cargo xtask build-ebpf`)",
            args.object.display()
        )
    })?;
    // Only the bench programs are used: keep the load balancer's maps in this object small.
    let sizes = MapSizes::small();
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).ok();
    let (topology, forwarder, json) = if args.routed {
        ("routed topology", "XDP_REDIRECT", "pktgen-routed")
    } else {
        ("one-armed topology", "XDP_TX", "pktgen")
    };
    eprintln!(
        "pktgen ({topology}): reference forwarder, then the load balancer ({})",
        args.modes.join(", ")
    );
    let mut cases = run_reference(&args, &obj, &sizes)?;
    let mut failed = Vec::new();
    for mode in &args.modes {
        match run_lb(&args, &obj, &sizes, mode) {
            Ok(c) => cases.extend(c),
            Err(e) => {
                eprintln!("  lb {mode}: FAILED: {e:#}");
                failed.push(format!("lb {mode}: {e:#}"));
            }
        }
    }
    // Ratios to the reference of the same kind on as many CPUs.
    let refs: Vec<(&'static str, usize, f64)> = cases
        .iter()
        .filter(|c| c.path == "reference")
        .map(|c| (c.kind, c.cpus, c.forwarded_mpps))
        .collect();
    for c in cases.iter_mut() {
        if let Some((_, _, r)) = refs.iter().find(|(k, n, _)| *k == c.kind && *n == c.cpus) {
            c.ratio_to_reference = if *r > 0.0 {
                c.forwarded_mpps / r
            } else {
                f64::NAN
            };
        }
    }
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let generator_cpus = cpu_sets(&args)?;
    let on = if args.cpus > 1 {
        format!(
            "generator + whole veth chain on CPU {} alone and on CPUs {:?} at once (each on flows of its own)",
            args.cpu, generator_cpus[1]
        )
    } else {
        format!("generator + whole veth chain on CPU {}", args.cpu)
    };
    println!(
        "packet rate, {topology}, XDP live frames ({FRAME}-byte IPv4 frames, batch {}), {} s x {} runs (median), {on} of {cpus} ({})",
        args.batch, args.secs, args.runs, cpu_model()
    );
    let rows: Vec<Vec<String>> = cases
        .iter()
        .map(|c| {
            vec![
                c.path.clone(),
                c.kind.to_string(),
                c.cpus.to_string(),
                fmt_num(c.generated_mpps),
                fmt_num(c.forwarded_mpps),
                format!("{:.0}%", c.delivered_pct),
                c.lb_prog_ns.map(fmt_num).unwrap_or_else(|| "-".into()),
                c.lb_prog_ns
                    .map(|ns| fmt_num(1e3 / ns))
                    .unwrap_or_else(|| "-".into()),
                format!("{:.2}", c.ratio_to_reference),
            ]
        })
        .collect();
    print_table(
        &[
            "path",
            "frames",
            "cpus",
            "generated Mpps",
            "forwarded Mpps",
            "delivered",
            "prog ns/pkt",
            "prog Mpps/core",
            "x reference",
        ],
        &rows,
    );
    let native: Vec<f64> = cases
        .iter()
        .filter(|c| c.path == "lb xdp-native" && c.cpus == 1)
        .map(|c| c.ratio_to_reference)
        .collect();
    let worst = native.iter().cloned().fold(f64::INFINITY, f64::min);
    let met = (!native.is_empty()).then_some(worst >= 0.8);
    println!(
        "  target: forwarded ≥ 0.8x the bare {forwarder} forwarder (native XDP, every frame kind, one CPU): {}",
        match met {
            Some(true) => format!("met (worst {worst:.2}x)"),
            Some(false) => format!("NOT met (worst {worst:.2}x)"),
            None => "not measured".into(),
        }
    );
    if args.routed && args.modes.iter().any(|m| m == "xdp-generic") {
        // The agent warns that generic XDP cannot redirect GRO/TSO super-packets to another interface; say why
        // this table does not show it, rather than let its generic rows read as "generic XDP is fine routed".
        println!(
            "  xdp-generic: these 64-byte frames never form GRO super-packets (TCP frames repeat one sequence number, UDP is not coalesced), so none is too large to redirect; bulk TCP is where generic XDP stalls routed (bench routed)"
        );
    }
    let report = Report {
        routed: args.routed,
        secs: args.secs,
        runs: args.runs,
        batch: args.batch,
        frame_bytes: FRAME,
        cpus,
        cpu_model: cpu_model(),
        generator_cpus,
        cases,
        target_ratio: 0.8,
        target_met: met,
    };
    let path = write_json(json, args.smoke, &report)?;
    println!("  JSON: {}", path.display());
    if !failed.is_empty() {
        bail!("{} path(s) failed: {}", failed.len(), failed.join("; "));
    }
    Ok(())
}
