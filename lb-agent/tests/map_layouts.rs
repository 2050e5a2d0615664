//! An upgrade across a map layout change, with the real programs and maps (root): the previous layout's pinned
//! state is carried into the new layout's maps before the new programs run, and every connection, UDP flow and
//! handshake in progress continues with the same translation. The previous layout's pins are this layout's,
//! renamed to the previous layout's directory: the two differ only in the connection tables' LRU lists (per CPU
//! now), which the carry does not depend on. (The netns e2e does the same with the real agent and real traffic.)

mod common;
use common::*;

use aya::maps::{Map, MapData};
use lb_agent::dataplane::maps::FamilyMaps;
use lb_agent::dataplane::programmer::Programmer;
use lb_common::{map_names as names, stat, Flow, FlowAddr, FlowKey, LAYOUT_VERSION};
use std::path::PathBuf;

/// A bpffs directory of the test's own, removed when dropped.
struct PinBase(PathBuf);

impl PinBase {
    fn new(name: &str) -> Self {
        let dir = PathBuf::from(format!(
            "/sys/fs/bpf/lb-test-layouts-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        PinBase(dir)
    }

    fn layout(&self, v: u32) -> PathBuf {
        self.0.join(format!("v{v}"))
    }
}

impl Drop for PinBase {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a connection's packets became before the upgrade: its forwarded SYN (backend, SNAT port).
struct Held {
    sport: u16,
    syn: Parsed,
}

fn carried_over<F: Fam>(name: &str) {
    const CONNECTIONS: u16 = 1000;
    const UDP_FLOWS: u16 = 100;
    const HANDSHAKES: u16 = 20;
    let base = PinBase::new(name);
    let (conns, udp, handshakes, stats_before, new_flows_before) = {
        let mut h = Harness::<F>::open_in(Hook::Xdp, Some(&base.0));
        h.apply(&[h.web(&[1, 2, 3]), h.dns(&[1, 2, 3])]);
        let conns: Vec<Held> = (0..CONNECTIONS)
            .map(|i| {
                let sport = 20000 + i;
                let syn = open_connection(&mut h, sport);
                Held { sport, syn }
            })
            .collect();
        let udp: Vec<(u16, Parsed)> = (0..UDP_FLOWS)
            .map(|i| {
                let sport = 40000 + i;
                let (v, out) = h.run(&h.client_udp(sport, b"q"));
                assert_eq!(v, Verdict::Tx);
                (sport, parse(&out))
            })
            .collect();
        // Handshakes in progress: the SYN forwarded, the SYN-ACK not yet.
        let handshakes: Vec<Held> = (0..HANDSHAKES)
            .map(|i| {
                let sport = 50000 + i;
                let (v, out) = h.run(&h.client_tcp(sport, SYN, b""));
                assert_eq!(v, Verdict::Tx);
                Held {
                    sport,
                    syn: parse(&out),
                }
            })
            .collect();
        let stats = h.stat(stat::NEW_FLOWS);
        let new_flows = h.svc_stats(&h.web(&[]).id).new_flows;
        (conns, udp, handshakes, stats, new_flows)
        // The harness is dropped: its programs go, its maps stay pinned.
    };
    std::fs::rename(base.layout(LAYOUT_VERSION), base.layout(LAYOUT_VERSION - 1)).unwrap();

    // The new layout's data plane: new maps, the previous layout's state carried in before anything runs.
    let mut h = Harness::<F>::open_in(Hook::Xdp, Some(&base.0));
    assert_eq!(h.dp.maps.flows.entries().unwrap().len(), 0, "new maps");
    let carried =
        h.dp.carry_over(false)
            .unwrap()
            .expect("the previous layout is carried");
    let sizes = test_sizes();
    h.programmer = Programmer::adopt(
        &mut h.dp.maps,
        sizes.services,
        sizes.backends,
        sizes.maglev_slots,
    )
    .unwrap();
    assert_eq!(h.programmer.len(), 2, "both services adopted");
    // Between the copy and its second pass, the old program (still attached on a real upgrade) opened a connection
    // — the first connection's entry under another client port, written into the old table here — and the new one
    // closed a carried connection (its forward entry left the table). The second pass brings the former over, not
    // the latter back.
    let late = h.key(30000, 6, WEB_PORT);
    let first = h.key(conns[0].sport, 6, WEB_PORT);
    let closed = h.key(conns[1].sport, 6, WEB_PORT);
    {
        let name = if F::A::FAMILY == lb_common::FAMILY_V4 {
            names::FLOWS_V4
        } else {
            names::FLOWS_V6
        };
        let data = MapData::from_pin(base.layout(LAYOUT_VERSION - 1).join(name)).unwrap();
        let mut old: aya::maps::HashMap<_, FlowKey<F::A>, Flow<F::A>> =
            aya::maps::HashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
        let entry = h.flows().get(&first).unwrap().unwrap();
        old.insert(late, entry, 0).unwrap();
    }
    let closed_entry = h.flows().get(&closed).unwrap().unwrap();
    F::A::flows_mut(&mut h.dp.maps).remove(&closed).unwrap();
    h.dp.finish_carry_over(carried).unwrap();
    assert!(
        h.flows().get(&late).unwrap().is_some(),
        "the late connection carried"
    );
    assert!(
        h.flows().get(&closed).unwrap().is_none(),
        "the closed one not brought back"
    );
    let (v, out) = h.run(&h.client_tcp(30000, ACK, b"late"));
    assert_eq!(
        v,
        Verdict::Tx,
        "the late connection's segment (marked in the flow filter)"
    );
    assert_eq!(parse(&out).dst, conns[0].syn.dst);
    // The closed one back, as the rest of the test expects every connection.
    h.dp.maps.set_flow(&closed, &closed_entry).unwrap();
    assert_eq!(
        h.dp.remove_other_layouts().unwrap(),
        vec![base.layout(LAYOUT_VERSION - 1)],
        "the previous layout's maps are freed (no link was pinned there)"
    );
    assert_eq!(
        h.stat(stat::NEW_FLOWS),
        stats_before,
        "the counters continue"
    );
    assert_eq!(h.svc_stats(&h.web(&[]).id).new_flows, new_flows_before);

    let handshakes_before = h.stat(stat::NEW_HANDSHAKES);
    // Every connection continues as it was translated: the same backend, the same SNAT port, both ways.
    for c in &conns {
        let (v, out) = h.run(&h.client_tcp(c.sport, ACK, b"after the upgrade"));
        assert_eq!(v, Verdict::Tx, "connection from port {}", c.sport);
        let p = parse(&out);
        assert_eq!(
            (p.dst, p.dport, p.src, p.sport),
            (c.syn.dst, c.syn.dport, c.syn.src, c.syn.sport),
            "connection from port {}",
            c.sport
        );
        let (v, out) = h.run(&tcp(
            p.dst_mac, LB_MAC, p.dst, p.dport, p.src, p.sport, ACK, b"reply",
        ));
        assert_eq!(v, Verdict::Tx, "reply to port {}", c.sport);
        assert_eq!(parse(&out).dport, c.sport);
    }
    for (sport, before) in &udp {
        let (v, out) = h.run(&h.client_udp(*sport, b"q"));
        assert_eq!(v, Verdict::Tx);
        let p = parse(&out);
        assert_eq!(
            (p.dst, p.sport),
            (before.dst, before.sport),
            "UDP flow {sport}"
        );
    }
    // Handshakes in progress complete: the backend's SYN-ACK, then the client's ACK.
    for c in &handshakes {
        let s = &c.syn;
        let (v, _) = h.run(&tcp(
            s.dst_mac, LB_MAC, s.dst, s.dport, s.src, s.sport, SYN_ACK, b"",
        ));
        assert_eq!(v, Verdict::Tx, "SYN-ACK of port {}", c.sport);
        let (v, out) = h.run(&h.client_tcp(c.sport, ACK, b""));
        assert_eq!(v, Verdict::Tx, "handshake ACK of port {}", c.sport);
        assert_eq!(parse(&out).sport, s.sport);
    }
    assert_eq!(
        h.stat(stat::NEW_HANDSHAKES),
        handshakes_before,
        "no connection started anew"
    );
    assert_eq!(
        h.svc_stats(&h.web(&[]).id).new_flows,
        new_flows_before + HANDSHAKES as u64,
        "the handshakes in progress completed"
    );
    // New connections, and the adopted services re-applied as the agent does on start.
    h.apply(&[h.web(&[1, 2, 3]), h.dns(&[1, 2, 3])]);
    open_connection(&mut h, 60000);
}

/// Opens a TCP connection (SYN, SYN-ACK, ACK, each forwarded); returns the forwarded SYN.
fn open_connection<F: Fam>(h: &mut Harness<F>, sport: u16) -> Parsed {
    let (v, out) = h.run(&h.client_tcp(sport, SYN, b""));
    assert_eq!(v, Verdict::Tx, "SYN from port {sport}");
    let p = parse(&out);
    let (v, _) = h.run(&tcp(
        p.dst_mac, LB_MAC, p.dst, p.dport, p.src, p.sport, SYN_ACK, b"",
    ));
    assert_eq!(v, Verdict::Tx, "SYN-ACK to port {sport}");
    let (v, _) = h.run(&h.client_tcp(sport, ACK, b""));
    assert_eq!(v, Verdict::Tx, "ACK from port {sport}");
    p
}

#[test]
fn the_previous_layouts_state_is_carried_over_v4() {
    carried_over::<V4>("v4");
}

#[test]
fn the_previous_layouts_state_is_carried_over_v6() {
    carried_over::<V6>("v6");
}

/// A layout this build cannot carry, with no program attached through it, is only left behind (and freed).
#[test]
fn an_unattached_older_layout_is_not_carried_and_not_refused() {
    let base = PinBase::new("old");
    drop(Harness::<V4>::open_in(Hook::Xdp, Some(&base.0)));
    let old = base.layout(LAYOUT_VERSION - 2);
    std::fs::rename(base.layout(LAYOUT_VERSION), &old).unwrap();
    let mut h = Harness::<V4>::open_in(Hook::Xdp, Some(&base.0));
    assert!(h.dp.carry_over(false).unwrap().is_none());
    assert_eq!(h.dp.remove_other_layouts().unwrap(), vec![old]);
}
