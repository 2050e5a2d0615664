//! High availability end to end: two or three load-balancer replicas on one L2 segment sharing a VIP through
//! VRRP (real keepalived supervised by the real agent), with connection-state sync between the agents. A
//! client holds hundreds of TCP connections exchanging data every 50 ms plus UDP flows while the master dies,
//! a new revision takes over, or a peer restarts. Needs root, keepalived, `lb-agent` and the eBPF objects
//! (`cargo xtask test` provides all of them).
//!
//! Times are printed, not asserted (benchmarks measure them: `cargo xtask bench failover`); what is asserted
//! is that connections survive and that the replicas never translate one flow differently.

use lb_common::{FlowAddr, In6};
use lb_testbed::ha::{hold_summary, survival, HaRig, HaRigConfig};
use lb_testbed::hold::HoldReport;
use lb_testbed::load::{epoch_ms, TcpFailure};
use lb_testbed::proxy_backend::{Acceptor, ProxyBackend};
use lb_testbed::rig::TCP_PORT;
use lb_testbed::Host;
use std::time::{Duration, Instant, SystemTime};

/// One rig at a time: each runs two or three agents, keepalived and hundreds of connections, and two at once on a
/// 2-core machine starved a burst of short connections into resets and timeouts.
static ONE_RIG: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The lock that keeps other tests' rigs away, and a started rig. Bound in this order, the rig is torn down
/// before the lock is released (locals drop in reverse order).
fn rig(f: impl FnOnce(&mut HaRigConfig)) -> (std::sync::MutexGuard<'static, ()>, HaRig) {
    let lock = ONE_RIG
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    assert!(lb_testbed::is_root(), "HA tests need root");
    let mut cfg = HaRigConfig::new().expect("artifacts built");
    f(&mut cfg);
    (lock, HaRig::start(cfg).expect("HA rig starts"))
}

fn hold_args(r: &HaRig, conns: usize, udp: usize) -> Vec<String> {
    hold_args_to(&r.vip.to_string(), conns, udp)
}

