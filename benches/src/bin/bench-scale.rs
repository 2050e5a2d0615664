//! `cargo xtask bench scale`: memory of the maps at 1M concurrent flows, time to apply 1000 services × 100
//! backends with `Programmer::apply`, and time from a config change to the first packet that follows it
//! (the real agent on the netns topology).

use anyhow::{Context, Result};
use clap::Parser;
use lb_agent::dataplane::model::{Protocol, ServiceId, ServiceSpec};
use lb_agent::dataplane::programmer::Programmer;
use lb_agent::dataplane::{Dataplane, MapSizes};
use lb_benches::{in_netns, median, print_table, write_json};
use lb_common::{FlowKeyV4, FlowV4};
use lb_testbed::rig::{Rig, RigConfig, UDP_NODE_PORT};
use lb_testbed::{Host, Topology};
use serde::Serialize;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// The data-plane object (built by `cargo xtask build-ebpf`).
    #[arg(long, default_value = "target/bpf/lb.o")]
    object: PathBuf,
    /// Concurrent connections to hold in the flow table (two entries each).
    #[arg(long, default_value_t = 1_000_000)]
    flows: u32,
    /// Services and backends per service for the apply benchmark.
    #[arg(long, default_value_t = 1000)]
    services: u32,
    #[arg(long, default_value_t = 100)]
    backends: u32,
    /// Repeats (median reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// A few seconds' run that only proves the benchmark runs (`cargo xtask test`): 10 000 flows, 10 services x
    /// 10 backends, one run; JSON under target/bench/smoke/.
    #[arg(long)]
    smoke: bool,
}

#[derive(Serialize)]
struct MapMem {
    name: String,
    max_entries: u64,
    memlock_bytes: u64,
}

#[derive(Serialize)]
struct Report {
    flows: u32,
    flow_entries: u32,
    maps: Vec<MapMem>,
    flow_map_mb: f64,
    all_maps_mb: f64,
    services: u32,
    backends_per_service: u32,
    apply_cold_s: f64,
    apply_change_s: f64,
    apply_noop_s: f64,
    config_to_packet_ms: Vec<f64>,
    config_to_packet_median_ms: f64,
    targets: Vec<(String, f64, f64, bool)>,
}

/// memlock of every BPF map this process holds, from /proc/self/fdinfo.
fn map_memory() -> Vec<MapMem> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc/self/fdinfo")
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(s) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        if !s.contains("map_type:") {
            continue;
        }
        let field = |k: &str| -> u64 {
            s.lines()
                .find_map(|l| l.strip_prefix(k))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        let id = field("map_id:");
        let name = aya::maps::loaded_maps()
            .flatten()
            .find(|m| m.id() == id as u32)
            .and_then(|m| m.name_as_str().map(str::to_string))
            .unwrap_or_else(|| format!("id {id}"));
        out.push(MapMem {
            name,
            max_entries: field("max_entries:"),
            memlock_bytes: field("memlock:"),
        });
    }
    out.sort_by_key(|m| std::cmp::Reverse(m.memlock_bytes));
    out
}

fn fill_flows(dp: &mut Dataplane, n: u32) -> Result<()> {
    let v = FlowV4::default();
    let entries: Vec<(FlowKeyV4, FlowV4)> = (0..n)
        .map(|i| {
            let key = FlowKeyV4 {
                src: (0x0a00_0000 | (i >> 16)).to_be(),
                dst: u32::from_be_bytes([203, 0, 113, 1]).to_be(),
                sport: (i as u16).to_be(),
                dport: 80u16.to_be(),
                proto: 6,
                _pad: [0; 3],
            };
            (key, v)
        })
        .collect();
    // Spread over the CPUs: with per-CPU LRU lists, one CPU's writes would fill only its share of the table.
    dp.maps.set_flows(&entries)
}

