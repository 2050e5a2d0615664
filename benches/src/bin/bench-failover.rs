//! `cargo xtask bench failover`: VRRP failover between load-balancer replicas on the netns segment.
//!
//! - Ours: two replicas, keepalived at 200 ms adverts driven by the agent, connection-state sync. Each round
//!   holds TCP connections exchanging data every 50 ms plus UDP flows, cuts the master's link (a dead VM), and
//!   measures the VRRP takeover time (until the backup has the VIP), the longest pause any connection saw
//!   (time until traffic flows again) and the share of connections that survived; then the link comes back
//!   and the pair settles before the next round.
//! - Anchor: the same replicas with yawol's keepalived timing (4 s adverts) and no state sync.
//! - Sync throughput: short connections through the master as fast as the client can open them; records
//!   replicated per second and the agents' CPU time per 1000 flows.

use anyhow::{bail, Result};
use clap::Parser;
use lb_benches::{median, print_table, process_cpu, wait, write_json};
use lb_testbed::ha::{survival, HaRig, HaRigConfig};
use lb_testbed::rig::TCP_PORT;
use lb_testbed::Host;
use serde::Serialize;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// Failovers with our settings.
    #[arg(long, default_value_t = 10)]
    failovers: usize,
    /// Failovers of the anchor (each costs ~20 s).
    #[arg(long, default_value_t = 3)]
    anchor_failovers: usize,
    /// Held TCP connections per round.
    #[arg(long, default_value_t = 200)]
    connections: usize,
    /// Held UDP flows per round.
    #[arg(long, default_value_t = 20)]
    udp_flows: usize,
    /// Short connections for the sync-throughput run.
    #[arg(long, default_value_t = 20000)]
    sync_connections: usize,
    /// A short run that only proves the benchmark runs (`cargo xtask test`): one failover of ours with 20
    /// connections and 2 UDP flows, none of the anchor (a round of its 4 s adverts takes ~45 s; it is the same
    /// round with other timers), 500 sync connections; JSON under target/bench/smoke/.
    #[arg(long)]
    smoke: bool,
}

#[derive(Serialize, Clone)]
struct Round {
    takeover_ms: f64,
    longest_gap_ms: f64,
    survival: f64,
    broken: usize,
}

#[derive(Serialize)]
struct Setup {
    name: String,
    advert_ms: u64,
    sync: bool,
    rounds: Vec<Round>,
    takeover_median_ms: f64,
    takeover_max_ms: f64,
    gap_median_ms: f64,
    gap_max_ms: f64,
    survival_min: f64,
    survival_mean: f64,
}

#[derive(Serialize)]
struct SyncRun {
    connections: usize,
    seconds: f64,
    new_flows: f64,
    records_sent: f64,
    records_applied_on_peer: f64,
    records_per_s: f64,
    master_agent_cpu_s: f64,
    backup_agent_cpu_s: f64,
    /// Both agents' CPU seconds per second without traffic.
    idle_cpu_per_s: f64,
    /// Both agents' CPU time over the run, less their idle CPU over the same time, per connection the master
    /// synced.
    cpu_us_per_connection: f64,
    /// Records the backup refused as conflicts (a split brain only; none here).
    conflicts: f64,
    peer_missing_flows: usize,
    /// Forward flows the backup holds and the master does not (connections closed there, lingering here).
    peer_extra_flows: usize,
}

#[derive(Serialize)]
struct Report {
    setups: Vec<Setup>,
    sync: SyncRun,
    apply: ApplyRun,
}

/// The receiving side's cost alone: a short connection's records (new, the client's FIN, the backend's FIN)
/// applied to a loaded data plane's maps through the agent's store, in frames, with no traffic beside it.
#[derive(Serialize)]
struct ApplyRun {
    connections: usize,
    records_per_frame: usize,
    /// CPU time of the applying thread per connection.
    cpu_us_per_connection: f64,
}