/// [`hold_args`] towards `vip` (an IPv6 one in brackets): a message every 50 ms, 5 s per round trip.
fn hold_args_to(vip: &str, conns: usize, udp: usize) -> Vec<String> {
    lb_testbed::ha::hold_args(
        vip,
        conns,
        udp,
        Duration::from_millis(50),
        Duration::from_secs(5),
    )
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until replica `to` has every forward flow `from` has, of both families (sync caught up).
fn wait_synced(r: &HaRig, from: Host, to: Host) {
    fn holds<A: FlowAddr>(r: &HaRig, from: Host, to: Host) -> bool {
        let a = r.forward_flows::<A>(from).unwrap();
        let b = r.forward_flows::<A>(to).unwrap();
        a.keys().all(|k| b.contains_key(k))
    }
    wait_until(
        &format!("{to} to hold {from}'s flows"),
        Duration::from_secs(20),
        || holds::<u32>(r, from, to) && holds::<In6>(r, from, to),
    );
}

/// Split-brain guard: every flow both replicas know is translated identically (both families), and no sync
/// conflict was counted anywhere.
fn assert_consistent(r: &HaRig, hosts: &[Host]) {
    fn differ<A: FlowAddr>(r: &HaRig, a: Host, b: Host) -> usize {
        let fa = r.forward_flows::<A>(a).unwrap();
        let fb = r.forward_flows::<A>(b).unwrap();
        fa.iter()
            .filter(|(k, v)| fb.get(k).is_some_and(|w| w != *v))
            .count()
    }
    for (i, a) in hosts.iter().enumerate() {
        for b in &hosts[i + 1..] {
            let differ = differ::<u32>(r, *a, *b) + differ::<In6>(r, *a, *b);
            assert_eq!(
                differ, 0,
                "{a} and {b} translate {differ} flows differently"
            );
        }
        let conflicts = r.metric(*a, "lb_sync_conflicts_total", "").unwrap();
        assert_eq!(conflicts, 0.0, "sync conflicts on {a}");
    }
}

/// Cuts the master's link while `hold` runs, and asserts that at least 99 % of its connections and flows survived
/// the takeover (reported as `what`).
fn master_dies_and_most_survive(
    r: &HaRig,
    master: Host,
    backup: Host,
    hold: lb_testbed::rig::Hold,
    what: &str,
) {
    let cut = kill_master(r, master, backup);
    std::thread::sleep(Duration::from_secs(4));
    let rep = hold.stop().unwrap();
    report(what, &rep);
    println!("VRRP takeover after {} ms", cut.takeover.as_millis());
    assert!(
        survival(&rep) >= 0.99,
        "only {:.2} % survived: {:?}",
        survival(&rep) * 100.0,
        rep.connections.iter().take(5).collect::<Vec<_>>()
    );
}

/// When a master died: the cut (`ip link set down` takes a while, and traffic meets the old master until it
/// returns) and the takeover.
struct Cut {
    /// Just before the link went down.
    before: SystemTime,
    /// Once it was down: from here on the old master gets nothing.
    done: SystemTime,
    /// From `before` until the backup held the VIP.
    takeover: Duration,
}

/// Cuts the master's link (a dead VM) and waits until the backup holds the VIP.
fn kill_master(r: &HaRig, master: Host, backup: Host) -> Cut {
    let before = SystemTime::now();
    r.cut_link(master, true).unwrap();
    let done = SystemTime::now();
    wait_until(
        "the backup to take the VIP",
        Duration::from_secs(10),
        || r.vip_holders().unwrap().contains(&backup),
    );
    Cut {
        before,
        done,
        takeover: before.elapsed().unwrap_or_default(),
    }
}

fn report(what: &str, rep: &HoldReport) {
    println!("{what}: {}", hold_summary(rep));
}

#[test]
fn master_dies_and_connections_survive() {
    let (_one, r) = rig(|_| {});
    let (master, backup) = r.wait_master_and_backup(Duration::from_secs(20)).unwrap();
    let args = hold_args(&r, 300, 20);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let hold = r.start_hold(&args).unwrap();
    wait_synced(&r, master, backup);
    assert_consistent(&r, &[master, backup]);

    master_dies_and_most_survive(&r, master, backup, hold, "master link cut");
    assert_consistent(&r, &[backup]);
}

/// The same over IPv6: a dual-stack pair, the client holding connections and flows to the IPv6 VIP, which the
/// VRRP instance moves with the IPv4 one (unsolicited neighbour advertisements from the new master).
#[test]
fn master_dies_and_ipv6_connections_survive() {
    let (_one, r) = rig(|c| c.ipv6 = true);
    let (master, backup) = r.wait_master_and_backup(Duration::from_secs(20)).unwrap();
    let vip6 = format!("[{}]", r.vip6.expect("dual-stack rig"));
    let args = hold_args_to(&vip6, 300, 20);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let hold = r.start_hold(&args).unwrap();
    wait_synced(&r, master, backup);
    assert!(
        !r.forward_flows::<In6>(backup).unwrap().is_empty(),
        "the backup holds the IPv6 flows"
    );
    assert_consistent(&r, &[master, backup]);

    master_dies_and_most_survive(&r, master, backup, hold, "IPv6, master link cut");
    assert_consistent(&r, &[backup]);
}

/// PROXY protocol v2 across a failover: HAProxy (`accept-proxy`) on every backend in front of the echo server,
/// 300 held connections through the VIP exchanging data every 50 ms; the master dies, and at least 99 % go on
/// through the backup with every echo verified — the backup translates their sequence numbers from the synced
/// entries — and HAProxy got the client's address on each.
#[test]
fn master_dies_and_proxy_connections_survive() {
    let (_one, mut r) = rig(|c| c.options = "  tcpProxyProtocol: true\n".into());
    r.stop_echo();
    let backends = ProxyBackend::start_all(&r.topo, r.dir(), |_| Acceptor::Haproxy).unwrap();
    let (master, backup) = r.wait_master_and_backup(Duration::from_secs(20)).unwrap();
    let args = hold_args(&r, 300, 0);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let hold = r.start_hold(&args).unwrap();
    wait_synced(&r, master, backup);
    master_dies_and_most_survive(&r, master, backup, hold, "PROXY v2, master link cut");
    let client = std::net::IpAddr::from(r.topo.ip(Host::Client));
    let logged = ProxyBackend::logged_all(&backends);
    assert!(logged.len() >= 297, "{} connections logged", logged.len());
    assert!(
        logged
            .iter()
            .all(|p| p.client == client && p.dst == std::net::IpAddr::from(r.vip)),
        "{logged:?}"
    );
}

/// An IPv6-only pair: the VRRP instance is an IPv6 one (VRRPv3 adverts from link-local addresses, unsolicited
/// neighbour advertisements on takeover).
#[test]
fn an_ipv6_only_pair_fails_over_with_vrrpv3() {
    let (_one, r) = rig(|c| {
        c.ipv6 = true;
        c.ipv6_only = true;
    });
    let (master, backup) = r.wait_master_and_backup(Duration::from_secs(20)).unwrap();
    let vip6 = format!("[{}]", r.vip6.expect("IPv6 rig"));
    let args = hold_args_to(&vip6, 200, 10);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let hold = r.start_hold(&args).unwrap();
    wait_synced(&r, master, backup);
    master_dies_and_most_survive(&r, master, backup, hold, "IPv6 only, master link cut");
}

/// A rollover as yawol does it: a machine of the new revision joins, takes the VIP once it has the flows, the old
/// ones go. The old revision runs the previous release's agent when `LB_PREVIOUS_AGENT_BIN` names its binary
/// (`cargo xtask upgrade-check`: flow sync between two releases), otherwise this build's.
#[test]
fn planned_rollover_to_a_new_revision_breaks_nothing() {
    let previous = std::env::var_os("LB_PREVIOUS_AGENT_BIN").map(std::path::PathBuf::from);
    let (_one, mut r) = rig(|c| {
        c.replicas = 3;
        c.start_agents = false;
    });
    let [old1, old2, new] = r.topo.lbs()[..] else {
        panic!("three replicas")
    };
    let this_build = r.cfg.agent_bin.clone();
    if let Some(p) = previous {
        r.cfg.agent_bin = p;
    }
    println!("the old revision's agent: {}", r.cfg.agent_bin.display());
    r.start_agent(old1, 100).unwrap();
    r.start_agent(old2, 100).unwrap();
    r.cfg.agent_bin = this_build;
    let master = r.wait_master(Duration::from_secs(20)).unwrap();
    let standby = if master == old1 { old2 } else { old1 };
    let args = hold_args(&r, 200, 20);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let hold = r.start_hold(&args).unwrap();
    wait_synced(&r, master, standby);

    // The new revision's machine: higher priority, takes the VIP only once it has the flows.
    r.start_agent(new, 150).unwrap();
    let t0 = Instant::now();
    r.wait_master_where(Duration::from_secs(30), |m| m == new)
        .unwrap();
    println!(
        "new revision took the VIP {} ms after its agent was ready",
        t0.elapsed().as_millis()
    );
    std::thread::sleep(Duration::from_secs(2));
    // The old machines are deleted, one at a time.
    for old in [standby, master] {
        r.kill_all(old).unwrap();
        r.cut_link(old, true).unwrap();
    }
    std::thread::sleep(Duration::from_secs(2));
    let rep = hold.stop().unwrap();
    report("planned rollover", &rep);
    assert_eq!(rep.broken, 0, "{:?}", rep.connections);
    assert_consistent(&r, &[new]);
}

#[test]
fn a_restarted_peer_resyncs_and_can_take_over() {
    let (_one, mut r) = rig(|_| {});
    let (master, backup) = r.wait_master_and_backup(Duration::from_secs(20)).unwrap();
    r.stop_agent(backup, libc::SIGTERM).unwrap();
    // Connections opened while the backup is away only reach it through the resync on rejoin.
    let args = hold_args(&r, 150, 10);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let hold = r.start_hold(&args).unwrap();
    r.start_agent(backup, 100).unwrap();
    wait_synced(&r, master, backup);
    // The dump's records are applied before its end marker is counted (and the periodic refreshes carry the same
    // flows), so the counter may trail the flow table by a moment.
    wait_until(
        "the rejoining peer to count a full dump",
        Duration::from_secs(10),
        || {
            r.metric(backup, "lb_sync_resyncs_received_total", "")
                .unwrap()
                >= 1.0
        },
    );
    assert_consistent(&r, &[master, backup]);
    assert_eq!(
        r.master().unwrap(),
        Some(master),
        "a rejoining peer must not take the VIP"
    );
    kill_master(&r, master, backup);
    std::thread::sleep(Duration::from_secs(4));
    let rep = hold.stop().unwrap();
    report("takeover by a resynced peer", &rep);
    assert!(
        survival(&rep) >= 0.99,
        "{:?}",
        rep.connections.iter().take(5).collect::<Vec<_>>()
    );
}

/// A connection table by key (addresses, ports, protocol): translation (addresses, ports), close state and timeout.
type Table = std::collections::BTreeMap<(u32, u32, u16, u16, u8), (u32, u32, u16, u16, u8, u32)>;

/// The connection table as the sync must reproduce it on a peer: every entry (forward and reverse) with its
/// translation and close state; ids, ages, next-hop MACs and the synced mark are each replica's own.
fn comparable_table(r: &HaRig, host: Host) -> Table {
    let keep = lb_common::FLOW_F_FORWARD
        | lb_common::FLOW_F_REVERSE
        | lb_common::FLOW_F_FIN
        | lb_common::FLOW_F_RST;
    r.flow_table::<u32>(host)
        .unwrap()
        .into_iter()
        .map(|(k, f)| {
            (
                (k.src, k.dst, k.sport, k.dport, k.proto),
                (
                    f.new_src,
                    f.new_dst,
                    f.new_sport,
                    f.new_dport,
                    f.flags & keep,
                    f.timeout_s,
                ),
            )
        })
        .collect()
}

/// What a stream of short connections met.
#[derive(Default)]
struct Churn {
    ok: usize,
    batches: usize,
    failures: Vec<TcpFailure>,
}

/// Runs batches of short connections (`lb-testbed load`) until `stop`.
fn churn(r: &HaRig, stop: &std::sync::atomic::AtomicBool, per_batch: usize) -> Churn {
    let target = format!("{}:{TCP_PORT}", r.vip);
    let n = per_batch.to_string();
    let mut c = Churn::default();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let rep = r
            .load(&["--tcp", &target, "--connections", &n, "--concurrency", "32"])
            .unwrap();
        let t = rep.tcp.expect("a TCP report");
        c.ok += t.ok;
        c.batches += 1;
        c.failures.extend(t.failures);
    }
    c
}

