//! The data plane's rules, proven with real packets through the real programs (XDP and TC entry points)
//! in the kernel via BPF_PROG_TEST_RUN. Needs root.

mod common;
use common::*;

both_families! {
    fn syn_creates_flow_and_is_full_natted(h) {
        h.apply(&[h.web(&[1, 2, 3])]);
        let (v, out) = h.run(&h.client_tcp(40000, SYN, b""));
        assert_eq!(v, Verdict::Tx);
        let p = parse(&out);
        assert_eq!(p.src, h.vip(), "SNAT to the VIP by default");
        assert_eq!(p.dport, WEB_NODE_PORT);
        assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
        let n = node_index(&p);
        assert_eq!(p.dst_mac, node_mac(n));
        assert_eq!(p.src_mac, LB_MAC);
        assert!(p.sport >= 1024);
    }
}

use lb_agent::dataplane::model::Protocol;
use lb_agent::dataplane::programmer::ip_to_addr;
use lb_common::{
    handshakes, stat, FlowAddr, FlowEvent, FlowKey, FLOW_F_END, FLOW_F_FIN, FLOW_F_FORWARD,
    FLOW_F_REVERSE, FLOW_F_RST, FLOW_F_SYN_ACK, TCP_CLOSING_TIMEOUT_S,
};
use std::net::{IpAddr, Ipv4Addr};

/// Sends a client's SYN and returns it as forwarded (the handshake is then in the transient table).
fn syn<F: Fam>(h: &mut Harness<F>, sport: u16) -> Parsed {
    let (v, out) = h.run(&h.client_tcp(sport, SYN, b""));
    assert_eq!(v, Verdict::Tx, "SYN from port {sport} forwarded");
    parse(&out)
}

/// Opens a TCP connection — the client's SYN, the backend's SYN-ACK, the client's ACK, each forwarded — and
/// returns the forwarded SYN.
fn open<F: Fam>(h: &mut Harness<F>, sport: u16) -> Parsed {
    let p = syn(h, sport);
    let (v, _) = h.run(&reply_tcp(&p, SYN_ACK, b""));
    assert_eq!(v, Verdict::Tx, "SYN-ACK to port {sport} forwarded");
    let (v, _) = h.run(&h.client_tcp(sport, ACK, b""));
    assert_eq!(v, Verdict::Tx, "handshake ACK from port {sport} forwarded");
    p
}

/// The reply of the backend to a forwarded packet `p`.
fn reply_tcp(p: &Parsed, flags: Flags, payload: &[u8]) -> Vec<u8> {
    tcp(
        p.dst_mac, LB_MAC, p.dst, p.dport, p.src, p.sport, flags, payload,
    )
}

/// Two client ports from `from` up whose keys share a slot of the handshake index.
fn colliding_ports<F: Fam>(h: &Harness<F>, from: u16) -> (u16, u16) {
    let mut seen = std::collections::HashMap::new();
    (from..=u16::MAX)
        .find_map(|port| {
            seen.insert(handshakes::slot(&h.key(port, 6, WEB_PORT)), port)
                .map(|other| (other, port))
        })
        .expect("thousands of ports in 2^20 slots collide")
}

/// Makes both entries of a flow look idle past their timeout. The timeout is shortened to 1 s because the
/// monotonic clock may not have run for a whole TCP timeout since boot; a zero timeout stays zero.
fn age<F: Fam>(h: &mut Harness<F>, key: &FlowKey<F::A>) {
    let f = h.flows().get(key).unwrap().expect("flow exists");
    for k in [*key, f.partner_key(key.proto)] {
        let mut e = h.flows().get(&k).unwrap().expect("entry exists");
        e.last_seen_ns = 1;
        e.timeout_s = e.timeout_s.min(1);
        h.dp.maps.set_flow(&k, &e).unwrap();
    }
}