/// Thread CPU time in seconds (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn apply_cost(connections: usize, per_frame: usize) -> Result<ApplyRun> {
    use lb_agent::dataplane::model::{Protocol, ServiceId, ServiceSpec};
    use lb_agent::dataplane::programmer::Programmer;
    use lb_agent::dataplane::{Dataplane, MapSizes};
    use lb_agent::ha::flowstore::BpfFlowStore;
    use lb_agent::ha::sync::FlowRecord;
    use lb_common::{FlowEventV4, FlowKeyV4, FlowV4, FLOW_EV_CLOSE, FLOW_EV_NEW, FLOW_F_FIN};
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    let sizes = MapSizes {
        flows: 131_072,
        transient: 65_536,
        ..MapSizes::default()
    };
    let mut dp = Dataplane::load(&sizes, None)?;
    let (vip, client, node) = (
        Ipv4Addr::new(203, 0, 113, 1),
        Ipv4Addr::new(198, 51, 100, 10),
        Ipv4Addr::new(10, 0, 0, 11),
    );
    Programmer::new(sizes.services, sizes.backends, sizes.maglev_slots).apply(
        &mut dp.maps,
        &[ServiceSpec {
            id: ServiceId {
                vip: IpAddr::V4(vip),
                port: 80,
                protocol: Protocol::Tcp,
            },
            snat: None,
            idle_timeout: Duration::from_secs(3600),
            source_ranges: vec![],
            backends: vec![SocketAddr::new(IpAddr::V4(node), 30080)],
            proxy_v2: false,
        }],
    )?;
    let mut store = BpfFlowStore::open(&dp.maps, Default::default())?;
    let raw = |a: Ipv4Addr| u32::from_ne_bytes(a.octets());
    let mut recs = Vec::with_capacity(connections * 3);
    for i in 0..connections {
        let cport = (10_000 + i % 50_000) as u16;
        let sport = (1024 + (i * 7) % 60_000) as u16;
        let key = FlowKeyV4 {
            src: raw(client),
            dst: raw(vip),
            sport: cport.to_be(),
            dport: 80u16.to_be(),
            proto: 6,
            _pad: [0; 3],
        };
        let fwd = FlowV4 {
            new_src: raw(vip),
            new_dst: raw(node),
            new_sport: sport.to_be(),
            new_dport: 30080u16.to_be(),
            flags: lb_common::FLOW_F_FORWARD,
            timeout_s: 3600,
            ..Default::default()
        };
        let rev = FlowV4 {
            new_src: raw(vip),
            new_dst: raw(client),
            new_sport: 80u16.to_be(),
            new_dport: cport.to_be(),
            flags: lb_common::FLOW_F_REVERSE,
            timeout_s: 3600,
            ..Default::default()
        };
        let ev = |kind, key, fwd, rev| FlowRecord {
            event: FlowEventV4 {
                kind,
                _pad: [0; 7],
                key,
                fwd,
                rev,
            }
            .into(),
            age_ms: 0,
        };
        recs.push(ev(FLOW_EV_NEW, key, fwd, rev));
        let fin = |mut f: FlowV4| {
            f.flags |= FLOW_F_FIN;
            f
        };
        recs.push(ev(FLOW_EV_CLOSE, key, fin(fwd), FlowV4::default()));
        recs.push(ev(
            FLOW_EV_CLOSE,
            fwd.partner_key(6),
            fin(rev),
            FlowV4::default(),
        ));
    }
    // A connection's records in different frames, as under churn: new connections in one frame, their closes
    // in later ones.
    let t = thread_cpu_s();
    for frame in recs.chunks(per_frame) {
        store.apply_batch(frame)?;
    }
    let cpu = thread_cpu_s() - t;
    Ok(ApplyRun {
        connections,
        records_per_frame: per_frame,
        cpu_us_per_connection: cpu * 1e6 / connections as f64,
    })
}

fn hold_args(r: &HaRig, a: &Args, timeout_ms: u64) -> Vec<String> {
    lb_testbed::ha::hold_args(
        &r.vip.to_string(),
        a.connections,
        a.udp_flows,
        Duration::from_millis(50),
        Duration::from_millis(timeout_ms),
    )
}

/// One failover: hold, cut the master, measure, restore, settle. A connection that has not exchanged data
/// for `timeout_ms` counts as broken, and the hold runs that long past the takeover, so every connection
/// that the new master cannot carry is seen as broken.
fn round(r: &HaRig, a: &Args, sync: bool, timeout_ms: u64) -> Result<Round> {
    let (master, backup) = r.wait_master_and_backup(Duration::from_secs(60))?;
    let args = hold_args(r, a, timeout_ms);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let hold = r.start_hold(&args)?;
    std::thread::sleep(Duration::from_secs(1));
    if sync {
        wait(
            "the backup to have the flows",
            Duration::from_secs(20),
            || {
                let m = r.forward_flows::<u32>(master)?;
                let b = r.forward_flows::<u32>(backup)?;
                Ok(m.keys().all(|k| b.contains_key(k)))
            },
        )?;
    }
    let t0 = Instant::now();
    r.cut_link(master, true)?;
    wait(
        "the backup to take the VIP",
        Duration::from_secs(60),
        || Ok(r.vip_holders()?.contains(&backup)),
    )?;
    let takeover_ms = t0.elapsed().as_secs_f64() * 1e3;
    std::thread::sleep(Duration::from_millis(timeout_ms + 1000));
    let rep = hold.stop()?;
    r.cut_link(master, false)?;
    // The old master comes back with a stale VIP: VRRP settles on one holder, sync repairs its table.
    wait("one VIP holder", Duration::from_secs(60), || {
        Ok(r.master()?.is_some())
    })?;
    std::thread::sleep(Duration::from_secs(3));
    Ok(Round {
        takeover_ms,
        longest_gap_ms: rep.max_gap_ms,
        survival: survival(&rep),
        broken: rep.broken,
    })
}

