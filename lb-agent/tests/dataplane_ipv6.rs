//! The IPv6 programs' rules, proven as `dataplane.rs` proves IPv4's: real IPv6 frames through the real programs
//! (the IPv4 entry points tail-call them) via BPF_PROG_TEST_RUN, both hooks. Needs root.

mod common;
use common::*;

use lb_agent::dataplane::model::Protocol;
use lb_common::{stat, FlowKeyV6, FLOW_F_FORWARD};
use std::net::{IpAddr, Ipv6Addr};

fn web6(nodes: &[u8]) -> lb_agent::dataplane::model::ServiceSpec {
    spec_on(VIP6.into(), Protocol::Tcp, WEB_PORT, WEB_NODE_PORT, nodes)
}

fn dns6(nodes: &[u8]) -> lb_agent::dataplane::model::ServiceSpec {
    spec_on(VIP6.into(), Protocol::Udp, DNS_PORT, DNS_NODE_PORT, nodes)
}

fn client6_tcp(sport: u16, flags: Flags, payload: &[u8]) -> Vec<u8> {
    tcp(
        CLIENT_MAC, LB_MAC, CLIENT6, sport, VIP6, WEB_PORT, flags, payload,
    )
}

fn client6_udp(sport: u16, payload: &[u8]) -> Vec<u8> {
    udp(CLIENT_MAC, LB_MAC, CLIENT6, sport, VIP6, DNS_PORT, payload)
}

/// The backend's reply to forwarded packet `p`.
fn reply(p: &Parsed, flags: Flags, payload: &[u8]) -> Vec<u8> {
    tcp(
        p.dst_mac, LB_MAC, p.dst, p.dport, p.src, p.sport, flags, payload,
    )
}

/// An Ethernet + IPv6 frame with next header `nh` and payload `payload` (hand-built: extension headers,
/// ICMPv6).
fn ipv6_frame(nh: u8, src: Ipv6Addr, dst: Ipv6Addr, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(54 + payload.len());
    f.extend_from_slice(&LB_MAC);
    f.extend_from_slice(&CLIENT_MAC);
    f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
    f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    f.extend_from_slice(&[nh, 64]);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&dst.octets());
    f.extend_from_slice(payload);
    f
}

fn fwd_key6(sport: u16, proto: u8, dport: u16) -> FlowKeyV6 {
    let w = |a: Ipv6Addr| lb_common::Addr { bytes: a.octets() }.v6_raw();
    FlowKeyV6 {
        src: w(CLIENT6),
        dst: w(VIP6),
        sport: sport.to_be(),
        dport: dport.to_be(),
        proto,
        _pad: [0; 3],
    }
}