both_families! {
    fn a_syn_waits_in_the_transient_table_until_the_handshake_completes(h) {
        h.apply(&[h.web(&[1, 2, 3])]);
        let p = syn(h, 40001);
        let key = h.key(40001, 6, WEB_PORT);
        assert_eq!(h.flows().get(&key).unwrap(), None, "no established entry for a SYN");
        // One entry per handshake, under its reverse key, holding both directions; the client's key finds it
        // through the handshake index.
        assert_eq!(h.transient().get(&key).unwrap(), None, "nothing under the client's key");
        let (rkey, r) = h.dp.maps.handshake(&key).unwrap().expect("the client's handshake");
        assert_eq!(h.transient().entries().unwrap(), vec![(rkey, r)]);
        let t = r.fwd;
        assert_eq!(t.flags & FLOW_F_FORWARD, FLOW_F_FORWARD);
        assert_eq!(t.new_dst, h.raw(p.dst));
        assert_eq!(u16::from_be(t.new_sport), p.sport);
        assert_eq!(t.timeout_s, 3600, "the service's idle timeout, for later");
        assert_eq!(rkey, t.partner_key(6));
        assert_eq!(r.flow.flags & FLOW_F_REVERSE, FLOW_F_REVERSE);
        // `lbctl flows` shows it as one connection, with both directions.
        let shown = lb_agent::report::inspect::flows(&h.dp.maps, &Default::default()).unwrap();
        assert_eq!(shown.len(), 1);
        assert_eq!((shown[0].state, shown[0].table), ("syn", "transient"));
        assert_eq!((shown[0].snat.port(), shown[0].backend.ip()), (p.sport, p.dst));
        assert_eq!(r.flow.new_dst, h.raw(h.client()));
        assert_eq!(r.flow.mac, CLIENT_MAC, "replies go back where the client's frames came from");
        let s = h.svc_stats(&h.web(&[]).id);
        assert_eq!((s.handshakes, s.new_flows, s.rx_packets), (1, 0, 1));
        assert_eq!((h.stat(stat::NEW_HANDSHAKES), h.stat(stat::NEW_FLOWS)), (1, 0));

        // The backend's SYN-ACK records what the client must acknowledge; the client's ACK completes it.
        assert_eq!(h.run(&reply_tcp(&p, SYN_ACK, b"")).0, Verdict::Tx);
        let r = h.transient().get(&rkey).unwrap().unwrap();
        assert_eq!(r.flow.flags & FLOW_F_SYN_ACK, FLOW_F_SYN_ACK);
        assert_eq!(u32::from_be(r.ack_be), SEQ + 1);
        let (v, out) = h.run(&h.client_tcp(40001, ACK, b""));
        assert_eq!(v, Verdict::Tx);
        assert_eq!(parse(&out).dst, p.dst);
        let f = h.flows().get(&key).unwrap().expect("established forward entry");
        assert_eq!((f.new_dst, f.new_sport, f.timeout_s), (t.new_dst, t.new_sport, 3600));
        let r = h.flows().get(&rkey).unwrap().expect("established reverse entry");
        assert_eq!(r.flags & (FLOW_F_REVERSE | FLOW_F_SYN_ACK), FLOW_F_REVERSE);
        assert_eq!(h.transient().entries().unwrap(), vec![], "the handshake's entry is gone");
        let s = h.svc_stats(&h.web(&[]).id);
        assert_eq!((s.handshakes, s.new_flows, s.rx_packets, s.tx_packets), (1, 1, 2, 1));
        assert_eq!(h.stat(stat::NEW_FLOWS), 1);
    }

    fn only_an_ack_of_the_backends_syn_ack_completes_a_handshake(h) {
        h.apply(&[h.web(&[1])]);
        let p = syn(h, 40005);
        let key = h.key(40005, 6, WEB_PORT);
        // Before the SYN-ACK, nothing can be acknowledged: a blind ACK (spoofed source) is dropped.
        assert_eq!(h.run(&h.client_tcp(40005, ACK, b"")).0, Verdict::Drop);
        h.run(&reply_tcp(&p, SYN_ACK, b""));
        // An ACK with another number, a segment without ACK: dropped, counted, nothing established.
        let wrong = tcp_seq(
            CLIENT_MAC, LB_MAC, (h.client(), 40005), (h.vip(), WEB_PORT), ACK, (SEQ, SEQ + 7), b"",
        );
        assert_eq!(h.run(&wrong).0, Verdict::Drop);
        let bare = tcp_seq(
            CLIENT_MAC, LB_MAC, (h.client(), 40005), (h.vip(), WEB_PORT), Flags::default(), (SEQ, 0), b"",
        );
        assert_eq!(h.run(&bare).0, Verdict::Drop);
        assert_eq!(h.flows().get(&key).unwrap(), None);
        assert_eq!(h.stat(stat::DROP_HANDSHAKE), 3);
        assert_eq!(h.svc_stats(&h.web(&[]).id).drop_handshake, 3);
        // The real ACK still completes it.
        assert_eq!(h.run(&h.client_tcp(40005, ACK, b"")).0, Verdict::Tx);
        assert!(h.flows().get(&key).unwrap().is_some());
    }

    fn a_syn_flood_never_touches_established_connections(h) {
        h.apply(&[h.web(&[1, 2, 3])]);
        let held = open(h, 40006);
        // Three times the transient table's capacity (1024 entries in tests) of SYNs from spoofed sources.
        for i in 0..1536u32 {
            let frame = tcp(CLIENT_MAC, LB_MAC, F::source(i), 1024 + (i % 60000) as u16, h.vip(), WEB_PORT, SYN, b"");
            assert_eq!(h.run(&frame).0, Verdict::Tx);
        }
        assert_eq!(h.flows().entries().unwrap().len(), 2, "only the established connection's two entries");
        assert!(h.transient().entries().unwrap().len() <= 1024);
        let (v, out) = h.run(&h.client_tcp(40006, ACK, b"still here"));
        assert_eq!(v, Verdict::Tx);
        assert_eq!(parse(&out).dst, held.dst);
        let s = h.svc_stats(&h.web(&[]).id);
        assert_eq!((s.handshakes, s.new_flows), (1537, 1));
    }

    fn a_stale_handshake_no_longer_counts(h) {
        h.apply(&[h.web(&[1])]);
        let p = syn(h, 40007);
        h.run(&reply_tcp(&p, SYN_ACK, b""));
        let key = h.key(40007, 6, WEB_PORT);
        let (rkey, mut t) = h.dp.maps.handshake(&key).unwrap().unwrap();
        t.flow.last_seen_ns = 1;
        h.transient_mut().insert(&rkey, &t).unwrap();
        // Past the handshake timeout the ACK finds nothing (and releases the entry); a SYN starts over.
        assert_eq!(h.run(&h.client_tcp(40007, ACK, b"")).0, Verdict::Drop);
        assert_eq!(h.stat(stat::DROP_NO_FLOW), 1);
        assert_eq!(h.transient().entries().unwrap(), vec![]);
        syn(h, 40007);
        let (_, t) = h.dp.maps.handshake(&key).unwrap().unwrap();
        assert!(t.flow.last_seen_ns > 1);
        assert_eq!(h.svc_stats(&h.web(&[]).id).handshakes, 2);
        // A stale handshake that the ACK never touched is replaced by the client's next SYN on its port.
        let (rkey, mut t) = h.dp.maps.handshake(&key).unwrap().unwrap();
        t.flow.last_seen_ns = 1;
        h.transient_mut().insert(&rkey, &t).unwrap();
        syn(h, 40007);
        assert_eq!(h.svc_stats(&h.web(&[]).id).handshakes, 3);
        assert_eq!(h.transient().entries().unwrap().len(), 1, "one entry: replaced, not a second port");
    }

    fn a_retransmitted_syn_finds_its_handshake(h) {
        h.apply(&[h.web(&[1, 2, 3])]);
        let a = syn(h, 40091);
        let b = syn(h, 40091);
        assert_eq!((a.dst, a.sport), (b.dst, b.sport), "the same backend and SNAT port");
        assert_eq!(h.svc_stats(&h.web(&[]).id).handshakes, 1);
        assert_eq!(h.transient().entries().unwrap().len(), 1);
        h.run(&reply_tcp(&b, SYN_ACK, b""));
        assert_eq!(h.run(&h.client_tcp(40091, ACK, b"")).0, Verdict::Tx);
        assert!(h.flows().get(&h.key(40091, 6, WEB_PORT)).unwrap().is_some());
    }

    fn a_handshake_index_slot_taken_by_another_client_is_repaired_by_the_syn_ack(h) {
        let (p1, p2) = colliding_ports(h, 1024);
        h.apply(&[h.web(&[1])]);
        let a = syn(h, p1);
        let b = syn(h, p2);
        // Each SYN-ACK points the slot back at its own handshake: both complete.
        h.run(&reply_tcp(&a, SYN_ACK, b""));
        assert_eq!(h.run(&h.client_tcp(p1, ACK, b"")).0, Verdict::Tx);
        h.run(&reply_tcp(&b, SYN_ACK, b""));
        assert_eq!(h.run(&h.client_tcp(p2, ACK, b"")).0, Verdict::Tx);
        assert_eq!(h.flows().entries().unwrap().len(), 4);
        // A slot taken between the SYN-ACK and the ACK: the ACK finds nothing and is dropped, counted; the
        // backend's retransmitted SYN-ACK repairs it.
        let (p3, p4) = colliding_ports(h, p2 + 1);
        let c = syn(h, p3);
        h.run(&reply_tcp(&c, SYN_ACK, b""));
        syn(h, p4);
        assert_eq!(h.run(&h.client_tcp(p3, ACK, b"")).0, Verdict::Drop);
        assert_eq!(h.stat(stat::DROP_NO_FLOW), 1);
        h.run(&reply_tcp(&c, SYN_ACK, b""));
        assert_eq!(h.run(&h.client_tcp(p3, ACK, b"")).0, Verdict::Tx);
    }

    fn a_client_reset_during_the_handshake_reaches_the_backend(h) {
        h.apply(&[h.web(&[1])]);
        let p = syn(h, 40008);
        let (v, out) = h.run(&h.client_tcp(40008, RST, b""));
        assert_eq!(v, Verdict::Tx);
        assert_eq!((parse(&out).dst, parse(&out).sport), (p.dst, p.sport));
        let key = h.key(40008, 6, WEB_PORT);
        let (_, t) = h.dp.maps.handshake(&key).unwrap().unwrap();
        assert_eq!(t.flow.flags & FLOW_F_RST, FLOW_F_RST);
        assert_eq!(h.flows().get(&key).unwrap(), None);
        // The backend's answer to it still reaches the client.
        assert_eq!(h.run(&reply_tcp(&p, RST, b"")).0, Verdict::Tx);
        // A new SYN on the port is a new handshake, in the same entry.
        syn(h, 40008);
        assert_eq!(h.svc_stats(&h.web(&[]).id).handshakes, 2);
        let (_, t) = h.dp.maps.handshake(&key).unwrap().unwrap();
        assert_eq!(t.flow.flags & FLOW_F_RST, 0);
        assert_eq!(h.transient().entries().unwrap().len(), 1);
    }

    fn a_closed_connection_leaves_the_flow_table_and_its_last_ack_passes(h) {
        h.apply(&[h.web(&[1])]);
        let p = open(h, 40009);
        let key = h.key(40009, 6, WEB_PORT);
        assert_eq!(h.run(&h.client_tcp(40009, FIN_ACK, b"")).0, Verdict::Tx);
        assert!(h.flows().get(&key).unwrap().is_some(), "half closed: the backend may still send");
        assert_eq!(h.run(&reply_tcp(&p, FIN_ACK, b"")).0, Verdict::Tx);
        assert_eq!(h.flows().entries().unwrap(), vec![], "closed both ways: out of the flow table");
        let t = h.transient().get(&key).unwrap().expect("moved to the transient table");
        assert_eq!((t.flow.flags & FLOW_F_FIN, t.flow.timeout_s), (FLOW_F_FIN, TCP_CLOSING_TIMEOUT_S));
        let (v, out) = h.run(&h.client_tcp(40009, ACK, b""));
        assert_eq!(v, Verdict::Tx, "the last ACK");
        assert_eq!(parse(&out).dst, p.dst);
        assert_eq!(h.svc_stats(&h.web(&[]).id).closed_flows, 2);
    }

    fn a_fin_on_the_completing_ack_is_recorded(h) {
        h.apply(&[h.web(&[1])]);
        let p = syn(h, 40012);
        h.run(&reply_tcp(&p, SYN_ACK, b""));
        assert_eq!(h.run(&h.client_tcp(40012, FIN_ACK, b"GET / HTTP/1.0\r\n\r\n")).0, Verdict::Tx);
        let f = h.flows().get(&h.key(40012, 6, WEB_PORT)).unwrap().expect("established");
        assert_eq!((f.flags & FLOW_F_FIN, f.timeout_s), (FLOW_F_FIN, TCP_CLOSING_TIMEOUT_S));
    }

    fn a_syn_from_the_backend_side_follows_only_an_existing_flow(h) {
        // No simultaneous open through a full NAT: a backend's SYN towards a SNAT port is forwarded only as
        // part of a flow that exists; without one it is not a service packet and goes to the kernel.
        h.apply(&[h.web(&[1])]);
        let p = open(h, 40010);
        let (v, out) = h.run(&reply_tcp(&p, SYN, b""));
        assert_eq!(v, Verdict::Tx);
        assert_eq!(parse(&out).dst, h.client());
        let stray = tcp(node_mac(1), LB_MAC, h.node(1), WEB_NODE_PORT, h.vip(), 50123, SYN, b"");
        assert_eq!(h.run(&stray).0, Verdict::Pass);
    }

    fn a_connection_a_peer_established_is_followed(h) {
        // State sync writes both entries straight into the flow table; no handshake is seen here.
        h.apply(&[h.web(&[1])]);
        let p = open(h, 40011);
        let key = h.key(40011, 6, WEB_PORT);
        let (f, r) = {
            let f = h.flows().get(&key).unwrap().unwrap();
            (f, h.flows().get(&f.partner_key(6)).unwrap().unwrap())
        };
        let mut fresh = Harness::<F>::open(h.hook);
        fresh.apply(&[h.web(&[1])]);
        fresh.dp.maps.set_flow(&key, &f).unwrap();
        fresh.dp.maps.set_flow(&f.partner_key(6), &r).unwrap();
        let (v, out) = fresh.run(&h.client_tcp(40011, ACK, b"after failover"));
        assert_eq!(v, Verdict::Tx);
        assert_eq!((parse(&out).dst, parse(&out).sport), (p.dst, p.sport));
        assert_eq!(fresh.run(&reply_tcp(&p, ACK, b"reply")).0, Verdict::Tx);
    }

    fn established_segment_follows_its_flow(h) {
        h.apply(&[h.web(&[1, 2, 3])]);
        let syn = open(h, 40002);
        for i in 0..5 {
            let (v, out) = h.run(&h.client_tcp(40002, ACK, format!("segment {i}").as_bytes()));
            assert_eq!(v, Verdict::Tx);
            let p = parse(&out);
            assert_eq!((p.dst, p.sport, p.dport), (syn.dst, syn.sport, syn.dport));
            assert!(p.ip_csum_ok && p.l4_csum_ok);
            assert_eq!(p.payload, format!("segment {i}").as_bytes());
        }
        assert_eq!(h.svc_stats(&h.web(&[]).id).new_flows, 1);
    }

    fn reply_is_translated_back_to_the_client(h) {
        h.apply(&[h.web(&[1, 2, 3])]);
        let syn = syn(h, 40003);
        let (v, out) = h.run(&reply_tcp(&syn, SYN_ACK, b""));
        assert_eq!(v, Verdict::Tx);
        let p = parse(&out);
        assert_eq!((p.src, p.sport), (h.vip(), WEB_PORT));
        assert_eq!((p.dst, p.dport), (h.client(), 40003));
        assert_eq!(p.dst_mac, CLIENT_MAC);
        assert_eq!(p.src_mac, LB_MAC);
        assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
        let s = h.svc_stats(&h.web(&[]).id);
        assert_eq!(s.tx_packets, 1);
        assert!(s.tx_bytes >= 40);
    }

    fn udp_is_full_natted_both_ways(h) {
        h.apply(&[h.dns(&[1, 2, 3])]);
        let (v, out) = h.run(&h.client_udp(5353, b"query"));
        assert_eq!(v, Verdict::Tx);
        let p = parse(&out);
        assert_eq!((p.src, p.dport, p.proto), (h.vip(), DNS_NODE_PORT, 17));
        assert!(p.ip_csum_ok && p.l4_csum_ok && !p.udp_csum_zero);
        assert_eq!(p.payload, b"query");
        let f = h.flows().get(&h.key(5353, 17, DNS_PORT)).unwrap().unwrap();
        assert_eq!(f.timeout_s, 60, "UDP default idle timeout");
        let back = udp(p.dst_mac, LB_MAC, p.dst, p.dport, p.src, p.sport, b"answer");
        let (v, out) = h.run(&back);
        assert_eq!(v, Verdict::Tx);
        let r = parse(&out);
        assert_eq!((r.src, r.sport, r.dst, r.dport), (h.vip(), DNS_PORT, h.client(), 5353));
        assert!(r.ip_csum_ok && r.l4_csum_ok);
        assert_eq!(r.payload, b"answer");
    }

    fn zero_length_payloads_are_forwarded(h) {
        h.apply(&[h.dns(&[1]), h.web(&[1])]);
        let (v, out) = h.run(&h.client_udp(5355, b""));
        assert_eq!(v, Verdict::Tx);
        assert!(parse(&out).l4_csum_ok);
        open(h, 40004);
        let (v, out) = h.run(&h.client_tcp(40004, ACK, b""));
        assert_eq!(v, Verdict::Tx);
        assert!(parse(&out).l4_csum_ok);
    }

    fn tcp_without_flow_that_is_not_a_syn_is_dropped(h) {
        h.apply(&[h.web(&[1, 2])]);
        for (name, flags) in [("ack", ACK), ("syn-ack", SYN_ACK), ("fin", FIN_ACK), ("rst", RST)] {
            let (v, _) = h.run(&h.client_tcp(40010, flags, b"data"));
            assert_eq!(v, Verdict::Drop, "{name}");
        }
        assert_eq!(h.stat(stat::DROP_NO_FLOW), 4);
        assert_eq!(h.svc_stats(&h.web(&[]).id).drop_no_flow, 4);
        assert!(h.flows().entries().unwrap().is_empty(), "no state created");
    }

    fn maglev_spreads_new_flows_and_backend_changes_keep_established_ones(h) {
        h.apply(&[h.web(&[1, 2, 3])]);
        let mut per_node = [0u32; 5];
        let mut chosen = Vec::new();
        for sport in 41000..41600u16 {
            let p = open(h, sport);
            let n = node_index(&p);
            per_node[n as usize] += 1;
            chosen.push((sport, n, p.sport));
        }
        for n in 1..=3 {
            assert!((150..=250).contains(&per_node[n]), "node {n}: {per_node:?}");
        }
        // A fourth backend joins and node 2 leaves: existing flows stay where they are.
        h.apply(&[h.web(&[1, 3, 4])]);
        for (sport, n, snat_port) in &chosen {
            let (v, out) = h.run(&h.client_tcp(*sport, ACK, b"x"));
            assert_eq!(v, Verdict::Tx);
            let p = parse(&out);
            assert_eq!((node_index(&p), p.sport), (*n, *snat_port), "flow from {sport} moved");
        }
        // New flows only go to the new set.
        let mut seen = [0u32; 5];
        for sport in 42000..42300u16 {
            seen[node_index(&open(h, sport)) as usize] += 1;
        }
        assert_eq!(seen[2], 0, "removed backend gets no new flow: {seen:?}");
        assert!(seen[4] > 50, "new backend takes its share: {seen:?}");
    }

    fn no_healthy_backend_drops_new_flows(h) {
        h.apply(&[h.web(&[])]);
        assert_eq!(h.run(&h.client_tcp(40030, SYN, b"")).0, Verdict::Drop);
        assert_eq!(h.svc_stats(&h.web(&[]).id).drop_no_backend, 1);
        assert_eq!(h.stat(stat::DROP_NO_BACKEND), 1);
    }

    fn unknown_next_hop_goes_to_the_kernel_and_is_counted(h) {
        h.apply(&[h.web(&[1])]);
        h.dp.maps.nexthops.remove(&lb_agent::dataplane::programmer::ip_to_addr(h.node(1))).unwrap();
        let f = h.client_tcp(40040, SYN, b"");
        let (v, out) = h.run(&f);
        assert_eq!(v, Verdict::Pass);
        assert_eq!(out, f, "passed unchanged");
        assert_eq!(h.stat(stat::PASS_NO_NEXTHOP), 1);
        assert_eq!(h.svc_stats(&h.web(&[]).id).pass_no_nexthop, 1);
        assert!(h.flows().entries().unwrap().is_empty(), "no half-made flow");
    }

    fn snat_ports_avoid_service_ports_and_existing_flows(h) {
        h.dp.maps.config.set(lb_common::CONFIG_INDEX, &lb_common::Config { snat_port_min: 40000, snat_port_max: 40003, hash_seed: 7, ..Default::default() }).unwrap();
        // A service on port 40001 of the VIP: replies to that port would look like new connections.
        h.apply(&[h.web(&[1]), h.spec(Protocol::Tcp, 40001, 31000, &[1])]);
        let mut ports = Vec::new();
        for sport in 43000..43003u16 {
            ports.push(open(h, sport).sport);
        }
        ports.sort();
        assert_eq!(ports, vec![40000, 40002, 40003]);
        // The range is used up for this backend: the next SYN is dropped and counted.
        assert_eq!(h.run(&h.client_tcp(43003, SYN, b"")).0, Verdict::Drop);
        assert_eq!(h.stat(stat::DROP_SNAT_EXHAUSTED), 1);
        assert_eq!(h.svc_stats(&h.web(&[]).id).drop_snat_exhausted, 1);
    }

    fn a_snat_port_the_flow_filter_marks_is_skipped_until_the_gc_rebuilds_it(h) {
        h.dp.maps.config.set(lb_common::CONFIG_INDEX, &lb_common::Config { snat_port_min: 40000, snat_port_max: 40003, hash_seed: 7, ..Default::default() }).unwrap();
        h.apply(&[h.web(&[1])]);
        let p = open(h, 43100);
        let key = h.key(43100, 6, WEB_PORT);
        let rkey = h.flows().get(&key).unwrap().unwrap().partner_key(6);
        let filter = &h.dp.maps.flow_filter;
        assert!(filter.may_hold(&key) && filter.may_hold(&rkey), "a completed handshake marks both keys");
        // Marks that no connection holds (a connection gone since, or another key's bit) on all free ports but
        // one: the next SYN takes that one without looking the others up, the one after finds none.
        let rkey_of = |port: u16| FlowKey { dport: port.to_be(), ..rkey };
        let free: Vec<u16> = (40000..=40003).filter(|&x| x != p.sport).collect();
        for &port in &free[1..] {
            filter.mark(&rkey_of(port));
        }
        assert_eq!(syn(h, 43101).sport, free[0]);
        assert_eq!(h.run(&h.client_tcp(43102, SYN, b"")).0, Verdict::Drop);
        assert_eq!(h.stat(stat::DROP_SNAT_EXHAUSTED), 1);
        // The GC's walk rebuilds the filter from what the table holds: the stale marks are gone, the
        // connection's stay.
        let report = lb_agent::dataplane::gc::collect(&mut h.dp.maps, lb_agent::dataplane::gc::now_ns(), None).unwrap();
        assert!(matches!(report.flow_filter_bits, Some(1..=2)), "{:?}", report.flow_filter_bits);
        let filter = &h.dp.maps.flow_filter;
        assert!(filter.may_hold(&key) && filter.may_hold(&rkey));
        assert!(free[1..].iter().all(|&port| !filter.may_hold(&rkey_of(port))));
        let p2 = syn(h, 43102);
        assert!(free[1..].contains(&p2.sport), "{}", p2.sport);
    }

    fn a_connection_made_while_the_filter_is_rebuilt_stays_marked(h) {
        h.apply(&[h.web(&[1])]);
        // The rebuild clears its generation, then a handshake completes that the walk does not see.
        h.dp.maps.flow_filter.begin_rebuild();
        open(h, 43200);
        h.dp.maps.flow_filter.finish_rebuild([]);
        let key = h.key(43200, 6, WEB_PORT);
        let rkey = h.flows().get(&key).unwrap().unwrap().partner_key(6);
        let filter = &h.dp.maps.flow_filter;
        assert!(filter.may_hold(&key) && filter.may_hold(&rkey), "marked in both generations by the data plane");
        // A SYN on it is looked up, so it still follows the connection (a stray SYN, not a new handshake).
        h.run(&h.client_tcp(43200, SYN, b""));
        assert_eq!(h.transient().get(&key).unwrap(), None);
    }

    fn configured_snat_address_is_used(h) {
        let mut w = h.web(&[1]);
        let snat = F::snat();
        w.snat = Some(snat);
        h.apply(&[w]);
        let p = open(h, 40050);
        assert_eq!(p.src, snat);
        let (v, out) = h.run(&reply_tcp(&p, SYN_ACK, b""));
        assert_eq!(v, Verdict::Tx);
        let r = parse(&out);
        assert_eq!((r.src, r.sport, r.dst), (h.vip(), WEB_PORT, h.client()));
    }

    fn idle_udp_flow_expires_and_a_new_one_is_made(h) {
        h.apply(&[h.dns(&[1, 2, 3])]);
        h.run(&h.client_udp(5370, b"a"));
        let key = h.key(5370, 17, DNS_PORT);
        let before = h.flows().get(&key).unwrap().unwrap();
        age(h, &key);
        let (v, _) = h.run(&h.client_udp(5370, b"b"));
        assert_eq!(v, Verdict::Tx);
        assert_eq!(h.svc_stats(&h.dns(&[]).id).new_flows, 2, "expired flow replaced");
        let after = h.flows().get(&key).unwrap().unwrap();
        assert!(after.last_seen_ns > 1);
        assert!(h.flows().get(&before.partner_key(17)).unwrap().is_none() || before.new_sport == after.new_sport,
            "the old reverse entry is released");
    }

    fn idle_tcp_flow_expires(h) {
        h.apply(&[h.web(&[1])]);
        open(h, 40060);
        let key = h.key(40060, 6, WEB_PORT);
        age(h, &key);
        assert_eq!(h.run(&h.client_tcp(40060, ACK, b"late")).0, Verdict::Drop, "expired TCP flow is gone");
        assert_eq!(h.stat(stat::DROP_NO_FLOW), 1);
    }

    fn a_flow_alive_in_one_direction_does_not_expire(h) {
        h.apply(&[h.dns(&[1])]);
        let p = {
            let (_, out) = h.run(&h.client_udp(5371, b"a"));
            parse(&out)
        };
        let key = h.key(5371, 17, DNS_PORT);
        let mut f = h.flows().get(&key).unwrap().unwrap();
        f.last_seen_ns = 1;
        h.dp.maps.set_flow(&key, &f).unwrap();
        // Only the forward entry is stale; the backend keeps streaming, so the flow stays.
        let (v, out) = h.run(&h.client_udp(5371, b"b"));
        assert_eq!(v, Verdict::Tx);
        assert_eq!(parse(&out).sport, p.sport);
        assert_eq!(h.svc_stats(&h.dns(&[]).id).new_flows, 1);
    }

    fn zero_idle_timeout_never_expires(h) {
        let mut d = h.dns(&[1]);
        d.idle_timeout = secs(0);
        h.apply(&[d]);
        h.run(&h.client_udp(5372, b"a"));
        let key = h.key(5372, 17, DNS_PORT);
        assert_eq!(h.flows().get(&key).unwrap().unwrap().timeout_s, 0);
        age(h, &key);
        h.run(&h.client_udp(5372, b"b"));
        assert_eq!(h.svc_stats(&h.dns(&[]).id).new_flows, 1);
    }

    fn fin_and_rst_shorten_the_lifetime(h) {
        h.apply(&[h.web(&[1])]);
        let p = open(h, 40070);
        let key = h.key(40070, 6, WEB_PORT);
        h.run(&h.client_tcp(40070, FIN_ACK, b""));
        let f = h.flows().get(&key).unwrap().unwrap();
        assert_eq!(f.flags & FLOW_F_FIN, FLOW_F_FIN);
        assert_eq!(f.timeout_s, TCP_CLOSING_TIMEOUT_S);
        let r = h.flows().get(&f.partner_key(6)).unwrap().unwrap();
        assert_eq!(r.timeout_s, 3600, "the other direction may still send (half close)");
        // A reset from the backend ends both directions (and moves them to the transient table).
        h.run(&reply_tcp(&p, RST, b""));
        let r = h.transient().get(&f.partner_key(6)).unwrap().unwrap().flow;
        assert_eq!((r.flags & FLOW_F_RST, r.timeout_s), (FLOW_F_RST, TCP_CLOSING_TIMEOUT_S));
        let f = h.transient().get(&key).unwrap().unwrap().flow;
        assert_eq!(f.flags & FLOW_F_RST, FLOW_F_RST);
        assert_eq!(h.svc_stats(&h.web(&[]).id).closed_flows, 2);
    }

    fn syn_on_a_closed_flow_opens_a_new_one(h) {
        h.apply(&[h.web(&[1])]);
        let first = open(h, 40080);
        let key = h.key(40080, 6, WEB_PORT);
        let old = h.flows().get(&key).unwrap().unwrap();
        h.run(&h.client_tcp(40080, RST, b""));
        // A retransmitted SYN on a live flow reuses it; after the reset a SYN is a new connection.
        let second = open(h, 40080);
        assert_eq!(h.svc_stats(&h.web(&[]).id).new_flows, 2);
        let new = h.flows().get(&key).unwrap().unwrap();
        assert_eq!(new.flags & FLOW_F_RST, 0);
        if new.new_sport != old.new_sport {
            assert!(h.flows().get(&old.partner_key(6)).unwrap().is_none(), "old reverse entry released");
        }
        assert_eq!(first.dst, second.dst);
    }

    fn retransmitted_syn_reuses_the_flow(h) {
        h.apply(&[h.web(&[1, 2, 3])]);
        let a = open(h, 40090);
        let b = open(h, 40090);
        assert_eq!((a.dst, a.sport), (b.dst, b.sport));
        assert_eq!(h.svc_stats(&h.web(&[]).id).new_flows, 1);
        assert_eq!(h.flows().entries().unwrap().len(), 2);
    }
}

