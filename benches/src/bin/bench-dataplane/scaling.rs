//! The scaling sweep (`--threads N`, `--sweep`): N threads, each pinned to a CPU of its own, run `bench_lb` on the
//! same maps at once through `BPF_PROG_TEST_RUN` — each on flows of its own (its CPU's template: the wrapper's
//! template map is per CPU) — so that whatever the CPUs share on the packet path (a common LRU list, a counter, a
//! lock) shows as the aggregate falling behind N times one thread's rate.
//!
//! Per case and thread count: the aggregate rate (the threads' rates added up, each the kernel's timing of its own
//! repeats — the call around them costs milliseconds that are no packet's — with the share of the run all
//! threads were running at once, "overlap", beside it), the mean ns per packet of the threads (the template
//! restore included, in every thread count alike) and the scaling efficiency, aggregate ÷ (N × one thread's).
//! Thread counts are measured in rounds. IPv4 cases; small tables for the fast cases, a handshake table emptied
//! before each measurement and sized for its SYNs for the new flow with room, the production-sized, filled ones for
//! the `_full` cases and the guarded SYN drop.

use super::{fill_both, load, open_connection, pad, verdict_name, Bench, MapSizes, VIP};
use anyhow::{bail, Context, Result};
use aya::programs::{TestRun, TestRunOptions};
use lb_benches::{allowed_cpus, cpu_model, median, pin_cpu, write_json};
use lb_test_support::packets::*;
use serde::Serialize;
use std::net::Ipv4Addr;
use std::sync::Barrier;
use std::time::Instant;

/// Thread counts of a sweep: 1, 2, 4, … up to the CPUs this process may run on, and that count itself.
pub fn sweep_counts(cpus: usize) -> Vec<usize> {
    let mut v: Vec<usize> = std::iter::successors(Some(1), |n| Some(n * 2))
        .take_while(|&n| n <= cpus)
        .collect();
    if v.last() != Some(&cpus) {
        v.push(cpus);
    }
    v
}

#[derive(Serialize)]
struct Row {
    case: &'static str,
    threads: usize,
    verdict: &'static str,
    aggregate_mpps: f64,
    /// Mean over the threads of the kernel's ns per repeat (template restore included).
    ns_per_packet: f64,
    /// `aggregate_mpps / (threads × the one-thread aggregate)`.
    efficiency: f64,
    /// The share of the shortest thread's run during which all threads ran (the lowest of the runs); the rates
    /// add up as concurrent ones only near 1.
    overlap: f64,
}

#[derive(Serialize)]
struct Goal {
    threads: usize,
    min_efficiency: f64,
    cases: Vec<&'static str>,
    /// The lowest efficiency among `cases` at `threads`, and whether it reaches the goal.
    worst: f64,
    met: bool,
}

#[derive(Serialize)]
struct Report {
    cpu_model: String,
    /// CPUs this process could run on.
    cpus: usize,
    threads: Vec<usize>,
    repeat: u32,
    new_flow_repeat: u32,
    runs: usize,
    rows: Vec<Row>,
    goals: Vec<Goal>,
}

/// Thread `k`'s client address for its connections and flows (not varied).
fn client(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 1, (k >> 8) as u8, k as u8)
}

/// Thread `k`'s template source for varied SYNs: the wrapper writes the counter into the last two address bytes
/// and the port, so the threads' first two bytes differ and their flows never meet.
fn varied_source(first: u8, k: usize) -> Ipv4Addr {
    Ipv4Addr::new(first, k as u8, 0, 0)
}

/// One measurement on N threads at once (or the median of several).
struct Measured {
    /// The threads' rates added up.
    mpps: f64,
    /// Mean ns per packet of the threads.
    ns: f64,
    /// How much of the shortest thread's run all threads were running (1: fully; the lowest of the runs).
    overlap: f64,
    /// Thread 0's.
    verdict: u32,
}