both_hooks! { ipv6:
    fn syn_creates_a_flow_and_is_full_natted(h) {
        h.apply(&[web6(&[1, 2, 3])]);
        let (v, out) = h.run(&client6_tcp(40000, SYN, b""));
        assert_eq!(v, Verdict::Tx);
        let p = parse(&out);
        assert_eq!(p.src, VIP6, "SNAT to the VIP by default");
        assert_eq!(p.dport, WEB_NODE_PORT);
        assert!(p.l4_csum_ok, "{p:?}");
        let n = node_index(&p);
        assert_eq!(p.dst_mac, node_mac(n));
        assert_eq!(p.src_mac, LB_MAC);
        assert!(p.sport >= 1024);
        assert_eq!(h.stat(stat::PASS_NO_IPV6_PROGRAM), 0);
    }

    fn a_connection_opens_and_carries_data_both_ways(h) {
        h.apply(&[web6(&[1, 2, 3])]);
        let syn = parse(&h.run(&client6_tcp(40001, SYN, b"")).1);
        let (v, out) = h.run(&reply(&syn, SYN_ACK, b""));
        assert_eq!(v, Verdict::Tx, "SYN-ACK forwarded");
        let r = parse(&out);
        assert_eq!((r.src, r.sport, r.dst, r.dport), (IpAddr::from(VIP6), WEB_PORT, IpAddr::from(CLIENT6), 40001));
        assert_eq!(r.dst_mac, CLIENT_MAC);
        assert!(r.l4_csum_ok, "{r:?}");
        let (v, _) = h.run(&client6_tcp(40001, ACK, b""));
        assert_eq!(v, Verdict::Tx, "handshake ACK forwarded");
        let f = h.dp.maps.flows_v6.get(&fwd_key6(40001, 6, WEB_PORT)).unwrap().expect("the connection is established");
        assert!(f.flags & FLOW_F_FORWARD != 0);
        let (v, out) = h.run(&client6_tcp(40001, ACK, b"GET / HTTP/1.1\r\n\r\n"));
        assert_eq!(v, Verdict::Tx);
        let d = parse(&out);
        assert_eq!((d.dst, d.sport, d.dport), (syn.dst, syn.sport, WEB_NODE_PORT), "same backend, same SNAT port");
        assert!(d.l4_csum_ok);
        assert_eq!(d.payload, b"GET / HTTP/1.1\r\n\r\n");
        let s = h.svc_stats(&web6(&[]).id);
        assert_eq!(s.new_flows, 1);
        assert_eq!(h.stat(stat::NEW_FLOWS), 1);
    }

    fn udp_is_full_natted_both_ways(h) {
        h.apply(&[dns6(&[1, 2, 3])]);
        let (v, out) = h.run(&client6_udp(5353, b"query"));
        assert_eq!(v, Verdict::Tx);
        let p = parse(&out);
        assert_eq!((p.src, p.dport, p.proto), (IpAddr::from(VIP6), DNS_NODE_PORT, 17));
        assert!(p.l4_csum_ok && !p.udp_csum_zero, "{p:?}");
        assert_eq!(p.payload, b"query");
        let back = udp(p.dst_mac, LB_MAC, p.dst, p.dport, p.src, p.sport, b"answer");
        let (v, out) = h.run(&back);
        assert_eq!(v, Verdict::Tx);
        let r = parse(&out);
        assert_eq!((r.src, r.sport, r.dst, r.dport), (IpAddr::from(VIP6), DNS_PORT, IpAddr::from(CLIENT6), 5353));
        assert!(r.l4_csum_ok);
        assert_eq!(r.payload, b"answer");
    }

    fn udp_without_checksum_is_dropped_and_counted(h) {
        h.apply(&[dns6(&[1])]);
        let mut f = client6_udp(5353, b"query");
        // The UDP checksum: Ethernet 14 + IPv6 40 + 6.
        f[60] = 0;
        f[61] = 0;
        let (v, _) = h.run(&f);
        assert_eq!(v, Verdict::Drop);
        assert_eq!(h.stat(stat::DROP_UDP6_NO_CHECKSUM), 1);
    }

    fn a_stray_segment_without_a_flow_is_dropped(h) {
        h.apply(&[web6(&[1])]);
        let (v, _) = h.run(&client6_tcp(40002, ACK, b"x"));
        assert_eq!(v, Verdict::Drop);
        assert_eq!(h.stat(stat::DROP_NO_FLOW), 1);
    }

    fn traffic_for_no_service_goes_to_the_kernel(h) {
        h.apply(&[web6(&[1])]);
        let ssh = tcp(CLIENT_MAC, LB_MAC, CLIENT6, 40003, VIP6, 22, SYN, b"");
        assert_eq!(h.run(&ssh).0, Verdict::Pass);
        assert_eq!(h.stat(stat::PASS_NOT_SERVICE), 1);
    }

    fn neighbour_discovery_goes_to_the_kernel_uncounted_as_malformed(h) {
        h.apply(&[web6(&[1])]);
        // A neighbour solicitation (type 135) for the VIP; its checksum is the kernel's business.
        let mut ns = vec![135, 0, 0, 0, 0, 0, 0, 0];
        ns.extend_from_slice(&VIP6.octets());
        let f = ipv6_frame(58, CLIENT6, VIP6, &ns);
        assert_eq!(h.run(&f).0, Verdict::Pass);
        assert_eq!(h.stat(stat::DROP_MALFORMED), 0);
    }

    fn fragments_to_a_vip_are_dropped(h) {
        h.apply(&[web6(&[1])]);
        // Fragment header (next header TCP, offset 0, more fragments) and the start of a TCP header.
        let mut frag = vec![6, 0, 0, 1, 0, 0, 0, 42];
        frag.extend_from_slice(&[0; 20]);
        let f = ipv6_frame(44, CLIENT6, VIP6, &frag);
        assert_eq!(h.run(&f).0, Verdict::Drop);
        assert_eq!(h.stat(stat::DROP_FRAGMENT), 1);
    }

    fn both_families_at_once(h) {
        h.apply(&[web(&[1, 2]), web6(&[3, 4])]);
        let (v4, out4) = h.run(&client_tcp(40004, SYN, b""));
        let (v6, out6) = h.run(&client6_tcp(40004, SYN, b""));
        assert_eq!((v4, v6), (Verdict::Tx, Verdict::Tx));
        assert!([1, 2].contains(&node_index(&parse(&out4))));
        assert!([3, 4].contains(&node_index(&parse(&out6))));
    }
}