/// Marks the connection from client port `sport` as ended by the agent (its backend failed or left) and, with
/// `silent`, makes its backend's last segment old (past `END_SILENCE_NS`).
fn end<F: Fam>(h: &mut Harness<F>, sport: u16, silent: bool) -> FlowKey<F::A> {
    let key = h.key(sport, 6, WEB_PORT);
    let mut f = h.flows().get(&key).unwrap().expect("connection exists");
    f.flags |= FLOW_F_END;
    h.dp.maps.set_flow(&key, &f).unwrap();
    if silent {
        let rkey = f.partner_key(6);
        let mut r = h.flows().get(&rkey).unwrap().expect("reverse entry exists");
        r.last_seen_ns = 1;
        h.dp.maps.set_flow(&rkey, &r).unwrap();
    }
    key
}

both_families! {
    fn the_clients_next_segment_of_an_ended_connection_is_answered_with_a_reset(h) {
        h.apply(&[h.web(&[1])]);
        open(h, 40300);
        let key = end(h, 40300, true);
        let (v, out) = h.run(&h.client_tcp(40300, ACK, b"into a dead backend"));
        assert_eq!(v, Verdict::Tx, "back to the client");
        let r = parse(&out);
        assert_eq!((r.src, r.sport), (h.vip(), WEB_PORT));
        assert_eq!((r.dst, r.dport), (h.client(), 40300));
        assert_eq!((r.dst_mac, r.src_mac), (CLIENT_MAC, LB_MAC));
        assert_eq!(r.tcp_flags, 0x04, "RST alone");
        assert_eq!(
            (r.seq, r.ack),
            (SEQ + 1, 0),
            "the reset's sequence number is what the client acknowledged: exactly what it accepts"
        );
        assert!(r.ip_csum_ok && r.l4_csum_ok, "{r:?}");
        // Closed as by a client's reset: both entries left for the transient table.
        assert!(h.flows().get(&key).unwrap().is_none());
        let t = h.transient().get(&key).unwrap().unwrap().flow;
        assert_eq!(t.flags & FLOW_F_RST, FLOW_F_RST);
        assert_eq!(h.stat(stat::RESET_BACKEND_GONE), 1);
        let s = h.svc_stats(&h.web(&[]).id);
        assert_eq!(
            (s.reset_backend_gone, s.rx_packets),
            (1, 2),
            "only the handshake's SYN and ACK went on"
        );
    }

    fn a_reset_from_the_client_of_an_ended_connection_closes_it_unanswered(h) {
        h.apply(&[h.web(&[1])]);
        open(h, 40301);
        let key = end(h, 40301, true);
        assert_eq!(h.run(&h.client_tcp(40301, RST, b"")).0, Verdict::Drop);
        assert!(h.flows().get(&key).unwrap().is_none());
        assert_eq!(h.stat(stat::RESET_BACKEND_GONE), 0);
    }

    fn a_syn_on_an_ended_connection_opens_a_new_one(h) {
        h.apply(&[h.web(&[1])]);
        open(h, 40302);
        let key = end(h, 40302, true);
        open(h, 40302);
        assert_eq!(h.flows().get(&key).unwrap().unwrap().flags & FLOW_F_END, 0);
        assert_eq!(h.svc_stats(&h.web(&[]).id).new_flows, 2);
        assert_eq!(h.stat(stat::RESET_BACKEND_GONE), 0);
    }

    fn an_ended_connection_goes_on_while_its_backend_answers(h) {
        h.apply(&[h.web(&[1])]);
        let syn = open(h, 40304);
        let key = end(h, 40304, false);
        // The backend's SYN-ACK just passed: it is not silent (a failing health check under load, a backend
        // removed while it serves), so the client's segment goes on.
        let (v, out) = h.run(&h.client_tcp(40304, ACK, b"still served"));
        assert_eq!(v, Verdict::Tx);
        let p = parse(&out);
        assert_eq!((p.dst, p.dport, p.payload.as_slice()), (syn.dst, syn.dport, &b"still served"[..]));
        assert_eq!(h.flows().get(&key).unwrap().unwrap().flags & FLOW_F_END, FLOW_F_END);
        assert_eq!(h.stat(stat::RESET_BACKEND_GONE), 0);
    }

    fn the_backends_segments_of_an_ended_connection_still_reach_the_client(h) {
        h.apply(&[h.web(&[1])]);
        let p = open(h, 40303);
        end(h, 40303, true);
        let (v, out) = h.run(&reply_tcp(&p, ACK, b"last words"));
        assert_eq!(v, Verdict::Tx);
        assert_eq!(parse(&out).payload, b"last words");
    }
}