impl Bench {
    /// Runs `bench_lb` on `cpus.len()` threads at once, thread `k` pinned to `cpus[k]` (whose template the caller
    /// set), `repeat` repeats each.
    fn run_parallel(&mut self, cpus: &[usize], len: usize, repeat: u32) -> Result<Measured> {
        let prog = &*self.dp.xdp_program("bench_lb")?;
        let start = Barrier::new(cpus.len());
        let runs = std::thread::scope(|s| {
            let threads: Vec<_> = cpus
                .iter()
                .map(|&cpu| {
                    let start = &start;
                    s.spawn(move || {
                        pin_cpu(cpu);
                        // The wrapper overwrites the frame with this CPU's template: only its length matters.
                        let frame = vec![0u8; len];
                        let mut out = vec![0u8; len + 256];
                        let mut opts = TestRunOptions::new();
                        opts.data_in = Some(&frame);
                        opts.data_out = Some(&mut out);
                        opts.repeat = repeat;
                        start.wait();
                        let t0 = Instant::now();
                        let r = prog.test_run(opts);
                        (t0, Instant::now(), r)
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("a benchmark thread panicked"))
                .collect::<Vec<_>>()
        });
        // Each thread's rate is the kernel's timing of its own repeats (`BPF_PROG_TEST_RUN`'s duration): the
        // call around them costs milliseconds that are no packet's (measured: 48 ms of wall time for 34 ms of
        // repeats, one thread, 300 000 repeats). The runs overlap when they started together and none ended before the last began.
        let mut spans = Vec::new();
        let (mut rate, mut ns, mut verdict) = (0.0, 0.0, None);
        for (t0, t1, r) in runs {
            let r = r.context("test run of bench_lb")?;
            let per = r.duration.as_secs_f64() * 1e9;
            rate += 1e3 / per;
            ns += per;
            verdict.get_or_insert(r.return_value);
            spans.push((t0, t1));
        }
        let latest_start = spans.iter().map(|s| s.0).max().context("no threads")?;
        let earliest_end = spans.iter().map(|s| s.1).min().context("no threads")?;
        let shortest = spans
            .iter()
            .map(|s| s.1 - s.0)
            .min()
            .context("no threads")?;
        let overlap = earliest_end
            .saturating_duration_since(latest_start)
            .as_secs_f64()
            / shortest.as_secs_f64();
        Ok(Measured {
            mpps: rate,
            ns: ns / cpus.len() as f64,
            overlap,
            verdict: verdict.unwrap_or_default(),
        })
    }

    /// One case on each of `counts` threads (thread `k` pinned to `allowed[k]`, on `frames[k]`): the medians of
    /// `runs` measurements, taken in rounds — every count once per round — so that the drift of a shared machine
    /// falls on all counts alike.
    fn scale_case(
        &mut self,
        allowed: &[usize],
        counts: &[usize],
        frames: &[Vec<u8>],
        vary: bool,
        repeat: u32,
        empty_handshakes: bool,
    ) -> Result<Vec<Measured>> {
        let max = counts.iter().copied().max().unwrap_or(1);
        // Templates by CPU number: thread k runs on allowed[k] whatever the count.
        let mut by_cpu: Vec<&[u8]> =
            vec![&frames[0]; allowed[..max].iter().max().map_or(1, |c| c + 1)];
        for (k, &cpu) in allowed[..max].iter().enumerate() {
            by_cpu[cpu] = &frames[k];
        }
        self.set_templates(&by_cpu, vary)?;
        let mut m: Vec<Vec<Measured>> = counts.iter().map(|_| Vec::new()).collect();
        for _ in 0..self.args.runs {
            for (i, &n) in counts.iter().enumerate() {
                if empty_handshakes {
                    let keys = self.dp.maps.transient.keys()?;
                    self.dp.maps.transient.remove_many(&keys)?;
                }
                m[i].push(self.run_parallel(&allowed[..n], frames[0].len(), repeat)?);
            }
        }
        Ok(m.into_iter()
            .map(|m| Measured {
                mpps: median(m.iter().map(|m| m.mpps).collect()),
                ns: median(m.iter().map(|m| m.ns).collect()),
                overlap: m.iter().map(|m| m.overlap).fold(f64::INFINITY, f64::min),
                verdict: m[0].verdict,
            })
            .collect())
    }
}

/// Runs the sweep over `counts` thread counts (each ≤ the allowed CPUs) and prints and writes its report.
pub fn run(b: &mut Bench, obj: &[u8], counts: &[usize]) -> Result<()> {
    let allowed = allowed_cpus()?;
    let max = *counts.iter().max().context("no thread counts")?;
    if max > allowed.len() || max > 250 {
        bail!(
            "{max} threads: this process may run on {} CPUs (at most 250 threads)",
            allowed.len()
        );
    }
    b.dp = load(obj, &MapSizes::default())?;
    // A new flow costs ~10× an established packet: fewer repeats keep each measurement near a second.
    let nf_repeat = b.args.repeat.min(200_000);
    let mut rows: Vec<Row> = Vec::new();
    let syn_from = |src: Ipv4Addr| pad(tcp(CLIENT_MAC, LB_MAC, src, 40000, VIP, 80, SYN, b""));

    // Small tables: each thread's own connection, UDP flow and non-service frame.
    let mut fast: Vec<(&'static str, Vec<Vec<u8>>)> = ["tcp_established", "tcp_reply"]
        .into_iter()
        .map(|c| (c, Vec::new()))
        .collect();
    let (mut udp, mut other) = (Vec::new(), Vec::new());
    for k in 0..max {
        let c = open_connection(b, client(k).into(), VIP.into(), 40000, 80)?;
        fast[0].1.push(c.first);
        fast[1].1.push(c.reply);
        let dgram = pad(udp_frame(client(k)));
        b.forward(&dgram, "a thread's UDP datagram")?;
        udp.push(dgram);
        other.push(pad(tcp(
            CLIENT_MAC,
            LB_MAC,
            client(k),
            40000,
            VIP,
            22,
            SYN,
            b"",
        )));
    }
    fast.push(("udp_established", udp));
    fast.push(("non_service_pass", other));
    for (case, frames) in &fast {
        let m = b.scale_case(&allowed, counts, frames, false, b.args.repeat, false)?;
        record_all(&mut rows, counts, case, m);
    }
    let syns: Vec<Vec<u8>> = (0..max).map(|k| syn_from(varied_source(10, k))).collect();
    // A handshake table with room for one measurement's SYNs, emptied before each (the handshakes a production
    // table holds complete and leave it): every insert finds a free element, none evicts. Its LRU lists are per
    // CPU, each over an even share of the possible CPUs': a share holds one thread's SYNs. A thread makes as many
    // as the production table holds (64 Ki): with more, the case measured the memory past the last-level cache,
    // not the data plane (200 000 SYNs a thread: 0.82-0.97 at two CPUs, every SYN of the sweep kept: 0.83-0.89).
    let room_repeat = nf_repeat.min(lb_common::defaults::MAX_TRANSIENT);
    let possible = aya::util::nr_cpus().map_err(|(_, e)| e)? as u32;
    let room = possible * (room_repeat + 4096);
    b.dp = load(
        obj,
        &MapSizes {
            transient: room,
            ..MapSizes::default()
        },
    )?;
    let m = b.scale_case(&allowed, counts, &syns, true, room_repeat, true)?;
    record_all(&mut rows, counts, "tcp_new_flow_syn", m);

    // Production tables, filled: new flows into them (the handshake table overrun), established connections in
    // them, and SYNs the rate guard drops.
    let production = MapSizes {
        flows: b.args.production_flows,
        flows_v6: b.args.production_flows,
        ..MapSizes::default()
    };
    b.dp = load(obj, &production)?;
    fill_both(&mut b.dp, &production)?;
    let mut established = Vec::new();
    for k in 0..max {
        established.push(open_connection(b, client(k).into(), VIP.into(), 40001, 80)?.first);
    }
    let m = b.scale_case(&allowed, counts, &syns, true, nf_repeat, false)?;
    record_all(&mut rows, counts, "tcp_new_flow_syn_full", m);
    let m = b.scale_case(&allowed, counts, &established, false, b.args.repeat, false)?;
    record_all(&mut rows, counts, "tcp_established_full", m);
    b.dp.maps.config.set(
        lb_common::CONFIG_INDEX,
        &lb_common::Config::default().with_syn_rate(1, 1),
    )?;
    let spoofed: Vec<Vec<u8>> = (0..max).map(|k| syn_from(varied_source(100, k))).collect();
    let m = b.scale_case(&allowed, counts, &spoofed, true, b.args.repeat, false)?;
    record_all(&mut rows, counts, "tcp_syn_guard_drop_full", m);

    // The cases in the order measured (each case's rows are together: `record_all` adds all its counts at once).
    let mut order: Vec<&'static str> = rows.iter().map(|r| r.case).collect();
    order.dedup();
    let goal = |threads, min, cases: Vec<&'static str>| {
        let worst = rows
            .iter()
            .filter(|r| r.threads == threads && cases.contains(&r.case))
            .map(|r| r.efficiency)
            .fold(f64::INFINITY, f64::min);
        Goal {
            threads,
            min_efficiency: min,
            cases,
            worst,
            met: worst >= min,
        }
    };
    let mut goals = vec![];
    if counts.contains(&2) {
        goals.push(goal(2, 0.9, order.clone()));
    }
    if counts.contains(&16) {
        goals.push(goal(
            16,
            0.8,
            vec![
                "tcp_established",
                "udp_established",
                "tcp_new_flow_syn_full",
            ],
        ));
    }
    let report = Report {
        cpu_model: cpu_model(),
        cpus: allowed.len(),
        threads: counts.to_vec(),
        repeat: b.args.repeat,
        new_flow_repeat: nf_repeat,
        runs: b.args.runs,
        rows,
        goals,
    };
    print(&report);
    let path = write_json("dataplane-scaling", b.args.smoke, &report)?;
    println!("  JSON: {}", path.display());
    Ok(())
}

/// Adds a case's rows, one per thread count, with each count's efficiency against the case's one-thread row.
fn record_all(rows: &mut Vec<Row>, counts: &[usize], case: &'static str, m: Vec<Measured>) {
    for (&threads, m) in counts.iter().zip(m) {
        let one = rows
            .iter()
            .find(|r| r.case == case && r.threads == 1)
            .map_or(m.mpps, |r| r.aggregate_mpps);
        rows.push(Row {
            case,
            threads,
            verdict: verdict_name(m.verdict),
            aggregate_mpps: m.mpps,
            ns_per_packet: m.ns,
            efficiency: m.mpps / (threads as f64 * one),
            overlap: m.overlap,
        });
    }
}

fn udp_frame(src: Ipv4Addr) -> Vec<u8> {
    udp(CLIENT_MAC, LB_MAC, src, 5353, VIP, 53, b"0123456789")
}

fn print(r: &Report) {
    println!();
    println!(
        "scaling, BPF_PROG_TEST_RUN on N threads at once (each pinned to a CPU of its own, on flows of its own), \
         {} repeats (new flows {}) x {} runs (median), 64-byte IPv4 frames",
        r.repeat, r.new_flow_repeat, r.runs
    );
    println!("  CPU: {} ({} CPUs usable)", r.cpu_model, r.cpus);
    println!(
        "  {:<24} {:>7} {:>8} {:>14} {:>14} {:>10} {:>8}",
        "case", "threads", "verdict", "aggregate Mpps", "ns/pkt/thread", "efficiency", "overlap"
    );
    for row in &r.rows {
        println!(
            "  {:<24} {:>7} {:>8} {:>14.2} {:>14.1} {:>10.2} {:>8.2}",
            row.case,
            row.threads,
            row.verdict,
            row.aggregate_mpps,
            row.ns_per_packet,
            row.efficiency,
            row.overlap
        );
    }
    for g in &r.goals {
        println!(
            "  goal: efficiency ≥ {} at {} threads ({}): {} (worst {:.2})",
            g.min_efficiency,
            g.threads,
            if g.cases.len() > 3 {
                "every case".to_owned()
            } else {
                g.cases.join(", ")
            },
            if g.met { "met" } else { "NOT met" },
            g.worst
        );
    }
}
