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
//! the `_full` cases (new TCP handshakes, new UDP flows, established connections) and the guarded SYN drop.
//!
//! `--sweeps K` runs the whole sweep K times and reports, per case and count, the medians across them, with the
//! efficiency against the median one-thread rate and the sweeps' own efficiencies as a range; `--combine` does
//! the same with the JSON of sweeps run elsewhere (`benches/sweep.sh`). One sweep is not enough on a virtual
//! machine whose neighbours come and go: a vCPU's speed changes from one sweep to the next (measured on a 16-vCPU
//! VM: one thread alone took 60 or 120 ns per established packet, sweep by sweep, sixteen at once 100-115 ns),
//! and one sweep's efficiency inherits whichever speed its one-thread row caught.

use super::{fill_both, load, open_connection, pad, verdict_name, Bench, MapSizes, VIP};
use anyhow::{bail, Context, Result};
use aya::programs::{TestRun, TestRunOptions};
use lb_benches::{allowed_cpus, cpu_model, median, pin_cpu, write_json};
use lb_test_support::packets::*;
use serde::{Deserialize, Serialize};
use std::net::Ipv4Addr;
use std::path::PathBuf;
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

#[derive(Serialize, Deserialize)]
struct Row {
    case: String,
    threads: usize,
    verdict: String,
    aggregate_mpps: f64,
    /// Mean over the threads of the kernel's ns per repeat (template restore included).
    ns_per_packet: f64,
    /// `aggregate_mpps / (threads × the one-thread aggregate)`.
    efficiency: f64,
    /// The share of the shortest thread's run during which all threads ran (the lowest of the runs); the rates
    /// add up as concurrent ones only near 1.
    overlap: f64,
    /// Several sweeps combined: the lowest and highest of their own efficiencies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    efficiency_range: Option<[f64; 2]>,
}

#[derive(Serialize, Deserialize)]
struct Goal {
    threads: usize,
    min_efficiency: f64,
    cases: Vec<String>,
    /// The lowest efficiency among `cases` at `threads`, and whether it reaches the goal.
    worst: f64,
    met: bool,
}

#[derive(Serialize, Deserialize)]
struct Report {
    cpu_model: String,
    /// CPUs this process could run on.
    cpus: usize,
    threads: Vec<usize>,
    repeat: u32,
    new_flow_repeat: u32,
    runs: usize,
    /// Sweeps whose medians the rows are (1: the rows are one sweep's).
    #[serde(default = "one")]
    sweeps: usize,
    rows: Vec<Row>,
    goals: Vec<Goal>,
}