both_hooks! {
    fn udp_zero_checksum_stays_zero(h) {
        h.apply(&[dns(&[1])]);
        let mut frame = client_udp(5354, b"no checksum");
        frame[40] = 0;
        frame[41] = 0;
        let (v, out) = h.run(&frame);
        assert_eq!(v, Verdict::Tx);
        let p = parse(&out);
        assert!(p.udp_csum_zero, "a zero UDP checksum means none and must stay zero");
        assert!(p.ip_csum_ok);
    }

    fn everything_else_goes_to_the_kernel_untouched(h) {
        h.apply(&[web(&[1]), dns(&[1])]);
        let mut arp = vec![0xff; 6];
        arp.extend_from_slice(&CLIENT_MAC);
        arp.extend_from_slice(&[0x08, 0x06]);
        arp.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
        arp.extend_from_slice(&[0u8; 20]);
        let ssh = tcp(CLIENT_MAC, LB_MAC, CLIENT, 50000, VIP, 22, SYN, b"");
        let other_udp = udp(CLIENT_MAC, LB_MAC, CLIENT, 50000, VIP, 5000, b"x");
        let to_other_ip = tcp(CLIENT_MAC, LB_MAC, CLIENT, 50000, Ipv4Addr::new(203, 0, 113, 9), 80, SYN, b"");
        let echo = {
            let mut f = icmp_error(CLIENT_MAC, LB_MAC, CLIENT, VIP, 8, 0, [0, 1, 0, 1], b"ping");
            f[34] = 8;
            f
        };
        let mut vrrp = udp(CLIENT_MAC, LB_MAC, CLIENT, 1, Ipv4Addr::new(224, 0, 0, 18), 2, b"vrrp");
        vrrp[23] = 112;
        fix_ip_checksum(&mut vrrp);
        let mut unknown = udp(CLIENT_MAC, LB_MAC, CLIENT, 1, VIP, 53, b"proto 253");
        unknown[23] = 253;
        fix_ip_checksum(&mut unknown);
        for (name, f) in [
            ("arp", &arp),
            ("ssh to the VM", &ssh),
            ("other UDP port", &other_udp),
            ("other address", &to_other_ip),
            ("icmp echo", &echo),
            ("vrrp", &vrrp),
            ("unknown protocol", &unknown),
        ] {
            let (v, out) = h.run(f);
            assert_eq!(v, Verdict::Pass, "{name}");
            assert_eq!(&out, f, "{name} must be untouched");
        }
        assert_eq!(h.stat(stat::PASS_NOT_IP), 1);
        assert_eq!(h.stat(stat::PASS_NOT_SERVICE), 6);
        assert_eq!(h.stat(stat::NEW_FLOWS), 0);
    }

    fn source_ranges_allow_and_deny_tcp_and_udp(h) {
        let mut w = web(&[1]);
        w.source_ranges = vec!["198.51.100.0/28".parse().unwrap(), "192.0.2.1/32".parse().unwrap()];
        let mut d = dns(&[1]);
        d.source_ranges = vec!["10.99.0.0/16".parse().unwrap()];
        h.apply(&[w.clone(), d.clone()]);
        // 198.51.100.10 is inside /28: allowed for TCP, outside the UDP service's range.
        assert_eq!(h.run(&client_tcp(40020, SYN, b"")).0, Verdict::Tx);
        assert_eq!(h.run(&client_udp(5360, b"q")).0, Verdict::Drop);
        let outsider = Ipv4Addr::new(198, 51, 100, 200);
        let f = tcp(CLIENT_MAC, LB_MAC, outsider, 40021, VIP, WEB_PORT, SYN, b"");
        assert_eq!(h.run(&f).0, Verdict::Drop);
        let inside_udp = udp(CLIENT_MAC, LB_MAC, Ipv4Addr::new(10, 99, 3, 4), 5361, VIP, DNS_PORT, b"q");
        assert_eq!(h.run(&inside_udp).0, Verdict::Tx);
        assert_eq!(h.svc_stats(&w.id).drop_source_range, 1);
        assert_eq!(h.svc_stats(&d.id).drop_source_range, 1);
        assert_eq!(h.stat(stat::DROP_SOURCE_RANGE), 2);
        // Empty list = everyone; removing the ranges opens the service.
        w.source_ranges.clear();
        h.apply(&[w, d]);
        assert_eq!(h.run(&f).0, Verdict::Tx);
        assert!(h.dp.maps.source_ranges.entries().iter().all(|(_, _, len)| *len == 16), "stale ranges removed");
    }

    fn icmp_frag_needed_from_a_node_reaches_the_client_translated(h) {
        h.apply(&[web(&[1])]);
        let syn = open(h, 40100);
        // The node (or a router before it) cannot forward our 1500-byte segment: it quotes what we sent.
        let quoted_frame = tcp(LB_MAC, syn.dst_mac, syn.src, syn.sport, syn.dst, syn.dport, ACK, &[0u8; 64]);
        let quoted = &quoted_frame[14..];
        let f = icmp_error(syn.dst_mac, LB_MAC, syn.dst4(), syn.src4(), 3, 4, [0, 0, 0x05, 0x00], quoted);
        let (v, out) = h.run(&f);
        assert_eq!(v, Verdict::Tx);
        assert_eq!(&out[0..6], &CLIENT_MAC);
        let outer = &out[14..34];
        assert_eq!(internet_checksum(&[outer]), 0, "outer IP checksum");
        assert_eq!(&outer[12..16], &VIP.octets());
        assert_eq!(&outer[16..20], &CLIENT.octets());
        let icmp = &out[34..];
        assert_eq!(internet_checksum(&[icmp]), 0, "ICMP checksum");
        assert_eq!((icmp[0], icmp[1], &icmp[6..8]), (3, 4, &[0x05, 0x00][..]), "type, code and MTU kept");
        let inner = &icmp[8..];
        assert_eq!(internet_checksum(&[&inner[..20]]), 0, "inner IP checksum");
        assert_eq!(&inner[12..16], &CLIENT.octets(), "inner source is the client");
        assert_eq!(&inner[16..20], &VIP.octets(), "inner destination is the VIP");
        assert_eq!(u16::from_be_bytes([inner[20], inner[21]]), 40100);
        assert_eq!(u16::from_be_bytes([inner[22], inner[23]]), WEB_PORT);
        let pseudo = pseudo_header(CLIENT, VIP, 6, inner.len() - 20);
        assert_eq!(internet_checksum(&[&pseudo, &inner[20..]]), 0, "inner TCP checksum");
        assert_eq!(h.stat(stat::ICMP_TRANSLATED), 1);
        assert_eq!(h.svc_stats(&web(&[]).id).icmp_translated, 1);
    }

    fn icmp_error_from_the_client_side_reaches_the_backend(h) {
        h.apply(&[dns(&[1])]);
        let (_, out) = h.run(&client_udp(5380, b"q"));
        let fwd = parse(&out);
        // What the client saw from us (VIP:53 → client:5380), quoted by the client's router.
        let quoted_frame = udp(LB_MAC, CLIENT_MAC, VIP, DNS_PORT, CLIENT, 5380, b"answer");
        let router = Ipv4Addr::new(198, 51, 100, 1);
        let f = icmp_error(CLIENT_MAC, LB_MAC, router, VIP, 3, 3, [0; 4], &quoted_frame[14..]);
        let (v, out) = h.run(&f);
        assert_eq!(v, Verdict::Tx);
        assert_eq!(&out[0..6], &node_mac(1));
        assert_eq!(&out[26..30], &fwd.src4().octets(), "from the SNAT address");
        assert_eq!(&out[30..34], &node(1).octets());
        assert_eq!(internet_checksum(&[&out[34..]]), 0, "ICMP checksum");
        let inner = &out[42..];
        assert_eq!(&inner[12..16], &node(1).octets(), "as the node sent it");
        assert_eq!(u16::from_be_bytes([inner[20], inner[21]]), DNS_NODE_PORT);
        assert_eq!(u16::from_be_bytes([inner[22], inner[23]]), fwd.sport);
        let pseudo = pseudo_header(node(1), fwd.src, 17, inner.len() - 20);
        assert_eq!(internet_checksum(&[&pseudo, &inner[20..]]), 0, "inner UDP checksum");
    }

    fn icmp_errors_about_other_traffic_pass(h) {
        h.apply(&[web(&[1])]);
        let quoted = tcp(LB_MAC, CLIENT_MAC, VIP, 22, CLIENT, 50000, ACK, b"");
        let f = icmp_error(CLIENT_MAC, LB_MAC, CLIENT, VIP, 3, 4, [0, 0, 5, 0], &quoted[14..]);
        let (v, out) = h.run(&f);
        assert_eq!((v, &out), (Verdict::Pass, &f));
        assert_eq!(h.stat(stat::PASS_ICMP_UNKNOWN), 1);
    }

    fn an_icmp_quote_ends_with_the_ip_packet_not_the_frame(h) {
        // Found by the differential fuzzer: bytes after the IP total length (Ethernet padding) were read as part
        // of the quote and rewritten, and the ICMP checksum was adjusted for bytes it does not cover.
        h.apply(&[web(&[1])]);
        let syn = open(h, 40120);
        let quoted_frame = tcp(LB_MAC, syn.dst_mac, syn.src, syn.sport, syn.dst, syn.dport, ACK, b"");
        let quoted = &quoted_frame[14..];
        // The error quotes the inner IP header and ports; the rest of the segment (its checksum too) is padding.
        let mut f = icmp_error(syn.dst_mac, LB_MAC, syn.dst4(), syn.src4(), 3, 4, [0, 0, 5, 0], &quoted[..24]);
        let end = f.len();
        f.extend_from_slice(&quoted[24..]);
        let (v, out) = h.run(&f);
        assert_eq!(v, Verdict::Tx);
        assert_eq!(internet_checksum(&[&out[34..end]]), 0, "ICMP checksum over the message");
        assert_eq!(&out[end..], &quoted[24..], "padding untouched");
        assert_eq!(&out[end - 24 + 12..end - 24 + 16], &CLIENT.octets(), "quote translated");
        // With the ports in the padding, the error is about nothing known.
        let mut g = icmp_error(syn.dst_mac, LB_MAC, syn.dst4(), syn.src4(), 3, 4, [0, 0, 5, 0], &quoted[..20]);
        g.extend_from_slice(&quoted[20..]);
        let (v, out) = h.run(&g);
        assert_eq!((v, &out), (Verdict::Pass, &g));
        assert_eq!(h.stat(stat::PASS_ICMP_UNKNOWN), 1);
        // An ICMP header cut off by the total length is malformed, like a cut TCP or UDP header.
        let mut cut = g.clone();
        cut[16..18].copy_from_slice(&21u16.to_be_bytes());
        assert_eq!(h.run(&cut).0, Verdict::Drop);
        assert_eq!(h.stat(stat::DROP_MALFORMED), 1);
    }

    fn ip_options_are_forwarded_untouched(h) {
        h.apply(&[web(&[1])]);
        let plain = client_tcp(40110, SYN, b"");
        // Insert a 4-byte option (NOP NOP NOP EOL) after the IPv4 header.
        let mut f = plain[..34].to_vec();
        f.extend_from_slice(&[1, 1, 1, 0]);
        f.extend_from_slice(&plain[34..]);
        f[14] = 0x46;
        let tot = u16::from_be_bytes([f[16], f[17]]) + 4;
        f[16..18].copy_from_slice(&tot.to_be_bytes());
        fix_ip_checksum(&mut f);
        let (v, out) = h.run(&f);
        assert_eq!(v, Verdict::Tx);
        assert_eq!(&out[34..38], &[1, 1, 1, 0], "options untouched");
        let p = parse(&out);
        assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
        assert_eq!(p.dport, WEB_NODE_PORT);
        assert_eq!(h.stat(stat::IP_OPTIONS), 1);
    }

    fn fragments_to_a_vip_are_dropped_others_pass(h) {
        h.apply(&[dns(&[1])]);
        let mut first = client_udp(5390, &[7u8; 64]);
        first[20] = 0x20; // more fragments
        fix_ip_checksum(&mut first);
        let mut later = client_udp(5390, &[7u8; 64]);
        later[20] = 0x00;
        later[21] = 0x10; // offset 128
        fix_ip_checksum(&mut later);
        assert_eq!(h.run(&first).0, Verdict::Drop);
        assert_eq!(h.run(&later).0, Verdict::Drop);
        let mut elsewhere = udp(CLIENT_MAC, LB_MAC, CLIENT, 5390, Ipv4Addr::new(203, 0, 113, 50), 53, b"x");
        elsewhere[20] = 0x20;
        fix_ip_checksum(&mut elsewhere);
        assert_eq!(h.run(&elsewhere).0, Verdict::Pass);
        assert_eq!(h.stat(stat::DROP_FRAGMENT), 2);
        assert_eq!(h.stat(stat::PASS_FRAGMENT), 1);
    }

    fn malformed_packets_are_dropped_and_counted(h) {
        h.apply(&[web(&[1]), dns(&[1])]);
        let good = client_tcp(40120, SYN, b"");
        let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
        cases.push(("truncated IPv4 header", good[..30].to_vec()));
        let mut bad_ihl = good.clone();
        bad_ihl[14] = 0x44;
        cases.push(("IHL 4", bad_ihl));
        let mut bad_version = good.clone();
        bad_version[14] = 0x65;
        cases.push(("version 6 in an IPv4 frame", bad_version));
        let mut long = good.clone();
        long[16..18].copy_from_slice(&1500u16.to_be_bytes());
        cases.push(("total length beyond the frame", long));
        let mut short = good.clone();
        short[16..18].copy_from_slice(&10u16.to_be_bytes());
        cases.push(("total length below the header", short));
        cases.push(("truncated TCP header", good[..44].to_vec()));
        let mut doff = good.clone();
        doff[46] = 0x40;
        cases.push(("TCP data offset 4", doff));
        let udp_ok = client_udp(5391, b"x");
        cases.push(("truncated UDP header", udp_ok[..38].to_vec()));
        cases.push(("Ethernet header only", good[..14].to_vec()));
        let dropped = h.run_malformed(&cases);
        assert_eq!(h.stat(stat::DROP_MALFORMED), dropped);
        assert!(h.dp.maps.flows.entries().unwrap().is_empty());
        // Ethernet padding after the IP packet is fine.
        let mut padded = client_udp(5392, b"x");
        padded.extend_from_slice(&[0u8; 20]);
        assert_eq!(h.run(&padded).0, Verdict::Tx);
    }

    fn runts_shorter_than_an_ethernet_header_never_reach_the_program(h) {
        // BPF_PROG_TEST_RUN (like every NIC) refuses frames shorter than an Ethernet header, so the
        // program's own bounds check for them cannot be exercised; the kernel's refusal is what we assert.
        assert!(h.try_run(&[0x42]).is_err(), "a one-byte packet is refused by the kernel");
        assert!(h.try_run(&[0u8; 13]).is_err());
    }
}

