//! Active-active end to end: three (or four) load-balancer replicas serve one VIP at once. Each replica's agent
//! announces the VIP over BGP through its own BIRD 2 to the upstream router — a namespace between the client
//! and the segment, where BIRD 2 merges the routes into one multipath route and the kernel spreads connections
//! over the replicas by a hash of their five-tuple. Each replica SNATs to its own address; flow sync runs between all of them, so a flow the routers
//! move to another replica is translated there as its owner does. Needs root, bird2, `lb-agent` and the eBPF
//! objects (`cargo xtask test` provides all of them).
//!
//! Without BGP (`--active-active` alone, as on OpenStack, where the controller programs the router from the
//! machines' eligibility), the test sets the router's multipath route itself from the agents' `lb_vip_eligible`.
//!
//! Times are printed, not asserted, except the one bound the design promises: a replica whose BIRD dies is
//! withdrawn within the BGP hold time.

use lb_testbed::ha::{hold_args, hold_summary, HaRig, HaRigConfig, BGP_HOLD_S};
use lb_testbed::hold::HoldReport;
use lb_testbed::rig::{TCP_PORT, UDP_PORT};
use lb_testbed::Host;
use std::time::{Duration, Instant};

/// One rig at a time (each runs three or four agents, four BIRDs and thousands of connections on 2 cores).
static ONE_RIG: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The lock and a started active-active rig with `replicas` namespaces (the first three started).
fn rig(replicas: usize) -> (std::sync::MutexGuard<'static, ()>, HaRig) {
    let lock = ONE_RIG
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    assert!(lb_testbed::is_root(), "active-active tests need root");
    let mut cfg = HaRigConfig::new().expect("artifacts built");
    cfg.replicas = replicas;
    cfg.active_active = true;
    cfg.start_agents = false;
    let mut r = HaRig::start(cfg).expect("active-active rig starts");
    let first: Vec<Host> = r.topo.lbs().into_iter().take(3).collect();
    for h in &first {
        r.start_agent(*h, 100).expect("agent starts");
    }
    r.wait_next_hops(&first, Duration::from_secs(30))
        .expect("the router routes the VIP to the three replicas");
    (lock, r)
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until each of `hosts` holds at least `flows` forward entries: every held flow, its own and its peers'.
fn wait_all_hold(r: &HaRig, hosts: &[Host], flows: usize) {
    wait_until(
        "every replica to hold every flow",
        Duration::from_secs(30),
        || {
            hosts
                .iter()
                .all(|h| r.forward_flows::<u32>(*h).unwrap().len() >= flows)
        },
    );
}

/// New flows (TCP connections and UDP flows) each replica has taken, once they add up to `total` (the agents
/// refresh their counters every second).
fn new_flows(r: &HaRig, hosts: &[Host], total: f64) -> Vec<f64> {
    let read = || -> Vec<f64> {
        hosts
            .iter()
            .map(|h| r.metric(*h, "lb_upstream_cx_total", "").unwrap())
            .collect()
    };
    let t = Instant::now();
    loop {
        let flows = read();
        if flows.iter().sum::<f64>() >= total || t.elapsed() > Duration::from_secs(5) {
            return flows;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `n` TCP connections and `n` UDP flows through the VIP, every one of them served; asserts each of `hosts` took
/// 33 % ± 10 % of the new flows (from their counters) and returns the counts.
fn assert_spread(r: &HaRig, hosts: &[Host], n: usize) -> Vec<f64> {
    let tcp = format!("{}:{TCP_PORT}", r.vip);
    let udp = format!("{}:{UDP_PORT}", r.vip);
    let n_text = n.to_string();
    let rep = r
        .load(&[
            "--tcp",
            &tcp,
            "--connections",
            &n_text,
            "--udp",
            &udp,
            "--udp-flows",
            &n_text,
            // Distinct source ports: a reused one would be the same flow.
            "--udp-first-port",
            "20000",
            "--concurrency",
            "64",
        ])
        .unwrap();
    let (t, u) = (rep.tcp.unwrap(), rep.udp.unwrap());
    assert_eq!(
        (t.ok, u.ok),
        (n, n),
        "TCP {:?}, UDP {:?}",
        t.errors,
        u.errors
    );
    let expected = (2 * n) as f64;
    let flows = new_flows(r, hosts, expected);
    let total: f64 = flows.iter().sum();
    assert_eq!(total, expected, "every flow counted once: {flows:?}");
    for (h, f) in hosts.iter().zip(&flows) {
        let share = f / total;
        println!("{h}: {f} new flows ({:.1} %)", share * 100.0);
        assert!(
            (share - 1.0 / hosts.len() as f64).abs() <= 0.10,
            "{h} took {:.1} % of the flows: {flows:?}",
            share * 100.0
        );
    }
    flows
}

fn report(what: &str, rep: &HoldReport) {
    println!("{what}: {}", hold_summary(rep));
}

/// Held connections and flows through the VIP: a message every 100 ms, `timeout` per round trip.
fn hold(r: &HaRig, tcp: usize, udp: usize, timeout: Duration) -> lb_testbed::rig::Hold {
    let args = hold_args(
        &r.vip.to_string(),
        tcp,
        udp,
        Duration::from_millis(100),
        timeout,
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    r.start_hold(&args).unwrap()
}

#[test]
fn three_replicas_share_new_flows_and_a_dead_bird_is_withdrawn_within_the_hold_time() {
    let (_lock, r) = rig(3);
    let lbs = r.topo.lbs();
    assert_spread(&r, &lbs, 3000);
    let tcp = format!("{}:{TCP_PORT}", r.vip);

    // The third replica's BIRD dies: its session closes, the router withdraws it at once (well within the hold
    // time, which bounds a replica that vanished without closing).
    let victim = lbs[2];
    let pid_file = r
        .dir()
        .join(format!("{}-bgp", victim.name()))
        .join("bird.pid");
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let killed = Instant::now();
    // SAFETY: kill(2) on the pid BIRD wrote for this replica.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    wait_until(
        "the router to withdraw the replica",
        Duration::from_secs(BGP_HOLD_S),
        || !r.next_hops().unwrap().contains(&victim),
    );
    println!(
        "withdrawn {} ms after BIRD was killed",
        killed.elapsed().as_millis()
    );
    let before = new_flows(&r, &lbs, 6000.0);
    let rep = r
        .load(&["--tcp", &tcp, "--connections", "300"])
        .unwrap()
        .tcp
        .unwrap();
    assert_eq!(rep.ok, 300, "{:?}", rep.errors);
    let after = new_flows(&r, &lbs, 6300.0);
    assert_eq!(after[2], before[2], "the withdrawn replica took new flows");

    // The agent restarts its BIRD; the replica is announced again and takes new flows.
    r.wait_next_hops(&lbs, Duration::from_secs(20)).unwrap();
    println!(
        "announced again {} ms after the kill",
        killed.elapsed().as_millis()
    );
    wait_until(
        "the agent to report the restart",
        Duration::from_secs(5),
        || {
            r.metric(victim, "lb_bird_restarts_total", "").unwrap() == 1.0
                && r.metric(victim, "lb_bgp_session_established", "").unwrap() == 1.0
        },
    );
    let rep = r
        .load(&["--tcp", &tcp, "--connections", "300"])
        .unwrap()
        .tcp
        .unwrap();
    assert_eq!(rep.ok, 300, "{:?}", rep.errors);
    assert!(new_flows(&r, &lbs, 6600.0)[2] > after[2]);
}

#[test]
fn held_connections_survive_a_replica_added_and_one_drained() {
    let (_lock, mut r) = rig(4);
    let lbs = r.topo.lbs();
    let hold = hold(&r, 1000, 200, Duration::from_millis(5000));
    // Every connection is in every replica's table before the routes change.
    wait_all_hold(&r, &lbs[..3], 1200);

    // A fourth replica: it syncs, then announces; the routers rehash part of the flows onto it.
    let packets = |r: &HaRig, h: Host| r.metric(h, "lb_client_packets_total", "").unwrap();
    r.start_agent(lbs[3], 100).unwrap();
    r.wait_next_hops(&lbs, Duration::from_secs(30)).unwrap();
    let at_add = packets(&r, lbs[3]);
    std::thread::sleep(Duration::from_secs(3));
    let moved_to_new = packets(&r, lbs[3]) - at_add;
    println!("client packets of held flows through the added replica in 3 s: {moved_to_new}");
    assert!(
        moved_to_new > 0.0,
        "no held flow moved to the added replica"
    );

    // The first replica drains: its agent stops, BIRD withdraws it; its pinned data plane goes on translating
    // the replies to its SNAT address, the others take its client packets with its translation.
    let drained = lbs[0];
    r.stop_agent(drained, libc::SIGTERM).unwrap();
    r.wait_next_hops(&lbs[1..], Duration::from_secs(10))
        .unwrap();
    let at_drain = packets(&r, lbs[1]) + packets(&r, lbs[2]) + packets(&r, lbs[3]);
    std::thread::sleep(Duration::from_secs(3));
    println!(
        "client packets through the remaining replicas in 3 s after the drain: {}",
        packets(&r, lbs[1]) + packets(&r, lbs[2]) + packets(&r, lbs[3]) - at_drain
    );

    let rep = hold.stop().unwrap();
    report("held across add and drain", &rep);
    assert_eq!(
        rep.broken,
        0,
        "{:?}",
        rep.connections.iter().take(5).collect::<Vec<_>>()
    );
    for h in &lbs[1..] {
        assert_eq!(
            r.metric(*h, "lb_sync_conflicts_total", "").unwrap(),
            0.0,
            "sync conflicts on {h}"
        );
    }
}

#[test]
fn a_crashed_replica_costs_only_the_connections_it_owned() {
    let (_lock, mut r) = rig(3);
    let lbs = r.topo.lbs();
    // Round trips may wait out the hold time and TCP's retransmission backoff behind it.
    let hold = hold(&r, 900, 150, Duration::from_millis(15000));
    wait_all_hold(&r, &lbs, 1050);
    // A connection belongs to the replica whose SNAT address it has: the backend answers there.
    let victim = lbs[1];
    let victim_ip = r.topo.ip(victim);
    let owned: std::collections::HashSet<(u8, u16)> = r
        .forward_flows::<u32>(lbs[0])
        .unwrap()
        .into_iter()
        .filter(|(k, _)| k.dst == u32::from_ne_bytes(r.vip.octets()))
        .filter(|(_, (src, ..))| *src == u32::from_ne_bytes(victim_ip.octets()))
        .map(|(k, _)| (k.proto, u16::from_be(k.sport)))
        .collect();
    println!("{} of 1050 held flows are the victim's", owned.len());

    // The machine dies: its link first (no FIN reaches the router, which waits out the hold time), then every
    // process.
    let crashed = Instant::now();
    r.cut_link(victim, true).unwrap();
    r.kill_all(victim).unwrap();
    wait_until(
        "the router to withdraw the dead replica",
        Duration::from_secs(BGP_HOLD_S + 2),
        || !r.next_hops().unwrap().contains(&victim),
    );
    println!(
        "withdrawn {} ms after the crash",
        crashed.elapsed().as_millis()
    );
    std::thread::sleep(Duration::from_secs(12));
    let rep = hold.stop().unwrap();
    report("held across a crash", &rep);
    let proto = |p: &str| if p == "tcp" { 6 } else { 17 };
    let others_broken: Vec<_> = rep
        .connections
        .iter()
        .filter(|c| c.broken && !owned.contains(&(proto(&c.proto), c.local_port)))
        .collect();
    assert!(
        others_broken.is_empty(),
        "{} connections of the surviving replicas broke: {:?}",
        others_broken.len(),
        others_broken.iter().take(5).collect::<Vec<_>>()
    );
    assert!(rep.broken <= owned.len());
}

#[test]
fn an_agent_killed_and_restarted_withdraws_and_returns_without_breaking_connections() {
    let (_lock, mut r) = rig(3);
    let lbs = r.topo.lbs();
    let hold = hold(&r, 600, 60, Duration::from_millis(5000));
    wait_all_hold(&r, &lbs, 660);
    // SIGKILL: BIRD gets its parent-death signal and closes its session; the pinned data plane stays and
    // translates the replies to this replica's SNAT address, the others take its client packets.
    let victim = lbs[1];
    let killed = Instant::now();
    r.stop_agent(victim, libc::SIGKILL).unwrap();
    let others = [lbs[0], lbs[2]];
    r.wait_next_hops(&others, Duration::from_secs(BGP_HOLD_S))
        .unwrap();
    println!(
        "withdrawn {} ms after the agent was killed",
        killed.elapsed().as_millis()
    );
    std::thread::sleep(Duration::from_secs(2));
    // The restarted agent takes its pinned data plane over, syncs, and announces again.
    r.start_agent(victim, 100).unwrap();
    r.wait_next_hops(&lbs, Duration::from_secs(30)).unwrap();
    println!(
        "announced again {} ms after the kill",
        killed.elapsed().as_millis()
    );
    std::thread::sleep(Duration::from_secs(3));
    let rep = hold.stop().unwrap();
    report("held across an agent's SIGKILL and restart", &rep);
    assert_eq!(
        rep.broken,
        0,
        "{:?}",
        rep.connections.iter().take(5).collect::<Vec<_>>()
    );
}

/// Without BGP (`--active-active` alone, how the OpenStack machines run): the test plays the controller, routing
/// the VIP to the replicas whose agent reports itself eligible (`lb_vip_eligible`, the `VIPEligible` condition in
/// Kubernetes mode). The replicas share the new flows; held connections survive one replica taken out of the route
/// and stopped, and brought back once eligible again.
#[test]
fn without_bgp_the_replicas_serve_where_the_routes_send_them() {
    let _lock = ONE_RIG
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    assert!(lb_testbed::is_root(), "active-active tests need root");
    let mut cfg = HaRigConfig::new().expect("artifacts built");
    cfg.replicas = 3;
    cfg.active_active = true;
    cfg.static_routes = true;
    // Starts the agents, waits until each is eligible and routes the VIP to all three.
    let mut r = HaRig::start(cfg).expect("active-active rig starts");
    let lbs = r.topo.lbs();
    assert_eq!(
        r.next_hops().unwrap(),
        lbs,
        "the route leads to the three replicas"
    );
    assert_spread(&r, &lbs, 1500);

    let hold = hold(&r, 600, 60, Duration::from_millis(5000));
    wait_all_hold(&r, &lbs, 660);
    // Drained as the controller drains a machine: out of the route first, then stopped; its pinned data plane
    // translates the replies to its SNAT address while the others take its client packets.
    let drained = lbs[0];
    r.set_next_hops(&lbs[1..]).unwrap();
    std::thread::sleep(Duration::from_secs(1));
    // What a drain waits for: the connections translated to its own address (its share of the held ones and of
    // the UDP flows above that have not idled out).
    let own = r.metric(drained, "lb_own_connections_active", "").unwrap();
    println!("{drained} routed out with {own} connections of its own");
    assert!(
        own > 0.0,
        "a replica routed out reports its own connections"
    );
    r.stop_agent(drained, libc::SIGTERM).unwrap();
    assert!(!r.eligible(drained), "a stopped agent is not eligible");
    std::thread::sleep(Duration::from_secs(2));
    // Back: routed to again only once its agent reports itself eligible (synced).
    r.start_agent(drained, 100).unwrap();
    r.wait_eligible(&[drained], Duration::from_secs(30))
        .unwrap();
    r.set_next_hops(&lbs).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let rep = hold.stop().unwrap();
    report(
        "held across a replica routed out, stopped, restarted and routed back",
        &rep,
    );
    assert_eq!(
        rep.broken,
        0,
        "{:?}",
        rep.connections.iter().take(5).collect::<Vec<_>>()
    );
    for h in &lbs {
        assert_eq!(
            r.metric(*h, "lb_sync_conflicts_total", "").unwrap(),
            0.0,
            "sync conflicts on {h}"
        );
    }
}