fn one() -> usize {
    1
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

/// A new flow costs ~10× an established packet: fewer repeats keep each measurement near a second.
const NEW_FLOW_REPEAT: u32 = 200_000;

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

/// Runs the sweep over `counts` thread counts (each ≤ the allowed CPUs) `sweeps` times, printing each sweep's
/// table, and prints and writes the report: the one sweep's, or the medians of several.
pub fn run(b: &mut Bench, obj: &[u8], counts: &[usize], sweeps: usize) -> Result<()> {
    let allowed = allowed_cpus()?;
    let max = *counts.iter().max().context("no thread counts")?;
    if max > allowed.len() || max > 250 {
        bail!(
            "{max} threads: this process may run on {} CPUs (at most 250 threads)",
            allowed.len()
        );
    }
    let mut reports = Vec::new();
    for k in 1..=sweeps.max(1) {
        let rows = sweep(b, obj, &allowed, counts)?;
        let report = Report {
            cpu_model: cpu_model(),
            cpus: allowed.len(),
            threads: counts.to_vec(),
            repeat: b.args.repeat,
            new_flow_repeat: b.args.repeat.min(NEW_FLOW_REPEAT),
            runs: b.args.runs,
            sweeps: 1,
            goals: goals(&rows, counts),
            rows,
        };
        if sweeps > 1 {
            println!("\nsweep {k} of {sweeps}");
        }
        print(&report);
        reports.push(report);
    }
    let report = if reports.len() == 1 {
        reports.pop().context("no sweep")?
    } else {
        let r = combine(reports)?;
        print(&r);
        r
    };
    let path = write_json("dataplane-scaling", b.args.smoke, &report)?;
    println!("  JSON: {}", path.display());
    Ok(())
}

/// Combines the JSON of earlier sweeps (`--combine`: run elsewhere, e.g. by `benches/sweep.sh` on a larger
/// machine) into one report of their medians; measures nothing.
pub fn combine_files(paths: &[PathBuf]) -> Result<()> {
    let reports = paths
        .iter()
        .map(|p| -> Result<Report> {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{}: not a scaling sweep's JSON", p.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    let report = combine(reports)?;
    print(&report);
    let path = write_json("dataplane-scaling-combined", false, &report)?;
    println!("  JSON: {}", path.display());
    Ok(())
}

/// One sweep: every case on every count, its rows in the order measured.
fn sweep(b: &mut Bench, obj: &[u8], allowed: &[usize], counts: &[usize]) -> Result<Vec<Row>> {
    let max = *counts.iter().max().context("no thread counts")?;
    b.dp = load(obj, &MapSizes::default())?;
    let nf_repeat = b.args.repeat.min(NEW_FLOW_REPEAT);
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
        let m = b.scale_case(allowed, counts, frames, false, b.args.repeat, false)?;
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
    let m = b.scale_case(allowed, counts, &syns, true, room_repeat, true)?;
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
    let m = b.scale_case(allowed, counts, &syns, true, nf_repeat, false)?;
    record_all(&mut rows, counts, "tcp_new_flow_syn_full", m);
    // A new UDP flow goes straight into the connection table (no handshake): its inserts, and its LRU lists.
    let datagrams: Vec<Vec<u8>> = (0..max)
        .map(|k| pad(udp_frame(varied_source(20, k))))
        .collect();
    let m = b.scale_case(allowed, counts, &datagrams, true, nf_repeat, false)?;
    record_all(&mut rows, counts, "udp_new_flow_full", m);
    let m = b.scale_case(allowed, counts, &established, false, b.args.repeat, false)?;
    record_all(&mut rows, counts, "tcp_established_full", m);
    b.dp.maps.config.set(
        lb_common::CONFIG_INDEX,
        &lb_common::Config::default().with_syn_rate(1, 1),
    )?;
    let spoofed: Vec<Vec<u8>> = (0..max).map(|k| syn_from(varied_source(100, k))).collect();
    let m = b.scale_case(allowed, counts, &spoofed, true, b.args.repeat, false)?;
    record_all(&mut rows, counts, "tcp_syn_guard_drop_full", m);

    Ok(rows)
}

/// The medians of several sweeps of the same thread counts, case by case: a count's aggregate and ns are the
/// medians of the sweeps' (each itself a median of runs), its efficiency is against the median one-thread rate,
/// and `efficiency_range` keeps the sweeps' own.
fn combine(reports: Vec<Report>) -> Result<Report> {
    let first = reports.first().context("no sweep to combine")?;
    if let Some(r) = reports.iter().find(|r| r.threads != first.threads) {
        bail!(
            "sweeps of different thread counts ({:?} and {:?}) do not combine",
            first.threads,
            r.threads
        );
    }
    let sweeps: usize = reports.iter().map(|r| r.sweeps).sum();
    let mut rows: Vec<Row> = Vec::new();
    for row in &first.rows {
        let same: Vec<&Row> = reports
            .iter()
            .flat_map(|r| &r.rows)
            .filter(|r| r.case == row.case && r.threads == row.threads)
            .collect();
        // A row that is itself combined brings its sweeps' range.
        let lo = same
            .iter()
            .map(|r| r.efficiency_range.map_or(r.efficiency, |e| e[0]));
        let hi = same
            .iter()
            .map(|r| r.efficiency_range.map_or(r.efficiency, |e| e[1]));
        let mpps = median(same.iter().map(|r| r.aggregate_mpps).collect());
        let efficiency = efficiency(&rows, &row.case, row.threads, mpps);
        rows.push(Row {
            case: row.case.clone(),
            threads: row.threads,
            verdict: row.verdict.clone(),
            aggregate_mpps: mpps,
            ns_per_packet: median(same.iter().map(|r| r.ns_per_packet).collect()),
            efficiency,
            overlap: same.iter().map(|r| r.overlap).fold(f64::INFINITY, f64::min),
            efficiency_range: Some([
                lo.fold(f64::INFINITY, f64::min),
                hi.fold(f64::NEG_INFINITY, f64::max),
            ]),
        });
    }
    let mut models: Vec<&str> = reports.iter().map(|r| r.cpu_model.as_str()).collect();
    models.dedup();
    Ok(Report {
        cpu_model: models.join(" / "),
        cpus: first.cpus,
        threads: first.threads.clone(),
        repeat: first.repeat,
        new_flow_repeat: first.new_flow_repeat,
        runs: first.runs,
        sweeps,
        goals: goals(&rows, &first.threads),
        rows,
    })
}

/// The goals that these counts can show: every case at two threads, the established, UDP and new-flow-
/// into-the-full-table cases at sixteen.
fn goals(rows: &[Row], counts: &[usize]) -> Vec<Goal> {
    // The cases in the order measured (each case's rows are together: `record_all` adds all its counts at once).
    let mut order: Vec<String> = rows.iter().map(|r| r.case.clone()).collect();
    order.dedup();
    let goal = |threads, min, cases: Vec<String>| {
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
        goals.push(goal(2, 0.9, order));
    }
    if counts.contains(&16) {
        let cases = [
            "tcp_established",
            "udp_established",
            "tcp_new_flow_syn_full",
        ];
        goals.push(goal(16, 0.8, cases.map(String::from).to_vec()));
    }
    goals
}

/// Adds a case's rows, one per thread count, with each count's efficiency against the case's one-thread row.
fn record_all(rows: &mut Vec<Row>, counts: &[usize], case: &str, m: Vec<Measured>) {
    for (&threads, m) in counts.iter().zip(m) {
        let efficiency = efficiency(rows, case, threads, m.mpps);
        rows.push(Row {
            case: case.to_owned(),
            threads,
            verdict: verdict_name(m.verdict).to_owned(),
            aggregate_mpps: m.mpps,
            ns_per_packet: m.ns,
            efficiency,
            overlap: m.overlap,
            efficiency_range: None,
        });
    }
}

/// `mpps` at `threads` against `threads` times the case's one-thread row in `rows` (1 for that row itself).
fn efficiency(rows: &[Row], case: &str, threads: usize, mpps: f64) -> f64 {
    let one = rows
        .iter()
        .find(|r| r.case == case && r.threads == 1)
        .map_or(mpps, |r| r.aggregate_mpps);
    mpps / (threads as f64 * one)
}

fn udp_frame(src: Ipv4Addr) -> Vec<u8> {
    udp(CLIENT_MAC, LB_MAC, src, 5353, VIP, 53, b"0123456789")
}

fn print(r: &Report) {
    println!();
    println!(
        "scaling, BPF_PROG_TEST_RUN on N threads at once (each pinned to a CPU of its own, on flows of its own), \
         {} repeats (new flows {}) x {} runs (median){}, 64-byte IPv4 frames",
        r.repeat,
        r.new_flow_repeat,
        r.runs,
        if r.sweeps > 1 {
            format!(", medians of {} sweeps", r.sweeps)
        } else {
            String::new()
        }
    );
    println!("  CPU: {} ({} CPUs usable)", r.cpu_model, r.cpus);
    let range_head = if r.sweeps > 1 { "  sweeps' eff." } else { "" };
    println!(
        "  {:<24} {:>7} {:>8} {:>14} {:>14} {:>10} {:>8}{range_head}",
        "case", "threads", "verdict", "aggregate Mpps", "ns/pkt/thread", "efficiency", "overlap"
    );
    for row in &r.rows {
        let range = row
            .efficiency_range
            .map(|[lo, hi]| format!("  {lo:>5.2}-{hi:.2}"))
            .unwrap_or_default();
        println!(
            "  {:<24} {:>7} {:>8} {:>14.2} {:>14.1} {:>10.2} {:>8.2}{range}",
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
            "  goal: efficiency ≥ {} at {} threads ({}): {} (worst {:.3})",
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