/// Frames the check applies to: addressed to `dst_mac`, otherwise the client's SYN.
fn client_syn_to<F: Fam>(h: &Harness<F>, dst_mac: [u8; 6], sport: u16) -> Vec<u8> {
    tcp(
        CLIENT_MAC,
        dst_mac,
        h.client(),
        sport,
        h.vip(),
        WEB_PORT,
        SYN,
        b"",
    )
}

fn set_flags<F: Fam>(h: &mut Harness<F>, flags: u32) {
    h.dp.maps
        .config
        .set(
            lb_common::CONFIG_INDEX,
            &lb_common::Config {
                flags,
                local_mac: LB_MAC,
                ..Default::default()
            },
        )
        .unwrap();
}

both_families! {
    fn frames_for_another_hosts_mac_go_to_the_kernel_when_checked(h) {
        h.apply(&[h.web(&[1, 2])]);
        let other = [0x02, 0, 0, 0, 0, 0x99];
        // Unchecked (single machine): the MAC does not matter.
        assert_eq!(h.run(&client_syn_to(h, other, 41000)).0, Verdict::Tx);
        set_flags(h, lb_common::CFG_F_CHECK_DST_MAC);
        assert_eq!(h.run(&client_syn_to(h, other, 41001)).0, Verdict::Pass, "another replica's frame");
        assert_eq!(h.stat(stat::PASS_OTHER_HOST), 1);
        assert!(h.flows().get(&h.key(41001, 6, WEB_PORT)).unwrap().is_none(), "no flow for it");
        assert_eq!(h.run(&client_syn_to(h, LB_MAC, 41002)).0, Verdict::Tx, "ours");
    }
}

both_families! {
    fn new_and_closing_flows_are_published_for_sync(h) {
        h.apply(&[h.web(&[1, 2])]);
        let mut events = h.dp.maps.take_flow_events::<F::A>().unwrap();
        open(h, 42000);
        assert!(events.next().is_none(), "nothing published while sync is off");
        set_flags(h, lb_common::CFG_F_SYNC_EVENTS);
        let p = open(h, 42001);
        let key = h.key(42001, 6, WEB_PORT);
        let ev = read_event::<F::A>(&mut events).expect("a new-flow event");
        assert_eq!(ev.kind, lb_common::FLOW_EV_NEW);
        assert_eq!(ev.key, key);
        let fwd = h.flows().get(&key).unwrap().unwrap();
        assert_eq!(ev.fwd, fwd);
        assert_eq!(ev.rev, h.flows().get(&fwd.partner_key(6)).unwrap().unwrap());
        // Established traffic publishes nothing; the first FIN of a direction does.
        h.run(&h.client_tcp(42001, ACK, b"x"));
        assert!(read_event::<F::A>(&mut events).is_none());
        h.run(&reply_tcp(&p, FIN_ACK, b""));
        let ev = read_event::<F::A>(&mut events).expect("a close event");
        assert_eq!(ev.kind, lb_common::FLOW_EV_CLOSE);
        assert_eq!(ev.key, fwd.partner_key(6), "the entry that saw the FIN");
        assert_eq!(ev.fwd.flags & FLOW_F_FIN, FLOW_F_FIN);
        h.run(&reply_tcp(&p, FIN_ACK, b""));
        assert!(read_event::<F::A>(&mut events).is_none(), "only the first FIN");
    }
}

both_families! {
    fn traffic_clears_the_synced_mark(h) {
        h.apply(&[h.web(&[1, 2])]);
        open(h, 43000);
        let key = h.key(43000, 6, WEB_PORT);
        let mut f = h.flows().get(&key).unwrap().unwrap();
        f.flags |= lb_common::FLOW_F_SYNCED;
        f.last_seen_ns = 1;
        f.timeout_s = 0;
        h.dp.maps.set_flow(&key, &f).unwrap();
        assert_eq!(h.run(&h.client_tcp(43000, ACK, b"x")).0, Verdict::Tx);
        let f = h.flows().get(&key).unwrap().unwrap();
        assert_eq!(f.flags & lb_common::FLOW_F_SYNCED, 0, "used here now: refreshed by this replica");
        assert!(f.last_seen_ns > 1);
    }
}

/// Turns the SYN rate guard on: `rate` handshakes per second with a burst of `burst` (per CPU; a test runs on
/// one CPU and takes well under a second, so nothing refills).
fn set_syn_rate<F: Fam>(h: &mut Harness<F>, rate: u32, burst: u32) {
    h.dp.maps
        .config
        .set(
            lb_common::CONFIG_INDEX,
            &lb_common::Config::default().with_syn_rate(rate, burst),
        )
        .unwrap();
}

/// A SYN to the web service from `src`.
fn syn_from<F: Fam>(h: &Harness<F>, src: IpAddr, sport: u16) -> Vec<u8> {
    tcp(CLIENT_MAC, LB_MAC, src, sport, h.vip(), WEB_PORT, SYN, b"")
}