fn setup(name: &str, a: &Args, advert: Duration, sync: bool, n: usize) -> Result<Setup> {
    if n == 0 {
        return Ok(Setup {
            name: name.into(),
            advert_ms: advert.as_millis() as u64,
            sync,
            rounds: Vec::new(),
            takeover_median_ms: f64::NAN,
            takeover_max_ms: f64::NAN,
            gap_median_ms: f64::NAN,
            gap_max_ms: f64::NAN,
            survival_min: f64::NAN,
            survival_mean: f64::NAN,
        });
    }
    let mut cfg = HaRigConfig::new()?;
    cfg.advert_interval = advert;
    cfg.sync = sync;
    let r = HaRig::start(cfg)?;
    // Broken = no data for the VRRP detection time (3 adverts) plus 5 s: long enough for TCP's retransmission
    // backoff to reach a new master that has the flow, so "broken" is about lost state, not about timers.
    let timeout_ms = 3 * advert.as_millis() as u64 + 5_000;
    let mut rounds = Vec::new();
    for i in 0..n {
        let rd = round(&r, a, sync, timeout_ms)?;
        eprintln!(
            "{name} round {}: takeover {:.0} ms, longest gap {:.0} ms, survival {:.1} %",
            i + 1,
            rd.takeover_ms,
            rd.longest_gap_ms,
            rd.survival * 100.0
        );
        rounds.push(rd);
    }
    let col = |f: fn(&Round) -> f64| rounds.iter().map(f).collect::<Vec<_>>();
    let max = |v: Vec<f64>| v.into_iter().fold(0.0, f64::max);
    let surv = col(|r| r.survival);
    Ok(Setup {
        name: name.into(),
        advert_ms: advert.as_millis() as u64,
        sync,
        takeover_median_ms: median(col(|r| r.takeover_ms)),
        takeover_max_ms: max(col(|r| r.takeover_ms)),
        gap_median_ms: median(col(|r| r.longest_gap_ms)),
        gap_max_ms: max(col(|r| r.longest_gap_ms)),
        survival_min: surv.iter().copied().fold(1.0, f64::min),
        survival_mean: surv.iter().sum::<f64>() / surv.len().max(1) as f64,
        rounds,
    })
}