#[test]
fn after_a_burst_of_short_connections_the_backup_holds_the_masters_table() {
    let (_one, r) = rig(|_| {});
    let (master, backup) = r.wait_master_and_backup(Duration::from_secs(20)).unwrap();
    // Some connections stay open through the burst, so that the tables are not trivially empty.
    let args = hold_args(&r, 100, 0);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let hold = r.start_hold(&args).unwrap();
    wait_synced(&r, master, backup);
    let target = format!("{}:{TCP_PORT}", r.vip);
    let rep = r
        .load(&[
            "--tcp",
            &target,
            "--connections",
            "20000",
            "--concurrency",
            "128",
        ])
        .unwrap();
    let t = rep.tcp.expect("a TCP report");
    println!(
        "burst: {} ok, {} failed, {:.0} connections/s",
        t.ok, t.failed, t.connections_per_s
    );
    assert_eq!(t.failed, 0, "{:?}", t.errors);
    // Within the sync lag the backup's table is the master's: the burst's connections closed on both.
    let t0 = Instant::now();
    let mut last = (0, 0, 0);
    let equal = (0..200).any(|_| {
        let (m, b) = (comparable_table(&r, master), comparable_table(&r, backup));
        if m == b {
            return true;
        }
        last = (
            m.len(),
            b.len(),
            b.iter().filter(|(k, v)| m.get(k) != Some(v)).count(),
        );
        std::thread::sleep(Duration::from_millis(50));
        false
    });
    assert!(
        equal,
        "after 10 s the backup's table still differs: master {} entries, backup {}, {} of the backup's not the master's",
        last.0, last.1, last.2
    );
    println!(
        "tables equal {} ms after the burst",
        t0.elapsed().as_millis()
    );
    let rep = hold.stop().unwrap();
    assert_eq!(rep.broken, 0);
    for h in [master, backup] {
        assert_eq!(
            r.metric(h, "lb_sync_conflicts_total", "").unwrap(),
            0.0,
            "conflicts on {h}"
        );
    }
}