both_families! {
    fn over_the_syn_rate_only_sources_that_completed_a_handshake_get_in(h) {
        h.apply(&[h.web(&[1, 2])]);
        let spoofed = F::source(1);
        // Three handshakes at once fit the burst: the client completes one, which makes it trusted.
        set_syn_rate(h, 1, 2);
        open(h, 44000);
        assert_eq!(h.run(&syn_from(h, spoofed, 1000)).0, Verdict::Tx);
        assert_eq!(h.run(&syn_from(h, spoofed, 1001)).0, Verdict::Tx);
        // Over the rate: the unknown source is dropped before it costs a handshake entry, and counted.
        assert_eq!(h.run(&syn_from(h, spoofed, 1002)).0, Verdict::Drop);
        let key = FlowKey { src: h.raw(spoofed), ..h.key(1002, 6, WEB_PORT) };
        assert_eq!(h.dp.maps.handshake(&key).unwrap(), None, "no handshake entry for a dropped SYN");
        assert_eq!(h.stat(stat::DROP_SYN_RATE), 1);
        assert_eq!(h.svc_stats(&h.web(&[]).id).drop_syn_rate, 1);
        // The client that completed a handshake still connects, and keeps its established connection.
        let p = open(h, 44001);
        assert_eq!(h.stat(stat::SYN_TRUSTED), 1);
        assert_eq!(h.run(&reply_tcp(&p, ACK, b"still here")).0, Verdict::Tx);
        // Over the rate the guard comes before everything else: even a retransmitted SYN of an admitted
        // handshake from an unknown source is dropped (its client retries; the handshake entry stays).
        assert_eq!(h.run(&syn_from(h, spoofed, 1000)).0, Verdict::Drop);
        assert_eq!(h.stat(stat::DROP_SYN_RATE), 2);
        let key = FlowKey { src: h.raw(spoofed), ..h.key(1000, 6, WEB_PORT) };
        assert!(h.dp.maps.handshake(&key).unwrap().is_some());
        // Without the guard every SYN opens a handshake again.
        set_syn_rate(h, 0, 0);
        assert_eq!(h.run(&syn_from(h, spoofed, 1003)).0, Verdict::Tx);
    }
}

fn read_event<A: FlowAddr>(
    rb: &mut aya::maps::RingBuf<aya::maps::MapData>,
) -> Option<FlowEvent<A>> {
    let item = rb.next()?;
    assert_eq!(item.len(), std::mem::size_of::<FlowEvent<A>>());
    // SAFETY: the data plane writes whole `FlowEvent<A>`s to the family's ring; read_unaligned copes with any
    // alignment.
    Some(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<FlowEvent<A>>()) })
}

mod state_sync {
    //! Two independent data planes: flows created on one and applied to the other through
    //! `BpfFlowStore` are translated identically by both.
    use super::*;
    use lb_agent::ha::flowstore::BpfFlowStore;
    use lb_agent::ha::sync::{ApplyOutcome, FlowRecord};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    /// Applies a peer's record through the store's one-record entry point.
    pub(super) fn apply<F: Fam>(
        store: &mut BpfFlowStore,
        ev: &FlowEvent<F::A>,
        age_ms: u32,
    ) -> ApplyOutcome {
        let rec = FlowRecord {
            event: F::sync_event(*ev),
            age_ms,
        };
        let mut outcomes = store.apply_batch(&[rec]).unwrap();
        assert_eq!(outcomes.len(), 1);
        outcomes.remove(0)
    }

    /// Replica A publishing its flow events (returned), replica B with a store to apply them to; A SNATs to
    /// `snat` (first, last port) when given.
    pub(super) fn pair<F: Fam>(
        snat: Option<(u16, u16)>,
    ) -> (
        Harness<F>,
        Harness<F>,
        BpfFlowStore,
        aya::maps::RingBuf<aya::maps::MapData>,
    ) {
        let mut a = Harness::<F>::open(Hook::Xdp);
        let mut b = Harness::<F>::open(Hook::Xdp);
        // Different service-id history on the two replicas: ids must be translated.
        a.apply(&[a.web(&[1, 2, 3]), a.dns(&[1, 2])]);
        b.apply(&[b.dns(&[1, 2])]);
        b.apply(&[b.dns(&[1, 2]), b.web(&[1, 2, 3])]);
        let store = BpfFlowStore::open(&b.dp.maps, Arc::new(AtomicBool::new(false))).unwrap();
        let mut cfg = lb_common::Config {
            flags: lb_common::CFG_F_SYNC_EVENTS,
            ..Default::default()
        };
        if let Some((min, max)) = snat {
            (cfg.snat_port_min, cfg.snat_port_max) = (min, max);
        }
        a.dp.maps.config.set(lb_common::CONFIG_INDEX, &cfg).unwrap();
        let events = a.dp.maps.take_flow_events::<F::A>().unwrap();
        (a, b, store, events)
    }

    per_family! {
        fn a_synced_flow_is_translated_like_on_its_origin() {
            let (mut a, mut b, mut store, mut events) = pair::<F>(None);
            let p = open(&mut a, 44000);
            let ev = read_event::<F::A>(&mut events).unwrap();
            assert_eq!(b.dp.maps.trusted_sources.keys().unwrap(), vec![]);
            assert_eq!(apply::<F>(&mut store, &ev, 250), ApplyOutcome::Applied);
            assert_eq!(
                apply::<F>(&mut store, &ev, 250),
                ApplyOutcome::Unchanged,
                "idempotent"
            );
            // The peer's completed handshake vouches for its client here too (the SYN rate guard lets it through).
            let client = lb_agent::dataplane::programmer::ip_to_addr(F::client());
            assert_eq!(b.dp.maps.trusted_sources.keys().unwrap(), vec![client]);
            // Both entries are marked in B's flow filter (B's data plane skips the lookup of unmarked TCP keys).
            let filter = &b.dp.maps.flow_filter;
            assert!(filter.may_hold(&ev.key) && filter.may_hold(&ev.fwd.partner_key(6)));

            // Client data and the backend's reply through B: exactly A's rewrite, no SYN needed.
            let data = a.client_tcp(44000, ACK, b"hello");
            let (va, oa) = a.run(&data);
            let (vb, ob) = b.run(&data);
            assert_eq!((va, vb), (Verdict::Tx, Verdict::Tx));
            assert_eq!(parse(&oa), parse(&ob));
            let reply = reply_tcp(&p, ACK, b"world");
            let (va, oa) = a.run(&reply);
            let (vb, ob) = b.run(&reply);
            assert_eq!((va, vb), (Verdict::Tx, Verdict::Tx));
            assert_eq!(parse(&oa), parse(&ob));
            // B counts the flow under its own id for the service.
            let key = b.key(44000, 6, WEB_PORT);
            let fb = b.flows().get(&key).unwrap().unwrap();
            let svc_b =
                b.dp.maps
                    .services
                    .entries()
                    .unwrap()
                    .into_iter()
                    .find(|(k, _)| k.port_be == WEB_PORT.to_be())
                    .unwrap()
                    .1;
            assert_eq!(fb.svc_id, svc_b.id);
            assert_eq!(b.svc_stats(&b.web(&[]).id).rx_packets, 1);
        }

        fn closes_and_unknown_services_and_conflicts() {
            let (mut a, b, mut store, mut events) = pair::<F>(None);
            let p = open(&mut a, 45000);
            let new = read_event::<F::A>(&mut events).unwrap();
            apply::<F>(&mut store, &new, 0);
            a.run(&reply_tcp(&p, RST, b""));
            let close = read_event::<F::A>(&mut events).unwrap();
            assert_eq!(apply::<F>(&mut store, &close, 0), ApplyOutcome::Applied);
            // A reset ends the connection: both entries leave the flow table for the transient one, as on A.
            let key = b.key(45000, 6, WEB_PORT);
            assert_eq!(b.flows().get(&key).unwrap(), None);
            assert_eq!(b.flows().get(&new.fwd.partner_key(6)).unwrap(), None);
            for k in [key, new.fwd.partner_key(6)] {
                let t = b.transient().get(&k).unwrap().expect("closed entry");
                assert_eq!(
                    t.flow.flags & FLOW_F_RST,
                    FLOW_F_RST,
                    "a reset closes both entries"
                );
                assert_eq!(t.flow.timeout_s, TCP_CLOSING_TIMEOUT_S);
            }
            assert_eq!(
                apply::<F>(&mut store, &close, 0),
                ApplyOutcome::Unchanged,
                "idempotent"
            );

            // A flow for a service B does not have.
            let mut other = new;
            other.key.dport = 9999u16.to_be();
            assert_eq!(
                apply::<F>(&mut store, &other, 0),
                ApplyOutcome::UnknownService
            );

            // Same client tuple, another SNAT port: the peer's later record replaces its earlier copy here (not a
            // conflict: this replica does not carry the connection itself).
            let mut moved = new;
            moved.key.sport = 45001u16.to_be();
            moved.fwd.new_sport = 50001u16.to_be();
            moved.rev.new_dport = 45001u16.to_be();
            apply::<F>(&mut store, &moved, 0);
            let mut conflicting = moved;
            conflicting.fwd.new_sport = 50002u16.to_be();
            assert_eq!(apply::<F>(&mut store, &conflicting, 0), ApplyOutcome::Applied);
            let k = conflicting.key;
            assert_eq!(
                b.flows().get(&k).unwrap().unwrap().new_sport,
                50002u16.to_be()
            );
            assert!(
                b.flows()
                    .get(&moved.fwd.partner_key(6))
                    .unwrap()
                    .is_none(),
                "the replaced SNAT port is freed"
            );
        }

        fn a_backup_keeps_more_connections_than_one_cpus_share_of_its_table() {
            // The connection table's LRU lists are per CPU here, each CPU evicting within its share (`test_sizes`:
            // 8192 entries). A master's connections arrive in a sync's small frames: written from one CPU, 6000
            // connections (12 000 entries) would overrun that CPU's share and evict one another.
            let (mut a, b, mut store, mut events) = pair::<F>(None);
            assert!(b.flows().per_cpu_lru());
            open(&mut a, 44000);
            let ev = read_event::<F::A>(&mut events).unwrap();
            let recs: Vec<FlowRecord> = (0..6000u16)
                .map(|i| {
                    let mut e = ev;
                    e.key.sport = (10000 + i).to_be();
                    e.fwd.new_sport = (20000 + i).to_be();
                    e.rev.new_dport = e.key.sport;
                    FlowRecord {
                        event: F::sync_event(e),
                        age_ms: 0,
                    }
                })
                .collect();
            for chunk in recs.chunks(7) {
                let outcomes = store.apply_batch(chunk).unwrap();
                assert!(outcomes.iter().all(|o| *o == ApplyOutcome::Applied), "{outcomes:?}");
            }
            assert_eq!(b.flows().entries().unwrap().len(), 12000, "every connection kept, both entries");
        }
    }