fn sync_throughput(a: &Args) -> Result<SyncRun> {
    let r = HaRig::start(HaRigConfig::new()?)?;
    let (master, backup) = r.wait_master_and_backup(Duration::from_secs(60))?;
    let cpu = |h: Host| r.agent_pid(h).map_or(0.0, |p| process_cpu(p as i32));
    let m = |h: Host, name: &str| r.metric(h, name, "").unwrap_or(0.0);
    // The agents' CPU without traffic (health checks, GC, metrics), subtracted below: what remains is the sync's
    // cost (and the master's GC of the connections it carried).
    let idle = Duration::from_secs(3);
    let (im, ib) = (cpu(master), cpu(backup));
    std::thread::sleep(idle);
    let idle_cpu_per_s = (cpu(master) - im + cpu(backup) - ib) / idle.as_secs_f64();
    let (cm, cb) = (cpu(master), cpu(backup));
    let flows0 = r.metric(master, "lb_dataplane_packets_total", "reason=\"new_flows\"")?;
    let applied0 =
        m(backup, "lb_sync_records_applied_total") + m(backup, "lb_sync_records_unchanged_total");
    let sent0 = m(master, "lb_sync_records_sent_total");
    // Every record the backup has dealt with, whatever the outcome.
    let dropped = |reason: &str| {
        r.metric(
            backup,
            "lb_sync_records_dropped_total",
            &format!("reason=\"{reason}\""),
        )
        .unwrap_or(0.0)
    };
    let processed = || {
        m(backup, "lb_sync_records_applied_total")
            + m(backup, "lb_sync_records_unchanged_total")
            + dropped("conflict")
            + dropped("unknown_service")
            + dropped("store_error")
    };
    let conflicts0 = dropped("conflict");
    let processed0 = processed();
    let t = Instant::now();
    let target = format!("{}:{TCP_PORT}", r.vip);
    let n = a.sync_connections.to_string();
    let load = r.load(&[
        "--tcp",
        &target,
        "--connections",
        &n,
        "--concurrency",
        "128",
    ])?;
    if let Some(t) = &load.tcp {
        eprintln!("sync run: {} connections ok, {} failed", t.ok, t.failed);
    }
    // The agents publish their counters once a second: let them catch up before reading.
    let settle = Duration::from_millis(1500);
    std::thread::sleep(settle);
    let sent = m(master, "lb_sync_records_sent_total") - sent0;
    wait(
        "the peer to apply everything",
        Duration::from_secs(60),
        || Ok(processed() - processed0 >= sent),
    )?;
    let busy = t.elapsed().as_secs_f64();
    let seconds = busy - settle.as_secs_f64();
    let new_flows =
        r.metric(master, "lb_dataplane_packets_total", "reason=\"new_flows\"")? - flows0;
    let applied = m(backup, "lb_sync_records_applied_total")
        + m(backup, "lb_sync_records_unchanged_total")
        - applied0;
    let (dm, db) = (cpu(master) - cm, cpu(backup) - cb);
    let fm = r.forward_flows::<u32>(master)?;
    let fb = r.forward_flows::<u32>(backup)?;
    Ok(SyncRun {
        connections: a.sync_connections,
        seconds,
        new_flows,
        records_sent: sent,
        records_applied_on_peer: applied,
        records_per_s: applied / seconds,
        master_agent_cpu_s: dm,
        backup_agent_cpu_s: db,
        idle_cpu_per_s,
        cpu_us_per_connection: (dm + db - idle_cpu_per_s * busy).max(0.0) * 1e6
            / new_flows.max(1.0),
        conflicts: dropped("conflict") - conflicts0,
        peer_missing_flows: fm.keys().filter(|k| !fb.contains_key(k)).count(),
        peer_extra_flows: fb.keys().filter(|k| !fm.contains_key(k)).count(),
    })
}

fn main() -> Result<()> {
    let mut a = Args::parse();
    if a.smoke {
        (a.failovers, a.anchor_failovers) = (1, 0);
        (a.connections, a.udp_flows, a.sync_connections) = (20, 2, 500);
    }
    if !lb_testbed::is_root() {
        bail!("bench failover needs root");
    }
    let apply = apply_cost(a.sync_connections, 64)?;
    println!(
        "sync apply alone: {} connections (new, FIN, FIN) in frames of {} records: {:.1} µs CPU per connection",
        apply.connections, apply.records_per_frame, apply.cpu_us_per_connection
    );
    let ours = setup(
        "ours (200 ms adverts, sync)",
        &a,
        Duration::from_millis(200),
        true,
        a.failovers,
    )?;
    let anchor = setup(
        "yawol timing (4 s adverts, no sync)",
        &a,
        Duration::from_secs(4),
        false,
        a.anchor_failovers,
    )?;
    let sync = sync_throughput(&a)?;
    let rows: Vec<Vec<String>> = [&ours, &anchor]
        .iter()
        .map(|s| {
            vec![
                s.name.clone(),
                s.rounds.len().to_string(),
                format!("{:.0} / {:.0}", s.takeover_median_ms, s.takeover_max_ms),
                format!("{:.0} / {:.0}", s.gap_median_ms, s.gap_max_ms),
                format!(
                    "{:.1} / {:.1}",
                    s.survival_mean * 100.0,
                    s.survival_min * 100.0
                ),
            ]
        })
        .collect();
    print_table(
        &[
            "setup",
            "failovers",
            "VRRP takeover ms (median / max)",
            "traffic pause ms (median / max)",
            "surviving % (mean / min)",
        ],
        &rows,
    );
    println!(
        "sync: {} new flows in {:.1} s, {:.0} records/s applied on the peer, agents' CPU {:.2} + {:.2} s (idle {:.3} s/s) = {:.1} µs per synced connection, {} conflicts, {} flows missing on the peer, {} extra there",
        sync.new_flows,
        sync.seconds,
        sync.records_per_s,
        sync.master_agent_cpu_s,
        sync.backup_agent_cpu_s,
        sync.idle_cpu_per_s,
        sync.cpu_us_per_connection,
        sync.conflicts,
        sync.peer_missing_flows,
        sync.peer_extra_flows
    );
    let path = write_json(
        "failover",
        a.smoke,
        &Report {
            setups: vec![ours, anchor],
            sync,
            apply,
        },
    )?;
    println!("JSON: {}", path.display());
    Ok(())
}