#[test]
fn the_master_dies_during_churn_and_held_connections_survive() {
    let (_one, r) = rig(|_| {});
    let (master, backup) = r.wait_master_and_backup(Duration::from_secs(20)).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let stream = s.spawn(|| churn(&r, &stop, 500));
        // 500 held connections, opened while the stream runs.
        std::thread::sleep(Duration::from_secs(1));
        let args = hold_args(&r, 500, 0);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let hold = r.start_hold(&args).unwrap();
        wait_synced(&r, master, backup);
        let cut = kill_master(&r, master, backup);
        std::thread::sleep(Duration::from_secs(4));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let rep = hold.stop().unwrap();
        let c = stream.join().unwrap();
        report("master link cut during churn", &rep);
        let (cut_ms, before_ms) = (epoch_ms(cut.done), epoch_ms(cut.before));
        // Start times relative to the cut, by kind.
        let mut kinds = std::collections::BTreeMap::<&str, Vec<i64>>::new();
        for f in &c.failures {
            let at = f.started_ms as i64 - before_ms as i64;
            kinds.entry(f.kind.as_str()).or_default().push(at);
        }
        println!(
            "VRRP takeover after {} ms; short connections: {} ok, {} failed in {} batches; failures by kind, started \
             at ms from the cut: {kinds:?}",
            cut.takeover.as_millis(),
            c.ok,
            c.failures.len(),
            c.batches
        );
        assert!(
            survival(&rep) >= 0.99,
            "only {:.2} % survived: {:?}",
            survival(&rep) * 100.0,
            rep.connections.iter().take(5).collect::<Vec<_>>()
        );
        // A short connection in flight at the cut may have had its handshake or its sync record lost with the
        // master. Every other one succeeds: one that ended before the cut never met the failover, and one started
        // after it has its SYN retried until the backup holds the VIP.
        let other: Vec<&TcpFailure> = c
            .failures
            .iter()
            .filter(|f| f.started_ms > cut_ms || f.ended_ms < before_ms)
            .collect();
        assert!(
            other.is_empty(),
            "{} short connections not in flight at the cut failed (cut at {cut_ms} ms): {:?}; {}",
            other.len(),
            other.iter().take(10).collect::<Vec<_>>(),
            diagnosis(&r, master, backup)
        );
        assert!(c.ok > 1000, "the stream ran ({} connections)", c.ok);
    });
    assert_eq!(
        r.metric(backup, "lb_sync_conflicts_total", "").unwrap(),
        0.0
    );
}

/// For a failure message: each replica's VRRP state changes from its agent's log (a flap before the cut would show
/// here), and the new master's data-plane counters that are not zero.
fn diagnosis(r: &HaRig, old: Host, new: Host) -> String {
    let vrrp = |h: Host| {
        let log = r.agent_log(h);
        let changes: Vec<String> = log
            .lines()
            .filter(|l| l.contains("VRRP state changed"))
            .map(str::to_string)
            .collect();
        format!("{h}'s VRRP state changes: {changes:?}")
    };
    let text = r.http_get(new, "/metrics").unwrap_or_default();
    let packets: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("lb_dataplane_packets_total") && !l.ends_with(" 0"))
        .map(|l| l.trim_start_matches("lb_dataplane_packets_total"))
        .collect();
    format!(
        "{}; {}; packets at {new}: {}",
        vrrp(old),
        vrrp(new),
        packets.join(", ")
    )
}