    /// An IPv6 connection's records land in the IPv6 tables under the same rules: the service id translated,
    /// the entries marked in the flow filter, a reset moving both to `TRANSIENT_V6`, the dump carrying them back.
    #[test]
    fn ipv6_records_use_the_ipv6_tables() {
        use lb_agent::ha::sync::{FlowRecord, SyncEvent};
        use lb_common::{
            FlowEventV6, FlowKeyV6, FlowV6, In6, Service, ServiceKey, FAMILY_V6, FLOW_EV_CLOSE,
            FLOW_EV_NEW, FLOW_F_FORWARD, FLOW_F_REVERSE,
        };
        let mut b = Harness::new(Hook::Xdp);
        let mut store = BpfFlowStore::open(&b.dp.maps, Arc::new(AtomicBool::new(false))).unwrap();
        let a6 = |last: u8| -> In6 {
            let mut o = [0u8; 16];
            o[..4].copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
            o[15] = last;
            lb_common::Addr { bytes: o }.v6_raw()
        };
        let (client, vip, node) = (a6(1), a6(100), a6(11));
        let skey = ServiceKey {
            addr: lb_common::Addr::from_v6_raw(vip),
            port_be: 443u16.to_be(),
            proto: lb_common::PROTO_TCP,
            family: FAMILY_V6,
        };
        let svc = Service {
            id: 9,
            ..Default::default()
        };
        b.dp.maps.services.insert(&skey, &svc).unwrap();
        let key = FlowKeyV6 {
            src: client,
            dst: vip,
            sport: 41000u16.to_be(),
            dport: 443u16.to_be(),
            proto: lb_common::PROTO_TCP,
            _pad: [0; 3],
        };
        let fwd = FlowV6 {
            new_src: vip,
            new_dst: node,
            new_sport: 50000u16.to_be(),
            new_dport: 30443u16.to_be(),
            flags: FLOW_F_FORWARD,
            svc_id: 3, // the peer's id
            timeout_s: 3600,
            ..Default::default()
        };
        let rev = FlowV6 {
            new_src: vip,
            new_dst: client,
            new_sport: 443u16.to_be(),
            new_dport: 41000u16.to_be(),
            flags: FLOW_F_REVERSE,
            svc_id: 3,
            timeout_s: 3600,
            ..Default::default()
        };
        let new = FlowEventV6 {
            kind: FLOW_EV_NEW,
            _pad: [0; 7],
            key,
            fwd,
            rev,
        };
        assert_eq!(store.apply(&new, 100).unwrap(), ApplyOutcome::Applied);
        assert_eq!(store.apply(&new, 100).unwrap(), ApplyOutcome::Unchanged);
        let rkey = fwd.partner_key(lb_common::PROTO_TCP);
        let f =
            b.dp.maps
                .flows_v6
                .get(&key)
                .unwrap()
                .expect("forward entry");
        assert_eq!(
            (f.svc_id, f.new_dst),
            (svc.id, node),
            "translated to B's id"
        );
        assert!(b.dp.maps.flows_v6.get(&rkey).unwrap().is_some());
        assert!(b.dp.maps.flow_filter.may_hold(&key) && b.dp.maps.flow_filter.may_hold(&rkey));
        assert_eq!(
            b.dp.maps.flows.entries().unwrap(),
            vec![],
            "nothing in the IPv4 table"
        );
        assert_eq!(
            b.dp.maps.trusted_sources.keys().unwrap(),
            vec![lb_common::Addr::from_v6_raw(client)]
        );
        let dump = store.dump().unwrap();
        assert!(
            matches!(dump.as_slice(), [FlowRecord { event: SyncEvent::V6(e), .. }] if e.key == key),
            "{dump:?}"
        );

        let mut close = new;
        close.kind = FLOW_EV_CLOSE;
        close.fwd.flags |= FLOW_F_RST;
        close.rev = FlowV6::default();
        assert_eq!(store.apply(&close, 0).unwrap(), ApplyOutcome::Applied);
        assert_eq!(b.dp.maps.flows_v6.get(&key).unwrap(), None);
        for k in [key, rkey] {
            let t =
                b.dp.maps
                    .transient_v6
                    .get(&k)
                    .unwrap()
                    .expect("closed entry");
            assert_eq!(t.flow.flags & FLOW_F_RST, FLOW_F_RST);
        }
    }
}

mod sync_churn {
    //! A backup's table under churn: connections opened, closed (FIN both ways, RST) and reopened on reused client
    //! and SNAT ports on a master, its flow events applied to a backup in batches of varying size. The backup's
    //! connection table must equal the master's — the same connections, translations and close state — and no
    //! record may count as a conflict: nothing here is a split brain.
    use super::state_sync::apply;
    use super::*;
    use lb_agent::ha::flowstore::BpfFlowStore;
    use lb_agent::ha::sync::{ApplyOutcome, FlowRecord};
    use lb_common::{Flow, FLOW_F_SYNCED};
    use std::collections::BTreeMap;

    /// A master publishing its flow events and SNATing to 24 ports (so that ports are reused as soon as a
    /// connection closed), a backup with a store to apply them to.
    fn pair<F: Fam>() -> (
        Harness<F>,
        Harness<F>,
        BpfFlowStore,
        aya::maps::RingBuf<aya::maps::MapData>,
    ) {
        super::state_sync::pair(Some((40000, 40023)))
    }

    /// Addresses (as on the wire) and ports of a key, or of a translation.
    type Tuple = ([u8; 16], [u8; 16], u16, u16);

    fn tuple<A: FlowAddr>(src: A, dst: A, sport: u16, dport: u16) -> Tuple {
        (src.to_addr().bytes, dst.to_addr().bytes, sport, dport)
    }

    /// The connection table as the sync must reproduce it: translations, close state and timeouts, without ids,
    /// ages and marks.
    fn table<F: Fam>(h: &mut Harness<F>) -> BTreeMap<Tuple, (Tuple, u8, u32)> {
        let norm = |f: &Flow<F::A>| {
            let flags = f.flags & !FLOW_F_SYNCED;
            (
                tuple(f.new_src, f.new_dst, f.new_sport, f.new_dport),
                flags,
                f.timeout_s,
            )
        };
        h.flows()
            .entries()
            .unwrap()
            .iter()
            .map(|(k, f)| (tuple(k.src, k.dst, k.sport, k.dport), norm(f)))
            .collect()
    }

    /// Closed connections' entries in the transient table, by key.
    fn closed<F: Fam>(h: &mut Harness<F>) -> BTreeMap<Tuple, Tuple> {
        h.transient()
            .entries()
            .unwrap()
            .iter()
            .filter(|(_, t)| t.closed())
            .map(|(k, t)| {
                let f = &t.flow;
                (
                    tuple(k.src, k.dst, k.sport, k.dport),
                    tuple(f.new_src, f.new_dst, f.new_sport, f.new_dport),
                )
            })
            .collect()
    }

    /// Lets a closing connection's time run out (both entries of a closed one in the transient table, a
    /// half-closed one's in the flow table), then runs the agent's GC pass, which deletes them.
    fn pass_closing_timeout<F: Fam>(h: &mut Harness<F>) {
        for (k, mut t) in h.transient().entries().unwrap() {
            if t.closed() {
                t.flow.last_seen_ns = 1;
                h.transient_mut().insert(&k, &t).unwrap();
            }
        }
        for (k, mut f) in h.flows().entries().unwrap() {
            if f.flags & (FLOW_F_FIN | FLOW_F_RST) != 0 {
                f.last_seen_ns = 1;
                h.dp.maps.set_flow(&k, &f).unwrap();
            }
        }
        lb_agent::dataplane::gc::collect(&mut h.dp.maps, lb_agent::dataplane::gc::now_ns(), None)
            .unwrap();
    }

    per_family! {
        fn the_backup_holds_the_masters_table_and_sees_no_conflict() {
            let (mut a, mut b, mut store, mut events) = pair::<F>();
            let mut outcomes = Vec::new();
            let mut batch = 1;
            // Client ports per SNAT port, from the new connections' records.
            let mut snat_users: BTreeMap<u16, std::collections::BTreeSet<u16>> = BTreeMap::new();
            let mut sync = |events: &mut aya::maps::RingBuf<aya::maps::MapData>,
                            store: &mut BpfFlowStore,
                            outcomes: &mut Vec<ApplyOutcome>| {
                let mut recs = Vec::new();
                while let Some(event) = read_event::<F::A>(events) {
                    if event.kind == lb_common::FLOW_EV_NEW {
                        snat_users
                            .entry(event.fwd.new_sport)
                            .or_default()
                            .insert(event.key.sport);
                    }
                    recs.push(FlowRecord {
                        event: F::sync_event(event),
                        age_ms: 0,
                    });
                }
                // Frames of 1, 2, 3 … 7 records: a connection's records are split across batches in every way.
                for chunk in recs.chunks(batch) {
                    outcomes.extend(store.apply_batch(chunk).unwrap());
                    batch = batch % 7 + 1;
                }
            };
            // Rounds of 12 client ports on 24 SNAT ports: ports a round frees are taken again by the next ones.
            for round in 0..8u16 {
                let ports: Vec<u16> = (0..12).map(|i| 41000 + (round % 3) * 12 + i).collect();
                let mut open_now = Vec::new();
                for &port in &ports {
                    open_now.push((port, open(&mut a, port)));
                }
                sync(&mut events, &mut store, &mut outcomes);
                for (i, (port, p)) in open_now.iter().enumerate() {
                    match i % 4 {
                        // FIN from the client first, then from the backend.
                        0 => {
                            assert_eq!(a.run(&a.client_tcp(*port, FIN_ACK, b"")).0, Verdict::Tx);
                            assert_eq!(a.run(&reply_tcp(p, FIN_ACK, b"")).0, Verdict::Tx);
                        }
                        // The backend closes first.
                        1 => {
                            assert_eq!(a.run(&reply_tcp(p, FIN_ACK, b"")).0, Verdict::Tx);
                            assert_eq!(a.run(&a.client_tcp(*port, FIN_ACK, b"")).0, Verdict::Tx);
                        }
                        // A reset.
                        2 => assert_eq!(a.run(&a.client_tcp(*port, RST, b"")).0, Verdict::Tx),
                        // Half closed: stays in the table.
                        _ => assert_eq!(a.run(&a.client_tcp(*port, FIN_ACK, b"")).0, Verdict::Tx),
                    }
                    if i % 5 == 0 {
                        sync(&mut events, &mut store, &mut outcomes);
                    }
                }
                sync(&mut events, &mut store, &mut outcomes);
                assert_eq!(
                    table(&mut b),
                    table(&mut a),
                    "round {round}: the connection tables differ"
                );
                let closed_a = closed(&mut a);
                let closed_b = closed(&mut b);
                for (k, t) in &closed_a {
                    assert_eq!(
                        closed_b.get(k),
                        Some(t),
                        "round {round}: a closed connection on the backup"
                    );
                }
                // The closing timeout passes on both: closed connections free their SNAT ports for the next round.
                for h in [&mut a, &mut b] {
                    pass_closing_timeout(h);
                }
            }
            assert!(outcomes.len() > 8 * 12 * 2, "{} records", outcomes.len());
            assert!(
                snat_users.values().filter(|c| c.len() > 1).count() >= 8,
                "SNAT ports reused by other clients: {snat_users:?}"
            );
            let conflicts = outcomes
                .iter()
                .filter(|o| **o == ApplyOutcome::Conflict)
                .count();
            assert_eq!(conflicts, 0, "outcomes: {outcomes:?}");
        }

        fn a_split_brain_is_a_conflict() {
            let (mut a, mut b, mut store, mut events) = pair::<F>();
            // Both replicas carry the same client port at once, each with its own connection: B's data plane made its
            // own (its SNAT range differs from A's, so the translations differ).
            open(&mut a, 42000);
            open(&mut b, 42000);
            let ev = read_event::<F::A>(&mut events).unwrap();
            assert_eq!(apply::<F>(&mut store, &ev, 0), ApplyOutcome::Conflict);
            // A copy of a peer's connection is superseded by the peer's later record without a conflict.
            let (mut a2, mut b2, mut store2, mut events2) = pair::<F>();
            let _ = &mut b2;
            open(&mut a2, 42001);
            let first = read_event::<F::A>(&mut events2).unwrap();
            let mut moved = first;
            moved.fwd.new_sport = 40007u16.to_be();
            moved.rev = Flow {
                new_dport: 42001u16.to_be(),
                ..first.rev
            };
            assert_eq!(apply::<F>(&mut store2, &moved, 0), ApplyOutcome::Applied);
            assert_eq!(apply::<F>(&mut store2, &first, 0), ApplyOutcome::Applied);
        }
    }
}

/// Moves this test's thread into a network namespace of its own holding a veth pair, `lbx0` (returned: its index)
/// and `lbx1`: the device map takes only interfaces of the caller's namespace, and the test runs see their frames
/// come in on that namespace's loopback (index 1). Other tests, on other threads, stay where they are.
fn netns_with_an_interface() -> u32 {
    // SAFETY: a plain syscall on this thread's own namespaces.
    assert_eq!(
        unsafe { libc::unshare(libc::CLONE_NEWNET) },
        0,
        "unshare(CLONE_NEWNET)"
    );
    let ok = std::process::Command::new("ip")
        .args([
            "link", "add", "lbx0", "type", "veth", "peer", "name", "lbx1",
        ])
        .status()
        .expect("running ip");
    assert!(ok.success(), "creating a veth pair");
    // Not from /sys/class/net: sysfs shows the namespace of whoever mounted it, not this thread's.
    let name = std::ffi::CString::new("lbx0").unwrap();
    // SAFETY: a NUL-terminated name.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    assert_ne!(index, 0, "lbx0's index");
    index
}

/// The MAC of the backends' interface in the multi-interface tests.
const BACK_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xbb, 0x01];

