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

    fn packet_too_big_from_a_node_reaches_the_client_translated(h) {
        h.apply(&[web6(&[1])]);
        let syn = open(h, 40100);
        // The node (or a router before it) cannot forward our segment: it quotes what we sent (IPv6 routers
        // never fragment, so this is how the client learns the path MTU).
        let quoted_frame = tcp(LB_MAC, syn.dst_mac, syn.src, syn.sport, syn.dst, syn.dport, ACK, &[0u8; 64]);
        let f = icmp_error(syn.dst_mac, LB_MAC, syn.dst, syn.src, 2, 0, 1280u32.to_be_bytes(), &quoted_frame[14..]);
        let (v, out) = h.run(&f);
        assert_eq!(v, Verdict::Tx);
        assert_eq!(&out[0..6], &CLIENT_MAC);
        assert_eq!(&out[22..38], &VIP6.octets(), "outer source: the VIP");
        assert_eq!(&out[38..54], &CLIENT6.octets(), "outer destination: the client");
        let icmp = &out[54..];
        assert_eq!(internet_checksum(&[&pseudo_header(VIP6, CLIENT6, 58, icmp.len()), icmp]), 0, "ICMPv6 checksum");
        assert_eq!((icmp[0], icmp[1], &icmp[4..8]), (2, 0, &1280u32.to_be_bytes()[..]), "type, code and MTU kept");
        let inner = &icmp[8..];
        assert_eq!(&inner[8..24], &CLIENT6.octets(), "inner source is the client");
        assert_eq!(&inner[24..40], &VIP6.octets(), "inner destination is the VIP");
        assert_eq!(u16::from_be_bytes([inner[40], inner[41]]), 40100);
        assert_eq!(u16::from_be_bytes([inner[42], inner[43]]), WEB_PORT);
        let pseudo = pseudo_header(CLIENT6, VIP6, 6, inner.len() - 40);
        assert_eq!(internet_checksum(&[&pseudo, &inner[40..]]), 0, "inner TCP checksum");
        assert_eq!(h.stat(stat::ICMP_TRANSLATED), 1);
        assert_eq!(h.svc_stats(&web6(&[]).id).icmp_translated, 1);
    }

    fn an_icmpv6_error_from_the_client_side_reaches_the_backend(h) {
        h.apply(&[dns6(&[1])]);
        let (_, out) = h.run(&client6_udp(5380, b"q"));
        let fwd = parse(&out);
        // What the client saw from us (VIP:53 → client:5380), quoted by the client's router: port unreachable.
        let quoted_frame = udp(LB_MAC, CLIENT_MAC, VIP6, DNS_PORT, CLIENT6, 5380, b"answer");
        let router: Ipv6Addr = "2001:db8:100::1".parse().unwrap();
        let f = icmp_error(CLIENT_MAC, LB_MAC, router, VIP6, 1, 4, [0; 4], &quoted_frame[14..]);
        let (v, out) = h.run(&f);
        assert_eq!(v, Verdict::Tx);
        assert_eq!(&out[0..6], &node_mac(1));
        assert_eq!(IpAddr::from(<[u8; 16]>::try_from(&out[22..38]).unwrap()), fwd.src, "from the SNAT address");
        assert_eq!(&out[38..54], &node6(1).octets());
        let icmp = &out[54..];
        assert_eq!(internet_checksum(&[&pseudo_header(fwd.src, node6(1), 58, icmp.len()), icmp]), 0, "ICMPv6 checksum");
        let inner = &icmp[8..];
        assert_eq!(&inner[8..24], &node6(1).octets(), "as the node sent it");
        assert_eq!(u16::from_be_bytes([inner[40], inner[41]]), DNS_NODE_PORT);
        assert_eq!(u16::from_be_bytes([inner[42], inner[43]]), fwd.sport);
        let pseudo = pseudo_header(node6(1), fwd.src, 17, inner.len() - 40);
        assert_eq!(internet_checksum(&[&pseudo, &inner[40..]]), 0, "inner UDP checksum");
    }

    fn icmpv6_errors_about_other_traffic_pass(h) {
        h.apply(&[web6(&[1])]);
        let quoted = tcp(LB_MAC, CLIENT_MAC, VIP6, 22, CLIENT6, 50000, ACK, b"");
        let f = icmp_error(CLIENT_MAC, LB_MAC, CLIENT6, VIP6, 1, 4, [0; 4], &quoted[14..]);
        let (v, out) = h.run(&f);
        assert_eq!((v, &out), (Verdict::Pass, &f));
        assert_eq!(h.stat(stat::PASS_ICMP_UNKNOWN), 1);
    }

    fn echo_to_the_vip_goes_to_the_kernel(h) {
        h.apply(&[web6(&[1])]);
        let f = icmp_error(CLIENT_MAC, LB_MAC, CLIENT6, VIP6, 128, 0, [0, 1, 0, 1], b"ping");
        assert_eq!(h.run(&f).0, Verdict::Pass);
        assert_eq!(h.stat(stat::DROP_MALFORMED) + h.stat(stat::PASS_ICMP_UNKNOWN), 0);
    }

    fn source_ranges_with_ipv6_prefixes(h) {
        let mut s = web6(&[1]);
        s.source_ranges = vec!["2001:db8:100::/48".parse().unwrap()];
        h.apply(&[s]);
        assert_eq!(h.run(&client6_tcp(40200, SYN, b"")).0, Verdict::Tx, "inside the range");
        let outsider: Ipv6Addr = "2001:db8:200::10".parse().unwrap();
        let f = tcp(CLIENT_MAC, LB_MAC, outsider, 40201, VIP6, WEB_PORT, SYN, b"");
        assert_eq!(h.run(&f).0, Verdict::Drop, "outside the range");
        assert_eq!(h.stat(stat::DROP_SOURCE_RANGE), 1);
        assert_eq!(h.svc_stats(&web6(&[]).id).drop_source_range, 1);
    }

    fn extension_headers_are_walked_and_left_untouched(h) {
        h.apply(&[web6(&[1])]);
        let plain = client6_tcp(40300, SYN, b"");
        // A destination-options header (8 bytes: next header TCP, length 0, PadN) between IPv6 and TCP.
        let mut f = plain[..54].to_vec();
        f[20] = 60;
        f.extend_from_slice(&[6, 0, 1, 4, 0, 0, 0, 0]);
        f.extend_from_slice(&plain[54..]);
        let plen = u16::from_be_bytes([f[18], f[19]]) + 8;
        f[18..20].copy_from_slice(&plen.to_be_bytes());
        let (v, out) = h.run(&f);
        assert_eq!(v, Verdict::Tx);
        assert_eq!(&out[54..62], &[6, 0, 1, 4, 0, 0, 0, 0], "the option is forwarded as it came");
        assert_eq!(h.stat(stat::IPV6_EXT_HEADERS), 1);
        // A routing header with segments left: the destination is not final, the kernel's business.
        let mut r = plain[..54].to_vec();
        r[20] = 43;
        r.extend_from_slice(&[6, 0, 4, 1, 0, 0, 0, 0]);
        r.extend_from_slice(&plain[54..]);
        r[18..20].copy_from_slice(&plen.to_be_bytes());
        assert_eq!(h.run(&r).0, Verdict::Pass);
        assert_eq!(h.stat(stat::PASS_IPV6_EXT), 1);
    }

    fn malformed_ipv6_is_dropped_and_counted(h) {
        h.apply(&[web6(&[1])]);
        let mut f = client6_tcp(40400, SYN, b"");
        // A payload length beyond the frame.
        f[18..20].copy_from_slice(&400u16.to_be_bytes());
        assert_eq!(h.run(&f).0, Verdict::Drop);
        assert_eq!(h.stat(stat::DROP_MALFORMED), 1);
    }
}

/// Opens an IPv6 connection (SYN, SYN-ACK, ACK, each forwarded) and returns the forwarded SYN.
fn open(h: &mut Harness, sport: u16) -> Parsed {
    let (v, out) = h.run(&client6_tcp(sport, SYN, b""));
    assert_eq!(v, Verdict::Tx, "SYN from port {sport} forwarded");
    let p = parse(&out);
    assert_eq!(
        h.run(&reply(&p, SYN_ACK, b"")).0,
        Verdict::Tx,
        "SYN-ACK forwarded"
    );
    assert_eq!(
        h.run(&client6_tcp(sport, ACK, b"")).0,
        Verdict::Tx,
        "ACK forwarded"
    );
    p
}
