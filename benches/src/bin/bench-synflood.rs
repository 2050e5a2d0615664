//! `cargo xtask bench synflood`: a SYN flood from spoofed sources at the highest rate one AF_PACKET socket in the
//! client namespace sends, for `--secs`, against the real agent (per attach mode) while `--held` connections
//! exchange a message every `--interval-ms` (idle ones with a long interval) and a client keeps opening new
//! connections. Reports the held connections that survived, the share of new connections that succeeded, the
//! program's cost per frame during the flood (`BPF_ENABLE_STATS`), and the agent's counters that tell eviction
//! (`drop_no_flow`: segments of a connection whose entry is gone) from overload (frames lost before the program).

use anyhow::{bail, Context, Result};
use clap::Parser;
use lb_benches::{fmt_num, print_table, prog_stats, write_json};
use lb_testbed::rig::{Rig, RigConfig, TCP_PORT};
use serde::Serialize;
use std::time::Duration;

#[derive(Parser)]
struct Args {
    /// Seconds of flooding.
    #[arg(long, default_value_t = 30.0)]
    secs: f64,
    /// Connections held through the flood.
    #[arg(long, default_value_t = 10_000)]
    held: usize,
    /// Each held connection sends a message this often (ms).
    #[arg(long, default_value_t = 2000)]
    interval_ms: u64,
    /// SYNs per second (0: as fast as the socket sends).
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// Attach modes.
    #[arg(long, value_delimiter = ',', default_value = "xdp-native,tc")]
    modes: Vec<String>,
    /// The agent's SYN rate guard: `off` (`--syn-rate-limit 0`), `on` (the agent's default limit), or a limit
    /// (handshakes per second per CPU).
    #[arg(long, value_delimiter = ',', default_value = "off,on")]
    guards: Vec<String>,
    /// A few seconds' run that only proves the benchmark runs (`cargo xtask test`): 3 s of flood against 200 held
    /// connections, every mode and guard; JSON under target/bench/smoke/.
    #[arg(long)]
    smoke: bool,
}

#[derive(Serialize)]
struct Case {
    mode: String,
    guard: String,
    flood_syns: u64,
    flood_per_s: f64,
    held: usize,
    held_broken: usize,
    held_surviving_pct: f64,
    held_longest_pause_ms: f64,
    new_ok: usize,
    new_tried: usize,
    new_ok_pct: f64,
    prog_ns_per_frame: Option<f64>,
    prog_frames: u64,
    handshakes: f64,
    drop_no_flow: f64,
    drop_syn_rate: f64,
}

fn run(args: &Args, mode: &str, guard: &str) -> Result<Case> {
    let mut cfg = RigConfig::new()?;
    cfg.attach_mode = mode.into();
    let limit = match guard {
        "on" => None,
        "off" => Some(0),
        n => Some(
            n.parse::<u32>()
                .with_context(|| format!("--guards takes off, on or a number, not {n}"))?,
        ),
    };
    if let Some(limit) = limit {
        cfg.agent_args = vec!["--syn-rate-limit".into(), limit.to_string()];
    }
    cfg.topology.prefix = "lbf".into();
    let r = Rig::start(cfg)?;
    let tcp = format!("{}:{TCP_PORT}", r.vip);
    let hold = r.start_hold(&[
        "--tcp",
        &tcp,
        "--connections",
        &args.held.to_string(),
        "--interval-ms",
        &args.interval_ms.to_string(),
        "--timeout-ms",
        "10000",
    ])?;
    let prog = if mode == "tc" { "lb_tc" } else { "lb_xdp" };
    let before = prog_stats(prog);
    let flood = r.start_synflood(TCP_PORT, args.secs, args.rate)?;
    std::thread::sleep(Duration::from_secs(2));
    // New connections while the flood lasts: rounds of 200 until it ends.
    let (mut new_ok, mut new_tried) = (0, 0);
    let rounds = ((args.secs - 4.0) / 4.0).max(1.0) as usize;
    for _ in 0..rounds {
        let rep = r.load(&["--tcp", &tcp, "--connections", "200", "--concurrency", "16"])?;
        let t = rep.tcp.context("no TCP report")?;
        new_ok += t.ok;
        new_tried += t.ok + t.failed;
    }
    let report = flood.finish()?;
    let after = prog_stats(prog);
    let held = hold.stop()?;
    std::thread::sleep(Duration::from_millis(1500));
    let runs = after.1.saturating_sub(before.1);
    let c = Case {
        mode: mode.into(),
        guard: guard.into(),
        flood_syns: report.sent,
        flood_per_s: report.per_second,
        held: held.established,
        held_broken: held.broken,
        held_surviving_pct: 100.0 * (held.established - held.broken) as f64
            / held.established.max(1) as f64,
        held_longest_pause_ms: held.max_gap_ms,
        new_ok,
        new_tried,
        new_ok_pct: 100.0 * new_ok as f64 / new_tried.max(1) as f64,
        prog_ns_per_frame: (runs > 0)
            .then(|| after.0.saturating_sub(before.0) as f64 / runs as f64),
        prog_frames: runs,
        handshakes: r.metric("lb_tcp_handshakes_total", "")?,
        drop_no_flow: r.metric("lb_dataplane_packets_total", "reason=\"drop_no_flow\"")?,
        drop_syn_rate: r.metric("lb_dataplane_packets_total", "reason=\"drop_syn_rate\"")?,
    };
    if c.held < args.held {
        bail!(
            "{mode}: only {} of {} connections were held",
            c.held,
            args.held
        );
    }
    Ok(c)
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    if args.smoke {
        (args.secs, args.held, args.interval_ms) = (3.0, 200, 500);
    }
    lb_testbed::topology::preflight()?;
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).ok();
    let mut cases = Vec::new();
    for mode in &args.modes {
        for guard in &args.guards {
            eprintln!("synflood: {mode}, SYN rate guard {guard}");
            cases.push(run(&args, mode, guard)?);
        }
    }
    println!(
        "SYN flood from spoofed sources for {} s ({}), {} connections held (a message every {} ms), new connections in rounds of 200",
        args.secs,
        if args.rate == 0 { "one socket's full rate".to_string() } else { format!("{} SYN/s", args.rate) },
        args.held,
        args.interval_ms
    );
    let rows: Vec<Vec<String>> = cases
        .iter()
        .map(|c| {
            vec![
                c.mode.clone(),
                c.guard.clone(),
                format!("{} ({}/s)", c.flood_syns, fmt_num(c.flood_per_s)),
                format!("{:.1}% ({} broken)", c.held_surviving_pct, c.held_broken),
                fmt_num(c.held_longest_pause_ms),
                format!("{:.1}% ({}/{})", c.new_ok_pct, c.new_ok, c.new_tried),
                c.prog_frames.to_string(),
                c.prog_ns_per_frame
                    .map(fmt_num)
                    .unwrap_or_else(|| "-".into()),
                fmt_num(c.drop_no_flow),
                fmt_num(c.drop_syn_rate),
            ]
        })
        .collect();
    print_table(
        &[
            "mode",
            "guard",
            "SYNs sent",
            "held surviving",
            "longest pause ms",
            "new connections ok",
            "frames in program",
            "prog ns/frame",
            "drop_no_flow",
            "drop_syn_rate",
        ],
        &rows,
    );
    let path = write_json("synflood", args.smoke, &cases)?;
    println!("  JSON: {}", path.display());
    Ok(())
}