fn services(n: u32, per: u32, port_shift: u16) -> Vec<ServiceSpec> {
    (0..n)
        .map(|s| ServiceSpec {
            id: ServiceId {
                vip: IpAddr::V4(Ipv4Addr::new(198, 18, (s >> 8) as u8, s as u8)),
                port: 80,
                protocol: Protocol::Tcp,
            },
            snat: None,
            idle_timeout: Duration::ZERO,
            source_ranges: vec![],
            backends: (0..per)
                .map(|b| {
                    SocketAddr::new(
                        IpAddr::V4(Ipv4Addr::new(10, 1, (b >> 8) as u8, b as u8)),
                        30000 + (s as u16 % 2000) + port_shift,
                    )
                })
                .collect(),
            proxy_v2: false,
        })
        .collect()
}

fn config_to_packet(runs: usize) -> Result<Vec<f64>> {
    let mut cfg = RigConfig::new()?;
    cfg.topology.prefix = "lbs".into();
    let rig = Rig::start(cfg)?;
    let mut out = Vec::new();
    let client_ns = rig.topo.netns(Host::Client).to_string();
    for i in 0..runs {
        let port = 5400 + i as u16;
        // Every run adds one more UDP port on the VIP, mapped to the echo servers' UDP NodePort.
        let mut extra = String::new();
        for p in 5400..=port {
            extra += &format!(
                "  - {{name: u{p}, protocol: UDP, port: {p}, nodePort: {UDP_NODE_PORT}}}\n"
            );
        }
        let yaml = rig
            .config_yaml(&[1, 2, 3], "")
            .replace("endpoints:\n", &format!("{extra}endpoints:\n"));
        let vip = rig.vip;
        let ms = in_netns(&client_ns, || {
            let s = UdpSocket::bind("0.0.0.0:0")?;
            s.set_nonblocking(true)?;
            let to = SocketAddr::new(vip.into(), port);
            let mut buf = [0u8; 256];
            // Nothing answers yet.
            s.send_to(b"before", to)?;
            std::thread::sleep(Duration::from_millis(100));
            while s.recv_from(&mut buf).is_ok() {}
            let t0 = Instant::now();
            rig.write_config(&yaml)?;
            let deadline = t0 + Duration::from_secs(10);
            let mut last_send = Instant::now() - Duration::from_secs(1);
            loop {
                if last_send.elapsed() >= Duration::from_micros(500) {
                    let _ = s.send_to(b"probe", to);
                    last_send = Instant::now();
                }
                if let Ok((n, _)) = s.recv_from(&mut buf) {
                    if n > 0 {
                        return Ok(t0.elapsed().as_secs_f64() * 1e3);
                    }
                }
                if Instant::now() > deadline {
                    anyhow::bail!("no reply 10 s after the config change");
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        })
        .with_context(|| rig.agent_log())?;
        eprintln!("  config change → first reply: {ms:.1} ms");
        out.push(ms);
        std::thread::sleep(Duration::from_millis(300));
    }
    Ok(out)
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    if args.smoke {
        (args.flows, args.services, args.backends, args.runs) = (10_000, 10, 10, 1);
    }
    lb_testbed::topology::preflight()?;
    Topology::cleanup_stale("lbs")?;
    let obj = std::fs::read(&args.object).with_context(|| {
        format!(
            "reading {} (run `cargo xtask build-ebpf`)",
            args.object.display()
        )
    })?;

    // 1. Map memory at N concurrent flows (2 entries each), every other map at its default size.
    let entries = args.flows * 2;
    let (maps, flow_mb, all_mb) = {
        let sizes = MapSizes {
            flows: entries,
            ..MapSizes::default()
        };
        let mut dp = Dataplane::load_object(&obj, &sizes, None)?;
        let t = Instant::now();
        fill_flows(&mut dp, entries)?;
        eprintln!(
            "  {entries} flow entries written in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        let maps = map_memory();
        let flow = maps
            .iter()
            .filter(|m| m.name.starts_with("FLOWS"))
            .map(|m| m.memlock_bytes)
            .sum::<u64>() as f64
            / 1e6;
        let all = maps.iter().map(|m| m.memlock_bytes).sum::<u64>() as f64 / 1e6;
        drop(dp);
        (maps, flow, all)
    };

    // 2. Apply 1000 × 100.
    let sizes = MapSizes {
        flows: 1024,
        services: 4096,
        backends: 1 << 18,
        maglev_slots: 1 << 25,
        ..MapSizes::default()
    };
    let (mut cold, mut change, mut noop) = (Vec::new(), Vec::new(), Vec::new());
    let a = services(args.services, args.backends, 0);
    let b = services(args.services, args.backends, 1);
    for _ in 0..args.runs {
        let mut dp = Dataplane::load_object(&obj, &sizes, None)?;
        let mut p = Programmer::new(sizes.services, sizes.backends, sizes.maglev_slots);
        let t = Instant::now();
        p.apply(&mut dp.maps, &a)?;
        cold.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        p.apply(&mut dp.maps, &a)?;
        noop.push(t.elapsed().as_secs_f64());
        // Every service's backends move to another NodePort: every table rewritten.
        let t = Instant::now();
        p.apply(&mut dp.maps, &b)?;
        change.push(t.elapsed().as_secs_f64());
    }
    let (cold, change, noop) = (median(cold), median(change), median(noop));

    // 3. Config change → first packet through the real agent.
    let c2p = config_to_packet(args.runs)?;
    let c2p_med = median(c2p.clone());

    println!(
        "scale: flow table at {} concurrent connections ({entries} entries), apply {} services x {} backends, config change → first packet ({} runs, median)",
        args.flows, args.services, args.backends, args.runs
    );
    let rows: Vec<Vec<String>> = maps
        .iter()
        .take(6)
        .map(|m| {
            vec![
                m.name.clone(),
                m.max_entries.to_string(),
                format!("{:.1}", m.memlock_bytes as f64 / 1e6),
            ]
        })
        .collect();
    print_table(&["map (largest first)", "max_entries", "memlock MB"], &rows);
    println!("  flow map {flow_mb:.0} MB, all maps {all_mb:.0} MB");
    print_table(
        &["measurement", "value"],
        &[
            vec![
                format!("apply {}x{} cold", args.services, args.backends),
                format!("{:.3} s", cold),
            ],
            vec![
                "apply, every backend moved".into(),
                format!("{:.3} s", change),
            ],
            vec!["apply, no change".into(), format!("{:.3} s", noop)],
            vec![
                "config change → first packet".into(),
                format!("{c2p_med:.1} ms (runs {c2p:.1?})"),
            ],
        ],
    );
    let targets = vec![
        (
            format!("{}M flows < 300 MB (flow map)", args.flows as f64 / 1e6),
            flow_mb,
            300.0,
            flow_mb < 300.0,
        ),
        (
            format!("{}x{} applied < 1 s (cold)", args.services, args.backends),
            cold,
            1.0,
            cold < 1.0,
        ),
        (
            "config change → packets < 100 ms".into(),
            c2p_med,
            100.0,
            c2p_med < 100.0,
        ),
    ];
    println!("  targets:");
    for (what, v, lim, met) in &targets {
        println!(
            "    {what:<36} {v:>9.3} (limit {lim}): {}",
            if *met { "met" } else { "NOT met" }
        );
    }
    let report = Report {
        flows: args.flows,
        flow_entries: entries,
        maps,
        flow_map_mb: flow_mb,
        all_maps_mb: all_mb,
        services: args.services,
        backends_per_service: args.backends,
        apply_cold_s: cold,
        apply_change_s: change,
        apply_noop_s: noop,
        config_to_packet_ms: c2p,
        config_to_packet_median_ms: c2p_med,
        targets,
    };
    let path = write_json("scale", args.smoke, &report)?;
    println!("  JSON: {}", path.display());
    Ok(())
}