/// Two interfaces: the client's, where the test runs' frames come in (loopback, slot 1, [`LB_MAC`]), and the
/// backends' (`lbx0`, slot 2, [`BACK_MAC`]), which node 1 is routed through; node 2 stays on the client's.
fn two_interfaces<F: Fam>(h: &mut Harness<F>) -> u32 {
    let back = netns_with_an_interface();
    h.dp.maps.set_egress(1, 1, LB_MAC).unwrap();
    h.dp.maps.set_egress(2, back, BACK_MAC).unwrap();
    for (node, egress, ifindex) in [(1, 2, back), (2, 1, 1)] {
        let nh = lb_common::NextHop {
            mac: node_mac(node),
            egress,
            _pad: 0,
            ifindex,
        };
        h.dp.maps
            .nexthops
            .insert(&ip_to_addr(h.node(node)), &nh)
            .unwrap();
    }
    back
}

both_families! {
    fn a_backend_behind_another_interface_gets_its_frames_redirected_and_replies_cross_back(h) {
        two_interfaces(h);
        h.apply(&[h.web(&[1])]);
        // XDP redirects through the device map; TC's redirect is the same action as its "back out" (`Tx`).
        let redirected = if h.hook == Hook::Xdp { Verdict::Redirect } else { Verdict::Tx };
        let (v, out) = h.run(&h.client_tcp(40000, SYN, b""));
        assert_eq!(v, redirected);
        let p = parse(&out);
        assert_eq!((p.src_mac, p.dst_mac), (BACK_MAC, node_mac(1)), "from the backends' interface to the node");
        assert_eq!((p.src, p.dst, p.dport), (h.vip(), h.node(1), WEB_NODE_PORT));
        assert!(p.ip_csum_ok && p.l4_csum_ok);
        let key = h.key(40000, 6, WEB_PORT);
        let (rkey, t) = h.dp.maps.handshake(&key).unwrap().expect("the handshake");
        assert_eq!((t.fwd.egress, t.flow.egress), (2, 1), "forward by the backends' interface, replies by the client's");
        // The backend's SYN-ACK crosses back: out of the client's interface, from its MAC.
        let (v, out) = h.run(&reply_tcp(&p, SYN_ACK, b""));
        assert_eq!(v, redirected);
        let r = parse(&out);
        assert_eq!((r.src_mac, r.dst_mac), (LB_MAC, CLIENT_MAC));
        assert_eq!((r.src, r.sport, r.dst, r.dport), (h.vip(), WEB_PORT, h.client(), 40000));
        assert!(r.l4_csum_ok);
        // Established, both entries keep their interfaces.
        assert_eq!(h.run(&h.client_tcp(40000, ACK, b"")).0, redirected);
        let f = h.flows().get(&key).unwrap().expect("established");
        let b = h.flows().get(&rkey).unwrap().expect("established");
        assert_eq!((f.egress, b.egress), (2, 1));
        let (v, out) = h.run(&h.client_tcp(40000, ACK, b"data"));
        assert_eq!((v, parse(&out).src_mac), (redirected, BACK_MAC));
        // UDP the same way.
        h.apply(&[h.web(&[1]), h.dns(&[1])]);
        let (v, out) = h.run(&h.client_udp(5353, b"q"));
        assert_eq!((v, parse(&out).src_mac), (redirected, BACK_MAC));
        let u = parse(&out);
        let back = udp(u.dst_mac, BACK_MAC, u.dst, u.dport, u.src, u.sport, b"a");
        let (v, out) = h.run(&back);
        assert_eq!((v, parse(&out).dst_mac, parse(&out).src_mac), (redirected, CLIENT_MAC, LB_MAC));
    }

    fn a_backend_on_the_clients_interface_is_answered_with_xdp_tx(h) {
        // The one-armed path stays what it was on a machine with more interfaces: no redirect, no slot.
        two_interfaces(h);
        h.apply(&[h.web(&[2])]);
        let p = open(h, 40001);
        assert_eq!((p.src_mac, p.dst_mac), (LB_MAC, node_mac(2)));
        let f = h.flows().get(&h.key(40001, 6, WEB_PORT)).unwrap().unwrap();
        assert_eq!(f.egress, 0);
        let (v, out) = h.run(&reply_tcp(&p, ACK, b"x"));
        assert_eq!((v, parse(&out).src_mac), (Verdict::Tx, LB_MAC));
    }

    fn an_egress_slot_the_agent_has_not_filled_sends_the_frame_to_the_kernel(h) {
        two_interfaces(h);
        let nh = lb_common::NextHop { mac: node_mac(3), egress: 5, _pad: 0, ifindex: 99 };
        h.dp.maps.nexthops.insert(&ip_to_addr(h.node(3)), &nh).unwrap();
        h.apply(&[h.web(&[3])]);
        let f = h.client_tcp(40002, SYN, b"");
        let (v, out) = h.run(&f);
        assert_eq!((v, &out), (Verdict::Pass, &f), "passed unchanged");
        assert_eq!(h.stat(stat::PASS_NO_NEXTHOP), 1);
    }

    fn frames_to_the_mac_of_the_interface_they_came_in_by_are_ours_when_checked(h) {
        // With the check on (replicas on one segment), the VIP's MAC is another (VRRP's); a backend's reply on
        // the backends' interface is addressed to that interface's own MAC.
        two_interfaces(h);
        h.apply(&[h.web(&[1])]);
        h.dp.maps.config.set(lb_common::CONFIG_INDEX, &lb_common::Config {
            flags: lb_common::CFG_F_CHECK_DST_MAC,
            local_mac: [0, 0, 0x5e, 0, 1, 1],
            ..Default::default()
        }).unwrap();
        // Here the test runs' frames come in on the loopback, slot 1, whose MAC is LB_MAC.
        assert_ne!(h.run(&h.client_tcp(40003, SYN, b"")).0, Verdict::Pass);
        assert_eq!(h.stat(stat::PASS_OTHER_HOST), 0);
        assert_eq!(h.run(&client_syn_to(h, [0x02, 0, 0, 0, 0, 0x99], 40004)).0, Verdict::Pass, "another host's");
        assert_eq!(h.stat(stat::PASS_OTHER_HOST), 1);
    }
}

/// Keeps the test on one CPU: the kernel side rate-limits per CPU, and a thread moved between runs would be
/// allowed a line on each.
fn pin_to_one_cpu() {
    let cpu = lb_agent::cpus::allowed()[0];
    lb_agent::cpus::pin_current_thread(cpu).unwrap();
}

both_families! {
    fn rare_events_reach_the_agents_log_with_their_details_once_per_second(h) {
        pin_to_one_cpu();
        let mut ring = lb_agent::report::kernel_log::ring(&mut h.dp).unwrap();
        // One SNAT port for the backend: the second connection finds none, twice.
        h.dp.maps.config.set(lb_common::CONFIG_INDEX, &lb_common::Config { snat_port_min: 40000, snat_port_max: 40000, hash_seed: 7, ..Default::default() }).unwrap();
        h.apply(&[h.web(&[1])]);
        open(h, 43000);
        for sport in [43001, 43002] {
            assert_eq!(h.run(&h.client_tcp(sport, SYN, b"")).0, Verdict::Drop);
        }
        assert_eq!(h.stat(stat::DROP_SNAT_EXHAUSTED), 2);
        // Malformed frames, many: counted each, logged once.
        let mut bad = h.client_tcp(43003, SYN, b"");
        // Version 4 with a header length of 4 words; in an IPv6 frame, version 4.
        let v6 = F::A::FAMILY == lb_common::FAMILY_V6;
        bad[14] = if v6 { 0x40 } else { 0x44 };
        for _ in 0..50 {
            assert_eq!(h.run(&bad).0, Verdict::Drop);
        }
        assert_eq!(h.stat(stat::DROP_MALFORMED), 50);
        let lines: Vec<String> = lb_agent::report::kernel_log::drain(&mut ring).iter().map(lb_agent::report::kernel_log::describe).collect();
        let backend = std::net::SocketAddr::new(h.node(1), WEB_NODE_PORT).to_string();
        let snat: Vec<_> = lines.iter().filter(|l| l.contains("no free SNAT port")).collect();
        assert_eq!(snat.len(), 1, "one line for two drops within a second: {lines:?}");
        assert!(snat[0].contains(&backend) && snat[0].starts_with("service "), "{lines:?}");
        let malformed: Vec<_> = lines.iter().filter(|l| l.contains("malformed frame")).collect();
        assert_eq!(malformed.len(), 1, "one line for 50 frames within a second: {lines:?}");
        let why = if v6 { "IPv6 header cut short or version not 6" } else { "IPv4 version or header length invalid" };
        assert!(malformed[0].contains(&format!("of {} bytes: {why}", bad.len())), "{lines:?}");
        assert_eq!(lines.len(), 2, "nothing else: {lines:?}");
    }
}

/// `lbctl trace`'s programs (the packet logic with a report around it) pass this kernel's verifier: they are
/// larger than the fast ones, and a change that only they cannot carry would otherwise show first in the netns
/// suite's trace test.
#[test]
fn the_traced_programs_pass_the_verifier() {
    let mut h = Harness::new(Hook::Xdp);
    let t = std::time::Instant::now();
    h.dp.xdp_program(lb_agent::dataplane::XDP_TRACE_PROGRAM)
        .unwrap();
    h.dp.tc_program_named(lb_agent::dataplane::TC_TRACE_PROGRAM)
        .unwrap();
    eprintln!("both traced programs verified in {:?}", t.elapsed());
}

/// Every program of the object passes this kernel's verifier; prints how many instructions it walked (the budget
/// is a million). `LB_OBJECT_FILE` points it at another object (to compare builds).
#[test]
fn verified_instruction_counts() {
    let obj = std::env::var("LB_OBJECT_FILE")
        .ok()
        .map(|f| std::fs::read(f).unwrap());
    let sizes = test_sizes();
    let mut dp = match &obj {
        Some(o) => lb_agent::dataplane::Dataplane::load_object(o, &sizes, None),
        None => lb_agent::dataplane::Dataplane::load(&sizes, None),
    }
    .expect("loading the data plane (root needed)");
    let only = std::env::var("LB_PROGRAMS").unwrap_or_default();
    let has_v6 = dp.ebpf_mut().unwrap().program("lb_xdp6").is_some();
    let v6 = lb_agent::dataplane::V6_PROGRAMS
        .iter()
        .filter(|_| has_v6)
        .map(|(name, xdp, _)| (name, xdp));
    for (name, xdp) in lb_agent::dataplane::PROGRAMS
        .iter()
        .map(|(n, x)| (n, x))
        .chain(v6)
    {
        if !only.is_empty() && !only.split(',').any(|p| p == *name) {
            continue;
        }
        let t = std::time::Instant::now();
        let info = if *xdp {
            dp.xdp_program(name).unwrap().info().unwrap()
        } else {
            dp.tc_program_named(name).unwrap().info().unwrap()
        };
        eprintln!(
            "{name}: {} verified instructions ({:?})",
            info.verified_instruction_count().unwrap_or(0),
            t.elapsed()
        );
    }
}

/// `lb-agent --check-programs`: every program of the object — exactly those the agent knows by name — loaded and
/// accepted by this kernel's verifier.
#[test]
fn check_programs_loads_every_program_of_the_object() {
    use lb_agent::dataplane::{check_programs, PROGRAMS, V6_PROGRAMS};
    let checks = check_programs().expect("loading the data plane (root needed)");
    let mut got: Vec<(&str, &str)> = checks.iter().map(|c| (c.name.as_str(), c.hook)).collect();
    got.sort();
    let mut want: Vec<(&str, &str)> = PROGRAMS
        .iter()
        .map(|(n, xdp)| (*n, *xdp))
        .chain(V6_PROGRAMS.iter().map(|(n, xdp, _)| (*n, *xdp)))
        .map(|(n, xdp)| (n, if xdp { "xdp" } else { "tc" }))
        .collect();
    want.sort();
    assert_eq!(got, want);
    let refused: Vec<_> = checks.iter().filter(|c| c.refused.is_some()).collect();
    assert!(refused.is_empty(), "refused: {refused:#?}");
}
