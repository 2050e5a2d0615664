//! `cargo xtask bench kube-config`: from a LoadBalancer write to the first packet that follows it, through the
//! real agent in Kubernetes mode against a real API server (kube-testenv) and its XDP data plane on the netns rig
//! (`lb_testbed::kube_rig`, the `kube_agent` test's setup). Each run moves the TCP service to a new port with a
//! merge patch of `spec.ports` and times, from sending the patch, the API server's answer and the first
//! connection a client (trying every 0.5 ms) makes through the new port: SYN forwarded to a backend, SYN-ACK
//! back. That includes the API server's write and watch, the agent's watch, validation and map update, and the
//! handshake. Target < 50 ms, stated and not asserted.
//!
//! An example of lb-benches rather than one of its binaries: it needs `lb-testbed`'s `kubernetes` feature (the
//! controller crate), which a dev-dependency gives the examples only, so the other benchmarks' release builds do
//! not compile the controller.

use anyhow::{bail, Result};
use clap::Parser;
use lb_benches::{median, print_table, write_json};
use lb_testbed::kube_rig::{KubeEnv, KubeRig};
use lb_testbed::rig::RigConfig;
use lb_testbed::Topology;
use serde::Serialize;
use std::time::Duration;

/// The target for write → first packet, ms.
const TARGET_MS: f64 = 50.0;

#[derive(Parser)]
struct Args {
    /// Port changes to time.
    #[arg(long, default_value_t = 50)]
    runs: usize,
    /// A few seconds' run that only proves the benchmark runs (`cargo xtask test`): 3 changes; JSON under
    /// target/bench/smoke/.
    #[arg(long)]
    smoke: bool,
}

#[derive(Serialize)]
struct Run {
    port: u16,
    generation: i64,
    write_ms: f64,
    first_packet_ms: f64,
    backend: String,
    refused_attempts: u32,
    unanswered_attempts: u32,
}

#[derive(Serialize)]
struct Stats {
    min: f64,
    median: f64,
    p90: f64,
    max: f64,
}

#[derive(Serialize)]
struct Report {
    runs: Vec<Run>,
    /// From sending the patch to the first connection through the new port.
    first_packet_ms: Stats,
    /// From sending the patch to the API server's answer (part of the above).
    write_ms: Stats,
    target_ms: f64,
    target_met: bool,
}

fn stats(v: &[f64]) -> Stats {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    // Nearest rank.
    let p90 = s[((s.len() as f64 * 0.9).ceil() as usize).clamp(1, s.len()) - 1];
    Stats {
        min: s[0],
        median: median(s.clone()),
        p90,
        max: s[s.len() - 1],
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> Result<()> {
    let mut a = Args::parse();
    if a.smoke {
        a.runs = 3;
    }
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    if !lb_testbed::is_root() {
        bail!("bench kube-config needs root");
    }
    Topology::cleanup_stale("lbkb")?;
    let mut cfg = RigConfig::new()?;
    cfg.topology.prefix = "lbkb".into();
    let k = KubeRig::start(KubeEnv::shared(), cfg, serde_json::json!({}))?;
    let mut runs = Vec::new();
    for i in 0..a.runs {
        // A new port each time (the previous one is dropped by the same write).
        let port = 8000 + i as u16;
        let c = k.change_port(port, Duration::from_secs(10))?;
        eprintln!(
            "  port -> {port}: write {:.1} ms, first packet {:.1} ms ({})",
            ms(c.write),
            ms(c.first_packet),
            c.backend
        );
        // Settled before the next change: the agent's status write and Event after an apply are not part of the
        // next measurement.
        k.wait_generation(c.generation)?;
        std::thread::sleep(Duration::from_millis(200));
        runs.push(Run {
            port,
            generation: c.generation,
            write_ms: ms(c.write),
            first_packet_ms: ms(c.first_packet),
            backend: c.backend,
            refused_attempts: c.refused,
            unanswered_attempts: c.unanswered,
        });
    }
    drop(k);
    let first: Vec<f64> = runs.iter().map(|r| r.first_packet_ms).collect();
    let write: Vec<f64> = runs.iter().map(|r| r.write_ms).collect();
    let (first, write) = (stats(&first), stats(&write));
    let met = first.median < TARGET_MS;
    println!(
        "kube-config: LoadBalancer port change → first packet through the new port ({} runs; real kube-apiserver, \
         agent in Kubernetes mode, XDP)",
        runs.len()
    );
    let row = |name: &str, s: &Stats| {
        vec![
            name.to_string(),
            format!("{:.1}", s.min),
            format!("{:.1}", s.median),
            format!("{:.1}", s.p90),
            format!("{:.1}", s.max),
        ]
    };
    print_table(
        &["ms", "min", "median", "p90", "max"],
        &[
            row("write → first packet", &first),
            row("write → API answer", &write),
        ],
    );
    println!(
        "  target: write → first packet < {TARGET_MS} ms (median): {:.1} ms, {}",
        first.median,
        if met { "met" } else { "NOT met" }
    );
    let path = write_json(
        "kube-config",
        a.smoke,
        &Report {
            runs,
            first_packet_ms: first,
            write_ms: write,
            target_ms: TARGET_MS,
            target_met: met,
        },
    )?;
    println!("  JSON: {}", path.display());
    Ok(())
}
